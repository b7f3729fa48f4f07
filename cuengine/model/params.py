"""The weights-and-state surface of LlamaModel: init, import/export, parameter and gradient views,
checkpoints. A mixin so that llama.py keeps to the step itself; it reads the model's `weights`,
`grads`, `opt_state`, `comm`, `_dp` and `_inference`, and calls its `_need_rs`."""

from __future__ import annotations

from pathlib import Path

from . import checkpoint
from .weights import hf_views


class ParametersMixin:
    # ---- weights -----------------------------------------------------------------------------
    def init_weights(self, seed: int = 42) -> None:
        """Seeded random init (see `ModelWeights.init`); resets the optimizer state and step."""
        self._gather_due = False  # every rank writes whole weights
        self.weights.init(seed)
        self._reset_optimizer()

    def import_weights(self, path, allow_cast: bool = False) -> None:
        """Load HF safetensors (file, directory or sharded index); see `ModelWeights.load_hf`."""
        self.weights.load_hf(path, allow_cast=allow_cast)
        self._gather_due = False
        self._reset_optimizer()

    def export_weights(self, out_dir) -> None:
        """Write `model.safetensors` + `config.json` that HF transformers loads unchanged."""
        self._need_weights("export_weights")
        self._need_whole_weights("export_weights")
        self.device.synchronize()
        self.weights.save_hf(out_dir)

    def num_parameters(self) -> int:
        return self.weights.num_parameters()

    def flops_per_token(self, T: int) -> float:
        """Training FLOPs per token at sequence length T: 6 per matmul parameter (forward 2,
        backward 4) plus causal attention, 6·L·(Hq·hs)·T (QKᵀ and PV, half the positions masked;
        Hq·hs is C except on Qwen3)."""
        cfg = self.cfg
        matmul_params = self.num_parameters()
        if not cfg.tied_embeddings:
            matmul_params -= cfg.vocab_size * cfg.hidden_size  # the embedding lookup is no matmul
        return 6.0 * matmul_params + 6.0 * cfg.num_layers * cfg.att_channels * T

    def _reset_optimizer(self) -> None:
        self.step = 0
        if self.opt_state is not None:
            self.opt_state.zero()
        if self._dp is not None:
            self._dp.zero()

    # ---- gradients and checkpoints -----------------------------------------------------------
    def gradients(self) -> dict:
        """{HF name: Tensor}: zero-copy views of the gradients (q/k/v and gate/up unpacked)."""
        self._need_rs("gradients")
        self._grads_written = True  # the script writes them (or reads what a backward wrote)
        return hf_views(self.cfg, self.grads)

    def parameters(self) -> dict:
        """{HF name: Tensor}: zero-copy, writable views of the master weights (q/k/v and gate/up
        unpacked into row views), so a script can write its own update with any tool that reads a
        Tensor (CuPy, DLPack, the kernel launchers, NumPy on the cpu device), then call
        `parameters_changed()` instead of `update`. With zero_stage >= 1, after an update, call
        `sync_weights()` on every rank first."""
        self._need_whole_weights("parameters")
        self.weights.assigned = True  # the script writes them (or reads what an init wrote)
        return hf_views(self.cfg, self.weights.tensors)

    def parameters_changed(self) -> None:
        """Refresh what derives from the weights after a write through `parameters()`: the FP8
        copies and their scales, and the inference engine's FP8 decode copies if it has any (they
        are requantized at every generation anyway). Captured CUDA graphs need nothing: a graph
        holds the buffers' addresses, not their contents, and the views share those buffers.
        Enqueued on the main stream after whatever wrote the weights there; a write from another
        stream or from the host must be finished before this call."""
        self._need_whole_weights("parameters_changed")
        self.weights.requantize()
        if self._inference is not None:
            self._inference.refresh_weights()

    def save_checkpoint(self, out_dir, extra: dict | None = None) -> None:
        """Weights, optimizer moments, RNG and step into `out_dir` (written to a temporary
        directory, then renamed). `extra` is any JSON-able dict, returned by load_checkpoint.

        With several ranks every rank calls it: sharded moments are gathered and rank 0 writes
        the checkpoint one process would write (so any number of ranks can load it), then all
        ranks wait for it."""
        self._need_rs("save_checkpoint")
        self._need_weights("save_checkpoint")
        # checked on every rank: rank 0 alone refusing would leave the others waiting in its barrier
        checkpoint.check_replaceable(Path(out_dir))
        self.sync_weights()
        if self.comm is None:
            checkpoint.save(self, out_dir, extra)
            return
        moments = self._dp.gather_moments() if self.opts.zero_stage > 0 else None
        if self.comm.rank == 0:
            checkpoint.save(self, out_dir, extra, moments=moments)
        self.comm.barrier()

    def load_checkpoint(self, path) -> dict:
        """Restore what save_checkpoint wrote; returns its `extra`. Checks everything first:
        a checkpoint of another shape raises ValueError and changes nothing."""
        self._need_rs("load_checkpoint")
        extra = checkpoint.load(self, path)
        self._gather_due = False  # every rank read the whole weights
        return extra
