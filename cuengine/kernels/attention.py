"""Causal GQA self-attention on the packed qkv layout: raw flash kernels and cuDNN SDPA.

qkv is (B, T, (Hq + 2*Hkv) * hs): the Hq query heads, then the Hkv key heads, then the Hkv value
heads; query head h reads kv head h // (Hq // Hkv). Forward writes att (B, T, Hq*hs) and the LSE
(B, Hq, T) fp32 (natural log of the softmax denominator of the scaled scores, scale 1/sqrt(hs)).
Backward writes (=) dqkv in the packed layout, dk and dv summed over each GQA group. This is the
seed's attention_forward_cudnn / attention_backward_cudnn, with our own kernels beside cuDNN.

Backends:
- "raw" (raw_kernels/attention.cu): bf16 with hs 64 or 128 runs the flash kernels (tensor cores,
  online softmax in registers, no T x T buffer): on compute capability 9.0 the wgmma kernels of
  raw_kernels/attention_sm90.cu (forward, and the backward's dq and dk/dv; SM90_FORWARD and
  SM90_BACKWARD list the head sizes), elsewhere mma.sync ones; fp32, and bf16 with other head sizes up to 256,
  run a simple warp-per-row kernel (correct, slow: meant for tests and small models). Backward is
  deterministic (dq in its own pass, GQA reduction in registers) and needs a workspace for
  D = rowsum(dO * O).
- "cudnn" (nvidia-cudnn-frontend, optional, imported lazily): SDPA forward with stats and SDPA
  backward, bf16; graphs built once per shape and device and cached. The backward runs cuDNN's
  deterministic algorithm unless `deterministic=False`: then cuDNN's default one, which adds dQ
  over key tiles with fp32 atomics (no separate dQ pass; bits may differ from run to run).
- "auto": cuDNN when it is importable and supports the call (bf16, hs a multiple of 8 up to 128),
  else raw. On the cpu device "auto" means raw.
The same checks run on both devices; on cpu every backend then runs the NumPy twin (exact causal
softmax attention in float32, one rounding to the storage dtype).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .. import _checks
from ..device import device as _get_device
from ..dtypes import BF16, BYTE, FP32
from ..dtypes import dtype as _dtype
from ._build import ceil_div, kernel_name, launch

BACKENDS = ("auto", "raw", "cudnn")
FLASH_HEAD_SIZES = (64, 128)  # bf16 head sizes with tensor-core kernels in the raw backend
RAW_MAX_HEAD_SIZE = 256  # the warp-per-row kernels keep 8 elements per lane
_FWD_WARPS = 8  # flash forward: 16 query rows per warp, 128 per block (NW_FWD in attention.cu)
# Head sizes whose bf16 forward and backward run attention_sm90.cu's wgmma kernels on compute
# capability 9.0 (elsewhere, and for head sizes not listed, attention.cu's mma.sync ones): the
# switches (tests and tools/bench_attention.py turn them off to run the mma.sync kernels on an H200).
# The forward's key block per head size is compiled into its kernel; _SM90_KEY_BLOCK sizes its
# shared memory. The backward runs 128 query rows / 128 keys per block (two warpgroups).
SM90_FORWARD: tuple[int, ...] = (64, 128)
SM90_BACKWARD: tuple[int, ...] = (64, 128)
_SM90_KEY_BLOCK = {64: 64, 128: 128}
_BLOCK = 64  # flash backward rows per block (queries and keys)
_SIMT_THREADS = 128  # warp-per-row kernels: 4 rows per block (__launch_bounds__(128) in attention.cu)
_ALIGN = 256


# ---- NumPy twin ------------------------------------------------------------------------------
def _split(qkv, n_q_heads, n_kv_heads):
    B, T, C3 = qkv.shape
    hs = C3 // (n_q_heads + 2 * n_kv_heads)
    x = np.asarray(qkv, np.float32).reshape(B, T, n_q_heads + 2 * n_kv_heads, hs)
    return x[:, :, :n_q_heads], x[:, :, n_q_heads : n_q_heads + n_kv_heads], x[:, :, n_q_heads + n_kv_heads :], hs


def attention_forward_numpy(qkv, n_q_heads: int, n_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Causal GQA attention in float32: qkv (B, T, (Hq+2Hkv)*hs) -> att (B, T, Hq*hs), lse (B, Hq, T).

    Per batch and head: s = q kᵀ / sqrt(hs) with the future masked, att = softmax(s) v,
    lse = log(sum(exp(s))) (natural log).
    """
    q, k, v, hs = _split(qkv, n_q_heads, n_kv_heads)
    B, T = q.shape[:2]
    group = n_q_heads // n_kv_heads
    scale = np.float32(1.0 / math.sqrt(hs))
    future = np.triu(np.ones((T, T), bool), 1)
    att = np.empty((B, T, n_q_heads, hs), np.float32)
    lse = np.empty((B, n_q_heads, T), np.float32)
    for b in range(B):
        for h in range(n_q_heads):
            s = (q[b, :, h] @ k[b, :, h // group].T) * scale
            s[future] = -np.inf
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            denom = p.sum(axis=1, keepdims=True)
            att[b, :, h] = (p @ v[b, :, h // group]) / denom
            lse[b, h] = (m + np.log(denom))[:, 0]
    return att.reshape(B, T, n_q_heads * hs), lse


def attention_backward_numpy(datt, att, lse, qkv, n_q_heads: int, n_kv_heads: int) -> np.ndarray:
    """The exact backward of attention_forward_numpy, in float32, given its outputs att and lse.

    datt, att (B, T, Hq*hs); lse (B, Hq, T); qkv (B, T, (Hq+2Hkv)*hs) -> dqkv, same shape as qkv.
    With p = exp(s - lse) (future masked), D = rowsum(datt * att), ds = p (datt vᵀ - D):
    dq = ds k / sqrt(hs), dk = dsᵀ q / sqrt(hs), dv = pᵀ datt, dk and dv summed over each group.
    """
    q, k, v, hs = _split(qkv, n_q_heads, n_kv_heads)
    B, T = q.shape[:2]
    group = n_q_heads // n_kv_heads
    scale = np.float32(1.0 / math.sqrt(hs))
    future = np.triu(np.ones((T, T), bool), 1)
    do = np.asarray(datt, np.float32).reshape(B, T, n_q_heads, hs)
    o = np.asarray(att, np.float32).reshape(B, T, n_q_heads, hs)
    lse = np.asarray(lse, np.float32)
    dx = np.zeros((B, T, n_q_heads + 2 * n_kv_heads, hs), np.float32)
    dk = dx[:, :, n_q_heads : n_q_heads + n_kv_heads]
    dv = dx[:, :, n_q_heads + n_kv_heads :]
    for b in range(B):
        for h in range(n_q_heads):
            kv = h // group
            s = (q[b, :, h] @ k[b, :, kv].T) * scale
            s[future] = -np.inf
            p = np.exp(s - lse[b, h][:, None])
            d = (do[b, :, h] * o[b, :, h]).sum(axis=1, keepdims=True)
            ds = p * (do[b, :, h] @ v[b, :, kv].T - d)
            dx[b, :, h] = (ds @ k[b, :, kv]) * scale
            dk[b, :, kv] += (ds.T @ q[b, :, h]) * scale
            dv[b, :, kv] += p.T @ do[b, :, h]
    return dx.reshape(qkv.shape)


# ---- backends --------------------------------------------------------------------------------
@functools.cache
def _cudnn():
    """The cudnn module, or None when nvidia-cudnn-frontend is not importable."""
    try:
        import cudnn

        return cudnn
    except Exception:  # missing package, or its libcudnn cannot be loaded
        return None


def available_backends() -> list[str]:
    """The backends this installation can run: always "raw", plus "cudnn" when importable."""
    return ["raw", "cudnn"] if _cudnn() is not None else ["raw"]


def _resolve_backend(backend, device, dtype, hs: int, T: int) -> str:
    """The backend ("raw" or "cudnn") for this call; ValueError when the request cannot be served."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        # cuDNN SDPA refuses s_q = s_kv = 1 (seen on the H200, cuDNN 9.19 / frontend 1.16)
        cudnn_fits = dtype == BF16 and hs % 8 == 0 and hs <= 128 and T != 1
        backend = "cudnn" if device.is_cuda and cudnn_fits and _cudnn() is not None else "raw"
    if backend == "cudnn":
        if _cudnn() is None:
            raise ValueError(
                "attention backend 'cudnn' needs nvidia-cudnn-frontend, which is not importable here "
                "(pip install 'cuengine[cudnn]'); available backends: " + ", ".join(available_backends())
            )
        if dtype != BF16:
            raise ValueError(f"attention backend 'cudnn' takes bf16 qkv, got {dtype}; use backend='raw' for fp32")
        if hs % 8:
            raise ValueError(f"attention backend 'cudnn' needs a head size that is a multiple of 8, got {hs}")
        if T == 1:
            raise ValueError("attention backend 'cudnn' does not support T = 1 (cuDNN SDPA refuses s_q = s_kv = 1); "
                             "use backend='raw' or 'auto'")  # fmt: skip
    elif hs > RAW_MAX_HEAD_SIZE:
        raise ValueError(f"attention backend 'raw' supports head sizes up to {RAW_MAX_HEAD_SIZE}, got {hs}")
    return backend


def _workspace_bytes(kind: str, backend: str, device, B: int, T: int, Hq: int, Hkv: int, hs: int,
                     deterministic: bool = True) -> int:  # fmt: skip
    if backend == "cudnn" and device.is_cuda:
        return _cudnn_graph(kind, B, T, Hq, Hkv, hs, device, deterministic).workspace
    if kind == "bwd":  # raw: D = rowsum(dO * O), fp32 (B, Hq, T)
        return -(-B * Hq * T * 4 // _ALIGN) * _ALIGN
    return 0


def workspace_shape(B: int, T: int, n_q_heads: int, n_kv_heads: int, head_size: int, backend: str = "auto",
                    dtype=BF16, device=None, passes=("forward", "backward"),
                    deterministic: bool = True) -> tuple[int]:  # fmt: skip
    """Shape (nbytes,) of the BYTE workspace that attention_forward and attention_backward need.

    The run state allocates it once and passes it to both; the largest need of `passes` ("forward",
    "backward" or both) is returned. `dtype` and `device` (default: "auto") decide what backend="auto" resolves
    to. On the cpu device the size is the raw backend's, whatever the backend, so cpu runs plan the
    same buffer. For cuDNN this builds (and caches) the graphs of the shape: call it, before any
    graph capture, for every batch size that will run (the forward's B and, when the backward runs
    in shard_view chunks, the chunk's B), and allocate the largest answer. `deterministic` as for
    attention_backward (cuDNN's non-deterministic backward needs an fp32 dQ accumulator in the workspace).
    """
    dev = _get_device(device if device is not None else "auto")
    _check_heads(n_q_heads, n_kv_heads)
    for name, val, least in (("B", B, 0), ("T", T, 0), ("head_size", head_size, 1)):
        if not isinstance(val, (int, np.integer)) or val < least:
            kind = "positive" if least else "non-negative"
            raise ValueError(f"workspace_shape: {name} must be a {kind} int, got {val!r}")
    _check_deterministic(deterministic, "workspace_shape")
    resolved = _resolve_backend(backend, dev, _dtype(dtype), head_size, T)
    if B == 0 or T == 0:
        return (0,)
    args = (resolved, dev, int(B), int(T), int(n_q_heads), int(n_kv_heads), int(head_size))
    kinds = {"forward": "fwd", "backward": "bwd"}
    if not passes or any(p not in kinds for p in passes):
        raise ValueError(f"workspace_shape: passes must name 'forward' and/or 'backward', got {passes!r}")
    return (max(_workspace_bytes(kinds[p], *args, deterministic) for p in passes),)


# ---- checks ----------------------------------------------------------------------------------
def _check_deterministic(deterministic, what: str) -> None:
    if not isinstance(deterministic, (bool, np.bool_)):
        raise ValueError(f"{what}: deterministic must be True or False, got {deterministic!r}")


def _check_heads(n_q_heads, n_kv_heads) -> None:
    for name, val in (("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"attention: {name} must be a positive int, got {val!r}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"attention: n_q_heads={n_q_heads} is not a multiple of n_kv_heads={n_kv_heads}")


def _qkv_layout(qkv, what: str, Hq: int, Hkv: int) -> tuple[int, int, int]:
    """(B, T, hs) of a packed qkv tensor."""
    _checks.expect(qkv, what, dtype=(FP32, BF16))
    H3 = Hq + 2 * Hkv
    if qkv.ndim != 3 or qkv.shape[2] == 0 or qkv.shape[2] % H3:
        raise ValueError(
            f"{what}: expected shape (B, T, (n_q_heads + 2*n_kv_heads) * head_size) with {H3} heads "
            f"(n_q_heads={Hq}, n_kv_heads={Hkv}), got tensor {qkv.name!r} {qkv.shape} {qkv.dtype}"
        )
    B, T, C3 = qkv.shape
    return B, T, C3 // H3


def _check_no_alias(outputs: dict, inputs: dict) -> None:
    """Outputs must not share memory with inputs (the kernels read inputs while writing) or each other."""
    out = list(outputs.items())
    for i, (oname, o) in enumerate(out):
        for iname, t in list(inputs.items()) + out[i + 1 :]:
            if _checks.overlaps(o, t):
                raise ValueError(f"attention: {oname} ({o.name!r}) overlaps {iname} ({t.name!r}) in memory")


def _check_workspace(workspace, need: int, device, kind: str) -> None:
    if workspace is None:
        if need:
            raise ValueError(
                f"attention {kind}: needs a workspace of {need} bytes (see attention.workspace_shape), got None"
            )
        return
    _checks.expect(workspace, "workspace", dtype=BYTE, device=device)
    if workspace.nbytes < need:
        raise ValueError(
            f"attention {kind}: workspace {workspace.name!r} holds {workspace.nbytes} bytes, needs {need} "
            f"(see attention.workspace_shape)"
        )


# ---- launchers -------------------------------------------------------------------------------
def attention_forward(att, lse, qkv, n_q_heads: int, n_kv_heads: int, backend: str = "auto", workspace=None,
                      stream=None) -> None:  # fmt: skip
    """Causal self-attention: att = softmax(q kᵀ / sqrt(hs), future masked) v, and its LSE.

    Args:
        att: output (B, T, Hq*hs), the dtype of qkv (written, =).
        lse: output (B, Hq, T) fp32: log of each row's softmax denominator (natural log).
        qkv: (B, T, (Hq + 2*Hkv) * hs) fp32 or bf16, packed q, k, v heads.
        n_q_heads, n_kv_heads: Hq and Hkv; Hq must be a multiple of Hkv (GQA).
        backend: "auto", "raw" or "cudnn" (see the module docstring).
        workspace: BYTE tensor of at least workspace_shape(...) bytes; raw needs none here.
        stream: the device stream to run on (default: the device's main stream).
    NumPy equivalent: attention_forward_numpy(qkv, Hq, Hkv), rounded to att's dtype.
    """
    _check_heads(n_q_heads, n_kv_heads)
    B, T, hs = _qkv_layout(qkv, "qkv", n_q_heads, n_kv_heads)
    _checks.expect(att, "att", dtype=qkv.dtype, shape=(B, T, n_q_heads * hs))
    _checks.expect(lse, "lse", dtype=FP32, shape=(B, n_q_heads, T))
    dev = _checks.same_device(att, lse, qkv, workspace)
    _check_no_alias({"att": att, "lse": lse}, {"qkv": qkv, "workspace": workspace})
    resolved = _resolve_backend(backend, dev, qkv.dtype, hs, T)
    _check_workspace(workspace, _workspace_bytes("fwd", resolved, dev, B, T, n_q_heads, n_kv_heads, hs), dev,
                     "forward")  # fmt: skip
    if B * T == 0:
        return
    if dev.is_cpu:
        a, m = attention_forward_numpy(qkv.array(), n_q_heads, n_kv_heads)
        att.array()[...] = a.astype(att.dtype.np)
        lse.array()[...] = m
        return
    flash = qkv.dtype == BF16 and hs in FLASH_HEAD_SIZES
    if flash or resolved == "cudnn":
        _checks.check_aligned("attention_forward", att, qkv)
    if resolved == "cudnn":
        entry = _cudnn_graph("fwd", B, T, n_q_heads, n_kv_heads, hs, dev)
        q, k, v = _qkv_pointers(qkv, n_q_heads, n_kv_heads, hs)
        _cudnn_execute(entry, {"q": q, "k": k, "v": v, "o": att.ptr, "stats": lse.ptr}, workspace, dev, stream)
        return
    scale = np.float32(1.0 / math.sqrt(hs))
    sizes = (np.int32(T), np.int32(n_q_heads), np.int32(n_kv_heads))
    if flash and hs in SM90_FORWARD and _is_sm90(dev):
        bc = _SM90_KEY_BLOCK[hs]
        smem = (128 + 4 * bc) * hs * 2 + 1024  # Q, double-buffered K and V, room to align to 1024
        launch("attention_sm90", kernel_name(f"attention_forward_sm90_hs{hs}", qkv), (ceil_div(T, 128), n_q_heads, B),
               256, (att, lse, qkv, *sizes, scale), dev, stream, shared_mem=smem)  # fmt: skip
    elif flash:
        rows = 16 * _FWD_WARPS
        smem = (rows + 4 * _BLOCK) * hs * 2  # Q tile, double-buffered K and V tiles
        _launch(f"attention_forward_flash_hs{hs}", qkv, (ceil_div(T, rows), n_q_heads, B), 32 * _FWD_WARPS,
                (att, lse, qkv, *sizes, scale), dev, stream, smem)  # fmt: skip
    else:
        args = (att, lse, qkv, np.int32(B), *sizes, np.int32(hs), scale)
        _launch("attention_forward_simt", qkv, _simt_blocks(B * n_q_heads * T), _SIMT_THREADS, args, dev, stream)


def attention_backward(dqkv, datt, att, lse, qkv, n_q_heads: int, n_kv_heads: int, backend: str = "auto",
                       workspace=None, deterministic: bool = True, stream=None) -> None:  # fmt: skip
    """Backward of attention_forward: dqkv (=) from the upstream gradient and the forward's outputs.

    Args:
        dqkv: output, packed like qkv (B, T, (Hq + 2*Hkv) * hs) (written, =); dk and dv are summed
            over the query heads of each GQA group.
        datt: (B, T, Hq*hs), the gradient of att; att: the forward's output; lse: (B, Hq, T) fp32,
            the forward's LSE; qkv: the forward's input. Batch shards (shard_view) of all of them work.
        n_q_heads, n_kv_heads, backend, stream: as for attention_forward.
        workspace: BYTE tensor of at least workspace_shape(..., deterministic=deterministic) bytes
            (raw: D = rowsum(dO * O)).
        deterministic: True (the default) gives the same bits on every run. False lets the cuDNN
            backend run its faster non-deterministic algorithm (dQ summed with fp32 atomics in an
            order that changes from run to run, so dqkv may differ in the last bits between runs; the
            values stay within bf16 rounding of the deterministic ones). The raw backend is always
            deterministic and ignores it.
    NumPy equivalent: attention_backward_numpy(datt, att, lse, qkv, Hq, Hkv), rounded to dqkv's dtype.
    """
    _check_heads(n_q_heads, n_kv_heads)
    B, T, hs = _qkv_layout(qkv, "qkv", n_q_heads, n_kv_heads)
    _checks.expect(dqkv, "dqkv", dtype=qkv.dtype, shape=qkv.shape)
    _checks.expect(datt, "datt", dtype=qkv.dtype, shape=(B, T, n_q_heads * hs))
    _checks.expect(att, "att", dtype=qkv.dtype, shape=(B, T, n_q_heads * hs))
    _checks.expect(lse, "lse", dtype=FP32, shape=(B, n_q_heads, T))
    dev = _checks.same_device(dqkv, datt, att, lse, qkv, workspace)
    _check_no_alias({"dqkv": dqkv, "workspace": workspace}, {"datt": datt, "att": att, "lse": lse, "qkv": qkv})
    _check_deterministic(deterministic, "attention_backward")
    resolved = _resolve_backend(backend, dev, qkv.dtype, hs, T)
    need = _workspace_bytes("bwd", resolved, dev, B, T, n_q_heads, n_kv_heads, hs, bool(deterministic))
    _check_workspace(workspace, need, dev, "backward")
    if B * T == 0:
        return
    if dev.is_cpu:
        dx = attention_backward_numpy(datt.array(), att.array(), lse.array(), qkv.array(), n_q_heads, n_kv_heads)
        dqkv.array()[...] = dx.astype(dqkv.dtype.np)
        return
    flash = qkv.dtype == BF16 and hs in FLASH_HEAD_SIZES
    if flash or resolved == "cudnn":
        _checks.check_aligned("attention_backward", dqkv, datt, att, qkv, workspace)
    if resolved == "cudnn":
        entry = _cudnn_graph("bwd", B, T, n_q_heads, n_kv_heads, hs, dev, bool(deterministic))
        q, k, v = _qkv_pointers(qkv, n_q_heads, n_kv_heads, hs)
        dq, dk, dv = _qkv_pointers(dqkv, n_q_heads, n_kv_heads, hs)
        ptrs = {"q": q, "k": k, "v": v, "o": att.ptr, "dO": datt.ptr, "stats": lse.ptr, "dQ": dq, "dK": dk, "dV": dv}
        _cudnn_execute(entry, ptrs, workspace, dev, stream)
        return
    dsum = workspace.flat().rows(0, B * n_q_heads * T * 4).view(FP32)  # D (B, Hq, T)
    args = (dsum, datt, att, np.int32(B), np.int32(T), np.int32(n_q_heads), np.int32(hs))
    _launch("attention_backward_dot", qkv, _simt_blocks(B * T * n_q_heads), _SIMT_THREADS, args, dev, stream)
    scale = np.float32(1.0 / math.sqrt(hs))
    args = (dqkv, datt, qkv, lse, dsum)
    if flash and hs in SM90_BACKWARD and _is_sm90(dev):
        sizes = (np.int32(T), np.int32(n_q_heads), np.int32(n_kv_heads), scale)
        smem = (2 * 128 + 4 * 64) * hs * 2 + 1024  # dq: Q, dO [128], 2 x K, V [64]; dkdv: K, V [128], 2 x Q, dO
        nblk = ceil_div(T, 128)
        for kernel, heads, extra in (("dq", n_q_heads, 0), ("dkdv", n_kv_heads, 4 * 64 * 4)):  # dkdv: lse, D
            name = kernel_name(f"attention_backward_{kernel}_sm90_hs{hs}", qkv)
            launch("attention_sm90", name, (nblk, heads, B), 256, (*args, *sizes), dev, stream, shared_mem=smem + extra)
    elif flash:
        sizes = (np.int32(T), np.int32(n_q_heads), np.int32(n_kv_heads), scale)
        smem = 6 * _BLOCK * hs * 2  # dq: Q, dO, 2 x K, 2 x V; dkdv: K, V, 2 x Q, 2 x dO (+ lse, D)
        nblk = ceil_div(T, _BLOCK)
        _launch(f"attention_backward_dq_flash_hs{hs}", qkv, (nblk, n_q_heads, B), 128, (*args, *sizes), dev, stream,
                smem)  # fmt: skip
        _launch(f"attention_backward_dkdv_flash_hs{hs}", qkv, (nblk, n_kv_heads, B), 128, (*args, *sizes), dev, stream,
                smem + 4 * _BLOCK * 4)  # fmt: skip
    else:
        args = (*args, np.int32(B), np.int32(T), np.int32(n_q_heads), np.int32(n_kv_heads), np.int32(hs), scale)
        _launch("attention_backward_dq_simt", qkv, _simt_blocks(B * n_q_heads * T), _SIMT_THREADS, args, dev, stream)
        _launch("attention_backward_dkdv_simt", qkv, _simt_blocks(B * n_kv_heads * T), _SIMT_THREADS, args, dev, stream)


def _is_sm90(dev) -> bool:
    """Whether attention_sm90.cu's kernels (sm_90a) run on dev: compute capability 9.0 only."""
    return getattr(dev, "compute_capability", None) == (9, 0)


def _launch(kernel: str, qkv, grid, block: int, args, dev, stream, shared_mem: int = 0) -> None:
    launch("attention", kernel_name(kernel, qkv), grid, block, args, dev, stream, shared_mem=shared_mem)


def _simt_blocks(rows: int) -> int:
    """Blocks for the warp-per-row kernels (and the D pass): one warp per row, _SIMT_THREADS per block."""
    return ceil_div(rows, _SIMT_THREADS // 32)


def _qkv_pointers(t, Hq: int, Hkv: int, hs: int) -> tuple[int, int, int]:
    """Addresses of the first q, k and v head of a packed tensor (their strides are the packed row)."""
    item = t.dtype.itemsize
    return t.ptr, t.ptr + Hq * hs * item, t.ptr + (Hq + Hkv) * hs * item


# ---- cuDNN -----------------------------------------------------------------------------------
class _CudnnEntry:
    __slots__ = ("graph", "tensors", "workspace")

    def __init__(self, graph, tensors: dict, workspace: int):
        self.graph, self.tensors, self.workspace = graph, tensors, workspace


@functools.cache
def _cudnn_handle(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return _cudnn().create_handle()


_GRAPHS: dict[tuple, _CudnnEntry] = {}


def _cudnn_graph(kind: str, B: int, T: int, Hq: int, Hkv: int, hs: int, device,
                 deterministic: bool = True) -> _CudnnEntry:  # fmt: skip
    """The built SDPA graph for this shape ("fwd" or "bwd"), from the cache or built now;
    `deterministic` picks the backward's algorithm (the forward has one).

    The packed layouts are described by strides, so no copies are made: q (B, Hq, T, hs) with
    strides (T*H3*hs, hs, H3*hs, 1) where H3 = Hq + 2*Hkv, k and v likewise from their own base
    addresses; att as (B, Hq, T, hs) with strides (T*Hq*hs, hs, Hq*hs, 1); the LSE as (B, Hq, T, 1).
    """
    deterministic = deterministic or kind == "fwd"
    key = (kind, B, T, Hq, Hkv, hs, device.index, deterministic)
    entry = _GRAPHS.get(key)
    if entry is not None:
        return entry
    cudnn = _cudnn()
    handle = _cudnn_handle(device.index)
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    H3 = Hq + 2 * Hkv
    packed = [T * H3 * hs, hs, H3 * hs, 1]
    o_stride = [T * Hq * hs, hs, Hq * hs, 1]
    q_dim, kv_dim, stats_dim, stats_stride = [B, Hq, T, hs], [B, Hkv, T, hs], [B, Hq, T, 1], [Hq * T, T, 1, 1]
    scale = 1.0 / math.sqrt(hs)
    try:
        with device.activate():
            g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            t = {
                "q": g.tensor(name="q", dim=q_dim, stride=packed, data_type=bf16),
                "k": g.tensor(name="k", dim=kv_dim, stride=packed, data_type=bf16),
                "v": g.tensor(name="v", dim=kv_dim, stride=packed, data_type=bf16),
            }
            if kind == "fwd":
                o, stats = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale,
                                  use_causal_mask=True)  # fmt: skip
                o.set_output(True).set_dim(q_dim).set_stride(o_stride).set_data_type(bf16)
                stats.set_output(True).set_dim(stats_dim).set_stride(stats_stride).set_data_type(f32)
                t.update(o=o, stats=stats)
            else:
                t["o"] = g.tensor(name="o", dim=q_dim, stride=o_stride, data_type=bf16)
                t["dO"] = g.tensor(name="dO", dim=q_dim, stride=o_stride, data_type=bf16)
                t["stats"] = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32)
                dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"],
                                             dO=t["dO"], stats=t["stats"], attn_scale=scale, use_causal_mask=True,
                                             use_deterministic_algorithm=deterministic)  # fmt: skip
                dq.set_output(True).set_dim(q_dim).set_stride(packed).set_data_type(bf16)
                dk.set_output(True).set_dim(kv_dim).set_stride(packed).set_data_type(bf16)
                dv.set_output(True).set_dim(kv_dim).set_stride(packed).set_data_type(bf16)
                t.update(dQ=dq, dK=dk, dV=dv)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            workspace = int(g.get_workspace_size())
    except Exception as err:
        raise RuntimeError(
            f"cuDNN SDPA {'forward' if kind == 'fwd' else 'backward'} is not available for B={B} T={T} "
            f"n_q_heads={Hq} n_kv_heads={Hkv} head_size={hs} bf16"
            f"{'' if deterministic else ' non-deterministic'}: {err}; use backend='raw'"
        ) from err
    entry = _GRAPHS[key] = _CudnnEntry(g, t, -(-workspace // _ALIGN) * _ALIGN)
    return entry


def _cudnn_execute(entry: _CudnnEntry, pointers: dict, workspace, device, stream) -> None:
    """Run a built graph on `stream` with raw device addresses (capturable: no sync, no allocation)."""
    cudnn = _cudnn()
    handle = _cudnn_handle(device.index)
    pack = {entry.tensors[name]: int(ptr) for name, ptr in pointers.items()}
    with device.activate():
        cudnn.set_stream(handle=handle, stream=device._stream(stream).ptr)
        entry.graph.execute(pack, workspace.ptr if workspace is not None else 0, handle=handle)
