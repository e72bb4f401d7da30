"""The hybrid engine (GPU dense layers + VRAM expert slots + CPU expert pool behind the doorbell) against the CPU
engine on the same file. Without a GPU this runs in numba's CUDA simulator (tests/conftest.py), on the 2-layer
"micro" model (hidden 64, Q8_0: the simulator interprets every GPU thread in Python); on the GPU machine the same
tests run on the device, plus one on the tiny Q4_K_M model (every quant type of a Q4_K_M file).

Tolerances (max abs difference of the logits / their std): with a float32 KV cache (kv_type="f32") the GPU only
sums in another order than the CPU engine's float32 reference: within TOL = 2e-3, and the top tokens agree. The
default float16 cache rounds every cached key and value by up to 2^-11 relative, which four layers carry to the
logits: measured 0.6e-3 (micro) to 2.2e-3 (tiny mixtral) on an H200, bound TOL_F16 = 5e-3. The int8 fast path
of the CPU pool is checked where it acts, per layer (its own float32-vs-int8 difference moves routing decisions
downstream: the CPU engine's fast path alone departs from its reference by 0.13-1.9 on the tiny files, so an
end-to-end bound would not measure the pool).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from strata_nb.api import Engine, gpu_fixed_bytes
from strata_nb.errors import StrataError
from strata_nb.experts.vram_cache import slot_layout
from strata_nb.plan import GB, make_gpu_plan
from strata_nb.runtime.cuda_rt import SIM
from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.synth import write_synthetic

TOL = 2e-3
TOL_F16 = 5e-3
PROMPT = [5, 17, 101, 3, 250, 42, 7]
CTX = 64


@pytest.fixture(scope="module", autouse=True)
def _fast_simulator_barriers():
    """The simulator's block barriers poll under the GIL: a short switch interval makes them ~10x cheaper."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "micro.gguf"
    write_synthetic(path, "micro", quant="Q8_0", seed=5)
    return path


@pytest.fixture(scope="module")
def reference(model):
    """CPU engine, float32 reference kernels: logits of the prompt, then of 3 greedy decode steps."""
    eng = Engine(model, device="cpu", n_ctx=CTX, fast=False)
    res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.0), keep_logits=True)
    return np.concatenate(res.logits), res.tokens


def budget_for(path, slots_per_layer: int, kv_type: str = "f16") -> float:
    """A --vram-budget giving this many expert slots per MoE layer."""
    from strata_nb.api import open_model
    from strata_nb.experts.source import open_experts

    g, spec = open_model(path)
    src = open_experts(g)
    per_layer = sum(slot_layout(src, l).slot_bytes for l in src.layers)
    return gpu_fixed_bytes(path, CTX, kv_type) + slots_per_layer * per_layer + per_layer // 2


def close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / b.std())


@pytest.mark.parametrize("slots,kv,gates,prefetch", [(0, "f32", "0", "0"), (2, "f32", "0", "0"),
                                                     (2, "f32", "1", "0"), (4, "f32", "0", "1"),
                                                     (2, "f16", "1", "1")])
def test_hybrid_logits_match_cpu_engine(model, reference, slots, kv, gates, prefetch, monkeypatch):
    """None, half and all experts in VRAM; gates (doorbell.py) and the L2 prefetch branch (prefetch.py) on and
    off: the same logits and tokens as the CPU engine."""
    ref, toks = reference
    monkeypatch.setenv("STRATA_NB_GATES", gates)
    monkeypatch.setenv("STRATA_NB_PREFETCH", prefetch)
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, slots, kv), kv_type=kv)
    try:
        assert set(eng.gpu_plan.slots.values()) == {slots}
        assert eng.backend._gated == (gates == "1" and not SIM and slots < 4)  # gates exist on a GPU only
        assert eng.backend._prefetch == (prefetch == "1")
        res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.0), keep_logits=True)
        got = np.concatenate(res.logits)
        assert got.shape == ref.shape
        assert close(got, ref) < (TOL if kv == "f32" else TOL_F16)
        assert res.tokens == toks
        assert (got.argmax(1) == ref.argmax(1)).all()
    finally:
        eng.close()


