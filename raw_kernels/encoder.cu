// Token embedding (the encoder): a row gather forward, a deterministic scatter-add backward.
//
//   forward:  out[n, :] = wte[tokens[n], :]                          (=; an id outside [0, V) gives a zero row)
//             with elements of wte outside the flat range [lo, hi) read as zero: one rank's rows of a
//             ZeRO-sharded embedding (lo, hi multiples of the 16-byte vector; 0, V * C for the whole table)
//   backward: dwte[v, :] += sum of dout[n, :] over n with tokens[n] == v    (+=, a parameter gradient)
//
// The backward gives the same bits on every run and is graph-capturable (no host sync, no allocation):
//   1. a stable LSD radix sort of the positions n by token id, 9-bit digits, ceil(bits(V) / 9) passes (keys
//      are 0..V: 2 passes for V below 2^18, e.g. 151936). Each pass is histogram (per 2048-position tile,
//      shared-memory integer atomics: counts do not depend on order) -> one exclusive scan over
//      (digit, tile) -> stable scatter (equal digits ranked by position through __match_any_sync and
//      per-warp counts, so positions keep their order). Both tile kernels issue all their global loads
//      first, then work in shared memory. An id outside [0, V) sorts as key V and is skipped by step 2,
//      so it cannot touch memory.
//   2. per run of equal tokens and 16-byte vector of channels: partial w sums positions k = w, w+4, ...
//      of the run in order in fp32, the four partials are added in order, and the result is added once
//      into dwte (one rounding to dwte's dtype). The NumPy twin sums in this same order. One block per
//      (4 sorted slots, 128 vectors): a thread per vector for runs of at most 4 positions, the whole
//      block (a warp per partial and 32 vectors) for the one longer run that can start there.
// Scratch (int32, see encoder_scratch_shape): positions ping/pong (N each), sorted keys (N), and the
// (512, tiles) digit histogram. Sizes: C a multiple of the 16-byte vector width of dout / wte.
#include "common.cuh"

constexpr int RADIX_BITS = 9;
constexpr int RADIX = 1 << RADIX_BITS;  // digit values; one thread per digit in histogram and scatter
constexpr int SORT_THREADS = RADIX;
constexpr int SORT_WARPS = SORT_THREADS / 32;
constexpr int SORT_ITEMS = 4;
constexpr int SORT_TILE = SORT_THREADS * SORT_ITEMS;  // positions per sort block
constexpr int SCAN_THREADS = 1024;
constexpr int PARTIALS = 4;    // partial sums per run and vector (the twin's summation order)
constexpr int SUM_SLOTS = PARTIALS;  // sorted slots per sum block
constexpr int SUM_VECS = 128;  // 16-byte vectors of channels per sum block
constexpr int SUM_THREADS = SUM_SLOTS * SUM_VECS;
constexpr int SUM_UNROLL = 4;  // positions in flight per warp on a long run
// A long run covers at least PARTIALS + 1 slots, so at most one can start in a sum block's slots.
static_assert(SUM_SLOTS <= PARTIALS + 1, "a sum block handles at most one long run");
static_assert(SUM_THREADS / 32 == PARTIALS * (SUM_VECS / 32), "long runs: a warp per (partial, 32 vectors)");

// ---- kernels ------------------------------------------------------------------------------

// Grid-stride over (position n, vector cv) pairs; the pair is advanced by the stride's quotient and
// remainder with one carry, so there is no 64-bit division per 16-byte vector.
template <typename T>
__device__ void encoder_forward_impl(T* out, const int* tokens, const T* wte, long long N, int C, int V,
                                     long long lo, long long hi) {
    constexpr int VN = Pack16<T>::N;
    const int vecs = C / VN;
    if (vecs == 0) return;
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long n = start / vecs;
    int cv = (int)(start - n * vecs);
    const long long dn = stride / vecs;
    const int dc = (int)(stride - dn * vecs);
    while (n < N) {
        const int c = cv * VN;
        const int t = tokens[n];
        const long long e = (long long)t * C + c;
        Pack16<T> v;
        if (t >= 0 && t < V && e >= lo && e < hi) {
            v = Pack16<T>::load(wte + e);
        } else {
            for (int k = 0; k < VN; ++k) v.v[k] = from_float<T>(0.f);
        }
        v.store(out + (size_t)n * C + c);
        n += dn, cv += dc;
        if (cv >= vecs) cv -= vecs, ++n;
    }
}

__device__ __forceinline__ int token_key(const int* tokens, int p, int V) {
    const int t = tokens[p];
    return (t >= 0 && t < V) ? t : V;
}

