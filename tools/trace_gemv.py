"""What a decode GEMV's time is made of inside the replayed batch-1 step: per block, timestamps at its
start, after the dependent-launch wait, after its input is staged, after its first tile's products and
at its end, for every GEMV of a few graph-replayed steps.

The ablation (`ablate_decode.py`) says what each GEMV adds to the step; this says where inside a
GEMV that time goes (PERF_NOTES 27(c): at the 0.5B shapes a GEMV is mostly its per-block chain, not
its weight bytes). The kernels are an instrumented copy of raw_kernels/ (`instrumented_dir`: gemv.cuh
with the timestamps; nothing else changes), so the process compiles its own gemv.cu. Each block's
thread 0 reads %globaltimer (one clock for every SM, to line blocks and launches up) and clock64 (its
SM's cycles, for the phases inside a block) and writes one record. Columns (µs, medians over a kind's
launches of the per-launch figure):
- release: from the previous GEMV's last block ending to this launch's first block passing its wait
  (what a dependent launch costs on the critical path; kernels that are not GEMVs are not traced, so
  the output projection's release includes the attention, and the first qkv's of a step the LM head
  where cuBLASLt runs it, the sampling and the embedding);
- span: first block's start to last block's end;
- wait / stage / first / rest: a block's phases (median block): from its start to past the wait, the
  input staged (and normalised), the first tile's products, the remaining tiles, reductions and stores;
- late: how long after the launch's first block passes its wait its last one does;
- tail: how long after the median block ends the last one does (blocks that take longer than the rest,
  with the same number of tiles, show here).

    python tools/trace_gemv.py --preset qwen2.5-0.5b --weights bf16 fp8
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ablate_decode import kind  # noqa: E402

from cuengine import cuda_available  # noqa: E402
from cuengine.kernels import _build, gemv  # noqa: E402

SLOTS = 1 << 18  # records the buffer holds (a 0.5B step makes about 30000, one a block of each GEMV)
FIELDS = 16  # u64 a record: 5 globaltimer stamps, 5 clock64 stamps, the shape, the block and grid, the SM
_HELPERS = r"""
__device__ unsigned long long gemv_trace[SLOTS][FIELDS];
__device__ unsigned gemv_trace_next;
// Thread 0 of a block takes a record at its start and writes each stamp as it happens (two registers
// held, not ten: the single-row kernels sit at their 80-register bound).
struct TraceStamps {
    unsigned long long* r = nullptr;
    unsigned marked = 0;
    __device__ __forceinline__ void mark(int i) {
        if (!r || marked >> i & 1u) return;
        marked |= 1u << i;
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        r[i] = t;
        r[5 + i] = clock64();
    }
};
__device__ __forceinline__ TraceStamps trace_start(int N, int K, int prologue, int dual, int block, int blocks) {
    TraceStamps s;
    if (threadIdx.x != 0) return s;
    const unsigned slot = atomicAdd(&gemv_trace_next, 1u);
    if (slot >= SLOTS) return s;
    s.r = gemv_trace[slot];
    unsigned smid;
    asm("mov.u32 %0, %%smid;" : "=r"(smid));
    s.r[10] = (unsigned long long)N << 32 | (unsigned)K;
    s.r[11] = (unsigned long long)prologue << 8 | dual;
    s.r[12] = (unsigned long long)block << 32 | (unsigned)blocks;
    s.r[13] = smid;
    s.mark(0);
    return s;
}
""".replace("SLOTS", str(SLOTS)).replace("FIELDS", str(FIELDS))
_STAGED = (
    "            stage_input<T, XS, BT>(xs, raw, s_rstd, x, norm_in, eps, prologue, m0, b, K, x_acc,\n"
    "                                   block == 0 ? x_out : nullptr);\n"
    "            __syncthreads();\n"
)
_NEXT = "        // the next item's first weights go out before this one's reduction and stores\n"
_END = "        tile_index = next_index;\n        m0 = next_m0;\n    }\n}\n"
# (text of gemv.cuh, what replaces it): a record per block that has a tile, with stamps at five points
_MARKS = [
    ('#include "common.cuh"\n', '#include "common.cuh"\n' + _HELPERS),
    (
        "    int tile_index = block, m0 = 0;\n",
        "    TraceStamps stamps = trace_start(N, K, prologue, dual, block, blocks);\n"
        "    int tile_index = block, m0 = 0;\n",
    ),
    (
        "            if (!staged) wait();\n",
        "            if (!staged) {\n                wait();\n                stamps.mark(1);\n            }\n",
    ),
    (_STAGED, _STAGED + "            stamps.mark(2);\n"),
    (_NEXT, "        stamps.mark(3);\n" + _NEXT),
    (_END, _END[: -len("}\n")] + "    stamps.mark(4);\n}\n"),
]


def instrumented_source(text: str) -> str:
    """gemv.cuh with the timestamps and the record; fails loudly if a place it marks has moved."""
    for old, new in _MARKS:
        if text.count(old) != 1:
            raise RuntimeError(f"trace_gemv: gemv.cuh no longer has {old.strip()[:60]!r} once; update _MARKS")
        text = text.replace(old, new)
    return text


def instrumented_dir(root: Path) -> Path:
    """A copy of raw_kernels/ in `root` with gemv.cuh instrumented."""
    src = _build.kernel_dir()
    dst = root / "raw_kernels"
    shutil.copytree(src, dst)
    (dst / "gemv.cuh").write_text(instrumented_source((src / "gemv.cuh").read_text()))
    return dst


def launches_of(records: np.ndarray) -> list[dict]:
    """Records (n, FIELDS) u64 in slot order -> launches in start order. A launch is a run of records of
    one shape and grid that has its grid's worth of blocks (every block of a decode GEMV has a tile)."""
    open_: dict[tuple, dict] = {}
    done = []
    for r in records:
        key = (int(r[10]), int(r[11]), int(r[12]) & 0xFFFFFFFF)
        launch = open_.setdefault(key, {"key": key, "rows": []})
        launch["rows"].append(r)
        if len(launch["rows"]) == key[2]:
            done.append(open_.pop(key))
    for launch in done:
        rows = np.array(launch.pop("rows"), dtype=np.uint64)
        N, K = int(launch["key"][0] >> 32), int(launch["key"][0] & 0xFFFFFFFF)
        prologue, dual = int(launch["key"][1] >> 8), int(launch["key"][1] & 0xFF)
        launch.update(N=N, K=K, kind=kind(gemv._PRO_NORM if prologue == gemv._PRO_NORM_STAGED else prologue,
                                          dual, K, N), rows=rows)  # fmt: skip
    return sorted(done, key=lambda launch: int(launch["rows"][:, 0].min()))


