"""cuengine.benchmark: the one timer and ceilings table of the bench scripts and `cuengine bench`."""

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import load_tool

import cuengine as ce
from cuengine.benchmark import CEILINGS, mfu, stream_timeline, time_ms, time_phases_ms


def test_ceilings_are_the_measured_figures():
    assert CEILINGS == {"copy": 4.27e12, "bf16": 747e12, "fp8": 1476e12, "bf16_peak": 989e12}


def test_mfu_is_against_the_dense_bf16_peak():
    assert mfu(6e9, 989e12 / 6e9) == pytest.approx(1.0)
    assert mfu(6e9, 1e5) == pytest.approx(6e14 / 989e12)


def test_time_ms_warms_up_then_reports_the_median_per_call():
    calls = []
    ms = time_ms(ce.device("cpu"), lambda: calls.append(time.sleep(0.005)), warmup=2, iters=3, reps=4)
    assert len(calls) == 2 + 3 * 4
    assert 5 <= ms < 15  # per call, not per sample of 4 (20 ms)


def test_time_phases_ms_times_each_phase_of_one_step():
    order = []
    phases = [lambda: order.append("fwd"), lambda: (order.append("bwd"), time.sleep(0.01))]
    fwd, bwd = time_phases_ms(ce.device("cpu"), phases, warmup=1, iters=3)
    assert order == ["fwd", "bwd"] * 4
    assert fwd < 5 <= bwd


def _copy(dev, nbytes):
    src, dst = ce.Tensor.empty(ce.BYTE, (nbytes,), dev), ce.Tensor.empty(ce.BYTE, (nbytes,), dev)
    return lambda: dev.copy_async(dst, src)


@pytest.mark.gpu
def test_cuda_events_time_the_device_work(cuda):
    """A 256 MiB copy runs near the copy ceiling, held or not; four times the bytes take about four times as long."""
    n = 256 << 20
    for hold in (0.0, 5.0):
        gbs = 2 * n / (time_ms(cuda, _copy(cuda, n), iters=5, hold_ms=hold) * 1e-3)
        assert 0.5 * CEILINGS["copy"] < gbs < 1.2 * CEILINGS["copy"], gbs
    small, big = time_phases_ms(cuda, [_copy(cuda, n // 4), _copy(cuda, n)], iters=5)
    assert 3 < big / small < 5


@pytest.mark.gpu
def test_the_hold_covers_each_sample(cuda):
    """Many short launches (64 empty kernels a sample, 40 samples: far longer to issue from Python than
    one 5 ms hold) are still timed at the GPU's pace, under the time Python takes to issue one: every
    sample waits behind a hold of its own. With one hold for all samples they read at Python's pace."""
    from cuengine.benchmark import _spin

    kernel = _spin(cuda.index)

    def empty():
        kernel((1,), (1,), (np.int64(0),), stream=cuda.stream.raw)

    empty()
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        empty()
    issue_ms = (time.perf_counter() - t0) * 1e3 / 2000
    cuda.synchronize()
    held = time_ms(cuda, empty, warmup=1, iters=40, reps=64, hold_ms=5)
    assert held < 0.5 * issue_ms, (held, issue_ms)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "e4m3", "e5m2"])
def test_fill_random(dev, dtype):
    from cuengine.benchmark import fill_random

    t = fill_random(ce.Tensor.empty(dtype, (64, 64), dev, name="t"), 3.0, seed=1)
    x = t.numpy().astype(np.float64)
    assert np.isfinite(x).all() and (x > 0).any() and (x < 0).any()
    if t.dtype.is_fp8:
        assert np.abs(x).max() < 2 and list(t.fp8_stats()) == [1.0, 1.0, 1.0]
    else:
        assert 2.5 < x.std() < 3.5
    again = fill_random(ce.Tensor.empty(dtype, (64, 64), dev, name="t"), 3.0, seed=1).numpy()
    np.testing.assert_array_equal(again.view(np.uint8), t.numpy().view(np.uint8))


def test_stream_timeline_finds_the_exposed_waits():
    """Compute on stream 7 with a 30 µs hole while an NCCL kernel on stream 9 runs from 40 to 100:
    30 µs of it beside compute kernels; the hole is the exposed wait."""
    kernels = [("gemm", 7, 0.0, 50.0), ("ncclDevKernel_ReduceScatter", 9, 40.0, 60.0), ("norm", 7, 80.0, 10.0),
               ("adamw", 7, 90.0, 30.0), ("gemm", 7, 10.0, 5.0), ("copy", 9, 110.0, 5.0)]  # fmt: skip
    t = stream_timeline(kernels)
    assert t["span_us"] == 120.0 and t["busy_us"] == {7: 90.0, 9: 65.0}
    assert t["idle_us"] == 30.0 and t["nccl_us"] == 60.0 and t["nccl_hidden_us"] == 30.0
    assert t["gaps"] == [(30.0, "gemm", "norm", 30.0)] and t["compute_us"] == 90.0
    assert t["nccl_by_name"] == {"ncclDevKernel_ReduceScatter": 60.0}
    # a replayed graph reports its branches on stream ids of its own (NCCL nodes maybe on the main
    # one): compute is every non-NCCL kernel, whatever its id
    moved = [(n, 7 if "nccl" in n else (3 if n == "norm" else s), a, d) for n, s, a, d in kernels]
    t = stream_timeline(moved)
    assert t["idle_us"] == 30.0 and t["compute_us"] == 90.0 and t["gaps"] == [(30.0, "gemm", "norm", 30.0)]
    # a hole with no collective in it: the host (or a dependency) kept the GPU waiting
    t = stream_timeline(kernels + [("gemm", 7, 130.0, 10.0)])
    assert t["gaps"] == [(30.0, "gemm", "norm", 30.0), (10.0, "adamw", "gemm", 0.0)]
    with pytest.raises(ValueError, match="no kernels"):
        stream_timeline([])


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "tools").glob("*.py")), ids=lambda p: p.name
)
def test_every_tool_imports(path):
    """A script that stopped importing (a helper it takes from another tool renamed) is found here,
    not on the GPU machine."""
    load_tool(path.stem)


