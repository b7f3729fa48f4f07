// Muon's elementwise steps around the Newton–Schulz matmuls (cuengine/model/muon.py drives them):
//   muon_momentum:  buf = mu buf + g;  out = g + mu buf        (g = grad * clip scale; Nesterov)
//                   buf in place (=), out written (=)
//   muon_normalize: x = bf16(g / (norm + 1e-7))                 x written (=); norm = result[0] of
//                   global_norm_finish over g's partial sums
//   muon_axpby:     out = bf16(alpha x + beta y)                out written (=); out may alias x
//   muon_apply:     p = p - lr (wd p + scale x)                 param in place (=)
// hparams (fp32, on the device) = adamw.make_hparams's [lr, beta1, beta2, eps, wd, step, mu, 0]:
// lr, wd and the step are AdamW's, mu (slot 6) is Muon's momentum. A non-finite clip scale writes
// nothing in muon_momentum and muon_apply (the skipped step; the Newton–Schulz scratch in between
// holds garbage that nothing reads). Every fp32 operation is an explicitly rounded intrinsic, as in
// adamw.cu, so the NumPy twin reproduces the values; bf16 params round stochastically with
// adamw.cu's hash (sr_hash.cuh).
#include "common.cuh"
#include "sr_hash.cuh"

// kernels

template <typename Tg>
__device__ void muon_momentum_impl(float* buf, float* out, const Tg* grad, const float* hp, const float* grad_scale,
                                   long long n) {
    const float gs = grad_scale ? *grad_scale : 1.f;
    if (!isfinite(gs)) return;
    const float mu = hp[6];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = __fmul_rn(to_float(grad[i]), gs);
        const float b = __fadd_rn(__fmul_rn(mu, buf[i]), g);
        buf[i] = b;
        out[i] = __fadd_rn(g, __fmul_rn(mu, b));
    }
}

extern "C" __global__ void __launch_bounds__(256) muon_momentum_f32(float* buf, float* out, const float* grad,
                                                                   const float* hp, const float* gs, long long n) {
    muon_momentum_impl<float>(buf, out, grad, hp, gs, n);
}
extern "C" __global__ void __launch_bounds__(256) muon_momentum_bf16(float* buf, float* out, const bf16* grad,
                                                                    const float* hp, const float* gs, long long n) {
    muon_momentum_impl<bf16>(buf, out, grad, hp, gs, n);
}

extern "C" __global__ void __launch_bounds__(256) muon_normalize(bf16* x, const float* g, const float* result,
                                                                long long n) {
    const float d = __fadd_rn(result[0], 1e-7f);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = __float2bfloat16_rn(__fdiv_rn(g[i], d));
}

extern "C" __global__ void __launch_bounds__(256) muon_axpby(bf16* out, const bf16* x, const bf16* y, float alpha,
                                                            float beta, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __float2bfloat16_rn(
            __fadd_rn(__fmul_rn(alpha, __bfloat162float(x[i])), __fmul_rn(beta, __bfloat162float(y[i]))));
}

template <typename Tp>
__device__ void muon_apply_impl(Tp* param, const bf16* x, const float* hp, const float* grad_scale, float scale,
                                u32 seed, long long n, long long off) {
    const float gs = grad_scale ? *grad_scale : 1.f;
    if (!isfinite(gs)) return;
    const float lr = hp[0], wd = hp[4];
    const u32 key = sr_key(seed, (u32)hp[5], 0u);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const float p = to_float(param[i]);
        const float upd = __fadd_rn(__fmul_rn(wd, p), __fmul_rn(scale, __bfloat162float(x[i])));
        param[i] = round_store<Tp>(__fsub_rn(p, __fmul_rn(lr, upd)), key, off + i);
    }
}

extern "C" __global__ void __launch_bounds__(256) muon_apply_f32(float* param, const bf16* x, const float* hp,
                                                                const float* gs, float scale, u32 seed, long long n,
                                                                long long off) {
    muon_apply_impl<float>(param, x, hp, gs, scale, seed, n, off);
}
extern "C" __global__ void __launch_bounds__(256) muon_apply_bf16(bf16* param, const bf16* x, const float* hp,
                                                                 const float* gs, float scale, u32 seed, long long n,
                                                                 long long off) {
    muon_apply_impl<bf16>(param, x, hp, gs, scale, seed, n, off);
}

// launchers: cuengine/kernels/muon.py
