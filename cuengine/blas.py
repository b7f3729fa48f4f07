"""cuBLASLt matmul: `out[M,N] (+)= op(a) @ op(b) (+ bias[N])`, row-major, for every linear layer.

Layout. cuBLASLt is column-major, and a row-major (M, N) matrix is the column-major (N, M) matrix
outᵀ. So the engine asks cuBLASLt for outᵀ = op(b)ᵀ·op(a)ᵀ: cuBLASLt's A is our `b` and its B is
our `a`, and nothing is copied. Our default `trans_b=True, trans_a=False` (`y = x wᵀ`) becomes
TRANSA=T, TRANSB=N: the TN layout that Hopper's FP8 kernels require.

Per-call cost. One handle and one workspace per device. Plans (matmul descriptor, four matrix
layouts and the heuristic's algorithm) are cached by dtypes, modes, M, N, K, epilogue and pointer
alignment. A call checks its arguments, writes the pointers that changed into the descriptor (bias,
FP8 scales, amax) and enqueues cublasLtMatmul: no allocation and no host sync, so matmuls can be
captured into a CUDA graph. Alpha and beta are module-level host constants read when the call is
enqueued (host pointer mode); the FP8 scales are device pointers read when the kernel runs, so a
replayed graph sees the current scales.

Plans are made on the first call of a shape. That is host work only (descriptor, layouts,
heuristic query), so a first call inside a graph capture is fine; the workspace, however, must exist
before a capture: call `init(allocator)` first (the model does, with its own allocator).

The workspace is shared by every matmul on a device: matmuls that may run at the same time on two
streams would race on it. Issue them on one stream.

Tuned algorithms. cuBLASLt's first heuristic choice is up to a quarter slower than the best of its
top 8 at some of the train step's shapes (on the H200: the 0.5B step's GEMMs 36.5 ms against 33.6
ms measured alone; in the power-capped step the gain is smaller, PERF_NOTES 23).
`gemm_tuning.json`, written by `tools/tune_gemm.py` on the GPU it describes, names for a plan key
(dtypes, modes, M, N, K, alignments) the algorithm to take among the heuristic's top `CANDIDATES`,
by its configuration (algorithm id, tile, stages, split-K, ...). The tool only names an algorithm
whose output it found bitwise equal to the first choice's, so the table changes speed, never
results: a run is the same bits with or without it. An entry applies only on the GPU model and
cuBLASLt version it was tuned on, and only when the heuristic still offers that configuration;
otherwise the first choice is used. `CUENGINE_GEMM_TUNING=0` or `use_tuned_algorithms(False)` turns
the table off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import weakref
from pathlib import Path

import numpy as np

from ._checks import VECTOR_BYTES, expect, is_aligned, overlaps, same_device
from .alloc import TensorAllocator
from .dtypes import BF16, BYTE, FP8_E4M3, FP8_E5M2, FP16, FP32
from .tensor import Tensor

TUNING_PATH = Path(__file__).with_name("gemm_tuning.json")
CANDIDATES = 8  # the heuristic's top choices a tuned entry may pick among (cuBLASLt returns 8 at most here)
# a cublasLtMatmulAlgo_t's configuration: what identifies an algorithm among the heuristic's results
ALGO_CONFIG = ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME", "CTA_SWIZZLING", "CUSTOM_OPTION",
               "INNER_SHAPE_ID", "CLUSTER_SHAPE_ID")  # fmt: skip
WORKSPACE_BYTES = 32 << 20  # what cuBLAS asks for on Hopper (split-K and stream-K reductions)
ROW_ALIGN = VECTOR_BYTES  # rows (leading dimensions) and pointers; below it FP8 fails and 16-bit types go slow

_FLOAT_TYPES = (FP32, FP16, BF16)
# alpha and beta: host scalars that cuBLASLt reads by pointer when a call is enqueued; module-level,
# so they outlive every call and every captured graph.
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)
_ONE_PTR = _ONE.ctypes.data
_ZERO_PTR = _ZERO.ctypes.data


# ---- NumPy twin ---------------------------------------------------------------------------------
def matmul_numpy(a, b, bias=None, c=None, *, trans_a=False, trans_b=True, scale_a=None, scale_b=None,
                 out_dtype=np.float32, scale_out=None, abs_max=None) -> np.ndarray:  # fmt: skip
    """The reference matmul: `op(a) @ op(b) (+ c) (+ bias)` in float32, rounded once to `out_dtype`.

    Args:
        a: (M, K), or (K, M) with `trans_a`; any float dtype, ml_dtypes bf16/fp8 included.
        b: (N, K) with `trans_b` (the default, `y = x wᵀ`), or (K, N).
        bias: (N,) or None, added in float32 before the rounding.
        c: (M, N) or None: the old output, added in float32 before the rounding (accumulate).
        scale_a, scale_b: dequantisation factors (an FP8 tensor's scale_inv): operands are
            dequantised as `value * scale` before the product.
        out_dtype: NumPy dtype of the result.
        scale_out: for an FP8 `out_dtype`, the quantisation scale: the result is stored as
            `clip(y * scale_out, ±fp8_max)` rounded to nearest even.
        abs_max: for an FP8 `out_dtype`, a 1-element float32 array set to max|y| (y before scaling).
    Returns:
        The (M, N) result in `out_dtype`. NumPy: `(op(a) @ op(b) + c + bias).astype(out_dtype)`.
    """
    x = np.asarray(a).astype(np.float32)
    w = np.asarray(b).astype(np.float32)
    if scale_a is not None:
        x = x * np.float32(scale_a)
    if scale_b is not None:
        w = w * np.float32(scale_b)
    y = (x.T if trans_a else x) @ (w.T if trans_b else w)
    if c is not None:
        y += np.asarray(c).astype(np.float32)
    if bias is not None:
        y += np.asarray(bias).astype(np.float32)
    out_dtype = np.dtype(out_dtype)
    fp8_max = {np.dtype(FP8_E4M3.np): FP8_E4M3.fp8_max, np.dtype(FP8_E5M2.np): FP8_E5M2.fp8_max}.get(out_dtype)
    if fp8_max is None:
        return y.astype(out_dtype)
    if abs_max is not None:
        abs_max[...] = np.max(np.abs(y)) if y.size else np.float32(0)
    return np.clip(y * np.float32(1.0 if scale_out is None else scale_out), -fp8_max, fp8_max).astype(out_dtype)


# ---- argument checks ----------------------------------------------------------------------------
def _as_matrix(t: Tensor, what: str) -> tuple[int, int]:
    """(rows, cols) of `t` with its leading dimensions flattened into rows."""
    if t.ndim == 0:
        raise ValueError(f"matmul: {what} is tensor {t.name!r}, a 0-d tensor; operands need at least one dimension")
    return math.prod(t.shape[:-1]), t.shape[-1]


def _describe(t: Tensor) -> str:
    return f"tensor {t.name!r} {t.shape} {t.dtype}"


def _check_dtypes(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum) -> bool:
    """Validate the dtype combination and modes; returns whether the operands are FP8."""
    fp8 = a.dtype.is_fp8 or b.dtype.is_fp8
    if fp8:
        if not (a.dtype.is_fp8 and b.dtype.is_fp8):
            raise ValueError(
                f"matmul: FP8 and non-FP8 operands cannot be mixed: a is {_describe(a)}, b is {_describe(b)}; "
                "quantize both (e4m3 × e4m3, or e4m3 × e5m2 for gradients)"
            )
        if a.dtype is FP8_E5M2 and b.dtype is FP8_E5M2:
            raise ValueError(
                f"matmul: e5m2 × e5m2 is not supported by cuBLASLt (a is {_describe(a)}, b is {_describe(b)}); "
                "use e4m3 for one operand"
            )
        if trans_a or not trans_b:
            raise ValueError(
                f"matmul: FP8 operands need trans_a=False, trans_b=True (Hopper FP8 GEMMs are TN only), got "
                f"trans_a={trans_a}, trans_b={trans_b}; transpose the operand first (fp8 transpose or "
                "quantize_and_transpose) so that a is (M, K) and b is (N, K)"
            )
        for t, what in ((a, "a"), (b, "b")):
            if t.stats is None:
                raise ValueError(
                    f"matmul: FP8 operand {what} is {_describe(t)} without FP8 stats; its scale_inv slot is the "
                    "dequantisation factor cuBLASLt reads"
                )
        allowed_out = (BF16, FP32, FP8_E4M3)
    else:
        if a.dtype is not b.dtype or not any(a.dtype is d for d in _FLOAT_TYPES):
            raise ValueError(
                f"matmul: operands must share one of fp32/fp16/bf16 (or both be FP8), got a {_describe(a)} "
                f"and b {_describe(b)}"
            )
        allowed_out = (a.dtype, FP32) if a.dtype is not FP32 else (FP32,)
    if not any(out.dtype is d for d in allowed_out):
        names = "/".join(d.name for d in allowed_out)
        raise ValueError(f"matmul: out must be {names} for {a.dtype} × {b.dtype} operands, got {_describe(out)}")
    if out.dtype.is_fp8:
        if out.stats is None:
            raise ValueError(
                f"matmul: FP8 out {_describe(out)} has no FP8 stats; its scale is read and its abs_max written"
            )
        if accumulate:
            raise ValueError(f"matmul: accumulate=True cannot add into the FP8 out {_describe(out)}")
    if fast_accum and not fp8:
        raise ValueError(f"matmul: fast_accum applies to FP8 operands only, got {a.dtype} × {b.dtype}")
    if bias is not None:
        want = BF16 if fp8 else out.dtype
        expect(bias, f"matmul bias (for {a.dtype} operands and {out.dtype} out)", dtype=want)
    return fp8


def _check(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum) -> tuple[int, int, int, tuple]:
    """All boundary checks; returns (M, N, K) and the addresses of (out, a, b, bias or 0)."""
    expect(out, "matmul out")
    expect(a, "matmul a")
    expect(b, "matmul b")
    if bias is not None:
        expect(bias, "matmul bias")
    same_device(out, a, b, bias)
    _check_dtypes(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum)

    a_rows, a_cols = _as_matrix(a, "a")
    b_rows, b_cols = _as_matrix(b, "b")
    M, K = (a_cols, a_rows) if trans_a else (a_rows, a_cols)
    N, K_b = (b_rows, b_cols) if trans_b else (b_cols, b_rows)
    op_a = f"op(a) = {'aᵀ' if trans_a else 'a'} is ({M}, {K})"
    if K_b != K:
        raise ValueError(
            f"matmul: inner dimensions differ: {op_a} from a {_describe(a)}, but op(b) = "
            f"{'bᵀ' if trans_b else 'b'} is ({K_b}, {N}) from b {_describe(b)}"
        )
    if K == 0:
        raise ValueError(f"matmul: K = 0 ({op_a} from a {_describe(a)}); there is nothing to multiply")
    if _as_matrix(out, "out") != (M, N):
        raise ValueError(f"matmul: out must be (M, N) = ({M}, {N}) for {op_a} and op(b) (K, N), got {_describe(out)}")
    if bias is not None:
        expect(bias, "matmul bias (N,)", shape=(N,))

    for t, what in ((a, "a"), (b, "b"), (out, "out")):
        row_bytes = t.shape[-1] * t.dtype.itemsize
        if row_bytes % ROW_ALIGN:
            raise ValueError(
                f"matmul: {what} is {_describe(t)} with rows of {row_bytes} bytes; cuBLASLt needs rows (leading "
                f"dimensions) of a multiple of {ROW_ALIGN} bytes ({ROW_ALIGN // t.dtype.itemsize} {t.dtype} "
                "elements): FP8 fails without it and 16/32-bit types fall back to slow kernels. Pad that dimension"
            )
    ptrs = (out.ptr, a.ptr, b.ptr, 0 if bias is None else bias.ptr)
    for t, what in zip((out, a, b, bias), ("out", "a", "b", "bias")):
        if not is_aligned(t, nbytes=ROW_ALIGN):
            raise ValueError(
                f"matmul: {what} is {_describe(t)} at address {t.ptr:#x}, not {ROW_ALIGN}-byte aligned "
                f"(byte offset {t.offset} into its storage)"
            )
    for t, what in ((a, "a"), (b, "b"), (bias, "bias")):
        if t is not None and overlaps(out, t):
            raise ValueError(
                f"matmul: out {_describe(out)} overlaps {what} {_describe(t)}; cuBLASLt cannot work in place"
            )
    return M, N, K, ptrs


# ---- per-device state and plans -----------------------------------------------------------------
class _Plan:
    """A cached cuBLASLt matmul: descriptor, layouts and algorithm, plus the pointers last set."""

    __slots__ = ("desc", "layouts", "pref", "results", "algo_ptr", "tuned", "ptr_buf", "ptr_buf_addr", "ptrs")

    def __init__(self, desc):
        self.desc = desc
        self.layouts: tuple = ()  # (A, B, C, D) in cuBLASLt's naming: A = our b, B = our a
        self.pref = None  # the heuristic's preference (workspace, alignments), kept for a tuning tool's re-query
        self.results: list = []  # MatmulHeuristicResult arrays, kept alive: cuBLASLt reads algo_ptr's struct
        self.algo_ptr = 0
        self.tuned = False  # the algorithm came from the tuning table
        self.ptr_buf = np.zeros(1, np.int64)  # staging for pointer attributes (cuBLASLt copies the value)
        self.ptr_buf_addr = self.ptr_buf.ctypes.data
        self.ptrs: dict[int, int] = {}

    def set_pointer(self, lt, attr: int, value: int) -> None:
        """Point descriptor attribute `attr` at `value`, skipping the call when it already does."""
        if self.ptrs.get(attr) != value:
            self.ptr_buf[0] = value
            lt.matmul_desc_set_attribute(self.desc, attr, self.ptr_buf_addr, 8)
            self.ptrs[attr] = value

    def set_pointers(self, lt, out, a, b, bias_ptr: int) -> None:
        attr = lt.MatmulDescAttribute
        if bias_ptr:
            self.set_pointer(lt, attr.BIAS_POINTER, bias_ptr)
        if a.dtype.is_fp8:
            self.set_pointer(lt, attr.A_SCALE_POINTER, b.scale_inv.ptr)  # cuBLASLt's A is our b
            self.set_pointer(lt, attr.B_SCALE_POINTER, a.scale_inv.ptr)
        if out.dtype.is_fp8:
            self.set_pointer(lt, attr.D_SCALE_POINTER, out.scale.ptr)
            self.set_pointer(lt, attr.AMAX_D_POINTER, out.abs_max.ptr)

    def destroy(self, lt) -> None:
        for layout in self.layouts:
            lt.matrix_layout_destroy(layout)
        if self.pref is not None:
            lt.matmul_preference_destroy(self.pref)
        lt.matmul_desc_destroy(self.desc)

    def candidates(self, state, count: int):
        """The heuristic's top `count` results for this plan (a MatmulHeuristicResult array) and how
        many it returned."""
        lt = _lt()
        results = lt.MatmulHeuristicResult(count)
        found = np.zeros(1, np.int32)
        with state.device.activate():
            lt.matmul_algo_get_heuristic(state.handle, self.desc, *self.layouts, self.pref, count, results.ptr,
                                         found.ctypes.data)  # fmt: skip
        return results, int(found[0])


class _DeviceState:
    """One cuBLASLt handle, one workspace (from a TensorAllocator) and the plan cache of a device."""

    def __init__(self, allocator: TensorAllocator, workspace_bytes: int, handle=None):
        self.device = allocator.device
        # weakly: this module-level state outlives models, and the allocator holds every buffer of its model, so
        # a strong reference kept a deleted model's memory (weights, activations, moments) until the next init
        self.allocator = weakref.ref(allocator)
        self.workspace_bytes = int(workspace_bytes)
        self.workspace, self.workspace_ptr = None, 0
        if self.device.is_cuda:  # the cpu twin needs none, so a cpu memory report shows none
            with allocator.context("cuBLASLt"):
                self.workspace = allocator.allocate(BYTE, "cublaslt_workspace", (self.workspace_bytes,))
            self.workspace_ptr = self.workspace.ptr
        self.handle = handle
        if self.device.is_cuda and handle is None:
            lt = _lt()
            with self.device.activate():
                self.handle = lt.create()
        self.plans: dict[tuple, _Plan] = {}
        self._tuned: dict[str, dict] | None = None

    def tuned_entries(self) -> dict[str, dict]:
        """This GPU's and cuBLASLt version's entries of the tuning table, read once ({} when off)."""
        if self._tuned is None:
            self._tuned = {}
            if _TUNING["enabled"] and self.device.is_cuda:
                self._tuned = tuning_entries(_TUNING["path"], self.device.name, _lt().get_version())
        return self._tuned

    def clear_plans(self) -> None:
        if self.plans:
            lt = _lt()
            for plan in self.plans.values():
                plan.destroy(lt)
            self.plans.clear()


_STATES: dict[tuple[str, int], _DeviceState] = {}
_TUNING = {"enabled": os.environ.get("CUENGINE_GEMM_TUNING", "1").lower() not in ("0", "off", "false"),
           "path": TUNING_PATH}  # fmt: skip
_RECORDING: list | None = None  # record_plans()'s list while it is open


# ---- the tuning table ---------------------------------------------------------------------------
def key_text(key: tuple) -> str:
    """A plan key as the tuning table writes it: "bf16,bf16,bf16,-,0,1,8192,1152,896,0,0,256,256,256,0"
    (a, b and out dtypes, bias dtype or "-", trans_a, trans_b, M, N, K, accumulate, fast_accum,
    then the alignments of a, b, out and bias)."""
    return ",".join("-" if v is None else str(int(v)) if isinstance(v, bool) else str(v) for v in key)


def tuning_entries(path, gpu: str, cublaslt_version: int) -> dict[str, dict]:
    """The entries of the table at `path` for `gpu` (a device name) and `cublaslt_version`: plan key
    text -> algorithm configuration. {} when the file or that table does not exist.

    Raises ValueError naming the file for a malformed table: a table or entry without the fields
    below, or a configuration that does not give every ALGO_CONFIG field as an integer.
        {"tables": [{"gpu": "NVIDIA H200", "cublaslt": 130400, "entries": {"<key text>": {"ID": 66, ...}}}]}
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        for table in data["tables"]:
            if table["gpu"] == gpu and int(table["cublaslt"]) == int(cublaslt_version):
                entries = table["entries"]
                for key, config in entries.items():
                    if sorted(config) != sorted(ALGO_CONFIG) or not all(type(v) is int for v in config.values()):
                        raise ValueError(f"entry {key!r} has {config}; it needs exactly {ALGO_CONFIG} as integers")
                return dict(entries)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"matmul tuning table {path}: malformed ({err!r})") from err
    return {}


