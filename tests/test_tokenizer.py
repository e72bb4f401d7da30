"""The GGUF tokenizer against llama.cpp: its own test vectors, and llama.cpp run on the same vocabulary files."""
from __future__ import annotations

import random
import time

import pytest

from conftest_vocab import LlamaCppVocab, read_cases, vocab_path
from strata_nb.errors import ModelFormatError, StrataError
from strata_nb.model.gguf_file import GGUFFile
from strata_nb.model.tokenizer import StreamDecoder, Tokenizer

# qwen2, llama-bpe and llama-spm are the three vocabulary kinds the runtime targets first; qwen35, gpt-2 and
# mpt (olmo's pre-tokenizer) cover the other pre-tokenizers whose llama.cpp vectors ship alongside.
VOCABS = ["qwen2", "llama-bpe", "llama-spm", "qwen35", "gpt-2", "mpt"]
ORACLE_VOCABS = ["qwen2", "llama-bpe", "llama-spm"]

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How's it going? I'm fine , thanks . Isn 't it ?",
    "it 's don 't they 're we 've I 'm you 'll he 'd ' quoted ' x",
    "  leading spaces and trailing   ",
    "中文测试：你好，世界！这是一个句子。",
    "日本語のテキストとカタカナ、ひらがな",
    "한국어 텍스트입니다",
    "emoji 🦙🚀 family 👩‍👩‍👧‍👦 flags 🇺🇸🇯🇵 skin 👍🏽",
    "combining: e\u0301 a\u0308 n\u0303 Z̤͔ͧ̑̓ä͖̭̈̇ \u0915\u094d\u0937",
    "Ünïcödé ÀÉÎÕÜ Straße Ελληνικά русский עברית العربية हिन्दी",
    "def f(x):\n    return x**2  # comment\n\tif x:\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 3.5f; }",
    "digits 1234567890 3.14159 1,000,000 12345678901234567890 007",
    "\n\n\n \t \n  \t\t  x\r\n\r\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s> [INST] hi [/INST] answer </s><s>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhey<|eot_id|>",
    "<|endoftext|><|im_end|>x<|im_start|>",
    "zero\u200bwidth\u200djoin\ufeffbom",
    "\x00\x01 control \x7f chars",
    "",
]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_gguf(vocab_path(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def oracles():
    cache: dict[str, LlamaCppVocab] = {}

    def get(name: str) -> LlamaCppVocab:
        if name not in cache:
            cache[name] = LlamaCppVocab(vocab_path(name))
        return cache[name]

    yield get
    for o in cache.values():
        o.close()


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(name, tokenizers):
    tok = tokenizers(name)
    cases = read_cases(name)
    assert len(cases) >= 40
    for text, expected in cases:
        # test-tokenizer-0.cpp tokenizes with add_special=false, parse_special=false
        assert tok.encode(text, add_special=False, parse_special=False) == expected, repr(text)


def test_build_time_qwen2():
    path = vocab_path("qwen2")
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(path)
    elapsed = time.perf_counter() - t0
    print(f"qwen2 tokenizer ({tok.vocab_size} tokens) built from the file in {elapsed:.2f} s")
    assert tok.vocab_size == 151936
    assert elapsed < 6.0  # ~1.4 s measured on 2 shared cores; gguf.GGUFReader alone takes ~9 s on this file


def test_from_open_file_equals_from_path(tokenizers):
    path = vocab_path("llama-spm")
    from_reader = Tokenizer.from_gguf(GGUFFile(path))
    from_path = tokenizers("llama-spm")
    assert from_reader.eog_ids == from_path.eog_ids and from_reader.add_bos == from_path.add_bos
    for text in TEXTS:
        assert from_reader.encode(text) == from_path.encode(text)


@pytest.mark.parametrize("name", ORACLE_VOCABS)
def test_encode_matches_llama_cpp(name, tokenizers, oracles):
    tok, lc = tokenizers(name), oracles(name)
    for text in TEXTS:
        for add_special in (True, False):
            for parse_special in (True, False):
                assert tok.encode(text, add_special, parse_special) == lc.tokenize(text, add_special, parse_special), \
                    (repr(text), add_special, parse_special)


@pytest.mark.parametrize("name", ORACLE_VOCABS)
def test_special_ids_and_eog_match_llama_cpp(name, tokenizers, oracles):
    tok, lc = tokenizers(name), oracles(name)
    assert (tok.bos_id, tok.eos_id, tok.eot_id) == (lc.bos(), lc.eos(), lc.eot())
    assert tok.eog_ids == {i for i in range(tok.vocab_size) if lc.is_eog(i)}
    assert tok.eos_id in tok.eog_ids


@pytest.mark.parametrize("name", ORACLE_VOCABS)
def test_pieces_match_llama_cpp(name, tokenizers, oracles):
    tok, lc = tokenizers(name), oracles(name)
    for tid in range(tok.vocab_size):
        assert tok.piece(tid, special=True) == lc.piece(tid, True) == tok.token_bytes(tid), tid
        assert tok.piece(tid, special=False) == lc.piece(tid, False), tid


def _random_ids(tok: Tokenizer, rng: random.Random, n_seq: int) -> list[list[int]]:
    """Random id sequences, mostly short tokens, so that spaces, punctuation and split characters meet."""
    short = [i for i in range(0, tok.vocab_size, 7) if len(tok.token_bytes(i)) <= 2]
    return [[rng.choice(short) if rng.random() < 0.7 else rng.randrange(tok.vocab_size)
             for _ in range(rng.randrange(1, 40))] for _ in range(n_seq)]


@pytest.mark.parametrize("name", ORACLE_VOCABS)
def test_decode_matches_llama_cpp(name, tokenizers, oracles):
    tok, lc = tokenizers(name), oracles(name)
    seqs = [lc.tokenize(t, True, True) for t in TEXTS] + _random_ids(tok, random.Random(0), 200)
    for ids in seqs:
        for special in (True, False):
            expected = lc.detokenize(ids, special)
            assert tok.detokenize(ids, special) == expected, (ids, special)
            assert tok.decode(ids, special) == expected.decode("utf-8", errors="replace")


def _stream(tok: Tokenizer, ids: list[int], special: bool = False) -> list[str]:
    dec = StreamDecoder(tok, special=special)
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("name", ORACLE_VOCABS)
def test_stream_decoder_equals_decode(name, tokenizers):
    tok = tokenizers(name)
    for text in TEXTS:
        ids = tok.encode(text)
        for special in (True, False):
            full = tok.decode(ids, special)
            chunks = _stream(tok, ids, special)
            assert "".join(chunks) == full, repr(text)
            if "\ufffd" not in full:  # a split character would have shown up as U+FFFD in some chunk
                assert all("\ufffd" not in c for c in chunks), (repr(text), chunks)
    for ids in _random_ids(tok, random.Random(1), 200):
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_stream_decoder_clean_spaces_fuzz(tokenizers):
    """llama-bpe's detokenizer drops spaces before , . ? ! and 's 'm 're 've: the stream must agree."""
    tok = tokenizers("llama-bpe")
    alphabet = [" ", "'", "s", "m", "r", "e", "v", "t", ",", ".", "?", "!", "  ", "x", "é", " '", "'s"]
    ids = [tok.encode(a, add_special=False) for a in alphabet]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]
    rng = random.Random(2)
    for _ in range(3000):
        seq = [rng.choice(ids) for _ in range(rng.randrange(1, 16))]
        assert "".join(_stream(tok, seq)) == tok.decode(seq), [tok.token_bytes(i) for i in seq]


def test_stream_decoder_is_prompt(tokenizers):
    """Prose comes out as it is generated: only a space whose clean-up is still open may wait."""
    tok = tokenizers("llama-bpe")
    text = "The quick brown fox jumps over the lazy dog, then naps."
    ids = tok.encode(text, add_special=False)
    dec = StreamDecoder(tok)
    out = b""
    for k, tid in enumerate(ids, 1):
        out += dec.push(tid).encode()
        so_far = tok.detokenize(ids[:k])
        assert text.encode().startswith(out) and len(so_far) - len(out) <= 1
    assert (out + dec.flush().encode()).decode() == text


def test_stream_decoder_utf8_across_tokens(tokenizers):
    """Characters spread over several byte tokens come out whole, once complete."""
    tok = tokenizers("llama-spm")
    text = "🦙x"
    ids = tok.encode(text, add_special=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert len(pieces) > 2 and b"".join(pieces) == b" " + text.encode()  # <0xF0><0x9F><0xA6><0x99> then x
    dec = StreamDecoder(tok)
    chunks = [dec.push(i) for i in ids]
    assert chunks[:-2] == [""] * (len(chunks) - 2) and chunks[-2] == "🦙" and chunks[-1] == "x"
    assert dec.flush() == ""


def test_stream_decoder_continuation_keeps_space(tokenizers):
    tok = tokenizers("llama-spm")
    ids = tok.encode(" world", add_special=False, parse_special=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    dec = StreamDecoder(tok, lstrip_first=False)
    assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == b"".join(tok.piece(i) for i in ids).decode()


def test_token_bytes(tokenizers):
    qwen, spm = tokenizers("qwen2"), tokenizers("llama-spm")
    assert qwen.token_bytes(qwen.token_to_id("Ġworld")) == b" world"
    assert qwen.token_bytes(qwen.token_to_id("<|im_end|>")) == b"<|im_end|>"
    assert qwen.piece(qwen.token_to_id("<|im_end|>")) == b""
    assert spm.token_bytes(spm.token_to_id("▁Hello")) == b" Hello"
    assert spm.token_bytes(spm.token_to_id("<0x0A>")) == b"\n"
    assert spm.token_bytes(spm.token_to_id("<0xE4>")) == b"\xe4"


def test_bos_and_special_parsing(tokenizers):
    qwen, llama3, spm = tokenizers("qwen2"), tokenizers("llama-bpe"), tokenizers("llama-spm")
    assert not qwen.add_bos and llama3.add_bos and spm.add_bos
    im_start = qwen.token_to_id("<|im_start|>")
    assert qwen.encode("<|im_start|>user")[0] == im_start
    assert im_start not in qwen.encode("<|im_start|>user", parse_special=False)
    assert llama3.encode("hi")[0] == llama3.bos_id and llama3.encode("hi", add_special=False)[0] != llama3.bos_id
    assert spm.encode("") == [spm.bos_id] and spm.encode("", add_special=False) == []
    assert qwen.is_eog(qwen.token_to_id("<|im_end|>")) and qwen.is_eog(qwen.token_to_id("<|endoftext|>"))
    assert not qwen.is_eog(im_start)


def test_bad_ids_raise(tokenizers):
    tok = tokenizers("llama-spm")
    with pytest.raises(StrataError, match="out of range"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(StrataError, match="out of range"):
        tok.token_bytes(-1)


def _write_vocab(path, model: str, pre: str | None = None) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_vocab_type(tmp_path):
    path = tmp_path / "bert.gguf"
    _write_vocab(path, "bert")
    with pytest.raises(ModelFormatError, match=r"'bert'.*gpt2, llama"):
        Tokenizer.from_gguf(path)


def test_unsupported_pre_tokenizer(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_vocab(path, "gpt2", "no-such-pre")
    with pytest.raises(ModelFormatError, match="no-such-pre"):
        Tokenizer.from_gguf(path)


def test_small_written_vocab_roundtrip(tmp_path):
    """A vocabulary written with gguf's writer: merges apply, decode inverts encode."""
    path = tmp_path / "tiny.gguf"
    _write_vocab(path, "gpt2", "gpt-2")
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("abab") == [2, 2] and tok.encode("ba") == [1, 0]
    assert tok.decode([2, 0, 1]) == "abab"


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(path)
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(empty)


def test_truncated_gguf(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(vocab_path("llama-spm").read_bytes()[:100_000])
    with pytest.raises(ModelFormatError, match="truncated"):
        Tokenizer.from_gguf(truncated)

