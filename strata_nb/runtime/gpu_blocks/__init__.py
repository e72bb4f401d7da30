"""The hybrid engine's token mixers on the GPU, one module per layer kind (ModelSpec.layers): each returns the
kernel launches (ops) of layer l for T tokens, on the backend's buffers and the layer's state (its arrays are in
the backend's device state, so captured graphs keep their addresses)."""
from __future__ import annotations

from strata_nb.runtime.gpu_blocks.attention import attention
from strata_nb.runtime.gpu_blocks.deltanet import deltanet

MIXERS = {"attention": attention, "gated_attention": attention, "deltanet": deltanet}
