"""Synthetic GGUF models: real architectures and quant mixes, random but valid weights, a small real tokenizer."""
from strata_nb.synth.presets import PRESETS, PUBLISHED, TINY, TINY_ARCHS, Shape
from strata_nb.synth.quantmix import MIXES, SINGLE_TYPES
from strata_nb.synth.writer import SynthPlan, TensorPlan, plan_synthetic, write_synthetic

__all__ = ["MIXES", "PRESETS", "PUBLISHED", "SINGLE_TYPES", "TINY", "TINY_ARCHS", "Shape", "SynthPlan",
           "TensorPlan", "plan_synthetic", "write_synthetic"]
