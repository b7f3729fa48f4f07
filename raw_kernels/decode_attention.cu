// Decode attention over a KV cache (flash-decoding, GQA), and the RoPE + cache append that feeds it.
//
//   rope_kv_append:  qkv (n, (Hq + 2*Hkv) * hs), in place: when rotate, the q and k heads of row r are
//                    rotated at position positions[r] (=), with exactly rope.cu's expression
//                    (out1 = x1 c - x2 s, out2 = x2 c + x1 s, fp32 math, one rounding); then
//                    k_cache[slots[r], g, positions[r], :] = k head g and v_cache[...] = v head g   (=)
//   decode_attention_split: block (split s, kv head g and q-head tile, row i) over its chunk of the
//                    positions [0, lengths[i]) of cache slot i, for every q head of the tile:
//                    m = max_p s_p, l = sum_p 2^(s_p - m), o = sum_p 2^(s_p - m) v_p with
//                    s_p = q.k_p / sqrt(hs) * log2(e), written to the scratch's partials (=). A row
//                    whose whole length is one chunk gets out = o / l from its only block (=).
//                    fused: the last split block of a (row, tile) to finish (a counter in the scratch)
//                    then merges the partials of its heads into out itself (=): no second launch.
//   decode_attention_combine: (when not fused) out[i, h] = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s (=)
// fp32 math throughout; out is rounded once; merges run in a fixed order (deterministic). Every kernel
// here may be launched as a programmatic dependent (common.cuh): it waits for its predecessor first.
// The chunk of a split is chosen on the device from the row's own length: chunk = max(ceil(len / S), MIN_CHUNK), so
// every length keeps up to S splits busy and a replayed graph adapts to the lengths. Lengths and
// positions outside the cache are clamped (attention) or skipped (append) on the device; the launchers
// check what the host can see.
// Scratch (fp32): [counters | partials]. A counter is 64 bits of arrivals; it must be zero before the
// first launch (decode_attention.py: zero the scratch once), and the last arrival of every launch sets it
// back to zero. One atomicAdd per split: a compare-and-swap loop made the splits that arrive together
// retry one after another, which the H200 profile showed as most of a 9-split merge's cost.
#include "common.cuh"

template <typename T, int P> struct alignas(sizeof(T) * P) Vec {
    T v[P];
};
// The cos/sin table a model dtype uses (kernels/rope.py: fp16 for bf16 models, which keeps more mantissa)
template <typename T> struct RopeTable { using F = float; };
template <> struct RopeTable<bf16> { using F = half; };

constexpr int MIN_CHUNK = 128;  // fewest positions per split (decode_attention.py: _MIN_CHUNK)
constexpr int NW = 4;          // warps per split block
#define NEG_INF (-__int_as_float(0x7f800000))

// ---- rope + append ------------------------------------------------------------------------

