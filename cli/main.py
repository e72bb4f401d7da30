"""strata-nb command line: parse options, call the API, print. No model logic lives here."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from strata_nb.errors import StrataError


def _fail(msg: str, code: int = 1) -> None:
    click.echo(f"strata-nb: error: {msg}", err=True)
    sys.exit(code)


class _Group(click.Group):
    """Every user-facing error becomes one line on stderr and a non-zero exit, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except StrataError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except MemoryError:
            _fail("out of memory (try a smaller --ctx or a smaller model)")
        except OSError as e:
            _fail(f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e))
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, SystemExit):
            raise
        except Exception as e:  # a bug: still one line, the traceback on request
            if os.environ.get("STRATA_NB_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set STRATA_NB_DEBUG=1 for a traceback)", 2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata-nb")
def main() -> None:
    """Run Mixture-of-Experts language models from GGUF files on ordinary machines."""


# ---------------------------------------------------------------------------------------------- generate
def _sampling_options(f):
    opts = [
        click.option("--temp", "temperature", type=float, default=0.0, show_default=True,
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-k", type=int, default=40, show_default=True),
        click.option("--top-p", type=float, default=0.95, show_default=True),
        click.option("--min-p", type=float, default=0.05, show_default=True),
        click.option("--repeat-penalty", type=float, default=1.0, show_default=True),
        click.option("--repeat-last-n", type=int, default=64, show_default=True),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="Subtracted from a token's logit per occurrence in the last --repeat-last-n tokens."),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="Subtracted once from the logit of a token in the last --repeat-last-n tokens."),
        click.option("--seed", type=int, default=None, help="Seed for sampling: the same seed, the same text."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _memory_options(f):
    opts = [
        click.option("--experts", type=click.Choice(["auto", "mmap", "tiered"]), default="auto", show_default=True,
                     help="Where routed experts are read from. auto: in place from the memory map when they fit "
                          "the RAM budget, else tiered (hottest resident in RAM, the rest read from the SSD "
                          "ahead of need); mmap: always in place (the page cache decides)."),
        click.option("--ram-budget", type=float, default=None, metavar="GB",
                     help="RAM this run may use (default: available RAM minus a reserve for the system)."),
        click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
                     help="auto: the hybrid GPU engine when numba.cuda finds a GPU, else the CPU engine."),
        click.option("--vram-budget", type=float, default=None, metavar="GB",
                     help="GPU memory this run may use: dense weights, KV cache, activations and expert slots "
                          "(default: free memory minus a reserve; hybrid engine only)."),
        click.option("--kv-type", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
                     help="The hybrid engine's KV cache: f16 as llama.cpp, or f32 (twice the memory; attention "
                          "exact to the CPU engine's float32)."),
        click.option("--expert-profile", type=click.Path(dir_okay=False), default=None,
                     help="Routing profile (from --save-profile): fill the resident experts hottest first."),
        click.option("--lookahead", type=int, default=None,
                     help="Experts per token predicted for the next layer and read ahead (0: off; default: the "
                          "model's top-k + 2)."),
        click.option("--save-profile", type=click.Path(dir_okay=False), default=None,
                     help="Save the routing profile (loaded counts plus this run's) here at exit."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _memory_kwargs(device, experts, ram_budget, vram_budget, expert_profile, lookahead, kv_type="f16") -> dict:
    return {"device": device, "experts": experts, "ram_budget": None if ram_budget is None else ram_budget * 1e9,
            "vram_budget": None if vram_budget is None else vram_budget * 1e9, "expert_profile": expert_profile,
            "lookahead_k": lookahead, "kv_type": kv_type}


def _engine_options(f):
    """What every command that loads an engine takes: context, threads, pack, kernels and the memory options."""
    opts = [
        click.option("--ctx", type=int, default=4096, show_default=True, help="Context length (KV cache size)."),
        click.option("--threads", type=int, default=None, help="CPU threads (default: all cores)."),
        click.option("--pack", default=None, type=click.Path(),
                     help="Expert pack (default: one beside the GGUF, if any)."),
        click.option("--kernels", type=click.Choice(["fast", "reference"]), default="fast", show_default=True,
                     help="fast: int8 activations; reference: float32 activations (the accuracy reference)."),
    ]
    f = _memory_options(f)
    for o in reversed(opts):  # listed before the memory options, as generate always listed them
        f = o(f)
    return f


def _take_engine(opts: dict) -> dict:
    """The engine's keyword arguments, popped from a command's options (_engine_options); save_profile is left."""
    memory = _memory_kwargs(*(opts.pop(k) for k in ("device", "experts", "ram_budget", "vram_budget",
                                                     "expert_profile", "lookahead", "kv_type")))
    return {"ctx": opts.pop("ctx"), "threads": opts.pop("threads"), "pack": opts.pop("pack"),
            "fast": opts.pop("kernels") == "fast", "memory": memory}


def _take_sampler(opts: dict):
    """The SamplerConfig of a command's sampling options (_sampling_options), popped from opts."""
    from strata_nb.runtime.sampler import SamplerConfig

    return SamplerConfig(**{k: opts.pop(k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                                      "repeat_last_n", "frequency_penalty", "presence_penalty",
                                                      "seed")})


def _parse_token_list(s: str) -> list[int]:
    try:
        return [int(t) for t in s.replace(",", " ").split()]
    except ValueError:
        raise StrataError(f"--tokens must be integers separated by commas or spaces, got {s!r}") from None


@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False), help="GGUF model file.")
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read the prompt from a file.")
@click.option("--tokens", default=None, help="Prompt as token ids (comma or space separated).")
@click.option("--chat", is_flag=True, help="Render the prompt with the model's chat template.")
@click.option("--system", default=None, help="System prompt (with --chat).")
@click.option("-n", "--n-predict", type=int, default=128, show_default=True, help="Tokens to generate.")
@_engine_options
@_sampling_options
@click.option("--dump-logits", type=click.Path(dir_okay=False), default=None,
              help="Save float32 [positions, vocab] logits of every prompt and generated position (.npy).")
@click.option("--stats", is_flag=True, help="Print timing and bandwidth statistics to stderr.")
def generate(model, prompt, prompt_file, tokens, chat, system, n_predict, dump_logits, stats, **opts):
    """Generate text from a prompt."""
    from strata_nb.cli.run import run_generate

    sources = [s for s in (prompt, prompt_file, tokens) if s is not None]
    if len(sources) != 1:
        raise StrataError("give exactly one of -p/--prompt, --prompt-file, --tokens")
    if tokens is not None and chat:
        raise StrataError("--chat needs text (-p or --prompt-file), not --tokens")
    if n_predict < 0:
        raise StrataError(f"-n must be >= 0, got {n_predict}")
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise StrataError(f"prompt file not found: {prompt_file}") from None
    engine = _take_engine(opts)
    run_generate(model=model, prompt=prompt, token_ids=_parse_token_list(tokens) if tokens is not None else None,
                 chat=chat, system=system, n_predict=n_predict, sampler=_take_sampler(opts),
                 dump_logits=dump_logits, stats=stats, save_profile=opts.pop("save_profile"), **engine)


# ------------------------------------------------------------------------------------------------- serve
@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False), help="GGUF model file.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--model-name", default=None, help="The model id clients name (default: the file name's stem).")
@click.option("--park-budget", type=float, default=2.0, show_default=True, metavar="GB",
              help="Host RAM for kept conversation states (least recently used dropped first).")
