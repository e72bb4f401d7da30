"""What a CUDA graph launch costs the host, and how fast a gate opens (GPU machine).

The hybrid engine launches one graph per segment (a MoE layer with CPU misses ends one), and at 50% VRAM the
benchmark put those launches at ~60 us each (2.9 ms per token for 49 segments), against ~1.5 ms for the single
~440-kernel graph of a token with every expert in VRAM. This probe separates what the launch costs from what is
around it:

- host time of cuGraphLaunch for graphs of N trivial kernels (N = 1, 9, 50, 440), with the stream idle, with the
  same graph still running (launched twice in a row), through cuda-python and through libcuda by ctypes;
- the same with the kernels of numba's real argument lists (an array argument is 5 + 2 * ndim parameters);
- the same while numba's OpenMP workers spin (the CPU pool ran just before, as in the engine);
- a gate's latency: a graph waiting on a word of mapped memory (cuda_rt.gate) before a kernel that writes a
  mapped flag; from the host's write to the flag seen, against a plain graph launch to the flag seen.

    python3 bench/gpu/launch_probe.py [--reps 200]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time

import numpy as np
from numba import cuda, njit, prange

from strata_nb.runtime.cuda_rt import Graph, device_pointer, gate, host_view


@cuda.jit
def _tiny(a):
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        a[0] += 1


@cuda.jit
def _many_args(a, b, c, d, e, f, g, h, i, j):  # ten 2-D arrays: the parameter count of the engine's kernels
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        a[0, 0] += b[0, 0] + c[0, 0] + d[0, 0] + e[0, 0] + f[0, 0] + g[0, 0] + h[0, 0] + i[0, 0] + j[0, 0]


@cuda.jit
def _spin(a, n):  # keeps the GPU busy: n dependent multiply-adds on one thread (~2 ns each)
    if cuda.threadIdx.x == 0:
        x = np.float32(a[1])
        for _ in range(n):
            x = x * np.float32(1.0000001) + np.float32(1e-7)
        a[0] += 1
        if x == np.float32(-1.0):  # never: keeps the loop
            a[1] = 1


@cuda.jit
def _flag(f, v):
    if cuda.threadIdx.x == 0:
        f[0] = v[0]
        v[0] += 1


@njit(parallel=True, cache=False)
def _pool_like(buf):
    for i in prange(buf.shape[0]):
        s = 0.0
        for k in range(20000):
            s += (i * k) % 7
        buf[i] = s


def med_us(xs) -> float:
    return statistics.median(xs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    from cuda.bindings import driver as drv

    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    st = cuda.stream()
    a = cuda.to_device(np.zeros(4, np.int64))
    arrs = [cuda.to_device(np.zeros((4, 4), np.float32)) for _ in range(10)]
    _tiny[1, 32, st](a)
    _many_args[1, 32, st](*arrs)
    _spin[1, 32, st](a, 10)
    st.synchronize()
    sh = int(st.handle)  # cuda-bindings handles convert to their address with int(); getPtr() is not it

    def graph(n, many):
        def rec(s):
            for _ in range(n):
                if many:
                    _many_args[1, 32, s](*arrs)
                else:
                    _tiny[1, 32, s](a)
        return Graph(rec, st, f"{n} kernels")

    print(f"host time of one graph launch, us (median of {args.reps}); stream idle unless said")
    print("| kernels | args | idle (cuda-python) | idle (ctypes) | back-to-back | while spinning OpenMP workers |")
    print("|---|---|---|---|---|---|")
    buf = np.zeros(15, np.float64)
    _pool_like(buf)
    for many in (False, True):
        for n in (1, 9, 50, 440):
            g = graph(n, many)
            h = int(g._exec)
            idle, raw, b2b, spin = [], [], [], []
            for _ in range(args.reps):
                st.synchronize()
                t0 = time.perf_counter()
                g.launch(st)
                idle.append(time.perf_counter() - t0)
            for _ in range(args.reps):
                st.synchronize()
                t0 = time.perf_counter()
                libcuda.cuGraphLaunch(ctypes.c_void_p(h), ctypes.c_void_p(sh))
                raw.append(time.perf_counter() - t0)
            st.synchronize()
            for _ in range(min(args.reps, 50)):
                t0 = time.perf_counter()
                g.launch(st)
                b2b.append(time.perf_counter() - t0)
            st.synchronize()
            for _ in range(min(args.reps, 50)):
                st.synchronize()
                _pool_like(buf)  # the workers spin for GOMP_SPINCOUNT after the region
                t0 = time.perf_counter()
                g.launch(st)
                spin.append(time.perf_counter() - t0)
            st.synchronize()
            print(f"| {n} | {'10 arrays' if many else '1 array'} | {med_us(idle):.1f} | {med_us(raw):.1f} | "
                  f"{med_us(b2b):.1f} | {med_us(spin):.1f} |")
            g.close()

    # a launch of a graph whose previous launch is still running (the engine's launch-ahead at 100%)
    gs = Graph(lambda s: _spin[1, 32, s](a, 500_000), st, "spin")  # ~1 ms
    g9 = graph(9, True)
    busy, busy_same = [], []
    for _ in range(20):
        st.synchronize()
        gs.launch(st)
        t0 = time.perf_counter()
        g9.launch(st)
        busy.append(time.perf_counter() - t0)
        gs.launch(st)
        t0 = time.perf_counter()
        gs.launch(st)
        busy_same.append(time.perf_counter() - t0)
    st.synchronize()
    print(f"\n9-kernel graph launched behind a running ~1-ms graph: {med_us(busy):.1f} us; the running graph "
          f"itself launched again: {med_us(busy_same):.1f} us")

    # a background Python thread that sleeps in short polls (the VRAM cache's copier waits on a queue instead)
    stop = threading.Event()

    def poller():
        while not stop.is_set():
            time.sleep(0.0002)

    th = threading.Thread(target=poller, daemon=True)
    th.start()
    xs = []
    for _ in range(args.reps):
        st.synchronize()
        t0 = time.perf_counter()
        g9.launch(st)
        xs.append(time.perf_counter() - t0)
    stop.set()
    th.join()
    print(f"9-kernel graph with a Python thread polling time.sleep(0.2 ms): {med_us(xs):.1f} us")

    # gate latency: the host's write of the gate word to the flag the kernel behind it writes, seen on the host
    word = cuda.mapped_array(1, np.uint32)
    wv = host_view(word)
    wv[0] = 0
    flag = cuda.mapped_array(1, np.int64)
    fv = host_view(flag)
    fv[0] = -1
    cnt = cuda.to_device(np.zeros(1, np.int64))
    addr = device_pointer(word)

    def gated(s):
        gate(s, addr)
        _flag[1, 32, s](flag, cnt)

    gg = Graph(gated, st, "gate + flag")
    gf = Graph(lambda s: _flag[1, 32, s](flag, cnt), st, "flag")
    lat_gate, lat_launch = [], []
    expect = 0
    for _ in range(args.reps):
        st.synchronize()
        gg.launch(st)
        time.sleep(0.0005)  # the GPU's front end is now polling the word
        t0 = time.perf_counter()
        wv[0] = 1
        while fv[0] != expect:
            if time.perf_counter() - t0 > 1.0:
                raise SystemExit("gate probe: the flag never came")
        lat_gate.append(time.perf_counter() - t0)
        expect += 1
        st.synchronize()
        t0 = time.perf_counter()
        gf.launch(st)
        while fv[0] != expect:
            if time.perf_counter() - t0 > 1.0:
                raise SystemExit("launch probe: the flag never came")
        lat_launch.append(time.perf_counter() - t0)
        expect += 1
    st.synchronize()
    print(f"gate opened by the host -> kernel behind it seen done: {med_us(lat_gate):.1f} us (p90 "
          f"{np.percentile(lat_gate, 90) * 1e6:.1f}); graph launched -> kernel seen done: {med_us(lat_launch):.1f} us")
    print(f"driver: {drv.cuDriverGetVersion()[1]}")


if __name__ == "__main__":
    main()
