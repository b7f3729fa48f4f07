// FP8 support: abs-max, per-tensor quantisation (plain, fused with a transpose, or both copies from
// one read: quantize_dual), byte transposes, and the bias gradient.
//
// - abs_max max-accumulates |x| into one fp32 slot (zero it first). The max is taken on the
//   float bit patterns as unsigned integers: they order like |x|, NaN sorts above inf (so a NaN
//   is reported, not dropped as fmaxf would), and the result is exact and order-independent.
// - quantize reads abs_max from a slot, writes the output's stats [abs_max, scale =
//   fp8_max/abs_max, scale_inv = 1/scale] (abs_max 0 or non-finite gives 1, 1) from the tensor's
//   first block, and stores x*scale with SATFINITE round-to-nearest-even.
// - quantize_dual_multi: quantize_dual of every tensor of a table (DualRecord) in one launch, each
//   block one tile of one tensor, bitwise one quantize_dual launch per tensor (16-byte variant only).
// - transposes go through a shared-memory tile: inp rows are read coalesced along C, out rows
//   are written coalesced along N in 16-byte chunks. One 32-bit smem word holds 4/sizeof(out)
//   consecutive n of one output row; the 33-word row pitch makes both phases conflict-free.
// - amax_history_roll: delayed scaling's bookkeeping, one thread per tensor (see the kernel).
// - bias_backward: dbias (+=, a parameter gradient) = column sums of dout in fp32, through a
//   fixed partial-sum layout in scratch and a fixed-order reduction (deterministic).
// Kernels without the `_scalar` suffix need 16-byte aligned rows (the launcher checks).
#include "common.cuh"

typedef unsigned char u8;  // NVRTC has no <stdint.h>
typedef unsigned short u16;
typedef unsigned int u32;

// kernels

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};

// 8 consecutive elements in as few aligned accesses as possible (16 bytes at most per access).
template <typename T> __device__ __forceinline__ void load8(const T* p, T (&v)[8]) {
    constexpr int P = sizeof(T) * 8 >= 16 ? 16 / sizeof(T) : 8;
#pragma unroll
    for (int j = 0; j < 8; j += P) {
        const Vec<T, P> w = *reinterpret_cast<const Vec<T, P>*>(p + j);
#pragma unroll
        for (int k = 0; k < P; ++k) v[j + k] = w.v[k];
    }
}

__device__ __forceinline__ bool first_block() { return blockIdx.x == 0 && blockIdx.y == 0; }

// The first block of a tensor (`first`) publishes the stats the quantised values were made with. The
// abs-max slot is left alone when it is the one being read (other blocks may still be reading it).
__device__ __forceinline__ void write_stats(bool first, float* stats, const float* amax_src, float amax, float scale) {
    if (first && threadIdx.x == 0) {
        if (stats + STAT_ABS_MAX != amax_src) stats[STAT_ABS_MAX] = amax;
        stats[STAT_SCALE] = scale;
        stats[STAT_SCALE_INV] = 1.f / scale;
    }
}

constexpr int UNROLL = 4;  // 16-byte loads in flight per thread in the grid-stride kernels

// Two values to FP8 in one SATFINITE round-to-nearest-even conversion (the instruction a single
// conversion issues anyway): `lo` in bits 0-7, `hi` in bits 8-15.
template <typename Tq> __device__ __forceinline__ u32 fp8x2_bits(float lo, float hi);
template <> __device__ __forceinline__ u32 fp8x2_bits<fp8e4>(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
template <> __device__ __forceinline__ u32 fp8x2_bits<fp8e5>(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E5M2);
}