// One block per row; a thread handles P elements of x1 and the matching P of x2 of one head.
template <typename T, typename F, int P>
__device__ void rope_kv_append_impl(T* qkv, T* k_cache, T* v_cache, const int* slots, const int* positions,
                                    const F* freqs, int Hq, int Hkv, int hs, int max_batch, int max_seq,
                                    int max_pos, bool rotate) {
    launch_dependents();
    grid_dependency_wait();  // qkv, slots and positions come from the kernels before
    const int r = blockIdx.x;
    const int slot = slots[r], pos = positions[r];
    if (slot < 0 || slot >= max_batch || pos < 0 || pos >= max_seq || (rotate && pos >= max_pos)) return;
    const int half = hs / 2, hv = half / P, H = Hq + 2 * Hkv;
    T* x = qkv + (size_t)r * H * hs;
    const F* f = freqs + (size_t)pos * hs;
    for (int it = (rotate ? 0 : Hq * hv) + threadIdx.x; it < H * hv; it += blockDim.x) {
        const int h = it / hv, j = (it - h * hv) * P;
        T* src = x + (size_t)h * hs + j;
        Vec<T, P> y1 = *reinterpret_cast<const Vec<T, P>*>(src);
        Vec<T, P> y2 = *reinterpret_cast<const Vec<T, P>*>(src + half);
        if (rotate && h < Hq + Hkv) {
#pragma unroll
            for (int k = 0; k < P; ++k) {
                const float a = to_float(y1.v[k]), bb = to_float(y2.v[k]);
                const float c = to_float(f[j + k]), sk = to_float(f[half + j + k]);
                y1.v[k] = from_float<T>(a * c - bb * sk);  // rope.cu's expression, rounded once
                y2.v[k] = from_float<T>(bb * c + a * sk);
            }
            *reinterpret_cast<Vec<T, P>*>(src) = y1;
            *reinterpret_cast<Vec<T, P>*>(src + half) = y2;
        }
        if (h >= Hq) {
            const bool is_k = h < Hq + Hkv;
            const int g = is_k ? h - Hq : h - Hq - Hkv;
            T* dst = (is_k ? k_cache : v_cache) + (((size_t)slot * Hkv + g) * max_seq + pos) * hs + j;
            *reinterpret_cast<Vec<T, P>*>(dst) = y1;
            *reinterpret_cast<Vec<T, P>*>(dst + half) = y2;
        }
    }
}

// ---- attention ----------------------------------------------------------------------------

// The chunk of positions of split s for a row of length len; nact = the splits that have work.
__device__ __forceinline__ void split_range(int len, int S, int s, int& p0, int& p1, int& nact) {
    const int chunk = max((len + S - 1) / S, MIN_CHUNK);
    nact = (len + chunk - 1) / chunk;
    p0 = s * chunk;
    p1 = min(len, p0 + chunk);
}

template <typename T, int VN> __device__ __forceinline__ void load_floats(const T* p, float (&out)[VN]) {
    const Vec<T, VN> w = *reinterpret_cast<const Vec<T, VN>*>(p);
#pragma unroll
    for (int k = 0; k < VN; ++k) out[k] = to_float(w.v[k]);
}

// Merge the softmax state (m, l, o) of another lane group into ours; -inf means "saw nothing".
template <int NE> __device__ __forceinline__ void merge_state(float& m, float& l, float (&o)[NE], float mo,
                                                              float lo, const float (&oo)[NE]) {
    const float mn = fmaxf(m, mo);
    const float a = m == NEG_INF ? 0.f : exp2f(m - mn), b = mo == NEG_INF ? 0.f : exp2f(mo - mn);
    l = l * a + lo * b;
#pragma unroll
    for (int e = 0; e < NE; ++e) o[e] = o[e] * a + oo[e] * b;
    m = mn;
}

// Count one split's arrival on its (row, tile) counter; true for the last of the nact splits, which
// also resets the counter to zero. Called by one thread after the block's partials are written.
__device__ bool arrive(unsigned long long* counter, unsigned nact) {
    __threadfence();  // the partials are visible before the arrival is
    if (atomicAdd(counter, 1ull) + 1 < nact) return false;
    atomicExch(counter, 0ull);
    __threadfence();  // the other splits' partials are read after their arrivals were seen
    return true;
}

