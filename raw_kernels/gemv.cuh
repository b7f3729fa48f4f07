// Decode GEMV device code, shared by gemv.cu (one launch per linear layer) and decode_layers.cu (every
// layer of a decode step in one persistent launch). gemv.cu's header has the contract.
//
// gemv_impl takes the block's index and the grid size as arguments (a persistent kernel runs it with its
// own grid) and a `wait` callable run once per block before anything an earlier phase wrote is touched:
// griddepcontrol.wait in gemv.cu, a grid-wide barrier in decode_layers.cu. Inputs and residuals that an
// earlier phase wrote are read through L2 only (ld.global.cg): within one persistent launch
// another SM wrote them, and L1 is not coherent.
#pragma once
#include "common.cuh"

// A kernel's weight rows per warp (R) and 16-byte weight vectors per row and lane in flight (U) are
// template parameters (gemv.cu's launchers): a lane's products are summed in the same order whatever they
// are, so they change the tiles, never the bits.
constexpr int WARPS = 8;  // warps per block
constexpr int SU = 2;     // 16-byte SwiGLU input vectors per thread in flight while staging

// PRO_NORM_STAGED: PRO_NORM with norm_weight copied into shared memory before the wait (gemv_impl), so the
// normalisation after the rstd reads it there instead of making an L2 round trip on the critical path.
enum Prologue { PRO_NONE = 0, PRO_NORM = 1, PRO_SWIGLU = 2, PRO_NORM_STAGED = 3 };
// What a dual GEMV writes: [gate | up] (b, N), or SiLU(gate) * up (b, N / 2), each rounded to the output
// dtype first as the training forward rounds its up projection.
enum Dual { DUAL_NONE = 0, DUAL_PAIR = 1, DUAL_SWIGLU = 2 };


// ---- helpers ------------------------------------------------------------------------------

// Reads of data another block may have written in the same launch: L2 only (L1 is not coherent).
template <typename T> __device__ __forceinline__ Pack16<T> load_pack_cg(const T* p) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    Pack16<T> r;
    memcpy(&r, &v, 16);
    return r;
}


// 16 bytes of weights that bypass L1: each vector is used once per pass
__device__ __forceinline__ uint4 load_weights(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// ---- fixed-point accumulators ---------------------------------------------------------------
// A linear layer split over its input (the "ksplit" decode arm: the down projection over hidden units,
// decode_mlp.cu) sums its blocks' partial outputs into an int64 row: each partial p is added as
// round(p * 2^ACC_SHIFT). Integer addition is associative, so the sum, and y = float(sum) * 2^-ACC_SHIFT
// rounded once, are the same whatever order the blocks' atomics land in: deterministic, no float atomics.
// A partial that is not finite or has |p| >= ACC_LIMIT (where 2^12 of them could overflow the sum) adds
// nothing and sets the row's flag word instead: a flagged row reads as NaN.
// Row layout (kernels/gemv.py: acc_shape): K values, the flag, one pad word (rows of 16-byte multiples).
constexpr int ACC_PAD = 2;
#define ACC_SCALE 268435456.f  // 2^28
#define ACC_LIMIT 8388608.f    // 2^23: |p| * 2^28 < 2^51, and 2^12 such partials sum within int64

// The fixed-point value of partial p; `bad` is set (and 0 returned) where it could overflow.
__device__ __forceinline__ long long acc_fix(float p, bool& bad) {
    if (!(fabsf(p) < ACC_LIMIT)) {  // NaN fails the comparison too
        bad = true;
        return 0;
    }
    return __float2ll_rn(p * ACC_SCALE);  // exact scaling by a power of two, then one rounding
}

// Adds a thread's fixed-point sum and flag into accumulator row `row` at n (after every partial is in).
__device__ __forceinline__ void acc_add(long long* row, int K, int n, long long q, bool bad) {
    if (q != 0) atomicAdd(reinterpret_cast<unsigned long long*>(row + n), (unsigned long long)q);
    if (bad) atomicOr(reinterpret_cast<unsigned long long*>(row + K), 1ull);
}

// The N values of accumulator row `row` at c .. c+N-1 (c a multiple of 2), read through L2: NaN if flagged.
template <int N> __device__ __forceinline__ void acc_read(const long long* row, int K, int c, float (&y)[N]) {
    const bool bad = __ldcg(row + K) != 0;
    #pragma unroll
    for (int k = 0; k < N; k += 2) {
        const longlong2 v = __ldcg(reinterpret_cast<const longlong2*>(row + c + k));
        y[k] = bad ? __int_as_float(0x7fffffff) : (float)v.x * (1.f / ACC_SCALE);
        if (k + 1 < N) y[k + 1] = bad ? __int_as_float(0x7fffffff) : (float)v.y * (1.f / ACC_SCALE);
    }
}


// Element j of a 32-bit word of W (fp32 or bf16), as a float, exactly.
template <typename W> __device__ __forceinline__ float widen(unsigned word, int j);
template <> __device__ __forceinline__ float widen<float>(unsigned word, int) { return __uint_as_float(word); }
template <> __device__ __forceinline__ float widen<bf16>(unsigned word, int j) {
    return __uint_as_float(j == 0 ? word << 16 : word & 0xffff0000u);
}
// Elements e and e + 1 (e even) of a 16-byte weight vector, as floats, exactly.
template <typename W> __device__ __forceinline__ float2 widen_pair(const unsigned (&words)[4], int e) {
    constexpr int PW = 4 / sizeof(W);  // elements per word
    return make_float2(widen<W>(words[e / PW], e % PW), widen<W>(words[(e + 1) / PW], (e + 1) % PW));
}
// Every E4M3 value is a half, so one cvt.rn.f16x2.e4m3x2 and two half-to-float conversions widen a pair
// exactly: 1.5 operations an element, where moving the byte's fields into a float's and rescaling take 4
// (a NaN byte reads as NaN).
template <> __device__ __forceinline__ float2 widen_pair<fp8e4>(const unsigned (&words)[4], int e) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(words[e / 4] >> (8 * (e % 4))), __NV_E4M3);
    return make_float2(__half2float(__ushort_as_half(h.x)), __half2float(__ushort_as_half(h.y)));
}

