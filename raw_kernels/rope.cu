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

// Heads per thread and the block: cuengine/kernels/rope.py sizes the grid by them (one wave of
// ROPE_BLOCKS_PER_SM blocks per SM, which __launch_bounds__ keeps resident). An H200 sweep of 2 or 4
// heads, 1-3 trips' loads issued together and 4-7 blocks per SM found none faster at the train step's shapes.
constexpr int ROPE_HEADS = 2, ROPE_THREADS = 128, ROPE_BLOCKS_PER_SM = 7;

// ---- kernels ------------------------------------------------------------------------------

// VN consecutive table values kept as the words that hold them (NW = VN * sizeof(F) / 4), each converted
// where it is used (tab): 16-byte (or 8-byte) vector loads when the table is 16-byte aligned (every row
// then is: hs is a multiple of 2 * VN), scalar loads otherwise (the kernel picks its loop once, by the
// table's address). Converted at the load, a trip's table would hold 2 * VN registers from its load on.
template <typename F, int VN> constexpr int table_words = VN * (int)sizeof(F) / 4;
template <bool VEC, int NW, typename F> __device__ __forceinline__ void load_table(const F* p, unsigned (&w)[NW]) {
    if (VEC && NW >= 4) {
#pragma unroll
        for (int j = 0; j < NW; j += 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned*>(p) + j);
            w[j] = v.x, w[j + 1] = v.y, w[j + 2] = v.z, w[j + 3] = v.w;
        }
    } else if (VEC) {  // fp32 data with an fp16 table: 4 values, 8 bytes
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x, w[1] = v.y;
    } else if constexpr (sizeof(F) == 4) {
#pragma unroll
        for (int k = 0; k < NW; ++k) w[k] = __float_as_uint(p[k]);
    } else {
#pragma unroll
        for (int k = 0; k < NW; ++k)
            w[k] = (unsigned)__half_as_ushort(p[2 * k]) | (unsigned)__half_as_ushort(p[2 * k + 1]) << 16;
    }
}
template <typename F, int NW> __device__ __forceinline__ float tab(const unsigned (&w)[NW], int k) {
    if constexpr (sizeof(F) == 4)
        return __uint_as_float(w[k]);
    else
        return __half2float(__ushort_as_half((unsigned short)(k % 2 ? w[k / 2] >> 16 : w[k / 2] & 0xffffu)));
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

// The grid-stride index i = (row * HP + p) * hv + jv of an item, kept as its digits (row, p, jv) and
// t = row % T_len, and advanced by the stride's digits with carries: no integer division per item.
struct RopeWalk {
    long long row;
    int p, jv, t;
};

// The shape, the pointers and the stride's digits, shared by every trip of a thread.
template <typename T, typename F, bool VEC_TABLE> struct Rope {
    static constexpr int U = ROPE_HEADS, VN = Pack16<T>::N, NW = table_words<F, VN>;
    struct Trip {  // one item's data (x1 and x2 of U heads) and table words, loaded and not yet used
        uint4 x1[U], x2[U];
        unsigned c[NW], s[NW];
    };
    T* out;
    const T* inp;
    const F* freqs;
    int T_len, hs, half, hv, H, R, HP, sj, sp, st;
    long long srow;
    float sign;  // the inverse rotation is the rotation by -angle
    bool read_v, copy_v, amax_on;

    __device__ __forceinline__ void advance(RopeWalk& w) const {  // by the stride, digit by digit
        w.jv += sj;
        int carry = w.jv >= hv;
        w.jv -= carry ? hv : 0;
        w.p += sp + carry;
        carry = w.p >= HP;
        w.p -= carry ? HP : 0;
        w.row += srow + carry;
        w.t += st + carry;
        w.t -= w.t >= T_len ? T_len : 0;
    }
    __device__ __forceinline__ size_t base(const RopeWalk& w) const {
        return ((size_t)w.row * H + w.p * U) * hs + w.jv * VN;
    }
    // Issues the item's loads, nothing waits on them: its U heads' x1 and x2, and the table's cos and sin
    // (read for a group of v heads too: no branch among the loads).
    __device__ __forceinline__ void load(const RopeWalk& w, Trip& d) const {
        const int h0 = w.p * U, j = w.jv * VN;
        const size_t b = base(w);
#pragma unroll
        for (int u = 0; u < U; ++u) {  // a head past H, or an in-place v head, reads head h0 again: no branch
            const size_t in = b + (h0 + u < H && (h0 + u < R || read_v) ? (size_t)u * hs : 0);
            d.x1[u] = *reinterpret_cast<const uint4*>(inp + in);
            d.x2[u] = *reinterpret_cast<const uint4*>(inp + in + half);
        }
        load_table<VEC_TABLE>(freqs + (size_t)w.t * hs + j, d.c);
        load_table<VEC_TABLE>(freqs + (size_t)w.t * hs + j + half, d.s);
    }
    // Rotates and stores the item loaded into d; returns the max |out| bits of what it covers.
    __device__ __forceinline__ unsigned store(const RopeWalk& w, const Trip& d) const {
        const int h0 = w.p * U;
        const size_t b = base(w);
        float c[VN], s[VN];
#pragma unroll
        for (int k = 0; k < VN; ++k) c[k] = tab<F>(d.c, k), s[k] = tab<F>(d.s, k);
        unsigned amax = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            T* o = out + b + (size_t)u * hs;
            if (h0 + u < R) {
                float y1[VN], y2[VN];
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    const float a = elem<T>(d.x1[u], k), bb = elem<T>(d.x2[u], k), sk = sign * s[k];
                    y1[k] = a * c[k] - bb * sk;
                    y2[k] = bb * c[k] + a * sk;
                }
                const uint4 w1 = to_words<T>(y1), w2 = to_words<T>(y2);
                *reinterpret_cast<uint4*>(o) = w1;
                *reinterpret_cast<uint4*>(o + half) = w2;
                if (amax_on) amax = max(amax, abs_max_bits<T>(w1, w2));
            } else if (h0 + u < H && read_v) {  // a v head: copied, and seen by abs_max
                if (copy_v) {
                    *reinterpret_cast<uint4*>(o) = d.x1[u];
                    *reinterpret_cast<uint4*>(o + half) = d.x2[u];
                }
                if (amax_on) amax = max(amax, abs_max_bits<T>(d.x1[u], d.x2[u]));
            }
        }
        return amax;
    }
};

