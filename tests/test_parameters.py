"""model.parameters() and parameters_changed(): a user-written update through writable views.

A script writes plain SGD through the views with NumPy on the cpu device; the weights and the next
loss match a NumPy computation over the float64 reference's gradients. A weight changed through a
view reaches the FP8 copy only after parameters_changed().
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_model as ref
from conftest import TOL
from test_model import batch, make, randomize, tiny, valid

from cuengine.model.weights import hf_shapes


def test_parameters_are_zero_copy_views_by_hf_name():
    cfg = tiny("tiny")
    m = make(cfg)
    params = m.parameters()
    assert {k: tuple(v.shape) for k, v in params.items()} == hf_shapes(cfg)
    q = params["model.layers.0.self_attn.q_proj.weight"]
    k = params["model.layers.0.self_attn.k_proj.weight"]
    packed = m.weights["layers.0.qkv_w"]
    assert q.storage is packed.storage and k.storage is packed.storage
    assert k.offset == packed.offset + q.nbytes  # k's rows start where q's end


def test_user_written_sgd_matches_numpy():
    """w -= lr * g through the views (NumPy on the cpu device), then parameters_changed(): the
    weights are NumPy's, and the next loss is the reference's at those weights."""
    cfg = tiny("tiny-llama", dtype="fp32")
    m = randomize(make(cfg))
    x, y = batch(cfg)
    p0 = m.weights.host_arrays()
    _, G, _ = ref.loss_and_grads(cfg, p0, x, y)
    lr = np.float32(0.5)
    m.forward(x)
    m.backward(x, y)
    grads, params = m.gradients(), m.parameters()
    for name, w in params.items():
        w.array()[...] -= lr * grads[name].array()
    m.parameters_changed()
    p1 = m.weights.host_arrays()
    rtol, atol = TOL["fp32"]
    for name, g in G.items():
        want = p0[name] - np.float64(lr) * g
        np.testing.assert_allclose(p1[name], want, rtol=rtol, atol=atol * float(lr) * np.sqrt(np.mean(g * g)),
                                   err_msg=name)  # fmt: skip
        assert not np.array_equal(p1[name], p0[name]), name
    want_loss, _, _ = ref.loss_and_grads(cfg, p1, x, y, with_grads=False)
    before, _, _ = ref.loss_and_grads(cfg, p0, x, y, with_grads=False)
    assert abs(m.validate(x, y) - want_loss) <= TOL["fp32"][0] * want_loss
    assert want_loss < before  # the step went downhill: the views really are the weights
    assert valid(y) > 0


@pytest.mark.parametrize("hf_name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_fp8_copy_follows_after_parameters_changed(hf_name):
    cfg = tiny("tiny")
    m = make(cfg, matmul_dtype="e4m3")
    w = m.parameters()[hf_name]
    ename = {"k_proj": "layers.1.qkv_w", "up_proj": "layers.0.up_w"}[hf_name.split(".")[-2]]
    q = m.weights.fp8[ename]
    row0 = w.offset // (w.shape[1] * w.dtype.itemsize) - m.weights[ename].offset // (w.shape[1] * w.dtype.itemsize)
    before = q.numpy().copy(), q.fp8_stats().copy()
    big = np.float32(4 * before[1][0])  # 4x the abs-max: the new abs-max, so the scale changes too
    w.array()[2, 3] = big
    assert np.array_equal(q.numpy().view(np.uint8), before[0].view(np.uint8))  # not before the call
    assert np.array_equal(q.fp8_stats(), before[1])
    m.parameters_changed()
    stats = q.fp8_stats()
    assert stats[0] == big
    deq = q.numpy().astype(np.float32) * stats[2]
    assert abs(deq[row0 + 2, 3] - big) <= 0.07 * big  # e4m3's 3-bit mantissa
    assert np.array_equal(m.weights.fp8_tp[ename].numpy().T.view(np.uint8), q.numpy().view(np.uint8))
