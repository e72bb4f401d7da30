"""Checks shared by the K-quant and legacy row-kernel tests (the kernels of both families have one contract)."""
from __future__ import annotations

import numpy as np
import pytest


def check_multi_rows(mr, single, w: np.ndarray, xq, xd, xs, error: type, short: tuple) -> None:
    """dot_q8_T_multi_rows `mr` on 7 rows w and 5 token rows (xq, xd, xs) writes exactly the single-row
    single-token results of `single` into out[j + k, r0:r1] and nothing else; rows outside the matrix, output rows
    outside out, token rows outside the activations, short output rows and the activations `short` (the same
    rows, cut to another length) raise `error`."""
    want = np.array([[single(w[r], xq[t], xd[t], xs[t]) for r in range(7)] for t in range(5)], np.float32)
    for (r0, r1), toks, j in (((0, 7), (4, 0, 2, 2), 0), ((2, 5), (1,), 3), ((6, 7), (3, 1), 2), ((3, 3), (0,), 0)):
        out = np.full((6, 9), np.nan, np.float32)
        mr(w, r0, r1, xq, xd, xs, toks, out, j)
        np.testing.assert_array_equal(out[j:j + len(toks), r0:r1], want[list(toks), r0:r1])
        live = np.zeros(out.shape, bool)
        live[j:j + len(toks), r0:r1] = True
        assert np.all(np.isnan(out[~live]))
    out = np.empty((4, 7), np.float32)
    bad = [((-1, 3), (0,), 0), ((0, 8), (0,), 0),  # rows outside the matrix
           ((0, 7), (0, 1), 3), ((0, 7), (0,), -1),  # output rows outside out
           ((0, 7), (0, 5), 0), ((0, 7), (-1,), 0)]  # token rows outside the activations
    for (r0, r1), toks, j in bad:
        with pytest.raises(error):
            mr(w, r0, r1, xq, xd, xs, toks, out, j)
    with pytest.raises(error):  # output rows too short
        mr(w, 0, 7, xq, xd, xs, (0,), out[:, :6], 0)
    with pytest.raises(error):  # activations of another length
        mr(w, 0, 7, *short, (0,), out, 0)