@pytest.mark.skipif(SIM, reason="a real GPU only: the Q4_K_M models are too slow for the simulator")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe", "mixtral"])
def test_hybrid_architectures_q4_k_m_match_cpu(tmp_path, arch):
    """Every quant type of a Q4_K_M file and every architecture trait (QKV bias, gated shared expert, full
    QK-norm, normal rope with YaRN) through the GPU kernels, half the experts in VRAM, both KV cache types."""
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, "tiny", arch=arch, quant="Q4_K_M", seed=3)
    prompt = list(range(3, 60, 3))
    ref = Engine(path, device="cpu", n_ctx=CTX, fast=False).logits(prompt)
    for kv, tol in (("f32", TOL), ("f16", TOL_F16)):
        eng = Engine(path, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(path, 4, kv), kv_type=kv)
        try:
            got = eng.logits(prompt)
            assert close(got, ref) < tol, kv
            assert (got.argmax(1) == ref.argmax(1)).all(), kv
        finally:
            eng.close()


def test_fast_cpu_pool_is_the_cpu_engines_int8_path(model, monkeypatch, tmp_path):
    """With the int8 kernels (fast=True), every layer's CPU pool result is exactly what a separate CPU engine's
    routed-expert FFN computes with int8 activations from the published inputs (the choices held in VRAM left
    out), and within int8 error of the float32 path."""
    from strata_nb.api import open_model
    from strata_nb.experts.profile import RoutingProfile
    from strata_nb.runtime import gpu_backend
    from strata_nb.runtime.cpu_backend import Activation, CPUBackend

    # Experts 0 and 1 of every layer fill the 2 slots at load, so the prompt's choices are hits and misses
    # mixed whatever the copy thread's timing (slots filled on first use would depend on it).
    prof = RoutingProfile.for_spec(open_model(model)[1])
    prof.counts[:, :2] = 1.0
    prof.tokens = 1
    prof.save(tmp_path / "hot01.npz")

    seen = []
    orig = gpu_backend.GPUBackend._cpu_pool

    def pool(self, layer, T, stats):
        mb = self.mb
        inputs = (mb.x[:T].copy(), mb.ids[:T].copy(), mb.wts[:T].copy(), mb.slot[:T].copy())
        dt = orig(self, layer, T, stats)
        seen.append((layer, *inputs, mb.y[:T].copy()))
        return dt

    monkeypatch.setattr(gpu_backend.GPUBackend, "_cpu_pool", pool)
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=True, vram_budget=budget_for(model, 2),
                 expert_profile=tmp_path / "hot01.npz")
    try:
        eng.warm_up()  # on a GPU its throwaway forwards pass through the pool too (computing every choice)
        seen.clear()
        eng.generate(PROMPT, 4, SamplerConfig(temperature=0.0))
        fast = CPUBackend(eng.spec, eng.weights, eng.store, fast=True)
        slow = CPUBackend(eng.spec, eng.weights, eng.store, fast=False)
    finally:
        eng.close()
    assert len(seen) == 4 * 2  # 4 forwards (prompt, 3 decode steps) x 2 MoE layers
    for _, _, ids, _, slot, _ in seen[:2]:  # the prompt's pool calls: slots from the profile's fill
        assert ((slot >= 0) == (ids < 2)).all()
        assert (slot < 0).any() and (slot >= 0).any()  # hits and misses mixed
    for layer, x, ids, wts, slot, y in seen:
        miss = np.where(slot >= 0, -1, ids).astype(np.int32)
        want = np.full_like(y, np.nan)
        fast.routed_experts(layer, Activation(x), miss, wts, want)
        np.testing.assert_array_equal(y, want)
        f32 = np.full_like(y, np.nan)
        slow.routed_experts(layer, Activation(x), miss, wts, f32)
        assert np.abs(y - f32).max() <= 2e-2 * np.abs(f32).max()


