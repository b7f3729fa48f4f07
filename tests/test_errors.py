"""Bad input and bad luck at the library level: FP8 tensors from NumPy, memory that runs out or a
plan that cannot fit, corrupt weight, config and checkpoint files, file modes, and a save that is
killed half-way. Each documented error is triggered here and its message checked."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, rng, tiny

import cuengine as ce
from cuengine import alloc as alloc_mod

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


def test_a_plan_larger_than_the_free_memory_is_refused(dev):
    """The same against the real figure: two buffers of just over half the free memory. The second is
    refused by the plan's check, before the device (or, on cpu, the kernel) runs out."""
    free, source = alloc_mod.available_bytes(dev)
    alloc = ce.TensorAllocator(dev)
    refused = pytest.raises(MemoryError, match=f"'second'.*does not fit.*of {re.escape(source)}")
    with refused, alloc.all_or_nothing("plan"):
        alloc.allocate("byte", "first", (free // 2 + (64 << 20),))  # never written: costs no memory on cpu
        alloc.allocate("byte", "second", (free // 2 + (64 << 20),))
    assert alloc.report().total == 0


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
    (tmp_path / "memory").mkdir()  # cgroup v1
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{6 << 30}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{2 << 30}\n")
    assert alloc_mod.host_available_bytes(meminfo, tmp_path) == 4 << 30
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert alloc_mod.host_available_bytes(meminfo, tmp_path) == 20000000 * 1024
    assert 0 < alloc_mod.host_available_bytes() and alloc_mod.available_bytes("cpu")[0] > 0


def test_print_memory_report_is_the_summary():
    """print(model.memory_report()) is one line per context (a 24-layer model with every kind of
    buffer has 14), not one per buffer (over a thousand); the per-buffer table is on request."""
    cfg = ce.TransformerConfig.preset("tiny").replace(num_layers=24)
    m = ce.LlamaModel(
        cfg, ce.TrainOptions(matmul_dtype="e4m3", offload_residual=True, recompute_swiglu=False), device="cpu"
    )
    m.allocate_run_state(2, 16)
    rep = m.memory_report()
    lines = str(rep).splitlines()
    assert len(lines) == len(rep.by_context) + 3 <= 20 and lines[-2].split()[:2] == ["total", "device"]
    assert len(rep.table(per_buffer=True).splitlines()) > 1000
    assert len(rep.table(per_buffer=True, top=10).splitlines()) == len(lines) + 2 + 10 + 1


# ---- corrupt weight, config and checkpoint files --------------------------------------------------
B, T = 2, 16


def make(cfg, seed=1, run_state=True):
    m = ce.LlamaModel(cfg, ce.TrainOptions(), device="cpu")
    m.init_weights(seed)
    if run_state:
        m.allocate_run_state(B, T)
    return m


def batch(cfg, seed=0):
    g = np.random.default_rng(seed)
    return tuple(g.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2))


def model_state(m) -> dict:
    """Every byte a failed load must leave alone: weights, moments (when allocated) and the step."""
    out = {f"w.{k}": v.numpy().tobytes() for k, v in m.weights.tensors.items()}
    if m.opt_state is not None:
        out.update({k: v.tobytes() for k, v in m.opt_state.host_arrays().items()})
    out["step"] = m.step
    return out


CORRUPTIONS = {
    "truncated": lambda b: b[: len(b) // 2],
    "empty": lambda b: b"",
    "header length past the end": lambda b: (len(b) * 4).to_bytes(8, "little") + b[8:],
    "header not JSON": lambda b: (
        b[:8] + b"#" * (int.from_bytes(b[:8], "little")) + b[8 + int.from_bytes(b[:8], "little") :]
    ),
    "text file": lambda b: b"this is not a safetensors file\n",
    "offsets overlap": lambda b: b.replace(b'"data_offsets":[0,', b'"data_offsets":[8,', 1),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_import_of_a_corrupt_file_names_it_and_changes_nothing(tmp_path, corruption):
    cfg = tiny()
    src = make(cfg, seed=3, run_state=False)
    src.export_weights(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(CORRUPTIONS[corruption](f.read_bytes()))
    m = make(cfg, run_state=False)
    before = model_state(m)
    with pytest.raises(ValueError, match=f"{f}: not a readable safetensors file"):
        m.import_weights(tmp_path)
    assert model_state(m) == before


def test_import_of_a_bad_sharded_index(tmp_path):
    from safetensors.numpy import save_file

    cfg = tiny("tiny-llama")
    m = make(cfg, run_state=False)
    arrays = m.weights.host_arrays()
    names = sorted(arrays)
    save_file({k: arrays[k] for k in names[:5]}, str(tmp_path / "a.safetensors"))
    save_file({k: arrays[k] for k in names[4:]}, str(tmp_path / "b.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    before = model_state(m)
    for text, msg in [
        ("{not json", "not a readable safetensors index"),
        ("[1, 2]", "needs a non-empty weight_map"),
        ('{"weight_map": {"x": 3}}', "needs a non-empty weight_map"),
        ('{"weight_map": {"x": "c.safetensors"}}', "names 'c.safetensors', which is not a file beside the index"),
        ('{"weight_map": {"x": "../a.safetensors"}}', "which is not a file beside the index"),
        (json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}), f"tensor '{names[4]}' is also in"),
    ]:
        index.write_text(text)
        with pytest.raises(ValueError, match=msg):
            m.import_weights(tmp_path)
        assert model_state(m) == before, text


@pytest.mark.parametrize("same", [True, False])
def test_tied_import_with_an_lm_head(tmp_path, same):
    """Many HF checkpoints of tied models also carry lm_head.weight: accepted when it is the
    embedding, refused with a clear error when it is not."""
    from safetensors.numpy import save_file

    cfg = tiny()  # tied
    src = make(cfg, seed=5, run_state=False)
    arrays = src.weights.host_arrays()
    head = arrays["model.embed_tokens.weight"].copy()
    if not same:
        head[7, 3] += 1
    save_file({**arrays, "lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    m = make(cfg, run_state=False)
    before = model_state(m)
    if same:
        m.import_weights(tmp_path)
        assert model_state(m) == {**model_state(src), "step": 0}
    else:
        with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
            m.import_weights(tmp_path)
        assert model_state(m) == before
    save_file({**arrays, "lm_head.weight": head[:, :8].copy()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head.weight' has shape \\(256, 8\\), expected \\(256, 64\\)"):
        m.import_weights(tmp_path)


@pytest.mark.parametrize(
    "text,msg",
    [
        ('{"architectures": ["LlamaForCausalLM"], ', "not readable JSON"),
        ("\xff\xfe", "not readable JSON"),
        ("[1, 2, 3]", "expected a JSON object, found list"),
        ('{"architectures": "LlamaForCausalLM"}', "unsupported 'architectures'"),
    ],
)
def test_from_pretrained_on_malformed_json_names_the_file(tmp_path, text, msg):
    f = tmp_path / "config.json"
    f.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=f"{f}: .*{msg}"):
        ce.TransformerConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("hidden_size", "64", "'hidden_size': '64' is not an integer"),
        ("vocab_size", 256.0, "'vocab_size': 256.0 is not an integer"),
        ("num_attention_heads", 0, "'num_attention_heads': 0 does not divide hidden_size 64"),
        ("rms_norm_eps", None, "'rms_norm_eps': None is not a finite number"),
        ("rope_theta", 10**400, "'rope_theta': 1000.* is not a finite number"),
        ("rope_parameters", [1], "'rope_parameters': \\[1\\] is not a JSON object"),
        ("layer_types", [["full_attention"]], "'layer_types'"),
        ("tie_word_embeddings", "true", "'tie_word_embeddings': 'true' is not true or false"),
        ("num_key_value_heads", 3, "num_kv_heads=3 does not divide num_q_heads=4"),
    ],
)
def test_from_pretrained_fields_of_the_wrong_type(tmp_path, field, value, msg):
    d = tiny().to_hf_dict()
    d[field] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: .*{msg}"):
        ce.TransformerConfig.from_pretrained(tmp_path)


def _corrupt_state(key, value):
    def change(d):
        state = json.loads((d / "state.json").read_text())
        state[key] = value
        (d / "state.json").write_text(json.dumps(state))

    return change


CHECKPOINT_CORRUPTIONS = {
    "truncated weights": (lambda d: _truncate(d / "weights.safetensors"), "weights.safetensors: not a readable"),
    "garbage optimizer": (
        lambda d: (d / "optimizer.safetensors").write_bytes(b"\x07" * 100),
        "optimizer.safetensors: not a readable",
    ),  # fmt: skip
    "missing optimizer": (lambda d: (d / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
    "state not JSON": (lambda d: (d / "state.json").write_text('{"step": 3,'), "state.json: not readable JSON"),
    "state a list": (lambda d: (d / "state.json").write_text("[]"), "state.json: expected a JSON object"),
    "no state": (lambda d: (d / "state.json").unlink(), "holds no state.json"),
    "step a string": (_corrupt_state("step", "3"), "'step' must be a non-negative int, found '3'"),
    "negative step": (_corrupt_state("step", -1), "'step' must be a non-negative int"),
    "extra not an object": (_corrupt_state("extra", [1]), "'extra' must be a JSON object"),
    "config of another model": (_corrupt_state("config", {"a": 1}), "written for another model config"),
    "other format": (_corrupt_state("format", "v0"), "has format 'v0'"),
}


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:-100])


@pytest.mark.parametrize("corruption", sorted(CHECKPOINT_CORRUPTIONS))
def test_load_of_a_corrupt_checkpoint_names_the_file_and_changes_nothing(tmp_path, corruption):
    cfg = tiny()
    a = make(cfg)
    a.train_step(*batch(cfg), lr=1e-3)
    a.save_checkpoint(tmp_path / "ckpt")
    change, msg = CHECKPOINT_CORRUPTIONS[corruption]
    change(tmp_path / "ckpt")
    b = make(cfg, seed=2)
    b.train_step(*batch(cfg, seed=1), lr=1e-3)
    before = model_state(b)
    with pytest.raises(ValueError, match=f"checkpoint: {tmp_path / 'ckpt'}.*{msg}"):
        b.load_checkpoint(tmp_path / "ckpt")
    assert model_state(b) == before


# ---- file modes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, mask):
    cfg = tiny()
    m = make(cfg)
    old = os.umask(mask)
    try:
        m.export_weights(tmp_path / "export")
        m.save_checkpoint(tmp_path / "ckpt")
        m.save_checkpoint(tmp_path / "ckpt")  # the replacing save too
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {
        "export": 0o777 & ~mask,  # made by mkdir
        "export/model.safetensors": 0o666 & ~mask,
        "export/config.json": 0o666 & ~mask,
        "ckpt": 0o777 & ~mask,
        "ckpt/weights.safetensors": 0o666 & ~mask,
        "ckpt/optimizer.safetensors": 0o666 & ~mask,
        "ckpt/state.json": 0o666 & ~mask,
    }


# ---- a save killed half-way ---------------------------------------------------------------------
KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import safetensors.numpy
    import cuengine as ce

    out, stage = sys.argv[1], sys.argv[2]
    cfg = ce.TransformerConfig.preset("tiny")
    m = ce.LlamaModel(cfg, ce.TrainOptions(), device="cpu")
    m.init_weights(1)
    m.allocate_run_state(2, 16)
    x = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    m.train_step(x, x, lr=1e-3)
    m.save_checkpoint(out + "/ckpt", extra={"save": 1})
    np.savez(out + "/first.npz", **{k: v.numpy().view(np.uint8) for k, v in m.weights.tensors.items()})
    m.train_step(x, x, lr=1e-3)

    def hang():
        print("ready", flush=True)
        time.sleep(120)

    save_file, replace = safetensors.numpy.save_file, os.replace

    def save_then_hang(*args, **kwargs):  # the weights file of the second save is written, then...
        save_file(*args, **kwargs)
        hang()

    def replace_then_hang(src, dst):  # the old checkpoint is moved aside, the new one not yet in
        replace(src, dst)
        hang()

    if stage == "write":
        safetensors.numpy.save_file = save_then_hang
    else:
        os.replace = replace_then_hang
    m.save_checkpoint(out + "/ckpt", extra={"save": 2})
    """
)


@pytest.mark.parametrize("stage", ["write", "rename"])
def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, stage):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path), stage], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line == "ready\n", proc.stderr.read() if proc.poll() is not None else line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith(".ckpt.tmp-") for n in leftovers) and ("ckpt" in leftovers) == (stage == "write")
    cfg = tiny()
    m = make(cfg, seed=9)
    assert m.load_checkpoint(tmp_path / "ckpt") == {"save": 1}
    assert m.step == 1
    first = np.load(tmp_path / "first.npz")
    for k, v in m.weights.tensors.items():
        np.testing.assert_array_equal(v.numpy().view(np.uint8), first[k], err_msg=k)
    # the next save puts things straight: no temporaries of dead processes, no old copy
    m.save_checkpoint(tmp_path / "ckpt", extra={"save": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "first.npz"]
    assert make(cfg, seed=9).load_checkpoint(tmp_path / "ckpt") == {"save": 3}


def test_a_panic_in_the_safetensors_reader_is_a_value_error(tmp_path, monkeypatch):
    """safetensors is Rust: a panic surfaces as pyo3's PanicException, a BaseException."""
    import safetensors

    class PanicException(BaseException):
        pass

    def panic(*args, **kwargs):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    cfg = tiny()
    m = make(cfg, run_state=False)
    m.export_weights(tmp_path)
    before = model_state(m)
    monkeypatch.setattr(safetensors, "safe_open", panic)
    with pytest.raises(ValueError, match=f"{tmp_path / 'model.safetensors'}: not a readable .*PanicException"):
        m.import_weights(tmp_path)
    assert model_state(m) == before


def test_staging_buffers_are_pinned_on_cuda_and_free_on_cpu(dev):
    """A host staging copy is needed only where device memory is not host memory."""
    alloc = ce.TensorAllocator(dev)
    t = alloc.allocate("int32", "inputs", (2, 8))
    host = alloc.staging(t, "inputs_host")
    host.array()[...] = np.arange(16).reshape(2, 8)
    dev.copy_async(t, host)
    dev.synchronize()
    np.testing.assert_array_equal(t.numpy(), np.arange(16).reshape(2, 8))
    if dev.is_cpu:
        assert host is t and alloc.report().pinned_bytes == 0
    else:
        assert host.kind == "pinned" and alloc.report().by_name[("Default (pinned)", "inputs_host")] == [256, 1]
