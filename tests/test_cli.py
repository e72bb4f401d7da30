"""The command line end to end: generation, stats, logits dump, pack, info, synth, and every refusal."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from strata_nb import api
from strata_nb.api import load
from strata_nb.errors import StrataError
from strata_nb.runtime.cuda_rt import SIM
from strata_nb.model.chat import render_chat
from strata_nb.cli.main import main
from strata_nb.synth import write_synthetic


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cli") / "tiny-qwen3moe.gguf"
    write_synthetic(p, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=1)
    return str(p)


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_refused(res, *needles: str) -> None:
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_generate_tokens_streams_text_and_stats(model):
    res = run("generate", "-m", model, "--tokens", "5,6,7,8", "-n", "12", "--stats")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip()  # streamed text
    for key in ("prompt", "decode", "weights/token", "expert FFNs", "load"):
        assert key in res.stderr


def test_dump_logits_matches_api(model, tmp_path):
    out = tmp_path / "logits.npy"
    res = run("generate", "-m", model, "--tokens", "1 2 3 4 5", "-n", "4", "--dump-logits", out)
    assert res.exit_code == 0, res.stderr
    dumped = np.load(out)
    assert dumped.dtype == np.float32 and dumped.shape[0] == 5 + 4
    eng = load(model, n_ctx=64)
    # The prompt rows are exactly the API's batch logits (same kernels, same batch).
    np.testing.assert_array_equal(dumped[:5], eng.logits([1, 2, 3, 4, 5]))
    assert not list(tmp_path.glob("*.tmp"))


def test_seed_gives_same_text(model):
    args = ("generate", "-m", model, "-p", "hello world", "-n", "16", "--temp", "0.9", "--top-k", "0")
    a, b = run(*args, "--seed", "11"), run(*args, "--seed", "11")
    assert a.exit_code == 0 and a.stdout == b.stdout


def test_chat_prompt_is_the_rendered_template(model, tmp_path):
    out = tmp_path / "chat.npy"
    res = run("generate", "-m", model, "-p", "Write a haiku", "--chat", "--system", "be brief", "-n", "3",
              "--dump-logits", out)
    assert res.exit_code == 0, res.stderr
    eng = load(model, n_ctx=128)
    text = render_chat(eng.gguf.get("tokenizer.chat_template"),
                       [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Write a haiku"}])
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    ids = eng.tokenizer.encode(text, add_special=True, parse_special=True)
    assert ids[0] == eng.tokenizer.token_to_id("<|im_start|>")  # parsed as one special token
    dumped = np.load(out)
    assert dumped.shape[0] == len(ids) + 3
    np.testing.assert_array_equal(dumped[:len(ids)], eng.logits(ids))


def test_info(model):
    res = run("info", "-m", model)
    assert res.exit_code == 0, res.stderr
    for key in ("qwen3moe", "experts", "Q4_K", "Q6_K", "routed experts", "KV cache"):
        assert key in res.stdout
    # which engine --device auto runs here, and why (the test machine: the simulator, or a GPU)
    want = "hybrid GPU engine on CUDA device" if not SIM else "CPU engine (only numba's CUDA simulator found"
    assert re.search(rf"^device \(auto\) +{re.escape(want)}", res.stdout, re.M), res.stdout


def test_device_reasons(monkeypatch):
    """Why auto falls back to the CPU engine: numba-cuda missing, numba's own CUDA target, no GPU, the simulator."""
    from strata_nb.api import pick_device
    from strata_nb.runtime import cuda_rt

    class FakeCuda:
        implementation = "NVIDIA"

        @staticmethod
        def is_available() -> bool:
            return False

    monkeypatch.setattr(cuda_rt, "SIM", False)
    monkeypatch.setattr(cuda_rt, "cuda", None)
    assert pick_device("auto") == ("cpu", f"device: CPU engine ({cuda_rt.NO_NUMBA_CUDA})")
    monkeypatch.setattr(cuda_rt, "cuda", type("BuiltIn", (FakeCuda,), {"implementation": "Built-in"}))
    assert pick_device("auto")[1] == f"device: CPU engine ({cuda_rt.NO_NUMBA_CUDA})"
    assert "pip install 'strata-nb[cuda]'" in cuda_rt.NO_NUMBA_CUDA
    monkeypatch.setattr(cuda_rt, "cuda", FakeCuda)
    assert pick_device("auto") == ("cpu", "device: CPU engine (numba-cuda found no CUDA GPU: no device, or no "
                                          "NVIDIA driver)")
    with pytest.raises(StrataError, match="--device cuda: numba-cuda found no CUDA GPU"):
        pick_device("cuda")
    with pytest.raises(StrataError, match="--vram-budget needs the hybrid GPU engine"):
        pick_device("auto", vram_budget=1e9)
    monkeypatch.setattr(cuda_rt, "SIM", True)
    assert pick_device("auto")[1].startswith("device: CPU engine (only numba's CUDA simulator found")
    assert pick_device("cuda") == ("cuda", "device: hybrid GPU engine on numba CUDA simulator")
    assert pick_device("cpu", None) == ("cpu", "device: CPU engine (--device cpu)")


