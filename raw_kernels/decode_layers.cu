// Every layer of a batch-1 decode step in one persistent launch (the "persistent" decode arm).
//
//   for each layer l (its weights and cache from the layer table, written once by decode_layers.py):
//     qkv      = gemv(residual, qkv_w, norm_weight=ln1, bias=qkv_b)             (gemv.cuh, as gemv.cu)
//     att      = decode attention with the RoPE + cache append fused            (decode_attention.cuh)
//     residual = gemv(att, atto_w, residual=residual)
//     up       = gemv_dual(residual, up_w, norm_weight=ln2)
//     residual = gemv(up, down_w, act=swiglu, residual=residual)
// Each phase is the device code of the "fused" arm's own kernels with the same K splits, so the step is
// bit-identical to that arm; what changes is how the phases meet. The grid is BLOCKS_PER_SM blocks per
// SM (1: 255 registers, what the attention wants; 2: 128, more warps for the GEMVs), all resident at
// once (decode_layers.py checks the occupancy before it launches), and
// the phases are separated by a grid-wide barrier instead of a kernel boundary: no launch, no drain of
// the grid, no flush. Before waiting at a barrier every block issues its first weight loads of the next
// phase (into registers: weights never depend on the step) and L2 prefetches of the weights two phases
// ahead, so HBM keeps streaming weights while the barrier and the small phases (attention, the short
// GEMVs) run. The attention phase runs two attention blocks per block, on threads 0-127 and 128-255.
// Everything a phase reads that an earlier phase wrote goes through L2 (ld.global.cg / cp.async.cg).
// sync: two uint32 counters, zero before the first launch; the last block to leave resets them.
#include "decode_attention.cuh"
#include "gemv.cuh"

constexpr int THREADS = WARPS * 32;  // the GEMV phases' block; the attention phase runs two NW-warp teams
static_assert(THREADS == 2 * NW * 32, "two attention teams per block");

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

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid arrives, then waits until all have: `target` = arrivals expected so far.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's writes before its arrival
        atomicAdd(counter, 1u);
        while (load_acquire(counter) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}

// L2 prefetch of the first `bytes` (at most `cap`) of a weight, spread over every thread of the grid.
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, long long cap) {
    const long long lines = (bytes < cap ? bytes : cap) / 128;
    const char* base = static_cast<const char*>(p);
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < lines; i += (long long)gridDim.x * THREADS)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base + i * 128));
}

