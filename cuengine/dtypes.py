"""Element types the engine stores, with their NumPy and cuBLASLt names.

One table is the truth for every layer: NumPy twins round through the `np`
dtype (ml_dtypes for bf16 and fp8), and cuBLASLt layouts take `cuda_type` (a
`cudaDataType_t` value, kept as a plain int so that this module imports without
any CUDA package). Raw kernels are instantiated per type under a name suffix
(`cuengine.kernels._build.kernel_name`), with the C types in raw_kernels/common.cuh.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # canonical short name, e.g. "bf16"
    itemsize: int  # bytes per element
    np: np.dtype  # NumPy storage type (ml_dtypes for bf16 and fp8)
    cuda_type: int  # cudaDataType_t value for cuBLASLt layouts
    fp8_max: float = 0.0  # largest finite value for fp8 types, else 0

    @property
    def is_fp8(self) -> bool:
        return self.fp8_max > 0

    def __repr__(self) -> str:
        return f"cuengine.{self.name}"

    def __str__(self) -> str:
        return self.name


FP32 = DType("fp32", 4, np.dtype(np.float32), 0)
FP16 = DType("fp16", 2, np.dtype(np.float16), 2)
BF16 = DType("bf16", 2, np.dtype(ml_dtypes.bfloat16), 14)
FP8_E4M3 = DType("e4m3", 1, np.dtype(ml_dtypes.float8_e4m3fn), 28, 448.0)
FP8_E5M2 = DType("e5m2", 1, np.dtype(ml_dtypes.float8_e5m2), 29, 57344.0)
INT32 = DType("int32", 4, np.dtype(np.int32), 10)
INT64 = DType("int64", 8, np.dtype(np.int64), 24)  # the decode arm's fixed-point accumulators (kernels/gemv.py)
BYTE = DType("byte", 1, np.dtype(np.uint8), 8)

ALL = (FP32, FP16, BF16, FP8_E4M3, FP8_E5M2, INT32, INT64, BYTE)

_ALIASES = {
    "fp32": FP32, "float32": FP32, "f32": FP32, "float": FP32,
    "fp16": FP16, "float16": FP16, "f16": FP16, "half": FP16,
    "bf16": BF16, "bfloat16": BF16,
    "e4m3": FP8_E4M3, "fp8_e4m3": FP8_E4M3, "float8_e4m3fn": FP8_E4M3,
    "e5m2": FP8_E5M2, "fp8_e5m2": FP8_E5M2, "float8_e5m2": FP8_E5M2,
    "int32": INT32, "i32": INT32,
    "int64": INT64, "i64": INT64,
    "byte": BYTE, "uint8": BYTE, "u8": BYTE,
}  # fmt: skip


def dtype(value) -> DType:
    """Parse a DType from a DType, a name such as "bf16" or "e4m3", or a NumPy dtype.

    Raises ValueError listing the valid names when the value names no engine type.
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _ALIASES.get(value.lower())
        if found is None:
            raise ValueError(f"unknown dtype {value!r}; valid names: {', '.join(sorted(_ALIASES))}")
        return found
    try:
        np_type = np.dtype(value)
    except TypeError:
        raise ValueError(f"cannot interpret {value!r} as a dtype; valid names: {', '.join(sorted(_ALIASES))}") from None
    for d in ALL:
        if d.np == np_type:
            return d
    raise ValueError(f"NumPy dtype {np_type} has no engine equivalent; valid names: {', '.join(sorted(_ALIASES))}")
