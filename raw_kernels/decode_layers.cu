// Every layer of a batch-1 decode step in one persistent launch (the "persistent" decode arm).
//
//   for each layer l (its weights and cache from the layer table, written once by decode_layers.py):
//     qkv      = gemv(residual, qkv_w, norm_weight=ln1, bias=qkv_b)
//     att      = decode attention with the RoPE + cache append fused            (decode_attention.cuh)
//     residual = gemv(att, o_w, residual=residual)
//     up       = gemv_dual(residual, up_w, norm_weight=ln2)                       ([gate | up])
//     residual = gemv(up, down_w, act=swiglu, residual=residual)
//
// Dataflow instead of kernel boundaries. Weights never depend on the step, so each block streams its
// share of them (a fixed range of rows of every linear, layer after layer) into a ring of shared-memory
// stages with bulk copies (cp.async.bulk, completion counted by an mbarrier per stage), and refills a
// stage as soon as its rows are used: HBM keeps delivering the next phases' and the next layer's
// weights while the block waits for a phase's input. A phase's input (a vector of at most I elements)
// is ready when every block has counted its part of the phase before into that phase's counter; it is
// read through L2 (another SM wrote it; L1 is not coherent).
// Sums: each output's dot product is split into the same K slices as gemv.cu's kernel with the same
// split (the launcher passes the "fused" arm's), with the same lanes, order and warp reduction, and the
// epilogue is gemv.cuh's; the attention phase is decode_attention.cuh's. So the step is bit-identical
// to the "fused" arm's kernels.
// sync: six uint32 counters, zero before the first launch (five phases, then the blocks that left); the
// last block to leave resets them.
#include "decode_attention.cuh"
#include "gemv.cuh"
#include "ring.cuh"

constexpr int THREADS = WARPS * 32;  // the GEMV phases' block; the attention phase runs two NW-warp teams
static_assert(THREADS == 2 * NW * 32, "two attention teams per block");
constexpr int MAX_STAGES = 8;  // ring stages at most (decode_layers.py: _MAX_STAGES)
constexpr int TILE_ROWS = 64;  // weight rows per stage at most (decode_layers.py: _TILE_ROWS; gate and up apart)
enum Phase { QKV = 0, ATTENTION = 1, OUT = 2, UP = 3, DOWN = 4, LEFT = 5 };

// One layer as the kernel reads it (decode_layers.py: LAYER_FIELDS, 16 pointers per layer).
struct DecodeLayer {
    const void* qkv_w;
    const float* qkv_scale;
    const void* qkv_b;
    const void* ln1;
    const void* o_w;
    const float* o_scale;
    const void* ln2;
    const void* up_w;
    const float* up_scale;
    const void* down_w;
    const float* down_scale;
    void* k_cache;
    void* v_cache;
    const void* unused[3];
};

// ---- counters between phases -------------------------------------------------------------

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// This block's part of a phase is written: count it (after every thread's stores).
__device__ __forceinline__ void count_done(unsigned* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
    }
}

// Wait until `target` parts of a phase are counted; then its outputs may be read (through L2).
__device__ __forceinline__ void wait_count(const unsigned* counter, unsigned target) {
    if (threadIdx.x == 0)
        while (load_acquire(counter) < target) {
        }
    __syncthreads();
}

// ---- the weight ring ---------------------------------------------------------------------

// Dynamic shared memory: the ring (stages x stage_bytes), the staged input or the attention's merge
// weights (xs_bytes), the weights' addresses (4 per layer). Declared here, so that reads through it are
// shared-memory loads (a pointer passed around would be generic).
extern __shared__ __align__(128) unsigned char dyn[];

// The linears of a layer in the order a block streams them. A block owns rows [b n / G, (b + 1) n / G)
// of each (for UP: gate rows and the up rows I apart, as pairs), in tiles of at most `per_tile` rows
// (pairs) cut evenly.
struct Linear {
    int n, K, dual, per_tile;
};
// (32-bit products: b n < 2^31 for every grid and linear the launcher accepts)
__device__ __forceinline__ int tile_count(const Linear& f, int b, int G) {
    const int rows = (b + 1) * f.n / G - b * f.n / G;
    return (rows + f.per_tile - 1) / f.per_tile;
}
__device__ __forceinline__ void tile_rows(const Linear& f, int b, int G, int tiles, int i, int& r0, int& r1) {
    const int first = b * f.n / G, rows = (b + 1) * f.n / G - first;
    r0 = first + i * rows / tiles;
    r1 = first + (i + 1) * rows / tiles;
}

