"""Where the hybrid engine's CPU expert pool spends its time, per call (run on the GPU machine).

    python3 bench/gpu/pool_probe.py -m MODEL [--share 0.5] [--tokens 64] [--threads 15]

Loads the model with the VRAM share of the expert slots that bench/hybrid_vs_llama.py gives (the same budget),
warms up, generates, and records every pool call of the decode tokens: the misses it computed, its wall time,
the time inside the compiled expert kernel, and the process's minor page faults during it. Prints the medians
(and the pool's mean and 99th percentile: a heavy tail) per number of missed choices: a cost that does not grow
with the misses is a fixed cost per layer (thread wake-ups, glue), one that grows with the faults is first touches
of expert pages. Run it under different
GOMP_SPINCOUNT / OMP_WAIT_POLICY settings to compare (they are read when the OpenMP runtime starts); PROBE_THREADS
sets --threads from the environment (call_dev.sh's PROBES pass settings that way).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_vs_llama import prompt_ids, share_plan  # noqa: E402

from strata_nb.api import Engine  # noqa: E402
from strata_nb.runtime import gpu_backend  # noqa: E402
from strata_nb.runtime.sampler import SamplerConfig  # noqa: E402


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("PROBE_THREADS", 15)))
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (and the warm-up's)")
    a = ap.parse_args()
    n_ctx = a.prompt + a.tokens + 8
    eng = Engine(a.model, device="cuda", n_ctx=n_ctx, threads=a.threads,
                 vram_budget=share_plan(a.model, a.share, n_ctx)[0])
    b = eng.backend
    calls: list[tuple[int, float, float, int]] = []  # (misses, pool s, kernel s, minor faults)
    recording = [False]
    kern_s = [0.0]
    orig_pool = gpu_backend.GPUBackend._cpu_pool

    def pool(self, layer, T, stats):
        if not recording[0] or stats is None:  # warm-up and prompt calls
            return orig_pool(self, layer, T, stats)
        m0, f0, k0 = stats.misses, _minflt(), kern_s[0]
        t0 = time.perf_counter()
        r = orig_pool(self, layer, T, stats)
        dt = time.perf_counter() - t0
        calls.append((stats.misses - m0, dt, kern_s[0] - k0, _minflt() - f0))
        return r

    gpu_backend.GPUBackend._cpu_pool = pool
    for layer, entry in list(b.cpu._moe.items()):
        kern = entry[0]

        def timed(*args, _k=kern):
            t0 = time.perf_counter()
            r = _k(*args)
            kern_s[0] += time.perf_counter() - t0
            return r

        b.cpu._moe[layer] = (timed,) + tuple(entry[1:])
    prompt = prompt_ids(0, a.prompt, eng.spec.n_vocab)
    eng.generate(prompt_ids(7919, a.prompt, eng.spec.n_vocab), max_new=4, sampler=SamplerConfig(temperature=0.8, seed=1))
    h0 = b.hybrid.copy()
    recording[0] = True
    f0, t0 = _minflt(), time.perf_counter()
    res = eng.generate(prompt, max_new=a.tokens, sampler=SamplerConfig(temperature=0.8, seed=0))
    wall = time.perf_counter() - t0
    recording[0] = False
    h = b.hybrid - h0
    n = max(h.tokens, 1)
    env = {k: os.environ.get(k, "-") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_NUM_THREADS")}
    print(f"share {a.share}, {a.threads} threads, env {env}")
    print(f"decode {res.decode_tps:.1f} tok/s over {res.decode_steps} tokens; per token ms: graph {1e3 * h.graph_s / n:.2f}"
          f" wait {1e3 * h.wait_s / n:.2f} cpu {1e3 * h.cpu_s / n:.2f} host {1e3 * h.host_s / n:.2f} (launch "
          f"{1e3 * h.launch_s / n:.2f} glue {1e3 * h.glue_s / n:.2f} call {1e3 * h.call_s / n:.2f} end "
          f"{1e3 * h.end_s / n:.2f}); minor faults {(_minflt() - f0) / n:.0f} per token (prompt included); "
          f"wall {wall:.2f} s")
    by = defaultdict(list)
    for c in calls:
        by[c[0]].append(c)
    print("misses  calls  pool us: median   mean    p99  kernel us: median   mean  outside kernel us (median)  faults/call")
    for nm in sorted(by):
        c = np.array([x[1:] for x in by[nm]], np.float64)
        print(f"{nm:6d} {len(c):6d} {1e6 * np.median(c[:, 0]):15.1f} {1e6 * c[:, 0].mean():6.1f} "
              f"{1e6 * np.percentile(c[:, 0], 99):6.1f} {1e6 * np.median(c[:, 1]):17.1f} {1e6 * c[:, 1].mean():6.1f} "
              f"{1e6 * np.median(c[:, 0] - c[:, 1]):27.1f} {np.mean(c[:, 2]):12.1f}")
    eng.close()


if __name__ == "__main__":
    main()
