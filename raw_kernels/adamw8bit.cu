// 8-bit AdamW: the update of adamw.cu with m and v stored as 8-bit codes plus one fp32 abs-max per
// block of 256 elements (bitsandbytes' block-wise dynamic quantization). In place (=) on param,
// qm, qv, absmax_m and absmax_v; grad, qmaps, hparams and grad_scale are read.
//
// One CUDA block of 256 threads per quantization block, one element per thread:
//   m = qmap_m[qm] * absmax_m, v = qmap_v[qv] * absmax_v            (dequantize)
//   the fp32 AdamW step of adamw.cu (same intrinsics, same order)     (update)
//   absmax = max |m| (max v) over the block; code = the nearest map value of m / absmax,
//   chosen as the number of midpoints strictly below it (a tie goes to the lower code)
// qmaps (fp32, 1024) = [signed map for m (256) | its 255 midpoints, +inf | unsigned map for v |
// its midpoints, +inf], made once on the host (cuengine/kernels/adamw8bit.py: dynamic_map), so the
// kernel and the NumPy twin compare against the same fp32 midpoints. hparams and the clip scale are
// read on the device as in adamw.cu; a non-finite clip scale writes nothing. bf16 params round
// stochastically with adamw.cu's hash (sr_hash.cuh, a copy of its functions; tests check the bits
// against adamw's NumPy twin). A max is order-independent, so the result is deterministic
// whatever the scheduling.
//
// adamw8bit_multi_*: every tensor of a table in one launch (cuengine.kernels.adamw8bit.AdamW8bitTable,
// written once, so a step uploads nothing and a captured graph replays it). A Record8 per tensor and an
// `owner` map (the record of every block of the launch). Block g takes QCHUNK quantization blocks of
// record owner[g] from (g - first_chunk) * QCHUNK, never past the tensor's last: a quantization block is
// always one tensor's own 256 elements, as in the per-tensor launch. One warp per quantization block
// (lane l: elements 8l .. 8l+7, moved as 16-byte words where the record says the addresses allow; the
// same elements, the max over the same values by shuffles alone), the maps and the bucket table loaded
// and beta^step taken once per block. Element i gets the per-tensor kernel's arithmetic (adam8_element),
// its seed and draw index i, and the code its binary search picks (quantize_bucket, a lookup and one
// comparison), so the bits equal one adamw8bit_update per record.
#include "common.cuh"
#include "sr_hash.cuh"

typedef unsigned char u8;

#define QBLOCK 256

// kernels

// The number of the 255 sorted midpoints strictly below x: the index of the nearest code.
__device__ __forceinline__ u8 quantize(float x, const float* mids) {
    int lo = 0, hi = 255;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (mids[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (u8)lo;
}

__device__ __forceinline__ float block_max(float x, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = red[0];
#pragma unroll
    for (int w = 1; w < QBLOCK / 32; ++w) r = fmaxf(r, red[w]);
    return r;
}

struct Adam8 {
    float lr, b1, b2, omb1, omb2, eps, wd, gs, bc1, bc2;
};

// One element: dequantize its codes (m, v out), the fp32 AdamW step; returns the new param (unrounded).
template <typename Tp, typename Tg>
__device__ __forceinline__ float adam8_element(Tp param, Tg grad, u8 qm, u8 qv, float am_old, float av_old,
                                               const float* maps, const Adam8& a, float& m, float& v) {
    m = __fmul_rn(maps[qm], am_old);
    v = __fmul_rn(maps[512 + qv], av_old);
    const float g = __fmul_rn(to_float(grad), a.gs);
    const float p = to_float(param);
    m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.omb1, g));
    v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(a.omb2, __fmul_rn(g, g)));
    const float mhat = __fdiv_rn(m, a.bc1), vhat = __fdiv_rn(v, a.bc2);
    const float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(a.wd, p));
    return __fsub_rn(p, __fmul_rn(a.lr, upd));
}

