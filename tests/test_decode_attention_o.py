"""The attention of one decode row with its output projection in one launch (kernels/decode_attention_o.py):
the twin against decode_attention + the output GEMV, both devices against the twin at short rows (every
block of a head runs the whole attention) and long ones (the head's blocks split the positions and
merge), repeated launches (the meeting's counters reset), and every documented error."""

import numpy as np
import pytest
from conftest import assert_close, rng
from test_decode_attention import make_case, nan_scratch

import cuengine as ce
from cuengine.kernels import decode_attention_o as dao
from cuengine.kernels import gemv as gv
from cuengine.kernels.decode_attention import decode_attention_scratch_shape, rope_kv_append_np
from cuengine.kernels.rope import rope_freqs


def case(hq, hkv, hs, max_seq, length, dtype="bf16", C=96, fp8=False, seed=0):
    qkv, kc, vc, ln = make_case(1, hq, hkv, hs, max_seq, [length], dtype, seed)
    freq_dt = np.float16 if dtype == "bf16" else np.float32
    c = {"qkv": qkv, "kc": kc, "vc": vc, "lengths": ln, "freqs": rope_freqs(max_seq, hs, 10000.0, freq_dt)}
    c["w_o"] = (rng(seed + 1).normal(0, 1, (C, hq * hs)) / np.sqrt(hq * hs)).astype(qkv.dtype)
    if fp8:
        c["w_o"], c["o_scale"] = gv.quantize_rows_np(c["w_o"])
    return c


def twin(c, hq, hkv):
    kc, vc = c["kc"].copy(), c["vc"].copy()
    att, delta = dao.decode_attention_o_np(c["qkv"], kc, vc, c["lengths"], c["freqs"], hq, hkv, c["w_o"],
                                           c.get("o_scale"))  # fmt: skip
    return att, delta, kc, vc


def test_twin_is_the_attention_then_the_output_gemv():
    hq, hkv, hs = 6, 2, 32
    c = case(hq, hkv, hs, 64, 40)
    att, delta, kc, _ = twin(c, hq, hkv)
    q = c["qkv"].copy()
    kc2, vc2 = c["kc"].copy(), c["vc"].copy()
    rope_kv_append_np(q, kc2, vc2, np.arange(1), c["lengths"] - 1, c["freqs"], hq, hkv)
    np.testing.assert_array_equal(kc, kc2)  # the row's k, rotated, appended at position 39
    want = gv.gemv_np(att, c["w_o"], out_dtype=np.float32)
    assert_close(gv.acc_values_np(delta), want, "fp32", "att . W_o", scale=np.abs(want).max())


# (hq, hkv, hs, C): the 0.5B shape's heads with a small C, head size 128, tiny heads of 16
SHAPES = [(14, 2, 64, 96), (4, 2, 128, 200), (4, 2, 16, 64)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("length", [1, 37, 700])  # a lone position; short (whole per block); long (split)
@pytest.mark.parametrize("hq,hkv,hs,C", SHAPES)
def test_device_matches_twin(dev, hq, hkv, hs, C, length, dtype, fp8):
    max_seq = 768
    c = case(hq, hkv, hs, max_seq, length, dtype, C, fp8)
    att_want, delta, kc_want, vc_want = twin(c, hq, hkv)
    shape = decode_attention_scratch_shape(1, hq, hs, max_seq)
    t = {k: ce.Tensor.from_numpy(v, dev, name=k) for k, v in c.items()}
    scratch = ce.Tensor.from_numpy(nan_scratch(shape, hs), dev, name="scratch")
    acc = ce.Tensor.from_numpy(np.zeros(gv.acc_shape(1, C), np.int64), dev, name="acc")
    att = ce.Tensor.from_numpy(np.full((1, hq * hs), 7, c["qkv"].dtype), dev, name="att")
    for rep in range(2):  # the counters of a long row's meeting are back at zero for the next launch
        t["kc"].copy_from_numpy(c["kc"])
        t["vc"].copy_from_numpy(c["vc"])
        dao.decode_attention_o(acc, att, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, scratch, t["freqs"],
                               t["w_o"], o_scale=t.get("o_scale"))  # fmt: skip
        assert_close(att.numpy(), att_want, dtype, f"att (launch {rep})")
        assert_close(t["kc"].numpy(), kc_want, dtype, "k_cache")  # the row's k rotated (fp32: to its rounding)
        np.testing.assert_array_equal(t["vc"].numpy(), vc_want)
    want = 2 * gv.acc_values_np(delta)
    got = gv.acc_values_np(acc.numpy())
    assert_close(got, want, dtype, "acc", scale=np.abs(want).max())


# ---- errors -----------------------------------------------------------------------------------
def _args(hq=4, hkv=2, hs=16, C=64, dtype="bf16", **change):
    c = case(hq, hkv, hs, 32, 5, dtype, C)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k) for k, v in c.items()}
    a = {
        "acc": ce.Tensor.from_numpy(np.zeros(gv.acc_shape(1, C), np.int64), "cpu", name="acc"),
        "att": ce.Tensor.empty(ce.dtype(dtype), (1, hq * hs), "cpu", name="att"),
        "qkv": t["qkv"],
        "k_cache": t["kc"],
        "v_cache": t["vc"],
        "lengths": t["lengths"],
        "n_q_heads": hq,
        "n_kv_heads": hkv,
        "scratch": ce.Tensor.from_numpy(nan_scratch(decode_attention_scratch_shape(1, hq, hs, 32), hs), "cpu"),
        "freqs": t["freqs"],
        "w_o": t["w_o"],
    }
    a.update(change)
    return a


