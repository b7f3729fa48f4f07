"""Shared test helpers: the device parametrisation, the tolerance table, and check_op.

A test that takes the `dev` fixture runs on "cpu" always and on "cuda" under the
`gpu` marker (skipped without a CUDA device). GPU tests compare the cuda result
against the cpu result (the NumPy twin) from the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuengine as ce

# One tolerance table per dtype: (rtol, atol) for comparing a device result with its twin.
# bf16 outputs may differ by one rounding step where the device accumulates in another order.
TOL = {
    "fp32": (1e-5, 1e-5),
    "fp16": (2e-3, 2e-3),
    "bf16": (1.6e-2, 1.6e-2),
    "e4m3": (1.25e-1, 1e-2),
    "e5m2": (2.5e-1, 1e-2),
    "int32": (0, 0),
    "byte": (0, 0),
}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    if ce.cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def dev(request):
    """Each device in turn: cpu, then cuda (gpu marker)."""
    return ce.device(request.param)


@pytest.fixture
def cuda():
    """The cuda device; only for tests that carry the gpu marker."""
    return ce.device("cuda")


def rng(seed=0):
    return np.random.default_rng(seed)


def assert_close(actual, expected, dtype, what="result", scale=1.0):
    """Compare two arrays with the tolerance of `dtype` (a DType or name); NaN never passes."""
    rtol, atol = TOL[ce.dtype(dtype).name]
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a) == np.isfinite(e)), f"{what}: non-finite values differ"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, err_msg=what)


def to_device(arrays: dict, device, dtypes: dict | None = None) -> dict:
    """Tensors on `device` from a dict of NumPy arrays (converted to dtypes[name] if given)."""
    dtypes = dtypes or {}
    return {k: ce.Tensor.from_numpy(v, device, name=k, dtype=dtypes.get(k)) for k, v in arrays.items()}


def check_op(op, inputs: dict, outputs: dict, dtypes: dict | None = None, compare=None, **kwargs):
    """Run `op(**outputs, **inputs, **kwargs)` on cpu and cuda from the same inputs and compare.

    `outputs` maps output names to initial arrays (outputs that accumulate start from them);
    `compare` maps output names to the dtype whose tolerance applies (default: its own dtype).
    Returns the cpu and cuda results as dicts of NumPy arrays.
    """
    results = {}
    for name in ("cpu", "cuda"):
        d = ce.device(name)
        ins = to_device(inputs, d, dtypes)
        outs = to_device(outputs, d, dtypes)
        op(**outs, **ins, **kwargs)
        results[name] = {k: t.numpy() for k, t in outs.items()}
    for k in outputs:
        dt = (compare or {}).get(k) or ce.dtype(results["cpu"][k].dtype)
        assert_close(results["cuda"][k].astype(np.float64), results["cpu"][k].astype(np.float64), dt, what=k)
    return results["cpu"], results["cuda"]
