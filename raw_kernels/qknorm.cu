// Qwen3's QK-norm: an RMSNorm over each query head and each key head of packed qkv, with one weight
// vector of head_size for all query heads and one for all key heads. Value heads pass through.
//
//   forward:  rstd[n, h] = 1 / sqrt(mean(x[n, h, :]^2) + eps);  out = x * rstd * w_h          (=)
//   backward: dinp = rstd * (w_h*dout - x*rstd * sum(w_h*dout*x) * rstd / hs)                  (=)
//             dweight_q, dweight_k += sum over rows and heads of dout * x * rstd              (+=)
// w_h is weight_q for the Hq query heads and weight_k for the Hkv key heads. One warp per (row, head),
// fp32 math, one rounding at each store. out may alias inp and dinp may alias dout: a lane reads its
// elements before it writes them and no other thread touches them. The v heads are copied (=), so
// in-place calls leave them as they are.
// The weight gradients are deterministic: block b adds the (row, head) pairs it owns, in a fixed order,
// into per-warp shared partials, then into scratch[b]; a second kernel adds scratch's rows in order.
// The block count is the scratch's first dimension (qknorm_scratch_shape), a function of the sizes only.
#include "common.cuh"

constexpr int QK_WARPS = 8;  // (row, head) pairs per block at a time

// ---- kernels ------------------------------------------------------------------------------

template <typename T>
__device__ void qknorm_forward_impl(T* out, float* rstd, const T* inp, const T* weight_q, const T* weight_k,
                                    float eps, int N, int Hq, int Hkv, int hs) {
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32, heads = Hq + 2 * Hkv, normed = Hq + Hkv;
    const size_t pairs = (size_t)N * heads;
    for (size_t p = (size_t)blockIdx.x * QK_WARPS + threadIdx.x / 32; p < pairs; p += (size_t)gridDim.x * QK_WARPS) {
        const int h = p % heads;
        const size_t base = p * hs;
        if (h >= normed) {  // a value head: copy
            for (int c = lane * VN; c < hs; c += 32 * VN) Pack16<T>::load(inp + base + c).store(out + base + c);
            continue;
        }
        const T* w = h < Hq ? weight_q : weight_k;
        float ss = 0.f;
        for (int c = lane * VN; c < hs; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c);
            for (int k = 0; k < VN; ++k) ss += to_float(x.v[k]) * to_float(x.v[k]);
        }
        ss = warp_sum(ss);
        const float r = 1.f / sqrtf(ss / hs + eps);
        if (lane == 0) rstd[(p / heads) * normed + h] = r;
        for (int c = lane * VN; c < hs; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c), wv = Pack16<T>::load(w + c);
            Pack16<T> y;
            for (int k = 0; k < VN; ++k) y.v[k] = from_float<T>(to_float(x.v[k]) * r * to_float(wv.v[k]));
            y.store(out + base + c);
        }
    }
}

// Block partials of (dweight_q, dweight_k) into scratch[blockIdx.x, 2, hs]; shared: warps * 2 * hs floats.
template <typename T>
__device__ void qknorm_backward_impl(T* dinp, float* scratch, const T* dout, const T* inp, const T* weight_q,
                                     const T* weight_k, const float* rstd, int N, int Hq, int Hkv, int hs) {
    extern __shared__ float s_dw[];  // (warps, 2, hs), lane-owned entries
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, heads = Hq + 2 * Hkv, normed = Hq + Hkv;
    float* my_dw = s_dw + (size_t)warp * 2 * hs;
    for (int c = lane; c < 2 * hs; c += 32) my_dw[c] = 0.f;
    __syncwarp();
    const size_t pairs = (size_t)N * heads;
    for (size_t p = (size_t)blockIdx.x * QK_WARPS + warp; p < pairs; p += (size_t)gridDim.x * QK_WARPS) {
        const int h = p % heads;
        const size_t base = p * hs;
        if (h >= normed) {
            for (int c = lane * VN; c < hs; c += 32 * VN) Pack16<T>::load(dout + base + c).store(dinp + base + c);
            continue;
        }
        const bool is_q = h < Hq;
        const T* w = is_q ? weight_q : weight_k;
        float* dw = my_dw + (is_q ? 0 : hs);
        const float r = rstd[(p / heads) * normed + h];
        float dot = 0.f;
        for (int c = lane * VN; c < hs; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c), g = Pack16<T>::load(dout + base + c),
                            wv = Pack16<T>::load(w + c);
            for (int k = 0; k < VN; ++k) dot += to_float(wv.v[k]) * to_float(g.v[k]) * to_float(x.v[k]);
        }
        dot = warp_sum(dot);
        const float coef = dot * r / hs;
        for (int c = lane * VN; c < hs; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c), g = Pack16<T>::load(dout + base + c),
                            wv = Pack16<T>::load(w + c);
            Pack16<T> d;
            for (int k = 0; k < VN; ++k) {
                const float xh = to_float(x.v[k]) * r, gk = to_float(g.v[k]);
                d.v[k] = from_float<T>(r * (to_float(wv.v[k]) * gk - xh * coef));
                dw[c + k] += gk * xh;
            }
            d.store(dinp + base + c);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * hs; c += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < QK_WARPS; ++w) acc += s_dw[(size_t)w * 2 * hs + c];
        scratch[(size_t)blockIdx.x * 2 * hs + c] = acc;
    }
}

// dweight_q[c] += sum_p scratch[p, 0, c];  dweight_k[c] += sum_p scratch[p, 1, c]  (in order of p)
template <typename T>
__device__ void qknorm_backward_dweight_impl(T* dweight_q, T* dweight_k, const float* scratch, int P, int hs) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= 2 * hs) return;
    float acc = 0.f;
    for (int p = 0; p < P; ++p) acc += scratch[(size_t)p * 2 * hs + c];
    T* dw = c < hs ? dweight_q + c : dweight_k + (c - hs);
    *dw = from_float<T>(to_float(*dw) + acc);
}

// ---- launchers ----------------------------------------------------------------------------

#define QKNORM_KERNELS(SUF, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(QK_WARPS * 32) qknorm_forward_##SUF(                       \
        T* out, float* rstd, const T* inp, const T* weight_q, const T* weight_k, float eps, int N, int Hq,   \
        int Hkv, int hs) {                                                                                  \
        qknorm_forward_impl<T>(out, rstd, inp, weight_q, weight_k, eps, N, Hq, Hkv, hs);                   \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(QK_WARPS * 32) qknorm_backward_##SUF(                      \
        T* dinp, float* scratch, const T* dout, const T* inp, const T* weight_q, const T* weight_k,         \
        const float* rstd, int N, int Hq, int Hkv, int hs) {                                                \
        qknorm_backward_impl<T>(dinp, scratch, dout, inp, weight_q, weight_k, rstd, N, Hq, Hkv, hs);       \
    }                                                                                                       \
    extern "C" __global__ void qknorm_backward_dweight_##SUF(T* dweight_q, T* dweight_k, const float* scratch,  \
                                                              int P, int hs) {                              \
        qknorm_backward_dweight_impl<T>(dweight_q, dweight_k, scratch, P, hs);                              \
    }
QKNORM_KERNELS(f32, float)
QKNORM_KERNELS(bf16, bf16)
