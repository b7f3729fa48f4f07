// On-device token sampling from logits rows: nb blocks of 1024 threads per row, the row re-read from L2
// per pass.
//
//   tokens[r] = argmax_j logits[r, j]                          temperature 0 (lowest index on ties)   (=)
//   tokens[r] = argmax_{j allowed} (x_j / T - log E_j)         otherwise (Gumbel-max)                  (=)
//       E_j = -log1p(-w_j), w_j = min((float(h_j) + 0.5) 2^-32, 1 - 2^-24), h_j = mix32(key ^ mix32(j)),
//       key = hash of (seed, row, step): an exact draw from softmax(x / T) over the allowed tokens
//       (E_j ~ Exp(1), so -log E_j is Gumbel), reproducible by the NumPy twin bit for bit.
//   allowed = { j : x_j >= tau },  tau = max(k-th largest x (top_k > 0), the top-p threshold): the
//       largest value whose mass sum_{x >= tau} p reaches top_p of the top-k set's mass. Ties at a
//       threshold are all kept.
//   params (int32[8 + 2 * MAX_SLOTS]): [0] temperature (float bits), [1] top_k, [2] top_p (float bits),
//       [3..4] seed (low, high), [5] step, [6] ticket, [8 + 2r..] row r's 64-bit merge slot (zero between
//       launches). The last block to finish (an atomic ticket) advances step and resets the ticket, so a
//       replayed graph draws new numbers each step with no host write.
// Greedy and unfiltered draws split each row over nb blocks (nb > 1 only for b <= MAX_SLOTS rows): each
// block's best (value, index) goes into the row's slot by one 64-bit atomicMax of (ordered value key,
// ~index), which keeps the larger value and the lower index on ties, and the last block moves the slots
// into tokens and zeroes them. With top-k or top-p, block 0 of the row does the whole row alone.
// Thresholds without a sort: a pass for the max M, a pass that bins every token by its gap
// g = (M - x) / T (2048 bins of 1/64 over g < 32, counts and masses exp(-g)), a prefix scan to find the
// bin holding the threshold, then a pass that gathers that bin's tokens (usually a few) into shared
// memory where the exact threshold is found among them. A gathered bin that overflows shared memory
// (thousands of near-equal logits) falls back to bisection over the keys, one pass per bit.
// Tokens with g >= 26 can never win the Gumbel argmax (-log E_j lies in [-2.81, 22.9]), so a threshold
// beyond the binned range is treated as "keep all": it would only drop tokens that cannot be drawn.
#include "common.cuh"

#define THREADS 1024
#define NBINS 2048  // 2 per thread in the scans
#define BIN_SCALE 64.f
#define GAP_MAX 32.f
#define CAP 2048  // gathered tokens of one bin
#define PARAM_STEP 5
#define PARAM_TICKET 6
#define PARAM_SLOTS 8  // MAX_SLOTS 64-bit slots from here (sampling.py: MAX_SLOTS)
#define MAX_SLOTS 64

// ---- helpers ------------------------------------------------------------------------------