// The thread that issues the bulk copies: not one that fences (count_done's thread 0, an attention
// team's first thread), since a fence may wait for the copies its warp has in flight.
constexpr int ISSUER = THREADS - 1;

template <typename W> struct Stream {
    const unsigned char* const* weights;  // per layer: qkv_w, o_w, up_w, down_w (shared memory)
    Linear f[4];                          // QKV, OUT, UP, DOWN
    int tiles[4], per_layer, total, stages, stage_bytes, b, G;
    unsigned long long* full;

    // Tile t of this block's sequence into its stage (ISSUER only; nothing past the last tile).
    __device__ void issue(int t) const {
        if (t >= total) return;
        const int l = t / per_layer;
        int j = t - l * per_layer, k = 0;
        while (j >= tiles[k]) j -= tiles[k++];
        int r0, r1;
        tile_rows(f[k], b, G, tiles[k], j, r0, r1);
        const unsigned row = (unsigned)(f[k].K * sizeof(W)), bytes = (unsigned)(r1 - r0) * row;
        const unsigned char* w = weights[4 * l + k];
        unsigned char* dst = dyn + (size_t)(t % stages) * stage_bytes;
        unsigned long long* bar = full + t % stages;
        ring_expect(bar, f[k].dual ? 2 * bytes : bytes);
        bulk_copy(dst, w + (size_t)r0 * row, bytes, bar);
        if (f[k].dual) bulk_copy(dst + bytes, w + ((size_t)f[k].n + r0) * row, bytes, bar);
    }
};

// ---- one linear from the ring ------------------------------------------------------------

