// RMSNorm over rows of C channels: forward, fused residual-add forward, backward.
//
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps);  out = x * rstd * weight         (=)
//   fused:    residual = round(inp1 + inp2);  then the forward on residual        (=)
//   backward: dinp = dresidual + rstd * (weight*dout - x*rstd * sum(weight*dout*x) * rstd / C)   (=)
//             dweight += sum over rows of dout * x * rstd                          (+=, a parameter gradient)
// One warp per row, fp32 math, one rounding at each store. abs_max outputs max-accumulate |stored value|
// with one integer atomicMax per block. dinp may alias dresidual, and residual and out may alias inp1 or
// inp2 (or each other): a lane handles the same elements in both passes of a row and reads each one
// before it writes it, and no other thread touches them.
// dweight is deterministic: block b's warps accumulate fixed rows (row = (k * blocks + b) * warps + warp)
// into per-warp partials, added in warp order into scratch[b]; a second kernel adds scratch's
// rows in order into dweight. The block count is the scratch's first dimension, a function of (N, C)
// only (rmsnorm_scratch_shape), so results do not depend on the GPU. C: a multiple of the 16-byte
// vector width.
// Backward variants: `rmsnorm_backward_v<V>_*` (C <= 32 * V vectors) keep what a lane re-uses across rows
// in registers (its weight vectors, its dweight partials) and copy each row's x, dout and dresidual
// (cp.async) into one of two per-warp shared-memory buffers, a row ahead of the one being computed. The
// block count is capped at 132 (one block per SM of the H200) so that blocks live for many rows.
// `rmsnorm_backward_*` (any C) reads the row from global memory in both passes. Both do the same
// arithmetic in the same order: the same bits.
#include "common.cuh"
#include "cp_async.cuh"

constexpr int FWD_WARPS = 8;  // rows per forward block
constexpr int BWD_STAGES = 2;  // row buffers per warp of rmsnorm_backward_v<V>: the one computed from, the next one


// ---- kernels ------------------------------------------------------------------------------

// RESIDUAL: residual = round(inp1 + inp2) is stored, then normalised; else inp1 is normalised.
template <typename T, bool RESIDUAL>
__device__ void rmsnorm_forward_impl(T* out, float* rstd, T* residual, const T* inp1, const T* inp2,
                                     const T* weight, float* abs_max, float eps, int N, int C) {
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32;
    unsigned amax = 0;
    for (int row = blockIdx.x * FWD_WARPS + threadIdx.x / 32; row < N; row += gridDim.x * FWD_WARPS) {
        const size_t base = (size_t)row * C;
        const T* x_row = RESIDUAL ? residual + base : inp1 + base;
        float ss = 0.f;
        for (int c = lane * VN; c < C; c += 32 * VN) {
            Pack16<T> x;
            if (RESIDUAL) {
                const Pack16<T> a = Pack16<T>::load(inp1 + base + c), b = Pack16<T>::load(inp2 + base + c);
                for (int k = 0; k < VN; ++k) x.v[k] = from_float<T>(to_float(a.v[k]) + to_float(b.v[k]));
                x.store(residual + base + c);
            } else {
                x = Pack16<T>::load(inp1 + base + c);
            }
            for (int k = 0; k < VN; ++k) {
                const float f = to_float(x.v[k]);
                ss += f * f;
            }
        }
        ss = warp_sum(ss);
        const float r = 1.f / sqrtf(ss / C + eps);
        if (lane == 0) rstd[row] = r;
        // second pass: the row is in L1 (or, for the residual, this thread's own stores)
        for (int c = lane * VN; c < C; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(x_row + c), w = Pack16<T>::load(weight + c);
            Pack16<T> y;
            for (int k = 0; k < VN; ++k) {
                y.v[k] = from_float<T>(to_float(x.v[k]) * r * to_float(w.v[k]));
                amax = max(amax, abs_bits(to_float(y.v[k])));
            }
            y.store(out + base + c);
        }
    }
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// A warp's dweight partials in shared memory are stored element-major, channel j * VN + k at k * C / VN + j
// (`dw_slot`): the lanes of a warp touch 32 consecutive words for each k (the looping kernel adds into
// them for every row). Channel-major, lane l's k-th element sat VN words from lane l-1's, an 8-way (bf16)
// bank conflict on each read-modify-write, which held the kernel to ~45% of copy bandwidth.
__device__ __forceinline__ int dw_slot(int c, int vn, int C) { return (c % vn) * (C / vn) + c / vn; }

// The block's per-warp partials (warps, C), each in dw_slot order, added in warp order into scratch[blockIdx.x].
__device__ __forceinline__ void block_partials_to_scratch(float* scratch, const float* s_partials, int vn, int C) {
    const int warps = blockDim.x / 32;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int slot = dw_slot(c, vn, C);
        float acc = s_partials[slot];
        for (int w = 1; w < warps; ++w) acc += s_partials[(size_t)w * C + slot];
        scratch[(size_t)blockIdx.x * C + c] = acc;
    }
}

