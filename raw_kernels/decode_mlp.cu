// The MLP of one decode row in one launch (the "ksplit" decode arm): RMSNorm, gate and up, SiLU·mul and
// the down projection, with the down projection split over the hidden units so that no block waits for
// another. The blocks' partial outputs meet in a fixed-point accumulator (gemv.cuh), which the next
// layer's RMSNorm prologue (gemv's x_acc) adds to the residual.
//
//   decode_mlp: x'   = x, or with x_acc r(x + r(y_in)), y_in its values; block 0 writes x' to x_out    (=)
//               h    = r(x' * rstd * norm_weight), rstd summed as rmsnorm_forward sums it
//               g_j  = r(s_j * h . Wu[j]),  u_j = r(s_{I+j} * h . Wu[I + j]),  a_j = r(silu(g_j) * u_j)
//               acc[n] += fix(s'_n * sum_{j in chunk} Wd[n, j] * a_j)   for every chunk of CU hidden units   (+=)
// r() rounds to the model dtype T (gate, up and SiLU·mul as the training forward rounds them); s and s'
// are the per-row E4M3 scales of Wu and Wd (1 for model-dtype weights); fix() is gemv.cuh's acc_fix, so
// the accumulator ends up with the exact integer sum of every chunk's rounded partial: the bits depend on
// CU (8 hidden units, 16 for E4M3 weights), never on the grid, the GPU or the order blocks finish in.
// acc must be zero (or hold what else is summed into the same output) before the launch.
//
// Work layout: a block per SM takes a contiguous range of chunks. A chunk's weights (its CU gate rows and
// CU up rows, two bulk copies, and the CU-wide slice of every down row, a 16-byte cp.async per piece) land
// in one stage of a shared-memory ring whose completion an mbarrier counts. Its first `early` stages are
// filled before the dependent-launch wait: the weights do not depend on the step, so they stream while the
// kernels before this one still run. After the wait the block stages x (with its norm), holds its slice of
// h in registers (a lane's 16-byte weight vectors v = lane + 32 i of each row, XV of them), and per chunk:
// warp w takes the gate/up pairs w, w + 8, ..., each lane's products then a warp sum; lane 0 writes a_j; one
// barrier; every thread adds its down rows' partials (rows n = thread + 256 k) into int64 registers, and
// the stage of the chunk before is refilled. The block's sums go out as one atomic per row at the end.
#include "gemv.cuh"
#include "ring.cuh"

constexpr int THREADS = WARPS * 32;
constexpr int MAX_STAGES = 8;   // ring stages at most (decode_mlp.py: _MAX_STAGES)
constexpr int MAX_ROWS_PT = 8;  // down rows per thread at most: C <= 2048 (decode_mlp.py: _MAX_C)
constexpr int ISSUER = THREADS - 1;  // the thread that counts the bulk bytes and issues the bulk copies

template <typename W> struct Chunk {
    static constexpr int CU = sizeof(W) == 1 ? 16 : 8;  // hidden units per chunk (16 bytes of E4M3 Wd)
    static constexpr int VW = 16 / sizeof(W);           // weights per 16-byte vector
    static constexpr int PIECES = CU * sizeof(W) / 16;  // 16-byte pieces of a down row's slice
};

// Stage `dst` <- chunk c (units [c CU, c CU + CU)): [gate rows | up rows | down pieces (C, CU)].
template <typename W>
__device__ void fill(unsigned char* dst, unsigned long long* full, const W* w_up, const W* w_down, int c, int C,
                     int I) {
    using Ch = Chunk<W>;
    const unsigned rows = (unsigned)(Ch::CU * C * sizeof(W));
    if (threadIdx.x == ISSUER) {
        ring_expect(full, 2 * rows);
        bulk_copy(dst, w_up + (size_t)c * Ch::CU * C, rows, full);
        bulk_copy(dst + rows, w_up + ((size_t)I + (size_t)c * Ch::CU) * C, rows, full);
    }
    unsigned char* down = dst + 2 * rows;
    for (int p = threadIdx.x; p < C * Ch::PIECES; p += THREADS) {
        const int n = p / Ch::PIECES, k = p - n * Ch::PIECES;
        copy16(down + (size_t)p * 16, w_down + (size_t)n * I + (size_t)c * Ch::CU + k * Ch::VW);
    }
    ring_arrive(full);
}

