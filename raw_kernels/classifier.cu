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
//
// The 16-byte block kernels pipeline both passes and need cache_n >= min(V, blockDim.x * 16 / sizeof(T))
// (a 16-byte slot per thread). Pass 1 copies the cached head into shared memory with cp.async two
// groups of four vectors ahead of the math, and loads the rest (the tail) into registers a group
// ahead, with an L2 prefetch a group further. Pass 2 takes the cached head first and, as each slot
// frees, re-reads the tail into it with cp.async, its last vector (the last one pass 1 read, still
// in L2) first. Their results are bitwise those of the plain loop that the `_warp` and `_scalar`
// kernels keep, run with the same threads: each thread takes the same elements in the same groups
// of four vectors in pass 1 and the same per-element math in pass 2. Three steps are cheaper:
// exp2 is MUFU.EX2 alone (ex2.approx.ftz) where no argument of the group (pass 1) or of the
// thread's elements (pass 2) lies below -126, the one range where exp2f's extra steps (scaling
// into and out of the subnormal results that MUFU.EX2 flushes) change the result, and exp2f
// otherwise; p * zf - 1 (a fused multiply-add) is formed for the target's element only, every other
// element taking p * zf, the bits of the fused form with 0; and bf16 results are rounded two at a
// time (F2FP, round-to-nearest-even as the scalar F2F). The dlogits are stored evict-first.
#include "common.cuh"
#include "cp_async.cuh"

// helpers
// ---- PTX helpers -------------------------------------------------------------------------
// (tests/kernel_emulator.py compiles this file on the host with everything from here to the end
// of this section replaced by host stand-ins of the same helpers.)
// 16 bytes at a shared-memory address (as smem_u32 gives it).
__device__ __forceinline__ uint4 ld_shared16(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
// 2^x by MUFU.EX2 alone: results below 2^-126 flush to 0, where exp2f would return them.
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// Two bf16 in one word, low half first: max, min (a NaN lane yields to the other, as fmaxf/fminf
// do), and fp32 -> bf16x2 round-to-nearest-even in one F2FP (the scalar F2F takes one per element).
__device__ __forceinline__ unsigned bf16x2_max(unsigned a, unsigned b) {
    __nv_bfloat162 r = __hmax2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<unsigned*>(&r);
}
__device__ __forceinline__ unsigned bf16x2_min(unsigned a, unsigned b) {
    __nv_bfloat162 r = __hmin2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<unsigned*>(&r);
}
__device__ __forceinline__ unsigned bf16x2_pack(float lo, float hi) {
    __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&r);
}
// Per 16-bit half, the unsigned max.
__device__ __forceinline__ unsigned u16x2_max(unsigned a, unsigned b) { return __vmaxu2(a, b); }
// ---- end of PTX helpers ----

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

