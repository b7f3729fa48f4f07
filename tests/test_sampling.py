"""On-device sampling: greedy, temperature, top-k, top-p and seeds. The twin against exact float64
distributions (frequencies over many draws), the step counter, graph replay, cpu vs cuda, and errors."""

import numpy as np
import pytest
from conftest import rng

import cuengine as ce
from cuengine.kernels.sampling import N_PARAMS, gumbel_np, sample_tokens, sample_tokens_np, sampling_params


def exact_probs(x, temperature, top_k, top_p):
    """The truncated distribution in float64, by sorting: softmax(x / T) over the top_k largest (ties at
    the k-th value kept), renormalised, then the fewest top tokens reaching top_p (ties kept)."""
    x = np.asarray(x, np.float64)
    keep = np.ones(x.size, bool)
    if 0 < top_k < x.size:
        keep = x >= np.sort(x)[::-1][top_k - 1]
    p = np.where(keep, np.exp((x - x.max()) / temperature), 0.0)
    p /= p.sum()
    if top_p < 1:
        desc = np.sort(p[keep])[::-1]
        n = int(np.searchsorted(np.cumsum(desc), top_p - 1e-12))
        p = np.where(p >= desc[n], p, 0.0)
        p /= p.sum()
    return p


def draw(logits, params, steps):
    """Tokens (steps, b) from the twin, one call per step (the counter moves on by itself)."""
    params = params.copy()
    return np.stack([sample_tokens_np(logits, params) for _ in range(steps)])


# ---- cpu: the twin ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_is_argmax_lowest_index_on_ties(dtype):
    x = rng(0).standard_normal((5, 300)).astype(ce.dtype(dtype).np)
    x[2, [7, 100, 250]] = 9.0  # a three-way tie: index 7 wins
    got = sample_tokens_np(x, sampling_params(0.0, 0, 1.0, 0))
    np.testing.assert_array_equal(got, np.argmax(x.astype(np.float64), axis=1))
    assert got[2] == 7


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7), (2.0, 3, 0.95)],
)
def test_frequencies_match_the_exact_distribution(temperature, top_k, top_p):
    """2000 draws (100 rows x 20 steps of the same logits) within a chi-square bound of the exact law."""
    x = np.array([2.0, 1.5, 1.5, 0.3, -0.2, 1.0, 0.9, -1.0, 0.0, 0.5, 2.2, -3.0], np.float32)
    p = exact_probs(x, temperature, top_k, top_p)
    tokens = draw(np.tile(x, (100, 1)), sampling_params(temperature, top_k, top_p, 1234), 20).ravel()
    counts = np.bincount(tokens, minlength=x.size)
    assert counts[p == 0].sum() == 0, f"drew tokens outside the allowed set: {counts} vs {p}"
    e = p[p > 0] * tokens.size
    chi2 = np.sum((counts[p > 0] - e) ** 2 / e)
    df = max(1, int(np.sum(p > 0)) - 1)
    assert chi2 < df + 6 * np.sqrt(2 * df), f"chi2 = {chi2:.1f} for {df} degrees of freedom: {counts} vs {e}"


def test_top_k_one_and_tiny_top_p_are_greedy():
    x = rng(1).standard_normal((16, 1000)).astype(np.float32)
    greedy = np.argmax(x, axis=1)
    for params in (sampling_params(0.8, 1, 1.0, 5), sampling_params(1.5, 0, 1e-6, 6), sampling_params(3, 50, 1e-9, 7)):
        np.testing.assert_array_equal(draw(x, params, 3), np.tile(greedy, (3, 1)))


def test_ties_at_the_top_k_threshold_are_kept():
    x = np.array([[3.0, 1.0, 3.0, 3.0, 0.0, -1.0]], np.float32)
    tokens = draw(np.tile(x, (100, 1)), sampling_params(1.0, 2, 1.0, 9), 3)
    assert set(np.unique(tokens)) == {0, 2, 3}  # all three tied largest values, nothing else


def test_seed_and_step_determine_the_draw():
    x = np.zeros((8, 50), np.float32)  # uniform: every draw is the hash's
    params = sampling_params(1.0, 0, 1.0, 2**40 + 3)
    a, b = draw(x, params, 6), draw(x, params, 6)
    np.testing.assert_array_equal(a, b)  # same seed: same tokens
    assert len({tuple(r) for r in a}) == 6  # each step draws anew
    assert len(set(a[0])) > 4  # and each row
    c = draw(x, sampling_params(1.0, 0, 1.0, 3), 6)  # the high seed word counts
    assert not np.array_equal(a, c)
    p = params.copy()
    sample_tokens_np(x, p)
    sample_tokens_np(x, p)
    assert p[5] == 2 and np.array_equal(p[:5], params[:5])


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_np(1, 2, 3, 4, 200_000)
    assert g.dtype == np.float32
    g = g.astype(np.float64)
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03
    assert g.min() >= -2.82 and g.max() <= 22.9


def test_sampling_params_layout():
    p = sampling_params(0.5, 40, 0.9, 2**33 + 7)
    assert p.dtype == np.int32 and p.shape == (N_PARAMS,) and not p[5:].any()
    assert p[:1].view(np.float32)[0] == np.float32(0.5) and p[1] == 40 and p[2:3].view(np.float32)[0] == np.float32(0.9)
    assert p[3:5].view(np.uint32).tolist() == [7, 2] and p[5] == 0


