// The optimizers' stochastic rounding: a bf16 store adds 16 random bits from a counter-based hash of
// (seed, step, array, element index) below the mantissa and truncates. Included by adamw.cu,
// adamw8bit.cu and muon.cu, whose NumPy twins draw the same bits through cuengine.kernels.adamw.sr_bits.
#pragma once
#include "common.cuh"

typedef unsigned int u32;  // NVRTC has no <stdint.h>

// lowbias32 (C. Wellons' hash prospector): a strong 32-bit integer mixer.
__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// One key per (seed, step, array); `which` is 0 for param, 1 for m, 2 for v.
__device__ __forceinline__ u32 sr_key(u32 seed, u32 step, u32 which) {
    return mix32(mix32(seed + 0x9e3779b9u * (which + 1u)) ^ step);
}

__device__ __forceinline__ u32 sr_bits(u32 key, long long i) {
    return mix32(mix32(key ^ (u32)i) + (u32)((unsigned long long)i >> 32));
}

template <typename T> __device__ __forceinline__ T round_store(float x, u32 key, long long i);
template <> __device__ __forceinline__ float round_store<float>(float x, u32, long long) { return x; }
template <> __device__ __forceinline__ bf16 round_store<bf16>(float x, u32 key, long long i) {
    const u32 b = (__float_as_uint(x) + (sr_bits(key, i) & 0xffffu)) & 0xffff0000u;
    return isfinite(x) ? __ushort_as_bfloat16((unsigned short)(b >> 16)) : __float2bfloat16_rn(x);
}