// ---- the pipelined block kernels: a 16-byte vector of T as four 32-bit words ----------------
template <bool FAST> __device__ __forceinline__ float exp2_of(float a) { return FAST ? ex2_ftz(a) : exp2f(a); }
__device__ __forceinline__ unsigned word(const uint4& v, int w) {
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Element k as float, the group's range, the stored words of P results, and the max |x| of the
// stored values as float bits (fabsf's, as the plain loop and fp8.cu's abs_max take it).
template <typename T> struct Lanes;
template <> struct Lanes<float> {
    static constexpr int P = 4;
    __device__ __forceinline__ static float get(const uint4& v, int k) { return __uint_as_float(word(v, k)); }
    __device__ __forceinline__ static void range(const uint4 (&v)[4], int nv, float& lo, float& hi) {
        hi = NEG_INF;
        lo = -NEG_INF;
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (u < nv)
#pragma unroll
                for (int k = 0; k < P; ++k) {
                    hi = fmaxf(hi, get(v[u], k));
                    lo = fminf(lo, get(v[u], k));
                }
    }
    __device__ __forceinline__ static uint4 pack(const float (&g)[P]) {
        return make_uint4(__float_as_uint(g[0]), __float_as_uint(g[1]), __float_as_uint(g[2]), __float_as_uint(g[3]));
    }
    __device__ __forceinline__ static unsigned amax(unsigned acc, const uint4& out) {
#pragma unroll
        for (int w = 0; w < 4; ++w) acc = max(acc, __float_as_uint(fabsf(__uint_as_float(word(out, w)))));
        return acc;
    }
    __device__ __forceinline__ static unsigned amax_bits(unsigned acc) { return acc; }
};
template <> struct Lanes<bf16> {  // element 2w is the low half of word w
    static constexpr int P = 8;
    __device__ __forceinline__ static float get(const uint4& v, int k) {
        const unsigned u = word(v, k / 2);
        return __uint_as_float(k % 2 ? u & 0xffff0000u : u << 16);
    }
    // Packed bf16 max/min over the words, then one fp32 max/min: the same values as fmaxf/fminf over
    // the elements (the conversion is exact and monotonic; NaN lanes yield in both), as far as
    // fmaxf(m, hi) and the exp arguments can tell (+0 and -0 may swap).
    __device__ __forceinline__ static void range(const uint4 (&v)[4], int nv, float& lo, float& hi) {
        unsigned mx = v[0].x, mn = v[0].x;
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (u < nv)
#pragma unroll
                for (int w = u == 0; w < 4; ++w) {
                    mx = bf16x2_max(mx, word(v[u], w));
                    mn = bf16x2_min(mn, word(v[u], w));
                }
        hi = fmaxf(__uint_as_float(mx << 16), __uint_as_float(mx & 0xffff0000u));  // NaN if all are: fmaxf(m, hi) = m
        lo = fminf(__uint_as_float(mn << 16), __uint_as_float(mn & 0xffff0000u));
    }
    __device__ __forceinline__ static uint4 pack(const float (&g)[P]) {
        return make_uint4(bf16x2_pack(g[0], g[1]), bf16x2_pack(g[2], g[3]), bf16x2_pack(g[4], g[5]),
                          bf16x2_pack(g[6], g[7]));
    }
    // acc holds two 16-bit maxima of |x|'s bits; a bf16's bits shifted left by 16 are its fp32 bits.
    __device__ __forceinline__ static unsigned amax(unsigned acc, const uint4& out) {
#pragma unroll
        for (int w = 0; w < 4; ++w) acc = u16x2_max(acc, word(out, w) & 0x7fff7fffu);
        return acc;
    }
    __device__ __forceinline__ static unsigned amax_bits(unsigned acc) {
        return __float_as_uint(fabsf(__uint_as_float(max(acc & 0xffffu, acc >> 16) << 16)));  // NaN: fabsf's NaN
    }
};

// acc + exp(x - mn) over the group's elements, in the plain loop's order.
template <typename T, bool FAST>
__device__ __forceinline__ float group_sum(float acc, const uint4 (&v)[4], int nv, float mn_l2) {
#pragma unroll
    for (int u = 0; u < 4; ++u)
        if (u < nv)
#pragma unroll
            for (int k = 0; k < Lanes<T>::P; ++k) acc += exp2_of<FAST>(fmaf(Lanes<T>::get(v[u], k), LOG2E, -mn_l2));
    return acc;
}

// One group of pass 1 (the plain loop's trip): fold the nv valid vectors of v into the running (m, s),
// and their minimum into xmin.
template <typename T>
__device__ __forceinline__ void online_group(const uint4 (&v)[4], int nv, float& m, float& s, float& xmin) {
    float lo, lm;
    Lanes<T>::range(v, nv, lo, lm);
    xmin = fminf(xmin, lo);
    const float mn = fmaxf(m, lm);
    if (mn == NEG_INF) return;  // only -inf so far: s stays 0
    const float mn_l2 = mn * LOG2E;
    const float acc = m == mn ? s : s * exp2f((m - mn) * LOG2E);
    // fma(x, log2e, c) is monotonic in x: the smallest element gives the smallest argument.
    s = !(fmaf(lo, LOG2E, -mn_l2) < -126.f) ? group_sum<T, true>(acc, v, nv, mn_l2)
                                             : group_sum<T, false>(acc, v, nv, mn_l2);
    m = mn;
}

// Pass 1 of one thread: its vectors j = 0..n-1 (elements tid*P + j*stride), the first c of them
// cached (slot j of the thread), in groups of 4 as the plain loop takes them.
template <typename T>
__device__ void pass1_pipelined(const T* x, uint4* cache, int tid, int nthreads, int n, int c,
                                float& m, float& s, float& xmin) {
    constexpr int P = Lanes<T>::P, U = 4;
    const unsigned vb = nthreads * 16;  // bytes from one of the thread's vectors to the next, in both memories
    const char* const src = reinterpret_cast<const char*>(x + tid * P);
    const unsigned dst = smem_u32(cache + tid);
    auto at = [&](int j) { return src + (size_t)(unsigned)j * vb; };
    auto issue = [&](int j0) {  // the cached vectors of the group from j0, as one commit group
        if (j0 < c) {
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u < c) cp_async16(dst + (j0 + u) * vb, at(j0 + u));
        }
        cp_async_commit();
    };
    // The group from j0 into cur (its tail vectors are there already); the next group's tail into nxt.
    auto step = [&](int j0, uint4(&cur)[U], uint4(&nxt)[U]) {
        cp_async_wait<1>();  // this group's copies have landed; the next group's may be in flight
        issue(j0 + 2 * U);
        if (j0 + U <= c) {
#pragma unroll
            for (int u = 0; u < U; ++u) cur[u] = ld_shared16(dst + (j0 + u) * vb);
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u < c) cur[u] = ld_shared16(dst + (j0 + u) * vb);
        }
        if (j0 + 2 * U > c && j0 + U < n) {  // the next group has tail vectors
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = j0 + U + u;
                if (c <= j && j < n) nxt[u] = *reinterpret_cast<const uint4*>(at(j));
            }
        }
        if (j0 + 3 * U > c && j0 + 2 * U < n) {  // so has the one after: into L2 now
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = j0 + 2 * U + u;
                if (c <= j && j < n) prefetch_l2(at(j));
            }
        }
        online_group<T>(cur, min(U, n - j0), m, s, xmin);
    };
    issue(0);
    issue(U);
    uint4 a[U], b[U];  // two groups' vectors, taking turns (no register moves)
