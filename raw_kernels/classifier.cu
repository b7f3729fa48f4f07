// Fused classifier: softmax cross-entropy forward and the first step of its backward, in one
// pass over one LM-head chunk of logits (N, V).
//
// Per row (token) with target t:
//   lse    = log(sum_j exp(x_j))                       written (=) to lse[row]
//   loss   = lse - x_t + z_loss * lse^2                accumulated (+=) into losses[row]
//   dx_j   = d_loss * (softmax_j * (1 + 2 z_loss lse) - [j == t])   written over x (in place)
// d_loss is read from device memory when `d_loss_dev` is not null (a captured graph then serves
// batches with different numbers of valid targets), else it is the scalar argument.
// With `amax` (not null, and only with write_dlogits) the kernel also max-accumulates |dx| of the
// stored dlogits into that fp32 slot (zero it first), as fp8.cu's abs_max would over the written
// buffer: the FP8 LM head's E5M2 quantize needs it, and this saves a read of the (N, V) logits.
// t == -1 ignores the row: losses[row] is left as is and its gradient row is zero. A target
// outside [-1, V) cannot raise from the device, so it adds NaN to losses[row] (and its gradient
// has no one-hot term); the trainer's non-finite loss check reports it.
//
// Invariants: one block (or one warp, `_warp` kernels) per row; the max/sum are kept online in
// fp32 (one read of the row for the forward, one more read plus one write for the backward); the
// target logit is read before the first block (or warp) barrier, so the in-place backward cannot
// overwrite it first. exp is evaluated as exp2 of a prescaled argument (MUFU.EX2, about 2 ulp):
// close to, not bitwise equal to, the fp32 twin. `cache_n` leading elements of the row (a
// multiple of the vector width, at most V, 0 in the `_warp` kernels) are kept in dynamic shared
// memory between the two passes. Rows whose length or start are not 16-byte aligned take the
// `_scalar` kernels.
#include "common.cuh"

// kernels

// `P` elements of T loaded or stored as one aligned access (16 bytes when vectorised).
template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no <math.h> INFINITY
constexpr float LOG2E = 1.44269504088896341f;

// Merge (m2, s2) into the running (m, s), where s = sum exp(x - m). An empty partner has
// m2 = -inf and s2 = 0; two empty ones stay empty instead of producing exp(-inf + inf) = NaN.
__device__ __forceinline__ void online_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == NEG_INF) return;
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

template <typename T, int P, int U, bool WARP>
__device__ void fused_classifier_impl(T* logits, float* losses, float* lse_out, float* amax, const int* targets,
                                      float d_loss,
                                      const float* d_loss_dev, float z_loss, int write_dlogits, int N, int V,
                                      int cache_n) {
    extern __shared__ __align__(16) unsigned char s_cache_bytes[];  // the row's first cache_n elements
    __shared__ float sh_m[32], sh_s[32];
    Vec<T, P>* cache = reinterpret_cast<Vec<T, P>*>(s_cache_bytes);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row = WARP ? blockIdx.x * (blockDim.x / 32) + warp : blockIdx.x;
    if (WARP && row >= N) return;  // warp mode has no block-wide barrier
    const int tid = WARP ? lane : threadIdx.x, nthreads = WARP ? 32 : blockDim.x;
    if (WARP) cache_n = 0;  // the warps of a block would share it
    T* x = logits + (size_t)row * V;
    const int target = targets[row];
    const bool valid = target >= 0 && target < V;
    // Read before the reduction's barrier: the backward below overwrites the row.
    const float x_target = (tid == 0 && valid) ? to_float(x[target]) : 0.f;

    // Pass 1: per-thread online max and sum, U accesses in flight per thread. exp(x - m) is taken
    // as exp2(x log2(e) - m log2(e)): one FFMA and one MUFU.EX2 per element.
    float m = NEG_INF, s = 0.f;
    const int stride = nthreads * P;
    for (int base = tid * P; base < V; base += stride * U) {
        Vec<T, P> pk[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * stride;
            if (i < V) pk[u] = *reinterpret_cast<const Vec<T, P>*>(x + i);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * stride;
            if (i < cache_n) cache[i / P] = pk[u];  // cache_n <= V
        }
        float lm = NEG_INF;
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + u * stride < V)
#pragma unroll
                for (int k = 0; k < P; ++k) lm = fmaxf(lm, to_float(pk[u].v[k]));
        const float mn = fmaxf(m, lm);
        if (mn == NEG_INF) continue;  // only -inf so far: s stays 0
        const float mn_l2 = mn * LOG2E;
        float acc = m == mn ? s : s * exp2f((m - mn) * LOG2E);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + u * stride < V)
