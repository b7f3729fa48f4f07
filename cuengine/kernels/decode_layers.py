"""Every layer of a batch-1 decode step in one persistent launch (raw_kernels/decode_layers.cu).

At batch 1 a decode layer is five small kernels (the qkv GEMV, the attention with its RoPE and
cache append, the output projection, the gate/up GEMV, the down GEMV), each reading 1–17 MB of
weights; on the H200 each took 4–15 µs against the 0.5–4 µs its bytes need, the rest being launch,
ramp-up and drain. This launcher runs all layers from one grid of one block per SM. Each block
streams its rows of every weight into a ring of shared-memory stages (bulk copies, refilled as soon
as a stage is used), so HBM keeps delivering weights while a phase waits for its input; the phases
meet at counters, not kernel boundaries. The sums are those of the "fused" arm's kernels (same K
splits, lanes and order; the attention is its device code), so the logits are bit-identical.

The layer table is written once (`write_layer_table`): the device addresses of each layer's
weights and cache, so the launch itself carries only scalars and stays capturable in a graph.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .._checks import expect, same_device
from ..dtypes import BF16, FP8_E4M3, FP16, FP32, INT32
from . import _build
from . import decode_attention as da
from . import gemv as gv

FAMILY = "decode_layers"
# One layer's pointers, in `struct DecodeLayer`'s order (16 slots of 8 bytes; the last three unused).
LAYER_FIELDS = ("qkv_w", "qkv_scale", "qkv_b", "ln1", "o_w", "o_scale", "ln2", "up_w", "up_scale", "down_w",
                "down_scale", "k_cache", "v_cache")  # fmt: skip
_SLOTS = 16
_THREADS = 256  # THREADS in decode_layers.cu: the GEMV's 8 warps, or two 4-warp attention blocks
# attention layouts with a compiled variant (q-head tiles of 8): (VN, NV, LP) per model dtype
_LAYOUTS = {"bf16": {"v8": (8, 1, 8), "v16": (8, 1, 16)}, "fp32": {"v16": (4, 1, 16), "v32": (4, 1, 32)}}
_CTYPE = {"bf16": "__nv_bfloat16", "fp32": "float", "e4m3": "__nv_fp8_e4m3"}
STAGE_BYTES = 32 << 10  # one ring stage: whole weight rows (gate and up rows in pairs), at most 64 (TILE_ROWS)
_MAX_STAGES = 8  # MAX_STAGES in decode_layers.cu
_SYNC = 6  # counters: five phases and the blocks that left
_MAX_SHARED = 227 * 1024  # shared memory one block may take on sm_90


def layer_table_shape(n_layers: int) -> tuple[int, int]:
    """(n_layers, 32) int32: 16 device addresses of 8 bytes per layer."""
    return (n_layers, 2 * _SLOTS)


def sync_shape() -> tuple[int]:
    """(6,) int32: the phase counters; zeroed once, every launch leaves them at zero."""
    return (_SYNC,)


def write_layer_table(table, layers: list[dict]) -> None:
    """Write each layer's addresses (dict of LAYER_FIELDS -> Tensor or None) into `table`; once, at
    allocation: the table is what lets a captured step find the weights without arguments."""
    expect(table, "write_layer_table table", INT32, layer_table_shape(len(layers)))
    ptrs = np.zeros((len(layers), _SLOTS), np.uint64)
    for i, layer in enumerate(layers):
        for j, f in enumerate(LAYER_FIELDS):
            t = layer.get(f)
            ptrs[i, j] = 0 if t is None or table.device.is_cpu else t.ptr
    table.copy_from_numpy(ptrs.view(np.int32))


def unsupported(cfg, dtype, device, b: int, weight_dtype=None) -> str | None:
    """Why the persistent step cannot run this model and batch on `device` (None when it can);
    weight_dtype: the decode weights' dtype (default: the model dtype)."""
    if b != 1:
        return f"the persistent decode step runs batch 1 only, got {b} rows"
    if cfg.qk_norm:
        return "the persistent decode step has no QK-norm phase (Qwen3)"
    if device.is_cuda and _layout(dtype, cfg.head_size) is None:
        return f"no persistent decode variant for {dtype} with head size {cfg.head_size}"
    if device.is_cuda and device.compute_capability < (9, 0):
        return "the persistent decode step needs compute capability 9.0 (bulk copies into shared memory)"
    size = (weight_dtype or dtype).itemsize
    A = cfg.num_q_heads * cfg.head_size
    for what, row in (("a down row", cfg.intermediate_size), ("a gate and up row pair", 2 * cfg.hidden_size),
                      ("an output row", A)):  # fmt: skip
        if row * size > STAGE_BYTES:
            return f"{what} ({row * size} bytes) does not fit a {STAGE_BYTES}-byte stage of the weight ring"
    return None


