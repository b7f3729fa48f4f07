"""Every raw_kernels/*.cu compiles to an sm_90 cubin with NVRTC, without a GPU.

Uses the same COMPILE_OPTIONS and include paths as the runtime loader, with the
CUDA headers of the nvidia-cuda-runtime wheel.
"""

import re
from pathlib import Path

import pytest

from cuengine.kernels import _build
from cuengine.kernels._build import COMPILE_OPTIONS, cuda_include_dirs, include_options, kernel_files

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is part of the [cuda] extra")


def test_headers_found():
    assert cuda_include_dirs(), "no CUDA headers: install the nvidia-cuda-runtime wheel ([cuda] extra)"


def test_there_are_kernels():
    assert kernel_files(), "raw_kernels/ holds no .cu files"


def _compile(path, template=None):
    src = path.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(src, path.name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    if template:
        (err,) = nvrtc.nvrtcAddNameExpression(prog, template.encode())
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [o.encode() for o in ("-arch=sm_90", *COMPILE_OPTIONS, *include_options())]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{path.name} failed to compile:\n{log.decode(errors='replace')}"
    err, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
    assert cubin_size > 0
    nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: p.name)
def test_compiles_to_sm90_cubin(path):
    _compile(path)


def test_decode_layers_instantiation_compiles():
    """decode_layers.cu's kernel is a template compiled per variant on demand (kernels/_build.module):
    the file alone instantiates nothing, so compile the variant the 0.5B model's bf16 decode runs."""
    from cuengine.kernels._build import kernel_dir

    _compile(kernel_dir() / "decode_layers.cu", "decode_layers<__nv_bfloat16, __nv_bfloat16, 8, 1, 8, 1>")


def test_an_edited_header_changes_the_source_cupy_caches(tmp_path, monkeypatch):
    """CuPy's kernel cache keys on the .cu text: the headers' digest rides on its last line, so a .cuh
    edit recompiles every module (a stale binary would pass every test of the edit it ignores)."""
    for f in ("gemv.cu", "gemv.cuh", "common.cuh"):
        (tmp_path / f).write_bytes((_build.kernel_dir() / f).read_bytes())
    cu = tmp_path / "gemv.cu"
    before = _build.module_source(cu)
    assert before.startswith(cu.read_text())  # line numbers of compile errors stay those of the file
    (tmp_path / "gemv.cuh").write_text((tmp_path / "gemv.cuh").read_text() + "\n// edited\n")
    _build._headers_digest.cache_clear()
    assert _build.module_source(cu) != before


def test_checkouts_with_the_same_headers_share_one_include_path(tmp_path):
    """The include path is part of CuPy's cache key: two copies of raw_kernels/ (ab_bench.sh's copies of the
    tree) compile with the same -I, a directory holding their headers, and an edited header gets another."""
    copies = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in copies:
        d.mkdir()
        for header in _build.kernel_dir().glob("*.cuh"):
            (d / header.name).write_bytes(header.read_bytes())
    (copies[2] / "gemv.cuh").write_text((copies[2] / "gemv.cuh").read_text() + "\n// edited\n")
    a, b, c = map(_build._header_dir, copies)
    assert a == b != c
    assert (c / "gemv.cuh").read_text().endswith("// edited\n")
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in _build.kernel_dir().glob("*.cuh"))
    assert (a / "common.cuh").read_bytes() == (_build.kernel_dir() / "common.cuh").read_bytes()
    assert include_options()[0] == f"-I{_build._header_dir(_build.kernel_dir())}"


@pytest.mark.parametrize("weights", ["__nv_bfloat16", "__nv_fp8_e4m3"])
def test_decode_mlp_instantiation_compiles(weights):
    """decode_mlp.cu's kernel is a template compiled per variant on demand: compile the 0.5B model's
    bf16-row variant over bf16 and E4M3 weights (4 and 2 weight vectors a lane)."""
    from cuengine.kernels._build import kernel_dir

    xv = 4 if weights == "__nv_bfloat16" else 2
    _compile(kernel_dir() / "decode_mlp.cu", f"decode_mlp<__nv_bfloat16, {weights}, {xv}>")


def test_decode_attention_o_instantiation_compiles():
    """decode_attention_o.cu's kernel is a template compiled per variant on demand: the 0.5B model's
    (bf16 rows, head size 64: decode_attention's v8 layout)."""
    from cuengine.kernels._build import kernel_dir

    _compile(kernel_dir() / "decode_attention_o.cu", "decode_attention_o<__nv_bfloat16, __nv_bfloat16, 8, 1, 8>")


# The training step's kernel families: each kernel waits for the kernel before it as its first statement, so
# its launcher may launch it as a programmatic dependent launch (the launch overlaps the tail of the kernel
# before; nothing is read or written before the wait). The decode families prefetch weights before their wait.
WAIT_FIRST = ("rmsnorm", "activations", "rope", "classifier", "adamw", "fp8")


def _kernel_bodies(src: str):
    """(name, first statement) of every extern "C" __global__ kernel of a .cu source (macros unfolded by line)."""
    text = re.sub(r"\\\n", "\n", src)
    for m in re.finditer(r'extern "C" __global__[^{;]*?([\w#]+)\s*\(([^)]*)\)\s*\{', text):
        body = text[m.end() :].lstrip()
        yield m.group(1), body[: body.index(";") + 1]


@pytest.mark.parametrize("family", WAIT_FIRST)
def test_training_kernels_wait_first_and_launch_as_dependents(family):
    src = (_build.kernel_dir() / f"{family}.cu").read_text()
    kernels = list(_kernel_bodies(src))
    assert kernels, f"{family}.cu: no kernels found"
    late = [name for name, first in kernels if first != "grid_dependency_wait();"]
    assert not late, f"{family}.cu: these kernels do not call grid_dependency_wait() first: {late}"
    launcher = (Path(_build.__file__).parent / f"{family}.py").read_text()
    calls = len(re.findall(r"(?<![\w.])(?:_build\.)?launch\(", launcher))
    assert calls and launcher.count("dependent=True") == calls, f"{family}.py: every launch should be dependent"