# ---- launcher: both devices ---------------------------------------------------------------------
def run_sampler(device, logits, params, steps=1, graph=False):
    t = {
        "x": ce.Tensor.from_numpy(logits, device, name="logits"),
        "p": ce.Tensor.from_numpy(params, device, name="params"),
        "tok": ce.Tensor.from_numpy(np.full(logits.shape[0], -1, np.int32), device, name="tokens"),
    }
    run = lambda: sample_tokens(t["tok"], t["x"], t["p"])
    out = []
    if graph:
        run()  # compile outside the capture
        out.append(t["tok"].numpy())
        g = device.capture(run)
    for _ in range(steps - graph):
        g.launch() if graph else run()
        out.append(t["tok"].numpy())
    return np.stack(out), t["p"].numpy()


MODES = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 20, 1.0), (1.2, 0, 0.9), (0.9, 50, 0.8)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES, ids=["greedy", "temperature", "top_k", "top_p", "top_k_top_p"])
def test_launcher_matches_twin(dev, dtype, mode):
    x = (rng(2).standard_normal((4, 517)) * 2).astype(ce.dtype(dtype).np)
    params = sampling_params(*mode, seed=77)
    got, p = run_sampler(dev, x, params, steps=3)
    np.testing.assert_array_equal(got, draw(x, params, 3))
    assert p[5] == 3 and p[6] == 0


def test_graph_replay_draws_fresh_tokens(dev):
    x = np.zeros((3, 64), np.float32)
    params = sampling_params(1.0, 0, 1.0, 11)
    got, p = run_sampler(dev, x, params, steps=5, graph=True)
    np.testing.assert_array_equal(got, draw(x, params, 5))
    assert len({tuple(r) for r in got}) == 5 and p[5] == 5


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,match",
    [
        ((-0.1, 0, 1.0, 0), "temperature = -0.1 must be finite"),
        ((float("nan"), 0, 1.0, 0), "temperature = nan"),
        ((1.0, -1, 1.0, 0), "top_k = -1 must be an integer >= 0"),
        ((1.0, 2.5, 1.0, 0), "top_k = 2.5"),
        ((1.0, 0, 0.0, 0), r"top_p = 0.0 must be in \(0, 1\]"),
        ((1.0, 0, 1.5, 0), "top_p = 1.5"),
        ((1.0, 0, 1.0, -1), r"seed = -1 must be an integer in \[0, 2\*\*64\)"),
        ((1.0, 0, 1.0, 2**64), "seed = 18446744073709551616"),
    ],
)
def test_bad_params(args, match):
    with pytest.raises(ValueError, match=match):
        sampling_params(*args)


def _call(
    tok=(2,), logits=(2, 10), params=(N_PARAMS,), tok_dt=np.int32, logits_dt=np.float32, params_dt=np.int32, p=None
):
    t = ce.Tensor.from_numpy(np.zeros(tok, tok_dt), "cpu", name="tokens")
    x = ce.Tensor.from_numpy(np.zeros(logits, logits_dt), "cpu", name="logits")
    pv = sampling_params(1.0, 0, 1.0, 0) if p is None else p
    q = ce.Tensor.from_numpy(np.resize(pv, params).astype(params_dt), "cpu", name="params")
    sample_tokens(t, x, q)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"logits_dt": np.float16}, "logits: expected dtype fp32/bf16"),
        ({"logits": (2, 3, 4)}, r"logits: expected shape \(\*, \*\)"),
        ({"logits": (2, 0)}, "at least one column"),
        ({"tok": (3,)}, r"tokens: expected shape \(2\)"),
        ({"tok_dt": np.float32}, "tokens: expected dtype int32"),
        ({"params": (8,)}, rf"params: expected shape \({N_PARAMS}\)"),
        ({"params_dt": np.float32}, "params: expected dtype int32"),
        ({"p": np.r_[np.float32(-1.0).view(np.int32), np.zeros(N_PARAMS - 1, np.int32)]}, "temperature = -1.0"),
    ],
)
def test_launcher_errors(over, match):
    _call()
    with pytest.raises(ValueError, match=match):
        _call(**over)


# ---- gpu ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES + [(0.7, 1, 1.0), (1.0, 151935, 1.0), (5.0, 0, 0.999)])
@pytest.mark.parametrize("b", [1, 3, 64])
def test_cuda_vocab_151936(cuda, dtype, mode, b):
    """Qwen's vocabulary, rows split over several blocks (greedy, temperature) or not (top-k, top-p): the
    twin's tokens, a moved-on step, and the merge slots back at zero."""
    x = (rng(3).standard_normal((b, 151936)) * 3).astype(ce.dtype(dtype).np)
    params = sampling_params(*mode, seed=2024)
    got, p = run_sampler(cuda, x, params, steps=2)
    np.testing.assert_array_equal(got, draw(x, params, 2))
    assert p[5] == 2 and not p[6:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES[:3])
def test_cuda_more_rows_than_slots(cuda, mode):
    """70 rows: one block per row, no merge slots."""
    x = rng(4).standard_normal((70, 30000)).astype(np.float32)
    params = sampling_params(*mode, seed=5)
    got, p = run_sampler(cuda, x, params, steps=2)
    np.testing.assert_array_equal(got, draw(x, params, 2))
    assert p[5] == 2 and not p[6:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [10, 3000])
def test_cuda_crowded_threshold_bin(cuda, top_k):
    """Thousands of near-equal logits share the threshold's bin: the bisection fallback, and exact ties."""
    V = 20000
    x = np.ones((2, V), np.float32)
    x[0] += np.arange(V, dtype=np.float32) * np.float32(1e-7)  # distinct keys inside one 1/64 bin
    x[:, 5] = 0.0
    params = sampling_params(1.0, top_k, 0.5, 3)
    got, _ = run_sampler(cuda, x, params, steps=3)
    np.testing.assert_array_equal(got, draw(x, params, 3))
