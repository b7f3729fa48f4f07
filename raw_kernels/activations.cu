// Element-wise MLP activations, plain and gated, forward and backward, and forwards that write FP8.
//
//   plain:  out = f(x)               x (N, H) -> out (N, H);  dinp = dout * f'(x)                  (=)
//   gated:  out = f(gate) * up       x (N, 2H) -> out (N, H); dinp = [dgate, dup] in x's layout  (=)
//           the gated backward may also write out (a dropped output recomputed in the same pass), or
//           out's E4M3 copy transposed (H, N) (gated_backward_quant_tp: a tile per block)
//           swiglu_oai: out = g * sigmoid(1.702 g) * (u + 1), g = min(gate, 7), u = clip(up, -7, 7)
//   layouts of x for gated: split = [gate | up] halves of each row; interleaved = gate at even
//   columns, up at odd columns.
// gelu_tanh_approx is evaluated as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), which equals
// 0.5 x (1 + tanh(u)) but keeps its accuracy for negative x, where 1 + tanh(u) cancels.
// f is chosen at run time (ACT_* below, one uniform branch) so that each layout and dtype is one kernel.
// fp32 math, one rounding at the store; abs_max outputs max-accumulate |stored value|, one integer
// atomicMax per block. The backward may run in place (dinp == inp): a thread reads its inputs before
// writing the same elements, and no other thread touches them. Gradients at the kinks follow PyTorch:
// relu'(0) = 0, and the clamps of swiglu_oai pass the gradient at their bounds.
// The `_quant` forwards read abs_max from the E4M3 output's stats, write scale = 448 / abs_max (1 when
// abs_max is 0) and scale_inv = 1 / scale, and store fp8(round_T(out) * scale) with SATFINITE RNE, so
// they equal the plain forward into T followed by quantisation. Given a `scale_src` (delayed scaling: a
// scale made from earlier steps' abs-maxes) they quantise with *scale_src instead and max-accumulate
// |round_T(out)| into the stats' abs-max, for the scales of later steps. The gated backward's
// gated_backward_q_tp variant writes dinp itself that way, in FP8 (E4M3 or E5M2) both as rows (N, 2H) and
// transposed (2H, N): the two copies an FP8 step's up-projection backward reads, with no bf16 dinp and no
// quantise pass. H: a multiple of the 16-byte vector width.
#include "common.cuh"

enum Act { ACT_SILU = 0, ACT_GELU = 1, ACT_RELU = 2, ACT_RELU_SQ = 3, ACT_SIGMOID = 4, ACT_SWIGLU_OAI = 5 };

constexpr float GELU_K = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_A = 0.044715f;
constexpr float OAI_ALPHA = 1.702f;
constexpr float OAI_LIMIT = 7.f;


// MUFU.EX2 and MUFU.RCP (about 2 ulp each) instead of the IEEE-exact expf and division: the
// element-wise kernels must stay memory-bound, and bf16 outputs round far above that error.
// For x < -87, exp(-x) overflows to inf and the quotient is 0, the correct limit.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

__device__ __forceinline__ float act_value(int act, float x) {
    switch (act) {
        case ACT_SILU: return x * sigmoid(x);
        case ACT_GELU: return x * sigmoid(2.f * GELU_K * (x + GELU_A * x * x * x));
        case ACT_RELU: return x > 0.f ? x : 0.f;
        case ACT_RELU_SQ: return x > 0.f ? x * x : 0.f;
        default: return sigmoid(x);
    }
}

__device__ __forceinline__ float act_grad(int act, float x) {
    switch (act) {
        case ACT_SILU: {
            const float s = sigmoid(x);
            return s * (1.f + x * (1.f - s));
        }
        case ACT_GELU: {
            const float x2 = x * x, s = sigmoid(2.f * GELU_K * (x + GELU_A * x2 * x));
            return s + x * (2.f * GELU_K) * (1.f + 3.f * GELU_A * x2) * s * (1.f - s);
        }
        case ACT_RELU: return x > 0.f ? 1.f : 0.f;
        case ACT_RELU_SQ: return x > 0.f ? 2.f * x : 0.f;
        default: {
            const float s = sigmoid(x);
            return s * (1.f - s);
        }
    }
}

