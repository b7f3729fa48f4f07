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


# Awkward row counts every kernel family is tested at: 1, primes, around a block and a wave, 8k.
ROWS = (1, 37, 199, 760, 1128, 8192)


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


def assert_bitwise(actual, expected, what="result"):
    """The same bits (NaN payloads and signed zeros included), e.g. for determinism."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {a.dtype} {a.shape} != {e.dtype} {e.shape}"
    np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8), err_msg=what)


def finite_difference(f, x, h=1e-6) -> np.ndarray:
    """The central-difference gradient of the scalar f at x, in float64, one element at a time:
    the reference the hand-written backwards are checked against."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        grad[idx] = (f(xp) - f(xm)) / (2 * h)
    return grad


def to_device(arrays: dict, device, dtypes: dict | None = None) -> dict:
    """Tensors on `device` from a dict of NumPy arrays (converted to dtypes[name] if given)."""
    dtypes = dtypes or {}
    return {k: ce.Tensor.from_numpy(v, device, name=k, dtype=dtypes.get(k)) for k, v in arrays.items()}


def tensors(dev, **arrays) -> dict:
    """Tensors on `dev` named after their keywords, in the arrays' own dtypes."""
    return to_device(arrays, dev)


def garbage(t: ce.Tensor) -> ce.Tensor:
    """Fill `t` with 0xff bytes (NaN for floats, -1 for ints): stale contents a kernel must not read."""
    t.copy_from_numpy(np.full(t.nbytes, 0xFF, np.uint8).view(t.dtype.np).reshape(t.shape))
    return t


def tiny(preset="tiny", **changes) -> ce.TransformerConfig:
    """A preset's config with some fields changed (TransformerConfig.replace checks them)."""
    return ce.TransformerConfig.preset(preset).replace(**changes)


def run_cli(capsys, *argv):
    """`cuengine ARGV...` in this process: (exit code, stdout, stderr)."""
    from cuengine import cli

    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_llmc(path, tokens, magic=20240520, version=1, count=None, dtype="<u2"):
    """An llm.c .bin shard written byte by byte from its spec (256 int32 header: magic, version,
    token count; then the tokens), independent of cuengine.data.write_bin. Returns path."""
    header = np.zeros(256, "<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype).tobytes())
    return path


def check_op(op, inputs: dict, outputs: dict, dtypes: dict | None = None, compare=None, *, inplace=None,
             scratch=None, repeat=False, scale=None, **kwargs):  # fmt: skip
    """Run `op(**outputs, **inputs, **kwargs)` on cpu and cuda from the same inputs and compare.

    outputs: output name -> initial array (outputs that accumulate start from it).
    dtypes: name -> dtype the array is converted to on upload (default: its own).
    compare: output name -> the dtype whose tolerance applies (default: the output's own dtype).
    inplace: output name -> input name: that output is the input's tensor itself, so the op runs in
        place, and it is compared afterwards; it needs no entry in outputs.
    scratch: argument name -> (dtype, shape) of a work buffer the op may overwrite: passed, not
        compared, and filled with garbage() first, so a kernel that reads stale scratch shows.
    repeat: run the op on cuda once more, from fresh copies of everything, and require every output
        bitwise equal to the first run (determinism).
    scale: output name -> factor on its absolute tolerance (e.g. sqrt(N) for a sum over N rows).
    Returns the cpu and cuda results as dicts of NumPy arrays.
    """

    def run(name):
        d = ce.device(name)
        ins = to_device(inputs, d, dtypes)
        outs = to_device(outputs, d, dtypes)
        outs.update({o: ins[i] for o, i in (inplace or {}).items()})
        work = {k: garbage(ce.Tensor.empty(dt, shape, d, name=k)) for k, (dt, shape) in (scratch or {}).items()}
        op(**outs, **ins, **work, **kwargs)
        return {k: t.numpy() for k, t in outs.items()}

    cpu, cuda = run("cpu"), run("cuda")
    for k in cpu:
        dt = (compare or {}).get(k) or ce.dtype(cpu[k].dtype)
        what = k if k not in (inplace or {}) else f"{k} (in place)"
        assert_close(cuda[k].astype(np.float64), cpu[k].astype(np.float64), dt, what, (scale or {}).get(k, 1.0))
    if repeat:
        for k, v in run("cuda").items():
            assert_bitwise(v, cuda[k], f"{k}: a second cuda run")
    return cpu, cuda


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package): for testing a tool's functions."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        f"{name}_tool", Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
