"""The optimizers side by side (issue 18): update time, optimizer memory and what they learn.

For each of `--optimizer` (default: adamw, adamw8bit, muon):
- at each `--preset` (default Qwen2.5-0.5B and 1.5B, B=8, T=1024, bf16, CUDA graphs): the update
  alone (global norm + optimizer, `cuengine.bench_train.bench_train_step`'s `update_ms`, median of
  `--steps`) and the allocator's "Optimizer" context;
- the loss after `--train-steps` (300) optimizer steps of `cuengine train` on its embedded default
  (the standard library corpus, the 25M "small" model on cuda, its default schedule), run as a
  subprocess so each run starts from a free GPU: the last logged train loss and the validation loss.

    python3 tools/bench_optimizers.py
    python3 tools/bench_optimizers.py --optimizer adamw muon --preset qwen2.5-0.5b --train-steps 100
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile

OPTIMIZERS = ("adamw", "adamw8bit", "muon")


def update_figures(preset: str, optimizer: str, steps: int) -> str:
    import cuengine as ce
    from cuengine.bench_train import bench_train_step
    from cuengine.model import TrainOptions, TransformerConfig

    opts = TrainOptions(use_cuda_graphs=True, optimizer=optimizer)
    r = bench_train_step(TransformerConfig.preset(preset), opts, ce.device("cuda"), 8, 1024, steps, 3)
    opt_gib = r["report"].by_context["Optimizer"][0] / 2**30
    return (f"{preset:<14}{optimizer:<11}{r['update_ms']:>10.2f}{opt_gib:>12.3f}{r['ms']:>10.2f}"
            f"{r['tok_s'] / 1e3:>9.1f}")  # fmt: skip


def train_losses(optimizer: str, steps: int) -> str:
    """(last train loss, val loss) of `cuengine train --steps N --optimizer X` as printed."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "cuengine.cli", "train", "--steps", str(steps), "--optimizer", optimizer,
               "--out", out, "--print-every", str(steps), "--seed", "0", "--sample-tokens", "0"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
    last = [line for line in run.stdout.splitlines() if line.startswith(f"step {steps}/")]
    if run.returncode or not last:
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        return f"{optimizer:<11} FAILED (exit {run.returncode}): {' | '.join(tail)}"
    loss = re.search(r"loss ([0-9.]+)", last[0])
    val = re.search(r"val ([0-9.]+)", last[0])
    return f"{optimizer:<11}{float(loss.group(1)):>12.4f}{float(val.group(1)) if val else float('nan'):>10.4f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--steps", type=int, default=5, help="timed steps and updates per shape")
    p.add_argument("--train-steps", type=int, default=300, help="optimizer steps of the default cuengine train run")
    args = p.parse_args(argv)
    import cuengine as ce

    if not ce.cuda_available():
        print("bench_optimizers: no CUDA device; nothing to measure")
        return 0
    print(f"{'shape':<14}{'optimizer':<11}{'update ms':>10}{'optim GiB':>12}{'step ms':>10}{'ktok/s':>9}")
    for preset in args.preset:
        for optimizer in args.optimizer:
            try:
                print(update_figures(preset, optimizer, args.steps), flush=True)
            except Exception as err:  # one failing configuration should not hide the rest
                print(f"{preset:<14}{optimizer:<11} FAILED: {type(err).__name__}: {str(err)[:200]}", flush=True)
    print(f"\ncuengine train, default model and data, {args.train_steps} steps")
    print(f"{'optimizer':<11}{'train loss':>12}{'val loss':>10}")
    for optimizer in args.optimizer:
        print(train_losses(optimizer, args.train_steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