__device__ __forceinline__ float gated_value(int act, float g, float u) {
    if (act == ACT_SWIGLU_OAI) {
        const float gc = fminf(g, OAI_LIMIT), uc = fminf(fmaxf(u, -OAI_LIMIT), OAI_LIMIT);
        return gc * sigmoid(OAI_ALPHA * gc) * (uc + 1.f);
    }
    return act_value(act, g) * u;
}

__device__ __forceinline__ void gated_grad(int act, float g, float u, float d, float& dg, float& du) {
    if (act == ACT_SWIGLU_OAI) {
        const float gc = fminf(g, OAI_LIMIT), uc = fminf(fmaxf(u, -OAI_LIMIT), OAI_LIMIT);
        const float s = sigmoid(OAI_ALPHA * gc), glu = gc * s;
        dg = g <= OAI_LIMIT ? d * (uc + 1.f) * (s + OAI_ALPHA * glu * (1.f - s)) : 0.f;
        du = (u >= -OAI_LIMIT && u <= OAI_LIMIT) ? d * glu : 0.f;
        return;
    }
    dg = d * u * act_grad(act, g);
    du = d * act_value(act, g);
}

// the two 16-byte packs of x (N, 2H) holding the gate and up values of VN consecutive outputs
// j..j+VN-1 of one row: split [gate | up] at j and H + j, interleaved (gate, up) pairs at 2j and 2j + VN
template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void load_gate_up_packs(const T* row, int j, int H, Pack16<T>& a, Pack16<T>& b) {
    constexpr int VN = Pack16<T>::N;
    a = Pack16<T>::load(row + (INTERLEAVED ? 2 * j : j));
    b = Pack16<T>::load(row + (INTERLEAVED ? 2 * j + VN : H + j));
}

// the gate and up values held by load_gate_up_packs' packs, in fp32
template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void unpack_gate_up(const Pack16<T>& a, const Pack16<T>& b, float* g, float* u) {
    constexpr int VN = Pack16<T>::N;
    if (INTERLEAVED) {
        for (int k = 0; k < VN / 2; ++k) {
            g[k] = to_float(a.v[2 * k]), u[k] = to_float(a.v[2 * k + 1]);
            g[VN / 2 + k] = to_float(b.v[2 * k]), u[VN / 2 + k] = to_float(b.v[2 * k + 1]);
        }
    } else {
        for (int k = 0; k < VN; ++k) g[k] = to_float(a.v[k]), u[k] = to_float(b.v[k]);
    }
}

// gate and up values of VN consecutive outputs j..j+VN-1 of one row of x (N, 2H)
template <typename T, bool INTERLEAVED>
__device__ __forceinline__ void load_gate_up(const T* row, int j, int H, float* g, float* u) {
    Pack16<T> a, b;
    load_gate_up_packs<T, INTERLEAVED>(row, j, H, a, b);
    unpack_gate_up<T, INTERLEAVED>(a, b, g, u);
}

// stores gate and up values (rounded to T) where load_gate_up read them; returns the max |bits|
template <typename T, bool INTERLEAVED>
__device__ __forceinline__ unsigned store_gate_up(T* row, int j, int H, const float* g, const float* u) {
    constexpr int VN = Pack16<T>::N;
    Pack16<T> a, b;
    if (INTERLEAVED) {
        for (int k = 0; k < VN / 2; ++k) {
            a.v[2 * k] = from_float<T>(g[k]), a.v[2 * k + 1] = from_float<T>(u[k]);
            b.v[2 * k] = from_float<T>(g[VN / 2 + k]), b.v[2 * k + 1] = from_float<T>(u[VN / 2 + k]);
        }
        a.store(row + 2 * j), b.store(row + 2 * j + VN);
    } else {
        for (int k = 0; k < VN; ++k) a.v[k] = from_float<T>(g[k]), b.v[k] = from_float<T>(u[k]);
        a.store(row + j), b.store(row + H + j);
    }
    unsigned m = 0;
    for (int k = 0; k < VN; ++k) m = max(m, max(abs_bits(to_float(a.v[k])), abs_bits(to_float(b.v[k]))));
    return m;
}

// ---- kernels ------------------------------------------------------------------------------

