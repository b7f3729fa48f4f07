"""Delayed FP8 scaling of the SwiGLU output and its input's gradient (TrainOptions.fp8_amax_history), in the model.

The kernels (activations' `scale=` arguments, fp8.amax_history_roll) are tested in test_activations.py and
test_fp8.py; here: the first micro-step scales as current scaling does, each later one quantises with the scale
the history held, the history holds the abs-maxes the step recorded, graphs replay the same bits, a checkpoint
carries the history, and the losses stay near current scaling's.
"""

import numpy as np
import pytest
from conftest import DEVICES, tiny
from test_model import batch, make

from cuengine.model.run_state import DELAYED_SLOTS, STAT_SLOTS
from cuengine.tensor import STAT_ABS_MAX, STAT_SCALE

FP8 = {"matmul_dtype": "e4m3"}
CURRENT = {"matmul_dtype": "e4m3", "fp8_amax_history": 0}  # every tensor scaled from its own abs-max


def train(m, steps, first=0):
    return [m.train_step(*batch(m.cfg, seed=10 + s), lr=1e-3) for s in range(first, first + steps)]


def delayed_stats(m):
    """(layers, len(DELAYED_SLOTS), STATS_SLOTS): the delayed tensors' stats slots as the last step left them."""
    idx = [STAT_SLOTS.index(name) for name in DELAYED_SLOTS]
    return m.rs.abs_maxes.numpy()[:, idx]


@pytest.fixture(params=DEVICES)
def dev(request):
    return request.param


def test_fp8_runs_scale_from_a_history_of_16_by_default():
    """FP8 matmuls without fp8_amax_history get delayed scaling over 16 micro-steps (the default FP8 recipe);
    0 asks for current scaling, and a run without FP8 matmuls has no history."""
    from cuengine.model import TrainOptions

    assert TrainOptions(**FP8).resolved("bf16").fp8_amax_history == 16
    assert TrainOptions(**CURRENT).resolved("bf16").fp8_amax_history == 0
    assert TrainOptions().resolved("bf16").fp8_amax_history == 0
    cfg = tiny()
    assert make(cfg, **FP8).rs.fp8_history.shape == (cfg.num_layers * len(DELAYED_SLOTS), 17)
    assert make(cfg, **CURRENT).rs.fp8_history is None


@pytest.mark.parametrize("grad_dtype", ["e5m2", "e4m3"])
def test_each_step_quantises_with_the_scale_the_history_held(dev, grad_dtype):
    """Step 0 scales the two tensors from their own abs-max (the bits of current scaling); from step 1 on each
    is quantised with the scale the history held before the step, and the history then holds the step's
    abs-max in front of the older ones, its scale fp8_max over their max."""
    cfg = tiny()
    n = 2
    m = make(cfg, device=dev, fp8_amax_history=n, grad_dtype=grad_dtype, **FP8)
    base = make(cfg, device=dev, grad_dtype=grad_dtype, **CURRENT)
    assert train(m, 1) == train(base, 1)
    L = cfg.num_layers
    fp8_max = np.array([448.0, 448.0 if grad_dtype == "e4m3" else 57344.0], np.float32)
    amaxes = [delayed_stats(m)[..., STAT_ABS_MAX]]
    for step in range(1, 4):
        before = m.rs.fp8_history.numpy().reshape(L, len(DELAYED_SLOTS), n + 1)
        train(m, 1, first=step)
        stats = delayed_stats(m)
        np.testing.assert_array_equal(stats[..., STAT_SCALE], before[..., 0])  # the scale it was written with
        amaxes.insert(0, stats[..., STAT_ABS_MAX])
        hist = m.rs.fp8_history.numpy().reshape(L, len(DELAYED_SLOTS), n + 1)
        np.testing.assert_array_equal(hist[..., 1:], np.stack(amaxes[:n], axis=-1))
        np.testing.assert_array_equal(hist[..., 0], fp8_max / np.max(amaxes[:n], axis=0))
    assert np.all(amaxes[0] > 0)


