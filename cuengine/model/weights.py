"""Model parameters: layout, seeded init, HF safetensors import/export and FP8 weight copies.

The engine packs HF's per-projection matrices so that one matmul does the work of several:
q/k/v stack into `qkv_w` ((Hq + 2 Hkv) * hs, C) (+ `qkv_b` on Qwen2) and gate/up stack into
`up_w` (2H, C) = [gate | up]; o_proj is `atto_w` (C, Hq * hs), and Qwen3's per-head q_norm and
k_norm are `q_norm_w` and `k_norm_w` (hs,). Every packed tensor is a row-stack, so each HF tensor
is a zero-copy row view of an engine tensor; `hf_layout` is the one table of that mapping, used by
import, export and `LlamaModel.gradients()`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..dtypes import BYTE, FP32
from ..dtypes import dtype as _dtype
from ..tensor import STATS_SLOTS, Tensor

MATMUL_WEIGHTS = ("qkv_w", "atto_w", "up_w", "down_w")  # the block matrices that get FP8 copies
_SAFETENSORS_DTYPE = {"BF16": "bf16", "F32": "fp32", "F16": "fp16"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints carry
_INIT_BLOCK = 1 << 22  # elements per independently seeded block of init_weights


def param_specs(cfg) -> list[tuple[str, tuple[int, ...], bool]]:
    """[(engine name, shape, decays)] in the engine's canonical order; `decays` marks the
    matrices that take weight decay (norm weights and biases do not)."""
    C, H, V, Q = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.qkv_channels
    A, hs = cfg.att_channels, cfg.head_size
    specs = [("wte", (V, C), True)]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        specs += [(p + "ln1_w", (C,), False), (p + "ln2_w", (C,), False), (p + "qkv_w", (Q, C), True)]
        if cfg.qkv_bias:
            specs.append((p + "qkv_b", (Q,), False))
        if cfg.qk_norm:
            specs += [(p + "q_norm_w", (hs,), False), (p + "k_norm_w", (hs,), False)]
        specs += [(p + "atto_w", (C, A), True), (p + "up_w", (2 * H, C), True), (p + "down_w", (C, H), True)]
    specs.append(("lnf_w", (C,), False))
    if not cfg.tied_embeddings:
        specs.append(("lm_head", (V, C), True))
    return specs


def hf_layout(cfg) -> dict[str, list[tuple[str, int, int]]]:
    """{engine name: [(HF name, first row, last row + 1)]}: where each HF tensor sits."""
    H, hs = cfg.intermediate_size, cfg.head_size
    q, kv = cfg.num_q_heads * hs, cfg.num_kv_heads * hs
    out = {"wte": [("model.embed_tokens.weight", 0, cfg.vocab_size)], "lnf_w": [("model.norm.weight", 0, 0)]}
    if not cfg.tied_embeddings:
        out["lm_head"] = [("lm_head.weight", 0, cfg.vocab_size)]
    for i in range(cfg.num_layers):
        e, h = f"layers.{i}.", f"model.layers.{i}."
        out[e + "ln1_w"] = [(h + "input_layernorm.weight", 0, 0)]
        out[e + "ln2_w"] = [(h + "post_attention_layernorm.weight", 0, 0)]
        for suffix, hsuf in (("qkv_w", "weight"), ("qkv_b", "bias")):
            if suffix == "qkv_b" and not cfg.qkv_bias:
                continue
            a = h + "self_attn."
            out[e + suffix] = [(a + f"q_proj.{hsuf}", 0, q), (a + f"k_proj.{hsuf}", q, q + kv),
                               (a + f"v_proj.{hsuf}", q + kv, q + 2 * kv)]  # fmt: skip
        if cfg.qk_norm:
            out[e + "q_norm_w"] = [(h + "self_attn.q_norm.weight", 0, 0)]
            out[e + "k_norm_w"] = [(h + "self_attn.k_norm.weight", 0, 0)]
        out[e + "atto_w"] = [(h + "self_attn.o_proj.weight", 0, 0)]
        out[e + "up_w"] = [(h + "mlp.gate_proj.weight", 0, H), (h + "mlp.up_proj.weight", H, 2 * H)]
        out[e + "down_w"] = [(h + "mlp.down_proj.weight", 0, 0)]
    return out


def hf_views(cfg, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """{HF name: zero-copy row view} of engine tensors (weights or gradients)."""
    views = {}
    for ename, parts in hf_layout(cfg).items():
        t = tensors[ename]
        for hname, a, b in parts:
            views[hname] = t if a == b == 0 else t.rows(a, b)
    return views


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    shapes = dict((n, s) for n, s, _ in param_specs(cfg))
    out = {}
    for ename, parts in hf_layout(cfg).items():
        for hname, a, b in parts:
            out[hname] = shapes[ename] if a == b == 0 else (b - a,) + shapes[ename][1:]
    return out


class ModelWeights:
    """The parameters of one model, allocated in the allocator's "Weights" context.

    Args:
        cfg: TransformerConfig.
        dtype: the model dtype ("bf16"/"fp32").
        alloc: the TensorAllocator.
        fp8: also keep E4M3 copies of the block matrices (with their scales) for FP8 matmuls, and
            their transposes (`fp8_tp`, sharing the stats slot) for the backward's TN-only dinp GEMM:
            made once per update from the same read of the weights, not once per backward matmul.
            Their stats slots are the rows of one table (`fp8_stats`), so one memset zeroes every
            abs-max before an update that records them (`zero_abs_max`, `requantize(abs_max_recorded=)`),
            and that requantize of every copy is one launch over a `QuantizeDualTable` (in `fp8_table_bytes`).
        layout: None, or a `cuengine.dist.ShardPlan`: then every parameter is a view of one flat
            buffer (`self.flat`) in the plan's layout, which ranks all-gather in place.
        fp8_head: with `fp8`, the LM head (`head_name`) gets copies too (TrainOptions.lmhead_fp8).
    """

    def __init__(self, cfg, dtype, alloc, fp8: bool = False, layout=None, fp8_head: bool = False):
        self.cfg = cfg
        self.dtype = _dtype(dtype)
        self.device = alloc.device
        self.specs = param_specs(cfg)
        self.tensors: dict[str, Tensor] = {}
        self.flat = None
        # False until init, load_hf, a checkpoint or a script (LlamaModel.parameters()) wrote every value: before
        # that the buffers hold whatever the allocator's memory held, and a step on them is garbage, not an error
        self.assigned = False
        with alloc.context("Weights"):
            if layout is not None:
                self.flat = alloc.allocate(self.dtype, "weights", (layout.total,)).fill_zero()
            for name, shape, _ in self.specs:
                if self.flat is None:
                    self.tensors[name] = alloc.allocate(self.dtype, name, shape)
                else:
                    s = layout.params[name]
                    self.tensors[name] = self.flat.rows(s.offset, s.offset + s.numel).reshape(shape)
                    self.tensors[name].name = name
        self._blocks = [{k[len(f"layers.{i}.") :]: v for k, v in self.tensors.items() if k.startswith(f"layers.{i}.")}
                        for i in range(cfg.num_layers)]  # fmt: skip
        self.fp8: dict[str, Tensor] = {}
        self.fp8_tp: dict[str, Tensor] = {}  # (C, OC) of each (OC, C) E4M3 copy, with its stats
        self.fp8_stats = None  # (copies, STATS_SLOTS) fp32: row i is the stats slot of the i-th copy
        # the BYTE table of requantize(abs_max_recorded=True), sized here and written on first use (a host->device
        # copy, which LlamaModel's first, eager update makes before any graph capture), then that fp8.QuantizeDualTable
        self.fp8_table_bytes, self._fp8_table = None, None
        if fp8:
            from ..kernels.fp8 import quantize_dual_table_shape

            quant = [(name, shape) for name, shape, _ in self.specs
                     if name.rsplit(".", 1)[-1] in MATMUL_WEIGHTS or (fp8_head and name == self.head_name)]  # fmt: skip
            with alloc.context("Weights FP8"):
                self.fp8_stats = alloc.allocate(FP32, "fp8_stats", (len(quant), STATS_SLOTS)).fill_zero()
                for i, (name, shape) in enumerate(quant):
                    q = alloc.allocate("e4m3", name + ".q", shape, stats=False).with_stats(self.fp8_stats[i])
                    tp = alloc.allocate("e4m3", name + ".qT", shape[::-1], stats=False)
                    self.fp8[name], self.fp8_tp[name] = q, tp.with_stats(q.stats)
                table_shape = quantize_dual_table_shape([shape for _, shape in quant])
                self.fp8_table_bytes = alloc.allocate(BYTE, "fp8_requantize_table", table_shape)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def block(self, i: int) -> dict[str, Tensor]:
        """{"ln1_w": ..., "qkv_w": ..., ...}: the tensors of layer i under their short names."""
        return self._blocks[i]

    @property
    def head_name(self) -> str:
        return "wte" if self.cfg.tied_embeddings else "lm_head"

    @property
    def lm_head(self) -> Tensor:
        return self.tensors[self.head_name]

    def num_parameters(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.specs)

    # ---- init --------------------------------------------------------------------------------
    def init(self, seed: int) -> None:
        """LLMQ's random_init: N(0, 0.02) for matrices, with the output projections (o_proj,
        down_proj) scaled by 1/sqrt(2 L) so the residual stream's variance does not grow with
        depth; norm weights (QK-norm's too) 1, biases 0.

        Every block of rows draws from its own generator seeded by (seed, tensor, block), so the
        same seed gives the same weights on every device and for any number of threads, and a
        thread pool can fill a 1.5B model in seconds.
        """
        scale_out = 1.0 / math.sqrt(2 * self.cfg.num_layers)
        host, tasks = {}, []
        for idx, (name, shape, _) in enumerate(self.specs):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("ln1_w", "ln2_w", "lnf_w", "q_norm_w", "k_norm_w", "qkv_b"):
                host[name] = np.full(shape, 0.0 if leaf == "qkv_b" else 1.0, self.dtype.np)
                continue
            host[name] = np.empty(shape, self.dtype.np)
            std = np.float32(0.02 * (scale_out if leaf in ("atto_w", "down_w") else 1.0))
            rows = max(1, _INIT_BLOCK // math.prod(shape[1:]))
            tasks += [(name, idx, b, rows, std) for b in range(-(-shape[0] // rows))]

        def fill(task):
            name, idx, b, rows, std = task
            out = host[name][b * rows : (b + 1) * rows]
            x = np.random.default_rng([seed, idx, b]).standard_normal(out.shape, dtype=np.float32)
            x *= std
            out[...] = x

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            list(pool.map(fill, tasks))
        for name, arr in host.items():
            self.tensors[name].copy_from_numpy(arr)
        self.requantize()
        self.assigned = True

    # ---- FP8 copies --------------------------------------------------------------------------
    @property
    def abs_max_slots(self) -> dict[str, Tensor]:
        """{name: (1,) abs-max slot of its E4M3 copy} for every weight with copies (empty without fp8)."""
        return {name: q.abs_max for name, q in self.fp8.items()}

    def zero_abs_max(self, stream=None) -> None:
        """Zero every copy's stats slot (one memset), for an update that records the new weights'
        abs-maxes in `abs_max_slots` (AdamWState.update(abs_max=)); `requantize(abs_max_recorded=True)`
        then writes the scales and values from them."""
        if self.fp8_stats is not None:
            self.fp8_stats.fill_zero(stream)

    def requantize(self, names=None, stream=None, abs_max_recorded: bool = False) -> None:
        """Refresh the E4M3 copies and their transposes (abs-max, scales, values) from the master
        weights (of `names` only, when given: those with copies); runs after every update, in
        stream order, without a host sync. `abs_max_recorded`: every slot of `abs_max_slots` already
        holds max|w| of the current weights (the update wrote it after `zero_abs_max`), so only the
        quantize pass runs (no memset and no abs-max pass): for every copy (names None) one
        `quantize_dual_multi` launch, the bits of one `quantize_dual` per copy, whose table the first
        such call writes (a host->device copy: make it outside any graph capture); for `names`, one
        `quantize_dual` per copy."""
        if not self.fp8:
            return
        from ..kernels import fp8

        if names is None and abs_max_recorded:
            if self._fp8_table is None:
                copies = list(self.fp8)
                self._fp8_table = fp8.QuantizeDualTable(
                    self.fp8_table_bytes, [self.fp8[n] for n in copies], [self.fp8_tp[n] for n in copies],
                    [self.tensors[n] for n in copies],
                )  # fmt: skip
            fp8.quantize_dual_multi(self._fp8_table, stream=stream)
            return
        for name in self.fp8 if names is None else names:
            q = self.fp8[name]
            if not abs_max_recorded:
                q.abs_max.fill_zero(stream)
                fp8.abs_max(q.abs_max, self.tensors[name], stream=stream)
            fp8.quantize_dual(q, self.fp8_tp[name], self.tensors[name], q.abs_max, stream=stream)

    # ---- HF safetensors ----------------------------------------------------------------------
    def load_hf(self, path, allow_cast: bool = False) -> None:
        """Import HF weights from a .safetensors file, a directory holding `model.safetensors`
        or a sharded `model.safetensors.index.json`.

        Everything is read and checked before any engine tensor is written, so a bad file
        (unreadable or corrupt, missing, extra or misshapen tensors, or another dtype without
        `allow_cast`) raises ValueError naming the file and leaves the weights as they were.
        A tied model accepts an `lm_head.weight` (many HF checkpoints carry one) only when it
        equals `model.embed_tokens.weight`.
        """
        files = _safetensors_files(Path(path))
        want = hf_shapes(self.cfg)
        tied_head = "lm_head.weight" if self.cfg.tied_embeddings else None
        found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for f in files:
            for key, (shape, dt) in _read_header(f).items():
                if key in found:
                    raise ValueError(f"{f}: tensor {key!r} is also in {found[key][0]}")
                found[key] = (f, shape, dt)
        extra = sorted(k for k in found if k not in want and k != tied_head and not k.endswith(_IGNORED_SUFFIXES))
        if extra:
            raise ValueError(f"{path}: unexpected tensors not in a {self.cfg.architecture} of this config: {extra[:8]}"
                             + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))  # fmt: skip
        missing = sorted(k for k in want if k not in found)
        if missing:
            raise ValueError(f"{path}: missing tensors: {missing[:8]}" + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""))  # fmt: skip
        read = dict(want)
        if tied_head in found:
            read[tied_head] = want["model.embed_tokens.weight"]
        for k, shape in read.items():
            f, got, dt = found[k]
            if got != shape:
                raise ValueError(f"{f}: tensor {k!r} has shape {got}, expected {shape}")
            engine_dt = _SAFETENSORS_DTYPE.get(dt)
            if engine_dt is None:
                raise ValueError(f"{f}: tensor {k!r} has dtype {dt}, which cuengine cannot read")
            if engine_dt != self.dtype.name and not allow_cast:
                raise ValueError(
                    f"{f}: tensor {k!r} is {engine_dt} but the model is {self.dtype.name}; "
                    "pass allow_cast=True to convert"
                )
        host: dict[str, np.ndarray] = {}
        by_file: dict[Path, list[str]] = {}
        for k in read:
            by_file.setdefault(found[k][0], []).append(k)
        for f, keys in by_file.items():
            host.update(_read_tensors(f, keys))
        if tied_head in host:
            head, emb = (host[k].astype(self.dtype.np) for k in (tied_head, "model.embed_tokens.weight"))
            if not np.array_equal(head.view(np.uint8), emb.view(np.uint8)):
                raise ValueError(
                    f"{found[tied_head][0]}: the config ties the LM head to the embedding (tie_word_embeddings) "
                    "but lm_head.weight differs from model.embed_tokens.weight; set tie_word_embeddings to "
                    "false in config.json to import it as an untied model"
                )
        packed = {}
        for ename, parts in hf_layout(self.cfg).items():
            arrs = [host[h] for h, _, _ in parts]
            arr = arrs[0] if len(arrs) == 1 else np.concatenate(arrs, axis=0)
            packed[ename] = arr.astype(self.dtype.np) if arr.dtype != self.dtype.np else arr
        for ename, arr in packed.items():
            self.tensors[ename].copy_from_numpy(arr)
        self.requantize()
        self.assigned = True

    def host_arrays(self) -> dict[str, np.ndarray]:
        """{HF name: host array in the model dtype}, unpacked."""
        out = {}
        for ename, parts in hf_layout(self.cfg).items():
            arr = self.tensors[ename].numpy()
            for hname, a, b in parts:
                out[hname] = arr if a == b == 0 else np.ascontiguousarray(arr[a:b])
        return out

    def save_hf(self, out_dir) -> None:
        """Write `model.safetensors` and `config.json` that HF transformers loads unchanged.
        Each file is written under a temporary name and renamed, so a crash leaves no torn file."""
        from safetensors.numpy import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg_dict = self.cfg.replace(dtype=self.dtype.name).to_hf_dict()
        atomic_write(out / "model.safetensors", lambda p: save_file(self.host_arrays(), p, metadata={"format": "pt"}))
        atomic_write(out / "config.json", lambda p: Path(p).write_text(json.dumps(cfg_dict, indent=2) + "\n"))


def atomic_write(target: Path, write) -> None:
    """Call `write(tmp_path)` and rename the result onto `target`, which gets the mode any new
    file gets under the user's umask (mkstemp alone would leave it 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def umask() -> int:
    """The process umask, read without changing it where Linux says it (/proc/self/status);
    elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The Rust readers of safetensors (and tokenizers) raise their own exception types, and a Rust
# panic surfaces as pyo3's PanicException, which derives from BaseException, not Exception.
def read_error(err: BaseException) -> bool:
    """True for what a reader may raise on a corrupt file; False for interrupts and exits."""
    return not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))


def _read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of a safetensors file, or ValueError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="np") as sf:
            return {k: (tuple(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype()) for k in sf.keys()}
    except BaseException as err:
        if not read_error(err):
            raise
        raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def _read_tensors(file: Path, keys) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="np") as sf:
            return {k: sf.get_tensor(k) for k in keys}
    except BaseException as err:
        if not read_error(err):
            raise
        raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: {err})") from None


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.name.endswith(".index.json"):
            try:
                index = json.loads(path.read_bytes())
            except (OSError, ValueError) as err:  # ValueError covers bad JSON and bad UTF-8
                raise ValueError(f"{path}: not a readable safetensors index ({err})") from None
            wmap = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wmap, dict) or not wmap or not all(isinstance(f, str) for f in wmap.values()):
                raise ValueError(f"{path}: a safetensors index needs a non-empty weight_map of tensor -> file name")
            files = sorted({path.parent / f for f in wmap.values()})
            for f in files:
                if f.parent != path.parent or not f.is_file():
                    raise ValueError(f"{path}: weight_map names {f.name!r}, which is not a file beside the index")
            return files
        return [path]
    if path.is_dir():
        if (path / "model.safetensors").is_file():
            return [path / "model.safetensors"]
        if (path / "model.safetensors.index.json").is_file():
            return _safetensors_files(path / "model.safetensors.index.json")
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json is there")
    raise FileNotFoundError(f"no safetensors file or directory at {path}")
