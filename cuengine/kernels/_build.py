"""Compiling raw_kernels/*.cu and launching their kernels.

Each .cu file is one RawModule, compiled lazily once per device and cached
(CuPy's memoize pattern). COMPILE_OPTIONS is the one place compile flags live;
the CPU-only compile test (tests/test_compile.py) uses the same list with
cuda.bindings.nvrtc, so what CI compiles is what the GPU runs.
"""

from __future__ import annotations

import functools
import glob
import os
from pathlib import Path

import numpy as np

from ..dtypes import DType
from ..tensor import Tensor

COMPILE_OPTIONS = ("-std=c++17", "-DNDEBUG")
# Families compiled for one architecture-specific target instead of the device's sm_XX: wgmma
# exists only in sm_90a. CuPy appends its own -arch after the options (and NVRTC takes the last
# one), so these are compiled here with cuda.bindings.nvrtc and loaded as cubins; the launcher
# must run them only on that architecture (attention.py checks the compute capability).
MODULE_ARCH = {"attention_sm90": "sm_90a"}
# The suffix each raw_kernels/*.cu kernel carries per element type it is instantiated for.
_SUFFIX = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "e4m3": "e4m3", "e5m2": "e5m2"}


def kernel_dir() -> Path:
    """Where the .cu sources are: raw_kernels/ beside the package, or packaged inside it."""
    here = Path(__file__).resolve().parents[2] / "raw_kernels"
    if here.is_dir():
        return here
    from importlib.resources import files

    return Path(str(files("cuengine.raw_kernels")))


def kernel_files() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


def cuda_include_dirs() -> list[str]:
    """CUDA headers from the nvidia-cuda-runtime wheel, then CUDA_PATH, so no system toolkit is needed."""
    dirs = []
    try:
        import nvidia

        for root in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(root, "cu1*", "include")))
            dirs += sorted(glob.glob(os.path.join(root, "cuda_runtime", "include")))
    except ImportError:
        pass
    cuda_path = os.environ.get("CUDA_PATH", "/usr/local/cuda")
    if os.path.isdir(os.path.join(cuda_path, "include")):
        dirs.append(os.path.join(cuda_path, "include"))
    return [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]


def include_options() -> tuple[str, ...]:
    return tuple(f"-I{d}" for d in [str(kernel_dir()), *cuda_include_dirs()])


@functools.cache
def module(family: str, device_index: int, template: str | None = None):
    """The compiled RawModule for raw_kernels/<family>.cu on one device; with `template` (a name
    expression such as "decode_layers<float, float, 4, 1, 16>") only that instantiation of the file's
    template kernel is compiled, for families whose variants are too costly to compile all at once."""
    import cupy

    path = kernel_dir() / f"{family}.cu"
    if family in MODULE_ARCH:
        cubin = _cubin_dir() / f"{family}.{MODULE_ARCH[family]}.cubin"
        cubin.write_bytes(compile_cubin(path, MODULE_ARCH[family])[0])
        with cupy.cuda.Device(device_index):
            return cupy.RawModule(path=str(cubin))
    source = module_source(path)
    names = (template,) if template else ()
    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=source, options=COMPILE_OPTIONS + include_options(), backend="nvrtc",
                             name_expressions=names)  # fmt: skip
        mod.compile()
    return mod


def module_source(path: Path) -> str:
    """The text of a .cu file as CuPy compiles it: with a last line naming the digest of the headers
    it may include. CuPy's on-disk kernel cache keys on the source text alone, so without it an edited
    raw_kernels/*.cuh would leave every .cu that includes it running its stale cached binary."""
    return path.read_text() + f"\n// raw_kernels headers: {_headers_digest(path.parent)}\n"


