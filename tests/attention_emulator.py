"""raw_kernels/attention.cu on the host, for tests/test_attention.py.

raw_kernels/attention.cu compiled by g++ with its PTX helpers (ldmatrix, mma.sync, cp.async,
ex2) swapped for host emulations that follow the PTX ISA fragment layouts; every CUDA thread is a
fiber and warp collectives synchronise them. The real launchers drive it (their `launch` is
redirected), so grids, shared-memory sizes, tiles, swizzles, masks and fragment shuffles are all
checked against the twin without a GPU. Races are provoked, not proven absent: copies land either
at the wait or at issue while warps run at different speeds. Register limits are not checked.
"""

import ctypes
import shutil
import subprocess

import numpy as np

import cuengine as ce
from cuengine.kernels._build import kernel_dir

EMU_HEADER = r"""
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
struct Dim3 { unsigned x, y, z; };
struct Copy { unsigned dst; const void* src; int n; };
struct Fiber {
    ucontext_t ctx; std::vector<char> stack; Dim3 tid; bool done;
    std::vector<std::vector<Copy>> groups; std::vector<Copy> open;
};
extern Fiber* g_cur;
extern Dim3 gridDim, blockIdx, blockDim;
extern size_t g_smem_size;
extern unsigned char g_smem[];
#define threadIdx (g_cur->tid)
void yield_();
extern const char* g_error;  // the first failure; the launch then reports it instead of crashing
extern long g_progress;      // barrier releases and finished threads: no change in a while = deadlock
extern int g_eager;          // 1: cp.async lands at issue, and the scheduler stalls threads at random
inline bool fail(const char* what) { if (!g_error) g_error = what; return false; }
struct Barrier { int arrived = 0; long gen = 0; };
inline void barrier_wait(Barrier& b, int count) {
    long gen = b.gen;
    if (++b.arrived == count) { b.arrived = 0; b.gen++; g_progress++; return; }
    while (b.gen == gen) yield_();
}
struct WarpX { Barrier bar; float f[32]; unsigned addr[32], a[32][4], b[32][2]; float c[32][4]; };
extern WarpX g_warps[32];
extern Barrier g_block_bar;
inline int lane_() { return threadIdx.x & 31; }
inline WarpX& warp_() { return g_warps[threadIdx.x >> 5]; }
inline void wbar() { barrier_wait(warp_().bar, 32); }
inline void __syncthreads() { barrier_wait(g_block_bar, blockDim.x); }
inline void __syncwarp() { wbar(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
    WarpX& w = warp_(); int l = lane_();
    w.f[l] = v; wbar(); float r = w.f[l ^ m]; wbar(); return r;
}
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat16 bf16;
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fc0};
    return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
inline float warp_sum(float x) { for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o); return x; }
struct alignas(16) int4 { int x, y, z, w; };
inline unsigned long __cvta_generic_to_shared(const void* p) { return (const unsigned char*)p - g_smem; }
// ---- the PTX helpers, emulated ----
inline unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
inline void cp_async16(unsigned dst, const void* src, int n) {
    if (dst % 16 || (uintptr_t)src % 16) fail("misaligned cp.async");
    if (dst + 16 > g_smem_size) { fail("cp.async past the dynamic shared memory"); return; }
    if (g_eager) { memset(g_smem + dst, 0, 16); if (n) memcpy(g_smem + dst, src, n); return; }
    g_cur->open.push_back({dst, src, n});
}
inline void cp_async_commit() { g_cur->groups.push_back(g_cur->open); g_cur->open.clear(); }
template <int N> inline void cp_async_wait() {  // copies land only now, so a missing wait shows
    auto& gs = g_cur->groups;
    while ((int)gs.size() > N) {
        for (auto& c : gs.front()) { memset(g_smem + c.dst, 0, 16); if (c.n) memcpy(g_smem + c.dst, c.src, c.n); }
        gs.erase(gs.begin());
    }
}
inline uint16_t sm16(unsigned a) { uint16_t v; memcpy(&v, g_smem + a, 2); return v; }
inline void ldsm(unsigned (&r)[4], unsigned addr, bool trans) {
    WarpX& w = warp_(); int l = lane_(), g = l >> 2, t = l & 3;
    w.addr[l] = addr % 16 || addr + 16 > g_smem_size ? fail("bad ldmatrix row address") : addr;
    wbar();
    for (int i = 0; i < 4; ++i) {  // thread l: row l/4, columns 2(l%4) and +1; transposed with .trans
        uint16_t lo = trans ? sm16(w.addr[8 * i + 2 * t] + 2 * g) : sm16(w.addr[8 * i + g] + 4 * t);
        uint16_t hi = trans ? sm16(w.addr[8 * i + 2 * t + 1] + 2 * g) : sm16(w.addr[8 * i + g] + 4 * t + 2);
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    wbar();
}
inline void ldsm_x4(unsigned (&r)[4], unsigned addr) { ldsm(r, addr, false); }
inline void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) { ldsm(r, addr, true); }
inline float half_(unsigned v, int hi) { return __bfloat162float({(uint16_t)(hi ? v >> 16 : v & 0xffff)}); }
inline void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    WarpX& w = warp_(); int l = lane_();
    for (int i = 0; i < 4; ++i) { w.a[l][i] = a[i]; w.c[l][i] = c[i]; }
    w.b[l][0] = b0; w.b[l][1] = b1; wbar();
    float A[16][16], B[16][8];
    for (int ln = 0; ln < 32; ++ln) {  // m16n8k16 fragments: g = lane/4, t = lane%4
        int g = ln >> 2, t = ln & 3;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = half_(w.a[ln][0], h); A[g + 8][2 * t + h] = half_(w.a[ln][1], h);
            A[g][2 * t + 8 + h] = half_(w.a[ln][2], h); A[g + 8][2 * t + 8 + h] = half_(w.a[ln][3], h);
            B[2 * t + h][g] = half_(w.b[ln][0], h); B[2 * t + 8 + h][g] = half_(w.b[ln][1], h);
        }
    }
    int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) {
        int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float acc = w.c[l][i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        c[i] = acc;
    }
    wbar();
}
inline unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return (unsigned)v.x.x | ((unsigned)v.y.x << 16);
}
inline float fast_exp2(float x) { return exp2f(x); }
"""