@click.option("--max-queue", type=int, default=16, show_default=True,
              help="Requests that may wait for the engine; more are refused with 503 and Retry-After.")
@click.option("--ray", "use_ray", is_flag=True, help="Run --replicas engines behind one endpoint with Ray Serve.")
@click.option("--replicas", type=int, default=2, show_default=True, help="Engines with --ray (one per process).")
@_engine_options
@_sampling_options
def serve(model, host, port, model_name, park_budget, max_queue, use_ray, replicas, **opts):
    """An OpenAI-compatible HTTP server (chat and completions, streamed or not) with kept conversations.
    The sampling options are the defaults a request's own fields override."""
    from strata_nb.cli.run import run_serve

    engine = _take_engine(opts)
    run_serve(model=model, host=host, port=port, model_name=model_name, park_budget=park_budget,
              max_queue=max_queue, use_ray=use_ray, replicas=replicas, sampler=_take_sampler(opts),
              save_profile=opts.pop("save_profile"), **engine)


# -------------------------------------------------------------------------------------------------- chat
@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False), help="GGUF model file.")
@click.option("--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", type=int, default=512, show_default=True, help="Most tokens per answer.")
@_engine_options
@_sampling_options
def chat(model, system, n_predict, **opts):
    """An interactive chat in the terminal: /reset, /save FILE, /load FILE, /stats, /quit."""
    from strata_nb.cli.run import run_chat

    if n_predict < 1:
        raise StrataError(f"-n must be >= 1, got {n_predict}")
    engine = _take_engine(opts)
    run_chat(model=model, system=system, n_predict=n_predict, sampler=_take_sampler(opts),
             save_profile=opts.pop("save_profile"), **engine)