#pragma unroll
    for (int u = 0; u < U; ++u) {
        a[u] = c <= u && u < n ? *reinterpret_cast<const uint4*>(at(u)) : make_uint4(0, 0, 0, 0);
        b[u] = make_uint4(0, 0, 0, 0);
    }
    for (int j0 = 0; j0 < n; j0 += 2 * U) {
        step(j0, a, b);
        if (j0 + U >= n) break;
        step(j0 + U, b, a);
    }
}

// dlogits of one vector at element i, from its logits v; max-accumulates the stored |dx| into acc.
template <typename T, bool FAST>
__device__ __forceinline__ uint4 grad_vec(const uint4& v, int i, int target, float lse_l2, float zf, float d_loss,
                                          unsigned& acc) {
    constexpr int P = Lanes<T>::P;
    float p[P], g[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
        p[k] = exp2_of<FAST>(fmaf(Lanes<T>::get(v, k), LOG2E, -lse_l2));
        g[k] = d_loss * (p[k] * zf);
    }
    if ((unsigned)target - (unsigned)i < (unsigned)P) {  // the target's one-hot term
#pragma unroll
        for (int k = 0; k < P; ++k)
            if (i + k == target) g[k] = d_loss * fmaf(p[k], zf, -1.f);
    }
    const uint4 out = Lanes<T>::pack(g);
    acc = Lanes<T>::amax(acc, out);
    return out;
}