def test_device_choice_by_layer_kinds(tmp_path, monkeypatch):
    """qwen3next's delta-net and gated attention layers have GPU blocks: auto and --device cuda pick the hybrid
    engine where there is a GPU; a kind with no GPU block is refused by --device cuda (auto: the CPU engine)."""
    from strata_nb import api
    from strata_nb.runtime import cuda_rt
    from strata_nb.synth import write_synthetic

    path = tmp_path / "next.gguf"
    write_synthetic(path, "tiny", arch="qwen3next", quant="Q8_0")
    _, spec = api.open_model(path)
    monkeypatch.setattr(cuda_rt, "SIM", False)
    monkeypatch.setattr(cuda_rt, "cuda_status", lambda: (True, "a GPU (test)"))
    assert api.pick_device("auto", spec=spec) == ("cuda", "device: hybrid GPU engine on a GPU (test)")
    assert api.pick_device("cuda", spec=spec) == ("cuda", "device: hybrid GPU engine on a GPU (test)")
    monkeypatch.setattr(api, "GPU_MIXERS", ("attention",))
    with pytest.raises(StrataError, match="no GPU block for deltanet, gated_attention layers yet .* --device cpu"):
        api.pick_device("cuda", spec=spec)


def test_pack_then_generate_identical(model, tmp_path):
    m = tmp_path / "m.gguf"
    shutil.copy(model, m)
    res = run("pack", m)
    assert res.exit_code == 0, res.stderr
    pack = tmp_path / "m.strata-pack"
    assert pack.exists()
    a = run("generate", "-m", m, "--tokens", "3 1 4 1 5", "-n", "10", "--pack", pack, "--dump-logits", tmp_path / "a.npy")
    # Move the pack away: the same run now reads the experts from the GGUF in place.
    pack.rename(tmp_path / "elsewhere.pack")
    b = run("generate", "-m", m, "--tokens", "3 1 4 1 5", "-n", "10", "--dump-logits", tmp_path / "b.npy")
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    assert run("pack", m, "-o", tmp_path / "elsewhere.pack", "--verify").exit_code == 0


def test_stale_pack_refused(model, tmp_path):
    m = tmp_path / "m.gguf"
    shutil.copy(model, m)
    assert run("pack", m).exit_code == 0
    other = tmp_path / "other.gguf"
    write_synthetic(other, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=2)
    shutil.copy(other, m)  # the GGUF changed under its pack
    assert_refused(run("generate", "-m", m, "--tokens", "1 2", "-n", "2"), "pack")


