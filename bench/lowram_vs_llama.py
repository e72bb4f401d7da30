"""Low-RAM benchmark: a model bigger than RAM, strata-nb's tiered experts vs llama.cpp's mmap, CPU only.

Each arm runs in its own process, one after the other (they would fight for the same RAM), with the page cache
dropped before each one where this user may (root), so every arm starts from the disk. Arms, per repetition:
  strata-auto   strata-nb with its automatic memory plan (tiered: resident arena + O_DIRECT reads + lookahead)
  strata-mmap   strata-nb with experts read in place from the memory map (the A/B arm)
  llama.cpp     llama-cpp-python, mmap, same threads, same prompt tokens
Decoding samples at --temp 0.8 with one seeded inverse-CDF sampler for every engine: greedy decoding of a
random-weight model repeats one token, so every engine would route the same experts at every step and the
decode would measure nothing of the file tier. The disk's own
sequential O_DIRECT read bandwidth is measured first. With --profile-run, a first strata-nb run on another prompt
records a routing profile and the strata arms start from it (--expert-profile).

  python bench/lowram_vs_llama.py -m /work/big/q30-Q8_0.gguf --threads 2 --reps 2 --out bench/results/lowram.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ALIGN = 4096


def disk_bandwidth(path: str, gb: float = 2.0, chunk: int = 4 << 20) -> tuple[float, dict[int, float]]:
    """The disk's O_DIRECT read bandwidth: `gb` GB of sequential 4 MiB reads split over N readers (one region
    each), for N in 8, 16 and 32 (this virtual disk serves parallel requests faster than one stream);
    returns the best GB/s and all of them."""
    import mmap
    import threading

    size = os.path.getsize(path)
    res = {}
    for threads in (8, 16, 32):
        per = int(gb * 1e9 / threads) // chunk * chunk
        starts = [(size // threads * i + threads * (1 << 30)) % (size - per - chunk) // ALIGN * ALIGN
                  for i in range(threads)]
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

        def run(off: int) -> None:
            buf = mmap.mmap(-1, chunk)
            mv = memoryview(buf)
            for o in range(off, off + per, chunk):
                os.preadv(fd, [mv], o)

        ts = [threading.Thread(target=run, args=(st,)) for st in starts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res[threads] = per * threads / (time.perf_counter() - t0) / 1e9
        os.close(fd)
    return max(res.values()), res


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- one arm (child)
def sample(logits: np.ndarray, temp: float, rng: np.random.Generator) -> int:
    """Greedy at temp 0, else inverse-CDF sampling of softmax(logits / temp): the same code for both engines."""
    if temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temp
    p = np.exp(z - z.max())
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1]), len(c) - 1))


def child(args) -> dict:
    import resource

    prompt = [int(t) for t in np.random.default_rng(args.prompt_seed).integers(10, args.vocab, args.n_prompt)]
    rng = np.random.default_rng(1000 + args.prompt_seed)
    out: dict = {"arm": args.arm}
    t0 = time.perf_counter()
    if args.arm == "llama.cpp":
        from strata_nb.bench import LlamaCppRunner

        r = LlamaCppRunner(args.model, args.threads, args.n_prompt + args.n_gen + 8, args.n_prompt)
        out["load_s"] = time.perf_counter() - t0
        step = lambda toks, pos: r._decode(toks, pos)  # noqa: E731
    else:
        from strata_nb.api import load

        kw = {"experts": "mmap"} if args.arm == "strata-mmap" else {"lookahead_k": args.lookahead}
        if args.profile:
            kw["expert_profile"] = args.profile
        eng = load(args.model, n_ctx=args.n_prompt + args.n_gen + 8, threads=args.threads, **kw)
        out["load_s"] = time.perf_counter() - t0
        out["plan"] = eng.plan.lines()
        session = eng.new_session()
        st = eng.store
        step = lambda toks, pos: eng.backend.forward(session, np.asarray(toks, np.int64))[-1]  # noqa: E731
        io0 = st.io.copy()
    t1 = time.perf_counter()
    tok = sample(step(prompt, 0), args.temp, rng)
    out["prompt_s"] = time.perf_counter() - t1
    toks = [tok]
    if args.arm != "llama.cpp":
        io1, counts1 = st.io.copy(), st.profile.run_counts.copy()
    t2 = time.perf_counter()
    for i in range(args.n_gen - 1):
        tok = sample(step([tok], args.n_prompt + i), args.temp, rng)
        toks.append(tok)
    out["decode_s"] = time.perf_counter() - t2
    out["decode_steps"] = args.n_gen - 1
    out["tokens"] = toks
    if args.arm != "llama.cpp":
        io2 = st.io.copy()
        out["prompt_io"], out["decode_io"] = dataclasses.asdict(io1 - io0), dataclasses.asdict(io2 - io1)
        if st.tiered:
            n = st.arena_slots
            # The best static placement of the same arena: the n (layer, expert) pairs this decode used most.
            flat = np.sort((st.profile.run_counts - counts1).reshape(-1))[::-1]
            out["best_static_hit"] = float(flat[:n].sum() / flat.sum())
            out["arena_slots"] = n
        if args.save_profile:
            eng.save_profile(args.save_profile)
        eng.close()
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return out


# ------------------------------------------------------------------------------------------------- parent
def memory_cgroup(gb: float) -> str:
    """A memory cgroup (v1 or v2) limited to gb GB: the arms run inside it, as on a machine with that much RAM.
    Page cache is charged to the cgroup, so llama.cpp's mmap is held to the same limit as strata-nb's plan."""
    v2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() else None
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / "strata-bench"
        d.mkdir(exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(str(int(gb * 1e9)))
        return str(d / "tasks")
    if v2 is None and Path("/sys/fs/cgroup/cgroup.procs").exists():
        v2 = Path("/sys/fs/cgroup")
    if v2 is None:
        raise SystemExit("--cgroup-gb: no memory cgroup controller found")
    d = v2 / "strata-bench"
    d.mkdir(exist_ok=True)
    (d / "memory.max").write_text(str(int(gb * 1e9)))
    return str(d / "cgroup.procs")


def run_arm(args, arm: str, prompt_seed: int, profile: str | None = None, save_profile: str | None = None) -> dict:
    dropped = drop_caches()
    cmd = [sys.executable, __file__, "--child", arm, "-m", args.model, "--threads", str(args.threads),
           "--n-prompt", str(args.n_prompt), "--n-gen", str(args.n_gen), "--prompt-seed", str(prompt_seed),
           "--vocab", str(args.vocab), "--temp", str(args.temp)]
    if args.lookahead is not None:
        cmd += ["--lookahead", str(args.lookahead)]
    if profile:
        cmd += ["--profile", profile]
    if save_profile:
        cmd += ["--save-profile", save_profile]
    t0 = time.perf_counter()
    enter = None
    if args.cgroup_tasks:
        enter = lambda: Path(args.cgroup_tasks).write_text(str(os.getpid()))  # noqa: E731
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, preexec_fn=enter)
    if p.returncode != 0:
        raise SystemExit(f"{arm} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    res["cache_dropped"] = dropped
    tg = res["decode_steps"] / res["decode_s"]
    print(f"  {arm:12s} load {res['load_s']:6.1f} s  prompt {res['prompt_s']:6.1f} s  decode {tg:6.3f} tok/s  "
          f"peak RSS {res['peak_rss_gb']:.1f} GB", file=sys.stderr, flush=True)
    return res


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def table(args, results: dict[str, list[dict]], disk_gbs: float, title: str) -> list[str]:
    g = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    lines = [f"### {title}", "",
             "| arm | load s | prompt s | decode tok/s | vs llama.cpp | GB/token RAM | GB/token SSD | SSD GB/s "
             "(of disk) | read wait ms/token | lookahead recall | RAM hit rate (arena) | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = _med([r["decode_steps"] / r["decode_s"] for r in results.get("llama.cpp", [])])
    for arm, rs in results.items():
        tg = _med([r["decode_steps"] / r["decode_s"] for r in rs])
        row = [arm, f"{_med([r['load_s'] for r in rs]):.1f}", f"{_med([r['prompt_s'] for r in rs]):.1f}",
               f"{tg:.3f}", f"{tg / base:.2f}x" if base == base else "-"]
        if "decode_io" in rs[0] and arm != "strata-mmap":
            io = [r["decode_io"] for r in rs]
            steps = [r["decode_steps"] for r in rs]
            ram = _med([(i["served"]["arena"] + i["served"]["recent"]) / n for i, n in zip(io, steps)])
            ssd = _med([i["served"]["ssd"] / n for i, n in zip(io, steps)])
            bw = _med([i["ssd_read_bytes"] / i["ssd_busy_s"] / 1e9 for i in io if i["ssd_busy_s"] > 0])
            wait = _med([1000 * i["read_wait_s"] / n for i, n in zip(io, steps)])
            rec = _med([i["lookahead_used"] / max(1, i["lookahead_used"] + i["demand_reads"]) for i in io])
            tot = [sum(i["served"].values()) for i in io]
            hit = _med([(i["served"]["arena"] + i["served"]["recent"]) / t for i, t in zip(io, tot)])
            arena = _med([i["served"]["arena"] / t for i, t in zip(io, tot)])
            row += [g(ram), g(ssd), f"{bw:.2f} ({100 * bw / disk_gbs:.0f}%)", f"{wait:.0f}", f"{100 * rec:.0f}%",
                    f"{100 * hit:.1f}% ({100 * arena:.1f}%)"]
        else:
            row += ["-"] * 6
        row.append(f"{max(r['peak_rss_gb'] for r in rs):.1f}")
        lines.append("| " + " | ".join(row) + " |")
    s = results.get("strata-auto", [])
    if s and "best_static_hit" in s[0]:
        lines += ["", f"strata-auto arena: {s[0]['arena_slots']} blobs; the best static placement of that many "
                      f"(layer, expert) pairs for the decode's own routing would hit "
                      f"{100 * _med([r['best_static_hit'] for r in s]):.1f}% (by count and bytes: one blob size)."]
        lines += ["", "plan (strata-auto, first repetition):", "", *[f"    {x}" for x in s[0]["plan"]]]
    toks = {arm: rs[0]["tokens"] for arm, rs in results.items()}
    if "llama.cpp" in toks:
        for arm, t in toks.items():
            if arm != "llama.cpp":
                same = sum(a == b for a, b in zip(t, toks["llama.cpp"]))
                lines.append(f"\n{arm}: {same} of {len(t)} generated tokens identical to llama.cpp's; "
                             f"{len(set(t))} distinct tokens generated")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arms", default="strata-auto,strata-mmap,llama.cpp")
    ap.add_argument("--profile-run", action="store_true", help="record a routing profile first and use it")
    ap.add_argument("--title", default="low-RAM decode")
    ap.add_argument("--cgroup-gb", type=float, default=None,
                    help="run every arm inside a memory cgroup of this many GB (a smaller machine)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--lookahead", type=int, default=None, help="strata-nb --lookahead (experts per token; "
                                                                    "default: the engine's, the router's top-k + 2)")
    ap.add_argument("--temp", type=float, default=0.8,
                    help="sampling temperature, the same seeded sampler for every engine (0: greedy)")
    # child mode
    ap.add_argument("--child", default=None)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--save-profile", default=None)
    args = ap.parse_args()
    if args.child:
        args.arm = args.child
        print(json.dumps(child(args)))
        return
    from strata_nb.api import open_model

    _, spec = open_model(args.model)
    args.vocab = spec.n_vocab
    args.cgroup_tasks = memory_cgroup(args.cgroup_gb) if args.cgroup_gb else None
    drop_caches()
    disk, per_n = disk_bandwidth(args.model)
    disk_txt = ", ".join(f"{n} readers {v:.2f}" for n, v in per_n.items())
    print(f"disk: {disk:.2f} GB/s O_DIRECT ({disk_txt})", file=sys.stderr, flush=True)
    profile = None
    if args.profile_run:
        profile = str(Path(args.model).with_suffix(".profile.npz"))
        print("profile run (prompt seed 1)", file=sys.stderr)
        run_arm(args, "strata-auto", prompt_seed=1, save_profile=profile)
    arms = args.arms.split(",")
    results: dict[str, list[dict]] = {a: [] for a in arms}
    for rep in range(args.reps):
        print(f"rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
        for a in arms:
            results[a].append(run_arm(args, a, prompt_seed=0, profile=profile if a == "strata-auto" else None))
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    head = [f"`{cmd}`", "",
            f"model `{args.model}` ({os.path.getsize(args.model) / 1e9:.1f} GB) on a machine with "
            f"{_ram_gb():.1f} GB RAM, no swap"
            + (f", every arm inside a {args.cgroup_gb:g} GB memory cgroup (page cache charged to it)"
               if args.cgroup_gb else "") + f"; {args.threads} threads; prompt {args.n_prompt} tokens, {args.n_gen} "
            f"generated ({'greedy' if args.temp <= 0 else f'sampled at temperature {args.temp}, the same seeded sampler for every engine'}); {args.reps} repetitions per arm, interleaved, medians; page cache dropped before "
            f"every arm: {all(r['cache_dropped'] for rs in results.values() for r in rs)}.",
            f"Disk: {disk:.2f} GB/s, the best of sequential 4 MiB O_DIRECT reads by 8, 16 and 32 readers ({disk_txt} "
            "GB/s), measured first.",
            "GB/token RAM/SSD: expert bytes per decode token served from RAM (resident arena + recent reads) and "
            "read from the SSD; SSD GB/s: bytes read over the time reads were in flight.", ""]
    lines = head + table(args, results, disk, args.title)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        p = Path(args.out)
        p.write_text((p.read_text() + "\n" if p.exists() else "") + text)


def _ram_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / 1e9


if __name__ == "__main__":
    main()
