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
import struct
import threading
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
    return tuple(f"-I{d}" for d in [str(_header_dir(kernel_dir())), *cuda_include_dirs()])


@functools.cache
def _header_dir(src: Path) -> Path:
    """src's *.cuh copied into a temporary directory named by their digest: the include path is part of
    CuPy's cache key, so two checkouts with the same sources (ab_bench.sh's copies of the tree) share
    compiled modules instead of each compiling every family again (80 s of device time a copy)."""
    import shutil
    import tempfile

    target = Path(tempfile.gettempdir()) / f"cuengine-headers-{_headers_digest(src)}"
    if not target.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        for header in src.glob("*.cuh"):
            shutil.copyfile(header, staging / header.name)
        try:
            staging.rename(target)  # whole or not at all; another process may have got there first
        except OSError:
            shutil.rmtree(staging)
    return target


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


def compile_cubin(path: Path, arch: str, extra_options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """raw_kernels/<family>.cu compiled by NVRTC to a cubin for `arch` (e.g. "sm_90a"), with
    COMPILE_OPTIONS, the include paths and the -ftz=true that CuPy adds to the other modules, then
    `extra_options`; returns the cubin and the compile log (ptxas performance warnings land there, and
    with "--ptxas-options=-v" each kernel's registers, stack frame and spills)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(path.read_bytes(), path.name.encode(), 0, [], [])
    opts = [o.encode() for o in (f"-arch={arch}", *COMPILE_OPTIONS, *include_options(), "-ftz=true", *extra_options)]
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
    dependent = dependent and _dependent_launch_supported(device.index)
    with device.activate():
        _launch_packed(fn, grid, block, [_arg(a) for a in args], s.raw.ptr, shared_mem, dependent)


@functools.cache
def _dependent_launch_supported(device_index: int) -> bool:
    """Programmatic dependent launch needs sm_90+. CUENGINE_DEPENDENT_LAUNCH=0 turns it off (ordinary
    launches): to rule it out when chasing a race, or to profile each kernel's own time (under it a
    kernel's time includes its wait for the one before)."""
    import cupy

    if os.environ.get("CUENGINE_DEPENDENT_LAUNCH", "1") == "0":
        return False
    return int(cupy.cuda.Device(device_index).compute_capability) >= 90


# Parameter formats by NumPy scalar type: every parameter gets an 8-byte slot
_PARAM_FORMAT = {"Q": "Q", "L": "Q", "q": "q", "l": "q", "d": "d", "I": "I4x", "i": "i4x", "f": "f4x"}
_MAX_PARAMS = 64
_MAX_LAUNCH_CONFIGS = 4096


class _ParamSlots(threading.local):
    """One 8-byte slot per kernel parameter and the array of their addresses, reused by every launch of a
    thread: cuLaunchKernelEx copies the values before it returns. A NumPy array per parameter and a new
    launch config per call made a dependent launch cost 35 µs of host time; packed, 17.5, and an ordinary
    launch 14.9 against CuPy's own RawKernel call at 13.4-15.5 (H100 host, PERF_NOTES 37(d))."""

    def __init__(self):
        self.values = np.zeros(_MAX_PARAMS, np.uint64)
        self.pointers = np.uint64(self.values.ctypes.data) + 8 * np.arange(_MAX_PARAMS, dtype=np.uint64)
        self.address = self.pointers.ctypes.data


_slots = _ParamSlots()
_param_formats: dict = {}  # (kernel, parameter types) -> struct format
_launch_configs: dict = {}  # (kernel, grid, block, stream, shared memory, dependent) -> (CUlaunchConfig, CUfunction)


def _param_format(fn, args) -> str:
    key = (fn, *map(type, args))
    fmt = _param_formats.get(key)
    if fmt is None:
        if len(args) > _MAX_PARAMS:
            raise ValueError(f"a kernel launch takes at most {_MAX_PARAMS} parameters, got {len(args)}")
        chars = [a.dtype.char for a in args]
        if any(c not in _PARAM_FORMAT for c in chars):
            raise TypeError(f"kernel launch: parameter types {chars}; use pointers, 32/64-bit ints and floats")
        fmt = _param_formats[key] = "=" + "".join(_PARAM_FORMAT[c] for c in chars)
    return fmt


def _launch_config(fn, grid, block, stream_ptr: int, shared_mem: int, dependent: bool):
    """(CUlaunchConfig, CUfunction), made once per launch shape; a dependent launch's config allows
    programmatic stream serialization."""
    key = (fn, grid, block, stream_ptr, shared_mem, dependent)
    config = _launch_configs.get(key)
    if config is None:
        from cuda.bindings import driver

        if len(_launch_configs) >= _MAX_LAUNCH_CONFIGS:  # shapes of a long-gone workload
            _launch_configs.clear()
        config = driver.CUlaunchConfig()
        (config.gridDimX, config.gridDimY, config.gridDimZ) = (*map(int, grid), 1, 1)[:3]
        (config.blockDimX, config.blockDimY, config.blockDimZ) = (*map(int, block), 1, 1)[:3]
        config.sharedMemBytes = shared_mem
        config.hStream = driver.CUstream(stream_ptr)
        if dependent:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
        config = _launch_configs[key] = (config, driver.CUfunction(fn.kernel.ptr))
    return config


def _launch_packed(fn, grid, block, args, stream_ptr: int, shared_mem: int, dependent: bool) -> None:
    """cuLaunchKernelEx with the parameters packed into the thread's slots; `args` as _arg returns them."""
    from cuda.bindings import driver

    struct.pack_into(_param_format(fn, args), _slots.values, 0, *args)
    config, function = _launch_config(fn, grid, block, stream_ptr, shared_mem, dependent)
    (err,) = driver.cuLaunchKernelEx(config, function, _slots.address, 0)
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
