"""Dtypes, devices, Tensor, TensorAllocator and DeviceMemoryStack, on cpu and cuda."""

import ml_dtypes
import numpy as np
import pytest

import cuengine as ce
from cuengine.tensor import stats_values


# ---- dtypes ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,size,np_type,cuda_type",
    [
        ("fp32", 4, np.float32, 0),
        ("fp16", 2, np.float16, 2),
        ("bf16", 2, ml_dtypes.bfloat16, 14),
        ("e4m3", 1, ml_dtypes.float8_e4m3fn, 28),
        ("e5m2", 1, ml_dtypes.float8_e5m2, 29),
        ("int32", 4, np.int32, 10),
        ("byte", 1, np.uint8, 8),
    ],
)
def test_dtype_table(name, size, np_type, cuda_type):
    d = ce.dtype(name)
    assert (d.itemsize, d.np, d.cuda_type) == (size, np.dtype(np_type), cuda_type)
    assert ce.dtype(np_type) is d
    assert ce.dtype(d) is d


def test_dtype_fp8_limits():
    assert ce.FP8_E4M3.fp8_max == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert ce.FP8_E5M2.fp8_max == float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)
    assert not ce.BF16.is_fp8


def test_dtype_bad_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown dtype 'bf17'.*bf16.*e4m3"):
        ce.dtype("bf17")
    with pytest.raises(ValueError, match="no engine equivalent"):
        ce.dtype(np.complex64)


# ---- devices --------------------------------------------------------------------------------
def test_device_names():
    assert ce.device("cpu").is_cpu
    assert ce.device("auto").kind == ("cuda" if ce.cuda_available() else "cpu")
    assert ce.device("cpu") is ce.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        ce.device("tpu")


