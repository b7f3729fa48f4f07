"""raw_kernels/rmsnorm.cu, fp8.cu, classifier.cu, adamw8bit.cu, rope.cu and activations.cu on the host, for
tests/test_kernel_emulation.py.

The fiber-per-thread machinery of tests/attention_emulator.py (barriers, warp shuffles, the launch
loop) with a common.cuh stand-in for the helpers these families use: bf16/fp16/fp8 types and
conversions (fp8 SATFINITE round-to-nearest-even by search over the 256 codes; the paired fp16 one
as two single ones), 16-byte packs that fail on a misaligned access, __reduce_max_sync, atomicMax
and cp.async (the attention emulator's: a copy reads global memory and lands only at its wait, so a
missing wait or a row staged after it was overwritten shows). Static shared arrays are plain
statics (blocks run one after another); rmsnorm's dynamic shared memory is the emulator's buffer.
The real launchers drive it (their `launch` is redirected), so grids, variants, tails and index
arithmetic are checked without a GPU; register limits and timing are not.
"""

import ctypes
import shutil
import subprocess

import attention_emulator as AE
import numpy as np

import cuengine as ce
from cuengine.kernels import _build
from cuengine.kernels._build import kernel_dir

# The attention emulator's fibers, barriers and bf16, and its cp.async (a copy lands at its wait), without
# its other PTX helpers; min/max come from <algorithm>.
_PTX = AE.EMU_HEADER.index("// ---- the PTX helpers, emulated ----")
_BASE = (
    AE.EMU_HEADER[: AE.EMU_HEADER.index("inline uint16_t sm16", _PTX)]
    .replace("#define __align__(n) alignas(n)", "#define __align__(n) alignas(n)\n#define __shared__ static")
    .replace("inline int min(int a, int b) { return a < b ? a : b; }", "")
    .replace("struct alignas(16) int4 { int x, y, z, w; };", "")
)
_COMMON = r"""
#include <algorithm>
using std::min; using std::max; using std::isfinite;
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
struct uint2 { unsigned x, y; }; struct alignas(16) uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
struct WarpU { unsigned u[32]; };
extern WarpU g_wu[32];
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    WarpU& w = g_wu[threadIdx.x >> 5]; int l = lane_();
    w.u[l] = v; wbar(); unsigned r = 0; for (int i = 0; i < 32; ++i) r = r > w.u[i] ? r : w.u[i]; wbar(); return r;
}
inline float __shfl_sync(unsigned, float v, int src) {  // rmsnorm.cu: a row's rstd from the lane holding it
    WarpX& w = warp_(); int l = lane_();
    w.f[l] = v; wbar(); float r = w.f[src & 31]; wbar(); return r;
}
inline unsigned atomicMax(unsigned* p, unsigned v) { unsigned o = *p; if (v > o) *p = v; return o; }
typedef _Float16 half;
inline float __half2float(half h) { return (float)h; }
inline half __float2half_rn(float f) { return (half)f; }
inline half __ushort_as_half(unsigned short u) { half h; memcpy(&h, &u, 2); return h; }
inline unsigned short __half_as_ushort(half h) { unsigned short u; memcpy(&u, &h, 2); return u; }  // rope.cu
struct half2 { half x, y; };
inline half2 __floats2half2_rn(float a, float b) { return {(half)a, (half)b}; }
// explicitly rounded fp32 intrinsics (adamw.cu, adamw8bit.cu): host IEEE arithmetic, and x86-64 g++ has
// no FMA to contract them into
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline bf16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline float fp8_decode(unsigned char c, int e5) {
    int s = c >> 7, e, m; float v;
    if (!e5) {
        e = (c >> 3) & 15; m = c & 7;
        if (e == 15 && m == 7) return NAN;
        v = e ? ldexpf(1 + m / 8.f, e - 7) : ldexpf(m / 8.f, -6);
    } else {
        e = (c >> 2) & 31; m = c & 3;
        if (e == 31) return m ? NAN : INFINITY;
        v = e ? ldexpf(1 + m / 4.f, e - 15) : ldexpf(m / 4.f, -14);
    }
    return s ? -v : v;
}
inline unsigned char __nv_cvt_float_to_fp8(float x, __nv_saturation_t, __nv_fp8_interpretation_t k) {
    int e5 = k == __NV_E5M2; float lim = e5 ? 57344.f : 448.f;
    if (x != x) return e5 ? 0x7f : 0x7f;
    if (x > lim) x = lim; if (x < -lim) x = -lim;
    int best = -1; double bd = 1e300;
    for (int c = 0; c < 256; ++c) { float v = fp8_decode(c, e5); if (!(v == v) || std::isinf(v)) continue;
        if (v == 0 && (c & 0x80)) continue;
        double d = fabs((double)v - x); if (d < bd || (d == bd && (c & 1) == 0)) { bd = d; best = c; } }
    if (fp8_decode(best, e5) == 0 && std::signbit(x)) best = 0x80;
    return (unsigned char)best;
}
inline unsigned short __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t s, __nv_fp8_interpretation_t k) {
    return __nv_cvt_float_to_fp8(v.x, s, k) | (__nv_cvt_float_to_fp8(v.y, s, k) << 8);
}
struct __nv_fp8_e4m3 { unsigned char __x; operator float() const { return fp8_decode(__x, 0); } };
struct __nv_fp8_e5m2 { unsigned char __x; operator float() const { return fp8_decode(__x, 1); } };
typedef __nv_fp8_e4m3 fp8e4; typedef __nv_fp8_e5m2 fp8e5;
inline float to_float(half x) { return (float)x; }
inline float to_float(fp8e4 x) { return float(x); }
inline float to_float(fp8e5 x) { return float(x); }
template <> inline half from_float<half>(float x) { return (half)x; }
template <> inline fp8e4 from_float<fp8e4>(float x) {
    fp8e4 r; r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); return r;
}
template <> inline fp8e5 from_float<fp8e5>(float x) {
    fp8e5 r; r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); return r;
}
#define STAT_ABS_MAX 0
#define STAT_SCALE 4
#define STAT_SCALE_INV 8
template <typename T> struct fp8_limits { static constexpr float max = 0.f; };
template <> struct fp8_limits<fp8e4> { static constexpr float max = 448.f; };
template <> struct fp8_limits<fp8e5> { static constexpr float max = 57344.f; };
template <typename T> struct alignas(16) Pack16 {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
    static Pack16 load(const T* p) {
        if ((uintptr_t)p % 16) fail("misaligned Pack16 load");
        return *reinterpret_cast<const Pack16*>(p);
    }
    void store(T* p) const {
        if ((uintptr_t)p % 16) fail("misaligned Pack16 store");
        *reinterpret_cast<Pack16*>(p) = *this;
    }
};
inline void cp_async16(unsigned dst, const void* src) { cp_async16(dst, src, 16); }  // cp_async.cuh's 2-operand form
inline unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
// cache-hinted global loads and stores (adamw8bit.cu): plain accesses that fail when misaligned
template <typename T> inline T __ldcs(const T* p) {
    if ((uintptr_t)p % sizeof(T)) fail("misaligned __ldcs");
    return *p;
}
template <typename T> inline void __stcs(T* p, T v) {
    if ((uintptr_t)p % sizeof(T)) fail("misaligned __stcs");
    *p = v;
}
// common.cuh's dependent-launch calls and fences (no-ops: blocks run one after another) and its loads
// through L2 (plain); its block_sum itself follows (_REAL)
inline void grid_dependency_wait() {}
inline void launch_dependents() {}
inline void __threadfence() {}
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline float load_cg(const float* p) { return *p; }
inline bf16 load_cg(const bf16* p) { return *p; }
inline void block_atomic_abs_max(float* dst, unsigned bits) {
    static unsigned s_bits[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (lane == 0) s_bits[warp] = bits;
    __syncthreads();
    if (warp == 0) {
        bits = lane < (int)(blockDim.x + 31) / 32 ? s_bits[lane] : 0u;
        bits = __reduce_max_sync(0xffffffffu, bits);
        if (lane == 0 && bits) atomicMax(reinterpret_cast<unsigned*>(dst), bits);
    }
}
"""

