"""Tune cuBLASLt's algorithm choice for the train step's GEMMs; write cuengine/gemm_tuning.json.

cuBLASLt's first heuristic choice is up to a quarter slower than the best of its top 8 at some of
the train step's shapes (PERF_NOTES 23). For each preset, dtype and batch: a fresh model (random init,
T = 1024 as bench_train) runs one eager train step with `blas.record_plans()` open, so every GEMM
the step makes a plan for is recorded with its operands. Each plan's candidates (the heuristic's
top `blas.CANDIDATES`) then run on fresh random operands of the recorded shapes, dtypes and
alignments (the same plan key):
- once each from the same starting output, on two sets of data; a candidate whose output (and, for
  an FP8 output, its abs-max) is not bitwise the first choice's is dropped, so the table cannot
  change a result;
- then timed, interleaved over --rounds rounds, the median per candidate.
The fastest remaining candidate is written when it beats the first choice by at least --min-gain;
otherwise the plan gets no entry and keeps the heuristic's choice. Entries are keyed by the GPU's
name and cuBLASLt's version, and merged into the existing file (a re-tuned key is replaced).

    python tools/tune_gemm.py --preset qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b --dtype bf16 fp8
    python tools/tune_gemm.py --preset qwen2.5-0.5b --batch 32 --dtype bf16 --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuengine as ce  # noqa: E402
from cuengine import blas  # noqa: E402
from cuengine.bench_train import random_batch  # noqa: E402
from cuengine.benchmark import fill_random, time_ms  # noqa: E402


def choose(times: list[float], same_bits: list[bool], min_gain: float) -> int | None:
    """Index of the candidate to write, or None to keep the first (index 0, the heuristic's
    choice): the fastest candidate whose output is bitwise the first's, if it is at least
    `min_gain` (a fraction) faster than the first."""
    if len(times) != len(same_bits) or not times:
        raise ValueError(f"choose: {len(times)} times for {len(same_bits)} candidates")
    allowed = [i for i in range(len(times)) if same_bits[i]]
    best = min(allowed, key=lambda i: times[i], default=0)
    return best if best != 0 and times[0] >= (1 + min_gain) * times[best] else None


def merge(table: dict, gpu: str, version: int, entries: dict) -> dict:
    """`table` (the file's contents, or {}) with `entries` written into the (gpu, version) table."""
    tables = [t for t in table.get("tables", []) if (t["gpu"], int(t["cublaslt"])) != (gpu, version)]
    old = next((t for t in table.get("tables", []) if (t["gpu"], int(t["cublaslt"])) == (gpu, version)), None)
    merged = dict(old["entries"]) if old else {}
    merged.update(entries)
    tables.append({"gpu": gpu, "cublaslt": version, "entries": dict(sorted(merged.items()))})
    return {"tables": sorted(tables, key=lambda t: (t["gpu"], t["cublaslt"]))}


def _snapshot(out):
    """A device copy of out (and of an FP8 out's stats). CuPy works on its own stream, which does
    not wait for the engine's (a non-blocking stream): so the device is synchronised around it."""
    out.device.synchronize()
    snap = out.array().copy(), (out.stats.array().copy() if out.dtype.is_fp8 else None)
    out.device.synchronize()
    return snap


def _restore(out, snap) -> None:
    out.device.synchronize()
    out.array()[...] = snap[0]
    out.device.synchronize()


def _fresh_like(t, align: int):
    """A new tensor of t's dtype and shape at an address of alignment `align` (as blas reads it:
    capped at 256), so that it gives the same plan key as t."""
    pad = (align if 0 < align < 256 else 0) // t.dtype.itemsize  # elements; every alignment here is >= 16 bytes
    base = ce.Tensor.empty(t.dtype, (t.nelem + 256 // t.dtype.itemsize,), t.device, name=t.name)
    return base.rows(pad, pad + t.nelem).reshape(t.shape)


def _fill(call: dict, seed: int) -> None:
    call["out"].device.synchronize()
    for i, name in enumerate(("out", "a", "b", "bias")):
        if call[name] is not None:
            fill_random(call[name], 1.0, seed * 4 + i)
    call["out"].device.synchronize()


def tune_plan(dev, key, recorded: dict, rounds: int, min_gain: float) -> tuple[dict | None, str]:
    """Run and time every candidate of one recorded plan; returns (configuration or None, report line).

    On fresh random operands with the recorded shapes, dtypes and alignments: the recorded ones may
    lie in the step's stack, where later temporaries left other data (FP8 codes that are NaN)."""
    align = dict(zip(("a", "b", "out", "bias"), key[-4:]))
    call = dict(recorded, **{n: None if recorded[n] is None else _fresh_like(recorded[n], align[n]) for n in align})
    text = blas.key_text(key)
    if blas.plan_key(**call) != key:
        return None, f"{text:<62} not tuned: fresh operands give the key {blas.key_text(blas.plan_key(**call))}"
    out = call["out"]
    candidates = blas.plan_candidates(dev, key)

    def run():
        blas.matmul(**call)

    same = [True] * len(candidates)
    for seed in (1, 2):  # two data sets: a different order of sums shows in either
        _fill(call, seed)
        start = _snapshot(out)
        first = None
        for i, (_config, ptr) in enumerate(candidates):  # one output held beside the first's (B = 32: 10 GB each)
            blas.set_plan_algorithm(dev, key, ptr)
            _restore(out, start)
            run()
            if first is None:
                first = _snapshot(out)
                continue
            out.device.synchronize()
            same[i] &= bool(dev.xp.array_equal(out.array(), first[0])) and (
                first[1] is None or bool(dev.xp.array_equal(out.stats.array(), first[1]))
            )
        del start, first
    samples: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for i, (_config, ptr) in enumerate(candidates):
            blas.set_plan_algorithm(dev, key, ptr)
            samples[i].append(time_ms(dev, run, warmup=1, iters=5, reps=3))
    times = [statistics.median(s) for s in samples]
    pick = choose(times, same, min_gain)
    blas.set_plan_algorithm(dev, key, candidates[0][1])
    best = pick if pick is not None else 0
    line = (f"{text:<62} first {1e3 * times[0]:9.1f} us  pick #{best} {1e3 * times[best]:9.1f} us "
            f"({100 * (times[0] / times[best] - 1):5.1f}%)  {sum(same)}/{len(same)} bitwise the first; "
            f"fastest #{min(range(len(times)), key=times.__getitem__)} {1e3 * min(times):9.1f} us")  # fmt: skip
    return (None if pick is None else candidates[pick][0]), line


def tune_model(preset: str, dtype: str, B: int, T: int, rounds: int, min_gain: float) -> dict:
    """One model's step: its plans tuned; returns {key text: configuration}."""
    from cuengine.model import LlamaModel, TrainOptions, TransformerConfig

    dev = ce.device("cuda")
    cfg = TransformerConfig.preset(preset)
    model = LlamaModel(cfg, TrainOptions(matmul_dtype="e4m3" if dtype == "fp8" else None), device=dev)
    model.init_weights(42)
    model.allocate_run_state(B, T)
    x, y = random_batch(cfg.vocab_size, B, T)
    with blas.record_plans() as calls:
        model.train_step(x, y, lr=1e-4)
    dev.synchronize()
    if not calls:
        raise RuntimeError(f"{preset} {dtype}: the train step made no new matmul plan to tune")
    entries = {}
    print(f"== {preset} {dtype} B={B} T={T}: {len(calls)} plans", flush=True)
    for key, call in calls:
        config, line = tune_plan(dev, key, call, rounds, min_gain)
        print("  " + line, flush=True)
        if config is not None:
            entries[blas.key_text(key)] = config
    del model, calls
    gc.collect()
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--batch", nargs="+", type=int, default=[8])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--min-gain", type=float, default=0.02, help="fraction the pick must beat the first by")
    p.add_argument("--out", type=Path, default=blas.TUNING_PATH)
    args = p.parse_args(argv)
    if not ce.cuda_available():
        print("tune_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    blas.use_tuned_algorithms(False)  # each plan starts from the heuristic's first choice
    dev = ce.device("cuda")
    version = blas._lt().get_version()
    entries = {}
    for preset in args.preset:
        for dtype in args.dtype:
            for B in args.batch:
                entries.update(tune_model(preset, dtype, B, args.seq, args.rounds, args.min_gain))
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.write_text(json.dumps(merge(table, dev.name, version, entries), indent=1) + "\n")
    print(f"{len(entries)} entries for {dev.name}, cuBLASLt {version} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
