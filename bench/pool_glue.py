"""The hybrid engine's CPU expert pool at T=1 without a GPU: the pool call and its kernel, timed apart.

    python bench/pool_glue.py [-m MODEL] [--threads 2] [--calls 400]

Loads MODEL (default: a 2-layer synthetic Qwen3-30B-A3B, Q4_K_M, written to /tmp on first use) as the hybrid
engine in numba's CUDA simulator (the pool itself is plain CPU code), with 8 VRAM slots per MoE layer filled with
experts 0-7 (their admission done before timing). Each call publishes one token's routing into the mailbox as the GPU would, 8 - m choices held in
VRAM and m missed ones drawn from the other experts (a fresh draw per call, as in decode), then runs
GPUBackend._cpu_pool on the device thread. Prints medians per number of misses: the pool call, the routed-expert
kernel's call inside it (which since the fused pool also splits the routing and quantizes x), and the difference
(the host glue). The machine has few cores and is shared: --threads 1 --clock cpu measures the glue without other
processes' load; kernel times with more threads want a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
import numpy as np  # noqa: E402

from strata_nb.api import Engine, gpu_fixed_bytes, open_model  # noqa: E402
from strata_nb.experts.source import open_experts  # noqa: E402
from strata_nb.experts.vram_cache import slot_layout  # noqa: E402
from strata_nb.runtime import gpu_backend  # noqa: E402

SLOTS = 8


def synthetic(path: Path) -> Path:
    if not path.exists():
        from strata_nb.cli.run import run_synth

        run_synth("qwen3-30b-a3b", None, 2, "Q4_K_M", 0, str(path), 0.0)
    return path


def load(path: Path, threads: int) -> Engine:
    g, spec = open_model(path)
    src = open_experts(g)
    per_layer = sum(slot_layout(src, l).slot_bytes for l in src.layers)
    eng = Engine(path, device="cuda", n_ctx=16, threads=threads,
                 vram_budget=gpu_fixed_bytes(path, 16) + SLOTS * per_layer + per_layer // 2)
    b = eng.backend

    def fill():  # admit experts 0-7 into every layer's slots and wait for the copies
        for l in b.cache.slots:
            b.cache.admit(l, np.arange(SLOTS))
        while b.cache.loading.any():
            time.sleep(0.01)
            b.cache.end_token(b.stream)

    b._thread.call(fill)
    b._thread.call(numba.set_num_threads, threads)  # numba's thread count is per calling thread
    return eng


def routings(rng, n: int, misses: int, n_expert: int, k: int, table: np.ndarray):
    """n routings of one token: k - misses choices among the resident experts, misses among the others."""
    res = np.flatnonzero(table >= 0)
    rest = np.flatnonzero(table < 0)
    out = []
    for _ in range(n):
        ids = np.concatenate([rng.choice(res, k - misses, replace=False), rng.choice(rest, misses, replace=False)])
        rng.shuffle(ids)
        w = rng.uniform(0.05, 0.3, k).astype(np.float32)
        out.append((ids.astype(np.int32), table[ids].astype(np.int32), w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="/tmp/strata-qwen3-30b-a3b-2l.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the device thread's CPU time (with --threads 1, immune to other processes' load)")
    a = ap.parse_args()
    eng = load(synthetic(Path(a.model)), a.threads)
    b, spec = eng.backend, eng.spec
    b.hybrid.tokens = gpu_backend.WARM_TOKENS  # count as the decode tokens after the cache's warm-up do
    layer = sorted(b.cache.slots)[0]
    rng = np.random.default_rng(0)
    mb = b.mb
    x = rng.standard_normal((a.calls, spec.n_embd)).astype(np.float32)
    cpu = b.cpu
    kern, ff = cpu._moe[layer][:2]
    kern_s = [0.0]
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter

    def timed(*args):
        t0 = clock()
        r = kern(*args)
        kern_s[0] += clock() - t0
        return r

    cpu._moe[layer] = (timed,) + cpu._moe[layer][1:]

    def run(cases):
        pool, kernel = [], []
        for i, (ids, slot, w) in enumerate(cases):
            mb.x[0] = x[i]
            mb.ids[0], mb.slot[0], mb.wts[0] = ids, slot, w
            k0 = kern_s[0]
            t0 = clock()
            b._cpu_pool(layer, 1, b.hybrid)
            pool.append(clock() - t0)
            kernel.append(kern_s[0] - k0)
        return np.median(pool), np.median(kernel)

    print(f"{spec.n_expert} experts, top-{spec.n_expert_used}, hidden {spec.n_embd}, expert width {ff}; "
          f"{a.threads} threads; T=1; medians over {a.calls} calls, {a.clock} clock")
    print("misses  pool us  kernel us  outside kernel us")
    for m in (0, 1, 2, 4, 8):
        cases = routings(rng, a.calls, m, spec.n_expert, spec.n_expert_used, b.cache.host_table[layer])
        b._thread.call(run, cases)  # compile, and map every expert page the cases read
        p, k = b._thread.call(run, cases)
        print(f"{m:6d} {1e6 * p:8.1f} {1e6 * k:10.1f} {1e6 * (p - k):18.1f}")
    eng.close()


if __name__ == "__main__":
    main()