// Walks the grid-stride items i = row * cols + col of a (rows, cols) grid as (row, col), with one
// division per thread instead of one per item: a step adds (stride / cols, stride % cols) and carries.
// Loop while row < rows; no columns means no items.
struct RowColWalk {
    long long row = 0, drow = 0;
    int col = 0, dcol = 0, cols;
    __device__ __forceinline__ RowColWalk(long long rows, int cols_) : cols(cols_) {
        if (cols <= 0) {
            row = rows;
            return;
        }
        const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        const long long stride = (long long)gridDim.x * blockDim.x;
        row = start / cols, col = (int)(start % cols);
        drow = stride / cols, dcol = (int)(stride % cols);
    }
    __device__ __forceinline__ void next() {
        row += drow, col += dcol;
        if (col >= cols) col -= cols, ++row;
    }
};

#define GRID_STRIDE(i, total)                                                             \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (total); \
         i += (long long)gridDim.x * blockDim.x)

// Calls f(row, j, g, u) for every VN outputs j..j+VN-1 of every row of a gated activation's
// (N, H) output, g and u holding their gate and up values read from x (N, 2H) in the layout.
template <typename T, bool INTERLEAVED, typename F>
__device__ __forceinline__ void for_each_gated(const T* inp, long long N, int H, F&& f) {
    constexpr int VN = Pack16<T>::N;
    for (RowColWalk w(N, H / VN); w.row < N; w.next()) {
        const int j = w.col * VN;
        float g[VN], u[VN];
        load_gate_up<T, INTERLEAVED>(inp + (size_t)w.row * 2 * H, j, H, g, u);
        f((size_t)w.row, j, g, u);
    }
}

template <int K> struct alignas(K) Bytes { unsigned char b[K]; };

// The scale of an FP8 output: *scale_src (delayed scaling) when given, else from the abs-max in its stats
// slot, fp8_max / abs_max, 1 when abs_max is 0 or not finite. Block 0 writes scale and scale_inv beside the
// abs-max, which it only reads.
__device__ __forceinline__ float fp8_output_scale(float* slot, const float* scale_src, float fp8_max) {
    const float scale = scale_src ? *scale_src : fp8_scale(slot[STAT_ABS_MAX], fp8_max);
    if (blockIdx.x == 0 && threadIdx.x == 0) slot[STAT_SCALE] = scale, slot[STAT_SCALE_INV] = 1.f / scale;
    return scale;
}

// Where the values a thread computes go, VN at a time. By default T values, with |value|
// max-accumulated into the block's abs-max (slot may be null). QUANT: E4M3 bytes of value * scale
// (SATFINITE RNE), scale from fp8_output_scale (the output's FP8 stats are slot): 448 / abs_max, abs_max
// only read; or with scale_src *scale_src, |value| then max-accumulated into the abs-max. The values are
// rounded to T first either way, so the quantised output equals the T output followed by quantisation.
template <typename T, bool QUANT = false> struct VecStore {
    static constexpr int VN = Pack16<T>::N;
    void* out;
    float* slot;
    float scale = 1.f;
    bool record = !QUANT;  // max-accumulate |value| into slot
    unsigned amax = 0;
    __device__ __forceinline__ VecStore(void* out_, float* slot_, const float* scale_src = nullptr)
        : out(out_), slot(slot_) {
        if constexpr (QUANT) scale = fp8_output_scale(slot, scale_src, fp8_limits<fp8e4>::max), record = scale_src;
    }
    // out[i .. i + VN) = y
    __device__ __forceinline__ void operator()(size_t i, const Pack16<T>& y) {
        if (record)
            for (int k = 0; k < VN; ++k) amax = max(amax, abs_bits(to_float(y.v[k])));
        if constexpr (QUANT) {
            Bytes<VN> q;
            for (int k = 0; k < VN; ++k) q.b[k] = from_float<fp8e4>(to_float(y.v[k]) * scale).__x;
            *reinterpret_cast<Bytes<VN>*>(static_cast<fp8e4*>(out) + i) = q;
        } else {
            y.store(static_cast<T*>(out) + i);
        }
    }
    __device__ __forceinline__ void finish() {
        if (record && slot) block_atomic_abs_max(slot + STAT_ABS_MAX, amax);
    }
};

template <typename T, bool QUANT>
__device__ void plain_forward_impl(void* out, const T* inp, float* slot, const float* scale_src, int act,
                                   long long vecs) {
    constexpr int VN = Pack16<T>::N;
    VecStore<T, QUANT> store(out, slot, scale_src);
    GRID_STRIDE(i, vecs) {
        const Pack16<T> x = Pack16<T>::load(inp + i * VN);
        Pack16<T> y;
        for (int k = 0; k < VN; ++k) y.v[k] = from_float<T>(act_value(act, to_float(x.v[k])));
        store(i * VN, y);
    }
    store.finish();
}

