"""Expert tiers: the memory plan, the tiered store (arena, recent slots, SSD reads, lookahead, adaptive placement),
routing profiles, and what happens when reads go wrong.

The reference for every tiered run is the same model with every expert read in place from the memory map
(MappedStore): the tiers only move bytes, so logits must be bit-identical, whichever tier served which expert.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from strata_nb.api import load, memory_needs
from strata_nb.errors import StrataError
from strata_nb.experts import pack as packfmt
from strata_nb.experts.profile import RoutingProfile
from strata_nb.experts.reader import BlobReader
from strata_nb.experts.tiered import READY, TieredStore, layer_layout
from strata_nb.plan import RUNTIME_BYTES, Machine, make_plan
from strata_nb.synth import write_synthetic

GB = 10**9
MACHINE = Machine(total_ram=64 * GB, available_ram=48 * GB, swap_free=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiers")
    path = d / "moe.gguf"
    write_synthetic(path, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A model with an expert pack beside it (one aligned extent per expert instead of three)."""
    d = tmp_path_factory.mktemp("tiers-pack")
    path = d / "moe.gguf"
    write_synthetic(path, "tiny", arch="qwen3moe", quant="Q8_0", seed=4)
    packfmt.write_pack(path)
    return str(path)


PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, 24)]


@pytest.fixture(scope="module")
def reference(model):
    eng = load(model, n_ctx=96, experts="mmap", machine=MACHINE)
    return eng.logits(PROMPT), eng.generate(PROMPT[:6], 12, keep_logits=True)


def tiered(path, arena_fraction, recent_slots=None, **kw):
    """An engine on `path` whose store keeps arena_fraction of the experts resident and reads the rest."""
    eng = load(path, n_ctx=96, experts="mmap", machine=MACHINE)
    src = eng.store.src
    layouts = {l: layer_layout(src, l) for l in src.layers}
    sb = max(lay.slot_bytes for lay in layouts.values())
    n_blobs = len(layouts) * eng.spec.n_expert
    kw.setdefault("profile", RoutingProfile.for_spec(eng.spec))
    store = TieredStore(src, eng.spec.n_expert, int(arena_fraction * n_blobs) * sb,
                        recent_slots if recent_slots is not None else 16, layouts=layouts, **kw)
    eng.store = eng.backend.experts = store
    return eng


@pytest.mark.parametrize("fraction,recent", [(0.0, 2), (0.25, 3), (0.5, 16)])
def test_tiered_logits_identical_to_mapped(model, reference, fraction, recent):
    """Prompt batch (waves limited by 2-3 recent slots) and greedy decode: bit-identical to the mapped run."""
    ref_logits, ref_gen = reference
    eng = tiered(model, fraction, recent)
    eng.store.lookahead_k = 3
    np.testing.assert_array_equal(eng.logits(PROMPT), ref_logits)
    gen = eng.generate(PROMPT[:6], 12, keep_logits=True)
    assert gen.tokens == ref_gen.tokens
    for a, b in zip(gen.logits, ref_gen.logits):
        np.testing.assert_array_equal(a, b)
    io = eng.store.io
    assert io.served["ssd"] > 0 and io.ssd_read_bytes > 0  # the file tier really served experts
    if fraction > 0:
        assert io.served["arena"] > 0
    eng.close()


def test_tiered_qwen3next_with_pack_identical_to_mapped(tmp_path):
    """The tiers move bytes whatever the layer kinds: a qwen3next (delta-net layers, gated shared expert) with an
    expert pack, a quarter of its experts resident, gives the mapped model's logits and generation."""
    path = tmp_path / "next.gguf"
    write_synthetic(path, "tiny", arch="qwen3next", quant="Q4_K_M", seed=3)
    ref = load(path, n_ctx=96, experts="mmap", machine=MACHINE)
    want, want_gen = ref.logits(PROMPT), ref.generate(PROMPT[:6], 12)
    packfmt.write_pack(path)
    eng = tiered(str(path), 0.25, 3)
    np.testing.assert_array_equal(eng.logits(PROMPT), want)
    assert eng.generate(PROMPT[:6], 12).tokens == want_gen.tokens
    assert eng.store.io.served.get("ssd", 0) > 0
    eng.close()


