"""Fused classifier: loss, LSE and in-place dlogits, against float64 and across devices."""

import numpy as np
import pytest
from conftest import assert_close, check_op, finite_difference, rng

import cuengine as ce
from cuengine.kernels.classifier import fused_classifier, fused_classifier_reference


def reference64(x, targets, d_loss, z_loss):
    """Independent float64 softmax cross-entropy with z-loss: (loss, lse, dlogits); ignored rows 0."""
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(x - lse[:, None])
    rows = np.arange(len(x))
    keep = targets >= 0
    loss = np.where(keep, lse - x[rows, np.maximum(targets, 0)] + z_loss * lse**2, 0.0)
    onehot = np.zeros_like(x)
    onehot[rows[keep], targets[keep]] = 1
    grad = d_loss * (p * (1 + 2 * z_loss * lse[:, None]) - onehot)
    grad[~keep] = 0
    return loss, lse, grad


def make_inputs(n, v, seed=0, ignore_every=5):
    r = rng(seed)
    logits = (r.standard_normal((n, v)) * 3).astype(np.float32)
    targets = r.integers(0, v, n).astype(np.int32)
    targets[::ignore_every] = -1
    losses = r.random(n).astype(np.float32)  # accumulation starts from non-zero losses
    return logits, targets, losses


def run(dev, logits, targets, losses, dtype, **kwargs):
    t = {
        "logits": ce.Tensor.from_numpy(logits, dev, name="logits", dtype=dtype),
        "losses": ce.Tensor.from_numpy(losses, dev, name="losses"),
        "lse": ce.Tensor.from_numpy(np.zeros(len(losses), np.float32), dev, name="lse"),
        "targets": ce.Tensor.from_numpy(targets, dev, name="targets"),
    }
    fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], **kwargs)
    return {k: t[k].numpy() for k in ("logits", "losses", "lse")}


# ---- cpu: the twin against float64 ------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,v", [(1, 256), (37, 1000), (16, 37), (5, 4099)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_twin_matches_float64(dtype, n, v, z_loss):
    logits, targets, losses0 = make_inputs(n, v)
    x_in = logits.astype(ce.dtype(dtype).np)  # the reference sees the stored (rounded) logits
    out = run(ce.device("cpu"), logits, targets, losses0, dtype, d_loss=0.5, z_loss=z_loss)
    loss, lse, grad = reference64(x_in, targets, 0.5, z_loss)
    np.testing.assert_allclose(out["lse"], lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["losses"], losses0 + loss, rtol=1e-5, atol=1e-5)
    assert_close(out["logits"], grad, dtype, "dlogits")


def test_dlogits_are_the_loss_gradient():
    """Central finite differences of the float64 loss match the twin's dlogits (z-loss included)."""
    logits, targets, losses0 = make_inputs(3, 11, seed=1, ignore_every=2)
    d_loss, z_loss = 0.25, 0.05
    out = run(ce.device("cpu"), logits, targets, losses0, "fp32", d_loss=d_loss, z_loss=z_loss)

    def total(x):
        return d_loss * reference64(x, targets, d_loss, z_loss)[0].sum()

    np.testing.assert_allclose(out["logits"], finite_difference(total, logits), rtol=1e-4, atol=1e-6)
    assert np.all(out["logits"][0] == 0)  # target -1: zero gradient row


def test_forward_only_leaves_logits():
    logits, targets, losses0 = make_inputs(7, 300)
    out = run(ce.device("cpu"), logits, targets, losses0, "fp32", d_loss=1.0, write_dlogits=False)
    np.testing.assert_array_equal(out["logits"], logits)
    loss, lse, _ = reference64(logits, targets, 1.0, 0.0)
    np.testing.assert_allclose(out["losses"], losses0 + loss, rtol=1e-5)


def test_ignored_and_bad_targets():
    logits, _, losses0 = make_inputs(4, 50)
    targets = np.array([-1, 3, 50, -7], np.int32)
    out = run(ce.device("cpu"), logits, targets, losses0, "fp32", d_loss=1.0)
    assert out["losses"][0] == losses0[0]  # ignored: nothing added
    assert np.all(out["logits"][0] == 0)
    assert np.isfinite(out["losses"][1])
    assert np.isnan(out["losses"][2]) and np.isnan(out["losses"][3])  # outside [-1, V): NaN, visible
    assert np.all(np.isfinite(out["lse"]))