# ------------------------------------------------------------------------------------------------ refusals
def test_missing_file():
    assert_refused(run("generate", "-m", "/nonexistent/model.gguf", "-p", "hi"), "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    assert_refused(run("generate", "-m", p, "-p", "hi"), "not a GGUF")


def test_truncated_file(model, tmp_path):
    p = tmp_path / "t.gguf"
    data = open(model, "rb").read()
    p.write_bytes(data[: len(data) // 2])
    assert_refused(run("generate", "-m", p, "-p", "hi"), "truncated")


def _tiny_gguf(path, arch: str, qtype=gguf.GGMLQuantizationType.F32) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    n = 32 if qtype == gguf.GGMLQuantizationType.F32 else 18  # one block of IQ4_NL is 18 bytes for 32 values
    data = np.zeros((4, 32), np.float32) if qtype == gguf.GGMLQuantizationType.F32 else np.zeros((4, n), np.uint8)
    w.add_tensor("token_embd.weight", data, raw_dtype=qtype if qtype != gguf.GGMLQuantizationType.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "bert.gguf"
    _tiny_gguf(p, "bert")
    assert_refused(run("generate", "-m", p, "-p", "hi"), "unsupported architecture 'bert'", "qwen3moe")


def test_unsupported_quant(tmp_path):
    p = tmp_path / "iq.gguf"
    _tiny_gguf(p, "qwen3moe", gguf.GGMLQuantizationType.IQ4_NL)
    assert_refused(run("info", "-m", p), "IQ4_NL", "token_embd.weight", "Q4_K")


# ------------------------------------------------------------------------------------- checks before loading
@pytest.fixture
def bound(monkeypatch) -> list:
    """Records every weight binding: a refused request must be refused before the engine binds anything (on the
    GPU machine the hybrid engine then uploads the weights and fills the VRAM expert cache, with a progress bar)."""
    calls: list = []
    real = api.bind_weights
    monkeypatch.setattr(api, "bind_weights", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("args, needles", [
    (("--tokens", " ".join(["3"] * 40), "--ctx", "32", "-n", "0"), ("longer than the context", "--ctx 32")),
    (("--tokens", "3 3 3", "--ctx", "32", "-n", "30"), ("prompt (3 tokens) + -n 30", "--ctx 32")),
    (("-p", "hello world " * 20, "--ctx", "16", "-n", "1"), ("exceed the context", "--ctx 16")),
    (("--tokens", "1 999999", "-n", "1"), ("token id 999999 out of range",)),
    (("-p", "", "-n", "1"), ("empty prompt",)),
])
def test_inputs_refused_before_loading(model, bound, device, args, needles):
    res = run("generate", "-m", model, "--device", device, *args)
    assert_refused(res, *needles)  # one line: no progress bar, plan or notice before it
    assert not bound


def test_options_refused_before_loading(model, bound, tmp_path):
    dense = tmp_path / "dense.gguf"
    write_synthetic(dense, "tiny", arch="qwen3", quant="Q8_0", seed=1)
    no_template = tmp_path / "no-template.gguf"  # the key renamed in place (same length): the file has none
    data = open(model, "rb").read()
    assert data.count(b"tokenizer.chat_template") == 1
    no_template.write_bytes(data.replace(b"tokenizer.chat_template", b"tokenizer.chat_templatX"))
    cases = [
        (("-m", model, "-p", "hi", "--device", "cpu", "--vram-budget", "1"), "needs the hybrid GPU engine"),
        (("-m", model, "-p", "hi", "--dump-logits", tmp_path / "no" / "x.npy"), "--dump-logits: directory"),
        (("-m", model, "-p", "hi", "--save-profile", tmp_path / "no" / "p.npz"), "--save-profile: directory"),
        (("-m", dense, "-p", "hi", "--save-profile", tmp_path / "p.npz"), "no routed experts"),
        (("-m", no_template, "-p", "hi", "--chat"), "has no tokenizer.chat_template"),
        (("-m", model, "-p", "hi", "--ctx", "0"), "--ctx must be positive"),
        (("-m", model, "-p", "hi", "--lookahead", "-1"), "--lookahead must be >= 0"),
        (("-m", model, "-p", "hi", "--temp", "-1"), "temperature"),
        (("-m", model, "-p", "hi", "--threads", "100000"), "--threads"),
    ]
    for args, needle in cases:
        assert_refused(run("generate", *args, "-n", "1"), needle)
    assert not bound


# ----------------------------------------------------------------------------------- compile vs timed work
def test_prompt_time_excludes_the_warm_up(model, monkeypatch):
    """The kernels compile in a warm-up before the clocks start; --stats reports it on its own line. A slow
    warm-up (a first run's compile) must show there and not in the prompt time."""
    from strata_nb.runtime.cpu_backend import CPUBackend

    real = CPUBackend.warm_up

    def slow_warm_up(self):
        time.sleep(2.0)
        real(self)

    monkeypatch.setattr(CPUBackend, "warm_up", slow_warm_up)
    # one thread: 4 tokens of the tiny model take milliseconds even on a busy machine
    res = run("generate", "-m", model, "--device", "cpu", "--threads", "1", "--tokens", "5 6 7 8", "-n", "3",
              "--stats")
    assert res.exit_code == 0, res.stderr
    ms = {k: float(v) for k, v in re.findall(r"^(load|compile/warm-up|prompt|decode)\s+(?:\d+ tokens in\s+)?"
                                             r"([\d.]+) ms", res.stderr, re.M)}
    assert set(ms) == {"load", "compile/warm-up", "prompt", "decode"}, res.stderr
    assert ms["compile/warm-up"] >= 2000
    assert ms["prompt"] < 2000


def test_after_the_warm_up_generation_compiles_nothing(model):
    """In a fresh process (no kernel in memory yet), warm_up() compiles, or loads from numba's cache, every kernel
    that prompt, decode and --dump-logits decode then call: numba takes its compiler lock for either (the specialized
    drivers and nested kernels included), and it must not take it inside the timed generation."""
    script = f"""
from numba.core import event
from strata_nb.api import load
from strata_nb.runtime.sampler import SamplerConfig

class Count(event.Listener):
    n = 0
    def on_start(self, ev):
        Count.n += 1
    def on_end(self, ev):
        pass

event.register("numba:compiler_lock", Count())
for experts in ("mmap", "tiered"):
    eng = load({str(model)!r}, device="cpu", n_ctx=64, experts=experts)
    eng.warm_up()
    n = Count.n
    assert n > 0
    eng.generate([5, 6, 7, 8, 9], 4, SamplerConfig(temperature=0.7, seed=1))
    eng.generate([5, 6], 3, SamplerConfig(), keep_logits=True)
    eng.logits([1, 2, 3])
    assert Count.n == n, (experts, n, Count.n)
    eng.close()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_only_the_files_quant_types_compile(tmp_path):
    """A file of one weight type compiles drivers and row kernels of its own types only (a fresh numba cache, so
    every kernel a driver calls is compiled here and shows its signatures)."""
    path = tmp_path / "q8.gguf"
    write_synthetic(path, "tiny", arch="qwen3moe", quant="Q8_0", seed=1)
    script = f"""
from strata_nb.api import load, open_model
from strata_nb.cpu_kernels import dot_float, dot_kquant, dot_legacy, matmul, qtypes
from strata_nb.runtime.sampler import SamplerConfig

g, _ = open_model({str(path)!r})
used = {{int(t.qtype) for t in g.tensors.values()}}
assert qtypes.Q8_0 in used and not used & {{qtypes.Q4_K, qtypes.Q6_K, qtypes.Q4_0}}, used
eng = load({str(path)!r}, device="cpu", n_ctx=64)
eng.generate([5, 6, 7, 8, 9], 3, SamplerConfig())
keys = [k for f in (matmul.matmul_for, matmul.moe_matmul_for, matmul.moe_ffn_for, matmul.dequant_rows_for)
        for k in f.built]
assert keys and all(q in used for k in keys for q in k if type(q) is int), (used, keys)
compiled = set()
for q in qtypes.SUPPORTED:
    t = qtypes.name(q).lower()
    for name in (f"dequant_{{t}}", f"dot_f32_{{t}}", f"dot_q8_{{t}}", f"dot_q8_{{t}}_multi", f"dot_q8_{{t}}_rows"):
        if any(getattr(getattr(m, name, None), "signatures", None) for m in (dot_float, dot_kquant, dot_legacy)):
            compiled.add(q)
assert qtypes.Q8_0 in compiled and compiled <= used, (used, compiled)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "STRATA_NB_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
