"""Every raw_kernels/*.cu compiles to an sm_90 cubin with NVRTC, without a GPU.

Uses the same COMPILE_OPTIONS and include paths as the runtime loader, with the
CUDA headers of the nvidia-cuda-runtime wheel.
"""

import pytest

from cuengine.kernels._build import COMPILE_OPTIONS, cuda_include_dirs, include_options, kernel_files

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is part of the [cuda] extra")


def test_headers_found():
    assert cuda_include_dirs(), "no CUDA headers: install the nvidia-cuda-runtime wheel ([cuda] extra)"


def test_there_are_kernels():
    assert kernel_files(), "raw_kernels/ holds no .cu files"


def _compile(path):
    src = path.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(src, path.name.encode(), 0, [], [])
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