// Any C: the row is read from global memory in both passes, the partials kept in shared memory
// (dynamic: warps * C floats).
template <typename T>
__device__ void rmsnorm_backward_loop_impl(T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, float* abs_max, int N, int C) {
    extern __shared__ float s_dweight[];  // (warps, C); lane-owned entries, so no barrier until the end
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int stride = C / VN;  // words between the k-th elements of consecutive vectors' slots
    float* my_dweight = s_dweight + (size_t)warp * C;  // vector j's element k at k * stride + j
    for (int c = lane; c < C; c += 32) my_dweight[c] = 0.f;
    unsigned amax = 0;
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const size_t base = (size_t)row * C;
        const float r = rstd[row];
        float dot = 0.f;  // sum(weight * dout * x)
        for (int c = lane * VN; c < C; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c), g = Pack16<T>::load(dout + base + c),
                            w = Pack16<T>::load(weight + c);
            for (int k = 0; k < VN; ++k) dot += to_float(w.v[k]) * to_float(g.v[k]) * to_float(x.v[k]);
        }
        dot = warp_sum(dot);
        const float coef = dot * r / C;
        for (int c = lane * VN; c < C; c += 32 * VN) {
            const Pack16<T> x = Pack16<T>::load(inp + base + c), g = Pack16<T>::load(dout + base + c),
                            w = Pack16<T>::load(weight + c), dr = Pack16<T>::load(dresidual + base + c);
            Pack16<T> d;
            for (int k = 0; k < VN; ++k) {
                const float xh = to_float(x.v[k]) * r, gk = to_float(g.v[k]);
                d.v[k] = from_float<T>(to_float(dr.v[k]) + r * (to_float(w.v[k]) * gk - xh * coef));
                my_dweight[k * stride + c / VN] += gk * xh;
                amax = max(amax, abs_bits(to_float(d.v[k])));
            }
            d.store(dinp + base + c);
        }
    }
    __syncthreads();
    block_partials_to_scratch(scratch, s_dweight, VN, C);
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// C <= 32 V VN: lane vector i of a row is channel (lane + 32 i) * VN, i < V. What a lane re-uses across
// rows lives in its registers: its V weight vectors (loaded once) and its dweight partials (V * VN floats:
// the lane owns these channels in every row); the rstd of 32 rows at a time sits one per lane and is
// shuffled out. A warp has BWD_STAGES (2) shared-memory buffers of a row's x, dout and dresidual: while it
// computes row j from buffer j % 2 (both passes read it there), row j + 1 is being copied (cp.async) into
// the other. So a row's loop waits on nothing but its own row's copy. (With the weight re-read from L1
// and the partials read-modify-written in shared memory for every row, in dependent chains, a warp took
// ~4 us per C = 1536 row: 72% of copy bandwidth. A third buffer, or 4 warps a block, measured no faster
// on the H200.)
// A lane copies and reads back only its own vectors, so its own wait is all the synchronisation; it has
// read a buffer (the previous row's) before it stages a later row into it (the asm's memory clobber keeps
// that order), and a row is staged before the warp stores it, so dinp may still alias dresidual.
template <typename T, int V>
__device__ void rmsnorm_backward_rows_impl(T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp,
                                           const T* weight, const float* rstd, float* abs_max, int N, int C) {
    extern __shared__ float s_dweight[];  // (warps, BWD_STAGES, 3, C) of T; at the end the (warps, C) partials
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int row0 = blockIdx.x * warps + warp, step = gridDim.x * warps;  // the warp's j-th row: row0 + j step
    T* stage = reinterpret_cast<T*>(s_dweight) + (size_t)warp * BWD_STAGES * 3 * C;
    auto stage_row = [&](int j) {  // into buffer j % BWD_STAGES; past the warp's last row an empty group
        const int row = row0 + j * step;
        if (row < N) {
            T* buf = stage + (size_t)(j % BWD_STAGES) * 3 * C;
            const size_t base = (size_t)row * C;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int c = (lane + 32 * i) * VN;
                if (c < C) {
                    cp_async16(smem_u32(buf + c), inp + base + c);
                    cp_async16(smem_u32(buf + C + c), dout + base + c);
                    cp_async16(smem_u32(buf + 2 * C + c), dresidual + base + c);
                }
            }
        }
        cp_async_commit();
    };
    for (int j = 0; j + 1 < BWD_STAGES; ++j) stage_row(j);
    auto rstd_of = [&](int j) {  // lane l: the rstd of the warp's row j + l
        const int row = row0 + (j + lane) * step;
        return row < N ? rstd[row] : 0.f;
    };
    float r_lanes = rstd_of(0), r_later = rstd_of(32);
    Pack16<T> w[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int c = (lane + 32 * i) * VN;
        if (c < C) w[i] = Pack16<T>::load(weight + c);
    }
    float dw[V][VN];
