// sum(x^2) of one tensor's slice for block `block` of a grid of `nblocks`, in one fixed order: the
// per-tensor global norm (norm.cu) and the multi-tensor one (adamw.cu) share it, so their partial
// sums are the same bits. Each thread strides over 16-byte packs (VEC) or elements; the tail (fewer
// than one pack) goes to the first threads of the grid; then block_sum.
#pragma once
#include "common.cuh"

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};

template <typename T, bool VEC> __device__ float norm_squared_part(const T* x, long long n, long long block,
                                                                   long long nblocks) {
    __shared__ float scratch[32];
    constexpr int P = VEC ? 16 / sizeof(T) : 1;
    const long long tid = block * blockDim.x + threadIdx.x;
    const long long nthreads = nblocks * blockDim.x;
    const long long packs = n / P;
    float acc = 0.f;
#pragma unroll 4
    for (long long p = tid; p < packs; p += nthreads) {
        const Vec<T, P> w = *reinterpret_cast<const Vec<T, P>*>(x + p * P);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            const float v = to_float(w.v[k]);
            acc += v * v;
        }
    }
    const long long i = packs * P + tid;
    if (i < n) {
        const float v = to_float(x[i]);
        acc += v * v;
    }
    return block_sum(acc, scratch);
}
