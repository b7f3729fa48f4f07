"""Decode benchmarks: per-token time against the weight-bandwidth bound, batch throughput,
prefill, and HF transformers (static cache + torch.compile) as the peer, all in one run.

Sections (`--section`, any of them; default all):
- arms:  GB/s of the decode-GEMV kernels (gemv bf16 and FP8, gemv_dual plain and with its SwiGLU
         epilogue, gemv with the fused SwiGLU input) and of the cuBLASLt M = b matmul on the same shapes,
         and of the whole FFN per arm (split, fused, fused_up, gemm), at hidden 896 / intermediate 4864
         (plus the 896 -> 151936 LM head) and 4096 / 14336, for `--arm-batches` (default 1 and 8),
         beside the copy ceiling. Bytes are the algorithmic minimum (weights + scales + x + out, each
         once). Weights rotate through copies
         totalling >= 256 MB so that the 50 MB L2 cannot serve them; 32+ launches are replayed from one
         CUDA graph, as the decode step runs them (cuengine.benchmark.time_ms on the graph, median of
         `--samples`). `--sweep-split` adds every K split of each gemv. `--l2-hot` keeps two copies
         only, which the L2 holds at the 0.5B shapes: a kernel whose time does not change is not
         bound by its weight bytes (BENCHMARKS fourteenth session, call 3).
- token: ms per token at batch 1 for the 0.5B and 1.5B shapes with bf16 and FP8 decode weights,
         beside the bound = weight bytes read per token / device-to-device copy bandwidth, the
         copy measured here (known on an H200: 4.27 TB/s); and the kernel launches of one step.
- batch: tokens/s of decode at batch 1, 8, 32 and 64, and prefill tokens/s of a 1024-token prompt.
- peer:  HF transformers `generate` with a static cache and torch.compile, same shapes, bf16
         (skipped when torch or transformers is missing).
Timing: the decode step is a replayed CUDA graph; CUDA events around `--steps` steps after a
warm-up (which also captures the graph); median of `--samples` runs, per step.

    python tools/bench_decode.py --section token batch peer
    python tools/bench_decode.py --section arms --sweep-split
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import fill, tensor  # noqa: E402

import cuengine as ce  # noqa: E402
from cuengine.benchmark import time_ms  # noqa: E402
from cuengine.inference import choose_ffn_arm, decode  # noqa: E402
from cuengine.kernels import decode_attention, decode_attention_o, decode_layers, decode_mlp, sampling  # noqa: E402

PRESETS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
MLP_DEFAULTS = {"EARLY_STAGES": decode_mlp.EARLY_STAGES, "SMEM_BUDGET": decode_mlp.SMEM_BUDGET}
PROMPT = 16  # prompt tokens before timed decode steps (--prompt)
TARGET_BOUND = 1.5  # batch-1 bf16 per-token time target: 1.5 x the bound (0.5B)


# ---- shared ---------------------------------------------------------------------------------
def copy_bandwidth(dev) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), timed like the kernels."""
    src, dst = (ce.Tensor.empty(ce.BYTE, (1 << 30,), dev) for _ in range(2))
    return 2 * src.nbytes / (time_ms(dev, lambda: dev.copy_async(dst, src), warmup=3, iters=10) / 1e3)


def engine(preset: str, max_batch: int, max_seq: int, weights: str):
    cfg = ce.TransformerConfig.preset(preset)
    m = ce.LlamaModel(cfg, device="cuda")
    m.init_weights(0)
    st = m.allocate_inference_state(max_batch=max_batch, max_seq_len=max_seq, weights=weights)
    return m, st


def prompts(cfg, b: int, T: int, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, T)).tolist()


def warm_up(st, b: int, prompt: int, arm: str, seed: int = 0) -> None:
    """Fresh greedy prompts of `prompt` tokens for b rows, prefilled, then the three decode steps that run
    eagerly, capture the graph and replay it once: what follows replays the captured step."""
    st.start(prompts(st.cfg, b, prompt, seed=seed), sampling.sampling_params(0.0, 0, 1.0, 0))
    st.prefill()
    for _ in range(3):
        decode.step(st, b, arm)


