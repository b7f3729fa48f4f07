"""`cuengine.train.Trainer` from Python, on the cpu device: the schedule, gradient accumulation,
the non-finite stop, validation and checkpoint cadence, hooks, a requested stop (and Ctrl-C),
bitwise resumption; and the README's Python snippets, run as written."""

import importlib.util
import json
import math
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import cuengine as ce
from cuengine.data import TokenSource
from cuengine.train import Schedule, Trainer, lr_at

B, T = 2, 32
TOKENS = np.frombuffer(Path(json.__file__).read_bytes() * 4, np.uint8).astype(np.int32)  # real text, as bytes


def make_model(B=B, T=T, seed=0):
    model = ce.LlamaModel(ce.TransformerConfig.preset("tiny"), ce.TrainOptions(model_dtype="fp32"), device="cpu")
    model.init_weights(seed)
    model.allocate_run_state(B, T)
    return model


def make_trainer(model=None, **kw):
    kw = dict(dict(batch_size=B, seq_len=T, steps=6, lr=Schedule(6, 3e-3, warmup=1)), **kw)
    return Trainer(model or make_model(kw["batch_size"], kw["seq_len"]), TokenSource([TOKENS], "json.py"), **kw)


def recorder():
    rows = []
    return rows, rows.append


# ---- schedule -----------------------------------------------------------------------------------
def test_lr_schedules():
    lr = lambda s, kind: lr_at(s, 11, 1.0, 0.1, 2, kind)  # 11 steps, 2 of warm-up, min_lr 0.1
    assert [lr(s, "cosine") for s in (0, 1, 2)] == [0.5, 1.0, 1.0]  # warm-up reaches lr at its last step
    assert lr(5, "cosine") == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 3)))
    assert lr(5, "linear") == pytest.approx(0.1 + 0.9 * (1 - 3 / 9))
    assert lr(10, "linear") == pytest.approx(0.2) and lr(10, "cosine") > 0.1  # the last step still learns
    assert lr(7, "constant") == 1.0
    vals = [lr(s, "cosine") for s in range(2, 11)]
    assert vals == sorted(vals, reverse=True)
    assert [Schedule(11, 1.0, 0.1, 2, "linear")(s) for s in range(11)] == [lr(s, "linear") for s in range(11)]
    with pytest.raises(ValueError, match="Schedule.kind"):
        Schedule(10, 1.0, kind="step")


def test_custom_lr_callable_and_constant_reach_the_steps():
    rows, hook = recorder()
    make_trainer(lr=lambda step: 1e-3 * (step + 1), hooks=[hook]).run()
    assert [r["lr"] for r in rows] == [1e-3 * s for s in range(1, 7)]
    rows, hook = recorder()
    make_trainer(lr=2e-3, hooks=[hook]).run(stop=2)
    assert [r["lr"] for r in rows] == [2e-3, 2e-3]


# ---- the loop -----------------------------------------------------------------------------------
def test_records_and_loss_falls():
    rows, hook = recorder()
    trainer = make_trainer(steps=30, lr=Schedule(30, 3e-3, warmup=3), hooks=[hook])
    assert trainer.run() == 30 and trainer.step == 30 and trainer.model.step == 30
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert abs(rows[0]["loss"] - math.log(256)) < 0.5
    assert np.mean([r["loss"] for r in rows[-5:]]) < rows[0]["loss"] - 1.0
    assert rows[-1]["tokens"] == 30 * B * T and rows[-1]["tok_per_s"] > 0 and rows[-1]["memory"] > 0
    assert "mfu" not in rows[-1] and "val_loss" not in rows[-1]  # no val source; MFU on cuda only


def test_grad_accumulation_equals_the_larger_batch():
    """2 micro-batches of B=2 see the windows one batch of B=4 sees: same losses and weights."""
    rows_a, hook_a = recorder()
    rows_b, hook_b = recorder()
    a = make_trainer(batch_size=2, grad_accum=2, hooks=[hook_a])
    b = make_trainer(batch_size=4, hooks=[hook_b])
    a.run(stop=3)
    b.run(stop=3)
    assert [r["tokens"] for r in rows_a] == [r["tokens"] for r in rows_b] == [128, 256, 384]
    np.testing.assert_allclose([r["loss"] for r in rows_a], [r["loss"] for r in rows_b], rtol=1e-5)
    wa, wb = a.model.weights.tensors, b.model.weights.tensors
    name = next(iter(wa))
    np.testing.assert_allclose(wa[name].numpy(), wb[name].numpy(), rtol=1e-4, atol=1e-6)


def test_non_finite_loss_stops_before_the_update(tmp_path):
    trainer = make_trainer(checkpoint_dir=tmp_path / "ckpt")
    trainer.run(stop=2)
    name = next(iter(trainer.model.weights.tensors))
    w = trainer.model.weights.tensors[name]
    w.copy_from_numpy(np.full(w.shape, np.nan, np.float32))
    for accum in (1, 2):
        trainer.accum = accum
        with pytest.raises(FloatingPointError, match=r"step 3: .*non-finite"):
            trainer.run()
        assert trainer.step == 2 and trainer.model.step == 2 and trainer.last_saved == 2