// ---- the kernel ----------------------------------------------------------------------------------------
// Dynamic shared memory (decode_mlp.py: _smem): stages x stage_bytes, then x staged in fp32 (C), its raw
// copy and the norm weight in T (C each), then the block's gate/up row scales (2 CU per chunk, E4M3 only).
template <typename T, typename W, int XV>
__device__ void decode_mlp_impl(long long* acc, T* x_out, const T* x, const long long* x_acc,
                                const T* __restrict__ norm_weight, const W* __restrict__ w_up,
                                const float* __restrict__ up_scale, const W* __restrict__ w_down,
                                const float* __restrict__ down_scale, float eps, int C, int I, int stages,
                                int stage_bytes, int early) {
    using Ch = Chunk<W>;
    constexpr int CU = Ch::CU, VW = Ch::VW;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ unsigned long long full[MAX_STAGES];  // one mbarrier per stage
    __shared__ float s_act[2][CU];
    __shared__ float s_rstd[1];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int chunks = I / CU, c0 = (int)((long long)blockIdx.x * chunks / gridDim.x);
    const int nch = (int)((long long)(blockIdx.x + 1) * chunks / gridDim.x) - c0;
    float* xs = reinterpret_cast<float*>(smem + (size_t)stages * stage_bytes);
    T* raw = reinterpret_cast<T*>(xs + C);
    T* nw = raw + C;
    float* scales = reinterpret_cast<float*>(nw + C);  // (nch, 2, CU): gate then up scales of each chunk
    launch_dependents();

    // Before the wait: the weights only. The ring's first `early` stages, the norm weight and the row scales.
    if (threadIdx.x == 0) ring_init(full, stages, THREADS + 1);  // every thread's arrival and the issuer's
    __syncthreads();
    const int filled = min(stages, nch), before = min(early, filled);
    for (int j = 0; j < before; ++j) fill<W>(smem + (size_t)j * stage_bytes, full + j, w_up, w_down, c0 + j, C, I);
    for (int c = threadIdx.x * Pack16<T>::N; c < C; c += THREADS * Pack16<T>::N)
        Pack16<T>::load(norm_weight + c).store(nw + c);
    if (up_scale != nullptr)
        for (int i = threadIdx.x; i < nch * 2 * CU; i += THREADS) {
            const int j = i / (2 * CU), r = i - j * 2 * CU, unit = (c0 + j) * CU + (r < CU ? r : r - CU);
            scales[i] = up_scale[r < CU ? unit : I + unit];
        }
    float ds[MAX_ROWS_PT];
    #pragma unroll
    for (int k = 0; k < MAX_ROWS_PT; ++k) {
        const int n = threadIdx.x + k * THREADS;
        ds[k] = down_scale != nullptr && n < C ? down_scale[n] : 1.f;
    }

    grid_dependency_wait();  // x and x_acc come from the kernels before
    for (int j = before; j < filled; ++j) fill<W>(smem + (size_t)j * stage_bytes, full + j, w_up, w_down, c0 + j, C, I);
    stage_input<T, float, 1>(xs, raw, s_rstd, x, nw, eps, PRO_NORM_STAGED, 0, 1, C, x_acc,
                             blockIdx.x == 0 ? x_out : nullptr);
    __syncthreads();
    const int Cv = C / VW;  // weight vectors per row
    float xr[XV][VW];
    #pragma unroll
    for (int i = 0; i < XV; ++i) {
        const int v = lane + 32 * i;
        #pragma unroll
        for (int e = 0; e < VW; ++e) xr[i][e] = v < Cv ? xs[v * VW + e] : 0.f;
    }

    long long tot[MAX_ROWS_PT];
    #pragma unroll
    for (int k = 0; k < MAX_ROWS_PT; ++k) tot[k] = 0;
    bool bad = false;
    for (int j = 0; j < nch; ++j) {
        const int slot = j % stages;
        unsigned char* stage = smem + (size_t)slot * stage_bytes;
        stage_wait(full + slot, (unsigned)(j / stages) & 1u);
        const W* rows = reinterpret_cast<const W*>(stage);
        // gate/up pairs: unit u = warp + 8 p, its gate row u and up row CU + u of the stage
        #pragma unroll
        for (int p = 0; p < CU / WARPS; ++p) {
            const int u = warp + WARPS * p;
            const W* gr = rows + (size_t)u * C;
            const W* ur = rows + (size_t)(CU + u) * C;
            float g = 0.f, up = 0.f;
            #pragma unroll
            for (int i = 0; i < XV; ++i) {
                const int v = lane + 32 * i;
                if (v < Cv) {
                    const uint4 a = *reinterpret_cast<const uint4*>(gr + (size_t)v * VW);
                    const uint4 bq = *reinterpret_cast<const uint4*>(ur + (size_t)v * VW);
                    const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {bq.x, bq.y, bq.z, bq.w};
                    #pragma unroll
                    for (int e = 0; e < VW; e += 2) {
                        const float2 pa = widen_pair<W>(wa, e), pb = widen_pair<W>(wb, e);
                        g = fmaf(xr[i][e], pa.x, g);
                        g = fmaf(xr[i][e + 1], pa.y, g);
                        up = fmaf(xr[i][e], pb.x, up);
                        up = fmaf(xr[i][e + 1], pb.y, up);
                    }
                }
            }
            g = warp_sum(g);
            up = warp_sum(up);
            if (lane == 0) {
                if (up_scale != nullptr) {
                    g *= scales[j * 2 * CU + u];
                    up *= scales[j * 2 * CU + CU + u];
                }
                const float gr_ = to_float(from_float<T>(g)), ur_ = to_float(from_float<T>(up));
                s_act[j & 1][u] = to_float(from_float<T>(swiglu_value(gr_, ur_)));
            }
        }
        __syncthreads();  // the chunk's a_j are in; every thread is done with the chunk before's stage
        if (j >= 1 && j - 1 + stages < nch) {
            const int prev = (j - 1) % stages;
            fill<W>(smem + (size_t)prev * stage_bytes, full + prev, w_up, w_down, c0 + j - 1 + stages, C, I);
        }
        const W* down = reinterpret_cast<const W*>(stage + 2 * (size_t)CU * C * sizeof(W));
        float a[CU];
        #pragma unroll
        for (int u = 0; u < CU; ++u) a[u] = s_act[j & 1][u];
        #pragma unroll
        for (int k = 0; k < MAX_ROWS_PT; ++k) {
            const int n = threadIdx.x + k * THREADS;
            if (n < C) {
                float p = 0.f;
                #pragma unroll
                for (int q = 0; q < Ch::PIECES; ++q)
                    p = dot16<W>(*reinterpret_cast<const uint4*>(down + (size_t)n * CU + q * VW), a + q * VW, p);
                tot[k] += acc_fix(p * ds[k], bad);
            }
        }
    }
    #pragma unroll
    for (int k = 0; k < MAX_ROWS_PT; ++k) {
        const int n = threadIdx.x + k * THREADS;
        if (n < C) acc_add(acc, C, n, tot[k], bad && k == 0);
    }
}

// decode_mlp<T, W, XV>: instantiated on demand by name expression (decode_mlp.py: the kernel name), so a
// process compiles only the variant it runs. XV: a lane's 16-byte weight vectors per row, ceil(C / VW / 32).
template <typename T, typename W, int XV>
__global__ void __launch_bounds__(THREADS, 2)
    decode_mlp(long long* acc, T* x_out, const T* x, const long long* x_acc, const T* norm_weight, const W* w_up,
               const float* up_scale, const W* w_down, const float* down_scale, float eps, int C, int I,
               int stages, int stage_bytes, int early) {
    decode_mlp_impl<T, W, XV>(acc, x_out, x, x_acc, norm_weight, w_up, up_scale, w_down, down_scale, eps, C, I,
                              stages, stage_bytes, early);
}
