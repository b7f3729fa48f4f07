"""cuengine: an LLM training and inference engine on CuPy, with no PyTorch."""

from . import dist, ops
from .alloc import DeviceMemoryStack, MemoryReport, TensorAllocator
from .blas import matmul
from .device import Device, cuda_available, device
from .dtypes import BF16, BYTE, FP8_E4M3, FP8_E5M2, FP16, FP32, INT32, INT64, DType, dtype
from .model import LlamaModel, TrainOptions, TransformerConfig
from .tensor import Tensor

__version__ = "0.1.0"

__all__ = [
    "BF16", "BYTE", "FP8_E4M3", "FP8_E5M2", "FP16", "FP32", "INT32", "INT64",
    "DType", "Device", "DeviceMemoryStack", "MemoryReport", "Tensor", "TensorAllocator",
    "LlamaModel", "TrainOptions", "TransformerConfig", "cuda_available", "device", "dist", "dtype", "matmul", "ops",
]  # fmt: skip