def _t(shape, dtype="bf16", name="t"):
    return ce.Tensor.from_numpy(np.zeros(shape, ce.dtype(dtype).np), "cpu", name=name)


ERRORS = {
    "heads": (dict(n_q_heads=3), "n_q_heads = 3 must be a positive multiple of n_kv_heads = 2"),
    "two rows": (dict(qkv=_t((2, 128))), r"decode_attention_o qkv: expected shape \(1, 128\)"),
    "att shape": (dict(att=_t((1, 32))), r"decode_attention_o att: expected shape \(1, 64\)"),
    "lengths": (dict(lengths=_t((2,), "int32")), r"decode_attention_o lengths: expected shape \(1\)"),
    "freqs dtype": (dict(freqs=_t((32, 16), "fp32")), "decode_attention_o freqs: expected dtype fp16"),
    "w_o width": (dict(w_o=_t((64, 32))), r"decode_attention_o w_o: expected shape \(\*, 64\)"),
    "acc shape": (dict(acc=_t((1, 64), "int64")), r"decode_attention_o acc: expected shape \(1, 66\)"),
    "e4m3 without scale": (dict(w_o=_t((64, 64), "e4m3")), "o_scale: e4m3 weight 't' needs its"),
    "scale without e4m3": (dict(o_scale=_t((64,), "fp32")), "o_scale: only e4m3 weights take row scales"),
    "length past the cache": (dict(lengths=ce.Tensor.from_numpy(np.array([40], np.int32), "cpu")), "outside"),
    "att overlaps qkv": ("att=qkv", "tensor 'qkv' overlaps 'qkv'"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors(name):
    change, match = ERRORS[name]
    a = _args()
    if change == "att=qkv":
        a["att"] = ce.Tensor(ce.BF16, (1, 64), a["qkv"].device, a["qkv"].storage, a["qkv"].offset, "qkv")
    else:
        a.update(change)
    with pytest.raises(ValueError, match=match):
        dao.decode_attention_o(a.pop("acc"), a.pop("att"), a.pop("qkv"), a.pop("k_cache"), a.pop("v_cache"),
                               a.pop("lengths"), a.pop("n_q_heads"), a.pop("n_kv_heads"), a.pop("scratch"),
                               a.pop("freqs"), a.pop("w_o"), **a)  # fmt: skip


def test_unsupported_head_sizes_say_why():
    assert "head size 48 is not a power-of-two number" in dao.unsupported(48, ce.BF16, ce.BF16)
    assert "head size 8 is not a power-of-two number (at most 32) of 16-weight" in dao.unsupported(
        8, ce.BF16, ce.FP8_E4M3
    )
    assert "runs over model-dtype or e4m3 weights" in dao.unsupported(64, ce.BF16, ce.FP32)
    assert dao.unsupported(128, ce.BF16, ce.FP8_E4M3) is None
