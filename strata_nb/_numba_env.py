"""Numba process settings that must be in place before numba is first imported.

- NUMBA_CACHE_DIR is versioned by a hash of the kernel sources: numba's cache key covers only a kernel's own
  file, so an edited intrinsic in another module would otherwise leave a stale cached kernel in use.
- The omp threading layer: 1-2 us per parallel region (workqueue costs ~130 us and is not thread-safe).
- OMP_WAIT_POLICY=active keeps workers spinning between regions (wake-up after idle costs up to ms here), but
  only for GOMP_SPINCOUNT iterations (~0.1 ms), then they sleep: spinning forever (active's default) took a core
  from the expert reader threads and the token thread whenever it waited for the SSD (prompt 5x, decode 6x
  slower with the tiered store on 2 cores).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

_KERNEL_DIRS = ("cpu_kernels", "cuda_kernels")


def _kernel_source_hash() -> str:
    pkg = Path(__file__).resolve().parent
    h = hashlib.sha256()
    # Kernel folders live beside the package in a checkout and under it once installed.
    for root in (pkg.parent, pkg):
        for name in _KERNEL_DIRS:
            d = root / name
            if d.is_dir():
                for f in sorted(d.glob("*.py")):
                    h.update(f.name.encode())
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("STRATA_NB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "strata-nb")
    return Path(base)


def configure() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "active")
    os.environ.setdefault("GOMP_SPINCOUNT", "200000")
    os.environ.setdefault("NUMBA_THREADING_LAYER", "omp")
    cache_dir = str(cache_root() / "numba" / _kernel_source_hash())
    os.environ["NUMBA_CACHE_DIR"] = cache_dir
    if "numba" in sys.modules:  # imported earlier by someone else: set the live config too
        import numba

        numba.config.CACHE_DIR = cache_dir


def kernels_cached() -> bool:
    """Whether compiled kernels for these sources are in the cache at all (a first run compiles for ~30 s)."""
    d = os.environ.get("NUMBA_CACHE_DIR")
    return bool(d) and any(Path(d).rglob("*matmul*.nbi"))
