"""Fuzzed bad input for every file reader: safetensors weights (`import_weights`), llm.c `.bin`
shards, `config.json`, checkpoints and `tokenizer.json`.

Each target starts from a valid file and mutates it, at the byte level (flips, truncation,
insertion, a new length field) and at the structure level (a JSON field or a safetensors header
entry replaced by an arbitrary value). Whatever comes out, the reader either accepts it or raises
ValueError (DataError for data files) naming the file; it never crashes with another exception,
hangs (a watchdog kills the run with a traceback), or leaves a model partly loaded.

Examples are capped for CI (2 cores): CUENGINE_FUZZ_EXAMPLES per target (default 60) with a
fixed derandomized seed; set it higher for a deeper local run, which also draws fresh examples.
`pytest --hypothesis-show-statistics tests/test_fuzz.py` prints how many cases each target ran.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cuengine as ce
from cuengine import data

EXAMPLES = int(os.environ.get("CUENGINE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="CUENGINE_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
WATCHDOG_S = 60  # one example takes milliseconds; anything near this is a hang


@contextlib.contextmanager
def watchdog():
    """Turn a hang into a failure: after WATCHDOG_S the process prints every thread's traceback
    and exits (this works inside C and Rust code, where a Python signal handler would never run)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- mutations ----------------------------------------------------------------------------------
# Any character but a lone surrogate, without st.text()'s default codec check: on Python 3.11 that check
# warns (NonRoundTrippableCharactersWarning) about characters the header's JSON escapes anyway.
chars = st.characters(exclude_categories=("Cs",))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(chars, max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(chars, max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def byte_mutation(draw, focus: int | None = None):
    """A function bytes -> bytes: flip, overwrite, insert, delete or truncate, at positions drawn
    from the first `focus` bytes (where a format keeps its header) or anywhere."""
    kind = draw(st.sampled_from(["flip", "overwrite", "insert", "delete", "truncate", "u64 length"]))
    pos_frac = draw(st.floats(0, 1, exclude_max=True))
    blob = draw(st.binary(min_size=1, max_size=16))
    bit = draw(st.integers(0, 7))
    value = draw(st.integers(0, 2**64 - 1))
    in_focus = focus is not None and draw(st.booleans())

    def mutate(b: bytes) -> bytes:
        n = min(len(b), focus) if in_focus else len(b)
        i = int(pos_frac * max(n, 1))
        if kind == "flip" and b:
            return b[:i] + bytes([b[i] ^ (1 << bit)]) + b[i + 1 :]
        if kind == "overwrite":
            return b[:i] + blob + b[i + len(blob) :]
        if kind == "insert":
            return b[:i] + blob + b[i:]
        if kind == "delete":
            return b[:i] + b[i + len(blob) :]
        if kind == "truncate":
            return b[:i]
        return struct.pack("<Q", value) + b[8:]  # a safetensors header length (or any 8 leading bytes)

    mutate.__name__ = f"{kind}@{pos_frac:.3f}{'(header)' if in_focus else ''}"
    return mutate


@st.composite
def json_mutation(draw):
    """A function dict -> JSON value: one field (possibly nested one level) replaced by an arbitrary
    JSON value or deleted, or a new field added, or the whole document replaced."""
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "nested", "document"]))
    index = draw(st.integers(0, 1000))
    value = draw(json_values)
    key = draw(st.text(chars, max_size=8))

    def mutate(d):
        if kind == "document":
            return value
        d = json.loads(json.dumps(d))
        keys = sorted(d)
        k = keys[index % len(keys)]
        if kind == "replace":
            d[k] = value
        elif kind == "delete":
            del d[k]
        elif kind == "add":
            d[key] = value
        elif isinstance(d[k], dict) and d[k]:
            sub = sorted(d[k])
            d[k][sub[index % len(sub)]] = value
        else:
            d[k] = value
        return d

    return mutate


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, allow_nan=True))


def assert_names(err: BaseException, path) -> None:
    assert str(path) in str(err), f"the error does not name {path}: {err}"


# ---- safetensors and import_weights -------------------------------------------------------------
def tiny_cfg(preset="tiny"):
    return ce.TransformerConfig.preset(preset).replace(num_layers=1)


def safetensors_header(b: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8 : 8 + n]), b[8 + n :]