__device__ __forceinline__ unsigned mix32(unsigned x) {  // lowbias32 (C. Wellons); sampling.py: _mix32
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ unsigned row_key(unsigned seed_lo, unsigned seed_hi, unsigned row, unsigned step) {
    return mix32(mix32(mix32(mix32(seed_lo + 0x9e3779b9u) ^ seed_hi) ^ row) ^ step);
}

// -log(E_j), E_j ~ Exp(1), with _rn intrinsics so no contraction departs from the twin's roundings.
__device__ __forceinline__ float neg_log_exp(unsigned key, int j) {
    const unsigned h = mix32(key ^ mix32((unsigned)j));
    const float w = fminf(__fmul_rn(__fadd_rn(__uint2float_rn(h), 0.5f), 2.3283064365386963e-10f), 0.99999994f);
    return -logf(-log1pf(-w));
}

// Floats ordered as unsigned keys (-0 folded onto +0, so equal values have equal keys).
__device__ __forceinline__ unsigned order_key(float x) {
    unsigned u = __float_as_uint(x);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// fn(j, x) for every element j in [begin, end) of the row: 16-byte loads when the row allows them
// (begin is then a multiple of the vector width).
template <typename T, typename Fn>
__device__ __forceinline__ void for_range(const T* row, int begin, int end, bool vec, Fn fn) {
    constexpr int VN = Pack16<T>::N;
    if (vec) {
        for (int jv = begin / VN + threadIdx.x; jv < end / VN; jv += blockDim.x) {
            const Pack16<T> p = Pack16<T>::load(row + (size_t)jv * VN);
#pragma unroll
            for (int k = 0; k < VN; ++k) fn(jv * VN + k, to_float(p.v[k]));
        }
    } else {
        for (int j = begin + threadIdx.x; j < end; j += blockDim.x) fn(j, to_float(row[j]));
    }
}

template <typename T, typename Fn> __device__ __forceinline__ void for_each(const T* row, int V, bool vec, Fn fn) {
    for_range(row, 0, V, vec, fn);
}

// Block argmax of (value, index): the larger value, the lower index on ties; every thread gets it.
__device__ __forceinline__ void block_argmax(float& v, int& j, float* sv, int* sj) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oj = __shfl_xor_sync(0xffffffffu, j, o);
        if (ov > v || (ov == v && oj < j)) v = ov, j = oj;
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) sv[threadIdx.x / 32] = v, sj[threadIdx.x / 32] = j;
    __syncthreads();
    v = sv[0], j = sj[0];
    for (int w = 1; w < THREADS / 32; ++w)
        if (sv[w] > v || (sv[w] == v && sj[w] < j)) v = sv[w], j = sj[w];
}

__device__ __forceinline__ unsigned block_max_u(unsigned x, unsigned* s) {
    x = __reduce_max_sync(0xffffffffu, x);
    __syncthreads();
    if (threadIdx.x % 32 == 0) s[threadIdx.x / 32] = x;
    __syncthreads();
    for (int w = 0; w < THREADS / 32; ++w) x = max(x, s[w]);
    return x;
}

struct Smem {
    float cnt[NBINS], mass[NBINS];  // per-bin token count and mass exp(-g)
    unsigned key[CAP];              // the gathered bin
    float w[CAP];
    float red[32];
    int redi[32];
    unsigned redu[32];
    float scan[32];
    int n, bin;
    float above;
    unsigned kmin, kmax;
};

// The smallest bin b with sum_{b' <= b} h[b'] >= target, or -1 if none; s.above = sum_{b' < b} h[b'].
// Bins 2t and 2t + 1 belong to thread t; a block-wide inclusive scan in a fixed order.
__device__ int find_bin(const float* h, float target, Smem& s) {
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const float h0 = h[2 * t], h1 = h[2 * t + 1];
    float x = h0 + h1;
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    const float prev = __shfl_up_sync(0xffffffffu, x, 1);
    if (t == 0) s.bin = NBINS;
    if (lane == 31) s.scan[warp] = x;
    __syncthreads();
    float excl = 0.f;  // sum of earlier warps in warp order, then of the earlier lanes
    for (int w = 0; w < warp; ++w) excl += s.scan[w];
    if (lane > 0) excl += prev;
    const float c0 = excl + h0, c1 = c0 + h1;
    const int mine = c0 >= target ? 2 * t : (c1 >= target ? 2 * t + 1 : NBINS);
    atomicMin(&s.bin, mine);
    __syncthreads();
    const int b = s.bin;
    if (b < NBINS && (b >> 1) == t) s.above = b == 2 * t ? excl : c0;
    __syncthreads();
    return b < NBINS ? b : -1;
}

// The bin of x by its gap to the max, NBINS when past the binned range; weight exp(-g).
__device__ __forceinline__ int gap_bin(float x, float M, float invT, float& w) {
    const float g = __fmul_rn(__fsub_rn(M, x), invT);
    w = expf(-g);
    return g < GAP_MAX ? (int)(g * BIN_SCALE) : NBINS;
}