template <typename T>
__device__ void plain_backward_impl(T* dinp, const T* dout, const T* inp, float* abs_max, int act,
                                    long long vecs) {
    constexpr int VN = Pack16<T>::N;
    VecStore<T> store(dinp, abs_max);
    GRID_STRIDE(i, vecs) {
        const Pack16<T> x = Pack16<T>::load(inp + i * VN), d = Pack16<T>::load(dout + i * VN);
        Pack16<T> y;
        for (int k = 0; k < VN; ++k) y.v[k] = from_float<T>(to_float(d.v[k]) * act_grad(act, to_float(x.v[k])));
        store(i * VN, y);
    }
    store.finish();
}

template <typename T, bool INTERLEAVED, bool QUANT>
__device__ void gated_forward_impl(void* out, const T* inp, float* slot, const float* scale_src, int act, long long N,
                                   int H) {
    constexpr int VN = Pack16<T>::N;
    VecStore<T, QUANT> store(out, slot, scale_src);
    for_each_gated<T, INTERLEAVED>(inp, N, H, [&](size_t row, int j, const float* g, const float* u) {
        Pack16<T> y;
        for (int k = 0; k < VN; ++k) y.v[k] = from_float<T>(gated_value(act, g[k], u[k]));
        store(row * H + j, y);
    });
    store.finish();
}

// The gated backwards fix the activation at compile time (a run-time switch per element cost two
// dispatches and two sigmoids per element) and take GATED_THREADS threads per block.
constexpr int GATED_THREADS = 256;

template <typename T, bool INTERLEAVED, int ACT>
__device__ __forceinline__ unsigned gated_grad_store(T* dinp, const Pack16<T>& a, const Pack16<T>& b,
                                                     const Pack16<T>& d, size_t row, int j, int H) {
    constexpr int VN = Pack16<T>::N;
    float g[VN], u[VN];
    unpack_gate_up<T, INTERLEAVED>(a, b, g, u);
    for (int e = 0; e < VN; ++e) gated_grad(ACT, g[e], u[e], to_float(d.v[e]), g[e], u[e]);
    return store_gate_up<T, INTERLEAVED>(dinp + row * 2 * H, j, H, g, u);
}

// One thread per 16-byte vector item i = row * (H / VN) + col of the (N, H) output, the grid covering
// every item (no stride loop: a loop of resident blocks, or cp.async staging of later trips, measured
// slower on the H200): its gate, up and dout packs are loaded into registers together, the gradient
// computed and stored. The activation is fixed at the kernel's entry (one uniform switch, each case a
// compiled-in body).
// With `out` (may be null) the item also writes the forward's output, as gated_forward writes it: a dropped
// activation is recomputed where its backward reads the same gate and up values (one pass over them fewer).
template <typename T, bool INTERLEAVED, int ACT>
__device__ __forceinline__ unsigned gated_backward_item(T* dinp, T* out, const T* dout, const T* inp, long long N,
                                                        int H) {
    constexpr int VN = Pack16<T>::N;
    const int hv = H / VN;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= N * hv) return 0;
    const long long row = i / hv;
    const int j = (int)(i - row * hv) * VN;
    Pack16<T> a, b;
    load_gate_up_packs<T, INTERLEAVED>(inp + (size_t)row * 2 * H, j, H, a, b);
    const Pack16<T> d = Pack16<T>::load(dout + (size_t)row * H + j);
    if (out) {
        float g[VN], u[VN];
        unpack_gate_up<T, INTERLEAVED>(a, b, g, u);
        Pack16<T> y;
        for (int k = 0; k < VN; ++k) y.v[k] = from_float<T>(gated_value(ACT, g[k], u[k]));
        y.store(out + (size_t)row * H + j);
    }
    return gated_grad_store<T, INTERLEAVED, ACT>(dinp, a, b, d, (size_t)row, j, H);
}

