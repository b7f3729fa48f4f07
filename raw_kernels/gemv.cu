// Decode GEMV for b = 1..64 rows: plain, dual (gate + up) and per-row E4M3 weight quantisation.
//
//   gemv:          out[m, n] = r(residual[m, n] + r(r(s[n] * sum_k xin[m, k] * W[n, k]) + bias[n]))  (=)
//                  s = w_scale for E4M3 weights (W8A16), else 1; bias and residual optional
//   gemv_dual:     the same over the packed (2H, K) [gate | up] weight, out (b, 2H) = [gate | up]   (=)
//                  or, dual = DUAL_SWIGLU, out (b, H) = r(silu(gate) * up) of those rounded values, as
//                  activations.cu's swiglu_forward computes it (SiLU·mul in the epilogue)           (=)
//   quantize_rows: w_scale[n] = max_k |w[n, k]| / 448 (1 for an all-zero row);
//                  w8[n, k] = e4m3(w[n, k] / w_scale[n]), clamped to +-448, round-to-nearest-even   (=)
// r() rounds to out's dtype O (the model dtype T, or fp32 for logits). xin is x, or the RMSNorm
// prologue r_T(x * rstd * norm_weight) with rstd = 1 / sqrt(mean(x^2) + eps) summed exactly as
// rmsnorm.cu sums it (one warp per row, lane-strided 16-byte vectors, warp_sum), there over
// x' = r_T(x + r_T(y)) when x_acc gives the fixed-point accumulator y that x misses (gemv.cuh; block 0
// then writes x' to x_out, when given: the residual the layer after reads), or the SwiGLU
// prologue r_T(silu(gate) * up) over x = [gate | up], computed as activations.cu computes it. The
// input is staged in shared memory BT rows at a time: in fp32 for BT = 1, else in T.
//
// Work layout: a tile of WARPS / S groups of R weight rows is one block's work at a time; the grid is
// one resident wave (two for a single row with many tiles a block: gemv._grid) and blocks take tiles
// round-robin, so with b <= BT a block stages (and normalises) its input once for all its tiles. The S
// warps of a group each reduce one K-slice: lanes stride over 16-byte weight vectors, U per row in
// flight, fp32 accumulators for R rows x BT input rows, then a warp shuffle sum and, for S > 1, an
// ordered sum of the S partials through shared memory. Every sum has a fixed order that depends only on
// (N, K, S), never on timing, on the grid or on b, so results are deterministic and batch-invariant;
// no float atomics.
// gemv_dual pairs gate row j with up row j in one warp. b > BT runs ceil(b / BT) passes over each
// tile's weight rows (re-read from L2). E4M3 weights are widened exactly, two at a time through
// half (quantize_rows of a NaN row also writes a NaN scale, so the output is NaN).
// Ready for programmatic dependent launch: only weights (the norm weight among them, staged into shared
// memory with prologue PRO_NORM_STAGED) are read before griddepcontrol.wait.
// K: a multiple of one 16-byte weight vector (8 bf16, 4 fp32, 16 e4m3 elements).
#include "gemv.cuh"

// One warp per row. The abs-max is an integer max of |value| bits, so a NaN (above inf) wins.
template <typename T>
__device__ void quantize_rows_impl(fp8e4* w8, float* w_scale, const T* w, int N, int K) {
    const int lane = threadIdx.x % 32;
    for (int n = blockIdx.x * WARPS + threadIdx.x / 32; n < N; n += gridDim.x * WARPS) {
        const T* row = w + (size_t)n * K;
        unsigned bits = 0;
        for (int k = lane; k < K; k += 32) bits = max(bits, abs_bits(to_float(row[k])));
        const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, bits));
        const float scale = amax == 0.f ? 1.f : amax / 448.f;
        if (lane == 0) w_scale[n] = scale;
        for (int k = lane; k < K; k += 32) w8[(size_t)n * K + k] = from_float<fp8e4>(to_float(row[k]) / scale);
    }
}


// ---- launchers ----------------------------------------------------------------------------
// gemv_<T>_<W>_<O>_<BT>: model dtype T, weight dtype W, out dtype O, BT input rows per pass, R = 2 weight
// rows per warp with U = 4 vectors a row in flight; gemv_<T>_e4m3_<O>_1_r4: BT = 1 with R = 4 and U = 1, so
// that a wide single-row GEMV over E4M3 weights has half the tiles (gemv.py's _rows says when). The
// single-row kernels stage their input as fp32 (XS), the multi-row ones, whose rows must fit, in T.

// Single-row kernels stay within 80 registers so that three blocks fit an SM: a decode-sized GEMV is about
// one wave of blocks, each a round trip or two to HBM, and more resident warps keep more bytes in flight
// (at 64 registers ptxas spills in the main loop).
#define GEMV_KERNEL(NAME, T, XS, W, O, BT, R, U, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) NAME(                                \
        O* out, const T* x, const W* w, const float* w_scale, const T* bias, const O* residual,               \
        const T* norm_weight, const long long* x_acc, T* x_out, float eps, int prologue, int dual, int b,     \
        int K, int N, int S) {                                                                                \
        gemv_impl<T, XS, W, O, BT, R, U>(out, x, w, w_scale, bias, residual, norm_weight, x_acc, x_out, eps,   \
                                         prologue, dual, b, K, N, S, blockIdx.x, gridDim.x,                   \
                                         [] { grid_dependency_wait(); });                                     \
    }
#define GEMV_KERNELS(SUF, T, W, O)                         \
    GEMV_KERNEL(gemv_##SUF##_1, T, float, W, O, 1, 2, 4, 3) \
    GEMV_KERNEL(gemv_##SUF##_4, T, T, W, O, 4, 2, 4, 2)     \
    GEMV_KERNEL(gemv_##SUF##_8, T, T, W, O, 8, 2, 4, 2)
#define GEMV_WIDE_KERNEL(SUF, T, O) GEMV_KERNEL(gemv_##SUF##_1_r4, T, float, fp8e4, O, 1, 4, 1, 3)
GEMV_KERNELS(bf16_bf16_bf16, bf16, bf16, bf16)
GEMV_KERNELS(bf16_bf16_f32, bf16, bf16, float)
GEMV_KERNELS(bf16_e4m3_bf16, bf16, fp8e4, bf16)
GEMV_KERNELS(bf16_e4m3_f32, bf16, fp8e4, float)
GEMV_KERNELS(f32_f32_f32, float, float, float)
GEMV_KERNELS(f32_e4m3_f32, float, fp8e4, float)
GEMV_WIDE_KERNEL(bf16_e4m3_bf16, bf16, bf16)
GEMV_WIDE_KERNEL(bf16_e4m3_f32, bf16, float)
GEMV_WIDE_KERNEL(f32_e4m3_f32, float, float)

#define QUANTIZE_KERNEL(SUF, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                 \
        quantize_rows_##SUF(fp8e4* w8, float* w_scale, const T* w, int N, int K) {                           \
        quantize_rows_impl<T>(w8, w_scale, w, N, K);                                                         \
    }
QUANTIZE_KERNEL(bf16, bf16)
QUANTIZE_KERNEL(f32, float)