def test_fp8_loss_curve_gap(tmp_path):
    """tools/fp8_loss.py: windowed curves, the worst gap after the warm-up and the last window's gap."""
    f8 = load_tool("fp8_loss")
    assert f8.window_means([1, 2, 3, 4, 5], 2) == [1.5, 2.5, 3.5, 4.5]
    ref = [2.0] * 10
    test = [2.0] * 4 + [2.2, 2.2] + [2.0] * 3 + [2.1]  # a bump at steps 5-6, then 5% above at the end
    worst, last = f8.curve_gap(test, ref, window=2, skip=6)
    assert worst == pytest.approx(0.05) and last == pytest.approx(0.025)  # the bump's windows end by step 6
    worst, _ = f8.curve_gap(test, ref, window=2, skip=0)
    assert worst == pytest.approx(0.10)
    with pytest.raises(ValueError, match="differ in length"):
        f8.curve_gap(test[:-1], ref, 2, 0)
    with pytest.raises(ValueError, match="window 11 must be in"):
        f8.window_means(ref, 11)
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5, "val_loss": 2.75}\n')
    assert f8.read_log(log) == ([3.0, 2.5], 2.75)
    log.write_text('{"step": 1, "loss": 3.0}\n{"step": 3, "loss": 2.5}\n')
    with pytest.raises(ValueError, match="step 3 follows step 1"):
        f8.read_log(log)
    # two seeds drifting 10% either way around bf16: each seed's gap is 10%, the mean curves' is 0
    up, down = [2.2] * 10, [1.8] * 10
    assert f8.seed_mean_gap([(up, ref), (down, ref)], 2, 0) == (pytest.approx(0.0), pytest.approx(0.0))
    assert f8.seed_mean_gap([(up, ref), (up, ref)], 2, 0) == (pytest.approx(0.1), pytest.approx(0.1))
    with pytest.raises(ValueError, match="differ in length"):
        f8.seed_mean_gap([(up, ref), (up[:-1], ref[:-1])], 2, 0)


def test_bench_kernels_reports_each_case_beside_a_copy_of_its_bytes(capsys):
    """tools/bench_kernels.py on the cpu device (a smoke run of the script, not a measurement): every
    case gets its bandwidth against the 1 GiB copy and against a copy of the same bytes."""
    bench = load_tool("bench_kernels")
    assert bench.main(["--device", "cpu", "--shrink", "2048", "--family", "rope", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("rope ")]
    assert len(rows) == 3 and "% same-size copy" in out
    for row in rows:
        pct, same = (float(x.rstrip("%")) for x in row.split()[-2:])
        assert pct > 0 and same > 0
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--family", "nope"])


# a line each script prints, and exits with, when it has nothing to run on (ptxas_report needs no GPU)
NO_GPU_LINE = ("no CUDA device", "needs a CUDA", "torch is not installed")


@pytest.mark.skipif(ce.cuda_available(), reason="what a script does where there is no GPU")
@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).parents[1] / "tools").glob("*.py")
                                          if p.name != "ptxas_report.py"))  # fmt: skip
