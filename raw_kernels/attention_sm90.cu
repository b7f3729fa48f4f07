// Causal self-attention on Hopper (sm_90a): the raw backend's flash kernels on wgmma, same contract
// as attention.cu's (packed qkv (B, T, (Hq + 2*Hkv) * hs), GQA, att (B, T, Hq*hs) bf16 and lse
// (B, Hq, T) fp32 natural log of the softmax denominator of the scaled scores; the backward writes
// (=) dqkv from attention.cu's D = rowsum(dO * O)), so each pass pairs with either file's other pass.
// Compiled for sm_90a only (kernels/_build.MODULE_ARCH: wgmma has no sm_90 or later-generation
// form); on any other GPU the launcher keeps attention.cu's mma.sync kernels. On compute capability
// 9.0 these kernels are the raw backend's bf16 hs 64/128 path (attention.SM90_FORWARD/SM90_BACKWARD).
// Backward: dq and dk/dv in two deterministic kernels as in attention.cu (dq recomputes S and dP),
// each GEMM a wgmma with the operands below.
//
// Block: NWG = 2 warpgroups (128 threads each), 64 query rows per warpgroup, BR = 128 rows per block
// (heaviest causal blocks of the whole grid first: longest_first), key blocks of BC rows, K/V double-buffered by cp.async (all threads
// copy; no producer warpgroup). Every tile sits in shared memory in wgmma's 128-byte-swizzle layout:
// per 64-column half of the head dim, rows of 128 bytes whose 16-byte chunk c sits at c ^ (row & 7),
// halves one after the other, each tile 1024-byte aligned (the swizzle repeats every 8 rows).
// Per key block each warpgroup computes S = Q K^T with both operands from shared memory (K-major),
// masks and exponentiates S in the accumulator registers (online softmax), packs P to bf16 in place
// (the m64nN accumulator layout of two adjacent 8-column groups is the m64k16 A-operand layout of
// each warp's 16 rows) and adds P V with V read as an N-major (transposed) B operand.
// Invariants: rows t >= T are never written; masked scores contribute exactly 0; deterministic (no
// atomics, a fixed order of sums); att/lse must not alias qkv.
#include "common.cuh"
#include "cp_async.cuh"

#define LOG2E 1.4426950408889634f
#define ATT_INF __int_as_float(0x7f800000)  // NVRTC has no math.h INFINITY
constexpr int NWG = 2;  // warpgroups per block in every kernel but the probe

// helpers
// ---- PTX helpers -------------------------------------------------------------------------
// (tests/attention_emulator.py compiles this file on the host with everything from here to the
// extern __shared__ declaration replaced by an emulation of the same helpers.)
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
// 2^x; ex2.approx maps -inf to +0, which is how masked scores vanish.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// The compiler must not move reads or writes of an accumulator across the asynchronous wgmma that
// owns it: an empty asm that "changes" every register, after the wait (CUTLASS's fence_operand).
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Named barriers (id 1..15; 0 is __syncthreads) over n threads: bar.sync waits for n arrivals,
// bar.arrive counts one warp's without waiting.
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// d (64 x N fp32, the m64nN accumulator layout) = A B (+ d when scale_d): wgmma_ss reads A (64 x 16,
// K-major) and B (16 x N, K-major) through shared-memory descriptors; wgmma_rs takes A from registers
// (each warp's 16 rows in the m16k16 fragment layout of mma.sync) and B N-major (transposed).
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, int scale_d);
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db, int scale_d);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <> __device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<64>(float (&d)[32], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<128>(float (&d)[64], const unsigned (&a)[4], unsigned long long db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

#else  // tests/test_compile.py builds every file for plain sm_90, where wgmma does not exist
__device__ __forceinline__ void wgmma_fence() { __trap(); }
__device__ __forceinline__ void wgmma_commit() { __trap(); }
template <int N> __device__ __forceinline__ void wgmma_wait() { __trap(); }
__device__ __forceinline__ void fence_proxy_async() { __trap(); }
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&)[N / 2], unsigned long long, unsigned long long, int) { __trap(); }
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&)[N / 2], const unsigned (&)[4], unsigned long long, int) { __trap(); }
#endif