// The fused merge, by the last split block of a tile: a warp per head finds M = max_s m_s and the weights
// 2^(m_s - M) (shared memory, (GM, S)), then every output element of the tile sums its splits in order.
// Loads go out MERGE_OUT outputs x MERGE_T splits at a time, so a merge of n splits costs a few L2 round
// trips rather than one per split and output.
constexpr int MERGE_OUT = 4, MERGE_T = 8;
template <typename T>
__device__ void merge_partials(T* out, const float* partials, int Hq, int hs, int S, int i, int h0, int gt, int nact) {
    extern __shared__ float sm_wt[];  // (gt, S)
    __shared__ float sm_L[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int hh = warp; hh < gt; hh += NW) {
        const float* ph = partials + ((size_t)i * Hq + h0 + hh) * S * (hs + 2);
        // nact <= _FUSE_MAX_SPLITS = 32: one split's (m, l) per lane, both loaded in one round trip
        const float m = lane < nact ? __ldcg(ph + (size_t)lane * (hs + 2) + hs) : NEG_INF;
        const float l = lane < nact ? __ldcg(ph + (size_t)lane * (hs + 2) + hs + 1) : 0.f;
        float M = m;
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        const float w = m == NEG_INF ? 0.f : exp2f(m - M);
        if (lane < nact) sm_wt[hh * S + lane] = w;
        const float L = warp_sum(lane < nact ? w * l : 0.f);
        if (lane == 0) sm_L[hh] = L;
    }
    __syncthreads();
    const int total = gt * hs;
    for (int base = threadIdx.x; base < total; base += blockDim.x * MERGE_OUT) {
        const float* pe[MERGE_OUT];
        int hh[MERGE_OUT];
        float acc[MERGE_OUT];
#pragma unroll
        for (int k = 0; k < MERGE_OUT; ++k) {
            const int idx = min(base + k * (int)blockDim.x, total - 1);  // past the end: a valid address, no store
            hh[k] = idx / hs;
            pe[k] = partials + ((size_t)i * Hq + h0 + hh[k]) * S * (hs + 2) + (idx - hh[k] * hs);
            acc[k] = 0.f;
        }
        for (int t0 = 0; t0 < nact; t0 += MERGE_T) {
            float v[MERGE_OUT][MERGE_T];
#pragma unroll
            for (int k = 0; k < MERGE_OUT; ++k)
#pragma unroll
                for (int j = 0; j < MERGE_T; ++j) v[k][j] = t0 + j < nact ? __ldcg(pe[k] + (size_t)(t0 + j) * (hs + 2)) : 0.f;
#pragma unroll
            for (int k = 0; k < MERGE_OUT; ++k)
#pragma unroll
                for (int j = 0; j < MERGE_T; ++j)
                    if (t0 + j < nact) acc[k] += sm_wt[hh[k] * S + t0 + j] * v[k][j];
        }
#pragma unroll
        for (int k = 0; k < MERGE_OUT; ++k) {
            const int idx = base + k * (int)blockDim.x;
            if (idx < total)
                out[(size_t)i * Hq * hs + (size_t)h0 * hs + idx] = from_float<T>(sm_L[hh[k]] > 0.f ? acc[k] / sm_L[hh[k]] : 0.f);
        }
    }
}