// The keys of one thread's SORT_ITEMS positions of a tile, all loads issued before any is used.
// `src` null means positions 0..N-1; a slot past N gets position 0 and key -1 ("none").
__device__ __forceinline__ void load_tile_items(int (&p)[SORT_ITEMS], int (&key)[SORT_ITEMS], const int* tokens,
                                                const int* src, int N, int V) {
    const int start = blockIdx.x * SORT_TILE + threadIdx.x;
#pragma unroll
    for (int k = 0; k < SORT_ITEMS; ++k) {
        const int i = start + k * SORT_THREADS;
        p[k] = i < N ? (src ? src[i] : i) : 0;
    }
#pragma unroll
    for (int k = 0; k < SORT_ITEMS; ++k) key[k] = start + k * SORT_THREADS < N ? token_key(tokens, p[k], V) : -1;
}

// Digit histogram of one tile: hist[digit * tiles + tile].
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    encoder_sort_histogram(int* hist, const int* tokens, const int* src, int N, int V, int shift, int tiles) {
    __shared__ int s_hist[RADIX];
    s_hist[threadIdx.x] = 0;
    int p[SORT_ITEMS], key[SORT_ITEMS];
    load_tile_items(p, key, tokens, src, N, V);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < SORT_ITEMS; ++k)
        if (key[k] >= 0) atomicAdd(&s_hist[(key[k] >> shift) & (RADIX - 1)], 1);
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
// Every global load of the tile is issued up front; the SORT_ITEMS rounds then touch shared memory only.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    encoder_sort_scatter(int* dst, int* keys, const int* hist, const int* tokens, const int* src, int N, int V,
                         int shift, int tiles) {
    __shared__ int s_base[RADIX];               // next free slot per digit for this tile
    __shared__ int s_count[SORT_WARPS][RADIX];  // per-warp digit counts of the current round
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned lanes_below = (1u << lane) - 1u;
    s_base[tid] = hist[tid * tiles + blockIdx.x];
    int p[SORT_ITEMS], key[SORT_ITEMS];
    load_tile_items(p, key, tokens, src, N, V);
#pragma unroll
    for (int k = 0; k < SORT_ITEMS; ++k) {
#pragma unroll
        for (int w = 0; w < SORT_WARPS; ++w) s_count[w][tid] = 0;
        __syncthreads();
        const int digit = key[k] >= 0 ? (key[k] >> shift) & (RADIX - 1) : RADIX;  // RADIX: "none"
        const unsigned peers = __match_any_sync(0xffffffffu, digit);
        const int rank = __popc(peers & lanes_below);
        if (digit < RADIX && rank == 0) s_count[warp][digit] = __popc(peers);
        __syncthreads();
        if (digit < RADIX) {
            int slot = s_base[digit] + rank;
            for (int w = 0; w < warp; ++w) slot += s_count[w][digit];
            dst[slot] = p[k];
            keys[slot] = key[k];
        }
        __syncthreads();  // every read of s_base and s_count above is done
        int total = 0;
#pragma unroll
        for (int w = 0; w < SORT_WARPS; ++w) total += s_count[w][tid];
        s_base[tid] += total;
    }
}