EMU_MAIN = r"""
#include "attention_emu.cu"
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
Fiber* g_cur;
const char* g_error;
long g_progress;
int g_eager;
Dim3 gridDim, blockIdx, blockDim;
size_t g_smem_size;
alignas(128) unsigned char g_smem[232448];
WarpX g_warps[32];
Barrier g_block_bar;
static ucontext_t sched_ctx;
static std::function<void()> g_body;
void yield_() { swapcontext(&g_cur->ctx, &sched_ctx); }
static void trampoline() { g_body(); g_cur->done = true; }
// Call a kernel with its arguments from an array of pointers to them (as cuLaunchKernel takes them).
template <typename... A, size_t... I> void call_impl(void (*fn)(A...), void** a, std::index_sequence<I...>) {
    fn(*reinterpret_cast<std::remove_reference_t<A>*>(a[I])...);
}
template <typename... A> void call(void (*fn)(A...), void** a) { call_impl(fn, a, std::index_sequence_for<A...>{}); }
#define K(NAME) {#NAME, [](void** a) { call(NAME, a); }}
struct Entry { const char* name; void (*call)(void**); };
static const Entry kernels[] = {
    K(attention_forward_flash_hs64_bf16), K(attention_forward_flash_hs128_bf16),
    K(attention_backward_dq_flash_hs64_bf16), K(attention_backward_dq_flash_hs128_bf16),
    K(attention_backward_dkdv_flash_hs64_bf16), K(attention_backward_dkdv_flash_hs128_bf16),
    K(attention_forward_simt_f32), K(attention_backward_dot_f32), K(attention_backward_dq_simt_f32),
    K(attention_backward_dkdv_simt_f32), K(attention_forward_simt_bf16), K(attention_backward_dot_bf16),
    K(attention_backward_dq_simt_bf16), K(attention_backward_dkdv_simt_bf16),
};
extern "C" void emu_set_eager(int on) { g_eager = on; }
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned block, size_t smem,
                          void** args) {
    const Entry* k = nullptr;
    for (const Entry& e : kernels) if (std::string(e.name) == name) k = &e;
    if (!k) return -1;
    if (smem > sizeof(g_smem) || block > 1024 || block % 32) return -2;
    g_error = nullptr;
    gridDim = {gx, gy, gz}; blockDim = {block, 1, 1}; g_smem_size = smem;
    g_body = [&] { k->call(args); };
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        memset(g_smem, 0xff, sizeof(g_smem));  // NaN: reading shared memory nobody wrote shows up
        g_block_bar = Barrier();
        for (WarpX& w : g_warps) w.bar = Barrier();
        std::vector<Fiber> f(block);
        for (unsigned i = 0; i < block; ++i) {
            f[i].stack.resize(128 * 1024); f[i].tid = {i, 0, 0}; f[i].done = false;
            getcontext(&f[i].ctx);
            f[i].ctx.uc_stack.ss_sp = f[i].stack.data(); f[i].ctx.uc_stack.ss_size = f[i].stack.size();
            f[i].ctx.uc_link = &sched_ctx;
            makecontext(&f[i].ctx, trampoline, 0);
        }
        // Eager mode: warps run at different speeds (rank r of n sits out a pass with odds r / 2n,
        // ranks rotating with the block), so fast warps get far ahead of slow ones between barriers.
        unsigned long rng = 88172645463325252ull + x + 7 * y + 131 * z;  // xorshift
        const unsigned nw = block / 32;
        for (unsigned left = block, idle = 0; left && !g_error;) {
            long before = g_progress;
            for (unsigned i = 0; i < block; ++i) {
                if (f[i].done) continue;
                if (g_eager && i % 32 == 0) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; }
                if (g_eager && rng % (2 * nw) < (i / 32 + x + y) % nw) continue;
                g_cur = &f[i];
                swapcontext(&sched_ctx, &f[i].ctx);
                if (f[i].done) {
                    left--;
                    g_progress++;
                    for (auto& gr : f[i].groups)
                        if (!gr.empty()) fail("thread exits with cp.async copies never waited for");
                }
            }
            idle = g_progress == before ? idle + 1 : 0;
            if (left && idle > 64) fail("deadlock: threads wait at barriers that never release");
        }
        if (g_error) return -3;
    }
    return 0;
}
extern "C" const char* emu_error() { return g_error ? g_error : ""; }
"""