extern __shared__ __align__(128) unsigned char att_smem[];

// Shared memory from the first 1024-byte boundary of the dynamic allocation (the launcher asks for
// 1024 bytes more): the hardware applies the 128-byte swizzle to address bits 4-6 from bits 7-9.
__device__ __forceinline__ bf16* smem_base() {
    const unsigned a = smem_u32(att_smem);
    return reinterpret_cast<bf16*>(att_smem + (((a + 1023u) & ~1023u) - a));
}

// The grid's blocks, longest first across the whole grid: the hardware starts blocks in launch
// order (x fastest), so the tile index is read as the slowest-varying one and every (head, batch)'s
// longest causal tile starts before any shorter tile (tile 0 = the longest). Read in x-fastest order
// the way the grid is laid out, the last heads' long tiles would start last and leave a tail.
struct GridTile {
    int tile, y, z;
};
__device__ __forceinline__ GridTile longest_first() {
    const int yz = gridDim.y * gridDim.z;
    const int id = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int rest = id % yz;
    return {id / yz, rest % (int)gridDim.y, rest / (int)gridDim.y};
}

// Element offset of 16-byte chunk ch (8 elements) of row r in a [HS/64][ROWS][64] swizzled tile.
template <int ROWS> __device__ __forceinline__ int sw_off(int r, int ch) {
    return (ch >> 3) * ROWS * 64 + r * 64 + (((ch & 7) ^ (r & 7)) << 3);
}

// ROWS x HS tile starting at global row row0 (row stride ld elements); rows >= T are zero-filled.
template <int ROWS, int HS, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int row0, int T, long ld) {
    constexpr int CH = HS / 8;
#pragma unroll
    for (int i = 0; i < (ROWS * CH + NT - 1) / NT; ++i) {
        const int c = threadIdx.x + i * NT;
        const int r = c / CH, ch = c % CH, row = row0 + r;
        const bool ok = row < T;
        cp_async16(smem_u32(s + sw_off<ROWS>(r, ch)), g + (ok ? (long)row * ld : 0L) + ch * 8, ok ? 16 : 0);
    }
}

// A wgmma shared-memory descriptor for the 128-byte swizzle: start address, leading and stride byte
// offsets (PTX ISA "Matrix Descriptor": 14 bits each of the value >> 4; swizzle mode 1 in bits 62-63).
// K-major operand (rows of 128 bytes): sbo = 1024 between 8-row groups, lbo unused. N-major B: lbo
// between 64-column halves, sbo = 1024 between 8-row (k) groups.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

// Issue s (64 x BC fp32) = Q K^T as one wgmma group: Q the 64 rows at shared address q of a tile of
// QROWS rows (its halves are QROWS * 128 bytes apart), K the BC-row tile at k. A k-step of 16
// columns is 32 bytes into a row. s is defined only after wgmma_wait and fence_acc(s).
template <int HS, int BC, int QROWS>
__device__ __forceinline__ void scores(float (&s)[BC / 2], unsigned q, unsigned k) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HS / 16; ++kk)
        wgmma_ss<BC>(s, sw128_desc(q + (kk >> 2) * QROWS * 128 + (kk & 3) * 32, 16, 1024),
                     sw128_desc(k + (kk >> 2) * BC * 128 + (kk & 3) * 32, 16, 1024), kk > 0);
    wgmma_commit();
}

