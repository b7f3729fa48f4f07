"""The `cuengine` command line: train, generate, bench, info.

`cuengine train` with no arguments trains a small model on the Python standard library's own
source (byte tokens, nothing to download) and writes a checkpoint, a JSON-lines log, the exported
weights and a generated sample into `runs/<timestamp>`. Bad input (a missing or corrupt file, a
token outside the vocabulary, a seq-len the model cannot take, a bad number) is reported in one
line on stderr with exit code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

H200_BF16_DENSE_FLOPS = 989e12  # MFU denominator: H100/H200 SXM dense BF16 peak
CHECKPOINT = "checkpoint"  # sub-directories and files of a run's --out
EXPORT = "model"
RUN_FILE = "run.json"
SAMPLE_FILE = "sample.txt"
LOG_FILE = "log.jsonl"

# Default run per device kind: a tiny model for the NumPy twins on a few cores, a small one on a GPU.
# fmt: off
DEVICE_DEFAULTS = {
    "cpu": dict(preset="tiny", batch_size=16, seq_len=256, steps=600, lr=3e-3, warmup=30, dtype="fp32",
                eval_every=200, eval_batches=4, sample_tokens=200),
    "cuda": dict(preset="small", batch_size=16, seq_len=1024, steps=500, lr=1e-3, warmup=50, dtype="bf16",
                 eval_every=100, eval_batches=16, sample_tokens=500),
}
# "small": a Qwen2-like shape (25M parameters at vocab 256) that suits the default corpus on a GPU.
SMALL_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_q_heads=8, num_kv_heads=4,
                   head_size=64, max_position_embeddings=1024)
# Run settings that a --resume takes from the run's run.json unless given again.
RUN_KEYS = ("model", "preset", "data", "val_data", "batch_size", "seq_len", "grad_accum", "steps", "lr", "min_lr",
            "warmup", "schedule", "dtype", "matmul_dtype", "grad_dtype", "recompute", "offload_residual",
            "cuda_graphs", "lmhead_chunks", "weight_decay", "grad_clip", "seed", "eval_every", "eval_batches",
            "save_every", "log", "sample_tokens")
# fmt: on
RECOMPUTE = ("rmsnorm", "qkv", "att", "ffn", "swiglu", "block")


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, nothing written."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


# ---- small helpers ------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("cuengine", "numpy", "ml-dtypes", "safetensors", "cupy-cuda13x", "nvmath-python", "cuda-bindings",
                "nvidia-cudnn-frontend"):  # fmt: skip
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _device(name):
    import cuengine as ce

    try:
        return ce.device(name)
    except (ValueError, RuntimeError) as err:
        raise UsageError(str(err)) from None


class Unavailable(RuntimeError):
    """A part of the engine this command needs does not import: one line on stderr, exit code 1."""


def _model_api():
    """(TransformerConfig, TrainOptions, LlamaModel), or Unavailable naming what failed to import."""
    try:
        from .model import LlamaModel, TrainOptions, TransformerConfig
    except ImportError as err:
        raise Unavailable(f"the model does not import in this build ({err})") from None
    return TransformerConfig, TrainOptions, LlamaModel


def _load_config(model_dir, preset):
    """The model's config from a HF directory, or a named preset ("small" is the default cuda shape)."""
    TransformerConfig = _model_api()[0]
    if model_dir is not None:
        path = Path(model_dir)
        if not path.is_dir():
            raise UsageError(f"--model {model_dir}: not a directory")
        try:
            return TransformerConfig.from_pretrained(path)
        except (OSError, ValueError) as err:  # missing/unreadable config.json, bad JSON, unsupported field
            raise UsageError(f"--model {model_dir}: {err}") from None
    if preset == "small":
        return TransformerConfig.preset("tiny-hs64").replace(**SMALL_SHAPE)
    try:
        return TransformerConfig.preset(preset)
    except ValueError as err:
        raise UsageError(f"--preset: {err} or 'small'") from None


def _check_numbers(args, spec):
    """`spec`: {name: (minimum, integer?)}; None values are skipped (filled in later)."""
    for name, (lo, integer) in spec.items():
        v = getattr(args, name, None)
        if v is None:
            continue
        flag = "--" + name.replace("_", "-")
        if integer and (not isinstance(v, int) or v < lo):
            raise UsageError(f"{flag} must be an integer >= {lo}, got {v}")
        if not integer and (not math.isfinite(v) or v < lo):
            raise UsageError(f"{flag} must be a finite number >= {lo}, got {v}")


