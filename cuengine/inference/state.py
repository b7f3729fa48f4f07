"""InferenceState: everything generation needs beside the model's weights, allocated once.

It holds no gradients, no optimizer moments and no training run state, so a model loaded only to
generate carries the weights plus these contexts in its memory report:
- "KV cache": k_cache, v_cache (L, max_batch, Hkv, max_seq, hs) in the model dtype;
- "Decode weights FP8" (weights="fp8" only): a per-row E4M3 copy (N, K) and its fp32 row scales
  (N,) of every linear layer, the LM head included (`gemv.quantize_rows`);
- "Decode scratch": the (max_batch, ...) buffers of one decode step, the (max_seq, ...) buffers of
  a prefill, the RoPE table, the device positions/lengths/tokens and the sampling parameters;
- "Decode host" (pinned): the prompt upload and the ring the sampled tokens come back through.
The model's own weights are shared, never copied: a model that trains can sample from what it
trains. Every buffer keeps its address for the state's life, which is what lets each decode step
be captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

import numpy as np

from .. import blas
from ..dtypes import BF16, FP8_E4M3, FP16, FP32, INT32, INT64
from ..dtypes import dtype as _dtype
from ..kernels import decode_attention, decode_attention_o, decode_layers, decode_mlp, gemv, rope, sampling
from . import decode
from .prefill import prefill_group

WEIGHTS = ("bf16", "fp8")  # "bf16": the model's own weights (fp32 for an fp32 model); "fp8": per-row E4M3
FFN_ARMS = ("split", "fused", "fused_up", "gemm", "persistent", "ksplit")
LINEARS = ("qkv_w", "atto_w", "up_w", "down_w")
RING = 16  # steps of sampled tokens in flight between the device and the host
MAX_BATCH = 64  # the decode kernels' row limit


class DecodeLinear:
    """One linear layer as the decode GEMVs read it: `w` (N, K) in the model dtype (the model's own
    tensor) or E4M3 with `scale` (N,) fp32, W ≈ w * scale[:, None]."""

    __slots__ = ("w", "scale")

    def __init__(self, w, scale=None):
        self.w = w
        self.scale = scale


class InferenceState:
    """The KV cache, decode weights and scratch of one model; see the module docstring.

    Args:
        model: the LlamaModel whose weights are read (shared).
        max_batch: sequences decoded together, 1..64.
        max_seq_len: prompt + new tokens of one sequence, at most max_position_embeddings.
        weights: "bf16" (the model's weights) or "fp8" (per-row E4M3 copies, requantized from the
            model's weights at the start of every generation).
        ffn_arm: "auto" (by batch size and weights, see `choose_ffn_arm`) or one of FFN_ARMS.
        cuda_graphs: capture each decode step once per (batch size, arm) and replay it.
    """

    def __init__(self, model, max_batch: int, max_seq_len: int, weights: str = "bf16", ffn_arm: str = "auto",
                 cuda_graphs: bool = True):  # fmt: skip
        cfg = model.cfg
        _check_int("max_batch", max_batch, 1, MAX_BATCH)
        _check_int("max_seq_len", max_seq_len, 2, cfg.max_position_embeddings,
                   "max_position_embeddings of the config")  # fmt: skip
        if weights not in WEIGHTS:
            raise ValueError(f"allocate_inference_state: weights must be one of {WEIGHTS}, got {weights!r}")
        check_ffn_arm(ffn_arm, weights)
        self.model_weights, self.cfg = model.weights, cfg  # not the model: it holds this state (no cycle)
        self.device = dev = model.device
        self.dtype = dt = model.dtype
        self.max_batch, self.max_seq = int(max_batch), int(max_seq_len)
        self.weights, self.ffn_arm, self.cuda_graphs = weights, ffn_arm, bool(cuda_graphs)
        self.graphs: dict = {}  # key -> captured Graph, least recently used first
        self.warm: dict = {}  # keys run once (eagerly), in order: the next run captures
        self.generation = 0  # bumped by every new generation: a stale stream() generator refuses to run on
        alloc = model.alloc
        blas.init(alloc)
        B, S, L = self.max_batch, self.max_seq, cfg.num_layers
        C, H, Q, V = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels, cfg.vocab_size
        Hq, Hkv, hs = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
        A = cfg.att_channels  # attention output width: Hq * hs (C except on Qwen3)

        with alloc.context("KV cache"):
            self.k_cache = alloc.allocate(dt, "k_cache", (L, B, Hkv, S, hs))
            self.v_cache = alloc.allocate(dt, "v_cache", (L, B, Hkv, S, hs))

        W = model.weights
        names = [f"layers.{i}.{n}" for i in range(L) for n in LINEARS] + ["lm_head"]
        src = {n: (W.lm_head if n == "lm_head" else W[n]) for n in names}
        if weights == "fp8":
            with alloc.context("Decode weights FP8"):
                self.linears = {n: DecodeLinear(alloc.allocate(FP8_E4M3, f"{n}.w8", t.shape, stats=False),
                                                alloc.allocate(FP32, f"{n}.w_scale", (t.shape[0],)))
                                for n, t in src.items()}  # fmt: skip
        else:
            self.linears = {n: DecodeLinear(t) for n, t in src.items()}
        self._sources = src
        # the LM head of two rows or more through cuBLASLt (decode.head_and_sample) where its rows meet
        # cuBLASLt's 16-byte rule
        self.head_by_gemm = weights != "fp8" and (C * dt.itemsize) % 16 == 0 and (V * FP32.itemsize) % 16 == 0

        with alloc.context("Decode scratch"):
            a = lambda dtype, name, shape: alloc.allocate(dtype, name, shape)
            # cos/sin are bounded by 1: fp16 keeps more mantissa than bf16 (the training table)
            freq_dt = FP16 if dt == BF16 else FP32
            self.freqs = a(freq_dt, "decode_freqs", (S, hs))
            self.freqs.copy_from_numpy(rope.rope_freqs(S, hs, cfg.rope_theta, freq_dt.np, cfg.rope_scaling))
            # one decode step, b <= max_batch rows
            self.tokens = a(INT32, "decode_tokens", (B,))  # the step's input, then the sampled token
            self.positions = a(INT32, "decode_positions", (B,))  # cache position of the input token
            self.lengths = a(INT32, "decode_lengths", (B,))  # positions + 1
            self.residual = a(dt, "decode_residual", (B, C))
            self.qkv = a(dt, "decode_qkv", (B, Q))
            self.att = a(dt, "decode_att", (B, A))
            # QK-norm's per-head rstd (Qwen3), which decode and prefill compute but never read
            self.qk_rstd = a(FP32, "decode_qk_rstd", (max(B, S), Hq + Hkv)) if cfg.qk_norm else None
            self.up = a(dt, "decode_up", (B, 2 * H))  # [gate | up]
            self.act = a(dt, "decode_swiglu", (B, H))  # "split", "fused_up" and "gemm"
            self.ln = a(dt, "decode_ln2", (B, C))  # "gemm": the normalised FFN input
            self.rstd = a(FP32, "decode_rstd", (B,))
            self.logits = a(FP32, "decode_logits", (B, V))
            # sized for max_batch rows, it serves every smaller batch
            self.att_scratch = a(FP32, "decode_attention_scratch",
                                 decode_attention.decode_attention_scratch_shape(B, Hq, hs, S)).fill_zero()  # fmt: skip
            template = np.asarray(sampling.sampling_params(0.0, 0, 1.0, 0))
            self.params = a(_dtype(template.dtype), "sampling_params", template.shape)
            # the "persistent" arm (batch 1, one launch for every layer): its layer table and phase counters
            self.persistent_why = decode_layers.unsupported(cfg, dt, dev, 1, FP8_E4M3 if weights == "fp8" else dt)
            self.layer_weights = self.layer_table = self.layer_sync = None
            if self.persistent_why is None:
                self.layer_weights = [self._layer_weights(i) for i in range(L)]
                self.layer_table = a(INT32, "decode_layer_table", decode_layers.layer_table_shape(L))
                decode_layers.write_layer_table(self.layer_table, self.layer_weights)
                self.layer_sync = a(INT32, "decode_layer_sync", decode_layers.sync_shape()).fill_zero()
            # the "ksplit" arm (batch 1): each layer's output projection and MLP sum into fixed-point
            # accumulators (zeroed at every step's start); the launch after each adds it to the residual row
            # and writes the sum to the other residual buffer (res_in: a layer's input, residual: its middle)
            self.ksplit_why = ksplit_unsupported(cfg, dt, dev, FP8_E4M3 if weights == "fp8" else dt)
            self.res_in = self.acc_o = self.acc_mlp = None
            if self.ksplit_why is None:
                self.res_in = a(dt, "decode_residual_in", (1, C))
                self.acc_o = a(INT64, "decode_acc_o", (L, gemv.acc_shape(1, C)[1]))
                self.acc_mlp = a(INT64, "decode_acc_mlp", (L, gemv.acc_shape(1, C)[1]))
            # prefill of a group of n prompts padded to T tokens, n * T <= max_seq rows
            self.p_res = a(dt, "prefill_residual", (S, C))
            self.p_res_att = a(dt, "prefill_res_att", (S, C))
            self.p_ln = a(dt, "prefill_ln", (S, C))
            self.p_rstd = a(FP32, "prefill_rstd", (S,))
            self.p_qkv = a(dt, "prefill_qkv", (S, Q))
            self.p_att = a(dt, "prefill_att", (S, A))
            self.p_lse = a(FP32, "prefill_lse", (Hq * S,))
            self.p_out = a(dt, "prefill_out", (S, C))  # att_o, then mlp_down
            self.p_up = a(dt, "prefill_up", (S, 2 * H))
            self.p_act = a(dt, "prefill_swiglu", (S, H))
            # every group's tokens, cache slots and positions, packed one after the other
            self.p_index = a(INT32, "prefill_index", (3, B * S))
            # each prompt's last row within its group's scratch rows, and those rows gathered
            # (res_att, then mlp_down): device data, so a captured prefill serves other lengths
            self.p_last = a(INT32, "prefill_last_rows", (B,))
            self.p_last_res = a(dt, "prefill_last_res_att", (B, C))
            self.p_last_out = a(dt, "prefill_last_out", (B, C))

        with alloc.context("Decode host"):
            self.index_host = alloc.allocate(INT32, "prefill_index_host", (3, B * S), kind="pinned")
            self.pos_host = alloc.allocate(INT32, "positions_host", (3, B), kind="pinned")
            self.ring = alloc.allocate(INT32, "token_ring", (RING, B), kind="pinned")
        self.ring_events = [dev.event() for _ in range(RING)]
        self.upload_event = dev.event()  # the last copy out of index_host / pos_host
        self.groups: list[tuple[int, int, int, int]] = []  # prefill groups: (first prompt, n, T, offset)

    # ---- weights -----------------------------------------------------------------------------
    def _layer_weights(self, i: int) -> dict:
        """Layer i's tensors for decode_layers (LAYER_FIELDS): its decode linears, norms, bias and cache."""
        blk, p = self.model_weights.block(i), f"layers.{i}."
        lin = {n: self.linears[p + n] for n in LINEARS}
        return {"qkv_w": lin["qkv_w"].w, "qkv_scale": lin["qkv_w"].scale, "qkv_b": blk.get("qkv_b"),
                "ln1": blk["ln1_w"], "o_w": lin["atto_w"].w, "o_scale": lin["atto_w"].scale, "ln2": blk["ln2_w"],
                "up_w": lin["up_w"].w, "up_scale": lin["up_w"].scale, "down_w": lin["down_w"].w,
                "down_scale": lin["down_w"].scale, "k_cache": self.k_cache[i], "v_cache": self.v_cache[i]}  # fmt: skip

    def refresh_weights(self) -> None:
        """Requantize the per-row E4M3 copies from the model's current weights (weights="fp8"),
        so a model that trained since the last generation samples from what it has become."""
        if self.weights != "fp8":
            return
        for n, lin in self.linears.items():
            gemv.quantize_rows(lin.w, lin.scale, self._sources[n])

    def bytes_per_token(self) -> int:
        """Weight bytes one batch-1 decode step reads: the linear layers in their decode form plus
        the embedding row and norm weights (the bound's numerator: bytes / copy bandwidth)."""
        total = sum(lin.w.nbytes + (lin.scale.nbytes if lin.scale is not None else 0) for lin in self.linears.values())
        cfg, L = self.cfg, self.cfg.num_layers
        norms = (2 * L + 1) * cfg.hidden_size + (2 * L * cfg.head_size if cfg.qk_norm else 0)  # Qwen3's QK-norm too
        return total + (norms + cfg.hidden_size) * self.dtype.itemsize

    # ---- a generation ------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: np.ndarray) -> None:
        """Upload the prompts (grouped for prefill, see `prefill`), their positions and the
        sampling parameters (whose step counter restarts, so a seed draws the same numbers), and
        requantize FP8 weights. Enqueued, except the small synchronous copy of `params`."""
        b, dev, S = len(prompts), self.device, self.max_seq
        lens = np.array([len(p) for p in prompts], np.int32)
        self.groups = []
        first = off = 0
        for i in range(1, b + 1):
            if i == b or (i + 1 - first) * int(lens[first : i + 1].max()) > S:
                n, T = i - first, prefill_rows(int(lens[first:i].max()), i - first, S)
                self.groups.append((first, n, T, off))
                first, off = i, off + n * T
        self.upload_event.synchronize()  # the previous copies out of the pinned buffers are done
        idx, pos = self.index_host.array(), self.pos_host.array()
        for first, n, T, off in self.groups:
            pos[2, first : first + n] = np.arange(n) * T + lens[first : first + n] - 1  # last row in the group
            tokens = idx[0, off : off + n * T].reshape(n, T)
            tokens[...] = 0  # padding: causal attention keeps it out of the real rows
            for r in range(n):
                tokens[r, : lens[first + r]] = prompts[first + r]
            idx[1, off : off + n * T] = np.repeat(np.arange(first, first + n, dtype=np.int32), T)
            idx[2, off : off + n * T] = np.tile(np.arange(T, dtype=np.int32), n)
        pos[0, :b], pos[1, :b] = lens - 1, lens  # as if each prompt's last token were a step's input
        dev.copy_async(self.p_index, self.index_host)
        dev.copy_async(self.positions.rows(0, b), self.pos_host[0].rows(0, b))
        dev.copy_async(self.lengths.rows(0, b), self.pos_host[1].rows(0, b))
        dev.copy_async(self.p_last.rows(0, b), self.pos_host[2].rows(0, b))
        self.upload_event.record()
        self.params.copy_from_numpy(params)
        self.refresh_weights()

    def prefill(self) -> None:
        """Prefill the prompts of `start` into their cache slots, then the LM head and the sampler
        on their last rows: st.tokens[:b] holds each prompt's first new token. Enqueued only.

        Consecutive prompts go through the forward together, right-padded to the longest of them,
        as many as fit the max_seq rows of scratch: causal attention keeps the padding out of the
        real rows, and the K/V the padding appends lie past each prompt's end, where decode
        overwrites them before any step reads them.

        With cuda_graphs the prefill of a group layout (first prompt, count, padded length, offset
        of each group) is captured at its second use and replayed after: a prefill is ~12 launches
        per layer, and from Python their launch cost, not the GPU, set its time (0.5B and 1.5B took
        the same 10-12 ms for 1024 tokens). Lengths are padded up to a multiple of PREFILL_ROUND
        (`prefill_rows`) so that prompts of nearby lengths share a graph; where each prompt's last
        row lies is device data (p_last)."""
        groups = tuple(self.groups)

        def run_groups():
            for first, n, T, off in groups:
                prefill_group(self, first, n, T, off)
            decode.head_and_sample(self, groups[-1][0] + groups[-1][1])

        self.run(("prefill", groups), run_groups)

    # ---- graphs ------------------------------------------------------------------------------
    def run(self, key, fn) -> None:
        """Run `fn`, or with cuda_graphs: eagerly the first time (kernels compile and cuBLASLt
        plans are built outside any capture), captured the second time, then replayed. At most
        PREFILL_GRAPHS prefill layouts stay captured (the least recently used is dropped)."""
        if not self.cuda_graphs:
            fn()
            return
        g = self.graphs.pop(key, None)
        if g is None and key not in self.warm:
            self.warm[key] = None
            if key[0] == "prefill":
                _drop_oldest_prefill(self.warm, 4 * PREFILL_GRAPHS)
            fn()
            return
        if g is None:
            g = self.device.capture(fn)
            # decode keys are bounded (batch size, arm); prefill layouts are not: keep the latest few,
            # waiting for the stream before one is dropped (a rare host sync: only a new layout's capture)
            if key[0] == "prefill" and sum(k[0] == "prefill" for k in self.graphs) >= PREFILL_GRAPHS:
                self.device.synchronize()
                _drop_oldest_prefill(self.graphs, PREFILL_GRAPHS - 1)
        self.graphs[key] = g  # now the most recently used
        g.launch()


PREFILL_GRAPHS = 8  # prefill layouts kept captured; the least recently used is dropped first


def _drop_oldest_prefill(ordered: dict, keep: int) -> None:
    """Drop the oldest prefill keys of `ordered` until `keep` remain."""
    keys = [k for k in ordered if k[0] == "prefill"]
    for k in keys[: max(0, len(keys) - keep)]:
        del ordered[k]


PREFILL_ROUND = 64  # prefill lengths are padded up to a multiple of this (graph reuse, see `prefill`)


def prefill_rows(longest: int, n: int, max_seq: int) -> int:
    """Rows per prompt of a prefill group of n prompts whose longest has `longest` tokens: rounded
    up to a multiple of PREFILL_ROUND while the group's n * rows stay within max_seq, never fewer
    than `longest` (the grouping already ensures n * longest <= max_seq)."""
    return max(longest, min(-(-longest // PREFILL_ROUND) * PREFILL_ROUND, max_seq // n))


def _check_int(name, value, lo, hi, hi_what=None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"allocate_inference_state: {name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        why = f" ({hi_what})" if hi_what else ""
        raise ValueError(f"allocate_inference_state: {name}={value} outside [{lo}, {hi}]{why}")


# Arm thresholds (see choose_ffn_arm), from the H200 (0.5B, ms per step, tools/bench_decode.py and
# BENCHMARKS.md's thirteenth session): bf16 b = 1: fused_up 0.620, fused 0.635; b = 2: fused_up 0.78,
# fused 0.81, gemm 0.97; b = 4: fused_up 0.82, gemm 0.97; b = 8: gemm 0.99, fused_up 1.05.
# fp8 b = 1: fused_up 0.634, fused 0.653; b = 8: fused_up 1.30, split 1.37; b = 64: split 10.2, fused_up 11.0.
FUSED_MAX_BATCH = 4  # bf16/fp32 weights: "fused_up" up to here, then "gemm"
FP8_FUSED_MAX_BATCH = 8  # fp8 weights: "fused_up" up to here, then "split"


def choose_ffn_arm(b: int, weights: str) -> str:
    """The arm for b rows (seed 004's choice, moved to where the H200 measurements put it).

    A GEMV reads each weight once per group of up to 8 rows and its cost grows with b, while
    cuBLASLt's M = b GEMM costs about the same from b = 1 to 64: the GEMV arm with SiLU·mul in the
    gate/up GEMV's epilogue ("fused_up": computed once, where "fused" has every down-projection
    block recompute it) wins up to a few rows, the "gemm" arm beyond.
    FP8 weights have only GEMV arms (weight-only W8A16): "fused_up" up to 8 rows, then "split",
    which stages SiLU·mul once (the seed's `act_mul`) in its own launch.
    """
    if weights == "fp8":
        return "fused_up" if b <= FP8_FUSED_MAX_BATCH else "split"
    return "fused_up" if b <= FUSED_MAX_BATCH else "gemm"


def ksplit_unsupported(cfg, dtype, device, weight_dtype) -> str | None:
    """Why the "ksplit" arm cannot run this model (None when it can): decode_mlp's and decode_attention_o's
    shapes, and bulk copies into shared memory (compute capability 9.0) on a GPU. The batch (1) is
    checked per step."""
    if device.is_cuda and device.compute_capability < (9, 0):
        return "it needs compute capability 9.0 (bulk copies into shared memory)"
    return decode_mlp.unsupported(cfg.hidden_size, cfg.intermediate_size, dtype, weight_dtype) or (
        decode_attention_o.unsupported(cfg.head_size, dtype, weight_dtype)
    )


def check_ffn_arm(arm: str, weights: str) -> None:
    """ValueError saying why `arm` cannot run with `weights`."""
    if arm != "auto" and arm not in FFN_ARMS:  # "persistent" and "ksplit" are checked per step: batch 1
        raise ValueError(f"ffn_arm must be 'auto' or one of {FFN_ARMS}, got {arm!r}")
    if arm == "gemm" and weights == "fp8":
        raise ValueError(
            "ffn_arm='gemm' cannot run with weights='fp8': cuBLASLt's FP8 GEMMs take FP8 activations as well "
            "(W8A8) and per-tensor scales, while the decode weights are per-row E4M3 for bf16 activations (W8A16); "
            "use 'split' or 'fused', or weights='bf16'"
        )