def test_a_gpu_tool_without_a_gpu_says_so_in_a_line(script):
    """Benchmark users run tools/ scripts as they are: without a GPU (or without torch, for the profilers)
    each says so in one line, never a traceback."""
    import subprocess
    import sys

    tools = Path(__file__).parents[1] / "tools"
    proc = subprocess.run([sys.executable, str(tools / script)], capture_output=True, text=True, timeout=120)
    said = (proc.stdout + proc.stderr).strip()
    assert "Traceback" not in said and said.count("\n") == 0 and any(s in said for s in NO_GPU_LINE), said


@pytest.mark.gpu
@pytest.mark.parametrize("arm, per_layer", [("fused_up", 5), ("ksplit", 3)])
def test_bench_decode_counts_every_kernel_of_a_step(cuda, arm, per_layer):
    """bench_decode's launches column, as test_inference counts the launchers: every family's kernels (it once
    missed decode_attention_o's, and read 52 for the ksplit arm's 76 at the 0.5B shape), plus the embedding,
    the LM head GEMV, the sampling and the position advance."""
    from cuengine.inference import decode

    bench = load_tool("bench_decode")
    cfg = ce.TransformerConfig.preset("tiny-llama").replace(dtype="bf16")
    m = ce.LlamaModel(cfg, device=cuda)
    m.init_weights(0)
    st = m.allocate_inference_state(max_batch=1, max_seq_len=16, ffn_arm=arm)
    m.generate([[1, 2]], 2)
    assert bench.launches(st, lambda: decode.decode_step_rows(st, 1, arm)) == per_layer * cfg.num_layers + 4