def use_tuned_algorithms(enabled: bool = True, path=None) -> None:
    """Turn the tuning table on or off (or point it at another file) for plans made from now on.

    Drops every cached plan, as `init` does when it replaces a workspace: graphs captured before
    must not be replayed. Results do not change either way (see the module docstring).
    Raises ValueError for a `path` that is not a file (the default table may be absent: no entries)."""
    if path is not None and not Path(path).is_file():
        raise ValueError(f"use_tuned_algorithms: no tuning table at {path}")
    _TUNING["enabled"] = bool(enabled)
    _TUNING["path"] = TUNING_PATH if path is None else Path(path)
    for state in _STATES.values():
        state.clear_plans()
        state._tuned = None


def num_tuned_plans(device) -> int:
    """How many of `device`'s cached plans took their algorithm from the tuning table."""
    return sum(plan.tuned for plan in _cached_plans(device))


def algo_config(algo_ptr: int) -> dict[str, int]:
    """The ALGO_CONFIG fields of the cublasLtMatmulAlgo_t at `algo_ptr` (a heuristic result's first
    member)."""
    lt = _lt()
    config = {}
    written = np.zeros(1, np.uint64)
    for name in ALGO_CONFIG:
        kind = getattr(lt.MatmulAlgoConfigAttribute, name)
        buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(kind))
        lt.matmul_algo_config_get_attribute(algo_ptr, kind, buf.ctypes.data, buf.itemsize, written.ctypes.data)
        config[name] = int(buf[0])
    return config


