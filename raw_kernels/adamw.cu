// AdamW update with decoupled weight decay, in place on (param, m, v).
//
// hparams (fp32, on the device) = [lr, beta1, beta2, eps, weight_decay, step, 0, 0] are read by
// the kernel, so one captured graph serves every step; step is 1-based. grad_scale (the clip
// scale of global_norm_finish) is a device pointer too, or null for 1. A non-finite grad_scale
// (global_norm_finish writes NaN for a non-finite norm) writes nothing: the step is skipped on the
// device, weights and moments untouched, without the host having to look.
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   p = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd p),  bc = 1 - beta^step
// Rounding points: every fp32 operation is an explicitly rounded intrinsic (no FMA contraction)
// and beta^step is taken in double, so the NumPy twin reproduces the fp32 values exactly.
// bf16 stores (param, m, v) round stochastically: 16 random bits from a counter-based hash of
// (seed, step, which array, element index + off) are added below the bf16 mantissa before truncating,
// which rounds up with probability equal to the discarded fraction (unbiased, reproducible,
// independent of the launch grid). fp32 stores are plain. The `_scalar` kernels take arrays
// that are not all 16-byte aligned.
//
// Multi-tensor kernels (one launch over every parameter instead of one per tensor) read a table of
// TensorRecord and, per launch, an `owner` map (the record index of each block), written once by
// cuengine.kernels.adamw.MultiTensorTable, so a step allocates nothing and a captured graph replays them:
//   adamw_multi_*: block g updates chunk g - first_chunk (ADAMW_CHUNK elements) of record owner[g];
//     every element gets the per-tensor kernel's arithmetic, seed and draw index, so the bits equal
//     one adamw_update launch per record. A record with an `amax` slot also max-accumulates |p| of the
//     values it stores (the bf16 after stochastic rounding, as fp8.cu's abs_max reads them: fabsf, as
//     float bits, so exact and order-independent) into it: the FP8 weight copy's abs-max, so requantize
//     needs no pass of its own (zero the slots first). On a skipped step (non-finite clip scale) the
//     weights stay and the slot gets their abs-max, read back.
//   global_norm_squared_multi_*: block g computes the sum that block g - first_norm of record owner[g]'s
//     own global_norm_squared launch (norm.cu, grid min(1024, ceil(n / 2048))) adds to its slot, the same
//     loop with the same block and grid, and writes it to sums[g] (=).
//   global_norm_fold_multi: partials[s] = the sums of every record's block s, added in table order
//     from 0 (=): the bits of zeroing the partials and calling global_norm_squared per tensor in order.
#include "common.cuh"
#include "norm_squared.cuh"  // Vec, norm_squared_part: the per-tensor norm's loop
#include "sr_hash.cuh"  // mix32, sr_key, sr_bits, round_store: the stochastic rounding


// kernels

template <typename T> __device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
    constexpr int P = 16 / sizeof(T);
#pragma unroll
    for (int j = 0; j < 8; j += P) {
        const Vec<T, P> w = *reinterpret_cast<const Vec<T, P>*>(p + j);
#pragma unroll
        for (int k = 0; k < P; ++k) x[j + k] = to_float(w.v[k]);
    }
}

struct AdamParams {
    float lr, b1, b2, omb1, omb2, eps, wd, gs, bc1, bc2;
    u32 kp, km, kv;
};

__device__ __forceinline__ AdamParams adam_params(const float* hp, const float* grad_scale, int wd_on, u32 seed) {
    AdamParams a;
    a.lr = hp[0];
    a.b1 = hp[1];
    a.b2 = hp[2];
    a.eps = hp[3];
    a.wd = wd_on ? hp[4] : 0.f;
    const float step = hp[5];
    a.omb1 = __fsub_rn(1.f, a.b1);
    a.omb2 = __fsub_rn(1.f, a.b2);
    a.gs = grad_scale ? *grad_scale : 1.f;
    a.bc1 = (float)(1.0 - pow((double)a.b1, (double)step));
    a.bc2 = (float)(1.0 - pow((double)a.b2, (double)step));
    const u32 ustep = (u32)step;
    a.kp = sr_key(seed, ustep, 0u);
    a.km = sr_key(seed, ustep, 1u);
    a.kv = sr_key(seed, ustep, 2u);
    // Opaque to the optimiser: otherwise it recomputes the keys' hash chains inside the element loop
    // (rematerialisation), once per stored element.
    asm("" : "+r"(a.kp), "+r"(a.km), "+r"(a.kv));
    return a;
}

// One element; returns the new param and updates m and v.
__device__ __forceinline__ float adam_element(float p, float g, float& m, float& v, const AdamParams& a) {
    g = __fmul_rn(g, a.gs);
    m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.omb1, g));
    v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(a.omb2, __fmul_rn(g, g)));
    const float mhat = __fdiv_rn(m, a.bc1), vhat = __fdiv_rn(v, a.bc2);
    const float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), a.eps)), __fmul_rn(a.wd, p));
    return __fsub_rn(p, __fmul_rn(a.lr, upd));
}

__device__ __forceinline__ unsigned abs_max_bits(float x) { return __float_as_uint(fabsf(x)); }  // fp8.cu's rule

