"""cuengine.blas.matmul: the NumPy twin against float64, every error path, cuda against the twin,
CUDA graph capture and the plan cache."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
from conftest import TOL, assert_close, load_tool, rng

import cuengine as ce
from cuengine import blas
from cuengine.blas import matmul, matmul_numpy
from cuengine.tensor import stats_values

# mode -> (trans_a, trans_b); a linear layer x (rows, cin) -> y (rows, cout) with w (cout, cin)
MODES = {"fwd": (False, True), "dx": (False, False), "dw": (True, False)}

# (a, b, out) dtypes
FLOAT_COMBOS = [
    ("fp32", "fp32", "fp32"),
    ("fp16", "fp16", "fp16"),
    ("fp16", "fp16", "fp32"),
    ("bf16", "bf16", "bf16"),
    ("bf16", "bf16", "fp32"),
]
FP8_COMBOS = [
    ("e4m3", "e4m3", "bf16"),
    ("e4m3", "e4m3", "fp32"),
    ("e5m2", "e4m3", "bf16"),  # the backward GEMMs: the e5m2 gradient (or its transposed copy) is a
    ("e4m3", "e5m2", "fp32"),
    ("e4m3", "e4m3", "e4m3"),
]


def dims(mode, rows, cin, cout):
    """(M, N, K) of the product for a linear layer with `rows` tokens."""
    return {"fwd": (rows, cout, cin), "dx": (rows, cin, cout), "dw": (cout, cin, rows)}[mode]


def quantize(x, dt):
    """x (float64) in dtype dt; FP8 values get per-tensor scaling and their stats [amax, scale, scale_inv]."""
    dt = ce.dtype(dt)
    if not dt.is_fp8:
        return x.astype(dt.np), None
    stats = np.array(stats_values(float(np.max(np.abs(x))), dt), np.float32)
    return np.clip(x * stats[1], -dt.fp8_max, dt.fp8_max).astype(dt.np), stats


def make_case(combo, mode, rows, cin, cout, with_bias, accumulate, seed=0):
    """Inputs for one matmul, as NumPy arrays: outputs of O(1) whatever K is."""
    a_dt, b_dt, out_dt = (ce.dtype(d) for d in combo)
    trans_a, trans_b = MODES[mode]
    M, N, K = dims(mode, rows, cin, cout)
    g = rng(seed)
    a = g.standard_normal((K, M) if trans_a else (M, K))
    b = g.standard_normal((N, K) if trans_b else (K, N)) / math.sqrt(K)
    case = {"combo": (a_dt, b_dt, out_dt), "trans_a": trans_a, "trans_b": trans_b, "accumulate": accumulate}
    case["a"], case["a_stats"] = quantize(a, a_dt)
    case["b"], case["b_stats"] = quantize(b, b_dt)
    bias_dt = ce.BF16 if a_dt.is_fp8 else out_dt
    case["bias"] = (0.5 * g.standard_normal(N)).astype(bias_dt.np) if with_bias else None
    case["c"] = g.standard_normal((M, N)).astype(out_dt.np) if accumulate else np.zeros((M, N), out_dt.np)
    case["out_stats"] = None
    if out_dt.is_fp8:  # the output scale leaves 20% headroom over the true abs-max
        amax = float(np.max(np.abs(reference(case))))
        case["out_stats"] = np.array([0.0, 0.8 * out_dt.fp8_max / amax, amax / (0.8 * out_dt.fp8_max)], np.float32)
    return case


def reference(case):
    """The float64 formula, independent of the twin: (op(a)·sa) @ (op(b)·sb) + c + bias."""
    a = case["a"].astype(np.float64) * (1.0 if case["a_stats"] is None else float(case["a_stats"][2]))
    b = case["b"].astype(np.float64) * (1.0 if case["b_stats"] is None else float(case["b_stats"][2]))
    y = (a.T if case["trans_a"] else a) @ (b.T if case["trans_b"] else b)
    if case["accumulate"]:
        y = y + case["c"].astype(np.float64)
    if case["bias"] is not None:
        y = y + case["bias"].astype(np.float64)
    return y


def tensor(dev, name, array, dt, stats=None):
    t = ce.Tensor.from_numpy(array, dev, name=name, dtype=dt)
    if stats is not None:
        t.set_fp8_stats(*stats)
    return t


def run(dev, case, fast_accum=False):
    """matmul on `dev`; returns (out as NumPy, out abs_max or None)."""
    a_dt, b_dt, out_dt = case["combo"]
    a = tensor(dev, "a", case["a"], a_dt, case["a_stats"])
    b = tensor(dev, "b", case["b"], b_dt, case["b_stats"])
    bias = None if case["bias"] is None else tensor(dev, "bias", case["bias"], case["bias"].dtype)
    out = tensor(dev, "out", case["c"], out_dt, case["out_stats"])
    matmul(out, a, b, bias, trans_a=case["trans_a"], trans_b=case["trans_b"], accumulate=case["accumulate"],
           fast_accum=fast_accum)  # fmt: skip
    return out.numpy(), (out.abs_max.numpy()[0] if out_dt.is_fp8 else None)


def cases(combos, modes):
    return [
        pytest.param(c, m, id=f"{'x'.join(c[:2])}-{c[2]}-{m}")
        for c in combos
        for m in modes
        if not (ce.dtype(c[0]).is_fp8 and m != "fwd")
    ]


def combo_ids(combos):
    return [f"{'x'.join(c[:2])}-{c[2]}" for c in combos]


# ---- the twin against float64 (cpu) -------------------------------------------------------------
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("combo,mode", cases(FLOAT_COMBOS + FP8_COMBOS, MODES))
def test_twin_matches_float64(combo, mode, rows, with_bias, accumulate):
    if accumulate and combo[2] == "e4m3":
        pytest.skip("FP8 out cannot accumulate (its own error test)")
    case = make_case(combo, mode, rows, 48, 80, with_bias, accumulate)
    out, amax = run(ce.device("cpu"), case)
    want = reference(case)
    if case["out_stats"] is not None:
        np.testing.assert_allclose(amax, np.max(np.abs(want)), rtol=1e-5)
        want = np.clip(want * case["out_stats"][1], -448, 448)
    assert_close(out, want, combo[2], what=f"{combo} {mode}")


def test_twin_on_any_rank_operands():
    """(B, T, C) activations flatten to rows, for the forward and the weight gradient."""
    g = rng(1)
    cpu = ce.device("cpu")
    x = g.standard_normal((2, 3, 48)).astype(ml_dtypes.bfloat16)
    w = (g.standard_normal((80, 48)) / 7).astype(ml_dtypes.bfloat16)
    bias = g.standard_normal(80).astype(ml_dtypes.bfloat16)
    y = ce.Tensor.empty(ce.BF16, (2, 3, 80), cpu, name="y")
    matmul(y, tensor(cpu, "x", x, ce.BF16), tensor(cpu, "w", w, ce.BF16), tensor(cpu, "bias", bias, ce.BF16))
    want = x.astype(np.float64).reshape(6, 48) @ w.astype(np.float64).T + bias.astype(np.float64)
    assert_close(y.numpy().reshape(6, 80), want, "bf16")

    dw = ce.Tensor.empty(ce.FP32, (80, 48), cpu, name="dw").fill_zero()
    matmul(dw, y, tensor(cpu, "x", x, ce.BF16), trans_a=True, trans_b=False, accumulate=True)
    want = y.numpy().astype(np.float64).reshape(6, 80).T @ x.astype(np.float64).reshape(6, 48)
    assert_close(dw.numpy(), want, "fp32")


def test_empty_rows_is_a_no_op(dev):
    x = ce.Tensor.empty(ce.BF16, (0, 48), dev, name="x")
    w = ce.Tensor.from_numpy(np.ones((80, 48)), dev, name="w", dtype=ce.BF16)
    y = ce.Tensor.empty(ce.BF16, (0, 80), dev, name="y")
    matmul(y, x, w)


@pytest.mark.parametrize("dt,big", [("bf16", 256.0), ("fp16", 2048.0)])
def test_bias_and_accumulate_round_once(dev, dt, big):
    """op(a)@op(b) = big + 1 lies halfway between two representable values: rounding it first and
    then adding 0.5 gives `big`, rounding once after the addition gives `big + 2`.

    The twin rounds once. cuBLASLt on the H200 was seen to give `big` (it rounds the product before
    its bias/beta epilogue), so on cuda the result may be either neighbour, never anything else."""
    a = np.zeros((1, 8))
    a[0, :2] = [big, 1.0]
    b = np.zeros((16, 8))
    b[:, :2] = 1.0
    half = np.full(16, 0.5)
    np_dt = ce.dtype(dt).np
    assert matmul_numpy(a.astype(np_dt), b.astype(np_dt), half, out_dtype=np_dt)[0, 0] == big + 2
    y = ce.Tensor.empty(dt, (1, 16), dev, name="y")
    at, bt = tensor(dev, "a", a, dt), tensor(dev, "b", b, dt)
    allowed = {big + 2} if dev.is_cpu else {big, big + 2}
    matmul(y, at, bt, tensor(dev, "bias", half, dt))
    assert set(y.numpy().astype(np.float64).ravel()) <= allowed
    y.copy_from_numpy(half.reshape(1, 16))
    matmul(y, at, bt, accumulate=True)
    assert set(y.numpy().astype(np.float64).ravel()) <= allowed


def test_fp8_out_saturates_and_reports_amax(dev):
    """An e4m3 out is clipped to ±448 (SATFINITE), and abs_max is max|y| before scaling."""
    a = np.full((2, 16), 16.0, ce.FP8_E4M3.np)  # stored FP8 values: from_numpy keeps them as they are
    a[1] = -16.0
    b = np.full((32, 16), 16.0, ce.FP8_E4M3.np)
    b[1] = 0.25
    ones = np.array([0.0, 1.0, 1.0], np.float32)
    at, bt = tensor(dev, "a", a, "e4m3", ones), tensor(dev, "b", b, "e4m3", ones)
    y = tensor(dev, "y", np.zeros((2, 32)), "e4m3", np.array([0.0, 0.5, 2.0], np.float32))
    matmul(y, at, bt)
    got = y.numpy().astype(np.float64)
    assert got[0, 0] == 448 and got[1, 0] == -448 and got[0, 1] == 32 and got[1, 1] == -32
    assert y.abs_max.numpy()[0] == 4096


# ---- errors ---------------------------------------------------------------------------------------
def _t(dt, shape, name="t", stats=True, offset=0):
    """A cpu tensor filled with a pattern; fp8 without `stats` has no stats slot."""
    cpu = ce.device("cpu")
    dt = ce.dtype(dt)
    storage = np.zeros(math.prod(shape) * dt.itemsize + 32, np.uint8)
    t = ce.Tensor(dt, shape, cpu, storage, offset, name)
    t.array()[...] = np.arange(math.prod(shape)).reshape(shape) % 7
    if dt.is_fp8 and stats:
        t.stats = tensor(cpu, f"{name}.stats", np.array([1.0, 1.0, 1.0]), ce.FP32)
    return t


def _overlapping():
    buf = _t("bf16", (64, 48), "buf")
    return {"out": buf.rows(16, 48), "a": buf.rows(0, 32), "b": _t("bf16", (48, 48), "w")}


ERRORS = {
    "fp8 trans_b=False": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e4m3", (32, 48)),
                                   "b": _t("e4m3", (48, 80)), "trans_b": False}, "TN only"),
    "fp8 trans_a": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e4m3", (48, 32)),
                             "b": _t("e4m3", (80, 48)), "trans_a": True}, "TN only"),
    "fp8 K not a multiple of 16": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e4m3", (32, 24)),
                                            "b": _t("e4m3", (80, 24))}, "rows of 24 bytes"),
    "bf16 K not a multiple of 8": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 12)),
                                            "b": _t("bf16", (80, 12))}, "rows of 24 bytes"),
    "out rows misaligned": (lambda: {"out": _t("bf16", (32, 36)), "a": _t("bf16", (32, 48)),
                                     "b": _t("bf16", (36, 48))}, "out is .* rows of 72 bytes"),
    "inner dimensions": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 48)),
                                  "b": _t("bf16", (80, 64))}, "inner dimensions differ"),
    "out shape": (lambda: {"out": _t("bf16", (32, 72)), "a": _t("bf16", (32, 48)),
                           "b": _t("bf16", (80, 48))}, r"out must be \(M, N\) = \(32, 80\)"),
    "bias dtype": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 48)), "b": _t("bf16", (80, 48)),
                            "bias": _t("fp32", (80,))}, "bias.*expected dtype bf16, got .* fp32"),
    "fp8 bias must be bf16": (lambda: {"out": _t("fp32", (32, 80)), "a": _t("e4m3", (32, 48)),
                                       "b": _t("e4m3", (80, 48)), "bias": _t("fp32", (80,))}, "expected dtype bf16"),
    "bias shape": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 48)), "b": _t("bf16", (80, 48)),
                            "bias": _t("bf16", (72,))}, r"expected shape \(80\)"),
    "fp8 a without stats": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e4m3", (32, 48), stats=False),
                                     "b": _t("e4m3", (80, 48))}, "operand a .* without FP8 stats"),
    "e5m2 x e5m2": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e5m2", (32, 48)),
                             "b": _t("e5m2", (80, 48))}, "e5m2 × e5m2"),
    "fp8 x bf16": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("e4m3", (32, 48)),
                            "b": _t("bf16", (80, 48))}, "cannot be mixed"),
    "bf16 x fp32": (lambda: {"out": _t("fp32", (32, 80)), "a": _t("bf16", (32, 48)),
                             "b": _t("fp32", (80, 48))}, "must share one of"),
    "int32 operands": (lambda: {"out": _t("int32", (32, 80)), "a": _t("int32", (32, 48)),
                                "b": _t("int32", (80, 48))}, "must share one of"),
    "fp16 out for bf16": (lambda: {"out": _t("fp16", (32, 80)), "a": _t("bf16", (32, 48)),
                                   "b": _t("bf16", (80, 48))}, "out must be bf16/fp32"),
    "fp8 out for bf16": (lambda: {"out": _t("e4m3", (32, 80)), "a": _t("bf16", (32, 48)),
                                  "b": _t("bf16", (80, 48))}, "out must be bf16/fp32"),
    "fp8 out accumulate": (lambda: {"out": _t("e4m3", (32, 80)), "a": _t("e4m3", (32, 48)),
                                    "b": _t("e4m3", (80, 48)), "accumulate": True}, "cannot add into the FP8 out"),
    "fp8 out without stats": (lambda: {"out": _t("e4m3", (32, 80), stats=False), "a": _t("e4m3", (32, 48)),
                                       "b": _t("e4m3", (80, 48))}, "FP8 out .* has no FP8 stats"),
    "fast_accum on bf16": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 48)),
                                    "b": _t("bf16", (80, 48)), "fast_accum": True}, "fast_accum applies to FP8"),
    "out overlaps a": (_overlapping, "overlaps a"),
    "misaligned pointer": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (32, 48), offset=2),
                                    "b": _t("bf16", (80, 48))}, "a is .* not 16-byte aligned"),
    "K = 0": (lambda: {"out": _t("bf16", (32, 80)), "a": _t("bf16", (0, 32)), "b": _t("bf16", (0, 80)),
                       "trans_a": True, "trans_b": False}, "K = 0"),
    "not a tensor": (lambda: {"out": _t("bf16", (32, 80)), "a": np.zeros((32, 48)), "b": _t("bf16", (80, 48))},
                     "expected a cuengine Tensor"),
    "0-d operand": (lambda: {"out": _t("bf16", (1, 80)), "a": _t("bf16", ()), "b": _t("bf16", (80, 48))},
                    "0-d tensor"),
}  # fmt: skip


@pytest.mark.parametrize("name", ERRORS)
def test_errors_are_clear_and_change_nothing(name):
    build, message = ERRORS[name]
    args = build()
    before = args["out"].numpy().copy()
    with pytest.raises(ValueError, match=message):
        matmul(**args)
    np.testing.assert_array_equal(args["out"].numpy().view(np.uint8), before.view(np.uint8))


def test_init_puts_the_workspace_in_the_report(dev):
    """On cuda the workspace shows in the report; the cpu twin needs none, so there it is absent."""
    alloc = ce.TensorAllocator(dev)
    want = [1 << 20, 1] if dev.is_cuda else None
    blas.init(alloc, workspace_bytes=1 << 20)
    assert alloc.report().by_context.get("cuBLASLt") == want
    blas.init(alloc, workspace_bytes=1 << 20)  # idempotent
    assert alloc.report().by_context.get("cuBLASLt") == want
    case = make_case(("bf16", "bf16", "bf16"), "fwd", 37, 48, 80, True, False)
    out, _ = run(dev, case)
    assert_close(out, reference(case), "bf16")
    blas.init(ce.TensorAllocator(dev))  # back to a full-size workspace for the other tests


# ---- CUDA graphs (cpu: the graph re-runs the function) -------------------------------------------
@pytest.mark.parametrize("combo", [("bf16", "bf16", "bf16"), ("e4m3", "e4m3", "bf16")], ids=["bf16", "e4m3"])
def test_graph_replay_equals_eager(dev, combo):
    """Capture, change the inputs and the FP8 scales, replay: the graph reads the new values."""
    blas.init(ce.TensorAllocator(dev))  # the workspace exists before the capture
    first = make_case(combo, "fwd", 199, 96, 112, True, False, seed=2)
    second = make_case(combo, "fwd", 199, 96, 112, True, False, seed=3)
    a_dt, b_dt, out_dt = first["combo"]
    a = tensor(dev, "a", first["a"], a_dt, first["a_stats"])
    b = tensor(dev, "b", first["b"], b_dt, first["b_stats"])
    bias = tensor(dev, "bias", first["bias"], first["bias"].dtype)
    y = ce.Tensor.empty(out_dt, (199, 112), dev, name="y")
    acc = ce.Tensor.empty(ce.FP32, (199, 112), dev, name="acc").fill_zero()

    def step():
        matmul(y, a, b, bias)
        matmul(acc, a, b, accumulate=True)

    graph = dev.capture(step)
    for case in (first, second):
        a.copy_from_numpy(case["a"])
        b.copy_from_numpy(case["b"])
        if case["a_stats"] is not None:
            a.set_fp8_stats(*case["a_stats"])
            b.set_fp8_stats(*case["b_stats"])
        bias.copy_from_numpy(case["bias"])
        graph.launch()
        eager_y, _ = run(dev, case)
        np.testing.assert_array_equal(y.numpy().view(np.uint16), eager_y.view(np.uint16))
    graph.launch()  # acc now holds first + 2 × second, each rounded in fp32
    want = np.zeros((199, 112), np.float32)
    for case in (first, second, second):
        want = run(dev, {**case, "combo": (a_dt, b_dt, ce.FP32), "bias": None, "accumulate": True, "c": want})[0]
    np.testing.assert_array_equal(acc.numpy(), want)


# ---- cuda against the twin ----------------------------------------------------------------------
def _gpu_tol(combo, fast_accum):
    a_dt, _, out_dt = combo
    if out_dt != "fp32" or a_dt == "fp32":
        return TOL[out_dt]
    if ce.dtype(a_dt).is_fp8:  # Hopper FP8 tensor cores accumulate with ~14 significant bits
        return (5e-3, 5e-3) if fast_accum else (1e-3, 1e-3)
    return (1e-4, 1e-4)  # 16-bit operands: exact products, accumulation order differs


def _compare(case, fast_accum=False):
    (want, want_amax), (got, got_amax) = (run(ce.device(d), case, fast_accum) for d in ("cpu", "cuda"))
    rtol, atol = _gpu_tol(tuple(d.name for d in case["combo"]), fast_accum)
    if case["combo"][0].is_fp8:
        # FP8 tensor cores accumulate with ~14 significant bits: the error scales with the largest
        # partial sums, so small outputs carry an absolute error relative to max|out|.
        atol *= max(1.0, float(np.max(np.abs(want.astype(np.float64)))))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    if want_amax is not None:
        np.testing.assert_allclose(got_amax, want_amax, rtol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 199, 760])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("combo", FLOAT_COMBOS, ids=combo_ids(FLOAT_COMBOS))
def test_cuda_matches_twin(combo, mode, with_bias, accumulate, rows):
    _compare(make_case(combo, mode, rows, 120, 56, with_bias, accumulate, seed=rows))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 199, 760])
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("combo", FP8_COMBOS, ids=combo_ids(FP8_COMBOS))
def test_cuda_matches_twin_fp8(combo, with_bias, accumulate, fast_accum, rows):
    if accumulate and combo[2] == "e4m3":
        pytest.skip("FP8 out cannot accumulate")
    _compare(make_case(combo, "fwd", rows, 208, 112, with_bias, accumulate, seed=rows), fast_accum)


@pytest.mark.gpu
def test_any_rank_and_row_views_on_cuda():
    """(B, T, C) operands and row slices that are 16- but not 256-byte aligned (own plan)."""
    g = rng(4)
    x = g.standard_normal((3, 5, 64))
    w = g.standard_normal((24, 64)) / 8
    for name in ("cpu", "cuda"):
        d = ce.device(name)
        xt, wt = tensor(d, "x", x, ce.BF16), tensor(d, "w", w, ce.BF16)
        y = ce.Tensor.empty(ce.BF16, (3, 5, 24), d, name="y")
        matmul(y, xt, wt)
        tail = ce.Tensor.empty(ce.BF16, (14, 24), d, name="tail")
        matmul(tail, xt.reshape(15, 64).rows(1, 15), wt)  # a starts 128 bytes in
        if name == "cpu":
            want_y, want_tail = y.numpy(), tail.numpy()
    assert_close(y.numpy(), want_y, "bf16")
    assert_close(tail.numpy(), want_tail, "bf16")


@pytest.mark.gpu
def test_plans_are_cached(cuda):
    def tensors(rows):
        g = rng(rows)
        x = tensor(cuda, "x", g.standard_normal((rows, 96)), ce.BF16)
        w = tensor(cuda, "w", g.standard_normal((40, 96)), ce.BF16)
        return ce.Tensor.empty(ce.BF16, (rows, 40), cuda, name="y"), x, w

    y, x, w = tensors(333)
    matmul(y, x, w)
    n = blas.num_plans(cuda)
    matmul(y, x, w)
    matmul(*tensors(333))  # other buffers, same shapes and alignment
    assert blas.num_plans(cuda) == n
    matmul(*tensors(334))
    assert blas.num_plans(cuda) == n + 1


@pytest.mark.gpu
def test_first_call_inside_a_capture(cuda):
    """A shape seen for the first time inside a capture plans on the host and replays correctly."""
    blas.init(ce.TensorAllocator(cuda))
    case = make_case(("bf16", "bf16", "bf16"), "dx", 51, 136, 88, False, False, seed=5)
    a = tensor(cuda, "a", case["a"], ce.BF16)
    b = tensor(cuda, "b", case["b"], ce.BF16)
    y = ce.Tensor.empty(ce.BF16, case["c"].shape, cuda, name="y")
    graph = cuda.capture(lambda: matmul(y, a, b, trans_b=False))
    graph.launch()
    assert_close(y.numpy(), run(ce.device("cpu"), case)[0], "bf16")


# ---- the tuning table (blas.tuning_entries, use_tuned_algorithms; tools/tune_gemm.py) -------------
CONFIG = dict.fromkeys(blas.ALGO_CONFIG, 0) | {"ID": 66, "TILE_ID": 18}
KEY = ("bf16", "bf16", "bf16", None, False, True, 8192, 1152, 896, False, False, 256, 256, 256, 0)


def write_table(path, gpu="NVIDIA H200", version=130400, entries=None):
    entries = {blas.key_text(KEY): CONFIG} if entries is None else entries
    path.write_text(json.dumps({"tables": [{"gpu": gpu, "cublaslt": version, "entries": entries}]}))
    return path


def test_key_text_spells_every_field():
    assert blas.key_text(KEY) == "bf16,bf16,bf16,-,0,1,8192,1152,896,0,0,256,256,256,0"


def test_tuning_entries_by_gpu_and_version(tmp_path):
    path = write_table(tmp_path / "t.json")
    assert blas.tuning_entries(path, "NVIDIA H200", 130400) == {blas.key_text(KEY): CONFIG}
    assert blas.tuning_entries(path, "NVIDIA H100 80GB HBM3", 130400) == {}  # another GPU
    assert blas.tuning_entries(path, "NVIDIA H200", 130401) == {}  # another cuBLASLt
    assert blas.tuning_entries(tmp_path / "none.json", "NVIDIA H200", 130400) == {}


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        json.dumps({"tables": [{"gpu": "NVIDIA H200", "entries": {}}]}),  # no version
        json.dumps({"tables": [{"gpu": "NVIDIA H200", "cublaslt": 130400, "entries": {"k": {"ID": 1}}}]}),
        json.dumps({"tables": [{"gpu": "NVIDIA H200", "cublaslt": 130400, "entries": {"k": CONFIG | {"ID": 1.5}}}]}),
    ],
    ids=["json", "version", "fields", "float"],
)
def test_malformed_tuning_table_is_named(tmp_path, bad):
    path = tmp_path / "bad.json"
    path.write_text(bad)
    with pytest.raises(ValueError, match="bad.json"):
        blas.tuning_entries(path, "NVIDIA H200", 130400)


def test_use_tuned_algorithms_refuses_a_missing_table(tmp_path):
    with pytest.raises(ValueError, match="no tuning table at"):
        blas.use_tuned_algorithms(True, path=tmp_path / "none.json")
    assert blas._TUNING["path"] == blas.TUNING_PATH  # nothing changed


def test_shipped_tuning_table_is_well_formed():
    """Every table in cuengine/gemm_tuning.json parses, and every key names a plan key's 15 fields."""
    data = json.loads(blas.TUNING_PATH.read_text())
    assert data["tables"]
    for table in data["tables"]:
        entries = blas.tuning_entries(blas.TUNING_PATH, table["gpu"], table["cublaslt"])
        assert entries and all(len(key.split(",")) == len(KEY) for key in entries)


