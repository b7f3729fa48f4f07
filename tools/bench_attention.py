"""Causal attention TFLOP/s, forward and backward: the raw flash kernels against cuDNN SDPA.

At a fixed number of tokens B*T (default 16k), for each T and head size: validate (raw against
cuDNN), warm up, then time each pass with CUDA events and report the median. Causal FLOPs are half
of the full 4*B*Hq*T^2*hs for the forward, and 2.5 times that for the backward (which therefore
counts the forward's recomputation of P but not the raw backend's extra dq pass). The ceiling is
the measured BF16 matmul rate (CEILINGS["bf16"] in cuengine.benchmark); the target is raw >= 60%
of cuDNN on the same shapes.

--sm90 adds one raw column per wgmma forward tiling of raw_kernels/attention_sm90.cu (WxBC[pp]:
W warpgroups of 64 query rows, key blocks of BC rows, pp when the warpgroups take turns at the
tensor cores; attention.SM90_FORWARD_VARIANTS), on a
compute capability 9.0 GPU; the plain "raw" column runs whatever attention.SM90_FORWARD selects.
Those columns time the forward only (their bwd shows nan): the backward is the raw column's.
"--sm90 bwd" adds the column wgbwd: the raw backend with attention_sm90.cu's wgmma backward.

    python tools/bench_attention.py
    python tools/bench_attention.py --seq 2048 --head-sizes 128 --heads 14:2 --iters 20
    python tools/bench_attention.py --head-sizes 128 --sm90 2x128pp 2x128 3x64pp
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuengine as ce  # noqa: E402
from cuengine.benchmark import CEILINGS, time_ms  # noqa: E402
from cuengine.kernels import attention as A  # noqa: E402


def random_bf16(dev, shape, seed, name):
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return ce.Tensor.from_numpy(x, dev, name=name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="B*T for every row of the table")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", default="16:4", help="n_q_heads:n_kv_heads")
    ap.add_argument("--backends", nargs="+", default=["raw", "cudnn"], choices=["raw", "cudnn"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    variants = {f"{w}x{bc}{'pp' * pp}": (w, bc, pp) for w, bc, pp in A.SM90_FORWARD_VARIANTS}
    ap.add_argument("--sm90", nargs="*", default=[], choices=[*variants, "bwd"],
                    help="wgmma forward tilings (and 'bwd': the wgmma backward) to add as raw columns")  # fmt: skip
    args = ap.parse_args()
    if not ce.cuda_available():
        print("bench_attention: no CUDA device")
        return 1
    backends = [b for b in args.backends if b in A.available_backends()]
    for b in set(args.backends) - set(backends):
        print(f"backend {b!r} is not installed here; skipping it")
    Hq, Hkv = (int(x) for x in args.heads.split(":"))
    dev = ce.device("cuda")
    # column label -> (backend, the SM90_FORWARD / SM90_BACKWARD entries while it runs, or None to
    # leave the module's choice)
    columns = {b: (b, None, None) for b in backends}
    if args.sm90 and dev.compute_capability != (9, 0):
        print(f"--sm90: the wgmma kernels need compute capability 9.0, not {dev.compute_capability}; skipping them")
    elif "raw" in backends:
        for v in args.sm90:
            columns[f"wg{v}"] = ("raw", variants[v], None) if v in variants else ("raw", None, True)
    print(f"{dev.name}: causal attention, bf16, B*T = {args.tokens}, Hq = {Hq}, Hkv = {Hkv}; "
          f"median of {args.iters} after {args.warmup} warm-up; ceiling {CEILINGS['bf16'] / 1e12:.0f} TFLOP/s "
          f"(BF16 matmul)")  # fmt: skip
    t_start = time.time()
    rows = []
    for hs in args.head_sizes:
        N = args.tokens
        qkv_all = random_bf16(dev, (N, (Hq + 2 * Hkv) * hs), 1, "qkv")
        datt_all = random_bf16(dev, (N, Hq * hs), 2, "datt")
        att_all = ce.Tensor.empty(ce.BF16, (N, Hq * hs), dev, name="att")
        dqkv_all = ce.Tensor.empty(ce.BF16, qkv_all.shape, dev, name="dqkv")
        lse_all = ce.Tensor.empty(ce.FP32, (N * Hq,), dev, name="lse")
        for T in args.seq:
            if N % T:
                print(f"skipping T={T}: it does not divide {N} tokens")
                continue
            B = N // T
            qkv = qkv_all.reshape(B, T, -1)
            datt = datt_all.reshape(B, T, -1)
            att = att_all.reshape(B, T, -1)
            dqkv = dqkv_all.reshape(B, T, -1)
            lse = lse_all.reshape(B, Hq, T)
            ws_bytes = max(A.workspace_shape(B, T, Hq, Hkv, hs, b, device=dev)[0] for b in backends)
            ws = ce.Tensor.empty(ce.BYTE, (ws_bytes,), dev, name="workspace")
            fwd_flops = 4 * B * Hq * T * T * hs / 2
            result = {"T": T, "B": B, "hs": hs}
            outputs = {}
            saved = dict(A.SM90_FORWARD), A.SM90_BACKWARD
            for col, (b, sm90, sm90_bwd) in columns.items():
                if sm90 is not None:
                    A.SM90_FORWARD = {**saved[0], hs: sm90}
                if sm90_bwd:
                    A.SM90_BACKWARD = (*saved[1], hs)
                try:
                    fwd = functools.partial(A.attention_forward, att, lse, qkv, Hq, Hkv, backend=b, workspace=ws)
                    bwd = functools.partial(A.attention_backward, dqkv, datt, att, lse, qkv, Hq, Hkv, backend=b,
                                            workspace=ws)  # fmt: skip
                    fwd()
                    bwd()
                    # (a forward variant's dqkv comes from the raw column's backward: not compared)
                    dx = dqkv.numpy().astype(np.float32) if sm90 is None else None
                    outputs[col] = (att.numpy().astype(np.float32), dx)
                    ms_f = time_ms(dev, fwd, args.warmup, args.iters)
                    # a forward variant's column runs the raw column's backward: time that once
                    ms_b = time_ms(dev, bwd, args.warmup, args.iters) if sm90 is None else float("nan")
                finally:
                    A.SM90_FORWARD, A.SM90_BACKWARD = saved
                result[col] = (fwd_flops / ms_f / 1e9, 2.5 * fwd_flops / ms_b / 1e9, ms_f, ms_b)
            if "cudnn" in outputs:
                a2, d2 = outputs["cudnn"]
                result["diff"] = {c: (float(np.abs(a1 - a2).max()),
                                      float(np.abs(d1 - d2).max()) if d1 is not None else float("nan"))
                                  for c, (a1, d1) in outputs.items() if c != "cudnn"}  # fmt: skip
            rows.append(result)
            line = f"T={T:5d} B={B:3d} hs={hs:3d}"
            for c in columns:
                tf_f, tf_b, ms_f, ms_b = result[c]
                line += f" | {c}: fwd {tf_f:6.1f} TF ({ms_f:.3f} ms) bwd {tf_b:6.1f} TF ({ms_b:.3f} ms)"
            for c, (da, dd) in result.get("diff", {}).items():
                line += f" | max|{c}-cudnn| att {da:.2e} dqkv {dd:.2e}"
            print(line, flush=True)

    raws = [c for c in columns if c != "cudnn"] if "cudnn" in columns else []
    print(f"\n{'T':>5} {'B':>3} {'hs':>3} | " + " | ".join(f"{c + ' fwd':>9} {c + ' bwd':>9}" for c in columns)
          + "".join(f" | fwd {c}/cudnn  bwd {c}/cudnn" for c in raws))  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r[c][0]:9.1f} {r[c][1]:9.1f}" for c in columns)
        ratio = "".join(f" | {r[c][0] / r['cudnn'][0]:>{10 + len(c)}.0%} {r[c][1] / r['cudnn'][1]:>{10 + len(c)}.0%}"
                        for c in raws)  # fmt: skip
        print(f"{r['T']:>5} {r['B']:>3} {r['hs']:>3} | {cells}{ratio}")
    print(f"(TFLOP/s; target raw/cudnn >= 60%; {time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