// Lanes come in groups of LP; a group works on one cache position at a time, each lane on NV vectors of
// VN consecutive elements (lane li of a group owns elements (v * LP + li) * VN ... + VN). The block's
// NW * 32 / LP groups walk the chunk U positions each per step, every group keeping its own online
// softmax state for the GM q heads of the tile, so K and V of the kv head are read once for all of them.
// The groups' states are merged through shuffles, then across warps through shared memory.
template <typename T, int VN, int NV, int LP, int GM, int U>
__device__ void split_impl(float* scratch, T* out, const T* qkv, T* k_cache, T* v_cache,
                           const int* lengths, int Hq, int Hkv, int hs, int max_seq, int S, int tiles, int tile_heads,
                           float scale_log2, long long part_offset, bool fused,
                           const typename RopeTable<T>::F* freqs, int max_pos) {
    constexpr int NE = VN * NV, NG = NW * 32 / LP, HSMAX = LP * NE;
    alignas(16) __shared__ float sm_q[GM][HSMAX];
    alignas(16) __shared__ T sm_new[2][HSMAX];  // with the append: this row's rotated k and its v, kv head g
    __shared__ float sm_o[NW][GM][HSMAX], sm_m[NW][GM], sm_l[NW][GM];
    launch_dependents();
    grid_dependency_wait();  // q, the cache and the lengths come from the kernels before
    const int s = blockIdx.x, i = blockIdx.z;
    const int g = blockIdx.y / tiles, tile = blockIdx.y - g * tiles;
    const int group = Hq / Hkv, h0 = g * group + tile * tile_heads;
    const int gt = min(tile_heads, group - tile * tile_heads);
    const int len = min(max(lengths[i], 0), max_seq);
    int p0, p1, nact;
    split_range(len, S, s, p0, p1, nact);
    if (s >= max(nact, 1) || gt <= 0) return;  // split 0 of an empty row stays, to write zeros

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, li = lane % LP, gi = threadIdx.x / LP;
    const size_t row = (size_t)(Hq + 2 * Hkv) * hs;
    const size_t base = ((size_t)i * Hkv + g) * max_seq * hs;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    // With freqs (the fused rope + append): q and the new k are rotated at pos = len - 1 here, the new k
    // and v are appended to the cache by split 0, and position pos is read from shared memory.
    const int pos = len - 1;
    const bool append = freqs != nullptr && len >= 1 && pos < max_pos;
    // The U positions of this group in the step at `step` (zeros past p1), K or V; position pos from
    // `fresh` (shared memory) when given.
    const auto load_step = [&](Vec<T, VN>(&r)[U][NV], const T* cache, int step, const T* fresh) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = step + u * NG + gi;
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                const int e0 = (v * LP + li) * VN;
                if (p < p1 && e0 < hs) {
                    const T* src = fresh != nullptr && p == pos ? fresh + e0 : cache + (size_t)p * hs + e0;
                    r[u][v] = *reinterpret_cast<const Vec<T, VN>*>(src);
                } else {
#pragma unroll
                    for (int k = 0; k < VN; ++k) r[u][v].v[k] = from_float<T>(0.f);
                }
            }
        }
    };
    const T* fresh_k = append ? sm_new[0] : nullptr;
    const T* fresh_v = append ? sm_new[1] : nullptr;
    // The first step's K and V are in flight while q is staged (position pos patched after the staging);
    // later steps load K(next) during the softmax and V(next) during the next scores, so one block walks
    // a long chunk at memory speed.
    Vec<T, VN> kr[U][NV], vr[U][NV];
    load_step(kr, kb, p0, nullptr);
    load_step(vr, vb, p0, nullptr);
    if (append) {
        // rope.cu's expression (fp32 math, one rounding to T), then q pre-scaled as below
        const auto rotate = [&](const T* x, int e) {
            const int half = hs / 2, j = e < half ? e : e - half;
            const float a = to_float(x[j]), bb = to_float(x[j + half]);
            const float c = to_float(freqs[(size_t)pos * hs + j]), sk = to_float(freqs[(size_t)pos * hs + half + j]);
            return from_float<T>(e < half ? a * c - bb * sk : bb * c + a * sk);
        };
        for (int idx = threadIdx.x; idx < GM * HSMAX; idx += blockDim.x) {
            const int hh = idx / HSMAX, e = idx - hh * HSMAX;
            sm_q[hh][e] = hh < gt && e < hs ? to_float(rotate(qkv + i * row + (size_t)(h0 + hh) * hs, e)) * scale_log2
                                            : 0.f;
        }
        for (int e = threadIdx.x; e < hs; e += blockDim.x) {
            sm_new[0][e] = rotate(qkv + i * row + (size_t)(Hq + g) * hs, e);
            sm_new[1][e] = qkv[i * row + (size_t)(Hq + Hkv + g) * hs + e];
        }
    } else if (threadIdx.x < LP) {
        // q of the tile, pre-scaled, in shared memory: registers go to the U positions in flight instead
#pragma unroll
        for (int hh = 0; hh < GM; ++hh)
#pragma unroll
            for (int v = 0; v < NV; ++v) {
                const int e0 = (v * LP + li) * VN;
                float t[VN];
                if (hh < gt && e0 < hs) {
                    load_floats<T, VN>(qkv + i * row + (size_t)(h0 + hh) * hs + e0, t);
                } else {
#pragma unroll
                    for (int k = 0; k < VN; ++k) t[k] = 0.f;
                }
#pragma unroll
                for (int k = 0; k < VN; ++k) sm_q[hh][e0 + k] = t[k] * scale_log2;
            }
    }
    __syncthreads();
    if (append) {
        if (s == 0 && tile == 0)
            for (int e = threadIdx.x; e < hs; e += blockDim.x) {
                k_cache[base + (size_t)pos * hs + e] = sm_new[0][e];
                v_cache[base + (size_t)pos * hs + e] = sm_new[1][e];
            }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (p0 + u * NG + gi == pos)
#pragma unroll
                for (int v = 0; v < NV; ++v) {
                    const int e0 = (v * LP + li) * VN;
                    if (e0 < hs) {
                        kr[u][v] = *reinterpret_cast<const Vec<T, VN>*>(sm_new[0] + e0);
                        vr[u][v] = *reinterpret_cast<const Vec<T, VN>*>(sm_new[1] + e0);
                    }
                }
    }

    float m[GM], l[GM], o[GM][NE];