def test_losses_stay_near_current_scaling():
    """A few steps of the tiny model: delayed scaling moves the losses by FP8 rounding, not more (and does
    move them: the path is taken)."""
    cfg = tiny()
    delayed = train(make(cfg, fp8_amax_history=4, **FP8), 6)
    current = train(make(cfg, **CURRENT), 6)
    assert delayed[0] == current[0]
    assert delayed[1:] != current[1:]
    np.testing.assert_allclose(delayed, current, rtol=2e-3)


@pytest.mark.parametrize(
    "memory",
    [{"recompute_swiglu": False}, {"recompute_ffn": True}, {"recompute_block": True}, {"offload_residual": True},
     {"recompute_ffn_layers": 1, "recompute_rmsnorm": True}],
)  # fmt: skip
def test_the_memory_options_give_the_same_bits(memory):
    """Whether the SwiGLU output is kept (transposed), recomputed from mlp_up, mlp_up itself recomputed (in every
    layer, the whole block, or the first layer only), or the residuals offloaded, the FP8 bytes the GEMMs read
    are the same, so the losses are bitwise the default's."""
    cfg = tiny()
    want = train(make(cfg, fp8_amax_history=3, **FP8), 4)
    assert train(make(cfg, fp8_amax_history=3, **FP8, **memory), 4) == want


def test_checkpoint_carries_the_history(dev, tmp_path):
    """Two steps, a save, two more: a model loaded from the save gives the last two steps' losses bitwise."""
    cfg = tiny()
    a = make(cfg, device=dev, fp8_amax_history=3, **FP8)
    train(a, 2)
    a.save_checkpoint(tmp_path / "ckpt")
    want = train(a, 2, first=2)
    b = make(cfg, device=dev, seed=7, fp8_amax_history=3, **FP8)
    b.load_checkpoint(tmp_path / "ckpt")
    assert train(b, 2, first=2) == want


def test_a_checkpoint_without_the_history_starts_it_afresh(tmp_path):
    """Saved with current scaling, resumed with delayed: the history starts empty, so the first step after the
    load scales as current scaling does (the same loss as the saving model's next step)."""
    cfg = tiny()
    a = make(cfg, **CURRENT)
    train(a, 2)
    a.save_checkpoint(tmp_path / "ckpt")
    b = make(cfg, fp8_amax_history=3, **FP8)
    train(b, 1)  # a filled history, which the load must clear
    b.load_checkpoint(tmp_path / "ckpt")
    assert not b.rs.fp8_history.numpy().any()
    assert train(b, 1, first=2) == train(a, 1, first=2)


@pytest.mark.gpu
def test_graphs_replay_the_eager_bits():
    """CUDA graphs (the first step eager and current-scaled, the second captured with the history's scales) give
    the losses and weights of eager steps, bitwise."""
    cfg = tiny()
    eager = make(cfg, device="cuda", fp8_amax_history=4, **FP8)
    graphs = make(cfg, device="cuda", fp8_amax_history=4, use_cuda_graphs=True, **FP8)
    assert train(graphs, 5) == train(eager, 5)
    for name, t in eager.weights.tensors.items():
        np.testing.assert_array_equal(graphs.weights[name].numpy().view(np.uint8), t.numpy().view(np.uint8))


def test_each_micro_step_rolls_the_history():
    """With two micro-steps a step the history takes one abs-max per micro-step: after one optimizer step of two
    micro-steps (the first current-scaled), two of its three columns are filled, and the second micro-step was
    quantised with the scale the first left."""
    cfg = tiny()
    m = make(cfg, fp8_amax_history=3, **FP8)
    (x1, y1), (x2, y2) = batch(cfg, 5), batch(cfg, 6)
    m.forward(x1)
    m.backward(x1, y1, micro_step=0, grad_accum_steps=2)
    after_first = m.rs.fp8_history.numpy().copy()
    m.forward(x2)
    m.backward(x2, y2, micro_step=1, grad_accum_steps=2)
    m.finish_step(1e-3, int((y1 != -1).sum() + (y2 != -1).sum()))
    hist = m.rs.fp8_history.numpy()
    assert np.all(hist[:, 1:3] > 0) and not hist[:, 3].any()
    np.testing.assert_array_equal(hist[:, 2], after_first[:, 1])
    np.testing.assert_array_equal(delayed_stats(m)[..., STAT_SCALE].reshape(-1), after_first[:, 0])
