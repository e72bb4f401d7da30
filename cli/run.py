"""What each command does once its options are parsed: call the API and print."""
from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from pathlib import Path

import click
import numpy as np

from strata_nb.errors import StrataError


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _Progress:
    """A click progress bar on stderr fed by (done, total) callbacks; created on the first call."""

    def __init__(self, label: str):
        self.label = label
        self.bar = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr, show_pos=False,
                                         show_percent=True, show_eta=True)
        self.bar.update(done - self.done)
        self.done = done

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()


def _save_npy_atomic(path: str, arr: np.ndarray) -> None:
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, p)


def _check_profile_path(save_profile: str | None) -> None:
    if save_profile is not None and not Path(save_profile).resolve().parent.is_dir():
        raise StrataError(f"--save-profile: directory does not exist: {Path(save_profile).parent}")


def open_engine(m, *, ctx, threads, pack, fast, memory: dict | None = None, banner: str | None = None):
    """Load an Engine from a checked Model: progress bar, the plan printed, then the kernels warmed up."""
    from strata_nb.api import load

    fill = _Progress("filling resident experts")
    eng = load(m, pack=pack, n_ctx=ctx, threads=threads, fast=fast, progress=fill, **(memory or {}))
    fill.finish()
    try:
        if banner:
            click.echo(banner, err=True)
        _echo_plan(eng)
        _warm_up(eng)
    except BaseException:
        eng.close()
        raise
    return eng


def _save_profile_at_exit(eng, save_profile: str | None) -> None:
    if save_profile is not None:
        eng.save_profile(save_profile)
        click.echo(f"routing profile saved to {save_profile}", err=True)


def run_generate(*, model, prompt, token_ids, chat, system, n_predict, ctx, threads, pack, fast, sampler,
                 dump_logits, stats, banner: str | None = None, memory: dict | None = None,
                 save_profile: str | None = None) -> None:
    from strata_nb.api import Model

    # The whole request is checked against the file before anything is loaded (weights bound, experts read or
    # uploaded): a refused run prints its one line and nothing else. The engine checks its own options (device,
    # --vram-budget, threads, lookahead) first thing, before any of that too.
    sampler.validate()
    _check_profile_path(save_profile)
    if dump_logits is not None and not Path(dump_logits).resolve().parent.is_dir():
        raise StrataError(f"--dump-logits: directory does not exist: {Path(dump_logits).parent}")
    m = Model(model)
    if save_profile is not None:
        m.require_experts("no routing profile to save")
    toks = m.check_tokens(m.encode(prompt, chat=chat, system=system) if token_ids is None else token_ids, ctx,
                          n_predict)
    eng = open_engine(m, ctx=ctx, threads=threads, pack=pack, fast=fast, memory=memory, banner=banner)
    try:
        _generate(eng, toks, n_predict, sampler, dump_logits, stats)
        _save_profile_at_exit(eng, save_profile)
    finally:
        eng.close()


def _open_for_session(model, ctx, threads, pack, fast, memory, sampler, save_profile, chat: bool):
    """serve and chat: the file and options checked, then the engine loaded."""
    from strata_nb.api import Model, check_ctx

    sampler.validate()
    check_ctx(ctx)
    _check_profile_path(save_profile)
    m = Model(model)
    if save_profile is not None:
        m.require_experts("no routing profile to save")
    if chat and not m.gguf.get("tokenizer.chat_template"):
        raise StrataError(f"{m.path.name} has no tokenizer.chat_template: nothing to chat with")
    return open_engine(m, ctx=ctx, threads=threads, pack=pack, fast=fast, memory=memory)