def test_device_sampler_gives_the_cpu_engines_tokens(model, monkeypatch):
    """Sampling on the device (only the id comes back) draws what the host sampler draws from the same seed."""
    cfg = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.1, seed=1234)
    cpu = Engine(model, device="cpu", n_ctx=CTX, fast=False)
    want = cpu.generate(PROMPT, 6, SamplerConfig(**cfg)).tokens
    from strata_nb.runtime import gpu_backend

    monkeypatch.setattr(gpu_backend, "WARM_TOKENS", 2)  # the cache's warm-up: the first 2 decode tokens here
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, 2))
    try:
        res = eng.generate(PROMPT, 6, SamplerConfig(**cfg))
        assert res.tokens == want
        h = res.hybrid
        assert h.tokens == res.decode_steps == 5
        assert h.hits + h.misses == 5 * 2 * 2  # decode tokens x MoE layers x top-k
        assert h.late_hits + h.late_misses == 3 * 2 * 2  # after the warm-up
        assert h.routed.sum() == h.late_hits + h.late_misses
        assert abs(h.wall_s - res.decode_s) < 0.25 * res.decode_s  # the breakdown accounts for the decode time
    finally:
        eng.close()


def test_decode_launched_ahead_gives_the_cpu_engines_tokens(model):
    """With every expert in VRAM a token needs no host work, so decode launches the next token's forward before
    reading this one's: a run to the length limit launches nothing past it; a stop leaves one forward launched
    ahead, and what comes next (continuing the same session with the same sampler, or a new prompt) still gives
    exactly the CPU engine's tokens."""
    from strata_nb.runtime.generate import generate
    from strata_nb.runtime.sampler import Sampler

    cfg = SamplerConfig(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.1, seed=77)
    cpu = Engine(model, device="cpu", n_ctx=CTX, fast=False)
    want = cpu.generate(PROMPT, 6, cfg).tokens
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, 4))
    try:
        be = eng.backend
        assert be.cache.full_layers == set(be.cache.slots)  # no doorbell: one graph a token
        res = eng.generate(PROMPT, 6, cfg)
        assert res.tokens == want
        assert be._ahead == 0  # the hint said the last token was the last
        # stop on the third token: the fourth is already on its way, then continue the same session (no
        # repetition penalty: a continuation's history is the device's, not the prompt generate() is given)
        plain = dataclasses.replace(cfg, repeat_penalty=1.0)
        stop = {cpu.generate(PROMPT, 6, plain).tokens[2]}
        runs = []
        for e in (cpu, eng):
            session, sampler = e.new_session(), Sampler(plain, eng.spec.n_vocab)
            first = generate(e.backend, session, PROMPT, 6, sampler, stop).tokens
            if e is eng:
                assert be._ahead != 0
            more = generate(e.backend, session, [first[-1]], 3, sampler, set()).tokens
            runs.append((first, more, session.pos))
        assert runs[1] == runs[0]
        assert len(runs[0][0]) <= 3 and runs[0][0][-1] in stop and len(runs[0][1]) == 3
        assert eng.generate(PROMPT, 6, cfg).tokens == want  # a new prompt after all that
    finally:
        eng.close()


def test_vram_cache_slots_hold_their_experts_after_admission_and_swaps(model, reference):
    """Admission on first use and adaptive swaps keep the device table true: every slot the table names holds
    exactly that expert's bytes, and the logits stay those of the CPU engine."""
    ref, _ = reference
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, 1), adapt_every=1)
    try:
        be = eng.backend
        be.cache.swaps_per_layer = 8
        res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.0), keep_logits=True)
        assert close(np.concatenate(res.logits), ref) < TOL
        eng.generate(PROMPT, 8, SamplerConfig(temperature=1.0, seed=3))
        cache = be.cache

        def check():
            table = cache.table.copy_to_host()
            assert (table == cache.host_table).all()
            for l, buf in cache.bufs.items():
                host = buf.copy_to_host()
                for e in np.flatnonzero(table[l] >= 0):
                    s = table[l, e]
                    for kind, m in cache.layouts[l].mats.items():
                        want = cache.src.rows(l, kind, e).reshape(-1)
                        assert (host[s, m.offset:m.offset + m.nbytes] == want).all()

        be._call(check)
        assert cache.stats.admitted > 0
        assert cache.stats.swaps > 0
    finally:
        eng.close()


