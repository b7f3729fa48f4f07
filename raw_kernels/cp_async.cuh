// cp.async, global -> shared, 16 bytes through L2 only (.cg), and its groups: the one definition that
// attention.cu, rmsnorm.cu and classifier.cu use. The host emulators (tests/attention_emulator.py,
// tests/kernel_emulator.py) replace this file with an empty one and define the same helpers, in which
// a copy lands only at its wait.
// No L2 cache-policy operand (`.L2::cache_hint` with a `createpolicy.fractional` policy): that form
// stopped with an illegal instruction on the H200 (compute-sanitizer, sixth session).
#pragma once

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// src_bytes < 16 zero-fills the rest of the destination (0: all of it)
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