// One thread per (row, group of U heads h0 = U p .. h0 + U - 1, VN-vector of the first half): it handles
// x1 and the matching x2 of each head, which share position t and so the table's cos and sin. In place
// without abs_max, the groups of v heads are not visited: HP counts the groups up to the last rotated
// head. In place, an item's loads alias its stores, but read only its own elements, and no other item
// (of this thread or another) touches them.
// A trip is one item's loads, then its stores, then the next trip's loads (the compiler keeps them behind
// the stores, which may alias them).
template <typename T, typename F, bool VEC_TABLE>
__device__ void rope_impl(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len,
                          int Hq, int Hkv, int hs, bool inverse, bool copy_v) {
    using K = Rope<T, F, VEC_TABLE>;
    constexpr int U = K::U;
    K k;
    k.out = out, k.inp = inp, k.freqs = freqs, k.T_len = T_len, k.hs = hs, k.half = hs / 2;
    k.hv = k.half / K::VN, k.H = Hq + 2 * Hkv, k.R = Hq + Hkv;
    k.read_v = copy_v || abs_max, k.copy_v = copy_v, k.amax_on = abs_max != nullptr;
    k.HP = ((k.read_v ? k.H : k.R) + U - 1) / U;
    k.sign = inverse ? -1.f : 1.f;
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long q = start / k.hv, sq = stride / k.hv;
    RopeWalk a;
    a.row = q / k.HP, a.jv = (int)(start - q * k.hv), a.p = (int)(q - a.row * k.HP), a.t = (int)(a.row % T_len);
    k.srow = sq / k.HP, k.sj = (int)(stride - sq * k.hv), k.sp = (int)(sq - k.srow * k.HP);
    k.st = (int)(k.srow % T_len);
    unsigned amax = 0;
    typename K::Trip d;
    while (a.row < rows) {
        k.load(a, d);
        amax = max(amax, k.store(a, d));
        k.advance(a);
    }
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

template <typename T, typename F>
__device__ __forceinline__ void rope_dispatch(T* out, const T* inp, const F* freqs, float* abs_max, long long rows,
                                              int T_len, int Hq, int Hkv, int hs, int inverse, int copy_v) {
    if (((size_t)freqs & 15) == 0)
        rope_impl<T, F, true>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse, copy_v);
    else
        rope_impl<T, F, false>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse, copy_v);
}

// ---- launchers ----------------------------------------------------------------------------

#define ROPE_KERNEL(SUF, T, SUFF, F)                                                                           \
    extern "C" __global__ void __launch_bounds__(ROPE_THREADS, ROPE_BLOCKS_PER_SM)                             \
        rope_##SUF##_##SUFF(T* out, const T* inp, const F* freqs, float* abs_max, long long rows, int T_len,      \
                            int Hq, int Hkv, int hs, int inverse, int copy_v) {                                \
        grid_dependency_wait();                                                                               \
        rope_dispatch<T, F>(out, inp, freqs, abs_max, rows, T_len, Hq, Hkv, hs, inverse, copy_v);             \
    }
#define ROPE_KERNELS(SUF, T)        \
    ROPE_KERNEL(SUF, T, f32, float) \
    ROPE_KERNEL(SUF, T, f16, half)
ROPE_KERNELS(f32, float)
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, half)
