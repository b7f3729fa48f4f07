"""Causal GQA attention: the NumPy twin against float64, the launchers' checks, and both GPU backends."""

import functools
import math

import attention_emulator as emu
import ml_dtypes
import numpy as np
import pytest
from conftest import TOL, finite_difference, rng
from kernel_emulator import or_skip

import cuengine as ce
from cuengine.kernels import attention as A
from cuengine.kernels.attention import (
    attention_backward,
    attention_backward_numpy,
    attention_forward,
    attention_forward_numpy,
    available_backends,
    workspace_shape,
)

HAS_CUDNN = "cudnn" in available_backends()
needs_cudnn = pytest.mark.skipif(not HAS_CUDNN, reason="nvidia-cudnn-frontend is not installed")


# ---- independent float64 reference ------------------------------------------------------------
def _heads64(qkv, Hq, Hkv):
    """q, k, v as float64 (B, T, Hq, hs), the kv heads repeated over each group."""
    B, T, C3 = qkv.shape
    hs = C3 // (Hq + 2 * Hkv)
    x = np.asarray(qkv, np.float64).reshape(B, T, Hq + 2 * Hkv, hs)
    group = Hq // Hkv
    return x[:, :, :Hq], np.repeat(x[:, :, Hq : Hq + Hkv], group, 2), np.repeat(x[:, :, Hq + Hkv :], group, 2), hs


def _probs64(q, k, hs):
    """Causal softmax weights (B, H, T, S) and the log of their denominators, without a max shift."""
    T = q.shape[1]
    w = np.exp(np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hs)) * np.tril(np.ones((T, T)))
    den = w.sum(-1)
    return w / den[..., None], np.log(den)


def forward64(qkv, Hq, Hkv):
    q, k, v, hs = _heads64(qkv, Hq, Hkv)
    p, lse = _probs64(q, k, hs)
    B, T = q.shape[:2]
    return np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, Hq * hs), lse


def backward64(datt, qkv, Hq, Hkv):
    """Through the softmax Jacobian (it never uses att): ds = p (dp - rowsum(p dp))."""
    q, k, v, hs = _heads64(qkv, Hq, Hkv)
    p, _ = _probs64(q, k, hs)
    B, T = q.shape[:2]
    do = np.asarray(datt, np.float64).reshape(B, T, Hq, hs)
    dp = np.einsum("bthd,bshd->bhts", do, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, k) / math.sqrt(hs)
    dk = np.einsum("bhts,bthd->bshd", ds, q) / math.sqrt(hs)
    dv = np.einsum("bhts,bthd->bshd", p, do)
    group = Hq // Hkv
    dk = dk.reshape(B, T, Hkv, group, hs).sum(3)
    dv = dv.reshape(B, T, Hkv, group, hs).sum(3)
    return np.concatenate([dq, dk, dv], axis=2).reshape(qkv.shape)


def _inputs(B, T, Hq, Hkv, hs, seed=0, dtype=np.float32):
    r = rng(seed)
    qkv = r.standard_normal((B, T, (Hq + 2 * Hkv) * hs)).astype(dtype)
    datt = r.standard_normal((B, T, Hq * hs)).astype(dtype)
    return qkv, datt


SMALL = [(2, 1, 2, 2, 8), (1, 7, 4, 1, 16), (2, 33, 6, 2, 8), (1, 64, 2, 1, 64), (1, 20, 3, 3, 24)]


# ---- the twin against float64 -------------------------------------------------------------------
@pytest.mark.parametrize("B,T,Hq,Hkv,hs", SMALL)
def test_twin_forward_matches_float64(B, T, Hq, Hkv, hs):
    qkv, _ = _inputs(B, T, Hq, Hkv, hs)
    att, lse = attention_forward_numpy(qkv, Hq, Hkv)
    att64, lse64 = forward64(qkv, Hq, Hkv)
    assert att.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(att, att64, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(lse, lse64, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("B,T,Hq,Hkv,hs", SMALL)
def test_twin_backward_matches_float64(B, T, Hq, Hkv, hs):
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=1)
    att, lse = attention_forward_numpy(qkv, Hq, Hkv)
    dqkv = attention_backward_numpy(datt, att, lse, qkv, Hq, Hkv)
    assert dqkv.shape == qkv.shape and dqkv.dtype == np.float32
    np.testing.assert_allclose(dqkv, backward64(datt, qkv, Hq, Hkv), rtol=1e-4, atol=2e-5)


def test_float64_backward_matches_finite_differences():
    B, T, Hq, Hkv, hs = 1, 5, 4, 2, 4
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=2, dtype=np.float64)
    grad = backward64(datt, qkv, Hq, Hkv)
    fd = finite_difference(lambda x: float((forward64(x, Hq, Hkv)[0] * datt).sum()), qkv)  # every q, k, v entry
    np.testing.assert_array_less(np.abs(fd - grad), 1e-6 * np.maximum(1.0, np.abs(fd)))


