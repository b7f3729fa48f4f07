"""`cuengine train`: a run directory around `cuengine.train.Trainer`.

The settings come from the command line, else (on --resume) the run's run.json, else the
defaults of the device kind. Everything is checked before anything is written; then the run
writes run.json, a JSON-lines log, checkpoints, the exported model and a generated sample.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ._cli_util import (
    UsageError,
    check_numbers,
    engine_flags,
    human,
    load_config,
    model_api,
    model_tokenizer,
    open_device,
    read_weights,
    recompute_options,
    token_stream,
)
from .benchmark import mfu
from .device import cuda_device_count
from .train import Schedule, Trainer

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
TRAIN_DEFAULTS = dict(grad_accum=1, min_lr=0.0, schedule="cosine", memory="default", recompute=[],
                      offload_residual=False, cuda_graphs=False, lmhead_chunks=None, weight_decay=0.1, grad_clip=1.0,
                      z_loss=0.0, seed=0,
                      save_every=0, save_minutes=10.0, model=None, data=None, val_data=None, matmul_dtype=None,
                      grad_dtype=None, log=None, optimizer="adamw", lmhead_fp8=False, nondeterministic_attention=False,
                      fp8_amax_history=None)
# Run settings that a --resume takes from the run's run.json unless given again.
RUN_KEYS = ("model", "preset", "data", "val_data", "batch_size", "seq_len", "grad_accum", "steps", "lr", "min_lr",
            "warmup", "schedule", "dtype", "matmul_dtype", "grad_dtype", "memory", "recompute", "offload_residual",
            "cuda_graphs", "lmhead_chunks", "weight_decay", "grad_clip", "z_loss", "seed", "eval_every", "eval_batches",
            "save_every", "save_minutes", "log", "sample_tokens", "optimizer", "lmhead_fp8",
            "nondeterministic_attention", "fp8_amax_history")
# fmt: on
# What a run whose run.json predates a setting ran with, where that is not today's default: resuming it keeps
# its recipe. fp8_amax_history: FP8 runs scaled every tensor from its own abs-max (0) before delayed
# scaling became the default.
BEFORE_THE_SETTING = {"fp8_amax_history": 0}
# A resumed run sees the batches the uninterrupted run would: these may not change on --resume.
FIXED_ON_RESUME = ("data", "batch_size", "seq_len", "grad_accum")
RESUME_RULE = """\
--resume continues the run in --out from its checkpoint, or from step 0 when it has none. Options
not given again take the run's values (run.json). The schedule and the cadences may change; --data,
--batch-size, --seq-len and --grad-accum may not, so that a resumed run sees the batches of the
uninterrupted one (to train on other data, start a new run with --model <run>/model). Ctrl-C ends
a run after the current step with a checkpoint."""
SCHEDULE_KEYS = ("steps", "lr", "min_lr", "warmup", "schedule")

_TRAIN_NUMBERS = {
    "batch_size": (1, True), "seq_len": (1, True), "grad_accum": (1, True), "steps": (1, True),
    "lr": (0.0, False), "min_lr": (0.0, False), "warmup": (0, True), "eval_every": (0, True),
    "eval_batches": (1, True), "save_every": (0, True), "save_minutes": (0.0, False), "lmhead_chunks": (1, True),
    "weight_decay": (0.0, False), "grad_clip": (0.0, False), "z_loss": (0.0, False), "seed": (0, True),
    "stop_after": (1, True),
    "print_every": (0, True), "sample_tokens": (0, True), "gpus": (1, True),
}  # fmt: skip
_COMM = None  # this process's communicator when `--gpus N` made it one of N ranks (see _train_on_gpus)


def _restartable(out: Path) -> bool:
    """A run directory that never wrote a checkpoint (a non-finite loss or a crash before the
    first): only its own run.json, log and plot, or a checkpoint write that did not finish."""
    return not (out / CHECKPOINT).exists() and all(
        p.name in (RUN_FILE, LOG_FILE, "log.png") or p.name.startswith(f".{CHECKPOINT}.") for p in out.iterdir()
    )


def _resolve(args, dev_kind: str) -> dict:
    """The run settings: command line, else the resumed run's run.json, else the defaults."""
    saved = {}
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            raise UsageError("--resume needs --out, the directory of the run to continue")
        if not (out / RUN_FILE).is_file():
            raise UsageError(f"--resume: no checkpoint to continue in {out} (no {RUN_FILE})")
        try:
            saved = json.loads((out / RUN_FILE).read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"--resume: {out / RUN_FILE} is unreadable ({err})") from None
        for key in FIXED_ON_RESUME:
            given = getattr(args, key)
            if given is not None and key in saved and given != saved[key]:
                flag = "--" + key.replace("_", "-")
                raise UsageError(f"--resume: {flag} {given} differs from the run's {saved[key]} ({out / RUN_FILE}); "
                                 f"a resumed run keeps its data and batch shape (start a new run with "
                                 f"--model {out / EXPORT} to change them)")  # fmt: skip
        if saved.get("gpus", 1) != args.gpus:
            n = saved.get("gpus", 1)
            raise UsageError(f"--resume: the run trained on {n} GPU(s); continue it with --gpus {n} (a resumed run "
                             "keeps its global batch, --batch-size per GPU times --gpus)")  # fmt: skip
    defaults = dict(DEVICE_DEFAULTS[dev_kind], **TRAIN_DEFAULTS)
    if saved:
        defaults.update(BEFORE_THE_SETTING)
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
    lo, hi = train.token_range()
    if lo < 0:  # (check_vocab says the same of a model's data, later)
        raise UsageError(f"{train.name}: token id {lo} is negative")
    v = train.vocab_size or hi + 1
    return v if v == 256 else -(-v // 128) * 128


def _train_options(run, cfg):
    TrainOptions = model_api()[1]
    kw = recompute_options(run["memory"], run["recompute"], cfg.num_layers)
    if run["lmhead_chunks"] is not None:
        kw["lmhead_chunks"] = run["lmhead_chunks"]
    try:
        opts = TrainOptions(model_dtype=run["dtype"], matmul_dtype=run["matmul_dtype"], grad_dtype=run["grad_dtype"],
                            offload_residual=run["offload_residual"], use_cuda_graphs=run["cuda_graphs"],
                            weight_decay=run["weight_decay"],
                            grad_clip=run["grad_clip"], z_loss=run["z_loss"], seed=run["seed"],
                            optimizer=run["optimizer"], lmhead_fp8=run["lmhead_fp8"],
                            fp8_amax_history=run["fp8_amax_history"],
                            attention_deterministic=not run["nondeterministic_attention"], **kw)  # fmt: skip
        return opts.resolved(cfg.dtype)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _check_creatable(flag: str, path: Path | None) -> None:
    """A UsageError unless `path` exists or its nearest existing ancestor is a directory this process may
    write into: found before the model is built, rather than as a traceback when the run's files are."""
    if path is None:
        return
    base = path.absolute()
    while not base.exists():
        base = base.parent
    if path.exists() or (base.is_dir() and os.access(base, os.W_OK | os.X_OK)):
        return
    raise UsageError(f"{flag} {path}: cannot be created ({base} is not a writable directory)")


def _prepare_train(args):
    """Everything a run needs, checked before anything is written: (run settings, out dir, device,
    trainer, val source, tokenizer)."""
    from safetensors import SafetensorError

    from . import data

    check_numbers(args, _TRAIN_NUMBERS)
    dev = _COMM.device if _COMM is not None else open_device(args.device)
    run = _resolve(args, dev.kind)
    check_numbers(argparse.Namespace(**run), _TRAIN_NUMBERS)
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
    if not args.resume and out.exists() and any(out.iterdir()) and not _restartable(out):
        raise UsageError(f"--out {out} already holds files; continue it with --resume or choose another --out")
    log = Path(run["log"]) if run["log"] else None
    if log is not None and not args.resume and log.is_file() and log.stat().st_size:
        raise UsageError(f"--log {log} already holds a log; a new run would overwrite it (continue that run with "
                         "--resume, or choose another --log)")  # fmt: skip
    for flag, path in (("--out", out), ("--log", log)):
        _check_creatable(flag, path)

    cfg = load_config(run["model"], run["preset"])
    tokenizer = model_tokenizer(run["model"])
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

    LlamaModel = model_api()[2]
    opts = _train_options(run, cfg)
    if _COMM is not None:  # each rank trains on its rows of every global batch; AdamW state sharded
        from .dist import RankSource

        opts.zero_stage = 1
        train, val = (RankSource(s, _COMM.rank, _COMM.world_size) for s in (train, val))
    model = LlamaModel(cfg, opts, dev, comm=_COMM)
    if run["model"] is not None:
        read_weights(model, run["model"])
    else:
        model.init_weights(seed=run["seed"])
    try:
        model.allocate_run_state(run["batch_size"], T)
    except ValueError as err:  # e.g. --lmhead-chunks that does not divide B*T
        raise UsageError(str(err)) from None
    # lr and steps are set below, once a resumed checkpoint has said its schedule
    trainer = Trainer(model, train, batch_size=run["batch_size"], seq_len=T, steps=run["steps"], lr=0.0,
                      grad_accum=run["grad_accum"], val=val, eval_every=run["eval_every"],
                      eval_batches=run["eval_batches"], checkpoint_dir=out / CHECKPOINT, save_every=run["save_every"],
                      save_seconds=60.0 * run["save_minutes"])  # fmt: skip
    if args.resume and (out / CHECKPOINT).exists():
        try:
            extra = trainer.resume()
        except (OSError, ValueError, KeyError, SafetensorError, data.DataError) as err:  # a corrupt or other run's
            raise UsageError(f"--resume: {out / CHECKPOINT}: {err}") from None
        for key in SCHEDULE_KEYS:  # the checkpoint's schedule, unless given again
            if getattr(args, key) is None:
                run[key] = extra["schedule"][key]
    elif args.resume:
        print(f"{out}: no checkpoint yet; starting the run again from step 0")
    trainer.steps = run["steps"]
    trainer.lr = Schedule(run["steps"], run["lr"], run["min_lr"], run["warmup"], run["schedule"])
    trainer.checkpoint_extra = {"schedule": {k: run[k] for k in SCHEDULE_KEYS}}
    return run, out, dev, trainer, val, tokenizer


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

    def show(self, rec: dict) -> None:
        step = rec["step"]
        self.times = self.times[-9:] + [rec["ms"] / 1e3] if self.tty else self.times + [rec["ms"] / 1e3]
        keep = "val_loss" in rec or step == self.total
        if not (self.tty or keep or step % self.every == 0):
            return
        tok_s = self.tokens_per_step * len(self.times) / sum(self.times)
        line = f"step {step:>{len(str(self.total))}}/{self.total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
        line += f"{human(tok_s)} tok/s"
        if self.flops_per_token is not None:
            line += f" | MFU {100 * mfu(self.flops_per_token, tok_s):.1f}%"
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


def _plot(log_path: Path) -> None:
    """loss.png beside the log when matplotlib is installed (the `plot` extra); else one line on how."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no {log_path.with_suffix('.png').name}: matplotlib is not installed; pip install 'cuengine[plot]')")
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


def cmd_train(args) -> int:
    if args.gpus > 1 and _COMM is None:
        _check_gpus(args)
        return _train_on_gpus(args)
    writer = _COMM is None or _COMM.rank == 0  # with several ranks, rank 0 writes the run's files
    ranks = 1 if _COMM is None else _COMM.world_size
    run, out, dev, trainer, val, tokenizer = _prepare_train(args)
    model, B, T, accum, total = trainer.model, trainer.B, trainer.T, trainer.accum, trainer.steps
    start, stop = trainer.step, args.stop_after or total
    if start >= stop:
        exported = all((out / EXPORT / f).is_file() for f in ("config.json", "model.safetensors"))
        if start < total or not writer or exported:
            print(f"{out}: already trained to step {start}; nothing to do")
            return 0
        # a run stopped between its last checkpoint and its export (Ctrl-C, a crash): the export comes now
        print(f"{out}: trained to step {start}, but {out / EXPORT} is missing; writing it")
        del model
        return _finish(trainer, out, run, dev, val, tokenizer)
    log_path = Path(run["log"]) if run["log"] else out / LOG_FILE
    try:  # _check_creatable cannot see every refusal (a read-only file system, /proc): the first writes can
        out.mkdir(parents=True, exist_ok=True)
        if writer:
            (out / RUN_FILE).write_text(json.dumps(dict(run, gpus=ranks), indent=1) + "\n")
            kept = []
            if args.resume and log_path.is_file():  # drop what ran after the checkpoint, it runs again
                kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text("".join(line + "\n" for line in kept))
    except OSError as err:
        raise UsageError(f"cannot write the run's files: {err}") from None

    print(f"cuengine train: {dev.name}, {model.num_parameters() / 1e6:.2f}M parameters, {model.cfg.num_layers} "
          f"layers, B={B} T={T} grad_accum={accum}, {total} steps; data {trainer.source.name} "
          f"({trainer.source.num_tokens:,} tokens), out {out}", flush=True)  # fmt: skip
    # all ranks' tokens per step; MFU per GPU
    flops = model.flops_per_token(T) / ranks if dev.is_cuda else None
    progress = _Progress(total, args.print_every, B * T * accum * ranks, flops)
    with log_path.open("a") if writer else open(os.devnull, "w") as log:

        def log_step(rec):
            log.write(json.dumps(rec) + "\n")
            log.flush()
            progress.show(rec)

        trainer.hooks = [log_step]
        try:
            step = trainer.run(stop, handle_sigint=True)
        except FloatingPointError as err:
            kept = "the last checkpoint is kept" if trainer.last_saved else "no checkpoint yet; run it again"
            print(f"\ncuengine train: {err}; stopping ({kept})", file=sys.stderr)
            return 1
    if writer:
        _plot(log_path)
    if trainer.stop_requested and step < stop:  # (a Ctrl-C in the last step lets the run finish)
        print(f"\ncuengine train: interrupted after step {step} of {total}; checkpoint written; continue with: "
              f"cuengine train --resume --out {out}", file=sys.stderr)  # fmt: skip
        return 130
    if step < total:
        print(f"stopped after step {step} of {total}; continue with: cuengine train --resume --out {out}")
        return 0
    if not writer:
        return 0
    del model
    return _finish(trainer, out, run, dev, val, tokenizer)


def _finish(trainer, out: Path, run, dev, val, tokenizer) -> int:
    """The trained model exported, then (its training buffers gone first) the sample written from the export."""
    _export(trainer.model, out, run)
    if run["sample_tokens"]:
        cfg = trainer.model.cfg
        trainer.model = None  # the training buffers go before the sampler's are allocated
        gc.collect()
        _write_sample(out, run, cfg, dev, val, tokenizer)
    return 0


def _export(model, out: Path, run) -> None:
    """HF weights (and the tokenizer) into <out>/model, so `cuengine generate --model` reads them."""
    model.export_weights(out / EXPORT)
    if run["model"] is not None and (Path(run["model"]) / "tokenizer.json").is_file():
        shutil.copy(Path(run["model"]) / "tokenizer.json", out / EXPORT / "tokenizer.json")
    print(f"wrote {out / CHECKPOINT}/ and {out / EXPORT}/")


def _write_sample(out: Path, run, cfg, dev, val, tokenizer) -> None:
    """<out>/sample.txt: the first tokens of the validation data, continued by the exported model."""
    prompt = [int(t) for t in val.shards[0][: max(1, min(32, run["seq_len"] // 2))]]
    n = min(run["sample_tokens"], cfg.max_position_embeddings - len(prompt))
    new = list(
        token_stream(out / EXPORT, cfg, run["dtype"], dev, prompt, n, temperature=0.8, top_k=40, seed=run["seed"])
    )
    text = tokenizer.decode([*prompt, *new])
    (out / SAMPLE_FILE).write_text(text + "\n", encoding="utf-8")
    print(f"--- sample ({out / SAMPLE_FILE}) ---\n{text}\n---")


def _dflt(key: str) -> str:
    """The help text of a train default: one value, or one per device."""
    if key in TRAIN_DEFAULTS:
        return f"default: {TRAIN_DEFAULTS[key]}"
    cpu, cuda = DEVICE_DEFAULTS["cpu"][key], DEVICE_DEFAULTS["cuda"][key]
    return f"default: {cpu}" if cpu == cuda else f"default: {cpu} on cpu, {cuda} on cuda"


def add_train_parser(t) -> None:
    g = t.add_argument_group("model")
    g.add_argument("--model", metavar="DIR",
                   help="HF model dir: config.json, *.safetensors, tokenizer.json (default: none)")  # fmt: skip
    g.add_argument(
        "--preset", help=f"a named shape when no --model: tiny, small, qwen2.5-0.5b, ... ({_dflt('preset')})"
    )
    g = t.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="FILE",
                   help="text file (byte tokens or the model's tokenizer), .npy token ids, or llm.c .bin shards "
                        "(paths or globs) (default: the Python standard library's sources)")  # fmt: skip
    g.add_argument("--val-data", nargs="+", metavar="FILE", help="validation data (default: 5%% of --data held out)")
    g = t.add_argument_group("batching")
    g.add_argument("--batch-size", type=int, help=f"sequences per micro-batch ({_dflt('batch_size')})")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence ({_dflt('seq_len')})")
    g.add_argument("--grad-accum", type=int, help=f"micro-batches per optimizer step ({_dflt('grad_accum')})")
    g.add_argument("--steps", type=int, help=f"optimizer steps of the whole run; sets the schedule ({_dflt('steps')})")
    g = t.add_argument_group("schedule")
    g.add_argument("--lr", type=float, help=f"peak learning rate ({_dflt('lr')})")
    g.add_argument("--min-lr", type=float, help=f"the floor the schedule decays towards ({_dflt('min_lr')})")
    g.add_argument("--warmup", type=int, help=f"linear warm-up steps ({_dflt('warmup')}, at most --steps / 5)")
    g.add_argument("--schedule", choices=("cosine", "linear", "constant"), help=_dflt("schedule"))
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay ({_dflt('weight_decay')})")
    g.add_argument("--grad-clip", type=float, help=f"global gradient-norm clip; 0 disables ({_dflt('grad_clip')})")
    g.add_argument("--z-loss", type=float, help=f"weight of the z-loss term lse^2 in the loss ({_dflt('z_loss')})")
    g.add_argument("--optimizer", help=f"adamw, adamw8bit (8-bit moments) or muon ({_dflt('optimizer')})")
    g = t.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    g.add_argument("--gpus", type=int, default=1,
                   help="GPUs of this host to train on, one process each (data parallel over NCCL with the AdamW "
                        "state sharded, ZeRO-1); --batch-size is per GPU (default: 1)")  # fmt: skip
    engine_flags(g, _dflt("dtype"))
    g.add_argument("--cuda-graphs", action="store_true", default=None,
                   help="capture and replay each block (default: off)")  # fmt: skip
    g.add_argument("--offload-residual", action="store_true", default=None,
                   help="keep residuals in host memory (default: off)")  # fmt: skip
    g.add_argument("--lmhead-chunks", type=int,
                   help="split the LM head and loss in chunks to save memory (default: chunks of <= 1 GiB of "
                        "logits, from 1024 rows up)")  # fmt: skip
    g.add_argument("--lmhead-fp8", action="store_true", default=None,
                   help="the LM head's GEMMs in FP8 too; needs --matmul-dtype e4m3 (default: off)")  # fmt: skip
    g.add_argument("--fp8-amax-history", type=int, metavar="N",
                   help="with --matmul-dtype e4m3: scale the SwiGLU output and its input's gradient from the "
                        "largest abs-max of the last N steps (delayed scaling: their quantise folds into the "
                        "kernels that compute them; a value above that max saturates; 0: every FP8 tensor from its own "
                        "abs-max) (default: 16 with --matmul-dtype e4m3)")  # fmt: skip
    g.add_argument("--nondeterministic-attention", action="store_true", default=None,
                   help="cuDNN's faster attention backward (dQ added with atomics): the run's bits vary from "
                        "run to run, so two runs of one seed no longer match (default: off)")  # fmt: skip
    g = t.add_argument_group("run", RESUME_RULE)
    g.add_argument("--out", metavar="DIR", help="run directory (default: runs/<timestamp>)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out")
    g.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end this invocation after STEP (with a checkpoint) without changing the schedule "
                        "(default: --steps)")  # fmt: skip
    g.add_argument("--seed", type=int, help=f"init, data order and rounding seed ({_dflt('seed')})")
    g.add_argument("--log", metavar="FILE", help="JSON-lines log, one line per step (default: <out>/log.jsonl)")
    g.add_argument(
        "--eval-every", type=int, help=f"validation every N steps; 0: only at the end ({_dflt('eval_every')})"
    )
    g.add_argument("--eval-batches", type=int, help=f"batches per validation ({_dflt('eval_batches')})")
    g.add_argument("--save-every", type=int,
                   help=f"checkpoint every N steps; 0: by time only ({_dflt('save_every')})")  # fmt: skip
    g.add_argument("--save-minutes", type=float,
                   help=f"checkpoint when M minutes passed since the last; 0: off ({_dflt('save_minutes')}); "
                        "a checkpoint is also written at the end and on Ctrl-C")  # fmt: skip
    g.add_argument("--print-every", type=int, default=0, help="progress line every N steps (0: auto)")
    g.add_argument("--sample-tokens", type=int,
                   help=f"tokens of the sample generated at the end; 0: none ({_dflt('sample_tokens')})")  # fmt: skip
    t.set_defaults(fn=cmd_train)


# ---- several GPUs: one process per GPU; rank 0 prints and writes the run's files --------------------
def _train_on_gpus(args) -> int:
    """`--gpus N`: N ranks of `cmd_train` (spawned, torchrun's environment); their exit code.

    A Ctrl-C reaches every process of the terminal's group: the ranks agree to stop after the
    step with a checkpoint, so this process ignores it (and so, until the trainer installs its
    handler, do the ranks it starts) rather than terminating them mid-step."""
    import signal

    from .dist import WorkerError, launch

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return launch(_train_rank, args.gpus, args)[0]
    except WorkerError as err:
        print(f"cuengine train: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_gpus(args) -> None:
    """`--gpus N` over NCCL needs N CUDA devices on this host: said in one line before N processes start and
    each fails with its own traceback. (The NumPy double, CUENGINE_DIST_BACKEND=fake, runs on the cpu.)"""
    if os.environ.get("CUENGINE_DIST_BACKEND", "nccl") != "nccl":
        return
    if args.device == "cpu":
        raise UsageError(f"--gpus {args.gpus} trains one process a GPU over NCCL; it does not go with --device cpu")
    count = cuda_device_count()
    if count < args.gpus:
        raise UsageError(f"--gpus {args.gpus}: this host has {count} CUDA device(s)")


def _train_rank(args) -> int:
    global _COMM
    from . import dist

    _COMM = dist.init()
    if _COMM.rank != 0:  # rank 0 speaks for the run; a rank's failure reaches the launcher as its traceback
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the life of this worker process)
    try:
        return cmd_train(args)
    finally:
        _COMM.close()
