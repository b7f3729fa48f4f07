"""Token sources for training: text (byte level or a tokenizer), .npy token ids, llm.c .bin shards,
and a default corpus that needs no download (the Python standard library's own source files).

Every source is a `TokenSource`: one or more 1-D token arrays (memory-mapped where the format
allows) cut into windows of `T + 1` tokens that never cross a shard boundary. `batch(B, T)` hands
out the next `B` windows; with `shuffle=True` the window order is a permutation drawn afresh each
epoch from `(seed, epoch)`, so a run is reproducible from its seed, and `state()` / `load_state()`
(the epoch and the cursor into that order) make it resumable to the exact same batches.

Readers validate what they read (magic, version, size, dtype, token range) and raise `DataError`
(a ValueError) with the file name and what was expected and seen.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import numpy as np

# llm.c shard header: 256 int32; [0] magic, [1] version, [2] token count; then the tokens.
BIN_HEADER_INTS = 256
BIN_HEADER_BYTES = BIN_HEADER_INTS * 4
# magic -> (version, token dtype, vocabulary of the tokenizer that wrote it)
BIN_FORMATS = {
    20240520: (1, np.dtype("<u2"), 50257),  # GPT-2 tokens
    20240801: (7, np.dtype("<u4"), 128256),  # Llama 3 tokens
}

# The default corpus: top-level stdlib modules, sorted by name, every VAL_EVERY-th file held out.
STDLIB_MAX_BYTES = 4 << 20
VAL_EVERY = 10

_SCAN_CHUNK = 1 << 26  # elements per chunk when scanning a memory map for its token range


class DataError(ValueError):
    """Bad data: a missing, unreadable or corrupt file, or tokens the model cannot take."""


class ByteTokenizer:
    """Text as its UTF-8 bytes: vocabulary 256, token id = byte value."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        """Ids above 255 (a larger model vocabulary) have no byte and are dropped."""
        ids = np.asarray(tokens, np.int64).ravel()
        return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, read with the `tokenizers` package."""

    name = "tokenizer.json"

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except BaseException as err:
            # The package raises a plain Exception on bad JSON; a Rust panic would surface as
            # pyo3's PanicException, which derives from BaseException.
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise DataError(f"{path}: not a readable tokenizer.json ({type(err).__name__}: {err})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in np.asarray(tokens).ravel()])


def load_tokenizer(model_dir: str | os.PathLike | None):
    """The tokenizer of a model directory: its tokenizer.json when present (an unreadable one is a
    DataError, never a silent fall-back), else `ByteTokenizer` (a model without one trains on bytes)."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            return HFTokenizer(path)
    return ByteTokenizer()


class TokenSource:
    """Windows of `T + 1` tokens from one or more 1-D token arrays (shards).

    Args:
        shards: 1-D integer arrays (NumPy arrays or memory maps); windows stay within one shard.
        name: what the tokens came from, for messages.
        seed: seeds the per-epoch window order.
        shuffle: False for evaluation: windows in file order, every epoch the same.
        vocab_size: the vocabulary of the writer of the tokens, when the format says (llm.c .bin),
            used to size a model when none is given; None otherwise.
    """

    def __init__(self, shards, name: str, seed: int = 0, shuffle: bool = True, vocab_size: int | None = None):
        for i, s in enumerate(shards):
            if getattr(s, "ndim", None) != 1 or s.dtype.kind not in "iu":
                got = f"{s.dtype} array of shape {s.shape}" if hasattr(s, "ndim") else type(s).__name__
                raise DataError(f"{name}: shard {i} must be a 1-D integer array of token ids, got {got}")
        self.shards = [s for s in shards if len(s) > 0]
        if not self.shards:
            raise DataError(f"{name}: no tokens")
        self.name = name
        self.seed = int(seed)
        self.shuffle = shuffle
        self.vocab_size = vocab_size
        self._range = None
        self._seq_len = None
        self._cached = (None, None)  # (epoch, window order of that epoch)
        self.epoch = 0
        self.cursor = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def token_range(self) -> tuple[int, int]:
        """(min, max) token id over all shards; scanned once in chunks (memory maps stay cheap)."""
        if self._range is None:
            lo, hi = None, None
            for s in self.shards:
                for i in range(0, len(s), _SCAN_CHUNK):
                    part = np.asarray(s[i : i + _SCAN_CHUNK])
                    a, b = int(part.min()), int(part.max())
                    lo = a if lo is None else min(lo, a)
                    hi = b if hi is None else max(hi, b)
            self._range = (lo, hi)
        return self._range

    def check_vocab(self, vocab_size: int, whose: str = "the model's") -> None:
        """Raise DataError unless every token id is in [0, vocab_size); `whose` names the vocabulary."""
        lo, hi = self.token_range()
        if lo < 0:
            raise DataError(f"{self.name}: token id {lo} is negative")
        if hi >= vocab_size:
            raise DataError(f"{self.name}: token id {hi} is >= {whose} vocab_size {vocab_size}")

    def num_windows(self, T: int) -> int:
        """How many windows of T+1 tokens (stride T) the shards hold."""
        return sum(max(len(s) - 1, 0) // T for s in self.shards)

    def check_seq_len(self, T: int) -> None:
        if self.num_windows(T) == 0:
            longest = max(len(s) for s in self.shards)
            raise DataError(
                f"{self.name}: {longest} tokens in its longest shard, fewer than one window of seq-len {T} + 1"
            )

    def _order(self, T: int, epoch: int) -> np.ndarray:
        n = self.num_windows(T)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def batch(self, B: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """The next B windows: (inputs, targets), int32 (B, T) each, targets = inputs shifted by one.

        NumPy equivalent for one row starting at token `o` of a shard `s`:
        `inputs = s[o : o + T]`, `targets = s[o + 1 : o + T + 1]`.
        A change of T starts a fresh window order at epoch 0.
        """
        if B < 1 or T < 1:
            raise ValueError(f"batch: B and T must be >= 1, got B={B}, T={T}")
        if T != self._seq_len:
            self.check_seq_len(T)
            self._seq_len, self.epoch, self.cursor, self._cached = T, 0, 0, (None, None)
        counts = np.array([max(len(s) - 1, 0) // T for s in self.shards], np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)])
        buf = np.empty((B, T + 1), np.int32)
        for b in range(B):
            if self._cached[0] != self.epoch:
                self._cached = (self.epoch, self._order(T, self.epoch))
            order = self._cached[1]
            w = int(order[self.cursor])
            k = int(np.searchsorted(starts, w, side="right")) - 1
            o = (w - int(starts[k])) * T
            buf[b] = self.shards[k][o : o + T + 1]
            self.cursor += 1
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        return np.ascontiguousarray(buf[:, :-1]), np.ascontiguousarray(buf[:, 1:])

    def state(self) -> dict:
        """Where the source stands: JSON-serialisable, for a checkpoint's `extra`."""
        return {"seed": self.seed, "seq_len": self._seq_len, "epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        """Continue from a `state()`: the following batches are those the saved source would give."""
        self.seed = int(state["seed"])
        T = state["seq_len"]
        self._seq_len, self._cached = None, (None, None)
        if T is not None:
            T = int(T)
            self.check_seq_len(T)
            if not 0 <= int(state["cursor"]) < self.num_windows(T):
                raise DataError(f"{self.name}: saved cursor {state['cursor']} is outside the data")
            self._seq_len = T
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def reset(self) -> None:
        """Back to the first batch (evaluation reads the same batches every time)."""
        self.epoch, self.cursor = 0, 0

    def split(self, val_fraction: float) -> tuple[TokenSource, TokenSource]:
        """(train, val): val is the last `val_fraction` of the last shard, in file order."""
        if not 0 < val_fraction < 1:
            raise ValueError(f"split: val_fraction must be in (0, 1), got {val_fraction}")
        last = self.shards[-1]
        cut = len(last) - max(int(len(last) * val_fraction), 2)
        if cut < 2:
            raise DataError(f"{self.name}: {len(last)} tokens are too few to hold out a validation split")
        train = TokenSource(self.shards[:-1] + [last[:cut]], self.name, self.seed, self.shuffle, self.vocab_size)
        val = TokenSource([last[cut:]], f"{self.name} (held out)", self.seed, False, self.vocab_size)
        return train, val


# ---- readers ------------------------------------------------------------------------------------
def _check_file(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    if not p.is_file():
        raise DataError(f"{p}: not a file")
    if not os.access(p, os.R_OK):
        raise DataError(f"{p}: not readable")
    return p


def read_text(path, tokenizer=None) -> np.ndarray:
    """Tokens of a text file: its bytes (vocab 256) or `tokenizer.encode` of its UTF-8 text.

    Returns int32 (N,) for a tokenizer; for bytes, the file memory-mapped as uint8 (N,) (widened
    to int32 per batch), so a large file costs no memory up front.
    """
    p = _check_file(path)
    if p.stat().st_size == 0:
        raise DataError(f"{p}: empty file")
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return np.memmap(p, dtype=np.uint8, mode="r")
    return tokenizer.encode(p.read_bytes().decode("utf-8", errors="replace"))


def read_npy(path) -> np.ndarray:
    """A 1-D integer array of token ids from a .npy file, memory-mapped."""
    p = _check_file(path)
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DataError(f"{p}: not a readable .npy file ({err})") from None
    if not isinstance(arr, np.ndarray):
        raise DataError(f"{p}: expected one array of token ids, found {type(arr).__name__}")
    if arr.dtype.kind not in "iu":
        raise DataError(f"{p}: token ids must be integers, found dtype {arr.dtype}")
    if arr.ndim != 1:
        raise DataError(f"{p}: token ids must be a 1-D array, found shape {arr.shape}")
    return arr


def read_bin(path) -> tuple[np.ndarray, int]:
    """Tokens of one llm.c shard, memory-mapped, and the writer's vocabulary size.

    Layout: 256 little-endian int32 (magic, version, token count, 0...), then the tokens:
    uint16 for magic 20240520 / version 1 (GPT-2), uint32 for 20240801 / version 7 (Llama 3).
    """
    p = _check_file(path)
    size = p.stat().st_size
    if size < BIN_HEADER_BYTES:
        raise DataError(f"{p}: {size} bytes, too short for the {BIN_HEADER_BYTES}-byte llm.c header")
    header = np.fromfile(p, dtype="<i4", count=BIN_HEADER_INTS)
    magic, version, count = (int(x) for x in header[:3])
    if magic not in BIN_FORMATS:
        known = ", ".join(str(m) for m in BIN_FORMATS)
        raise DataError(f"{p}: bad magic {magic} in the llm.c header (expected one of {known})")
    want_version, dtype, vocab = BIN_FORMATS[magic]
    if version != want_version:
        raise DataError(f"{p}: llm.c header version {version}, expected {want_version} for magic {magic}")
    if count <= 0 or size != BIN_HEADER_BYTES + count * dtype.itemsize:
        raise DataError(
            f"{p}: header says {count} tokens ({BIN_HEADER_BYTES + count * dtype.itemsize} bytes in all) "
            f"but the file has {size} bytes"
        )
    return np.memmap(p, dtype=dtype, mode="r", offset=BIN_HEADER_BYTES, shape=(count,)), vocab


def write_bin(path, tokens, magic: int = 20240520) -> None:
    """Write tokens as an llm.c shard (the inverse of `read_bin`), e.g. to make .bin data from
    a tokenizer's output."""
    version, dtype, _ = BIN_FORMATS[magic]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise DataError(f"{path}: token ids do not fit {dtype}")
    header = np.zeros(BIN_HEADER_INTS, "<i4")
    header[:3] = magic, version, tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())


def expand_paths(specs) -> list[str]:
    """Files named by `specs` (paths or glob patterns), each pattern's matches sorted."""
    out = []
    for spec in [specs] if isinstance(specs, (str, os.PathLike)) else specs:
        spec = str(spec)
        if glob.has_magic(spec):
            found = sorted(glob.glob(spec))
            if not found:
                raise DataError(f"{spec}: no files match")
            out += found
        else:
            out.append(spec)
    if not out:
        raise DataError("no data files given")
    return out


def open_source(specs, tokenizer=None, seed: int = 0, shuffle: bool = True) -> TokenSource:
    """A TokenSource for data files, chosen by extension: `.bin` (llm.c shards, several allowed),
    `.npy` (token ids), anything else is text (through `tokenizer`, or bytes)."""
    paths = expand_paths(specs)
    kinds = {Path(p).suffix.lower() if Path(p).suffix.lower() in (".bin", ".npy") else "text" for p in paths}
    if len(kinds) > 1:
        raise DataError(f"data files mix formats ({', '.join(sorted(kinds))}); give one kind at a time")
    kind = kinds.pop()
    name = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more)"
    vocab = None
    if kind == ".bin":
        shards = []
        for p in paths:
            tokens, v = read_bin(p)
            if vocab is not None and v != vocab:
                raise DataError(f"{p}: llm.c shard of another tokenizer than {paths[0]}")
            shards.append(tokens)
            vocab = v
    elif kind == ".npy":
        shards = [read_npy(p) for p in paths]
    else:
        shards = [read_text(p, tokenizer) for p in paths]
        vocab = 256 if tokenizer is None or isinstance(tokenizer, ByteTokenizer) else None
    return TokenSource(shards, name, seed=seed, shuffle=shuffle, vocab_size=vocab)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, val) source files of the default corpus: the top-level modules of this Python's
    standard library, sorted by name, up to STDLIB_MAX_BYTES; every VAL_EVERY-th is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise DataError(f"{root}: no standard-library sources found for the default corpus")
    chosen, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > STDLIB_MAX_BYTES:
            break
        chosen.append(f)
        total += size
    train = [f for i, f in enumerate(chosen) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [f for i, f in enumerate(chosen) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val


def stdlib_tokens(files) -> np.ndarray:
    """The bytes of `files` (from stdlib_files) one after another, as uint8 token ids (vocabulary 256):
    the default corpus as `cuengine train` reads it, and the skewed ids kernel tests and benchmarks use."""
    return np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)


def stdlib_sources(seed: int = 0) -> tuple[TokenSource, TokenSource]:
    """(train, val) byte-level sources over `stdlib_files()`: real text every Python install has,
    so `cuengine train` needs no download. Vocabulary 256."""
    train, val = stdlib_files()
    return (
        TokenSource([stdlib_tokens(train)], f"stdlib corpus ({len(train)} files)", seed=seed, vocab_size=256),
        TokenSource([stdlib_tokens(val)], f"stdlib corpus, held out ({len(val)} files)", seed, False, vocab_size=256),
    )