def test_pack_extents_and_lookahead_accounting(packed):
    ref = load(packed, n_ctx=96, experts="mmap", machine=MACHINE)
    assert type(ref.store.src).__name__ == "PackExperts"
    want = ref.logits(PROMPT)
    eng = tiered(packed, 0.25, 4)
    assert all(len(x) == 1 for lay in eng.store.layouts.values() for x in lay.extents)  # one read per blob
    eng.store.lookahead_k = 4
    np.testing.assert_array_equal(eng.logits(PROMPT), want)
    eng.generate(PROMPT[:4], 10)
    io = eng.store.io
    assert io.lookahead_used > 0 and 0 < io.recall <= 1
    # every expert a layer used came from exactly one tier
    assert sum(io.served.values()) == eng.backend.stats.expert_bytes
    eng.close()


def test_engine_plan_forces_file_tier(model, reference):
    """Through the public API: a RAM budget below the model makes the plan tiered; logits unchanged."""
    ref_logits, _ = reference
    eng0 = load(model, n_ctx=96, experts="mmap", machine=MACHINE)
    needs = memory_needs(eng0.gguf, eng0.spec, 96)
    budget = RUNTIME_BYTES + needs.dense_bytes + needs.kv_bytes + 16 * eng0.plan.slot_bytes + needs.expert_bytes // 3
    eng = load(model, n_ctx=96, ram_budget=budget, machine=MACHINE)
    p = eng.plan
    assert p.mode == "tiered" and 0 < p.arena < needs.expert_bytes and p.used <= budget
    np.testing.assert_array_equal(eng.logits(PROMPT), ref_logits)
    eng.close()


def _vm_locked_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    return 0


def test_tiered_plan_locks_dense_weights(model):
    """Under a tiered plan the dense weights are mlocked (where allowed) so reclaim cannot take them."""
    before = _vm_locked_kb()
    eng = load(model, n_ctx=96, experts="tiered", machine=MACHINE)
    dense = [t for n, t in eng.gguf.tensors.items() if "_exps." not in n]
    if eng.locked_bytes == 0:
        pytest.skip("mlock not allowed for this user (RLIMIT_MEMLOCK)")
    assert eng.locked_bytes == sum(t.nbytes for t in dense)
    assert (_vm_locked_kb() - before) * 1024 >= eng.locked_bytes
    assert load(model, n_ctx=96, experts="mmap", machine=MACHINE).locked_bytes == 0
    eng.close()


# ---------------------------------------------------------------------------------------------- faults
def _reads_after(monkeypatch, before) -> None:
    """Every extent read by the reader threads first calls before() (a delay, a stall)."""
    orig = BlobReader._read_extent

    def patched(self, off, dest, want):
        before()
        return orig(self, off, dest, want)

    monkeypatch.setattr(BlobReader, "_read_extent", patched)


def test_slow_reads_are_waited_for(model, reference, monkeypatch):
    ref_logits, _ = reference
    _reads_after(monkeypatch, lambda: time.sleep(0.02))
    eng = tiered(model, 0.0, 4, read_timeout_s=5.0)
    np.testing.assert_array_equal(eng.logits(PROMPT), ref_logits)
    assert eng.store.io.read_wait_s > 0
    eng.close()


def test_stalled_read_is_an_error_not_a_hang(model, monkeypatch):
    release = threading.Event()
    _reads_after(monkeypatch, lambda: release.wait(10))
    eng = tiered(model, 0.0, 4, read_timeout_s=0.3)
    t0 = time.perf_counter()
    with pytest.raises(StrataError, match="made no progress for 0.3 s"):
        eng.logits(PROMPT)
    assert time.perf_counter() - t0 < 5
    release.set()
    eng.close()


def test_failing_reader_thread_is_an_error(model, monkeypatch):
    def boom(self, off, dest, want):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(BlobReader, "_read_extent", boom)
    eng = tiered(model, 0.0, 4)
    with pytest.raises(StrataError, match="expert read failed: moe.gguf: .*Input/output error"):
        eng.logits(PROMPT)
    eng.close()


def _copy_packed(packed, tmp_path):
    import shutil

    g = tmp_path / "m.gguf"
    shutil.copy(packed, g)
    shutil.copy(packfmt.default_pack_path(packed), packfmt.default_pack_path(g))
    return str(g), packfmt.default_pack_path(g)