def test_validation_cadence():
    rows, hook = recorder()
    val = TokenSource([TOKENS[-3000:]], "held out", shuffle=False)
    make_trainer(val=val, eval_every=2, eval_batches=2, steps=5, lr=Schedule(5, 1e-3), hooks=[hook]).run()
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 5]  # and always at the last step
    assert all(math.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)


def test_checkpoint_cadence_by_steps_time_and_stop(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(Trainer, "save", lambda self: saved.append(self.step))
    make_trainer(checkpoint_dir=tmp_path, save_every=2, steps=7, lr=1e-3).run(stop=5)
    assert saved == [2, 4, 5]  # and at the step run() stops at
    saved.clear()
    make_trainer(checkpoint_dir=tmp_path, save_seconds=1e-9, lr=1e-3).run(stop=3)
    assert saved == [1, 2, 3]  # every step: the interval has always passed (without checkpoint_dir: an error)


def test_resume_is_bitwise_and_restores_the_data_position(tmp_path):
    rows_a, hook_a = recorder()
    make_trainer(hooks=[hook_a]).run()
    rows_b, hook_b = recorder()
    first = make_trainer(checkpoint_dir=tmp_path / "ckpt", checkpoint_extra={"note": "hi"}, hooks=[hook_b])
    assert first.run(stop=3) == 3 and first.last_saved == 3
    second = make_trainer(checkpoint_dir=tmp_path / "ckpt", hooks=[hook_b])
    assert second.resume() == {"note": "hi"} and second.step == 3
    second.run()
    assert [r["step"] for r in rows_b] == list(range(1, 7))
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]
    other = Trainer(make_model(), TokenSource([TOKENS], "x"), batch_size=B, seq_len=T, steps=6, lr=1e-3)
    other.model.opts.seed = 99  # another run's rounding seed: refused, nothing changed
    with pytest.raises(ValueError, match="seed"):
        other.resume(tmp_path / "ckpt")
    assert other.step == 0 and other.model.step == 0


def test_request_stop_from_a_hook_ends_with_a_checkpoint(tmp_path):
    trainer = make_trainer(checkpoint_dir=tmp_path / "ckpt", steps=50, lr=1e-3)
    trainer.hooks = [lambda rec: rec["step"] == 2 and trainer.request_stop()]
    assert trainer.run() == 2 and trainer.stop_requested and trainer.last_saved == 2
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["extra"]["step"] == 2


def test_ctrl_c_finishes_the_step_and_checkpoints_then_a_second_interrupts(tmp_path):
    trainer = make_trainer(checkpoint_dir=tmp_path / "ckpt", steps=50, lr=1e-3)
    trainer.hooks = [lambda rec: rec["step"] == 2 and os.kill(os.getpid(), signal.SIGINT)]
    before = signal.getsignal(signal.SIGINT)
    assert trainer.run(handle_sigint=True) == 2 and trainer.last_saved == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back

    def twice(rec):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    trainer.hooks = [twice]
    with pytest.raises(KeyboardInterrupt):
        trainer.run(handle_sigint=True)
    assert trainer.last_saved == 2 and signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(batch_size=0), "batch_size must be an integer >= 1"),
        (dict(grad_accum=1.5), "grad_accum must be an integer >= 1"),
        (dict(save_seconds=-1), "save_seconds must be a number >= 0, got -1"),
        (dict(eval_every=0.5), "eval_every must be an integer >= 0, got 0.5"),
        (dict(save_every=-2), "save_every must be an integer >= 0, got -2"),
        (dict(eval_every=2), "eval_every=2 needs val, the validation source"),
        (dict(save_every=2), "save_every and save_seconds need checkpoint_dir"),
        (dict(save_seconds=60.0), "save_every and save_seconds need checkpoint_dir"),
    ],
)
def test_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(model=object(), **kw)


def test_a_source_without_batch_is_refused_up_front():
    with pytest.raises(ValueError, match="source needs a batch\\(B, T\\) method, got list"):
        Trainer(object(), [TOKENS], batch_size=B, seq_len=T, steps=2, lr=1e-3)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(steps=0), "Schedule.steps must be an int >= 1, got 0"),
        (dict(warmup=-1), "Schedule.warmup must be an int >= 0, got -1"),
        (dict(warmup=1.5), "Schedule.warmup must be an int >= 0, got 1.5"),
        (dict(lr=float("nan")), "Schedule.lr must be a finite number >= 0, got nan"),
        (dict(min_lr=-1e-4), "Schedule.min_lr must be a finite number >= 0"),
        (dict(min_lr=1.0), "Schedule.min_lr 1.0 is above lr 0.001"),
    ],
)
def test_bad_schedules(kw, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**(dict(steps=10, lr=1e-3) | kw))


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="no checkpoint directory"):
        make_trainer(model=object()).resume()


# ---- the README's Python, as written -------------------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_blocks():
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_python_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    """Every ```python block of the README, in order, in one namespace per block, in a fresh
    directory (blocks that need transformers run where it is installed). On a machine without a
    GPU this is what a new user on a laptop gets."""
    blocks = readme_python_blocks()
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    has_transformers = importlib.util.find_spec("transformers") is not None
    for code in blocks:
        if "import transformers" in code and not has_transformers:
            continue
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "my_model" / "config.json").is_file()
    assert "grad norm" in out
