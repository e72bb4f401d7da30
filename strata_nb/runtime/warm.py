"""The first run's compile, spread over processes: helper processes compile the routed-expert drivers (the
largest kernels: ~7 s each on the demo's development VM, of ~30 s in all) into numba's on-disk cache while the
engine's process compiles everything else; the engine then loads them from the cache.

numba compiles one function at a time per process (a global compiler lock), so this is the only way a cold start
uses more than one core. A helper that fails or is late costs nothing but the gain: the engine compiles what the
cache does not hold. Run as `python -m strata_nb.runtime.warm MODEL FAST LAYER[,LAYER...]`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from strata_nb.errors import StrataError

JOIN_S = 600.0  # a helper still compiling after this long is stopped (the engine compiles its kernels itself)


def helpers_wanted(n_kernels: int) -> int:
    """Helper processes for n routed-expert drivers: one each, leaving one core to the engine's own compile."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(n_kernels, cores - 1))


def start(path: str | os.PathLike, fast: bool, layers: list[int]) -> list[subprocess.Popen]:
    """Helpers compiling the routed-expert drivers of `layers` (one layer per driver), spread over
    helpers_wanted() processes; none on a single core, or where a process cannot be started (the warm-up then
    compiles everything itself)."""
    n = helpers_wanted(len(layers))
    procs: list[subprocess.Popen] = []
    for i in range(n):
        mine = layers[i::n]
        err = tempfile.TemporaryFile()  # not a pipe: a helper's warnings must never block it while nobody reads
        try:
            p = subprocess.Popen([sys.executable, "-m", "strata_nb.runtime.warm", str(path), str(int(fast)),
                                  ",".join(map(str, mine))],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        except OSError:
            err.close()
            join(procs, 0.0)
            return []
        p.err_file = err
        procs.append(p)
    return procs


def join(procs: list[subprocess.Popen], timeout_s: float = JOIN_S) -> list[str]:
    """Wait for the helpers (bounded: one still running at the deadline is killed); returns one line per helper
    that failed (the engine then compiles those kernels itself)."""
    deadline = time.monotonic() + timeout_s
    failed = []
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            failed.append(f"compile helper {p.pid} still running after {timeout_s:g} s; stopped")
        else:
            if p.returncode != 0:
                p.err_file.seek(0)
                tail = p.err_file.read().decode(errors="replace").strip().splitlines()[-1:]
                failed.append(f"compile helper {p.pid} exited with {p.returncode}: {' '.join(tail)}")
        p.err_file.close()
    return failed


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python -m strata_nb.runtime.warm MODEL FAST LAYER[,LAYER...]", file=sys.stderr)
        return 2
    from strata_nb.api import open_model
    from strata_nb.experts.source import open_experts
    from strata_nb.experts.store import MappedStore
    from strata_nb.model.weights import bind_weights
    from strata_nb.runtime.cpu_backend import CPUBackend

    try:
        g, spec = open_model(argv[1])
        backend = CPUBackend(spec, bind_weights(g, spec), MappedStore(open_experts(g), None), fast=argv[2] == "1")
        backend.compile_routed([int(v) for v in argv[3].split(",")])
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