// Among the tokens of bin b with key >= kfloor: the largest key t with above + F(t) >= target, where
// F(t) sums val (1 in count mode, else the mass) over those with key >= t; the smallest of their keys
// when none reaches it. *mass_ge = the mass of the tokens at or above the returned key.
template <typename T>
__device__ unsigned refine(const T* row, int V, bool vec, float M, float invT, int b, unsigned kfloor, bool count,
                           float above, float target, float* mass_ge, Smem& s) {
    if (threadIdx.x == 0) s.n = 0, s.kmin = 0xffffffffu, s.kmax = 0u;
    __syncthreads();
    for_each(row, V, vec, [&](int j, float x) {
        float w;
        const unsigned k = order_key(x);
        if (gap_bin(x, M, invT, w) == b && k >= kfloor) {
            const int slot = atomicAdd(&s.n, 1);
            if (slot < CAP) s.key[slot] = k, s.w[slot] = w;
            atomicMin(&s.kmin, k);
            atomicMax(&s.kmax, k);
        }
    });
    __syncthreads();
    const int n = s.n;
    const unsigned kmin = s.kmin, kmax = s.kmax;
    unsigned tau;
    if (n <= CAP) {
        unsigned best = 0u;
        bool found = false;
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            const unsigned kc = s.key[c];
            float F = 0.f;
            for (int e = 0; e < n; ++e) F += s.key[e] >= kc ? (count ? 1.f : s.w[e]) : 0.f;
            if (above + F >= target) found = true, best = max(best, kc);
        }
        found = __syncthreads_or(found);
        best = block_max_u(best, s.redu);
        tau = found ? best : kmin;
        float m = 0.f;
        for (int e = threadIdx.x; e < n; e += blockDim.x) m += s.key[e] >= tau ? s.w[e] : 0.f;
        *mass_ge = block_sum(m, s.red);
        return tau;
    }
    // Too many to gather: bisection on the key, one pass over the row per step.
    auto sum_ge = [&](unsigned t, bool mass) {
        float acc = 0.f;
        for_each(row, V, vec, [&](int j, float x) {
            float w;
            const unsigned k = order_key(x);
            if (gap_bin(x, M, invT, w) == b && k >= kfloor && k >= t) acc += mass ? w : 1.f;
        });
        return block_sum(acc, s.red);
    };
    unsigned lo = kmin, hi = kmax;
    if (above + sum_ge(lo, !count) >= target) {
        while (lo < hi) {
            const unsigned mid = lo + ((hi - lo) >> 1) + ((hi - lo) & 1u);  // no overflow at hi - lo = 2^32 - 1
            if (above + sum_ge(mid, !count) >= target) lo = mid;
            else hi = mid - 1;
        }
    }
    *mass_ge = sum_ge(lo, true);
    return lo;
}

// ---- kernel -------------------------------------------------------------------------------

// The top-k / top-p threshold of one row (keys >= it are allowed), by the whole block: see the header.
template <typename T>
__device__ unsigned threshold(const T* row, int V, bool vec, float invT, int top_k, float top_p, Smem& s) {
    const bool use_k = top_k > 0 && top_k < V, use_p = top_p < 1.f;
    float M = -__int_as_float(0x7f800000);
    int unused = 0;
    for_each(row, V, vec, [&](int, float x) { M = fmaxf(M, x); });
    block_argmax(M, unused, s.red, s.redi);
    for (int i = threadIdx.x; i < NBINS; i += blockDim.x) s.cnt[i] = 0.f, s.mass[i] = 0.f;
    __syncthreads();
    float far_mass = 0.f;
    for_each(row, V, vec, [&](int, float x) {
        float w;
        const int b = gap_bin(x, M, invT, w);
        if (b < NBINS) {
            atomicAdd(&s.cnt[b], 1.f);
            atomicAdd(&s.mass[b], w);
        } else {
            far_mass += w;
        }
    });
    far_mass = block_sum(far_mass, s.red);  // syncs: the histogram is complete
    float mass_k = far_mass;
    for (int i = 0; i < NBINS; ++i) mass_k += s.mass[i];  // fixed order, every thread alike
    unsigned tau = 0u;
    int bk = -1;
    if (use_k) {
        bk = find_bin(s.cnt, (float)top_k, s);
        if (bk >= 0) {  // else the k-th value lies past the binned range: nothing drawable is dropped
            float above_mass = 0.f, in_bin;
            for (int i = 0; i < bk; ++i) above_mass += s.mass[i];
            tau = refine(row, V, vec, M, invT, bk, 0u, true, s.above, (float)top_k, &in_bin, s);
            mass_k = above_mass + in_bin;
            __syncthreads();
            if (threadIdx.x == 0) s.mass[bk] = in_bin;  // only the top-k part of its bin, nothing after
            for (int i = bk + 1 + threadIdx.x; i < NBINS; i += blockDim.x) s.mass[i] = 0.f;
            __syncthreads();
        }
    }
    if (use_p) {
        const float target = top_p * mass_k;
        const int bp = find_bin(s.mass, target, s);
        if (bp >= 0) {
            float unused_mass;
            tau = max(tau, refine(row, V, vec, M, invT, bp, bp == bk ? tau : 0u, false, s.above, target,
                                  &unused_mass, s));
        }
    }
    return tau;
}