// Issue o (64 x HS fp32) += P V as one wgmma group: P the 64 x BC accumulator p packed to bf16 in place (8-column groups 2kk
// and 2kk+1 of each warp's 16 rows are the A fragment of k-step kk), V the BC-row tile at v, read
// N-major: k-step kk is 16 rows (2048 bytes) down, the second half of the head dim BC * 128 bytes on.
template <int HS, int BC>
__device__ __forceinline__ void add_pv(float (&o)[HS / 2], const float (&p)[BC / 2], unsigned v) {
    unsigned a[BC / 16][4];
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[kk][i] = pack_bf16(p[8 * kk + 2 * i], p[8 * kk + 2 * i + 1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) wgmma_rs<HS>(o, a[kk], sw128_desc(v + kk * 2048, BC * 128, 1024), 1);
    wgmma_commit();
}

// The forward's warpgroups take turns at the tensor cores in a ring (FlashAttention-3's ping-pong):
// warpgroup w waits at barrier 1 + w for its turn, issues its GEMM, and passes the turn on to
// warpgroup w + 1 before it waits for the result, so one warpgroup's exponentials overlap the
// next one's GEMMs instead of all of them issuing at once and then all waiting on the exp unit.
// Each turn is a pair (bar.sync by the owner, bar.arrive by the predecessor): 256 threads.
template <bool ON> struct TurnRing {
    int wg;
    __device__ __forceinline__ void start() const {  // the last warpgroup hands warpgroup 0 its first turn
        if (ON && wg == NWG - 1) named_arrive(1, 256);
    }
    __device__ __forceinline__ void wait() const {
        if (ON) named_sync(1 + wg, 256);
    }
    __device__ __forceinline__ void pass(bool final) const {  // final: no turn follows (none may dangle)
        if (ON && !(final && wg == NWG - 1)) named_arrive(1 + (wg + 1) % NWG, 256);
    }
};

// Put a warpgroup's 64 x HS accumulator, row r times mul[r & 1]... as bf16 into rows r0.. of a
// [HS/64][ROWS][64] swizzled tile (entries 4n + 2r, 4n + 2r + 1 are row 16 warp + g + 8r, columns
// 8n + 2tq, + 1).
template <int HS, int ROWS>
__device__ __forceinline__ void stage_acc(bf16* tile, int r0, const float (&acc)[HS / 2], const float (&mul)[2]) {
    const int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < HS / 2; i += 2) {
        const int r = (i >> 1) & 1, rr = r0 + 16 * warp + g + 8 * r;
        *reinterpret_cast<unsigned*>(tile + sw_off<ROWS>(rr, i >> 2) + 2 * tq) =
            pack_bf16(acc[i] * mul[r], acc[i + 1] * mul[r]);
    }
}
// Rows 0..ROWS-1 of a swizzled tile to global rows row0 + r < T (row stride ld), 16-byte stores by NT threads.
template <int HS, int ROWS, int NT>
__device__ __forceinline__ void store_tile(bf16* out, long ld, int row0, int T, const bf16* tile) {
    constexpr int CH = HS / 8;
#pragma unroll
    for (int i = 0; i < ROWS * CH / NT; ++i) {
        const int c = threadIdx.x + i * NT, rr = c / CH, ch = c % CH;
        if (row0 + rr < T)
            *reinterpret_cast<int4*>(out + (long)(row0 + rr) * ld + ch * 8) =
                *reinterpret_cast<const int4*>(tile + sw_off<ROWS>(rr, ch));
    }
}

