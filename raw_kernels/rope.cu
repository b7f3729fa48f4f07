// Rotary position embedding (HF rotate-half form) on packed qkv (B, T, Hq + 2*Hkv, hs).
//
//   forward:  for q and k heads, with x1 = x[:hs/2], x2 = x[hs/2:], c = cos(t * f), s = sin(t * f):
//             out1 = x1 c - x2 s,  out2 = x2 c + x1 s                      (=)
//   backward: the inverse (transposed) rotation: dx1 = d1 c + d2 s,  dx2 = d2 c - d1 s   (=)
//   v heads are copied unchanged when out is not inp; in place they are left alone, but still read
//   when abs_max is asked for, since abs_max covers the whole output tensor.
// The table freqs (max_pos, hs) holds [cos | sin] halves in fp32 or fp16; row t serves position t.
// fp32 math, one rounding at the store. In place (out == inp) is safe: each thread reads its two
// vectors before writing them, and no other thread touches them. hs: a multiple of 2 * (16-byte
// vector width).
#include "common.cuh"

__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// max over the block of each thread's |x| bits, then one atomicMax. Non-negative floats (NaN above inf)
// order like their bit patterns, so the integer max is exact and order-independent.
__device__ __forceinline__ void block_atomic_abs_max(float* dst, unsigned bits) {
    __shared__ unsigned s_bits[32];
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

// ---- kernels ------------------------------------------------------------------------------

// One thread per (row, head, VN-vector of the first half): it handles x1 and the matching x2.
template <typename T, typename F>
__device__ void rope_impl(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len,
                          int Hq, int Hkv, int hs, bool inverse, bool copy_v) {
    constexpr int VN = Pack16<T>::N;
    const int half = hs / 2, hv = half / VN, H = Hq + 2 * Hkv;
    const long long total = rows * H * hv;
    const float sign = inverse ? -1.f : 1.f;  // the inverse rotation is the rotation by -angle
    unsigned amax = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % hv) * VN;
        const long long rh = i / hv;
        const int h = (int)(rh % H);
        const long long row = rh / H;
        const bool rotate = h < Hq + Hkv;
        if (!rotate && !copy_v && !abs_max) continue;
        const size_t base = (size_t)rh * hs + j;
        const Pack16<T> x1 = Pack16<T>::load(inp + base), x2 = Pack16<T>::load(inp + base + half);
        Pack16<T> y1 = x1, y2 = x2;
        if (rotate) {
            const F* f = freqs + (size_t)(row % T_len) * hs + j;
            for (int k = 0; k < VN; ++k) {
                const float c = to_float(f[k]), s = sign * to_float(f[half + k]);
                const float a = to_float(x1.v[k]), b = to_float(x2.v[k]);
                y1.v[k] = from_float<T>(a * c - b * s);
                y2.v[k] = from_float<T>(b * c + a * s);
            }
        }
        if (rotate || copy_v) {
            y1.store(out + base);
            y2.store(out + base + half);
        }
        for (int k = 0; k < VN; ++k)
            amax = max(amax, max(abs_bits(to_float(y1.v[k])), abs_bits(to_float(y2.v[k]))));
    }
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// ---- launchers ----------------------------------------------------------------------------

#define ROPE_KERNEL(SUF, T, SUFF, F)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                     \
        rope_##SUF##_##SUFF(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len, \
                            int Hq, int Hkv, int hs, int inverse, int copy_v) {                           \
        rope_impl<T, F>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse != 0, copy_v != 0);   \
    }
#define ROPE_KERNELS(SUF, T)        \
    ROPE_KERNEL(SUF, T, f32, float) \
    ROPE_KERNEL(SUF, T, f16, half)
ROPE_KERNELS(f32, float)
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, half)