// The block's tiles of linear k (starting at tile t of its sequence): out[n] = epilogue(x . w[n]) for its
// rows, x staged past the ring. Item (row q of the tile, slice s of S) is one warp's dot product over
// vectors [s C / S, (s + 1) C / S) of the row, lanes 32 vectors apart, and thread q sums row q's slices
// in order: gemv_impl's sums, from shared memory. (A warp per row pair with its slices in turn, no
// barrier per tile, was slower: 3 rows of 4864 left 6 of 8 warps idle; PERF_NOTES 20.)
template <typename T, typename W>
__device__ int run_linear(const Stream<W>& st, int k, int t, T* out, const float* w_scale, const T* bias,
                          const T* residual, int S, float (*s_part)[TILE_ROWS][WARPS]) {
    constexpr int VW = 16 / sizeof(W), NT = Pack16<T>::N;
    const Linear& f = st.f[k];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, C = f.K / VW, N = f.dual ? 2 * f.n : f.n;
    const int log_s = __ffs(S) - 1;  // S is a power of two (gemv.py: _SPLITS), so slices are shifts
    const T* xs = reinterpret_cast<const T*>(dyn + (size_t)st.stages * st.stage_bytes);
    for (int i = 0; i < st.tiles[k]; ++i, ++t) {
        int r0, r1;
        tile_rows(f, st.b, st.G, st.tiles[k], i, r0, r1);
        const int pairs = r1 - r0, rows = f.dual ? 2 * pairs : pairs;
        // the finisher of tile row q = thread q: its output column and epilogue operands, in flight now
        const int q = threadIdx.x;
        const int n = q < pairs ? r0 + q : r0 + q - pairs + f.n;  // UP: gate rows, then the up rows I apart
        Epilogue ep = Epilogue{1.f, 0.f, 0.f};
        if (q < rows) {
            ep = fetch_weights<T>(w_scale, bias, n);
            fetch_residual<T>(ep, residual, 0, n, N);
        }
        const int slot = t % st.stages;
        stage_wait(st.full + slot, (unsigned)(t / st.stages) & 1u);
        const W* sw = reinterpret_cast<const W*>(dyn + (size_t)slot * st.stage_bytes);
        float (*part)[WARPS] = s_part[t & 1];
        for (int item = warp; item < rows << log_s; item += WARPS) {
            const int r = item >> log_s, s = item & (S - 1);
            const int c0 = s * C >> log_s, c1 = (s + 1) * C >> log_s;  // gemv_impl's slice * C / S
            const W* wrow = sw + (size_t)r * f.K;
            float acc = 0.f;
            #pragma unroll 4
            for (int c = c0 + lane; c < c1; c += 32) {
                const uint4 v = *reinterpret_cast<const uint4*>(wrow + (size_t)c * VW);
                const unsigned words[4] = {v.x, v.y, v.z, v.w};
                #pragma unroll
                for (int h = 0; h < VW / NT; ++h) {
                    float wf[NT];
                    #pragma unroll
                    for (int e = 0; e < NT; e += 2) {
                        const float2 p = widen_pair<W>(words, h * NT + e);
                        wf[e] = p.x;
                        wf[e + 1] = p.y;
                    }
                    const Pack16<T> xv = Pack16<T>::load(xs + (size_t)c * VW + h * NT);
                    #pragma unroll
                    for (int e = 0; e < NT; ++e) acc = fmaf(to_float(xv.v[e]), wf[e], acc);
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) part[r][s] = acc;
        }
        __syncthreads();  // the stage is used up and the partials are in
        if (threadIdx.x == ISSUER) st.issue(t + st.stages);
        if (q < rows) {
            float y = part[q][0];
            if (S > 1) {
                y = 0.f;
                for (int s = 0; s < S; ++s) y += part[q][s];
            }
            finish<T>(out, ep, w_scale != nullptr, bias != nullptr, residual != nullptr, y, 0, n, N);
        }
    }
    return t;
}

// The input of a linear into xs (decode rows are 1): gemv.cuh's staging, with its norm or SwiGLU.
template <typename T>
__device__ void stage(T* xs, float* s_rstd, const T* x, const T* norm_weight, float eps, int prologue, int K) {
    stage_input<T, T, 1>(xs, xs, s_rstd, x, norm_weight, eps, prologue, 0, 1, K);
    __syncthreads();
}

// One kernel per (T, W, attention layout, q heads per attention block GM), instantiated on demand by
// name expression (decode_layers.py: the kernel name) so that a process compiles only the variant it runs.
template <typename T, typename W, int VN, int NV, int LP, int GM>
__global__ void __launch_bounds__(THREADS, 1)
    decode_layers(const DecodeLayer* layers, int n_layers, T* residual, T* qkv, T* att, T* up, float* scratch,
                  const int* lengths, const typename RopeTable<T>::F* freqs, unsigned* sync, int C, int I, int Hq,
                  int Hkv, int hs, int max_seq, int max_pos, float eps, int S_att, int tiles, int tile_heads,
                  float scale_log2, long long part_offset, int s_qkv, int s_o, int s_up, int s_down, int stages,
                  int stage_bytes, int xs_bytes) {
    __shared__ __align__(8) unsigned long long full[MAX_STAGES];
    __shared__ float s_part[2][TILE_ROWS][WARPS];
    __shared__ float s_rstd[1];
    const int block = blockIdx.x, G = gridDim.x;
    const int Q = (Hq + 2 * Hkv) * hs, A = Hq * hs;
    const int row_cap = stage_bytes / (int)sizeof(W);  // weights per stage
    Stream<W> st;
    st.f[0] = {Q, C, 0, min(TILE_ROWS, row_cap / C)};
    st.f[1] = {C, A, 0, min(TILE_ROWS, row_cap / A)};
    st.f[2] = {I, C, 1, min(TILE_ROWS / 2, row_cap / (2 * C))};
    st.f[3] = {C, I, 0, min(TILE_ROWS, row_cap / I)};
    st.per_layer = 0;
    for (int k = 0; k < 4; ++k) st.per_layer += st.tiles[k] = tile_count(st.f[k], block, G);
    st.total = st.per_layer * n_layers;
    st.stages = stages;
    st.stage_bytes = stage_bytes;
    st.b = block;
    st.G = G;
    st.full = full;
    T* xs = reinterpret_cast<T*>(dyn + (size_t)stages * stage_bytes);
    // the weights' addresses, read by every issue: in shared memory past the staged input
    const unsigned char** weights = reinterpret_cast<const unsigned char**>(dyn + (size_t)stages * stage_bytes + xs_bytes);
    for (int i = threadIdx.x; i < 4 * n_layers; i += THREADS) {
        const DecodeLayer& L = layers[i / 4];
        const int k = i % 4;
        weights[i] = static_cast<const unsigned char*>(k == 0 ? L.qkv_w : k == 1 ? L.o_w : k == 2 ? L.up_w : L.down_w);
    }
    st.weights = weights;
    __syncthreads();
    if (threadIdx.x == ISSUER) {
        ring_init(full, stages, 1);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (int t = 0; t < stages; ++t) st.issue(t);
    }
    __syncthreads();

    const int ny = Hkv * tiles, nvb = S_att * ny;  // attention blocks of the row
    const int team = threadIdx.x / (NW * 32);
    float* sm_wt = reinterpret_cast<float*>(xs) + team * tile_heads * S_att;
    int t = 0;  // this block's next tile
    for (int l = 0; l < n_layers; ++l) {
        const DecodeLayer L = layers[l];
        const unsigned done = (unsigned)G * (l + 1);  // each block counts each phase once per layer
        if (l > 0) wait_count(sync + DOWN, (unsigned)G * l);
        if (st.tiles[0]) stage(xs, s_rstd, residual, static_cast<const T*>(L.ln1), eps, PRO_NORM, C);
        t = run_linear<T, W>(st, 0, t, qkv, L.qkv_scale, static_cast<const T*>(L.qkv_b), (const T*)nullptr, s_qkv,
                             s_part);
        count_done(sync + QKV);
        wait_count(sync + QKV, done);
        for (int v = team * G + block; v < nvb; v += 2 * G) {
            const int s = v % S_att, y = v / S_att;
            if (team == 0)
                split_impl<T, VN, NV, LP, GM, 4, 0>(scratch, att, qkv, static_cast<T*>(L.k_cache),
                                                   static_cast<T*>(L.v_cache), lengths, Hq, Hkv, hs, max_seq, S_att,
                                                   tiles, tile_heads, scale_log2, part_offset, true, freqs, max_pos, s,
                                                   y, 0, ny, sm_wt, [] {});  // the phase waited above
            else
                split_impl<T, VN, NV, LP, GM, 4, 1>(scratch, att, qkv, static_cast<T*>(L.k_cache),
                                                   static_cast<T*>(L.v_cache), lengths, Hq, Hkv, hs, max_seq, S_att,
                                                   tiles, tile_heads, scale_log2, part_offset, true, freqs, max_pos, s,
                                                   y, 0, ny, sm_wt, [] {});  // the phase waited above
        }
        count_done(sync + ATTENTION);
        wait_count(sync + ATTENTION, done);
        if (st.tiles[1]) stage(xs, s_rstd, att, (const T*)nullptr, eps, PRO_NONE, A);
        t = run_linear<T, W>(st, 1, t, residual, L.o_scale, (const T*)nullptr, residual, s_o, s_part);
        count_done(sync + OUT);
        wait_count(sync + OUT, done);
        if (st.tiles[2]) stage(xs, s_rstd, residual, static_cast<const T*>(L.ln2), eps, PRO_NORM, C);
        t = run_linear<T, W>(st, 2, t, up, L.up_scale, (const T*)nullptr, (const T*)nullptr, s_up, s_part);
        count_done(sync + UP);
        wait_count(sync + UP, done);
        if (st.tiles[3]) stage(xs, s_rstd, up, (const T*)nullptr, eps, PRO_SWIGLU, I);
        t = run_linear<T, W>(st, 3, t, residual, L.down_scale, (const T*)nullptr, residual, s_down, s_part);
        count_done(sync + DOWN);
    }
    // The last block out resets the counters for the next launch: every block has passed every wait.
    if (threadIdx.x == 0 && atomicAdd(sync + LEFT, 1u) == (unsigned)G - 1)
        for (int k = 0; k <= LEFT; ++k) sync[k] = 0;
}
