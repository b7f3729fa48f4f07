"""InferenceMixin: `allocate_inference_state`, `generate` and `stream` on LlamaModel.

A generation uploads the prompts once, prefills them (`prefill.prefill_prompt`), then runs one
decode step per new token (`decode.step`, a replayed CUDA graph). The sampled tokens of each step
come back through a ring of pinned host rows, one small asynchronous copy per step; the host reads
a step's tokens while up to `lag` - 1 later steps are already enqueued (generate: RING - 1; stream:
one, so tokens arrive as they are made while the next step runs), so it never stalls the device. No logits row ever
leaves the device. Stop tokens are checked on the host: a row that stopped keeps decoding
(harmlessly, inside its cache) until every row has stopped or max_new_tokens is reached.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..kernels import sampling
from . import decode
from .state import MAX_BATCH, RING, InferenceState, check_ffn_arm, choose_ffn_arm

Steps = Iterator[list[tuple[int, int]]]  # per step: [(prompt index, token)]
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_SEQ = 2048


class InferenceMixin:
    """Generation for a model with `cfg`, `device`, `alloc`, `dtype` and `weights` (LlamaModel).

    It needs no run state: `generate` on a model that only imported its weights allocates the
    inference state (KV cache, decode scratch) and nothing else.
    """

    _inference: InferenceState | None = None

    @property
    def inference_state(self) -> InferenceState | None:
        return self._inference

    def allocate_inference_state(self, max_batch: int = DEFAULT_MAX_BATCH, max_seq_len: int | None = None,
                                 weights: str = "bf16", ffn_arm: str = "auto",
                                 cuda_graphs: bool = True) -> InferenceState:  # fmt: skip
        """Allocate the KV cache (max_batch, max_seq_len), the decode scratch and, with
        weights="fp8", per-row E4M3 copies of every linear layer. Called on first use of
        generate/stream otherwise. Once per model (the allocator does not free).

        Args:
            max_batch: prompts per generation, 1..64.
            max_seq_len: prompt + new tokens, at most the config's max_position_embeddings
                (None: 2048, or max_position_embeddings when that is smaller).
            weights: "bf16" (the model's own weights, shared) or "fp8" (W8A16 decode GEMVs).
            ffn_arm: "auto", "split", "fused", "fused_up", "gemm", "persistent" (batch 1: every layer in one
                launch; opt-in, slower than the GEMV arms on the H200 so far) or "ksplit" (batch 1: a layer in
                3 launches, the output and down projections summed in fixed point; opt-in, 1.2-1.5x slower than
                "fused_up" on the H100 and the H200, tools/PERF_NOTES.md 34-35); see inference.state.choose_ffn_arm.
            cuda_graphs: capture each decode step once per batch size and replay it.
        """
        if self._inference is not None:
            s = self._inference
            raise ValueError(
                f"allocate_inference_state: already allocated (max_batch={s.max_batch}, max_seq_len={s.max_seq}, "
                f"weights={s.weights!r}); allocate it once, before the first generate, or make a new LlamaModel"
            )
        if max_seq_len is None:
            max_seq_len = min(DEFAULT_MAX_SEQ, self.cfg.max_position_embeddings)
        self._inference = InferenceState(self, max_batch, max_seq_len, weights, ffn_arm, cuda_graphs)
        return self._inference

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop_tokens=(), ffn_arm: str | None = None) -> list[list[int]]:  # fmt: skip
        """New tokens for each prompt.

        Args:
            prompts: list of token-id lists (lengths may differ), at most max_batch of them.
            max_new_tokens: tokens to generate per prompt (>= 1); prompt + max_new_tokens must
                fit the cache (max_seq_len) and max_position_embeddings.
            temperature: 0 = greedy (argmax, lowest id on ties); else sample softmax(logits / t).
            top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest nucleus whose
                probability reaches top_p (1 = all). seed: the same seed gives the same samples.
            stop_tokens: ids that end a sequence; the stop token is included as its last token.
            ffn_arm: override the state's arm for this call ("auto", "split", "fused", "fused_up", "gemm",
                "persistent", "ksplit").
        Returns:
            [[new ids of prompt 0], [new ids of prompt 1], ...]; a list is shorter than
            max_new_tokens only when it ends with a stop token.
        Raises:
            ValueError (before anything runs) for an empty prompt, an id outside the vocabulary,
            a prompt too long for the cache, more prompts than max_batch, bad sampling parameters.
        """
        run = self._prepare("generate", prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
                            ffn_arm)  # fmt: skip
        out = [[] for _ in run[1]]
        for step in self._run(*run, lag=RING):
            for row, tok in step:
                out[row].append(tok)
        return out

    def stream(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, stop_tokens=(), ffn_arm: str | None = None) -> Steps:  # fmt: skip
        """Like `generate`, but yields each step's tokens as soon as the device has made them.

        Every step yields a list of (prompt index, token) pairs, one per sequence still running
        (a sequence's stop token is its last pair). Arguments are checked when stream() is
        called; the work starts at the first next(). A later generate/stream call on the same
        model supersedes this one: resuming it then raises RuntimeError.
        """
        run = self._prepare("stream", prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens,
                            ffn_arm)  # fmt: skip
        return self._run(*run, lag=2)

    # ---- internals ---------------------------------------------------------------------------
    def _prepare(self, what, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, ffn_arm):
        """Check every argument (nothing changes on a bad one), allocate the state on first use,
        and return the arguments of `_run`."""
        V = self.cfg.vocab_size
        prompts = _check_prompts(what, prompts, V)
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"{what}: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if not isinstance(temperature, (int, float, np.floating)) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"{what}: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"{what}: top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if not isinstance(top_p, (int, float, np.floating)) or not 0 < top_p <= 1:
            raise ValueError(f"{what}: top_p must be in (0, 1] (1 = off), got {top_p!r}")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError(f"{what}: seed must be an int in [0, 2**64), got {seed!r}")
        stops = frozenset(_check_ids(what, "stop_tokens", stop_tokens, V))
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens
        max_pos = self.cfg.max_position_embeddings
        if need > max_pos:
            raise ValueError(f"{what}: a prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {need} "
                             f"exceeds max_position_embeddings={max_pos}")  # fmt: skip
        st = self._inference
        if st is not None:
            weights = st.weights
            if len(prompts) > st.max_batch:
                raise ValueError(f"{what}: {len(prompts)} prompts, but the inference state holds max_batch="
                                 f"{st.max_batch} (see allocate_inference_state)")  # fmt: skip
            if need > st.max_seq:
                raise ValueError(f"{what}: a prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {need} "
                                 f"does not fit the KV cache of max_seq_len={st.max_seq} "
                                 f"(see allocate_inference_state)")  # fmt: skip
        else:
            weights = "bf16"
            if len(prompts) > MAX_BATCH:
                raise ValueError(f"{what}: {len(prompts)} prompts; decode takes at most {MAX_BATCH} at once")
        arm = "auto" if ffn_arm is None else ffn_arm
        check_ffn_arm(arm, weights)
        if st is None:
            st = self.allocate_inference_state(max(DEFAULT_MAX_BATCH, len(prompts)),
                                               min(max_pos, max(DEFAULT_MAX_SEQ, need)))  # fmt: skip
        if arm == "auto":
            arm = st.ffn_arm
        params = np.asarray(sampling.sampling_params(float(temperature), int(top_k), float(top_p), int(seed)))
        return st, prompts, max_new_tokens, params, stops, arm

    def _run(self, st, prompts, n_new, params, stops, arm, lag) -> Steps:
        """Yield each step's [(row, token)] for rows not yet stopped; see the module docstring."""
        b, dev = len(prompts), st.device
        st.generation += 1
        gen = st.generation
        arm = choose_ffn_arm(b, st.weights) if arm == "auto" else arm
        st.start(prompts, params)
        running = np.ones(b, bool)
        issued = done = 0
        while done < n_new:
            if st.generation != gen:
                raise RuntimeError("this stream was superseded by a later generate/stream call on the same model")
            while issued < n_new and issued - done < lag:
                if issued == 0:
                    st.prefill()
                else:
                    decode.step(st, b, arm)
                k = issued % RING
                dev.copy_async(st.ring[k].rows(0, b), st.tokens.rows(0, b))
                st.ring_events[k].record()
                issued += 1
            k = done % RING
            st.ring_events[k].synchronize()
            tokens = st.ring[k].array()[:b].tolist()
            done += 1
            out = [(row, tok) for row, tok in enumerate(tokens) if running[row]]
            for row, tok in out:
                if tok in stops:
                    running[row] = False
            yield out
            if not running.any():
                return


def _check_prompts(what, prompts, V) -> list[list[int]]:
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{what}: prompts must be a non-empty list of token-id lists, got {_describe(prompts)}")
    if all(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError(f"{what}: prompts must be a list of token-id lists; for one prompt pass [prompt]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__"):
            raise ValueError(f"{what}: prompt {i} must be a list of token ids, got {_describe(p)}")
        if len(p) == 0:
            raise ValueError(f"{what}: prompt {i} is empty; every prompt needs at least one token")
        out.append(_check_ids(what, f"prompt {i}", p, V))
    return out


def _check_ids(what, name, ids, V) -> list[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{what}: {name} must be a list of int token ids, got {_describe(ids)}")
    ids = list(ids)
    for t in ids:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
            raise ValueError(f"{what}: {name} holds {t!r}, not an int token id")
        if not 0 <= t < V:
            raise ValueError(f"{what}: {name} holds token id {int(t)}, outside the vocabulary [0, {V})")
    return [int(t) for t in ids]


def _describe(x) -> str:
    return f"{type(x).__name__} {x!r}"[:80]
