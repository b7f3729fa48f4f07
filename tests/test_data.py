"""Token sources: the text, .npy and llm.c .bin readers, the stdlib corpus, batching, resumption."""

import numpy as np
import pytest
from conftest import write_llmc

from cuengine import data


# ---- readers --------------------------------------------------------------------------------
def test_bin_reader_reads_llmc_layout(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 1000)
    got, vocab = data.read_bin(write_llmc(tmp_path / "a.bin", tokens))
    assert vocab == 50257 and got.dtype == np.uint16 and isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, tokens)


def test_bin_reader_llama3_uint32(tmp_path):
    tokens = np.array([0, 70000, 128255, 5])
    got, vocab = data.read_bin(write_llmc(tmp_path / "a.bin", tokens, 20240801, 7, dtype="<u4"))
    assert vocab == 128256
    np.testing.assert_array_equal(got, tokens)


def test_write_bin_round_trips(tmp_path):
    tokens = np.arange(300) * 7
    data.write_bin(tmp_path / "w.bin", tokens)
    raw = (tmp_path / "w.bin").read_bytes()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [20240520, 1, 300] and len(raw) == 1024 + 600
    np.testing.assert_array_equal(data.read_bin(tmp_path / "w.bin")[0], tokens)
    with pytest.raises(data.DataError, match="do not fit"):
        data.write_bin(tmp_path / "x.bin", [70000])


@pytest.mark.parametrize(
    "kwargs,tokens,message",
    [
        (dict(magic=1234), [1, 2], "bad magic 1234"),
        (dict(version=2), [1, 2], "version 2, expected 1"),
        (dict(count=5), [1, 2], "header says 5 tokens"),
        (dict(count=0), [], "header says 0 tokens"),
    ],
)
def test_bin_reader_rejects_bad_headers(tmp_path, kwargs, tokens, message):
    with pytest.raises(data.DataError, match=message):
        data.read_bin(write_llmc(tmp_path / "bad.bin", tokens, **kwargs))


def test_bin_reader_rejects_short_and_missing_files(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"\0" * 100)
    with pytest.raises(data.DataError, match="too short"):
        data.read_bin(tmp_path / "short.bin")
    with pytest.raises(data.DataError, match="no such file"):
        data.read_bin(tmp_path / "nope.bin")
    with pytest.raises(data.DataError, match="not a file"):
        data.read_bin(tmp_path)


def test_text_reader_bytes_and_empty(tmp_path):
    (tmp_path / "t.txt").write_text("héllo\n", encoding="utf-8")
    got = data.read_text(tmp_path / "t.txt")
    assert got.tolist() == list("héllo\n".encode())
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(data.DataError, match="empty file"):
        data.read_text(tmp_path / "e.txt")


def test_text_reader_uses_tokenizer(tmp_path):
    class Words:
        def encode(self, text):
            return np.array([len(w) for w in text.split()], np.int32)

    (tmp_path / "t.txt").write_text("a bb ccc", encoding="utf-8")
    assert data.read_text(tmp_path / "t.txt", Words()).tolist() == [1, 2, 3]


def test_npy_reader(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(50, dtype=np.int64))
    got = data.read_npy(tmp_path / "ok.npy")
    assert got.tolist() == list(range(50))
    np.save(tmp_path / "f.npy", np.zeros(4, np.float32))
    with pytest.raises(data.DataError, match="must be integers, found dtype float32"):
        data.read_npy(tmp_path / "f.npy")
    np.save(tmp_path / "2d.npy", np.zeros((2, 3), np.int32))
    with pytest.raises(data.DataError, match=r"1-D array, found shape \(2, 3\)"):
        data.read_npy(tmp_path / "2d.npy")
    (tmp_path / "junk.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(data.DataError, match="not a readable .npy"):
        data.read_npy(tmp_path / "junk.npy")
    raw = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[: len(raw) - 40])
    with pytest.raises(data.DataError, match="not a readable .npy"):
        data.read_npy(tmp_path / "cut.npy")


