// Token embedding (the encoder): a row gather forward, a deterministic scatter-add backward.
//
//   forward:  out[n, :] = wte[tokens[n], :]                          (=; an id outside [0, V) gives a zero row)
//   backward: dwte[v, :] += sum of dout[n, :] over n with tokens[n] == v    (+=, a parameter gradient)
//
// The backward gives the same bits on every run and is graph-capturable (no host sync, no allocation):
//   1. a stable LSD radix sort of the positions n by token id, 8-bit digits, ceil(bits(V) / 8) passes.
//      Each pass is histogram (per 2048-position tile, shared-memory integer atomics: counts do not
//      depend on order) -> one exclusive scan over (digit, tile) -> stable scatter (equal digits ranked
//      by position through __match_any_sync and per-warp counts, so positions keep their order).
//      An id outside [0, V) sorts as key V and is skipped by step 2, so it cannot touch memory.
//   2. one block per (run of equal tokens, 32 * VN channels): warp w sums positions k = w, w+4, ...
//      of the run in order in fp32, the four warp partials are added in warp order, and the result is
//      added once into dwte (one rounding to dwte's dtype). The NumPy twin sums in this same order.
// Scratch (int32, see encoder_scratch_shape): positions ping/pong (N each), sorted keys (N), and the
// (256, tiles) digit histogram. Sizes: C a multiple of the 16-byte vector width of dout / wte.
#include "common.cuh"

constexpr int SORT_THREADS = 256;  // one thread per digit value in the histogram and scan
constexpr int SORT_WARPS = SORT_THREADS / 32;
constexpr int SORT_ITEMS = 8;
constexpr int SORT_TILE = SORT_THREADS * SORT_ITEMS;  // positions per sort block
constexpr int SCAN_THREADS = 1024;
constexpr int SUM_WARPS = 4;
constexpr int SUM_UNROLL = 4;  // positions in flight per warp

// ---- kernels ------------------------------------------------------------------------------

template <typename T>
__device__ void encoder_forward_impl(T* out, const int* tokens, const T* wte, long long N, int C, int V) {
    constexpr int VN = Pack16<T>::N;
    const int vecs = C / VN;
    const long long total = N * vecs;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long n = i / vecs;
        const int c = (int)(i - n * vecs) * VN;
        const int t = tokens[n];
        Pack16<T> v;
        if (t >= 0 && t < V) {
            v = Pack16<T>::load(wte + (size_t)t * C + c);
        } else {
            for (int k = 0; k < VN; ++k) v.v[k] = from_float<T>(0.f);
        }
        v.store(out + (size_t)n * C + c);
    }
}

__device__ __forceinline__ int token_key(const int* tokens, int p, int V) {
    const int t = tokens[p];
    return (t >= 0 && t < V) ? t : V;
}

// Digit histogram of one tile: hist[digit * tiles + tile]. `src` null means positions 0..N-1.
extern "C" __global__ void encoder_sort_histogram(int* hist, const int* tokens, const int* src, int N, int V,
                                                  int shift, int tiles) {
    __shared__ int s_hist[SORT_THREADS];
    s_hist[threadIdx.x] = 0;
    __syncthreads();
    const int start = blockIdx.x * SORT_TILE;
    for (int k = 0; k < SORT_ITEMS; ++k) {
        const int i = start + k * SORT_THREADS + threadIdx.x;
        if (i < N) {
            const int p = src ? src[i] : i;
            atomicAdd(&s_hist[(token_key(tokens, p, V) >> shift) & 255], 1);
        }
    }
    __syncthreads();
    hist[threadIdx.x * tiles + blockIdx.x] = s_hist[threadIdx.x];
}

