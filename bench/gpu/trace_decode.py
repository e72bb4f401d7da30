"""Where a hybrid decode token's GPU time goes, as the GPU ran it (run on the GPU machine).

    python3 bench/gpu/trace_decode.py -m MODEL [--share 1.0] [--prompt 128] [--gen 128] [--tokens 8]
                                      [--warmup-seed 0] [--host-profile N] [--out trace.json]

Loads the model with the VRAM share of hybrid_vs_llama.py, generates a warm-up (4 tokens) and an untraced generation
(--prompt + --gen tokens: its decode rate, as the benchmark's), then records `--tokens` decode tokens of one more
generation with torch's profiler (CUPTI: every kernel of the process, numba's and graph-replayed ones included) and
prints the GPU's busy time per token (the sum of kernel durations) against the token's period, the idle time inside
and before tokens, and per kernel (and grid) its launches per token and microseconds: the times inside the real
decode graph, weights cold in HBM, unlike profile_decode.py (one op replayed) and matvec_variants.py (one kernel
alone). torch is only a tracer here (the GPU machine has it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_vs_llama import prompt_ids, share_plan  # noqa: E402

from strata_nb.api import Engine  # noqa: E402
from strata_nb.runtime.sampler import SamplerConfig  # noqa: E402

_SKIP = {"cudapy", "strata_nb", "cuda_kernels", "_3clocals_3e"}


def short(name: str) -> str:
    """A kernel's name as module.function (CUPTI gives numba's kernels demangled, with ABI tags and arguments;
    mangled names are parsed the same way)."""
    if name.startswith("_ZN"):  # Itanium nested name: <len><id>... up to the first non-digit
        i, parts = 3, []
        while i < len(name) and name[i].isdigit():
            j = i
            while name[j].isdigit():
                j += 1
            parts.append(name[j:j + int(name[i:j])])
            i = j + int(name[i:j])
    else:
        parts = name.split("(")[0].split("[abi:")[0].split("::")
    return ".".join(p for p in parts if p not in _SKIP) or name[:60]


def key(e: dict) -> str:
    """Kernel and grid: the same kernel function serves several matrices (Q/K/V, the output projection...)."""
    g = e.get("args", {}).get("grid")
    return f"{short(e['name'])} {g}" if g else short(e["name"])


def host_line(res) -> str:
    """A generation's decode breakdown, ms per token (as hybrid_vs_llama.py reports it)."""
    h = getattr(res, "hybrid", None)
    if h is None or not h.tokens:
        return "no hybrid stats"
    f = 1e3 / h.tokens
    return (f"ms/token graph {h.graph_s * f:.2f} wait {h.wait_s * f:.2f} cpu {h.cpu_s * f:.2f} host {h.host_s * f:.2f} "
            f"(launch {h.launch_s * f:.2f} glue {h.glue_s * f:.2f} call {h.call_s * f:.2f} end {h.end_s * f:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--share", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the untraced and traced runs")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated untraced (as hybrid_vs_llama.py)")
    ap.add_argument("--warmup-seed", type=int, default=0,
                    help="the warm-up generation's sampler seed (the timed ones use 0; hybrid_vs_llama.py warms up "
                         "with another seed, which binds a new device sampler and captures the graphs again)")
    ap.add_argument("--host-profile", type=int, default=0,
                    help="then generate this many tokens under cProfile and print the host's top functions")
    ap.add_argument("--out", default=None, help="keep the chrome trace here")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile  # a CUPTI tracer (the GPU machine has torch)

    n_ctx = a.prompt + max(a.gen, a.tokens + 2) + 8
    eng = Engine(a.model, device="cuda", n_ctx=n_ctx, threads=a.threads,
                 vram_budget=share_plan(a.model, a.share, n_ctx)[0])
    cfg = SamplerConfig(temperature=0.8, seed=0)
    eng.generate(prompt_ids(7919, a.prompt, eng.spec.n_vocab), max_new=4,
                 sampler=SamplerConfig(temperature=0.8, seed=a.warmup_seed))
    res = eng.generate(prompt_ids(0, a.prompt, eng.spec.n_vocab), max_new=a.gen, sampler=cfg)
    print(f"share {a.share}, prompt {a.prompt}, {a.gen} generated: decode {res.decode_tps:.1f} tok/s untraced; "
          f"{host_line(res)}")
    if a.host_profile:  # where the host's share of a token goes, by Python function
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        r1 = eng.generate(prompt_ids(2, a.prompt, eng.spec.n_vocab), max_new=a.host_profile, sampler=cfg)
        pr.disable()
        print(f"under cProfile: decode {r1.decode_tps:.1f} tok/s; {host_line(r1)}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        r2 = eng.generate(prompt_ids(1, a.prompt, eng.spec.n_vocab), max_new=a.tokens + 2, sampler=cfg)
        wall = time.perf_counter() - t0
    print(f"traced: decode {r2.decode_tps:.1f} tok/s, wall {wall:.3f} s")
    path = a.out or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    names = [key(e) for e in ev]
    ring = [i for i, n in enumerate(names) if "ring" in n]
    if len(ring) < 4:
        print(f"{len(ev)} kernels, {len(ring)} token ends: too few to analyse; names: {sorted(set(names))[:20]}")
        return
    # decode tokens: between consecutive token ends (the first traced forwards are the prompt's)
    toks = list(zip(ring[1:-1], ring[2:]))[-a.tokens:]
    busy, span, gin, gbetween = [], [], [], []
    per = defaultdict(list)
    for i0, i1 in toks:
        ks = ev[i0 + 1:i1 + 1]
        busy.append(sum(e["dur"] for e in ks))
        span.append(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"])
        gbetween.append(ks[0]["ts"] - (ev[i0]["ts"] + ev[i0]["dur"]))
        gaps = [ks[j]["ts"] - (ks[j - 1]["ts"] + ks[j - 1]["dur"]) for j in range(1, len(ks))]
        gin.append(sum(g for g in gaps if g > 0))
        for e, n in zip(ks, names[i0 + 1:i1 + 1]):
            per[n].append(e["dur"])
    nt = len(toks)
    per_tok = [(ev[i1]["ts"] - ev[i0]["ts"]) for i0, i1 in toks]
    print(f"{nt} decode tokens traced: period {np.median(per_tok) / 1e3:.3f} ms (median, token end to token end); "
          f"GPU busy {np.median(busy) / 1e3:.3f} ms; first to last kernel {np.median(span) / 1e3:.3f} ms; idle inside "
          f"{np.median(gin) / 1e3:.3f} ms; idle before the token's first kernel {np.median(gbetween) / 1e3:.3f} ms; "
          f"{(i1 - i0)} kernels per token")
    print("kernel                                   per token   mean us   total us/token")
    for n, d in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {n:50s} {len(d) / nt:8.1f} {np.mean(d):9.2f} {sum(d) / nt:12.1f}")
    i0, i1 = toks[-1]
    print("one layer in order (the last token's kernels 1..40): name, start offset us, duration us, gap before us")
    ks = ev[i0 + 1:i1 + 1]
    for j in range(min(40, len(ks))):
        g = ks[j]["ts"] - (ks[j - 1]["ts"] + ks[j - 1]["dur"]) if j else 0
        print(f"  {key(ks[j]):50s} {ks[j]['ts'] - ks[0]['ts']:9.1f} {ks[j]['dur']:7.2f} {g:7.2f}")
    eng.close()


if __name__ == "__main__":
    main()
