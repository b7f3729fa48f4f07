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
// into per-warp shared partials, added in warp order into scratch[b]; a second kernel adds scratch's
// rows in order into dweight. The block count is the scratch's first dimension, a function of (N, C)
// only (rmsnorm_scratch_shape), so results do not depend on the GPU. C: a multiple of the 16-byte
// vector width.
// Backward variants: `rmsnorm_backward_v<V>_*` (C <= 32 * V vectors) run both passes of a row from
// registers, and keep memory busy across a warp's rows: the next row's x, dout and dresidual are
// copied (cp.async) into a per-warp shared-memory stage while this row computes and stores. The block
// count is capped low (264) so that blocks live for many rows: with a warp's rows one after another
// and nothing in flight between them, each row paid the full memory latency (43% of copy bandwidth).
// `rmsnorm_backward_*` (any C) reads the row from global memory in both passes. Both do the same
// arithmetic in the same order: the same bits.
#include "common.cuh"
#include "cp_async.cuh"

constexpr int FWD_WARPS = 8;  // rows per forward block


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

// Block partials of dweight into scratch[blockIdx.x, :]; dynamic shared memory: warps * C floats.
// V > 0: lane vector i of a row is channel (lane + 32 i) * VN, i < V, held in registers (C <= 32 V VN).
// A warp's partials are stored element-major, channel j * VN + k at k * C / VN + j (`dw_slot`): the lanes
// of a warp touch 32 consecutive words for each k. Channel-major, lane l's k-th element sat VN words
// from lane l-1's, an 8-way (bf16) bank conflict on each of the row's read-modify-writes, which held
// the kernel to ~45% of copy bandwidth.
__device__ __forceinline__ int dw_slot(int c, int vn, int C) { return (c % vn) * (C / vn) + c / vn; }

template <typename T, int V>
__device__ void rmsnorm_backward_impl(T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp,
                                      const T* weight, const float* rstd, float* abs_max, int N, int C) {
    extern __shared__ float s_dweight[];  // (warps, C); lane-owned entries, so no barrier until the end
    constexpr int VN = Pack16<T>::N;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int stride = C / VN;  // words between the k-th elements of consecutive vectors' slots
    float* my_dweight = s_dweight + (size_t)warp * C;  // vector j's element k at k * stride + j
    const int row0 = blockIdx.x * warps + warp, step = gridDim.x * warps;
    // V > 0: the warp's next row (x, dout, dresidual: (3, C) after the partials) is copied into shared
    // memory while this one computes from registers. A lane copies and reads back only its own vectors,
    // so its own wait is all the synchronisation; it reads the staged row into registers before it
    // stages the next one over it (the asm's memory clobber keeps that order), and a row is staged
    // before the warp stores it, so dinp may still alias dresidual.
    T* stage = reinterpret_cast<T*>(s_dweight + (size_t)warps * C) + (size_t)warp * 3 * C;
    auto stage_row = [&](int row) {
        const size_t base = (size_t)row * C;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int c = (lane + 32 * i) * VN;
            if (c < C) {
                cp_async16(smem_u32(stage + c), inp + base + c);
                cp_async16(smem_u32(stage + C + c), dout + base + c);
                cp_async16(smem_u32(stage + 2 * C + c), dresidual + base + c);
            }
        }
        cp_async_commit();
    };
    float r_next = 0.f;
    if constexpr (V > 0) {
        if (row0 < N) {  // in flight while the partials are zeroed
            stage_row(row0);
            r_next = rstd[row0];
        }
    }
    for (int c = lane; c < C; c += 32) my_dweight[c] = 0.f;
    unsigned amax = 0;
    for (int row = row0; row < N; row += step) {
        const size_t base = (size_t)row * C;
        float dot = 0.f;  // sum(weight * dout * x)
        if constexpr (V > 0) {
            const float r = r_next;
            Pack16<T> xs[V], gs[V], drs[V];
            cp_async_wait<0>();
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int c = (lane + 32 * i) * VN;
                if (c < C) {
                    xs[i] = Pack16<T>::load(stage + c);
                    gs[i] = Pack16<T>::load(stage + C + c);
                    drs[i] = Pack16<T>::load(stage + 2 * C + c);
                }
            }
            if (row + step < N) {
                stage_row(row + step);
                r_next = rstd[row + step];
            }
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int c = (lane + 32 * i) * VN;
                if (c >= C) continue;
                const Pack16<T> w = Pack16<T>::load(weight + c);
                for (int k = 0; k < VN; ++k) dot += to_float(w.v[k]) * to_float(gs[i].v[k]) * to_float(xs[i].v[k]);
            }
            dot = warp_sum(dot);
            const float coef = dot * r / C;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int c = (lane + 32 * i) * VN;
                if (c >= C) continue;
                const Pack16<T> w = Pack16<T>::load(weight + c);
                Pack16<T> d;
                for (int k = 0; k < VN; ++k) {
                    const float xh = to_float(xs[i].v[k]) * r, gk = to_float(gs[i].v[k]);
                    d.v[k] = from_float<T>(to_float(drs[i].v[k]) + r * (to_float(w.v[k]) * gk - xh * coef));
                    my_dweight[k * stride + c / VN] += gk * xh;
                    amax = max(amax, abs_bits(to_float(d.v[k])));
                }
                d.store(dinp + base + c);
            }
        } else {
            const float r = rstd[row];
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
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int slot = dw_slot(c, VN, C);
        float acc = s_dweight[slot];
        for (int w = 1; w < warps; ++w) acc += s_dweight[(size_t)w * C + slot];
        scratch[(size_t)blockIdx.x * C + c] = acc;
    }
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

