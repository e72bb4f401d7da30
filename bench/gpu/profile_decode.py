"""Per-kernel times of one hybrid decode token on the GPU (run on the GPU machine).

    python3 bench/gpu/profile_decode.py -m MODEL [--share 1.0] [--reps 200]

Builds the T=1 decode program (every expert in VRAM by default), then times each launch of it alone: the op
repeated `reps` times captured in one CUDA graph, CUDA events around a replay (the position is not advanced, so
every launch does the same work; replayed launches cost ~1 us each, as in the decode graphs).
Prints the ops of the first layer and of the head in program order with microseconds per launch, the sum per
layer, and the whole token as one replay of the captured graphs: the gap between the sum of kernels and the graph
is launch overhead.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from strata_nb.api import Engine  # noqa: E402
from strata_nb.runtime.cuda_rt import Graph  # noqa: E402
from strata_nb.runtime.sampler import SamplerConfig  # noqa: E402


def replay_us(fn, st, reps: int, name: str = "bench") -> float:
    """Microseconds per launch of fn(stream): `reps` launches captured in one CUDA graph, CUDA events around a
    replay (after one untimed replay)."""
    g = Graph(lambda s: [fn(s) for _ in range(reps)], st, name)
    g.launch(st)
    st.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record(st)
    g.launch(st)
    e1.record(st)
    e1.synchronize()
    g.close()
    return 1e3 * cuda.event_elapsed_time(e0, e1) / reps


def label(op) -> str:
    try:
        src = inspect.getsource(op).strip()
    except OSError:
        return repr(op)
    m = src.split("lambda st:", 1)[-1].strip()
    return m[:90]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--vram-budget-gb", type=float, default=None)
    a = ap.parse_args()
    eng = Engine(a.model, device="cuda", n_ctx=4096,
                 vram_budget=a.vram_budget_gb * 1e9 if a.vram_budget_gb else None)
    res = eng.generate([5, 17, 101, 3, 250, 42, 7], 16, SamplerConfig(temperature=0.0))
    b = eng.backend
    print(f"decode {res.decode_steps} tokens: {1e3 * res.decode_s / max(res.decode_steps, 1):.3f} ms/token "
          f"(hybrid breakdown graph {1e3 * b.hybrid.graph_s / max(b.hybrid.tokens, 1):.3f} ms)")

    def work():
        segs = b._decode
        st = b.stream
        rows = []
        ops = [op for seg in segs for op in seg.ops]
        n_layer = b.spec.n_layer
        for i, op in enumerate(ops):
            lab = label(op)
            if "advance" in lab or "ring" in lab or hasattr(op, "forks") or hasattr(op, "joins"):
                continue  # the prefetch branch's fork and join only make sense inside a segment
            rows.append((i, lab, replay_us(op, st, a.reps, f"op {i}")))
        # the whole token as graph replays (position restored afterwards)
        pos = b.pos.copy_to_host()
        st.synchronize()
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            for seg in segs:
                seg.launch(st)
            b.pos.copy_to_device(pos, stream=st)
        st.synchronize()
        graph_ms = 1e3 * (time.perf_counter() - t0) / n
        return rows, graph_ms, n_layer

    rows, graph_ms, n_layer = b._call(work)
    total = sum(r[2] for r in rows)
    print(f"{len(rows)} launches per token, kernels alone {total / 1e3:.3f} ms, one token replayed from graphs "
          f"{graph_ms:.3f} ms ({n_layer} layers)")
    per = len(rows) // max(n_layer, 1)
    for i, lab, us in rows[: per + 2] + rows[-6:]:
        print(f"  {i:4d} {us:8.2f} us  {lab}")
    eng.close()


if __name__ == "__main__":
    main()