// Elements [lo, hi) of one tensor (lo a multiple of 8), thread `tid` of `nthreads`; draw index off + i.
// Returns the max of abs_max_bits over the params this thread stored (the per-tensor kernels drop it).
template <typename Tp, typename Tg, typename Tm, typename Tv, bool VEC>
__device__ __forceinline__ unsigned adamw_range(Tp* param, const Tg* grad, Tm* m, Tv* v, const AdamParams& a,
                                            long long off, long long lo, long long hi, long long tid,
                                            long long nthreads) {
    unsigned bits = 0;
    long long done = lo;
    if (VEC) {
        const long long packs = (hi - lo) / 8;
        for (long long pk = tid; pk < packs; pk += nthreads) {
            const long long i0 = lo + pk * 8;
            float xp[8], xg[8], xm[8], xv[8];
            load8(param + i0, xp);
            load8(grad + i0, xg);
            load8(m + i0, xm);
            load8(v + i0, xv);
            Vec<Tp, 8> op;
            Vec<Tm, 8> om;
            Vec<Tv, 8> ov;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float np = adam_element(xp[k], xg[k], xm[k], xv[k], a);
                op.v[k] = round_store<Tp>(np, a.kp, off + i0 + k);
                bits = max(bits, abs_max_bits(to_float(op.v[k])));
                om.v[k] = round_store<Tm>(xm[k], a.km, off + i0 + k);
                ov.v[k] = round_store<Tv>(xv[k], a.kv, off + i0 + k);
            }
            // Vec<T, 8> of fp32 is 32 bytes: two 16-byte stores on a 16-byte aligned address.
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tp))
                *reinterpret_cast<Vec<Tp, 16 / sizeof(Tp)>*>(param + i0 + j) =
                    *reinterpret_cast<const Vec<Tp, 16 / sizeof(Tp)>*>(op.v + j);
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tm))
                *reinterpret_cast<Vec<Tm, 16 / sizeof(Tm)>*>(m + i0 + j) =
                    *reinterpret_cast<const Vec<Tm, 16 / sizeof(Tm)>*>(om.v + j);
#pragma unroll
            for (int j = 0; j < 8; j += 16 / sizeof(Tv))
                *reinterpret_cast<Vec<Tv, 16 / sizeof(Tv)>*>(v + i0 + j) =
                    *reinterpret_cast<const Vec<Tv, 16 / sizeof(Tv)>*>(ov.v + j);
        }
        done = lo + packs * 8;
    }
    for (long long i = done + tid; i < hi; i += nthreads) {
        float xm = to_float(m[i]), xv = to_float(v[i]);
        const float np = adam_element(to_float(param[i]), to_float(grad[i]), xm, xv, a);
        const Tp sp = round_store<Tp>(np, a.kp, off + i);
        param[i] = sp;
        bits = max(bits, abs_max_bits(to_float(sp)));
        m[i] = round_store<Tm>(xm, a.km, off + i);
        v[i] = round_store<Tv>(xv, a.kv, off + i);
    }
    return bits;
}

template <typename Tp, typename Tg, typename Tm, typename Tv, bool VEC>
__device__ void adamw_impl(Tp* param, const Tg* grad, Tm* m, Tv* v, const float* hp, const float* grad_scale,
                           int wd_on, u32 seed, long long n, long long off) {
    const AdamParams a = adam_params(hp, grad_scale, wd_on, seed);
    if (!isfinite(a.gs)) return;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    adamw_range<Tp, Tg, Tm, Tv, VEC>(param, grad, m, v, a, off, 0, n, tid, (long long)gridDim.x * blockDim.x);
}

// ---- multi-tensor ------------------------------------------------------------------------------
#define ADAMW_CHUNK 32768  // elements per block of adamw_multi: a multiple of 8 (MultiTensorTable.CHUNK)

// One tensor of a multi-tensor table: 72 bytes, the layout of cuengine.kernels.adamw._RECORD.
struct TensorRecord {
    void* param;
    const void* grad;
    void* m;
    void* v;
    long long n;    // elements (> 0)
    long long off;  // the draw index of element 0 (adamw_update's index_offset)
    u32 seed;       // adamw_update's seed for this tensor
    int wd_on;
    int first_chunk;  // the first adamw_multi block of this tensor: a prefix sum over the table
    int first_norm;   // the first global_norm_squared_multi block of this tensor
    float* amax;      // null, or the slot that max-accumulates |param| as stored (the FP8 copy's abs-max)
};

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// `owner` (the table's block maps) holds the record index of every block of the launch: one load, where a
// search over the records would be a chain of them (a norm block reads only ~16 KB).
template <typename Tp, typename Tg, typename Tm, typename Tv>
__device__ void adamw_multi_impl(const TensorRecord* tab, const int* owner, const float* hp, const float* grad_scale) {
    const TensorRecord& r = tab[owner[blockIdx.x]];
    const AdamParams a = adam_params(hp, grad_scale, r.wd_on, r.seed);
    Tp* param = static_cast<Tp*>(r.param);
    const long long lo = (long long)(blockIdx.x - r.first_chunk) * ADAMW_CHUNK;
    const long long hi = min(lo + ADAMW_CHUNK, r.n);
    float* amax = r.amax;  // the same for the whole block, so the block reduction below is uniform
    unsigned bits = 0;
    if (!isfinite(a.gs)) {  // skipped: the slot still needs the (unchanged) weights' abs-max
        if (amax == nullptr) return;
        for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x)
            bits = max(bits, abs_max_bits(to_float(param[i])));
    } else {
        const Tg* grad = static_cast<const Tg*>(r.grad);
        Tm* m = static_cast<Tm*>(r.m);
        Tv* v = static_cast<Tv*>(r.v);
        // what the per-tensor launcher decides with _checks.is_aligned (the values do not depend on it)
        if (aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v))
            bits = adamw_range<Tp, Tg, Tm, Tv, true>(param, grad, m, v, a, r.off, lo, hi, threadIdx.x, blockDim.x);
        else
            bits = adamw_range<Tp, Tg, Tm, Tv, false>(param, grad, m, v, a, r.off, lo, hi, threadIdx.x, blockDim.x);
    }
    if (amax != nullptr) block_atomic_abs_max(amax, bits);
}

