"""How every benchmark times and what it measures against: tools/bench_*.py, tools/profile_step.py
and `cuengine bench` (which an installed wheel runs without tools/, hence this module's place).

DESIGN rule 7: validate first, warm up, time with CUDA events, report the median, state the ceiling.
One timer and one table of ceilings, so that no two scripts time differently or quote another peak.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

# Ceilings, in bytes/s and FLOP/s. Measured on the H200 (shared/DESIGN.md: a 1 GiB device-to-device
# copy counting bytes read + written; cuBLASLt at 8192³), except the dense peak, NVIDIA's
# H100/H200 SXM datasheet figure, which MFU divides by as everyone's MFU does.
CEILINGS = {
    "copy": 4.27e12,  # bytes/s, device-to-device copy (bytes read + bytes written)
    "bf16": 747e12,  # FLOP/s, BF16 matmul
    "fp8": 1476e12,  # FLOP/s, FP8 (E4M3) matmul
    "bf16_peak": 989e12,  # FLOP/s, dense BF16 peak: the MFU denominator
}

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_CYCLES_PER_MS = 2_000_000  # about the H100/H200 SM clock; a hold only has to be long enough


def mfu(flops_per_token: float, tokens_per_s: float) -> float:
    """Model FLOP utilisation: the model's FLOP rate as a fraction of CEILINGS["bf16_peak"]."""
    return flops_per_token * tokens_per_s / CEILINGS["bf16_peak"]


def fill_random(t, scale: float = 1.0, seed: int = 0):
    """Benchmark data written in place on t's own device, without a host round trip: N(0, scale²)
    values; bf16 by truncating fp32 bits (plenty for timing); FP8 as random codes of |x| < 2 of either
    sign (never NaN or inf), with unit scales. Returns t."""
    xp = t.device.xp
    rng = xp.random.default_rng(seed)
    a = t.array()
    if t.dtype.is_fp8:
        bits = rng.integers(0, 128, a.shape, dtype=xp.int32).astype(xp.uint8)
        a.view(xp.uint8)[...] = (bits & 0x3F) | ((bits & 0x40) << 1)  # magnitude bits 0x00-0x3f, bit 6 the sign
        if t.stats is not None:
            t.set_fp8_stats(1.0, 1.0, 1.0)
        return t
    x = rng.standard_normal(a.shape, dtype=xp.float32) * xp.float32(scale)
    if a.dtype.kind == "u":  # bf16 on cuda: the array holds the raw bits
        a[...] = (x.view(xp.uint32) >> 16).astype(xp.uint16)
    else:
        a[...] = x
    return t


def time_ms(device, fn: Callable[[], object], warmup: int = 3, iters: int = 10, reps: int = 1,
            hold_ms: float = 0.0) -> float:  # fmt: skip
    """Median milliseconds of one call of `fn()` on `device`'s main stream.

    `warmup` untimed calls, then `iters` samples, each `reps` back-to-back calls between two CUDA
    events (divide by reps: enough reps make a short kernel's sample outweigh Python's launch cost).
    `hold_ms` > 0 parks the stream in a spin kernel for about that long before each sample, so that
    the sample's calls queue up behind it and the GPU never waits for Python between them (one hold for
    all the samples let a case of many short launches, whose Python side outlasted the hold, be timed
    at Python's pace). On cpu the samples are host wall-clock times (good for checking a script, not
    for numbers).
    """
    for _ in range(warmup):
        fn()
    if device.is_cpu:
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(samples) / reps
    events = [(device.event(timing=True), device.event(timing=True)) for _ in range(iters)]
    device.synchronize()
    for start, end in events:
        if hold_ms > 0:
            _spin(device.index)((1,), (1,), (np.int64(hold_ms * _CYCLES_PER_MS),), stream=device.stream.raw)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    device.synchronize()
    return statistics.median(start.elapsed_ms(end) for start, end in events) / reps


