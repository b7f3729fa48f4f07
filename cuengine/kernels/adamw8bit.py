"""8-bit AdamW: m and v as 8-bit codes with one fp32 abs-max per block of 256 elements.

bitsandbytes' block-wise dynamic quantization (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2022): a code is an index into a 256-entry map whose values are spread
logarithmically over [-1, 1] (signed, for m) or [0, 1] (unsigned, for v), scaled by the block's
abs-max. A linear int8 code would round the small second moments of a block to zero, and
m / (sqrt(0) + eps) then blows up; the dynamic map keeps about 2 significant digits over 7 decades.
Each kernel dequantizes, updates in fp32 exactly as `adamw.adamw_update`, and requantizes, in one
pass. State: 2 bytes per parameter plus 8 bytes per 256, against 8 for fp32 moments.
`adamw8bit_update_multi` updates every tensor of an `AdamW8bitTable` in one launch, with the bits of
one `adamw8bit_update` per tensor.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import _checks
from ..dtypes import BF16, BYTE, FP32, INT32
from . import _build
from .adamw import _store, adamw_fp32_np

QBLOCK = 256  # elements per abs-max scale


@functools.cache
def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: 256 sorted
    fp32 values; for each decade 10^-6 .. 10^0, the midpoints of an even split of [0.1, 1] (twice
    as many per decade unsigned, which needs no sign), plus 0 and 1."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = np.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += list(10.0 ** (-6 + i) * means)
        if signed:
            data += list(-(10.0 ** (-6 + i)) * means)
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.sort(np.array(data, np.float64)).astype(np.float32)


@functools.cache
def make_qmaps() -> np.ndarray:
    """The (1024,) fp32 `qmaps` buffer `adamw8bit_update` reads: [signed map | its midpoints, +inf |
    unsigned map | its midpoints, +inf]; the midpoints are rounded to fp32 here, once, for both the
    kernel and the twin."""
    parts = []
    for signed in (True, False):
        c = dynamic_map(signed)
        mids = (c[:-1] + c[1:]) * np.float32(0.5)
        parts += [c, mids, np.array([np.inf], np.float32)]
    return np.concatenate(parts).astype(np.float32)


# The bucket table of adamw8bit_multi's quantization (BSHIFT, BFIRST, BHALF, BBYTES in adamw8bit.cu).
BUCKET_SHIFT = 16  # a bucket: the |x| whose fp32 bits share their top 16 (exponent and 7 mantissa bits)
BUCKET_MIN, BUCKET_MAX = np.float32(2.0**-23), np.float32(1.0)  # smaller |x| join the first bucket, larger the last
_BFIRST = int(BUCKET_MIN.view(np.uint32)) >> BUCKET_SHIFT
BUCKET_HALF = (int(BUCKET_MAX.view(np.uint32)) >> BUCKET_SHIFT) - _BFIRST + 1  # buckets per map and sign
BUCKET_BYTES = -(-4 * BUCKET_HALF // 16) * 16


@functools.cache
def make_buckets() -> np.ndarray:
    """The (BUCKET_BYTES,) uint8 table adamw8bit_multi's `quantize_bucket` reads: for the signed map,
    then the unsigned one, first x >= 0 (and -0) and then x < 0 (and NaN), the number of midpoints of
    `make_qmaps()` below every x of each bucket of |x|. Checked here: at most one midpoint lies inside
    a bucket (so the kernel's one comparison with the next midpoint finishes the count) and a NaN,
    which takes the last negative bucket, gets code 0 as the binary search gives it."""
    q = make_qmaps()
    t = np.arange(_BFIRST, _BFIRST + BUCKET_HALF, dtype=np.uint32)
    lo_abs = (t << BUCKET_SHIFT).view(np.float32).copy()  # the smallest |x| of each bucket
    hi_abs = ((t + 1) << BUCKET_SHIFT).view(np.float32)  # the next bucket's first |x|
    hi_abs = np.nextafter(hi_abs, np.float32(0))  # ... the largest |x| of each bucket
    lo_abs[0], hi_abs[-1] = 0.0, np.inf  # the clamps: [0, ...] and [1, inf]
    out = np.zeros(BUCKET_BYTES, np.uint8)
    for m, mids in enumerate((q[256:512], q[768:1024])):  # 255 midpoints, +inf
        for s, (lo_x, hi_x) in enumerate(((lo_abs, hi_abs), (-hi_abs, -lo_abs))):
            lo = np.searchsorted(mids, lo_x, side="left")  # midpoints below every x of the bucket
            inside = np.searchsorted(mids, hi_x, side="right") - lo
            if inside.max() > 1:
                raise AssertionError(f"make_buckets: {inside.max()} midpoints in one bucket of map {m} sign {s}")
            out[(2 * m + s) * BUCKET_HALF : (2 * m + s + 1) * BUCKET_HALF] = lo
        assert out[(2 * m + 2) * BUCKET_HALF - 1] == 0  # NaN: no midpoint below -inf, and mids[0] < NaN is false
    return out


def num_blocks(n: int) -> int:
    return -(-int(n) // QBLOCK)


def quantize_reference(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8, abs-max per block) of fp32 `x` (N,), as the kernel requantizes."""
    x = np.asarray(x, np.float32).reshape(-1)
    nb = num_blocks(x.size)
    pad = np.zeros(nb * QBLOCK, np.float32)
    pad[: x.size] = np.abs(x) if signed else x
    amax = pad.reshape(nb, QBLOCK).max(axis=1).astype(np.float32)
    a = np.repeat(amax, QBLOCK)[: x.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        norm = np.where(a > 0, x / np.where(a > 0, a, np.float32(1)), np.float32(0)).astype(np.float32)
    q = make_qmaps()
    mids = q[256:511] if signed else q[768:1023]
    return np.searchsorted(mids, norm, side="left").astype(np.uint8), amax


def dequantize_reference(codes: np.ndarray, absmax: np.ndarray, signed: bool) -> np.ndarray:
    c = dynamic_map(signed)
    a = np.repeat(np.asarray(absmax, np.float32), QBLOCK)[: codes.size]
    return (c[np.asarray(codes).reshape(-1)] * a).astype(np.float32)


def adamw8bit_reference(param, grad, qm, qv, absmax_m, absmax_v, hparams, grad_scale, weight_decay_on: bool,
                        seed: int):  # fmt: skip
    """The NumPy twin: returns new (param, qm, qv, absmax_m, absmax_v); a non-finite grad_scale
    returns the inputs unchanged. The fp32 operations are adamw_reference's, in its order."""
    f32 = np.float32
    m = dequantize_reference(qm, absmax_m, True)
    v = dequantize_reference(qv, absmax_v, False)
    out = adamw_fp32_np(param.astype(f32).reshape(-1), grad, m, v, hparams, grad_scale, weight_decay_on)
    if out is None:
        return param.copy(), qm.copy(), qv.copy(), absmax_m.copy(), absmax_v.copy()
    p, m, v, step = out
    qm2, am = quantize_reference(m, True)
    qv2, av = quantize_reference(v, False)
    p = _store(p, param.dtype, seed, step, 0).reshape(param.shape)
    return p, qm2.reshape(qm.shape), qv2.reshape(qv.shape), am, av


def _check_state(what, param, grad, qm, qv, absmax_m, absmax_v) -> None:
    """The dtype and size checks of one tensor's update (shared by the per-tensor launcher and the table)."""
    _checks.expect(param, f"{what}: param", dtype=(FP32, BF16))  # (N,)
    _checks.expect(grad, f"{what}: grad", dtype=(FP32, BF16))  # (N,)
    _checks.expect(qm, f"{what}: qm", dtype=BYTE)  # (N,)
    _checks.expect(qv, f"{what}: qv", dtype=BYTE)  # (N,)
    n = param.nelem
    nb = num_blocks(n)
    _checks.expect(absmax_m, f"{what}: absmax_m", dtype=FP32, shape=(nb,))  # (ceil(N/256),)
    _checks.expect(absmax_v, f"{what}: absmax_v", dtype=FP32, shape=(nb,))  # (ceil(N/256),)
    for t, label in ((grad, "grad"), (qm, "qm"), (qv, "qv")):
        if t.nelem != n:
            raise ValueError(
                f"{what}: {label} {t.name!r} {t.shape} {t.dtype} has {t.nelem} elements, "
                f"param {param.name!r} {param.shape} has {n}"
            )


def adamw8bit_update(param, grad, qm, qv, absmax_m, absmax_v, qmaps, hparams, grad_scale, weight_decay_on: bool,
                     seed: int, stream=None) -> None:  # fmt: skip
    """One 8-bit AdamW step, in place on param, the codes and their block abs-maxes.

    Args:
        param: fp32 or bf16, N elements (any shape).
        grad: fp32 or bf16, N elements.
        qm, qv: byte (uint8), N elements each: codes of m (signed map) and v (unsigned map).
        absmax_m, absmax_v: (ceil(N/256),) fp32: each block's abs-max (all zero: m = v = 0).
        qmaps: (1024,) fp32 on the device holding `make_qmaps()`.
        hparams, grad_scale, weight_decay_on, seed: as in `adamw.adamw_update` (a non-finite
            grad_scale writes nothing; bf16 params round stochastically with adamw's draws).

    NumPy equivalent: `adamw8bit_reference(...)`.
    """
    what = "adamw8bit_update"
    _check_state(what, param, grad, qm, qv, absmax_m, absmax_v)
    n = param.nelem
    nb = num_blocks(n)
    _checks.expect(qmaps, f"{what}: qmaps", dtype=FP32, shape=(1024,))  # (1024,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    dev = _checks.same_device(param, grad, qm, qv, absmax_m, absmax_v, qmaps, hparams, grad_scale)
    seed = int(seed) & 0xFFFFFFFF
    if n == 0:
        return
    if dev.is_cpu:
        gs = None if grad_scale is None else grad_scale.array()[0]
        out = adamw8bit_reference(param.array(), grad.array(), qm.array(), qv.array(), absmax_m.array(),
                                  absmax_v.array(), hparams.array(), gs, weight_decay_on, seed)  # fmt: skip
        _build.write_twin_results(zip((param, qm, qv, absmax_m, absmax_v), out))
        return
    name = _build.kernel_name("adamw8bit", param, grad)
    args = (param, grad, qm, qv, absmax_m, absmax_v, qmaps, hparams, grad_scale, np.int32(bool(weight_decay_on)),
            np.uint32(seed), np.int64(n))  # fmt: skip
    _build.launch("adamw8bit", name, nb, QBLOCK, args, dev, stream)


# ---- multi-tensor: one launch over every parameter -------------------------------------------------
# One Record8 of adamw8bit.cu: 72 bytes, in this order.
_RECORD = np.dtype([("param", "<u8"), ("grad", "<u8"), ("qm", "<u8"), ("qv", "<u8"), ("absmax_m", "<u8"),
                    ("absmax_v", "<u8"), ("n", "<i8"), ("seed", "<u4"), ("wd_on", "<i4"), ("first_chunk", "<i4"),
                    ("vec", "<i4")])  # fmt: skip
CHUNK = 32  # quantization blocks per block of adamw8bit_multi (QCHUNK in adamw8bit.cu)


def _chunks(n: int) -> int:
    return _build.ceil_div(num_blocks(n), CHUNK)


def _buckets_offset(records: int, chunks: int) -> int:
    """Where the bucket table starts: after the records and the owner map, 16-byte aligned."""
    return -(-(records * _RECORD.itemsize + 4 * chunks) // 16) * 16


def multi_tensor_table_shape(numels) -> tuple[int]:
    """Bytes of the BYTE table an `AdamW8bitTable` over tensors of these element counts needs: one
    record per non-empty tensor, the owner (int32 record index) of every block of the launch, then
    `make_buckets()` (16-byte aligned)."""
    ns = [int(n) for n in numels if n > 0]
    return (_buckets_offset(len(ns), sum(_chunks(n) for n in ns)) + BUCKET_BYTES,)


class AdamW8bitTable:
    """The device table `adamw8bit_update_multi` reads: one record per non-empty tensor (its six
    addresses, size, seed, weight-decay flag, first block of the launch, whether its rows move as
    vectors), the owner map, then the quantization's bucket table (`make_buckets`), written once
    here, so a step allocates and uploads nothing.

    Args:
        table: BYTE tensor of `multi_tensor_table_shape(numels)` on the tensors' device; written now
            (a host-to-device copy: build the table outside any graph capture).
        params, grads, qms, qvs, absmax_ms, absmax_vs: lists of equal length, each sextuple as
            `adamw8bit_update` takes it; one dtype per role (params fp32 or bf16, grads fp32 or bf16:
            one kernel instantiation).
        weight_decay_on, seeds: per tensor, as `adamw8bit_update` takes them.

    The tensors must stay where they are: the table holds their addresses.
    """

    def __init__(self, table, params, grads, qms, qvs, absmax_ms, absmax_vs, weight_decay_on, seeds):
        what = "AdamW8bitTable"
        k = len(params)
        if k == 0:
            raise ValueError(f"{what}: no tensors")
        lists = {"grads": grads, "qms": qms, "qvs": qvs, "absmax_ms": absmax_ms, "absmax_vs": absmax_vs,
                 "weight_decay_on": weight_decay_on, "seeds": seeds}  # fmt: skip
        for label, lst in lists.items():
            if len(lst) != k:
                raise ValueError(f"{what}: {label} has {len(lst)} entries, params has {k}")
        for p, g in zip(params, grads):
            for t, label, first in ((p, "param", params[0]), (g, "grad", grads[0])):
                _checks.expect(t, f"{what}: {label}", dtype=(FP32, BF16))  # (N,)
                if t.dtype != first.dtype:
                    raise ValueError(f"{what}: {label} {t.name!r} is {t.dtype} but {first.name!r} is {first.dtype}; "
                                     "one table holds one dtype per role")  # fmt: skip
        for p, g, qm, qv, am, av in zip(params, grads, qms, qvs, absmax_ms, absmax_vs):
            _check_state(what, p, g, qm, qv, am, av)
        self.device = _checks.same_device(table, *params, *grads, *qms, *qvs, *absmax_ms, *absmax_vs)
        _checks.expect(table, f"{what}: table", dtype=BYTE, shape=multi_tensor_table_shape([p.nelem for p in params]))
        self.entries = [e for e in zip(params, grads, qms, qvs, absmax_ms, absmax_vs, weight_decay_on, seeds)
                        if e[0].nelem]  # fmt: skip
        rec = np.zeros(len(self.entries), _RECORD)
        self.chunks = sum(_chunks(e[0].nelem) for e in self.entries)
        if self.chunks >= 2**31:
            raise ValueError(f"{what}: {self.chunks} blocks do not fit the launch's int32 block index")
        owners = np.zeros(self.chunks, np.int32)
        first = 0
        for i, (r, (p, g, qm, qv, am, av, wd, seed)) in enumerate(zip(rec, self.entries)):
            r["param"], r["grad"], r["qm"], r["qv"], r["absmax_m"], r["absmax_v"] = (
                t.ptr for t in (p, g, qm, qv, am, av)
            )
            r["n"], r["seed"], r["wd_on"], r["first_chunk"] = p.nelem, int(seed) & 0xFFFFFFFF, bool(wd), first
            # 8 elements a lane: 16-byte words of param and grad, 8-byte words of the codes
            r["vec"] = all(t.ptr % 16 == 0 for t in (p, g)) and all(t.ptr % 8 == 0 for t in (qm, qv))
            c = _chunks(p.nelem)
            owners[first : first + c] = i
            first += c
        off = _buckets_offset(len(rec), self.chunks)
        if self.device.is_cuda and table.ptr % 16:
            raise ValueError(
                f"{what}: table {table.name!r} is not 16-byte aligned (its bucket table moves in 16-byte words)"
            )
        if self.device.is_cuda and self.entries:
            pad = np.zeros(off - rec.nbytes - owners.nbytes, np.uint8)
            table.copy_from_numpy(np.concatenate([rec.view(np.uint8), owners.view(np.uint8), pad, make_buckets()]))
        self.table = table
        head = rec.nbytes
        self.owner = table.rows(head, head + owners.nbytes).view(INT32) if self.entries else None  # (chunks,)
        self.buckets = table.rows(off, off + BUCKET_BYTES)  # (BUCKET_BYTES,)
        self.dtypes = (params[0], grads[0])


def adamw8bit_update_multi(table: AdamW8bitTable, qmaps, hparams, grad_scale, stream=None) -> None:
    """`adamw8bit_update` of every tensor of `table`, in one launch, bitwise as one launch per tensor
    (parameters, codes and block abs-maxes; bf16 params round with each tensor's own seed and element
    indices; a non-finite grad_scale writes nothing).

    Args:
        table: an AdamW8bitTable.
        qmaps: (1024,) fp32 on the device holding `make_qmaps()`.
        hparams: (8,) fp32 on the device, as `adamw.adamw_update` reads it.
        grad_scale: (1,) fp32 on the device or None.

    NumPy equivalent: `adamw8bit_reference` per tensor (the cpu path calls `adamw8bit_update` per tensor).
    """
    what = "adamw8bit_update_multi"
    _checks.expect(qmaps, f"{what}: qmaps", dtype=FP32, shape=(1024,))  # (1024,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    dev = _checks.same_device(table.table, qmaps, hparams, grad_scale)
    if not table.entries:
        return
    if dev.is_cpu:
        for p, g, qm, qv, am, av, wd, seed in table.entries:
            adamw8bit_update(p, g, qm, qv, am, av, qmaps, hparams, grad_scale, wd, seed, stream=stream)
        return
    name = _build.kernel_name("adamw8bit_multi", *table.dtypes)
    args = (table.table, table.owner, qmaps, table.buckets, hparams, grad_scale)
    _build.launch("adamw8bit", name, table.chunks, 256, args, dev, stream)
