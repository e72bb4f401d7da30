"""Hybrid benchmark: strata-nb's hybrid GPU engine vs llama.cpp built with CUDA, at matching VRAM expert shares.

The dense part of every layer runs on the GPU in both engines; the routed experts are split between VRAM and the
CPU. Arms, interleaved over --reps, medians reported:
  llama.cpp   llama-bench -m FILE -t T -p P -n N -r 1 -o json, placements: every expert on the GPU (-ngl 99),
              the experts of half the layers on the GPU (-ngl 99 -ncmoe L/2), of a quarter (-ncmoe 3L/4), and
              none (-ngl 99 -ot exps=CPU)
  strata-nb   Engine(device="cuda", vram_budget = gpu_fixed_bytes + share * expert bytes) for the shares 1 (the
              GPU floor: every expert in VRAM), 0.5, 0.25 and 0, each in its own process (a fresh CUDA context):
              a P-token prompt, then N tokens sampled at --temp 0.8 with a fixed seed (greedy decoding of a
              random-weight model repeats one token and would route the same experts at every step)
Measured first, each in its own process: the GPU's read bandwidth (a numba.cuda kernel reading --gpubw-gib GiB,
and a device-to-device copy as a cross-check), and the host's RAM read bandwidth with T threads (a vectorized
numba prange sum of --membw-gib GiB). The report sets the GPU floor against its ideal time (bytes read per
token / GPU bandwidth) and the CPU-side expert GB/s (miss bytes / time in CPU expert kernels) against RAM.
With --profile-run, one strata-nb run on another prompt records a routing profile first (--save-profile) and
the strata-nb arms start from it; for every run the report sets the VRAM hit rate the cache reached against the
best static placement of the same slots (per layer, the `slots` experts the decode itself routed to most).

  python bench/hybrid_vs_llama.py -m /tmp/models/q30-Q4_K_M.gguf --reps 2
  python bench/hybrid_vs_llama.py -m /tmp/models/q30-Q4_K_M-skew1.2.gguf --profile-run --reps 2
  python bench/hybrid_vs_llama.py --self-check   # no GPU needed: llama-bench parsing and table writing on
                                                 # llama.cpp's own recorded sample output, kernel checksums
Writes <out>.md (tables, naming the command) and <out>.json (raw results) after every run, so a run cut short
still leaves what it measured; default <out>: bench/results/hybrid_<model file stem>.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import strata_nb  # noqa: F401  (numba settings: threading layer, cache folder) before numba is imported
from numba import cuda, uint64  # no device work at import; NUMBA_ENABLE_CUDASIM is read here (the self-check's child)

REPO = Path(__file__).resolve().parent.parent
SHARES = (1.0, 0.5, 0.25, 0.0)


# ------------------------------------------------------------------------------------------- small helpers
def _ok(x) -> bool:
    """A number that is not NaN (None and NaN mark what was not measured)."""
    return isinstance(x, (int, float)) and not math.isnan(x)


def _med(xs) -> float:
    xs = [x for x in xs if _ok(x)]
    return statistics.median(xs) if xs else float("nan")


def _jsonable(x):
    """numpy scalars/arrays and dataclass dicts -> plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


def _fmt(x: float, nd: int = 1) -> str:
    return f"{x:,.{nd}f}" if _ok(x) else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if _ok(x) else "-"


def prompt_ids(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, n)]


