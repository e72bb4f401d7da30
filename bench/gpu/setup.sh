# Source at the start of every device call, from the repository root:   . bench/gpu/setup.sh
#
# The GPU machine is bare and offline: this installs the carried wheels (.gpu/*.whl: numpy 2.4.x, which
# numba-cuda 0.30.4 needs, and gguf) into /tmp/site, makes this checkout importable as `strata_nb` from any
# working directory, puts a `strata-nb` command on PATH, points numba's caches under /tmp (restoring a carried
# cache, .gpu/numba-cache.tar.xz, when there is one), and prints what it found. Takes a few seconds; running it
# again on a warm machine skips what is already done.
# Defines ts (timestamped echo) for the caller. Returns non-zero (without exiting the caller's shell) on failure.

GPU_T0=${GPU_T0:-$(date +%s)}
export GPU_T0
ts() { printf '[%s +%4ss] %s\n' "$(date +%H:%M:%S)" "$(($(date +%s) - GPU_T0))" "$*"; }

_gpu_setup() {
    local repo site wheels stamp d
    repo=$(pwd)
    if [ ! -f "$repo/pyproject.toml" ] || [ ! -d "$repo/strata_nb" ]; then
        echo "setup.sh: source me from the strata-nb repository root (not $repo)" >&2
        return 1
    fi
    site=/tmp/site
    wheels=$(ls "$repo"/.gpu/*.whl 2>/dev/null)
    if [ -z "$wheels" ]; then
        echo "setup.sh: no wheels in .gpu/ (name .gpu in the call's carry list)" >&2
        return 1
    fi
    stamp=$(basename -a $wheels | sort | tr '\n' ' ')
    if [ "$(cat "$site/.wheels" 2>/dev/null)" != "$stamp" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            $wheels || { echo "setup.sh: wheel install failed" >&2; return 1; }
        echo "$stamp" >"$site/.wheels"
    fi

    # The package maps cli/, cpu_kernels/ and cuda_kernels/ to strata_nb.* (pyproject package-dir). Links inside
    # this copy of the tree give the same layout from the checkout itself, so `python3 -m pytest` (which puts the
    # working directory first on sys.path) and scripts import the code under test, not an installed copy.
    for d in cli cpu_kernels cuda_kernels; do
        if [ -e "$repo/strata_nb/$d" ] && [ ! -L "$repo/strata_nb/$d" ]; then
            echo "setup.sh: strata_nb/$d exists and is not a link; refusing to replace it" >&2
            return 1
        fi
        ln -sfn "../$d" "$repo/strata_nb/$d"
    done

    # numba's on-disk cache is valid while a source file's (mtime, size) stamp matches. The tree is copied afresh
    # for each call, so give every source file an mtime derived from its content: a cache carried from an earlier
    # call is reused for unchanged files and is stale (recompiled) for edited ones.
    python3 - "$repo" <<'EOF' || return 1
import hashlib, os, sys
root = sys.argv[1]
for top in ("strata_nb", "cli", "cpu_kernels", "cuda_kernels", "tests", "bench"):
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                with open(p, "rb") as fh:
                    h = int(hashlib.sha256(fh.read()).hexdigest()[:7], 16)
                os.utime(p, (1.5e9 + h, 1.5e9 + h))
EOF

    export STRATA_NB_CACHE=/tmp/strata-cache   # strata_nb sets NUMBA_CACHE_DIR under it (per kernel-source hash)
    export NUMBA_CACHE_DIR=/tmp/strata-cache/numba-other   # for processes that import numba before strata_nb
    if [ -f "$repo/.gpu/numba-cache.tar.xz" ] && [ ! -d /tmp/strata-cache/numba ]; then
        mkdir -p /tmp/strata-cache && tar -xJf "$repo/.gpu/numba-cache.tar.xz" -C /tmp/strata-cache \
            && echo "setup.sh: restored the carried numba cache ($(du -sh /tmp/strata-cache | cut -f1))"
    fi

    mkdir -p "$site/bin"
    printf '#!/bin/sh\nexec python3 -m strata_nb.cli.main "$@"\n' >"$site/bin/strata-nb"
    chmod +x "$site/bin/strata-nb"
    export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"
    export PYTHONUNBUFFERED=1
    export STRATA_REPO="$repo"

    ts "setup: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM seen now, $(df -h /tmp | awk 'NR==2{print $4}') free on /tmp"
    nvidia-smi -L || echo "setup.sh: nvidia-smi failed" >&2
    # The versions actually imported, and one real kernel compile: numba-cuda with the wrong numpy fails here.
    python3 - <<'EOF' || { echo "setup.sh: python check failed" >&2; return 1; }
import sys, time
import numpy, numba, llvmlite, gguf
import strata_nb, strata_nb.cli.main, strata_nb.cpu_kernels.ops  # noqa: F401
from importlib.metadata import version
def v(name):
    try:
        return version(name)
    except Exception:
        return "-"
print(f"python {sys.version.split()[0]}; numpy {numpy.__version__} ({numpy.__file__}); numba {numba.__version__}; "
      f"numba-cuda {v('numba-cuda')}; llvmlite {llvmlite.__version__}; gguf {v('gguf')}; "
      f"cuda-bindings {v('cuda-bindings')}; strata_nb from {strata_nb.__file__}")
from numba import cuda
if cuda.is_available():
    t0 = time.perf_counter()
    @cuda.jit
    def _k(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = i * 2
    d = cuda.to_device(numpy.zeros(256, numpy.int32))
    _k[1, 256](d)
    assert (d.copy_to_host() == numpy.arange(256) * 2).all()
    name = getattr(cuda.get_current_device(), "name", "the CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else name
    print(f"numba.cuda: {name}, test kernel compiled and ran in {time.perf_counter() - t0:.2f} s")
else:
    print("numba.cuda: no GPU visible")
EOF
    command -v strata-nb >/dev/null || { echo "setup.sh: strata-nb is not on PATH" >&2; return 1; }
}

_gpu_setup