# ---- open_source and vocab checks -----------------------------------------------------------
def test_open_source_dispatch_and_glob(tmp_path):
    for i in range(3):
        write_llmc(tmp_path / f"s_{i}.bin", np.full(10 + i, i))
    src = data.open_source(str(tmp_path / "s_*.bin"))
    assert len(src.shards) == 3 and src.num_tokens == 33 and src.vocab_size == 50257
    assert src.token_range() == (0, 2)
    np.save(tmp_path / "ids.npy", np.arange(9, dtype=np.int32))
    assert data.open_source([str(tmp_path / "ids.npy")]).vocab_size is None
    (tmp_path / "t.txt").write_bytes(b"abc")
    assert data.open_source(str(tmp_path / "t.txt")).vocab_size == 256
    with pytest.raises(data.DataError, match="mix formats"):
        data.open_source([str(tmp_path / "ids.npy"), str(tmp_path / "t.txt")])
    with pytest.raises(data.DataError, match="no files match"):
        data.open_source(str(tmp_path / "none_*.bin"))


def test_check_vocab(tmp_path):
    write_llmc(tmp_path / "v.bin", [3, 1, 300, 2])
    src = data.open_source(str(tmp_path / "v.bin"))
    src.check_vocab(301)
    with pytest.raises(data.DataError, match="token id 300 is >= the model's vocab_size 256"):
        src.check_vocab(256)
    np.save(tmp_path / "neg.npy", np.array([1, -3, 2], np.int32))
    with pytest.raises(data.DataError, match="token id -3 is negative"):
        data.open_source(str(tmp_path / "neg.npy")).check_vocab(10)


# ---- batching -------------------------------------------------------------------------------
def test_batches_are_windows_of_the_stream():
    stream = np.arange(1000, dtype=np.int32) * 3
    src = data.TokenSource([stream], "s", shuffle=False)
    x, y = src.batch(4, 16)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int32
    for b in range(4):
        np.testing.assert_array_equal(x[b], stream[16 * b : 16 * b + 16])
        np.testing.assert_array_equal(y[b], stream[16 * b + 1 : 16 * b + 17])


def test_shuffled_epoch_covers_every_window_once_and_never_crosses_shards():
    shards = [np.arange(0, 101), np.arange(1000, 1051), np.arange(5000, 5005)]
    src = data.TokenSource(shards, "s", seed=3)
    T, n = 10, 10 + 5 + 0
    assert src.num_windows(T) == n
    x, y = src.batch(n, T)
    starts = sorted(int(r[0]) for r in x)
    assert starts == [10 * i for i in range(10)] + [1000 + 10 * i for i in range(5)]
    for xr, yr in zip(x, y):
        np.testing.assert_array_equal(yr, xr + 1)  # consecutive within one shard
    assert src.state()["epoch"] == 1 and src.state()["cursor"] == 0
    x2, _ = src.batch(n, T)
    assert sorted(int(r[0]) for r in x2) == starts and not np.array_equal(x, x2)  # a new order


def test_same_seed_same_batches_other_seed_other_batches():
    stream = np.random.default_rng(1).integers(0, 256, 5000)
    a, b, c = (data.TokenSource([stream], "s", seed=s) for s in (7, 7, 8))
    xa, xb, xc = a.batch(8, 32)[0], b.batch(8, 32)[0], c.batch(8, 32)[0]
    np.testing.assert_array_equal(xa, xb)
    assert not np.array_equal(xa, xc)


def test_resume_gives_the_same_batches():
    stream = np.random.default_rng(2).integers(0, 256, 3000)
    straight = data.TokenSource([stream], "s", seed=5)
    expected = [straight.batch(7, 20) for _ in range(6)]  # crosses an epoch (149 windows, 42 used)
    first = data.TokenSource([stream], "s", seed=5)
    for _ in range(3):
        first.batch(7, 20)
    saved = first.state()
    resumed = data.TokenSource([stream], "s", seed=0)
    resumed.load_state(saved)
    for x, y in expected[3:]:
        rx, ry = resumed.batch(7, 20)
        np.testing.assert_array_equal(rx, x)
        np.testing.assert_array_equal(ry, y)


def test_batches_wrap_across_epochs_when_data_is_small():
    src = data.TokenSource([np.arange(25)], "s", shuffle=False)
    x, _ = src.batch(5, 8)  # 3 windows per epoch
    assert [int(r[0]) for r in x] == [0, 8, 16, 0, 8]
    assert src.state()["epoch"] == 1


