"""Where a data-parallel train step waits: per rank, the time no compute kernel runs and the NCCL
kernels beside it, from a CUPTI trace of the captured (CUDA graph) step. `--gpus 1` gives the
compute-kernel time without communication, to compare against.

Starts `--gpus` ranks (`cuengine.dist.launch`, NCCL); each builds the model with `--zero-stage`,
warms up (the first step eager, the second captures), records `--steps` steps under torch.profiler
(only as a CUPTI front end, as tools/profile_step.py uses it; the engine never imports torch) and
reduces its kernels with `cuengine.benchmark.stream_timeline`: the time inside the recorded span
when no compute kernel ran (what communication, or the host between steps, left exposed), the NCCL
kernels' time (per collective) and how much of it ran beside compute kernels, and the longest
gaps with the kernels on either side. Steps end with train_step's loss read-back, as in tools/bench_train.py.

    python3 tools/profile_dist.py --preset qwen2.5-1.5b --dtype bf16 --gpus 2 --zero-stage 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_timeline(preset: str, dtype: str, B: int, T: int, steps: int, zero_stage: int, top: int) -> dict:
    """One rank (spawned by `cuengine.dist.launch`): its stream_timeline over `steps` graph steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import cuengine as ce
    from cuengine.bench_train import random_batch
    from cuengine.benchmark import stream_timeline
    from cuengine.model import LlamaModel, TrainOptions, TransformerConfig

    comm = ce.dist.init()
    cfg = TransformerConfig.preset(preset)
    opts = TrainOptions(matmul_dtype="e4m3" if dtype == "fp8" else None, use_cuda_graphs=True, zero_stage=zero_stage)
    model = LlamaModel(cfg, opts, device=comm.device, comm=comm)
    model.init_weights(42)
    model.allocate_run_state(B, T)
    x, y = random_batch(cfg.vocab_size, B, T, seed=comm.rank)
    for _ in range(3):  # eager, capture, one replay
        model.train_step(x, y, lr=1e-4)
    comm.device.synchronize()
    # one step more is recorded and its kernels dropped (those before "step1" began on the host): the
    # ranks start the profiler at different times, and the first recorded step's first collective
    # would count the other rank's lateness
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps + 1):
            with record_function(f"step{k}"):
                model.train_step(x, y, lr=1e-4)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    start = min(float(e["ts"]) for e in events if e.get("name") == "step1")
    kernels = [(e["name"], e.get("args", {}).get("stream"), float(e["ts"]), float(e["dur"]))
               for e in events if e.get("cat") == "kernel" and float(e["ts"]) >= start]  # fmt: skip
    timeline = stream_timeline(kernels, top)
    del model
    comm.close()
    return timeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--batch", type=int, default=8, help="rows per GPU")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2])
    p.add_argument("--gaps", type=int, default=8, help="longest compute-stream gaps to list per rank")
    args = p.parse_args(argv)
    try:
        import torch.profiler  # noqa: F401
    except ImportError:
        print("torch is not installed: nothing to profile with")
        return 0
    import cuengine as ce

    res = ce.dist.launch(rank_timeline, args.gpus, args.preset, args.dtype, args.batch, args.seq, args.steps,
                         args.zero_stage, args.gaps, backend="nccl", timeout=600)  # fmt: skip
    n = args.steps
    print(f"{args.preset} {args.dtype}, {args.gpus} GPUs, ZeRO-{args.zero_stage}, B={args.batch} per GPU: per step")
    for rank, t in enumerate(res):
        print(f"rank {rank}: span {t['span_us'] / n / 1e3:.2f} ms; compute kernels {t['compute_us'] / n / 1e3:.2f} ms; "
              f"no compute {t['idle_us'] / n / 1e3:.2f} ms; NCCL kernels {t['nccl_us'] / n / 1e3:.2f} ms, "
              f"of which {t['nccl_hidden_us'] / n / 1e3:.2f} ms beside compute kernels")  # fmt: skip
        for name, us in sorted(t["nccl_by_name"].items(), key=lambda kv: -kv[1]):
            print(f"    {us / n / 1e3:7.3f} ms  {name[:90]}")
        for us, before, after, nccl in t["gaps"]:
            print(f"    idle {us:8.1f} us (NCCL running {nccl:7.1f})  after {before[:50]}  before {after[:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