// y plus the dot product of a 16-byte weight vector (VW = 16 / sizeof(W) weights, widened exactly) with
// x[0 .. VW), in order: the split projections' partials (decode_mlp.cu, decode_attention_o.cu).
template <typename W, typename X> __device__ __forceinline__ float dot16(uint4 v, const X* x, float y) {
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    #pragma unroll
    for (int e = 0; e < 16 / (int)sizeof(W); e += 2) {
        const float2 pw = widen_pair<W>(words, e);
        y = fmaf(pw.x, to_float(x[e]), y);
        y = fmaf(pw.y, to_float(x[e + 1]), y);
    }
    return y;
}

// SiLU(g) * u as activations.cu's act_value(ACT_SILU, g) * u computes it
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * __fdividef(1.f, 1.f + __expf(-g)) * u; }

template <typename A, typename B> constexpr bool same_type = false;
template <typename A> constexpr bool same_type<A, A> = true;

// 16 bytes of T stored into the staged input as XS (T itself, or fp32: every T value is a float).
template <typename XS, typename T> __device__ __forceinline__ void store_staged(XS* dst, const Pack16<T>& v) {
    if constexpr (same_type<XS, T>) {
        v.store(dst);
    } else {
        #pragma unroll
        for (int h = 0; h < Pack16<T>::N; h += Pack16<XS>::N) {
            Pack16<XS> f;
            #pragma unroll
            for (int k = 0; k < Pack16<XS>::N; ++k) f.v[k] = to_float(v.v[h + k]);
            f.store(dst + h);
        }
    }
}

