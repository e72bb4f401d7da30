"""The CPU decode attention alone (cpu_kernels.ops.attention_block: QK-norm, rope, KV append and causal GQA
attention of one token), Qwen3-30B-A3B's heads (32 over 4 kv heads of 128), at a few positions.

    python bench/cpu_attention.py [--positions 30,150,1000] [--reps 50]

Prints the median microseconds a call (one layer of one decode token) at each position, with the threads numba
runs on. The KV cache is float32 as the CPU engine keeps it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from numba import get_num_threads

from strata_nb.cpu_kernels import ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", default="30,150,1000")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    nh, nkv, hd = 32, 4, 128
    pos = [int(p) for p in a.positions.split(",")]
    ctx = max(pos) + 1
    kc = rng.standard_normal((nkv, ctx, hd)).astype(np.float32)
    vc = rng.standard_normal((nkv, ctx, hd)).astype(np.float32)
    norm = np.ones(hd, np.float32)
    cos, sin = np.ones((1, hd // 2), np.float32), np.zeros((1, hd // 2), np.float32)
    out = np.zeros((1, nh, hd), np.float32)
    print(f"attention_block, {nh} heads / {nkv} kv heads x {hd}, {get_num_threads()} threads, median of {a.reps}")
    for p in pos:
        ts = []
        for _ in range(a.reps + 1):
            q = rng.standard_normal((1, nh * hd)).astype(np.float32)
            k = rng.standard_normal((1, nkv * hd)).astype(np.float32)
            t = time.perf_counter()
            ops.attention_block(q, k, k.copy(), norm, norm, ops.QK_NORM_HEAD, 1e-6, cos, sin, True, kc, vc, p,
                                1.0 / np.sqrt(hd), out)
            ts.append(time.perf_counter() - t)
        print(f"position {p:6d}: {np.median(ts[1:]) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
