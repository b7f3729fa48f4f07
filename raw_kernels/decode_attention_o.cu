// The attention of one decode row and its output projection in one launch (the "ksplit" decode arm):
// the output projection split over the q heads, summed in a fixed-point accumulator (gemv.cuh) that the
// MLP launch after it (decode_mlp.cu, its x_acc) adds to the residual.
//
//   decode_attention_o: att[h] = decode attention of q head h over positions [0, len) with the RoPE and the
//                       cache append of decode_attention.cu (its split_impl), rounded to T             (=)
//                       acc[n] += fix(s_n * W_o[n, h hs : (h + 1) hs] . att[h])  for every q head h      (+=)
// s the per-row E4M3 scales of W_o (1 for model-dtype weights); fix() is gemv.cuh's acc_fix: the sum over
// heads is exact in the accumulator, so its bits do not depend on the order blocks finish in. acc must be
// zero (or hold what else is summed into the same output) before the launch. att is also written (by the
// head's first block; the projection reads the block's own copy in shared memory).
//
// Work layout: block (c, h) takes q head h and rows [c C / NC, (c + 1) C / NC) of W_o (NC = gridDim.x);
// its W_o slice is copied into shared memory (cp.async) before the dependent-launch wait, with its row
// scales, beside the first step of K and V and the position's cos | sin row. A row of up to long_len
// positions: every block of the head runs the whole attention itself (split_impl with one split), into
// shared memory (HEAD_OUT). A longer row: block c runs split c of `splits` (chunks of at least
// MIN_CHUNK positions), the NC blocks of the head meet at a counter, and each merges the partials itself
// (merge_partials). Those blocks spin on each other, so they must all be resident: the grid is one wave,
// and the next dependent launch is released only after the meeting. Then lane groups of hs / VW lanes take
// the rows, each lane a 16-byte vector of the row's slice, a shuffle sum, one atomic per row.
// Counters (64-bit, zero at rest; the last block of a head to leave resets them): row 1 of
// decode_attention's scratch counters, which the batch-1 step leaves unused.
#include "decode_attention.cuh"
#include "gemv.cuh"

constexpr int THREADS = NW * 32;  // split_impl's block
constexpr int MAX_HEAD = 256;      // head size at most (decode_attention.py: MAX_HEAD_SIZE)

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