def test_device_warm_up_changes_no_state(model, reference):
    """The throwaway forwards that compile every kernel on a GPU (the simulator skips them in Engine.warm_up: it
    compiles nothing) admit, swap and count nothing, leave the device sampler's state alone and capture the decode
    graphs; the run after them (another sampler chain and seed) reuses those graphs and gives the CPU engine's
    logits and tokens."""
    ref, toks = reference
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, 1), adapt_every=1)
    try:
        be = eng.backend
        cache, prof = be.cache, eng.store.profile

        def state():
            return (cache.host_table.copy(), cache.counts.copy(), cache._tokens, dataclasses.asdict(cache.stats),
                    prof.total().copy(), prof.run_tokens, dataclasses.asdict(be.stats), be.hybrid.tokens,
                    be.sampler, be.sampler.step, be.sampler.counts.copy_to_host(), be.sampler.ring.copy_to_host())

        before = state()
        assert be._decode is None
        be._call(be._warm_up)
        after = state()
        for a, b in zip(before, after):
            assert (a == b).all() if isinstance(a, np.ndarray) else a == b
        assert be._dev_pos == 3  # it did run: 2 tokens, then 1
        graphs = be._decode
        assert graphs and all(seg.graph is not None for seg in graphs)
        res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.0), keep_logits=True)
        assert close(np.concatenate(res.logits), ref) < TOL
        assert res.tokens == toks
        res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.7, top_k=5, seed=11))
        assert be._decode is graphs  # the same captured program: no capture inside the generation
    finally:
        eng.close()


@pytest.mark.parametrize("slots", [0, 2])
def test_hybrid_qwen3next_matches_cpu(tmp_path, slots):
    """The GPU's delta-net and gated attention blocks (qwen3next: 3 delta-net layers, 1 gated attention, a gated
    shared expert): a prompt, decode steps on the device sampler (the recurrent state carried in device memory
    through the graphs), the same tokens and logits as the CPU engine; then a snapshot restored continues alike."""
    path = tmp_path / "next.gguf"
    write_synthetic(path, "micro", arch="qwen3next", quant="Q8_0", seed=5)
    ref = Engine(path, device="cpu", n_ctx=CTX, fast=False).generate(PROMPT, 3, SamplerConfig(temperature=0.0),
                                                                      keep_logits=True)
    eng = Engine(path, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(path, slots, "f32"),
                 kv_type="f32")
    try:
        res = eng.generate(PROMPT, 3, SamplerConfig(temperature=0.0), keep_logits=True)
        got, want = np.concatenate(res.logits), np.concatenate(ref.logits)
        assert close(got, want) < TOL
        assert res.tokens == ref.tokens
        s = eng.new_session()
        eng.backend.forward(s, np.asarray(PROMPT[:4]))
        snap = s.snapshot()
        a = eng.backend.forward(s, np.asarray(PROMPT[4:]), all_logits=True)
        s.restore(snap)
        b = eng.backend.forward(s, np.asarray(PROMPT[4:]), all_logits=True)
        if slots:  # the cache may have moved an expert between GPU and CPU in between: another summation order
            assert close(b, a) < TOL
        else:
            np.testing.assert_array_equal(b, a)
    finally:
        eng.close()


def test_gpu_session_snapshot_restore_and_takeover(model):
    """The GPU engine's sessions share its device state: a snapshot (device to host) restored into a session
    continues bit for bit with the device sampler; a session whose state another one has used since is refused
    until a snapshot is restored into it. Every expert in VRAM: with a share, the cache's placement adapts between
    the two runs, and an expert computed by the CPU pool instead of the GPU rounds its sum differently."""
    eng = Engine(model, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(model, 4, "f32"), kv_type="f32")
    try:
        be, greedy = eng.backend, SamplerConfig(temperature=0.0)
        from strata_nb.runtime.sampler import Sampler

        a = eng.new_session()
        be.forward(a, np.asarray(PROMPT[:-1]))
        snap = a.snapshot()

        def continue_(s):  # the last prompt token and two decode steps on the device sampler
            smp = Sampler(greedy, eng.spec.n_vocab)
            tok = be.sample_next(s, [PROMPT[-1]], smp, list(PROMPT))
            out = [tok]
            for _ in range(2):
                tok = be.sample_next(s, [tok], smp, list(PROMPT) + out)
                out.append(tok)
            return out, be.forward(s, np.asarray([out[-1]]))

        first, logits = continue_(a)
        b = eng.new_session()  # takes the device state over at position 0
        be.forward(b, np.asarray(PROMPT[:3]))
        with pytest.raises(StrataError, match="restore a snapshot"):
            be.forward(a, np.asarray([1]))
        a.restore(snap)
        again, logits2 = continue_(a)
        assert again == first
        np.testing.assert_array_equal(logits, logits2)
    finally:
        eng.close()


