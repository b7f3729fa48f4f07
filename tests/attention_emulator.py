"""raw_kernels/attention.cu and attention_sm90.cu on the host, for tests/test_attention.py.

Each file compiled by g++ with its PTX helpers (ldmatrix, mma.sync, cp.async, ex2; wgmma and its
fences) swapped for host emulations that follow the PTX ISA fragment layouts; every CUDA thread is
a fiber and warp (warpgroup) collectives synchronise them. wgmma reads its shared-memory operands
through the matrix descriptors (start address, leading and stride byte offsets, the 128-byte
swizzle applied to the address bits, K-major or N-major B) and its A operand from the warpgroup's
registers in the fragment layout, and, like cp.async, delivers its accumulators only at
wgmma.wait_group: an accumulator read too early, or an operand overwritten before the wait, shows.
The real launchers drive it (their `launch` is redirected), so grids, shared-memory sizes, tiles,
swizzles, masks and fragment shuffles are all checked against the twin without a GPU. Races are
provoked, not proven absent: copies land either at the wait or at issue while warps run at
different speeds. Register limits are not checked.
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
// one wgmma.mma_async: d (n/2 floats of this thread) = A B (+ d), A from a descriptor or from the
// warpgroup's register slot `slot`, B from a descriptor (N-major when trans_b)
struct WgOp { float* d; int n; unsigned long long da, db; bool a_reg; int slot; bool trans_b; int scale_d; };
struct Fiber {
    ucontext_t ctx; std::vector<char> stack; Dim3 tid; bool done;
    std::vector<std::vector<Copy>> groups; std::vector<Copy> open;
    std::vector<std::vector<WgOp>> wg_groups; std::vector<WgOp> wg_open;
    bool wg_fenced, proxy_dirty; int wg_issued;
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
    if (g_eager) {
        memset(g_smem + dst, 0, 16); if (n) memcpy(g_smem + dst, src, n);
        g_cur->proxy_dirty = true; return;
    }
    g_cur->open.push_back({dst, src, n});
}
inline void cp_async_commit() { g_cur->groups.push_back(g_cur->open); g_cur->open.clear(); }
template <int N> inline void cp_async_wait() {  // copies land only now, so a missing wait shows
    auto& gs = g_cur->groups;
    while ((int)gs.size() > N) {
        for (auto& c : gs.front()) { memset(g_smem + c.dst, 0, 16); if (c.n) memcpy(g_smem + c.dst, c.src, c.n); }
        if (!gs.front().empty()) g_cur->proxy_dirty = true;  // generic-proxy writes: wgmma needs a proxy fence
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

# wgmma (attention_sm90.cu only), after EMU_HEADER
WGMMA_EMU = r"""
#define HAS_WGMMA
struct WarpGroupX { Barrier bar; std::vector<unsigned> a; };  // a[(slot * 128 + thread) * 4 + i]
extern WarpGroupX g_wgs[8];
inline void __trap() { fail("__trap"); }
inline WarpGroupX& wg_() { return g_wgs[threadIdx.x >> 7]; }
template <int R> inline void fence_acc(float (&)[R]) {}
inline void wgmma_fence() { g_cur->wg_fenced = true; }
extern Barrier g_named[16];  // bar.sync / bar.arrive with ids 1..15
inline void named_sync(int id, int n) { barrier_wait(g_named[id], n); }
inline void named_arrive(int id, int n) {
    Barrier& b = g_named[id];
    if (++b.arrived == n) { b.arrived = 0; b.gen++; g_progress++; }
}
inline void fence_proxy_async() { g_cur->proxy_dirty = false; }
inline void wg_issue(float* d, int n, unsigned long long da, const unsigned* a, unsigned long long db, bool trans_b,
                     int scale_d) {
    if (!g_cur->wg_fenced) fail("wgmma.mma_async without a wgmma.fence since the last wait");
    if (g_cur->proxy_dirty) fail("wgmma reads shared memory that cp.async wrote, without fence.proxy.async");
    WarpGroupX& w = wg_();
    const int slot = g_cur->wg_issued++;
    if (a) {
        if (w.a.size() < (size_t)(slot + 1) * 512) w.a.resize((size_t)(slot + 1) * 512);
        memcpy(&w.a[((size_t)slot * 128 + (threadIdx.x & 127)) * 4], a, 16);
    }
    g_cur->wg_open.push_back({d, n, da, db, a != nullptr, slot, trans_b, scale_d});
    barrier_wait(w.bar, 128);  // .sync.aligned: the warpgroup issues together
}
template <int N> inline void wgmma_ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, int scale_d) {
    wg_issue(d, N, da, nullptr, db, false, scale_d);
}
template <int N>
inline void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    wg_issue(d, N, 0, a, db, true, scale_d);
}
inline void wgmma_commit() { g_cur->wg_groups.push_back(g_cur->wg_open); g_cur->wg_open.clear(); }
// One bf16 of a 128-byte-swizzled operand: the 16-byte chunk bits 4-6 of the address XOR bits 7-9.
inline float sw128_at(unsigned addr) {
    const unsigned a = addr ^ (((addr >> 7) & 7u) << 4);
    if (a + 2 > g_smem_size) { fail("wgmma operand past the dynamic shared memory"); return 0.f; }
    return __bfloat162float({sm16(a)});
}
struct Desc { unsigned start, lbo, sbo; };
inline Desc desc_(unsigned long long d) {
    if (d >> 62 != 1) fail("wgmma descriptor: only the 128-byte swizzle is emulated");
    if ((d >> 49) & 7) fail("wgmma descriptor: base offset must be 0");
    return {(unsigned)(d & 0x3FFF) << 4, (unsigned)((d >> 16) & 0x3FFF) << 4, (unsigned)((d >> 32) & 0x3FFF) << 4};
}
inline void wg_run(const WgOp& op) {  // this thread's accumulators of one m64nNk16
    const int t = threadIdx.x & 127, w = t >> 5, g = (t & 31) >> 2, tq = t & 3;
    const Desc A = desc_(op.a_reg ? (1ull << 62) : op.da), B = desc_(op.db);
    const unsigned* areg = op.a_reg ? &wg_().a[(size_t)op.slot * 512] : nullptr;
    for (int i = 0; i < op.n / 2; ++i) {
        const int row = 16 * w + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * tq + (i & 1);
        float acc = op.scale_d ? op.d[i] : 0.f;
        for (int k = 0; k < 16; ++k) {
            float a;
            if (areg) {  // row m, column k of the m64k16 fragment: warp m / 16, the m16k16 layout of mma.sync
                const int th = (row >> 4) * 32 + (row & 7) * 4 + (k & 7) / 2, r = ((row & 15) >> 3) + 2 * (k >> 3);
                a = half_(areg[th * 4 + r], k & 1);
            } else {  // K-major: 8-row groups sbo apart, rows 128 bytes apart, k contiguous
                a = sw128_at(A.start + (row >> 3) * A.sbo + (row & 7) * 128 + 2 * k);
            }
            // B N-major: 64-column halves lbo apart, 8-row (k) groups sbo apart, n contiguous
            const float b = op.trans_b ? sw128_at(B.start + (col >> 6) * B.lbo + (k >> 3) * B.sbo + (k & 7) * 128
                                                  + 2 * (col & 63))
                                       : sw128_at(B.start + (col >> 3) * B.sbo + (col & 7) * 128 + 2 * k);
            acc += a * b;
        }
        op.d[i] = acc;
    }
}
template <int N> inline void wgmma_wait() {  // accumulators land only now, so a missing wait shows
    auto& gs = g_cur->wg_groups;
    while ((int)gs.size() > N) {
        for (auto& op : gs.front()) wg_run(op);
        gs.erase(gs.begin());
    }
    g_cur->wg_fenced = false;
}
"""

EMU_MAIN = r"""
#include "attention_emu.cu"
#ifndef HAS_WGMMA
struct WarpGroupX { Barrier bar; std::vector<unsigned> a; };
#endif
Barrier g_named[16];
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
alignas(1024) unsigned char g_smem[232448];
WarpX g_warps[32];
WarpGroupX g_wgs[8];
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
static const Entry kernels[] = {KERNEL_TABLE};
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
        for (WarpGroupX& w : g_wgs) { w.bar = Barrier(); w.a.clear(); }
        for (Barrier& b : g_named) b = Barrier();
        std::vector<Fiber> f(block);
        for (unsigned i = 0; i < block; ++i) {
            f[i].stack.resize(128 * 1024); f[i].tid = {i, 0, 0}; f[i].done = false;
            f[i].wg_fenced = f[i].proxy_dirty = false; f[i].wg_issued = 0;
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
                    if (!f[i].wg_groups.empty() || !f[i].wg_open.empty())
                        fail("thread exits with wgmma never waited for");
                }
            }
            idle = g_progress == before ? idle + 1 : 0;
            if (left && idle > 64) fail("deadlock: threads wait at barriers that never release");
        }
        for (Barrier& b : g_named)
            if (b.arrived) fail("a named barrier is left with arrivals that no bar.sync took");
        if (g_error) return -3;
    }
    return 0;
}
extern "C" const char* emu_error() { return g_error ? g_error : ""; }
"""


class EmulatedCuda:
    """A stand-in for a cuda Device whose memory is host memory and whose kernels run in the emulator
    (an H100/H200 as far as the launchers ask: compute capability 9.0)."""

    kind, index, name, is_cuda, is_cpu, compute_capability = "cuda", 0, "emulated", True, False, (9, 0)


# The kernels each family's library can launch (the names cuengine/kernels/attention.py uses).
KERNELS = {
    "attention": [
        f"attention_{k}_bf16"
        for hs in (64, 128)
        for k in (f"forward_flash_hs{hs}", f"backward_dq_flash_hs{hs}", f"backward_dkdv_flash_hs{hs}")
    ]
    + [
        f"attention_{k}_{t}"
        for t in ("f32", "bf16")
        for k in ("forward_simt", "backward_dot", "backward_dq_simt", "backward_dkdv_simt")
    ],  # fmt: skip
    "attention_sm90": [f"wgmma_probe_hs{hs}_bc{bc}" for hs, bc in ((64, 64), (128, 64), (128, 128))]
    + [f"attention_forward_sm90_hs{hs}_bf16" for hs in (64, 128)]
    + [f"attention_backward_{k}_sm90_hs{hs}_bf16" for hs in (64, 128) for k in ("dq", "dkdv")],
}


def build(workdir, family="attention"):
    """Compile raw_kernels/<family>.cu with the emulated helpers into workdir; the loaded library, or
    None without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    src = (kernel_dir() / f"{family}.cu").read_text()
    a = src.index("// ---- PTX helpers")
    decl = "extern __shared__ __align__(128) unsigned char att_smem[];\n"
    b = src.index(decl)
    (workdir / "attention_emu.cu").write_text(src[:a] + "#define att_smem g_smem\n" + src[b + len(decl) :])
    (workdir / "common.cuh").write_text(EMU_HEADER + (WGMMA_EMU if family == "attention_sm90" else ""))
    (workdir / "cp_async.cuh").write_text("")  # cp_async.cuh's helpers are emulated in EMU_HEADER
    table = ", ".join(f"K({k})" for k in KERNELS[family])
    (workdir / "emu.cpp").write_text(EMU_MAIN.replace("KERNEL_TABLE", table))
    out = workdir / "libemu.so"
    cmd = [gxx, "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-o", str(out), str(workdir / "emu.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_error.restype = ctypes.c_char_p
    return lib


def launch(libs, family, name, grid, block, args, device, stream=None, shared_mem=0):
    """kernels._build.launch for the emulator: `libs` maps each family to its build(), the other
    arguments as launch takes them."""
    lib = libs[family]
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
    assert rc == 0, f"emulated launch of {name} failed ({rc}): {lib.emu_error().decode()}"
