"""Weight-streaming speed of the CPU matrix kernels against the machine's measured read bandwidth.

The read bandwidth is a parallel sum over a uint64 array of --bw-gib GiB. For every supported quant type: GB/s
of weight bytes for matmul_q8 and matmul_f32 (one token, dense matrices) and moe_matmul (8 experts of 768x2048
per call, int8 and float32 paths), each sweep reading a rotating set of matrices large enough to defeat the
caches. Every round measures the bandwidth and every kernel once (this VM's bandwidth drifts up to 2x from
minute to minute, so only ratios within one run compare); medians over the rounds.

    python bench/kernels.py --threads 2 [--out bench/results/kernels.md]
"""
from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import numpy as np

import strata_nb  # noqa: F401  (numba environment before numba is imported)
import numba
from strata_nb.cpu_kernels.actq import group, quantize
from strata_nb.cpu_kernels.matmul import matmul_f32, matmul_q8, moe_matmul
from strata_nb.cpu_kernels.membw import read_sweep
from strata_nb.cpu_kernels.qtypes import FLOAT_TYPES, QUANT_INFO, SUPPORTED, name, row_bytes

KERNELS = ("matmul_q8", "matmul_f32", "moe_q8", "moe_f32")
# byte offsets of the fp16 scale/min fields inside one block (ggml-common.h block layouts)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def valid_blocks(qtype: int, nbytes: int, rng: np.random.Generator) -> np.ndarray:
    """nbytes of rows of qtype: random quants with finite fp16 scales (random bits would give NaN, Inf and
    denormals, which run at other speeds); a 1 MiB random pattern tiled, so the set is built fast."""
    _, blk, bsize = QUANT_INFO[qtype]
    nblk = (1 << 20) // bsize
    if qtype in FLOAT_TYPES:
        v = rng.standard_normal(nblk * bsize // 4).astype(np.float32)
        pat = {0: v, 1: v.astype(np.float16), 30: (v.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
        pat = pat.view(np.uint8)
    else:
        pat = rng.integers(0, 256, (nblk, bsize), dtype=np.uint8)
        for off in FP16_FIELDS[name(qtype)]:
            pat[:, off:off + 2] = (rng.standard_normal((nblk, 1)) * 0.01).astype(np.float16).view(np.uint8)
        pat = pat.reshape(-1)
    reps = -(-nbytes // pat.size)
    return np.tile(pat, reps)[:nbytes]


class TypeCase:
    """The rotating weight set of one type, viewed both as dense matrices and as experts."""

    def __init__(self, qtype: int, set_bytes: int, rows: int, k: int, e_rows: int, e_k: int,
                 rng: np.random.Generator):
        self.qtype = qtype
        self.rb = row_bytes(qtype, k)
        self.mat_bytes = rows * self.rb
        self.n_mat = max(2, set_bytes // self.mat_bytes)
        self.erb = row_bytes(qtype, e_k)
        self.exp_bytes = e_rows * self.erb
        self.n_exp = max(16, (set_bytes // self.exp_bytes) // 8 * 8)
        total = max(self.n_mat * self.mat_bytes, self.n_exp * self.exp_bytes)
        self.buf = valid_blocks(qtype, total, rng)
        self.mats = [self.buf[i * self.mat_bytes:(i + 1) * self.mat_bytes].reshape(rows, self.rb)
                     for i in range(self.n_mat)]
        self.e_rows = e_rows
        self.x = rng.standard_normal((1, k)).astype(np.float32)
        self.xq, self.xd, self.xs = quantize(self.x, group(qtype))
        self.ex = rng.standard_normal((1, e_k)).astype(np.float32)
        self.exq, self.exd, self.exs = quantize(self.ex, group(qtype))
        self.out = np.empty((1, rows), np.float32)
        self.eout = np.empty((8, e_rows), np.float32)
        self.grp = np.arange(9, dtype=np.int64)
        self.tok = np.zeros(8, np.int64)

    def sweep(self, kernel: str) -> tuple[float, int]:
        """Seconds and weight bytes of one pass over the whole set."""
        qt = self.qtype
        if kernel.startswith("matmul"):
            t0 = time.perf_counter()
            for w in self.mats:
                if kernel == "matmul_q8":
                    matmul_q8(qt, w, self.x, self.xq, self.xd, self.xs, self.out)
                else:
                    matmul_f32(qt, w, self.x, self.out)
            return time.perf_counter() - t0, self.n_mat * self.mat_bytes
        fast = kernel == "moe_q8"
        t0 = time.perf_counter()
        for g in range(0, self.n_exp, 8):
            ptrs = self.buf.ctypes.data + np.arange(g, g + 8, dtype=np.int64) * self.exp_bytes
            moe_matmul(fast, qt, ptrs, self.e_rows, self.erb, self.grp[:-1], self.grp[1:], self.tok,
                       self.ex, self.exq, self.exd, self.exs, self.eout)
        return time.perf_counter() - t0, self.n_exp * self.exp_bytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median reported)")
    ap.add_argument("--set-mib", type=int, default=256, help="rotating weight set per type, MiB")
    ap.add_argument("--bw-gib", type=float, default=2.0, help="buffer of the bandwidth measurement, GiB")
    ap.add_argument("--rows", type=int, default=2048, help="dense matrix rows")
    ap.add_argument("--k", type=int, default=2048, help="dense matrix columns")
    ap.add_argument("--types", default="", help="comma-separated subset, e.g. Q8_0,Q4_K (default: all)")
    ap.add_argument("--out", help="also write the table and the command line to this markdown file")
    args = ap.parse_args(argv)

    numba.set_num_threads(args.threads)
    ids = {name(q): q for q in SUPPORTED}
    wanted = [s.strip().upper() for s in args.types.split(",") if s.strip()] or list(ids)
    unknown = [s for s in wanted if s not in ids]
    if unknown:
        ap.error(f"unknown quant type(s): {', '.join(unknown)}")

    bw_buf = np.ones(int(args.bw_gib * (1 << 30)) // 8, np.uint64)  # touched: no page faults in the timing
    read_sweep(bw_buf)
    rng = np.random.default_rng(0)
    cases = [TypeCase(ids[s], args.set_mib << 20, args.rows, args.k, 768, 2048, rng) for s in wanted]
    for c in cases:  # compile and touch every page outside the timing
        for kern in KERNELS:
            c.sweep(kern)
    times: dict[tuple[int, str], list[float]] = {}
    bws = []
    for _ in range(args.reps):
        bws.append(read_sweep(bw_buf))
        for c in cases:
            for kern in KERNELS:
                s, nb = c.sweep(kern)
                times.setdefault((c.qtype, kern), []).append(nb / s / 1e9)
    bw = statistics.median(bws)

    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    lines = [
        f"Read bandwidth {bw:.1f} GB/s (median; rounds ranged {min(bws):.1f}-{max(bws):.1f}); "
        f"{args.threads} threads; {platform.processor() or platform.machine()}; "
        f"medians of {args.reps} interleaved sweeps over {args.set_mib} MiB per type.",
        f"Dense: {args.rows}x{args.k}, T=1. MoE: 8 experts of 768x2048 per call, T=1. GB/s of weight bytes "
        "(% of the read bandwidth).",
        "",
        "| type | matmul_q8 | matmul_f32 | moe q8 | moe f32 |",
        "|---|---|---|---|---|",
    ]
    for c in cases:
        cells = []
        for kern in KERNELS:
            g = statistics.median(times[(c.qtype, kern)])
            cells.append(f"{g:.1f} ({100 * g / bw:.0f}%)")
        lines.append(f"| {name(c.qtype)} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# CPU kernel bandwidth\n\n`{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
