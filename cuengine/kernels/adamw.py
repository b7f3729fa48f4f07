"""AdamW with decoupled weight decay and seeded stochastic rounding for bf16 state.

Hyper-parameters and the clip scale are read on the device, so the update can be
captured once into a CUDA graph and replayed every step. bf16 params and moments
round stochastically from a counter-based hash of (seed, step, array, index):
without it, small updates to bf16 weights round away to nothing. The NumPy twin
draws the same bits and makes the same fp32 roundings, so cpu and cuda agree.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import BF16, BYTE, FP32, INT32
from . import _build
from .fp8 import abs_max_reference
from .norm import _THREADS as _NORM_THREADS
from .norm import NORM_SLOTS, global_norm_squared, norm_partials_shape

_U32 = np.uint32


def make_hparams(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> np.ndarray:
    """The (8,) fp32 hparams array that `adamw_update` reads; step is 1-based."""
    return np.array([lr, beta1, beta2, eps, weight_decay, step, 0, 0], np.float32)


# ---- the twin's random bits (same as mix32/sr_key/sr_bits in adamw.cu) ---------------------------
def _mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> _U32(15))
    x = x * _U32(0x846CA68B)
    return x ^ (x >> _U32(16))


def sr_bits(seed: int, step: int, which: int, index: np.ndarray) -> np.ndarray:
    """The 32 random bits for elements `index` (int64) of array `which` (0 param, 1 m, 2 v)."""
    with np.errstate(over="ignore"):
        base = np.array([(seed + 0x9E3779B9 * (which + 1)) & 0xFFFFFFFF], _U32)
        key = _mix32(_mix32(base) ^ _U32(step & 0xFFFFFFFF))
        idx = np.asarray(index, np.int64).astype(np.uint64)
        lo = (idx & np.uint64(0xFFFFFFFF)).astype(_U32)
        hi = (idx >> np.uint64(32)).astype(_U32)
        return _mix32(_mix32(key ^ lo) + hi)


def stochastic_round_bf16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Round fp32 `x` to bf16, up in magnitude with probability equal to the dropped fraction.

    Adds the low 16 of `bits` below the bf16 mantissa and truncates; inf and NaN round to nearest.
    """
    x = np.asarray(x, np.float32)
    raw = (x.view(_U32) + (bits.astype(_U32) & _U32(0xFFFF))) & _U32(0xFFFF0000)
    return np.where(np.isfinite(x), raw.view(np.float32), x).astype(BF16.np)


def _store(x: np.ndarray, dtype, seed: int, step: int, which: int, offset: int = 0) -> np.ndarray:
    if dtype == BF16.np:
        return stochastic_round_bf16(x, sr_bits(seed, step, which, np.arange(offset, offset + x.size)).reshape(x.shape))
    return x.astype(dtype)


def adamw_fp32_np(p, grad, m, v, hparams, grad_scale, weight_decay_on: bool):
    """The kernels' fp32 AdamW arithmetic, in their order, on flat fp32 p, m, v (grad any float
    dtype): returns (p, m, v, step), or None for a skipped step (a non-finite grad_scale). Shared
    by the AdamW and 8-bit AdamW twins; beta^step in float64 as the host computes it."""
    f32 = np.float32
    hp = np.asarray(hparams, f32)
    lr, b1, b2, eps = hp[0], hp[1], hp[2], hp[3]
    wd = hp[4] if weight_decay_on else f32(0)
    bc1 = f32(1.0 - np.float64(b1) ** np.float64(hp[5]))
    bc2 = f32(1.0 - np.float64(b2) ** np.float64(hp[5]))
    gs = f32(1) if grad_scale is None else f32(grad_scale)
    if not np.isfinite(gs):
        return None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = grad.astype(f32).reshape(-1) * gs
        m = b1 * m + (f32(1) - b1) * g
        v = b2 * v + (f32(1) - b2) * (g * g)
        upd = (m / bc1) / (np.sqrt(v / bc2) + eps) + wd * p
        p = p - lr * upd
    return p, m, v, int(hp[5])