template <typename Tp, typename Tg>
__device__ void adamw8bit_impl(Tp* param, const Tg* grad, u8* qm, u8* qv, float* absmax_m, float* absmax_v,
                               const float* qmaps, const float* hp, const float* grad_scale, int wd_on, u32 seed,
                               long long n) {
    __shared__ float maps[1024];
    __shared__ float red_m[QBLOCK / 32], red_v[QBLOCK / 32];
    const float gs = grad_scale ? *grad_scale : 1.f;
    if (!isfinite(gs)) return;  // the skipped step: the same for every thread
    for (int k = threadIdx.x; k < 1024; k += blockDim.x) maps[k] = qmaps[k];
    const float lr = hp[0], b1 = hp[1], b2 = hp[2], eps = hp[3], wd = wd_on ? hp[4] : 0.f, step = hp[5];
    const float omb1 = __fsub_rn(1.f, b1), omb2 = __fsub_rn(1.f, b2);
    const float bc1 = (float)(1.0 - pow((double)b1, (double)step));
    const float bc2 = (float)(1.0 - pow((double)b2, (double)step));
    const long long b = blockIdx.x;
    const long long i = b * QBLOCK + threadIdx.x;
    const bool in = i < n;
    const float am_old = absmax_m[b], av_old = absmax_v[b];
    __syncthreads();  // maps loaded
    const Adam8 a = {lr, b1, b2, omb1, omb2, eps, wd, gs, bc1, bc2};
    float p = 0.f, m = 0.f, v = 0.f;
    if (in) p = adam8_element(param[i], grad[i], qm[i], qv[i], am_old, av_old, maps, a, m, v);
    const float am = block_max(in ? fabsf(m) : 0.f, red_m);
    const float av = block_max(in ? v : 0.f, red_v);
    if (in) {
        param[i] = round_store<Tp>(p, sr_key(seed, (u32)step, 0u), i);
        qm[i] = quantize(am > 0.f ? __fdiv_rn(m, am) : 0.f, maps + 256);
        qv[i] = quantize(av > 0.f ? __fdiv_rn(v, av) : 0.f, maps + 768);
    }
    if (threadIdx.x == 0) {
        absmax_m[b] = am;
        absmax_v[b] = av;
    }
}

// ---- multi-tensor ------------------------------------------------------------------------------
#define QCHUNK 32  // quantization blocks per adamw8bit_multi block (AdamW8bitTable.CHUNK)
#define QWARPS 8   // warps per adamw8bit_multi block: one quantization block each at a time

// The bucket table of quantize_bucket (cuengine.kernels.adamw8bit.make_buckets): a bucket is the 2^16
// consecutive fp32 bit patterns of |x| that share their top 16 bits (exponent and 7 mantissa bits), from
// 2^-23 (every smaller |x| joins it) to 1.0 (every larger |x| joins it), for each sign and map.
#define BSHIFT 16
#define BFIRST (104 << 7)  // the bucket of 2^-23
#define BHALF 2945         // buckets per map and sign: BFIRST .. the bucket of 1.0 (127 << 7)
#define BBYTES 11792       // [signed map: x >= 0 | x < 0 | unsigned map: x >= 0 | x < 0], 4 * BHALF rounded up to 16

// quantize's code, the number of the 255 sorted midpoints strictly below x (0 for NaN), without its eight
// dependent shared-memory loads and without a branch. buckets[j] = the midpoints below every x of bucket j,
// and at most one midpoint, the next one (mids[lo]; +inf past the last), lies inside the bucket
// (make_buckets checks both), so one comparison finishes the count. A NaN takes the last bucket of the
// negative half (fminf returns the other operand), where lo = 0 and the comparison is false; -0 takes
// the positive half, whose count at 0 is the same. Checked against quantize on the host for every fp32
// pattern but the signaling NaNs (the host's fminf makes those NaN; x here is a quotient or 0, never one).
__device__ __forceinline__ u8 quantize_bucket(float x, const float* mids, const u8* buckets) {
    const float ax = fmaxf(fminf(fabsf(x), 1.f), 0x1p-23f);
    const u32 j = (__float_as_uint(ax) >> BSHIFT) - BFIRST + (x >= 0.f ? 0u : (u32)BHALF);
    const u32 lo = buckets[j];
    return (u8)(lo + (mids[lo] < x));
}