def llama_placements(n_layer: int, shares=SHARES) -> dict[float, tuple[list[str], str]]:
    """llama-bench arguments and a label for each share of the expert layers on the GPU. -ncmoe N keeps the
    experts of the first N layers on the CPU; share 0 keeps every expert tensor on the CPU by name."""
    out = {}
    for s in shares:
        if s >= 1:
            out[s] = (["-ngl", "99"], "-ngl 99")
        elif s <= 0:
            out[s] = (["-ngl", "99", "-ot", "exps=CPU"], "-ngl 99 -ot exps=CPU")
        else:
            n_cpu = n_layer - round(s * n_layer)
            out[s] = (["-ngl", "99", "-ncmoe", str(n_cpu)], f"-ngl 99 -ncmoe {n_cpu}")
    return out


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench -o json output (a list of tests) -> prompt and decode tok/s and the raw records. Where a test
    ran under several settings (--repack 0,1), the fastest record of each test counts, and its repack is kept."""
    i, j = stdout.find("["), stdout.rfind("]")
    if i < 0 or j < i:
        raise ValueError("no JSON array in llama-bench output")
    recs = json.loads(stdout[i:j + 1])
    pp = [r for r in recs if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    tg = [r for r in recs if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not pp and not tg:
        raise ValueError(f"llama-bench output has no prompt or generation test ({len(recs)} records)")
    pp = sorted(pp, key=lambda r: -float(r["avg_ts"]))
    tg = sorted(tg, key=lambda r: -float(r["avg_ts"]))
    return {"prompt_tps": float(pp[0]["avg_ts"]) if pp else float("nan"),
            "decode_tps": float(tg[0]["avg_ts"]) if tg else float("nan"),
            "n_prompt": int(pp[0]["n_prompt"]) if pp else 0, "n_gen": int(tg[0]["n_gen"]) if tg else 0,
            "prompt_repack": pp[0].get("repack") if pp else None, "decode_repack": tg[0].get("repack") if tg else None,
            "decode_all": [(r.get("repack"), float(r["avg_ts"])) for r in tg], "records": recs}


def best_static_hit(routed: np.ndarray, slots) -> float:
    """The hit rate of the best static placement with slots[l] VRAM slots in layer l: the slots[l] experts the
    run routed to most, per layer, out of every routed selection."""
    routed = np.asarray(routed, np.int64)
    total = routed.sum()
    if total == 0:
        return float("nan")
    srt = -np.sort(-routed, axis=1)
    hit = sum(int(srt[layer, :int(n)].sum()) for layer, n in enumerate(slots))
    return hit / float(total)


def model_bytes(path: str) -> dict:
    """Weight bytes a decode token reads, from the file: every dense tensor once (the token embedding: one row,
    unless the output head is tied to it) and, in each MoE layer, n_expert_used of its n_expert experts."""
    from strata_nb.model.gguf_file import GGUFFile
    from strata_nb.model.spec import spec_from_gguf

    g = GGUFFile(path)
    spec = spec_from_gguf(g)
    tied = "output.weight" not in g.tensors
    dense = expert = 0
    expert_active = 0.0
    for name, t in g.tensors.items():
        if "_exps." in name:
            expert += t.nbytes
            expert_active += t.nbytes * spec.n_expert_used / spec.n_expert
        elif name == "token_embd.weight" and not tied:
            dense += t.nbytes // t.shape[0]
        else:
            dense += t.nbytes
    return {"n_layer": spec.n_layer, "n_expert": spec.n_expert, "n_expert_used": spec.n_expert_used,
            "n_vocab": spec.n_vocab, "file_bytes": g.size, "expert_bytes": expert,
            "dense_bytes_per_token": dense, "expert_bytes_per_token": expert_active,
            "bytes_per_token": dense + expert_active}


# ------------------------------------------------------------------------------------------- bandwidth kernels
def host_membw(gib: float, threads: int, sweeps: int = 5) -> dict:
    import numba

    from strata_nb.cpu_kernels.membw import read_sweep, sum_u64

    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    a = np.ones(max(1, int(gib * 2**30) // 8), np.uint64)  # touched: the pages exist before timing
    if int(sum_u64(a, 8 * threads)) != a.shape[0]:  # also the warm-up (compile) run
        raise RuntimeError("host read kernel: wrong sum")
    gbs = [read_sweep(a, 8 * threads) for _ in range(sweeps)]  # 8 chunks per thread: equal work
    return {"threads": threads, "gib": gib, "gbs": gbs, "best_gbs": max(gbs), "median_gbs": _med(gbs)}


def gpu_bandwidth(gib: float, reps: int = 10) -> dict:
    """The GPU's read bandwidth: a kernel XOR-reading `gib` GiB of uint64 (grid-stride, 4 loads in flight per
    thread), timed with CUDA events, best of reps; and a device-to-device copy (read + write bytes counted)."""
    @cuda.jit
    def fill(a):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < a.shape[0]:
            a[i] = uint64(i) * uint64(0x9E3779B97F4A7C15)
            i += stride

    @cuda.jit
    def read(a, out):
        t = cuda.grid(1)
        stride = cuda.gridsize(1)
        n = a.shape[0]
        s0 = uint64(0)
        s1 = uint64(0)
        s2 = uint64(0)
        s3 = uint64(0)
        i = t
        while i + 3 * stride < n:
            s0 ^= a[i]
            s1 ^= a[i + stride]
            s2 ^= a[i + 2 * stride]
            s3 ^= a[i + 3 * stride]
            i += 4 * stride
        while i < n:
            s0 ^= a[i]
            i += stride
        out[t] = s0 ^ s1 ^ s2 ^ s3

    from numba import config

    n = max(1, int(gib * 2**30) // 8)
    if config.ENABLE_CUDASIM:
        blocks, threads = 2, 32
    else:
        dev = cuda.get_current_device()
        blocks, threads = dev.MULTIPROCESSOR_COUNT * 4, 512
    a = cuda.device_array(n, np.uint64)
    out = cuda.device_array(blocks * threads, np.uint64)
    fill[blocks, threads](a)
    read[blocks, threads](a, out)  # compile + warm
    cuda.synchronize()
    expect = np.bitwise_xor.reduce(np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) \
        if n <= 1 << 24 else None
    if expect is not None and np.bitwise_xor.reduce(out.copy_to_host()) != expect:
        raise RuntimeError("GPU read kernel: wrong checksum")
    res = {"gib": gib, "blocks": blocks, "threads": threads}
    if config.ENABLE_CUDASIM:
        res["checked"] = expect is not None
        return res
    e0, e1 = cuda.event(), cuda.event()
    read_gbs = []
    for _ in range(reps):
        e0.record()
        read[blocks, threads](a, out)
        e1.record()
        e1.synchronize()
        read_gbs.append(a.nbytes / (cuda.event_elapsed_time(e0, e1) / 1e3) / 1e9)
    b = cuda.device_array_like(a)
    copy_gbs = []
    for _ in range(reps):
        e0.record()
        b.copy_to_device(a)
        e1.record()
        e1.synchronize()
        copy_gbs.append(2 * a.nbytes / (cuda.event_elapsed_time(e0, e1) / 1e3) / 1e9)
    _, total = cuda.current_context().get_memory_info()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    res.update(read_gbs=read_gbs, best_read_gbs=max(read_gbs), copy_gbs=copy_gbs, best_copy_gbs=max(copy_gbs),
               gpu=name, vram_total=total)
    return res


# ------------------------------------------------------------------------------------------- one arm (child)
def share_plan(model: str, share: float, n_ctx: int) -> tuple[int, int, int, int, int]:
    """(VRAM budget, fixed bytes, expert bytes, bytes of one slot in every MoE layer, slots per layer) for a VRAM
    share of the expert slots. The engine gives every MoE layer (budget - fixed) // (one slot in each layer)
    slots, and a slot is an expert padded to alignment: share * expert_bytes would fall a slot short at share 1.
    So the budget is round(share * n_expert) slots per layer, plus half a slot of slack."""
    from strata_nb.api import gpu_fixed_bytes, memory_needs, open_model
    from strata_nb.experts.source import open_experts
    from strata_nb.experts.vram_cache import slot_layout

    g, spec = open_model(model)
    fixed = gpu_fixed_bytes(model, n_ctx)
    src = open_experts(g)
    per_slot = sum(slot_layout(src, layer).slot_bytes for layer in src.layers)
    want = round(share * spec.n_expert)
    return fixed + want * per_slot + per_slot // 2, fixed, memory_needs(g, spec, n_ctx).expert_bytes, per_slot, want


def strata_child(a) -> dict:
    import dataclasses
    import resource

    from strata_nb.api import Engine, open_model
    from strata_nb.runtime.sampler import SamplerConfig

    g, spec = open_model(a.model)
    n_ctx = a.n_ctx or a.n_prompt + a.n_gen + 8
    budget, fixed, expert_bytes, per_slot, want = share_plan(a.model, a.share, n_ctx)
    out: dict = {"arm": "strata-nb", "share": a.share, "prompt_seed": a.prompt_seed, "gpu_fixed_bytes": fixed,
                 "expert_bytes": expert_bytes, "slot_bytes_all_layers": per_slot, "slots_per_layer_asked": want,
                 "vram_budget": budget, "profile": a.profile}
    t0 = time.perf_counter()
    eng = Engine(a.model, device="cuda", n_ctx=n_ctx, threads=a.threads, vram_budget=budget,
                 expert_profile=a.profile)
    out["load_s"] = time.perf_counter() - t0
    try:
        from numba import cuda

        free, total = cuda.current_context().get_memory_info()
        out["vram_used_after_load"] = total - free
    except Exception as e:  # the figure is informative only
        out["vram_used_after_load"] = f"unavailable: {e}"
    prompt = prompt_ids(a.prompt_seed, a.n_prompt, spec.n_vocab)
    if a.warmup:  # first-call costs (compiles, graph captures at both token counts, first touches) outside the
        # timed run, as llama-bench's warm-up run does: a prompt of the same length, on other token ids
        t1 = time.perf_counter()
        eng.generate(prompt_ids(a.prompt_seed + 7919, a.n_prompt, spec.n_vocab), max_new=4,
                     sampler=SamplerConfig(temperature=a.temp, seed=a.seed + 1))
        out["warmup_s"] = time.perf_counter() - t1
    res = eng.generate(prompt, max_new=a.n_gen, sampler=SamplerConfig(temperature=a.temp, seed=a.seed))
    out.update(prompt_tokens=res.prompt_tokens, prompt_s=res.prompt_s, decode_s=res.decode_s,
               decode_steps=res.decode_steps, prompt_tps=res.prompt_tps, decode_tps=res.decode_tps,
               distinct_tokens=len(set(res.tokens)), n_tokens=len(res.tokens), stopped_by=res.stopped_by)
    hy = getattr(res, "hybrid", None)
    out["hybrid"] = _jsonable(dataclasses.asdict(hy)) if hy is not None else None
    if out["hybrid"] is not None:
        out["hybrid"]["cpu_expert_s"] = res.expert_s  # decode time inside the CPU pool's expert kernels
        out["hybrid"]["slots"] = [eng.gpu_plan.slots.get(l, 0) for l in range(spec.n_layer)]
    if a.save_profile:
        eng.save_profile(a.save_profile)
        out["saved_profile"] = a.save_profile
    eng.close()
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return out


def derive(r: dict) -> dict:
    """Per-run figures from a strata-nb child's raw output."""
    hy = r.get("hybrid") or {}
    steps = r.get("decode_steps") or 0
    d: dict = {}
    if hy:
        hits, misses = hy.get("hits", 0), hy.get("misses", 0)
        hb, mb = hy.get("hit_bytes", 0), hy.get("miss_bytes", 0)
        d["hit_rate"] = hits / (hits + misses) if hits + misses else float("nan")
        lh, lm = hy.get("late_hits", 0), hy.get("late_misses", 0)
        d["hit_rate_late"] = lh / (lh + lm) if lh + lm else float("nan")  # after the cache's warm-up tokens
        d["hit_rate_bytes"] = hb / (hb + mb) if hb + mb else float("nan")
        d["expert_bytes_per_token"] = (hb + mb) / steps if steps else float("nan")
        ce = hy.get("cpu_expert_s")  # time in the CPU expert kernels
        d["cpu_expert_gbs"] = mb / ce / 1e9 if ce and ce > 0 and mb else float("nan")
        for k in ("graph_s", "wait_s", "cpu_s", "host_s", "launch_s", "glue_s", "call_s", "end_s"):
            d[k.replace("_s", "_ms_per_token")] = 1000 * hy.get(k, float("nan")) / steps if steps else float("nan")
        if hy.get("routed") is not None and hy.get("slots") is not None:
            d["best_static_hit"] = best_static_hit(np.asarray(hy["routed"]), hy["slots"])
            d["slots"] = int(np.sum(hy["slots"]))
    return d


