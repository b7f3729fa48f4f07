"""`cuengine train | generate | bench | info` on the cpu device: training on the default corpus,
exact resumption, bad input (exit 2, one line, nothing written), generation, Ctrl-C, help and packaging."""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, write_llmc

from cuengine import cli
from cuengine import train as train_loop

try:
    from cuengine.model import LlamaModel, TransformerConfig  # noqa: F401

    MODEL_ERROR = None
except ImportError as err:
    MODEL_ERROR = str(err)
needs_model = pytest.mark.skipif(MODEL_ERROR is not None, reason=f"cuengine.model does not import: {MODEL_ERROR}")

# Small and quick on two cores; the loss must still fall clearly within 20 steps.
FAST = ["--device", "cpu", "--batch-size", "4", "--seq-len", "64", "--eval-batches", "1", "--sample-tokens", "0"]


def cli_proc(*argv, cwd, timeout=300, **kw):
    """`python -m cuengine.cli *argv` as a real process on this source tree."""
    env = dict(os.environ, PYTHONPATH=str(Path(cli.__file__).parents[1]))
    cmd = [sys.executable, "-m", "cuengine.cli", *map(str, argv)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- training -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 20-step run on the default corpus, shared by the tests that read its outputs."""
    out = tmp_path_factory.mktemp("train") / "run"
    code = cli.main(["train", *FAST, "--steps", "20", "--warmup", "2", "--eval-every", "10", "--sample-tokens", "16",
                     "--out", str(out)])  # fmt: skip
    return code, out


@needs_model
def test_train_default_data_loss_falls(trained):
    code, out = trained
    assert code == 0
    rows = read_log(out / "log.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(256)) < 0.5  # starts near uniform over the byte vocabulary
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20]
    assert rows[-1]["val_loss"] < losses[0] - 0.5
    for key in ("lr", "tok_per_s", "memory", "tokens"):
        assert rows[-1][key] > 0
    assert "mfu" not in rows[-1]  # MFU is reported on cuda only
    assert (out / "checkpoint").is_dir() and (out / "model" / "config.json").is_file()
    assert json.loads((out / "run.json").read_text())["steps"] == 20
    assert len((out / "sample.txt").read_bytes()) >= 16
    has_plot = importlib.util.find_spec("matplotlib") is not None  # the optional `plot` extra
    assert (out / "log.png").is_file() == has_plot


@needs_model
def test_generate_from_trained_model(trained, capsys):
    _, out = trained
    argv = ["generate", "--model", out / "model", "--prompt", "def ", "--max-new-tokens", 12, "--device", "cpu"]
    code, text, err = run_cli(capsys, *argv, "--seed", 3)
    assert code == 0, err
    assert text.startswith("def ") and len(text.encode()) > len("def \n")
    assert run_cli(capsys, *argv, "--seed", 3)[1] == text  # seeded
    code, greedy, _ = run_cli(capsys, *argv, "--temperature", 0)
    assert code == 0 and greedy == run_cli(capsys, *argv, "--temperature", 0, "--seed", 9)[1]


def _metaspace_tokenizer():
    """Word tokens whose decoder turns "▁" into a space and drops it at the start of a text, as Llama 2's does."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models

    words = ["▁hello", "▁world", "\n", "▁again", "[UNK]"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    return tok


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_streamed_text_adds_up_to_the_whole_and_decodes_a_line_a_token(kind):
    """The pieces `cuengine generate` prints, one a token, are the whole text's decode, split: an incomplete UTF-8
    character waits for its bytes, a token after a newline keeps its leading space, and a step decodes the tokens
    since the last newline, not all of them (700 tokens in lines of 7: a whole decode a step would read ~245k)."""
    from cuengine.cli import TextStream
    from cuengine.data import ByteTokenizer

    if kind == "bytes":
        tok, prompt = ByteTokenizer(), list(b"> ")
        tokens = list(("ab\u00e9cd\n" * 100).encode()) + [0xC3]  # ends inside a character
    else:
        tok, prompt = _metaspace_tokenizer(), [0]
        tokens = [1, 2, 3, 1, 0, 2, 1] * 100
    decoded = []
    counting = type("Counting", (), {"decode": lambda self, ids: decoded.append(len(ids)) or tok.decode(ids)})()
    text = TextStream(counting, prompt)
    pieces = [text.add(t) for t in tokens]
    assert "".join(pieces) + text.finish() == tok.decode(prompt + tokens)
    assert "\ufffd" not in "".join(pieces) and ("" in pieces) == (kind == "bytes")  # the held-back halves of é
    assert sum(decoded) < 12 * len(tokens), sum(decoded)


@needs_model
def test_generate_with_fp8_decode_weights(trained, capsys, monkeypatch):
    """--weights fp8 decodes through per-row E4M3 copies, from a KV cache of exactly prompt + new tokens."""
    from cuengine.inference import InferenceMixin

    seen, allocate = [], InferenceMixin.allocate_inference_state

    def recording(self, *a, **kw):
        st = allocate(self, *a, **kw)
        seen.append((st.weights, st.max_batch, st.max_seq))
        return st

    monkeypatch.setattr(InferenceMixin, "allocate_inference_state", recording)
    _, out = trained
    argv = [
        "generate",
        "--model",
        out,
        "--prompt",
        "def ",
        "--max-new-tokens",
        6,
        "--device",
        "cpu",
        "--temperature",
        0,
    ]
    code, text, err = run_cli(capsys, *argv, "--weights", "fp8")
    assert code == 0 and text.startswith("def ") and len(text.encode()) > len("def \n"), err
    assert seen == [("fp8", 1, 4 + 6)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and seen[1] == ("bf16", 1, 10), err


@needs_model
def test_train_from_model_dir_and_its_tokenizer(trained, tmp_path, capsys):
    _, out = trained
    (tmp_path / "d.txt").write_text("import sys\n\ndef main(argv):\n    return 0\n" * 40)
    argv = ["train", *FAST, "--steps", "2", "--data", tmp_path / "d.txt"]
    code, _, err = run_cli(capsys, *argv, "--model", out / "model", "--out", tmp_path / "ft")
    assert code == 0, err
    first = read_log(tmp_path / "ft" / "log.jsonl")[0]["loss"]
    assert first < math.log(256) - 1.0  # the trained weights were imported, not a fresh init
    from test_data import word_tokenizer

    shutil.copytree(out / "model", tmp_path / "m")
    word_tokenizer(tmp_path / "m")
    (tmp_path / "w.txt").write_text("def x return y " * 3000)
    argv = ["train", *FAST, "--steps", "2", "--data", tmp_path / "w.txt", "--model", tmp_path / "m"]
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "tok")
    assert code == 0, err
    assert (tmp_path / "tok" / "model" / "tokenizer.json").is_file()
    code, text, err = run_cli(capsys, "generate", "--model", tmp_path / "tok" / "model", "--prompt", "def x",
                              "--max-new-tokens", 5, "--device", "cpu")  # fmt: skip
    assert code == 0, err
    words = text.split()  # ids past the tokenizer's 5 words (the model has 256) decode to nothing
    assert words[:2] == ["def", "x"] and set(words) <= {"[UNK]", "def", "return", "x", "y"}
    assert "[5 tokens in " in err and "; the first after " in err and "tokens/s]" in err


@needs_model
def test_resume_continues_the_same_loss_sequence(tmp_path, capsys):
    common = [*FAST, "--steps", "10", "--warmup", "2", "--eval-every", "5", "--seed", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(capsys, "train", *common, "--out", straight)[0] == 0
    code, out, _ = run_cli(capsys, "train", *common, "--out", split, "--stop-after", "5")
    assert code == 0 and "--resume" in out
    assert len(read_log(split / "log.jsonl")) == 5 and not (split / "model").exists()
    code, _, err = run_cli(capsys, "train", "--resume", "--out", split, "--device", "cpu")
    assert code == 0, err
    a, b = read_log(straight / "log.jsonl"), read_log(split / "log.jsonl")
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]  # bitwise: the floats are logged exactly
    assert [r["lr"] for r in b] == [r["lr"] for r in a]
    assert [r.get("val_loss") for r in b] == [r.get("val_loss") for r in a]
    # Resuming with another model is refused before anything changes.
    before = {p: p.stat().st_mtime_ns for p in split.rglob("*")}
    code, _, err = run_cli(capsys, "train", "--resume", "--out", split, "--device", "cpu", "--preset", "tiny-llama",
                           "--steps", "12")  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "written for another model config" in err, err
    assert {p: p.stat().st_mtime_ns for p in split.rglob("*")} == before


@needs_model
def test_resume_after_a_crash_reruns_the_steps_after_the_checkpoint(tmp_path, monkeypatch, capsys):
    common = [*FAST, "--steps", "6", "--warmup", "1", "--eval-every", "0", "--save-every", "3"]
    assert run_cli(capsys, "train", *common, "--out", tmp_path / "straight")[0] == 0
    real_step, calls = train_loop.optimizer_step, []

    def crash_on_fifth(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step(*args)

    monkeypatch.setattr(train_loop, "optimizer_step", crash_on_fifth)
    code, _, err = run_cli(capsys, "train", *common, "--out", tmp_path / "crashed")
    assert code == 130 and "interrupted" in err
    assert len(read_log(tmp_path / "crashed" / "log.jsonl")) == 4  # step 4 ran after the checkpoint at 3
    monkeypatch.setattr(train_loop, "optimizer_step", real_step)
    assert run_cli(capsys, "train", "--resume", "--out", tmp_path / "crashed", "--device", "cpu")[0] == 0
    a, b = read_log(tmp_path / "straight" / "log.jsonl"), read_log(tmp_path / "crashed" / "log.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]


@needs_model
def test_train_on_text_npy_and_bin_with_grad_accum(tmp_path, capsys):
    text = b"the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "t.txt").write_bytes(text)
    np.save(tmp_path / "t.npy", np.frombuffer(text, np.uint8).astype(np.int32))
    write_llmc(tmp_path / "t_000.bin", np.frombuffer(text, np.uint8))
    write_llmc(tmp_path / "t_001.bin", np.frombuffer(text[::-1], np.uint8))
    logs = {}
    for name, spec in (("txt", "t.txt"), ("npy", "t.npy"), ("bin", "t_*.bin")):
        out = tmp_path / f"run_{name}"
        argv = ["train", *FAST, "--steps", "3", "--grad-accum", "2", "--warmup", "1", "--data", tmp_path / spec]
        code, _, err = run_cli(capsys, *argv, "--out", out)
        assert code == 0, err
        logs[name] = read_log(out / "log.jsonl")
        assert len(logs[name]) == 3 and logs[name][0]["tokens"] == 2 * 4 * 64
    # Without --model the vocabulary comes from the data: bytes 256; .npy max id 'z' + 1 padded to
    # 128; GPT-2 .bin shards 50257 padded to 50304. A fresh model's first loss is near log(V).
    for name, vocab in (("txt", 256), ("npy", 128), ("bin", 50304)):
        assert abs(logs[name][0]["loss"] - math.log(vocab)) < 0.3, (name, logs[name][0]["loss"])


@needs_model
def test_engine_flags_reach_the_model_and_keep_the_losses(tmp_path, capsys):
    common = [*FAST, "--steps", "3", "--warmup", "1"]
    assert run_cli(capsys, "train", *common, "--out", tmp_path / "base")[0] == 0
    flags = ["--recompute", "ffn", "att", "--offload-residual", "--cuda-graphs", "--nondeterministic-attention"]
    assert run_cli(capsys, "train", *common, *flags, "--out", tmp_path / "flags")[0] == 0
    saved = json.loads((tmp_path / "flags" / "run.json").read_text())
    assert saved["recompute"] == ["ffn", "att"] and saved["offload_residual"] and saved["cuda_graphs"]
    assert saved["nondeterministic_attention"]  # (the NumPy twin has one attention backward: same losses)
    from cuengine.cli_train import _train_options
    from cuengine.model import TransformerConfig

    opts = _train_options(saved, TransformerConfig.preset("tiny"))
    assert not opts.attention_deterministic and opts.recompute_ffn and opts.use_cuda_graphs
    base, other = read_log(tmp_path / "base" / "log.jsonl"), read_log(tmp_path / "flags" / "log.jsonl")
    assert [r["loss"] for r in other] == [r["loss"] for r in base]


@needs_model
def test_bench_minimal(capsys):
    code, out, err = run_cli(capsys, "bench", "--preset", "tiny", "--batch-size", 2, "--seq-len", 32, "--steps", 2,
                             "--warmup", 1, "--device", "cpu")  # fmt: skip
    assert code == 0, err
    assert "tok/s" in out and "tiny" in out
    assert "total device" in out and "wte" not in out  # the per-context summary only


def test_bench_report_lists_every_buffer(capsys):
    code, out, err = run_cli(capsys, "bench", "--preset", "tiny", "--batch-size", 2, "--seq-len", 32, "--steps", 1,
                             "--warmup", 1, "--device", "cpu", "--report")  # fmt: skip
    assert code == 0, err
    assert "total device" in out and "wte" in out and "gradients" in out


# ---- cuda (the lead runs these on an H200) --------------------------------------------------------
@pytest.mark.gpu
def test_train_cuda_default_shape_loss_falls_and_resumes_exactly(tmp_path, capsys):
    """The default cuda run (the "small" shape, bf16) for a few steps: the loss falls, MFU is
    logged, and 3 + resume 3 steps give bitwise the losses of 6 straight (seeded stochastic
    rounding; needs deterministic kernels, attention backward included)."""
    code, _, err = run_cli(capsys, "train", "--device", "cuda", "--steps", 30, "--eval-every", 15,
                           "--sample-tokens", 20, "--out", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    rows = read_log(tmp_path / "run" / "log.jsonl")
    assert np.mean([r["loss"] for r in rows[-5:]]) < rows[0]["loss"] - 1.0
    assert all(0 < r["mfu"] < 1 for r in rows)
    code, text, err = run_cli(capsys, "generate", "--model", tmp_path / "run" / "model", "--prompt", "import ",
                              "--max-new-tokens", 20, "--device", "cuda")  # fmt: skip
    assert code == 0 and text.startswith("import "), err
    common = ["--device", "cuda", "--steps", 6, "--batch-size", 4, "--seq-len", 256, "--sample-tokens", 0]
    assert run_cli(capsys, "train", *common, "--out", tmp_path / "a")[0] == 0
    assert run_cli(capsys, "train", *common, "--out", tmp_path / "b", "--stop-after", 3)[0] == 0
    assert run_cli(capsys, "train", "--resume", "--out", tmp_path / "b", "--device", "cuda")[0] == 0
    a, b = read_log(tmp_path / "a" / "log.jsonl"), read_log(tmp_path / "b" / "log.jsonl")
    assert [r["loss"] for r in b] == [r["loss"] for r in a]


@pytest.mark.gpu
def test_bench_cuda_uses_the_project_measurement(capsys):
    code, out, err = run_cli(capsys, "bench", "--preset", "tiny-hs64", "--batch-size", 2, "--seq-len", 128,
                             "--steps", 3, "--device", "cuda")  # fmt: skip
    assert code == 0, err
    assert "(CUDA graphs)" in out and "MFU" in out and "tok/s" in out


# ---- bad input: one line on stderr, exit code 2, nothing written ---------------------------------
def make_bad_files(tmp):
    """The files the bad-input cases name, made in `tmp`."""
    write_llmc(tmp / "magic.bin", [1, 2, 3], magic=12345)
    write_llmc(tmp / "version.bin", [1, 2, 3], version=3)
    write_llmc(tmp / "big.bin", [1, 2, 60000] * 100)
    write_llmc(tmp / "v300.bin", [1, 300, 2] * 100)
    (tmp / "junk.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "old.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    np.save(tmp / "ids.npy", np.arange(300, dtype=np.int32) % 256)
    np.save(tmp / "negative.npy", np.arange(300, dtype=np.int32) % 256 - 1)
    (tmp / "nocfg").mkdir()
    (tmp / "badcfg").mkdir()
    (tmp / "badcfg" / "config.json").write_text("{not json")
    for name in ("noweights", "badweights"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(TransformerConfig.preset("tiny").to_hf_dict()))
    (tmp / "badweights" / "model.safetensors").write_bytes(b"garbage12345678")
    (tmp / "gpt2").mkdir()
    (tmp / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))


# Each kind of bad input: extra argv ({tmp} = the folder of make_bad_files) and the expected message.
BAD_CASES = [
    pytest.param(["--data", "{tmp}/nope.txt"], "nope.txt: no such file", id="missing data"),
    pytest.param(["--data", "{tmp}/junk.npy"], "not a readable .npy", id="corrupt npy"),
    pytest.param(["--data", "{tmp}/empty.txt"], "empty file", id="empty text"),
    pytest.param(["--data", "{tmp}/magic.bin"], "bad magic 12345", id="bin magic"),
    pytest.param(["--data", "{tmp}/version.bin"], "version 3, expected 1", id="bin version"),
    pytest.param(["--data", "{tmp}/big.bin"], "token id 60000 is >= its format's vocab_size 50257", id="bin token"),
    pytest.param(["--model", "{tmp}/noweights", "--data", "{tmp}/v300.bin"],
                 "token id 300 is >= the model's vocab_size 256", id="model vocab"),
    pytest.param(["--data", "{tmp}/negative.npy"], "negative.npy: token id -1 is negative", id="negative id"),
    pytest.param(["--model", "{tmp}/noweights", "--data", "{tmp}/negative.npy"], "token id -1 is negative",
                 id="negative id, model vocab"),
    pytest.param(["--val-data", "{tmp}/nope.bin"], "nope.bin: no such file", id="val data"),
    pytest.param(["--data", "{tmp}/none_*.bin"], "no files match", id="glob"),
    pytest.param(["--model", "{tmp}/nowhere"], "not a directory", id="model dir"),
    pytest.param(["--model", "{tmp}/nocfg"], "no config.json", id="model config"),
    pytest.param(["--model", "{tmp}/badcfg"], "badcfg", id="model json"),
    pytest.param(["--model", "{tmp}/gpt2"], "unsupported 'architectures'", id="model arch"),
    pytest.param(["--model", "{tmp}/noweights"], "neither model.safetensors nor", id="no weights"),
    pytest.param(["--model", "{tmp}/badweights"], "Error while deserializing header", id="bad weights"),
    pytest.param(["--seq-len", 4096], "--seq-len 4096 is longer than the model allows (max_position_embeddings 256)",
                 id="seq-len"),
    pytest.param(["--data", "{tmp}/ids.npy", "--seq-len", 200], "fewer than one window of seq-len 200",
                 id="seq-len data"),
    pytest.param(["--steps", 0], "--steps must be an integer >= 1, got 0", id="steps 0"),
    pytest.param(["--steps", "ten"], "argument --steps: invalid int value: 'ten'", id="steps text"),
    pytest.param(["--lr", -1], "--lr must be a finite number >= 0.0, got -1.0", id="lr"),
    pytest.param(["--lr", "nan"], "--lr must be a finite number", id="lr nan"),
    pytest.param(["--lr", 0], "--lr must be > 0, got 0.0", id="lr zero"),
    pytest.param(["--lmhead-chunks", 3, "--batch-size", 1, "--seq-len", 64], "lmhead_chunks=3 does not divide",
                 id="lmhead"),
    pytest.param(["--batch-size", 0], "--batch-size must be an integer >= 1", id="batch"),
    pytest.param(["--steps", 5, "--warmup", 5], "--warmup 5 must be below --steps 5", id="warmup"),
    pytest.param(["--lr", 1e-4, "--min-lr", 1e-3], "--min-lr 0.001 is above --lr 0.0001", id="min-lr"),
    pytest.param(["--steps", 5, "--stop-after", 9], "--stop-after must be in [1, --steps 5]", id="stop-after"),
    pytest.param(["--schedule", "step"], "invalid choice: 'step'", id="schedule"),
    pytest.param(["--matmul-dtype", "e4m3", "--dtype", "fp32"], "matmul_dtype 'e4m3' needs model_dtype 'bf16'",
                 id="options"),
    pytest.param(["--resume"], "--resume: no checkpoint to continue", id="resume"),
    pytest.param(["--device", "tpu"], "unknown device 'tpu'", id="device"),
    pytest.param(["--out", "{tmp}/empty.txt"], "empty.txt is a file, not a directory", id="out file"),
    pytest.param(["--out", "{tmp}/empty.txt/run"], "empty.txt is not a writable directory", id="out under a file"),
    pytest.param(["--log", "{tmp}/old.jsonl"], "old.jsonl already holds a log; a new run would overwrite it",
                 id="log of another run"),
    pytest.param(["--log", "{tmp}/empty.txt/log.jsonl"], "empty.txt/log.jsonl: cannot be created",
                 id="log under a file"),
]  # fmt: skip


@needs_model
@pytest.mark.parametrize("argv,message", BAD_CASES)
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, monkeypatch, capsys, argv, message):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    make_bad_files(inputs)
    argv = [str(a).format(tmp=inputs) for a in argv]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the default --out (runs/<timestamp>) would appear here
    before = sorted(p.name for p in inputs.iterdir())
    code, out, err = run_cli(capsys, "train", "--device", "cpu", "--out", work / "run", *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("cuengine train: error: "), err
    assert message in err, err
    assert not (work / "run").exists() and list(work.iterdir()) == []
    assert sorted(p.name for p in inputs.iterdir()) == before
    code, _, err = run_cli(capsys, "train", "--device", "cpu", *argv)  # default --out
    assert code == 2 and list(work.iterdir()) == []


@needs_model
def test_a_refused_first_write_is_one_line(tmp_path, monkeypatch, capsys):
    """What the early check cannot foresee (a read-only file system, /proc as root) fails at the run's first
    write: one line, exit 2."""
    from cuengine import cli_train

    monkeypatch.setattr(cli_train, "_check_creatable", lambda flag, path: None)
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "train", *FAST, "--steps", "2", "--warmup", "0", "--out", tmp_path / "file" / "run")
    assert code == 2 and err.count("\n") == 1 and "cannot write the run's files" in err, err


@needs_model
def test_gpus_needs_as_many_cuda_devices(tmp_path, monkeypatch, capsys):
    """`--gpus N` over NCCL is refused in one line, before any process starts, on the cpu or with fewer GPUs."""
    from cuengine import cli_train

    monkeypatch.delenv("CUENGINE_DIST_BACKEND", raising=False)
    monkeypatch.setattr(cli_train, "_train_on_gpus", lambda args: pytest.fail("the ranks started"))
    code, _, err = run_cli(capsys, "train", "--device", "cpu", "--gpus", "2", "--out", tmp_path / "run")
    assert code == 2 and "does not go with --device cpu" in err, err
    monkeypatch.setattr(cli_train, "cuda_device_count", lambda: 1)
    code, _, err = run_cli(capsys, "train", "--gpus", "2", "--out", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and "--gpus 2: this host has 1 CUDA device(s)" in err, err
    assert not (tmp_path / "run").exists()


@needs_model
def test_a_one_token_window_still_writes_its_sample(tmp_path, capsys):
    """--seq-len 1 trains, and its closing sample starts from a one-token prompt (seq-len // 2 would be none)."""
    code, out, err = run_cli(capsys, "train", "--device", "cpu", "--seq-len", "1", "--steps", "2", "--warmup", "0",
                             "--eval-batches", "1", "--sample-tokens", "3", "--out", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "run" / "sample.txt").read_text().strip()


@needs_model
def test_a_run_stopped_before_its_export_exports_on_resume(tmp_path, capsys):
    """A run whose last checkpoint was written but whose export was not (a Ctrl-C or a crash in between) gets
    its export, and its sample, from `--resume`, the weights those of the checkpoint; then there is nothing to do."""
    out = tmp_path / "run"
    argv = ["train", *FAST[:-2], "--sample-tokens", "4", "--steps", "3", "--warmup", "1", "--out", out]
    assert run_cli(capsys, *argv)[0] == 0
    first = (out / "model" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "model")
    (out / "sample.txt").unlink()
    code, text, err = run_cli(capsys, "train", "--out", out, "--resume")
    assert code == 0 and "model is missing; writing it" in text, err
    assert (out / "model" / "model.safetensors").read_bytes() == first and (out / "sample.txt").read_text()
    code, text, _ = run_cli(capsys, "train", "--out", out, "--resume")
    assert code == 0 and "already trained to step 3; nothing to do" in text
    shutil.rmtree(out / "model")
    code, _, err = run_cli(capsys, "generate", "--model", out, "--prompt", "x")
    assert code == 2 and f"finish it with: cuengine train --resume --out {out}" in err, err


@needs_model
def test_out_dir_with_files_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = run_cli(capsys, "train", "--device", "cpu", "--out", tmp_path)
    assert code == 2 and "already holds files" in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@needs_model
@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt", "x"], "the following arguments are required: --model"),
        (["generate", "--model", "/nonexistent/m", "--prompt", "x"], "not a directory"),
        (["generate", "--model", ".", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be"),
        (["generate", "--model", ".", "--prompt", "x", "--weights", "int8"], "--weights: invalid choice: 'int8'"),
        (["bench", "--preset", "gpt5", "--device", "cpu"], "unknown preset 'gpt5'"),
        (["bench", "--preset", "tiny", "--seq-len", "9999", "--device", "cpu"], "--seq-len 9999 is longer"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_other_commands_bad_input(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_command_line_process_exit_code(tmp_path):
    """The real process: `python -m cuengine.cli` exits 2 with one line for bad input."""
    proc = cli_proc("train", "--device", "cpu", "--steps", "0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "cuengine train: error: --steps must be an integer >= 1, got 0\n"
    assert list(tmp_path.iterdir()) == []


def test_info_still_works(capsys):
    code, out, _ = run_cli(capsys, "info", "--device", "cpu")
    assert code == 0 and "device: cpu" in out and "numpy:" in out


# ---- no traceback, no stranded run, help and output (issue 14) ----------------------------------------
@needs_model
def test_resume_from_a_truncated_checkpoint_is_one_line_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    assert cli_proc("train", *FAST, "--steps", 4, "--stop-after", 2, "--out", run, cwd=tmp_path).returncode == 0
    weights = run / "checkpoint" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    proc = cli_proc("train", "--resume", "--out", run, "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("cuengine train: error: --resume: ") and "weights.safetensors" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_info_on_a_missing_gpu_is_one_line(tmp_path):
    import cuengine as ce

    if ce.cuda_available():
        pytest.skip("a CUDA device is present")
    proc = cli_proc("info", "--device", "cuda", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no CUDA device" in proc.stderr, proc.stderr


@needs_model
def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_resumes(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(Path(cli.__file__).parents[1]))
    cmd = [sys.executable, "-m", "cuengine.cli", "train", *FAST, "--steps", "2000", "--eval-every", "0", "--out", run]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ((run / "log.jsonl").is_file() and len((run / "log.jsonl").read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    steps = [r["step"] for r in read_log(run / "log.jsonl")]
    n = steps[-1]
    assert steps == list(range(1, n + 1)) and n < 2000
    assert f"interrupted after step {n} of 2000; checkpoint written" in err and "Traceback" not in err
    assert json.loads((run / "checkpoint" / "state.json").read_text())["extra"]["step"] == n
    proc = cli_proc("train", "--resume", "--out", run, "--device", "cpu", "--stop-after", n + 2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in read_log(run / "log.jsonl")] == list(range(1, n + 3))


@needs_model
def test_ctrl_c_in_the_last_step_lets_the_run_finish(tmp_path, monkeypatch, capsys):
    real_step = train_loop.optimizer_step

    def ctrl_c_at_step_3(model, *args):
        if model.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step: the step finishes
        return real_step(model, *args)

    monkeypatch.setattr(train_loop, "optimizer_step", ctrl_c_at_step_3)
    code, _, err = run_cli(capsys, "train", *FAST, "--steps", 3, "--warmup", 1, "--out", tmp_path / "last")
    assert code == 0 and (tmp_path / "last" / "model" / "config.json").is_file(), err
    code, _, err = run_cli(capsys, "train", *FAST, "--steps", 4, "--warmup", 1, "--out", tmp_path / "mid")
    assert code == 130 and "interrupted after step 3 of 4; checkpoint written" in err
    assert not (tmp_path / "mid" / "model").exists() and (tmp_path / "mid" / "checkpoint").is_dir()


@needs_model
def test_checkpoint_by_time_is_the_default_cadence(tmp_path, monkeypatch, capsys):
    saved = []
    monkeypatch.setattr(train_loop.Trainer, "save", lambda self: saved.append(self.step))
    assert run_cli(capsys, "train", *FAST, "--steps", 4, "--out", tmp_path / "a")[0] == 0
    assert json.loads((tmp_path / "a" / "run.json").read_text())["save_minutes"] == 10.0
    assert saved == [4]  # four quick steps: only the final checkpoint
    saved.clear()
    assert run_cli(capsys, "train", *FAST, "--steps", 4, "--save-minutes", 1e-9, "--out", tmp_path / "b")[0] == 0
    assert saved == [1, 2, 3, 4]
    saved.clear()
    assert run_cli(capsys, "train", *FAST, "--steps", 4, "--save-every", 3, "--out", tmp_path / "c")[0] == 0
    assert saved == [3, 4]


@needs_model
def test_a_run_without_a_checkpoint_can_be_started_again(tmp_path, monkeypatch, capsys):
    """A non-finite loss at step 2 leaves run.json and the log but no checkpoint: the same command,
    or --resume, starts it again instead of refusing the directory."""
    real_step = train_loop.optimizer_step

    def nan_at_step_2(model, *args):
        if model.step == 1:
            raise FloatingPointError("the loss is nan (non-finite); the update was skipped")
        return real_step(model, *args)

    run, argv = tmp_path / "run", ["train", *FAST, "--steps", 3, "--warmup", 1]
    monkeypatch.setattr(train_loop, "optimizer_step", nan_at_step_2)
    code, _, err = run_cli(capsys, *argv, "--out", run)
    assert code == 1 and "step 2: the loss is nan" in err and "no checkpoint yet; run it again" in err
    assert sorted(p.name for p in run.iterdir()) == ["log.jsonl", "run.json"]
    monkeypatch.setattr(train_loop, "optimizer_step", real_step)
    code, _, err = run_cli(capsys, *argv, "--out", run)
    assert code == 0, err
    first = read_log(run / "log.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3]
    monkeypatch.setattr(train_loop, "optimizer_step", nan_at_step_2)
    assert run_cli(capsys, *argv, "--out", tmp_path / "again")[0] == 1
    monkeypatch.setattr(train_loop, "optimizer_step", real_step)
    code, out, err = run_cli(capsys, "train", "--resume", "--out", tmp_path / "again", "--device", "cpu")
    assert code == 0 and "no checkpoint yet; starting the run again from step 0" in out, err
    assert [r["loss"] for r in read_log(tmp_path / "again" / "log.jsonl")] == [r["loss"] for r in first]


@needs_model
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch-size", 8], "--resume: --batch-size 8 differs from the run's 4"),
        (["--seq-len", 32], "--resume: --seq-len 32 differs from the run's 64"),
        (["--grad-accum", 2], "--resume: --grad-accum 2 differs from the run's 1"),
        (["--data", "{tmp}/other.txt"], "--resume: --data ['"),
    ],
)
def test_resume_keeps_data_and_batch_shape(tmp_path, capsys, argv, message):
    run = tmp_path / "run"
    (tmp_path / "other.txt").write_text("other text " * 500)
    assert run_cli(capsys, "train", *FAST, "--steps", 4, "--stop-after", 2, "--out", run)[0] == 0
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    argv = [str(a).format(tmp=tmp_path) for a in argv]
    code, _, err = run_cli(capsys, "train", "--resume", "--out", run, "--device", "cpu", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err and "keeps its data and batch shape" in err, err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    code, _, err = run_cli(capsys, "train", "--resume", "--out", run, "--device", "cpu", "--batch-size", 4)
    assert code == 0, err  # the same value again is fine


@needs_model
def test_plot_or_one_line_on_how_to_get_it(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "train", *FAST, "--steps", 2, "--warmup", 1, "--out", tmp_path / "r")
    assert code == 0
    if importlib.util.find_spec("matplotlib") is None:
        assert out.count("pip install 'cuengine[plot]'") == 1 and not (tmp_path / "r" / "log.png").exists()
    else:
        assert (tmp_path / "r" / "log.png").is_file() and "cuengine[plot]" not in out


@needs_model
def test_unreadable_tokenizer_is_an_error_not_bytes(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TransformerConfig.preset("tiny").to_hf_dict()))
    (model / "tokenizer.json").write_text("{not a tokenizer")
    for argv in (["train", "--device", "cpu", "--model", model, "--out", tmp_path / "r"],
                 ["generate", "--device", "cpu", "--model", model, "--prompt", "x"]):  # fmt: skip
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "tokenizer.json: not a readable tokenizer.json" in err, err
    assert not (tmp_path / "r").exists()


def test_every_option_shows_its_default():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == {"train", "generate", "bench", "info"}
    for name, sub in subs.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in formatter._expand_help(action), (name, action.option_strings)


def test_version_and_no_command(tmp_path):
    import cuengine

    proc = cli_proc("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == f"cuengine {cuengine.__version__}\n"
    proc = cli_proc(cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: cuengine") and proc.stderr == ""
    assert all(cmd in proc.stdout for cmd in ("train", "generate", "bench", "info"))
    proc = cli_proc("train", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "--save-minutes" in proc.stdout and "(default: 10.0)" in proc.stdout


@needs_model
def test_generate_from_a_run_directory_streams_and_reports_speed(trained, tmp_path):
    _, out = trained
    argv = ["generate", "--prompt", "def ", "--max-new-tokens", 8, "--device", "cpu", "--temperature", 0]
    by_run = cli_proc(*argv, "--model", out, cwd=tmp_path)
    by_model = cli_proc(*argv, "--model", out / "model", cwd=tmp_path)
    assert by_run.returncode == 0 and by_run.stdout == by_model.stdout and by_run.stdout.startswith("def ")
    speed = r"\[8 tokens in [0-9.]+ s, [0-9.]+ tokens/s; the first after [0-9.]+ s, then [0-9.]+ tokens/s\]\n"
    assert re.fullmatch(speed, by_run.stderr), by_run.stderr


@needs_model
@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x" * 250, "--max-new-tokens", 10], "--prompt of 250 tokens + --max-new-tokens 10 exceed"),
        (["--prompt", "x", "--top-p", 0], "--top-p must be in (0, 1]"),
    ],
)
def test_generate_bad_prompt(trained, capsys, argv, message):
    _, out = trained
    code, text, err = run_cli(capsys, "generate", "--model", out, "--device", "cpu", *argv)
    assert code == 2 and text == "" and err.count("\n") == 1 and message in err, err


@needs_model
def test_files_follow_the_umask(tmp_path):
    proc = cli_proc("train", *FAST, "--steps", 2, "--warmup", 1, "--out", tmp_path / "r", cwd=tmp_path,
                    preexec_fn=lambda: os.umask(0o027))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "r").rglob("*")}
    assert modes["r/checkpoint"] == modes["r/model"] == 0o750
    assert modes["r/checkpoint/weights.safetensors"] == modes["r/model/model.safetensors"] == 0o640
    assert set(modes.values()) == {0o750, 0o640}, modes


def test_the_wheel_holds_every_package():
    """pyproject lists the packages by name: a new sub-package missing there installs from a source
    tree (-e) but breaks `import cuengine` from a wheel. The package never reads tools/ either."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(cli.__file__).parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "cuengine").rglob("__init__.py")}
    assert found | {"cuengine.raw_kernels"} == listed
    assert not [p for p in (root / "cuengine").rglob("*.py") if '"tools"' in p.read_text()]


def test_test_command_output_has_no_skip_lines(tmp_path):
    """The README's test command (its pytest options, under this project's settings): skips are
    counted in the summary line, not listed one line each (without a GPU there are many)."""
    pytest.importorskip("xdist")  # the command's -n needs pytest-xdist (the "test" extra)
    root = Path(cli.__file__).parents[1]
    readme = (root / "README.md").read_text()
    command = readme.split("Install and run the tests", 1)[1].split("```")[1].strip()
    options = command.split("-m pytest", 1)[1].split()
    assert "-q" in options, command
    (tmp_path / "test_skips.py").write_text("import pytest\n\n\n@pytest.mark.parametrize('i', range(5))\n"
                                            "def test_gpu(i):\n    pytest.skip('no CUDA device')\n")  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", *options, "-p", "no:cacheprovider", "-c", root / "pyproject.toml",
           tmp_path / "test_skips.py"]  # fmt: skip
    proc = subprocess.run(list(map(str, cmd)), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "5 skipped" in proc.stdout and "no CUDA device" not in proc.stdout, proc.stdout


def test_resume_of_a_run_from_before_delayed_scaling_keeps_current_scaling(tmp_path):
    """A run.json written before fp8_amax_history existed ran FP8 with current scaling: its resume keeps that
    recipe, where today's default (delayed) would change the numerics mid-run; a newer run.json, a value given
    again and a fresh run take theirs."""
    from cuengine import cli_train

    def resolve(*argv, saved=None):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        if saved is not None:
            (out / cli_train.RUN_FILE).write_text(json.dumps(saved))
        args = cli.build_parser().parse_args(["train", "--out", str(out), *argv])
        return cli_train._resolve(args, "cuda")["fp8_amax_history"]

    old = {"preset": "tiny", "batch_size": 4, "seq_len": 64, "matmul_dtype": "e4m3"}
    assert resolve("--resume", saved=old) == 0
    assert resolve("--resume", saved={**old, "fp8_amax_history": None}) is None
    assert resolve("--resume", "--fp8-amax-history", "16", saved=old) == 16
    assert resolve() is None
