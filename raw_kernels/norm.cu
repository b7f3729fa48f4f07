// Global gradient norm, deterministic and entirely on the device.
//
// global_norm_squared adds sum(x^2) of one tensor into a buffer of fp32 partial sums: block b
// adds its sum into slot b with a plain read-modify-write. Launches on one stream are ordered,
// so no atomics are needed, and since the grid depends only on the tensor's size and each block
// sums in a fixed order, the result is bitwise reproducible. The caller zeroes the partials once
// per step. global_norm_finish sums the slots in a fixed order (one block) and writes
// [norm, clip_scale]; a NaN or inf norm stays in result[0] for the host to see, and makes the
// clip scale NaN, which adamw reads as "skip this step".
// The `_scalar` kernels take tensors whose start is not 16-byte aligned.
#include "norm_squared.cuh"

// kernels

template <typename T, bool VEC> __device__ void norm_squared_impl(float* partials, const T* x, long long n) {
    const float acc = norm_squared_part<T, VEC>(x, n, blockIdx.x, gridDim.x);
    if (threadIdx.x == 0) partials[blockIdx.x] += acc;
}

__device__ void norm_finish_impl(float* result, const float* partials, int slots, float max_norm) {
    __shared__ float scratch[32];
    float acc = 0.f;
    for (int i = threadIdx.x; i < slots; i += blockDim.x) acc += partials[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const float norm = sqrtf(acc);
        result[0] = norm;
        const float clip = (max_norm > 0.f && norm > max_norm) ? max_norm / norm : 1.f;
        result[1] = isfinite(norm) ? clip : __int_as_float(0x7fc00000);  // NaN: skip the update
    }
}

#define NORM_KERNELS(SUF, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        global_norm_squared_##SUF(float* partials, const T* x, long long n) {                                 \
        norm_squared_impl<T, true>(partials, x, n);                                                           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        global_norm_squared_##SUF##_scalar(float* partials, const T* x, long long n) {                        \
        norm_squared_impl<T, false>(partials, x, n);                                                          \
    }
NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, bf16)

extern "C" __global__ void __launch_bounds__(1024)
    global_norm_finish(float* result, const float* partials, int slots, float max_norm) {
    norm_finish_impl(result, partials, slots, max_norm);
}

// launchers: cuengine/kernels/norm.py (global_norm_squared, global_norm_finish)
