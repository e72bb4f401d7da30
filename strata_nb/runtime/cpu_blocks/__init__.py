"""The CPU engine's token mixers, one module per layer kind (ModelSpec.layers): each takes the backend (its
matmul and norm building blocks), the layer's weights, the residual stream, the layer's state in the session and
the forward's positions, and returns what the mixer adds to the residual stream."""
from __future__ import annotations

from strata_nb.runtime.cpu_blocks.attention import attention
from strata_nb.runtime.cpu_blocks.deltanet import deltanet

MIXERS = {"attention": attention, "gated_attention": attention, "deltanet": deltanet}
