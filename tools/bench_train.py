"""Train-step throughput of the Qwen2.5-0.5B / 1.5B shapes: tokens/s, MFU and memory.

Random init, random tokens, B=8, T=1024 by default, CUDA graphs on. Each configuration runs
`--warmup` steps (the first runs eagerly, the second captures the graphs), then `--steps` timed
steps; a step is timed between CUDA events recorded at consecutive step starts, so it includes
the update that train_step leaves running. MFU is against cuengine.benchmark.CEILINGS["bf16_peak"]
(989 TFLOP/s, H100/H200 dense BF16) with `LlamaModel.flops_per_token` (6 per matmul parameter +
causal attention), the same count for FP8. Memory is the engine allocator's device total
(nothing is allocated in a step).

When torch and transformers import, the same step runs in HF transformers (the preset's
architecture from its config.json: Qwen2, Qwen3 or Llama; bf16 weights, SDPA, fused AdamW, its own
loss through `labels=`), eager and under torch.compile, and the ratio is printed; its memory is
torch's max_memory_allocated over the timed steps. DESIGN.md targets: 0.5B BF16 >= 170k tok/s,
FP8 >= 200k; 1.5B BF16 >= 66k, FP8 >= 85k.

    python tools/bench_train.py --preset qwen2.5-0.5b --dtype bf16 fp8 --steps 10
    python tools/bench_train.py --preset qwen2.5-0.5b qwen2.5-1.5b --batch 32 --grad-accum 16 --no-peer
    python tools/bench_train.py --preset qwen2.5-3b --no-peer --memory lean

Long context (issue 17): `--long-context` runs B=1 at T = 1024, 8192 and 16384 (or the `--seq`
values given) with LM-head chunks of 1024 rows (`--lmhead-chunks auto`); add the memory flags and
the attention backend to compare, e.g.

    python tools/bench_train.py --preset qwen2.5-0.5b --long-context --dtype bf16 --recompute block --offload-residual
    python tools/bench_train.py --preset qwen2.5-0.5b --long-context --memory lean --attention-backend raw

A T that does not fit prints allocate_run_state's answer (which options would make it fit); the
peer is run at every T and reported where it fits.

`--grad-accum N` makes a step N micro-batches of (--batch, --seq) and one update (tokens/s counts all
of them); the peer then runs N forward/backward passes before its optimizer step too. LLMQ's figures
at B=32 x 16 (524k-token steps): 160k (0.5B) and 61.4k (1.5B) tok/s, bf16.

`--gpus N` also runs each engine configuration data parallel on N GPUs (one process each, NCCL,
`--zero-stage`, --batch per GPU) right after its 1-GPU run, and prints the speedup (target >= 0.95 N),
the exposed communication per step (the N-GPU step time minus the 1-GPU one at the same per-GPU
batch: what backward and the optimizer did not hide) and the memory per GPU beside the 1-GPU figure
and the optimizer bytes that sharding saves.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import numpy as np

TARGETS = {("qwen2.5-0.5b", "bf16"): 170e3, ("qwen2.5-0.5b", "fp8"): 200e3,
           ("qwen2.5-1.5b", "bf16"): 66e3, ("qwen2.5-1.5b", "fp8"): 85e3}  # fmt: skip


def bench_engine(preset: str, dtype: str, B: int, T: int, steps: int, warmup: int, extra: dict,
                 accum: int = 1) -> dict:  # fmt: skip
    """`cuengine.bench_train.bench_train_step` (the measurement `cuengine bench` makes) on cuda with graphs."""
    import cuengine as ce
    from cuengine.bench_train import bench_train_step
    from cuengine.model import TransformerConfig

    r = bench_train_step(TransformerConfig.preset(preset), options(dtype, extra), ce.device("cuda"), B, T, steps,
                         warmup, accum)  # fmt: skip
    return dict(r, name=f"cuengine {dtype}")


FP8_ONLY = ("lmhead_fp8", "fp8_amax_history")


def options(dtype: str, extra: dict, **kw):
    """TrainOptions of one engine run: FP8 block matmuls for "fp8", CUDA graphs, the flags in `extra`
    (the FP8_ONLY ones only where the matmuls are FP8)."""
    from cuengine.model import TrainOptions

    if dtype != "fp8":
        extra = {k: v for k, v in extra.items() if k not in FP8_ONLY}
    return TrainOptions(matmul_dtype="e4m3" if dtype == "fp8" else None, use_cuda_graphs=True, **extra, **kw)


def bench_rank(preset: str, dtype: str, B: int, T: int, steps: int, warmup: int, extra: dict, accum: int,
               zero_stage: int) -> dict:  # fmt: skip
    """One rank of `--gpus N` (spawned by `cuengine.dist.launch`): `bench_engine` with a communicator."""
    import cuengine as ce
    from cuengine.bench_train import bench_train_step
    from cuengine.model import TransformerConfig

    comm = ce.dist.init()
    opts = options(dtype, extra, zero_stage=zero_stage)
    r = bench_train_step(TransformerConfig.preset(preset), opts, comm.device, B, T, steps, warmup, accum, comm=comm)
    r["report"] = str(r["report"])
    comm.close()
    return r


def bench_dist(r1: dict, preset: str, dtype: str, T: int, args, extra: dict) -> dict | None:
    """The `--gpus` run beside the 1-GPU result `r1`; prints the comparison."""
    import cuengine as ce

    gc.collect()  # the 1-GPU model's buffers go before the ranks allocate theirs
    n, z = args.gpus, args.zero_stage
    try:
        res = ce.dist.launch(bench_rank, n, preset, dtype, args.batch, T, args.steps, args.warmup, extra,
                             args.grad_accum, z, backend="nccl", timeout=600)  # fmt: skip
    except Exception as err:
        print(f"{preset} {dtype} x{n}: FAILED: {type(err).__name__}: {err}")
        return None
    r = dict(res[0], name=f"cuengine {dtype} {n} GPUs zero{z}", mem_gib=max(x["mem_gib"] for x in res), target=None)
    opt_bytes = (2 if args.opt_dtype == "bf16" else 4) * 2 * r["params"]
    saved = opt_bytes * (1 - 1 / n) if z > 0 else 0.0
    print(
        f"{preset} {dtype} x{n} zero{z}: {r['ms']:.2f} ms/step, {r['tok_s'] / 1e3:.1f}k tok/s = "
        f"{r['tok_s'] / r1['tok_s']:.2f}x one GPU (target >= {0.95 * n:.2f}x); exposed communication "
        f"{r['ms'] - r1['ms']:.2f} ms/step; {r['mem_gib']:.2f} GiB per GPU vs {r1['mem_gib']:.2f} on one "
        f"(sharded optimizer bytes saved: {saved / 2**30:.2f} GiB; target: below by at least that)",
        flush=True,
    )
    return r


def bench_peer(preset: str, B: int, T: int, steps: int, warmup: int, compiled: bool, accum: int = 1) -> dict:
    import torch
    import transformers

    from cuengine.bench_train import random_batch
    from cuengine.model import TransformerConfig

    cfg = TransformerConfig.preset(preset)
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "torch_dtype"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(device="cuda", dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.from_numpy(random_batch(cfg.vocab_size, B, T)[0].astype(np.int64)).cuda()

    fwd = torch.compile(model) if compiled else model  # the model compiled; fused AdamW runs as it is

    def fn():
        for _ in range(accum):
            # transformers' own loss (labels=, shifted inside): what a user of the peer runs, and what
            # torch.compile fuses; upcasting the logits here and calling cross_entropy outside the compiled
            # model read 29.4 GiB and 105.5k tok/s at 0.5B, against 17.9 GiB and 121.1k (eleventh session)
            loss = fwd(input_ids=x, labels=x).loss / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # torch's own events on torch's stream (cuengine.benchmark's are on the engine's), the same rule:
    # warm-up, events at consecutive step starts, median.
    for _ in range(warmup + (2 if compiled else 0)):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for i in range(steps):
        ev[i].record()
        fn()
    ev[steps].record()
    torch.cuda.synchronize()
    step_ms = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(steps))
    name = "HF transformers " + ("torch.compile" if compiled else "eager")
    out = {"name": name, "ms": step_ms, "tok_s": accum * B * T / (step_ms / 1e3), "mfu": float("nan"),
           "mem_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
    return out


def lmhead_chunks(arg: str | None, rows: int) -> int | None:
    """--lmhead-chunks: an int; "auto": the most chunks (a power of two dividing `rows`) that keep
    >= 1024 rows each, so the (rows / chunks, V) logits stay small at long T; None: the engine's
    choice (TrainOptions.lmhead_chunks=None) or the memory preset's."""
    if arg is None or arg != "auto":
        return None if arg is None else int(arg)
    chunks = 1
    while rows % (2 * chunks) == 0 and rows // (2 * chunks) >= 1024:
        chunks *= 2
    return chunks


