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
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import VECTOR_BYTES, expect, is_aligned, same_device
from .alloc import TensorAllocator
from .dtypes import BF16, BYTE, FP8_E4M3, FP8_E5M2, FP16, FP32
from .tensor import Tensor

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


def _overlaps(x: Tensor, y: Tensor) -> bool:
    return x.storage is y.storage and x.offset < y.offset + y.nbytes and y.offset < x.offset + x.nbytes


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
        if t is not None and _overlaps(out, t):
            raise ValueError(
                f"matmul: out {_describe(out)} overlaps {what} {_describe(t)}; cuBLASLt cannot work in place"
            )
    return M, N, K, ptrs


# ---- per-device state and plans -----------------------------------------------------------------
class _Plan:
    """A cached cuBLASLt matmul: descriptor, layouts and algorithm, plus the pointers last set."""

    __slots__ = ("desc", "layouts", "algo", "algo_ptr", "ptr_buf", "ptr_buf_addr", "ptrs")

    def __init__(self, desc):
        self.desc = desc
        self.layouts: tuple = ()  # (A, B, C, D) in cuBLASLt's naming: A = our b, B = our a
        self.algo = None  # MatmulHeuristicResult, kept alive: cuBLASLt reads its algo struct (offset 0) by pointer
        self.algo_ptr = 0
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
        lt.matmul_desc_destroy(self.desc)


class _DeviceState:
    """One cuBLASLt handle, one workspace (from a TensorAllocator) and the plan cache of a device."""

    def __init__(self, allocator: TensorAllocator, workspace_bytes: int, handle=None):
        self.device = allocator.device
        self.allocator = allocator
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

    def clear_plans(self) -> None:
        if self.plans:
            lt = _lt()
            for plan in self.plans.values():
                plan.destroy(lt)
            self.plans.clear()


_STATES: dict[tuple[str, int], _DeviceState] = {}


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
    if state is not None and state.allocator is allocator and state.workspace_bytes >= workspace_bytes:
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


def num_plans(device) -> int:
    """How many matmul plans are cached for `device` (a Device); 0 on cpu."""
    state = _STATES.get((device.kind, device.index))
    return 0 if state is None else len(state.plans)


def _alignment(ptr: int) -> int:
    """The largest power of two dividing `ptr`, capped at 256 (cuBLASLt's default assumption); 0 for null."""
    return min(256, ptr & -ptr) if ptr else 0


def _make_plan(state: _DeviceState, out, a, b, bias, M, N, K, trans_a, trans_b, fast_accum) -> _Plan:
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

        pref = lt.matmul_preference_create()
        try:

            def set_pref(name, value):
                kind = getattr(lt.MatmulPreferenceAttribute, name)
                buf = np.array([value], dtype=lt.get_matmul_preference_attribute_dtype(kind))
                lt.matmul_preference_set_attribute(pref, kind, buf.ctypes.data, buf.itemsize)

            set_pref("MAX_WORKSPACE_BYTES", state.workspace_bytes)
            set_pref("MIN_ALIGNMENT_A_BYTES", _alignment(b.ptr))
            set_pref("MIN_ALIGNMENT_B_BYTES", _alignment(a.ptr))
            set_pref("MIN_ALIGNMENT_C_BYTES", _alignment(out.ptr))
            set_pref("MIN_ALIGNMENT_D_BYTES", _alignment(out.ptr))
            plan.algo = lt.MatmulHeuristicResult(1)
            plan.algo_ptr = plan.algo.ptr
            found = np.zeros(1, np.int32)
            why = "no algorithm returned"
            try:
                with state.device.activate():
                    lt.matmul_algo_get_heuristic(state.handle, plan.desc, *plan.layouts, pref, 1, plan.algo.ptr,
                                                 found.ctypes.data)  # fmt: skip
            except lt.cuBLASLtError as err:
                found[0] = 0
                why = str(err)
        finally:
            lt.matmul_preference_destroy(pref)
        if found[0] == 0 or plan.algo.state != 0:
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
    bias_name = None if bias is None else bias.dtype.name
    key = (a.dtype.name, b.dtype.name, out.dtype.name, bias_name, trans_a, trans_b, M, N, K, fast_accum,
           _alignment(a_ptr), _alignment(b_ptr), _alignment(out_ptr), _alignment(bias_ptr))  # fmt: skip
    lt = _lt()
    plan = state.plans.get(key)
    if plan is None:
        plan = state.plans[key] = _make_plan(state, out, a, b, bias, M, N, K, trans_a, trans_b, fast_accum)
    plan.set_pointers(lt, out, a, b, bias_ptr)
    la, lb, lc, ld = plan.layouts
    c_ptr = 0 if out.dtype.is_fp8 else out_ptr  # C = D in place; an FP8 D has no C (beta = 0), as in nvmath
    with dev.activate():
        lt.matmul(state.handle, plan.desc, _ONE_PTR, b_ptr, la, a_ptr, lb, _ONE_PTR if accumulate else _ZERO_PTR,
                  c_ptr, lc, out_ptr, ld, plan.algo_ptr, state.workspace_ptr, state.workspace_bytes,
                  dev._stream(stream).ptr)  # fmt: skip