def step_ms(st, b: int, steps: int, samples: int, prompt: int = PROMPT, arm: str | None = None) -> float:
    """Median ms per decode step of b rows (graph replay), from fresh prompts of `prompt` tokens."""
    dev, arm = st.device, arm or decode_arm(st, b)
    times = []
    for s in range(samples + 1):
        warm_up(st, b, prompt, arm, seed=s)
        start, end = dev.event(timing=True), dev.event(timing=True)
        start.record()
        for _ in range(steps):
            decode.step(st, b, arm)
        end.record()
        end.synchronize()
        if s:  # the first sample compiles and captures
            times.append(start.elapsed_ms(end) / steps)
    return statistics.median(times)


def decode_arm(st, b: int) -> str:
    return choose_ffn_arm(b, st.weights) if st.ffn_arm == "auto" else st.ffn_arm


def launches(st, fn) -> int:
    """Kernel launches (cuBLASLt calls included) that fn() makes, run eagerly."""
    from cuengine import blas
    from cuengine.kernels import _build, activations, decode_step, encoder, gemv, rmsnorm

    # _build.launch itself for the persistent arm, which calls it through the module
    modules = (_build, activations, decode_attention, decode_attention_o, decode_mlp, decode_step, encoder, gemv,
               rmsnorm, sampling)  # fmt: skip
    patched = [(m, "launch") for m in modules]
    patched.append((blas, "matmul"))
    saved = [getattr(m, name) for m, name in patched]
    count = [0]

    def counting(launcher):
        def wrapped(*a, **k):
            count[0] += 1
            return launcher(*a, **k)

        return wrapped

    for (m, name), launcher in zip(patched, saved):
        setattr(m, name, counting(launcher))
    try:
        fn()
    finally:
        for (m, name), launcher in zip(patched, saved):
            setattr(m, name, launcher)
    st.device.synchronize()
    return count[0]


# ---- sections -------------------------------------------------------------------------------
def arm_runs(args) -> list[tuple[str, str, dict]]:
    """(arm, label, decode_mlp settings) to time: the ksplit arm once per `--early-stages` x `--mlp-smem-kb`
    value given (both are baked into the captured step)."""
    runs = []
    for arm in args.arms:
        early = args.early_stages if arm == "ksplit" and args.early_stages else [None]
        kb = args.mlp_smem_kb if arm == "ksplit" and args.mlp_smem_kb else [None]
        for e in early:
            for k in kb:
                knobs = {"EARLY_STAGES": e, "SMEM_BUDGET": None if k is None else k << 10}
                label = arm + (f"/e{e}" if e is not None else "") + (f"/{k}k" if k is not None else "")
                runs.append((arm, label, {n: v for n, v in knobs.items() if v is not None}))
    return runs


def token_section(args, dev, bw) -> list[str]:
    rows = [f"copy ceiling measured: {bw / 1e12:.2f} TB/s; prompt {args.prompt} tokens; weight ring stages of "
            f"{decode_layers.STAGE_BYTES >> 10} KB (persistent); attention blocks of up to "
            f"{decode_attention.SMALL_BATCH_TILE_HEADS} q heads", "",
            f"{'shape':<14}{'weights':>8}{'arm':>16}{'ms/token':>10}{'bound ms':>10}{'x bound':>9}{'GB/s':>8}"
            f"{'launches':>10}"]  # fmt: skip
    for preset in args.preset:
        for weights in ("bf16", "fp8"):
            m, st = engine(preset, 1, args.prompt + 8 * args.steps, weights)
            for arm, label, knobs in arm_runs(args):
                if knobs:  # baked into the captured step: capture it again
                    for name, value in {**MLP_DEFAULTS, **knobs}.items():
                        setattr(decode_mlp, name, value)
                    st.graphs.clear()
                    st.warm.clear()
                ms = step_ms(st, 1, args.steps, args.samples, args.prompt, arm)
                nbytes = st.bytes_per_token()
                bound = nbytes / bw * 1e3
                n = launches(st, lambda st=st, arm=arm: decode.decode_step_rows(st, 1, arm))
                rows.append(f"{preset:<14}{weights:>8}{label:>16}{ms:>10.3f}{bound:>10.3f}{ms / bound:>9.2f}"
                            f"{nbytes / ms / 1e6:>8.0f}{n:>10}")  # fmt: skip
            for name, value in MLP_DEFAULTS.items():  # the next engine starts from the shipped settings
                setattr(decode_mlp, name, value)
            del m, st
    rows.append(f"target: 0.5B bf16 <= {TARGET_BOUND} x bound; fp8 <= 0.6 x the bf16 time")
    return rows


