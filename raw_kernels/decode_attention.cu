// Decode attention over a KV cache (flash-decoding, GQA), and the RoPE + cache append that feeds it.
//
//   rope_kv_append:  qkv (n, (Hq + 2*Hkv) * hs), in place: when rotate, the q and k heads of row r are
//                    rotated at position positions[r] (=), with exactly rope.cu's expression
//                    (out1 = x1 c - x2 s, out2 = x2 c + x1 s, fp32 math, one rounding); then
//                    k_cache[slots[r], g, positions[r], :] = k head g and v_cache[...] = v head g   (=)
//   decode_attention_split: block (split s, kv head g and q-head tile, row i) over its chunk of the
//                    positions [0, lengths[i]) of cache slot i, for every q head of the tile:
//                    m = max_p s_p, l = sum_p 2^(s_p - m), o = sum_p 2^(s_p - m) v_p with
//                    s_p = q.k_p / sqrt(hs) * log2(e), written to the scratch's partials (=). A row
//                    whose whole length is one chunk gets out = o / l from its only block (=).
//                    fused: the last split block of a (row, tile) to finish (a counter in the scratch)
//                    then merges the partials of its heads into out itself (=): no second launch.
//   decode_attention_combine: (when not fused) out[i, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s (=)
// fp32 math throughout; out is rounded once; merges run in a fixed order (deterministic). Every kernel
// here may be launched as a programmatic dependent (common.cuh): it waits for its predecessor first.
// The chunk of a split is chosen on the device from the row's own length: chunk = max(ceil(len / S), MIN_CHUNK), so
// every length keeps up to S splits busy and a replayed graph adapts to the lengths. Lengths and
// positions outside the cache are clamped (attention) or skipped (append) on the device; the launchers
// check what the host can see.
// Scratch (fp32): [counters | partials]. A counter is 64 bits of arrivals; it must be zero before the
// first launch (decode_attention.py: zero the scratch once), and the last arrival of every launch sets it
// back to zero. One atomicAdd per split: a compare-and-swap loop made the splits that arrive together
// retry one after another, which the H200 profile showed as most of a 9-split merge's cost.
#include "decode_attention.cuh"

// ---- rope + append ------------------------------------------------------------------------

// One block per row; a thread handles P elements of x1 and the matching P of x2 of one head.
template <typename T, typename F, int P>
__device__ void rope_kv_append_impl(T* qkv, T* k_cache, T* v_cache, const int* slots, const int* positions,
                                    const F* freqs, int Hq, int Hkv, int hs, int max_batch, int max_seq,
                                    int max_pos, bool rotate) {
    launch_dependents();
    grid_dependency_wait();  // qkv, slots and positions come from the kernels before
    const int r = blockIdx.x;
    const int slot = slots[r], pos = positions[r];
    if (slot < 0 || slot >= max_batch || pos < 0 || pos >= max_seq || (rotate && pos >= max_pos)) return;
    const int half = hs / 2, hv = half / P, H = Hq + 2 * Hkv;
    T* x = qkv + (size_t)r * H * hs;
    const F* f = freqs + (size_t)pos * hs;
    for (int it = (rotate ? 0 : Hq * hv) + threadIdx.x; it < H * hv; it += blockDim.x) {
        const int h = it / hv, j = (it - h * hv) * P;
        T* src = x + (size_t)h * hs + j;
        Vec<T, P> y1 = *reinterpret_cast<const Vec<T, P>*>(src);
        Vec<T, P> y2 = *reinterpret_cast<const Vec<T, P>*>(src + half);
        if (rotate && h < Hq + Hkv) {
#pragma unroll
            for (int k = 0; k < P; ++k) {
                const float a = to_float(y1.v[k]), bb = to_float(y2.v[k]);
                const float c = to_float(f[j + k]), sk = to_float(f[half + j + k]);
                y1.v[k] = from_float<T>(a * c - bb * sk);  // rope.cu's expression, rounded once
                y2.v[k] = from_float<T>(bb * c + a * sk);
            }
            *reinterpret_cast<Vec<T, P>*>(src) = y1;
            *reinterpret_cast<Vec<T, P>*>(src + half) = y2;
        }
        if (h >= Hq) {
            const bool is_k = h < Hq + Hkv;
            const int g = is_k ? h - Hq : h - Hq - Hkv;
            T* dst = (is_k ? k_cache : v_cache) + (((size_t)slot * Hkv + g) * max_seq + pos) * hs + j;
            *reinterpret_cast<Vec<T, P>*>(dst) = y1;
            *reinterpret_cast<Vec<T, P>*>(dst + half) = y2;
        }
    }
}

