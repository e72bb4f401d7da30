"""L2 prefetch: kernels that read one byte of every 32-byte sector of some weight bytes, so that the sectors are in
the GPU's L2 cache (50 MB on an H200) when the kernel that needs them runs.

Decode kernels are latency-bound: each waits on a few dependent rounds of memory loads, and a round from HBM takes
about twice as long as one from L2 (bench/gpu/profile_decode.py: a layer's kernels replayed alone, weights
L2-resident, take about half of their share of a real token). The engine launches these on a second stream that
branches off the decode graph (the next layer's dense matrices and the chosen experts' down matrices while the
current layer computes), meant to cost bandwidth, which decode leaves idle, and no time on the critical path.
Measured on the H200 they cost time: the host waited 6.77 ms a token for the GPU with them against 6.01 without
(likely because their blocks take SM slots the decode kernels then wait for; not measured), so the engine
leaves them off unless STRATA_NB_PREFETCH=1.

Each warp's XOR of the bytes it read goes to out[0] with one atomic (the loads are kept, and a test can check them).
Launch helpers never allocate, copy or synchronize (they are captured into CUDA graphs).
"""
from __future__ import annotations

from numba import config, cuda, int32, uint32, uint64

SIM = bool(config.ENABLE_CUDASIM)
SECTOR_SHIFT = 5  # 32-byte L2 sectors
# One block of one thread in the simulator (a simulated thread is a Python thread); on a GPU few blocks, each
# thread with 4 loads in flight: enough to stream a layer's ~20 MB well within the time the layer computes.
PF_BLOCKS, PF_THREADS = (1, 1) if SIM else (64, 256)
_U = uint64


if SIM:
    @cuda.jit(device=True)
    def _xor_out(out, acc):
        cuda.atomic.xor(out, 0, acc)
else:
    @cuda.jit(device=True)
    def _xor_out(out, acc):
        """One atomic per warp: the lanes' values XOR-reduced by shuffles first."""
        v = int32(acc)  # numba's shuffles take signed integers
        for s in (16, 8, 4, 2, 1):
            v ^= cuda.shfl_xor_sync(0xFFFFFFFF, v, s)
        if (cuda.threadIdx.x & 31) == 0:
            cuda.atomic.xor(out, 0, uint32(v))


@cuda.jit(device=True)
def _sectors(w, base, nsec, i, step):
    """XOR of byte base + (s << 5) of w for s = i, i + step, ... < nsec (4 independent loads at a time)."""
    acc = uint32(0)
    while i + 3 * step < nsec:
        acc ^= (uint32(w[_U(base + (i << SECTOR_SHIFT))]) ^ uint32(w[_U(base + ((i + step) << SECTOR_SHIFT))])) ^ \
            (uint32(w[_U(base + ((i + 2 * step) << SECTOR_SHIFT))]) ^
             uint32(w[_U(base + ((i + 3 * step) << SECTOR_SHIFT))]))
        i += 4 * step
    while i < nsec:
        acc ^= uint32(w[_U(base + (i << SECTOR_SHIFT))])
        i += step
    return acc


@cuda.jit(cache=True)
def _touch_k(w, out):
    """w: flat uint8 bytes; reads byte 32s of w for every sector s."""
    nsec = (w.shape[0] + 31) >> SECTOR_SHIFT
    _xor_out(out, _sectors(w, 0, nsec, cuda.grid(1), cuda.gridsize(1)))


@cuda.jit(cache=True)
def _touch_slots_k(w, slot_bytes, off, nbytes, slot_of, ids, out):
    """w: the expert slots' flat bytes; for each choice j of token 0 whose expert has a slot s >= 0, the bytes
    s * slot_bytes + off .. + nbytes (one matrix of that expert)."""
    nsec = (nbytes + 31) >> SECTOR_SHIFT
    kk = ids.shape[1]
    acc = uint32(0)
    for j in range(kk):
        s = slot_of[_U(ids[0, _U(j)])]
        if s >= 0:  # the same for every thread
            acc ^= _sectors(w, s * slot_bytes + off, nsec, cuda.grid(1), cuda.gridsize(1))
    _xor_out(out, acc)


def _flat(arr):
    return arr.reshape(arr.size) if len(arr.shape) > 1 else arr


def touch(w, out, stream) -> None:
    """Bring every 32-byte sector of the device array w (uint8, C-contiguous) into L2; out uint32[>=1] receives
    the XOR of the bytes read (XORed into what it holds)."""
    _touch_k[PF_BLOCKS, PF_THREADS, stream](_flat(w), out)


def touch_slots(slots, off: int, nbytes: int, slot_of, ids, out, stream) -> None:
    """The same for one matrix (bytes off .. off + nbytes of a slot) of each expert token 0 chose (ids int32[>=1,
    k]) that has a VRAM slot (slot_of int32[E], slots u8[n_slots, slot_bytes])."""
    _touch_slots_k[PF_BLOCKS, PF_THREADS, stream](_flat(slots), slots.shape[1], off, nbytes, slot_of, ids, out)