// Visits x[0, n) in grid-stride order: with VEC, 8 elements at a time through on8(i, v) (v = x[i, i+8)),
// UNROLL groups loaded before the first is handed on (loads in flight; and a byte store of a quantised
// output may alias x), then what is left one element at a time through on1(i, x[i]).
template <typename T, bool VEC, typename F8, typename F1>
__device__ __forceinline__ void grid_stride8(const T* x, long long n, F8&& on8, F1&& on1) {
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (VEC) {
        const long long packs = n / 8;
        long long p = tid;
        for (; p + (UNROLL - 1) * nthreads < packs; p += UNROLL * nthreads) {
            T v[UNROLL][8];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) load8(x + (p + u * nthreads) * 8, v[u]);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) on8((p + u * nthreads) * 8, v[u]);
        }
        for (; p < packs; p += nthreads) {
            T v[8];
            load8(x + p * 8, v);
            on8(p * 8, v);
        }
        done = packs * 8;
    }
    for (long long i = done + tid; i < n; i += nthreads) on1(i, x[i]);
}

// ---- abs_max ----------------------------------------------------------------------------------
// fabsf, not abs_bits: under -ftz it flushes denormals to 0, which this kernel has always reported.
template <typename T, bool VEC> __device__ void abs_max_impl(float* amax, const T* x, long long n) {
    unsigned bits = 0;
    grid_stride8<T, VEC>(
        x, n,
        [&](long long, const T(&v)[8]) {
#pragma unroll
            for (int k = 0; k < 8; ++k) bits = max(bits, __float_as_uint(fabsf(to_float(v[k]))));
        },
        [&](long long, T v) { bits = max(bits, __float_as_uint(fabsf(to_float(v)))); });
    block_atomic_abs_max(amax, bits);
}

// ---- quantize -------------------------------------------------------------------------------
template <typename Tin, typename Tq>
__device__ __forceinline__ void quantize8(Tq* out, const Tin (&v)[8], float scale) {
    u32 w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 lo = fp8x2_bits<Tq>(to_float(v[4 * h]) * scale, to_float(v[4 * h + 1]) * scale);
        const u32 hi = fp8x2_bits<Tq>(to_float(v[4 * h + 2]) * scale, to_float(v[4 * h + 3]) * scale);
        w[h] = lo | hi << 16;
    }
    *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);  // 8 bytes, little-endian: v[0] first
}

template <typename Tin, typename Tq, bool VEC>
__device__ void quantize_impl(Tq* out, float* stats, const float* amax_src, const Tin* x, long long n) {
    const float amax = *amax_src;
    const float scale = fp8_scale(amax, fp8_limits<Tq>::max);
    write_stats(first_block(), stats, amax_src, amax, scale);
    grid_stride8<Tin, VEC>(
        x, n, [&](long long i, const Tin(&v)[8]) { quantize8<Tin, Tq>(out + i, v, scale); },
        [&](long long i, Tin v) { out[i] = from_float<Tq>(to_float(v) * scale); });
}