def adamw_reference(param, grad, m, v, hparams, grad_scale, weight_decay_on: bool, seed: int, index_offset: int = 0):
    """The NumPy twin: returns new (param, m, v) in their own dtypes.

    Arrays may be of any shape with equal sizes; hparams as in `adamw_update`; grad_scale a
    float or None. Same fp32 operations, in the same order, as the kernel (`adamw_fp32_np`).
    A non-finite grad_scale returns the inputs unchanged (the skipped step).
    """
    f32 = np.float32
    out = adamw_fp32_np(param.astype(f32).reshape(-1), grad, m.astype(f32).reshape(-1), v.astype(f32).reshape(-1),
                        hparams, grad_scale, weight_decay_on)  # fmt: skip
    if out is None:
        return param.copy(), m.copy(), v.copy()
    p, m32, v32, step = out
    k = index_offset
    return (_store(p, param.dtype, seed, step, 0, k).reshape(param.shape),
            _store(m32, m.dtype, seed, step, 1, k).reshape(m.shape),
            _store(v32, v.dtype, seed, step, 2, k).reshape(v.shape))  # fmt: skip


def adamw_update(param, grad, m, v, hparams, grad_scale, weight_decay_on: bool, seed: int, index_offset: int = 0,
                 stream=None) -> None:  # fmt: skip
    """One AdamW step, in place on param, m and v.

    Args:
        param: fp32 or bf16, any shape (N elements).
        grad: fp32 or bf16, N elements.
        m, v: fp32 or bf16, N elements each: first and second moments.
        hparams: (8,) fp32 on the device: [lr, beta1, beta2, eps, weight_decay, step, 0, 0],
            step 1-based (see `make_hparams`). Read by the kernel, so a captured graph follows
            the values the host writes before each replay.
        grad_scale: (1,) fp32 on the device (the clip scale, `result[1:2]` of
            `global_norm_finish`), or None for 1. Non-finite: nothing is written (the step is
            skipped on the device: global_norm_finish gives NaN for a non-finite norm).
        weight_decay_on: False for norms and biases.
        seed: constant per tensor (it is baked into a captured graph); the step in hparams
            varies the draws. bf16 outputs round stochastically from these; fp32 ones do not.
        index_offset: the index of element 0 in the random draws: a slice [k, k+N) of a tensor
            updated with index_offset=k rounds exactly as that slice of the whole tensor (a
            rank updating its shard of a parameter rounds as one process would).

    Update: g = grad*scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr * ((m/(1-b1^step)) / (sqrt(v/(1-b2^step)) + eps) + wd p).

    NumPy equivalent: `adamw_reference(...)`.
    """
    what = "adamw_update"
    _checks.expect(param, f"{what}: param", dtype=(FP32, BF16))  # (N,)
    _checks.expect(grad, f"{what}: grad", dtype=(FP32, BF16))  # (N,)
    _checks.expect(m, f"{what}: m", dtype=(FP32, BF16))  # (N,)
    _checks.expect(v, f"{what}: v", dtype=(FP32, BF16))  # (N,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    n = param.nelem
    for t, label in ((grad, "grad"), (m, "m"), (v, "v")):
        if t.nelem != n:
            raise ValueError(
                f"{what}: {label} {t.name!r} {t.shape} {t.dtype} has {t.nelem} elements, "
                f"param {param.name!r} {param.shape} has {n}"
            )
    dev = _checks.same_device(param, grad, m, v, hparams, grad_scale)
    seed = int(seed) & 0xFFFFFFFF
    if n == 0:
        return
    if dev.is_cpu:
        gs = None if grad_scale is None else grad_scale.array()[0]
        p2, m2, v2 = adamw_reference(param.array(), grad.array(), m.array(), v.array(), hparams.array(), gs,
                                     weight_decay_on, seed, index_offset)  # fmt: skip
        param.array()[...] = p2
        m.array()[...] = m2
        v.array()[...] = v2
        return
    vec = _checks.is_aligned(param, grad, m, v)
    name = _build.kernel_name("adamw", param, grad, m, v, scalar=not vec)
    grid = _build.grid_size(dev, n, 256 * (8 if vec else 1), 8)
    args = (param, grad, m, v, hparams, grad_scale, np.int32(bool(weight_decay_on)), np.uint32(seed), np.int64(n),
            np.int64(index_offset))  # fmt: skip
    _build.launch("adamw", name, grid, 256, args, dev, stream, dependent=True)