def lr_at(step: int, total: int, lr: float, min_lr: float, warmup: int, schedule: str) -> float:
    """Learning rate of 0-based `step` of `total`: linear warm-up over `warmup` steps, then
    `schedule` ("cosine", "linear" or "constant") from `lr` towards `min_lr`, which it would reach
    one step after the last (as llm.c does: the last step still learns)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    frac = (step - warmup) / max(total - warmup, 1)
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _memory_bytes(dev) -> int:
    """Device memory in use on cuda; peak resident memory of this process on cpu."""
    if dev.is_cuda:
        free, total = dev.memory_info()
        return total - free
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- sampling -----------------------------------------------------------------------------------
def sample_next(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """One token from a (V,) logits row: argmax at temperature 0, else softmax(logits / temperature)
    over the `top_k` largest (0 = all)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    if 0 < top_k < logits.size:
        keep = np.argpartition(logits, -top_k)[-top_k:]
    else:
        keep = np.arange(logits.size)
    z = logits[keep] / temperature
    p = np.exp(z - z.max())
    return int(keep[rng.choice(keep.size, p=p / p.sum())])


def generate_tokens(model, prompt, n_new: int, T: int, temperature: float, top_k: int, seed: int,
                    vocab_limit: int | None = None) -> list[int]:  # fmt: skip
    """Sample `n_new` tokens after `prompt` through `model.logits` on the model's fixed run state.

    The context is cropped to its last T tokens (T at most the run state's); `model.logits` pads
    it to the run state's shape, which causal attention makes harmless to the real positions.
    `vocab_limit` restricts sampling to the first ids (a byte tokenizer on a larger vocabulary).
    """
    rng = np.random.default_rng(seed)
    ctx = [int(t) for t in prompt]
    out = []
    for _ in range(n_new):
        window = np.asarray([ctx[-T:]], np.int32)  # (1, t)
        row = model.logits(window)[0, -1]  # (V,)
        token = sample_next(row[:vocab_limit] if vocab_limit else row, temperature, top_k, rng)
        ctx.append(token)
        out.append(token)
    return out


