"""Test-session checks: under CI every oracle must be present, so no comparison is silently skipped."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Without a GPU the cuda kernels run in numba's CUDA simulator (tiny shapes only). Numba reads this when it is
# first imported, so it is set here, before any test module imports it; on a GPU machine the real device is used.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("CI"):
        return
    missing = [m for m in ("llama_cpp", "transformers", "torch", "accelerate") if importlib.util.find_spec(m) is None]
    vocab = Path(os.environ.get("STRATA_VOCAB_DIR", ""))
    if not (vocab / "ggml-vocab-qwen2.gguf").is_file() or not (vocab / "templates").is_dir():
        missing.append(f"llama.cpp vocabularies and templates in STRATA_VOCAB_DIR={vocab}")
    if missing:
        raise pytest.UsageError("CI run without the test oracles: " + ", ".join(missing) + " (tests/run.sh installs them)")