// ---- transposes -------------------------------------------------------------------------------
// One tile: 32 * RW rows of inp (n) by 64 columns (c); 256 threads, thread (a, b) owns rows
// RW*a .. RW*a+RW-1 and columns 8b .. 8b+7. QUANT converts Tin to the fp8 Tq with `scale`;
// otherwise Tin and Tout are the same raw-bits type and are moved unchanged (NaN payloads too).
// ROWS (with QUANT, 1-byte out): the quantised bytes are also stored untransposed into rows (N, C),
// 8 bytes per thread and row, so one read of inp gives both FP8 copies.
// The tile is number `pos` of the tensor's tiles in row-tile-major order (`col_tiles` = ceil(C / 64) per
// row tile): consecutive positions are consecutive column tiles of one row tile, so blocks that start
// together read the 64-column pieces of each input row at about the same time (whole DRAM pages) rather
// than a row-tile sweep apart.
template <typename Tin, typename Tout, typename Tq, bool QUANT, bool VEC, bool ROWS = false>
__device__ void transpose_tile(Tout* out, const Tin* inp, int N, int C, float scale, unsigned pos, unsigned col_tiles,
                               u8* rows = nullptr) {
    constexpr int S = sizeof(Tout);
    constexpr int RW = 4 / S;
    constexpr int TN = 32 * RW, TC = 64, EPC = 16 / S;  // EPC: out elements per 16-byte chunk
    __shared__ u32 tile[TC][33];
    const int b = threadIdx.x % 8, a = threadIdx.x / 8;
    const int n0 = (int)(pos / col_tiles) * TN, c0 = (int)(pos % col_tiles) * TC;
    const int c = c0 + 8 * b;
    u32 words[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) words[k] = 0;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int n = n0 + RW * a + r;
        Tin v[8];
        bool have[8];
        const Tin* row = inp + (size_t)n * C;
        if (VEC) {
            const bool ok = n < N && c < C;
            if (ok) load8(row + c, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) have[k] = ok;
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                have[k] = n < N && c + k < C;
                if (have[k]) v[k] = row[c + k];
            }
        }
        u32 row_bytes[2] = {0u, 0u};  // ROWS: the 8 quantised bytes of this row, little-endian
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (!have[k]) continue;
            u32 bits;
            if constexpr (QUANT) bits = fp8x2_bits<Tq>(to_float(v[k]) * scale, 0.f);
            else bits = (u32)v[k];
            words[k] |= bits << (8 * S * r);
            if constexpr (ROWS) row_bytes[k / 4] |= (bits & 0xffu) << (8 * (k % 4));
        }
        if constexpr (ROWS) {
            u8* dst = rows + (size_t)n * C + c;
            if (VEC) {
                if (have[0]) *reinterpret_cast<uint2*>(dst) = make_uint2(row_bytes[0], row_bytes[1]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k)
                    if (have[k]) dst[k] = (u8)(row_bytes[k / 4] >> (8 * (k % 4)));
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[8 * b + k][a] = words[k];
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int idx = threadIdx.x + 256 * h, j = idx % 8, cc = idx / 8;
        const int oc = c0 + cc, on = n0 + j * EPC;
        if (oc >= C || on >= N) continue;
        const uint4 w = make_uint4(tile[cc][4 * j], tile[cc][4 * j + 1], tile[cc][4 * j + 2], tile[cc][4 * j + 3]);
        Tout* dst = out + (size_t)oc * N + on;
        if (VEC) {
            *reinterpret_cast<uint4*>(dst) = w;
        } else {
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < EPC; ++e)
                if (on + e < N) dst[e] = (Tout)(ws[e / RW] >> (8 * S * (e % RW)));
        }
    }
}

// A one-tensor transpose launch: the grid is (row tiles, column tiles), and blocks start in order of
// blockIdx.x first, so the block's place in that order is its tile's position.
__device__ __forceinline__ unsigned grid_tile() { return blockIdx.y * gridDim.x + blockIdx.x; }

template <typename Tin, typename Tq, bool VEC>
__device__ void quantize_transpose_impl(Tq* out, float* stats, const float* amax_src, const Tin* inp, int N, int C) {
    const float amax = *amax_src;
    const float scale = fp8_scale(amax, fp8_limits<Tq>::max);
    write_stats(first_block(), stats, amax_src, amax, scale);
    transpose_tile<Tin, u8, Tq, true, VEC>(reinterpret_cast<u8*>(out), inp, N, C, scale, grid_tile(), gridDim.y);
}

// Both FP8 copies of inp (N, C) from one read: rows (N, C) and out (C, N), the same values and stats.
// This block does tile `pos` of `col_tiles` per row tile (see transpose_tile); `first`: it is the
// tensor's first block, which writes the stats.
template <typename Tin, typename Tq, bool VEC>
__device__ void quantize_dual_impl(Tq* rows, Tq* out, float* stats_rows, float* stats_out, const float* amax_src,
                                   const Tin* inp, int N, int C, bool first, unsigned pos, unsigned col_tiles) {
    const float amax = *amax_src;
    const float scale = fp8_scale(amax, fp8_limits<Tq>::max);
    write_stats(first, stats_rows, amax_src, amax, scale);
    if (stats_out != stats_rows) write_stats(first, stats_out, amax_src, amax, scale);
    transpose_tile<Tin, u8, Tq, true, VEC, true>(reinterpret_cast<u8*>(out), inp, N, C, scale, pos, col_tiles,
                                                 reinterpret_cast<u8*>(rows));
}