// The gated backward of one tile of TILE_ROWS rows by TILE_OUTS outputs that writes transposed FP8 copies:
// the forward's output as E4M3 into out_tp (H, N) (may be null), the bytes activation_forward_quant and then a
// byte transpose would write, for an FP8 weight-gradient GEMM that reads the dropped output's transposed
// copy; and with DQ dinp itself in FP8 (GradQ), as rows (N, 2H) and transposed (2H, N), in place of the T
// dinp. Thread (a, b) = (tid / 8, tid % 8) takes rows 4a..4a+3 and outputs 8b..8b+7 of the tile, all its
// loads issued before any use; the four rows' bytes of an output meet in one 32-bit word of shared memory
// (fp8.cu's transpose_tile: pitch 33 words, conflict-free both ways) and leave in 16-byte runs along N.
constexpr int TILE_ROWS = 128, TILE_OUTS = 64;

// The FP8 dinp of gated_backward_q_tp: bytes of round_T(gradient) * scale (SATFINITE RNE), E5M2 or E4M3.
struct GradQ {
    unsigned char* rows;  // (N, 2H), x's layout
    unsigned char* tp;    // (2H, N)
    float scale;
    bool e5m2;
    __device__ __forceinline__ unsigned byte(float v) const {
        return e5m2 ? from_float<fp8e5>(v * scale).__x : from_float<fp8e4>(v * scale).__x;
    }
};

// Writes one (TILE_OUTS, TILE_ROWS) tile of bytes from shared memory (word [c][w] = rows 4w..4w+3 of output c)
// to dst, output c of the tile going to row row_of(c) of the (rows, N) destination, in 16-byte runs.
template <typename F>
__device__ __forceinline__ void store_tile_tp(unsigned char* dst, const unsigned (*tile)[33], long long n0, int oc0,
                                              int H, long long N, F&& row_of) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int idx = threadIdx.x + 256 * h, run = idx % 8, c = idx / 8;
        const int oc = oc0 + c;
        const long long on = n0 + 16 * run;
        if (oc >= H || on >= N) continue;
        const uint4 w = make_uint4(tile[c][4 * run], tile[c][4 * run + 1], tile[c][4 * run + 2], tile[c][4 * run + 3]);
        unsigned char* out = dst + (size_t)row_of(oc) * N + on;
        if (N % 16 == 0) {
            *reinterpret_cast<uint4*>(out) = w;
        } else {
            const unsigned ws[4] = {w.x, w.y, w.z, w.w};
            for (int e = 0; e < 16 && on + e < N; ++e) out[e] = (unsigned char)(ws[e / 4] >> (8 * (e % 4)));
        }
    }
}