// kernels
// ---- layout probe --------------------------------------------------------------------------
// One warpgroup runs the forward's two products on one tile: s_out (64 x BC) = Q K^T and o_out
// (64 x HS) = bf16(s) V, fp32, from row-major Q (64 x HS), K and V (BC x HS). tests/test_attention.py
// checks them against NumPy first on the GPU, so that a descriptor or fragment mistake (which the
// emulator, written from the same reading of the PTX ISA, could share) shows on its own.
template <int HS, int BC>
__device__ __forceinline__ void wgmma_probe(float* s_out, float* o_out, const bf16* q, const bf16* k, const bf16* v) {
    bf16* sQ = smem_base();
    bf16* sK = sQ + 64 * HS;
    bf16* sV = sK + BC * HS;
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
    load_tile<64, HS, 128>(sQ, q, 0, 64, HS);
    load_tile<BC, HS, 128>(sK, k, 0, BC, HS);
    load_tile<BC, HS, 128>(sV, v, 0, BC, HS);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float s[BC / 2], o[HS / 2];
    scores<HS, BC, 64>(s, smem_u32(sQ), smem_u32(sK));
    wgmma_wait<0>();
    fence_acc(s);
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
    add_pv<HS, BC>(o, s, smem_u32(sV));
    wgmma_wait<0>();
    fence_acc(o);
    const int row = 16 * warp + g;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) s_out[(row + 8 * ((i >> 1) & 1)) * BC + 8 * (i >> 2) + 2 * tq + (i & 1)] = s[i];
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) o_out[(row + 8 * ((i >> 1) & 1)) * HS + 8 * (i >> 2) + 2 * tq + (i & 1)] = o[i];
}

// ---- forward -------------------------------------------------------------------------------
// Grid (ceil(T / BR), Hq, B), block 128 * NWG. Shared (from a 1024-byte boundary): Q [BR][HS],
// K [2][BC][HS], V [2][BC][HS], each in the swizzled layout above. PINGPONG: the TurnRing order.
template <int HS, int BC, bool PINGPONG>
__device__ __forceinline__ void flash_forward_sm90(bf16* __restrict__ att, float* __restrict__ lse,
                                                   const bf16* __restrict__ qkv, int T, int Hq, int Hkv, float scale) {
    constexpr int BR = 64 * NWG, NT = 128 * NWG;
    bf16* sQ = smem_base();
    bf16* sK = sQ + BR * HS;
    bf16* sV = sK + 2 * BC * HS;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const GridTile at = longest_first();
    const int q0 = (gridDim.x - 1 - at.tile) * BR;
    const int h = at.y, b = at.z, kvh = h / (Hq / Hkv);
    const long ld = (long)(Hq + 2 * Hkv) * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gK = base + (long)(Hq + kvh) * HS;
    const bf16* gV = base + (long)(Hq + Hkv + kvh) * HS;
    const int n_kv = (min(q0 + BR, T) + BC - 1) / BC;
    const int row_g = q0 + 64 * wg;           // first query row of this warpgroup
    const int row_t = row_g + 16 * warp + g;  // this thread's rows: row_t and row_t + 8
    const float sl2 = scale * LOG2E;
    const unsigned q_addr = smem_u32(sQ + 64 * wg * 64);  // the warpgroup's 64 rows of each half

    load_tile<BR, HS, NT>(sQ, base + (long)h * HS, q0, T, ld);
    cp_async_commit();
    load_tile<BC, HS, NT>(sK, gK, 0, T, ld);
    load_tile<BC, HS, NT>(sV, gV, 0, T, ld);
    cp_async_commit();

    float o[HS / 2];
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
    float m[2] = {-ATT_INF, -ATT_INF}, l[2] = {0.f, 0.f};
    const TurnRing<PINGPONG> turn{wg};
    turn.start();

    for (int j = 0; j < n_kv; ++j) {
        if (j + 1 < n_kv) {
            const int nb = (j + 1) & 1;
            load_tile<BC, HS, NT>(sK + nb * BC * HS, gK, (j + 1) * BC, T, ld);
            load_tile<BC, HS, NT>(sV + nb * BC * HS, gV, (j + 1) * BC, T, ld);
        }
        cp_async_commit();
        cp_async_wait<1>();  // everything but the block just requested has landed
        fence_proxy_async();
        __syncthreads();
        const int kv0 = j * BC;
        // (The wgmma code sits in one branch: issue and wait under separate conditions make ptxas
        // serialize every wgmma of the kernel.)
        if (kv0 <= row_g + 63) {  // else every key of the block is in the future of the warpgroup's rows
            float s[BC / 2];
            turn.wait();
            scores<HS, BC, BR>(s, q_addr, smem_u32(sK + (j & 1) * BC * HS));
            turn.pass(false);
            wgmma_wait<0>();
            fence_acc(s);
            if (kv0 + BC - 1 > row_g) {  // the block reaches past the diagonal of some row
#pragma unroll
                for (int i = 0; i < BC / 2; ++i)
                    if (kv0 + 8 * (i >> 2) + 2 * tq + (i & 1) > row_t + 8 * ((i >> 1) & 1)) s[i] = -ATT_INF;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // accumulator entries 4n + 2r, 4n + 2r + 1 are row row_t + 8r
                float mx = -ATT_INF;
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[r], mx);
                const float base_l2 = m_new == -ATT_INF ? 0.f : m_new * sl2;  // no (-inf) - (-inf)
                const float alpha = fast_exp2(m[r] * sl2 - base_l2);
                m[r] = m_new;
                l[r] *= alpha;
#pragma unroll
                for (int n = 0; n < HS / 8; ++n) {
                    o[4 * n + 2 * r] *= alpha;
                    o[4 * n + 2 * r + 1] *= alpha;
                }
#pragma unroll
                for (int n = 0; n < BC / 8; ++n)
#pragma unroll
                    for (int e = 4 * n + 2 * r; e < 4 * n + 2 * r + 2; ++e) {
                        const float p = fast_exp2(fmaf(s[e], sl2, -base_l2));
                        s[e] = p;
                        l[r] += p;  // per-thread partial; the 4 threads of a row are summed at the end
                    }
            }
            turn.wait();
            add_pv<HS, BC>(o, s, smem_u32(sV + (j & 1) * BC * HS));
            turn.pass(j == n_kv - 1);
            wgmma_wait<0>();
            fence_acc(o);
        } else {  // still take both turns, so that the ring goes on
            turn.wait();
            turn.pass(false);
            turn.wait();
            turn.pass(j == n_kv - 1);
        }
        __syncthreads();  // the stage read here is refilled by the next iteration's prefetch
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = 1.f / l[r];
        const int row = row_t + 8 * r;
        if (tq == 0 && row < T) lse[((long)b * Hq + h) * T + row] = m[r] * scale + logf(l[r]);
    }
    // Stage the bf16 output in sQ (its wgmma reads are complete), then 16-byte coalesced stores.
    stage_acc<HS, BR>(sQ, 64 * wg, o, inv);
    __syncthreads();
    store_tile<HS, BR, NT>(att + (long)b * T * Hq * HS + (long)h * HS, (long)Hq * HS, q0, T, sQ);
}