# ---- multi-tensor: one launch over every parameter -------------------------------------------------
# One TensorRecord of adamw.cu: 72 bytes, in this order.
_RECORD = np.dtype([("param", "<u8"), ("grad", "<u8"), ("m", "<u8"), ("v", "<u8"), ("n", "<i8"), ("off", "<i8"),
                    ("seed", "<u4"), ("wd_on", "<i4"), ("first_chunk", "<i4"), ("first_norm", "<i4"),
                    ("amax", "<u8")])  # fmt: skip
CHUNK = 32768  # elements per block of adamw_multi (ADAMW_CHUNK in adamw.cu)


def _norm_grid(n: int) -> int:
    """The grid of norm.global_norm_squared for n elements (its sum order is that grid's)."""
    return min(NORM_SLOTS, _build.ceil_div(n, _NORM_THREADS * 8))


def _table_layout(numels) -> tuple[int, int, int]:
    """(records, adamw blocks, norm blocks) of a table over tensors of these element counts."""
    ns = [n for n in numels if n > 0]
    return len(ns), sum(_build.ceil_div(n, CHUNK) for n in ns), sum(_norm_grid(n) for n in ns)


def multi_tensor_table_shape(numels) -> tuple[int]:
    """Bytes of the BYTE table a `MultiTensorTable` over tensors of these element counts needs: the
    records, then the owner (int32 record index) of every adamw block and of every norm block."""
    k, chunks, norms = _table_layout(numels)
    return (max(1, k * _RECORD.itemsize + 4 * (chunks + norms)),)


def multi_norm_sums_shape(numels) -> tuple[int]:
    """The fp32 scratch `global_norm_squared_multi` writes for tensors of these element counts."""
    return (max(1, _table_layout(numels)[2]),)


