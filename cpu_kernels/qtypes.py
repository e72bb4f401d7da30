"""GGML quant type ids and block geometry (the ids are the GGUF file's own numbering)."""
from __future__ import annotations

F32 = 0
F16 = 1
Q4_0 = 2
Q4_1 = 3
Q5_0 = 6
Q5_1 = 7
Q8_0 = 8
Q2_K = 10
Q3_K = 11
Q4_K = 12
Q5_K = 13
Q6_K = 14
BF16 = 30

# id -> (name, elements per block, bytes per block)
QUANT_INFO: dict[int, tuple[str, int, int]] = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22),
    Q5_1: ("Q5_1", 32, 24),
    Q8_0: ("Q8_0", 32, 34),
    Q2_K: ("Q2_K", 256, 84),
    Q3_K: ("Q3_K", 256, 110),
    Q4_K: ("Q4_K", 256, 144),
    Q5_K: ("Q5_K", 256, 176),
    Q6_K: ("Q6_K", 256, 210),
}
SUPPORTED = tuple(QUANT_INFO)
FLOAT_TYPES = (F32, F16, BF16)


def name(qtype: int) -> str:
    return QUANT_INFO[qtype][0] if qtype in QUANT_INFO else f"type {qtype}"


def row_bytes(qtype: int, n: int) -> int:
    """Bytes of one row of n elements; n must be a multiple of the block size."""
    _, blk, size = QUANT_INFO[qtype]
    if n % blk:
        raise ValueError(f"{name(qtype)} rows need a multiple of {blk} elements, got {n}")
    return n // blk * size