def test_twin_gqa_reduces_over_the_group():
    B, T, Hq, Hkv, hs = 2, 9, 6, 2, 8
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=3)
    group = Hq // Hkv
    x = qkv.reshape(B, T, Hq + 2 * Hkv, hs)
    k = np.repeat(x[:, :, Hq : Hq + Hkv], group, 2)
    v = np.repeat(x[:, :, Hq + Hkv :], group, 2)
    mha = np.concatenate([x[:, :, :Hq], k, v], axis=2).reshape(B, T, 3 * Hq * hs)
    att, lse = attention_forward_numpy(qkv, Hq, Hkv)
    att_m, lse_m = attention_forward_numpy(mha, Hq, Hq)
    np.testing.assert_allclose(att, att_m, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, lse_m, rtol=1e-6, atol=1e-6)
    d = attention_backward_numpy(datt, att, lse, qkv, Hq, Hkv).reshape(B, T, Hq + 2 * Hkv, hs)
    dm = attention_backward_numpy(datt, att_m, lse_m, mha, Hq, Hq).reshape(B, T, 3 * Hq, hs)
    np.testing.assert_allclose(d[:, :, :Hq], dm[:, :, :Hq], rtol=1e-5, atol=1e-6)
    for part, lo in ((Hq, Hq), (Hq + Hkv, 2 * Hq)):  # dk, then dv: sums over each group
        summed = dm[:, :, lo : lo + Hq].reshape(B, T, Hkv, group, hs).sum(3)
        np.testing.assert_allclose(d[:, :, part : part + Hkv], summed, rtol=1e-5, atol=1e-5)


# ---- launchers on cpu ----------------------------------------------------------------------------
def _tensors(dev, qkv, datt, Hq, Hkv, dtype, backend="raw"):
    """Input and output tensors on `dev`; outputs start as NaN so that unwritten elements show."""
    B, T, C3 = qkv.shape
    hs = C3 // (Hq + 2 * Hkv)
    t = {
        "qkv": ce.Tensor.from_numpy(qkv, dev, name="qkv", dtype=dtype),
        "datt": ce.Tensor.from_numpy(datt, dev, name="datt", dtype=dtype),
        "att": ce.Tensor.from_numpy(np.full((B, T, Hq * hs), np.nan), dev, name="att", dtype=dtype),
        "lse": ce.Tensor.from_numpy(np.full((B, Hq, T), np.nan), dev, name="lse", dtype=ce.FP32),
        "dqkv": ce.Tensor.from_numpy(np.full(qkv.shape, np.nan), dev, name="dqkv", dtype=dtype),
    }
    ws = workspace_shape(B, T, Hq, Hkv, hs, backend, dtype=dtype, device=dev)
    t["ws"] = ce.Tensor.empty(ce.BYTE, ws, dev, name="workspace")
    return t


def _run(t, Hq, Hkv, backend="raw", stream=None):
    attention_forward(t["att"], t["lse"], t["qkv"], Hq, Hkv, backend=backend, workspace=t["ws"], stream=stream)
    attention_backward(t["dqkv"], t["datt"], t["att"], t["lse"], t["qkv"], Hq, Hkv, backend=backend,
                       workspace=t["ws"], stream=stream)  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["auto", "raw"])
def test_cpu_launchers_run_the_twin_and_round_once(dtype, backend):
    B, T, Hq, Hkv, hs = 2, 13, 4, 2, 16
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=4)
    dt = ce.dtype(dtype)
    t = _tensors(ce.device("cpu"), qkv, datt, Hq, Hkv, dt, backend)
    _run(t, Hq, Hkv, backend)
    q32 = qkv.astype(dt.np).astype(np.float32)  # the values the tensor holds
    d32 = datt.astype(dt.np).astype(np.float32)
    att, lse = attention_forward_numpy(q32, Hq, Hkv)
    np.testing.assert_array_equal(t["att"].numpy(), att.astype(dt.np))
    np.testing.assert_array_equal(t["lse"].numpy(), lse)
    dx = attention_backward_numpy(d32, t["att"].numpy().astype(np.float32), lse, q32, Hq, Hkv)
    np.testing.assert_array_equal(t["dqkv"].numpy(), dx.astype(dt.np))