// Stages input rows m0 .. m0+BT-1 (zeros past b) of the GEMV input into xs (BT, K), in XS: T, or fp32 so
// that the dot products read floats without converting each input once per weight row. The norm prologues
// copy x's rows into raw (BT, K) T first (xs itself when XS is T). With PRO_NORM_STAGED, norm_weight
// points at the copy in shared memory (loaded through registers before the wait).
// x_acc (norm prologues only): rows of an accumulator (b, K + ACC_PAD) that x misses: the rows
// normalised are x' = r(x + r(y)), y the accumulator's values, as a residual epilogue rounds them; the
// caller passes x_out (b, K) to one block only, which writes x' there.
template <typename T, typename XS, int BT>
__device__ void stage_input(XS* xs, T* raw, float* s_rstd, const T* x, const T* __restrict__ norm_weight,
                            float eps, int prologue, int m0, int b, int K, const long long* x_acc = nullptr,
                            T* x_out = nullptr) {
    constexpr int VT = Pack16<T>::N;
    const int vecs = K / VT, total = BT * vecs;
    if (prologue == PRO_SWIGLU) {
        // one vector staging fp32: the conversion's registers, beside the weight vectors in flight, would
        // spill (tools/PERF_NOTES.md 28(d))
        constexpr int SV = same_type<XS, T> ? SU : 1;
        for (int i0 = threadIdx.x; i0 < total; i0 += blockDim.x * SV) {
            Pack16<T> v[SV];
            #pragma unroll
            for (int j = 0; j < SV; ++j) {
                const int i = i0 + j * blockDim.x, t = i / vecs, c = (i - t * vecs) * VT, m = m0 + t;
                if (i >= total || m >= b) {
                    for (int k = 0; k < VT; ++k) v[j].v[k] = from_float<T>(0.f);
                } else {
                    const T* row = x + (size_t)m * 2 * K;
                    const Pack16<T> g = load_pack_cg(row + c), u = load_pack_cg(row + K + c);
                    for (int k = 0; k < VT; ++k)
                        v[j].v[k] = from_float<T>(swiglu_value(to_float(g.v[k]), to_float(u.v[k])));
                }
            }
            #pragma unroll
            for (int j = 0; j < SV; ++j) {
                const int i = i0 + j * blockDim.x, t = i / vecs;
                if (i < total) store_staged(xs + (size_t)t * K + (i - t * vecs) * VT, v[j]);
            }
        }
        return;
    }
    // through registers, SN vectors a thread in flight: on the H200 the down projection's 9.7 KB row
    // staged by cp.async cost 1.8 us more per GEMV (tools/PERF_NOTES.md 26), and the norm prologues' rows
    // and norm weight 0.3-0.9 us more (PERF_NOTES 30); two staging fp32 (three spill). A norm prologue
    // keeps x's raw rows (in T) to normalise from.
    const bool norm = prologue != PRO_NONE;
    if (norm && x_acc != nullptr) {
        // x' = r(x + r(y)): one vector a thread in flight, beside its accumulator's four times the bytes
        for (int i = threadIdx.x; i < total; i += blockDim.x) {
            const int t = BT == 1 ? 0 : i / vecs, c = (i - t * vecs) * VT, m = m0 + t;
            Pack16<T> v;
            if (m < b) {
                v = load_pack_cg(x + (size_t)m * K + c);
                float y[VT];
                acc_read<VT>(x_acc + (size_t)m * (K + ACC_PAD), K, c, y);
                for (int k = 0; k < VT; ++k) v.v[k] = from_float<T>(to_float(v.v[k]) + to_float(from_float<T>(y[k])));
                if (x_out != nullptr) v.store(x_out + (size_t)m * K + c);
            } else {
                for (int k = 0; k < VT; ++k) v.v[k] = from_float<T>(0.f);
            }
            v.store(raw + (size_t)t * K + c);
        }
    }
    constexpr int SN = same_type<XS, T> ? 4 : 2;
    for (int i0 = norm && x_acc != nullptr ? total : threadIdx.x; i0 < total; i0 += blockDim.x * SN) {
        Pack16<T> v[SN];
        #pragma unroll
        for (int j = 0; j < SN; ++j) {
            const int i = i0 + j * blockDim.x, t = BT == 1 ? 0 : i / vecs, c = (i - t * vecs) * VT;
            if (i < total && m0 + t < b) v[j] = load_pack_cg(x + (size_t)(m0 + t) * K + c);
            else for (int k = 0; k < VT; ++k) v[j].v[k] = from_float<T>(0.f);
        }
        #pragma unroll
        for (int j = 0; j < SN; ++j) {
            const int i = i0 + j * blockDim.x, t = BT == 1 ? 0 : i / vecs, c = (i - t * vecs) * VT;
            if (i >= total) continue;
            if (norm) v[j].store(raw + (size_t)t * K + c);
            else store_staged(xs + (size_t)t * K + c, v[j]);
        }
    }
    if (!norm) return;
    // rstd as rmsnorm_forward computes it: one warp per row, the same lane order and warp_sum
    __syncthreads();  // every thread's rows (and its share of the norm weight) are in
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int t = warp; t < BT; t += WARPS) {
        float ss = 0.f;
        for (int c = lane * VT; c < K; c += 32 * VT) {
            const Pack16<T> v = Pack16<T>::load(raw + (size_t)t * K + c);
            for (int k = 0; k < VT; ++k) {
                const float f = to_float(v.v[k]);
                ss += f * f;
            }
        }
        ss = warp_sum(ss);
        if (lane == 0) s_rstd[t] = 1.f / sqrtf(ss / K + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int t = i / vecs, c = (i - t * vecs) * VT;
        const Pack16<T> v = Pack16<T>::load(raw + (size_t)t * K + c), w = Pack16<T>::load(norm_weight + c);
        const float r = s_rstd[t];
        Pack16<T> y;
        for (int k = 0; k < VT; ++k) y.v[k] = from_float<T>(to_float(v.v[k]) * r * to_float(w.v[k]));
        store_staged(xs + (size_t)t * K + c, y);
    }
}

