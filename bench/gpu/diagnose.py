"""Where does the hybrid engine part from the CPU engine on a real GPU? (run on the GPU machine)

    python3 bench/gpu/diagnose.py [--archs qwen3moe,qwen2moe,olmoe,mixtral] [--slots 0,4,8]

For each tiny Q4_K_M architecture file and VRAM slot count, runs one prompt through both engines (float32
reference kernels on the CPU) and prints, per layer, the relative error of the residual stream after attention
and after the FFN (max |gpu - cpu| / std(cpu)), then checks every dense matrix of the file through the GPU matmul
(prompt tiles, T=19, and matrix-vector, T=1) against the CPU's float32 kernel. The first row that goes wrong
names the op to look at.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from strata_nb.api import Engine, gpu_fixed_bytes, open_model  # noqa: E402
from strata_nb.cpu_kernels.matmul import matmul_f32  # noqa: E402
from strata_nb.cpu_kernels.qtypes import name as qname  # noqa: E402
from strata_nb.cuda_kernels import matmul as kmm  # noqa: E402
from strata_nb.experts.source import open_experts  # noqa: E402
from strata_nb.experts.vram_cache import slot_layout  # noqa: E402
from strata_nb.model.weights import Linear  # noqa: E402
from strata_nb.runtime import cpu_backend, gpu_backend  # noqa: E402
from strata_nb.synth import write_synthetic  # noqa: E402

CTX = 64
PROMPT = list(range(3, 60, 3))


def budget_for(path, slots: int) -> float:
    g, _ = open_model(path)
    src = open_experts(g)
    per_layer = sum(slot_layout(src, l).slot_bytes for l in src.layers)
    return gpu_fixed_bytes(path, CTX) + slots * per_layer + per_layer // 2


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / (b.std() + 1e-30))


def cpu_trace(path):
    rec = []
    orig = cpu_backend.CPUBackend.attention

    def attention(self, lw, layer, x, session, cos, sin):
        out = orig(self, lw, layer, x, session, cos, sin)
        rec.append(("in", layer, x.copy()))
        rec.append(("mid", layer, x + out))
        return out

    cpu_backend.CPUBackend.attention = attention
    try:
        eng = Engine(path, device="cpu", n_ctx=CTX, fast=False)
        logits = eng.logits(PROMPT)
    finally:
        cpu_backend.CPUBackend.attention = orig
    return rec, logits


def gpu_trace(path, slots):
    rec = []
    orig = gpu_backend.GPUBackend._attention

    def _attention(self, l, T):
        def snap(tag):
            def op(st):
                st.synchronize()
                rec.append((tag, l, self.x[:T].copy_to_host()))
            return op
        return [snap("in")] + orig(self, l, T) + [snap("mid")]

    gpu_backend.GPUBackend._attention = _attention
    try:
        eng = Engine(path, device="cuda", n_ctx=CTX, fast=False, vram_budget=budget_for(path, slots))
        try:
            logits = eng.logits(PROMPT)
            weights = eng.weights
        finally:
            eng.close()
    finally:
        gpu_backend.GPUBackend._attention = orig
    return rec, logits, weights


def check_matrices(weights) -> None:
    stream = cuda.stream()
    rng = np.random.default_rng(0)
    mats = []
    for i, lw in enumerate(weights.layers):
        for f, v in vars(lw).items():
            if isinstance(v, Linear):
                mats.append((f"L{i}.{f}", v))
    mats.append(("output", weights.output))
    worst = []
    for nm, m in mats:
        rows = np.ascontiguousarray(m.rows)
        kdim = kmm._row_elems(m.qtype, rows.shape[1])
        for T in (19, 1):
            x = rng.standard_normal((T, kdim)).astype(np.float32)
            want = np.empty((T, rows.shape[0]), np.float32)
            matmul_f32(m.qtype, rows, x, want)
            out = cuda.device_array((T, rows.shape[0]), np.float32)
            kmm.matmul(m.qtype, cuda.to_device(rows), cuda.to_device(x), out, T, stream)
            got = out.copy_to_host()
            e = rel(got, want)
            worst.append((e, nm, qname(m.qtype), rows.shape, T))
    worst.sort(reverse=True)
    for e, nm, q, shp, T in worst[:8]:
        print(f"    matmul {nm:24s} {q:5s} {str(shp):14s} T={T:2d}: rel err {e:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="qwen3moe,qwen2moe,olmoe,mixtral")
    ap.add_argument("--slots", default="0,4,8")
    ap.add_argument("--preset", default="tiny", help="tiny (Q4_K_M), or micro (Q8_0: for the simulator)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    for arch in a.archs.split(","):
        path = tmp / f"{arch}.gguf"
        if a.preset == "micro":
            write_synthetic(path, "micro", quant="Q8_0", seed=3)
        else:
            write_synthetic(path, "tiny", arch=arch, quant="Q4_K_M", seed=3)
        crec, clog = cpu_trace(path)
        for slots in (int(s) for s in a.slots.split(",")):
            grec, glog, weights = gpu_trace(path, slots)
            print(f"== {arch}, {slots} slots: logits rel err {rel(glog, clog):.3e}")
            for (tag, l, c), (tag2, l2, g) in zip(crec, grec):
                assert (tag, l) == (tag2, l2)
                print(f"    layer {l} {tag:3s}: {rel(g, c):.3e}   per token max: "
                      f"{' '.join(f'{rel(g[t], c[t]):.0e}' for t in range(0, len(c), 3))}")
        check_matrices(weights)


if __name__ == "__main__":
    main()
