"""What the `cuengine` commands share: the one-line error types, and the checks that turn bad
input (a device, a model directory, its weights or tokenizer, a number) into a UsageError."""

from __future__ import annotations

import math
from pathlib import Path

from .model.options import MEMORY_PRESETS, memory_preset

RECOMPUTE = ("rmsnorm", "qkv", "att", "ffn", "swiglu", "block")


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2, nothing written."""


class Unavailable(RuntimeError):
    """A part of the engine this command needs does not import: one line on stderr, exit code 1."""


def open_device(name):
    import cuengine as ce

    try:
        return ce.device(name)
    except (ValueError, RuntimeError) as err:
        raise UsageError(str(err)) from None


def model_api():
    """(TransformerConfig, TrainOptions, LlamaModel), or Unavailable naming what failed to import."""
    try:
        from .model import LlamaModel, TrainOptions, TransformerConfig
    except ImportError as err:
        raise Unavailable(f"the model does not import in this build ({err})") from None
    return TransformerConfig, TrainOptions, LlamaModel


def load_config(model_dir, preset):
    """The model's config from a HF directory, or a named preset."""
    TransformerConfig = model_api()[0]
    if model_dir is not None:
        path = Path(model_dir)
        if not path.is_dir():
            raise UsageError(f"--model {model_dir}: not a directory")
        try:
            return TransformerConfig.from_pretrained(path)
        except (OSError, ValueError) as err:  # missing/unreadable config.json, bad JSON, unsupported field
            raise UsageError(f"--model {model_dir}: {err}") from None
    try:
        return TransformerConfig.preset(preset)
    except ValueError as err:
        raise UsageError(f"--preset: {err}") from None


def model_tokenizer(model_dir):
    from . import data

    try:
        return data.load_tokenizer(model_dir)
    except data.DataError as err:
        raise UsageError(str(err)) from None


def check_numbers(args, spec):
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


def human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def read_weights(model, model_dir) -> None:
    """Load a model directory's safetensors; a missing, corrupt or misshapen file is bad input."""
    from safetensors import SafetensorError

    try:
        model.import_weights(model_dir, allow_cast=True)  # e.g. bf16 files into an fp32 run on cpu
    except (OSError, ValueError, SafetensorError) as err:
        raise UsageError(f"--model {model_dir}: {err}") from None


def token_stream(model_dir, cfg, dtype, dev, prompt: list[int], max_new_tokens: int, weights: str = "bf16",
                 **sampling_kw):  # fmt: skip
    """An iterator over the new tokens after `prompt` from the model in `model_dir`, each as the
    inference engine makes it (`model.stream`), with `weights` "bf16" or "fp8" decode weights and a
    KV cache of exactly the prompt and the new tokens. Arguments it refuses (a prompt too long for
    its context) are a UsageError."""
    _, TrainOptions, LlamaModel = model_api()
    model = LlamaModel(cfg, TrainOptions(model_dtype=dtype), dev)
    read_weights(model, model_dir)
    try:
        model.allocate_inference_state(max_batch=1, max_seq_len=len(prompt) + max_new_tokens, weights=weights)
        steps = model.stream([prompt], max_new_tokens, **sampling_kw)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return (token for step in steps for _, token in step)


def engine_flags(p, dtype_default: str) -> None:
    """--dtype, --matmul-dtype, --grad-dtype, --recompute (train and bench)."""
    p.add_argument("--dtype", choices=("bf16", "fp32"), help=f"weights/activations dtype ({dtype_default})")
    p.add_argument("--matmul-dtype", choices=("bf16", "fp32", "e4m3"),
                   help="block matmul operands; e4m3 = FP8 (default: the model dtype)")  # fmt: skip
    p.add_argument("--grad-dtype", choices=("e4m3", "e5m2"),
                   help="FP8 dtype of the activation gradients (default: e5m2 with --matmul-dtype e4m3)")  # fmt: skip
    p.add_argument("--recompute", nargs="+", action="extend", choices=RECOMPUTE, default=[], metavar="PART",
                   help=f"recompute these activations in backward: {', '.join(RECOMPUTE)} (default: none)")  # fmt: skip
    p.add_argument("--memory", choices=MEMORY_PRESETS,
                   help="what the step keeps for backward: default = the LM head in chunks of <= 1 GiB of logits and "
                        "SwiGLU recomputed; fast = every activation kept (3-5%% quicker, the most memory); lean = "
                        "also RMSNorm and the up projection of half the layers recomputed (about 10%% slower than "
                        "fast; 0.59x the compiled HF peer's memory at 1.5B); --recompute adds parts (default: "
                        "default)")  # fmt: skip


def recompute_options(memory: str | None, recompute, num_layers: int) -> dict:
    """The TrainOptions fields of `--memory` (None: default) and the `--recompute` parts added to it."""
    kw = memory_preset(memory or "default", num_layers)
    kw.update({f"recompute_{r}": True for r in recompute})
    if {"ffn", "block"} & set(recompute):  # these recompute every layer's up projection
        kw.pop("recompute_ffn_layers", None)
    return kw