// ---- backward: dq ----------------------------------------------------------------------------
// Grid (ceil(T / BQ), Hq, B), block 128 * NWG, BQ = 64 * NWG query rows (64 per warpgroup). Over the
// 64-row key blocks up to the diagonal: S = Q K^T and dP = dO V^T (shared-memory operands),
// P = exp(S*scale - lse), dS = P (dP - D) in registers, dQ += dS K (dS from registers, K N-major);
// dq = scale dQ. Shared: Q, dO [BQ][HS], then two stages of K, V [64][HS].
template <int HS>
__device__ __forceinline__ void flash_backward_dq_sm90(bf16* __restrict__ dqkv, const bf16* __restrict__ datt,
                                                       const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                                       const float* __restrict__ dsum, int T, int Hq, int Hkv,
                                                       float scale) {
    constexpr int BQ = 64 * NWG, BC = 64, NT = 128 * NWG;
    bf16* sQ = smem_base();
    bf16* sdO = sQ + BQ * HS;
    bf16* sK = sdO + BQ * HS;    // [2][BC][HS]
    bf16* sV = sK + 2 * BC * HS;  // [2][BC][HS]
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
    const GridTile at = longest_first();
    const int q0 = (gridDim.x - 1 - at.tile) * BQ;
    const int h = at.y, b = at.z, kvh = h / (Hq / Hkv);
    const long ld = (long)(Hq + 2 * Hkv) * HS, ld_o = (long)Hq * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gK = base + (long)(Hq + kvh) * HS;
    const bf16* gV = base + (long)(Hq + Hkv + kvh) * HS;
    const int n_kv = (min(q0 + BQ, T) + BC - 1) / BC;
    const int row_g = q0 + 64 * wg, row_t = row_g + 16 * warp + g;
    const float sl2 = scale * LOG2E;
    const unsigned q_addr = smem_u32(sQ + 64 * wg * 64), do_addr = smem_u32(sdO + 64 * wg * 64);

    load_tile<BQ, HS, NT>(sQ, base + (long)h * HS, q0, T, ld);
    load_tile<BQ, HS, NT>(sdO, datt + (long)b * T * ld_o + (long)h * HS, q0, T, ld_o);
    cp_async_commit();
    load_tile<BC, HS, NT>(sK, gK, 0, T, ld);
    load_tile<BC, HS, NT>(sV, gV, 0, T, ld);
    cp_async_commit();

    float lse_l2[2], d_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_t + 8 * r;
        const long idx = ((long)b * Hq + h) * T + row;
        lse_l2[r] = row < T ? lse[idx] * LOG2E : 0.f;  // rows past T: zero q and dO give dS = 0
        d_row[r] = row < T ? dsum[idx] : 0.f;
    }
    float dq[HS / 2];
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) dq[i] = 0.f;

    for (int j = 0; j < n_kv; ++j) {
        if (j + 1 < n_kv) {
            const int nb = (j + 1) & 1;
            load_tile<BC, HS, NT>(sK + nb * BC * HS, gK, (j + 1) * BC, T, ld);
            load_tile<BC, HS, NT>(sV + nb * BC * HS, gV, (j + 1) * BC, T, ld);
        }
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        const int kv0 = j * BC;
        if (kv0 <= row_g + 63) {
            const unsigned k_s = smem_u32(sK + (j & 1) * BC * HS);
            float s[BC / 2], dp[BC / 2];
            scores<HS, BC, BQ>(s, q_addr, k_s);
            scores<HS, BC, BQ>(dp, do_addr, smem_u32(sV + (j & 1) * BC * HS));
            wgmma_wait<0>();
            fence_acc(s);
            fence_acc(dp);
            const bool diag = kv0 + BC - 1 > row_g;
#pragma unroll
            for (int i = 0; i < BC / 2; ++i) {
                const int r = (i >> 1) & 1;
                float p = fast_exp2(fmaf(s[i], sl2, -lse_l2[r]));
                if (diag && kv0 + 8 * (i >> 2) + 2 * tq + (i & 1) > row_t + 8 * r) p = 0.f;
                s[i] = p * (dp[i] - d_row[r]);  // dS
            }
            add_pv<HS, BC>(dq, s, k_s);
            wgmma_wait<0>();
            fence_acc(dq);
        }
        __syncthreads();
    }
    const float mul[2] = {scale, scale};
    stage_acc<HS, BQ>(sQ, 64 * wg, dq, mul);  // each warpgroup's own rows of sQ
    __syncthreads();
    store_tile<HS, BQ, NT>(dqkv + (long)b * T * ld + (long)h * HS, ld, q0, T, sQ);
}

