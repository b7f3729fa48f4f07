"""Benchmark cuengine.matmul (cuBLASLt): TFLOP/s for BF16 and FP8 at 8192³ and at the train-step
shapes of Qwen2.5-0.5B and Qwen2.5-1.5B, forward and both backward products.

Validates every mode against the cpu twin on a small case first. Each figure is the median over
--iters calls timed with CUDA events, after --warmup calls (cuengine.benchmark.time_ms). The calls
are enqueued behind a spin kernel (its hold_ms), so the GPU never waits for Python and the events
time the GEMM alone. Input sets rotate (enough of them to hold 3× the 50 MB L2 between two uses of
one set), so L2 does not flatter the small shapes. Ceilings are cuengine.benchmark.CEILINGS, the
cuBLASLt measurements on the H200 at 8192³ (BF16 747 and FP8 1476 TFLOP/s).

Products of a linear layer x (M, C) -> y (M, OC) with w (OC, C), as the engine runs them:
    fwd  y = x wᵀ          BF16 TN; FP8 e4m3 × e4m3
    dx   dx = dy w          BF16 NN; FP8 e5m2 dy × e4m3 wᵀ-copy (TN)
    dw   dw += dyᵀ x        BF16 NT; FP8 e5m2 dyᵀ-copy × e4m3 xᵀ-copy (TN), accumulating
Outputs are bf16.

    python tools/bench_matmul.py                         # everything, about a minute on an H200
    python tools/bench_matmul.py --dtypes bf16 --models 0.5b --tokens 4096
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuengine as ce  # noqa: E402
from cuengine import blas  # noqa: E402
from cuengine.benchmark import CEILINGS, fill_random, time_ms  # noqa: E402

CEILING = {dt: CEILINGS[dt] / 1e12 for dt in ("bf16", "fp8")}  # TFLOP/s
L2_BYTES = 50 * 2**20
VOCAB = 151936
MODELS = {  # hidden, intermediate, q heads, kv heads, head size
    "0.5b": (896, 4864, 14, 2, 64),
    "1.5b": (1536, 8960, 12, 2, 128),
}
MODES = {"fwd": (False, True), "dx": (False, False), "dw": (True, False)}


def layers(model: str) -> list[tuple[str, int, int]]:
    """(name, in, out) of each linear layer."""
    hidden, inter, nq, nkv, hs = MODELS[model]
    return [
        ("qkv", hidden, (nq + 2 * nkv) * hs),
        ("att_out", nq * hs, hidden),
        ("up", hidden, 2 * inter),
        ("down", inter, hidden),
        ("lm_head", hidden, VOCAB),
    ]


def dims(product: str, tokens: int, cin: int, cout: int) -> tuple[int, int, int]:
    return {"fwd": (tokens, cout, cin), "dx": (tokens, cin, cout), "dw": (cout, cin, tokens)}[product]


def operands(dtype: str, product: str, M: int, N: int, K: int):
    """(a dtype, a shape, b dtype, b shape, trans_a, trans_b) as the engine calls matmul."""
    if dtype == "bf16":
        trans_a, trans_b = MODES[product]
        return ("bf16", (K, M) if trans_a else (M, K), "bf16", (N, K) if trans_b else (K, N), trans_a, trans_b)
    return ("e4m3" if product == "fwd" else "e5m2", (M, K), "e4m3", (N, K), False, True)


def make_set(dev, dtype, product, M, N, K, seed):
    a_dt, a_shape, b_dt, b_shape, trans_a, trans_b = operands(dtype, product, M, N, K)
    a = ce.Tensor.empty(a_dt, a_shape, dev, name="a")
    b = ce.Tensor.empty(b_dt, b_shape, dev, name="b")
    out = ce.Tensor.empty("bf16", (M, N), dev, name="out")
    for i, t in enumerate((a, b, out)):
        fill_random(t, 1.0, seed * 3 + i)
    return out, a, b, {"trans_a": trans_a, "trans_b": trans_b, "accumulate": product == "dw"}


def validate(dtypes) -> None:
    """Every mode on cuda against the cpu twin, on a small case; stops the benchmark on a mismatch."""
    M, N, K = 96, 160, 256
    g = np.random.default_rng(0)
    for dtype in dtypes:
        for product in MODES:
            a_dt, a_shape, b_dt, b_shape, trans_a, trans_b = operands(dtype, product, M, N, K)
            a, b = g.standard_normal(a_shape), g.standard_normal(b_shape) / math.sqrt(K)
            results = []
            for name in ("cpu", "cuda"):
                d = ce.device(name)
                ta = ce.Tensor.from_numpy(a, d, name="a", dtype=a_dt)
                tb = ce.Tensor.from_numpy(b, d, name="b", dtype=b_dt)
                for t in (ta, tb):
                    if t.stats is not None:  # unit scales: the values are the numbers
                        t.set_fp8_stats(1.0, 1.0, 1.0)
                out = ce.Tensor.empty("bf16", (M, N), d, name="out").fill_zero()
                blas.matmul(out, ta, tb, trans_a=trans_a, trans_b=trans_b, accumulate=product == "dw")
                results.append(out.numpy().astype(np.float64))
            err = np.max(np.abs(results[0] - results[1]) / (1.6e-2 + 1.6e-2 * np.abs(results[0])))
            if not err <= 1.0:
                sys.exit(f"validation failed: {dtype} {product}: cuda differs from the twin ({err:.2f}× tolerance)")
    print(f"validated {', '.join(dtypes)} × {', '.join(MODES)} against the cpu twin")


def bench(dev, dtype, product, M, N, K, warmup, iters) -> float:
    """Median milliseconds of one matmul."""
    set_bytes = 2 * (M * K + N * K) // (2 if dtype == "fp8" else 1) + 2 * M * N
    n_sets = max(2, min(8, 1 + math.ceil(3 * L2_BYTES / set_bytes)))
    sets = itertools.cycle([make_set(dev, dtype, product, M, N, K, seed) for seed in range(n_sets)])

    def call():
        out, a, b, kw = next(sets)
        blas.matmul(out, a, b, **kw)

    return time_ms(dev, call, warmup, iters, hold_ms=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", type=int, default=8192, help="M of the train step (B*T)")
    p.add_argument("--square", type=int, default=8192, help="size of the square case (0 to skip)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if not ce.cuda_available():
        print("bench_matmul: no CUDA device; nothing to measure", file=sys.stderr)
        sys.exit(1)
    dev = ce.device("cuda")
    blas.init(ce.TensorAllocator(dev))
    validate(args.dtypes)
    print(f"{dev.name}; median of {args.iters} after {args.warmup} warm-up calls; TFLOP/s (% of ceiling)")

    cases = []
    if args.square:
        cases.append((f"{args.square}³", "", "fwd", (args.square,) * 3))
    for model in args.models:
        for layer, cin, cout in layers(model):
            for product in MODES:
                cases.append((model, layer, product, dims(product, args.tokens, cin, cout)))

    head = f"{'model':<7}{'layer':<9}{'prod':<5}{'M':>7}{'N':>8}{'K':>7}"
    for dtype in args.dtypes:
        head += f"{dtype + ' ms':>11}{dtype + ' TFLOP/s':>24}"
    print(head)
    ms = {}  # (dtype, case index) -> median ms
    for i, (model, layer, product, (M, N, K)) in enumerate(cases):
        line = f"{model:<7}{layer:<9}{product:<5}{M:>7}{N:>8}{K:>7}"
        for dtype in args.dtypes:
            t = ms[dtype, i] = bench(dev, dtype, product, M, N, K, args.warmup, args.iters)
            tflops = 2 * M * N * K / t / 1e9
            line += f"{t:>11.3f}{f'{tflops:.0f} / {CEILING[dtype]:.0f} ({tflops / CEILING[dtype]:.0%})':>24}"
        print(line, flush=True)

    print("\nsummary: all train-step products of a model together (total FLOP / total time)")
    for dtype in args.dtypes:
        for model in args.models:
            idx = [i for i, case in enumerate(cases) if case[0] == model]
            flop = sum(2 * math.prod(cases[i][3]) for i in idx)
            tflops = flop / sum(ms[dtype, i] for i in idx) / 1e9
            print(
                f"  {dtype:<5}{model:<6}{tflops:>6.0f} / {CEILING[dtype]:.0f} TFLOP/s ({tflops / CEILING[dtype]:.0%})"
            )


if __name__ == "__main__":
    main()