# ------------------------------------------------------------------------------------------------- parent
def run_child(args, kind: str, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "-m", args.model or "-",
           "--threads", str(args.threads), "--n-prompt", str(args.n_prompt), "--n-gen", str(args.n_gen),
           "--n-ctx", str(args.n_ctx), "--temp", str(args.temp), "--seed", str(args.seed), *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} child failed ({p.returncode}): {' '.join(extra)}\n{p.stderr[-4000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


def run_llama(args, share: float, placement: list[str], timeout: float) -> dict:
    exe = args.llama_bench
    cmd = [exe, "-m", args.model, "-t", str(args.threads), "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", "1", "--repack", "0,1", "-o", "json", *placement]
    env = dict(os.environ)
    libdir = str(Path(exe).resolve().parent)
    env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr[-4000:]}")
    try:
        res = parse_llama_bench(p.stdout)
    except ValueError as e:
        raise ValueError(f"{e}: {shlex.join(cmd)}\nstdout: {p.stdout[-1000:]}\nstderr: {p.stderr[-2000:]}") from None
    res.update(arm="llama.cpp", share=share, args=placement, wall_s=time.perf_counter() - t0,
               command=shlex.join(cmd))
    return res


def report(meta: dict, runs: list[dict]) -> str:
    """The markdown report of everything measured so far."""
    mb = meta.get("model") or {}
    gpu = meta.get("gpubw") or {}
    host = meta.get("membw") or {}
    ram = host.get("best_gbs", float("nan"))
    gpu_bw = gpu.get("best_read_gbs", float("nan"))
    bpt = mb.get("bytes_per_token", float("nan"))
    shares = sorted({r["share"] for r in runs}, reverse=True)

    def by(arm: str, s: float) -> list[dict]:
        return [r for r in runs if r["arm"] == arm and r["share"] == s and not r.get("profile_run")]

    lines = [f"`{meta.get('command', '')}`", ""]
    if mb:
        lines.append(f"model `{meta.get('model_path')}` ({mb['file_bytes'] / 1e9:.2f} GB; {mb['n_layer']} layers, "
                     f"{mb['n_expert']} experts, top-{mb['n_expert_used']}; routed experts "
                     f"{mb['expert_bytes'] / 1e9:.2f} GB); {meta.get('threads')} CPU threads; prompt "
                     f"{meta.get('n_prompt')} tokens, {meta.get('n_gen')} generated (strata-nb: sampled at "
                     f"temperature {meta.get('temp')}, seed {meta.get('seed')}; llama-bench: its own pp/tg tests); "
                     f"{meta.get('reps')} interleaved repetitions, medians.")
    if meta.get("machine"):
        lines.append(f"machine: {meta['machine']}")
    if meta.get("profile"):
        lines.append(f"strata-nb arms start from the routing profile `{meta['profile']}`, recorded by one run on "
                     f"another prompt (seed {meta.get('profile_prompt_seed')}) at VRAM share "
                     f"{meta.get('profile_share')}.")
    lines.append("")
    if gpu.get("best_read_gbs"):
        lines.append(f"GPU read bandwidth: {gpu_bw:,.0f} GB/s (numba.cuda kernel XOR-reading {gpu['gib']:g} GiB of "
                     f"uint64, best of {len(gpu['read_gbs'])}); device-to-device copy {gpu['best_copy_gbs']:,.0f} "
                     f"GB/s counting read + write bytes.")
    if host.get("best_gbs"):
        lines.append(f"Host RAM read bandwidth, {host['threads']} threads: {ram:.1f} GB/s (best of "
                     f"{len(host['gbs'])}; median {host['median_gbs']:.1f}; vectorized numba sum of "
                     f"{host['gib']:g} GiB uint64 in {8 * host['threads']} chunks, strata_nb.cpu_kernels.membw).")
    if mb:
        lines.append(f"Bytes a decode token reads (from the file): dense {mb['dense_bytes_per_token'] / 1e6:.0f} MB "
                     f"+ experts {mb['expert_bytes_per_token'] / 1e6:.0f} MB = {bpt / 1e6:.0f} MB"
                     + (f"; the GPU floor's ideal time at {gpu_bw:,.0f} GB/s: {1e3 * bpt / (gpu_bw * 1e9):.3f} ms/token "
                        f"= {gpu_bw * 1e9 / bpt:,.0f} tok/s (KV reads not counted)." if _ok(gpu_bw) else "."))
    lines += ["", "| VRAM expert share | llama.cpp placement | llama.cpp prompt tok/s | llama.cpp decode tok/s "
                  "| strata-nb prompt tok/s | strata-nb decode tok/s | decode vs llama.cpp | VRAM hit rate after "
                  "warm-up (best static) | CPU experts GB/s (of RAM) | ms/token graph / wait / cpu / host |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in shares:
        ll, st = by("llama.cpp", s), by("strata-nb", s)
        ds = [derive(r) for r in st]
        l_tg, s_tg = _med([r["decode_tps"] for r in ll]), _med([r["decode_tps"] for r in st])
        place = ll[0]["placement_label"] if ll else "-"
        ratio = f"{s_tg / l_tg:.2f}x" if _ok(l_tg) and _ok(s_tg) else "-"
        hit, best = _med([d.get("hit_rate_late") for d in ds]), _med([d.get("best_static_hit") for d in ds])
        ce = _med([d.get("cpu_expert_gbs") for d in ds])
        phases = " / ".join(_fmt(_med([d.get(k) for d in ds]), 2) for k in
                            ("graph_ms_per_token", "wait_ms_per_token", "cpu_ms_per_token", "host_ms_per_token"))
        lines.append(
            f"| {100 * s:g}% | {place} | {_fmt(_med([r['prompt_tps'] for r in ll]))} | {_fmt(l_tg)} | "
            f"{_fmt(_med([r['prompt_tps'] for r in st]))} | {_fmt(s_tg)} | {ratio} | {_pct(hit)} ({_pct(best)}) | "
            f"{_fmt(ce)}" + (f" ({100 * ce / ram:.0f}%)" if _ok(ce) and _ok(ram) else "") + f" | {phases} |")
    st_all = [r for r in runs if r["arm"] == "strata-nb" and not r.get("profile_run")]
    floor = by("strata-nb", 1.0)
    if floor and _ok(gpu_bw) and _ok(bpt):
        tg = _med([r["decode_tps"] for r in floor])
        ideal = gpu_bw * 1e9 / bpt
        lines += ["", f"GPU floor (every expert in VRAM): strata-nb {tg:.1f} tok/s = {1e3 / tg:.3f} ms/token, "
                      f"{100 * tg / ideal:.0f}% of the bandwidth-ideal {ideal:,.0f} tok/s"
                  + (f"; llama.cpp all-GPU {100 * _med([r['decode_tps'] for r in by('llama.cpp', 1.0)]) / ideal:.0f}%"
                     if by("llama.cpp", 1.0) else "") + "."]
    if st_all:
        lines += ["", "strata-nb per run: share, rep, decode tok/s, VRAM slots, hit rate by count / by bytes (all "
                      "decode tokens), hit rate after the cache's warm-up (the first 16 decode tokens) and the best "
                      "static hit rate of the same slots over those tokens, expert MB per token, CPU expert GB/s, "
                      "load s, distinct tokens generated; host ms/token as graph launches / pool glue / engine "
                      "call (lock, context check, the mapped token read) / token end:", ""]
        for r in st_all:
            d = derive(r)
            lines.append(f"- {100 * r['share']:g}% rep {r.get('rep', 0) + 1}: {_fmt(r['decode_tps'])} tok/s, "
                         f"{d.get('slots', '-')} slots (all layers), {_pct(d.get('hit_rate'))} / "
                         f"{_pct(d.get('hit_rate_bytes'))}"
                         f", after warm-up {_pct(d.get('hit_rate_late'))}, best static {_pct(d.get('best_static_hit'))}"
                         + (f" (the cache reached {100 * d['hit_rate_late'] / d['best_static_hit']:.0f}% of it)"
                            if d.get("best_static_hit") and _ok(d.get("hit_rate_late")) else "") + ", "
                         f"{_fmt(d.get('expert_bytes_per_token', float('nan')) / 1e6, 0)} MB/token, "
                         f"{_fmt(d.get('cpu_expert_gbs'))} GB/s, load {_fmt(r.get('load_s'))} s, "
                         f"{r.get('distinct_tokens', '-')} of {r.get('n_tokens', '-')} tokens distinct; host "
                         + " / ".join(_fmt(d.get(k), 2) for k in ("launch_ms_per_token", "glue_ms_per_token",
                                                                    "call_ms_per_token", "end_ms_per_token")))
    ll_all = [r for r in runs if r["arm"] == "llama.cpp"]
    if ll_all:
        rec = ll_all[0]["records"][0]
        lines += ["", f"llama.cpp: llama-bench build {rec.get('build_commit')} ({rec.get('backends')}, "
                      f"{rec.get('gpu_info')}; flash_attn {rec.get('flash_attn')}), "
                      f"-p {ll_all[0]['n_prompt']} -n {ll_all[0]['n_gen']} -r 1 --repack 0,1 per run, after its own "
                      "warm-up run; the faster repack of each test counts; -ncmoe N keeps the experts of the first N "
                      "layers on the CPU. Decode tok/s by repack: " + "; ".join(
                          f"{100 * r['share']:.0f}% " + ", ".join(f"repack {int(bool(k))} {v:.1f}"
                                                                  for k, v in sorted(r.get("decode_all", [])))
                          for r in ll_all) + "."]
    if meta.get("skipped"):
        lines += ["", f"Not run (deadline {meta.get('deadline_s')} s): " + ", ".join(meta["skipped"])]
    if meta.get("errors"):
        last = lambda e: ([x for x in e["error"].splitlines() if x.strip()] or ["?"])[-1]  # noqa: E731
        lines += ["", "Errors (the JSON has the ends of their logs):", "",
                  *[f"- {e['run']}: {last(e)}" for e in meta["errors"]]]
    return "\n".join(lines) + "\n"


def save(out: str, meta: dict, runs: list[dict]) -> None:
    """<out>.json and <out>.md, and copies in $BENCH_MIRROR_DIR when set (the device call's $OUT: what a
    call cut short by its time limit has measured still comes back)."""
    text = json.dumps(_jsonable({"meta": meta, "runs": runs}), indent=1)
    md = f"## {meta.get('title', 'hybrid decode')}\n\n" + report(meta, runs)
    targets = [Path(out)]
    if os.environ.get("BENCH_MIRROR_DIR"):
        targets.append(Path(os.environ["BENCH_MIRROR_DIR"]) / Path(out).name)
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        Path(str(t) + ".json").write_text(text)
        Path(str(t) + ".md").write_text(md)


def machine_line(gpu: dict) -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numba

    return (f"{gpu.get('gpu', 'GPU ?')}, {cpu} ({os.cpu_count()} cores), python {platform.python_version()}, "
            f"numba {numba.__version__}, numpy {np.__version__}")


def main_bench(args) -> None:
    t_start = time.perf_counter()
    if not Path(args.model).is_file():
        raise SystemExit(f"no model file {args.model}")
    with_llama = not args.no_llama
    if with_llama and not (args.llama_bench and os.access(args.llama_bench, os.X_OK)):
        raise SystemExit(f"llama-bench not found at {args.llama_bench!r} (--llama-bench PATH or --no-llama)")
    out = args.out or str(REPO / "bench" / "results" / f"hybrid_{Path(args.model).stem}")
    mb = model_bytes(args.model)
    shares = [float(s) for s in args.shares.split(",")]
    placements = llama_placements(mb["n_layer"], shares)
    argv = [Path(sys.argv[0]).as_posix()] + sys.argv[1:]
    meta: dict = {"command": "python " + shlex.join(argv), "model_path": args.model, "model": mb,
                  "threads": args.threads, "n_prompt": args.n_prompt, "n_gen": args.n_gen, "temp": args.temp,
                  "seed": args.seed, "reps": args.reps,
                  "title": args.title or f"hybrid decode: {Path(args.model).name}",
                  "deadline_s": args.deadline_s, "skipped": [], "errors": []}
    runs: list[dict] = []

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr,
              flush=True)

    est: dict[str, list[float]] = {"llama.cpp": [], "strata-nb": []}

    def fits(kind: str) -> bool:
        if args.deadline_s is None:
            return True
        guess = max(est[kind]) if est[kind] else args.first_arm_s
        return time.perf_counter() - t_start + guess <= args.deadline_s

    def left() -> float:
        return 3600.0 if args.deadline_s is None else max(30.0, args.deadline_s - (time.perf_counter() - t_start))

    if not args.no_bandwidth:
        try:
            log("GPU read bandwidth ...")
            meta["gpubw"] = run_child(args, "gpubw", ["--gpubw-gib", str(args.gpubw_gib)], left())
            log(f"  GPU read {meta['gpubw']['best_read_gbs']:,.0f} GB/s, "
                f"copy {meta['gpubw']['best_copy_gbs']:,.0f} GB/s")
            log(f"host RAM read bandwidth, {args.threads} threads ...")
            meta["membw"] = run_child(args, "membw", ["--membw-gib", str(args.membw_gib)], left())
            log(f"  RAM read {meta['membw']['best_gbs']:.1f} GB/s")
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            meta["errors"].append({"run": "bandwidth", "error": str(e)[-3000:]})
            log(f"bandwidth FAILED: {e}")
    meta["machine"] = machine_line(meta.get("gpubw") or {})
    save(out, meta, runs)

    if args.profile_run:
        prof = args.profile_path or f"/tmp/strata-profiles/{Path(args.model).stem}.profile.npz"
        Path(prof).parent.mkdir(parents=True, exist_ok=True)
        log(f"profile run: strata-nb share {args.profile_share}, prompt seed {args.seed + 1} -> {prof}")
        try:
            r = run_child(args, "strata", ["--share", str(args.profile_share), "--prompt-seed", str(args.seed + 1),
                                           "--save-profile", prof] + (["--no-warmup"] if args.no_warmup else []),
                          left())
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:  # the arms still run, without it
            meta["errors"].append({"run": "profile run (the strata-nb arms ran without a profile)",
                                   "error": str(e)[-3000:]})
            log(f"profile run FAILED: {e}")
        else:
            r.update(profile_run=True, rep=-1)
            runs.append(r)
            meta.update(profile=prof, profile_prompt_seed=args.seed + 1, profile_share=args.profile_share)
            est["strata-nb"].append(r["wall_s"])
    for rep in range(args.reps):
        for s in shares:
            arms = (["llama.cpp"] if with_llama else []) + ["strata-nb"]
            if rep % 2:  # alternate which engine goes first
                arms.reverse()
            for arm in arms:
                name = f"{arm} {100 * s:g}% rep {rep + 1}"
                if not fits(arm):
                    meta["skipped"].append(name)
                    continue
                try:
                    if arm == "llama.cpp":
                        r = run_llama(args, s, placements[s][0], left())
                        r["placement_label"] = placements[s][1]
                        log(f"{name}: prompt {r['prompt_tps']:8.1f} tok/s  decode {r['decode_tps']:7.2f} tok/s  "
                            f"({r['wall_s']:.0f} s)")
                    else:
                        extra = ["--share", str(s), "--prompt-seed", str(args.seed)]
                        if meta.get("profile"):
                            extra += ["--profile", meta["profile"]]
                        if args.no_warmup:
                            extra.append("--no-warmup")
                        r = run_child(args, "strata", extra, left())
                        d = derive(r)
                        log(f"{name}: prompt {r['prompt_tps']:8.1f} tok/s  decode {r['decode_tps']:7.2f} tok/s  "
                            f"hit {_pct(d.get('hit_rate'))}, after warm-up {_pct(d.get('hit_rate_late'))} "
                            f"(best static {_pct(d.get('best_static_hit'))})  "
                            f"({r['wall_s']:.0f} s)")
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                    meta["errors"].append({"run": name, "error": str(e)[-3000:]})
                    log(f"{name} FAILED: {e}")
                    continue
                r["rep"] = rep
                est[arm].append(r["wall_s"])
                runs.append(r)
                save(out, meta, runs)
    meta["total_s"] = time.perf_counter() - t_start
    save(out, meta, runs)
    print(Path(out + ".md").read_text())
    log(f"wrote {out}.md and {out}.json")


# ------------------------------------------------------------------------------------------------ self-check
def _sample_llama_json() -> str:
    """llama-bench's own recorded `-o json` sample from its README (in the carried tarball or the sdist)."""
    import tarfile

    cands = [(REPO / ".gpu" / "llama.cpp.tar.gz", "llama.cpp/tools/llama-bench/README.md")]
    sd = Path(os.environ.get("STRATA_NB_CACHE") or Path.home() / ".cache" / "strata-nb") / "sdist"
    for p in sorted(sd.glob("llama_cpp_python-*.tar.gz")):
        cands.append((p, f"{p.name[:-len('.tar.gz')]}/vendor/llama.cpp/tools/llama-bench/README.md"))
    for tar, member in cands:
        if tar.is_file():
            with tarfile.open(tar) as tf:
                try:
                    text = tf.extractfile(member).read().decode()
                except KeyError:
                    continue
            m = re.search(r"### JSON\s.*?```json\n(.*?)```", text, re.DOTALL)
            if m:
                return m.group(1)
    raise SystemExit("self-check: no llama-bench README found (.gpu/llama.cpp.tar.gz or the llama-cpp-python sdist)")


def self_check() -> None:
    """No GPU and no llama-bench needed: the parsing and report paths on recorded llama-bench output, the
    best-static computation, the bytes-per-token arithmetic on a tiny synthetic file, and both bandwidth kernels'
    results (the GPU one in numba's CUDA simulator)."""
    sample = _sample_llama_json()
    parsed = parse_llama_bench("llama-bench log noise\n" + sample)
    recs = json.loads(sample)
    pp = next(r for r in recs if r["n_gen"] == 0)
    tg = next(r for r in recs if r["n_prompt"] == 0)
    assert parsed["prompt_tps"] == pp["avg_ts"] and parsed["decode_tps"] == tg["avg_ts"], parsed
    print(f"parse: prompt {parsed['prompt_tps']} tok/s (n_prompt {parsed['n_prompt']}), decode "
          f"{parsed['decode_tps']} tok/s (n_gen {parsed['n_gen']}) from llama.cpp's recorded sample")

    assert llama_placements(48)[0.5][0] == ["-ngl", "99", "-ncmoe", "24"]
    assert llama_placements(48)[0.25][0] == ["-ngl", "99", "-ncmoe", "36"]
    assert llama_placements(48)[0.0][0] == ["-ngl", "99", "-ot", "exps=CPU"]

    rng = np.random.default_rng(0)
    routed = rng.integers(0, 50, (3, 16))
    slots = [0, 5, 16]
    brute = (0 + np.sort(routed[1])[-5:].sum() + routed[2].sum()) / routed.sum()
    assert abs(best_static_hit(routed, slots) - brute) < 1e-12

    with tempfile.TemporaryDirectory() as td:
        from strata_nb.synth import write_synthetic

        f = Path(td) / "tiny.gguf"
        write_synthetic(f, "tiny", arch="qwen3moe", quant="Q8_0", seed=0)
        mb = model_bytes(str(f))
        from gguf import GGUFReader

        ts = {t.name: int(t.n_bytes) for t in GGUFReader(str(f)).tensors}
        exp = sum(v for k, v in ts.items() if "_exps." in k)
        emb_row = ts["token_embd.weight"] // mb["n_vocab"] if "output.weight" in ts else ts["token_embd.weight"]
        dense = sum(v for k, v in ts.items() if "_exps." not in k and k != "token_embd.weight") + emb_row
        assert mb["expert_bytes"] == exp and mb["dense_bytes_per_token"] == dense, (mb, exp, dense)
        assert abs(mb["expert_bytes_per_token"] - exp * mb["n_expert_used"] / mb["n_expert"]) < 1e-6
        print(f"model bytes: tiny qwen3moe, {mb['bytes_per_token']:.0f} B/token checked against gguf's reader")

        meta = {"command": "python bench/hybrid_vs_llama.py --self-check", "model_path": str(f), "model": mb,
                "threads": 15, "n_prompt": 128, "n_gen": 128, "temp": 0.8, "seed": 0, "reps": 1,
                "title": "self-check (llama.cpp's recorded README sample, no strata-nb runs)"}
        run = dict(parsed, arm="llama.cpp", share=1.0, args=["-ngl", "99"], placement_label="-ngl 99", rep=0)
        out = str(Path(td) / "check")
        save(out, meta, [run])
        md = Path(out + ".md").read_text()
        back = json.loads(Path(out + ".json").read_text())
        assert f"{pp['avg_ts']:,.1f}" in md and f"{tg['avg_ts']:,.1f}" in md, md
        assert back["runs"][0]["decode_tps"] == tg["avg_ts"]
        print("report:\n" + md)

    # 300 uint64 (a ragged tail for the 4-way unrolled loop), in the simulator: the XOR checksum is checked inside.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    here = str(Path(__file__).resolve().parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import hybrid_vs_llama as h; "
            "print(h.gpu_bandwidth(300 * 8 / 2**30, reps=1))")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "'checked': True" in p.stdout, p.stdout + p.stderr
    print("GPU read kernel: checksum right in the CUDA simulator")
    host = host_membw(2**-6, threads=2, sweeps=1)  # 16 MiB: the sum is checked inside
    print(f"host read kernel: sum right ({host['best_gbs']:.1f} GB/s on 16 MiB, not a measurement)")
    print("self-check passed")