class EmulatedCuda:
    """A stand-in for a cuda Device whose memory is host memory and whose kernels run in the emulator."""

    kind, index, name, is_cuda, is_cpu = "cuda", 0, "emulated", True, False


def build(workdir):
    """Compile attention.cu with the emulated helpers into workdir; the loaded library, or None without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    src = (kernel_dir() / "attention.cu").read_text()
    a = src.index("// ---- PTX helpers")
    decl = "extern __shared__ __align__(128) unsigned char att_smem[];\n"
    b = src.index(decl)
    (workdir / "attention_emu.cu").write_text(src[:a] + "#define att_smem g_smem\n" + src[b + len(decl) :])
    (workdir / "common.cuh").write_text(EMU_HEADER)
    (workdir / "cp_async.cuh").write_text("")  # cp_async.cuh's helpers are emulated in EMU_HEADER
    (workdir / "emu.cpp").write_text(EMU_MAIN)
    out = workdir / "libemu.so"
    cmd = [gxx, "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-o", str(out), str(workdir / "emu.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_error.restype = ctypes.c_char_p
    return lib


def launch(lib, family, name, grid, block, args, device, stream=None, shared_mem=0):
    """kernels._build.launch for the emulator: `lib` from build(), the other arguments as launch takes them."""
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (int(grid),)
    gx, gy, gz = (*grid, 1, 1)[:3]
    vals = []
    for x in args:
        if isinstance(x, ce.Tensor):
            vals.append(ctypes.c_void_p(x.ptr))
        elif isinstance(x, np.int32):
            vals.append(ctypes.c_int(int(x)))
        elif isinstance(x, np.float32):
            vals.append(ctypes.c_float(float(x)))
        else:
            raise TypeError(f"{name}: argument {x!r}")
    argv = (ctypes.c_void_p * len(vals))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals))
    rc = lib.emu_launch(name.encode(), gx, gy, gz, int(block), int(shared_mem), argv)
    assert family == "attention" and rc == 0, f"emulated launch of {name} failed ({rc}): {lib.emu_error().decode()}"