def test_truncated_pack_is_an_error(packed, tmp_path):
    g, pack = _copy_packed(packed, tmp_path)
    eng = tiered(g, 0.0, 4)
    os.truncate(pack, os.path.getsize(pack) // 2)
    with pytest.raises(StrataError, match="m.strata-pack: (short read|expert read at byte|the file changed)"):
        eng.logits(PROMPT)
    eng.close()


def test_pack_changed_under_us_is_an_error(packed, tmp_path):
    g, pack = _copy_packed(packed, tmp_path)
    eng = tiered(g, 0.0, 4)
    time.sleep(0.01)
    with open(pack, "r+b") as f:  # same size, new bytes: only the modification time tells
        f.seek(8192)
        f.write(b"\xff" * 64)
    with pytest.raises(StrataError, match="changed while the model was running"):
        eng.logits(PROMPT)
    eng.close()


# ---------------------------------------------------------------------------------------------- profiles
def test_profile_round_trip_fill_and_adaptation(model, reference, tmp_path):
    ref_logits, ref_gen = reference
    eng = tiered(model, 0.25, 4)
    eng.generate(PROMPT[:6], 12)
    prof = tmp_path / "p.npz"
    eng.save_profile(prof)
    assert prof.is_file() and not (tmp_path / "p.npz.tmp").exists()
    counts = eng.store.profile.total()
    assert counts.sum() == (6 + 11) * eng.spec.n_expert_used * eng.spec.n_layer  # tokens x top-k x layers
    eng.close()

    loaded = RoutingProfile.load(prof, eng.spec)
    np.testing.assert_array_equal(loaded.counts, counts)
    # A run started from the profile holds its hottest experts from the first token: the arena has one pool per
    # blob size (a Q4_K_M file mixes ffn_down types across layers), and each pool holds the hottest experts of
    # the layers of its size, as many as it has slots.
    eng2 = tiered(model, 0.25, 4, profile=loaded)
    st = eng2.store
    res = st.resident()
    assert int(res.sum()) == st.arena_slots > 0
    ranked = loaded.ranked().tolist()
    for size, pi in st._arena.items():
        layers = {l for l, lay in st.layouts.items() if lay.slot_bytes == size}
        top = [(l, e) for l, e in ranked if l in layers][:st.pools[pi].n]
        assert top and all(res[l, e] for l, e in top), size
    np.testing.assert_array_equal(eng2.logits(PROMPT), ref_logits)

    # Adaptation: after a round, no recent-slot expert is hotter (beyond the hysteresis) than a resident one,
    # and every slot and the location table agree.
    eng2.generate(PROMPT[:6], 12)
    st._adapt()
    arena, recent = st.pools[0], st.pools[1]
    flat = st.decayed.reshape(-1)
    r_ok = (recent.key >= 0) & (recent.state == READY)
    a_ok = (arena.key >= 0) & (arena.state == READY)
    if r_ok.any() and a_ok.any():
        assert flat[recent.key[r_ok]].max() <= flat[arena.key[a_ok]].min() + 1.0
    for pi, pool in enumerate(st.pools):
        for s in np.flatnonzero(pool.key >= 0):
            l, e = divmod(int(pool.key[s]), st.n_expert)
            assert (st.loc_pool[l, e], st.loc_slot[l, e]) == (pi, s)
    gen = eng2.generate(PROMPT[:6], 12)
    assert gen.tokens == ref_gen.tokens  # the swaps moved bytes correctly
    eng2.close()


def test_profile_for_another_model_is_refused(model, tmp_path):
    eng = load(model, n_ctx=32, experts="mmap", machine=MACHINE)
    p = RoutingProfile("qwen3moe", eng.spec.n_layer + 1, eng.spec.n_expert)
    p.save(tmp_path / "other.npz")
    with pytest.raises(StrataError, match="profile is for qwen3moe with 5 layers"):
        RoutingProfile.load(tmp_path / "other.npz", eng.spec)
    (tmp_path / "junk.npz").write_bytes(b"not a profile")
    with pytest.raises(StrataError, match="not a strata-nb routing profile"):
        RoutingProfile.load(tmp_path / "junk.npz", eng.spec)


# ---------------------------------------------------------------------------------------------- the plan
PLAN = dict(dense=2 * GB, kv=GB // 2, experts=30 * GB, n_blobs=6144, slot_bytes=30 * GB // 6144 + 4096,
            recent_slots=32)


def test_plan_budgets_over_what_exists_are_refused():
    m = Machine(total_ram=24 * GB, available_ram=20 * GB, swap_free=0)
    with pytest.raises(StrataError, match="more than this machine's RAM"):
        make_plan(**PLAN, ram_budget=25 * GB, machine=m)
    with pytest.raises(StrataError, match="more than the RAM available now"):
        make_plan(**PLAN, ram_budget=21 * GB, machine=m)
    with pytest.raises(StrataError, match="before any expert"):
        make_plan(**PLAN, ram_budget=2 * GB, machine=m)
    with pytest.raises(StrataError, match="no room for the 32 expert read slots"):
        make_plan(**PLAN, ram_budget=int(3.3 * GB), machine=m)


@pytest.mark.parametrize("avail", [4, 8, 12, 16, 20, 23, 40, 60])
def test_automatic_plan_never_exceeds_available_memory(avail):
    m = Machine(total_ram=64 * GB, available_ram=avail * GB, swap_free=0)
    try:
        p = make_plan(**PLAN, machine=m)
    except StrataError:
        assert avail * GB - max(1 << 30, 0.05 * m.total_ram) < 2.5 * GB + RUNTIME_BYTES + 32 * PLAN["slot_bytes"]
        return
    assert p.used <= m.available_ram - p.reserve
    assert p.mode == ("mmap" if p.fixed + PLAN["experts"] <= p.budget else "tiered")
    if p.mode == "tiered":
        assert p.arena % PLAN["slot_bytes"] == 0 and p.file_tier > 0
        assert p.budget - p.used < PLAN["slot_bytes"]  # the arena takes what is left, to one blob


@pytest.mark.parametrize("version", ["v1", "v2", "none"])
def test_plan_sees_the_memory_cgroup(tmp_path, version):
    """In a container the machine is its memory cgroup: limit, and what is charged minus reclaimable cache."""
    from strata_nb.plan import _cgroup_memory

    proc = tmp_path / "cgroup"
    if version == "v1":
        proc.write_text("4:memory:/box\n0::/\n")
        d = tmp_path / "memory" / "box"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text("12000000000\n")
        (d / "memory.usage_in_bytes").write_text("5000000000\n")
        (d / "memory.stat").write_text("cache 3000000000\ntotal_inactive_file 2000000000\n")
        assert _cgroup_memory(str(tmp_path), str(proc)) == (12_000_000_000, 9_000_000_000)
    elif version == "v2":
        proc.write_text("0::/box\n")
        d = tmp_path / "box"
        d.mkdir()
        (d / "memory.max").write_text("8000000000\n")
        (d / "memory.current").write_text("7000000000\n")
        (d / "memory.stat").write_text("anon 6000000000\ninactive_file 500000000\n")
        assert _cgroup_memory(str(tmp_path), str(proc)) == (8_000_000_000, 1_500_000_000)
    else:
        proc.write_text("0::/box\n")
        (tmp_path / "box").mkdir()
        (tmp_path / "box" / "memory.max").write_text("max\n")
        assert _cgroup_memory(str(tmp_path), str(proc)) is None


# ---------------------------------------------------------------------------------------------- CLI
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "strata_nb.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_plan_generate_and_profiles(model, tmp_path):
    r = _cli("plan", "-m", model, "--ctx", "128")
    assert r.returncode == 0, r.stderr
    assert "dense weights" in r.stdout and "experts" in r.stdout and "budget" in r.stdout

    r = _cli("plan", "-m", model, "--ram-budget", "100000")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "more than this machine's RAM" in r.stderr

    prof = tmp_path / "run.npz"
    r = _cli("generate", "-m", model, "--tokens", "5,6,7,8", "-n", "6", "--experts", "tiered", "--stats",
             "--save-profile", str(prof))
    assert r.returncode == 0, r.stderr
    assert "plan:" in r.stderr and "resident in RAM" in r.stderr and "SSD reads: O_DIRECT" in r.stderr
    assert "decode experts" in r.stderr and "lookahead recall" in r.stderr
    assert prof.is_file()
    r = _cli("generate", "-m", model, "--tokens", "5,6,7,8", "-n", "2", "--experts", "tiered",
             "--expert-profile", str(prof))
    assert r.returncode == 0, r.stderr
    r = _cli("generate", "-m", model, "--tokens", "5", "-n", "2", "--expert-profile", str(tmp_path / "none.npz"))
    assert r.returncode != 0 and "expert profile not found" in r.stderr