def _need(*modules: str, extra: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise StrataError(f"{', '.join(missing)} not installed: pip install 'strata-nb[{extra}]'")


def run_serve(*, model, host, port, model_name, park_budget, max_queue, use_ray, replicas, ctx, threads, pack, fast,
              sampler, memory, save_profile) -> None:
    if not 0 < port < 65536:
        raise StrataError(f"--port must be in 1..65535, got {port}")
    if not park_budget >= 0:
        raise StrataError(f"--park-budget must be >= 0, got {park_budget}")
    _need("fastapi", "uvicorn", *(("ray",) if use_ray else ()), extra="serve-ray" if use_ray else "serve")
    if use_ray:
        from strata_nb.serve.ray_app import run_replicas

        if save_profile is not None:
            raise StrataError("--save-profile is not supported with --ray (one profile per replica)")
        run_replicas(model, replicas=replicas, host=host, port=port, engine={"n_ctx": ctx, "threads": threads,
                     "pack": pack, "fast": fast, **memory}, sampler=sampler, park_budget_bytes=int(park_budget * 1e9),
                     max_queue=max_queue, model_name=model_name)
        return
    import uvicorn

    from strata_nb.serve.app import create_app
    from strata_nb.serve.service import Service

    eng = _open_for_session(model, ctx, threads, pack, fast, memory, sampler, save_profile, chat=False)
    try:
        svc = Service(eng, sampler=sampler, park_budget_bytes=int(park_budget * 1e9), max_queue=max_queue,
                      model_id=model_name)
        click.echo(f"serving {svc.model_id} at http://{host}:{port}/v1 (Ctrl-C to stop)", err=True)
        # uvicorn handles SIGINT/SIGTERM: no new connections, open ones get 5 s, then their tasks are cancelled
        # (which cancels their generations). It then re-raises the signal to the handler it found: these quiet
        # ones, so that the engine thread is stopped, the profile saved and the engine closed, with exit status 0.
        quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            uvicorn.run(create_app(lambda: svc), host=host, port=port, log_level="warning",
                        timeout_graceful_shutdown=5)
        finally:
            for sig, handler in quiet.items():
                signal.signal(sig, handler)
        svc.scheduler.close()
        _save_profile_at_exit(eng, save_profile)
    finally:
        eng.close()


def run_chat(*, model, system, n_predict, ctx, threads, pack, fast, sampler, memory, save_profile) -> None:
    from strata_nb.serve.terminal import TerminalChat

    eng = _open_for_session(model, ctx, threads, pack, fast, memory, sampler, save_profile, chat=True)
    try:
        TerminalChat(eng, sampler=sampler, max_new=n_predict, system=system).run(sys.stdin)
        _save_profile_at_exit(eng, save_profile)
    finally:
        eng.close()


def _echo_plan(eng) -> None:
    lines = eng.plan.lines()
    st = eng.store
    if st is not None and st.tiered:
        how = "O_DIRECT" if st.reader.direct else "buffered (the file system refuses O_DIRECT)"
        lock = "locked in RAM" if eng.locked_bytes else "not locked (mlock not allowed)"
        lines.insert(-1, f"  SSD reads: {how}, {st.reader.threads} reader threads, lookahead {st.lookahead_k} "
                         f"experts/token; dense weights {lock}")
    vram = eng.gpu_plan.lines() if eng.gpu_plan is not None else ["VRAM: not used (CPU engine)"]
    for line in [eng.device_line, *lines, *vram]:
        click.echo(f"plan: {line}", err=True)


def run_plan(model: str, ctx: int, pack: str | None, memory: dict) -> None:
    """The plan a run would make (the same functions the engine calls), without loading the weights."""
    from strata_nb.api import check_ctx, open_model, pick_device, plan_gpu, plan_memory
    from strata_nb.experts.source import open_experts

    check_ctx(ctx)
    g, s = open_model(model)
    src = open_experts(g, pack) if s.is_moe else None
    device, line = pick_device(memory["device"], memory["vram_budget"], s)
    plan, _ = plan_memory(g, s, src, ctx, experts=memory["experts"], ram_budget=memory["ram_budget"])
    vram = (plan_gpu(g, s, src, ctx, memory["vram_budget"], memory["kv_type"]).lines() if device == "cuda"
            else ["VRAM: not used (CPU engine)"])
    click.echo(f"model {g.path.name}: {_gb(g.size)}, context {ctx}" + (f", experts from {src.path.name}" if src else ""))
    for line in [line, *plan.lines(), *vram]:
        click.echo(line)


def _generate(eng, toks: list[int], n_predict: int, sampler, dump_logits: str | None, stats: bool) -> None:
    from strata_nb.model.textstream import TextStream

    text = TextStream(eng.tokenizer)  # generated text continues the prompt, as llama.cpp prints it

    def on_token(t: int) -> None:
        piece = text.push(t)
        if piece:
            click.echo(piece, nl=False)

    res = eng.generate(toks, n_predict, sampler, on_token=on_token, keep_logits=dump_logits is not None)
    click.echo(text.flush())
    if dump_logits:
        _save_npy_atomic(dump_logits, np.concatenate(res.logits, axis=0).astype(np.float32))
    if stats:
        print_stats(eng, res)


def _warm_up(eng) -> None:
    """Compile the kernels (or load them from numba's cache) before the clocks start, on a line of its own:
    "compiling kernels ... N s", counting up in place on a terminal while a first run compiles."""
    import threading
    import time

    from strata_nb._numba_env import kernels_cached

    cold = not kernels_cached()
    what = "compiling kernels" if cold else "loading compiled kernels"
    if cold:
        click.echo(f"{what} for the quant types of this file (first run on this machine; cached in "
                   f"{os.environ.get('NUMBA_CACHE_DIR')})", err=True)
    done = threading.Event()
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(1.0):
            click.echo(f"\r{what} ... {time.perf_counter() - t0:4.0f} s", nl=False, err=True)

    ticker = threading.Thread(target=tick, daemon=True) if tty else None
    if ticker is not None:
        ticker.start()
    try:
        secs = eng.warm_up()
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
    cr = "\r" if tty else ""
    click.echo(f"{cr}{what} ... {secs:.1f} s (not in the prompt or decode times)", err=True)


def print_stats(eng, res) -> None:
    e = click.echo
    e(f"load            {eng.load_s * 1000:8.1f} ms   ({eng.threads} threads, "
      f"{'fast int8' if eng.backend.fast else 'reference float32'} kernels)", err=True)
    e(f"compile/warm-up {eng.warm_s * 1000:8.1f} ms   (kernels compiled, or loaded from numba's cache, by a "
      f"throwaway forward; not in the prompt time)", err=True)
    e(f"prompt          {res.prompt_tokens:5d} tokens in {res.prompt_s * 1000:8.1f} ms = {res.prompt_tps:8.2f} tok/s",
      err=True)
    if res.decode_steps:
        gpu_eb = res.hybrid.hit_bytes if res.hybrid is not None else 0  # experts computed from VRAM slots
        bpt = res.bytes_per_token + gpu_eb / res.decode_steps
        e(f"decode          {res.decode_steps:5d} tokens in {res.decode_s * 1000:8.1f} ms = {res.decode_tps:8.2f} tok/s"
          f" (wall clock over whole tokens)", err=True)
        e(f"weights/token   {_gb(bpt)} read ({_gb((res.expert_bytes + gpu_eb) / res.decode_steps)} routed experts, "
          f"{_gb(res.dense_bytes / res.decode_steps)} dense) -> {bpt * res.decode_tps / 1e9:.2f} GB/s", err=True)
        other = res.decode_s - res.expert_s
        e(f"decode time     expert FFNs {res.expert_s * 1000:8.1f} ms ({100 * res.expert_s / res.decode_s:4.1f}%), "
          f"rest {other * 1000:8.1f} ms ({100 * other / res.decode_s:4.1f}%)", err=True)
    for label, io, n in (("prompt experts", res.prompt_io, res.prompt_tokens), ("decode experts", res.decode_io,
                                                                                   res.decode_steps)):
        if io is not None and n and eng.store is not None and eng.store.tiered:
            for i, line in enumerate(io_lines(io, n, per="token" if label.startswith("decode") else "prompt")):
                e(f"{label if i == 0 else '':15s} {line}", err=True)
    if res.hybrid is not None and res.hybrid.tokens:  # (--dump-logits decodes through the logits path)
        for line in hybrid_lines(eng, res):
            e(line, err=True)
    e(f"stopped by      {res.stopped_by} after {len(res.tokens)} generated tokens", err=True)


def hybrid_lines(eng, res) -> list[str]:
    """The hybrid engine's decode: where each token's wall time went, who computed the experts, VRAM use."""
    h, n = res.hybrid, res.decode_steps
    ms = lambda v: f"{v * 1000 / n:7.2f} ms"  # noqa: E731
    out = [f"token time      GPU (doorbell waits) {ms(h.wait_s)} + GPU (head, sampler) {ms(h.graph_s)} + "
           f"CPU pool {ms(h.cpu_s)} + host {ms(h.host_s)} = {ms(h.wall_s)} per token",
           f"host time       graph launches {ms(h.launch_s)}, pool glue {ms(h.glue_s)}, engine call "
           f"{ms(h.call_s)}, token end {ms(h.end_s)} per token"]
    tot = h.hits + h.misses
    if tot:
        gbs = h.miss_bytes / res.expert_s / 1e9 if res.expert_s > 0 else float("nan")
        from strata_nb.runtime.gpu_backend import WARM_TOKENS  # loaded already: the hybrid engine ran

        late = h.late_hits + h.late_misses
        after = f" ({100 * h.late_hits / late:.1f}% after the first {WARM_TOKENS} tokens)" if late else ""
        out.append(f"expert hits     {100 * h.hits / tot:5.1f}% of choices{after}, "
                   f"{100 * h.hit_bytes / max(1, h.hit_bytes + h.miss_bytes):5.1f}% of bytes from VRAM; CPU pool "
                   f"{_gb(h.miss_bytes / n)} per token at {gbs:.1f} GB/s in its kernels")
    cs = getattr(eng.backend, "cache", None)
    if cs is not None:
        out.append(f"VRAM cache      {cs.stats.admitted} admitted on first use, {cs.stats.swaps} swaps, "
                   f"{_gb(cs.stats.copied_bytes)} copied")
    out += eng.backend.vram_lines()
    return out


def io_lines(io, n: int, per: str) -> list[str]:
    """Where the experts came from (per decode token, or for the whole prompt) and what the SSD did."""
    d = n if per == "token" else 1
    sv = io.served
    ram = sv["arena"] + sv["recent"]
    gbs = io.ssd_read_bytes / io.ssd_busy_s / 1e9 if io.ssd_busy_s > 0 else float("nan")
    return [f"{_gb(ram / d)} from RAM (arena {_gb(sv['arena'] / d)}, recent {_gb(sv['recent'] / d)}), "
            f"{_gb(sv['ssd'] / d)} from the SSD per {per}",
            f"SSD read {_gb(io.ssd_read_bytes / d)} per {per} at {gbs:.2f} GB/s while reading; waited "
            f"{io.read_wait_s * 1000 / d:.1f} ms per {per}",
            f"lookahead recall {100 * io.recall:.0f}% ({io.lookahead_used} of "
            f"{io.lookahead_used + io.demand_reads} file-tier experts), wasted {_gb(io.lookahead_wasted_bytes / d)} "
            f"per {per}; {io.swaps} promotions into RAM"]


def run_info(model: str, ctx: int) -> None:
    from strata_nb.api import memory_needs, open_model, pick_device
    from strata_nb.cpu_kernels import qtypes

    g, s = open_model(model)
    e = click.echo
    e(f"file            {g.path} ({_gb(g.size)})")
    e(f"device (auto)   {pick_device('auto', spec=s)[1].removeprefix('device: ')}")
    e(f"architecture    {s.arch}" + (f" (MoE: {s.n_expert} experts, top-{s.n_expert_used}, expert ffn {s.n_ff_exp}"
                                      f"{', shared expert' if s.shared_expert else ''}"
                                      f"{', gated' if s.shared_expert_gate else ''}"
                                      f"{', renormalized' if s.expert_norm else ''})" if s.is_moe else " (dense)"))
    kinds = Counter({"deltanet": "delta-net"}.get(ls.mixer, ls.mixer.replace("_", " ")) for ls in s.layers)
    e(f"layers          {s.n_layer} ({', '.join(f'{n} {k}' for k, n in kinds.items())}"
      f"{f', {s.n_nextn} MTP not run' if s.n_nextn else ''}), embedding {s.n_embd}, vocab {s.n_vocab}, "
      f"trained context {s.n_ctx_train}")
    if s.deltanet is not None:
        dn = s.deltanet
        e(f"delta-net       {dn.n_k_head} key heads of {dn.head_k_dim}, {dn.n_v_head} value heads of {dn.head_v_dim} "
          f"({'tiled' if dn.tiled else 'grouped'} over the key heads), conv {dn.conv_kernel}")
    e(f"attention       {s.n_head} heads, {s.n_head_kv} kv heads, head dim {s.head_dim}, qk-norm {s.qk_norm}, "
      f"qkv bias {'yes' if s.qkv_bias else 'no'}")
    r = s.rope
    e(f"rope            {r.style}, {r.n_rot} dims, base {r.base:g}, scaling {r.scaling}"
      + (f" x{1 / r.freq_scale:g} (orig ctx {r.n_ctx_orig})" if r.scaling != "none" else ""))
    if not s.is_moe:
        e(f"ffn             {s.n_ff}")
    mix_n: Counter = Counter()
    mix_b: Counter = Counter()
    for t in g.tensors.values():
        mix_n[t.qtype] += 1
        mix_b[t.qtype] += t.nbytes
    e("quant mix       " + ", ".join(f"{qtypes.name(q)} x{mix_n[q]} ({_gb(mix_b[q])})"
                                     for q in sorted(mix_b, key=lambda q: -mix_b[q])))
    m = memory_needs(g, s, ctx)
    e(f"weights         dense {_gb(m.dense_bytes)}, routed experts {_gb(m.expert_bytes)}")
    if s.is_moe:
        per = m.expert_bytes / (s.n_expert * sum(s.moe_layers)) * s.n_expert_used * sum(s.moe_layers)
        e(f"per token       {_gb(m.dense_bytes)} dense + {_gb(per)} of experts read (top-{s.n_expert_used})")
    state = "KV cache" + (" + recurrent states" if s.recurrent else "")
    e(f"memory for run  {_gb(m.total)} (weights mapped from the file + {state} {_gb(m.kv_bytes)} at --ctx {ctx})")


def run_pack(model: str, output: str | None, verify: bool) -> None:
    from strata_nb.experts import pack as packmod

    if verify:
        pack_path = output or packmod.default_pack_path(model)
        secs = packmod.verify_pack(pack_path, model)
        click.echo(f"{pack_path} matches {model} (every expert re-hashed in {secs:.1f} s)")
        return
    progress = _Progress("packing experts")
    path = packmod.write_pack(model, output, progress=progress)
    progress.finish()
    click.echo(f"wrote {path} ({_gb(Path(path).stat().st_size)})")


def run_synth(preset, arch, layers, quant, seed, output, router_skew: float = 0.0) -> None:
    from strata_nb.synth import write_synthetic

    progress = _Progress("writing tensors")
    summary = write_synthetic(output, preset, arch=arch, layers=layers, quant=quant, seed=seed, progress=progress,
                              router_skew=router_skew)
    progress.finish()
    size = Path(output).stat().st_size
    skew = f", router skew {router_skew:g}" if router_skew else ""
    click.echo(f"wrote {output} ({_gb(size)}): {summary.get('arch', '')} preset {preset}, {quant}, random weights"
               f"{skew}")


def demo_model_path() -> Path:
    from strata_nb._numba_env import cache_root

    return cache_root() / "demo" / "demo-qwen3moe-q4km.gguf"


def run_demo(model, prompt, n_predict, threads) -> None:
    from strata_nb.runtime.sampler import SamplerConfig

    banner = None
    if model is None:
        path = demo_model_path()
        if not path.exists():
            from strata_nb.synth import write_synthetic

            path.parent.mkdir(parents=True, exist_ok=True)
            click.echo(f"writing a small synthetic MoE (qwen3moe shapes, Q4_K_M) to {path} ...", err=True)
            write_synthetic(path, "demo", quant="Q4_K_M", seed=0)
        model = str(path)
        banner = ("demo: this model has RANDOM weights (a synthetic qwen3moe written by `strata-nb synth`);"
                  " the text is meaningless, the speed is real. Use -m MODEL.gguf for a real model.")
    run_generate(model=model, prompt=prompt, token_ids=None, chat=False, system=None, n_predict=n_predict,
                 ctx=max(512, n_predict + 256), threads=threads, pack=None, fast=True, sampler=SamplerConfig(),
                 dump_logits=None, stats=True, banner=banner)