@pytest.mark.skipif(ce.cuda_available(), reason="only meaningful without a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="finds no CUDA device"):
        ce.device("cuda")


def test_cuda_without_cupy_says_how_to_install_it(monkeypatch):
    import builtins
    import sys

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    for mod in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(RuntimeError, match=r"CuPy is not installed \(pip install 'cuengine\[cuda\]'\)"):
        ce.device("cuda")


def test_stream_event_sync(dev):
    s = dev.new_stream()
    t = ce.Tensor.from_numpy(np.arange(8, dtype=np.float32), dev, name="x")
    out = ce.Tensor.empty(ce.FP32, (8,), dev, name="y")
    ev = dev.event()
    dev.copy_async(out, t, stream=dev.stream)
    dev.stream.record(ev)
    s.wait(ev)
    s.synchronize()
    ev.synchronize()
    assert ev.done()
    dev.synchronize()
    np.testing.assert_array_equal(out.numpy(), np.arange(8, dtype=np.float32))


def test_stream_priority(dev, monkeypatch):
    """A "high" stream is the device's most urgent; a captured graph keeps the priority of the
    stream that captured each kernel (the collectives of a step stay urgent inside its graph)."""
    high, normal = dev.new_stream(priority="high"), dev.new_stream()
    assert (high.priority, normal.priority) == ("high", "normal")
    with pytest.raises(ValueError, match="priority must be one of"):
        dev.new_stream(priority="urgent")
    if not dev.is_cuda:
        return
    from cuda.bindings import driver

    greatest = driver.cuCtxGetStreamPriorityRange()[2]
    assert high.raw.priority == greatest < normal.raw.priority == 0
    x = ce.Tensor.from_numpy(np.ones(1 << 16, np.float32), dev, name="x")
    x.array()[...] *= 1  # CuPy compiles its kernel here, not inside the capture
    ev, back = dev.event(), dev.event()

    def work():  # scale x on the high stream, forked from the main one and joined back
        dev.stream.record(ev)
        high.wait(ev)
        with high.raw:
            x.array()[...] *= 3
        high.record(back)
        dev.stream.wait(back)

    flags_seen = []  # the driver does not report USE_NODE_PRIORITY back (cuGraphExecGetFlags gave 0 on the
    instantiate = driver.cuGraphInstantiate  # H200 with the flag passed), so watch what is passed

    def watched(graph, flags):
        flags_seen.append(int(flags))
        return instantiate(graph, flags)

    monkeypatch.setattr(driver, "cuGraphInstantiate", watched)
    graph = dev.capture(work)
    err, nodes, count = driver.cuGraphGetNodes(driver.CUgraph(graph.raw.graph), 0)
    err, nodes, count = driver.cuGraphGetNodes(driver.CUgraph(graph.raw.graph), count)
    kernels = [n for n in nodes if driver.cuGraphNodeGetType(n)[1] == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL]
    attr = driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    assert [driver.cuGraphKernelNodeGetAttribute(n, attr)[1].priority for n in kernels] == [greatest]
    # and the graph runs each node at that priority, not at the launch stream's
    use_node_priority = driver.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
    assert len(flags_seen) == 1 and flags_seen[0] & int(use_node_priority)
    graph.launch()
    dev.synchronize()
    np.testing.assert_array_equal(x.numpy(), np.full(1 << 16, 3, np.float32))


def test_graph_instantiate_flags_follow_the_switch(monkeypatch):
    """Graphs run each node at its capturing stream's priority (flag 8) unless
    CUENGINE_GRAPH_NODE_PRIORITY=0 asks for the launch stream's."""
    from cuengine.device import graph_instantiate_flags

    monkeypatch.delenv("CUENGINE_GRAPH_NODE_PRIORITY", raising=False)
    assert graph_instantiate_flags() == 8
    monkeypatch.setenv("CUENGINE_GRAPH_NODE_PRIORITY", "0")
    assert graph_instantiate_flags() == 0


def test_copies_host_device_pinned(dev):
    alloc = ce.TensorAllocator(dev)
    host = alloc.allocate(ce.BF16, "host", (4, 5), kind="pinned")
    devt = alloc.allocate(ce.BF16, "dev", (4, 5))
    back = alloc.allocate(ce.BF16, "back", (4, 5), kind="pinned")
    data = np.random.default_rng(0).standard_normal((4, 5)).astype(ml_dtypes.bfloat16)
    host.array()[...] = data  # pinned memory is host-visible
    dev.copy_async(devt, host)
    dev.copy_async(back, devt)
    dev.stream.synchronize()
    np.testing.assert_array_equal(back.array(), data)
    np.testing.assert_array_equal(devt.numpy(), data)
    # synchronous copy from a pageable tensor works; async from one is refused on cuda
    pageable = ce.Tensor(ce.BF16, (4, 5), dev, np.zeros(40, np.uint8), name="pageable", kind="host")
    dev.copy(devt, pageable)
    np.testing.assert_array_equal(devt.numpy(), np.zeros((4, 5), ml_dtypes.bfloat16))
    if dev.is_cuda:
        with pytest.raises(ValueError, match="pageable host memory"):
            dev.copy_async(devt, pageable)
    with pytest.raises(ValueError, match="copy: 'dev' holds 40 bytes"):
        dev.copy(devt, alloc.allocate(ce.BF16, "small", (3,)))


def test_graph_capture_replays(dev):
    x = ce.Tensor.from_numpy(np.ones(16, np.float32), dev, name="x")
    y = ce.Tensor.from_numpy(np.full(16, 7, np.float32), dev, name="y")

    def work():
        dev.copy_async(y, x)
        x.fill_zero()

    graph = dev.capture(work)
    # capture records without running
    np.testing.assert_array_equal(y.numpy(), np.full(16, 7, np.float32))
    graph.launch()
    dev.stream.synchronize()
    np.testing.assert_array_equal(y.numpy(), np.ones(16, np.float32))
    np.testing.assert_array_equal(x.numpy(), np.zeros(16, np.float32))
    x.copy_from_numpy(np.full(16, 3, np.float32))
    graph.launch()
    np.testing.assert_array_equal(y.numpy(), np.full(16, 3, np.float32))


# ---- tensors --------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16", "e4m3", "e5m2", "int32", "byte"])
def test_tensor_roundtrip(dev, dt):
    d = ce.dtype(dt)
    src = (np.random.default_rng(1).standard_normal((3, 37)) * 4).astype(d.np)
    t = ce.Tensor.from_numpy(src, dev, name="t")
    assert t.shape == (3, 37) and t.dtype is d and t.nelem == 111 and t.nbytes == 111 * d.itemsize
    np.testing.assert_array_equal(t.numpy().view(np.uint8), src.view(np.uint8))


def test_tensor_views(dev):
    src = np.arange(24, dtype=np.float32).reshape(6, 4)
    t = ce.Tensor.from_numpy(src, dev, name="m")
    np.testing.assert_array_equal(t.reshape(4, 6).numpy(), src.reshape(4, 6))
    np.testing.assert_array_equal(t.reshape(-1, 3).numpy(), src.reshape(-1, 3))
    np.testing.assert_array_equal(t.rows(2, 5).numpy(), src[2:5])
    np.testing.assert_array_equal(t[1].numpy(), src[1])
    np.testing.assert_array_equal(t[-1].numpy(), src[-1])
    np.testing.assert_array_equal(t[4:].numpy(), src[4:])
    np.testing.assert_array_equal(t.shard_view(1, 3).numpy(), src[2:4])
    np.testing.assert_array_equal(t.view(ce.BYTE).numpy(), src.view(np.uint8))
    np.testing.assert_array_equal(t.view(ce.BF16).shape, (6, 8))
    # views alias: writing through a row slice changes the parent
    t.rows(0, 1).fill_zero()
    assert t.numpy()[0].sum() == 0 and t.numpy()[1].sum() == src[1].sum()


def test_tensor_misuse_names_the_tensor(dev):
    t = ce.Tensor.from_numpy(np.zeros((6, 4), np.float32), dev, name="acts")
    with pytest.raises(ValueError, match="'acts'.*cannot reshape"):
        t.reshape(5, 5)
    with pytest.raises(ValueError, match="'acts'.*rows \\[4, 8\\) out of range"):
        t.rows(4, 8)
    with pytest.raises(IndexError, match="'acts'"):
        t[6]
    with pytest.raises(ValueError, match="'acts'.*does not split into 4 shards"):
        t.shard_view(0, 4)
    with pytest.raises(ValueError, match="'odd'.*not a multiple of fp32"):
        ce.Tensor.from_numpy(np.zeros(3, np.uint8), dev, name="odd").view(ce.FP32)
    with pytest.raises(ValueError, match="'acts' \\(fp32\\) carries no FP8 stats"):
        t.abs_max
    with pytest.raises(ValueError, match="'acts'.*runs past the end"):
        ce.Tensor(ce.FP32, (7, 4), dev, t.storage, name="acts")
    with pytest.raises(ValueError, match="expected shape \\(6, 4\\), got \\(4, 6\\)"):
        t.copy_from_numpy(np.zeros((4, 6)))


def test_fp8_stats_travel_with_views(dev):
    src = np.array([[1.0, -3.5], [0.25, 2.0]], np.float32)
    t = ce.Tensor.from_numpy(src, dev, name="q", dtype="e4m3")
    stats = t.fp8_stats()
    assert stats[0] == 3.5
    np.testing.assert_allclose(stats[1:], stats_values(3.5, ce.FP8_E4M3)[1:])
    assert t.rows(1, 2).abs_max.numpy()[0] == 3.5
    assert t.reshape(4).scale.numpy()[0] == np.float32(448 / 3.5)
    assert stats_values(0.0, ce.FP8_E5M2) == (0.0, 1.0, 1.0)


def test_with_stats(dev):
    t = ce.Tensor.from_numpy(np.ones(4, np.float32), dev, name="w", dtype="bf16")
    slot = ce.Tensor.empty(ce.FP32, (ce.tensor.STATS_SLOTS,), dev, name="slot").fill_zero()
    tw = t.with_stats(slot).set_fp8_stats(2.0, 224.0, 1 / 224)
    assert tw.abs_max.numpy()[0] == 2.0 and t.stats is None
    np.testing.assert_array_equal(tw.fp8_stats(), np.array([2.0, 224.0, 1 / 224], np.float32))
    # each field is 16-byte aligned: cuBLASLt refuses scale pointers that are not
    assert tw.abs_max.ptr % 16 == tw.scale.ptr % 16 == tw.scale_inv.ptr % 16 == 0
    with pytest.raises(ValueError, match="stats must be fp32 with 12 slots"):
        t.with_stats(t)
    big = ce.Tensor.empty(ce.FP32, (16,), dev, name="big")
    with pytest.raises(ValueError, match="stats slot 'big' is not 16-byte aligned"):
        t.with_stats(big.rows(1, 13))


def test_interop(dev):
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = ce.Tensor.from_numpy(src, dev, name="x")
    if dev.is_cuda:
        import cupy

        np.testing.assert_array_equal(cupy.asnumpy(cupy.from_dlpack(t)), src)
        np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(t)), src)
        assert t.__cuda_array_interface__["shape"] == (3, 4)
        c = t.cupy()
        c[0, 0] = 42  # zero-copy
        assert t.numpy()[0, 0] == 42
        bits = ce.Tensor.from_numpy(src, dev, name="b", dtype="bf16").cupy()
        # CuPy 14 has bf16; where a CuPy lacks a type the view holds raw bits. Either way the bits match.
        np.testing.assert_array_equal(
            cupy.asnumpy(bits).view(np.uint16), src.astype(ml_dtypes.bfloat16).view(np.uint16)
        )
    else:
        np.testing.assert_array_equal(np.from_dlpack(t), src)
        with pytest.raises(AttributeError):
            t.__cuda_array_interface__
        with pytest.raises(ValueError, match="host memory"):
            t.cupy()