// In-place exclusive scan of hist[0, M) by one block: each thread scans a contiguous chunk.
extern "C" __global__ void encoder_sort_scan(int* hist, int M) {
    __shared__ int s_warp[SCAN_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int per = (M + SCAN_THREADS - 1) / SCAN_THREADS;
    const int begin = min((int)threadIdx.x * per, M), end = min(begin + per, M);
    int sum = 0;
    for (int i = begin; i < end; ++i) sum += hist[i];
    int incl = sum;  // inclusive scan of the chunk sums within the warp
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = s_warp[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        s_warp[lane] = w;
    }
    __syncthreads();
    int run = incl - sum + (warp > 0 ? s_warp[warp - 1] : 0);
    for (int i = begin; i < end; ++i) {
        const int c = hist[i];
        hist[i] = run;
        run += c;
    }
}

// Stable scatter of one tile: dst[slot] = position, keys[slot] = its full key. Positions of equal digit
// keep their order: rank = earlier rounds + earlier warps of this round + earlier lanes of this warp.
extern "C" __global__ void encoder_sort_scatter(int* dst, int* keys, const int* hist, const int* tokens,
                                                const int* src, int N, int V, int shift, int tiles) {
    __shared__ int s_base[SORT_THREADS];              // next free slot per digit for this tile
    __shared__ int s_count[SORT_WARPS][SORT_THREADS];  // per-warp digit counts of the current round
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned lanes_below = (1u << lane) - 1u;
    s_base[tid] = hist[tid * tiles + blockIdx.x];
    const int start = blockIdx.x * SORT_TILE;
    for (int k = 0; k < SORT_ITEMS; ++k) {
        for (int w = 0; w < SORT_WARPS; ++w) s_count[w][tid] = 0;
        __syncthreads();
        const int i = start + k * SORT_THREADS + tid;
        int p = 0, key = 0, digit = SORT_THREADS;  // SORT_THREADS: "no digit", for i >= N
        if (i < N) {
            p = src ? src[i] : i;
            key = token_key(tokens, p, V);
            digit = (key >> shift) & 255;
        }
        const unsigned peers = __match_any_sync(0xffffffffu, digit);
        const int rank = __popc(peers & lanes_below);
        if (digit < SORT_THREADS && rank == 0) s_count[warp][digit] = __popc(peers);
        __syncthreads();
        if (digit < SORT_THREADS) {
            int slot = s_base[digit] + rank;
            for (int w = 0; w < warp; ++w) slot += s_count[w][digit];
            dst[slot] = p;
            keys[slot] = key;
        }
        __syncthreads();  // every read of s_base and s_count above is done
        int total = 0;
        for (int w = 0; w < SORT_WARPS; ++w) total += s_count[w][tid];
        s_base[tid] += total;
    }
}

// Sum of one run of equal keys over 32 * VN channels; the block's first slot must start the run.
template <typename TG, typename TD>
__device__ void encoder_backward_sum_impl(TG* dwte, const TD* dout, const int* sorted, const int* keys, int N,
                                          int V, int C) {
    constexpr int VN = Pack16<TD>::N;
    __shared__ float s_part[SUM_WARPS - 1][VN][32];
    const int i = blockIdx.x;
    const int key = keys[i];
    if (key >= V || (i > 0 && keys[i - 1] == key)) return;  // uniform over the block: before any barrier
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = (blockIdx.y * 32 + lane) * VN;
    const bool active = c < C;
    float acc[VN];
    for (int k = 0; k < VN; ++k) acc[k] = 0.f;
    for (int j = i + warp; j < N; j += SUM_WARPS * SUM_UNROLL) {
        int pos[SUM_UNROLL];
        bool in_run[SUM_UNROLL];
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; ++u) {
            const int jj = j + u * SUM_WARPS;
            in_run[u] = jj < N && keys[jj] == key;  // the run is contiguous: once false, false after
            pos[u] = in_run[u] ? sorted[jj] : 0;
        }
        Pack16<TD> v[SUM_UNROLL];
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; ++u)
            if (in_run[u] && active) v[u] = Pack16<TD>::load(dout + (size_t)pos[u] * C + c);
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; ++u)
            if (in_run[u] && active)
                for (int k = 0; k < VN; ++k) acc[k] += to_float(v[u].v[k]);
        if (!in_run[SUM_UNROLL - 1]) break;
    }
    if (warp > 0)
        for (int k = 0; k < VN; ++k) s_part[warp - 1][k][lane] = acc[k];
    __syncthreads();
    if (warp == 0 && active) {
        for (int w = 1; w < SUM_WARPS; ++w)
            for (int k = 0; k < VN; ++k) acc[k] += s_part[w - 1][k][lane];
        TG* row = dwte + (size_t)key * C + c;
        for (int k = 0; k < VN; ++k) row[k] = from_float<TG>(to_float(row[k]) + acc[k]);
    }
}

// ---- launchers ----------------------------------------------------------------------------

#define ENCODER_FORWARD(SUF, T)                                                                         \
    extern "C" __global__ void encoder_forward_##SUF(T* out, const int* tokens, const T* wte, long long N, \
                                                     int C, int V) {                                    \
        encoder_forward_impl<T>(out, tokens, wte, N, C, V);                                            \
    }
ENCODER_FORWARD(f32, float)
ENCODER_FORWARD(bf16, bf16)
ENCODER_FORWARD(f16, half)

#define ENCODER_BACKWARD_SUM(SUFG, TG, SUFD, TD)                                                          \
    extern "C" __global__ void __launch_bounds__(SUM_WARPS * 32) encoder_backward_sum_##SUFG##_##SUFD(    \
        TG* dwte, const TD* dout, const int* sorted, const int* keys, int N, int V, int C) {              \
        encoder_backward_sum_impl<TG, TD>(dwte, dout, sorted, keys, N, V, C);                              \
    }
#define ENCODER_BACKWARD_SUM_ALL(SUFG, TG)          \
    ENCODER_BACKWARD_SUM(SUFG, TG, f32, float)      \
    ENCODER_BACKWARD_SUM(SUFG, TG, bf16, bf16)      \
    ENCODER_BACKWARD_SUM(SUFG, TG, f16, half)
ENCODER_BACKWARD_SUM_ALL(f32, float)
ENCODER_BACKWARD_SUM_ALL(bf16, bf16)
ENCODER_BACKWARD_SUM_ALL(f16, half)
