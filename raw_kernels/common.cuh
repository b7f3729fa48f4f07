// Shared device helpers for every kernel family: typed load/store through float,
// 16-byte vector access, warp and block reductions, and FP8 SATFINITE conversion.
// Conventions (all families): outputs first, then inputs, then sizes; parameter
// gradients accumulate (+=), activation gradients are written (=).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef __nv_fp8_e4m3 fp8e4;
typedef __nv_fp8_e5m2 fp8e5;

// ---- scalar conversions (round-to-nearest-even, as ml_dtypes does) -------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(fp8e4 x) { return float(x); }
__device__ __forceinline__ float to_float(fp8e5 x) { return float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }
// SATFINITE: out-of-range values clamp to +-max (448 for E4M3, 57344 for E5M2); NaN stays NaN.
template <> __device__ __forceinline__ fp8e4 from_float<fp8e4>(float x) {
    fp8e4 r; r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); return r;
}
template <> __device__ __forceinline__ fp8e5 from_float<fp8e5>(float x) {
    fp8e5 r; r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); return r;
}

// FP8 stats slot layout (cuengine.tensor.STATS_SLOTS): each field in its own 16-byte lane, because
// cuBLASLt rejects scale pointers that are not 16-byte aligned.
#define STAT_ABS_MAX 0
#define STAT_SCALE 4
#define STAT_SCALE_INV 8

template <typename T> struct fp8_limits { static constexpr float max = 0.f; };
template <> struct fp8_limits<fp8e4> { static constexpr float max = 448.f; };
template <> struct fp8_limits<fp8e5> { static constexpr float max = 57344.f; };

// The per-tensor scale of an FP8 copy from its abs-max: fp8_max / amax, 1 when amax is 0 or not finite
// (cuengine.tensor.stats_values).
__device__ __forceinline__ float fp8_scale(float amax, float fp8_max) {
    return (amax > 0.f && isfinite(amax)) ? fp8_max / amax : 1.f;
}

// ---- 16-byte vectors -------------------------------------------------------------------
// Pack16<T> holds 16 bytes of T; use it for coalesced 128-bit loads and stores.
template <typename T> struct alignas(16) Pack16 {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
    __device__ __forceinline__ static Pack16 load(const T* p) { return *reinterpret_cast<const Pack16*>(p); }
    __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<Pack16*>(p) = *this; }
};

// A value another block may have written earlier in the same launch (a persistent kernel's earlier
// phase): read through L2 only, since L1 is not coherent across SMs.
__device__ __forceinline__ float load_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ bf16 load_cg(const bf16* p) {
    return __ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(p)));
}

// ---- reductions ------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats. Deterministic
// for a fixed block size: the reduction tree does not depend on timing.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(x);
}

__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// max over the block of each thread's |x| bits, then one atomicMax. Non-negative floats (NaN above inf)
// order like their bit patterns, so the integer max is exact and order-independent.
__device__ __forceinline__ void block_atomic_abs_max(float* dst, unsigned bits) {
    __shared__ unsigned s_bits[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (lane == 0) s_bits[warp] = bits;
    __syncthreads();
    if (warp == 0) {
        bits = lane < (int)(blockDim.x + 31) / 32 ? s_bits[lane] : 0u;
        bits = __reduce_max_sync(0xffffffffu, bits);
        if (lane == 0 && bits) atomicMax(reinterpret_cast<unsigned*>(dst), bits);
    }
}

// Barrier `id` (1..15; 0 is __syncthreads) over the first `threads` threads that reach it: lets part
// of a block synchronise without the rest.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- programmatic dependent launch (kernels/_build.py: launch(..., dependent=True)) -------------
// A kernel launched as a dependent may start while its predecessor on the stream still runs: it must
// call grid_dependency_wait() before it reads anything an earlier kernel wrote or writes anything an
// earlier kernel reads. launch_dependents() lets the next dependent kernel start its own prologue.
// Both are no-ops in an ordinary launch, and left out below sm_90.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