#pragma unroll
                for (int k = 0; k < P; ++k) acc += exp2f(fmaf(to_float(pk[u].v[k]), LOG2E, -mn_l2));
        s = acc;
        m = mn;
    }
    // Warp, then block: every thread ends with the same (m, s) (the merge is commutative).
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        online_merge(m, s, m2, s2);
    }
    if (WARP) {
        __syncwarp();  // orders lane 0's read of the target logit before any lane's write below
    } else {
        const int warps = blockDim.x / 32;
        if (lane == 0) {
            sh_m[warp] = m;
            sh_s[warp] = s;
        }
        __syncthreads();
        m = lane < warps ? sh_m[lane] : NEG_INF;
        s = lane < warps ? sh_s[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            online_merge(m, s, m2, s2);
        }
    }
    const float lse = m + logf(s);

    if (tid == 0) {
        lse_out[row] = lse;
        if (valid) losses[row] += lse - x_target + z_loss * lse * lse;
        else if (target != -1) losses[row] += __int_as_float(0x7fc00000);  // NaN: bad target id
    }
    if (!write_dlogits) return;

    // Pass 2: dlogits over logits. Each thread rewrites exactly the elements it reads, and reads
    // back from the shared-memory cache only what it wrote there itself (no barrier needed). The
    // row is walked backwards, so the first global reads hit what pass 1 read last (still in L2).
    const float zf = 1.f + 2.f * z_loss * lse, lse_l2 = lse * LOG2E;
    if (d_loss_dev) d_loss = *d_loss_dev;
    const bool ignored = target == -1;
    const int chunk = stride * U;
    unsigned amax_bits = 0;  // max |dx| of the stored values, as float bits (fp8.cu's abs_max: fabsf, -ftz)
    for (int c = (V - 1) / chunk; c >= 0; --c) {
        const int base = c * chunk + tid * P;
        Vec<T, P> pk[U];
        if (!ignored) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = base + u * stride;
                if (i < cache_n) pk[u] = cache[i / P];
                else if (i < V) pk[u] = *reinterpret_cast<const Vec<T, P>*>(x + i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * stride;
            if (i >= V) break;
            Vec<T, P> out;
#pragma unroll
            for (int k = 0; k < P; ++k) {
                float g = 0.f;
                if (!ignored) {
                    const float p = exp2f(fmaf(to_float(pk[u].v[k]), LOG2E, -lse_l2));
                    g = d_loss * (p * zf - (i + k == target ? 1.f : 0.f));
                }
                out.v[k] = from_float<T>(g);
                amax_bits = max(amax_bits, __float_as_uint(fabsf(to_float(out.v[k]))));
            }
            *reinterpret_cast<Vec<T, P>*>(x + i) = out;
        }
    }
    if (!amax) return;
    if (WARP) {  // the warp's lanes only: other warps of the block may have returned (row >= N)
        amax_bits = __reduce_max_sync(0xffffffffu, amax_bits);
        if (lane == 0 && amax_bits) atomicMax(reinterpret_cast<unsigned*>(amax), amax_bits);
    } else {
        block_atomic_abs_max(amax, amax_bits);
    }
}

// Block per row: 1024 threads, four 16-byte loads in flight per thread (64 KB per SM with one
// block resident), and the row's head cached in dynamic shared memory for the backward so that
// what pass 2 re-reads from global memory stays small enough to hit L2. Warp per row (`_warp`,
// 8 rows per 256-thread block) for short rows, where a block per row would leave most threads idle;
// there one access per trip keeps the registers at 32, so that 64 rows are in flight per SM.
#define CLASSIFIER_KERNEL(NAME, T, THREADS, P, UNROLL, WARP)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        NAME(T* logits, float* losses, float* lse, float* amax, const int* targets, float d_loss,             \
             const float* d_loss_dev, float z_loss, int write_dlogits, int N, int V, int cache_n) {           \
        fused_classifier_impl<T, P, UNROLL, WARP>(logits, losses, lse, amax, targets, d_loss, d_loss_dev,     \
                                                  z_loss, write_dlogits, N, V, cache_n);                      \
    }
#define CLASSIFIER_KERNELS(SUF, T)                                                                            \
    CLASSIFIER_KERNEL(fused_classifier_##SUF, T, 1024, 16 / sizeof(T), 4, false)                              \
    CLASSIFIER_KERNEL(fused_classifier_##SUF##_scalar, T, 1024, 1, 4, false)                                  \
    CLASSIFIER_KERNEL(fused_classifier_##SUF##_warp, T, 256, 16 / sizeof(T), 1, true)                         \
    CLASSIFIER_KERNEL(fused_classifier_##SUF##_scalar_warp, T, 256, 1, 2, true)

CLASSIFIER_KERNELS(f32, float)
CLASSIFIER_KERNELS(bf16, bf16)

// launchers: cuengine/kernels/classifier.py (fused_classifier)