# ---- allocator ------------------------------------------------------------------------------
def test_allocator_contexts_and_report(dev):
    alloc = ce.TensorAllocator(dev)
    with alloc.context("Weights"):
        w = alloc.allocate("bf16", "qkv_w", (64, 32))
        alloc.allocate("bf16", "qkv_w", (64, 32))
    with alloc.context("Activations"):
        q = alloc.allocate("e4m3", "ln1.q", (8, 32))
        alloc.allocate("fp32", "res", (8, 32), kind="pinned")
    assert w.name == "qkv_w" and q.stats is not None and q.abs_max.numpy()[0] == 0
    rep = alloc.report()
    assert rep.by_context["Weights"] == [2 * 4096, 2]
    assert rep.by_name[("Weights", "qkv_w")] == [2 * 4096, 2]
    assert rep.by_name[("Activations", "ln1.q")][0] == 256
    assert rep.by_name[("Activations", "ln1.q.stats")][0] == 256
    assert rep.pinned_bytes == 1024
    assert rep.device_bytes == 2 * 4096 + 256 + 256
    assert "Weights" in str(rep) and "ln1.q" not in str(rep)  # print(report) is the per-context summary
    rows = [line.split() for line in rep.table(per_buffer=True).splitlines()]
    assert ["Activations", "ln1.q", "1", "0.00"] in rows
    alloc.free_all()
    assert alloc.report().total == 0