#pragma unroll
    for (int i = 0; i < V; ++i)
        for (int k = 0; k < VN; ++k) dw[i][k] = 0.f;
    unsigned amax = 0;
    int j = 0;
    for (int row = row0; row < N; row += step, ++j) {
        stage_row(j + BWD_STAGES - 1);  // into the buffer the previous row was computed from
        if (j % 32 == 0 && j > 0) {
            r_lanes = r_later;
            r_later = rstd_of(j + 32);
        }
        const float r = __shfl_sync(0xffffffffu, r_lanes, j % 32);
        cp_async_wait<BWD_STAGES - 1>();  // this row's copy: every group but the newest (the next row's)
        const T* buf = stage + (size_t)(j % BWD_STAGES) * 3 * C;
        float dot = 0.f;  // sum(weight * dout * x)
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int c = (lane + 32 * i) * VN;
            if (c >= C) continue;
            const Pack16<T> x = Pack16<T>::load(buf + c), g = Pack16<T>::load(buf + C + c);
            for (int k = 0; k < VN; ++k) dot += to_float(w[i].v[k]) * to_float(g.v[k]) * to_float(x.v[k]);
        }
        dot = warp_sum(dot);
        const float coef = dot * r / C;
        const size_t base = (size_t)row * C;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int c = (lane + 32 * i) * VN;
            if (c >= C) continue;
            const Pack16<T> x = Pack16<T>::load(buf + c), g = Pack16<T>::load(buf + C + c),
                            dr = Pack16<T>::load(buf + 2 * C + c);
            Pack16<T> d;
            for (int k = 0; k < VN; ++k) {
                const float xh = to_float(x.v[k]) * r, gk = to_float(g.v[k]);
                d.v[k] = from_float<T>(to_float(dr.v[k]) + r * (to_float(w[i].v[k]) * gk - xh * coef));
                dw[i][k] += gk * xh;
                amax = max(amax, abs_bits(to_float(d.v[k])));
            }
            d.store(dinp + base + c);
        }
    }
    cp_async_wait<0>();  // only empty groups are left: nothing lands on the partials
    __syncthreads();     // every warp is done with its buffers, which the partials overwrite
    float* my_dweight = s_dweight + (size_t)warp * C;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int c = (lane + 32 * i) * VN;
        if (c < C)
            for (int k = 0; k < VN; ++k) my_dweight[dw_slot(c + k, VN, C)] = dw[i][k];
    }
    __syncthreads();
    block_partials_to_scratch(scratch, s_dweight, VN, C);
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// dweight[c] += sum over p of scratch[p, c], added in order of p. A block of DW_WARPS warps owns 32
// columns: all its warps load DW_CHUNK rows of them at once (coalesced, every load in flight), into
// shared memory, where warp 0's lane c adds them in row order. One thread per column loading the
// rows itself kept C/256 SMs busy and ran at their L2 bandwidth.
constexpr int DW_WARPS = 32, DW_CHUNK = 256;
template <typename T>
__device__ void rmsnorm_backward_dweight_impl(T* dweight, const float* scratch, int P, int C) {
    __shared__ float tile[DW_CHUNK][32];  // row p, column lane: conflict-free in both phases
    constexpr int PER_WARP = DW_CHUNK / DW_WARPS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int c = blockIdx.x * 32 + lane;
    float acc = 0.f;
    for (int p0 = 0; p0 < P; p0 += DW_CHUNK) {
        const int rows = min(DW_CHUNK, P - p0);
        float v[PER_WARP];
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) {
            const int p = warp + DW_WARPS * j;
            v[j] = p < rows && c < C ? scratch[(size_t)(p0 + p) * C + c] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < PER_WARP; ++j) tile[warp + DW_WARPS * j][lane] = v[j];
        __syncthreads();
        if (warp == 0)
            for (int p = 0; p < rows; ++p) acc += tile[p][lane];
        __syncthreads();
    }
    if (warp == 0 && c < C) dweight[c] = from_float<T>(to_float(dweight[c]) + acc);
}