# -------------------------------------------------------------------------------------------------- info
@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False))
@click.option("--ctx", type=int, default=4096, show_default=True, help="Context length for the memory estimate.")
def info(model, ctx):
    """Architecture, dimensions, quant mix and the memory a run needs."""
    from strata_nb.cli.run import run_info

    run_info(model, ctx)


# -------------------------------------------------------------------------------------------------- plan
@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False))
@click.option("--ctx", type=int, default=4096, show_default=True, help="Context length (KV cache size).")
@click.option("--pack", default=None, type=click.Path(), help="Expert pack (default: one beside the GGUF, if any).")
@click.option("--experts", type=click.Choice(["auto", "mmap", "tiered"]), default="auto", show_default=True)
@click.option("--ram-budget", type=float, default=None, metavar="GB", help="RAM the run may use (default: automatic).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--vram-budget", type=float, default=None, metavar="GB",
              help="GPU memory the run may use (default: automatic; hybrid engine only).")
@click.option("--kv-type", type=click.Choice(["f16", "f32"]), default="f16", show_default=True,
              help="The hybrid engine's KV cache element type.")
def plan(model, ctx, pack, experts, ram_budget, device, vram_budget, kv_type):
    """Print the memory plan a run would use: RAM, SSD and (hybrid engine) VRAM expert slots."""
    from strata_nb.cli.run import run_plan

    run_plan(model, ctx, pack, _memory_kwargs(device, experts, ram_budget, vram_budget, None, None, kv_type))


# -------------------------------------------------------------------------------------------------- pack
@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", default=None, type=click.Path(), help="Pack file (default: beside the GGUF).")
@click.option("--verify", is_flag=True, help="Check an existing pack against the GGUF (full hash) instead.")
def pack(model, output, verify):
    """Write the per-expert blob pack of a MoE GGUF (4 KiB aligned, bound to its GGUF)."""
    from strata_nb.cli.run import run_pack

    run_pack(model, output, verify)


# ------------------------------------------------------------------------------------------------- synth
@main.command()
@click.option("--preset", default="tiny", show_default=True,
              help="tiny, micro, demo, tiny-moe64, qwen3-30b-a3b, qwen3-next-80b-a3b, qwen3-235b-a22b, "
                   "olmoe-1b-7b, mixtral-8x7b")
@click.option("--arch", default=None, help="Architecture for the tiny preset (qwen3moe, qwen2moe, llama, ...).")
@click.option("--layers", type=int, default=None, help="Keep only the first N layers.")
@click.option("--quant", default="Q4_K_M", show_default=True, help="Q4_K_M or one type: Q8_0, BF16, Q4_K, ...")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--router-skew", type=float, default=0.0, show_default=True, metavar="ALPHA",
              help="Skewed MoE routing: the expert of rank r is selected with frequency ~ (r+1)^-ALPHA "
                   "(real models: ~1.2); calibrated by a short pilot run. 0: the plain random router.")
def synth(preset, arch, layers, quant, seed, output, router_skew):
    """Write a random-weight GGUF with real shapes (for tests and benchmarks)."""
    from strata_nb.cli.run import run_synth

    run_synth(preset, arch, layers, quant, seed, output, router_skew)


# ------------------------------------------------------------------------------------------------- bench
@main.command()
@click.option("-m", "--model", required=True, type=click.Path(dir_okay=False))
@click.option("-p", "--n-prompt", type=int, default=128, show_default=True)
@click.option("-n", "--n-gen", type=int, default=64, show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--reps", type=int, default=3, show_default=True)
@click.option("--llama-cpp/--no-llama-cpp", default=True, show_default=True,
              help="Also run llama.cpp (llama-cpp-python) on the same file, interleaved.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the markdown table here.")
def bench(model, n_prompt, n_gen, threads, reps, llama_cpp, out):
    """Prompt and decode speed, side by side with llama.cpp, medians of interleaved repetitions."""
    from strata_nb.bench import run_bench

    run_bench(model, n_prompt=n_prompt, n_gen=n_gen, threads=threads, reps=reps, with_llama_cpp=llama_cpp,
              out=out)


# -------------------------------------------------------------------------------------------------- demo
@main.command()
@click.option("-m", "--model", default=None, type=click.Path(dir_okay=False),
              help="A GGUF to run (default: a small synthetic MoE written once to the user cache).")
@click.option("-p", "--prompt", default="The quick brown fox", show_default=True)
@click.option("-n", "--n-predict", type=int, default=48, show_default=True)
@click.option("--threads", type=int, default=None)
def demo(model, prompt, n_predict, threads):
    """The main job on an embedded default: generate with --stats from a small synthetic MoE."""
    from strata_nb.cli.run import run_demo

    run_demo(model, prompt, n_predict, threads)


if __name__ == "__main__":
    main()