@pytest.mark.skipif(SIM, reason="a real GPU only: the simulator has no stream memory operations")
def test_gated_work_waits_for_the_host_and_closes_its_gate():
    """Work captured behind a gate does not run until the host opens it, then runs once and closes the gate
    again, replay after replay (what the hybrid engine's per-layer segments rely on)."""
    import time

    from numba import cuda

    from strata_nb.cuda_kernels import ops as kops
    from strata_nb.runtime.cuda_rt import Graph
    from strata_nb.runtime.doorbell import Mailbox

    mb = Mailbox(1, 64, 1, n_layer=2)
    st = cuda.stream()
    assert mb.gates_work(st, 5.0)
    x = cuda.to_device(np.zeros((1, 64), np.float32))
    y = cuda.to_device(np.ones((1, 64), np.float32))
    g = Graph(lambda s: (mb.gate_op(1)(s), kops.add(x, y, 1, s)), st, "gated add")
    try:
        for rep in range(1, 4):
            g.launch(st)
            ev = cuda.event()
            ev.record(st)
            time.sleep(0.05)
            assert not ev.query() and mb.gates[1] == 0  # held: the add has not run
            mb.open(1)
            deadline = time.perf_counter() + 5.0
            while not ev.query():
                assert time.perf_counter() < deadline, "the gated work did not run after the gate opened"
                time.sleep(1e-3)
            assert x.copy_to_host()[0, 0] == rep and mb.gates[1] == 0  # ran once, gate closed by the device
    finally:
        mb.release(st, 5.0)  # a failed check must not leave the stream held
        g.close()


def test_a_gpu_that_never_publishes_is_an_error_not_a_hang(model, monkeypatch):
    from strata_nb.cuda_kernels import mailbox

    eng = Engine(model, device="cuda", n_ctx=CTX, vram_budget=budget_for(model, 0), gpu_timeout_s=0.3)
    try:
        monkeypatch.setattr(mailbox, "ring", lambda counter, seq, stream: None)
        with pytest.raises(StrataError, match="did not publish"):
            eng.logits(PROMPT[:3])
    finally:
        eng.close()


def test_gpu_plan_refuses_what_the_device_cannot_hold():
    kw = dict(free=10 * GB, total=12 * GB, dense=2 * GB, kv=1 * GB, scratch=GB // 2,
              experts=40 * GB, slot_bytes={0: 10 << 20, 1: 10 << 20}, n_expert=128)
    with pytest.raises(StrataError, match="more than the GPU has free"):
        make_gpu_plan(**kw, vram_budget=11 * GB)
    with pytest.raises(StrataError, match="before any expert slot"):
        make_gpu_plan(**kw, vram_budget=3 * GB)
    p = make_gpu_plan(**kw, vram_budget=5 * GB)
    per = (5 * GB - p.fixed) // (20 << 20)
    assert p.slots == {0: per, 1: per} and p.slot_total <= 5 * GB - p.fixed
    auto = make_gpu_plan(**kw)
    assert auto.budget < kw["free"] and auto.fixed + auto.slot_total <= auto.budget
    # whole layers, the last first: 1.28 GB holds one layer of 128 experts of 10 MiB, not two
    whole = make_gpu_plan(**kw, vram_budget=p.fixed + 128 * (10 << 20) + (100 << 20), layout="layers")
    assert whole.slots == {0: 0, 1: 128}
    with pytest.raises(StrataError, match="unknown VRAM layout"):
        make_gpu_plan(**kw, layout="rows")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "strata_nb.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_device_choice_and_vram_plan(model):
    r = _cli("plan", "-m", str(model), "--ctx", str(CTX), "--device", "cpu", "--vram-budget", "4")
    assert r.returncode != 0 and "needs the hybrid GPU engine" in r.stderr
    r = _cli("plan", "-m", str(model), "--ctx", str(CTX), "--device", "cuda", "--vram-budget",
             str(budget_for(model, 2) / GB))
    assert r.returncode == 0, r.stderr
    assert "expert slots" in r.stdout and "4 of 8 experts (50%)" in r.stdout
    r = _cli("generate", "-m", str(model), "--ctx", str(CTX), "--device", "cuda", "--tokens",
             ",".join(map(str, PROMPT)), "-n", "3", "--stats", "--vram-budget", str(budget_for(model, 1) / GB))
    assert r.returncode == 0, r.stderr
    for want in ("device: hybrid GPU engine", "expert slots", "token time", "expert hits", "VRAM cache"):
        assert want in r.stderr, want


