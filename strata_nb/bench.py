"""`strata-nb bench`: strata-nb and llama.cpp on the same GGUF, interleaved repetitions, medians.

llama.cpp runs through llama-cpp-python's low-level API with its extra CPU buffer types off (they crash on the
development VMs; see shared/reference/oracles.md), the same thread count and the same prompt tokens.
"""
from __future__ import annotations

import ctypes
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from strata_nb.errors import StrataError


@dataclass
class RunTimes:
    prompt_s: float
    decode_s: float
    decode_steps: int
    bytes_per_token: float = float("nan")
    expert_bytes_per_token: float = float("nan")  # of bytes_per_token: the routed experts' weights


class StrataRunner:
    name = "strata-nb"

    def __init__(self, model: str, threads: int | None, n_ctx: int):
        from strata_nb.api import load

        self.engine = load(model, n_ctx=n_ctx, threads=threads)

    def run(self, prompt: list[int], n_gen: int) -> RunTimes:
        from strata_nb.runtime.sampler import SamplerConfig

        res = self.engine.generate(prompt, n_gen, SamplerConfig(temperature=0.0))
        # A run that stops early (an end-of-generation id) would flatter nobody: decode stays per step.
        return RunTimes(res.prompt_s, res.decode_s, res.decode_steps, res.bytes_per_token,
                        res.expert_bytes / res.decode_steps if res.decode_steps else float("nan"))


_LOG_SINK = None  # llama.cpp keeps the ctypes callback pointer: it must outlive every call


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, model: str, threads: int, n_ctx: int, n_batch: int):
        try:
            import llama_cpp as L
        except ImportError:
            raise StrataError("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
        self.L = L
        global _LOG_SINK
        if _LOG_SINK is None:  # llama.cpp's load log would bury the table
            _LOG_SINK = L.llama_log_callback(lambda level, text, user_data: None)
            L.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(model.encode(), mp)
        if not self.model:
            raise StrataError(f"llama.cpp could not load {model}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise StrataError("llama.cpp could not create a context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def _decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == len(tokens) - 1
        if self.L.llama_decode(self.ctx, b) != 0:
            raise StrataError("llama_decode failed")
        ptr = self.L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def run(self, prompt: list[int], n_gen: int) -> RunTimes:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        logits = self._decode(prompt, 0)
        tok = int(np.argmax(logits))
        prompt_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        steps = 0
        for i in range(n_gen - 1):
            logits = self._decode([tok], len(prompt) + i)
            tok = int(np.argmax(logits))
            steps += 1
        return RunTimes(prompt_s, time.perf_counter() - t1, steps)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def _pmd_share(arr: np.ndarray) -> str:
    """The share of the file mapping under arr mapped in 2 MiB pages (FilePmdMapped in /proc/self/smaps)."""
    lo, hi = arr.ctypes.data, arr.ctypes.data + arr.nbytes
    pmd_kb, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                    a, b = (int(v, 16) for v in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and head == "FilePmdMapped:":
                    pmd_kb += int(line.split()[1])
    except (OSError, ValueError):
        return "an unknown share"
    return f"{100 * pmd_kb * 1024 / arr.nbytes:.0f}%"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_bench(model: str, *, n_prompt: int = 128, n_gen: int = 64, threads: int | None = None, reps: int = 3,
              with_llama_cpp: bool = True, out: str | None = None, title: str | None = None) -> str:
    """Interleave strata-nb and llama.cpp repetitions on one file; print (and optionally write) a markdown table."""
    import click

    from strata_nb.cpu_kernels.membw import read_sweep

    n_ctx = n_prompt + n_gen + 8
    ours = StrataRunner(model, threads, n_ctx)
    threads = ours.engine.threads
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, ours.engine.spec.n_vocab, n_prompt)]
    runners = [ours]
    if with_llama_cpp:
        runners.append(LlamaCppRunner(model, threads, n_ctx, n_prompt))
    click.echo(f"warming up ({', '.join(r.name for r in runners)}) ...", err=True)
    for r in runners:  # compile / first-touch the mapping outside the timed repetitions
        r.run(prompt[:8], 2)
    times: dict[str, list[RunTimes]] = {r.name: [] for r in runners}
    # Two ceilings, measured between the repetitions (this VM drifts): anonymous memory (huge pages where the
    # kernel gives them) and the model file's own page-cache mapping, which is how the weights are read here.
    anon = np.ones(1 << 27, np.uint64)
    data = ours.engine.gguf.data
    mapped = data[: data.shape[0] // 8 * 8].view(np.uint64)
    read_sweep(anon[:1024])
    read_sweep(mapped[:1024])
    bw_anon: list[float] = []
    bw_map: list[float] = []
    for i in range(reps):
        bw_anon.append(read_sweep(anon))
        bw_map.append(read_sweep(mapped))
        for r in runners:
            times[r.name].append(r.run(prompt, n_gen))
            t = times[r.name][-1]
            click.echo(f"rep {i + 1}/{reps} {r.name:10s} prompt {n_prompt / t.prompt_s:8.2f} tok/s   decode "
                       f"{t.decode_steps / t.decode_s:8.2f} tok/s", err=True)
    bw, bwm = _median(bw_anon), _median(bw_map)
    bpt = _median([t.bytes_per_token for t in times["strata-nb"]])
    ebpt = _median([t.expert_bytes_per_token for t in times["strata-nb"]])
    rows = []
    med = {}
    for name, ts in times.items():
        pp = _median([n_prompt / t.prompt_s for t in ts])
        tg = _median([t.decode_steps / t.decode_s for t in ts])
        med[name] = (pp, tg)
        gbs = bpt * tg / 1e9
        rows.append(f"| {name} | {pp:.2f} | {tg:.2f} | {bpt / 1e6:.1f} | {gbs:.2f} | {100 * gbs / bw:.0f}% | "
                    f"{100 * gbs / bwm:.0f}% |")
    lines = [
        f"## {title or 'strata-nb vs llama.cpp'}",
        "",
        f"model `{model}`; {threads} threads; prompt {n_prompt} tokens, {n_gen} generated (greedy); "
        f"{reps} interleaved repetitions, medians; {platform.processor() or platform.machine()}, "
        f"python {sys.version.split()[0]}",
        "",
        f"Read bandwidth measured between the repetitions (parallel sums, {threads} threads): anonymous memory "
        f"{bw:.1f} GB/s, the model file's page-cache mapping {bwm:.1f} GB/s ({_pmd_share(data)} of the file "
        "mapped in 2 MiB pages: how the file came into the page cache decides that, for both engines).",
        "",
        f"Weights read per decoded token: {bpt / 1e6:.1f} MB, of which routed experts {ebpt / 1e6:.1f} MB "
        f"({100 * ebpt / bpt:.0f}%).",
        "",
        "| engine | prompt tok/s | decode tok/s | MB read/token | achieved GB/s | of anonymous-memory bandwidth "
        "| of mapped-file bandwidth |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    if with_llama_cpp:
        (pp0, tg0), (pp1, tg1) = med["strata-nb"], med["llama.cpp"]
        lines += ["", f"ratios strata-nb / llama.cpp: decode {tg0 / tg1:.2f}x, prompt {pp0 / pp1:.2f}x",
                  "llama.cpp: llama-cpp-python low-level API, CPU only, use_extra_bufts=False "
                  "(the repacking buffer types crash on these VMs)."]
        runners[1].close()
    table = "\n".join(lines) + "\n"
    click.echo(table)
    if out:
        from pathlib import Path

        Path(out).write_text(table)
    return table