def test_tune_gemm_picks_the_fastest_bitwise_equal_candidate():
    choose = load_tool("tune_gemm").choose
    assert choose([1.0, 0.8, 0.9], [True, False, True], 0.02) == 2  # the faster #1 changes bits
    assert choose([1.0, 0.99, 0.9], [True, True, False], 0.02) is None  # 1% is under min_gain
    assert choose([1.0, 1.1], [True, True], 0.02) is None  # the first is fastest
    with pytest.raises(ValueError):
        choose([1.0], [True, False], 0.02)


def test_tune_gemm_merges_into_its_gpu_and_version():
    merge = load_tool("tune_gemm").merge
    old = {
        "tables": [
            {"gpu": "A", "cublaslt": 1, "entries": {"k1": 1, "k2": 2}},
            {"gpu": "B", "cublaslt": 1, "entries": {"k": 3}},
        ]
    }
    new = merge(old, "A", 1, {"k2": 5, "k3": 6})
    assert new["tables"][0] == {"gpu": "A", "cublaslt": 1, "entries": {"k1": 1, "k2": 5, "k3": 6}}
    assert new["tables"][1] == old["tables"][1]
    assert merge({}, "C", 2, {"k": 1}) == {"tables": [{"gpu": "C", "cublaslt": 2, "entries": {"k": 1}}]}