COLUMNS = ("blocks", "release", "span", "wait", "stage", "first", "rest", "late", "tail")


def summary(records: np.ndarray) -> tuple[float, dict[str, dict[str, float]]]:
    """ns a cycle (from the blocks' globaltimer and clock64 spans), and for each GEMV ("kind K->N") its
    number of launches and the medians over them of COLUMNS (blocks a launch, the rest in µs)."""
    launches = launches_of(records)
    if not launches:
        return float("nan"), {}
    rows = np.concatenate([launch["rows"] for launch in launches]).astype(np.int64)
    busy = rows[:, 9] > rows[:, 5]
    ns_per_cycle = float(np.median((rows[busy, 4] - rows[busy, 0]) / (rows[busy, 9] - rows[busy, 5])))
    figures: dict[str, list[dict[str, float]]] = {}
    previous_end = None
    for launch in launches:
        r = launch["rows"].astype(np.int64)
        end = r[:, 4].max()
        phases = np.median(np.diff(r[:, 5:10], axis=1), axis=0) * ns_per_cycle / 1e3
        f = dict(zip(COLUMNS[3:7], phases.tolist()))
        f["blocks"] = len(r)
        f["release"] = np.nan if previous_end is None else (r[:, 1].min() - previous_end) / 1e3
        f["span"] = (end - r[:, 0].min()) / 1e3
        f["late"] = (r[:, 1].max() - r[:, 1].min()) / 1e3
        f["tail"] = (end - np.median(r[:, 4])) / 1e3
        figures.setdefault(f"{launch['kind']} {launch['K']}->{launch['N']}", []).append(f)
        previous_end = end
    out = {}
    for name, fs in figures.items():
        out[name] = {"launches": len(fs)}
        for c in COLUMNS:
            known = [f[c] for f in fs if not np.isnan(f[c])]
            out[name][c] = statistics.median(known) if known else float("nan")
    return ns_per_cycle, out


def report(records: np.ndarray) -> list[str]:
    """The table of the module docstring from the raw records."""
    ns_per_cycle, table = summary(records)
    if not table:
        return ["no complete GEMV launch was recorded"]
    out = [f"{ns_per_cycle:.3f} ns a cycle; µs, medians over a GEMV's launches",
           f"{'gemv':<24}{'launches':>9}" + "".join(f"{c:>9}" for c in COLUMNS)]  # fmt: skip
    for name, row in table.items():
        out.append(f"{name:<24}{row['launches']:>9}{row['blocks']:>9.0f}"
                   + "".join(f"{row[c]:>9.2f}" for c in COLUMNS[1:]))  # fmt: skip
    return out


def trace(preset: str, weights: str, arm: str, steps: int, prompt: int) -> np.ndarray:
    """The records of `steps` replayed batch-1 decode steps (after the eager step, the capture and a replay)."""
    import cupy
    from bench_decode import engine, warm_up

    from cuengine.inference import decode

    m, st = engine(preset, 1, prompt + steps + 8, weights)
    warm_up(st, 1, prompt, arm)
    st.device.synchronize()
    mod = _build.module("gemv", st.device.index)
    counter = cupy.ndarray((1,), cupy.uint32, memptr=mod.get_global("gemv_trace_next"))
    counter[...] = 0
    cupy.cuda.Device().synchronize()
    for _ in range(steps):
        decode.step(st, 1, arm)
    st.device.synchronize()
    n = min(int(counter.get()[0]), SLOTS)
    buf = cupy.ndarray((SLOTS, FIELDS), cupy.uint64, memptr=mod.get_global("gemv_trace"))
    records = buf[:n].get()
    del m, st
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b"])
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=("bf16", "fp8"))
    p.add_argument("--arm", default="fused_up", choices=("fused", "fused_up", "split"))
    p.add_argument("--steps", type=int, default=4, help="replayed steps traced")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--save", type=Path, help="also write each run's raw records to SAVE/<preset>-<weights>.npy")
    args = p.parse_args(argv)
    if not cuda_available():
        print("trace_gemv: no CUDA device; nothing to trace", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="trace-gemv-") as tmp:
        traced = instrumented_dir(Path(tmp))
        _build.kernel_dir = lambda: traced  # before anything compiles: every family from the copy
        for preset in args.preset:
            for weights in args.weights:
                print(f"== {preset} {weights} {args.arm}, {args.steps} steps")
                records = trace(preset, weights, args.arm, args.steps, args.prompt)
                print("\n".join(report(records)))
                if args.save:
                    args.save.mkdir(parents=True, exist_ok=True)
                    np.save(args.save / f"{preset}-{weights}.npy", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
