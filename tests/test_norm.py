"""Global gradient norm: float64 reference, clipping, non-finite norms, determinism, capture."""

import numpy as np
import pytest
from conftest import rng

import cuengine as ce
from cuengine.kernels.norm import global_norm_finish, global_norm_squared, norm_partials_shape

SIZES = [(1,), (37,), (199, 760), (1128, 37), (8192, 97), (3, 5, 7)]


def grads(seed=0):
    """Gradient-like arrays of awkward sizes and both dtypes."""
    r = rng(seed)
    out = []
    for i, shape in enumerate(SIZES):
        dt = ce.BF16 if i % 2 else ce.FP32
        out.append((r.standard_normal(shape) * 10.0 ** -(i % 3)).astype(dt.np))
    return out


def norm_of(dev, arrays, max_norm, views=False):
    """[norm, clip] and the partials after summing `arrays` on `dev`."""
    partials = ce.Tensor.empty(ce.FP32, norm_partials_shape(), dev, name="partials").fill_zero()
    result = ce.Tensor.empty(ce.FP32, (2,), dev, name="result")
    for a in arrays:
        if views:  # start 1 element past an aligned address: the unaligned kernels
            t = ce.Tensor.from_numpy(np.concatenate([np.zeros(1, a.dtype), a.reshape(-1)]), dev)[1:]
        else:
            t = ce.Tensor.from_numpy(a, dev)
        global_norm_squared(partials, t)
    global_norm_finish(result, partials, max_norm)
    return result.numpy(), partials.numpy()


def ref_norm(arrays):
    return np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays))


# ---- cpu --------------------------------------------------------------------------------------
def test_twin_matches_float64():
    arrays = grads()
    (norm, clip), _ = norm_of(ce.device("cpu"), arrays, 0.0)
    np.testing.assert_allclose(norm, ref_norm(arrays), rtol=1e-6)
    assert clip == 1.0


@pytest.mark.parametrize("factor,expect_clip", [(2.0, False), (0.5, True), (0.0, False), (-1.0, False)])
def test_clip_scale(factor, expect_clip):
    arrays = grads(1)
    ref = ref_norm(arrays)
    (norm, clip), _ = norm_of(ce.device("cpu"), arrays, factor * ref)
    np.testing.assert_allclose(norm, ref, rtol=1e-6)
    np.testing.assert_allclose(clip, factor * ref / norm if expect_clip else 1.0, rtol=1e-6)


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_norm_is_visible(dev, bad, max_norm):
    """The norm stays visible and the clip scale is NaN, which adamw_update reads as "skip"."""
    arrays = grads(2)
    arrays[2][5, 6] = bad
    (norm, clip), _ = norm_of(dev, arrays, max_norm)
    np.testing.assert_equal(norm, bad)
    assert np.isnan(clip)


def test_partials_shape():
    (slots,) = norm_partials_shape()
    assert slots >= 132  # at least one slot per H200 SM


def test_bad_arguments():
    cpu = ce.device("cpu")
    partials = ce.Tensor.empty(ce.FP32, norm_partials_shape(), cpu, name="p")
    result = ce.Tensor.empty(ce.FP32, (2,), cpu, name="r")
    x = ce.Tensor.empty(ce.FP32, (8,), cpu, name="x")
    with pytest.raises(ValueError, match=r"global_norm_squared: partials: expected shape"):
        global_norm_squared(ce.Tensor.empty(ce.FP32, (7,), cpu), x)
    with pytest.raises(ValueError, match=r"global_norm_squared: partials: expected dtype fp32"):
        global_norm_squared(ce.Tensor.empty(ce.BF16, norm_partials_shape(), cpu), x)
    with pytest.raises(ValueError, match=r"global_norm_squared: tensor: expected dtype fp32/bf16"):
        global_norm_squared(partials, ce.Tensor.empty(ce.INT32, (8,), cpu))
    with pytest.raises(ValueError, match=r"global_norm_finish: result: expected shape \(2\)"):
        global_norm_finish(ce.Tensor.empty(ce.FP32, (3,), cpu), partials, 1.0)
    with pytest.raises(ValueError, match=r"global_norm_finish: partials: expected shape"):
        global_norm_finish(result, ce.Tensor.empty(ce.FP32, (2,), cpu), 1.0)


def test_captured_graph_replays(dev):
    """No host sync inside: the whole norm captures into a graph and replays the same value."""
    arrays = grads(3)
    tensors = [ce.Tensor.from_numpy(a, dev) for a in arrays]
    partials = ce.Tensor.empty(ce.FP32, norm_partials_shape(), dev)
    result = ce.Tensor.empty(ce.FP32, (2,), dev)

    def step():
        partials.fill_zero()
        for t in tensors:
            global_norm_squared(partials, t)
        global_norm_finish(result, partials, 1.0)

    step()  # compile and load the kernels outside the capture
    graph = dev.capture(step)
    result.copy_from_numpy(np.zeros(2, np.float32))
    graph.launch()
    first = result.numpy()
    np.testing.assert_allclose(first[0], ref_norm(arrays), rtol=1e-5)
    tensors[0].copy_from_numpy(arrays[0] * 2)  # the graph reads the buffers as they are at launch
    graph.launch()
    assert result.numpy()[0] > first[0]


# ---- cuda ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("views", [False, True])
def test_cuda_matches_cpu_and_float64(views):
    arrays = grads(4)
    ref = ref_norm(arrays)
    (cpu_norm, cpu_clip), _ = norm_of(ce.device("cpu"), arrays, 0.5 * ref, views)
    (gpu_norm, gpu_clip), _ = norm_of(ce.device("cuda"), arrays, 0.5 * ref, views)
    np.testing.assert_allclose(gpu_norm, cpu_norm, rtol=1e-5)
    np.testing.assert_allclose(gpu_norm, ref, rtol=1e-5)
    np.testing.assert_allclose(gpu_clip, cpu_clip, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_bitwise_reproducible():
    arrays = grads(5) + [rng(6).standard_normal(151936 * 64).astype(ce.BF16.np)]
    runs = [norm_of(ce.device("cuda"), arrays, 1.0) for _ in range(3)]
    for result, partials in runs[1:]:
        np.testing.assert_array_equal(result, runs[0][0])
        np.testing.assert_array_equal(partials, runs[0][1])