// The epilogue operands of one output, loaded before the dot products so that they arrive during them:
// the weight-side ones (row scale, bias; fetch_weights, for a block's first item before the dependent-launch
// wait) and the residual (after it).
struct Epilogue {
    float scale, bias, residual;
};
template <typename T>
__device__ __forceinline__ Epilogue fetch_weights(const float* w_scale, const T* bias, int n) {
    Epilogue e{1.f, 0.f, 0.f};
    if (w_scale) e.scale = w_scale[n];
    if (bias) e.bias = to_float(bias[n]);
    return e;
}
template <typename O>
__device__ __forceinline__ void fetch_residual(Epilogue& e, const O* residual, int m, int n, int N) {
    if (residual) e.residual = to_float(load_cg(residual + (size_t)m * N + n));
}

// The epilogue of one output: scale, round, bias, round, residual, round.
template <typename O>
__device__ __forceinline__ void finish(O* out, const Epilogue& e, bool scaled, bool biased, bool residual, float y,
                                       int m, int n, int N) {
    if (scaled) y *= e.scale;
    O v = from_float<O>(y);
    if (biased) v = from_float<O>(to_float(v) + e.bias);
    if (residual) v = from_float<O>(e.residual + to_float(v));
    out[(size_t)m * N + n] = v;
}


// The weight row (and out column) of tile row q: gemv_dual pairs gate row q/2 (q even) with up row
// N/2 + q/2 (q odd) in one warp.
__device__ __forceinline__ int weight_row(int q, int N, int dual) { return dual ? (q & 1 ? N / 2 + q / 2 : q / 2) : q; }

// The first U weight vectors of each of a warp's R rows for its K-slice [c0, c1).
template <typename W, int R, int U>
__device__ __forceinline__ void load_first(uint4 (&wv)[U][R], const W* const (&wrow)[R], int c0, int c1, int lane) {
    constexpr int VW = 16 / sizeof(W);
    for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
            wv[u][r] = c0 + lane + 32 * u < c1 ? load_weights(wrow[r] + (size_t)(c0 + lane + 32 * u) * VW)
                                               : make_uint4(0u, 0u, 0u, 0u);
}


// ---- kernels ------------------------------------------------------------------------------