# classifier.cu's PTX helpers (its "// ---- PTX helpers" section is swapped for these; cp.async is the
# attention emulator's, in _BASE: copies land at the wait, so a missing wait reads the 0xff fill);
# ex2.approx.ftz
# flushes results below 2^-126 to 0 as MUFU.EX2 does; bf16x2 max/min let a NaN lane yield to the
# other (both NaN: 0x7fff) and prefer +0 (max) or -0 (min) between zeros, as HMNMX2 does.
_CLASSIFIER_HELPERS = r"""
inline uint4 ld_shared16(unsigned addr) {
    uint4 v{};
    if (addr % 16 || addr + 16 > g_smem_size) { fail("ld.shared outside the dynamic shared memory"); return v; }
    memcpy(&v, g_smem + addr, 16);
    return v;
}
inline void prefetch_l2(const void*) {}
inline float ex2_ftz(float x) { const float y = exp2f(x); return y < 0x1p-126f ? 0.f : y; }
inline unsigned bf16_pick(unsigned a, unsigned b, bool mx) {
    const float fa = __uint_as_float(a << 16), fb = __uint_as_float(b << 16);
    if (fa != fa) return fb != fb ? 0x7fffu : b;
    if (fb != fb) return a;
    if (fa == fb) return ((a >> 15) == (unsigned)mx) ? b : a;  // zeros of both signs: +0 for max, -0 for min
    return (fa > fb) == mx ? a : b;
}
inline unsigned bf16x2_max(unsigned a, unsigned b) {
    return bf16_pick(a & 0xffff, b & 0xffff, true) | bf16_pick(a >> 16, b >> 16, true) << 16;
}
inline unsigned bf16x2_min(unsigned a, unsigned b) {
    return bf16_pick(a & 0xffff, b & 0xffff, false) | bf16_pick(a >> 16, b >> 16, false) << 16;
}
inline unsigned bf16x2_pack(float lo, float hi) {
    return (unsigned)__float2bfloat16_rn(lo).x | (unsigned)__float2bfloat16_rn(hi).x << 16;
}
inline unsigned u16x2_max(unsigned a, unsigned b) {
    return std::max(a & 0xffff, b & 0xffff) | std::max(a >> 16, b >> 16) << 16;
}
"""


