"""Token sampling through `LlamaModel.logits`: the stand-in for the inference engine's
`model.generate` / `model.stream` until those land (same arguments, same results per seed).

Each new token runs a full forward over the whole context on a (len(prompts), context) run state:
quadratic in the length and far slower than a KV cache, but it needs nothing beyond training.
"""

from __future__ import annotations

import numpy as np


def sample_next(
    logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator, top_p: float = 1.0
) -> int:
    """One token from a (V,) logits row: argmax at temperature 0, else softmax(logits / temperature)
    over the `top_k` largest (0 = all), then over the smallest set whose probability reaches `top_p`."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    if 0 < top_k < logits.size:
        keep = np.argpartition(logits, -top_k)[-top_k:]
    else:
        keep = np.arange(logits.size)
    z = logits[keep] / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        n = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1  # the nucleus: reaches top_p
        keep, p = keep[order[:n]], p[order[:n]] / p[order[:n]].sum()
    return int(keep[rng.choice(keep.size, p=p)])


def stream(model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           seed: int = 0, stop_tokens=()):  # fmt: skip
    """The new tokens of one prompt (`prompts` holds exactly one token list) as they are made, each
    step as `[(0, token)]`: the (prompt index, token) pairs of the inference engine's stream.

    As there, the arguments are checked when stream() is called and the work starts at the first
    next(): a run state of (1, prompt + max_new_tokens) is allocated when the model has none; a
    prompt that leaves no room in max_position_embeddings, or in an existing smaller run state,
    raises ValueError. Stops early after a token of `stop_tokens` (which is yielded).
    """
    if len(prompts) != 1:
        raise ValueError(f"stream: this sampler takes one prompt, got {len(prompts)}")
    ctx = [int(t) for t in prompts[0]]
    need = len(ctx) + max_new_tokens
    if need > model.cfg.max_position_embeddings:
        raise ValueError(f"stream: prompt {len(ctx)} + max_new_tokens {max_new_tokens} tokens exceed the model's "
                         f"context (max_position_embeddings {model.cfg.max_position_embeddings})")  # fmt: skip
    if model.rs is None:
        model.allocate_run_state(1, need)
    elif model.rs.T < need:
        raise ValueError(f"stream: prompt {len(ctx)} + max_new_tokens {max_new_tokens} tokens exceed the run state's "
                         f"T={model.rs.T}")  # fmt: skip
    return _steps(model, ctx, max_new_tokens, temperature, top_k, top_p, seed, {int(t) for t in stop_tokens})


def _steps(model, ctx: list[int], n: int, temperature, top_k, top_p, seed, stop: set[int]):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        row = model.logits(np.asarray([ctx], np.int32))[0, -1]  # (V,)
        token = sample_next(row, temperature, top_k, rng, top_p)
        ctx.append(token)
        yield [(0, token)]
        if token in stop:
            return


def generate(model, prompts, max_new_tokens: int, **kw) -> list[list[int]]:
    """The new tokens of each prompt (`stream` over each one in turn)."""
    return [[t for step in stream(model, [p], max_new_tokens, **kw) for _, t in step] for p in prompts]