class MultiTensorTable:
    """The device table that `adamw_update_multi` and `global_norm_squared_multi` read: one record
    per non-empty tensor (its four addresses, size, draw offset, seed, weight-decay flag, first
    block of each launch and abs-max slot), written once here, so a step allocates and uploads nothing.

    Args:
        table: BYTE tensor of `multi_tensor_table_shape(numels)` on the tensors' device; written now
            (a host-to-device copy: build the table outside any graph capture).
        grads: the tensors (fp32 or bf16, one dtype) whose squares `global_norm_squared_multi` sums.
        params, ms, vs: lists as long as grads, each quadruple as `adamw_update` takes it, one dtype
            per role (one kernel instantiation); or all None for a table that serves the norm alone.
        weight_decay_on, seeds: per tensor, as `adamw_update` takes them (None with params None).
        index_offsets: per tensor (adamw_update's index_offset), or None for 0.
        abs_maxes: per tensor, None or a (1,) fp32 slot into which `adamw_update_multi` max-accumulates
            |param| as stored (e.g. the `abs_max` of the weight's FP8 copy, so that the copy can be
            quantized without an abs-max pass); or None for no slots.

    The tensors must stay where they are: the table holds their addresses.
    """

    def __init__(self, table, grads, params=None, ms=None, vs=None, weight_decay_on=None, seeds=None,
                 index_offsets=None, abs_maxes=None):  # fmt: skip
        what = "MultiTensorTable"
        k = len(grads)
        if k == 0:
            raise ValueError(f"{what}: no tensors")
        self.norm_only = params is None
        if self.norm_only:
            if any(x is not None for x in (ms, vs, weight_decay_on, seeds, index_offsets, abs_maxes)):
                raise ValueError(
                    f"{what}: a norm-only table (params None) takes no ms, vs, flags, seeds, offsets or abs_maxes"
                )
            params = ms = vs = grads
            weight_decay_on, seeds = [False] * k, [0] * k
        index_offsets = [0] * k if index_offsets is None else list(index_offsets)
        abs_maxes = [None] * k if abs_maxes is None else list(abs_maxes)
        lists = {"params": params, "ms": ms, "vs": vs, "weight_decay_on": weight_decay_on, "seeds": seeds,
                 "index_offsets": index_offsets, "abs_maxes": abs_maxes}  # fmt: skip
        for label, lst in lists.items():
            if lst is None or len(lst) != k:
                raise ValueError(f"{what}: {label} has {None if lst is None else len(lst)} entries, grads has {k}")
        for p, g, m, v in zip(params, grads, ms, vs):
            for t, label, first in ((p, "param", params[0]), (g, "grad", grads[0]), (m, "m", ms[0]), (v, "v", vs[0])):
                _checks.expect(t, f"{what}: {label}", dtype=(FP32, BF16))  # (N,)
                if t.dtype != first.dtype:
                    raise ValueError(f"{what}: {label} {t.name!r} is {t.dtype} but {first.name!r} is {first.dtype}; "
                                     "one table holds one dtype per role")  # fmt: skip
            for t, label in ((g, "grad"), (m, "m"), (v, "v")):
                if t.nelem != p.nelem:
                    raise ValueError(f"{what}: {label} {t.name!r} {t.shape} {t.dtype} has {t.nelem} elements, "
                                     f"param {p.name!r} {p.shape} has {p.nelem}")  # fmt: skip
        slots = [a for a in abs_maxes if a is not None]
        for a in slots:
            _checks.expect(a, f"{what}: abs_maxes", dtype=FP32, shape=(1,))  # (1,)
        self.device = _checks.same_device(table, *params, *grads, *ms, *vs, *slots)
        want = multi_tensor_table_shape([p.nelem for p in params])
        _checks.expect(table, f"{what}: table", dtype=BYTE, shape=want)  # (bytes,)
        kept = [i for i, p in enumerate(params) if p.nelem]
        self.entries = [
            (params[i], grads[i], ms[i], vs[i], weight_decay_on[i], seeds[i], index_offsets[i]) for i in kept
        ]
        self.abs_maxes = [abs_maxes[i] for i in kept]  # one per entry: None or the (1,) slot
        k, self.chunks, self.norm_blocks = _table_layout([e[0].nelem for e in self.entries])
        rec = np.zeros(k, _RECORD)
        owners = np.zeros(self.chunks + self.norm_blocks, np.int32)
        chunks = norms = 0
        for i, (r, (p, g, m, v, wd, seed, off), amax) in enumerate(zip(rec, self.entries, self.abs_maxes)):
            r["param"], r["grad"], r["m"], r["v"] = p.ptr, g.ptr, m.ptr, v.ptr
            r["amax"] = 0 if amax is None else amax.ptr
            r["n"], r["off"], r["seed"], r["wd_on"] = p.nelem, off, int(seed) & 0xFFFFFFFF, bool(wd)
            r["first_chunk"], r["first_norm"] = chunks, norms
            c, b = _build.ceil_div(p.nelem, CHUNK), _norm_grid(p.nelem)
            owners[chunks : chunks + c] = i
            owners[self.chunks + norms : self.chunks + norms + b] = i
            chunks, norms = chunks + c, norms + b
        head = k * _RECORD.itemsize
        if self.device.is_cuda and self.entries:
            table.copy_from_numpy(np.concatenate([rec.view(np.uint8), owners.view(np.uint8)]))
        self.table = table
        if self.entries:  # the owner maps: int32 views of the table after the records
            owner = table.rows(head, head + owners.nbytes).view(INT32)
            self.chunk_owner, self.norm_owner = owner[: self.chunks], owner[self.chunks :]
        self.dtypes = (params[0], grads[0], ms[0], vs[0])

    def norm_sums_shape(self) -> tuple[int]:
        """The fp32 scratch `global_norm_squared_multi` writes: one sum per norm block."""
        return multi_norm_sums_shape([e[0].nelem for e in self.entries])