# Functions of raw_kernels/common.cuh that the emulator compiles as they are (the stand-in header
# defines away __device__ and __forceinline__).
_REAL = ("block_sum", "fp8_scale")


def _real_functions() -> str:
    text = (_build.kernel_dir() / "common.cuh").read_text()  # the real one, whatever kernel_dir a test points at
    out = []
    for name in _REAL:
        a = text.index(f" {name}(")
        a = text.rindex("\n", 0, a) + 1
        out.append(text[a : text.index("\n}\n", a) + 3])
    return "".join(out)


def or_skip(built):
    """`built` (a library or launcher this module or attention_emulator built), or skip the test
    when it is None: without g++ there is nothing to emulate the kernels with."""
    if built is None:
        import pytest

        pytest.skip("g++ is needed to emulate the CUDA kernels on the host")
    return built


def build(family, kernels, workdir):
    """Compile raw_kernels/<family>.cu with the stand-ins into workdir; the library, or None without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    src = (kernel_dir() / f"{family}.cu").read_text()
    src = src.replace("extern __shared__ float s_dweight[];", "float* s_dweight = (float*)g_smem;")
    src = src.replace(  # classifier.cu's row cache
        "extern __shared__ __align__(16) unsigned char s_cache_bytes[];", "unsigned char* s_cache_bytes = g_smem;"
    )
    if family == "activations":  # host exp and division for MUFU's
        src = src.replace("return __fdividef(1.f, 1.f + __expf(-x));", "return 1.f / (1.f + expf(-x));")
    if family == "classifier":
        a, b = src.index("// ---- PTX helpers"), src.index("// ---- end of PTX helpers ----")
        src = src[:a] + _CLASSIFIER_HELPERS + src[b:]
    (workdir / f"{family}_emu.cu").write_text(src)
    (workdir / "common.cuh").write_text(_BASE + _COMMON + _real_functions())
    (workdir / "cp_async.cuh").write_text("")  # its helpers are the attention emulator's, in _BASE
    main = AE.EMU_MAIN.replace('#include "attention_emu.cu"', f'#include "{family}_emu.cu"')
    a = main.index("static const Entry kernels[] = {")
    b = main.index("};", a)
    main = main[:a] + "static const Entry kernels[] = {" + ", ".join(f"K({k})" for k in kernels) + main[b:]
    main = main.replace("WarpX g_warps[32];", "WarpX g_warps[32];\nWarpU g_wu[32];")
    (workdir / f"{family}_main.cpp").write_text(main)
    out = workdir / f"lib{family}.so"
    done = subprocess.run(
        [gxx, "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-o", str(out), str(workdir / f"{family}_main.cpp")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[:5000]
    lib = ctypes.CDLL(str(out))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_error.restype = ctypes.c_char_p
    return lib


class EmulatedCuda(AE.EmulatedCuda):
    num_sms = 4  # grid-stride kernels size their grids by it
    compute_capability = (9, 0)  # the classifier sizes its shared-memory row cache by it


def launch(lib, family, name, grid, block, args, device, stream=None, shared_mem=0, dependent=False):
    """kernels._build.launch for the emulator: `lib` from build(), the other arguments as launch takes them
    (`dependent` changes nothing: blocks run one after another, launches too)."""
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    gx, gy, gz = (*grid, 1, 1)[:3]
    vals = []
    for x in args:
        if x is None:
            vals.append(ctypes.c_void_p(0))
        elif isinstance(x, ce.Tensor):
            vals.append(ctypes.c_void_p(x.ptr))
        elif isinstance(x, np.int32):
            vals.append(ctypes.c_int(int(x)))
        elif isinstance(x, np.int64):
            vals.append(ctypes.c_longlong(int(x)))
        elif isinstance(x, np.float32):
            vals.append(ctypes.c_float(float(x)))
        else:
            raise TypeError(f"{name}: argument {x!r}")
    argv = (ctypes.c_void_p * len(vals))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals))
    rc = lib.emu_launch(name.encode(), gx, gy, gz, int(block), int(shared_mem), argv)
    assert rc == 0, f"emulated launch of {name} failed ({rc}): {lib.emu_error().decode()}"


DEV = EmulatedCuda()


def tensor(values, dtype, name="t", pad=4096):
    """A tensor in host memory on the emulated device, with 0xA5 canary margins on both sides."""
    dt = ce.dtype(dtype)
    raw = np.ascontiguousarray(np.asarray(values).astype(dt.np)).reshape(-1).view(np.uint8)
    storage = np.full(raw.size + 2 * pad, 0xA5, np.uint8)
    storage[pad : pad + raw.size] = raw
    return ce.Tensor(dt, np.shape(values), DEV, storage, pad, name)


def margins_ok(x) -> bool:
    """Nothing was written outside the tensor."""
    m = np.concatenate([x.storage[: x.offset], x.storage[x.offset + x.nbytes :]])
    return np.all(m == 0xA5)


def adamw8bit_launcher(workdir):
    """A `launch` for adamw8bit.cu's per-tensor and multi-tensor kernels (every dtype pair) on the
    host, built in `workdir`; None without g++. The seed (a u32) travels as the int32 of its bits."""
    import numpy as np

    names = [f"adamw8bit{m}_{p}_{g}" for m in ("", "_multi") for p in ("f32", "bf16") for g in ("f32", "bf16")]
    shutil.copy(kernel_dir() / "sr_hash.cuh", workdir)
    lib = build("adamw8bit", names, workdir)
    if lib is None:
        return None

    def run(family, name, grid, block, args, *a, **kw):
        args = tuple(np.int32(np.array(x, np.uint32).view(np.int32)) if isinstance(x, np.uint32) else x for x in args)
        launch(lib, family, name, grid, block, args, *a, **kw)

    return run
