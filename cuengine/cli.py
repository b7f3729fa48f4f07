"""The `cuengine` command line: train, generate, bench, info.

`cuengine train` with no arguments trains a small model on the Python standard library's own
source (byte tokens, nothing to download) and writes a checkpoint, a JSON-lines log, the exported
weights and a generated sample into `runs/<timestamp>`. Bad input (a missing or corrupt file, a
token outside the vocabulary, a seq-len the model cannot take, a bad number) is reported in one
line on stderr with exit code 2, before anything is written. Ctrl-C ends a run after the current
step with a checkpoint; `cuengine train --resume --out <run>` continues it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._cli_util import (
    Unavailable,
    UsageError,
    check_numbers,
    engine_flags,
    human,
    load_config,
    model_api,
    model_tokenizer,
    open_device,
    recompute_options,
    token_stream,
)
from .benchmark import CEILINGS
from .cli_train import EXPORT, RUN_FILE, add_train_parser


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (explicit in the text where it depends on the device)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" not in text and action.default not in (None, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("cuengine", "numpy", "ml-dtypes", "safetensors", "tokenizers", "cupy-cuda13x", "nvmath-python",
                "cuda-bindings", "nvidia-cudnn-frontend"):  # fmt: skip
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


# ---- generate -----------------------------------------------------------------------------------
class TextStream:
    """The text of a prompt and the tokens that continue it, a piece a token. Each `add` decodes the tokens
    since the last newline only, starting from the newline's own token (so a tokenizer that drops a token's
    leading space at the start of a text decodes the next one as mid-text): a long generation costs a line's
    decode a token, not the whole text's."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer, self.cache, self.shown = tokenizer, list(prompt), ""

    def add(self, token: int) -> str:
        """What `token` adds to the text (the prompt's own text comes with the first); "" while an incomplete
        UTF-8 character waits for its next bytes."""
        self.cache.append(int(token))
        text = self.tokenizer.decode(self.cache)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.shown) :]
        if text.endswith("\n"):
            self.cache = self.cache[-1:]
            self.shown = self.tokenizer.decode(self.cache)
        else:
            self.shown = text
        return piece

    def finish(self) -> str:
        """What is left: the held-back bytes of an incomplete character, as the tokenizer decodes them."""
        return self.tokenizer.decode(self.cache)[len(self.shown) :]


def cmd_generate(args) -> int:
    check_numbers(args, {"max_new_tokens": (1, True), "temperature": (0.0, False), "top_k": (0, True),
                          "top_p": (0.0, False), "seed": (0, True)})  # fmt: skip
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file() and (model_dir / EXPORT / "config.json").is_file():
        model_dir = model_dir / EXPORT  # a `cuengine train` run directory
    elif not (model_dir / "config.json").is_file() and (model_dir / RUN_FILE).is_file():
        raise UsageError(f"--model {model_dir}: a `cuengine train` run with no exported model yet (it ends the run); "
                         f"finish it with: cuengine train --resume --out {model_dir}")  # fmt: skip
    dev = open_device(args.device)
    cfg = load_config(model_dir, None)
    tokenizer = model_tokenizer(model_dir)
    prompt = [int(t) for t in tokenizer.encode(args.prompt)]
    if not prompt:
        raise UsageError("--prompt is empty (it encodes to no tokens)")
    if max(prompt) >= cfg.vocab_size:
        raise UsageError(f"--prompt: token id {max(prompt)} is >= the model's vocab_size {cfg.vocab_size}")
    if len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UsageError(
            f"--prompt of {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} exceed the model's context "
            f"of {cfg.max_position_embeddings} tokens (max_position_embeddings)"
        )
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stream = token_stream(model_dir, cfg, args.dtype, dev, prompt, args.max_new_tokens, args.weights, **kw)
    text, n, first = TextStream(tokenizer, prompt), 0, None
    t0 = time.perf_counter()
    for token in stream:
        first = time.perf_counter() - t0 if first is None else first
        n += 1
        print(text.add(token), end="", flush=True)
    dt = time.perf_counter() - t0
    print(text.finish())
    # the first token also pays the first use (inference state, kernel compiles) and the prefill
    rest = f", then {(n - 1) / (dt - first):.1f} tokens/s" if n > 1 and dt > first else ""
    print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tokens/s; the first after {first:.2f} s{rest}]", file=sys.stderr)
    return 0


