"""Issue benchmark: strata-nb's CPU engine vs llama.cpp on a synthetic model with published shapes (Qwen3-30B-A3B
by default).

    python bench/cpu_vs_llama.py --quant Q8_0 --layers 12 --threads 2       # ~8.0 GB file
    python bench/cpu_vs_llama.py --quant Q4_K_M --layers 12 --threads 2     # ~4.5 GB file
    python bench/cpu_vs_llama.py --quant Q4_K_M --layers 10 --vocab full    # the real 151,936-token head
    python bench/cpu_vs_llama.py --preset qwen3-next-80b-a3b --layers 8 --n-prompt 512   # ~8.0 GB, 2 attention

--vocab small (the default) keeps the real layer shapes but the small trained vocabulary, so a cut-down file reads
about the share of routed-expert bytes per token that the full-depth model does (Q8_0: experts 65% of a token's
bytes at 12 layers; the full 48-layer model with its 151k head: 59%). With --vocab full at 5-10 layers the head
is half of the bytes, which flatters neither engine's expert path. The table says what share the experts were.

Writes the synthetic GGUF once (to --dir), then runs `strata_nb.bench.run_bench` (interleaved repetitions,
medians, achieved GB/s against the measured read bandwidth) and saves the table under bench/results/.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import strata_nb  # noqa: F401  (numba settings)
from strata_nb.bench import run_bench
from strata_nb.synth import write_synthetic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="a published shape (strata-nb synth presets)")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vocab", choices=("small", "full"), default="small",
                    help="small: the trained ~900-token vocabulary; full: the real 151,936 (head and embedding)")
    ap.add_argument("--dir", default="/tmp/strata-bench")
    ap.add_argument("--out", default=None, help="default: bench/results/cpu_qwen3-30b-a3b_L{layers}_{quant}.md")
    a = ap.parse_args()
    tag = "" if a.vocab == "full" else "-sv"
    model = Path(a.dir) / f"{a.preset}-L{a.layers}-{a.quant}{tag}.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {model} ...", file=sys.stderr)
        write_synthetic(model, a.preset, layers=a.layers, quant=a.quant, seed=0,
                        small_vocab=a.vocab == "small")
    out = a.out or str(Path(__file__).parent / "results" / f"cpu_{a.preset}_L{a.layers}_{a.quant}{tag}.md")
    table = run_bench(str(model), n_prompt=a.n_prompt, n_gen=a.n_gen, threads=a.threads, reps=a.reps,
                      with_llama_cpp=True,
                      title=f"CPU decode and prompt: synthetic {a.preset} shapes, {a.layers} layers, {a.quant}, "
                            f"{a.vocab} vocabulary")
    cmd = "python bench/cpu_vs_llama.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    Path(out).write_text(table + f"\ncommand: `{cmd}`\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
