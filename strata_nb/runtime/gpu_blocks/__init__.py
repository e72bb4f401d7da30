"""The hybrid engine's blocks on the GPU, one module per layer kind (ModelSpec.layers): each returns the kernel
launches (ops) of layer l for T tokens, on the backend's buffers and the layer's state (its arrays are in the
backend's device state, so captured graphs keep their addresses). FFNs also say where the host's CPU pool acts."""
from __future__ import annotations

from strata_nb.runtime.gpu_blocks.attention import attention
from strata_nb.runtime.gpu_blocks.deltanet import deltanet
from strata_nb.runtime.gpu_blocks.ffn import dense, moe

MIXERS = {"attention": attention, "gated_attention": attention, "deltanet": deltanet}
FFNS = {"dense": dense, "moe": moe}