// ---- backward: dk, dv ------------------------------------------------------------------------
// Grid (ceil(T / BK), Hkv, B), block 128 * NWG, BK = 64 * NWG keys (64 per warpgroup; block 0 first:
// it sees every query). Over each query head of the GQA group and each 64-row query block from the
// diagonal on: S^T = K Q^T and dP^T = V dO^T (shared-memory operands), P^T = exp(S^T*scale - lse),
// dS^T = P^T (dP^T - D) in registers, dV += P^T dO and dK += dS^T Q (P^T and dS^T from registers,
// dO and Q N-major); dk = scale dK. Shared: K, V [BK][HS], then two stages of Q, dO [64][HS],
// lse*log2(e) [64] (+inf past T, so P = 0 there), D [64].
template <int HS>
__device__ __forceinline__ void flash_backward_dkdv_sm90(bf16* __restrict__ dqkv, const bf16* __restrict__ datt,
                                                         const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                                         const float* __restrict__ dsum, int T, int Hq, int Hkv,
                                                         float scale) {
    constexpr int BK = 64 * NWG, BQ = 64, NT = 128 * NWG;
    bf16* sK = smem_base();
    bf16* sV = sK + BK * HS;
    bf16* sQ = sV + BK * HS;                                   // [2][BQ][HS]
    bf16* sdO = sQ + 2 * BQ * HS;                              // [2][BQ][HS]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BQ * HS);  // [2][BQ]
    float* sD = sL + 2 * BQ;                                   // [2][BQ]
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, tq = threadIdx.x & 3;
    const GridTile at = longest_first();
    const int k0 = at.tile * BK, kvh = at.y, b = at.z, G = Hq / Hkv;
    const long ld = (long)(Hq + 2 * Hkv) * HS, ld_o = (long)Hq * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gdO = datt + (long)b * T * ld_o;
    const int qb0 = k0 / BQ, steps = (T + BQ - 1) / BQ - qb0, total = G * steps;
    const int row_g = k0 + 64 * wg, key_t = row_g + 16 * warp + g;  // the warpgroup's first key, the thread's
    const float sl2 = scale * LOG2E;
    const unsigned k_addr = smem_u32(sK + 64 * wg * 64), v_addr = smem_u32(sV + 64 * wg * 64);

    auto load_stage = [&](int it, int buf) {
        const int h = kvh * G + it / steps, q0 = (qb0 + it % steps) * BQ;
        load_tile<BQ, HS, NT>(sQ + buf * BQ * HS, base + (long)h * HS, q0, T, ld);
        load_tile<BQ, HS, NT>(sdO + buf * BQ * HS, gdO + (long)h * HS, q0, T, ld_o);
        if (threadIdx.x < BQ) {
            const int q = q0 + threadIdx.x;
            const long idx = ((long)b * Hq + h) * T + q;
            sL[buf * BQ + threadIdx.x] = q < T ? lse[idx] * LOG2E : ATT_INF;
            sD[buf * BQ + threadIdx.x] = q < T ? dsum[idx] : 0.f;
        }
    };
    load_tile<BK, HS, NT>(sK, base + (long)(Hq + kvh) * HS, k0, T, ld);
    load_tile<BK, HS, NT>(sV, base + (long)(Hq + Hkv + kvh) * HS, k0, T, ld);
    load_stage(0, 0);
    cp_async_commit();

    float dk[HS / 2], dv[HS / 2];
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;

    for (int it = 0; it < total; ++it) {
        const int buf = it & 1;
        if (it + 1 < total) load_stage(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        const int q0 = (qb0 + it % steps) * BQ;
        if (q0 + BQ - 1 >= row_g) {  // some query of the block sees some key of the warpgroup
            const unsigned q_s = smem_u32(sQ + buf * BQ * HS), do_s = smem_u32(sdO + buf * BQ * HS);
            const float* l_s = sL + buf * BQ;
            const float* d_s = sD + buf * BQ;
            float s[BQ / 2], dp[BQ / 2];
            scores<HS, BQ, BK>(s, k_addr, q_s);
            scores<HS, BQ, BK>(dp, v_addr, do_s);
            wgmma_wait<0>();
            fence_acc(s);
            fence_acc(dp);
            const bool diag = q0 < row_g + 63;  // some query of the block comes before some key
#pragma unroll
            for (int i = 0; i < BQ / 2; ++i) {
                const int qi = 8 * (i >> 2) + 2 * tq + (i & 1);
                float p = fast_exp2(fmaf(s[i], sl2, -l_s[qi]));
                if (diag && q0 + qi < key_t + 8 * ((i >> 1) & 1)) p = 0.f;
                s[i] = p;                       // P^T
                dp[i] = p * (dp[i] - d_s[qi]);  // dS^T
            }
            add_pv<HS, BQ>(dv, s, do_s);
            add_pv<HS, BQ>(dk, dp, q_s);
            wgmma_wait<0>();
            fence_acc(dv);
            fence_acc(dk);
        }
        __syncthreads();
    }
    const float mul_k[2] = {scale, scale}, mul_v[2] = {1.f, 1.f};
    stage_acc<HS, BK>(sK, 64 * wg, dk, mul_k);  // each warpgroup's own rows of sK and sV
    stage_acc<HS, BK>(sV, 64 * wg, dv, mul_v);
    __syncthreads();
    store_tile<HS, BK, NT>(dqkv + (long)b * T * ld + (long)(Hq + kvh) * HS, ld, k0, T, sK);
    store_tile<HS, BK, NT>(dqkv + (long)b * T * ld + (long)(Hq + Hkv + kvh) * HS, ld, k0, T, sV);
}

// ---- entry points: the names cuengine/kernels/attention.py launches ----------------------------
#define WGMMA_PROBE(HS, BC)                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) wgmma_probe_hs##HS##_bc##BC(                          \
        float* s_out, float* o_out, const bf16* q, const bf16* k, const bf16* v) {                           \
        wgmma_probe<HS, BC>(s_out, o_out, q, k, v);                                                          \
    }