@contextlib.contextmanager
def record_plans():
    """Collect the calls that make new plans while open, for `tools/tune_gemm.py`: a list of
    (key, matmul arguments as a dict) in the order the plans were made, the tensors included (so
    the tool can run each plan again on the same operands)."""
    global _RECORDING
    calls: list = []
    _RECORDING = calls
    try:
        yield calls
    finally:
        _RECORDING = None


def plan_candidates(device, key: tuple) -> list[tuple[dict[str, int], int]]:
    """(configuration, algo pointer) of each usable algorithm among the heuristic's top CANDIDATES
    for `device`'s cached plan `key`, the heuristic's order; the pointers live until the next call."""
    state = _state(device)
    plan = state.plans[key]
    results, found = plan.candidates(state, CANDIDATES)
    plan.results.append(results)
    return [(algo_config(results[i].ptr), results[i].ptr) for i in range(found) if results[i].state == 0]


def set_plan_algorithm(device, key: tuple, algo_ptr: int) -> None:
    """Point `device`'s cached plan `key` at another algorithm (from plan_candidates): for tuning."""
    _state(device).plans[key].algo_ptr = algo_ptr


def _lt():
    from nvmath.bindings import cublasLt

    return cublasLt


def init(allocator: TensorAllocator, workspace_bytes: int = WORKSPACE_BYTES) -> None:
    """Give matmuls on `allocator.device` their workspace, allocated from `allocator`.

    The workspace is named "cublaslt_workspace" in the context "cuBLASLt", so it shows in the
    allocator's memory report (on cuda only: the cpu twin needs no workspace). Call it
    before a step is captured. Without it, the first matmul on a device allocates the workspace from
    a private allocator. Calling it again with another allocator or a larger size replaces the
    workspace and drops the plans; graphs captured before then must not be replayed.
    """
    dev = allocator.device
    key = (dev.kind, dev.index)
    state = _STATES.get(key)
    if state is not None and state.allocator() is allocator and state.workspace_bytes >= workspace_bytes:
        return
    handle = None
    if state is not None:
        state.clear_plans()
        handle = state.handle
    _STATES[key] = _DeviceState(allocator, workspace_bytes, handle)