#define RMSNORM_BACKWARD_KERNEL(SUF, T, V, NAME)                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                 \
        T* dinp, float* scratch, const T* dresidual, const T* dout, const T* inp, const T* weight,          \
        const float* rstd, float* abs_max, int N, int C) {                                                  \
        rmsnorm_backward_impl<T, V>(dinp, scratch, dresidual, dout, inp, weight, rstd, abs_max, N, C);      \
    }

#define RMSNORM_KERNELS(SUF, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(FWD_WARPS * 32) rmsnorm_forward_##SUF(                     \
        T* out, float* rstd, const T* inp, const T* weight, float* abs_max, float eps, int N, int C) {     \
        rmsnorm_forward_impl<T, false>(out, rstd, nullptr, inp, nullptr, weight, abs_max, eps, N, C);       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(FWD_WARPS * 32) fused_residual_rmsnorm_forward_##SUF(      \
        T* residual, T* out, float* rstd, const T* inp1, const T* inp2, const T* weight, float* abs_max,    \
        float eps, int N, int C) {                                                                          \
        rmsnorm_forward_impl<T, true>(out, rstd, residual, inp1, inp2, weight, abs_max, eps, N, C);         \
    }                                                                                                       \
    RMSNORM_BACKWARD_KERNEL(SUF, T, 0, rmsnorm_backward_##SUF)                                              \
    RMSNORM_BACKWARD_KERNEL(SUF, T, 1, rmsnorm_backward_v1_##SUF)                                           \
    RMSNORM_BACKWARD_KERNEL(SUF, T, 2, rmsnorm_backward_v2_##SUF)                                           \
    RMSNORM_BACKWARD_KERNEL(SUF, T, 4, rmsnorm_backward_v4_##SUF)                                           \
    RMSNORM_BACKWARD_KERNEL(SUF, T, 8, rmsnorm_backward_v8_##SUF)                                           \
    extern "C" __global__ void __launch_bounds__(DW_WARPS * 32) rmsnorm_backward_dweight_##SUF(             \
        T* dweight, const float* scratch, int P, int C) {                                                   \
        rmsnorm_backward_dweight_impl<T>(dweight, scratch, P, C);                                           \
    }
RMSNORM_KERNELS(f32, float)
RMSNORM_KERNELS(bf16, bf16)
RMSNORM_KERNELS(f16, half)