def test_cpu_backward_accepts_batch_shards():
    B, T, Hq, Hkv, hs, n = 4, 11, 2, 1, 8, 2
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=5)
    dev = ce.device("cpu")
    t = _tensors(dev, qkv, datt, Hq, Hkv, ce.BF16)
    _run(t, Hq, Hkv)
    full = t["dqkv"].numpy().copy()
    t["dqkv"].fill_zero()
    ws = ce.Tensor.empty(ce.BYTE, workspace_shape(B // n, T, Hq, Hkv, hs, "raw", device=dev), dev, name="ws_chunk")
    for i in range(n):
        attention_backward(*(t[k].shard_view(i, n) for k in ("dqkv", "datt", "att", "lse", "qkv")), Hq, Hkv,
                           backend="raw", workspace=ws)  # fmt: skip
    np.testing.assert_array_equal(t["dqkv"].numpy(), full)


def test_available_backends_and_workspace_shape():
    assert available_backends()[0] == "raw"
    assert set(available_backends()) <= {"raw", "cudnn"}
    cpu = ce.device("cpu")
    # raw: forward needs nothing, backward D = rowsum(dO * O) in fp32, rounded up to 256 bytes
    assert workspace_shape(3, 100, 14, 2, 64, "raw", device=cpu) == (16896,)  # 3 * 14 * 100 * 4 = 16800
    assert workspace_shape(1, 1, 1, 1, 64, "auto", device=cpu) == (256,)
    with pytest.raises(ValueError, match="T must be a non-negative int"):
        workspace_shape(1, -1, 1, 1, 64, device=cpu)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        workspace_shape(1, 8, 1, 1, 64, "flash", device=cpu)


def test_t_of_one_and_empty_batch():
    dev = ce.device("cpu")
    qkv, datt = _inputs(2, 1, 2, 1, 8, seed=6)
    t = _tensors(dev, qkv, datt, 2, 1, ce.FP32)
    _run(t, 2, 1)
    x = qkv.reshape(2, 1, 4, 8)
    np.testing.assert_allclose(t["att"].numpy().reshape(2, 1, 2, 8), x[:, :, [3, 3]], rtol=1e-6)  # softmax of one
    np.testing.assert_allclose(t["lse"].numpy(), (x[:, 0, :2] * x[:, 0, [2]]).sum(-1)[:, :, None] / math.sqrt(8),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    e = _tensors(dev, qkv[:0], datt[:0], 2, 1, ce.FP32)
    _run(e, 2, 1)  # nothing to do, no error


# ---- error paths -----------------------------------------------------------------------------------
@pytest.fixture
def cpu_set():
    qkv, datt = _inputs(1, 8, 4, 2, 16, seed=7)
    return _tensors(ce.device("cpu"), qkv, datt, 4, 2, ce.BF16)


def _fwd(t, **kw):
    args = {"att": t["att"], "lse": t["lse"], "qkv": t["qkv"], "n_q_heads": 4, "n_kv_heads": 2, "workspace": t["ws"]}
    args.update(kw)
    attention_forward(**args)


def _bwd(t, **kw):
    args = {"dqkv": t["dqkv"], "datt": t["datt"], "att": t["att"], "lse": t["lse"], "qkv": t["qkv"],
            "n_q_heads": 4, "n_kv_heads": 2, "workspace": t["ws"]}  # fmt: skip
    args.update(kw)
    attention_backward(**args)


def _t(shape, dtype, name="x"):
    return ce.Tensor.empty(dtype, shape, "cpu", name=name)


def test_error_bad_qkv_layout(cpu_set):
    with pytest.raises(ValueError, match=r"qkv: expected shape \(B, T, \(n_q_heads \+ 2\*n_kv_heads\) \* head_size\)"):
        _fwd(cpu_set, qkv=_t((1, 8, 8 * 16 + 4), ce.BF16))
    with pytest.raises(ValueError, match="qkv: expected shape"):
        _fwd(cpu_set, qkv=_t((8, 8 * 16), ce.BF16))
    with pytest.raises(ValueError, match="qkv: expected shape"):
        _bwd(cpu_set, qkv=_t((1, 8, 8 * 16 - 3), ce.BF16))


def test_error_heads(cpu_set):
    with pytest.raises(ValueError, match="n_q_heads=3 is not a multiple of n_kv_heads=2"):
        _fwd(cpu_set, n_q_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads must be a positive int, got 0"):
        _bwd(cpu_set, n_kv_heads=0)
    with pytest.raises(ValueError, match="n_q_heads must be a positive int"):
        _fwd(cpu_set, n_q_heads=4.0)


def test_error_dtypes_and_shapes(cpu_set):
    with pytest.raises(ValueError, match="qkv: expected dtype fp32/bf16"):
        _fwd(cpu_set, qkv=_t((1, 8, 128), ce.FP16))
    with pytest.raises(ValueError, match="att: expected dtype bf16"):
        _fwd(cpu_set, att=_t((1, 8, 64), ce.FP32))
    with pytest.raises(ValueError, match=r"att: expected shape \(1, 8, 64\)"):
        _fwd(cpu_set, att=_t((1, 8, 32), ce.BF16))
    with pytest.raises(ValueError, match="lse: expected dtype fp32"):
        _fwd(cpu_set, lse=_t((1, 4, 8), ce.BF16))
    with pytest.raises(ValueError, match=r"lse: expected shape \(1, 4, 8\)"):
        _bwd(cpu_set, lse=_t((1, 8, 4), ce.FP32))
    with pytest.raises(ValueError, match=r"dqkv: expected shape \(1, 8, 128\)"):
        _bwd(cpu_set, dqkv=_t((1, 8, 64), ce.BF16))
    with pytest.raises(ValueError, match="dqkv: expected dtype bf16"):
        _bwd(cpu_set, dqkv=_t((1, 8, 128), ce.FP32))
    with pytest.raises(ValueError, match="datt: expected dtype bf16"):
        _bwd(cpu_set, datt=_t((1, 8, 64), ce.FP32))
    with pytest.raises(ValueError, match=r"att: expected shape \(1, 8, 64\)"):
        _bwd(cpu_set, att=_t((1, 4, 64), ce.BF16))


def test_error_backends(cpu_set, monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; use one of auto, raw, cudnn"):
        _fwd(cpu_set, backend="flash")
    big = _t((1, 8, 3 * 264), ce.BF16)
    with pytest.raises(ValueError, match="backend 'raw' supports head sizes up to 256, got 264"):
        _fwd(cpu_set, qkv=big, att=_t((1, 8, 264), ce.BF16), lse=_t((1, 1, 8), ce.FP32), n_q_heads=1,
             n_kv_heads=1, backend="raw")  # fmt: skip
    if not HAS_CUDNN:
        with pytest.raises(ValueError, match="backend 'cudnn' needs nvidia-cudnn-frontend"):
            _fwd(cpu_set, backend="cudnn")
        with pytest.raises(ValueError, match="backend 'cudnn' needs nvidia-cudnn-frontend"):
            _bwd(cpu_set, backend="cudnn")
    monkeypatch.setattr(A, "_cudnn", lambda: object())  # pretend it is installed
    f32 = _tensors(ce.device("cpu"), *_inputs(1, 8, 4, 2, 16), 4, 2, ce.FP32)
    with pytest.raises(ValueError, match="backend 'cudnn' takes bf16 qkv, got fp32"):
        _fwd(f32, backend="cudnn")
    odd = _tensors(ce.device("cpu"), *_inputs(1, 8, 4, 2, 12), 4, 2, ce.BF16)
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        _bwd(odd, backend="cudnn")


def test_error_workspace(cpu_set):
    with pytest.raises(ValueError, match="backward: needs a workspace of 256 bytes"):
        _bwd(cpu_set, workspace=None)
    with pytest.raises(ValueError, match="workspace 'small' holds 16 bytes, needs 256"):
        _bwd(cpu_set, workspace=_t((16,), ce.BYTE, "small"))
    with pytest.raises(ValueError, match="workspace: expected dtype byte"):
        _bwd(cpu_set, workspace=_t((64,), ce.FP32))
    _fwd(cpu_set, workspace=None)  # the raw forward needs none


def test_error_aliasing(cpu_set):
    with pytest.raises(ValueError, match=r"dqkv \('qkv'\) overlaps qkv \('qkv'\)"):
        _bwd(cpu_set, dqkv=cpu_set["qkv"])
    t = cpu_set["qkv"]
    with pytest.raises(ValueError, match="att .* overlaps qkv"):
        _fwd(cpu_set, att=t.flat().rows(0, 8 * 64).reshape(1, 8, 64))
    with pytest.raises(ValueError, match="workspace .* overlaps lse"):
        _bwd(cpu_set, workspace=cpu_set["lse"].view(ce.BYTE).reshape(-1))


def test_bad_input_changes_nothing(cpu_set):
    before = cpu_set["dqkv"].numpy().copy()
    with pytest.raises(ValueError):
        _bwd(cpu_set, workspace=None)
    np.testing.assert_array_equal(cpu_set["dqkv"].numpy().view(np.uint16), before.view(np.uint16))


# ---- GPU: both backends against the twin ---------------------------------------------------------
# (B, T, Hq, Hkv, hs): T in {1, 17, 128, 1000, 2048} x hs in {64, 128} x Hq/Hkv in {1/1, 4/1, 14/2},
# not every combination (the float32 twin on T = 2048 takes seconds).
GPU_CASES = [
    (2, 1, 4, 1, 64), (2, 1, 14, 2, 128),
    (2, 17, 1, 1, 64), (2, 17, 4, 1, 128), (1, 17, 14, 2, 64),
    (2, 128, 1, 1, 128), (1, 128, 4, 1, 64), (2, 128, 14, 2, 128),
    (1, 1000, 1, 1, 64), (1, 1000, 4, 1, 128), (1, 1000, 14, 2, 64), (1, 1000, 14, 2, 128),
    (1, 2048, 4, 1, 64), (1, 2048, 14, 2, 128),
]  # fmt: skip
LSE_TOL = (1e-4, 2e-4)  # fp32 LSE from the same bf16 inputs; sums in another order
F32_TOL = (1e-4, 1e-4)  # fp32 kernels against the float32 twin: sums over T in another order


@functools.cache
def _reference(case, dtype_name):
    """Inputs (rounded to dtype) and the cpu twin's att, lse, dqkv for one case."""
    B, T, Hq, Hkv, hs = case
    dt = ce.dtype(dtype_name)
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=sum(case))
    qkv, datt = qkv.astype(dt.np), datt.astype(dt.np)
    t = _tensors(ce.device("cpu"), qkv, datt, Hq, Hkv, dt)
    _run(t, Hq, Hkv)
    return qkv, datt, t["att"].numpy(), t["lse"].numpy(), t["dqkv"].numpy()


def _on_cuda(case, dtype_name, backend):
    B, T, Hq, Hkv, hs = case
    qkv, datt = _reference(case, dtype_name)[:2]
    dev = ce.device("cuda")
    t = _tensors(dev, qkv, datt, Hq, Hkv, ce.dtype(dtype_name), backend)
    _run(t, Hq, Hkv, backend)
    return {k: t[k].numpy() for k in ("att", "lse", "dqkv")}


TAIL = 6.0  # the per-element bound for the rare tail, in multiples of the table (see _compare)
DQKV_FACTOR = 2.0  # the flash backward rounds P and dS to bf16 for its MMAs: two roundings the twin does not make


def _compare(got, want, dtype_name, what, factor=1.0):
    """In units of each channel's rms s (last axis; not the largest value, so a small part such as dq
    beside larger dk/dv is held to its own size; s >= 1e-3 x the largest value, so rounding noise in
    an all-but-zero channel such as dq at T = 1 passes), two bounds from the tolerance table:
    - the rms error over all elements <= rtol (a systematic 3% error in any channel shows here);
    - every element within TAIL x (atol + rtol |want|): bf16 paths round P and dS at other points
      than the twin, and on the H200 a few elements in a million land up to ~5 atol away.
    factor scales both (0 demands bitwise equality)."""
    want64, got64 = np.asarray(want, np.float64), np.asarray(got, np.float64)
    if what == "lse":
        np.testing.assert_allclose(got64, want64, rtol=LSE_TOL[0] * factor, atol=LSE_TOL[1] * factor, err_msg=what)
        return
    rtol, atol = F32_TOL if dtype_name == "fp32" else TOL[dtype_name]
    flat = want64.reshape(-1, want64.shape[-1])
    s = np.maximum(np.sqrt(np.mean(flat * flat, axis=0)), 1e-3 * float(np.abs(want64).max(initial=0.0)))
    s = np.where(s > 0, s, 1.0)
    g, w = got64 / s, want64 / s
    if factor == 0:
        np.testing.assert_array_equal(got64, want64, err_msg=what)
        return
    rms_err = float(np.sqrt(np.mean((g - w) ** 2))) if g.size else 0.0
    assert rms_err <= rtol * factor, f"{what}: rms error {rms_err:.4g} (in channel-rms units) > {rtol * factor:.4g}"
    np.testing.assert_allclose(g, w, rtol=TAIL * rtol * factor, atol=TAIL * atol * factor, err_msg=what)


def _check_against_twin(case, dtype_name, backend):
    ref = dict(zip(("att", "lse", "dqkv"), _reference(case, dtype_name)[2:]))
    got = _on_cuda(case, dtype_name, backend)
    for k in ("att", "lse", "dqkv"):
        assert np.all(np.isfinite(got[k].astype(np.float32))), f"{k}: non-finite values (unwritten?)"
        _compare(got[k], ref[k], dtype_name, k, factor=DQKV_FACTOR if k == "dqkv" else 1.0)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_raw_bf16_matches_twin(case):
    _check_against_twin(case, "bf16", "raw")


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_cudnn_matches_twin_and_raw(case):
    if case[1] == 1:  # T = 1: cuDNN SDPA refuses it, and the backend says so
        with pytest.raises(ValueError, match="does not support T = 1"):
            _check_against_twin(case, "bf16", "cudnn")
        return
    got = _check_against_twin(case, "bf16", "cudnn")
    raw = _on_cuda(case, "bf16", "raw")
    for k in ("att", "lse", "dqkv"):
        _compare(raw[k], got[k], "bf16", f"raw vs cudnn {k}", factor=2.0)


def _needs_sm90():
    cc = ce.device("cuda").compute_capability
    if cc != (9, 0):
        pytest.skip(f"the wgmma kernels (sm_90a) need compute capability 9.0, not {cc}")


def _mma_sync_only(monkeypatch):
    """The mma.sync kernels of attention.cu even on compute capability 9.0 (the other GPUs' path)."""
    monkeypatch.setattr(A, "SM90_FORWARD", ())
    monkeypatch.setattr(A, "SM90_BACKWARD", ())


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_raw_mma_sync_matches_twin(case, monkeypatch):
    """attention.cu's flash kernels, which every GPU but compute capability 9.0 runs (there
    test_gpu_raw_bf16_matches_twin runs the wgmma ones)."""
    _mma_sync_only(monkeypatch)
    _check_against_twin(case, "bf16", "raw")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("mix", ["wgmma-fwd", "wgmma-bwd"])
def test_gpu_raw_sm90_pairs_with_mma_sync(case, mix, monkeypatch):
    """One pass on wgmma, the other on mma.sync: the lse and D contracts are the same."""
    _needs_sm90()
    monkeypatch.setattr(A, "SM90_BACKWARD" if mix == "wgmma-fwd" else "SM90_FORWARD", ())
    _check_against_twin(case, "bf16", "raw")


def test_sm90_switch():
    """The wgmma kernels are the default for bf16 hs 64 and 128, only on compute capability 9.0."""

    class Dev:
        compute_capability = (9, 0)

    assert A.SM90_FORWARD == A.SM90_BACKWARD == (64, 128) and set(A._SM90_KEY_BLOCK) == {64, 128}
    assert A._is_sm90(Dev())
    Dev.compute_capability = (10, 0)  # no wgmma on Blackwell: the mma.sync kernels run
    assert not A._is_sm90(Dev())
    assert not A._is_sm90(ce.device("cpu"))


def test_sm90_module_compiles_for_sm90a():
    """attention_sm90.cu through the loader's own NVRTC path for its architecture (MODULE_ARCH), with
    no ptxas warning: "wgmma.mma_async instructions are serialized" (C7518) means ptxas lost track
    of an accumulator and every wgmma waits for the one before. The plain sm_90 build of
    tests/test_compile.py only sees the file's __trap() stand-ins."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is part of the [cuda] extra")
    from cuengine.kernels._build import MODULE_ARCH, compile_cubin, kernel_dir

    assert MODULE_ARCH["attention_sm90"] == "sm_90a"
    cubin, log = compile_cubin(kernel_dir() / "attention_sm90.cu", "sm_90a")
    assert len(cubin) > 0
    assert "C7518" not in log and "Performance" not in log, log


# The warp-per-row kernels: fp32, and bf16 head sizes without flash kernels (hs 80: lanes partly idle).
SIMT_CASES = [(2, 1, 4, 1, 64), (2, 17, 4, 2, 32), (1, 300, 14, 2, 128), (1, 129, 2, 1, 80), (1, 70, 3, 1, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("case", SIMT_CASES, ids=str)
def test_gpu_raw_simt_matches_twin(case, dtype_name):
    if dtype_name == "bf16" and case[4] in A.FLASH_HEAD_SIZES:
        pytest.skip("bf16 with this head size runs the flash kernels")
    _check_against_twin(case, dtype_name, "raw")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["raw", "raw-mma", pytest.param("cudnn", marks=needs_cudnn)])
def test_gpu_batch_shards_deterministic_stream_and_graph(backend, monkeypatch):
    """Chunked backward (the seed's AttBwdChunks), repeatability, a side stream and graph capture
    (raw: the wgmma kernels on compute capability 9.0; raw-mma: attention.cu's everywhere)."""
    if backend == "raw-mma":
        _mma_sync_only(monkeypatch)
        backend = "raw"
    case = (4, 200, 4, 2, 128)
    B, T, Hq, Hkv, hs = case
    qkv, datt = _reference(case, "bf16")[:2]
    dev = ce.device("cuda")
    t = _tensors(dev, qkv, datt, Hq, Hkv, ce.BF16, backend)
    _run(t, Hq, Hkv, backend)
    full = {k: t[k].numpy().copy() for k in ("att", "lse", "dqkv")}
    _run(t, Hq, Hkv, backend)
    exact = backend == "raw"  # cuDNN runs its deterministic algorithm, but only raw promises bitwise results
    if exact:
        for k in full:
            np.testing.assert_array_equal(t[k].numpy(), full[k], err_msg=f"{k} not repeatable")
    n = 2
    ws = ce.Tensor.empty(ce.BYTE, workspace_shape(B // n, T, Hq, Hkv, hs, backend, device=dev), dev, name="ws_chunk")
    t["dqkv"].fill_zero()
    for i in range(n):
        attention_backward(*(t[k].shard_view(i, n) for k in ("dqkv", "datt", "att", "lse", "qkv")), Hq, Hkv,
                           backend=backend, workspace=ws)  # fmt: skip
    _compare(t["dqkv"].numpy(), full["dqkv"], "bf16", "chunked dqkv", factor=0.0 if exact else 1.0)
    side = dev.new_stream()
    for k in ("att", "lse", "dqkv"):
        t[k].fill_zero()
    dev.synchronize()  # the fills ran on the main stream
    _run(t, Hq, Hkv, backend, stream=side)
    side.synchronize()
    for k in full:
        _compare(t[k].numpy(), full[k], "bf16", f"side stream {k}", factor=0.0 if exact else 1.0)
    graph = dev.capture(lambda: _run(t, Hq, Hkv, backend))
    for k in ("att", "lse", "dqkv"):
        t[k].fill_zero()
    graph.launch()
    dev.synchronize()
    for k in full:
        _compare(t[k].numpy(), full[k], "bf16", f"graph replay {k}", factor=0.0 if exact else 1.0)


@pytest.mark.gpu
def test_gpu_auto_picks_cudnn_when_installed():
    case = (1, 64, 4, 1, 64)
    got = _on_cuda(case, "bf16", "auto")
    ref = _reference(case, "bf16")
    for k, want in zip(("att", "lse", "dqkv"), ref[2:]):
        _compare(got[k], want, "bf16", k)
    ws = workspace_shape(1, 64, 4, 1, 64, "auto", device=ce.device("cuda"))
    assert ws == workspace_shape(1, 64, 4, 1, 64, "cudnn" if HAS_CUDNN else "raw", device=ce.device("cuda"))


# ---- CPU emulation of the CUDA kernels (tests/attention_emulator.py) --------------------------------
EMU_CASES = [  # (B, T, Hq, Hkv, hs, dtype, eager): flash with tails, GQA and the causal warp skip, copies
    # landing late (at the wait) and early (at issue, with warps drifting apart); simt fp32 and bf16
    (2, 17, 4, 1, 128, "bf16", 0), (1, 65, 6, 2, 64, "bf16", 0), (1, 130, 2, 1, 128, "bf16", 0),
    (1, 130, 2, 1, 64, "bf16", 1), (1, 130, 2, 2, 128, "bf16", 1),
    (2, 9, 4, 2, 80, "fp32", 0), (1, 12, 3, 1, 40, "bf16", 0),
]  # fmt: skip


# attention_sm90.cu's kernels (the emulated device is compute capability 9.0, so bf16 hs 64/128 runs
# them by default): causal tails, a warpgroup whose rows end before a key block (skipped), GQA, copies
# landing early and late; hs 128 is the ping-pong forward with 128-key blocks, hs 64 the free one.
EMU_SM90_CASES = [  # (B, T, Hq, Hkv, hs, "sm90", eager)
    (2, 17, 4, 1, 128, "sm90", 0), (1, 200, 2, 1, 128, "sm90", 1), (1, 130, 6, 2, 64, "sm90", 1),
    (1, 70, 2, 1, 64, "sm90", 0), (1, 300, 2, 1, 128, "sm90", 1), (1, 260, 2, 1, 64, "sm90", 0),
]  # fmt: skip


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The emulated library of each attention family, for emu.launch."""
    return {f: or_skip(emu.build(tmp_path_factory.mktemp(f), f)) for f in ("attention", "attention_sm90")}


def _probe_inputs(hs, bc, seed=0):
    r = rng(seed)
    return [r.standard_normal((rows, hs)).astype(ml_dtypes.bfloat16) for rows in (64, bc, bc)]


def _check_probe(s, o, q, k, v):
    """The probe's Q K^T against NumPy, and its P V against NumPy from the probe's own S rounded to
    bf16 (so that a wrong P V shows even where S is right)."""
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    np.testing.assert_allclose(s, f32[0] @ f32[1].T, rtol=1e-5, atol=1e-4, err_msg="S = Q K^T")
    want = s.astype(ml_dtypes.bfloat16).astype(np.float32) @ f32[2]
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-3, err_msg="O = P V")


def _run_probe(launch_fn, dev, hs, bc, tensor):
    """The probe kernel through launch_fn on dev; tensor(array, name) puts an array on dev."""
    q, k, v = _probe_inputs(hs, bc, seed=hs + bc)
    t = [tensor(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    s_out = tensor(np.full((64, bc), np.nan, np.float32), "s_out")
    o_out = tensor(np.full((64, hs), np.nan, np.float32), "o_out")
    launch_fn("attention_sm90", f"wgmma_probe_hs{hs}_bc{bc}", 1, 128, (s_out, o_out, *t), dev,
              shared_mem=(64 + 2 * bc) * hs * 2 + 1024)  # fmt: skip
    _check_probe(s_out.numpy(), o_out.numpy(), q, k, v)


def _host_tensor(values, name, dev=None):
    """A tensor on the emulated device whose storage is a host array."""
    a = np.ascontiguousarray(values)
    dt = ce.BF16 if a.dtype == ml_dtypes.bfloat16 else ce.FP32
    return ce.Tensor(dt, a.shape, dev or emu.EmulatedCuda(), a.reshape(-1).view(np.uint8).copy(), 0, name)


PROBES = [(64, 64), (128, 64), (128, 128)]  # (hs, key block): m64n64k16 and m64n128k16, both forms


@pytest.mark.parametrize("hs,bc", PROBES)
def test_emulated_wgmma_probe(emulator, hs, bc):
    """The emulator's wgmma (descriptors, swizzle, fragments) on the probe kernel against NumPy."""
    dev = emu.EmulatedCuda()
    _run_probe(functools.partial(emu.launch, emulator), dev, hs, bc, functools.partial(_host_tensor, dev=dev))


@pytest.mark.gpu
@pytest.mark.parametrize("hs,bc", PROBES)
def test_gpu_wgmma_probe(hs, bc):
    """The same probe on the GPU: a layout mistake made twice (kernel and emulator) shows here."""
    from cuengine.kernels._build import launch

    dev = ce.device("cuda")
    _run_probe(launch, dev, hs, bc, lambda x, name: ce.Tensor.from_numpy(x, dev, name=name))


@pytest.mark.parametrize("case", EMU_CASES + EMU_SM90_CASES, ids=str)
def test_emulated_kernels_match_twin(emulator, monkeypatch, case):
    B, T, Hq, Hkv, hs, dtype_name, eager = case
    if dtype_name == "sm90":  # attention_sm90.cu's kernels (the default here)
        dtype_name = "bf16"
    else:  # attention.cu's kernels
        _mma_sync_only(monkeypatch)
    monkeypatch.setattr(A, "launch", functools.partial(emu.launch, emulator))
    for lib in emulator.values():
        lib.emu_set_eager(eager)
    dt = ce.dtype(dtype_name)
    qkv, datt = _inputs(B, T, Hq, Hkv, hs, seed=sum(case[:5]))
    qkv, datt = qkv.astype(dt.np), datt.astype(dt.np)
    dev = emu.EmulatedCuda()

    def tensor(values, dtype, name):
        """A tensor with wide canary margins on both sides, so that writes out of bounds show."""
        raw = np.ascontiguousarray(np.asarray(values).astype(ce.dtype(dtype).np)).reshape(-1).view(np.uint8)
        pad = 4096 + 8 * raw.size  # a full block of rows past T stays inside it
        storage = np.full(raw.size + 2 * pad, 0xA5, np.uint8)
        storage[pad : pad + raw.size] = raw
        return ce.Tensor(dtype, np.shape(values), dev, storage, pad, name)

    t = {
        "qkv": tensor(qkv, dt, "qkv"),
        "datt": tensor(datt, dt, "datt"),
        "att": tensor(np.full((B, T, Hq * hs), np.nan), dt, "att"),
        "lse": tensor(np.full((B, Hq, T), np.nan), ce.FP32, "lse"),
        "dqkv": tensor(np.full(qkv.shape, np.nan), dt, "dqkv"),
        "ws": tensor(np.zeros(workspace_shape(B, T, Hq, Hkv, hs, "raw", dtype=dt, device="cpu")), ce.BYTE, "ws"),
    }
    _run(t, Hq, Hkv, "raw")
    for k, x in t.items():
        margins = np.concatenate([x.storage[: x.offset], x.storage[x.offset + x.nbytes :]])
        assert np.all(margins == 0xA5), f"{k}: written out of bounds"
    q32 = qkv.astype(np.float32)
    att, lse = attention_forward_numpy(q32, Hq, Hkv)
    dx = attention_backward_numpy(datt.astype(np.float32), t["att"].numpy().astype(np.float32), t["lse"].numpy(), q32,
                                  Hq, Hkv)  # fmt: skip
    _compare(t["att"].numpy(), att.astype(dt.np), dtype_name, "att")
    _compare(t["lse"].numpy(), lse, dtype_name, "lse")
    _compare(t["dqkv"].numpy(), dx.astype(dt.np), dtype_name, "dqkv", factor=DQKV_FACTOR)


# ---- the non-deterministic cuDNN backward (TrainOptions.attention_deterministic=False) ---------------
def test_deterministic_flag_is_checked_and_plain_on_cpu(cpu_set):
    with pytest.raises(ValueError, match="attention_backward: deterministic must be True or False, got 'no'"):
        _bwd(cpu_set, deterministic="no")
    with pytest.raises(ValueError, match="workspace_shape: deterministic must be True or False, got 1"):
        workspace_shape(1, 8, 4, 2, 16, "raw", device="cpu", deterministic=1)
    # on cpu (and with the raw backend) the flag changes nothing: the same workspace, the same bits
    assert workspace_shape(1, 8, 4, 2, 16, "raw", device="cpu", deterministic=False) == workspace_shape(
        1, 8, 4, 2, 16, "raw", device="cpu"
    )
    _fwd(cpu_set)
    _bwd(cpu_set)
    want = cpu_set["dqkv"].numpy().copy()
    cpu_set["dqkv"].fill_zero()
    _bwd(cpu_set, deterministic=False)
    np.testing.assert_array_equal(cpu_set["dqkv"].numpy(), want)


NONDET_CASES = [(2, 128, 14, 2, 64), (1, 1000, 14, 2, 64), (2, 128, 12, 2, 128), (1, 2048, 16, 2, 128)]


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("case", NONDET_CASES, ids=str)
def test_gpu_cudnn_nondeterministic_backward_matches_deterministic(case):
    """cuDNN's atomic-dQ backward against its deterministic one (bf16 TOL) and the twin; its own
    workspace size (an fp32 dQ accumulator), and a CUDA graph replay of it."""
    B, T, Hq, Hkv, hs = case
    qkv, datt = _reference(case, "bf16")[:2]
    ref = dict(zip(("att", "lse", "dqkv"), _reference(case, "bf16")[2:]))
    dev = ce.device("cuda")
    det = _on_cuda(case, "bf16", "cudnn")
    t = _tensors(dev, qkv, datt, Hq, Hkv, ce.BF16, "cudnn")
    need = workspace_shape(B, T, Hq, Hkv, hs, "cudnn", device=dev, deterministic=False)
    t["ws"] = ce.Tensor.empty(ce.BYTE, (max(need[0], t["ws"].nelem),), dev, name="workspace")
    attention_forward(t["att"], t["lse"], t["qkv"], Hq, Hkv, backend="cudnn", workspace=t["ws"])

    def bwd():
        attention_backward(t["dqkv"], t["datt"], t["att"], t["lse"], t["qkv"], Hq, Hkv, backend="cudnn",
                           workspace=t["ws"], deterministic=False)  # fmt: skip

    bwd()
    got = t["dqkv"].numpy()
    assert np.all(np.isfinite(got.astype(np.float32)))
    _compare(got, det["dqkv"], "bf16", "non-deterministic vs deterministic dqkv")
    _compare(got, ref["dqkv"], "bf16", "non-deterministic dqkv vs twin")
    graph = dev.capture(bwd)
    t["dqkv"].fill_zero()
    graph.launch()
    dev.synchronize()
    _compare(t["dqkv"].numpy(), det["dqkv"], "bf16", "graph replay of the non-deterministic backward")