// Sum of the runs of equal keys that start in slots [SUM_SLOTS * blockIdx.x, +SUM_SLOTS), over
// SUM_VECS vectors of VN channels (blockIdx.y). Every partial sum below is the twin's: partial w of a
// run holds its ranks w, w + 4, ... added in order to 0.f; the run's total is ((p0 + p1) + p2) + p3.
//  - short runs (at most PARTIALS slots): SUM_VECS threads per slot, each summing all partials of one
//    vector itself (each partial has at most one term), so every thread of the block has loads in
//    flight. The keys, positions, dout rows and dwte row of a run are two dependent loads deep.
//  - a long run (more than PARTIALS slots; at most one can start among SUM_SLOTS = PARTIALS slots):
//    the whole block, warp (chunk q, partial w) summing ranks w, w + 4, ... of 32 vectors, the partials
//    then added in order through shared memory.
template <typename TG, typename TD>
__device__ void encoder_backward_sum_impl(TG* dwte, const TD* dout, const int* sorted, const int* keys, int N,
                                          int V, int C) {
    constexpr int VN = Pack16<TD>::N;
    __shared__ float s_part[PARTIALS - 1][SUM_VECS / 32][VN][32];
    __shared__ int s_long[SUM_SLOTS];  // the slot, if it starts a long run, else -1
    const int tid = threadIdx.x;
    const int g = tid / SUM_VECS, t = tid % SUM_VECS;
    const int s = blockIdx.x * SUM_SLOTS + g;
    int k[PARTIALS + 2];  // keys[s - 1 .. s + PARTIALS]; -1 outside [0, N), which never matches a key
#pragma unroll
    for (int r = 0; r < PARTIALS + 2; ++r) {
        const int j = s - 1 + r;
        k[r] = (j >= 0 && j < N) ? keys[j] : -1;
    }
    int pos[PARTIALS];
#pragma unroll
    for (int r = 0; r < PARTIALS; ++r) pos[r] = s + r < N ? sorted[s + r] : 0;
    const int key = k[1];
    const bool starts = s < N && key < V && k[0] != key;
    const bool is_long = starts && k[PARTIALS + 1] == key;
    if (t == 0) s_long[g] = is_long ? s : -1;
    const int c = (blockIdx.y * SUM_VECS + t) * VN;
    if (starts && !is_long && c < C) {
        TG* row = dwte + (size_t)key * C + c;
        Pack16<TD> v[PARTIALS];
#pragma unroll
        for (int r = 0; r < PARTIALS; ++r)
            if (k[1 + r] == key) v[r] = Pack16<TD>::load(dout + (size_t)pos[r] * C + c);
        float old[VN];
#pragma unroll
        for (int e = 0; e < VN; ++e) old[e] = to_float(row[e]);
#pragma unroll
        for (int e = 0; e < VN; ++e) {
            float total = 0.f;
#pragma unroll
            for (int r = 0; r < PARTIALS; ++r) {
                float part = 0.f;
                if (k[1 + r] == key) part += to_float(v[r].v[e]);
                total = r == 0 ? part : total + part;
            }
            row[e] = from_float<TG>(old[e] + total);
        }
    }
    __syncthreads();
    int ls = -1;
#pragma unroll
    for (int q = 0; q < SUM_SLOTS; ++q) ls = max(ls, s_long[q]);
    if (ls < 0) return;  // uniform over the block

    const int lane = tid % 32, warp = tid / 32;
    const int w = warp % PARTIALS, q = warp / PARTIALS;
    const int cl = (blockIdx.y * SUM_VECS + q * 32 + lane) * VN;
    const bool active = cl < C;
    const int lkey = keys[ls];
    constexpr int GROUP = PARTIALS * SUM_UNROLL;  // slots per loop trip
    int jkey[SUM_UNROLL], jpos[SUM_UNROLL];
#pragma unroll
    for (int u = 0; u < SUM_UNROLL; ++u) {
        const int jj = ls + w + u * PARTIALS;
        jkey[u] = jj < N ? keys[jj] : -1;
        jpos[u] = jj < N ? sorted[jj] : 0;
    }
    TG* row = dwte + (size_t)lkey * C + cl;
    float old[VN];
    if (w == 0 && active)
        for (int e = 0; e < VN; ++e) old[e] = to_float(row[e]);
    float acc[VN];
    for (int e = 0; e < VN; ++e) acc[e] = 0.f;
    for (int j = ls + w;; j += GROUP) {
        bool in_run[SUM_UNROLL];  // the run is contiguous: once false, false after
        Pack16<TD> v[SUM_UNROLL];
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; ++u) {
            in_run[u] = jkey[u] == lkey;
            if (in_run[u] && active) v[u] = Pack16<TD>::load(dout + (size_t)jpos[u] * C + cl);
        }
        if (in_run[SUM_UNROLL - 1]) {  // the run may go on: fetch the next trip's keys and positions
#pragma unroll
            for (int u = 0; u < SUM_UNROLL; ++u) {
                const int jj = j + GROUP + u * PARTIALS;
                jkey[u] = jj < N ? keys[jj] : -1;
                jpos[u] = jj < N ? sorted[jj] : 0;
            }
        }
#pragma unroll
        for (int u = 0; u < SUM_UNROLL; ++u)
            if (in_run[u] && active)
                for (int e = 0; e < VN; ++e) acc[e] += to_float(v[u].v[e]);
        if (!in_run[SUM_UNROLL - 1]) break;
    }
    if (w > 0)
        for (int e = 0; e < VN; ++e) s_part[w - 1][q][e][lane] = acc[e];
    __syncthreads();
    if (w == 0 && active) {
        for (int p = 1; p < PARTIALS; ++p)
            for (int e = 0; e < VN; ++e) acc[e] += s_part[p - 1][q][e][lane];
        for (int e = 0; e < VN; ++e) row[e] = from_float<TG>(old[e] + acc[e]);
    }
}

// ---- launchers ----------------------------------------------------------------------------

#define ENCODER_FORWARD(SUF, T)                                                                         \
    extern "C" __global__ void encoder_forward_##SUF(T* out, const int* tokens, const T* wte, long long N, \
                                                     int C, int V, long long lo, long long hi) {        \
        encoder_forward_impl<T>(out, tokens, wte, N, C, V, lo, hi);                                    \
    }
ENCODER_FORWARD(f32, float)
ENCODER_FORWARD(bf16, bf16)
ENCODER_FORWARD(f16, half)

#define ENCODER_BACKWARD_SUM(SUFG, TG, SUFD, TD)                                                          \
    extern "C" __global__ void __launch_bounds__(SUM_THREADS, 2) encoder_backward_sum_##SUFG##_##SUFD(    \
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