def safetensors_file(header, payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + payload


@pytest.fixture(scope="module")
def weights_case(tmp_path_factory):
    """A valid export of a 1-layer tied Qwen2-like model, and a model to import into."""
    d = tmp_path_factory.mktemp("weights")
    src = ce.LlamaModel(tiny_cfg(), device="cpu")
    src.init_weights(1)
    src.export_weights(d)
    dst = ce.LlamaModel(tiny_cfg(), device="cpu")
    dst.init_weights(2)
    return (d / "model.safetensors").read_bytes(), dst


def weights_of(m) -> dict:
    return {k: v.numpy().tobytes() for k, v in m.weights.tensors.items()}


def import_or_refuse(m, content: bytes, kind: str) -> str:
    """Import `content` as model.safetensors; on refusal the weights must be unchanged."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.safetensors"
        f.write_bytes(content)
        before = weights_of(m)
        try:
            with watchdog():
                m.import_weights(d)
        except ValueError as err:
            assert_names(err, d)
            assert weights_of(m) == before, f"{kind}: a refused import changed the weights"
            return "refused"
    return "accepted"


@FUZZ
@given(mutation=byte_mutation(focus=1024))
def test_fuzz_import_weights_bytes(weights_case, mutation):
    valid, m = weights_case
    event(import_or_refuse(m, mutation(valid), mutation.__name__))


header_fields = st.sampled_from(["dtype", "shape", "data_offsets", "delete", "rename", "add", "metadata"])


@FUZZ
@given(field=header_fields, index=st.integers(0, 1000), value=json_values,
       shape=st.lists(st.integers(-2, 2**40), max_size=4), name=st.text(chars, max_size=40))  # fmt: skip
def test_fuzz_import_weights_header(weights_case, field, index, value, shape, name):
    """One entry of the safetensors header changed: dtype, shape, offsets (to arbitrary values or
    plausible integers), an entry deleted, renamed or added, or the metadata replaced."""
    valid, m = weights_case
    header, payload = safetensors_header(valid)
    keys = sorted(k for k in header if k != "__metadata__")
    k = keys[index % len(keys)]
    if field == "dtype":
        header[k]["dtype"] = value if index % 2 else ["F32", "BF16", "F16", "F64", "I64", "U8", "F8_E4M3", "BOOL"][
            index % 8]  # fmt: skip
    elif field == "shape":
        header[k]["shape"] = value if index % 3 == 0 else shape
    elif field == "data_offsets":
        header[k]["data_offsets"] = value if index % 3 == 0 else (shape + [0, 0])[:2]
    elif field == "delete":
        del header[k]
    elif field == "rename":
        header[name] = header.pop(k)
    elif field == "add":
        header[name] = value
    else:
        header["__metadata__"] = value
    event(import_or_refuse(m, safetensors_file(header, payload), f"{field} of {k}"))


# ---- llm.c .bin shards --------------------------------------------------------------------------
def read_bin_or_refuse(content: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "shard.bin"
        f.write_bytes(content)
        try:
            with watchdog():
                tokens, vocab = data.read_bin(f)
                source = data.open_source([str(f)])
        except data.DataError as err:
            assert_names(err, f)
            return "refused"
        # accepted: the header's count is exactly what the file holds
        magic, _, count = struct.unpack("<3i", content[:12])
        version, dtype, want_vocab = data.BIN_FORMATS[magic]
        assert len(tokens) == count == (len(content) - data.BIN_HEADER_BYTES) // dtype.itemsize
        assert vocab == want_vocab and source.num_tokens == count
        del tokens, source  # release the memory maps before the directory goes
    return "accepted"


@FUZZ
@given(mutation=byte_mutation(focus=16), magic=st.sampled_from(sorted(data.BIN_FORMATS)),
       n=st.integers(1, 300))  # fmt: skip
def test_fuzz_bin_reader_bytes(mutation, magic, n):
    _, dtype, _ = data.BIN_FORMATS[magic]
    with tempfile.TemporaryDirectory() as d:
        data.write_bin(Path(d) / "x.bin", np.arange(n) % 50000, magic=magic)
        valid = (Path(d) / "x.bin").read_bytes()
    event(read_bin_or_refuse(mutation(valid)))


@FUZZ
@given(magic=st.sampled_from(sorted(data.BIN_FORMATS)) | st.integers(-(2**31), 2**31 - 1),
       version=st.integers(-(2**31), 2**31 - 1) | st.sampled_from([1, 7]),
       count=st.integers(-(2**31), 2**31 - 1) | st.integers(0, 400), payload=st.integers(0, 1600),
       header_len=st.sampled_from([0, 11, 12, 1023, 1024]))  # fmt: skip
def test_fuzz_bin_reader_header(magic, version, count, payload, header_len):
    """Arbitrary header ints (or a short header) and payload length."""
    header = np.zeros(256, "<i4")
    header[:3] = magic, version, count
    event(read_bin_or_refuse(header.tobytes()[:header_len] + bytes(payload)))


# ---- config.json --------------------------------------------------------------------------------
def config_or_refuse(text: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "config.json"
        f.write_bytes(text)
        try:
            with watchdog():
                cfg = ce.TransformerConfig.from_pretrained(d)
        except ValueError as err:
            assert_names(err, f)
            return "refused"
        assert isinstance(cfg, ce.TransformerConfig)
        cfg.validate()
    return "accepted"


CONFIGS = [ce.TransformerConfig.preset(p).to_hf_dict() for p in ("tiny", "tiny-llama")]


@FUZZ
@given(which=st.sampled_from([0, 1]), mutation=json_mutation())
def test_fuzz_config_json_fields(which, mutation):
    event(config_or_refuse(json.dumps(mutation(CONFIGS[which]), allow_nan=True).encode()))


@FUZZ
@given(which=st.sampled_from([0, 1]), mutation=byte_mutation())
def test_fuzz_config_json_bytes(which, mutation):
    event(config_or_refuse(mutation(json.dumps(CONFIGS[which], indent=2).encode())))


# ---- checkpoints --------------------------------------------------------------------------------
CKPT_FILES = ("weights.safetensors", "optimizer.safetensors", "state.json")


@pytest.fixture(scope="module")
def checkpoint_case(tmp_path_factory):
    """A valid checkpoint of a 1-layer model after one step, and another model to load it into."""
    d = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_cfg("tiny-llama")
    src = ce.LlamaModel(cfg, device="cpu")
    src.init_weights(1)
    src.allocate_run_state(2, 16)
    x = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    src.train_step(x, x, lr=1e-3)
    src.save_checkpoint(d / "ckpt", extra={"data": {"epoch": 0}})
    dst = ce.LlamaModel(cfg, device="cpu")
    dst.init_weights(2)
    dst.allocate_run_state(2, 16)
    return {f: (d / "ckpt" / f).read_bytes() for f in CKPT_FILES}, dst


def model_state(m) -> dict:
    return {**weights_of(m), **{k: v.tobytes() for k, v in m.opt_state.host_arrays().items()}, "step": m.step}


def load_or_refuse(m, files: dict) -> str:
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "ckpt"
        ckpt.mkdir()
        for name, content in files.items():
            (ckpt / name).write_bytes(content)
        before = model_state(m)
        try:
            with watchdog():
                m.load_checkpoint(ckpt)
        except ValueError as err:
            assert_names(err, ckpt)
            assert model_state(m) == before, "a refused checkpoint changed the model"
            return "refused"
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
    return "accepted"


@FUZZ
@given(which=st.sampled_from(CKPT_FILES), mutation=byte_mutation(focus=512))
def test_fuzz_checkpoint_bytes(checkpoint_case, which, mutation):
    files, m = checkpoint_case
    event(load_or_refuse(m, {**files, which: mutation(files[which])}))


@FUZZ
@given(mutation=json_mutation())
def test_fuzz_checkpoint_state_json(checkpoint_case, mutation):
    files, m = checkpoint_case
    state = json.loads(files["state.json"])
    event(load_or_refuse(m, {**files, "state.json": json.dumps(mutation(state), allow_nan=True).encode()}))


# ---- tokenizer.json -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return (d / "tokenizer.json").read_bytes()


def tokenizer_or_refuse(text: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "tokenizer.json"
        f.write_bytes(text)
        try:
            with watchdog():
                tok = data.load_tokenizer(d)
        except data.DataError as err:
            assert_names(err, f)
            return "refused"
        assert isinstance(tok, data.HFTokenizer) and tok.vocab_size >= 0
        with watchdog():
            ids = tok.encode("def f(x):\n    return x + 1\n")
            tok.decode(ids)
    return "accepted"


@FUZZ
@given(mutation=byte_mutation())
def test_fuzz_tokenizer_json_bytes(tokenizer_json, mutation):
    event(tokenizer_or_refuse(mutation(tokenizer_json)))


@FUZZ
@given(mutation=json_mutation())
def test_fuzz_tokenizer_json_fields(tokenizer_json, mutation):
    event(tokenizer_or_refuse(json.dumps(mutation(json.loads(tokenizer_json)), allow_nan=True).encode()))
