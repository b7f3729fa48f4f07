"""Causal attention TFLOP/s, forward and backward: the raw flash kernels against cuDNN SDPA.

At a fixed number of tokens B*T (default 16k), for each T and head size: validate (raw against
cuDNN), warm up, then time each pass with CUDA events and report the median. Causal FLOPs are half
of the full 4*B*Hq*T^2*hs for the forward, and 2.5 times that for the backward (which therefore
counts the forward's recomputation of P but not the raw backend's extra dq pass). The ceiling is
the measured BF16 matmul rate (CEILINGS["bf16"] in cuengine.benchmark); the target is raw >= 60%
of cuDNN on the same shapes.

On compute capability 9.0 the raw column runs the wgmma kernels of raw_kernels/attention_sm90.cu
(attention.SM90_FORWARD / SM90_BACKWARD); "--sm90 mma" adds the column mma: the raw backend with
those switches off, i.e. attention.cu's mma.sync kernels that every other GPU runs.

    python tools/bench_attention.py
    python tools/bench_attention.py --seq 2048 --head-sizes 128 --heads 14:2 --iters 20
    python tools/bench_attention.py --head-sizes 128 --sm90 mma
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

# --sm90 columns: the attention module's switches while each runs
SM90_COLUMNS = {"mma": {"SM90_FORWARD": (), "SM90_BACKWARD": ()}}


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
    ap.add_argument("--sm90", nargs="*", default=[], choices=list(SM90_COLUMNS),
                    help="raw columns with other attention_sm90.cu switches (mma: the mma.sync kernels)")  # fmt: skip
    args = ap.parse_args()
    if not ce.cuda_available():
        print("bench_attention: no CUDA device")
        return 1
    backends = [b for b in args.backends if b in A.available_backends()]
    for b in set(args.backends) - set(backends):
        print(f"backend {b!r} is not installed here; skipping it")
    Hq, Hkv = (int(x) for x in args.heads.split(":"))
    dev = ce.device("cuda")
    # column label -> (backend, attention module switches set while it runs)
    columns = {b: (b, {}) for b in backends}
    if args.sm90 and dev.compute_capability != (9, 0):
        print(f"--sm90: the wgmma kernels need compute capability 9.0, not {dev.compute_capability}; skipping them")
    elif "raw" in backends:
        columns.update({c: ("raw", SM90_COLUMNS[c]) for c in args.sm90})
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
            for col, (b, switches) in columns.items():
                saved = {k: getattr(A, k) for k in switches}
                for k, v in switches.items():
                    setattr(A, k, v)
                try:
                    fwd = functools.partial(A.attention_forward, att, lse, qkv, Hq, Hkv, backend=b, workspace=ws)
                    bwd = functools.partial(A.attention_backward, dqkv, datt, att, lse, qkv, Hq, Hkv, backend=b,
                                            workspace=ws)  # fmt: skip
                    fwd()
                    bwd()
                    outputs[col] = (att.numpy().astype(np.float32), dqkv.numpy().astype(np.float32))
                    ms_f = time_ms(dev, fwd, args.warmup, args.iters)
                    ms_b = time_ms(dev, bwd, args.warmup, args.iters)
                finally:
                    for k, v in saved.items():
                        setattr(A, k, v)
                result[col] = (fwd_flops / ms_f / 1e9, 2.5 * fwd_flops / ms_b / 1e9, ms_f, ms_b)
            if "cudnn" in outputs:
                a2, d2 = outputs["cudnn"]
                result["diff"] = {c: (float(np.abs(a1 - a2).max()), float(np.abs(d1 - d2).max()))
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
