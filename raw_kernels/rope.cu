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

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};


// ---- kernels ------------------------------------------------------------------------------

// VN consecutive table values as floats: 16-byte (or 8-byte) vector loads when the table is 16-byte
// aligned (every row then is: hs is a multiple of 2 * VN), scalar loads otherwise.
template <int VN, typename F> __device__ __forceinline__ void load_table(const F* p, bool vec, float (&out)[VN]) {
    constexpr int W = VN * (int)sizeof(F) > 16 ? 16 / (int)sizeof(F) : VN;  // elements per access
    if (vec) {
#pragma unroll
        for (int j = 0; j < VN; j += W) {
            const Vec<F, W> w = *reinterpret_cast<const Vec<F, W>*>(p + j);
#pragma unroll
            for (int k = 0; k < W; ++k) out[j + k] = to_float(w.v[k]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < VN; ++k) out[k] = to_float(p[k]);
    }
}

// One thread per (row, head, VN-vector of the first half): it handles x1 and the matching x2.
// The grid-stride index i = rh * hv + jv, rh = row * H + h, row = b * T_len + t, is kept as rh and the
// digits (t, h, jv), advanced by the stride's digits with carries: no integer division per item.
template <typename T, typename F>
__device__ void rope_impl(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len,
                          int Hq, int Hkv, int hs, bool inverse, bool copy_v) {
    constexpr int VN = Pack16<T>::N;
    const int half = hs / 2, hv = half / VN, H = Hq + 2 * Hkv;
    const float sign = inverse ? -1.f : 1.f;  // the inverse rotation is the rotation by -angle
    const bool vec_table = ((size_t)freqs & 15) == 0;
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long rh_end = rows * H;
    long long rh = start / hv;
    const long long srh = stride / hv;
    int jv = (int)(start - rh * hv);
    const int sj = (int)(stride - srh * hv);
    int h = (int)(rh % H);
    const int sh = (int)(srh % H);
    int t = (int)((rh / H) % T_len);
    const int st = (int)((srh / H) % T_len);
    unsigned amax = 0;
    while (rh < rh_end) {
        const bool rotate = h < Hq + Hkv;
        if (rotate || copy_v || abs_max) {
            const int j = jv * VN;
            const size_t base = (size_t)rh * hs + j;
            const Pack16<T> x1 = Pack16<T>::load(inp + base), x2 = Pack16<T>::load(inp + base + half);
            Pack16<T> y1 = x1, y2 = x2;
            if (rotate) {
                const F* f = freqs + (size_t)t * hs + j;
                float c[VN], s[VN];
                load_table<VN>(f, vec_table, c);
                load_table<VN>(f + half, vec_table, s);
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    const float a = to_float(x1.v[k]), bb = to_float(x2.v[k]), sk = sign * s[k];
                    y1.v[k] = from_float<T>(a * c[k] - bb * sk);
                    y2.v[k] = from_float<T>(bb * c[k] + a * sk);
                }
            }
            if (rotate || copy_v) {
                y1.store(out + base);
                y2.store(out + base + half);
            }
            if (abs_max)
#pragma unroll
                for (int k = 0; k < VN; ++k)
                    amax = max(amax, max(abs_bits(to_float(y1.v[k])), abs_bits(to_float(y2.v[k]))));
        }
        jv += sj;  // advance by the stride, digit by digit
        int carry = jv >= hv;
        jv -= carry ? hv : 0;
        rh += srh + carry;
        h += sh + carry;
        carry = h >= H;
        h -= carry ? H : 0;
        t += st + carry;
        t -= t >= T_len ? T_len : 0;
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