template <typename T, typename W, int VN, int NV, int LP>
__device__ void attention_o_impl(long long* acc, float* scratch, T* att, const T* qkv, T* k_cache, T* v_cache,
                                 const int* lengths, const typename RopeTable<T>::F* freqs, const W* __restrict__ w_o,
                                 const float* __restrict__ o_scale, int Hq, int Hkv, int hs, int max_seq, int max_pos,
                                 int C, int splits, int long_len, float scale_log2, long long part_offset) {
    constexpr int VW = 16 / sizeof(W);
    extern __shared__ __align__(16) unsigned char smem[];  // W_o slice (rows, hs), its row scales, S merge weights
    __shared__ __align__(16) T att_s[MAX_HEAD];            // head h's attention, as att holds it
    const int c = blockIdx.x, NC = gridDim.x, h = blockIdx.y, tid = threadIdx.x;
    const int n0 = (int)((long long)c * C / NC), rows = (int)((long long)(c + 1) * C / NC) - n0;
    const int group = Hq / Hkv, A = Hq * hs;
    W* ws = reinterpret_cast<W*>(smem);
    float* s_scale = reinterpret_cast<float*>(smem + (((size_t)rows * hs * sizeof(W) + 15) & ~(size_t)15));
    float* sm_wt = s_scale + rows;
    const int len = min(max(lengths[0], 0), max_seq);  // written by earlier steps (the launcher's contract)
    const bool split = len > long_len;
    if (!split) launch_dependents();  // no block waits for another

    // the W_o slice, before the wait (weights only)
    const int pieces = hs * (int)sizeof(W) / 16;
    for (int p = tid; p < rows * pieces; p += THREADS) {
        const int r = p / pieces, k = p - r * pieces;
        const W* src = w_o + (size_t)(n0 + r) * A + (size_t)h * hs + k * VW;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(
                         ws + (size_t)r * hs + k * VW)),
                     "l"(src)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int r = tid; r < rows; r += THREADS) s_scale[r] = o_scale != nullptr ? o_scale[n0 + r] : 1.f;

    // the attention of head h: all of it (one split), or split c of S
    const int S = split ? splits : 1, s = split ? c : 0;
    const auto wait = [] { grid_dependency_wait(); };
    if (s < S)  // its output into att_s (HEAD_OUT)
        split_impl<T, VN, NV, LP, 1, 4, -1, true>(scratch, att_s, qkv, k_cache, v_cache, lengths, Hq, Hkv, hs, max_seq,
                                                  S, group, 1, scale_log2, part_offset, false, freqs, max_pos, s, h, 0,
                                                  Hq, sm_wt, wait);
    grid_dependency_wait();  // a block without positions returned from split_impl before its wait
    if (split) {
        unsigned long long* arrive = reinterpret_cast<unsigned long long*>(scratch) + Hq;  // row 1 of the counters
        unsigned long long* depart = arrive + Hq;
        __syncthreads();  // every thread's partials are written
        if (tid == 0) {
            __threadfence();
            atomicAdd(arrive + h, 1ull);
            while (load_acquire(arrive + h) < (unsigned long long)NC) {
            }
        }
        __syncthreads();
        launch_dependents();  // every block of the grid has passed its meeting: none waits on a later one
        int p0, p1, nact;
        split_range(len, S, 0, p0, p1, nact);
        if (nact > 1) {
            __threadfence();
            merge_partials<T, -1, true>(att_s, sm_wt, scratch + part_offset, Hq, hs, S, 0, h, 1, nact);
        }
        __syncthreads();
        if (tid == 0 && atomicAdd(depart + h, 1ull) == (unsigned long long)NC - 1) {
            arrive[h] = 0;  // every block of the head has seen the meeting: the counters are free again
            depart[h] = 0;
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();  // att_s is written by this block's split (one split) or its merge; the W_o slice is in
    if (c == 0)
        for (int e = tid; e < hs; e += THREADS) att[(size_t)h * hs + e] = att_s[e];

    // rows of the slice: a group of LPR lanes each, a lane the 16-byte vector li of the row
    const int LPR = hs / VW, per = THREADS / LPR, li = tid % LPR;
    long long q = 0;
    bool bad = false;
    for (int r = tid / LPR; r < rows + (per - rows % per) % per; r += per) {
        float y = 0.f;
        if (r < rows) y = dot16<W>(*reinterpret_cast<const uint4*>(ws + (size_t)r * hs + li * VW), att_s + li * VW, y);
        for (int o = LPR / 2; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
        if (r < rows && li == 0) {
            if (o_scale != nullptr) y *= s_scale[r];
            q = acc_fix(y, bad);
            acc_add(acc, C, n0 + r, q, bad);
        }
    }
}

// decode_attention_o<T, W, VN, NV, LP>: instantiated on demand by name expression (decode_attention_o.py),
// with decode_attention's layout (VN, NV, LP) for the head size.
template <typename T, typename W, int VN, int NV, int LP>
__global__ void __launch_bounds__(THREADS, 1)
    decode_attention_o(long long* acc, float* scratch, T* att, const T* qkv, T* k_cache, T* v_cache,
                       const int* lengths, const typename RopeTable<T>::F* freqs, const W* w_o, const float* o_scale,
                       int Hq, int Hkv, int hs, int max_seq, int max_pos, int C, int splits, int long_len,
                       float scale_log2, long long part_offset) {
    attention_o_impl<T, W, VN, NV, LP>(acc, scratch, att, qkv, k_cache, v_cache, lengths, freqs, w_o, o_scale, Hq,
                                       Hkv, hs, max_seq, max_pos, C, splits, long_len, scale_log2, part_offset);
}
