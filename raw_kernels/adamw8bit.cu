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
    float p = 0.f, m = 0.f, v = 0.f;
    if (in) {
        m = __fmul_rn(maps[qm[i]], am_old);
        v = __fmul_rn(maps[512 + qv[i]], av_old);
        const float g = __fmul_rn(to_float(grad[i]), gs);
        p = to_float(param[i]);
        m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));
        v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(omb2, __fmul_rn(g, g)));
        const float mhat = __fdiv_rn(m, bc1), vhat = __fdiv_rn(v, bc2);
        const float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps)), __fmul_rn(wd, p));
        p = __fsub_rn(p, __fmul_rn(lr, upd));
    }
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

#define ADAMW8BIT_KERNEL(PS, TP, GS, TG)                                                                       \
    extern "C" __global__ void __launch_bounds__(QBLOCK)                                                     \
        adamw8bit_##PS##_##GS(TP* param, const TG* grad, u8* qm, u8* qv, float* absmax_m, float* absmax_v,  \
                              const float* qmaps, const float* hp, const float* grad_scale, int wd_on,       \
                              u32 seed, long long n) {                                                       \
        adamw8bit_impl<TP, TG>(param, grad, qm, qv, absmax_m, absmax_v, qmaps, hp, grad_scale, wd_on, seed, n); \
    }
ADAMW8BIT_KERNEL(f32, float, f32, float)
ADAMW8BIT_KERNEL(f32, float, bf16, bf16)
ADAMW8BIT_KERNEL(bf16, bf16, f32, float)
ADAMW8BIT_KERNEL(bf16, bf16, bf16, bf16)

// launchers: cuengine/kernels/adamw8bit.py (adamw8bit_update)