// ---- quantize_dual over many tensors in one launch ---------------------------------------------
// One tensor of a quantize_dual_multi table: 64 bytes, the layout of cuengine.kernels.fp8._DUAL_RECORD.
struct DualRecord {
    void* rows;              // (N, C) FP8: the plain copy
    void* out;               // (C, N) FP8: the transposed copy
    float* stats_rows;       // (STATS_SLOTS,) fp32
    float* stats_out;        // (STATS_SLOTS,) fp32: stats_rows, or a slot of its own
    const float* amax;       // (1,) fp32: the abs-max the scale comes from
    const void* inp;         // (N, C) Tin
    int N, C;
    int first_block;  // this tensor's first block of the launch: a prefix sum of the tile counts over the table
    int col_tiles;    // ceil(C / 64): gridDim.y of its own quantize_dual launch
};

// Block g does tile g - first_block of record owner[g] (`owner`, written once with the table: one load
// where a search over the records would be a chain of them) with the per-tensor kernel's code, scale and
// tile position, so every byte and stat is that of one quantize_dual launch per record. The tables hold
// only tensors that meet the 16-byte conditions (the launcher launches per tensor otherwise), and no
// record's abs-max source is another record's stats slot (the launcher checks), so the order of the
// records' blocks does not matter. __launch_bounds__(256, 8): 32 registers, no spills (40 without), the
// per-tensor kernel's count, so 8 blocks per SM (2048 threads) as there, not 6.
template <typename Tin, typename Tq> __device__ void quantize_dual_multi_impl(const DualRecord* tab, const int* owner) {
    const DualRecord r = tab[owner[blockIdx.x]];  // a copy: the FP8 stores below may alias the table for all
                                                  // the compiler knows, which would reload every field
    const unsigned pos = blockIdx.x - (unsigned)r.first_block;
    quantize_dual_impl<Tin, Tq, true>(static_cast<Tq*>(r.rows), static_cast<Tq*>(r.out), r.stats_rows, r.stats_out,
                                      r.amax, static_cast<const Tin*>(r.inp), r.N, r.C, pos == 0, pos,
                                      (unsigned)r.col_tiles);
}

// ---- bias backward ----------------------------------------------------------------------------
// Partial sums: block (strip, chunk) sums rows [chunk*rows, +rows) of a strip of 32*P columns into
// scratch[chunk][col]. `rows`, a multiple of 8 and a function of (N, OC) that the launcher picks so
// that the grid is about one wave on an H100/H200, is at least BIAS_ROWS: the chunks fit the scratch.
// 8 warps take rows round-robin, each keeping BIAS_UNROLL rows' loads in flight and adding them in
// row order; lanes take columns.
constexpr int BIAS_ROWS = 128;
constexpr int BIAS_UNROLL = 4;

template <typename T, int P>
__device__ void bias_partial_impl(float* scratch, const T* dout, int N, int OC, int rows) {
    __shared__ float red[8][32 * P];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int col = blockIdx.x * 32 * P + lane * P;
    const int r_end = min(N, (int)(blockIdx.y + 1) * rows);
    float acc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) acc[k] = 0.f;
    if (col < OC) {
        int r = blockIdx.y * rows + warp;
        for (; r + 8 * (BIAS_UNROLL - 1) < r_end; r += 8 * BIAS_UNROLL) {
            Vec<T, P> w[BIAS_UNROLL];
#pragma unroll
            for (int u = 0; u < BIAS_UNROLL; ++u)
                w[u] = *reinterpret_cast<const Vec<T, P>*>(dout + (size_t)(r + 8 * u) * OC + col);
#pragma unroll
            for (int u = 0; u < BIAS_UNROLL; ++u)
#pragma unroll
                for (int k = 0; k < P; ++k) acc[k] += to_float(w[u].v[k]);
        }
        for (; r < r_end; r += 8) {
            const Vec<T, P> w = *reinterpret_cast<const Vec<T, P>*>(dout + (size_t)r * OC + col);
#pragma unroll
            for (int k = 0; k < P; ++k) acc[k] += to_float(w.v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < P; ++k) red[warp][lane * P + k] = acc[k];
    __syncthreads();
    for (int t = threadIdx.x; t < 32 * P; t += blockDim.x) {
        const int c = blockIdx.x * 32 * P + t;
        if (c >= OC) break;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) s += red[w][t];
        scratch[(size_t)blockIdx.y * OC + c] = s;
    }
}