def test_too_short_for_a_window_and_bad_state():
    src = data.TokenSource([np.arange(10)], "tiny")
    with pytest.raises(data.DataError, match="fewer than one window of seq-len 16"):
        src.batch(1, 16)
    with pytest.raises(data.DataError, match="outside the data"):
        src.load_state({"seed": 0, "seq_len": 4, "epoch": 0, "cursor": 99})
    with pytest.raises(data.DataError, match="no tokens"):
        data.TokenSource([np.arange(0)], "empty")
    with pytest.raises(data.DataError, match="shard 1 must be a 1-D integer array of token ids, got int64 array of sh"):
        data.TokenSource([np.arange(10), np.zeros((2, 5), np.int64)], "rows")
    with pytest.raises(data.DataError, match="shard 0 must be a 1-D integer array of token ids, got float32 array"):
        data.TokenSource([np.arange(10, dtype=np.float32)], "floats")
    with pytest.raises(data.DataError, match="shard 0 must be a 1-D integer array of token ids, got list"):
        data.TokenSource([[1, 2, 3]], "list")


def test_split_holds_out_the_tail():
    src = data.TokenSource([np.arange(100), np.arange(1000, 1200)], "s")
    train, val = src.split(0.1)
    assert train.num_tokens + val.num_tokens == 300
    np.testing.assert_array_equal(val.shards[0], np.arange(1180, 1200))
    assert not val.shuffle and train.shuffle


# ---- default corpus and tokenizers ----------------------------------------------------------
def test_stdlib_corpus_is_deterministic_and_held_out():
    train_files, val_files = data.stdlib_files()
    assert train_files and val_files and not set(train_files) & set(val_files)
    assert [f.name for f in train_files] == sorted(f.name for f in train_files)
    train, val = data.stdlib_sources(seed=1)
    assert 1 << 20 < train.num_tokens + val.num_tokens <= data.STDLIB_MAX_BYTES
    assert val.num_tokens > 10_000
    train.check_vocab(256)
    x, _ = train.batch(2, 64)
    train2, _ = data.stdlib_sources(seed=1)
    np.testing.assert_array_equal(train2.batch(2, 64)[0], x)


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    ids = tok.encode("naïve ✓")
    assert ids.dtype == np.int32 and tok.decode(ids) == "naïve ✓"
    assert tok.decode([104, 105, 999]) == "hi"  # ids beyond a byte are dropped


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(data.load_tokenizer(None), data.ByteTokenizer)
    assert isinstance(data.load_tokenizer(tmp_path), data.ByteTokenizer)


def word_tokenizer(path):
    """A 5-word tokenizer.json written with the `tokenizers` package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "return": 2, "x": 3, "y": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    word_tokenizer(tmp_path)
    tok = data.load_tokenizer(tmp_path)
    assert isinstance(tok, data.HFTokenizer) and tok.vocab_size == 5
    assert tok.encode("def x return z").tolist() == [1, 3, 2, 0]
    assert tok.decode([1, 3, 2, 4]) == "def x return y"
    (tmp_path / "c.txt").write_text("def x\nreturn y\n")
    assert data.read_text(tmp_path / "c.txt", tok).tolist() == [1, 3, 2, 4]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{broken")
    with pytest.raises(data.DataError, match="not a readable tokenizer.json"):
        data.load_tokenizer(tmp_path / "bad")


def test_tokenizer_reader_panic_is_a_data_error(tmp_path, monkeypatch):
    """A Rust panic inside `tokenizers` surfaces as pyo3's PanicException, a BaseException: it is
    reported as a DataError naming the file like any other unreadable tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")

    class PanicException(BaseException):
        pass

    class Panicking:
        @staticmethod
        def from_file(path):
            raise PanicException("index out of bounds")

    word_tokenizer(tmp_path)
    monkeypatch.setattr(tokenizers, "Tokenizer", Panicking)
    with pytest.raises(data.DataError, match=f"{tmp_path / 'tokenizer.json'}: .*PanicException: index out of bounds"):
        data.load_tokenizer(tmp_path)
    monkeypatch.setattr(Panicking, "from_file", staticmethod(lambda path: (_ for _ in ()).throw(KeyboardInterrupt)))
    with pytest.raises(KeyboardInterrupt):  # an interrupt is not a bad file
        data.load_tokenizer(tmp_path)