def test_twin_is_a_plain_numpy_function():
    logits, targets, losses0 = make_inputs(6, 40)
    x = logits.copy()
    losses, lse = losses0.copy(), np.zeros(6, np.float32)
    fused_classifier_reference(x, losses, lse, targets, 1.0)
    _, ref_lse, ref_grad = reference64(logits, targets, 1.0, 0.0)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    np.testing.assert_allclose(x, ref_grad, rtol=1e-5, atol=1e-6)


# ---- cpu: error paths -------------------------------------------------------------------------
def _tensors(n=4, v=16, **override):
    cpu = ce.device("cpu")
    t = {
        "logits": ce.Tensor.empty(ce.FP32, (n, v), cpu, name="logits"),
        "losses": ce.Tensor.empty(ce.FP32, (n,), cpu, name="losses"),
        "lse": ce.Tensor.empty(ce.FP32, (n,), cpu, name="lse"),
        "targets": ce.Tensor.empty(ce.INT32, (n,), cpu, name="targets"),
    }
    for k, (dt, shape) in override.items():
        t[k] = ce.Tensor.empty(dt, shape, cpu, name=k)
    return t


@pytest.mark.parametrize(
    "override,match",
    [
        ({"logits": (ce.FP16, (4, 16))}, r"logits: expected dtype fp32/bf16.*fp16"),
        ({"logits": (ce.FP32, (64,))}, r"logits: expected shape \(\*, \*\)"),
        ({"losses": (ce.FP32, (5,))}, r"losses: expected shape \(4\)"),
        ({"losses": (ce.BF16, (4,))}, r"losses: expected dtype fp32"),
        ({"lse": (ce.FP32, (4, 1))}, r"lse: expected shape \(4\)"),
        ({"targets": (ce.FP32, (4,))}, r"targets: expected dtype int32"),
        ({"targets": (ce.INT32, (3,))}, r"targets: expected shape \(4\)"),
        ({"logits": (ce.FP32, (4, 0))}, r"empty vocabulary"),
    ],
)
def test_bad_arguments(override, match):
    t = _tensors(**override)
    with pytest.raises(ValueError, match=match):
        fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1.0)


@pytest.mark.parametrize(
    "abs_max,kwargs,match",
    [
        ((ce.FP32, (2,)), {}, r"abs_max: expected shape \(1\)"),
        ((ce.BF16, (1,)), {}, r"abs_max: expected dtype fp32"),
        ((ce.FP32, (1,)), {"write_dlogits": False}, r"abs_max records max\|dlogits\|, so it needs write_dlogits=True"),
    ],
)
def test_bad_abs_max(abs_max, kwargs, match):
    t = _tensors()
    t["logits"].array()[...] = 0
    t["targets"].array()[...] = 0
    slot = ce.Tensor.from_numpy(np.full(abs_max[1], 7, np.float32), ce.device("cpu"), name="amax", dtype=abs_max[0])
    before = {k: v.numpy().copy() for k, v in t.items()}
    with pytest.raises(ValueError, match=match):
        fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1.0, abs_max=slot, **kwargs)
    for k, v in t.items():  # nothing written
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
    assert np.all(slot.numpy().astype(np.float32) == 7)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("start", [0.0, 0.25, 1e6])
def test_twin_abs_max_is_the_max_of_the_stored_dlogits(dtype, start):
    """abs_max max-accumulates max|dlogits| as stored (rounded to the logits dtype): what fp8.abs_max
    over the written logits would give, so the FP8 LM head needs no second read of them."""
    from cuengine.kernels.fp8 import abs_max_reference

    logits, targets, losses0 = make_inputs(9, 300, seed=11)
    cpu = ce.device("cpu")
    slot = ce.Tensor.from_numpy(np.array([start], np.float32), cpu, name="amax")
    plain = run(cpu, logits, targets, losses0, dtype, d_loss=0.5)
    fused = run(cpu, logits, targets, losses0, dtype, d_loss=0.5, abs_max=slot)
    for k in plain:  # the other outputs do not change
        np.testing.assert_array_equal(fused[k], plain[k], err_msg=k)
    want = max(np.float32(start), abs_max_reference(plain["logits"]))
    assert slot.numpy()[0] == want and (start == 1e6 or 0 < want <= 0.5)