// dbias[c] += the chunk partials of column c, added in chunk order; 8 loads in flight.
template <typename T> __device__ void bias_reduce_impl(T* dbias, const float* scratch, int chunks, int OC) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    float s = 0.f;
    for (int i0 = 0; i0 < chunks; i0 += 8) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = i0 + j < chunks ? scratch[(size_t)(i0 + j) * OC + c] : 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (i0 + j < chunks) s += v[j];
    }
    dbias[c] = from_float<T>(to_float(dbias[c]) + s);
}

#define ABS_MAX_KERNELS(SUF, T)                                                                               \
    extern "C" __global__ void abs_max_##SUF(float* amax, const T* x, long long n) {                          \
        grid_dependency_wait();                                                                               \
        abs_max_impl<T, true>(amax, x, n);                                                                    \
    }                                                                                                         \
    extern "C" __global__ void abs_max_##SUF##_scalar(float* amax, const T* x, long long n) {                 \
        grid_dependency_wait();                                                                               \
        abs_max_impl<T, false>(amax, x, n);                                                                   \
    }
ABS_MAX_KERNELS(f32, float)
ABS_MAX_KERNELS(bf16, bf16)

#define QUANT_KERNELS(SUF, TIN, QSUF, TQ)                                                                     \
    extern "C" __global__ void quantize_##SUF##_##QSUF(TQ* out, float* stats, const float* amax,              \
                                                       const TIN* x, long long n) {                           \
        grid_dependency_wait();                                                                               \
        quantize_impl<TIN, TQ, true>(out, stats, amax, x, n);                                                 \
    }                                                                                                         \
    extern "C" __global__ void quantize_##SUF##_##QSUF##_scalar(TQ* out, float* stats, const float* amax,     \
                                                                const TIN* x, long long n) {                  \
        grid_dependency_wait();                                                                               \
        quantize_impl<TIN, TQ, false>(out, stats, amax, x, n);                                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) quantize_transpose_##SUF##_##QSUF(                      \
        TQ* out, float* stats, const float* amax, const TIN* inp, int N, int C) {                             \
        grid_dependency_wait();                                                                               \
        quantize_transpose_impl<TIN, TQ, true>(out, stats, amax, inp, N, C);                                  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) quantize_transpose_##SUF##_##QSUF##_scalar(             \
        TQ* out, float* stats, const float* amax, const TIN* inp, int N, int C) {                             \
        grid_dependency_wait();                                                                               \
        quantize_transpose_impl<TIN, TQ, false>(out, stats, amax, inp, N, C);                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) quantize_dual_##SUF##_##QSUF(                           \
        TQ* rows, TQ* out, float* stats_rows, float* stats_out, const float* amax, const TIN* inp, int N,     \
        int C) {                                                                                              \
        grid_dependency_wait();                                                                               \
        quantize_dual_impl<TIN, TQ, true>(rows, out, stats_rows, stats_out, amax, inp, N, C, first_block(),   \
                                          grid_tile(), gridDim.y);                                            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) quantize_dual_##SUF##_##QSUF##_scalar(                  \
        TQ* rows, TQ* out, float* stats_rows, float* stats_out, const float* amax, const TIN* inp, int N,     \
        int C) {                                                                                              \
        grid_dependency_wait();                                                                               \
        quantize_dual_impl<TIN, TQ, false>(rows, out, stats_rows, stats_out, amax, inp, N, C, first_block(),  \
                                           grid_tile(), gridDim.y);                                           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 8) quantize_dual_multi_##SUF##_##QSUF(                  \
        const DualRecord* tab, const int* owner) {                                                            \
        grid_dependency_wait();                                                                               \
        quantize_dual_multi_impl<TIN, TQ>(tab, owner);                                                        \
    }
