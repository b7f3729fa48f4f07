"""conftest.check_op, the helper most GPU tests are written with, run on cpu with "cuda" played by cpu."""

import numpy as np
import pytest
from conftest import check_op

import cuengine as ce

X = np.arange(8, dtype=np.float32)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    cpu = ce.device("cpu")
    monkeypatch.setattr(ce, "device", lambda name="auto": cpu)


def test_compares_outputs_and_returns_both_runs(cpu_as_cuda):
    def double(out, x):
        out.array()[...] = 2 * x.array()

    cpu, cuda = check_op(double, {"x": X}, {"out": np.zeros(8, np.float32)})
    np.testing.assert_array_equal(cpu["out"], 2 * X)
    np.testing.assert_array_equal(cuda["out"], 2 * X)


def test_inplace_passes_the_input_tensor_as_the_output(cpu_as_cuda):
    seen = []

    def double_in_place(dx, x):
        seen.append(dx is x)
        dx.array()[...] *= 2

    cpu, _ = check_op(double_in_place, {"x": X}, {}, inplace={"dx": "x"})
    assert seen == [True, True]
    np.testing.assert_array_equal(cpu["dx"], 2 * X)


def test_scratch_is_garbage_and_not_compared(cpu_as_cuda):
    seen = []

    def with_scratch(out, x, work):
        seen.append(work.numpy().copy())
        work.array()[...] = np.random.default_rng().standard_normal(work.shape)  # differs per run
        out.array()[...] = x.array()

    cpu, _ = check_op(with_scratch, {"x": X}, {"out": np.zeros(8, np.float32)}, scratch={"work": ("int32", (3, 5))})
    assert "work" not in cpu and len(seen) == 2
    assert all(s.dtype == np.int32 and s.shape == (3, 5) and np.all(s == -1) for s in seen)


def test_repeat_catches_a_run_to_run_difference(cpu_as_cuda):
    calls = []

    def drifting(out, x):
        calls.append(1)
        out.array()[...] = x.array() + np.float32(1e-7) * len(calls)  # within tolerance, not bitwise

    check_op(drifting, {"x": X}, {"out": np.zeros(8, np.float32)})
    with pytest.raises(AssertionError, match="a second cuda run"):
        check_op(drifting, {"x": X}, {"out": np.zeros(8, np.float32)}, repeat=True)


def test_scale_widens_one_outputs_absolute_tolerance(cpu_as_cuda):
    calls = []

    def off_by_1e_4(out, x):
        calls.append(1)
        out.array()[...] = x.array() + np.float32(1e-4) * (len(calls) % 2)

    with pytest.raises(AssertionError):
        check_op(off_by_1e_4, {"x": X}, {"out": np.zeros(8, np.float32)})
    check_op(off_by_1e_4, {"x": X}, {"out": np.zeros(8, np.float32)}, scale={"out": 100.0})
