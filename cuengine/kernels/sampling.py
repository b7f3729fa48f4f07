"""On-device token sampling from a logits row per sequence (raw_kernels/sampling.cu).

temperature 0 is greedy (argmax, lowest index on ties). Otherwise the token is an exact draw from
softmax(logits / temperature) restricted to the top_k largest logits (0 = all) and then to the top_p
nucleus (the fewest highest-probability tokens whose probability reaches top_p; ties at either
threshold are kept), made by Gumbel-max: argmax over the allowed tokens of x / T - log(E), with
E = -log1p(-u) exponential and u a counter-based hash of (seed, row, step, token id). The NumPy twin
uses the same hash and the same float32 roundings, so it draws the same tokens (up to float near-ties
between the device's log/exp and NumPy's).

The parameters live in a small device buffer (`sampling_params` builds it on the host) together with a
step counter that the kernel itself advances after each launch, so a replayed CUDA graph draws fresh
numbers every step without any host write, and a run is reproducible from (seed, step). Greedy and
plain-temperature rows are split over several blocks (up to 16, while b <= 64) that merge through
per-row slots in the same buffer; with top-k or top-p one block does the row (threshold passes).
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import expect, same_device
from ..dtypes import BF16, FP32, INT32
from ._build import ceil_div, launch

FAMILY = "sampling"
FLOATS = (FP32, BF16)
MAX_SLOTS = 64  # rows that can share their row among several blocks (MAX_SLOTS in sampling.cu)
# int32 slots: temperature, top_k, top_p, seed lo, seed hi, step, ticket, spare, then a 64-bit merge slot per row
N_PARAMS = 8 + 2 * MAX_SLOTS
_STEP, _TICKET = 5, 6
_THREADS = 1024
_MAX_BLOCKS_PER_ROW = 16
_SUFFIX = {"fp32": "f32", "bf16": "bf16"}
_U32 = 0xFFFFFFFF


# ---- parameters ---------------------------------------------------------------------------
def sampling_params(temperature: float, top_k: int, top_p: float, seed: int) -> np.ndarray:
    """The (N_PARAMS,) int32 host array to copy into the device params buffer of sample_tokens.

    temperature >= 0 (0 = greedy); top_k >= 0 (0 = no top-k); 0 < top_p <= 1 (1 = no nucleus);
    0 <= seed < 2**64. Floats are stored as float32 bits; the step counter and the kernel's merge slots
    start at 0 (the kernel leaves the slots at 0 after each launch).
    """
    t, p = float(temperature), float(top_p)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"sampling_params: temperature = {temperature} must be finite and >= 0 (0 = greedy)")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"sampling_params: top_k = {top_k} must be an integer >= 0 (0 = no top-k)")
    if not 0 < p <= 1:
        raise ValueError(f"sampling_params: top_p = {top_p} must be in (0, 1] (1 = no nucleus)")
    if int(seed) != seed or not 0 <= seed < 2**64:
        raise ValueError(f"sampling_params: seed = {seed} must be an integer in [0, 2**64)")
    top_k = min(int(top_k), 2**31 - 1)
    out = np.zeros(N_PARAMS, np.int32)
    out[0] = np.float32(t).view(np.int32)
    out[1] = top_k
    out[2] = np.float32(p).view(np.int32)
    out[3:5] = np.array([int(seed) & _U32, int(seed) >> 32], np.uint32).view(np.int32)
    return out


def _unpack(params: np.ndarray):
    """(temperature, top_k, top_p, seed_lo, seed_hi, step) from a params array (float32 / uint32)."""
    f = params.view(np.float32)
    u = params.view(np.uint32)
    return f[0], int(params[1]), f[2], int(u[3]), int(u[4]), int(u[_STEP])


# ---- NumPy twin ---------------------------------------------------------------------------
def _mix32(x) -> np.ndarray:
    """lowbias32 (C. Wellons' 32-bit integer hash), element-wise on uint32; sampling.cu: mix32."""
    x = np.array(x, np.uint32, ndmin=1)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def _row_key(seed_lo: int, seed_hi: int, row: int, step: int) -> np.ndarray:
    k = _mix32((seed_lo + 0x9E3779B9) & _U32)
    k = _mix32(k ^ np.uint32(seed_hi))
    k = _mix32(k ^ np.uint32(row & _U32))
    return _mix32(k ^ np.uint32(step & _U32))


def gumbel_np(seed_lo: int, seed_hi: int, row: int, step: int, V: int) -> np.ndarray:
    """(V,) float32 -log(E_j), E_j = -log1p(-u_j) ~ Exp(1): the Gumbel noise of one row and step.

    u_j = min((float32(h_j) + 0.5) * 2**-32, 1 - 2**-24), h_j = mix32(key ^ mix32(j)): in (0, 1), so
    -log(E) lies in [-2.81, 22.9].
    """
    h = _mix32(_row_key(seed_lo, seed_hi, row, step) ^ _mix32(np.arange(V, dtype=np.uint32)))
    u = np.minimum((h.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-32), np.float32(1 - 2.0**-24))
    return -np.log(-np.log1p(-u))


def allowed_np(x: np.ndarray, temperature, top_k: int, top_p) -> np.ndarray:
    """(V,) bool: the tokens left after top-k, then top-p over the top-k set's renormalised mass.

    Probabilities are exp(-(max - x) / T) in float32 (1/T rounded to float32 first), summed in float64.
    """
    V = x.size
    allowed = np.ones(V, bool)
    if 0 < top_k < V:
        allowed = x >= np.partition(x, V - top_k)[V - top_k]
    if top_p < 1:
        inv_t = np.float32(1) / np.float32(temperature)
        w = np.exp(-((x.max() - x) * inv_t)).astype(np.float64)
        vals = x[allowed]
        order = np.argsort(-vals, kind="stable")
        cum = np.cumsum(w[allowed][order])
        n = min(int(np.searchsorted(cum, float(top_p) * cum[-1])), vals.size - 1)
        allowed &= x >= vals[order][n]
    return allowed


def sample_tokens_np(logits: np.ndarray, params: np.ndarray) -> np.ndarray:
    """(b,) int32 tokens for logits (b, V) under params (sampling_params's layout); advances the step
    counter params[5] by one, in place, as the kernel does (when b > 0)."""
    temperature, top_k, top_p, seed_lo, seed_hi, step = _unpack(params)
    x = np.asarray(logits, np.float32)
    b, V = x.shape
    tokens = np.empty(b, np.int32)
    for r in range(b):
        if not temperature > 0:
            tokens[r] = np.argmax(x[r])
            continue
        z = x[r] * (np.float32(1) / np.float32(temperature)) + gumbel_np(seed_lo, seed_hi, r, step, V)
        z[~allowed_np(x[r], temperature, top_k, top_p)] = -np.inf
        tokens[r] = np.argmax(z)
    if b:
        params[_STEP] = np.uint32((step + 1) & _U32).view(np.int32)
        params[_TICKET] = 0
    return tokens


# ---- launcher -----------------------------------------------------------------------------
def sample_tokens(tokens, logits, params, stream=None) -> None:
    """Draw one token per logits row on the device; no logits leave it.

    Args:
        tokens: (b,) int32, written (=).
        logits: (b, V) fp32 or bf16 (V up to a few hundred thousand).
        params: (N_PARAMS,) int32 device buffer holding sampling_params(...), 8-byte aligned; its step
            counter [5] is advanced by one per launch (in place), so each call (or graph replay) draws new
            numbers. Its values are checked on cpu only (the device copy is not read back).
    NumPy equivalent: sample_tokens_np(logits, params).
    """
    expect(logits, "sample_tokens logits", FLOATS, (None, None))
    b, V = logits.shape
    if V < 1:
        raise ValueError(
            f"sample_tokens logits: expected at least one column, got tensor {logits.name!r} {logits.shape}"
        )
    expect(tokens, "sample_tokens tokens", INT32, (b,))
    expect(params, "sample_tokens params", INT32, (N_PARAMS,))
    dev = same_device(tokens, logits, params)
    if dev.is_cpu:
        p = params.array()
        t, k, tp, lo, hi, _ = _unpack(p)
        sampling_params(t, k, tp, lo | hi << 32)  # raises on values no sampling_params would write
        tokens.array()[...] = sample_tokens_np(logits.array(), p)
        return
    if b == 0:
        return
    if params.ptr % 8:
        raise ValueError(
            f"sample_tokens params: device address {params.ptr:#x} of {params.name!r} is not 8-byte aligned"
        )
    nb = 1
    if b <= MAX_SLOTS:
        nb = max(1, min(_MAX_BLOCKS_PER_ROW, ceil_div(2 * dev.num_sms, b), ceil_div(V, 16 * _THREADS)))
    name = f"sample_tokens_{_SUFFIX[logits.dtype.name]}"
    launch(FAMILY, name, (nb, b), _THREADS, (tokens, logits, params, np.int32(V)), dev, stream)
