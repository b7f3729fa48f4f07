"""Errors of the core layer that a user can reach without a GPU, each triggered and its message
checked: tensor shapes, views and indexing, dtype and device names, the launchers' boundary checks,
stacks, data sources and readers, config validation, weight and checkpoint files, and ZeRO plans.
An error no test reaches can lose its message (or its check) unnoticed; these pin both."""

from __future__ import annotations

import json
import os
import re
import sysconfig

import numpy as np
import pytest
from conftest import write_llmc

import cuengine as ce
from cuengine import data
from cuengine.data import DataError
from cuengine.dist import checkpoint as dist_ckpt
from cuengine.dist.plan import ShardPlan


# ---- tensors: shapes, views, indexing -----------------------------------------------------------
def t46(name="t"):
    return ce.Tensor.empty("fp32", (4, 6), "cpu", name=name)


def t0(name="t"):
    return ce.Tensor.empty("fp32", (), "cpu", name=name)


@pytest.mark.parametrize(
    "make,error,msg",
    [
        (lambda: ce.Tensor.empty("fp32", (2, -3)), ValueError, "negative dimension in shape (2, -3)"),
        (lambda: ce.Tensor.empty("fp32", (2.5,)), ValueError, "shape (2.5,): every dimension must be an int"),
        (lambda: t46().reshape(-1, -1), ValueError, "tensor 't': reshape to (-1, -1) has more than one -1"),
        (lambda: t46().reshape(-1, 5), ValueError, "tensor 't': cannot reshape (4, 6) to (-1, 5)"),
        (lambda: t46().reshape(0, -1), ValueError, "tensor 't': cannot reshape (4, 6) to (0, -1)"),
        (lambda: t0().view("int32"), ValueError, "tensor 't': cannot view a 0-d tensor as int32"),
        (lambda: t0().rows(0, 0), ValueError, "tensor 't': cannot slice a 0-d tensor"),
        (lambda: t46()[::2], ValueError, "tensor 't': only unit-step row slices are views"),
        (lambda: t46()[0, 1], TypeError, "tensor 't': index with an int or a slice over the first dimension"),
        (lambda: t46().shard_view(2, 2), ValueError, "tensor 't': shard 2 out of range for 2 shards"),
        (lambda: t46().shard_view(-1, 4), ValueError, "tensor 't': shard -1 out of range for 4 shards"),
    ],
    ids=[
        "negative-dim",
        "float-dim",
        "two-minus-ones",
        "minus-one-no-fit",
        "minus-one-zero",
        "view-0d",
        "rows-0d",
        "step-slice",
        "tuple-index",
        "shard-past-end",
        "shard-negative",
    ],
)
def test_bad_tensor_shapes_views_and_indices(make, error, msg):
    with pytest.raises(error, match=re.escape(msg)):
        make()


