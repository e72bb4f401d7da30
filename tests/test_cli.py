"""The command line end to end: generation, stats, logits dump, pack, info, synth, and every refusal."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from strata_nb.api import load
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


def test_prompt_longer_than_context(model):
    assert_refused(run("generate", "-m", model, "--tokens", " ".join(["3"] * 40), "--ctx", "32"), "context")


def test_token_out_of_range(model):
    assert_refused(run("generate", "-m", model, "--tokens", "1 999999"), "999999", "out of range")


def test_empty_prompt(model):
    assert_refused(run("generate", "-m", model, "-p", ""), "empty prompt")


def test_bad_sampler_option(model):
    assert_refused(run("generate", "-m", model, "-p", "hi", "--temp", "-1"), "temperature")