def test_choose_swaps_ranks_by_decayed_counts_with_hysteresis_and_a_budget():
    """The cache's adaptation step on one layer: the hottest experts without a slot replace the coldest residents
    while the newcomer leads by more than one token, never more than the budget, never a loading expert."""
    from strata_nb.experts.vram_cache import choose_swaps

    slot_expert = np.array([0, 1, 2, -2], np.int64)  # slot 3 is loading expert 6
    table = np.full(8, -1, np.int32)
    table[[0, 1, 2]] = [0, 1, 2]
    loading = np.zeros(8, bool)
    loading[6] = True
    counts = np.array([5.0, 0.5, 2.0, 0.0, 4.0, 1.4, 9.0, 3.2])
    # candidates by count: 4 (4.0), 7 (3.2), 5 (1.4); residents coldest first: slot 1 (0.5), slot 2 (2.0), slot 0
    assert choose_swaps(slot_expert, table, loading, counts, 8) == [(1, 4), (2, 7)]  # 1.4 <= 5.0 + 1 stops it
    assert choose_swaps(slot_expert, table, loading, counts, 1) == [(1, 4)]
    counts[7] = 3.0  # 3.0 <= 2.0 + 1: within the hysteresis
    assert choose_swaps(slot_expert, table, loading, counts, 8) == [(1, 4)]
    assert choose_swaps(np.full(4, -1, np.int64), np.full(8, -1, np.int32), loading, counts, 8) == []


def test_plan_swaps_over_all_layers_matches_the_rule_by_sorting():
    """The compiled step over every layer (decay, then each partly cached layer's swaps) against the rule stated
    with stable sorts, on random layers with ties in the counts, loading experts and free slots."""
    from strata_nb.cpu_kernels.swaps import plan_swaps

    def by_sorting(se, table, loading, counts, budget):
        res = np.flatnonzero(se >= 0)
        cand = np.flatnonzero((table < 0) & ~loading & (counts > 0))
        cand = cand[np.argsort(-counts[cand], kind="stable")]
        cold = res[np.argsort(counts[se[res]], kind="stable")]
        out = []
        for e, s in zip(cand, cold):
            if len(out) >= budget or counts[e] <= counts[se[s]] + 1.0:
                break
            out.append((int(s), int(e)))
        return out

    r = np.random.default_rng(3)
    L, E, budget = 12, 64, 3
    nslots = r.integers(0, E + 1, L)
    nslots[[0, 1]] = [0, E]  # a layer without slots, and one holding every expert: never adapted
    se2 = np.full((L, E), -1, np.int64)
    table = np.full((L, E), -1, np.int32)
    loading = np.zeros((L, E), bool)
    for l in range(L):
        ex = r.permutation(E)[:nslots[l]]
        for s, e in enumerate(ex):
            if r.random() < 0.1:
                se2[l, s] = -2  # loading
                loading[l, e] = True
            elif r.random() < 0.9:
                se2[l, s] = e
                table[l, e] = s
    counts = np.floor(r.random((L, E)) * 8) / 2  # coarse: many ties
    want_counts = counts * 0.7
    want = [(l, s, e) for l in range(L) if 0 < nslots[l] < E
            for s, e in by_sorting(se2[l, :nslots[l]], table[l], loading[l], want_counts[l], budget)]
    out = np.empty((L * budget, 3), np.int64)
    n = plan_swaps(se2, nslots.astype(np.int64), table, loading, counts, 0.7, budget, out)
    np.testing.assert_array_equal(counts, want_counts)
    assert [tuple(x) for x in out[:n].tolist()] == want
    assert len(want) > L  # the case exercises several swaps a layer