def _layout(dtype, hs: int):
    name = da._layout(dtype, hs)
    return name if name in _LAYOUTS.get(dtype.name, {}) else None


def decode_layers_np(layers: list[dict], residual, qkv, att, up, lengths, freqs, Hq: int, Hkv: int, eps: float):
    """The twin on NumPy arrays (layers: dicts of LAYER_FIELDS -> array or None), in place: the
    "fused" arm's kernels' twins, layer after layer."""
    res = residual
    for L in layers:
        qkv[...] = gv.gemv_np(res, L["qkv_w"], L["qkv_scale"], L["qkv_b"], norm_weight=L["ln1"], eps=eps)
        ln = lengths.astype(np.int64)
        q = qkv.copy()
        da.rope_kv_append_np(q, L["k_cache"], L["v_cache"], np.arange(len(ln)), ln - 1, freqs, Hq, Hkv)
        att[...] = da.decode_attention_np(q, L["k_cache"], L["v_cache"], ln, Hq, Hkv).astype(att.dtype)
        res[...] = gv.gemv_np(att, L["o_w"], L["o_scale"], residual=res)
        up[...] = gv.gemv_dual_np(res, L["up_w"], L["up_scale"], norm_weight=L["ln2"], eps=eps)
        res[...] = gv.gemv_np(up, L["down_w"], L["down_scale"], residual=res, act="swiglu")


