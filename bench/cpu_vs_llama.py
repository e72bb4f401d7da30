"""Issue benchmark: strata-nb's CPU engine vs llama.cpp on a synthetic qwen3moe with Qwen3-30B-A3B shapes.

    python bench/cpu_vs_llama.py --quant Q4_K_M --layers 10 --threads 2     # ~3.9 GB file
    python bench/cpu_vs_llama.py --quant Q8_0 --layers 5 --threads 2        # ~3.6 GB file

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
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/strata-bench")
    ap.add_argument("--out", default=None, help="default: bench/results/cpu_qwen3-30b-a3b_L{layers}_{quant}.md")
    a = ap.parse_args()
    model = Path(a.dir) / f"qwen3-30b-a3b-L{a.layers}-{a.quant}.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {model} ...", file=sys.stderr)
        write_synthetic(model, "qwen3-30b-a3b", layers=a.layers, quant=a.quant, seed=0)
    out = a.out or str(Path(__file__).parent / "results" / f"cpu_qwen3-30b-a3b_L{a.layers}_{a.quant}.md")
    table = run_bench(str(model), n_prompt=a.n_prompt, n_gen=a.n_gen, threads=a.threads, reps=a.reps,
                      with_llama_cpp=True,
                      title=f"CPU decode and prompt: synthetic Qwen3-30B-A3B shapes, {a.layers} layers, {a.quant}")
    cmd = "python bench/cpu_vs_llama.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    Path(out).write_text(table + f"\ncommand: `{cmd}`\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
