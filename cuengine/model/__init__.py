"""The LLaMA / Qwen2 model: config, options, weights, run state, forward/backward/update, checkpoints."""

from .config import TransformerConfig
from .llama import LlamaModel
from .options import TrainOptions

__all__ = ["LlamaModel", "TrainOptions", "TransformerConfig"]
