// AdamW update with decoupled weight decay, in place on (param, m, v).
//
// hparams (fp32, on the device) = [lr, beta1, beta2, eps, weight_decay, step, 0, 0] are read by
// the kernel, so one captured graph serves every step; step is 1-based. grad_scale (the clip
// scale of global_norm_finish) is a device pointer too, or null for 1. A non-finite grad_scale
// (global_norm_finish writes NaN for a non-finite norm) writes nothing: the step is skipped on the
// device, weights and moments untouched, without the host having to look.
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   p = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd p),  bc = 1 - beta^step
// Rounding points: every fp32 operation is an explicitly rounded intrinsic (no FMA contraction)
// and beta^step is taken in double, so the NumPy twin reproduces the fp32 values exactly.
// bf16 stores (param, m, v) round stochastically: 16 random bits from a counter-based hash of
// (seed, step, which array, element index + off) are added below the bf16 mantissa before truncating,
// which rounds up with probability equal to the discarded fraction (unbiased, reproducible,
// independent of the launch grid). fp32 stores are plain. The `_scalar` kernels take arrays
// that are not all 16-byte aligned.
#include "common.cuh"
#include "sr_hash.cuh"  // mix32, sr_key, sr_bits, round_store: the stochastic rounding


// kernels

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};

template <typename T> __device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
    constexpr int P = 16 / sizeof(T);
#pragma unroll
    for (int j = 0; j < 8; j += P) {
        const Vec<T, P> w = *reinterpret_cast<const Vec<T, P>*>(p + j);
#pragma unroll
        for (int k = 0; k < P; ++k) x[j + k] = to_float(w.v[k]);
    }
}

struct AdamParams {
    float lr, b1, b2, omb1, omb2, eps, wd, gs, bc1, bc2;
    u32 kp, km, kv;
};

__device__ __forceinline__ AdamParams adam_params(const float* hp, const float* grad_scale, int wd_on, u32 seed) {
    AdamParams a;
    a.lr = hp[0];
    a.b1 = hp[1];
    a.b2 = hp[2];
    a.eps = hp[3];
    a.wd = wd_on ? hp[4] : 0.f;
    const float step = hp[5];
    a.omb1 = __fsub_rn(1.f, a.b1);
    a.omb2 = __fsub_rn(1.f, a.b2);
    a.gs = grad_scale ? *grad_scale : 1.f;
    a.bc1 = (float)(1.0 - pow((double)a.b1, (double)step));
    a.bc2 = (float)(1.0 - pow((double)a.b2, (double)step));
    const u32 ustep = (u32)step;
    a.kp = sr_key(seed, ustep, 0u);
    a.km = sr_key(seed, ustep, 1u);
    a.kv = sr_key(seed, ustep, 2u);
    // Opaque to the optimiser: otherwise it recomputes the keys' hash chains inside the element loop
    // (rematerialisation), once per stored element.
    asm("" : "+r"(a.kp), "+r"(a.km), "+r"(a.kv));
    return a;
}

// One element; returns the new param and updates m and v.
__device__ __forceinline__ float adam_element(float p, float g, float& m, float& v, const AdamParams& a) {
    g = __fmul_rn(g, a.gs);
    m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.omb1, g));
    v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(a.omb2, __fmul_rn(g, g)));
    const float mhat = __fdiv_rn(m, a.bc1), vhat = __fdiv_rn(v, a.bc2);
    const float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(a.wd, p));
    return __fsub_rn(p, __fmul_rn(a.lr, upd));
}

template <typename Tp, typename Tg, typename Tm, typename Tv, bool VEC>
__device__ void adamw_impl(Tp* param, const Tg* grad, Tm* m, Tv* v, const float* hp, const float* grad_scale,
                           int wd_on, u32 seed, long long n, long long off) {
    const AdamParams a = adam_params(hp, grad_scale, wd_on, seed);
    if (!isfinite(a.gs)) return;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (VEC) {
        const long long packs = n / 8;
        for (long long pk = tid; pk < packs; pk += nthreads) {
            const long long i0 = pk * 8;
            float xp[8], xg[8], xm[8], xv[8];
            load8(param + i0, xp);
            load8(grad + i0, xg);
            load8(m + i0, xm);
            load8(v + i0, xv);
            Vec<Tp, 8> op;
            Vec<Tm, 8> om;
            Vec<Tv, 8> ov;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float np = adam_element(xp[k], xg[k], xm[k], xv[k], a);
                op.v[k] = round_store<Tp>(np, a.kp, off + i0 + k);
                om.v[k] = round_store<Tm>(xm[k], a.km, off + i0 + k);
                ov.v[k] = round_store<Tv>(xv[k], a.kv, off + i0 + k);
            }
            // Vec<T, 8> of fp32 is 32 bytes: two 16-byte stores on a 16-byte aligned address.
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tp))
                *reinterpret_cast<Vec<Tp, 16 / sizeof(Tp)>*>(param + i0 + j) =
                    *reinterpret_cast<const Vec<Tp, 16 / sizeof(Tp)>*>(op.v + j);
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tm))
                *reinterpret_cast<Vec<Tm, 16 / sizeof(Tm)>*>(m + i0 + j) =
                    *reinterpret_cast<const Vec<Tm, 16 / sizeof(Tm)>*>(om.v + j);
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tv))
                *reinterpret_cast<Vec<Tv, 16 / sizeof(Tv)>*>(v + i0 + j) =
                    *reinterpret_cast<const Vec<Tv, 16 / sizeof(Tv)>*>(ov.v + j);
        }
        done = packs * 8;
    }
    for (long long i = done + tid; i < n; i += nthreads) {
        float xm = to_float(m[i]), xv = to_float(v[i]);
        const float np = adam_element(to_float(param[i]), to_float(grad[i]), xm, xv, a);
        param[i] = round_store<Tp>(np, a.kp, off + i);
        m[i] = round_store<Tm>(xm, a.km, off + i);
        v[i] = round_store<Tv>(xv, a.kv, off + i);
    }
}

#define ADAMW_KERNEL(PS, TP, GS, TG, MS, TM, VS, TV)                                                          \
    extern "C" __global__ void __launch_bounds__(256) adamw_##PS##_##GS##_##MS##_##VS(                        \
        TP* param, const TG* grad, TM* m, TV* v, const float* hp, const float* grad_scale, int wd_on,         \
        u32 seed, long long n, long long off) {                                                               \
        adamw_impl<TP, TG, TM, TV, true>(param, grad, m, v, hp, grad_scale, wd_on, seed, n, off);             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) adamw_##PS##_##GS##_##MS##_##VS##_scalar(               \
        TP* param, const TG* grad, TM* m, TV* v, const float* hp, const float* grad_scale, int wd_on,         \
        u32 seed, long long n, long long off) {                                                               \
        adamw_impl<TP, TG, TM, TV, false>(param, grad, m, v, hp, grad_scale, wd_on, seed, n, off);            \
    }
#define ADAMW_MV(PS, TP, GS, TG)                                                                              \
    ADAMW_KERNEL(PS, TP, GS, TG, f32, float, f32, float)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, f32, float, bf16, bf16)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, bf16, bf16, f32, float)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, bf16, bf16, bf16, bf16)
ADAMW_MV(f32, float, f32, float)
ADAMW_MV(f32, float, bf16, bf16)
ADAMW_MV(bf16, bf16, f32, float)
ADAMW_MV(bf16, bf16, bf16, bf16)

// launchers: cuengine/kernels/adamw.py (adamw_update)