def time_phases_ms(device, phases: list[Callable[[], object]], warmup: int = 3, iters: int = 10) -> list[float]:
    """Median milliseconds of each phase of a step whose phases depend on each other (a forward
    and the backward that consumes its context): each iteration runs them in order, with an event
    between consecutive phases. Timing as in time_ms."""
    for _ in range(warmup):
        for f in phases:
            f()
    if device.is_cpu:
        marks = []
        for _ in range(iters):
            marks.append([time.perf_counter()])
            for f in phases:
                f()
                marks[-1].append(time.perf_counter())
        ms = [[1e3 * (b - a) for a, b in zip(m, m[1:])] for m in marks]
    else:
        events = [[device.event(timing=True) for _ in range(len(phases) + 1)] for _ in range(iters)]
        for ev in events:
            ev[0].record()
            for f, e in zip(phases, ev[1:]):
                f()
                e.record()
        device.synchronize()
        ms = [[a.elapsed_ms(b) for a, b in zip(ev, ev[1:])] for ev in events]
    return [statistics.median(m[i] for m in ms) for i in range(len(phases))]


def stream_timeline(kernels, top: int = 8) -> dict:
    """Where a multi-stream step waits, from one rank's kernel records [(name, stream, start_us,
    dur_us)] (a CUPTI trace, e.g. torch.profiler's). Compute is every non-NCCL kernel, whatever its
    stream id: a replayed CUDA graph runs concurrent branches on streams of its own, so the main
    stream's kernels may carry several ids (and NCCL nodes the main one). The time inside the span
    when no compute kernel runs is what the collectives (or the host) left exposed. Returns
    {"span_us", "busy_us" {stream: union of its kernels' time}, "compute_us" (union of compute
    kernels' time), "idle_us" (span - compute_us), "nccl_us" (union of NCCL kernels' time),
    "nccl_hidden_us" (NCCL time during compute kernels), "nccl_by_name" {kernel name: summed time},
    "gaps" [(idle_us, kernel before, kernel after, NCCL time within)] the `top` longest compute
    gaps (a gap with no NCCL kernel in it waited on the host or on a dependency)}."""
    if not kernels:
        raise ValueError("stream_timeline: no kernels recorded")

    def union(spans):
        out = []
        for a, b in sorted(spans):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def length(spans):
        return sum(b - a for a, b in spans)

    def is_nccl(k):
        return "nccl" in k[0].lower()

    by_stream: dict = {}
    for _, stream, t, d in kernels:
        by_stream.setdefault(stream, []).append((t, t + d))
    busy = {st: length(union(sp)) for st, sp in by_stream.items()}
    t0 = min(k[2] for k in kernels)
    t1 = max(k[2] + k[3] for k in kernels)
    compute = sorted((k for k in kernels if not is_nccl(k)), key=lambda k: k[2])
    nccl = [k for k in kernels if is_nccl(k)]
    compute_busy = union([(k[2], k[2] + k[3]) for k in compute])
    nccl_busy = union([(k[2], k[2] + k[3]) for k in nccl])
    hidden = 0.0
    for a, b in nccl_busy:
        for c, d in compute_busy:
            hidden += max(0.0, min(b, d) - max(a, c))

    def nccl_within(a, b):
        return sum(max(0.0, min(b, d) - max(a, c)) for c, d in nccl_busy)

    gaps, end, before = [], None, None
    for name, _, t, d in compute:
        if end is not None and t > end:
            gaps.append((t - end, before, name, nccl_within(end, t)))
        if end is None or t + d >= end:
            end, before = t + d, name
    gaps.sort(key=lambda g: -g[0])
    by_name: dict = {}
    for name, _, _, d in nccl:
        by_name[name] = by_name.get(name, 0.0) + d
    return {"span_us": t1 - t0, "busy_us": busy, "compute_us": length(compute_busy),
            "idle_us": (t1 - t0) - length(compute_busy), "nccl_us": length(nccl_busy), "nccl_hidden_us": hidden,
            "nccl_by_name": by_name, "gaps": gaps[:top]}  # fmt: skip


@functools.cache
def _spin(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawKernel(_SPIN, "spin")