@functools.cache
def _headers_digest(directory: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for header in sorted(directory.glob("*.cuh")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()[:16]


def compile_cubin(path: Path, arch: str) -> tuple[bytes, str]:
    """raw_kernels/<family>.cu compiled by NVRTC to a cubin for `arch` (e.g. "sm_90a"), with
    COMPILE_OPTIONS, the include paths and the -ftz=true that CuPy adds to the other modules;
    returns the cubin and the compile log (ptxas performance warnings land there)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(path.read_bytes(), path.name.encode(), 0, [], [])
    opts = [o.encode() for o in (f"-arch={arch}", *COMPILE_OPTIONS, *include_options(), "-ftz=true")]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{path.name} ({arch}) failed to compile:\n{log}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@functools.cache
def _cubin_dir() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="cuengine-cubin-"))


@functools.cache
def function(family: str, name: str, device_index: int):
    """The compiled kernel `name` of raw_kernels/<family>.cu (its attributes, its occupancy)."""
    if "<" in name:  # a template instantiation
        return module(family, device_index, name).get_function(name)
    return module(family, device_index).get_function(name)


_smem_opt_in: dict = {}  # kernel -> the dynamic shared memory limit set on it


def _arg(a):
    if isinstance(a, Tensor):
        return np.uint64(a.ptr)
    if a is None:
        return np.uint64(0)  # optional pointer argument left out
    if isinstance(a, (np.generic,)):
        return a
    raise TypeError(f"kernel argument {a!r}: pass Tensors, None, or NumPy scalars with the C type (np.int32, ...)")


def launch(family: str, name: str, grid, block, args, device, stream=None, shared_mem: int = 0,
           dependent: bool = False) -> None:  # fmt: skip
    """Launch kernel `name` of raw_kernels/<family>.cu.

    `args` are Tensors (passed as pointers), None (a null pointer) or NumPy scalars
    whose type matches the C parameter (np.int32 for int, np.float32 for float, ...).

    `dependent=True` launches it as a programmatic dependent launch (sm_90+): its blocks may start
    while the previous kernel on the stream finishes, and a CUDA graph captured from the stream keeps
    that overlap. Only for kernels that execute `griddepcontrol.wait` (common.cuh:
    grid_dependency_wait) before they read what earlier kernels wrote or write what they read; it
    hides the launch and the prologue of short decode kernels behind their predecessor's tail.

    A name with "<" is a template instantiation (see `module`).
    """
    fn = function(family, name, device.index)
    if shared_mem > _smem_opt_in.get(fn, 0):
        # Dynamic plus static shared memory over 48 KB needs the opt-in, even when the
        # dynamic part alone is under it; raise the limit once per kernel.
        fn.max_dynamic_shared_size_bytes = shared_mem
        _smem_opt_in[fn] = shared_mem
    s = device._stream(stream)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    block = tuple(block) if isinstance(block, (tuple, list)) else (int(block),)
    with device.activate():
        if dependent and _dependent_launch_supported(device.index):
            _launch_dependent(fn, grid, block, [_arg(a) for a in args], s.raw.ptr, shared_mem)
        else:
            fn(grid, block, tuple(_arg(a) for a in args), stream=s.raw, shared_mem=shared_mem)


@functools.cache
def _dependent_launch_supported(device_index: int) -> bool:
    """Programmatic dependent launch needs sm_90+ and the driver binding that sets launch attributes.
    CUENGINE_DEPENDENT_LAUNCH=0 turns it off (ordinary launches): to rule it out when chasing a race,
    or to profile each kernel's own time (under it a kernel's time includes its wait for the one before)."""
    import cupy

    if os.environ.get("CUENGINE_DEPENDENT_LAUNCH", "1") == "0":
        return False

    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return int(cupy.cuda.Device(device_index).compute_capability) >= 90


def _launch_dependent(fn, grid, block, args, stream_ptr: int, shared_mem: int) -> None:
    """cuLaunchKernelEx with programmatic stream serialization allowed; `args` as _arg returns them."""
    from cuda.bindings import driver

    values = [np.array([a]) for a in args]  # each parameter's bytes, alive until the launch has copied them
    pointers = np.array([v.ctypes.data for v in values], dtype=np.uint64)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    (config.gridDimX, config.gridDimY, config.gridDimZ) = (*grid, 1, 1)[:3]
    (config.blockDimX, config.blockDimY, config.blockDimZ) = (*block, 1, 1)[:3]
    config.sharedMemBytes = shared_mem
    config.hStream = driver.CUstream(stream_ptr)
    config.attrs = [attr]
    config.numAttrs = 1
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(fn.kernel.ptr), pointers.ctypes.data, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx: {err.name}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def write_twin_results(results, abs_max=None, amax_of=None) -> None:
    """A launcher's cpu path: each (tensor, array) of `results` into its tensor, and |amax_of|
    max-accumulated into the optional (1,) abs_max slot, NaN-propagating like the kernels' integer max."""
    for t, a in results:
        t.array()[...] = a
    if abs_max is not None and amax_of.size:
        slot = abs_max.array()
        slot[...] = np.maximum(slot, np.max(np.abs(amax_of.astype(np.float32))))


def kernel_name(base: str, *types, scalar: bool = False) -> str:
    """The name of one instantiation of kernel `base`: base_<suffix>..., one suffix per type.

    `types` are DTypes or Tensors (their dtype), e.g. kernel_name("quantize", inp, out) is
    "quantize_bf16_e4m3". `scalar` picks the `_scalar` variant that .cu files keep for unaligned data.
    """
    parts = [base] + [_SUFFIX[(t if isinstance(t, DType) else t.dtype).name] for t in types]
    return "_".join(parts) + ("_scalar" if scalar else "")


def grid_size(device, work: int, per_block: int, blocks_per_sm: int = 16) -> int:
    """Blocks for a grid-stride kernel: one per `per_block` items of `work`, never more than
    `blocks_per_sm` per SM (further blocks would only queue; the stride loop covers the rest), at least 1."""
    return max(1, min(ceil_div(work, per_block), device.num_sms * blocks_per_sm))