def batch_section(args, dev, bw) -> list[str]:
    rows = [
        f"prompt {args.prompt} tokens",
        f"{'shape':<14}{'weights':>8}{'batch':>7}{'arm':>7}{'ms/step':>9}{'tok/s':>10}",
    ]
    for preset in args.preset:
        m, st = engine(preset, max(args.batches), max(1024 + 8, args.prompt + 8 * args.steps), "bf16")
        for b in args.batches:
            ms = step_ms(st, b, args.steps, args.samples, args.prompt)
            rows.append(f"{preset:<14}{'bf16':>8}{b:>7}{decode_arm(st, b):>7}{ms:>9.3f}{b / ms * 1e3:>10.0f}")
        p = prompts(m.cfg, 1, 1024)
        params = sampling.sampling_params(0.0, 0, 1.0, 0)

        def prefill_ms(graphs: bool, st=st, p=p, params=params) -> float:
            """Median of `--samples` prefills after two (with graphs: the eager one, then the capture)."""
            st.cuda_graphs, times = graphs, []
            for _ in range(args.samples + 2):
                st.start(p, params)
                start, end = dev.event(timing=True), dev.event(timing=True)
                start.record()
                st.prefill()
                end.record()
                end.synchronize()
                times.append(start.elapsed_ms(end))
            return statistics.median(times[2:])

        eager, ms = prefill_ms(False), prefill_ms(True)
        rows.append(f"{preset:<14}{'bf16':>8}  prefill 1024 tokens: {ms:.2f} ms from its graph, "
                    f"{1024 / ms * 1e3:,.0f} tok/s; eager (a new prompt layout): {eager:.2f} ms")  # fmt: skip
        del m, st
    return rows


def peer_section(args, dev, bw):
    """The peer in a child process of its own per mode (`--peer-child MODE`): torch.compile's CUDA
    graphs there never meet this process's CuPy state, and a crash of one mode (the H200 runs saw a
    segfault after compiling) ends that mode's rows, not the benchmark. Rows are yielded as the child
    prints them, so a run cut short by a timeout keeps what was measured."""
    for mode in PEER_MODES:
        cmd = [sys.executable, __file__, "--peer-child", mode, "--preset", *args.preset, "--prompt",
               str(args.prompt), "--steps", str(args.steps), "--samples", str(args.samples)]  # fmt: skip
        with tempfile.TemporaryFile("w+") as log:  # stderr (compile warnings) to a file: a pipe could fill
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
            for line in child.stdout:
                if line.strip():
                    yield line.rstrip()
            child.wait()
            log.seek(0)
            err = log.read()
        if child.returncode:
            rc = child.returncode
            why = f"signal {-rc}" if rc < 0 else f"exit {rc}"
            tail = [line for line in err.splitlines() if line.strip() and not line.startswith("W")][-2:]
            yield f"peer ({mode}): the child process ended with {why}" + (": " + " | ".join(tail) if tail else "")


# The peer's modes. "generate": transformers' own compilation of the static-cache decode step
# (generate compiles it with torch.compile and CUDA graphs when the cache is static: transformers 5.x in
# the GPU image), the "static cache + torch.compile" peer; "eager": static cache, that compilation
# turned off. (torch.compile wrapped around model.forward by hand, as older HF docs did, compiles on top
# of generate's own: it segfaulted in two H200 runs and ran past 150 s in a third, so it is not a mode.)
PEER_MODES = ("generate", "eager")