// One tensor of an adamw8bit table: 72 bytes, the layout of cuengine.kernels.adamw8bit._RECORD.
struct Record8 {
    void* param;
    const void* grad;
    u8* qm;
    u8* qv;
    float* absmax_m;
    float* absmax_v;
    long long n;      // elements (> 0)
    u32 seed;         // adamw8bit_update's seed for this tensor
    int wd_on;
    int first_chunk;  // the first adamw8bit_multi block of this tensor: a prefix sum over the table
    int vec;          // param and grad 16-byte aligned, qm and qv 8-byte aligned: whole rows move as vectors
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// A lane's eight consecutive elements: one 16-byte word of bf16, two of fp32, half of one of codes.
template <typename T> struct alignas(sizeof(T) * 8 < 16 ? sizeof(T) * 8 : 16) Row8 {
    T v[8];
};
template <typename T> struct RowWord { typedef uint4 type; };
template <> struct RowWord<u8> { typedef uint2 type; };

// Streamed once: loads and stores that evict first (.cs), so the maps and the table stay in L2. `whole`:
// all eight elements exist and the address is aligned; else the first `valid` element by element (zeros after).
template <typename T> __device__ __forceinline__ Row8<T> load_row(const T* p, bool whole, int valid, T zero) {
    typedef typename RowWord<T>::type W;
    Row8<T> r;
    if (whole) {
#pragma unroll
        for (int w = 0; w < (int)(sizeof(r) / sizeof(W)); ++w)
            reinterpret_cast<W*>(r.v)[w] = __ldcs(reinterpret_cast<const W*>(p) + w);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) r.v[k] = k < valid ? __ldcs(p + k) : zero;
    }
    return r;
}
template <typename T> __device__ __forceinline__ void store_row(T* p, const Row8<T>& r, bool whole, int valid) {
    typedef typename RowWord<T>::type W;
    if (whole) {
#pragma unroll
        for (int w = 0; w < (int)(sizeof(r) / sizeof(W)); ++w)
            __stcs(reinterpret_cast<W*>(p) + w, reinterpret_cast<const W*>(r.v)[w]);
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (k < valid) __stcs(p + k, r.v[k]);
    }
}