template <typename T> __device__ void norm_multi_impl(float* sums, const TensorRecord* tab, const int* owner,
                                                      int count) {
    const int ri = owner[blockIdx.x];
    const TensorRecord& r = tab[ri];
    const int nblocks = (ri + 1 < count ? tab[ri + 1].first_norm : (int)gridDim.x) - r.first_norm;
    const T* x = static_cast<const T*>(r.grad);
    const int b = blockIdx.x - r.first_norm;
    const float s = aligned16(x) ? norm_squared_part<T, true>(x, r.n, b, nblocks)
                                 : norm_squared_part<T, false>(x, r.n, b, nblocks);
    if (threadIdx.x == 0) sums[blockIdx.x] = s;
}

#define ADAMW_KERNEL(PS, TP, GS, TG, MS, TM, VS, TV)                                                          \
    extern "C" __global__ void __launch_bounds__(256) adamw_##PS##_##GS##_##MS##_##VS(                        \
        TP* param, const TG* grad, TM* m, TV* v, const float* hp, const float* grad_scale, int wd_on,         \
        u32 seed, long long n, long long off) {                                                               \
        grid_dependency_wait();                                                                               \
        adamw_impl<TP, TG, TM, TV, true>(param, grad, m, v, hp, grad_scale, wd_on, seed, n, off);             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) adamw_##PS##_##GS##_##MS##_##VS##_scalar(               \
        TP* param, const TG* grad, TM* m, TV* v, const float* hp, const float* grad_scale, int wd_on,         \
        u32 seed, long long n, long long off) {                                                               \
        grid_dependency_wait();                                                                               \
        adamw_impl<TP, TG, TM, TV, false>(param, grad, m, v, hp, grad_scale, wd_on, seed, n, off);            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) adamw_multi_##PS##_##GS##_##MS##_##VS(                  \
        const TensorRecord* tab, const int* owner, const float* hp, const float* grad_scale) {                \
        grid_dependency_wait();                                                                               \
        adamw_multi_impl<TP, TG, TM, TV>(tab, owner, hp, grad_scale);                                         \
    }
#define ADAMW_MV(PS, TP, GS, TG)                                                                              \
    ADAMW_KERNEL(PS, TP, GS, TG, f32, float, f32, float)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, f32, float, bf16, bf16)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, bf16, bf16, f32, float)                                                      \
    ADAMW_KERNEL(PS, TP, GS, TG, bf16, bf16, bf16, bf16)
ADAMW_MV(f32, float, f32, float)
ADAMW_MV(f32, float, bf16, bf16)
ADAMW_MV(bf16, bf16, f32, float)
ADAMW_MV(bf16, bf16, bf16, bf16)

extern "C" __global__ void __launch_bounds__(256)
    global_norm_squared_multi_f32(float* sums, const TensorRecord* tab, const int* owner, int count) {
    grid_dependency_wait();
    norm_multi_impl<float>(sums, tab, owner, count);
}
extern "C" __global__ void __launch_bounds__(256)
    global_norm_squared_multi_bf16(float* sums, const TensorRecord* tab, const int* owner, int count) {
    grid_dependency_wait();
    norm_multi_impl<bf16>(sums, tab, owner, count);
}

// One block; thread s folds slot s. `total` = the number of sums (the norm launch's grid).
extern "C" __global__ void __launch_bounds__(1024)
    global_norm_fold_multi(float* partials, const float* sums, const TensorRecord* tab, int count, int total,
                           int slots) {
    grid_dependency_wait();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8  // the loads run ahead; only the adds are a chain
        for (int i = 0; i < count; ++i) {
            const int first = tab[i].first_norm;
            const int nblocks = (i + 1 < count ? tab[i + 1].first_norm : total) - first;
            if (s < nblocks) acc += sums[first + s];
        }
        partials[s] = acc;
    }
}

// launchers: cuengine/kernels/adamw.py (adamw_update, adamw_update_multi, global_norm_squared_multi)