# ---- train --------------------------------------------------------------------------------------
def _resolve(args, dev_kind: str) -> dict:
    """The run settings: command line, else the resumed run's run.json, else the device defaults."""
    saved = {}
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            raise UsageError("--resume needs --out, the directory of the run to continue")
        if not (out / RUN_FILE).is_file() or not (out / CHECKPOINT).is_dir():
            raise UsageError(f"--resume: no checkpoint to continue in {out} (expected {RUN_FILE} and {CHECKPOINT}/)")
        try:
            saved = json.loads((out / RUN_FILE).read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"--resume: {out / RUN_FILE} is unreadable ({err})") from None
    defaults = dict(DEVICE_DEFAULTS[dev_kind], grad_accum=1, min_lr=0.0, schedule="cosine", recompute=[],
                    offload_residual=False, cuda_graphs=False, lmhead_chunks=1, weight_decay=0.1, grad_clip=1.0,
                    seed=0, save_every=0, model=None, data=None, val_data=None, matmul_dtype=None,
                    grad_dtype=None, log=None)  # fmt: skip
    run = {}
    for key in RUN_KEYS:
        given = getattr(args, key)
        run[key] = given if given is not None and given != [] else saved.get(key, defaults[key])
    if args.warmup is None and "warmup" not in saved and isinstance(run["steps"], int):
        run["warmup"] = min(run["warmup"], run["steps"] // 5)  # a short run keeps most steps past warm-up
    if run["model"] is not None:
        run["preset"] = None
    return run


def _open_data(run, tokenizer):
    """(train, val) token sources, checked; raises UsageError for any bad data."""
    from . import data

    try:
        if run["data"] is None:
            train, val = data.stdlib_sources(seed=run["seed"])
        else:
            train = data.open_source(run["data"], tokenizer, seed=run["seed"])
            if run["val_data"] is None:
                train, val = train.split(0.05)
        if run["val_data"] is not None:
            val = data.open_source(run["val_data"], tokenizer, seed=run["seed"], shuffle=False)
    except data.DataError as err:
        raise UsageError(str(err)) from None
    return train, val


def _data_vocab(train) -> int:
    """Vocabulary for a preset model trained on `train`: the format's, else max id + 1, padded to 128."""
    v = train.vocab_size or train.token_range()[1] + 1
    return v if v == 256 else -(-v // 128) * 128


def _import_weights(model, model_dir) -> None:
    """Load a model directory's safetensors; a missing, corrupt or misshapen file is bad input."""
    from safetensors import SafetensorError

    try:
        model.import_weights(model_dir, allow_cast=True)  # e.g. bf16 files into an fp32 run on cpu
    except (OSError, ValueError, SafetensorError) as err:
        raise UsageError(f"--model {model_dir}: {err}") from None


def _train_options(run, cfg):
    TrainOptions = _model_api()[1]
    kw = {f"recompute_{r}": True for r in run["recompute"]}
    opts = TrainOptions(model_dtype=run["dtype"], matmul_dtype=run["matmul_dtype"], grad_dtype=run["grad_dtype"],
                        offload_residual=run["offload_residual"], use_cuda_graphs=run["cuda_graphs"],
                        lmhead_chunks=run["lmhead_chunks"], weight_decay=run["weight_decay"],
                        grad_clip=run["grad_clip"], seed=run["seed"], **kw)  # fmt: skip
    try:
        return opts.resolved(cfg.dtype)
    except ValueError as err:
        raise UsageError(str(err)) from None


SCHEDULE_KEYS = ("steps", "lr", "min_lr", "warmup", "schedule")


def _prepare_train(args):
    """Everything a run needs, checked before anything is written:
    (run settings, out dir, device, model, train source, val source, tokenizer, checkpoint extra)."""
    from . import data

    _check_numbers(args, _TRAIN_NUMBERS)
    dev = _device(args.device)
    run = _resolve(args, dev.kind)
    ns = argparse.Namespace(**run)
    _check_numbers(ns, _TRAIN_NUMBERS)
    if run["warmup"] >= run["steps"] and run["schedule"] != "constant":
        raise UsageError(f"--warmup {run['warmup']} must be below --steps {run['steps']}")
    if run["lr"] <= 0:
        raise UsageError(f"--lr must be > 0, got {run['lr']}")
    if run["min_lr"] > run["lr"]:
        raise UsageError(f"--min-lr {run['min_lr']} is above --lr {run['lr']}")
    if args.stop_after is not None and not 1 <= args.stop_after <= run["steps"]:
        raise UsageError(f"--stop-after must be in [1, --steps {run['steps']}], got {args.stop_after}")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if not args.resume and out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} already holds files; continue it with --resume or choose another --out")

    cfg = _load_config(run["model"], run["preset"])
    try:
        tokenizer = data.load_tokenizer(run["model"])
    except data.DataError as err:
        raise UsageError(str(err)) from None
    train, val = _open_data(run, tokenizer)
    if run["model"] is None:
        cfg = cfg.replace(vocab_size=_data_vocab(train))
    T = run["seq_len"]
    if T > cfg.max_position_embeddings:
        raise UsageError(
            f"--seq-len {T} is longer than the model allows (max_position_embeddings {cfg.max_position_embeddings})"
        )
    try:
        for src in (train, val):  # a format's own vocabulary is checked too: it catches corrupt shards
            if src.vocab_size is not None and src.vocab_size < cfg.vocab_size:
                src.check_vocab(src.vocab_size, "its format's")
            src.check_vocab(cfg.vocab_size)
            src.check_seq_len(T)
    except data.DataError as err:
        raise UsageError(str(err)) from None

    opts = _train_options(run, cfg)
    LlamaModel = _model_api()[2]
    model = LlamaModel(cfg, opts, dev)
    if run["model"] is not None:
        _import_weights(model, run["model"])
    else:
        model.init_weights(seed=run["seed"])
    try:
        model.allocate_run_state(run["batch_size"], T)
    except ValueError as err:  # e.g. --lmhead-chunks that does not divide B*T
        raise UsageError(str(err)) from None
    extra = None
    if args.resume:
        try:
            extra = model.load_checkpoint(out / CHECKPOINT)
            train.load_state(extra["data"])
        except (ValueError, KeyError) as err:  # another model or data than the checkpoint's
            raise UsageError(f"--resume: {out / CHECKPOINT}: {err}") from None
        for key in SCHEDULE_KEYS:  # the checkpoint's schedule, unless given again
            if getattr(args, key) is None:
                run[key] = extra["schedule"][key]
    return run, out, dev, model, train, val, tokenizer, extra


class _Progress:
    """The progress line: step, loss, lr, tokens/s, MFU (cuda), memory, validation loss.

    On a terminal it is rewritten in place every step; otherwise printed every `every` steps.
    Throughput is averaged over the steps since the last line (the last 10 on a terminal), so a
    single slow step (a shared machine, a checkpoint) does not dominate what is shown.
    """

    def __init__(self, total: int, every: int, tokens_per_step: int, flops_per_token: float | None):
        self.tty = sys.stdout.isatty()
        self.total = total
        self.every = every or (1 if self.tty else max(total // 20, 1))
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.times: list[float] = []
        self.width = 0

    def show(self, rec: dict, seconds: float) -> None:
        step = rec["step"]
        self.times = self.times[-9:] + [seconds] if self.tty else self.times + [seconds]
        keep = "val_loss" in rec or step == self.total
        if not (self.tty or keep or step % self.every == 0):
            return
        tok_s = self.tokens_per_step * len(self.times) / sum(self.times)
        line = f"step {step:>{len(str(self.total))}}/{self.total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
        line += f"{_human(tok_s)} tok/s"
        if self.flops_per_token is not None:
            line += f" | MFU {100 * self.flops_per_token * tok_s / H200_BF16_DENSE_FLOPS:.1f}%"
        line += f" | mem {rec['memory'] / 2**30:.2f} GiB"
        if "val_loss" in rec:
            line += f" | val {rec['val_loss']:.4f}"
        if self.tty:
            pad = max(self.width - len(line), 0)
            self.width = 0 if keep else len(line)  # a kept line ends with a newline: nothing to cover
            print("\r" + line + " " * pad, end="\n" if keep else "", flush=True)
        else:
            print(line, flush=True)
            self.times = []


def _evaluate(model, val, B, T, batches) -> float:
    val.reset()
    return float(np.mean([model.validate(*val.batch(B, T)) for _ in range(batches)]))


def _plot(log_path: Path) -> None:
    """loss.png beside the log, when matplotlib is installed (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=log_path.parent.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(log_path.with_suffix(".png"), dpi=100)
    plt.close(fig)


def _step(model, train, B: int, T: int, accum: int, lr: float) -> float:
    """One optimizer step over `accum` micro-batches; the mean loss. Raises FloatingPointError
    (before the update) on a non-finite loss."""
    if accum == 1:
        return model.train_step(*train.batch(B, T), lr=lr)
    for micro in range(accum):
        x, y = train.batch(B, T)
        model.forward(x)
        model.backward(x, y, micro_step=micro, grad_accum_steps=accum)
    # The per-token losses accumulate over the micro-steps; the model has no public reader yet.
    loss = model.loss_sum() / (B * T * accum)
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} (non-finite); the update was skipped")
    model.update(lr=lr)
    return loss


def _save(model, out: Path, step: int, train, run) -> None:
    """The checkpoint, with what a resumed run needs to give the same batches and learning rates."""
    schedule = {k: run[k] for k in SCHEDULE_KEYS}
    model.save_checkpoint(out / CHECKPOINT, extra={"step": step, "data": train.state(), "schedule": schedule})


def cmd_train(args) -> int:
    run, out, dev, model, train, val, tokenizer, extra = _prepare_train(args)
    B, T, accum, total = run["batch_size"], run["seq_len"], run["grad_accum"], run["steps"]
    start = extra["step"] if extra else 0
    stop = args.stop_after or total
    if start >= stop:
        print(f"{out}: already trained to step {start}; nothing to do")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
    log_path = Path(run["log"]) if run["log"] else out / LOG_FILE
    kept = []
    if args.resume and log_path.is_file():  # drop what ran after the checkpoint, it runs again
        kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= start]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("".join(line + "\n" for line in kept))

    n_params = model.num_parameters()
    flops_tok = model.flops_per_token(T)
    print(f"cuengine train: {dev.name}, {n_params / 1e6:.2f}M parameters, {model.cfg.num_layers} layers, "
          f"B={B} T={T} grad_accum={accum}, {total} steps; data {train.name} ({train.num_tokens:,} tokens), "
          f"out {out}", flush=True)  # fmt: skip
    progress = _Progress(total, args.print_every, B * T * accum, flops_tok if dev.is_cuda else None)
    step = start
    with log_path.open("a") as log:
        for step in range(start + 1, stop + 1):
            lr = lr_at(step - 1, total, run["lr"], run["min_lr"], run["warmup"], run["schedule"])
            t0 = time.perf_counter()
            try:
                loss = _step(model, train, B, T, accum, lr)
            except FloatingPointError as err:
                print(f"\ncuengine train: step {step}: {err}; stopping (the last checkpoint is kept)", file=sys.stderr)
                return 1
            dt = time.perf_counter() - t0
            rec = {"step": step, "loss": loss, "lr": lr, "tokens": step * B * T * accum,
                   "tok_per_s": B * T * accum / dt, "ms": dt * 1e3, "memory": _memory_bytes(dev)}  # fmt: skip
            if dev.is_cuda:
                rec["mfu"] = flops_tok * rec["tok_per_s"] / H200_BF16_DENSE_FLOPS
            if (run["eval_every"] and step % run["eval_every"] == 0) or step == total:
                rec["val_loss"] = _evaluate(model, val, B, T, run["eval_batches"])
            log.write(json.dumps(rec) + "\n")
            log.flush()
            progress.show(rec, dt)
            if (run["save_every"] and step % run["save_every"] == 0) or step == stop:
                _save(model, out, step, train, run)
    _plot(log_path)
    if step < total:
        print(f"stopped after step {step} of {total}; continue with: cuengine train --resume --out {out}")
        return 0
    _export(model, out, run)
    if run["sample_tokens"]:
        cfg = model.cfg
        del model  # the training buffers go before the sampler's are allocated
        gc.collect()
        _write_sample(out, run, cfg, dev, val, tokenizer)
    return 0


def _export(model, out: Path, run) -> None:
    """HF weights (and the tokenizer) into <out>/model, so `cuengine generate --model` reads them."""
    model.export_weights(out / EXPORT)
    if run["model"] is not None and (Path(run["model"]) / "tokenizer.json").is_file():
        shutil.copy(Path(run["model"]) / "tokenizer.json", out / EXPORT / "tokenizer.json")
    print(f"wrote {out / CHECKPOINT}/ and {out / EXPORT}/")


def _sampler(model_dir, cfg, dtype, dev, T: int):
    """A model read from `model_dir` with a (1, T) run state: one row per forward instead of the
    training batch's B, for generation."""
    _, TrainOptions, LlamaModel = _model_api()
    model = LlamaModel(cfg, TrainOptions(model_dtype=dtype), dev)
    _import_weights(model, model_dir)
    model.allocate_run_state(1, T)
    return model


def _write_sample(out: Path, run, cfg, dev, val, tokenizer) -> None:
    """<out>/sample.txt: the first tokens of the validation data, continued by the exported model."""
    prompt = np.asarray(val.shards[0][: min(32, run["seq_len"] // 2)], np.int32)
    T = min(run["seq_len"], len(prompt) + run["sample_tokens"])
    model = _sampler(out / EXPORT, cfg, run["dtype"], dev, T)
    limit = tokenizer.vocab_size if tokenizer.vocab_size < cfg.vocab_size else None
    new = generate_tokens(model, prompt, run["sample_tokens"], T, 0.8, 40, run["seed"], limit)
    text = tokenizer.decode([*prompt, *new])
    (out / SAMPLE_FILE).write_text(text + "\n", encoding="utf-8")
    print(f"--- sample ({out / SAMPLE_FILE}) ---\n{text}\n---")


_TRAIN_NUMBERS = {
    "batch_size": (1, True), "seq_len": (1, True), "grad_accum": (1, True), "steps": (1, True),
    "lr": (0.0, False), "min_lr": (0.0, False), "warmup": (0, True), "eval_every": (0, True),
    "eval_batches": (1, True), "save_every": (0, True), "lmhead_chunks": (1, True), "weight_decay": (0.0, False),
    "grad_clip": (0.0, False), "seed": (0, True), "stop_after": (1, True), "print_every": (0, True),
    "sample_tokens": (0, True),
}  # fmt: skip


# ---- generate -----------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from . import data

    _check_numbers(args, {"max_new_tokens": (1, True), "temperature": (0.0, False), "top_k": (0, True),
                          "seed": (0, True), "window": (1, True)})  # fmt: skip
    dev = _device(args.device)
    cfg = _load_config(args.model, None)
    try:
        tokenizer = data.load_tokenizer(args.model)
    except data.DataError as err:
        raise UsageError(str(err)) from None
    prompt = tokenizer.encode(args.prompt)
    if prompt.size == 0:
        raise UsageError("--prompt is empty")
    if prompt.max() >= cfg.vocab_size:
        raise UsageError(f"--prompt: token id {prompt.max()} is >= the model's vocab_size {cfg.vocab_size}")
    T = min(args.window or cfg.max_position_embeddings, cfg.max_position_embeddings, prompt.size + args.max_new_tokens)
    model = _sampler(args.model, cfg, args.dtype, dev, T)
    limit = tokenizer.vocab_size if tokenizer.vocab_size < cfg.vocab_size else None
    new = generate_tokens(model, prompt, args.max_new_tokens, T, args.temperature, args.top_k, args.seed, limit)
    print(tokenizer.decode([*prompt, *new]))
    return 0


# ---- bench --------------------------------------------------------------------------------------
def _bench_tool():
    """`bench_engine` of tools/bench_train.py when running from a source tree (tools/ is not
    installed with the package), else None."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_train.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("cuengine_tools_bench_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, "bench_engine", None)


def _print_report(report, full: bool) -> None:
    """The memory report by context; with `full`, also every named buffer."""
    print(str(report) if full else str(report).split("\n\n")[0])


def cmd_bench(args) -> int:
    _check_numbers(args, {"batch_size": (1, True), "seq_len": (1, True), "steps": (1, True), "warmup": (0, True)})
    dev = _device(args.device)
    preset = args.preset or ("qwen2.5-0.5b" if dev.is_cuda else "tiny")
    cfg = _load_config(None, preset)
    B, T = args.batch_size, args.seq_len or min(1024, cfg.max_position_embeddings)
    if T > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len {T} is longer than the model allows "
                         f"(max_position_embeddings {cfg.max_position_embeddings})")  # fmt: skip
    _, TrainOptions, LlamaModel = _model_api()
    extra = {f"recompute_{r}": True for r in args.recompute}
    if args.dtype:
        extra["model_dtype"] = args.dtype
    if args.grad_dtype:
        extra["grad_dtype"] = args.grad_dtype
    opts = TrainOptions(matmul_dtype=args.matmul_dtype, use_cuda_graphs=bool(args.cuda_graphs), **extra)
    try:
        opts = opts.resolved(cfg.dtype)
    except ValueError as err:
        raise UsageError(str(err)) from None
    label = f"{preset} B={B} T={T} {opts.model_dtype}/{opts.matmul_dtype}"
    bench_engine = _bench_tool() if dev.is_cuda else None
    if bench_engine is not None:  # the project's measurement: CUDA graphs, events between step starts
        r = bench_engine(preset, "fp8" if opts.fp8 else "bf16", B, T, args.steps, args.warmup, extra)
        print(f"{label} on {dev.name} (tools/bench_train.py, CUDA graphs): median step {r['ms']:.2f} ms, "
              f"{_human(r['tok_s'])} tok/s, MFU {100 * r['mfu']:.1f}% of 989 TFLOP/s, "
              f"{r['mem_gib']:.2f} GiB")  # fmt: skip
        _print_report(r["report"], args.report)
        return 0
    model = LlamaModel(cfg, opts, dev)
    model.init_weights(seed=0)
    model.allocate_run_state(B, T)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])
    times = []
    for i in range(args.warmup + args.steps):
        dev.synchronize()
        t0 = time.perf_counter()
        model.train_step(x, y, lr=1e-5)
        dev.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(times))
    tok_s = B * T / (ms / 1e3)
    line = (f"{label} on {dev.name}: {model.num_parameters() / 1e6:.1f}M parameters, median step {ms:.2f} ms "
            f"over {args.steps} steps, {_human(tok_s)} tok/s")  # fmt: skip
    if dev.is_cuda:
        line += f", MFU {100 * model.flops_per_token(T) * tok_s / H200_BF16_DENSE_FLOPS:.1f}% of 989 TFLOP/s"
    print(line)
    _print_report(model.memory_report(), args.report)
    return 0


# ---- info ---------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    import cuengine as ce

    dev = ce.device(args.device)
    print(f"device: {dev.kind} - {dev.name}")
    if dev.is_cuda:
        print(f"compute capability: {dev.compute_capability[0]}.{dev.compute_capability[1]}, SMs: {dev.num_sms}")
    free, total = dev.memory_info()
    print(f"memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    for pkg, ver in _versions().items():
        print(f"{pkg}: {ver}")
    return 0


# ---- parser -------------------------------------------------------------------------------------
def _engine_flags(p, resume_defaults: bool) -> None:
    """--dtype, --matmul-dtype, --grad-dtype, --recompute, --cuda-graphs (train and bench)."""
    d = None if resume_defaults else False
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="weights/activations dtype (cpu default fp32)")
    p.add_argument("--matmul-dtype", choices=("bf16", "fp32", "e4m3"), help="block matmul operands; e4m3 = FP8")
    p.add_argument("--grad-dtype", choices=("e4m3", "e5m2"), help="FP8 dtype of the activation gradients")
    p.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=[], metavar="PART",
                   help=f"recompute these activations in backward: {', '.join(RECOMPUTE)}")  # fmt: skip
    p.add_argument("--cuda-graphs", action="store_true", default=d, help="capture and replay each block")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cuengine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: a small one on the stdlib sources, no download)")
    g = t.add_argument_group("model")
    g.add_argument("--model", metavar="DIR", help="HF model dir: config.json, *.safetensors, tokenizer.json")
    g.add_argument("--preset", help="a named shape when no --model: tiny, small, qwen2.5-0.5b, ... (default by device)")
    g = t.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="FILE",
                   help="text file (byte tokens or the model's tokenizer), .npy token ids, or llm.c .bin shards "
                        "(paths or globs); default: the Python standard library's sources")  # fmt: skip
    g.add_argument("--val-data", nargs="+", metavar="FILE", help="validation data (default: 5%% held out)")
    g = t.add_argument_group("batching")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    g.add_argument("--steps", type=int, help="optimizer steps of the whole run (sets the schedule)")
    g = t.add_argument_group("schedule")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, help="the floor the schedule decays towards (default 0)")
    g.add_argument("--warmup", type=int, help="linear warm-up steps")
    g.add_argument("--schedule", choices=("cosine", "linear", "constant"))
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip; 0 disables")
    g = t.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    _engine_flags(g, resume_defaults=True)
    g.add_argument("--offload-residual", action="store_true", default=None, help="keep residuals in host memory")
    g.add_argument("--lmhead-chunks", type=int, help="split the LM head and loss into chunks (saves memory)")
    g = t.add_argument_group("run")
    g.add_argument("--out", metavar="DIR", help="run directory (default runs/<timestamp>)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    g.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end this invocation after STEP (with a checkpoint) without changing the schedule")  # fmt: skip
    g.add_argument("--seed", type=int)
    g.add_argument("--log", metavar="FILE", help="JSON-lines log, one line per step (default <out>/log.jsonl)")
    g.add_argument("--eval-every", type=int, help="validation every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, help="batches per validation")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--print-every", type=int, default=0, help="progress line every N steps (0: auto)")
    g.add_argument("--sample-tokens", type=int, help="tokens of the sample generated at the end (0: none)")
    t.set_defaults(fn=cmd_train)

    gen = sub.add_parser("generate", help="sample text from a model directory")
    gen.add_argument("--model", metavar="DIR", required=True, help="HF model dir (e.g. <train --out>/model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="0 = the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--window", type=int, help="context tokens per forward (default: prompt + new, capped)")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", choices=("bf16", "fp32"))
    gen.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="time train_step for a named preset")
    b.add_argument("--preset", help="a model shape (default: qwen2.5-0.5b on cuda, tiny on cpu)")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--seq-len", type=int, help="default: 1024, or the preset's maximum if smaller")
    b.add_argument("--steps", type=int, default=20, help="timed steps")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    b.add_argument("--device", default="auto")
    b.add_argument("--report", action="store_true", help="print every named buffer of the memory report")
    _engine_flags(b, resume_defaults=False)
    b.set_defaults(fn=cmd_bench)

    info = sub.add_parser("info", help="print the device, library versions and memory")
    info.add_argument("--device", default="auto")
    info.set_defaults(fn=cmd_info)
    return p


def main(argv=None) -> int:
    """Run one command; returns its exit code (2 for bad input, reported in one line on stderr)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = parser.parse_args(argv)
        return args.fn(args)
    except UsageError as err:
        print(f"cuengine {command or ''}: error: {err}".replace("  ", " "), file=sys.stderr)
        return 2
    except Unavailable as err:
        print(f"cuengine {command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