// tile: TILE_OUTS rows of shared words for out_tp, then (DQ) TILE_OUTS for dgate and TILE_OUTS for dup
template <typename T, bool INTERLEAVED, int ACT, bool DQ>
__device__ __forceinline__ unsigned gated_backward_tile_tp(T* dinp, const GradQ& gq, unsigned char* out_tp, float scale,
                                                           const T* dout, const T* inp, long long N, int H,
                                                           unsigned (*tile)[33]) {
    constexpr int VN = Pack16<T>::N, P = 8 / VN;  // packs per thread and row
    const int b = threadIdx.x % 8, a = threadIdx.x / 8;
    const int col_tiles = (H + TILE_OUTS - 1) / TILE_OUTS;
    const long long n0 = (long long)(blockIdx.x / col_tiles) * TILE_ROWS;
    const int oc0 = (int)(blockIdx.x % col_tiles) * TILE_OUTS, j0 = oc0 + 8 * b;
    Pack16<T> ga[4][P], ub[4][P], d[4][P];
    bool have[4][P];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const long long n = n0 + 4 * a + r;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = j0 + p * VN;
            have[r][p] = n < N && j < H;
            if (!have[r][p]) continue;
            load_gate_up_packs<T, INTERLEAVED>(inp + (size_t)n * 2 * H, j, H, ga[r][p], ub[r][p]);
            d[r][p] = Pack16<T>::load(dout + (size_t)n * H + j);
        }
    }
    unsigned words[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u}, m = 0;
    // the gradient's bytes go straight to their shared words (byte r of word [c][a]), not through registers
    unsigned char(*gbytes)[33][4] = reinterpret_cast<unsigned char(*)[33][4]>(tile + TILE_OUTS);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            if (!have[r][p]) continue;
            const size_t n = (size_t)(n0 + 4 * a + r);
            const int j = j0 + p * VN;
            float g[VN], u[VN];
            unpack_gate_up<T, INTERLEAVED>(ga[r][p], ub[r][p], g, u);
            if (out_tp) {
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    const float y = to_float(from_float<T>(gated_value(ACT, g[k], u[k])));
                    words[p * VN + k] |= (unsigned)from_float<fp8e4>(y * scale).__x << (8 * r);
                }
            }
            if constexpr (DQ) {
                Bytes<VN> qg, qu;
                Bytes<2 * VN> qi;
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    float dg, du;
                    gated_grad(ACT, g[k], u[k], to_float(d[r][p].v[k]), dg, du);
                    dg = to_float(from_float<T>(dg)), du = to_float(from_float<T>(du));
                    m = max(m, max(abs_bits(dg), abs_bits(du)));
                    const unsigned bg = gq.byte(dg), bu = gq.byte(du);
                    const int c = 8 * b + p * VN + k;
                    gbytes[c][a][r] = (unsigned char)bg, gbytes[TILE_OUTS + c][a][r] = (unsigned char)bu;
                    qg.b[k] = (unsigned char)bg, qu.b[k] = (unsigned char)bu;
                    qi.b[2 * k] = (unsigned char)bg, qi.b[2 * k + 1] = (unsigned char)bu;
                }
                unsigned char* row = gq.rows + n * 2 * H;
                if (INTERLEAVED) {
                    *reinterpret_cast<Bytes<2 * VN>*>(row + 2 * j) = qi;
                } else {
                    *reinterpret_cast<Bytes<VN>*>(row + j) = qg;
                    *reinterpret_cast<Bytes<VN>*>(row + H + j) = qu;
                }
            } else {
                m = max(m, gated_grad_store<T, INTERLEAVED, ACT>(dinp, ga[r][p], ub[r][p], d[r][p], n, j, H));
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) tile[8 * b + k][a] = words[k];
    __syncthreads();
    if (out_tp) store_tile_tp(out_tp, tile, n0, oc0, H, N, [](int oc) { return oc; });
    if constexpr (DQ) {
        store_tile_tp(gq.tp, tile + TILE_OUTS, n0, oc0, H, N, [](int oc) { return INTERLEAVED ? 2 * oc : oc; });
        store_tile_tp(gq.tp, tile + 2 * TILE_OUTS, n0, oc0, H, N,
                      [H](int oc) { return INTERLEAVED ? 2 * oc + 1 : H + oc; });
    }
    return m;
}

// The gated backward, one item per thread (out: T (N, H) or null), or with TP one tile per block (out:
// E4M3 (H, N) or null, scale its quantisation scale; with DQ dinp in FP8 as gq says; tile the block's rows of
// shared memory).
template <typename T, bool INTERLEAVED, int ACT, bool TP, bool DQ>
__device__ __forceinline__ unsigned gated_backward_body(T* dinp, const GradQ& gq, void* out, float scale,
                                                        const T* dout, const T* inp, long long N, int H,
                                                        unsigned (*tile)[33]) {
    if constexpr (TP)
        return gated_backward_tile_tp<T, INTERLEAVED, ACT, DQ>(dinp, gq, static_cast<unsigned char*>(out), scale,
                                                               dout, inp, N, H, tile);
    else
        return gated_backward_item<T, INTERLEAVED, ACT>(dinp, static_cast<T*>(out), dout, inp, N, H);
}

template <typename T, bool INTERLEAVED, bool TP, bool DQ = false>
__device__ void gated_backward_impl(T* dinp, const GradQ& gq, void* out, float scale, const T* dout, const T* inp,
                                    float* abs_max, int act, long long N, int H) {
    __shared__ unsigned tile[TP ? (DQ ? 3 : 1) * TILE_OUTS : 1][33];  // one array for every activation's body
    unsigned amax;
#define BODY(A) gated_backward_body<T, INTERLEAVED, A, TP, DQ>(dinp, gq, out, scale, dout, inp, N, H, tile)
    switch (act) {
        case ACT_SILU: amax = BODY(ACT_SILU); break;
        case ACT_GELU: amax = BODY(ACT_GELU); break;
        case ACT_RELU: amax = BODY(ACT_RELU); break;
        case ACT_RELU_SQ: amax = BODY(ACT_RELU_SQ); break;
        case ACT_SWIGLU_OAI: amax = BODY(ACT_SWIGLU_OAI); break;
        default: amax = BODY(ACT_SIGMOID);
    }
#undef BODY
    if (abs_max) block_atomic_abs_max(abs_max, amax);
}

// ---- launchers ----------------------------------------------------------------------------
// The `_quant` forwards take the e4m3 output and its stats slot where the others take out and abs_max.