# ---- bench --------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from .bench_train import bench_train_step

    check_numbers(args, {"batch_size": (1, True), "seq_len": (1, True), "steps": (1, True), "warmup": (0, True)})
    dev = open_device(args.device)
    preset = args.preset or ("qwen2.5-0.5b" if dev.is_cuda else "tiny")
    cfg = load_config(None, preset)
    B, T = args.batch_size, args.seq_len or min(1024, cfg.max_position_embeddings)
    if T > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len {T} is longer than the model allows "
                         f"(max_position_embeddings {cfg.max_position_embeddings})")  # fmt: skip
    TrainOptions = model_api()[1]
    extra = recompute_options(args.memory, args.recompute, cfg.num_layers)
    if args.dtype:
        extra["model_dtype"] = args.dtype
    if args.grad_dtype:
        extra["grad_dtype"] = args.grad_dtype
    graphs = dev.is_cuda if args.cuda_graphs is None else args.cuda_graphs
    try:
        opts = TrainOptions(matmul_dtype=args.matmul_dtype, use_cuda_graphs=graphs, **extra).resolved(cfg.dtype)
        r = bench_train_step(cfg, opts, dev, B, T, args.steps, args.warmup)
    except ValueError as err:
        raise UsageError(str(err)) from None
    line = (f"{preset} B={B} T={T} {opts.model_dtype}/{opts.matmul_dtype} on {dev.name}"
            f"{' (CUDA graphs)' if graphs else ''}: {r['params'] / 1e6:.1f}M parameters, median step "
            f"{r['ms']:.2f} ms over {args.steps} steps, {human(r['tok_s'])} tok/s")  # fmt: skip
    if dev.is_cuda:
        line += f", MFU {100 * r['mfu']:.1f}% of {CEILINGS['bf16_peak'] / 1e12:.0f} TFLOP/s, {r['mem_gib']:.2f} GiB"
    print(line)
    print(r["report"].table(per_buffer=args.report))
    return 0


# ---- info ---------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    dev = open_device(args.device)
    print(f"device: {dev.kind} - {dev.name}")
    if dev.is_cuda:
        print(f"compute capability: {dev.compute_capability[0]}.{dev.compute_capability[1]}, SMs: {dev.num_sms}")
    free, total = dev.memory_info()
    print(f"memory: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    for pkg, ver in _versions().items():
        print(f"{pkg}: {ver}")
    return 0


# ---- parser -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    import cuengine

    p = _Parser(prog="cuengine", description=__doc__, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"cuengine {cuengine.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,generate,bench,info}")
    kw = dict(formatter_class=_Formatter)

    t = sub.add_parser("train", help="train a model (default: a small one on the stdlib sources, no download)", **kw)
    add_train_parser(t)

    gen = sub.add_parser("generate", help="continue a prompt with a model directory (or a train run's)", **kw)
    gen.add_argument("--model", metavar="DIR", required=True,
                     help="HF model dir, or a `cuengine train` run dir (default: none, required)")  # fmt: skip
    gen.add_argument("--prompt", required=True, help="the text to continue (default: none, required)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="0 = the whole vocabulary")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus: 1 = the whole vocabulary")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", choices=("bf16", "fp32"), help="default: the model's (config.json)")
    gen.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                     help="decode weights: the model's own, or per-row E4M3 copies made at load (W8A16)")  # fmt: skip
    gen.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="time train_step for a named preset", **kw)
    b.add_argument("--preset", help="a model shape (default: qwen2.5-0.5b on cuda, tiny on cpu)")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--seq-len", type=int, help="default: 1024, or the preset's maximum if smaller")
    b.add_argument("--steps", type=int, default=20, help="timed steps")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    b.add_argument("--device", default="auto")
    b.add_argument("--report", action="store_true", help="print every named buffer of the memory report")
    engine_flags(b, "default: the preset's, fp32 on cpu")
    b.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="capture and replay each block (default: on for cuda)")  # fmt: skip
    b.set_defaults(fn=cmd_bench)

    info = sub.add_parser("info", help="print the device, library versions and memory", **kw)
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
        if args.command is None:
            parser.print_help()
            return 0
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