def test_tune_gemm_never_picks_a_candidate_that_changes_bits(monkeypatch):
    """tools/tune_gemm.tune_plan with the cuBLASLt calls stubbed on cpu: three candidates, the fastest of
    which writes other bits (another order of sums); the one written is the fastest bitwise-equal one."""
    tool = load_tool("tune_gemm")
    cpu = ce.device("cpu")
    a, b = (ce.Tensor.from_numpy(np.ones(s, np.float32), cpu) for s in ((4, 16), (8, 16)))
    out = ce.Tensor.empty(ce.FP32, (4, 8), cpu)
    chosen = {"algo": 0}
    monkeypatch.setattr(blas, "plan_candidates", lambda dev, key: [({"ID": i}, i) for i in range(3)])
    monkeypatch.setattr(blas, "set_plan_algorithm", lambda dev, key, ptr: chosen.update(algo=ptr))
    monkeypatch.setattr(blas, "plan_key", lambda **call: KEY)

    def matmul(out, a, b, **kw):
        out.array()[...] = np.float32(16) + (np.float32(2**-19) if chosen["algo"] == 1 else 0)

    monkeypatch.setattr(blas, "matmul", matmul)
    monkeypatch.setattr(tool, "time_ms", lambda dev, fn, **kw: {0: 1.0, 1: 0.5, 2: 0.8}[chosen["algo"]])
    call = dict(out=out, a=a, b=b, bias=None, trans_a=False, trans_b=True, accumulate=False, fast_accum=False,
                stream=None)  # fmt: skip
    config, line = tool.tune_plan(cpu, KEY, call, rounds=2, min_gain=0.02)
    assert config == {"ID": 2} and "2/3 bitwise the first" in line


