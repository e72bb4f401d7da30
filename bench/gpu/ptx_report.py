"""Compile the decode kernels for an H200 (sm_90) without a GPU: registers, spills and shared memory per kernel.

    CUDA_HOME=/usr/local/cuda-13.0 /work/cudavenv/bin/python bench/gpu/ptx_report.py [--sass DIR]

A kernel that does not compile for a real GPU (numba's CUDA simulator accepts things the real compiler refuses, such
as an array shape given as an expression inside the kernel) fails here, at no device time. Needs a CUDA toolkit's
libnvvm and ptxas (the development machine has /usr/local/cuda-13.0) and, in a virtual environment of its own (the
test environment runs the simulator):
    python -m venv --system-site-packages /work/cudavenv
    /work/cudavenv/bin/pip install numba-cuda==0.30.4 "nvidia-cuda-nvrtc>=13,<14" "nvidia-cuda-cuobjdump>=13,<14" \
        nvidia-cuda-nvdisasm
--sass DIR also writes each kernel's SASS there (cuobjdump + nvdisasm from those wheels).
Run from the repository root; the strata_nb.{cpu,cuda}_kernels imports resolve through links made in a temporary
copy of the package layout (as bench/gpu/setup.sh does on the GPU machine).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CC = (9, 0)


def _package_layout() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="strata-ptx-"))
    pkg = tmp / "strata_nb"
    pkg.mkdir()
    for f in (ROOT / "strata_nb").iterdir():
        if f.name not in ("cli", "cpu_kernels", "cuda_kernels"):
            (pkg / f.name).symlink_to(f)
    for d in ("cli", "cpu_kernels", "cuda_kernels"):
        (pkg / d).symlink_to(ROOT / d)
    sys.path.insert(0, str(tmp))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", help="write each kernel's SASS into this folder")
    a = ap.parse_args()
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    _package_layout()
    from numba import cuda, typeof
    import numba.cuda.dispatcher as disp

    # device functions ask the current device for its compute capability: there is none here
    disp.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)
    from strata_nb.cpu_kernels.qtypes import F32, Q4_K, Q6_K
    from strata_nb.cuda_kernels import attention as A
    from strata_nb.cuda_kernels import matmul as M
    from strata_nb.cuda_kernels import ops as O

    tools = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "nvidia" / "cu13" / "bin"
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0"))
    ptxas = shutil.which("ptxas") or str(cuda_home / "bin" / "ptxas")
    out = Path(a.sass) if a.sass else Path(tempfile.mkdtemp(prefix="strata-ptx-out-"))
    out.mkdir(parents=True, exist_ok=True)

    def report(fn, args, tag: str) -> None:
        sig = tuple(typeof(x) for x in args)
        try:
            ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=CC)
        except Exception as e:  # noqa: BLE001 - the point is to show it
            print(f"{tag:24s} DOES NOT COMPILE: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            return
        p = out / f"{tag}.ptx"
        p.write_text(ptx)
        r = subprocess.run([ptxas, f"-arch=sm_{CC[0]}{CC[1]}", "-v", str(p), "-o", str(out / f"{tag}.cubin")],
                           capture_output=True, text=True)
        info = " ".join(ln.split(":", 1)[-1].strip() for ln in r.stderr.splitlines()
                        if "Used" in ln or "spill" in ln)
        print(f"{tag:24s} {info}")
        if a.sass:
            env = dict(os.environ, PATH=f"{tools}:{os.environ.get('PATH', '')}")
            s = subprocess.run([str(tools / "cuobjdump"), "-sass", str(out / f"{tag}.cubin")], capture_output=True,
                               text=True, env=env)
            (out / f"{tag}.sass").write_text(s.stdout + s.stderr)

    u8 = np.zeros(16, np.uint8)
    u16, u32, f16v = np.zeros(16, np.uint16), np.zeros(16, np.uint32), np.zeros(16, np.float16)
    f32 = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    i32 = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    f16 = lambda *s: np.zeros(s, np.float16)  # noqa: E731
    D, F, QD = 2048, 768, 4096
    rb4, rb6, rbo, rbf = D // 256 * 144, D // 256 * 210, QD // 256 * 144, F // 256 * 210
    m4 = (u8, u32, f16v, rb4, 8, f32(1, 8), 0)
    q8x = (np.zeros((1, D // 4), np.uint32), f32(1, D // 32), f32(1, D // 16))  # the int8 form written (q8_out)
    for warps, rows in sorted({M._mv_shape(D, 5120), M._mv_shape(D, 128), M._mv_shape(QD, D)}):
        fn = M._dense_fn(((Q4_K, 4), (Q4_K, 4), (Q6_K, 2)), D, rows, warps, True)
        report(fn, (f32(1, D), f32(D), 1e-6, f32(1, D), 0, *m4, 1, *m4, 1, u8, u16, f16v, rb6, 8, f32(1, 8), 0,
                    *q8x), f"dense_{warps}x{rows}")
    fr = M._dense_fn(((F32, 4),), D, 1, M._mv_shape(D, 128)[0], True)
    mr = (u8, u32, f16v, 4 * D, 128, f32(1, 128), 0)
    report(fr, (f32(1, D), f32(D), 1e-6, f32(1, D), 1, *mr, 1, *mr, 0, *mr, *q8x), "router_norm")
    report(M._gate_up_fn((Q4_K, 4), (Q4_K, 4), D, M.MV_ROWS),
           (u8, u32, f16v, u8, u32, f16v, 100, 0, 0, rb4, rb4, F, i32(128), i32(1, 8), f32(1, D), f32(8, F), 1),
           "moe_gate_up")
    report(M._down_fn((Q6_K, 2), F, M.MV_ROWS_DOWN),
           (u8, u16, f16v, 100, 0, rbf, D, i32(128), i32(1, 8), f32(1, 8), f32(8, F), f32(1, D), 1), "moe_down")
    report(M._tiled_fn(Q4_K, 4), (u8, u32, f16v, rbo, QD // 16, D, f32(8, QD).view(np.uint64), f32(8, D), 8, 0),
           "prompt_tile")
    report(O._qk_rope_kv_k, (f32(1, QD), f32(1, 512), f32(1, 512), f32(128), f32(128), 1, 1e-6, np.zeros(64), 1.0,
                             True, 128, 32, 4, 128, f16(4, 64, 128), f16(4, 64, 128), i32(1), 1), "qk_rope_kv")
    i64 = np.zeros(1, np.int64)
    report(O._route_topk_k, (f32(1, 128), 8, True, 1.0, i32(1, 8), f32(1, 8), 1, 1, f32(1, D), i32(128), f32(1, D),
                             i32(1, 8), f32(1, 8), i32(1, 8), i32(1), i64, i64), "route_topk")
    part, fused, _ = A._kernels(128, A.DECODE_HEADS, A.SHORT[0], A._GPU_WARPS, False)
    long_only, _, _ = A._kernels(128, A.DECODE_HEADS, A.DECODE_HEADS, A._GPU_WARPS, False)
    att = (f32(1, QD), f16(4, 64, 128), f16(4, 64, 128), i32(1), 0.1, f32(32, 64), f32(32, 64), f32(32, 64, 128),
           i32(32), f32(1, QD), 64, 8, 2, 64, 4, 32, 448)
    report(part, att + (f32(1, QD), f32(1, QD), f32(1), f32(1), 0, 0.0, f32(1), 1.0, False, 0), "attention_decode")
    report(long_only, att + (f32(1, QD), f32(1, QD), f32(1), f32(1), 0, 0.0, f32(1), 1.0, False, 0),
           "attention_decode_long")
    report(fused, att + (f32(1, 512), f32(1, 512), f32(128), f32(128), 1, 1e-6, np.zeros(64), 1.0, True, 128),
           "attention_decode_rope")
    from strata_nb.cuda_kernels import prefetch as P
    report(P._touch_k, (u8, u32[:1]), "l2_touch")
    report(P._touch_slots_k, (u8, 100, 0, 50, i32(128), i32(1, 8), u32[:1]), "l2_touch_slots")


if __name__ == "__main__":
    main()
