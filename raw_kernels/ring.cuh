// A shared-memory ring of weight stages, filled by the async copy engines and counted by an mbarrier per
// stage (sm_90): decode_layers.cu (the persistent decode step) and decode_mlp.cu share these helpers.
// tests/test_decode_mlp.py runs decode_mlp.cu on the host with a stand-in for this file.
#pragma once

__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Each stage's mbarrier expects `count` arrivals a phase (a fill).
__device__ __forceinline__ void ring_init(unsigned long long* full, int stages, unsigned count) {
    for (int s = 0; s < stages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(full + s)), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// An arrival on `full` that also expects `bytes` of bulk copies before the phase completes.
__device__ __forceinline__ void ring_expect(unsigned long long* full, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(full)), "r"(bytes)
                 : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared, counted on `full`
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* full) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(dst)),
                 "l"(src), "r"(bytes), "r"(smem_address(full))
                 : "memory");
}

// 16 bytes global -> shared by this thread (cp.async), counted by its next ring_arrive.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

// This thread's arrival on `full`, once its cp.async copies so far have landed (one of the expected count).
__device__ __forceinline__ void ring_arrive(unsigned long long* full) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(full)) : "memory");
}

// Until the stage's `parity`-th fill (mod 2) has landed.
__device__ __forceinline__ void stage_wait(unsigned long long* full, unsigned parity) {
    asm volatile(
        "{\n\t.reg .pred ready;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n\t"
        "@!ready bra WAIT;\n}" ::"r"(smem_address(full)),
        "r"(parity)
        : "memory");
}