# ---- dtype and device names -----------------------------------------------------------------------
def test_a_value_that_is_no_dtype_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"cannot interpret <object object at .*> as a dtype; valid names: .*bf16"):
        ce.dtype(object())


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: ce.Device("tpu"), "device kind must be 'cuda' or 'cpu', got 'tpu'"),
        (lambda: ce.device(0), "device name must be a string, got 0"),
        (
            lambda: ce.device("cpu").event(timing=True).elapsed_ms(ce.device("cpu").event()),
            "event timing needs the cuda device",
        ),
    ],
    ids=["device-kind", "device-name-type", "event-timing"],
)
def test_bad_device_requests(make, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        make()


# ---- the launchers' boundary checks -------------------------------------------------------------
def test_a_simulated_tensor_is_refused_by_a_launcher():
    """A simulated stack hands out layouts without memory: a kernel must not be given one."""
    out = ce.DeviceMemoryStack.simulate().allocate("fp32", (4, 4), name="sim")
    a, b = ce.Tensor.empty("fp32", (4, 8), name="a"), ce.Tensor.empty("fp32", (4, 8), name="b")
    with pytest.raises(ValueError, match=re.escape("matmul out: tensor 'sim' has no memory (simulated stack)")):
        ce.matmul(out, a, b)


def test_tensors_of_another_device_object_are_refused():
    """Devices are compared by identity: a Device constructed directly is not cuengine.device("cpu"),
    so mixing their tensors (as mixing cuda:0 and cuda:1 would) is an error naming both."""
    other = ce.Device("cpu")
    out = ce.Tensor.empty("fp32", (4, 4), name="out")
    a = ce.Tensor.empty("fp32", (4, 8), other, name="a")
    b = ce.Tensor.empty("fp32", (4, 8), name="b")
    with pytest.raises(ValueError, match=re.escape("tensor 'a' is on Device('cpu'), but 'out' is on Device('cpu')")):
        ce.matmul(out, a, b)
    g = ce.Tensor.empty("fp32", (4,), other, name="g")
    with pytest.raises(ValueError, match=re.escape("all_reduce: tensor: tensor 'g' is on Device('cpu'), expected")):
        ce.dist.SoloComm("cpu").all_reduce(g)


def test_a_stack_capacity_larger_than_its_buffer():
    buf = ce.Tensor.empty("byte", (256,), name="buf")
    with pytest.raises(ValueError, match="stack 'scratch': capacity 512 exceeds its buffer of 256"):
        ce.DeviceMemoryStack(buf, capacity=512, name="scratch")


# ---- data sources and readers -------------------------------------------------------------------
def source(n=100):
    return data.TokenSource([np.arange(n, dtype=np.int32)], "src")


@pytest.mark.parametrize("B,T", [(0, 4), (2, 0), (-1, -1)])
def test_batch_sizes_must_be_positive(B, T):
    with pytest.raises(ValueError, match=re.escape(f"batch: B and T must be >= 1, got B={B}, T={T}")):
        source().batch(B, T)


@pytest.mark.parametrize("fraction", [0, 1, -0.1, 1.5])
def test_split_fraction_must_be_inside_the_unit_interval(fraction):
    with pytest.raises(ValueError, match=re.escape(f"split: val_fraction must be in (0, 1), got {fraction}")):
        source().split(fraction)


def test_split_of_too_few_tokens():
    with pytest.raises(DataError, match="src: 3 tokens are too few to hold out a validation split"):
        source(3).split(0.5)


def test_an_unreadable_file(tmp_path):
    f = tmp_path / "tokens.txt"
    f.write_text("hello")
    f.chmod(0)
    if os.access(f, os.R_OK):
        pytest.skip("this process reads files of any mode (root, CAP_DAC_OVERRIDE)")
    with pytest.raises(DataError, match=f"{f}: not readable"):
        data.open_source(str(f))


def test_an_npz_archive_named_npy(tmp_path):
    f = tmp_path / "tokens.npy"
    with open(f, "wb") as fh:
        np.savez(fh, a=np.arange(10))
    with pytest.raises(DataError, match=f"{f}: expected one array of token ids, found NpzFile"):
        data.open_source(str(f))


def test_no_data_files():
    with pytest.raises(DataError, match="no data files given"):
        data.open_source([])


def test_llmc_shards_of_two_tokenizers(tmp_path):
    a = write_llmc(tmp_path / "a.bin", np.arange(50))
    b = write_llmc(tmp_path / "b.bin", np.arange(50), magic=20240801, version=7, dtype="<u4")
    with pytest.raises(DataError, match=f"{b}: llm.c shard of another tokenizer than {a}"):
        data.open_source([str(a), str(b)])


def test_default_corpus_without_stdlib_sources(tmp_path, monkeypatch):
    """A Python whose standard library ships compiled or zipped has no .py files to train on."""
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    with pytest.raises(DataError, match=f"{tmp_path}: no standard-library sources found for the default corpus"):
        data.stdlib_files()


# ---- config validation --------------------------------------------------------------------------
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize(
    "changes,msg",
    [
        (dict(vocab_size=0), "TransformerConfig.vocab_size must be a positive int, got 0"),
        (dict(num_layers=True), "TransformerConfig.num_layers must be a positive int, got True"),
        (dict(head_size=16.0), "TransformerConfig.head_size must be a positive int, got 16.0"),
        (dict(architecture="GPT2LMHeadModel"), "TransformerConfig.architecture must be ("),
        (dict(hidden_size=12, head_size=3), "TransformerConfig.head_size must be even for RoPE, got 3"),
        (dict(dtype="fp16"), "TransformerConfig.dtype must be 'bf16' or 'fp32', got 'fp16'"),
        (dict(rope_theta=0.0), "TransformerConfig.rope_theta and rms_norm_eps must be positive"),
        (dict(rms_norm_eps=-1e-6), "TransformerConfig.rope_theta and rms_norm_eps must be positive"),
        (dict(rope_scaling={**LLAMA3, "beta": 1}), "TransformerConfig.rope_scaling: unknown llama3 keys ['beta']"),
    ],
    ids=[
        "vocab-zero",
        "layers-bool",
        "head-size-float",
        "architecture",
        "head-size-odd",
        "dtype",
        "rope-theta",
        "rms-eps",
        "llama3-extra-key",
    ],
)
def test_config_fields_that_make_no_model(changes, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        ce.TransformerConfig.preset("tiny").replace(**changes)


def test_two_different_rope_scalings_in_a_config_json():
    """transformers 5 writes rope_parameters, older ones rope_scaling: both given must agree."""
    d = ce.TransformerConfig.preset("tiny").to_hf_dict()
    d["rope_scaling"] = LLAMA3
    d["rope_parameters"] = {**LLAMA3, "factor": 4.0}
    with pytest.raises(ValueError, match=r"cfg: unsupported 'rope_parameters': .*'factor': 4\.0.* differs from the "):
        ce.TransformerConfig.from_hf_dict(d, source="cfg")


# ---- weight and checkpoint files ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    m = ce.LlamaModel(ce.TransformerConfig.preset("tiny"), ce.TrainOptions(), device="cpu")
    m.init_weights(1)
    m.allocate_run_state(2, 16)
    return m


def test_import_of_a_dtype_cuengine_cannot_read(tmp_path, model):
    from safetensors.numpy import save_file

    arrays = model.weights.host_arrays()
    arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(np.float64)
    f = tmp_path / "model.safetensors"
    save_file(arrays, str(f))
    with pytest.raises(ValueError, match=f"{f}: tensor 'model.norm.weight' has dtype F64, which cuengine cannot read"):
        model.import_weights(tmp_path)


def test_import_of_a_file_that_breaks_after_its_header_was_read(tmp_path, model, monkeypatch):
    """The header is checked first and the tensors read afterwards: a file truncated in between
    (another process rewriting it) fails in the second read, which names the file too."""
    import safetensors

    model.export_weights(tmp_path)
    f = tmp_path / "model.safetensors"
    real, opened = safetensors.safe_open, []

    def truncating_open(path, *args, **kwargs):
        opened.append(path)
        if len(opened) == 2:
            f.write_bytes(f.read_bytes()[:100])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", truncating_open)
    with pytest.raises(ValueError, match=f"{f}: not a readable safetensors file"):
        model.import_weights(tmp_path)
    assert len(opened) == 2


def test_import_from_nowhere(tmp_path, model):
    with pytest.raises(FileNotFoundError, match=f"no safetensors file or directory at {tmp_path / 'nowhere'}"):
        model.import_weights(tmp_path / "nowhere")


def test_checkpoint_tensor_of_another_dtype(tmp_path, model):
    from safetensors.numpy import load_file, save_file

    model.save_checkpoint(tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "weights.safetensors"
    arrays = load_file(str(f))
    arrays["layers.0.atto_w"] = arrays["layers.0.atto_w"].astype(np.float32)
    save_file(arrays, str(f))
    msg = f"checkpoint: {f}: 'layers.0.atto_w' is float32 (64, 64), expected bfloat16 (64, 64)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        model.load_checkpoint(tmp_path / "ckpt")


# ---- ZeRO plans and sharded checkpoints ---------------------------------------------------------
SPECS = [("wte", (8, 4), False), ("layers.0.w", (4, 4), True)]


def test_shard_plan_alignment_must_be_positive():
    with pytest.raises(ValueError, match="ShardPlan: align must be >= 1, got 0"):
        ShardPlan(SPECS, 2, align=0)


def test_unflatten_of_a_buffer_of_another_size():
    plan = ShardPlan(SPECS, 2)
    msg = f"ShardPlan.unflatten: expected a flat buffer of {plan.total} elements, got (5,)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        plan.unflatten(np.zeros(5))


def test_sharded_checkpoint_of_another_format(tmp_path):
    dist_ckpt.write_manifest(tmp_path, ShardPlan(SPECS, 1), ["params"])
    f = tmp_path / dist_ckpt.MANIFEST
    f.write_text(json.dumps({**json.loads(f.read_text()), "format": "cuengine-shards-0"}))
    msg = f"checkpoint: {f} has format 'cuengine-shards-0', expected {dist_ckpt.FORMAT!r}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        dist_ckpt.read_manifest(tmp_path)