// Tiles of WARPS / S * R rows, dealt round-robin to the blocks (the grid may be smaller than the tile count:
// a tile's sums do not depend on which block runs it). A block's work is (tile, pass of BT input rows)
// items in order; the first weight vectors of the next item are in flight while the current one reduces
// and writes. Dynamic shared memory: the staged input, BT * K * sizeof(XS) bytes; with a norm prologue and XS
// other than T the raw rows, + BT * K * sizeof(T); with PRO_NORM_STAGED the norm weight, + K * sizeof(T).
// dual: a Dual (DUAL_SWIGLU writes out (b, N / 2)).
template <typename T, typename XS, typename W, typename O, int BT, int R, int U, typename Wait>
__device__ void gemv_impl(O* out, const T* x, const W* __restrict__ w, const float* w_scale, const T* bias,
                          const O* residual, const T* __restrict__ norm_weight, const long long* x_acc, T* x_out,
                          float eps, int prologue, int dual, int b, int K, int N, int S, int block, int blocks,
                          Wait wait) {
    extern __shared__ __align__(16) unsigned char smem[];
    XS* xs = reinterpret_cast<XS*>(smem);
    T* raw = same_type<XS, T> ? reinterpret_cast<T*>(xs) : reinterpret_cast<T*>(xs + (size_t)BT * K);
    __shared__ float s_partial[WARPS][R][BT];
    __shared__ float s_rstd[BT];
    constexpr int VW = 16 / sizeof(W);         // weights per 16-byte vector
    constexpr int NT = Pack16<XS>::N;          // staged inputs per 16-byte vector
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int groups = WARPS / S, group = warp / S, slice = warp % S;
    const int C = K / VW;
    const int c0 = (int)((long long)slice * C / S), c1 = (int)((long long)(slice + 1) * C / S);
    const int tiles = (N + groups * R - 1) / (groups * R);
    // The next kernel may start its own weight prefetch now: it waits for this grid before reading outputs.
    launch_dependents();
    if (block >= tiles) {
        wait();
        return;
    }
    // The output this thread finishes, (tile row fr, input row ft of the pass), if any: with S = 1 lane
    // r * BT + t of each warp, with S > 1 thread (g * R + r) * BT + t after the ordered sum of the slices.
    const int fi = S == 1 ? lane : threadIdx.x;
    const bool finisher = S == 1 ? lane < R * BT : threadIdx.x < groups * R * BT;
    const int fr = (S == 1 ? group : fi / (R * BT)) * R + fi / BT % R, ft = fi % BT;

    int tile_index = block, m0 = 0;
    const W* wrow[R];
    const auto set_rows = [&](int ti) {
        for (int r = 0; r < R; ++r) {
            const int q = min(ti * groups * R + group * R + r, N - 1);  // rows past N load a valid row, store nothing
            wrow[r] = w + (size_t)weight_row(q, N, dual) * K;
        }
    };
    set_rows(tile_index);
    uint4 wv[U][R];
    load_first<W, R, U>(wv, wrow, c0, c1, lane);  // in flight while the block stages its input
    // the first item's row scale and bias too: after the wait they would be DRAM round trips of their own
    Epilogue first = Epilogue{1.f, 0.f, 0.f};
    if (finisher && tile_index * groups * R + fr < N)
        first = fetch_weights<T>(w_scale, bias, weight_row(tile_index * groups * R + fr, N, dual));
    // The norm weight is a weight too: into shared memory behind xs before the wait (PRO_NORM_STAGED)
    const T* norm_in = norm_weight;
    if (prologue == PRO_NORM_STAGED) {
        constexpr int VT = Pack16<T>::N;
        T* ws = raw + (size_t)BT * K;
        for (int c = threadIdx.x * VT; c < K; c += blockDim.x * VT) Pack16<T>::load(norm_weight + c).store(ws + c);
        norm_in = ws;
    }
    bool staged = false;  // with one pass (b <= BT) the input is staged once for all the block's tiles
    for (;;) {
        const int tile = tile_index * groups * R;  // first row of the tile
        // The previous item must be done with xs and s_partial; warps that only read the staged input and
        // keep their sums in registers run ahead across tiles.
        if (S > 1 || b > BT || !staged) __syncthreads();
        if (b > BT || !staged) {
            // Under programmatic dependent launch everything above (weights only) overlaps the previous
            // kernel (or phase); its outputs (x, residual, out's memory) are touched only after this wait.
            if (!staged) wait();
            stage_input<T, XS, BT>(xs, raw, s_rstd, x, norm_in, eps, prologue, m0, b, K, x_acc,
                                   block == 0 ? x_out : nullptr);
            __syncthreads();
            staged = true;
        }
        const int fq = tile + fr, fm = m0 + ft;
        const bool writes = finisher && fq < N && fm < b;
        const int fn = weight_row(min(fq, N - 1), N, dual);
        Epilogue ep = tile_index == block ? first : writes ? fetch_weights<T>(w_scale, bias, fn) : Epilogue{1.f, 0.f, 0.f};
        if (writes) fetch_residual<O>(ep, residual, fm, fn, N);

        float acc[R][BT];
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < BT; ++t) acc[r][t] = 0.f;
        for (int c = c0 + lane; c < c1; c += 32 * U) {
            if (c != c0 + lane)
                for (int u = 0; u < U; ++u)
                    for (int r = 0; r < R; ++r)
                        wv[u][r] = c + 32 * u < c1 ? load_weights(wrow[r] + (size_t)(c + 32 * u) * VW)
                                                   : make_uint4(0u, 0u, 0u, 0u);
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cu = c + 32 * u;
                if (cu < c1) {
                    unsigned words[R][4];
                    #pragma unroll
                    for (int r = 0; r < R; ++r) {
                        words[r][0] = wv[u][r].x;
                        words[r][1] = wv[u][r].y;
                        words[r][2] = wv[u][r].z;
                        words[r][3] = wv[u][r].w;
                    }
                    // one input vector (NT elements) at a time, so only NT weights per row are live
                    #pragma unroll
                    for (int h = 0; h < VW / NT; ++h) {
                        float wf[R][NT];
                        #pragma unroll
                        for (int r = 0; r < R; ++r)
                            #pragma unroll
                            for (int k = 0; k < NT; k += 2) {
                                const float2 p = widen_pair<W>(words[r], h * NT + k);
                                wf[r][k] = p.x;
                                wf[r][k + 1] = p.y;
                            }
                        #pragma unroll
                        for (int t = 0; t < BT; ++t) {
                            const Pack16<XS> xv = Pack16<XS>::load(xs + (size_t)t * K + (size_t)cu * VW + h * NT);
                            #pragma unroll
                            for (int k = 0; k < NT; ++k) {
                                const float xk = to_float(xv.v[k]);
                                #pragma unroll
                                for (int r = 0; r < R; ++r) acc[r][t] = fmaf(xk, wf[r][k], acc[r][t]);
                            }
                        }
                    }
                }
            }
        }
        // the next item's first weights go out before this one's reduction and stores
        int next_index = tile_index, next_m0 = m0 + BT;
        if (next_m0 >= b) {
            next_m0 = 0;
            next_index += blocks;
        }
        const bool more = next_index < tiles;
        if (more) {
            if (next_index != tile_index) set_rows(next_index);
            load_first<W, R, U>(wv, wrow, c0, c1, lane);
        }

        // (unrolled: indexed by the loop counters, acc would be picked by lane from a local-memory copy)
        #pragma unroll
        for (int r = 0; r < R; ++r)
            #pragma unroll
            for (int t = 0; t < BT; ++t) acc[r][t] = warp_sum(acc[r][t]);
        float y = 0.f;
        if (S == 1) {  // lane r * BT + t holds (row r, input row t)
            #pragma unroll
            for (int r = 0; r < R; ++r)
                #pragma unroll
                for (int t = 0; t < BT; ++t)
                    if (lane == r * BT + t) y = acc[r][t];
        } else {
            if (lane == 0)
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    #pragma unroll
                    for (int t = 0; t < BT; ++t) s_partial[warp][r][t] = acc[r][t];
            __syncthreads();
            if (finisher) {
                const int g = fi / (R * BT), r = fi / BT % R, t = fi % BT;
                for (int s = 0; s < S; ++s) y += s_partial[g * S + s][r][t];
            }
        }
        if (dual == DUAL_SWIGLU) {
            // gate and up, each rounded as finish() rounds them; the up row's finisher is BT threads after
            // its gate row's, in the same warp (tile rows pair up as gate q/2, up q/2), so every lane shuffles
            const float v = to_float(from_float<O>(w_scale != nullptr ? y * ep.scale : y));
            const float up = __shfl_down_sync(0xffffffffu, v, BT);
            if (writes && fq % 2 == 0) out[(size_t)fm * (N / 2) + fq / 2] = from_float<O>(swiglu_value(v, up));
        } else if (writes) {
            finish<O>(out, ep, w_scale != nullptr, bias != nullptr, residual != nullptr, y, fm, fn, N);
        }
        if (!more) break;
        tile_index = next_index;
        m0 = next_m0;
    }
}
