"""Where a train step's (or a decode step's) GPU time goes: a per-kernel table for one preset.

Uses torch.profiler only as a CUPTI front end (it records every CUDA kernel in the process,
CuPy's and cuBLASLt's included); the engine itself never imports torch. Skips cleanly without it.
Beside the kernel sum it prints the step's wall time on the GPU (cuengine.benchmark.time_ms: warm-up,
CUDA events, median), so the gap between the two is the time the GPU waits for Python.

    python3 tools/profile_step.py --preset qwen2.5-0.5b --dtype bf16
    python3 tools/profile_step.py --dtype fp8 --fp8-amax-history 0   # FP8 with current scaling
    python3 tools/profile_step.py --decode --batch 1 --dtype fp8    # decode step, FP8 decode weights
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--nondeterministic-attention", action="store_true",
                   help="cuDNN's non-deterministic attention backward (attention_deterministic=False)")  # fmt: skip
    p.add_argument("--fp8-amax-history", type=int, metavar="N",
                   help="with --dtype fp8: delayed scaling over N steps, 0 current scaling (TrainOptions."
                        "fp8_amax_history; default: the options' default, 16)")  # fmt: skip
    p.add_argument("--decode", action="store_true",
                   help="profile one decode step of --batch rows after a --seq-token prompt instead")  # fmt: skip
    args = p.parse_args(argv)
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("torch is not installed: nothing to profile with")
        return 0
    import cuengine as ce
    from cuengine.model import TransformerConfig

    cfg = TransformerConfig.preset(args.preset)
    dev = ce.device("cuda")
    if args.decode:
        run, step_ms = decode_step(cfg, dev, args)
    else:
        run, step_ms = train_step(cfg, dev, args)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            run()
        dev.synchronize()
    what = "decode" if args.decode else "train"
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    events.sort(key=lambda e: -e.device_time_total)
    kernels_ms = total / args.steps / 1e3
    calls = sum(e.count for e in events) / args.steps
    print(f"{args.preset} {args.dtype} {what} b={args.batch}: GPU time per step {kernels_ms:.3f} ms in {calls:.0f} "
          f"kernels (eager); step {step_ms:.3f} ms (events, median of {args.steps}): the GPU is busy "
          f"{kernels_ms / step_ms:.0%}")  # fmt: skip
    groups = {}
    for e in events:
        g = kernel_group(e.key)
        groups[g] = groups.get(g, 0.0) + e.device_time_total
    print(
        "by group: "
        + ", ".join(f"{g} {t / args.steps / 1e3:.3f} ms" for g, t in sorted(groups.items(), key=lambda kv: -kv[1]))
    )
    print(f"{'kernel':<70}{'calls/step':>11}{'us/call':>9}{'ms/step':>10}{'%':>7}")
    for e in events[: args.rows]:
        name = e.key if len(e.key) <= 68 else e.key[:65] + "..."
        share = 100 * e.device_time_total / total
        per_call = e.device_time_total / e.count
        print(f"{name:<70}{e.count / args.steps:>11.0f}{per_call:>9.1f}{e.device_time_total / args.steps / 1e3:>10.3f}"
              f"{share:>7.1f}")  # fmt: skip
    return 0


def kernel_group(name: str) -> str:
    """GEMM (cuBLASLt's kernels), attention (cuDNN's or ours) or everything else: what a step's floor
    analysis needs apart, since the GEMMs run at their cuBLASLt rate and the rest against copy bandwidth."""
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass")):
        return "gemm"
    if any(k in low for k in ("cudnn", "sdpa", "flash", "attention")):
        return "attention"
    return "other"


def train_step(cfg, dev, args):
    """(run one eager train step, the graph-free step's median ms)."""
    import numpy as np

    from cuengine.benchmark import time_ms
    from cuengine.model import LlamaModel, TrainOptions

    opts = TrainOptions(matmul_dtype="e4m3" if args.dtype == "fp8" else None, use_cuda_graphs=False,
                        attention_deterministic=not args.nondeterministic_attention,
                        fp8_amax_history=args.fp8_amax_history)  # fmt: skip
    model = LlamaModel(cfg, opts, device=dev)
    model.init_weights(42)
    model.allocate_run_state(args.batch, args.seq)
    g = np.random.default_rng(0)
    x = g.integers(0, cfg.vocab_size, (args.batch, args.seq), dtype=np.int32)
    y = np.roll(x, -1, axis=1)
    step_ms = time_ms(dev, lambda: model.train_step(x, y, lr=1e-4), warmup=2, iters=args.steps)
    return (lambda: model.train_step(x, y, lr=1e-4)), step_ms


def decode_step(cfg, dev, args):
    """(run one eager decode step of --batch rows, the captured step's median ms): the eager kernels
    are the graph's kernels, so the gap between their sum and the graph's step time is launch gaps."""
    import numpy as np

    from cuengine.benchmark import time_ms
    from cuengine.inference import decode
    from cuengine.inference.state import choose_ffn_arm
    from cuengine.kernels import sampling
    from cuengine.model import LlamaModel

    b = args.batch
    model = LlamaModel(cfg, device=dev)
    model.init_weights(42)
    st = model.allocate_inference_state(max_batch=b, max_seq_len=args.seq + 64 * args.steps + 64,
                                        weights="fp8" if args.dtype == "fp8" else "bf16")  # fmt: skip
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, args.seq)).tolist()
    st.start(prompts, sampling.sampling_params(0.0, 0, 1.0, 0))
    st.prefill()
    arm = choose_ffn_arm(b, st.weights)
    step_ms = time_ms(dev, lambda: decode.step(st, b, arm), warmup=3, iters=20 * args.steps, hold_ms=20)
    return (lambda: decode.decode_step_rows(st, b, arm)), step_ms


if __name__ == "__main__":
    sys.exit(main())