#pragma unroll
    for (int hh = 0; hh < GM; ++hh) {
        m[hh] = NEG_INF;
        l[hh] = 0.f;
#pragma unroll
        for (int e = 0; e < NE; ++e) o[hh][e] = 0.f;
    }
    // The trip count is uniform over the block: the shuffles below need every lane of a warp.
    for (int step = p0; step < p1; step += NG * U) {
        const int next = step + NG * U;
        float sc[U][GM];
#pragma unroll
        for (int hh = 0; hh < GM; ++hh) {
            float qv[NE];
#pragma unroll
            for (int v = 0; v < NV; ++v)
#pragma unroll
                for (int k = 0; k < VN; ++k) qv[v * VN + k] = sm_q[hh][(v * LP + li) * VN + k];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float d = 0.f;
#pragma unroll
                for (int v = 0; v < NV; ++v)
#pragma unroll
                    for (int k = 0; k < VN; ++k) d += qv[v * VN + k] * to_float(kr[u][v].v[k]);
                sc[u][hh] = d;
            }
        }
        if (next < p1) load_step(kr, kb, next, fresh_k);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int hh = 0; hh < GM; ++hh) {
                float d = sc[u][hh];
#pragma unroll
                for (int off = LP / 2; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
                sc[u][hh] = step + u * NG + gi < p1 ? d : NEG_INF;
            }
#pragma unroll
        for (int hh = 0; hh < GM; ++hh) {
            float mx = sc[0][hh];
#pragma unroll
            for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][hh]);
            const float mn = fmaxf(m[hh], mx);
            if (mn == NEG_INF) continue;  // this group has no position yet (uniform within the group)
            const float corr = exp2f(m[hh] - mn);
            float pu[U];
#pragma unroll
            for (int u = 0; u < U; ++u) pu[u] = exp2f(sc[u][hh] - mn);
            float lsum = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) lsum += pu[u];
            l[hh] = l[hh] * corr + lsum;
#pragma unroll
            for (int v = 0; v < NV; ++v)
#pragma unroll
                for (int k = 0; k < VN; ++k) {
                    float acc = o[hh][v * VN + k] * corr;
#pragma unroll
                    for (int u = 0; u < U; ++u) acc += pu[u] * to_float(vr[u][v].v[k]);
                    o[hh][v * VN + k] = acc;
                }
            m[hh] = mn;
        }
        if (next < p1) load_step(vr, vb, next, fresh_v);
    }
    // merge the groups of each warp, then the warps
#pragma unroll
    for (int off = LP; off < 32; off *= 2) {
#pragma unroll
        for (int hh = 0; hh < GM; ++hh) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[hh], off);
            const float lo = __shfl_xor_sync(0xffffffffu, l[hh], off);
            float oo[NE];
