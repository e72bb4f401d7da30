"""Shared helpers for the tokenizer and chat tests: llama.cpp's vocabulary files and llama.cpp itself.

The vocabularies (ggml-vocab-*.gguf with llama.cpp's .inp/.out test vectors) ship in llama.cpp's models/
folder, e.g. inside the llama-cpp-python sdist; STRATA_VOCAB_DIR points at it.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

VOCAB_DIR = Path(os.environ.get("STRATA_VOCAB_DIR", "/tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/models"))


def vocab_path(name: str) -> Path:
    """models/ggml-vocab-NAME.gguf, or skip the test when the folder is not there."""
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp vocabulary {path} not found (set STRATA_VOCAB_DIR to llama.cpp's models/ folder)")
    return path


def templates_dir() -> Path:
    path = VOCAB_DIR / "templates"
    if not path.is_dir():
        pytest.skip(f"llama.cpp chat templates {path} not found (set STRATA_VOCAB_DIR to llama.cpp's models/ folder)")
    return path


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test vectors, split exactly as tests/test-tokenizer-0.cpp splits them."""
    path = vocab_path(name)
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs = raw.split(sep)
    if inputs and inputs[-1] == "":  # the C++ reader stops at the end instead of yielding an empty case
        inputs.pop()
    outputs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")[:len(inputs)]
    assert len(outputs) == len(inputs), f"{path}: {len(inputs)} inputs but {len(outputs)} outputs"
    return [(s, [int(x) for x in o.split()]) for s, o in zip(inputs, outputs)]


class LlamaCppVocab:
    """llama.cpp's tokenizer through llama-cpp-python's low-level API, vocabulary only."""

    _log_cb = None

    def __init__(self, path: Path):
        llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (oracle tests)")
        self.lib = llama_cpp
        if LlamaCppVocab._log_cb is None:  # silence the loader; keep the callback alive for the process
            LlamaCppVocab._log_cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
                lambda level, text, data: None)
            llama_cpp.llama_log_set(LlamaCppVocab._log_cb, None)
            llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        b = text.encode("utf-8")
        cap = len(b) + 8
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, b, len(b), buf, cap, add_special, parse_special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, ids: list[int], special: bool) -> bytes:
        arr = (self.lib.llama_token * max(1, len(ids)))(*ids)
        cap = 64 * len(ids) + 64
        buf = ctypes.create_string_buffer(cap)
        n = self.lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, False, special)
        assert n >= 0
        return buf.raw[:n]

    def piece(self, tid: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(4096)
        n = self.lib.llama_token_to_piece(self.vocab, tid, buf, 4096, 0, special)
        assert n >= 0
        return buf.raw[:n]

    def is_eog(self, tid: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, tid))

    def bos(self) -> int:
        return self.lib.llama_vocab_bos(self.vocab)

    def eos(self) -> int:
        return self.lib.llama_vocab_eos(self.vocab)

    def eot(self) -> int:
        return self.lib.llama_vocab_eot(self.vocab)

    def close(self) -> None:
        self.lib.llama_model_free(self.model)