// Grid (nb, b): block (part, r) draws over its slice of row r, or (top-k / top-p) part 0 over the row.
template <typename T> __device__ void sample_impl(int* tokens, const T* logits, int* params, int V) {
    __shared__ Smem s;
    __shared__ unsigned s_step;
    __shared__ bool s_last;
    const int r = blockIdx.y, part = blockIdx.x, nb = gridDim.x;
    const T* row = logits + (size_t)r * V;
    unsigned long long* slots = reinterpret_cast<unsigned long long*>(params + PARAM_SLOTS);
    constexpr int VN = Pack16<T>::N;
    const bool vec = V % VN == 0 && ((size_t)logits & 15) == 0;
    if (threadIdx.x == 0) s_step = (unsigned)params[PARAM_STEP];
    __syncthreads();
    const float temperature = __int_as_float(params[0]), top_p = __int_as_float(params[2]);
    const int top_k = params[1];
    const bool greedy = !(temperature > 0.f);
    const bool filtered = !greedy && ((top_k > 0 && top_k < V) || top_p < 1.f);
    float best = -__int_as_float(0x7f800000);
    int arg = 0x7fffffff;  // no element seen
    if (!filtered || part == 0) {
        int begin = 0, end = V;
        if (!filtered) {  // this block's slice, whole vectors
            const int chunk = ((V + nb - 1) / nb + VN - 1) / VN * VN;
            begin = min(V, part * chunk);
            end = min(V, begin + chunk);
        }
        if (greedy) {
            for_range(row, begin, end, vec, [&](int j, float x) {
                if (x > best || (x == best && j < arg)) best = x, arg = j;
            });
        } else {
            const float invT = 1.f / temperature;
            const unsigned key = row_key((unsigned)params[3], (unsigned)params[4], (unsigned)r, s_step);
            const unsigned tau = filtered ? threshold(row, V, vec, invT, top_k, top_p, s) : 0u;
            for_range(row, begin, end, vec, [&](int j, float x) {
                if (order_key(x) < tau) return;
                const float z = __fadd_rn(__fmul_rn(x, invT), neg_log_exp(key, j));
                if (z > best || (z == best && j < arg)) best = z, arg = j;
            });
        }
        block_argmax(best, arg, s.red, s.redi);
    }
    if (threadIdx.x == 0) {
        if (nb == 1) {
            tokens[r] = arg < V ? arg : 0;  // 0 when every logit is NaN
        } else if (arg < V) {
            const unsigned long long packed = (unsigned long long)order_key(best) << 32 | (0xffffffffu - (unsigned)arg);
            atomicMax(slots + r, packed);
        }
        __threadfence();
        const unsigned ticket = atomicAdd(reinterpret_cast<unsigned*>(params + PARAM_TICKET), 1u);
        __threadfence();
        s_last = ticket == gridDim.x * gridDim.y - 1;  // every block has read the step and merged its best
    }
    __syncthreads();
    if (!s_last) return;
    if (nb > 1)
        for (int rr = threadIdx.x; rr < (int)gridDim.y; rr += blockDim.x) {
            const unsigned long long v = atomicExch(slots + rr, 0ull);
            const unsigned j = 0xffffffffu - (unsigned)(v & 0xffffffffu);
            tokens[rr] = v && j < (unsigned)V ? (int)j : 0;
        }
    if (threadIdx.x == 0) {
        params[PARAM_STEP] = (int)(s_step + 1u);
        params[PARAM_TICKET] = 0;
    }
}

// ---- launchers ----------------------------------------------------------------------------

#define SAMPLE_KERNEL(SUF, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) sample_tokens_##SUF(int* tokens, const T* logits,   \
                                                                             int* params, int V) {            \
        sample_impl<T>(tokens, logits, params, V);                                                           \
    }
SAMPLE_KERNEL(f32, float)
SAMPLE_KERNEL(bf16, bf16)
