"""What each kernel of a batch-1 decode step costs inside its CUDA graph, dependent launches on.

A per-kernel profile (`profile_step.py --decode`) times kernels one by one, eagerly; inside the graph
a kernel's launch and first weight loads overlap the one before, so its own time is not what it adds
to the step. This tool measures what it adds: every layer's kernel of one kind is left out ("skip"),
or a GEMV is shrunk to its first 16 rows (32 for gate/up) with the same prologue and the same wait
("min"), and the step is timed again (`bench_decode.step_ms`: graph replay, median of --samples).
whole − min is what the rest of a GEMV's rows cost, min − skip its floor (launch, wait, input
staging, one tile). At the 0.5B shapes the rest is not the weight bytes: with its weights held in
L2 a GEMV takes the same time (`bench_decode --section arms --l2-hot`), so it is the further tiles
each block works through. The tokens such a step makes are wrong; only the timing means anything.

    python tools/ablate_decode.py --preset qwen2.5-0.5b --arm fused_up

Figures: BENCHMARKS.md's thirteenth session (calls 2 and 3, as a session probe) and fourteenth
session (call 3, this tool); PERF_NOTES 26 and 27.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode as bd  # noqa: E402

from cuengine import cuda_available  # noqa: E402
from cuengine.inference import decode  # noqa: E402
from cuengine.kernels import gemv  # noqa: E402

_PRO_NONE, _PRO_NORM, _PRO_SWIGLU = gemv._PRO_NONE, gemv._PRO_NORM, gemv._PRO_SWIGLU


def kind(prologue: int, dual: int, K: int, N: int) -> str:
    """Which of a layer's GEMVs (or the FP8 LM head) a gemv launch is, from its shape and prologue."""
    if dual:
        return "gate/up"
    if prologue == _PRO_SWIGLU:
        return "down"
    if prologue == _PRO_NORM:
        return "qkv" if N < 20000 else "head"
    return "output" if K < 2000 else "down"  # "fused_up" feeds the down GEMV a plain input


class Ablation:
    """Patches the decode step's launchers: `mode` maps a kernel kind to "skip" or "min"."""

    def __init__(self):
        self.mode: dict[str, str] = {}
        self._launch, self._att, self._matmul = (
            gemv._launch,
            decode.decode_attention.decode_attention,
            decode.blas.matmul,
        )

    def install(self):
        def launch(out, x, w, w_scale, bias, residual, norm_weight, eps, prologue, dual, b, K, N, *rest):
            m = self.mode.get(kind(prologue, dual, K, N))
            if m == "skip":
                return
            if m == "min":
                N = 32 if dual else 16
            self._launch(out, x, w, w_scale, bias, residual, norm_weight, eps, prologue, dual, b, K, N, *rest)

        def attention(*a, **kw):
            if self.mode.get("attention") != "skip":
                self._att(*a, **kw)

        def matmul(*a, **kw):  # the bf16 LM head is the step's only cuBLASLt call on the GEMV arms
            if self.mode.get("head") != "skip":
                self._matmul(*a, **kw)

        gemv._launch, decode.decode_attention.decode_attention, decode.blas.matmul = launch, attention, matmul

    def remove(self):
        gemv._launch, decode.decode_attention.decode_attention, decode.blas.matmul = (
            self._launch,
            self._att,
            self._matmul,
        )


GEMVS = ("qkv", "output", "gate/up", "down")
VARIANTS = (
    [("whole step", {})]
    + [(f"skip {k}", {k: "skip"}) for k in ("qkv", "attention", "output", "gate/up", "down", "head")]
    + [(f"min {k}", {k: "min"}) for k in GEMVS]
    + [
        ("min all four GEMVs", dict.fromkeys(GEMVS, "min")),
        ("skip all four GEMVs", dict.fromkeys(GEMVS, "skip")),
        ("skip all but embedding + sampling", dict.fromkeys((*GEMVS, "attention", "head"), "skip")),
    ]
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--arm", default="fused_up", help="a GEMV arm: fused, fused_up or split")
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args(argv)
    if not cuda_available():
        print("ablate_decode: no CUDA device; nothing to measure", file=sys.stderr)
        return 1
    ab = Ablation()
    ab.install()
    try:
        for weights in args.weights:
            m, st = bd.engine(args.preset, 1, bd.PROMPT + 8 * args.steps, weights)
            print(f"{args.preset} {weights} arm {args.arm}, ms/token", flush=True)
            for name, mode in VARIANTS:
                ab.mode = mode
                st.graphs.clear()
                st.warm.clear()
                ms = bd.step_ms(st, 1, args.steps, args.samples, bd.PROMPT, args.arm)
                print(f"  {name:<36}{ms:8.4f}", flush=True)
            del m, st
    finally:
        ab.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
