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


def _thread_safe_simulator() -> None:
    """numba's CUDA simulator runs a block's threads as Python threads, and two of its mechanisms race there.

    1. On every device-function call it swaps the `cuda` global of the function's module for its fake module,
       restoring it on return: the first thread to return restores the real module while another still reads
       `cuda.threadIdx` (seen in CI: "module 'numba.cuda' has no attribute 'threadIdx'" in block_sum). Counting
       the threads inside each module keeps the fake in place until the last one leaves.
    2. cuda.shared.array looks up the block's allocation by call site and creates it when absent, unlocked: two
       threads that both miss get separate "shared" arrays, and one reads the other's never-written copy (seen as
       a garbage index in the sampler's block_max). A lock around the lookup makes the first creation win."""
    import sys
    import threading
    from contextlib import contextmanager

    import numpy as np
    from numba import config
    from numba.core import types
    from numba.np import numpy_support

    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi

    lock = threading.Lock()  # guards both shims' bookkeeping
    inside: dict[int, list] = {}  # id(module globals) -> [threads inside, original bindings]

    @contextmanager
    def swapped_cuda_module(fn, fake_cuda_module):
        from numba import cuda

        glob = fn.__globals__
        with lock:
            st = inside.get(id(glob))
            if st is None:
                orig = {k: v for k, v in glob.items() if v is cuda}
                glob.update({k: fake_cuda_module for k in orig})
                st = inside[id(glob)] = [0, orig]
            st[0] += 1
        try:
            yield
        finally:
            with lock:
                st[0] -= 1
                if st[0] == 0:
                    glob.update(st[1])
                    del inside[id(glob)]

    sim_kernel.swapped_cuda_module = swapped_cuda_module

    alloc = kernelapi.FakeCUDAShared.array

    def shared_array(self, shape, dtype):
        if shape == 0:  # dynamic shared memory: one buffer, no lookup
            return alloc(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)  # the key the simulator uses: the calling line
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = shared_array


_thread_safe_simulator()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("CI"):
        return
    missing = [m for m in ("llama_cpp", "transformers", "torch", "accelerate") if importlib.util.find_spec(m) is None]
    vocab = Path(os.environ.get("STRATA_VOCAB_DIR", ""))
    if not (vocab / "ggml-vocab-qwen2.gguf").is_file() or not (vocab / "templates").is_dir():
        missing.append(f"llama.cpp vocabularies and templates in STRATA_VOCAB_DIR={vocab}")
    if missing:
        raise pytest.UsageError("CI run without the test oracles: " + ", ".join(missing) + " (tests/run.sh installs them)")