# ------------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH", "/tmp/llama/build/bin/llama-bench"))
    ap.add_argument("--no-llama", action="store_true", help="strata-nb arms only")
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=0, help="strata-nb context (default: prompt + generated + 8)")
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0, help="prompt and sampler seed (the profile run uses seed + 1)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shares", default="1,0.5,0.25,0", help="VRAM shares of the expert weights")
    ap.add_argument("--profile-run", action="store_true",
                    help="record a routing profile on another prompt first; the strata-nb arms start from it")
    ap.add_argument("--profile-share", type=float, default=0.25, help="VRAM share of the profile run")
    ap.add_argument("--profile-path", default=None)
    ap.add_argument("--no-warmup", action="store_true", help="strata-nb: no short warm-up generate before timing")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the GPU and RAM bandwidth measurements")
    ap.add_argument("--gpubw-gib", type=float, default=4.0)
    ap.add_argument("--membw-gib", type=float, default=8.0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no run that would end past this many seconds (the longest run so far as guess)")
    ap.add_argument("--first-arm-s", type=float, default=60.0, help="the guess before any run of an arm ended")
    ap.add_argument("--out", default=None, help="output prefix (default bench/results/hybrid_<model stem>)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--self-check", action="store_true")
    # child mode
    ap.add_argument("--child", default=None, choices=["strata", "gpubw", "membw"])
    ap.add_argument("--share", type=float, default=1.0)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--save-profile", default=None)
    a = ap.parse_args()
    a.warmup = not a.no_warmup
    if a.self_check:
        self_check()
        return
    if a.child == "gpubw":
        print(json.dumps(_jsonable(gpu_bandwidth(a.gpubw_gib))))
        return
    if a.child == "membw":
        print(json.dumps(_jsonable(host_membw(a.membw_gib, a.threads))))
        return
    if a.child == "strata":
        print(json.dumps(_jsonable(strata_child(a))))
        return
    if not a.model:
        ap.error("-m/--model is required")
    main_bench(a)


if __name__ == "__main__":
    main()