@pytest.mark.gpu
def test_tuned_entry_picks_its_algorithm_and_keeps_the_bits(cuda, tmp_path):
    """A table entry naming one of the heuristic's other candidates is the one the plan takes
    (num_tuned_plans), and the output is bitwise what the first choice gives, as tune_gemm checks."""
    g = rng(7)
    x = tensor(cuda, "x", g.standard_normal((8192, 896)), ce.BF16)  # the 0.5B attention output projection
    w = tensor(cuda, "w", g.standard_normal((896, 896)), ce.BF16)
    y = ce.Tensor.empty(ce.BF16, (8192, 896), cuda, name="y")
    blas.use_tuned_algorithms(False)
    try:
        blas.init(ce.TensorAllocator(cuda))
        matmul(y, x, w)
        first = y.numpy().copy()
        key = next(iter(blas._state(cuda).plans))
        equal = []
        for config, ptr in blas.plan_candidates(cuda, key)[1:]:
            blas.set_plan_algorithm(cuda, key, ptr)
            matmul(y, x, w)
            if np.array_equal(y.numpy(), first):
                equal.append(config)
        assert equal, "no other candidate gives the first choice's bits at this shape"
        blas.use_tuned_algorithms(True, path=write_table(tmp_path / "t.json", cuda.name, blas._lt().get_version(),
                                                         {blas.key_text(key): equal[-1]}))  # fmt: skip
        matmul(y, x, w)
        assert blas.num_tuned_plans(cuda) == 1
        plan = blas._state(cuda).plans[key]
        assert blas.algo_config(plan.algo_ptr) == equal[-1]
        assert np.array_equal(y.numpy(), first)
    finally:
        blas.use_tuned_algorithms(True)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_shipped_tuning_changes_no_bit_of_a_train_step(cuda, fp8):
    """The 0.5B step (B = 8, T = 1024, the tuned shapes) gives the same losses, bit for bit, with the
    shipped table and without it, and the table is in use on a GPU it has entries for."""
    from cuengine.bench_train import random_batch

    cfg = ce.TransformerConfig.preset("qwen2.5-0.5b")
    x, t = random_batch(cfg.vocab_size, 8, 1024)
    losses, tuned = {}, {}
    try:
        for on in (True, False):
            blas.use_tuned_algorithms(on)
            model = ce.LlamaModel(cfg, ce.TrainOptions(matmul_dtype="e4m3" if fp8 else None), device=cuda)
            model.init_weights(42)
            model.allocate_run_state(8, 1024)
            losses[on] = [model.train_step(x, t, lr=1e-4) for _ in range(3)]
            tuned[on] = blas.num_tuned_plans(cuda)
            del model
    finally:
        blas.use_tuned_algorithms(True)
    assert losses[True] == losses[False]
    assert tuned[False] == 0
    has_table = blas.tuning_entries(blas.TUNING_PATH, cuda.name, blas._lt().get_version())
    assert tuned[True] > 0 or not has_table
