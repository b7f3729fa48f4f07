// Decode attention device code (flash-decoding over the KV cache), shared by decode_attention.cu (its own
// launches) and decode_layers.cu (a phase of the persistent decode step). decode_attention.cu's header
// has the contract.
#pragma once
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

// The threads that run one attention block: the whole block (TEAM -1, decode_attention.cu's kernels of
// NW warps), or half of a persistent kernel's 2 * NW warps (TEAM 0 or 1), synchronised by named barrier
// 1 + TEAM so that the two halves work on different blocks independently.
template <int TEAM> __device__ __forceinline__ int team_thread() { return TEAM < 0 ? threadIdx.x : threadIdx.x - TEAM * NW * 32; }
template <int TEAM> __device__ __forceinline__ void team_sync() {
    if constexpr (TEAM < 0) {
        __syncthreads();
    } else {
        named_barrier(1 + TEAM, NW * 32);
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

// VN values written earlier in the launch (through L2, element by element: only q is read this way)
template <typename T, int VN> __device__ __forceinline__ void load_floats(const T* p, float (&out)[VN]) {
#pragma unroll
    for (int k = 0; k < VN; ++k) out[k] = to_float(load_cg(p + k));
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
// HEAD_OUT: out points at the tile's own gt * hs values (decode_attention_o.cu's shared memory), not the rows'.
constexpr int MERGE_OUT = 4, MERGE_T = 8;
template <typename T, int TEAM, bool HEAD_OUT = false>
__device__ void merge_partials(T* out, float* sm_wt, const float* partials, int Hq, int hs, int S, int i, int h0,
                               int gt, int nact) {
    __shared__ float sm_L[32];
    const int tid = team_thread<TEAM>(), lane = tid % 32, warp = tid / 32;
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
    team_sync<TEAM>();
    const int total = gt * hs;
    for (int base = tid; base < total; base += NW * 32 * MERGE_OUT) {
        const float* pe[MERGE_OUT];
        int hh[MERGE_OUT];
        float acc[MERGE_OUT];
#pragma unroll
        for (int k = 0; k < MERGE_OUT; ++k) {
            const int idx = min(base + k * NW * 32, total - 1);  // past the end: a valid address, no store
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
            const int idx = base + k * NW * 32;
            if (idx < total)
                out[HEAD_OUT ? idx : (size_t)i * Hq * hs + (size_t)h0 * hs + idx] =
                    from_float<T>(sm_L[hh[k]] > 0.f ? acc[k] / sm_L[hh[k]] : 0.f);
        }
    }
}

// Lanes come in groups of LP; a group works on one cache position at a time, each lane on NV vectors of
// VN consecutive elements (lane li of a group owns elements (v * LP + li) * VN ... + VN). The block's
// NW * 32 / LP groups walk the chunk U positions each per step, every group keeping its own online
// softmax state for the GM q heads of the tile, so K and V of the kv head are read once for all of them.
// The groups' states are merged through shuffles, then across warps through shared memory.
// The block's coordinates (split s, kv head and tile y of ny, row i) are arguments, so that a persistent
// kernel can run it as TEAM 0 or 1 (threads 0-127 or 128-255 of its block, each on blocks of its own).
// `wait` runs once before anything the kernels before it wrote is read: griddepcontrol.wait in
// decode_attention.cu, nothing in decode_layers.cu (its phase already waited). Before it the block reads
// the row's length and, with the fused append, its first step of K and V: those were written by earlier
// decode steps or the prefill (the contract in kernels/decode_attention.py), and position len - 1, which
// this launch appends, is replaced from shared memory after the wait.
template <typename T, int VN, int NV, int LP, int GM, int U, int TEAM = -1, bool HEAD_OUT = false, typename Wait>
__device__ void split_impl(float* scratch, T* out, const T* qkv, T* k_cache, T* v_cache,
                           const int* lengths, int Hq, int Hkv, int hs, int max_seq, int S, int tiles, int tile_heads,
                           float scale_log2, long long part_offset, bool fused,
                           const typename RopeTable<T>::F* freqs, int max_pos, int s, int y, int i, int ny,
                           float* sm_wt, Wait wait) {
    constexpr int NE = VN * NV, NG = NW * 32 / LP, HSMAX = LP * NE;
    alignas(16) __shared__ float sm_q[GM][HSMAX];
    alignas(16) __shared__ T sm_new[2][HSMAX];  // with the append: this row's rotated k and its v, kv head g
    __shared__ float sm_cs[HSMAX];               // with the append: the cos | sin row of position len - 1
    __shared__ float sm_o[NW][GM][HSMAX], sm_m[NW][GM], sm_l[NW][GM];
    const int g = y / tiles, tile = y - g * tiles;
    const int group = Hq / Hkv, h0 = g * group + tile * tile_heads;
    const int gt = min(tile_heads, group - tile * tile_heads);
    const int len = min(max(lengths[i], 0), max_seq);
    int p0, p1, nact;
    split_range(len, S, s, p0, p1, nact);
    if (s >= max(nact, 1) || gt <= 0) return;  // split 0 of an empty row stays, to write zeros

    const int tid = team_thread<TEAM>(), lane = tid % 32, warp = tid / 32, li = lane % LP, gi = tid / LP;
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
    if (append) {
        load_step(kr, kb, p0, nullptr);
        load_step(vr, vb, p0, nullptr);
        // the position's cos | sin row too (a table no kernel writes): after the wait it would be a DRAM
        // round trip on the critical path, queued behind whatever weights the kernels around it stream
        for (int e = tid; e < hs; e += NW * 32) sm_cs[e] = to_float(freqs[(size_t)pos * hs + e]);
        team_sync<TEAM>();
        wait();
    } else {  // the separate rope_kv_append kernel before this one wrote position len - 1
        wait();
        load_step(kr, kb, p0, nullptr);
        load_step(vr, vb, p0, nullptr);
    }
    if (append) {
        // rope.cu's expression (fp32 math, one rounding to T), then q pre-scaled as below
        const auto rotate = [&](const T* x, int e) {
            const int half = hs / 2, j = e < half ? e : e - half;
            const float a = to_float(load_cg(x + j)), bb = to_float(load_cg(x + j + half));
            const float c = sm_cs[j], sk = sm_cs[half + j];
            return from_float<T>(e < half ? a * c - bb * sk : bb * c + a * sk);
        };
        for (int idx = tid; idx < GM * HSMAX; idx += NW * 32) {
            const int hh = idx / HSMAX, e = idx - hh * HSMAX;
            sm_q[hh][e] = hh < gt && e < hs ? to_float(rotate(qkv + i * row + (size_t)(h0 + hh) * hs, e)) * scale_log2
                                            : 0.f;
        }
        for (int e = tid; e < hs; e += NW * 32) {
            sm_new[0][e] = rotate(qkv + i * row + (size_t)(Hq + g) * hs, e);
            sm_new[1][e] = load_cg(qkv + i * row + (size_t)(Hq + Hkv + g) * hs + e);
        }
    } else if (tid < LP) {
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
    team_sync<TEAM>();
    if (append) {
        if (s == 0 && tile == 0)
            for (int e = tid; e < hs; e += NW * 32) {
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
    team_sync<TEAM>();
    float* partials = scratch + part_offset;
    for (int idx = tid; idx < gt * hs; idx += NW * 32) {
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
            out[HEAD_OUT ? idx : (size_t)i * Hq * hs + (size_t)h * hs + e] = from_float<T>(L > 0.f ? O / L : 0.f);
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
    team_sync<TEAM>();
    if (tid == 0) {
        unsigned long long* counters = reinterpret_cast<unsigned long long*>(scratch);
        s_last = arrive(counters + (size_t)i * ny + y, (unsigned)nact);
    }
    team_sync<TEAM>();
    if (!s_last) return;
    __threadfence();
    merge_partials<T, TEAM, HEAD_OUT>(out, sm_wt, partials, Hq, hs, S, i, h0, gt, nact);
}