def _state(device) -> _DeviceState:
    state = _STATES.get((device.kind, device.index))
    if state is None:
        init(TensorAllocator(device))
        state = _STATES[(device.kind, device.index)]
    return state


def _cached_plans(device) -> list[_Plan]:
    state = _STATES.get((device.kind, device.index))
    return [] if state is None else list(state.plans.values())


def num_plans(device) -> int:
    """How many matmul plans are cached for `device` (a Device); 0 on cpu."""
    return len(_cached_plans(device))


def _alignment(ptr: int) -> int:
    """The largest power of two dividing `ptr`, capped at 256 (cuBLASLt's default assumption); 0 for null."""
    return min(256, ptr & -ptr) if ptr else 0


def _make_plan(state: _DeviceState, key, out, a, b, bias, M, N, K, trans_a, trans_b, fast_accum) -> _Plan:
    from nvmath.bindings.cublas import ComputeType

    lt = _lt()
    op_n, op_t = 0, 1  # cublasOperation_t
    plan = _Plan(lt.matmul_desc_create(int(ComputeType.COMPUTE_32F), FP32.cuda_type))
    try:

        def set_attr(name, value):
            kind = getattr(lt.MatmulDescAttribute, name)
            buf = np.array([value], dtype=lt.get_matmul_desc_attribute_dtype(kind))
            lt.matmul_desc_set_attribute(plan.desc, kind, buf.ctypes.data, buf.itemsize)

        set_attr("TRANSA", op_t if trans_b else op_n)
        set_attr("TRANSB", op_t if trans_a else op_n)
        if fast_accum:
            set_attr("FAST_ACCUM", 1)
        set_attr("EPILOGUE", int(lt.Epilogue.BIAS if bias is not None else lt.Epilogue.DEFAULT))
        if bias is not None:
            set_attr("BIAS_DATA_TYPE", bias.dtype.cuda_type)
        plan.set_pointers(lt, out, a, b, 0 if bias is None else bias.ptr)  # the heuristic reads their alignment

        layouts = []
        for dt, rows, cols, ld in (
            (b.dtype, *((K, N, K) if trans_b else (N, K, N))),  # cuBLASLt A = our b, column-major
            (a.dtype, *((M, K, M) if trans_a else (K, M, K))),  # cuBLASLt B = our a
            (BF16 if out.dtype.is_fp8 else out.dtype, N, M, N),  # C: cuBLASLt wants a 16-bit C type for FP8 D
            (out.dtype, N, M, N),  # D = outᵀ, column-major (N, M)
        ):
            layouts.append(lt.matrix_layout_create(dt.cuda_type, rows, cols, ld))
            plan.layouts = tuple(layouts)

        pref = plan.pref = lt.matmul_preference_create()

        def set_pref(name, value):
            kind = getattr(lt.MatmulPreferenceAttribute, name)
            buf = np.array([value], dtype=lt.get_matmul_preference_attribute_dtype(kind))
            lt.matmul_preference_set_attribute(pref, kind, buf.ctypes.data, buf.itemsize)

        set_pref("MAX_WORKSPACE_BYTES", state.workspace_bytes)
        set_pref("MIN_ALIGNMENT_A_BYTES", _alignment(b.ptr))
        set_pref("MIN_ALIGNMENT_B_BYTES", _alignment(a.ptr))
        set_pref("MIN_ALIGNMENT_C_BYTES", _alignment(out.ptr))
        set_pref("MIN_ALIGNMENT_D_BYTES", _alignment(out.ptr))
        wanted = state.tuned_entries().get(key_text(key))
        why = "no algorithm returned"
        try:
            results, found = plan.candidates(state, CANDIDATES if wanted else 1)
        except lt.cuBLASLtError as err:
            results, found, why = None, 0, str(err)
        pick = 0
        if wanted and found:
            match = [i for i in range(found) if results[i].state == 0 and algo_config(results[i].ptr) == wanted]
            pick, plan.tuned = (match[0], True) if match else (0, False)
        if found:
            plan.results, plan.algo_ptr = [results], results[pick].ptr
        if found == 0 or results[pick].state != 0:
            raise RuntimeError(
                f"matmul: cuBLASLt has no algorithm ({why}) for out {_describe(out)} = op(a) @ op(b) with a "
                f"{_describe(a)}, b {_describe(b)}, M={M} N={N} K={K}, trans_a={trans_a}, trans_b={trans_b}, "
                f"bias={'none' if bias is None else bias.dtype}, fast_accum={fast_accum} on {state.device.name} "
                f"(FP8 needs compute capability 8.9 or newer)"
            )
    except BaseException:
        plan.destroy(lt)
        raise
    return plan


