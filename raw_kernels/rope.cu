// Rotary position embedding (HF rotate-half form) on packed qkv (B, T, Hq + 2*Hkv, hs).
//
//   forward:  for q and k heads, with x1 = x[:hs/2], x2 = x[hs/2:], c = cos(t * f), s = sin(t * f):
//             out1 = x1 c - x2 s,  out2 = x2 c + x1 s                      (=)
//   backward: the inverse (transposed) rotation: dx1 = d1 c + d2 s,  dx2 = d2 c - d1 s   (=)
//   v heads are copied unchanged when out is not inp; in place they are left alone, but still read
//   when abs_max is asked for, since abs_max covers the whole output tensor.
// The table freqs (max_pos, hs) holds [cos | sin] halves in fp32 or fp16; row t serves position t.
// fp32 math, one rounding at the store. In place (out == inp) is safe: each thread reads all its
// vectors before writing them, and no other thread touches them. hs: a multiple of 2 * (16-byte
// vector width).
#include "common.cuh"

// Heads per thread, and the block: cuengine/kernels/rope.py sizes the grid by them (one wave of
// ROPE_BLOCKS_PER_SM blocks per SM, which __launch_bounds__ keeps resident: 72 registers).
constexpr int ROPE_HEADS = 2, ROPE_THREADS = 128, ROPE_BLOCKS_PER_SM = 7;

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};


// ---- kernels ------------------------------------------------------------------------------

