"""The MLP op, fc1 -> activation -> fc2, with a hand-written backward and activation recompute (seed 002).

    preact  = x @ w1ᵀ          # (N, F1)  F1 = 2H for gated activations, H otherwise
    postact = act(preact)      # (N, H)   gated: act(gate = preact[:, 0::2], up = preact[:, 1::2])
    out     = postact @ w2ᵀ    # (N, out)

Forward saves x (a reference) and, unless recompute, fc1's output `preact`; the post-activation is
never saved: backward recomputes it from preact (one elementwise pass), as the seed's fused
dact-GEMM does. Backward then overwrites preact with its own gradient, so a context serves one
backward (autograd frees saved tensors likewise) and backward's temporaries are only (N, hidden).
With recompute, backward recomputes preact with one extra GEMM into an (N, F1) stack temporary, so
the only activation memory between forward and backward is the caller's x. Gated activations read
preact in the interleaved (d two) layout the seed uses, so w1's rows alternate gate, up, gate, ...

FP8 (`matmul_dtype="e4m3"`): the two forward GEMMs read per-tensor-scaled e4m3 copies of x, w1,
postact and w2, made on the stack (the postact abs-max is fused into the activation kernel). The
backward GEMMs stay in the inputs' dtype: Hopper FP8 GEMMs are TN only, and the transposed FP8
copies a full FP8 backward needs belong to the model's forward_qmm/backward_qmm, not to this op.
The gradients are therefore those of the bf16 graph at the FP8 forward's pre-activation.

Memory: the out-first functions (`mlp_forward`, `mlp_backward`) allocate nothing. Their temporaries
come from a DeviceMemoryStack and are freed in LIFO order before they return, so a step that calls
them can be captured into a CUDA graph. `mlp_stack_bytes` sizes that stack by running the same code
against a simulated stack. `mlp` and `mlp_grad` are the thin allocating wrappers, and `mlp_numpy`
is the arrays-in, arrays-out twin (the cpu device computes exactly it).

Gradients: activation gradients are written (`=`); weight gradients are written too, unless the
context says fuse_grad_accum, in which case they accumulate into the given buffers (`+=`, a GEMM
with beta = 1), as the seed's gemm_add_inplace does.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

from .._checks import expect, same_device
from ..alloc import DeviceMemoryStack
from ..blas import matmul, matmul_numpy
from ..device import device as _get_device
from ..dtypes import BF16, BYTE, FP8_E4M3, FP32
from ..dtypes import dtype as _dtype
from ..kernels import fp8
from ..kernels.activations import (
    ACTIVATIONS,
    GATED,
    activation_backward,
    activation_backward_np,
    activation_forward,
    activation_forward_np,
)
from ..tensor import STATS_SLOTS, Tensor

DTYPES = (BF16, FP32)


@dataclass
class MLPContext:
    """What `mlp_backward` needs from `mlp_forward` (the seed's saved tensors).

    x, w1 and w2 are references to the caller's tensors, not copies: they must keep their values
    until backward has run. `preact` is the caller's buffer holding fc1's output, or None when
    backward recomputes it; backward overwrites it with its gradient and marks the context consumed.
    """

    x: Tensor  # (N, in) or (..., in)
    w1: Tensor  # (F1, in)
    w2: Tensor  # (out, H)
    preact: Tensor | None  # (N, F1), None under recompute
    activation: str
    fuse_grad_accum: bool = False
    matmul_dtype: str | None = None  # "e4m3": the forward GEMMs (and fc1's recompute) ran in FP8
    consumed: bool = False  # preact holds its gradient now: a second backward would read garbage

    @property
    def recompute(self) -> bool:
        return self.preact is None

    @property
    def saved_bytes(self) -> int:
        """Activation bytes kept alive between forward and backward beyond the input x."""
        return 0 if self.preact is None else self.preact.nbytes


@dataclass(frozen=True)
class _Dims:
    n: int  # rows (tokens)
    inp: int  # in_features
    f1: int  # fc1 outputs: 2H gated, H otherwise
    hidden: int  # H
    out: int  # out_features
    dtype: object
    gated: bool
    fp8: bool  # forward GEMMs on e4m3 copies


def _matmul_dtype(matmul_dtype) -> str | None:
    if matmul_dtype is None:
        return None
    name = _dtype(matmul_dtype).name
    if name in ("bf16", "fp32"):
        return None
    if name != "e4m3":
        raise ValueError(
            f"mlp: matmul_dtype must be None (the inputs' dtype) or 'e4m3', got {matmul_dtype!r}; "
            "e5m2 is for gradients, and this op's backward GEMMs run in the inputs' dtype"
        )
    return name


def _dims(x, w1, w2, activation, matmul_dtype=None) -> _Dims:
    """Check the MLP's inputs and return its sizes; every rejection names the tensor and why."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"mlp: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    for t, what in ((x, "mlp x"), (w1, "mlp w1"), (w2, "mlp w2")):
        if not isinstance(t, Tensor):
            raise ValueError(f"{what}: expected a cuengine Tensor, got {type(t).__name__}")
        if t.dtype.is_fp8:
            raise ValueError(
                f"{what}: tensor {t.name!r} is {t.dtype}; pass bf16 or fp32 tensors and matmul_dtype='e4m3' "
                "for FP8 forward GEMMs (the op quantises them itself)"
            )
    dt = x.dtype
    if dt not in DTYPES:
        raise ValueError(f"mlp x: expected dtype bf16/fp32, got tensor {x.name!r} {x.dtype} {x.shape}")
    if x.ndim < 2:
        raise ValueError(f"mlp x: expected shape (..., in) with at least 2 dimensions, got {x.name!r} {x.shape}")
    gated = activation in GATED
    n, inp = math.prod(x.shape[:-1]), x.shape[-1]
    _check(w2, "mlp w2 (out, hidden)", dt, (None, None))
    out, hidden = w2.shape
    f1 = 2 * hidden if gated else hidden
    _check(w1, f"mlp w1 ({'2*hidden' if gated else 'hidden'}, in) for {activation}", dt, (f1, inp))
    if n == 0:
        raise ValueError(f"mlp x: tensor {x.name!r} {x.shape} has no rows")
    for size, name in ((inp, "in_features"), (hidden, "hidden_features"), (out, "out_features")):
        if size % 8:
            raise ValueError(
                f"mlp: {name} = {size} must be a multiple of 8 (16-byte rows for cuBLASLt and the vector kernels)"
            )
    fp8_gemms = _matmul_dtype(matmul_dtype) is not None
    if fp8_gemms:
        for size, name in ((inp, "in_features"), (hidden, "hidden_features")):
            if size % 16:
                raise ValueError(
                    f"mlp: {name} = {size} must be a multiple of 16 for matmul_dtype='e4m3' (the K of an FP8 "
                    "GEMM spans 16-byte rows)"
                )
    return _Dims(n, inp, f1, hidden, out, dt, gated, fp8_gemms)


def _check(t, what, dtype, shape) -> Tensor:
    """expect() that also takes a sizing run's layout-only tensors (mlp_stack_bytes)."""
    return expect(t, what, dtype=dtype, shape=shape, simulated_ok=True)


def _rows(t: Tensor, n: int) -> Tensor:
    return t.reshape(n, t.shape[-1])


class _Launch:
    """The launches one MLP call makes, in stream order; all no-ops against a simulated stack,
    which is how mlp_stack_bytes runs the real code without memory."""

    def __init__(self, stack: DeviceMemoryStack, d: _Dims, activation: str, stream):
        self.live = not stack.is_simulated
        self.stack, self.d, self.activation, self.stream = stack, d, activation, stream
        self.layout = {"layout": "interleaved"} if d.gated else {}

    def matmul(self, out, a, b, **kwargs):
        if self.live:
            matmul(out, a, b, stream=self.stream, **kwargs)

    def act_forward(self, post, pre, abs_max=None):
        if self.live:
            activation_forward(post, pre, self.activation, **self.layout, abs_max=abs_max, stream=self.stream)

    def act_backward(self, dpre, dpost, pre):
        if self.live:
            activation_backward(dpre, dpost, pre, self.activation, **self.layout, stream=self.stream)

    @contextlib.contextmanager
    def e4m3(self, shape, name, src=None):
        """An e4m3 stack temporary with its own stats slot (zeroed), quantised from `src` if given."""
        with self.stack.temporary(FP32, (STATS_SLOTS,), f"{name}.stats") as stats:
            with self.stack.temporary(FP8_E4M3, shape, name) as raw:
                q = raw.with_stats(stats)
                if self.live:
                    stats.fill_zero(self.stream)  # abs-max outputs max-accumulate
                    if src is not None:
                        fp8.abs_max(q.abs_max, src, stream=self.stream)
                        fp8.quantize_with_abs_max(q, src, stream=self.stream)
                yield q

    def fc1(self, pre, x2, w1):
        """pre (N, F1) = x @ w1ᵀ, on e4m3 copies of x and w1 under FP8."""
        if not self.d.fp8:
            self.matmul(pre, x2, w1)
            return
        with self.e4m3(x2.shape, "mlp.x_e4m3", x2) as x8, self.e4m3(w1.shape, "mlp.w1_e4m3", w1) as w18:
            self.matmul(pre, x8, w18)

    def act_fc2(self, out2, pre, w2):
        """out (N, out) = act(pre) @ w2ᵀ, on e4m3 copies of act(pre) and w2 under FP8."""
        d, stack = self.d, self.stack
        if not d.fp8:
            with stack.temporary(d.dtype, (d.n, d.hidden), "mlp.postact") as post:
                self.act_forward(post, pre)  # (N, H)
                self.matmul(out2, post, w2)
            return
        with self.e4m3((d.n, d.hidden), "mlp.postact_e4m3") as post8:
            with stack.temporary(d.dtype, (d.n, d.hidden), "mlp.postact") as post:
                self.act_forward(post, pre, abs_max=post8.abs_max)  # the abs-max fused into the activation
                if self.live:
                    fp8.quantize_with_abs_max(post8, post, stream=self.stream)
            with self.e4m3(w2.shape, "mlp.w2_e4m3", w2) as w28:
                self.matmul(out2, post8, w28)


def _saved_or_temp(stack: DeviceMemoryStack, saved: Tensor | None, d: _Dims, name: str):
    """`saved` itself, or an (N, F1) stack temporary when there is none (recompute)."""
    if saved is not None:
        return contextlib.nullcontext(saved)
    return stack.temporary(d.dtype, (d.n, d.f1), name)


def mlp_forward(out, preact, x, w1, w2, activation: str, stack: DeviceMemoryStack, *, matmul_dtype=None,
                fuse_grad_accum: bool = False, stream=None) -> MLPContext:  # fmt: skip
    """out = act(x @ w1ᵀ) @ w2ᵀ, writing into caller-supplied buffers.

    Args:
        out: (..., out) output, same leading dims and dtype as x (written).
        preact: (N, F1) buffer that keeps fc1's output for backward (written), or None to save
            nothing and recompute it in backward (recompute=True).
        x: (..., in) input, bf16 or fp32; N = prod(leading dims).
        w1: (F1, in) fc1 weight; F1 = 2*hidden for gated activations (rows interleaved gate, up),
            hidden otherwise.
        w2: (out, hidden) fc2 weight.
        activation: one of ACTIVATIONS ("gelu_tanh_approx", "relu", "relu_sq", "swiglu",
            "swiglu_oai", "reglu", "geglu", "glu").
        stack: temporaries: the (N, hidden) post-activation, plus the (N, F1) pre-activation under
            recompute, plus the e4m3 copies under FP8; all freed before returning. A simulated
            stack records them and launches nothing.
        matmul_dtype: None, or "e4m3" for FP8 forward GEMMs (in and hidden multiples of 16).
        fuse_grad_accum: recorded in the context: backward then accumulates dW1 and dW2 (`+=`).
    Returns:
        The MLPContext that mlp_backward takes.
    Raises:
        ValueError for unknown activations, sizes not multiples of 8, mismatched weights, dtype or
        device mismatches, and fp8 inputs. MemoryError if the stack is too small.

    NumPy: `out = act(x @ w1.T) @ w2.T`, rounding to the storage dtype after each GEMM and the
    activation (under FP8, x, w1, act(...) and w2 are quantised to e4m3 for the products).
    """
    d = _dims(x, w1, w2, activation, matmul_dtype)
    _check(out, "mlp_forward out", d.dtype, x.shape[:-1] + (d.out,))
    if preact is not None:
        _check(preact, "mlp_forward preact", d.dtype, (d.n, d.f1))
    if not stack.is_simulated:
        same_device(out, preact, x, w1, w2)
        _ensure_room(stack, "mlp_forward", _stack_need(d, activation, preact is None, (True, True, True))[0])
    ops = _Launch(stack, d, activation, stream)
    with _saved_or_temp(stack, preact, d, "mlp.preact") as pre:
        ops.fc1(pre, _rows(x, d.n), w1)  # (N, F1) = (N, in) @ (F1, in)ᵀ
        ops.act_fc2(_rows(out, d.n), pre, w2)  # (N, out) = act(N, F1 -> N, H) @ (out, H)ᵀ
    return MLPContext(x, w1, w2, preact, activation, fuse_grad_accum, _matmul_dtype(matmul_dtype))


def mlp_backward(dx, dw1, dw2, dout, ctx: MLPContext, stack: DeviceMemoryStack, *, stream=None) -> None:
    """Gradients of the MLP, writing into caller-supplied buffers.

    Args:
        dx: (..., in) input gradient (written), or None if not wanted. It is written last, so it
            may be x itself or dout's memory (in place).
        dw1: (F1, in) fc1 weight gradient, or None; written, or accumulated (`+=`) when
            ctx.fuse_grad_accum. The weights' dtype, or fp32 (rounded once from the fp32 GEMM).
        dw2: (out, hidden) fc2 weight gradient, or None; written, or accumulated likewise.
        dout: (..., out) upstream gradient.
        ctx: what mlp_forward returned; its x, w1, w2 (and preact) must be unchanged since. The
            pre-activation (ctx.preact, or under recompute the stack temporary it is recomputed
            into) is overwritten in place by its gradient, so a saved context serves one backward.
        stack: temporaries: the (N, hidden) post-activation, reused for its gradient, plus under
            recompute the (N, F1) pre-activation; all freed before returning.
    Raises:
        ValueError for wrong shapes, dtypes or devices, or a context whose preact an earlier
        backward consumed; MemoryError (before any launch) if the stack is too small.

    NumPy (float64, no intermediate rounding):
        pre = x @ w1.T; post = act(pre); dw2 (+)= dout.T @ post
        dpre = act_grad(pre, dout @ w2); dx = dpre @ w1; dw1 (+)= dpre.T @ x
    """
    x, w1, w2 = ctx.x, ctx.w1, ctx.w2
    d = _dims(x, w1, w2, ctx.activation, ctx.matmul_dtype)
    _check(dout, "mlp_backward dout", d.dtype, x.shape[:-1] + (d.out,))
    if dx is not None:
        _check(dx, "mlp_backward dx", d.dtype, x.shape)
    grad_dtypes = (d.dtype, FP32)  # bf16 weights may keep fp32 gradients (cuBLASLt writes fp32 from bf16)
    if dw1 is not None:
        _check(dw1, "mlp_backward dw1", grad_dtypes, w1.shape)
    if dw2 is not None:
        _check(dw2, "mlp_backward dw2", grad_dtypes, w2.shape)
    if ctx.preact is not None:
        _check(ctx.preact, "mlp_backward ctx.preact", d.dtype, (d.n, d.f1))
    need_dpre = dx is not None or dw1 is not None
    if ctx.consumed:
        raise ValueError(
            "mlp_backward: ctx.preact already holds its gradient from an earlier backward; run mlp_forward again "
            "(or use recompute, whose context can serve any number of backwards)"
        )
    if not need_dpre and dw2 is None:
        return
    if not stack.is_simulated:
        same_device(dx, dw1, dw2, dout, x, w1, w2, ctx.preact)
        wanted = (dx is not None, dw1 is not None, dw2 is not None)
        _ensure_room(stack, "mlp_backward", _stack_need(d, ctx.activation, ctx.recompute, wanted)[1])
    ops = _Launch(stack, d, ctx.activation, stream)
    acc = ctx.fuse_grad_accum
    x2, dout2 = _rows(x, d.n), _rows(dout, d.n)
    with _saved_or_temp(stack, ctx.preact, d, "mlp.preact") as pre:
        if ctx.recompute:
            ops.fc1(pre, x2, w1)  # the extra GEMM recompute trades for memory; bitwise the forward's
        dpre = pre  # the activation gradient overwrites the pre-activation in place
        with stack.temporary(d.dtype, (d.n, d.hidden), "mlp.postact") as post:
            if dw2 is not None:
                ops.act_forward(post, pre)  # bitwise the forward's (bf16/fp32) post-activation
                ops.matmul(dw2, dout2, post, trans_a=True, trans_b=False, accumulate=acc)  # (out, H) = doutᵀ @ post
            if need_dpre:
                dpost = post  # the post-activation is dead once dW2 has it: reuse its memory
                ops.matmul(dpost, dout2, w2, trans_b=False)  # (N, H) = (N, out) @ (out, H)
                ops.act_backward(dpre, dpost, pre)  # (N, F1)
        if dw1 is not None:
            ops.matmul(dw1, dpre, x2, trans_a=True, trans_b=False, accumulate=acc)  # (F1, in) = dpreᵀ @ x
        if dx is not None:  # last: nothing reads x or dout after it, so dx may overwrite either
            ops.matmul(_rows(dx, d.n), dpre, w1, trans_b=False)  # (N, in) = (N, F1) @ (F1, in)
    if need_dpre and not ctx.recompute:
        ctx.consumed = True


def mlp_numpy(x, w1, w2, activation: str, dout=None, dw1=None, dw2=None, matmul_dtype=None, grad_dtype=None):
    """The NumPy twin of mlp_forward + mlp_backward, arrays in and arrays out, with the same rounding
    points (what the cpu device computes, bit for bit).

    Args:
        x (..., in), w1 (F1, in), w2 (out, H): float32 or ml_dtypes bfloat16 arrays of one dtype.
        activation: as mlp_forward; gated ones read the interleaved layout.
        dout: (..., out) upstream gradient, or None for the forward alone.
        dw1, dw2: existing gradients to accumulate into (fuse_grad_accum), or None to write them;
            their dtype (x's or float32) is the result's.
        matmul_dtype: None or "e4m3" (forward GEMMs on per-tensor-scaled e4m3 copies).
        grad_dtype: NumPy dtype of written weight gradients (default x's).
    Returns:
        (out, dx, dw1, dw2); the gradients are None without dout. Saved and recompute contexts
        give the same values, so there is one twin for both.
    """
    dt = x.dtype
    layout = "interleaved" if activation in GATED else "split"
    x2 = x.reshape(-1, x.shape[-1])
    quantised = _matmul_dtype(matmul_dtype) is not None

    def forward_gemm(a, b):  # (M, K) @ (N, K)ᵀ, on e4m3 copies under FP8
        if not quantised:
            return matmul_numpy(a, b, out_dtype=dt)
        (qa, sa), (qb, sb) = (fp8.quantize_reference(t, fp8.abs_max_reference(t), FP8_E4M3) for t in (a, b))
        return matmul_numpy(qa, qb, scale_a=sa[2], scale_b=sb[2], out_dtype=dt)

    pre = forward_gemm(x2, w1)  # (N, F1)
    post = activation_forward_np(pre, activation, layout)  # (N, H)
    out = forward_gemm(post, w2).reshape(x.shape[:-1] + (w2.shape[0],))
    if dout is None:
        return out, None, None, None
    d2 = dout.reshape(-1, dout.shape[-1])
    gdt = dt if grad_dtype is None else grad_dtype
    g2 = matmul_numpy(d2, post, c=dw2, trans_a=True, trans_b=False, out_dtype=gdt if dw2 is None else dw2.dtype)
    dpost = matmul_numpy(d2, w2, trans_b=False, out_dtype=dt)  # (N, H)
    dpre = activation_backward_np(dpost, pre, activation, layout)  # (N, F1)
    g1 = matmul_numpy(dpre, x2, c=dw1, trans_a=True, trans_b=False, out_dtype=gdt if dw1 is None else dw1.dtype)
    dx = matmul_numpy(dpre, w1, trans_b=False, out_dtype=dt).reshape(x.shape)
    return out, dx, g1, g2


def mlp_stack_bytes(n: int, in_features: int, hidden: int, out_features: int, activation: str,
                    recompute: bool, dtype="bf16", matmul_dtype=None) -> int:  # fmt: skip
    """Stack bytes that one mlp_forward plus mlp_backward (all gradients) needs, by simulation.

    It runs the real functions against a simulated stack with layout-only tensors, so it cannot
    drift from what they allocate. Without FP8 the peak is (N, hidden) elements, plus (N, F1)
    under recompute; FP8 adds the e4m3 copies of the forward GEMMs' operands.
    """
    dt = _dtype(dtype)
    f1 = 2 * hidden if activation in GATED else hidden
    layout = _layout_tensor(dt)
    d = _dims(layout("x", (n, in_features)), layout("w1", (f1, in_features)), layout("w2", (out_features, hidden)),
              activation, matmul_dtype)  # fmt: skip
    return max(_stack_need(d, activation, recompute, (True, True, True)))


def _layout_tensor(dt):
    cpu = _get_device("cpu")
    return lambda name, shape: Tensor(dt, shape, cpu, None, 0, name)


@functools.lru_cache(maxsize=256)
def _stack_need(d: _Dims, activation: str, recompute: bool, wanted: tuple[bool, bool, bool]) -> tuple[int, int]:
    """(forward, backward) stack bytes for these sizes and wanted gradients (dx, dw1, dw2): the real
    functions run against simulated stacks with layout-only tensors, once per configuration."""
    layout = _layout_tensor(d.dtype)
    x = layout("x", (d.n, d.inp))
    w1, w2 = layout("w1", (d.f1, d.inp)), layout("w2", (d.out, d.hidden))
    fwd, bwd = DeviceMemoryStack.simulate(), DeviceMemoryStack.simulate()
    preact = None if recompute else layout("preact", (d.n, d.f1))
    matmul_dtype = "e4m3" if d.fp8 else None
    ctx = mlp_forward(layout("out", (d.n, d.out)), preact, x, w1, w2, activation, fwd, matmul_dtype=matmul_dtype)
    grads = [
        layout(name, t.shape) if want else None for name, t, want in zip(("dx", "dw1", "dw2"), (x, w1, w2), wanted)
    ]
    mlp_backward(*grads, layout("dout", (d.n, d.out)), ctx, bwd)
    return fwd.max_utilization(), bwd.max_utilization()


def _ensure_room(stack: DeviceMemoryStack, what: str, need: int) -> None:
    """Raise before any launch when the stack cannot hold the call's temporaries: a MemoryError half
    way through backward would leave a gradient accumulated once already."""
    free = stack.capacity - stack.used
    if need > free:
        raise MemoryError(
            f"stack {stack.name!r}: {what} needs {need} bytes of temporaries but {free} of its {stack.capacity} "
            "are free; size the stack with mlp_stack_bytes or by simulating the step first"
        )


def _stack_for(d: _Dims, activation, recompute, matmul_dtype, device) -> DeviceMemoryStack:
    size = mlp_stack_bytes(d.n, d.inp, d.hidden, d.out, activation, recompute, d.dtype, matmul_dtype)
    return DeviceMemoryStack(Tensor.empty(BYTE, (size,), device, name="mlp.stack"), name="mlp.stack")


def mlp(x, w1, w2, activation: str, recompute: bool = False, fuse_grad_accum: bool = False, matmul_dtype=None,
        stack: DeviceMemoryStack | None = None, stream=None) -> tuple[Tensor, MLPContext]:  # fmt: skip
    """Allocating wrapper over mlp_forward: returns (out (..., out), ctx for mlp_grad).

    It allocates out, the saved pre-activation (unless recompute) and, if no stack is given, a stack
    of mlp_stack_bytes. Inside a step use mlp_forward with preallocated buffers instead.
    NumPy: `act(x @ w1.T) @ w2.T`.
    """
    d = _dims(x, w1, w2, activation, matmul_dtype)
    dev = x.device
    out = Tensor.empty(d.dtype, x.shape[:-1] + (d.out,), dev, name="mlp.out")
    preact = None if recompute else Tensor.empty(d.dtype, (d.n, d.f1), dev, name="mlp.preact")
    stack = stack if stack is not None else _stack_for(d, activation, recompute, matmul_dtype, dev)
    ctx = mlp_forward(out, preact, x, w1, w2, activation, stack, matmul_dtype=matmul_dtype,
                      fuse_grad_accum=fuse_grad_accum, stream=stream)  # fmt: skip
    return out, ctx


def mlp_grad(dout, ctx: MLPContext, dw1=None, dw2=None, stack: DeviceMemoryStack | None = None,
             stream=None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Allocating wrapper over mlp_backward: returns (dx, dw1, dw2).

    With ctx.fuse_grad_accum, given dw1/dw2 are existing gradients that receive `+=`; a gradient
    not given is allocated and written (the seed does the same when weight.grad is None).
    Without fuse_grad_accum, given dw buffers are overwritten.
    """
    x, w1, w2 = ctx.x, ctx.w1, ctx.w2
    d = _dims(x, w1, w2, ctx.activation, ctx.matmul_dtype)
    dev = x.device
    dx = Tensor.empty(d.dtype, x.shape, dev, name="mlp.dx")
    fresh = []
    if dw1 is None:
        dw1 = Tensor.empty(d.dtype, w1.shape, dev, name="mlp.dw1")
        fresh.append(dw1)
    if dw2 is None:
        dw2 = Tensor.empty(d.dtype, w2.shape, dev, name="mlp.dw2")
        fresh.append(dw2)
    if ctx.fuse_grad_accum:
        for t in fresh:  # nothing to accumulate into: start from zero, which equals writing
            t.fill_zero(stream)
    stack = stack if stack is not None else _stack_for(d, ctx.activation, ctx.recompute, ctx.matmul_dtype, dev)
    mlp_backward(dx, dw1, dw2, dout, ctx, stack, stream=stream)
    return dx, dw1, dw2
