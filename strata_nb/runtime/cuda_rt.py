"""The few CUDA runtime pieces numba.cuda does not wrap the way the hybrid engine needs them.

- cuda_status(): is there a usable GPU (or the simulator), and if not, why (numba-cuda missing, no GPU, driver).
- Graph: a sequence of kernel launches captured once as a CUDA graph (stream capture through the driver API, as
  gpu-machine.md measured: ~1 us per replayed kernel against ~33 us per launch from Python) and replayed. Under
  numba's simulator there are no graphs: the recorded launches are replayed as calls, which is the same
  computation, so the tests exercise the same code path.
- gate(): a stream-ordered wait on a word of mapped host memory that the host sets (the GPU's front end polls it;
  no kernel spins), so work queued behind it starts when the host says, without a launch from the host.
- host_view(): the numpy view of a mapped (zero-copy) array; event_done(): a non-blocking event query;
  wait_event(): a bounded host wait on one.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
from numba import config

from strata_nb.errors import StrataError

try:
    from numba import cuda
except ImportError:  # a numba without its built-in CUDA target and without numba-cuda
    cuda = None

SIM = bool(config.ENABLE_CUDASIM)
NO_NUMBA_CUDA = "numba-cuda is not installed: pip install 'strata-nb[cuda]' for the hybrid GPU engine"


def cuda_status() -> tuple[bool, str]:
    """(usable, a line saying what was found): the simulator, a GPU, or why there is none (numba-cuda missing,
    no GPU, a broken driver)."""
    if cuda is None:
        return False, NO_NUMBA_CUDA
    if SIM:
        return True, "numba CUDA simulator"
    # numba's own deprecated CUDA target is not what the engine is built and tested on (graphs need cuda-bindings)
    if getattr(cuda, "implementation", None) != "NVIDIA":
        return False, NO_NUMBA_CUDA
    try:
        if not cuda.is_available():
            return False, "numba-cuda found no CUDA GPU: no device, or no NVIDIA driver"
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return True, f"CUDA device {dev.id}: {name} (compute {dev.compute_capability[0]}.{dev.compute_capability[1]})"
    except Exception as e:  # a broken driver install is "no GPU", said plainly
        return False, f"CUDA not usable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    if SIM:
        return 8 << 30, 8 << 30  # the simulator's "device" is host memory; the plan needs some number
    free, total = cuda.current_context().get_memory_info()
    return int(free), int(total)


def host_view(mapped) -> np.ndarray:
    """The host numpy view of a cuda.mapped_array (the simulator wraps it)."""
    return mapped if isinstance(mapped, np.ndarray) else mapped._ary


def event_done(ev) -> bool:
    """Has the work before ev.record() finished? (The simulator runs everything synchronously.)"""
    return True if SIM else bool(ev.query())


def wait_event(ev, timeout_s: float, what: str) -> None:
    """Wait on the host until the work before ev.record() has finished: polled, bounded by timeout_s (an error
    naming what was awaited, never a hang)."""
    deadline = time.perf_counter() + timeout_s
    while not event_done(ev):
        if time.perf_counter() > deadline:
            raise StrataError(f"{what} did not finish within {timeout_s:g} s")
        time.sleep(0.0002)


def sync_event():
    """An event for ordering streams (no timing: cheaper to record)."""
    return cuda.event() if SIM else cuda.event(timing=False)


def stream_wait(stream, ev) -> None:
    """Make stream wait (on the device, not the host) for ev."""
    if not SIM:
        ev.wait(stream)


def device_pointer(mapped, index: int = 0) -> int:
    """The device address of element `index` of a 1-D device or mapped array."""
    return int(mapped.__cuda_array_interface__["data"][0]) + index * mapped.dtype.itemsize


def gate(stream, addr: int) -> None:
    """Enqueue on stream: wait (in the GPU's front end, no kernel spinning) until the uint32 at addr (mapped host
    memory) is 1, then set it back to 0. Captured into a graph like a kernel. The host opens the gate by writing
    1 there; everything enqueued after it waits, with no launch from the host in between."""
    from cuda.bindings import driver as drv

    h, a = stream.handle, drv.CUdeviceptr(addr)
    _check(drv.cuStreamWaitValue32(h, a, 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value),
           "stream wait on a mapped word")
    _check(drv.cuStreamWriteValue32(h, a, 0, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT.value),
           "stream write to a mapped word")


def _check(res, what: str):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise StrataError(f"CUDA {what} failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


class Graph:
    """Launches recorded by fn(stream), captured into one CUDA graph and replayed with launch(stream).

    fn must only enqueue work on the stream it is given (the cuda_kernels launch helpers do exactly that) and must
    read every per-token value from device memory, since a replay repeats the captured arguments.
    """

    def __init__(self, fn: Callable[[object], None], stream, name: str):
        self.name = name
        self._fn = fn
        self._exec = None
        if SIM:
            return
        from cuda.bindings import driver as drv

        self._drv = drv
        h = stream.handle
        _check(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
               f"begin capture of {name}")
        try:
            fn(stream)
        except BaseException:
            drv.cuStreamEndCapture(h)
            raise
        graph = _check(drv.cuStreamEndCapture(h), f"end capture of {name}")
        self._graph = graph
        self._exec = _check(drv.cuGraphInstantiate(graph, 0), f"instantiate {name}")
        _check(drv.cuGraphUpload(self._exec, h), f"upload {name}")

    def launch(self, stream) -> None:
        if self._exec is None:
            self._fn(stream)
        else:
            _check(self._drv.cuGraphLaunch(self._exec, stream.handle), f"launch {self.name}")

    def close(self) -> None:
        if self._exec is not None:
            self._drv.cuGraphExecDestroy(self._exec)
            self._drv.cuGraphDestroy(self._graph)
            self._exec = None