#define GATED_KERNELS(SUF, T, LAYOUT, INTERLEAVED)                                                            \
    extern "C" __global__ void gated_forward_##LAYOUT##_##SUF(T* out, const T* inp, float* abs_max, int act,  \
                                                              long long N, int H) {                          \
        grid_dependency_wait();                                                                               \
        gated_forward_impl<T, INTERLEAVED, false>(out, inp, abs_max, nullptr, act, N, H);                     \
    }                                                                                                          \
    extern "C" __global__ void gated_forward_quant_##LAYOUT##_##SUF(fp8e4* out, const T* inp, float* stats,   \
                                                                    const float* scale_src, int act,         \
                                                                    long long N, int H) {                     \
        grid_dependency_wait();                                                                               \
        gated_forward_impl<T, INTERLEAVED, true>(out, inp, stats, scale_src, act, N, H);                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(GATED_THREADS)                                                \
        gated_backward_##LAYOUT##_##SUF(T* dinp, T* out, const T* dout, const T* inp, float* abs_max, int act, \
                                        long long N, int H) {                                                 \
        grid_dependency_wait();                                                                                \
        gated_backward_impl<T, INTERLEAVED, false>(dinp, GradQ{}, out, 1.f, dout, inp, abs_max, act, N, H);    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(GATED_THREADS) gated_backward_quant_tp_##LAYOUT##_##SUF(      \
        T* dinp, fp8e4* out_tp, float* stats, const float* scale_src, const T* dout, const T* inp,             \
        float* abs_max, int act, long long N, int H) {                                                         \
        grid_dependency_wait();                                                                                \
        const float scale = fp8_output_scale(stats, scale_src, fp8_limits<fp8e4>::max);                        \
        gated_backward_impl<T, INTERLEAVED, true>(dinp, GradQ{}, out_tp, scale, dout, inp, abs_max, act, N, H); \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(GATED_THREADS) gated_backward_q_tp_##LAYOUT##_##SUF(          \
        unsigned char* dinp_q, unsigned char* dinp_tp, float* dinp_stats, const float* dinp_scale,             \
        fp8e4* out_tp, float* out_stats, const float* out_scale, const T* dout, const T* inp, int act,         \
        long long N, int H, int e5m2) {                                                                        \
        grid_dependency_wait();                                                                                \
        const float fmax = e5m2 ? fp8_limits<fp8e5>::max : fp8_limits<fp8e4>::max;                              \
        const GradQ gq{dinp_q, dinp_tp, fp8_output_scale(dinp_stats, dinp_scale, fmax), e5m2 != 0};            \
        const float scale = out_tp ? fp8_output_scale(out_stats, out_scale, fp8_limits<fp8e4>::max) : 1.f;     \
        gated_backward_impl<T, INTERLEAVED, true, true>(nullptr, gq, out_tp, scale, dout, inp,                  \
                                                        dinp_stats + STAT_ABS_MAX, act, N, H);                 \
    }

#define ACTIVATION_KERNELS(SUF, T)                                                                             \
    extern "C" __global__ void act_forward_##SUF(T* out, const T* inp, float* abs_max, int act,              \
                                                 long long vecs) {                                          \
        grid_dependency_wait();                                                                              \
        plain_forward_impl<T, false>(out, inp, abs_max, nullptr, act, vecs);                                          \
    }                                                                                                          \
    extern "C" __global__ void act_forward_quant_##SUF(fp8e4* out, const T* inp, float* stats,               \
                                                       const float* scale_src, int act, long long vecs) {   \
        grid_dependency_wait();                                                                              \
        plain_forward_impl<T, true>(out, inp, stats, scale_src, act, vecs);                                  \
    }                                                                                                          \
    extern "C" __global__ void act_backward_##SUF(T* dinp, const T* dout, const T* inp, float* abs_max,       \
                                                  int act, long long vecs) {                                \
        grid_dependency_wait();                                                                              \
        plain_backward_impl<T>(dinp, dout, inp, abs_max, act, vecs);                                         \
    }                                                                                                          \
    GATED_KERNELS(SUF, T, split, false)                                                                        \
    GATED_KERNELS(SUF, T, interleaved, true)
ACTIVATION_KERNELS(f32, float)
ACTIVATION_KERNELS(bf16, bf16)
ACTIVATION_KERNELS(f16, half)
