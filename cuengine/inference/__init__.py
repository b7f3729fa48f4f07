"""Inference: KV cache, prefill, the fused decode step with the seed-004 FFN arms, on-device
sampling, one CUDA graph per step, and `generate` / `stream` (mixed into LlamaModel)."""

from .api import InferenceMixin
from .state import FFN_ARMS, WEIGHTS, InferenceState, choose_ffn_arm

__all__ = ["FFN_ARMS", "WEIGHTS", "InferenceMixin", "InferenceState", "choose_ffn_arm"]