def test_allocator_out_of_memory_includes_report(dev):
    alloc = ce.TensorAllocator(dev, limit_bytes=1 << 20)
    with alloc.context("Weights"):
        alloc.allocate("fp32", "embedding", (1024, 128))
    with pytest.raises(MemoryError, match="(?s)out of memory allocating 'huge'.*Weights.*embedding"):
        alloc.allocate("fp32", "huge", (1024, 1024))


def test_allocator_real_out_of_memory(dev):
    alloc = ce.TensorAllocator(dev)
    alloc.allocate("byte", "small", (16,))
    with pytest.raises(MemoryError, match="(?s)out of memory allocating 'enormous'.*small"):
        alloc.allocate("byte", "enormous", (1 << 52,))


def test_allocator_bad_kind(dev):
    with pytest.raises(ValueError, match="kind must be 'device' or 'pinned'"):
        ce.TensorAllocator(dev).allocate("fp32", "x", (4,), kind="managed")


# ---- stack ----------------------------------------------------------------------------------
def test_stack_lifo_alignment_and_high_water(dev):
    alloc = ce.TensorAllocator(dev)
    buf = alloc.allocate("byte", "stack", (4096,))
    stack = ce.DeviceMemoryStack(buf)
    a = stack.allocate("fp32", (10,), "a")
    b = stack.allocate("bf16", (300,), "b")
    assert (b.ptr - a.ptr) == 256 and a.ptr % 256 == buf.ptr % 256
    stack.free(b)
    c = stack.allocate("byte", (1000,), "c")
    assert c.ptr == b.ptr  # reuse after free
    assert stack.max_utilization() == 256 + 1024
    assert [n for n, _ in stack.high_mark_contents] == ["a", "c"]
    with pytest.raises(ValueError, match="free\\('a'\\) out of order.*'c'"):
        stack.free(a)
    stack.free(c)
    stack.free(a)
    assert stack.used == 0
    with pytest.raises(MemoryError, match="stack 'stack'.*'big'"):
        stack.allocate("fp32", (2000,), "big")
    with stack.temporary("fp32", (4,), "t") as t:
        t.copy_from_numpy(np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(t.numpy(), np.arange(4, dtype=np.float32))
    assert stack.used == 0


def test_stack_simulation_sizes_real_stack(dev):
    def step(stack):
        x = stack.allocate("bf16", (8, 1000), "x")
        y = stack.allocate("fp32", (8, 100), "y")
        stack.free(y)
        z = stack.allocate("e4m3", (8, 5000), "z")
        stack.free(z)
        stack.free(x)

    sim = ce.DeviceMemoryStack.simulate(dev)
    step(sim)
    t = sim.allocate("fp32", (4,), "sim")
    with pytest.raises(ValueError, match="'sim' has no memory"):
        t.numpy()
    sim.free(t)
    alloc = ce.TensorAllocator(dev)
    with alloc.context("Stack"):
        real = ce.DeviceMemoryStack.sized_from(sim, alloc)
    assert real.capacity == sim.max_utilization() == 16128 + 40192  # x, then the larger of y and z
    step(real)  # the same pattern fits exactly
    assert alloc.report().by_context["Stack"][0] >= real.capacity
    with pytest.raises(ValueError, match="free\\('late'\\) but nothing is allocated"):
        real.free(ce.Tensor.from_numpy(np.zeros(1, np.float32), dev, name="late"))


# ---- boundary checks and kernel names shared by the launchers ------------------------------------
class _Cuda:
    """A device that says it is cuda, over host memory: the address rules apply, nothing launches."""

    kind, index, name, is_cuda, is_cpu = "cuda", 0, "fake cuda", True, False


def _view(byte_offset, dtype=ce.BF16, n=16, device=None):
    """A tensor `byte_offset` bytes past a 256-byte boundary of its buffer."""
    raw = np.zeros(512 + n * dtype.itemsize, np.uint8)
    base = -raw.ctypes.data % 256
    return ce.Tensor(dtype, (n,), device or _Cuda(), raw, base + byte_offset, name=f"at{byte_offset}")


def test_alignment_checks():
    from cuengine._checks import check_aligned, is_aligned

    assert is_aligned(_view(0), None, _view(32)) and not is_aligned(_view(0), _view(2))
    assert is_aligned(_view(8), nbytes=8) and not is_aligned(_view(8))
    check_aligned("op", _view(0), None, _view(2, device=ce.device("cpu")))  # the twins have no address rule
    with pytest.raises(ValueError, match=r"op: tensor 'at2' bf16 \(16,\) at device address 0x[0-9a-f]+ is not 16-byte"):
        check_aligned("op", _view(0), _view(2))


def test_vector_width_check():
    from cuengine._checks import check_vector_width

    check_vector_width("op", "C", 24, ce.BF16)
    check_vector_width("op", "C", 4, ce.FP32)
    with pytest.raises(ValueError, match="op: C = 12 must be a multiple of 8 for 16-byte bf16 vectors"):
        check_vector_width("op", "C", 12, ce.BF16)
    with pytest.raises(ValueError, match="op: head size = 8 must be a multiple of 16 for 16-byte bf16 vectors"):
        check_vector_width("op", "head size", 8, ce.BF16, vectors=2)


def test_kernel_names_and_grid_size():
    from cuengine.kernels._build import grid_size, kernel_name

    x = ce.Tensor.empty(ce.BF16, (4,), "cpu")
    assert kernel_name("quantize", x, ce.FP8_E4M3) == "quantize_bf16_e4m3"
    assert kernel_name("adamw", ce.FP32, ce.FP16, scalar=True) == "adamw_f32_f16_scalar"
    sms = type("D", (), {"num_sms": 132})()
    assert grid_size(sms, 0, 256) == 1 and grid_size(sms, 257, 256) == 2
    assert grid_size(sms, 10**9, 256) == 132 * 16 and grid_size(sms, 10**9, 256, 4) == 132 * 4


@pytest.mark.gpu
def test_cuda_kernels_without_a_scalar_variant_refuse_unaligned_views(cuda):
    """A view that starts 2 bytes into a 16-byte vector is refused by name, not read misaligned."""
    from cuengine.kernels import activations, encoder, rmsnorm, rope

    def at2(shape, dtype=ce.BF16):
        t = ce.Tensor.from_numpy(np.zeros(int(np.prod(shape)) + 8, dtype.np), cuda, name="x")
        return t[1 : 1 + int(np.prod(shape))].reshape(*shape)

    def ok(shape, dtype=ce.BF16, name="ok"):
        return ce.Tensor.from_numpy(np.zeros(shape, dtype.np), cuda, name=name)

    calls = [
        lambda: activations.activation_forward(ok((4, 8)), at2((4, 16)), "swiglu"),
        lambda: activations.activation_backward(ok((4, 8)), ok((4, 8)), at2((4, 8)), "relu"),
        lambda: rmsnorm.rmsnorm_forward(ok((4, 8)), ok((4,), ce.FP32), at2((4, 8)), ok((8,)), 1e-5),
        lambda: rope.rope_forward(ok((1, 4, 48)), at2((1, 4, 48)), ok((4, 16), ce.FP32), 1, 1),
        lambda: encoder.encoder_forward(ok((1, 4, 8)), ok((1, 4), ce.INT32), at2((10, 8))),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="tensor 'x' .* is not 16-byte aligned"):
            call()