// Pass 2 of one thread (row not ignored): the cached head from its slots, then the tail, re-read
// last vector first into the slots as they free (tail vector k, i.e. vector n-1-k, in slot k % c).
template <typename T, bool FAST>
__device__ void pass2_pipelined(T* x, uint4* cache, int tid, int nthreads, int n, int c, int target, float lse_l2,
                                float zf, float d_loss, unsigned& acc) {
    constexpr int P = Lanes<T>::P;
    const int stride = nthreads * P, tail = n - c;
    const unsigned vb = nthreads * 16;
    char* const xt = reinterpret_cast<char*>(x + tid * P);
    const unsigned dst = smem_u32(cache + tid);
    auto at = [&](int j) { return xt + (size_t)(unsigned)j * vb; };
    // One commit group per vector done, so that tail vector k is always group k of this pass.
    auto fetch = [&](int k, int q) {
        if (k < tail) cp_async16(dst + q * vb, at(n - 1 - k));
        cp_async_commit();
    };
    auto step = [&](int j, int q) {
        const uint4 out = grad_vec<T, FAST>(ld_shared16(dst + q * vb), tid * P + j * stride, target, lse_l2, zf,
                                            d_loss, acc);
        __stcs(reinterpret_cast<uint4*>(at(j)), out);
    };
    for (int q = 0; q < c; ++q) {
        step(q, q);
        fetch(q, q);  // after the slot is read (its value is used by then)
    }
    for (int k = 0, q = 0; k < tail; ++k) {
        if (c > 7) cp_async_wait<7>();  // tail k was committed c groups ago
        else cp_async_wait<0>();
        step(n - 1 - k, q);
        fetch(k + c, q);
        q = q + 1 == c ? 0 : q + 1;
    }
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
    const int stride = nthreads * P;
    // The 16-byte block kernels pipeline both passes (cache_n >= min(V, stride): a slot per thread).
    constexpr bool PIPE = !WARP && sizeof(T) * P == 16;
    // This thread's vectors, and how many of them are cached (pipelined passes).
    const int n_vec = tid * P < V ? (V - tid * P + stride - 1) / stride : 0;
    const int n_cached = tid * P < cache_n ? (cache_n - tid * P + stride - 1) / stride : 0;
    float xmin = -NEG_INF;  // the smallest element of the thread (pipelined passes)

    // Pass 1: per-thread online max and sum, U accesses in flight per thread. exp(x - m) is taken
    // as exp2(x log2(e) - m log2(e)): one FFMA and one MUFU.EX2 per element.
    float m = NEG_INF, s = 0.f;
    if constexpr (PIPE) {
        pass1_pipelined<T>(x, reinterpret_cast<uint4*>(s_cache_bytes), tid, nthreads, n_vec, n_cached, m, s,
                           xmin);
    } else {
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
    // plain loop walks the row backwards, so the first global reads hit what pass 1 read last
    // (still in L2); the pipelined one re-reads the tail from its last vector on.
    const float zf = 1.f + 2.f * z_loss * lse, lse_l2 = lse * LOG2E;
    if (d_loss_dev) d_loss = *d_loss_dev;
    const bool ignored = target == -1;
    unsigned amax_bits = 0;  // max |dx| of the stored values, as float bits (fp8.cu's abs_max: fabsf, -ftz)
    if constexpr (PIPE) {
        unsigned acc = 0;
        if (ignored) {
            for (int j = 0; j < n_vec; ++j)
                __stcs(reinterpret_cast<uint4*>(x + tid * P + j * stride), make_uint4(0, 0, 0, 0));
        } else if (!(fmaf(xmin, LOG2E, -lse_l2) < -126.f)) {  // no argument below -126: MUFU.EX2 alone
            pass2_pipelined<T, true>(x, reinterpret_cast<uint4*>(s_cache_bytes), tid, nthreads, n_vec, n_cached,
                                     target, lse_l2, zf, d_loss, acc);
        } else {
            pass2_pipelined<T, false>(x, reinterpret_cast<uint4*>(s_cache_bytes), tid, nthreads, n_vec, n_cached,
                                      target, lse_l2, zf, d_loss, acc);
        }
        amax_bits = Lanes<T>::amax_bits(acc);
    } else {
        const int chunk = stride * U;
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
        grid_dependency_wait();                                                                               \
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