#pragma unroll
            for (int e = 0; e < NE; ++e) oo[e] = __shfl_xor_sync(0xffffffffu, o[hh][e], off);
            merge_state<NE>(m[hh], l[hh], o[hh], mo, lo, oo);
        }
    }
    if (lane < LP) {
#pragma unroll
        for (int hh = 0; hh < GM; ++hh) {
#pragma unroll
            for (int v = 0; v < NV; ++v)
#pragma unroll
                for (int k = 0; k < VN; ++k) sm_o[warp][hh][(v * LP + li) * VN + k] = o[hh][v * VN + k];
            if (lane == 0) {
                sm_m[warp][hh] = m[hh];
                sm_l[warp][hh] = l[hh];
            }
        }
    }
    __syncthreads();
    float* partials = scratch + part_offset;
    for (int idx = threadIdx.x; idx < gt * hs; idx += blockDim.x) {
        const int hh = idx / hs, e = idx - hh * hs;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][hh]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float a = sm_m[w][hh] == NEG_INF ? 0.f : exp2f(sm_m[w][hh] - M);
            L += sm_l[w][hh] * a;
            O += sm_o[w][hh][e] * a;
        }
        const int h = h0 + hh;
        if (nact <= 1) {
            out[(size_t)i * Hq * hs + (size_t)h * hs + e] = from_float<T>(L > 0.f ? O / L : 0.f);
        } else {
            float* part = partials + (((size_t)i * Hq + h) * S + s) * (hs + 2);
            part[e] = O;
            if (e == 0) {
                part[hs] = M;
                part[hs + 1] = L;
            }
        }
    }
    if (nact <= 1 || !fused) return;
    __shared__ bool s_last;
    __threadfence();  // each thread's partials reach the device before the block's arrival
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long* counters = reinterpret_cast<unsigned long long*>(scratch);
        s_last = arrive(counters + (size_t)i * gridDim.y + blockIdx.y, (unsigned)nact);
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    merge_partials<T>(out, partials, Hq, hs, S, i, h0, gt, nact);
}

// One block per (row, q head) of the rows with two splits or more: weights 2^(m_s - M) of the active
// splits in shared memory, then every output element sums its splits in a fixed order.
template <typename T>
__device__ void combine_impl(T* out, const float* scratch, const int* lengths, int Hq, int hs, int max_seq, int S,
                             long long part_offset) {
    extern __shared__ float sm_w[];  // (S,)
    __shared__ float red[32];
    launch_dependents();
    grid_dependency_wait();  // the partials come from the split kernel
    const int i = blockIdx.x / Hq, h = blockIdx.x - i * Hq;
    const int len = min(max(lengths[i], 0), max_seq);
    int p0, p1, nact;
    split_range(len, S, 0, p0, p1, nact);
    if (nact <= 1) return;  // its split wrote the output
    const float* part = scratch + part_offset + ((size_t)i * Hq + h) * S * (hs + 2);
    float M = NEG_INF;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) M = fmaxf(M, part[(size_t)s * (hs + 2) + hs]);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = M;
    __syncthreads();
    M = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) M = fmaxf(M, red[w]);
    float L = 0.f;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) {
        const float* ps = part + (size_t)s * (hs + 2);
        const float w = ps[hs] == NEG_INF ? 0.f : exp2f(ps[hs] - M);
        sm_w[s] = w;
        L += w * ps[hs + 1];
    }
    L = block_sum(L, red);  // syncs first, so red is free again and sm_w is complete
    for (int e = threadIdx.x; e < hs; e += blockDim.x) {
        float acc = 0.f;
#pragma unroll 8
        for (int s = 0; s < nact; ++s) acc += sm_w[s] * part[(size_t)s * (hs + 2) + e];
        out[(size_t)i * Hq * hs + (size_t)h * hs + e] = from_float<T>(L > 0.f ? acc / L : 0.f);
    }
}