def main(argv=None) -> int:
    from cuengine._cli_util import recompute_options
    from cuengine.model import TransformerConfig
    from cuengine.model.options import MEMORY_PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, ... (TransformerConfig.preset)")  # fmt: skip
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths T (default 1024)")
    p.add_argument("--long-context", action="store_true",
                   help="B=1, T = 1024 8192 16384 (unless --seq), --lmhead-chunks auto (unless given)")  # fmt: skip
    p.add_argument("--attention-backend", default="auto", choices=["auto", "raw", "cudnn"])
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lmhead-chunks", default=None,
                   help="an int, or 'auto': chunks of >= 1024 rows (default: the memory preset's; auto with "
                        "--long-context)")  # fmt: skip
    p.add_argument("--recompute", nargs="*", default=[],
                   help="recompute flags, e.g. ffn swiglu rmsnorm (TrainOptions.recompute_<name>)")  # fmt: skip
    p.add_argument("--recompute-ffn-layers", type=int, default=None,
                   help="recompute the up projection in the first N layers (recompute_ffn_layers)")  # fmt: skip
    p.add_argument("--memory", choices=MEMORY_PRESETS, default="default",
                   help="memory preset, --recompute added to it (as the CLI's --memory)")  # fmt: skip
    p.add_argument("--offload-residual", action="store_true")
    p.add_argument("--lmhead-fp8", action="store_true", help="fp8 runs: the LM head's GEMMs in FP8 too")
    p.add_argument("--fp8-amax-history", type=int, metavar="N",
                   help="fp8 runs: delayed scaling of the SwiGLU output and its input's gradient from the last N "
                        "micro-steps' abs-maxes (TrainOptions.fp8_amax_history; 0: current scaling; default: "
                        "the options' default, 16)")  # fmt: skip
    p.add_argument("--nondeterministic-attention", action="store_true",
                   help="cuDNN's non-deterministic attention backward (attention_deterministic=False)")  # fmt: skip
    p.add_argument("--opt-dtype", default="fp32", choices=["fp32", "bf16"], help="AdamW m and v dtype")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit", "muon"],
                   help="prints its update time and optimizer memory")  # fmt: skip
    p.add_argument("--no-peer", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--no-gemm-tuning", action="store_true",
                   help="cuBLASLt's first heuristic choice for every GEMM (cuengine/gemm_tuning.json off)")  # fmt: skip
    p.add_argument("--report", action="store_true", help="print the memory report of each engine run")
    p.add_argument("--gpus", type=int, default=1, help="also run each engine configuration on this many GPUs")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage of the --gpus runs")
    args = p.parse_args(argv)
    import cuengine as ce

    if not ce.cuda_available():
        print("bench_train: no CUDA device; nothing to measure")
        return 0
    if args.no_gemm_tuning:
        from cuengine import blas

        blas.use_tuned_algorithms(False)
    if args.long_context:
        args.batch = 1
        args.seq = args.seq or [1024, 8192, 16384]
        args.lmhead_chunks = args.lmhead_chunks or "auto"
    seqs = args.seq or [1024]
    chunks_arg = args.lmhead_chunks
    extra = {"lmhead_fp8": True} if args.lmhead_fp8 else {}
    if args.fp8_amax_history is not None:
        extra["fp8_amax_history"] = args.fp8_amax_history
    extra.update(offload_residual=args.offload_residual, attention_backend=args.attention_backend,
                 opt_m_dtype=args.opt_dtype, opt_v_dtype=args.opt_dtype, optimizer=args.optimizer,
                 attention_deterministic=not args.nondeterministic_attention)  # fmt: skip
    accum = args.grad_accum
    try:
        import torch
        import transformers  # noqa: F401

        peer = not args.no_peer
    except ImportError:
        peer = False
        print("bench_train: torch/transformers not importable; no peer comparison")
    rows = []
    for preset, T in ((p_, t) for p_ in args.preset for t in seqs):
        runs = []
        label = preset if len(seqs) == 1 else f"{preset} T={T}"
        layers = TransformerConfig.preset(preset).num_layers
        run_extra = {**extra, **recompute_options(args.memory, args.recompute, layers)}
        if args.recompute_ffn_layers is not None:
            run_extra["recompute_ffn_layers"] = args.recompute_ffn_layers
        chunks = lmhead_chunks(chunks_arg, args.batch * T)
        if chunks is not None:
            run_extra["lmhead_chunks"] = chunks
        for dtype in args.dtype:
            try:
                r = bench_engine(preset, dtype, args.batch, T, args.steps, args.warmup,
                                 run_extra, accum)  # fmt: skip
            except Exception as err:  # report and go on: one failing configuration should not hide the rest
                first = "\n".join(str(err).splitlines()[:2])  # an out-of-memory's advice, without its table
                print(f"{label} {dtype}: FAILED: {type(err).__name__}: {first}", flush=True)
                continue
            target = TARGETS.get((preset, dtype)) if (args.batch, T, accum) == (8, 1024, 1) else None
            r["target"] = target
            print(f"{label} {dtype}: {r['ms']:.2f} ms/step, {r['tok_s'] / 1e3:.1f}k tok/s, MFU {100 * r['mfu']:.1f}%, "
                  f"{r['mem_gib']:.2f} GiB, loss {r['first_loss']:.3f} -> {r['loss']:.3f}, setup {r['setup_s']:.0f} s"
                  + (f", target {target / 1e3:.0f}k" if target else ""), flush=True)  # fmt: skip
            print(f"  {args.optimizer}: update {r['update_ms']:.2f} ms, optimizer memory "
                  f"{r['report'].by_context['Optimizer'][0] / 2**30:.3f} GiB", flush=True)  # fmt: skip
            if args.report:
                print(r["report"])
            runs.append(r)
            if args.gpus > 1:
                d = bench_dist(r, preset, dtype, T, args, run_extra)
                if d is not None:
                    runs.append(d)
        if peer:
            # the engine's last model is gone before the peer allocates (the eager 1.5B peer once ran out of memory
            # on an 80 GB H100 beside 33.5 GiB of it, which cuBLASLt's module-level state held through the model's
            # allocator, now held weakly); the collection is for anything left in a reference cycle
            gc.collect()
            for compiled in (False, True):
                try:
                    r = bench_peer(preset, args.batch, T, args.steps, args.warmup, compiled, accum)
                except Exception as err:
                    print(f"{label} peer compiled={compiled}: FAILED: {type(err).__name__}: {str(err)[:300]}")
                    torch.cuda.empty_cache()
                    continue
                print(f"{label} {r['name']}: {r['ms']:.2f} ms/step, {r['tok_s'] / 1e3:.1f}k tok/s, "
                      f"{r['mem_gib']:.2f} GiB", flush=True)  # fmt: skip
                runs.append(r)
                torch.cuda.empty_cache()
        rows += [(label, r) for r in runs]
    print(f"\n{'shape':<22}{'run':<32}{'ms/step':>9}{'ktok/s':>9}{'MFU %':>7}{'GiB':>8}{'target':>8}")
    for preset, r in rows:
        tgt = f"{r['target'] / 1e3:.0f}k" if r.get("target") else ""
        mfu = "" if np.isnan(r["mfu"]) else f"{100 * r['mfu']:.1f}"
        print(f"{preset:<22}{r['name']:<32}{r['ms']:>9.2f}{r['tok_s'] / 1e3:>9.1f}{mfu:>7}{r['mem_gib']:>8.2f}{tgt:>8}")
    for preset in dict.fromkeys(p_ for p_, _ in rows):
        mine = [r for p_, r in rows if p_ == preset and r["name"].startswith("cuengine")]
        peers = [r for p_, r in rows if p_ == preset and r["name"].startswith("HF")]
        for m in mine:
            for q in peers:
                print(f"{preset}: {m['name']} / {q['name']}: {m['tok_s'] / q['tok_s']:.2f}x tokens/s, "
                      f"{m['mem_gib'] / q['mem_gib']:.2f}x memory")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