// One block per (row, q head) of the rows with two splits or more: weights 2^(m_s - M) of the active
// splits in shared memory, then every output element sums its splits in a fixed order.
template <typename T>
__device__ void combine_impl(T* out, const float* scratch, const int* lengths, int Hq, int hs, int max_seq, int S,
                             long long part_offset) {
    extern __shared__ float sm_w[];  // (S,)
    __shared__ float red[32];
    launch_dependents();
    grid_dependency_wait();  // the partials come from the split kernel
    const int i = blockIdx.x / Hq, h = blockIdx.x - i * Hq;
    const int len = min(max(lengths[i], 0), max_seq);
    int p0, p1, nact;
    split_range(len, S, 0, p0, p1, nact);
    if (nact <= 1) return;  // its split wrote the output
    const float* part = scratch + part_offset + ((size_t)i * Hq + h) * S * (hs + 2);
    float M = NEG_INF;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) M = fmaxf(M, part[(size_t)s * (hs + 2) + hs]);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = M;
    __syncthreads();
    M = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) M = fmaxf(M, red[w]);
    float L = 0.f;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) {
        const float* ps = part + (size_t)s * (hs + 2);
        const float w = ps[hs] == NEG_INF ? 0.f : exp2f(ps[hs] - M);
        sm_w[s] = w;
        L += w * ps[hs + 1];
    }
    L = block_sum(L, red);  // syncs first, so red is free again and sm_w is complete
    for (int e = threadIdx.x; e < hs; e += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < nact; ++s) acc += sm_w[s] * part[(size_t)s * (hs + 2) + e];
        out[(size_t)i * Hq * hs + (size_t)h * hs + e] = from_float<T>(L > 0.f ? acc / L : 0.f);
    }
}

// ---- launchers ----------------------------------------------------------------------------

#define ROPE_APPEND_KERNEL(SUF, T, SUFF, F, P, PN)                                                             \
    extern "C" __global__ void __launch_bounds__(128) rope_kv_append_##SUF##_##SUFF##_##PN(                    \
        T* qkv, T* k_cache, T* v_cache, const int* slots, const int* positions, const F* freqs, int Hq,        \
        int Hkv, int hs, int max_batch, int max_seq, int max_pos, int rotate) {                                \
        rope_kv_append_impl<T, F, P>(qkv, k_cache, v_cache, slots, positions, freqs, Hq, Hkv, hs, max_batch,   \
                                     max_seq, max_pos, rotate != 0);                                           \
    }
#define ROPE_APPEND_KERNELS(SUF, T)                                  \
    ROPE_APPEND_KERNEL(SUF, T, f32, float, Pack16<T>::N, vec)        \
    ROPE_APPEND_KERNEL(SUF, T, f32, float, 1, scalar)                \
    ROPE_APPEND_KERNEL(SUF, T, f16, half, Pack16<T>::N, vec)         \
    ROPE_APPEND_KERNEL(SUF, T, f16, half, 1, scalar)
ROPE_APPEND_KERNELS(f32, float)
ROPE_APPEND_KERNELS(bf16, bf16)

// Names: decode_attention_split_<dtype>_<layout>_g<GM>, layout = v<LP> (16-byte vectors, LP lanes per
// position), v32x2 (two vectors per lane) or gen (any even hs: 2-element vectors, a warp per position).
#define SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, GM)                                                           \
    extern "C" __global__ void __launch_bounds__(NW * 32) decode_attention_split_##SUF##_##LAYOUT##_g##GM(     \
        float* scratch, T* out, const T* qkv, T* k_cache, T* v_cache, const int* lengths, int Hq, int Hkv,      \
        int hs, int max_seq, int S, int tiles, int tile_heads, float scale_log2, long long part_offset,          \
        int fused, const RopeTable<T>::F* freqs, int max_pos) {                                                 \
        extern __shared__ float sm_wt[]; /* the fused merge's weights */                                        \
        launch_dependents();                                                                                    \
        split_impl<T, VN, NV, LP, GM, 4>(scratch, out, qkv, k_cache, v_cache, lengths, Hq, Hkv, hs, max_seq, S, \
                                         tiles, tile_heads, scale_log2, part_offset, fused != 0, freqs,        \
                                         max_pos, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y, sm_wt,         \
                                         [] { grid_dependency_wait(); /* q from the kernel before */ });        \
    }
#define SPLIT_KERNELS_G(SUF, T, LAYOUT, VN, NV, LP) \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 1)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 2)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 4)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 8)
SPLIT_KERNELS_G(bf16, bf16, v8, 8, 1, 8)
SPLIT_KERNELS_G(bf16, bf16, v16, 8, 1, 16)
SPLIT_KERNELS_G(bf16, bf16, v32, 8, 1, 32)
SPLIT_KERNELS_G(bf16, bf16, gen, 2, 4, 32)
SPLIT_KERNELS_G(f32, float, v8, 4, 1, 8)
SPLIT_KERNELS_G(f32, float, v16, 4, 1, 16)
SPLIT_KERNELS_G(f32, float, v32, 4, 1, 32)
SPLIT_KERNELS_G(f32, float, v32x2, 4, 2, 32)
SPLIT_KERNELS_G(f32, float, gen, 2, 4, 32)

#define COMBINE_KERNEL(SUF, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) decode_attention_combine_##SUF(                          \
        T* out, const float* scratch, const int* lengths, int Hq, int hs, int max_seq, int S,                  \
        long long part_offset) {                                                                               \
        combine_impl<T>(out, scratch, lengths, Hq, hs, max_seq, S, part_offset);                               \
    }
COMBINE_KERNEL(f32, float)
COMBINE_KERNEL(bf16, bf16)