def peer_rows(args) -> None:
    """HF transformers generate with a static cache in `args.peer_child` mode (PEER_MODES), run by
    `--peer-child MODE`; prints each row as it is measured, so a later crash keeps the earlier rows."""
    try:
        import torch
        import transformers
    except ImportError:
        print("peer: torch/transformers not importable; skipped")
        return
    print(f"{'shape':<14}{'peer':<36}{'batch':>6}{'ms/token':>10}{'tok/s':>10}", flush=True)
    for preset in args.preset:
        cfg = ce.TransformerConfig.preset(preset)
        hf_cfg = transformers.Qwen2Config(
            **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
        )
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(hf_cfg).to(device="cuda", dtype=torch.bfloat16).eval()
        model.generation_config.cache_implementation = "static"
        mode = args.peer_child
        if mode == "eager":
            model.generation_config.disable_compile = True
        label = {"generate": "HF static cache, generate compiles", "eager": "HF static cache, eager"}[mode]
        for b in (1, 8):
            x = torch.from_numpy(np.array(prompts(cfg, b, args.prompt), np.int64)).cuda()

            def gen(n, x=x, model=model):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            short, long = 16, 16 + args.steps
            for _ in range(3):  # compile, capture the cudagraphs
                gen(long)
            # the difference of two lengths takes prefill and setup out
            ms = statistics.median((gen(long) - gen(short)) / args.steps * 1e3 for _ in range(args.samples))
            print(f"{preset:<14}{label:<36}{b:>6}{ms:>10.3f}{b / ms * 1e3:>10.0f}",
                  flush=True)  # fmt: skip
        del model
        torch.cuda.empty_cache()


ARM_SHAPES = (("0.5B", 896, 4864), ("7B", 4096, 14336))  # (name, hidden, intermediate)
LM_HEAD = (896, 151936)  # Qwen2.5-0.5B: hidden -> vocabulary, fp32 logits
ROTATE_BYTES = 256e6  # weight copies per case total at least this: five times the H200's L2
GRAPH_LAUNCHES = 32  # launches per replayed graph (a multiple of the number of copies)