def decode_layers(residual, qkv, att, up, scratch, sync, table, layers: list[dict], lengths, freqs, n_q_heads: int,
                  n_kv_heads: int, eps: float, stream=None) -> None:  # fmt: skip
    """Run every layer of one batch-1 decode step on residual, in place.

    Args:
        residual: (1, C) bf16 or fp32, the step's hidden state: in = the token's embedding, out = the
            last layer's output (before the final norm).
        qkv (1, (Hq + 2*Hkv) * hs), att (1, Hq * hs), up (1, 2I): scratch of the model dtype.
        scratch: decode_attention's fp32 scratch (zeroed once). sync: (6,) int32, zeroed once; each
            launch leaves it at zero. table: from write_layer_table(table, layers).
        layers: per layer, LAYER_FIELDS -> Tensor: qkv_w (Q, C), o_w (C, A), up_w (2I, C) [gate | up],
            down_w (C, I) in the model dtype, or e4m3 with their (N,) fp32 row scales; qkv_b (Q,) or
            None; ln1, ln2 (C,); k_cache, v_cache (max_batch, Hkv, max_seq, hs), row 0 is this row's.
        lengths: (1,) int32 on the device: the row attends to [0, lengths[0]); its new k, v go to
            position lengths[0] - 1 (as decode_attention with freqs). freqs: the RoPE table.
    Raises ValueError for what the kernel does not take (see `unsupported` for the model-level
    reasons). NumPy equivalent: decode_layers_np.
    """
    what = "decode_layers"
    dt = residual.dtype
    expect(residual, f"{what} residual", (FP32, BF16), (1, None))
    C = residual.shape[1]
    if not layers:
        raise ValueError(f"{what}: no layers")
    k0 = layers[0]["k_cache"]
    max_batch, _, max_seq, hs = k0.shape
    Hq, Hkv = n_q_heads, n_kv_heads
    Q, A = (Hq + 2 * Hkv) * hs, Hq * hs
    I = layers[0]["down_w"].shape[1]  # noqa: E741
    expect(qkv, f"{what} qkv", dt, (1, Q))
    expect(att, f"{what} att", dt, (1, A))
    expect(up, f"{what} up", dt, (1, 2 * I))
    expect(lengths, f"{what} lengths", INT32, (1,))
    expect(freqs, f"{what} freqs", FP16 if dt == BF16 else FP32, (None, hs))
    expect(sync, f"{what} sync", INT32, (_SYNC,))
    expect(table, f"{what} table", INT32, layer_table_shape(len(layers)))
    wdt = layers[0]["qkv_w"].dtype
    for i, L in enumerate(layers):
        for f, shape in (("qkv_w", (Q, C)), ("o_w", (C, A)), ("up_w", (2 * I, C)), ("down_w", (C, I))):
            expect(L[f], f"{what} layer {i} {f}", wdt, shape)
            s = L.get(f[:-2] + "_scale")
            if wdt == FP8_E4M3:
                expect(s, f"{what} layer {i} {f[:-2]}_scale", FP32, (shape[0],))
            elif s is not None:
                raise ValueError(f"{what} layer {i}: only e4m3 weights take row scales")
        if wdt not in (dt, FP8_E4M3):
            raise ValueError(f"{what}: weights are {wdt}; expected {dt} (the model dtype) or e4m3")
        if L.get("qkv_b") is not None:
            expect(L["qkv_b"], f"{what} layer {i} qkv_b", dt, (Q,))
        for f in ("ln1", "ln2"):
            expect(L[f], f"{what} layer {i} {f}", dt, (C,))
        for f in ("k_cache", "v_cache"):
            expect(L[f], f"{what} layer {i} {f}", dt, k0.shape)
    # on the cpu too, as `unsupported`: the arm takes the same models on every device
    for name, row in (("down", I), ("gate and up pair", 2 * C), ("output", A)):
        if row * wdt.itemsize > STAGE_BYTES:
            raise ValueError(f"{what}: a {name} row of {row * wdt.itemsize} bytes does not fit a {STAGE_BYTES}-byte "
                             "stage")  # fmt: skip
    dev = same_device(residual, qkv, att, up, scratch, sync, table, lengths, freqs)
    if dev.is_cpu:
        arrays = [{f: (None if L.get(f) is None else L[f].array()) for f in LAYER_FIELDS} for L in layers]
        ln = lengths.array()
        if not 1 <= int(ln[0]) <= min(max_seq, freqs.shape[0]):
            raise ValueError(f"{what} lengths: length {int(ln[0])} is outside [1, {min(max_seq, freqs.shape[0])}]")
        decode_layers_np(arrays, residual.array(), qkv.array(), att.array(), up.array(), ln, freqs.array(), Hq,
                         Hkv, eps)  # fmt: skip
        return
    layout = _layout(dt, hs)
    if layout is None:
        raise ValueError(f"{what}: no variant for {dt} with head size {hs}")
    tiles, tile_heads = da.tile_heads(1, Hq, Hkv, dev.num_sms)
    counter_rows = da._counter_rows(hs)
    S = max(1, min(da._splits(1, max_seq, Hkv * tiles, dev.num_sms), scratch.shape[0] - counter_rows,
                   da._FUSE_MAX_SPLITS))  # fmt: skip
    vec = 16 // wdt.itemsize
    splits = [gv._split(n, k // vec) for n, k in ((Q, C), (C, A), (2 * I, C), (C, I))]
    VN, NV, LP = _LAYOUTS[dt.name][layout]
    gm = 1 << (tile_heads - 1).bit_length()  # the split kernel decode_attention launches for these heads
    name = f"decode_layers<{_CTYPE[dt.name]}, {_CTYPE[wdt.name]}, {VN}, {NV}, {LP}, {gm}>"
    # the staged input (or the attention's merge weights), then the weights' addresses (4 per layer)
    xs_bytes = _round_up(max(max(C, A, I) * dt.itemsize, 2 * 4 * tile_heads * S), 16)
    grid, stages = _launch_shape(dev, name, xs_bytes + 32 * len(layers), STAGE_BYTES)
    args = (table, np.int32(len(layers)), residual, qkv, att, up, scratch, lengths, freqs, sync, np.int32(C),
            np.int32(I), np.int32(Hq), np.int32(Hkv), np.int32(hs), np.int32(max_seq), np.int32(freqs.shape[0]),
            np.float32(eps), np.int32(S), np.int32(tiles), np.int32(tile_heads),
            np.float32(math.log2(math.e) / math.sqrt(hs)), np.int64(counter_rows * Hq * (hs + 2)),
            *(np.int32(s) for s in splits), np.int32(stages), np.int32(STAGE_BYTES), np.int32(xs_bytes))  # fmt: skip
    _build.launch(
        FAMILY, name, grid, _THREADS, args, dev, stream, shared_mem=stages * STAGE_BYTES + xs_bytes + 32 * len(layers)
    )


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@functools.cache
def _launch_shape(dev, name: str, rest_bytes: int, stage_bytes: int) -> tuple[int, int]:
    """(grid, ring stages): one block per SM with as many stages as the shared memory left by the
    kernel's static arrays and the rest of its dynamic shared memory holds, after checking that the
    block fits an SM: the phases' counters need every block resident at once (a grid that did not
    would wait forever)."""
    import cupy

    fn = _build.function(FAMILY, name, dev.index)
    stages = min(_MAX_STAGES, (_MAX_SHARED - fn.shared_size_bytes - rest_bytes) // stage_bytes)
    if stages < 2:
        raise ValueError(f"decode_layers: {rest_bytes} bytes of staged input and weight addresses leave no room "
                         f"for two {stage_bytes}-byte stages")  # fmt: skip
    smem = stages * stage_bytes + rest_bytes
    fn.max_dynamic_shared_size_bytes = smem
    with dev.activate():
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, _THREADS, smem)
    if per_sm < 1:
        raise ValueError(f"decode_layers: a block of {name} does not fit an SM ({smem} bytes of shared memory)")
    return dev.num_sms, stages
