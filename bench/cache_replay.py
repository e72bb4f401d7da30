"""The VRAM expert cache's hit rate without a GPU: a routing trace recorded with the CPU engine, replayed through
the cache's placement policy (admission on first use into free slots, then every adapt_every tokens
vram_cache.choose_swaps on decayed counts), against the best static placement of the same slots.

    python bench/cache_replay.py -m MODEL [--layers-x 4] [--shares 0.5,0.25] [--swaps-per-layer 2]

The trace: a 128-token prompt, then 128 tokens sampled at temperature 0.8 (as bench/hybrid_vs_llama.py runs).
Copies are taken to finish by the end of the token that scheduled them (admissions) or the next one (swaps: they
wait for the table upload); on the GPU machine a prompt's admissions take a few tokens to copy, so the replay is
an upper bound early on. --layers-x N makes a deeper model from a shallow file: N copies of its layers, each with
its expert ids permuted (a 12-layer file stands in for 48 layers; the swap budget's behaviour depends on depth).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_vs_llama import best_static_hit  # noqa: E402

from strata_nb.api import Engine  # noqa: E402
from strata_nb.experts.vram_cache import choose_swaps  # noqa: E402
from strata_nb.runtime import cpu_backend  # noqa: E402
from strata_nb.runtime.gpu_backend import WARM_TOKENS  # noqa: E402
from strata_nb.runtime.sampler import SamplerConfig  # noqa: E402


def record(model: str, n_prompt: int, n_gen: int) -> tuple[list[list[np.ndarray]], int, int]:
    """[forward][layer] -> ids [T, k] of a prompt and n_gen decode steps, the layer count, the expert count."""
    rec: list[tuple[int, np.ndarray]] = []
    orig = cpu_backend.CPUBackend.routed_experts

    def hook(self, layer, a, ids, wts, out, record=True):
        rec.append((layer, np.array(ids)))
        return orig(self, layer, a, ids, wts, out, record)

    eng = Engine(model, device="cpu", n_ctx=n_prompt + n_gen + 8)
    eng.warm_up()
    cpu_backend.CPUBackend.routed_experts = hook
    try:
        prompt = np.random.default_rng(0).integers(100, eng.spec.n_vocab - 1, n_prompt).tolist()
        eng.generate(prompt, n_gen, SamplerConfig(temperature=0.8, seed=0))
    finally:
        cpu_backend.CPUBackend.routed_experts = orig
        eng.close()
    layers = sorted({l for l, _ in rec})
    nl = len(layers)
    return [[ids for _, ids in rec[i:i + nl]] for i in range(0, len(rec), nl)], nl, eng.spec.n_expert


def deepen(fw: list[list[np.ndarray]], n_expert: int, times: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(1)
    perms = [np.arange(n_expert)] + [rng.permutation(n_expert) for _ in range(times - 1)]
    return [[p[ids] for p in perms for ids in f] for f in fw]


def replay(fw: list[list[np.ndarray]], n_expert: int, slots: int, adapt_every: int = 4, decay: float = 0.7,
           swaps_per_layer: int = 2) -> tuple[float, float, float, float]:
    """(hit rate over the decode steps, after the first WARM_TOKENS of them, best static over those, swaps per
    decode token after those: each is one expert copied into VRAM)."""
    nl = len(fw[0])
    table = np.full((nl, n_expert), -1, np.int32)
    slot_expert = np.full((nl, slots), -1, np.int64)
    loading = np.zeros((nl, n_expert), bool)
    counts = np.zeros((nl, n_expert))
    routed = np.zeros((nl, n_expert), np.int64)
    pending: list[tuple[int, int, int, int]] = []  # (layer, slot, expert, token at whose end it lands)
    hits = np.zeros(2, np.int64)
    swaps = 0
    total = np.zeros(2, np.int64)
    for tok, f in enumerate(fw):
        step = tok - 1  # forward 0 is the prompt
        for l, ids in enumerate(f):
            hit = table[l, ids] >= 0
            if step >= 0:
                late = int(step >= WARM_TOKENS)
                for w in {0, late}:
                    hits[w] += hit.sum()
                    total[w] += hit.size
                if late:
                    np.add.at(routed[l], ids.ravel(), 1)
            np.add.at(counts[l], ids.ravel(), 1)
            free = list(np.flatnonzero(slot_expert[l] == -1))
            for e in np.unique(ids[~hit]):
                if not free:
                    break
                if not loading[l, e]:
                    s = free.pop(0)
                    slot_expert[l, s], loading[l, e] = -2, True
                    pending.append((l, s, int(e), tok))
        for l, s, e, at in [p for p in pending if p[3] <= tok]:
            table[l, e], slot_expert[l, s], loading[l, e] = s, e, False
        pending = [p for p in pending if p[3] > tok]
        if (tok + 1) % adapt_every == 0:
            counts *= decay
            for l in range(nl):
                for s, e in choose_swaps(slot_expert[l], table[l], loading[l], counts[l], swaps_per_layer):
                    table[l, slot_expert[l, s]] = -1
                    slot_expert[l, s], loading[l, e] = -2, True
                    pending.append((l, s, e, tok + 1))
                    swaps += tok > WARM_TOKENS
    late_steps = max(len(fw) - 1 - WARM_TOKENS, 1)
    return hits[0] / total[0], hits[1] / total[1], best_static_hit(routed, [slots] * nl), swaps / late_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--layers-x", type=int, default=1)
    ap.add_argument("--shares", default="0.5,0.25")
    ap.add_argument("--swaps-per-layer", default="2")
    ap.add_argument("--adapt-every", default="4", help="tokens between adaptation steps (a list)")
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=128)
    a = ap.parse_args()
    fw, nl, ne = record(a.model, a.n_prompt, a.n_gen)
    if a.layers_x > 1:
        fw = deepen(fw, ne, a.layers_x)
    print(f"trace: {a.model}, {len(fw[0])} layers ({nl} x {a.layers_x}), {ne} experts, prompt {a.n_prompt} + "
          f"{len(fw) - 1} decode steps; hit rates over the decode steps, after the first {WARM_TOKENS} of them, "
          "and the best static placement of the same slots over those")
    for share in (float(x) for x in a.shares.split(",")):
        for every in (int(x) for x in a.adapt_every.split(",")):
            for b in (int(x) for x in a.swaps_per_layer.split(",")):
                h, hl, best, sw = replay(fw, ne, int(round(share * ne)), adapt_every=every, swaps_per_layer=b)
                print(f"share {share:4.2f}, every {every:2d} tokens {b:3d} swaps a layer: hit {100 * h:5.1f}%, after "
                      f"warm-up {100 * hl:5.1f}%, best static {100 * best:5.1f}% -> {100 * hl / best:5.1f}% of it; "
                      f"{sw:5.1f} swaps per token")


if __name__ == "__main__":
    main()
