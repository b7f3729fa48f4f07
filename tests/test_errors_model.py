"""Refusals no other test reached: the model's step API, the kernels' shape checks on the cpu device,
the command line, and the distributed layer (the base Communicator, the test double's transport,
the rendezvous and the ZeRO sharding's own checks). Each documented error is triggered here and its
message checked, so a check that goes missing, or whose message stops naming the culprit, shows."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import types

import numpy as np
import pytest
from conftest import run_cli, tiny

import cuengine as ce
from cuengine import _cli_util, dist
from cuengine.dist import fake, rendezvous
from cuengine.dist.zero import DataParallel
from cuengine.kernels import activations, decode_attention, decode_layers, muon, qknorm, rmsnorm, rope
from cuengine.model.weights import param_specs

B, T = 2, 16


def batch(cfg, b=B, t=T):
    g = np.random.default_rng(0)
    return tuple(g.integers(0, cfg.vocab_size, (b, t)).astype(np.int32) for _ in range(2))


def cpu_tensor(dtype, shape, name="t"):
    return ce.Tensor.empty(dtype, shape, "cpu", name=name)


# ---- the model's step API ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    """One allocated tiny model; every call below is refused before it changes anything."""
    m = ce.LlamaModel(tiny(), ce.TrainOptions(model_dtype="fp32"), device="cpu")
    m.init_weights(1)
    m.allocate_run_state(B, T)
    return m


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m, x, y: m.allocate_run_state(B, T), "the run state is already allocated; make a new LlamaModel"),
        (lambda m, x, y: m.backward(x, y, micro_step=1, grad_accum_steps=1),
         re.escape("backward: micro_step=1 outside [0, grad_accum_steps=1)")),
        (lambda m, x, y: m.update(float("nan")), "update: lr must be a finite number >= 0, got nan"),
        (lambda m, x, y: m.train_step(x, y, lr=-1.0), "train_step: lr must be a finite number >= 0, got -1.0"),
        (lambda m, x, y: m.finish_step("1e-3", 4), "finish_step: lr must be a finite number >= 0, got '1e-3'"),
        (lambda m, x, y: m.logits(np.zeros((B + 1, T), np.int32)),
         re.escape("logits: inputs must be (b, t) with b <= 2 and t <= 16, got (3, 16)")),
        (lambda m, x, y: m.logits(x.astype(np.int64)), "logits: expected an int32 NumPy array, got int64"),
    ],
    ids=["allocate-twice", "micro-step", "update-lr", "train-step-lr", "finish-step-lr", "logits-shape",
         "logits-dtype"],
)  # fmt: skip
def test_step_api_refusals(model, call, message):
    x, y = batch(model.cfg)
    with pytest.raises(ValueError, match=message):
        call(model, x, y)


@pytest.mark.parametrize("call", ["update", "finish_step"])
def test_an_update_before_any_backward_is_refused(call):
    """The gradient buffer holds the allocator's old bytes until a backward (or a script through gradients())
    writes it: an update from it would write garbage into the weights."""
    m = ce.LlamaModel(tiny(), ce.TrainOptions(model_dtype="fp32"), device="cpu")
    m.init_weights(1)
    m.allocate_run_state(B, T)
    before = {k: v.numpy().copy() for k, v in m.weights.tensors.items()}
    with pytest.raises(ValueError, match=f"{call}: no gradients yet; run backward first"):
        getattr(m, call)(1e-3) if call == "update" else m.finish_step(1e-3, B * T)
    assert all(np.array_equal(v.numpy(), before[k]) for k, v in m.weights.tensors.items())
    for g in m.gradients().values():  # a script's gradients
        g.copy_from_numpy(np.zeros(g.shape, np.float32))
    m.update(1e-3)
    assert m.step == 1


@pytest.mark.parametrize(
    "b,t,opts,message",
    [
        (0, 4, {}, "allocate_run_state: B and T must be >= 1, got B=0, T=4"),
        (2.0, 4, {}, "allocate_run_state: B and T must be ints, got B=2.0, T=4"),
        (1, 4, {"matmul_dtype": "e4m3"}, "FP8 matmuls need B\\*T to be a multiple of 16, got 4"),
    ],
    ids=["zero-batch", "float-batch", "fp8-rows"],
)
def test_allocate_run_state_refusals(b, t, opts, message):
    m = ce.LlamaModel(tiny(dtype="bf16"), ce.TrainOptions(**opts), device="cpu")
    with pytest.raises(ValueError, match=message):
        m.allocate_run_state(b, t)


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
def test_validate_non_finite_loss():
    cfg = tiny("tiny-llama")
    m = ce.LlamaModel(cfg, ce.TrainOptions(model_dtype="fp32"), device="cpu")
    m.init_weights(1)
    m.allocate_run_state(B, T)
    w = m.weights["lm_head"]
    arr = w.numpy()
    arr[5, 3] = np.inf
    w.copy_from_numpy(arr)
    with pytest.raises(FloatingPointError, match="validate: the loss is (nan|inf) \\(non-finite\\)"):
        m.validate(*batch(cfg))


# ---- kernels on the cpu device -------------------------------------------------------------------
def test_activation_needs_a_last_dimension():
    with pytest.raises(
        ValueError, match=re.escape("activation_forward inp: expected shape (..., H), got tensor 'x' ()")
    ):
        activations.activation_forward(cpu_tensor("fp32", (), "y"), cpu_tensor("fp32", (), "x"), "swiglu")


def test_rmsnorm_needs_a_last_dimension():
    with pytest.raises(ValueError, match=re.escape("rmsnorm_forward inp: expected shape (..., C), got tensor 'x' ()")):
        rmsnorm.rmsnorm_forward(cpu_tensor("fp32", ()), cpu_tensor("fp32", (1,)), cpu_tensor("fp32", (), "x"),
                                cpu_tensor("fp32", (8,)), 1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "wq_shape,heads,message",
    [
        ((2, 8), (1, 1), re.escape("qknorm_forward weight_q: expected shape (head_size,), got (2, 8)")),
        ((8,), (0, 1), "qknorm_forward: n_q_heads=0 and n_kv_heads=1 must be >= 1"),
    ],
    ids=["weight-q-2d", "no-q-heads"],
)
def test_qknorm_refusals(wq_shape, heads, message):
    qkv = cpu_tensor("fp32", (2, 24), "qkv")
    with pytest.raises(ValueError, match=message):
        qknorm.qknorm_forward(cpu_tensor("fp32", (2, 24)), cpu_tensor("fp32", (2, 3)), qkv,
                              cpu_tensor("fp32", wq_shape), cpu_tensor("fp32", (8,)), *heads, 1e-5)  # fmt: skip


def test_rope_freqs_negative_max_pos():
    with pytest.raises(ValueError, match="rope_freqs: max_pos = -1 must be non-negative"):
        rope.rope_freqs(-1, 8, 10000.0)


def test_muon_operands_must_have_one_size():
    out, x, y = cpu_tensor("bf16", (4, 4), "out"), cpu_tensor("bf16", (4, 4), "x"), cpu_tensor("bf16", (3, 4), "y")
    with pytest.raises(ValueError, match=re.escape("muon_axpby: 'y' (3, 4) bf16 has 12 elements, 'out' (4, 4) has 16")):
        muon.muon_axpby(out, x, y, 1.0, 1.0)


def test_rope_kv_append_refuses_a_cache_that_overlaps_qkv():
    buf = cpu_tensor("fp32", (32,), "buf")  # qkv (1, (1 + 2*1) * 8) and a (1, 1, 4, 8) cache in the same memory
    qkv = buf.rows(0, 24).reshape(1, 24)
    k_cache, v_cache = buf.reshape(1, 1, 4, 8), cpu_tensor("fp32", (1, 1, 4, 8), "v_cache")
    idx = ce.Tensor.from_numpy(np.zeros(1, np.int32), "cpu", name="idx")
    freqs = ce.Tensor.from_numpy(rope.rope_freqs(4, 8, 10000.0), "cpu", name="freqs")
    with pytest.raises(ValueError, match="rope_kv_append: k_cache 'buf' overlaps qkv 'buf'"):
        decode_attention.rope_kv_append(qkv, k_cache, v_cache, idx, idx, freqs, 1, 1)


@pytest.fixture(scope="module")
def inference_state():
    m = ce.LlamaModel(tiny("tiny-hs64", dtype="bf16"), device="cpu")
    m.init_weights(1)
    return m, m.allocate_inference_state(max_batch=2, max_seq_len=32)


def _decode_layers(m, st, layers, lengths):
    decode_layers.decode_layers(st.residual.rows(0, 1), st.qkv.rows(0, 1), st.att.rows(0, 1), st.up.rows(0, 1),
                                st.att_scratch, st.layer_sync, st.layer_table, layers, lengths, st.freqs,
                                m.cfg.num_q_heads, m.cfg.num_kv_heads, 1e-5)  # fmt: skip


def test_decode_layers_refuses_weights_of_another_dtype(inference_state):
    m, st = inference_state
    fp32 = [dict(L, **{f: cpu_tensor("fp32", L[f].shape, f) for f in ("qkv_w", "o_w", "up_w", "down_w")})
            for L in st.layer_weights]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("decode_layers: weights are fp32; expected bf16 (the model dtype)")):
        _decode_layers(m, st, fp32, st.lengths.rows(0, 1))


def test_decode_layers_refuses_a_length_outside_the_cache(inference_state):
    m, st = inference_state
    lengths = ce.Tensor.from_numpy(np.zeros(1, np.int32), "cpu", name="lengths")
    with pytest.raises(ValueError, match=re.escape("decode_layers lengths: length 0 is outside [1, 32]")):
        _decode_layers(m, st, st.layer_weights, lengths)


# ---- the command line ----------------------------------------------------------------------------
def test_model_that_does_not_import_is_unavailable(capsys, monkeypatch):
    """A build whose cuengine.model fails to import says so (exit 1) instead of a traceback."""
    monkeypatch.setitem(sys.modules, "cuengine.model", None)
    with pytest.raises(_cli_util.Unavailable, match="the model does not import in this build"):
        _cli_util.model_api()
    code, _, err = run_cli(capsys, "bench", "--device", "cpu")
    assert code == 1 and "the model does not import in this build" in err, err


def test_generate_prompt_outside_the_vocabulary(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(tiny(vocab_size=64).to_hf_dict()))
    code, out, err = run_cli(capsys, "generate", "--model", tmp_path, "--device", "cpu", "--prompt", "z")
    assert code == 2 and out == "" and "--prompt: token id 122 is >= the model's vocab_size 64" in err, err


def test_generate_refusal_of_the_engine_is_usage_error(tmp_path, capsys):
    """A value the command line lets through but the engine refuses (a seed past 2**64) is one line."""
    m = ce.LlamaModel(tiny(), ce.TrainOptions(model_dtype="fp32"), device="cpu")
    m.init_weights(1)
    m.export_weights(tmp_path)
    code, out, err = run_cli(capsys, "generate", "--model", tmp_path, "--device", "cpu", "--prompt", "a",
                             "--max-new-tokens", 1, "--seed", 2**64)  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert re.search(re.escape("seed must be an int in [0, 2**64)"), err), err


def test_bench_refusal_of_the_options_is_usage_error(capsys):
    code, out, err = run_cli(capsys, "bench", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
                             "--matmul-dtype", "e4m3", "--steps", 1, "--warmup", 0)  # fmt: skip
    assert code == 2 and out == "" and "matmul_dtype 'e4m3' needs model_dtype 'bf16'" in err, err


def test_resume_with_an_unreadable_run_file(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{not json")
    code, out, err = run_cli(capsys, "train", "--device", "cpu", "--resume", "--out", tmp_path)
    assert code == 2 and out == "" and re.search(r"--resume: .*run\.json is unreadable \(Expecting", err), err


# ---- the distributed layer -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,args",
    [
        ("all_reduce", ("t",)),
        ("reduce_scatter", ("half", "t")),
        ("all_gather", ("t", "half")),
        ("broadcast", ("t",)),
        ("broadcast_object", ({"step": 1},)),
    ],
)
def test_base_communicator_leaves_the_collectives_to_a_backend(method, args):
    comm = dist.Communicator(0, 2, 0, ce.device("cpu"))
    t = {"t": cpu_tensor("fp32", (8,)), "half": cpu_tensor("fp32", (4,))}
    with pytest.raises(NotImplementedError):
        getattr(comm, method)(*(t.get(a, a) if isinstance(a, str) else a for a in args))


def test_recv_from_a_closed_peer_is_eof():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        b.close()
        with pytest.raises(EOFError, match="connection closed"):
            rendezvous.recv_msg(a)


def test_listen_on_a_busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(rendezvous.DistError, match=f"rendezvous: rank 0 cannot listen on port {port}: "):
            rendezvous.listen("127.0.0.1", port, 1)


def test_fake_comm_after_close():
    comm = fake.FakeComm(0, 1, 0, "127.0.0.1", rendezvous.free_port(), 10.0)
    comm.close()
    with pytest.raises(rendezvous.DistError, match="rank 0: barrier on a closed communicator"):
        comm.barrier()


def _rank0(port, then):
    """A stand-in rank 0 of a world of two: answers rank 1's init, then `then` ("exit" or "hang")."""
    server = rendezvous.listen("127.0.0.1", port, 2)
    done = threading.Event()

    def run():
        try:
            sock = rendezvous.accept(server, 2, [1], fake._TAG, 10.0)[1]
        finally:
            server.close()
        rendezvous.send_msg(sock, ("ok", rendezvous.recv_msg(sock)[3]))
        if then == "hang":
            done.wait(30)
        sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return done, thread