template <typename Tp, typename Tg>
__device__ void adamw8bit_multi_impl(const Record8* tab, const int* owner, const float* qmaps, const uint4* btab,
                                     const float* hp, const float* grad_scale) {
    __shared__ uint4 s_maps[1024 / 4], s_buckets[BBYTES / 16];  // 16-byte words: copied as such
    __shared__ float s_bc[2];
    const float gs = grad_scale ? *grad_scale : 1.f;
    if (!isfinite(gs)) return;  // the skipped step: the same for every block
    const Record8& r = tab[owner[blockIdx.x]];
    s_maps[threadIdx.x] = reinterpret_cast<const uint4*>(qmaps)[threadIdx.x];
    for (int k = threadIdx.x; k < BBYTES / 16; k += QWARPS * 32) s_buckets[k] = btab[k];
    const float b1 = hp[1], b2 = hp[2], step = hp[5];
    if (threadIdx.x == 0) {  // the per-tensor kernel's expressions, once per block
        s_bc[0] = (float)(1.0 - pow((double)b1, (double)step));
        s_bc[1] = (float)(1.0 - pow((double)b2, (double)step));
    }
    __syncthreads();  // maps, buckets and bias corrections loaded
    const Adam8 a = {hp[0], b1, b2, __fsub_rn(1.f, b1), __fsub_rn(1.f, b2), hp[3], r.wd_on ? hp[4] : 0.f, gs,
                     s_bc[0], s_bc[1]};
    const u32 key = sr_key(r.seed, (u32)step, 0u);
    const float* maps = reinterpret_cast<const float*>(s_maps);
    const u8* buckets = reinterpret_cast<const u8*>(s_buckets);
    // locals: the stores below could alias the table as far as the compiler knows, and would reload it
    Tp* param = static_cast<Tp*>(r.param);
    const Tg* grad = static_cast<const Tg*>(r.grad);
    u8 *qm = r.qm, *qv = r.qv;
    float *absmax_m = r.absmax_m, *absmax_v = r.absmax_v;
    const long long n = r.n, nb = (n + QBLOCK - 1) / QBLOCK;
    const bool vec = r.vec != 0;
    const long long b_lo = (long long)(blockIdx.x - r.first_chunk) * QCHUNK;
    const long long b_hi = b_lo + QCHUNK < nb ? b_lo + QCHUNK : nb;
    const int lane = threadIdx.x & 31;
    const Tp pzero = from_float<Tp>(0.f);
    const Tg gzero = from_float<Tg>(0.f);
    for (long long b = b_lo + (threadIdx.x >> 5); b < b_hi; b += QWARPS) {
        // elements i0 .. i0 + 7 of this lane; i0 is a multiple of 8, so i0 | k is i0 + k
        const long long i0 = b * QBLOCK + lane * 8;
        const int cnt = n - b * QBLOCK < QBLOCK ? (int)(n - b * QBLOCK) : QBLOCK;  // the block's elements
        const bool whole = vec && cnt == QBLOCK;
        const int valid = min(max(cnt - lane * 8, 0), 8);
        Row8<Tp> pr = load_row(param + i0, whole, valid, pzero);
        const Row8<Tg> gr = load_row(grad + i0, whole, valid, gzero);
        Row8<u8> cm = load_row(qm + i0, whole, valid, (u8)0), cv = load_row(qv + i0, whole, valid, (u8)0);
        const float am_old = absmax_m[b], av_old = absmax_v[b];
        // fmaxf drops a NaN operand, so starting from NaN makes the max a function of the block's 256 values
        // (0 past the end) alone, NaNs included, as block_max's order gives it
        float m[8], v[8], mx_m = __int_as_float(0x7fc00000), mx_v = mx_m;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float p = adam8_element(pr.v[k], gr.v[k], cm.v[k], cv.v[k], am_old, av_old, maps, a, m[k], v[k]);
            pr.v[k] = round_store<Tp>(p, key, i0 | k);
        }
        store_row(param + i0, pr, whole, valid);
        if (cnt == QBLOCK) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                mx_m = fmaxf(mx_m, fabsf(m[k]));
                mx_v = fmaxf(mx_v, v[k]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                mx_m = fmaxf(mx_m, k < valid ? fabsf(m[k]) : 0.f);
                mx_v = fmaxf(mx_v, k < valid ? v[k] : 0.f);
            }
        }
        const float am = warp_max(mx_m), av = warp_max(mx_v);  // every lane read am_old/av_old above
        // am > 0 ? m / am : 0 without a branch: the division by 1 is thrown away
        const bool pos_m = am > 0.f, pos_v = av > 0.f;
        const float dm = pos_m ? am : 1.f, dv = pos_v ? av : 1.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float xm = __fdiv_rn(m[k], dm), xv = __fdiv_rn(v[k], dv);
            cm.v[k] = quantize_bucket(pos_m ? xm : 0.f, maps + 256, buckets);
            cv.v[k] = quantize_bucket(pos_v ? xv : 0.f, maps + 768, buckets + 2 * BHALF);
        }
        store_row(qm + i0, cm, whole, valid);
        store_row(qv + i0, cv, whole, valid);
        if (lane == 0) {
            absmax_m[b] = am;
            absmax_v[b] = av;
        }
    }
}

#define ADAMW8BIT_KERNEL(PS, TP, GS, TG)                                                                       \
    extern "C" __global__ void __launch_bounds__(QBLOCK)                                                     \
        adamw8bit_##PS##_##GS(TP* param, const TG* grad, u8* qm, u8* qv, float* absmax_m, float* absmax_v,  \
                              const float* qmaps, const float* hp, const float* grad_scale, int wd_on,       \
                              u32 seed, long long n) {                                                       \
        adamw8bit_impl<TP, TG>(param, grad, qm, qv, absmax_m, absmax_v, qmaps, hp, grad_scale, wd_on, seed, n); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QWARPS * 32, 4) adamw8bit_multi_##PS##_##GS(                 \
        const Record8* tab, const int* owner, const float* qmaps, const uint4* buckets, const float* hp,     \
        const float* grad_scale) {                                                                           \
        adamw8bit_multi_impl<TP, TG>(tab, owner, qmaps, buckets, hp, grad_scale);                            \
    }
ADAMW8BIT_KERNEL(f32, float, f32, float)
ADAMW8BIT_KERNEL(f32, float, bf16, bf16)
ADAMW8BIT_KERNEL(bf16, bf16, f32, float)
ADAMW8BIT_KERNEL(bf16, bf16, bf16, bf16)

// launchers: cuengine/kernels/adamw8bit.py (adamw8bit_update, adamw8bit_update_multi)
