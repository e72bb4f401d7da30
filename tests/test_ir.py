import numpy as np
from numba import njit

from strata_nb.cpu_kernels.ir import load_bf16, load_f16, prefetch


@njit
def _read(buf, i):
    prefetch(buf, i)
    return load_f16(buf, i), load_bf16(buf, i)


def test_half_and_bfloat_loads_match_numpy():
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(64).astype(np.float32)
    for v in vals:
        for off in (0, 3):  # unaligned too: scales sit at odd offsets inside blocks
            buf = np.zeros(8, np.uint8)
            buf[off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
            h, _ = _read(buf, off)
            assert h == np.float32(np.float16(v))
            bf = (np.float32(v).view(np.uint32) >> 16).astype(np.uint16)
            buf[off:off + 2] = np.frombuffer(bf.tobytes(), np.uint8)
            _, b = _read(buf, off)
            assert b == (np.uint32(bf) << 16).view(np.float32)
