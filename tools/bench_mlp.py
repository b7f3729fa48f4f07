"""Benchmark the MLP op (cuengine.ops.mlp): forward + backward time and memory, with and without recompute.

Validates a small case against the cpu twin first, then for each activation and recompute mode
times mlp_forward and mlp_backward with CUDA events after a warm-up (median of --iters,
cuengine.benchmark.time_phases_ms) and reports TFLOP/s against the BF16 matmul ceiling
(cuengine.benchmark.CEILINGS), and the peak activation memory: stack high-water mark + what forward
saves for backward.

    python tools/bench_mlp.py                       # 8192 tokens, 4096 -> 11008 -> 4096, bf16
    python tools/bench_mlp.py --activations relu_sq --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuengine as ce  # noqa: E402
from cuengine.benchmark import CEILINGS, fill_random, time_phases_ms  # noqa: E402
from cuengine.kernels.activations import GATED  # noqa: E402
from cuengine.ops import mlp_backward, mlp_forward, mlp_stack_bytes  # noqa: E402

MiB = 2**20


def validate(act, dtype, matmul_dtype):
    """A small case on cuda against the cpu twin; stops the benchmark if they disagree."""
    n, inp, hidden, out = 256, 512, 1376, 512
    f1 = 2 * hidden if act in GATED else hidden
    r = np.random.default_rng(0)
    arrays = {
        "x": r.standard_normal((n, inp)),
        "w1": r.standard_normal((f1, inp)) / np.sqrt(inp),
        "w2": r.standard_normal((out, hidden)) / np.sqrt(hidden),
        "dout": r.standard_normal((n, out)),
    }
    res = {}
    for name in ("cpu", "cuda"):
        dev = ce.device(name)
        t = {k: ce.Tensor.from_numpy(v, dev, name=k, dtype=dtype) for k, v in arrays.items()}
        o, dx = ce.Tensor.empty(dtype, (n, out), dev), ce.Tensor.empty(dtype, (n, inp), dev)
        dw1, dw2 = ce.Tensor.empty(dtype, (f1, inp), dev), ce.Tensor.empty(dtype, (out, hidden), dev)
        size = mlp_stack_bytes(n, inp, hidden, out, act, True, dtype, matmul_dtype)
        stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (size,), dev))
        ctx = mlp_forward(o, None, t["x"], t["w1"], t["w2"], act, stack, matmul_dtype=matmul_dtype)
        mlp_backward(dx, dw1, dw2, t["dout"], ctx, stack)
        res[name] = [a.numpy().astype(np.float64) for a in (o, dx, dw1, dw2)]
    for what, a, e in zip(("out", "dx", "dw1", "dw2"), res["cuda"], res["cpu"]):
        err = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)
        if not err < (6e-2 if matmul_dtype else 2e-2):
            sys.exit(f"validation failed: {act} {what}: max error {err:.3g} of the largest value")


def bench(args, act, recompute):
    dev = ce.device("cuda")
    dt = ce.dtype(args.dtype)
    n, inp, hidden, out = args.tokens, args.in_features, args.hidden, args.out_features or args.in_features
    f1 = 2 * hidden if act in GATED else hidden
    alloc = ce.TensorAllocator(dev)
    x, dout = alloc.allocate(dt, "x", (n, inp)), alloc.allocate(dt, "dout", (n, out))
    w1, w2 = alloc.allocate(dt, "w1", (f1, inp)), alloc.allocate(dt, "w2", (out, hidden))
    for i, (t, scale) in enumerate(((x, 1.0), (dout, 1.0), (w1, inp**-0.5), (w2, hidden**-0.5))):
        fill_random(t, scale, i)
    o, dx = alloc.allocate(dt, "out", (n, out)), alloc.allocate(dt, "dx", (n, inp))
    dw1, dw2 = alloc.allocate(dt, "dw1", w1.shape), alloc.allocate(dt, "dw2", w2.shape)
    dw1.fill_zero()
    dw2.fill_zero()
    preact = None if recompute else alloc.allocate(dt, "preact", (n, f1))
    sim = ce.DeviceMemoryStack.simulate()
    ctx = mlp_forward(o, preact, x, w1, w2, act, sim, matmul_dtype=args.matmul_dtype)
    mlp_backward(dx, dw1, dw2, dout, ctx, sim)
    stack = ce.DeviceMemoryStack.sized_from(sim, alloc)

    saved = {}

    def forward():
        saved["ctx"] = mlp_forward(o, preact, x, w1, w2, act, stack, matmul_dtype=args.matmul_dtype,
                                   fuse_grad_accum=args.fuse_grad_accum)  # fmt: skip

    def backward():
        mlp_backward(dx, dw1, dw2, dout, saved["ctx"], stack)

    fwd, bwd = time_phases_ms(dev, [forward, backward], args.warmup, args.iters)
    ctx = saved["ctx"]
    gemm_fwd = 2.0 * n * (inp * f1 + hidden * out)
    model = 3 * gemm_fwd  # forward + the four backward GEMMs
    executed = model + (2.0 * n * inp * f1 if recompute else 0.0)  # + the recomputed fc1
    row = {
        "act": act,
        "recompute": recompute,
        "fwd_ms": fwd,
        "bwd_ms": bwd,
        "total_ms": fwd + bwd,
        "model_tflops": model / (fwd + bwd) / 1e9,
        "exec_tflops": executed / (fwd + bwd) / 1e9,
        "stack_mib": stack.high_water_mark / MiB,
        "saved_mib": ctx.saved_bytes / MiB,
    }
    alloc.free_all()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--in-features", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=11008)
    p.add_argument("--out-features", type=int, default=None, help="default: --in-features")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--activations", default="swiglu,gelu_tanh_approx")
    p.add_argument("--matmul-dtype", default=None, choices=["e4m3"], help="FP8 forward GEMMs (backward stays bf16)")
    p.add_argument("--fuse-grad-accum", action="store_true", help="accumulate dW (beta = 1) instead of writing")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not ce.cuda_available():
        sys.exit("bench_mlp needs a CUDA device")
    acts = args.activations.split(",")
    for act in acts:
        validate(act, args.dtype, args.matmul_dtype)
    rows = [bench(args, act, rc) for act in acts for rc in (False, True)]
    ceiling = CEILINGS["bf16"] / 1e12  # fp32 has no tensor-core path worth quoting: its % is of this too
    out = args.out_features or args.in_features
    fp8 = ", e4m3 forward GEMMs" if args.matmul_dtype else ""
    print(f"MLP {args.tokens} tokens, {args.in_features} -> {args.hidden} -> {out}, {args.dtype}{fp8}; "
          f"median of {args.iters} after {args.warmup} warm-up; ceiling {ceiling:.0f} TFLOP/s")  # fmt: skip
    print("model TFLOP/s counts 3x the forward GEMMs; executed adds the recompute GEMM.")
    head = ("activation", "recompute", "fwd ms", "bwd ms", "total ms", "model TF/s", "exec TF/s", "% ceil",
            "stack MiB", "saved MiB", "peak MiB")  # fmt: skip
    print(("{:<18}{:>10}" + "{:>11}" * 9).format(*head))
    for r in rows:
        print(
            ("{:<18}{:>10}" + "{:>11.2f}" * 6 + "{:>11.0f}" * 3).format(
                r["act"], str(r["recompute"]), r["fwd_ms"], r["bwd_ms"], r["total_ms"], r["model_tflops"],
                r["exec_tflops"], 100 * r["exec_tflops"] / ceiling, r["stack_mib"], r["saved_mib"],
                r["stack_mib"] + r["saved_mib"],
            )
        )  # fmt: skip


if __name__ == "__main__":
    main()