def _plan_key(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum, M, N, K, ptrs) -> tuple:
    """What a plan is cached (and tuned) by. `accumulate` is in it because candidates that agree bit
    for bit on `out = product` need not on `out += product` (beta = 1 in their epilogues)."""
    out_ptr, a_ptr, b_ptr, bias_ptr = ptrs
    bias_name = None if bias is None else bias.dtype.name
    return (a.dtype.name, b.dtype.name, out.dtype.name, bias_name, trans_a, trans_b, M, N, K, accumulate,
            fast_accum, _alignment(a_ptr), _alignment(b_ptr), _alignment(out_ptr), _alignment(bias_ptr))  # fmt: skip


def plan_key(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None, *, trans_a: bool = False,
             trans_b: bool = True, accumulate: bool = False, fast_accum: bool = False,
             stream=None) -> tuple:  # fmt: skip
    """The plan key of `matmul` with these arguments (after its checks): for tools/tune_gemm.py."""
    M, N, K, ptrs = _check(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum)
    return _plan_key(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum, M, N, K, ptrs)


# ---- the launcher -------------------------------------------------------------------------------
def matmul(out: Tensor, a: Tensor, b: Tensor, bias: Tensor | None = None, *, trans_a: bool = False,
           trans_b: bool = True, accumulate: bool = False, fast_accum: bool = False, stream=None) -> None:  # fmt: skip
    """Row-major `out[M,N] (+)= op(a) @ op(b) (+ bias[N])` through cuBLASLt (NumPy twin on cpu).

    The three modes a linear layer needs, for x (M, K), w (N, K), y (M, N):
        forward      `y = x wᵀ`  : matmul(y, x, w)                           (the default)
        input grad   `dx = dy w` : matmul(dx, dy, w, trans_b=False)
        weight grad  `dw += dyᵀx`: matmul(dw, dy, x, trans_a=True, trans_b=False, accumulate=True)

    Args:
        out: (M, N), written (or added to with `accumulate`). Leading dimensions of any tensor
            flatten into rows: a (B, T, C) activation is (B*T, C).
        a: (M, K), or (K, M) with `trans_a`.
        b: (N, K) with `trans_b` (default), or (K, N).
        bias: (N,) or None, added before the single rounding to out's dtype. bf16 for FP8
            operands, else out's dtype.
        trans_a, trans_b: op(a) = aᵀ, op(b) = bᵀ.
        accumulate: out = old out + product (beta = 1), e.g. gradient accumulation.
        fast_accum: FP8 only: cuBLASLt's fast accumulation (no periodic promotion to fp32).
        stream: a Stream of out's device; None is the device's main stream.

    Dtypes: a and b both fp32, fp16 or bf16, with out of the same dtype or fp32; or FP8
    (e4m3 × e4m3, e4m3 × e5m2 or e5m2 × e4m3, TN only) with out bf16, fp32 or e4m3. FP8 operands
    are dequantised by their `scale_inv` slots (device pointers). An e4m3 `out` is quantised with
    its `scale` slot (read) and gets max|result before scaling| written (not max-accumulated) to
    its `abs_max` slot; its `scale_inv` slot is left as it is.

    Alignment: every row (last dimension) of a, b and out must be a multiple of 16 bytes and
    every pointer 16-byte aligned (K % 16 == 0 for FP8). cuBLASLt fails below that for FP8 and
    silently falls back to slow kernels for 16/32-bit types, so both raise.

    Raises ValueError (and changes nothing) for a bad dtype combination, a non-TN FP8 call, FP8
    tensors without stats, shapes that do not match, bad alignment, out overlapping an input,
    fast_accum without FP8, accumulate into FP8, or a bias of the wrong dtype or shape.
    NumPy: `out = (op(a)*sa @ op(b)*sb (+ out) + bias).astype(out.dtype)`, see `matmul_numpy`.
    """
    M, N, K, ptrs = _check(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum)
    if M == 0 or N == 0:
        return
    dev = out.device
    if dev.is_cpu:
        fp8 = a.dtype.is_fp8
        out2d = out.array().reshape(M, N)
        out2d[...] = matmul_numpy(
            a.array().reshape(_as_matrix(a, "a")),
            b.array().reshape(_as_matrix(b, "b")),
            None if bias is None else bias.array(),
            out2d if accumulate else None,
            trans_a=trans_a,
            trans_b=trans_b,
            scale_a=a.scale_inv.array()[0] if fp8 else None,
            scale_b=b.scale_inv.array()[0] if fp8 else None,
            out_dtype=out.dtype.np,
            scale_out=out.scale.array()[0] if out.dtype.is_fp8 else None,
            abs_max=out.abs_max.array() if out.dtype.is_fp8 else None,
        )
        return

    out_ptr, a_ptr, b_ptr, bias_ptr = ptrs
    state = _state(dev)
    key = _plan_key(out, a, b, bias, trans_a, trans_b, accumulate, fast_accum, M, N, K, ptrs)
    lt = _lt()
    plan = state.plans.get(key)
    if plan is None:
        plan = state.plans[key] = _make_plan(state, key, out, a, b, bias, M, N, K, trans_a, trans_b, fast_accum)
        if _RECORDING is not None:
            _RECORDING.append((key, dict(out=out, a=a, b=b, bias=bias, trans_a=trans_a, trans_b=trans_b,
                                         accumulate=accumulate, fast_accum=fast_accum, stream=stream)))  # fmt: skip
    plan.set_pointers(lt, out, a, b, bias_ptr)
    la, lb, lc, ld = plan.layouts
    c_ptr = 0 if out.dtype.is_fp8 else out_ptr  # C = D in place; an FP8 D has no C (beta = 0), as in nvmath
    with dev.activate():
        lt.matmul(state.handle, plan.desc, _ONE_PTR, b_ptr, la, a_ptr, lb, _ONE_PTR if accumulate else _ZERO_PTR,
                  c_ptr, lc, out_ptr, ld, plan.algo_ptr, state.workspace_ptr, state.workspace_bytes,
                  dev._stream(stream).ptr)  # fmt: skip
