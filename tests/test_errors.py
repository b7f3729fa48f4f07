"""Bad input and bad luck at the library level: FP8 tensors from NumPy, memory that runs out or a
plan that cannot fit, corrupt weight, config and checkpoint files, file modes, and a save that is
killed half-way. Each documented error is triggered here and its message checked."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, rng

import cuengine as ce
from cuengine import alloc as alloc_mod
from cuengine.model import weights as weights_mod

ROOT = Path(__file__).resolve().parent.parent


# ---- FP8 tensors from NumPy -----------------------------------------------------------------------
@pytest.mark.parametrize("a_dt,b_dt", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 300.0])
def test_fp8_from_numpy_then_matmul_matches_numpy(dev, a_dt, b_dt, magnitude):
    """from_numpy quantizes with the scale it records, so matmul (which dequantizes by scale_inv)
    gives NumPy's product, at any magnitude: tiny values would flush to zero and large ones saturate
    if they were stored unscaled."""
    g = rng(1)
    a = g.uniform(0.5, 2.0, (32, 64)) * magnitude  # positive: no cancellation, so rtol is per element
    b = g.uniform(0.5, 2.0, (48, 64))
    ta = ce.Tensor.from_numpy(a, dev, name="a", dtype=a_dt)
    tb = ce.Tensor.from_numpy(b, dev, name="b", dtype=b_dt)
    out = ce.Tensor.empty("fp32", (32, 48), dev, name="out")
    ce.matmul(out, ta, tb)
    worst = "e5m2" if "e5m2" in (a_dt, b_dt) else "e4m3"
    assert_close(out.numpy(), a @ b.T, worst, what=f"{a_dt} x {b_dt}", scale=magnitude)
    # the stored values times the recorded scale_inv give the input back, to FP8 precision
    assert_close(ta.numpy().astype(np.float64) * ta.fp8_stats()[2], a, a_dt, scale=magnitude)
    assert ta.fp8_stats()[0] == np.float32(a.max())


def test_fp8_from_numpy_keeps_stored_fp8_values(dev):
    """An array already of the FP8 dtype is stored bit for bit, with unit scales."""
    q = np.array([[1.0, -3.5], [448.0, 0.25]], ce.FP8_E4M3.np)
    t = ce.Tensor.from_numpy(q, dev, name="q")
    np.testing.assert_array_equal(t.numpy().view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(t.fp8_stats(), np.array([448.0, 1.0, 1.0], np.float32))


# ---- the allocator: out of memory, plans that cannot fit ------------------------------------------
def test_out_of_memory_names_the_request_prints_the_table_and_keeps_nothing(dev):
    alloc = ce.TensorAllocator(dev, limit_bytes=1 << 20)
    with alloc.context("Weights"):
        alloc.allocate("fp32", "embedding", (1024, 128))
    before = alloc.report()
    # the values fit, the stats slot does not: neither may stay allocated
    with alloc.context("Activations"), pytest.raises(MemoryError) as err:
        alloc.allocate("e4m3", "ln1.q", ((512 << 10) - 100,))
    msg = str(err.value)
    assert "out of memory allocating 'ln1.q.stats'" in msg and "in context 'Activations'" in msg
    rows = [line.split() for line in msg.splitlines()]
    assert ["context", "buffer", "buffers", "MiB"] in rows and ["Weights", "embedding", "1", "0.50"] in rows
    assert alloc.report() == before


def test_out_of_memory_table_is_capped(dev):
    alloc = ce.TensorAllocator(dev, limit_bytes=4 << 20)
    for i in range(100):
        alloc.allocate("byte", f"b{i}", (256 * (i + 1),))
    with pytest.raises(MemoryError) as err:
        alloc.allocate("byte", "huge", (4 << 20,))
    msg = str(err.value)
    assert "b99 " in msg and "b0 " not in msg and f"({100 - alloc_mod.OOM_TABLE_ROWS} smaller names)" in msg
    assert len(msg.splitlines()) < alloc_mod.OOM_TABLE_ROWS + 12


def test_all_or_nothing_releases_the_whole_plan(dev):
    alloc = ce.TensorAllocator(dev, limit_bytes=1 << 20)
    alloc.allocate("fp32", "kept", (16,))
    before = alloc.report()
    with pytest.raises(MemoryError, match="'too_big'"), alloc.all_or_nothing("a plan", check_fit=False):
        alloc.allocate("fp32", "a", (1024,))
        alloc.allocate("e4m3", "b", (1024,))
        alloc.allocate("byte", "too_big", (1 << 20,))
    assert alloc.report() == before
    with alloc.all_or_nothing("another plan"):  # what succeeds stays
        alloc.allocate("fp32", "c", (16,))
    assert alloc.report().by_name[("Default", "c")] == [256, 1]


def test_a_plan_that_cannot_fit_is_refused_before_memory_runs_out(dev, monkeypatch):
    """The plan is compared with what the device (or, on cpu, the host) has free at its start;
    on cpu NumPy memory is only taken when written, so nothing else would stop it."""
    free = 10 << 20
    monkeypatch.setattr(alloc_mod, "available_bytes", lambda device, kind="device": (free, "what the test allows"))
    alloc = ce.TensorAllocator(dev)
    before = alloc.report()
    with pytest.raises(MemoryError) as err, alloc.all_or_nothing("allocate_run_state(B=8, T=1024)"):
        for i in range(4):
            alloc.allocate("fp32", f"act.{i}", (1 << 20,))  # 4 MiB each: the third crosses 10 MiB
    msg = str(err.value)
    assert "allocate_run_state(B=8, T=1024) does not fit" in msg and "'act.2'" in msg
    assert "need 12.00 MiB, more than the 10.00 MiB of what the test allows" in msg
    assert alloc.report() == before
    with alloc.all_or_nothing("a plan that fits"):
        alloc.allocate("fp32", "small", (1 << 20,))


def test_cpu_plan_counts_pinned_and_device_in_one_pool(monkeypatch):
    monkeypatch.setattr(alloc_mod, "available_bytes", lambda device, kind="device": (6 << 20, "host"))
    alloc = ce.TensorAllocator("cpu")
    with pytest.raises(MemoryError, match="'staging'"), alloc.all_or_nothing("plan"):
        alloc.allocate("byte", "dev", (4 << 20,))
        alloc.allocate("byte", "staging", (4 << 20,), kind="pinned")


def test_host_available_bytes_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert alloc_mod.host_available_bytes(meminfo, tmp_path / "no-cgroup") == 20000000 * 1024
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{3 << 30}\n")
    assert alloc_mod.host_available_bytes(meminfo, tmp_path) == 5 << 30
    (tmp_path / "memory.max").write_text("max\n")
    assert alloc_mod.host_available_bytes(meminfo, tmp_path) == 20000000 * 1024
    assert 0 < alloc_mod.host_available_bytes() and alloc_mod.available_bytes("cpu")[0] > 0


def test_print_memory_report_is_the_summary():
    """print(report) stays a dozen lines for a real model; the per-buffer table is on request."""
    cfg = ce.TransformerConfig.preset("tiny")
    alloc = ce.TensorAllocator("cpu")
    ce.LlamaModel(cfg, device="cpu", alloc=alloc)
    for i in range(500):
        alloc.allocate("fp32", f"extra.{i}", (4,))
    rep = alloc.report()
    assert len(str(rep).splitlines()) <= 12 and "Weights" in str(rep)
    assert len(rep.table(per_buffer=True).splitlines()) > 500