template <typename T, typename W, int VN, int NV, int LP, int GM>
__device__ void decode_layers_impl(const DecodeLayer* layers, int n_layers, T* residual, T* qkv, T* att, T* up,
                                   float* scratch, const int* lengths, const typename RopeTable<T>::F* freqs,
                                   unsigned* sync, int C, int I, int Hq, int Hkv, int hs, int max_seq, int max_pos,
                                   float eps, int S_att, int tiles, int tile_heads, float scale_log2,
                                   long long part_offset, int s_qkv, int s_o, int s_up, int s_down,
                                   long long prefetch_cap) {
    extern __shared__ __align__(16) unsigned char dyn[];
    const int block = blockIdx.x, G = gridDim.x;
    const int Q = (Hq + 2 * Hkv) * hs, A = Hq * hs;
    unsigned crossed = 0;
    bool started = false;
    // A phase's wait: the first one (the encoder wrote the residual before this launch) is free.
    const auto wait = [&] {
        if (started) grid_barrier(sync, ++crossed * (unsigned)G);
        started = true;
    };
    const long long wb = sizeof(W);
    const int ny = Hkv * tiles, nvb = S_att * ny;  // attention blocks of the row
    const int team = threadIdx.x / (NW * 32);
    float* sm_wt = reinterpret_cast<float*>(dyn) + team * tile_heads * S_att;
    for (int l = 0; l < n_layers; ++l) {
        const DecodeLayer L = layers[l];
        const DecodeLayer* next = l + 1 < n_layers ? layers + l + 1 : nullptr;
        prefetch_l2(L.o_w, wb * C * A, prefetch_cap);
        gemv_impl<T, W, T, 1>(qkv, residual, static_cast<const W*>(L.qkv_w), L.qkv_scale,
                              static_cast<const T*>(L.qkv_b), (const T*)nullptr, static_cast<const T*>(L.ln1), eps,
                              PRO_NORM, 0, 1, C, Q, s_qkv, block, G, wait);
        prefetch_l2(L.up_w, wb * 2 * I * C, prefetch_cap);
        wait();
        for (int v = team * G + block; v < nvb; v += 2 * G) {
            const int s = v % S_att, y = v / S_att;
            if (team == 0)
                split_impl<T, VN, NV, LP, GM, 4, 0>(scratch, att, qkv, static_cast<T*>(L.k_cache),
                                                   static_cast<T*>(L.v_cache), lengths, Hq, Hkv, hs, max_seq, S_att,
                                                   tiles, tile_heads, scale_log2, part_offset, true, freqs, max_pos, s,
                                                   y, 0, ny, sm_wt);
            else
                split_impl<T, VN, NV, LP, GM, 4, 1>(scratch, att, qkv, static_cast<T*>(L.k_cache),
                                                   static_cast<T*>(L.v_cache), lengths, Hq, Hkv, hs, max_seq, S_att,
                                                   tiles, tile_heads, scale_log2, part_offset, true, freqs, max_pos, s,
                                                   y, 0, ny, sm_wt);
        }
        prefetch_l2(L.down_w, wb * C * I, prefetch_cap);
        gemv_impl<T, W, T, 1>(residual, att, static_cast<const W*>(L.o_w), L.o_scale, (const T*)nullptr, residual,
                              (const T*)nullptr, eps, PRO_NONE, 0, 1, A, C, s_o, block, G, wait);
        if (next) prefetch_l2(next->qkv_w, wb * Q * C, prefetch_cap);
        gemv_impl<T, W, T, 1>(up, residual, static_cast<const W*>(L.up_w), L.up_scale, (const T*)nullptr,
                              (const T*)nullptr, static_cast<const T*>(L.ln2), eps, PRO_NORM, 1, 1, C, 2 * I, s_up,
                              block, G, wait);
        gemv_impl<T, W, T, 1>(residual, up, static_cast<const W*>(L.down_w), L.down_scale, (const T*)nullptr,
                              residual, (const T*)nullptr, eps, PRO_SWIGLU, 0, 1, I, C, s_down, block, G, wait);
    }
    // The last block out resets the counters for the next launch: every block has passed every barrier.
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == (unsigned)G - 1) {
        sync[0] = 0;
        sync[1] = 0;
    }
}

// One kernel per (T, W, attention layout, q heads per attention block GM, resident blocks per SM),
// instantiated on demand by name expression
// (decode_layers.py: kernel_expression) so that a process compiles only the variant it runs:
// each inlines a whole decode layer and takes NVRTC about 18 s.
template <typename T, typename W, int VN, int NV, int LP, int GM, int BLOCKS_PER_SM>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
    decode_layers(const DecodeLayer* layers, int n_layers, T* residual, T* qkv, T* att, T* up, float* scratch,
                  const int* lengths, const typename RopeTable<T>::F* freqs, unsigned* sync, int C, int I, int Hq,
                  int Hkv, int hs, int max_seq, int max_pos, float eps, int S_att, int tiles, int tile_heads,
                  float scale_log2, long long part_offset, int s_qkv, int s_o, int s_up, int s_down,
                  long long prefetch_cap) {
    decode_layers_impl<T, W, VN, NV, LP, GM>(layers, n_layers, residual, qkv, att, up, scratch, lengths, freqs, sync, C,
                                         I, Hq, Hkv, hs, max_seq, max_pos, eps, S_att, tiles, tile_heads, scale_log2,
                                         part_offset, s_qkv, s_o, s_up, s_down, prefetch_cap);
}