def test_ab_bench_runs_each_variant_in_turn(tmp_path):
    """tools/ab_bench.sh: each variant's copy has its patches applied (a leading - reverses one), the
    command runs in every copy round after round, and a patch that does not apply stops it."""
    import os
    import shutil
    import subprocess

    if shutil.which("git") is None or shutil.which("tar") is None:
        pytest.skip("git and tar are needed")
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "README.md").write_text(readme + "AB_MARKER\n")
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "README.md").write_text(readme)
    diff = subprocess.run(["git", "diff", "--no-index", "orig/README.md", "changed/README.md"], cwd=tmp_path,
                          capture_output=True, text=True).stdout  # fmt: skip
    patch = tmp_path / "marker.patch"
    patch.write_text(diff.replace("a/orig/README.md", "a/README.md").replace("b/changed/README.md", "b/README.md"))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "AB_DIR": str(tmp_path / "ab")}
    tool = str(root / "tools/ab_bench.sh")
    run = subprocess.run(["bash", tool, "-r", "2", "-g", "^[0-9]", "grep -c AB_MARKER README.md", "plain",
                          f"marked={patch}", f"undone={patch},-{patch}"], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = (tmp_path / "out" / "ab.log").read_text().split("\n")
    assert lines[:-1] == [f"{v} r{r}  {n}" for r in (1, 2) for v, n in (("plain", 0), ("marked", 1), ("undone", 0))]
    bad = subprocess.run(["bash", tool, "true", f"twice={patch},{patch}"], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert bad.returncode == 1 and "does not apply to twice" in bad.stderr


def test_trace_gemv_instruments_a_compilable_copy(tmp_path, monkeypatch):
    """tools/trace_gemv.py: its gemv.cuh copy compiles for sm_90a with the stamps in place, and a
    gemv.cuh whose marked places moved is refused rather than traced half-way."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is part of the [cuda] extra")
    from cuengine.kernels import _build

    tool = load_tool("trace_gemv")
    traced = tool.instrumented_dir(tmp_path)
    text = (traced / "gemv.cuh").read_text()
    assert text.count("stamps.mark(") == 4 and "trace_start(N, K" in text
    monkeypatch.setattr(_build, "kernel_dir", lambda: traced)
    _build.compile_cubin(traced / "gemv.cu", "sm_90a")
    with pytest.raises(RuntimeError, match="no longer has"):
        tool.instrumented_source(text.replace("    launch_dependents();\n", ""))


def test_trace_gemv_summary_of_two_gemvs():
    """Launches are told apart by shape and grid though their blocks' records interleave, and the
    phases (from clock64, scaled by the blocks' own ns a cycle), spans, releases, late starts and tails
    come out of the stamps."""
    tool = load_tool("trace_gemv")
    from cuengine.kernels import gemv

    def record(ns, N, K, prologue, block, blocks):
        r = np.zeros(tool.FIELDS, np.uint64)
        r[:5] = ns
        r[5:10] = [2 * t for t in ns]  # 0.5 ns a cycle
        r[10], r[11], r[12] = N << 32 | K, prologue << 8, block << 32 | blocks
        return r

    qkv = (1152, 896, gemv._PRO_NORM_STAGED)
    down = (896, 4864, gemv._PRO_NONE)
    records = np.array([
        record([0, 1000, 1500, 2000, 3000], *qkv, 0, 2),
        record([3000, 4000, 4100, 4600, 5000], *down, 0, 2),  # the next launch's first block, early
        record([100, 1200, 1600, 2200, 3500], *qkv, 1, 2),
        record([3200, 4300, 4500, 5000, 5400], *down, 1, 2),
    ])  # fmt: skip
    ns_per_cycle, table = tool.summary(records)
    assert ns_per_cycle == 0.5
    assert set(table) == {"qkv 896->1152", "down 4864->896"}
    q, d = table["qkv 896->1152"], table["down 4864->896"]
    assert q["launches"] == 1 and q["blocks"] == 2 and np.isnan(q["release"])
    assert q["span"] == pytest.approx(3.5) and q["late"] == pytest.approx(0.2)
    assert q["wait"] == pytest.approx(1.05) and q["stage"] == pytest.approx(0.45)
    assert q["first"] == pytest.approx(0.55) and q["rest"] == pytest.approx(1.15)
    assert q["tail"] == pytest.approx(0.25) and d["tail"] == pytest.approx(0.2)  # last end - median end
    assert d["release"] == pytest.approx(0.5)  # 4000 ns, the first pass of its wait, after qkv ended at 3500
    assert d["span"] == pytest.approx(2.4) and d["late"] == pytest.approx(0.3)
    assert tool.report(records)[2].startswith("qkv 896->1152")
    assert tool.report(records[:3])[2:] == tool.report(records[[0, 2]])[2:]  # an incomplete launch is left out


_PTXAS_LOG = """ptxas info    : 176 bytes gmem
ptxas info    : Compiling entry function 'tile_kernel' for 'sm_90a'
ptxas info    : Function properties for tile_kernel
ptxas         .     224 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Function properties for a_called_helper
ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 224 bytes cumulative stack size, 8576 bytes smem
ptxas info    : Compile time = 61.366 ms
ptxas info    : Compiling entry function 'plain_kernel' for 'sm_90a'
ptxas info    : Function properties for plain_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers"""


def test_ptxas_report_reads_each_kernels_resources():
    """tools/ptxas_report.py: each kernel's registers, stack frame, spills and shared memory from a ptxas -v
    log (a called helper's frame not charged to the kernel), and a real family compiled on this machine."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is part of the [cuda] extra")
    from cuengine.kernels._build import kernel_dir

    tool = load_tool("ptxas_report")
    assert tool.parse_log(_PTXAS_LOG) == [
        {"kernel": "tile_kernel", "registers": 128, "stack": 224, "spill_stores": 8, "spill_loads": 12, "smem": 8576},
        {"kernel": "plain_kernel", "registers": 40, "stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0},
    ]
    got = {k["kernel"]: k for k in tool.report(kernel_dir() / "rope.cu")}
    assert "rope_bf16_f32" in got and got["rope_bf16_f32"]["registers"] > 0


def test_bench_train_options_pass_the_fp8_only_flags_to_fp8_runs_alone():
    """--lmhead-fp8 and --fp8-amax-history reach the FP8 runs' TrainOptions and are left out of the bf16 ones
    (which would refuse them)."""
    tool = load_tool("bench_train")
    extra = {"lmhead_fp8": True, "fp8_amax_history": 16, "offload_residual": True}
    fp8 = tool.options("fp8", extra)
    assert fp8.lmhead_fp8 and fp8.fp8_amax_history == 16 and fp8.offload_residual and fp8.fp8
    bf16 = tool.options("bf16", extra)
    assert not bf16.lmhead_fp8 and not bf16.fp8_amax_history and bf16.offload_residual