QUANT_KERNELS(f32, float, e4m3, fp8e4)
QUANT_KERNELS(f32, float, e5m2, fp8e5)
QUANT_KERNELS(bf16, bf16, e4m3, fp8e4)
QUANT_KERNELS(bf16, bf16, e5m2, fp8e5)

#define TRANSPOSE_KERNELS(SUF, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(256) transpose_##SUF(T* out, const T* inp, int N, int C) {   \
        grid_dependency_wait();                                                                               \
        transpose_tile<T, T, T, false, true>(out, inp, N, C, 1.f, grid_tile(), gridDim.y);                    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) transpose_##SUF##_scalar(T* out, const T* inp, int N,   \
                                                                               int C) {                       \
        grid_dependency_wait();                                                                               \
        transpose_tile<T, T, T, false, false>(out, inp, N, C, 1.f, grid_tile(), gridDim.y);                   \
    }
TRANSPOSE_KERNELS(u8, u8)
TRANSPOSE_KERNELS(u16, u16)

#define BIAS_KERNELS(SUF, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4) bias_partial_##SUF(float* scratch, const T* dout,  \
                                                                            int N, int OC, int rows) {        \
        grid_dependency_wait();                                                                               \
        bias_partial_impl<T, 16 / sizeof(T)>(scratch, dout, N, OC, rows);                                     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 4) bias_partial_##SUF##_scalar(float* scratch,          \
                                                                                     const T* dout, int N,    \
                                                                                     int OC, int rows) {      \
        grid_dependency_wait();                                                                               \
        bias_partial_impl<T, 1>(scratch, dout, N, OC, rows);                                                  \
    }                                                                                                         \
    extern "C" __global__ void bias_reduce_##SUF(T* dbias, const float* scratch, int chunks, int OC) {        \
        grid_dependency_wait();                                                                               \
        bias_reduce_impl<T>(dbias, scratch, chunks, OC);                                                      \
    }
BIAS_KERNELS(f32, float)
BIAS_KERNELS(bf16, bf16)

// Delayed scaling of R FP8 tensors. Row r of history (R, n + 1) holds the scale those tensors' producers
// quantise with (column 0) and the abs-maxes of the last n micro-steps, newest first (columns 1..n). At the
// end of a micro-step: shift the abs-maxes one column on, put the one the producers recorded this
// micro-step (stats[slots[r] + STAT_ABS_MAX]) in column 1, and set the scale from the largest finite one, as
// quantize does from one abs-max (fp8_max[r] / max; 1 when it is 0). A non-finite abs-max (a micro-step whose
// gradient overflowed) is kept in the history but left out of the max, so it cannot hold the scale at 1 for
// the next n micro-steps.
extern "C" __global__ void amax_history_roll(float* history, const float* stats, const int* slots,
                                             const float* fp8_max, int R, int n) {
    grid_dependency_wait();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        float* h = history + (size_t)r * (n + 1);
        for (int k = n; k > 1; --k) h[k] = h[k - 1];
        h[1] = stats[slots[r] + STAT_ABS_MAX];
        float m = 0.f;
        for (int k = 1; k <= n; ++k)
            if (isfinite(h[k])) m = fmaxf(m, h[k]);
        h[0] = fp8_scale(m, fp8_max[r]);
    }
}

// launchers: cuengine/kernels/fp8.py (abs_max, quantize_with_abs_max, quantize_and_transpose,
// quantize_dual, QuantizeDualTable + quantize_dual_multi, transpose, bias_backward, amax_history_roll)