@pytest.mark.parametrize(
    "then,timeout,message",
    [
        ("exit", 10.0, "rank 1: lost rank 0 (the hub) during barrier #2: rank 0 exited or died"),
        ("hang", 1.0, "rank 1: no answer to barrier #2 within 1 s"),
    ],
)
def test_fake_comm_when_rank0_goes_away_or_stops_answering(then, timeout, message):
    """The hub's own messages come first in practice; these are the rank's last word when the hub
    process itself is gone (socket closed) or wedged (no reply past timeout + 5 s)."""
    port = rendezvous.free_port()
    done, thread = _rank0(port, then)
    comm = fake.FakeComm(1, 2, 1, "127.0.0.1", port, timeout)
    try:
        if then == "exit":
            thread.join(10)
        with pytest.raises(rendezvous.DistError, match=re.escape(message)):
            comm.barrier()
    finally:
        done.set()
        thread.join(10)


def test_data_parallel_checks_its_arguments():
    cfg = tiny()
    solo, cpu = dist.SoloComm("cpu"), ce.device("cpu")
    alloc = ce.TensorAllocator(cpu)
    plan1, plan2 = dist.ShardPlan(param_specs(cfg), 1), dist.ShardPlan(param_specs(cfg), 2)
    with pytest.raises(ValueError, match=re.escape("zero_stage must be one of (0, 1, 2), got 3")):
        DataParallel(solo, 3, plan1, "fp32", alloc, B * T)
    with pytest.raises(ValueError, match="DataParallel: the plan is for 2 ranks, the job has 1"):
        DataParallel(solo, 0, plan2, "fp32", alloc, B * T)
    elsewhere = types.SimpleNamespace(world_size=1, rank=0, device="cuda:7")  # a communicator on another device
    with pytest.raises(ValueError, match=re.escape("the communicator is on cuda:7, the model on Device('cpu')")):
        DataParallel(elsewhere, 0, plan1, "fp32", alloc, B * T)


