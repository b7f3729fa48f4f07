"""Bandwidth of the memory-bound kernel families against the device-to-device copy ceiling.

Each case moves at least 64 MB (bytes read + bytes written, counting every tensor once: the
algorithmic minimum, not what the kernel happens to re-read from L2). The ceiling is measured
here, as a 1 GiB device-to-device copy timed the same way (CEILINGS["copy"] in cuengine.benchmark
is the known H200 figure). Timing: cuengine.benchmark.time_ms, CUDA events around a few
back-to-back launches (about 200 MB of traffic) after a warm-up; the median per launch. The timed
launches queue up behind a spin kernel (`--hold-ms`), so that a kernel shorter than its Python
wrapper is timed on the GPU alone, as it runs inside a captured step (`--hold-ms 0`: the launches
are timed as Python issues them, the measurement before 2026-11-30's seventh session).
Each case is also timed against a device-to-device copy of the same bytes (the "% same-size copy"
column): a copy of 60-130 MB itself reaches only ~90% of the 1 GiB figure.

    python tools/bench_kernels.py                      # every family
    python tools/bench_kernels.py --family fp8,adamw   # some of them
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuengine as ce  # noqa: E402
from cuengine.benchmark import CEILINGS, time_ms  # noqa: E402
from cuengine.benchmark import fill_random as fill  # noqa: E402

FAMILIES = ("classifier", "fp8", "norm", "adamw", "encoder", "rmsnorm", "rope", "swiglu")
MB = 1e6


def randint(t, high, seed=0):
    xp = t.device.xp
    t.array()[...] = xp.random.default_rng(seed).integers(0, high, t.shape, dtype=xp.int32)
    return t


def tensor(dev, dtype, shape, scale=1.0, seed=0, name="t"):
    return fill(ce.Tensor.empty(dtype, shape, dev, name=name), scale, seed)


def launch_ms(dev, fn, nbytes: int, warmup: int, iters: int, hold_ms: float) -> float:
    """Median milliseconds per call of fn(), with enough calls per sample for about 200 MB of
    traffic; with hold_ms > 0 every timed call is queued before the GPU starts on them."""
    reps = max(1, min(64, round(2e8 / max(nbytes, 1))))
    return time_ms(dev, fn, warmup, iters, reps=reps, hold_ms=hold_ms)


# ---- cases: each yields (family, case, bytes moved, fn) ------------------------------------------
def same_size_copy(dev, src, dst, nbytes: int):
    """A device-to-device copy moving `nbytes` (half read, half written) between prefixes of the
    ceiling's buffers (at most their size): what a copy of a case's bytes reaches at that size, which
    is below the 1 GiB figure for the smaller cases (a wave's ramp and drain weigh more)."""
    n = max(1, min(nbytes // 2, src.nbytes))
    a, b = src.rows(0, n), dst.rows(0, n)
    return lambda: dev.copy_async(b, a)


def classifier_cases(dev, shrink):
    from cuengine.kernels.classifier import fused_classifier

    for n, v, dt in ((2048, 151936, ce.BF16), (2048, 151936, ce.FP32), (131072, 256, ce.BF16)):
        n = max(1, n // shrink)
        logits = tensor(dev, dt, (n, v), 2.0)
        losses, lse = ce.Tensor.empty(ce.FP32, (n,), dev).fill_zero(), ce.Tensor.empty(ce.FP32, (n,), dev)
        targets = randint(ce.Tensor.empty(ce.INT32, (n,), dev), v, 1)
        size = logits.nbytes
        # Replays overwrite the logits with dlogits: the work per launch is the same.
        args = (logits, losses, lse, targets, 1.0 / n)
        yield "classifier", f"fwd+bwd ({n}, {v}) {dt}", 2 * size, lambda a=args: fused_classifier(*a)
        yield "classifier", f"fwd only ({n}, {v}) {dt}", size, lambda a=args: fused_classifier(*a, write_dlogits=False)


def fp8_cases(dev, shrink):
    from cuengine.kernels import fp8

    # (B*T, intermediate) of a 0.5B-shape MLP: 8192 rows (80 MB of bf16, where launch and tail
    # latency are a visible part of ~25 us) and 32768 rows (320 MB), both reported.
    for rows in (8192, 32768):
        n, c = max(16, rows // shrink), 4864
        x = tensor(dev, ce.BF16, (n, c), 3.0)
        amax = ce.Tensor.empty(ce.FP32, (1,), dev).fill_zero()
        q = ce.Tensor.empty(ce.FP8_E4M3, (n, c), dev)
        qt = ce.Tensor.empty(ce.FP8_E4M3, (c, n), dev)
        fp8.abs_max(q.abs_max, x)
        e = n * c
        yield "fp8", f"abs_max ({n}, {c}) bf16", 2 * e, lambda x=x, amax=amax: fp8.abs_max(amax, x)
        yield "fp8", f"quantize ({n}, {c}) bf16->e4m3", 3 * e, lambda x=x, q=q: fp8.quantize_with_abs_max(q, x)
        yield (
            "fp8",
            f"quant+transpose ({n}, {c}) bf16->e4m3",
            3 * e,
            lambda x=x, qt=qt: fp8.quantize_and_transpose(qt, x),
        )
        yield "fp8", f"transpose ({n}, {c}) e4m3", 2 * e, lambda q=q, qt=qt: fp8.transpose(qt, q)
        xt = ce.Tensor.empty(ce.BF16, (c, n), dev)
        yield "fp8", f"transpose ({n}, {c}) bf16", 4 * e, lambda x=x, xt=xt: fp8.transpose(xt, x)
        dbias = ce.Tensor.empty(ce.FP32, (c,), dev).fill_zero()
        scratch = ce.Tensor.empty(ce.FP32, fp8.bias_backward_scratch_shape(n, c), dev)
        yield (
            "fp8",
            f"bias_backward ({n}, {c}) bf16",
            2 * e,
            lambda x=x, dbias=dbias, scratch=scratch: fp8.bias_backward(dbias, x, scratch),
        )


def norm_cases(dev, shrink):
    from cuengine.kernels.norm import global_norm_finish, global_norm_squared, norm_partials_shape

    partials = ce.Tensor.empty(ce.FP32, norm_partials_shape(), dev).fill_zero()
    result = ce.Tensor.empty(ce.FP32, (2,), dev)
    v, c = max(1, 151936 // shrink), 896  # the 0.5B embedding gradient
    for dt in (ce.BF16, ce.FP32):
        g = tensor(dev, dt, (v, c), 1e-3)
        yield "norm", f"norm_squared ({v}, {c}) {dt}", g.nbytes, lambda g=g: global_norm_squared(partials, g)
    yield "norm", "finish (latency only)", 0, lambda: global_norm_finish(result, partials, 1.0)


def adamw_cases(dev, shrink):
    from cuengine.kernels.adamw import adamw_update, make_hparams

    n = (64 << 20) // shrink
    hp = ce.Tensor.from_numpy(make_hparams(1e-4, 0.9, 0.95, 1e-8, 0.1, 10), dev)
    scale = ce.Tensor.from_numpy(np.array([0.5], np.float32), dev)
    for pdt, gdt, mdt in ((ce.BF16, ce.BF16, ce.FP32), (ce.FP32, ce.FP32, ce.FP32), (ce.BF16, ce.BF16, ce.BF16)):
        p, g = tensor(dev, pdt, (n,), 0.02), tensor(dev, gdt, (n,), 1e-3, 1)
        m, v = tensor(dev, mdt, (n,), 1e-4, 2), tensor(dev, mdt, (n,), 0.0, 3)  # v = 0: no negatives
        traffic = n * (2 * pdt.itemsize + gdt.itemsize + 4 * mdt.itemsize)  # p, m, v read and written
        args = (p, g, m, v, hp, scale, True, 42)
        yield "adamw", f"update {n} p={pdt} g={gdt} m,v={mdt}", traffic, lambda a=args: adamw_update(*a)


def encoder_cases(dev, shrink):
    from cuengine.kernels.encoder import (
        encoder_backward,
        encoder_backward_plan,
        encoder_backward_sum,
        encoder_forward,
        encoder_scratch_shape,
    )

    b, t, v, c = max(1, 32 // shrink), 1024, 151936, 896
    wte = tensor(dev, ce.BF16, (v, c), 0.02)
    tokens = randint(ce.Tensor.empty(ce.INT32, (b, t), dev), v, 4)
    out = ce.Tensor.empty(ce.BF16, (b, t, c), dev)
    row = c * 2
    yield "encoder", f"forward ({b}, {t}, {c}) bf16", 2 * b * t * row, lambda: encoder_forward(out, tokens, wte)
    dwte = ce.Tensor.empty(ce.BF16, (v, c), dev).fill_zero()
    dout = tensor(dev, ce.BF16, (b, t, c), 1e-3)
    scratch = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(b, t, c), dev)
    unique = int(dev.xp.unique(tokens.array()).size)
    traffic = b * t * row + 2 * unique * row  # dout read; the touched dwte rows read and written
    yield "encoder", f"backward ({b}, {t}, {c}) bf16", traffic, lambda: encoder_backward(dwte, dout, tokens, scratch)
    # its two halves: the token plan (what the train step runs beside the LM head; latency only) and the
    # sum over dout (what the step waits for at the end of its backward), the plan made once first
    plan = lambda: encoder_backward_plan(scratch, tokens, v, c)  # noqa: E731
    yield "encoder", f"backward plan ({b}, {t}) (latency only)", 0, plan
    plan()
    yield (
        "encoder",
        f"backward sum ({b}, {t}, {c}) bf16",
        traffic,
        lambda: encoder_backward_sum(dwte, dout, tokens, scratch),
    )
    # skewed ids, where few ids have most positions: the default corpus's bytes (the space is a quarter
    # of them), and one id at every position
    for label, ids, vocab in (
        ("bytes", stdlib_bytes(32768 // shrink), 256),
        ("one id x", np.full(8192 // shrink, 7), v),
    ):
        n = ids.size
        toks = ce.Tensor.from_numpy(ids.astype(np.int32).reshape(1, n), dev)
        grad = ce.Tensor.empty(ce.BF16, (vocab, c), dev).fill_zero()
        d = tensor(dev, ce.BF16, (1, n, c), 1e-3)
        s = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(1, n, c), dev)
        traffic = n * row + 2 * np.unique(ids).size * row
        yield (
            "encoder",
            f"backward {label} {n} ({c}) bf16",
            traffic,
            lambda g=grad, d=d, k=toks, s=s: encoder_backward(g, d, k, s),
        )


def stdlib_bytes(n: int) -> np.ndarray:
    """The first n bytes of the default training corpus (cuengine.data.stdlib_files), as int32 ids."""
    from cuengine import data

    return data.stdlib_tokens(data.stdlib_files()[0])[:n].astype(np.int32)


def rmsnorm_cases(dev, shrink):
    from cuengine.kernels.rmsnorm import (
        fused_residual_rmsnorm_forward,
        rmsnorm_backward,
        rmsnorm_forward,
        rmsnorm_scratch_shape,
    )

    n, c = max(1, 32768 // shrink), 1536
    x, x2 = tensor(dev, ce.BF16, (n, c)), tensor(dev, ce.BF16, (n, c), seed=1)
    w = tensor(dev, ce.BF16, (c,), seed=2)
    out, res = ce.Tensor.empty(ce.BF16, (n, c), dev), ce.Tensor.empty(ce.BF16, (n, c), dev)
    rstd = ce.Tensor.empty(ce.FP32, (n,), dev)
    a = n * c * 2
    yield "rmsnorm", f"forward ({n}, {c}) bf16", 2 * a, lambda: rmsnorm_forward(out, rstd, x, w, 1e-6)
    yield (
        "rmsnorm",
        f"fused residual fwd ({n}, {c}) bf16",
        4 * a,
        lambda: fused_residual_rmsnorm_forward(res, out, rstd, x, x2, w, 1e-6),
    )
    rmsnorm_forward(out, rstd, x, w, 1e-6)
    dw = ce.Tensor.empty(ce.BF16, (c,), dev).fill_zero()
    scratch = ce.Tensor.empty(ce.FP32, rmsnorm_scratch_shape(n, c), dev)
    dinp, dres = ce.Tensor.empty(ce.BF16, (n, c), dev), tensor(dev, ce.BF16, (n, c), seed=3)
    yield (
        "rmsnorm",
        f"backward ({n}, {c}) bf16",
        4 * a,
        lambda: rmsnorm_backward(dinp, dw, scratch, dres, x2, x, w, rstd),
    )


def rope_cases(dev, shrink):
    from cuengine.kernels.rope import rope_backward, rope_forward, rope_freqs

    b, t, hq, hkv, hs = max(1, 16 // shrink), 1024, 12, 2, 128  # 1.5B shape
    freqs = ce.Tensor.from_numpy(rope_freqs(t, hs, 1e6, dtype=np.float16), dev)
    qkv = tensor(dev, ce.BF16, (b, t, (hq + 2 * hkv) * hs))
    out = ce.Tensor.empty(ce.BF16, qkv.shape, dev)
    yield "rope", f"forward {qkv.shape} bf16", 2 * qkv.nbytes, lambda: rope_forward(out, qkv, freqs, hq, hkv)
    qk = 2 * qkv.nbytes * (hq + hkv) // (hq + 2 * hkv)  # in place, the v heads are neither read nor written
    # the train step and prefill rotate in place (blocks.py, prefill.py): the form the engine runs
    yield "rope", "forward in place", qk, lambda: rope_forward(out, out, freqs, hq, hkv)
    yield "rope", f"backward in place {qkv.shape} bf16", qk, lambda: rope_backward(out, out, freqs, hq, hkv)


def swiglu_cases(dev, shrink):
    from cuengine.kernels.activations import activation_forward_quant, swiglu_backward, swiglu_forward

    n, h = max(1, 8192 // shrink), 8960  # 1.5B MLP
    inp = tensor(dev, ce.BF16, (n, 2 * h))
    out, dout = ce.Tensor.empty(ce.BF16, (n, h), dev), tensor(dev, ce.BF16, (n, h), seed=1)
    dinp = ce.Tensor.empty(ce.BF16, (n, 2 * h), dev)
    e = n * h * 2
    yield "swiglu", f"forward ({n}, {2 * h}) bf16", 3 * e, lambda: swiglu_forward(out, inp)
    yield "swiglu", f"backward ({n}, {2 * h}) bf16", 5 * e, lambda: swiglu_backward(dinp, dout, inp)
    # the FP8 step's: the dropped output rewritten as its E4M3 copy, transposed (one byte an element more)
    out_tp = ce.Tensor.empty(ce.FP8_E4M3, (h, n), dev).set_fp8_stats(4.0, 0.0, 0.0)
    bwd_tp = lambda: swiglu_backward(dinp, dout, inp, out_fp8_tp=out_tp)  # noqa: E731
    yield "swiglu", f"backward + E4M3 out transposed ({n}, {2 * h})", 5 * e + e // 2, bwd_tp
    # with delayed scaling (fp8_amax_history): the gradient as E5M2 rows and transposed, no bf16 gradient
    scale = ce.Tensor.from_numpy(np.array([2.0, 4.0], np.float32), dev)
    dq = ce.Tensor.empty(ce.FP8_E5M2, (n, 2 * h), dev).set_fp8_stats(0.0, 0.0, 0.0)
    dq_tp = ce.Tensor.empty(ce.FP8_E5M2, (2 * h, n), dev)
    bwd_q = lambda: swiglu_backward(dq, dout, inp, out_fp8_tp=out_tp, out_scale=scale[:1], dinp_tp=dq_tp,  # noqa: E731
                                    dinp_scale=scale[1:])  # fmt: skip
    yield "swiglu", f"backward, E5M2 gradient (delayed) + E4M3 out transposed ({n}, {2 * h})", 5 * e + e // 2, bwd_q
    # and its forward: the output straight to E4M3
    q = ce.Tensor.empty(ce.FP8_E4M3, (n, h), dev).set_fp8_stats(0.0, 0.0, 0.0)
    fwd_q = lambda: activation_forward_quant(q, inp, "swiglu", scale=scale[:1])  # noqa: E731
    yield "swiglu", f"forward to E4M3 (delayed) ({n}, {2 * h})", 2 * e + e // 2, fwd_q


CASES = {
    "classifier": classifier_cases,
    "fp8": fp8_cases,
    "norm": norm_cases,
    "adamw": adamw_cases,
    "encoder": encoder_cases,
    "rmsnorm": rmsnorm_cases,
    "rope": rope_cases,
    "swiglu": swiglu_cases,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="all", help=f"comma-separated subset of {', '.join(FAMILIES)} (or 'all')")
    ap.add_argument("--iters", type=int, default=20, help="timed launches per case (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed launches first (the first compiles)")
    ap.add_argument("--device", default="cuda", help="cuda; or cpu, with --shrink, to check this script without a GPU")
    ap.add_argument(
        "--hold-ms",
        type=float,
        default=20.0,
        help="park the stream this long before the timed launches (0: time them as issued)",
    )
    ap.add_argument("--shrink", type=int, default=1, help="divide each case's row count by this (smoke runs)")
    args = ap.parse_args(argv)
    families = FAMILIES if args.family == "all" else tuple(f.strip() for f in args.family.split(","))
    unknown = [f for f in families if f not in CASES]
    if unknown:
        ap.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    if args.device != "cpu" and not ce.cuda_available():
        print("bench_kernels: no CUDA device", file=sys.stderr)
        return 1
    dev = ce.device(args.device)

    rows = []
    src, dst = (
        ce.Tensor.empty(ce.BYTE, ((1 << 30) // args.shrink,), dev),
        ce.Tensor.empty(ce.BYTE, ((1 << 30) // args.shrink,), dev),
    )
    nbytes = 2 * src.nbytes
    ceiling = nbytes / (
        launch_ms(dev, lambda: dev.copy_async(dst, src), nbytes, args.warmup, args.iters, args.hold_ms) * 1e-3
    )
    print(f"{dev.name}: device-to-device copy {ceiling / 1e12:.2f} TB/s (the ceiling; known figure "
          f"{CEILINGS['copy'] / 1e12:.2f} TB/s)")  # fmt: skip
    failed = 0
    for family in families:
        try:
            for fam, case, nbytes, fn in CASES[family](dev, args.shrink):
                ms = launch_ms(dev, fn, nbytes, args.warmup, args.iters, args.hold_ms)
                gbs = nbytes / (ms * 1e-3) / 1e9 if nbytes else float("nan")
                same = float("nan")
                if nbytes:  # the copy of the same bytes, timed the same way right after the case
                    copy = same_size_copy(dev, src, dst, nbytes)
                    copy_ms = launch_ms(dev, copy, nbytes, args.warmup, args.iters, args.hold_ms)
                    same = 100 * copy_ms * max(1.0, nbytes / (2 * src.nbytes)) / ms if ms else float("nan")
                rows.append((fam, case, nbytes / MB, ms * 1e3, gbs, 100 * gbs * 1e9 / ceiling, same))
                print(f"  {fam:<10} {case:<48} {ms * 1e3:9.1f} us {gbs:8.0f} GB/s", flush=True)
        except Exception as err:  # one broken family must not hide the others' numbers
            failed += 1
            print(f"  {family}: FAILED {type(err).__name__}: {err}", file=sys.stderr)
            traceback.print_exc(limit=3)
        dev.synchronize()

    print(f"\n{'family':<11}{'case':<50}{'MB':>9}{'us':>10}{'GB/s':>9}{'% copy':>8}{'% same-size copy':>18}")
    for fam, case, mb, us, gbs, pct, same in rows:
        pct_s = f"{pct:7.1f}%" if mb else "      -"
        gbs_s = f"{gbs:9.0f}" if mb else "        -"
        same_s = f"{same:17.1f}%" if mb else "                 -"
        print(f"{fam:<11}{case:<50}{mb:9.1f}{us:10.1f}{gbs_s}{pct_s}{same_s}")
    print(f"(ceiling: d2d copy {ceiling / 1e9:.0f} GB/s, 1 GiB; target for memory-bound kernels: >= 80% of it. "
          "Same-size copy: a copy moving the case's bytes, timed beside it)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
