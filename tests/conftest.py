"""Test-session checks: under CI every oracle must be present, so no comparison is silently skipped."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("CI"):
        return
    missing = [m for m in ("llama_cpp", "transformers", "torch", "accelerate") if importlib.util.find_spec(m) is None]
    vocab = Path(os.environ.get("STRATA_VOCAB_DIR", ""))
    if not (vocab / "ggml-vocab-qwen2.gguf").is_file() or not (vocab / "templates").is_dir():
        missing.append(f"llama.cpp vocabularies and templates in STRATA_VOCAB_DIR={vocab}")
    if missing:
        raise pytest.UsageError("CI run without the test oracles: " + ", ".join(missing) + " (tests/run.sh installs them)")