// ---- launchers ----------------------------------------------------------------------------

#define RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, V)                                                             \
    extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_v##V##_##SUF(                        \
        T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp, const T* weight,          \
        const float* rstd, float* abs_max, int N, int C) {                                                  \
        grid_dependency_wait();                                                                             \
        rmsnorm_backward_rows_impl<T, V>(dinp, scratch, dresidual, dout, inp, weight, rstd, abs_max, N, C); \
    }

#define RMSNORM_KERNELS(SUF, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(FWD_WARPS * 32) rmsnorm_forward_##SUF(                     \
        T* out, float* rstd, const T* inp, const T* weight, float* abs_max, float eps, int N, int C) {     \
        grid_dependency_wait();                                                                             \
        rmsnorm_forward_impl<T, false>(out, rstd, nullptr, inp, nullptr, weight, abs_max, eps, N, C);       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(FWD_WARPS * 32) fused_residual_rmsnorm_forward_##SUF(      \
        T* residual, T* out, float* rstd, const T* inp1, const T* inp2, const T* weight, float* abs_max,    \
        float eps, int N, int C) {                                                                          \
        grid_dependency_wait();                                                                             \
        rmsnorm_forward_impl<T, true>(out, rstd, residual, inp1, inp2, weight, abs_max, eps, N, C);         \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) rmsnorm_backward_##SUF(                                \
        T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp, const T* weight,          \
        const float* rstd, float* abs_max, int N, int C) {                                                  \
        grid_dependency_wait();                                                                             \
        rmsnorm_backward_loop_impl<T>(dinp, scratch, dresidual, dout, inp, weight, rstd, abs_max, N, C);    \
    }                                                                                                       \
    RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, 1)                                                                 \
    RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, 2)                                                                 \
    RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, 4)                                                                 \
    RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, 6)                                                                 \
    RMSNORM_BACKWARD_ROWS_KERNEL(SUF, T, 8)                                                                 \
    extern "C" __global__ void __launch_bounds__(DW_WARPS * 32) rmsnorm_backward_dweight_##SUF(             \
        T* dweight, const float* scratch, int P, int C) {                                                   \
        grid_dependency_wait();                                                                             \
        rmsnorm_backward_dweight_impl<T>(dweight, scratch, P, C);                                           \
    }
RMSNORM_KERNELS(f32, float)
RMSNORM_KERNELS(bf16, bf16)
RMSNORM_KERNELS(f16, half)