def graph_us(dev, launch, copies: int, samples: int) -> float:
    """Median µs per launch of `launch(i)`, i cycling through the weight copies, replayed from a CUDA
    graph (launched eagerly once per copy first: kernels compile, cuBLASLt plans and workspace exist)."""
    n = copies * -(-GRAPH_LAUNCHES // copies)
    for i in range(copies):
        launch(i)
    dev.synchronize()
    graph = dev.capture(lambda: [launch(i % copies) for i in range(n)])
    return time_ms(dev, graph.launch, warmup=3, iters=samples) / n * 1e3


class Weights:
    """`copies` device copies of one (N, K) weight, bf16 or per-row E4M3 with its row scales."""

    def __init__(self, dev, N: int, K: int, fp8: bool, rotate: float = ROTATE_BYTES, seed: int = 0):
        from cuengine.kernels import gemv

        src = tensor(dev, ce.BF16, (N, K), 1 / np.sqrt(K), seed, name="w")
        self.nbytes = N * K * (1 if fp8 else 2) + (4 * N if fp8 else 0)
        self.copies = max(2, int(-(-rotate // self.nbytes)))
        self.w, self.scale = [], []
        for i in range(self.copies):
            if fp8:
                self.w.append(ce.Tensor.empty(ce.FP8_E4M3, (N, K), dev, name=f"w8.{i}"))
                self.scale.append(ce.Tensor.empty(ce.FP32, (N,), dev, name=f"w_scale.{i}"))
                gemv.quantize_rows(self.w[-1], self.scale[-1], src)
            else:
                self.w.append(ce.Tensor.empty(ce.BF16, (N, K), dev, name=f"w.{i}"))
                self.scale.append(None)
                dev.copy_async(self.w[-1], src)
        dev.synchronize()


def arm_cases(dev, b: int, sweep: bool, rotate: float = ROTATE_BYTES):
    """(label, weight dtype, bytes, copies, launch(i)) for each kernel and FFN arm at b rows."""
    from cuengine import blas
    from cuengine.kernels import activations, gemv

    def act(shape, seed=1):
        return tensor(dev, ce.BF16, shape, 1.0, seed, name="x")

    splits = (None, 1, 2, 4, 8) if sweep else (None,)
    gemv_shapes = [(f"{n} gemv {h}->{i}", h, i) for n, h, i in ARM_SHAPES]
    gemv_shapes += [(f"{n} gemv {i}->{h}", i, h) for n, h, i in ARM_SHAPES]
    gemv_shapes.insert(1, ("0.5B lm_head {}->{}".format(*LM_HEAD), *LM_HEAD))
    for label, K, N in gemv_shapes:
        x = act((b, K))
        logits = K == LM_HEAD[0] and N == LM_HEAD[1]
        out = ce.Tensor.empty(ce.FP32 if logits else ce.BF16, (b, N), dev, name="out")
        io = x.nbytes + out.nbytes
        for fp8 in (False, True):
            W = Weights(dev, N, K, fp8, rotate)
            for split in splits:
                tag = label + ("" if split is None else f" split={split}")
                fn = lambda i, W=W, x=x, out=out, split=split: gemv.gemv(  # noqa: E731
                    out, x, W.w[i], w_scale=W.scale[i], split=split
                )
                yield tag, "fp8" if fp8 else "bf16", W.nbytes + io, W.copies, fn
            if not fp8:
                mm = lambda i, W=W, x=x, out=out: blas.matmul(out, x, W.w[i])  # noqa: E731
                yield f"{label} (cuBLASLt M=b)", "bf16", W.nbytes + io, W.copies, mm
            del W
    for name, hidden, inter in ARM_SHAPES:
        x, h = act((b, hidden)), act((b, inter))
        up = ce.Tensor.empty(ce.BF16, (b, 2 * inter), dev, name="up")
        out = ce.Tensor.empty(ce.BF16, (b, hidden), dev, name="out")
        fill(up, 1.0, 2)
        for fp8 in (False, True):
            wd = "fp8" if fp8 else "bf16"
            Wup, Wdown = Weights(dev, 2 * inter, hidden, fp8, rotate), Weights(dev, hidden, inter, fp8, rotate)
            dual = lambda i, W=Wup, x=x, up=up: gemv.gemv_dual(up, x, W.w[i], w_scale=W.scale[i])  # noqa: E731
            yield f"{name} gemv_dual {hidden}->2x{inter}", wd, Wup.nbytes + x.nbytes + up.nbytes, Wup.copies, dual
            dual_act = lambda i, W=Wup, x=x, h=h: gemv.gemv_dual(  # noqa: E731
                h, x, W.w[i], w_scale=W.scale[i], act="swiglu"
            )
            yield (
                f"{name} gemv_dual swiglu {hidden}->{inter}",
                wd,
                Wup.nbytes + x.nbytes + h.nbytes,
                Wup.copies,
                dual_act,
            )
            silu = lambda i, W=Wdown, up=up, out=out: gemv.gemv(  # noqa: E731
                out, up, W.w[i], w_scale=W.scale[i], act="swiglu"
            )
            yield f"{name} gemv swiglu {inter}->{hidden}", wd, Wdown.nbytes + up.nbytes + out.nbytes, Wdown.copies, silu
            ffn = Wup.nbytes + Wdown.nbytes + x.nbytes + out.nbytes
            copies = max(Wup.copies, Wdown.copies)

            def split_arm(i, Wu=Wup, Wd=Wdown, x=x, up=up, h=h, out=out):
                gemv.gemv_dual(up, x, Wu.w[i % Wu.copies], w_scale=Wu.scale[i % Wu.copies])
                activations.swiglu_forward(h, up)
                gemv.gemv(out, h, Wd.w[i % Wd.copies], w_scale=Wd.scale[i % Wd.copies])

            def fused_arm(i, Wu=Wup, Wd=Wdown, x=x, up=up, out=out):
                gemv.gemv_dual(up, x, Wu.w[i % Wu.copies], w_scale=Wu.scale[i % Wu.copies])
                gemv.gemv(out, up, Wd.w[i % Wd.copies], w_scale=Wd.scale[i % Wd.copies], act="swiglu")

            def fused_up_arm(i, Wu=Wup, Wd=Wdown, x=x, h=h, out=out):
                gemv.gemv_dual(h, x, Wu.w[i % Wu.copies], w_scale=Wu.scale[i % Wu.copies], act="swiglu")
                gemv.gemv(out, h, Wd.w[i % Wd.copies], w_scale=Wd.scale[i % Wd.copies])

            yield f"{name} FFN arm split", wd, ffn, copies, split_arm
            yield f"{name} FFN arm fused", wd, ffn, copies, fused_arm
            yield f"{name} FFN arm fused_up", wd, ffn, copies, fused_up_arm
            if not fp8:

                def gemm_arm(i, Wu=Wup, Wd=Wdown, x=x, up=up, h=h, out=out):
                    blas.matmul(up, x, Wu.w[i % Wu.copies])
                    activations.swiglu_forward(h, up)
                    blas.matmul(out, h, Wd.w[i % Wd.copies])

                yield f"{name} FFN arm gemm", wd, ffn, copies, gemm_arm
            if b == 1 and not decode_mlp.unsupported(hidden, inter, ce.BF16, Wup.w[0].dtype):
                acc = ce.Tensor.empty(ce.INT64, gemv.acc_shape(1, hidden), dev, name="acc")
                dev.fill_zero(acc)
                norm = tensor(dev, ce.BF16, (hidden,), 1.0, 3, name="norm")

                def ksplit_arm(i, Wu=Wup, Wd=Wdown, x=x, acc=acc, norm=norm):
                    j, k = i % Wu.copies, i % Wd.copies
                    decode_mlp.decode_mlp(acc, x, norm, Wu.w[j], Wd.w[k], up_scale=Wu.scale[j], down_scale=Wd.scale[k])

                yield f"{name} FFN arm ksplit (decode_mlp, +norm)", wd, ffn, copies, ksplit_arm
            del Wup, Wdown


def arms_section(args, dev, bw):
    """Yields its table rows as they are measured (the section takes a minute or two)."""
    from cuengine import blas

    blas.init(ce.TensorAllocator(dev))
    yield f"copy ceiling measured: {bw / 1e12:.2f} TB/s (target: >= 80% on the gemv rows at b = 1)"
    yield f"{'case':<44}{'weights':>8}{'b':>4}{'MB':>9}{'copies':>7}{'us':>9}{'GB/s':>8}{'% copy':>8}"
    for b in args.arm_batches:
        for label, wd, nbytes, copies, fn in arm_cases(dev, b, args.sweep_split, 0 if args.l2_hot else ROTATE_BYTES):
            us = graph_us(dev, fn, copies, args.samples)
            gbs = nbytes / us / 1e3
            yield (f"{label:<44}{wd:>8}{b:>4}{nbytes / 1e6:>9.1f}{copies:>7}{us:>9.2f}{gbs:>8.0f}"
                   f"{100 * gbs * 1e9 / bw:>7.0f}%")  # fmt: skip
        yield ""


SECTIONS = {"arms": arms_section, "token": token_section, "batch": batch_section, "peer": peer_section}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--preset", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed sample")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument(
        "--prompt", type=int, default=PROMPT, help="prompt tokens before the timed steps (token, batch, peer)"
    )
    p.add_argument("--arm-batches", nargs="+", type=int, default=[1, 8], help="batch sizes of the arms section")
    p.add_argument("--sweep-split", action="store_true", help="arms: time every K split of each gemv")
    p.add_argument("--l2-hot", action="store_true", help="arms: two weight copies only (L2-resident where they fit)")
    p.add_argument(
        "--arms", nargs="+", default=["fused", "fused_up", "persistent"], help="token: the batch-1 arms to time"
    )
    p.add_argument("--stage-kb", type=int, help="token: the persistent arm's weight ring stage (KB)")
    p.add_argument("--early-stages", nargs="+", type=int,
                   help="token: time the ksplit arm with each of these decode_mlp.EARLY_STAGES")  # fmt: skip
    p.add_argument("--mlp-smem-kb", nargs="+", type=int,
                   help="token: time the ksplit arm with each of these decode_mlp.SMEM_BUDGET (KB)")  # fmt: skip
    p.add_argument("--tile-heads", type=int, choices=(1, 2, 4, 8),
                   help="q heads per decode attention block while a batch's blocks fit one wave")  # fmt: skip
    p.add_argument("--peer-child", choices=PEER_MODES, help=argparse.SUPPRESS)  # the peer section's process
    args = p.parse_args(argv)
    if args.stage_kb is not None:
        decode_layers.STAGE_BYTES = args.stage_kb << 10
    if args.tile_heads is not None:
        decode_attention.SMALL_BATCH_TILE_HEADS = args.tile_heads
    if args.peer_child:
        peer_rows(args)
        return 0
    if not ce.cuda_available():
        print("bench_decode: no CUDA device; nothing to measure")
        return 0
    dev = ce.device("cuda")
    bw = copy_bandwidth(dev)
    for name in args.section:
        print(f"\n== {name} ==")
        for line in SECTIONS[name](args, dev, bw):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
