"""The CPU engine's blocks, one module per layer kind (ModelSpec.layers). A token mixer takes the backend (its
matmul and norm building blocks), the layer's weights, the residual stream, the layer's state in the session and
the forward's positions; an FFN takes the backend, the layer's weights and index and the normed FFN input. Each
returns what it adds to the residual stream."""
from __future__ import annotations

from strata_nb.runtime.cpu_blocks.attention import attention
from strata_nb.runtime.cpu_blocks.deltanet import deltanet
from strata_nb.runtime.cpu_blocks.ffn import dense, moe

MIXERS = {"attention": attention, "gated_attention": attention, "deltanet": deltanet}
FFNS = {"dense": dense, "moe": moe}