// ---- launchers ----------------------------------------------------------------------------

#define ROPE_APPEND_KERNEL(SUF, T, SUFF, F, P, PN)                                                             \
    extern "C" __global__ void __launch_bounds__(128) rope_kv_append_##SUF##_##SUFF##_##PN(                    \
        T* qkv, T* k_cache, T* v_cache, const int* slots, const int* positions, const F* freqs, int Hq,        \
        int Hkv, int hs, int max_batch, int max_seq, int max_pos, int rotate) {                                \
        rope_kv_append_impl<T, F, P>(qkv, k_cache, v_cache, slots, positions, freqs, Hq, Hkv, hs, max_batch,   \
                                     max_seq, max_pos, rotate != 0);                                           \
    }
#define ROPE_APPEND_KERNELS(SUF, T)                                  \
    ROPE_APPEND_KERNEL(SUF, T, f32, float, Pack16<T>::N, vec)        \
    ROPE_APPEND_KERNEL(SUF, T, f32, float, 1, scalar)                \
    ROPE_APPEND_KERNEL(SUF, T, f16, half, Pack16<T>::N, vec)         \
    ROPE_APPEND_KERNEL(SUF, T, f16, half, 1, scalar)
ROPE_APPEND_KERNELS(f32, float)
ROPE_APPEND_KERNELS(bf16, bf16)

// Names: decode_attention_split_<dtype>_<layout>_g<GM>, layout = v<LP> (16-byte vectors, LP lanes per
// position), v32x2 (two vectors per lane) or gen (any even hs: 2-element vectors, a warp per position).
#define SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, GM)                                                           \
    extern "C" __global__ void __launch_bounds__(NW * 32) decode_attention_split_##SUF##_##LAYOUT##_g##GM(     \
        float* scratch, T* out, const T* qkv, T* k_cache, T* v_cache, const int* lengths, int Hq, int Hkv,      \
        int hs, int max_seq, int S, int tiles, int tile_heads, float scale_log2, long long part_offset,          \
        int fused, const RopeTable<T>::F* freqs, int max_pos) {                                                 \
        split_impl<T, VN, NV, LP, GM, 4>(scratch, out, qkv, k_cache, v_cache, lengths, Hq, Hkv, hs, max_seq, S, \
                                         tiles, tile_heads, scale_log2, part_offset, fused != 0, freqs,        \
                                         max_pos);                                                              \
    }
#define SPLIT_KERNELS_G(SUF, T, LAYOUT, VN, NV, LP) \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 1)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 2)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 4)     \
    SPLIT_KERNEL(SUF, T, LAYOUT, VN, NV, LP, 8)
SPLIT_KERNELS_G(bf16, bf16, v8, 8, 1, 8)
SPLIT_KERNELS_G(bf16, bf16, v16, 8, 1, 16)
SPLIT_KERNELS_G(bf16, bf16, v32, 8, 1, 32)
SPLIT_KERNELS_G(bf16, bf16, gen, 2, 4, 32)
SPLIT_KERNELS_G(f32, float, v8, 4, 1, 8)
SPLIT_KERNELS_G(f32, float, v16, 4, 1, 16)
SPLIT_KERNELS_G(f32, float, v32, 4, 1, 32)
SPLIT_KERNELS_G(f32, float, v32x2, 4, 2, 32)
SPLIT_KERNELS_G(f32, float, gen, 2, 4, 32)

#define COMBINE_KERNEL(SUF, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) decode_attention_combine_##SUF(                          \
        T* out, const float* scratch, const int* lengths, int Hq, int hs, int max_seq, int S,                  \
        long long part_offset) {                                                                               \
        combine_impl<T>(out, scratch, lengths, Hq, hs, max_seq, S, part_offset);                               \
    }
COMBINE_KERNEL(f32, float)
COMBINE_KERNEL(bf16, bf16)