def adamw_update_multi(table: MultiTensorTable, hparams, grad_scale, stream=None) -> None:
    """`adamw_update` of every tensor of `table`, in one launch, bitwise as one launch per tensor.

    Args:
        table: a MultiTensorTable (params, grads, moments, seeds, decay flags, offsets, abs-max slots).
        hparams: (8,) fp32 on the device, as `adamw_update` reads it.
        grad_scale: (1,) fp32 on the device or None; non-finite: no param or moment is written.

    Each tensor's abs-max slot (if it has one) max-accumulates max|param| of the new param as stored,
    bitwise `fp8.abs_max(slot, param)` after the update (of the unchanged param on a skipped step).

    NumPy equivalent: `adamw_reference` per tensor (the cpu path calls `adamw_update` per tensor), then
    `slot[0] = max(slot[0], fp8.abs_max_reference(param))`.
    """
    what = "adamw_update_multi"
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    dev = _checks.same_device(table.table, hparams, grad_scale)
    if table.norm_only:
        raise ValueError(f"{what}: the table was built for the norm alone (no params, ms, vs)")
    if not table.entries:
        return
    if dev.is_cpu:
        for (p, g, m, v, wd, seed, off), amax in zip(table.entries, table.abs_maxes):
            adamw_update(p, g, m, v, hparams, grad_scale, wd, seed, off)
            if amax is not None:
                a = amax.array()
                a[0] = np.maximum(a[0], abs_max_reference(p.array()))
        return
    name = _build.kernel_name("adamw_multi", *table.dtypes)
    args = (table.table, table.chunk_owner, hparams, grad_scale)
    _build.launch("adamw", name, table.chunks, 256, args, dev, stream, dependent=True)


def global_norm_squared_multi(partials, sums, table: MultiTensorTable, stream=None) -> None:
    """partials = (zero, then `norm.global_norm_squared(partials, grad)` for every grad of `table` in
    order), bitwise, in two launches: the per-tensor sums in one, then their fold in table order.

    Args:
        partials: fp32 of `norm.norm_partials_shape()`, written (=): no zeroing needed.
        sums: fp32 scratch of `table.norm_sums_shape()`.
        table: a MultiTensorTable; its grads are the tensors summed.

    NumPy equivalent: `partials[...] = 0; partials[0] += global_norm_squared_reference(g)` per grad.
    """
    what = "global_norm_squared_multi"
    _checks.expect(partials, f"{what}: partials", dtype=FP32, shape=norm_partials_shape())
    _checks.expect(sums, f"{what}: sums", dtype=FP32, shape=table.norm_sums_shape())
    dev = _checks.same_device(partials, sums, table.table)
    if dev.is_cpu or not table.entries:
        partials.fill_zero(stream)
        for e in table.entries:
            global_norm_squared(partials, e[1], stream=stream)
        return
    count = np.int32(len(table.entries))
    grad = table.dtypes[1]
    name = _build.kernel_name("global_norm_squared_multi", grad)
    args = (sums, table.table, table.norm_owner, count)
    _build.launch("adamw", name, table.norm_blocks, _NORM_THREADS, args, dev, stream, dependent=True)
    args = (partials, sums, table.table, count, np.int32(table.norm_blocks), np.int32(NORM_SLOTS))
    _build.launch("adamw", "global_norm_fold_multi", 1, 1024, args, dev, stream, dependent=True)