# ---- cuda against the twin ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,v", [(37, 256), (5, 4099), (37, 4104), (16, 151936)])
def test_cuda_abs_max_equals_abs_max_of_the_written_dlogits(dtype, n, v):
    """Every kernel variant (warp, block, scalar): the recorded max|dlogits| is bitwise fp8.abs_max over
    the dlogits the same launch wrote; a row of NaN logits makes it NaN, as abs_max reports NaN."""
    from cuengine.kernels.fp8 import abs_max

    dev = ce.device("cuda")
    logits, targets, losses0 = make_inputs(n, v, seed=n + v)
    for nan in (False, True):
        if nan:
            logits[1, 3] = np.nan
        t = {
            "logits": ce.Tensor.from_numpy(logits, dev, name="logits", dtype=dtype),
            "losses": ce.Tensor.from_numpy(losses0, dev, name="losses"),
            "lse": ce.Tensor.from_numpy(np.zeros(n, np.float32), dev, name="lse"),
            "targets": ce.Tensor.from_numpy(targets, dev, name="targets"),
        }
        fused, sep = (ce.Tensor.from_numpy(np.zeros(1, np.float32), dev, name=k) for k in ("fused", "sep"))
        fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1.0 / n, abs_max=fused)
        abs_max(sep, t["logits"])
        assert fused.numpy().view(np.uint32)[0] == sep.numpy().view(np.uint32)[0], (fused.numpy(), sep.numpy())
        assert np.isnan(fused.numpy()[0]) == nan


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "n,v",
    [
        (1, 256),
        (37, 256),
        (199, 1000),
        (37, 4096),  # the longest rows of the warp-per-row kernels
        (5, 4104),  # the shortest vectorised rows of the block-per-row kernel
        (760, 4099),
        (1128, 37),
        (8192, 256),
        (37, 151936),  # the shared-memory cache holds part of a row (fp32 and bf16)
        (3, 50257),  # ... a whole row
    ],
)
def test_cuda_matches_cpu(dtype, n, v):
    logits, targets, losses0 = make_inputs(n, v, seed=n + v)
    targets[1::7] = -1
    check_op(
        fused_classifier,
        inputs={"targets": targets},
        outputs={"logits": logits, "losses": losses0, "lse": np.zeros(n, np.float32)},
        dtypes={"logits": dtype},
        d_loss=1.0 / n,
        z_loss=1e-4,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_forward_only_and_bad_targets(dtype):
    logits, _, losses0 = make_inputs(64, 2048, seed=3)
    targets = rng(4).integers(0, 2048, 64).astype(np.int32)
    targets[:3] = [-1, 2048, -2]
    _, cuda = check_op(
        fused_classifier,
        inputs={"targets": targets},
        outputs={"logits": logits, "losses": losses0, "lse": np.zeros(64, np.float32)},
        dtypes={"logits": dtype},
        d_loss=1.0,
        write_dlogits=False,
    )
    np.testing.assert_array_equal(cuda["logits"], logits.astype(ce.dtype(dtype).np))
    assert cuda["losses"][0] == losses0[0] and np.isnan(cuda["losses"][1:3]).all()


@pytest.mark.gpu
def test_cuda_rows_of_a_larger_chunk(cuda):
    """A row slice (as the LM-head chunks use) writes only its rows."""
    logits, targets, losses0 = make_inputs(40, 512, seed=5)
    res = {}
    for name in ("cpu", "cuda"):
        d = ce.device(name)
        x = ce.Tensor.from_numpy(logits, d, name="logits", dtype="bf16")
        losses = ce.Tensor.from_numpy(losses0, d, name="losses")
        lse = ce.Tensor.from_numpy(np.zeros(40, np.float32), d, name="lse")
        tg = ce.Tensor.from_numpy(targets, d, name="targets")
        fused_classifier(x.rows(10, 30), losses.rows(10, 30), lse.rows(10, 30), tg.rows(10, 30), 0.1)
        res[name] = (x.numpy(), losses.numpy(), lse.numpy())
    for a, b, dt in zip(res["cuda"], res["cpu"], ("bf16", "fp32", "fp32")):
        assert_close(a, b, dt)
    np.testing.assert_array_equal(res["cuda"][0][:10], logits[:10].astype(ce.BF16.np))
    assert np.all(res["cuda"][2][30:] == 0)