// VN consecutive table values as floats: 16-byte (or 8-byte) vector loads when the table is 16-byte
// aligned (every row then is: hs is a multiple of 2 * VN), scalar loads otherwise (the kernel picks
// its loop once, by the table's address).
template <bool VEC, int VN, typename F> __device__ __forceinline__ void load_table(const F* p, float (&out)[VN]) {
    constexpr int W = VN * (int)sizeof(F) > 16 ? 16 / (int)sizeof(F) : VN;  // elements per access
    if (VEC) {
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

// A 16-byte vector of T kept as its four 32-bit words, element k converted where it is used: as a
// Pack16 of a 16-bit type the compiler splits it into 16-bit registers as soon as it lands, 8 more
// registers per vector.
__device__ __forceinline__ unsigned word(const uint4& w, int i) { return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w; }
template <typename T> __device__ __forceinline__ float elem(const uint4& w, int k);
template <> __device__ __forceinline__ float elem<float>(const uint4& w, int k) { return __uint_as_float(word(w, k)); }
template <> __device__ __forceinline__ float elem<bf16>(const uint4& w, int k) {  // exact, as __bfloat162float
    const unsigned u = word(w, k / 2);
    return __uint_as_float(k % 2 ? u & 0xffff0000u : u << 16);
}
template <> __device__ __forceinline__ float elem<half>(const uint4& w, int k) {
    const unsigned u = word(w, k / 2);
    return __half2float(__ushort_as_half((unsigned short)(k % 2 ? u >> 16 : u & 0xffffu)));
}

// y rounded to T (to nearest even, as from_float), as the words of a 16-byte vector: a pair of 16-bit
// values takes one paired conversion (cvt.rn.bf16x2.f32 / f16x2).
__device__ __forceinline__ unsigned pack2(bf16, float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}
__device__ __forceinline__ unsigned pack2(half, float lo, float hi) {
    const half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}
template <typename T, int N> __device__ __forceinline__ uint4 to_words(const float (&y)[N]) {
    if constexpr (sizeof(T) == 4)
        return make_uint4(__float_as_uint(y[0]), __float_as_uint(y[1]), __float_as_uint(y[2]), __float_as_uint(y[3]));
    else
        return make_uint4(pack2(T(), y[0], y[1]), pack2(T(), y[2], y[3]), pack2(T(), y[4], y[5]), pack2(T(), y[6], y[7]));
}

// max |v| bits over two vectors
template <typename T> __device__ __forceinline__ unsigned abs_max_bits(const uint4& a, const uint4& b) {
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < Pack16<T>::N; ++k) m = max(m, max(abs_bits(elem<T>(a, k)), abs_bits(elem<T>(b, k))));
    return m;
}

// One thread per (row, pair of heads h0 = 2p and h0 + 1, VN-vector of the first half): it handles x1
// and the matching x2 of both heads, which share position t and so the table's cos and sin. Its four
// data loads and the table loads are all issued before anything waits on them: 64 bytes of data in
// flight per thread (one head per thread had 32). In place, the loads alias the stores, but they read
// only this thread's own elements. In place without abs_max, the pairs of v heads are not visited:
// HP counts the pairs up to the last rotated head. The grid-stride index i = (row * HP + p) * hv + jv
// is kept as its digits (row, p, jv) and t = row % T_len, advanced by the stride's digits with
// carries: no integer division per item.
template <typename T, typename F, bool VEC_TABLE>
__device__ void rope_impl(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len,
                          int Hq, int Hkv, int hs, bool inverse, bool copy_v) {
    constexpr int VN = Pack16<T>::N, U = ROPE_HEADS;
    const bool read_v = copy_v || abs_max;
    const int half = hs / 2, hv = half / VN, H = Hq + 2 * Hkv, R = Hq + Hkv, HP = ((read_v ? H : R) + U - 1) / U;
    const float sign = inverse ? -1.f : 1.f;  // the inverse rotation is the rotation by -angle
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long q = start / hv, row = q / HP;
    const long long sq = stride / hv, srow = sq / HP;
    int jv = (int)(start - q * hv), p = (int)(q - row * HP), t = (int)(row % T_len);
    const int sj = (int)(stride - sq * hv), sp = (int)(sq - srow * HP), st = (int)(srow % T_len);
    unsigned amax = 0;
    while (row < rows) {
        const int h0 = p * U, j = jv * VN;
        const size_t base = ((size_t)row * H + h0) * hs + j;
        uint4 x1[U], x2[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // a head past H, or an in-place v head, reads head h0 again: no branch
            const size_t in = base + (h0 + u < H && (h0 + u < R || read_v) ? (size_t)u * hs : 0);
            x1[u] = *reinterpret_cast<const uint4*>(inp + in);
            x2[u] = *reinterpret_cast<const uint4*>(inp + in + half);
        }
        float c[VN], s[VN];  // read for a pair of v heads too: no branch among the loads
        load_table<VEC_TABLE>(freqs + (size_t)t * hs + j, c);
        load_table<VEC_TABLE>(freqs + (size_t)t * hs + j + half, s);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            T* o = out + base + (size_t)u * hs;
            if (h0 + u < R) {
                float y1[VN], y2[VN];
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    const float a = elem<T>(x1[u], k), bb = elem<T>(x2[u], k), sk = sign * s[k];
                    y1[k] = a * c[k] - bb * sk;
                    y2[k] = bb * c[k] + a * sk;
                }
                const uint4 w1 = to_words<T>(y1), w2 = to_words<T>(y2);
                *reinterpret_cast<uint4*>(o) = w1;
                *reinterpret_cast<uint4*>(o + half) = w2;
                if (abs_max) amax = max(amax, abs_max_bits<T>(w1, w2));
            } else if (h0 + u < H && read_v) {  // a v head: copied, and seen by abs_max
                if (copy_v) {
                    *reinterpret_cast<uint4*>(o) = x1[u];
                    *reinterpret_cast<uint4*>(o + half) = x2[u];
                }
                if (abs_max) amax = max(amax, abs_max_bits<T>(x1[u], x2[u]));
            }
        }
        jv += sj;  // advance by the stride, digit by digit
        int carry = jv >= hv;
        jv -= carry ? hv : 0;
        p += sp + carry;
        carry = p >= HP;
        p -= carry ? HP : 0;
        row += srow + carry;
        t += st + carry;
        t -= t >= T_len ? T_len : 0;
    }
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// ---- launchers ----------------------------------------------------------------------------

#define ROPE_KERNEL(SUF, T, SUFF, F)                                                                      \
    extern "C" __global__ void __launch_bounds__(ROPE_THREADS, ROPE_BLOCKS_PER_SM)                        \
        rope_##SUF##_##SUFF(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len, \
                            int Hq, int Hkv, int hs, int inverse, int copy_v) {                           \
        if (((size_t)freqs & 15) == 0)                                                                    \
            rope_impl<T, F, true>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse, copy_v);   \
        else                                                                                              \
            rope_impl<T, F, false>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse, copy_v);  \
    }
#define ROPE_KERNELS(SUF, T)        \
    ROPE_KERNEL(SUF, T, f32, float) \
    ROPE_KERNEL(SUF, T, f16, half)
ROPE_KERNELS(f32, float)
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, half)