WGMMA_PROBE(64, 64)
WGMMA_PROBE(128, 64)
WGMMA_PROBE(128, 128)

// attention_forward_sm90_hs<HS>_bf16: two warpgroups (128 query rows per block); hs 128 with key
// blocks of 128 taking turns at the tensor cores (TurnRing), hs 64 with key blocks of 64 issuing
// freely, two blocks per SM (the H200's fastest of 2-3 warpgroups x 64/128 keys x ping-pong or not
// at T = 1k-8k; attention.py's _SM90_KEY_BLOCK sizes the shared memory).
#define FORWARD_SM90(HS, BC, MIN_BLOCKS, PP)                                                                \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS)                                           \
        attention_forward_sm90_hs##HS##_bf16(bf16* att, float* lse, const bf16* qkv, int T, int Hq, int Hkv, \
                                             float scale) {                                                  \
        flash_forward_sm90<HS, BC, PP>(att, lse, qkv, T, Hq, Hkv, scale);                                 \
    }
FORWARD_SM90(128, 128, 1, true)
FORWARD_SM90(64, 64, 2, false)

// attention_backward_{dq,dkdv}_sm90_hs<HS>_bf16: two warpgroups (128 query rows / 128 keys per block)
#define BACKWARD_SM90(HS)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_backward_dq_sm90_hs##HS##_bf16(            \
        bf16* dqkv, const bf16* datt, const bf16* qkv, const float* lse, const float* dsum, int T, int Hq,    \
        int Hkv, float scale) {                                                                               \
        flash_backward_dq_sm90<HS>(dqkv, datt, qkv, lse, dsum, T, Hq, Hkv, scale);                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_backward_dkdv_sm90_hs##HS##_bf16(          \
        bf16* dqkv, const bf16* datt, const bf16* qkv, const float* lse, const float* dsum, int T, int Hq,    \
        int Hkv, float scale) {                                                                               \
        flash_backward_dkdv_sm90<HS>(dqkv, datt, qkv, lse, dsum, T, Hq, Hkv, scale);                       \
    }
BACKWARD_SM90(64)
BACKWARD_SM90(128)

// launchers: cuengine/kernels/attention.py (attention_forward; the probe in tests/test_attention.py)