def zero_refusals() -> dict:
    """Worker (two fake ranks): the refusals that need a real job of several ranks."""
    comm = dist.init()
    cfg, out = tiny(), {}
    x, y = batch(cfg)
    m = ce.LlamaModel(cfg, ce.TrainOptions(model_dtype="fp32", optimizer="muon", zero_stage=1), "cpu", comm=comm)
    with pytest.raises(ValueError) as err:
        m.allocate_run_state(B, T)
    out["muon"] = str(err.value)
    m = ce.LlamaModel(cfg, ce.TrainOptions(model_dtype="fp32", zero_stage=1), "cpu", comm=comm)
    m.init_weights(1)
    m.allocate_run_state(B, T)
    m.train_step(x, y, lr=1e-3)
    with pytest.raises(ValueError) as err:
        m.parameters()
    out["gather"] = str(err.value)
    dp = DataParallel(comm, 0, dist.ShardPlan(param_specs(cfg), 2), "fp32", ce.TensorAllocator(comm.device), B * T)
    with pytest.raises(ValueError) as err:
        dp.gather_moments()
    out["moments"] = str(err.value)
    comm.close()
    return out


def test_zero_refusals_on_two_ranks():
    results = dist.launch(zero_refusals, 2, backend="fake", timeout=60)
    for r in results:
        assert re.search(re.escape("allocate_run_state: zero_stage 1 shards AdamW's moments; with "
                                   "optimizer='muon' use zero_stage=0"), r["muon"]), r  # fmt: skip
        assert re.search("parameters: with zero_stage 1 the last update's weights are all-gathered by the next "
                         "forward; call sync_weights\\(\\) on every rank first", r["gather"]), r  # fmt: skip
        assert r["moments"] == "gather_moments: with zero_stage 0 the moments are not sharded", r
