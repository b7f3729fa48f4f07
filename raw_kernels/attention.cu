// Causal self-attention on the packed qkv layout (B, T, (Hq + 2*Hkv) * hs): q heads, then k heads,
// then v heads; query head h reads kv head h / (Hq / Hkv) (GQA). Forward writes att (B, T, Hq*hs)
// and lse (B, Hq, T) fp32 = natural log of the softmax denominator of the scaled scores
// (scale = 1/sqrt(hs)). Backward writes (=) dqkv in the same packed layout: dq per query head,
// dk and dv summed over the query heads of each GQA group.
//
// Two families:
// - flash (bf16, hs 64 and 128): FlashAttention-2 on mma.sync.m16n8k16 (bf16 in, fp32 accumulate).
//   Q/K/V/dO tiles are staged in shared memory by cp.async (16-byte chunks, XOR-swizzled by row so
//   that ldmatrix phases hit 8 distinct bank groups), read into fragments with ldmatrix, and the
//   score tile stays in registers: the m16n8 accumulator layout of two adjacent n-tiles is exactly
//   the m16k16 A-operand layout of the next product, so P (or dS) is packed to bf16 in place.
//   No T x T buffer. Each warp owns 16 rows of its block.
// - simt (fp32 or bf16, any hs <= 256): one warp per row, fp32 math, lanes split the head dim.
//   Slow and simple; it serves fp32 and the head sizes the flash kernels do not cover.
// Backward (both families) is deterministic: D = rowsum(dO * O) first, then dq in its own pass
// over key blocks (no atomics) and dk/dv with the key block in the outer loop, looping over every
// query head of the GQA group so the group reduction happens in registers.
// Invariants: rows t >= T are never written; masked scores contribute exactly 0; the kernels only
// read qkv/att/datt/lse and write their outputs, which must not alias the inputs.
#include "common.cuh"
#include "cp_async.cuh"

#define LOG2E 1.4426950408889634f
#define ATT_INF __int_as_float(0x7f800000)  // NVRTC has no math.h INFINITY

// helpers
// ---- PTX helpers -------------------------------------------------------------------------
// (tests/test_attention.py compiles this file on the host with everything from here to the
// extern __shared__ declaration replaced by an emulation of the same helpers.)
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// c += a * b for one m16n8k16 tile: a row-major 16x16 bf16 (4 regs), b 16x8 "col" (2 regs), c fp32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats -> bf16x2 with the first in the low half (the lower column of a fragment pair).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
// 2^x; ex2.approx maps -inf to +0, which is how masked scores vanish.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

extern __shared__ __align__(128) unsigned char att_smem[];

// Shared tiles are [rows][HS] bf16; the 16-byte chunk c of row r sits at chunk c ^ (r & 7).
template <int HS> __device__ __forceinline__ int swz(int r, int chunk) { return r * HS + ((chunk ^ (r & 7)) << 3); }

// ROWS x HS tile starting at global row row0 (row stride ld elements); rows >= T are zero-filled.
template <int ROWS, int HS, int NT>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int row0, int T, long ld) {
    constexpr int CH = HS / 8;
    static_assert((ROWS * CH) % NT == 0, "tile chunks must split evenly over the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CH / NT; ++i) {
        const int c = threadIdx.x + i * NT;
        const int r = c / CH, ch = c % CH, row = row0 + r;
        const bool ok = row < T;
        cp_async16(smem_u32(s + swz<HS>(r, ch)), g + (ok ? (long)row * ld : 0L) + ch * 8, ok ? 16 : 0);
    }
}

// One step of a double-buffered K/V pipeline of 64-row key blocks: starts copying block j + 1 (if
// any) into the other stage, then waits until block j has landed in stage j & 1 for every thread.
template <int BC, int HS, int NT>
__device__ __forceinline__ void kv_pipeline_step(bf16* sK, bf16* sV, const bf16* gK, const bf16* gV, int j, int n_kv,
                                                 int T, long ld) {
    if (j + 1 < n_kv) {
        const int nb = (j + 1) & 1;
        load_tile<BC, HS, NT>(sK + nb * BC * HS, gK, (j + 1) * BC, T, ld);
        load_tile<BC, HS, NT>(sV + nb * BC * HS, gV, (j + 1) * BC, T, ld);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the block just requested has landed
    __syncthreads();
}

// A operand (16 rows x 16 k) at rows r0.., k chunk pair kc.. (2 chunks = 16 elements).
template <int HS> __device__ __forceinline__ void ld_a(unsigned (&a)[4], const bf16* s, int r0, int kc, int lane) {
    ldsm_x4(a, smem_u32(s + swz<HS>(r0 + (lane & 15), kc + (lane >> 4))));
}
// B operands of two n-tiles from a tile stored [n][k] (k contiguous): n rows n0..n0+15, k chunks kc, kc+1.
// r[0], r[1] = b0, b1 of n-tile n0..n0+7; r[2], r[3] = b0, b1 of n-tile n0+8..n0+15.
template <int HS> __device__ __forceinline__ void ld_b_nk(unsigned (&b)[4], const bf16* s, int n0, int kc, int lane) {
    ldsm_x4(b, smem_u32(s + swz<HS>(n0 + (lane & 7) + ((lane >> 4) << 3), kc + ((lane >> 3) & 1))));
}
// B operands of two n-tiles from a tile stored [k][n] (n contiguous), transposed by ldmatrix:
// k rows k0..k0+15, n chunks nc (n-tile 0) and nc+1 (n-tile 1).
template <int HS> __device__ __forceinline__ void ld_b_kn(unsigned (&b)[4], const bf16* s, int k0, int nc, int lane) {
    ldsm_x4_trans(b, smem_u32(s + swz<HS>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc + (lane >> 4))));
}

// acc[HS/8][4] (a 16 x HS fp32 accumulator of one warp) += A(16 x 64, the s[8][4] accumulators
// packed to bf16) * B(64 x HS), B read from a [k][n] tile of 64 rows.
template <int HS>
__device__ __forceinline__ void mma_acc_pk(float (&acc)[HS / 8][4], const float (&s)[8][4], const bf16* tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        const unsigned a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                               pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HS / 16; ++dp) {
            unsigned b[4];
            ld_b_kn<HS>(b, tile, kk * 16, dp * 2, lane);
            mma_bf16(acc[2 * dp], a, b[0], b[1]);
            mma_bf16(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// s[8][4] = A(16 x HS) * B^T for B a [n][k] tile of 64 rows; A from fragments af[HS/16] (mma_scores)
// or from the 16 rows a_row0.. of the shared tile a_tile (mma_scores_smem_a).
template <int HS>
__device__ __forceinline__ void mma_scores(float (&s)[8][4], const unsigned (&af)[HS / 16][4], const bf16* b_tile, int lane) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned b[4];
            ld_b_nk<HS>(b, b_tile, np * 16, kk * 2, lane);
            mma_bf16(s[2 * np], af[kk], b[0], b[1]);
            mma_bf16(s[2 * np + 1], af[kk], b[2], b[3]);
        }
    }
}
template <int HS>
__device__ __forceinline__ void mma_scores_smem_a(float (&s)[8][4], const bf16* a_tile, int a_row0, const bf16* b_tile,
                                                  int lane) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; ++kk) {
        unsigned a[4];
        ld_a<HS>(a, a_tile, a_row0, kk * 2, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned b[4];
            ld_b_nk<HS>(b, b_tile, np * 16, kk * 2, lane);
            mma_bf16(s[2 * np], a, b[0], b[1]);
            mma_bf16(s[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// Write a warp's 16 x HS fp32 accumulator (times mul) as bf16 rows to global, staged through the
// warp's own 16 rows of `stage` (a swizzled [rows][HS] tile) so the global stores are 16-byte and
// coalesced. Global row r of the warp goes to out + (row0 + r) * ld, for row0 + r < T.
template <int HS>
__device__ __forceinline__ void store_rows(bf16* out, long ld, int row0, int T, const float (&acc)[HS / 8][4],
                                           const float (&mul)[2], bf16* stage, int stage_row0, int lane) {
    const int g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < HS / 8; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rr = stage_row0 + g + 8 * r;
            *reinterpret_cast<unsigned*>(stage + swz<HS>(rr, nt) + 2 * tq) =
                pack_bf16(acc[nt][2 * r] * mul[r], acc[nt][2 * r + 1] * mul[r]);
        }
    }
    __syncwarp();
    constexpr int CH = HS / 8;
#pragma unroll
    for (int i = 0; i < 16 * CH / 32; ++i) {
        const int c = lane + 32 * i, rr = c / CH, ch = c % CH;
        if (row0 + rr < T)
            *reinterpret_cast<int4*>(out + (long)(row0 + rr) * ld + ch * 8) =
                *reinterpret_cast<const int4*>(stage + swz<HS>(stage_row0 + rr, ch));
    }
}

// kernels
// ---- flash forward -------------------------------------------------------------------------
// Grid (ceil(T / BR), Hq, B), block 32*NW. Query block BR = 16*NW rows (heaviest causal blocks
// first), key blocks of 64, K/V double-buffered. Shared: Q [BR][HS], K [2][64][HS], V [2][64][HS].
template <int HS, int NW>
__device__ __forceinline__ void flash_forward(bf16* __restrict__ att, float* __restrict__ lse,
                                              const bf16* __restrict__ qkv, int T, int Hq, int Hkv, float scale) {
    constexpr int BR = 16 * NW, BC = 64, NT = 32 * NW, KS = HS / 16;
    bf16* sQ = reinterpret_cast<bf16*>(att_smem);
    bf16* sK = sQ + BR * HS;
    bf16* sV = sK + 2 * BC * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (Hq / Hkv);
    const long ld = (long)(Hq + 2 * Hkv) * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gQ = base + (long)h * HS;
    const bf16* gK = base + (long)(Hq + kvh) * HS;
    const bf16* gV = base + (long)(Hq + Hkv + kvh) * HS;
    const int n_kv = (min(q0 + BR, T) + BC - 1) / BC;
    const int row_w = q0 + warp * 16;  // first query row of this warp
    const float sl2 = scale * LOG2E;

    load_tile<BR, HS, NT>(sQ, gQ, q0, T, ld);
    cp_async_commit();
    load_tile<BC, HS, NT>(sK, gK, 0, T, ld);
    load_tile<BC, HS, NT>(sV, gV, 0, T, ld);
    cp_async_commit();

    unsigned qf[KS][4];
    float o[HS / 8][4];
#pragma unroll
    for (int nt = 0; nt < HS / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {-ATT_INF, -ATT_INF}, l[2] = {0.f, 0.f};

    for (int j = 0; j < n_kv; ++j) {
        kv_pipeline_step<BC, HS, NT>(sK, sV, gK, gV, j, n_kv, T, ld);
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) ld_a<HS>(qf[kk], sQ, warp * 16, kk * 2, lane);
        }
        const int kv0 = j * BC;
        if (kv0 <= row_w + 15) {  // else every key of this block is in the future of all 16 rows
            const bf16* k_s = sK + (j & 1) * BC * HS;
            const bf16* v_s = sV + (j & 1) * BC * HS;
            float s[8][4];
            mma_scores<HS>(s, qf, k_s, lane);
            if (kv0 + BC - 1 > row_w) {  // the block reaches past the diagonal of some row
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (kv0 + nt * 8 + 2 * tq + (e & 1) > row_w + g + 8 * (e >> 1)) s[nt][e] = -ATT_INF;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -ATT_INF;
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[r], mx);
                const float base_l2 = m_new == -ATT_INF ? 0.f : m_new * sl2;  // no (-inf) - (-inf)
                const float alpha = fast_exp2(m[r] * sl2 - base_l2);
                m[r] = m_new;
                l[r] *= alpha;
#pragma unroll
                for (int nt = 0; nt < HS / 8; ++nt) {
                    o[nt][2 * r] *= alpha;
                    o[nt][2 * r + 1] *= alpha;
                }
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        const float p = fast_exp2(fmaf(s[nt][e], sl2, -base_l2));
                        s[nt][e] = p;
                        l[r] += p;  // per-thread partial; the 4 threads of a row are summed at the end
                    }
            }
            mma_acc_pk<HS>(o, s, v_s, lane);
        }
        __syncthreads();  // the buffer read here is refilled by the next iteration's prefetch
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = 1.f / l[r];
        const int row = row_w + g + 8 * r;
        if (tq == 0 && row < T) lse[((long)b * Hq + h) * T + row] = m[r] * scale + logf(l[r]);
    }
    // Each warp stages its output in its own 16 rows of sQ, which only it has read.
    store_rows<HS>(att + (long)b * T * Hq * HS + (long)h * HS, (long)Hq * HS, row_w, T, o, inv, sQ, warp * 16, lane);
}

// ---- flash backward: dq ----------------------------------------------------------------------
// Grid (ceil(T / 64), Hq, B), block 128. For 64 query rows: S = Q K^T, P = exp(S*scale - lse),
// dP = dO V^T, dS = P (dP - D), dQ += dS K over the key blocks up to the diagonal; dq = scale dQ.
// Shared: Q [64][HS], dO [64][HS], K [2][64][HS], V [2][64][HS]. With QREG the warp keeps its Q and
// dO fragments in registers; without, it rereads them from shared memory (hs 128: registers run out).
template <int HS, bool QREG>
__device__ __forceinline__ void flash_backward_dq(bf16* __restrict__ dqkv, const bf16* __restrict__ datt,
                                                  const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                                  const float* __restrict__ dsum, int T, int Hq, int Hkv, float scale) {
    constexpr int BR = 64, BC = 64, NT = 128, KS = HS / 16;
    bf16* sQ = reinterpret_cast<bf16*>(att_smem);
    bf16* sdO = sQ + BR * HS;
    bf16* sK = sdO + BR * HS;
    bf16* sV = sK + 2 * BC * HS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (Hq / Hkv);
    const long ld = (long)(Hq + 2 * Hkv) * HS, ld_o = (long)Hq * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gK = base + (long)(Hq + kvh) * HS;
    const bf16* gV = base + (long)(Hq + Hkv + kvh) * HS;
    const int n_kv = (min(q0 + BR, T) + BC - 1) / BC;
    const int row_w = q0 + warp * 16;
    const float sl2 = scale * LOG2E;

    load_tile<BR, HS, NT>(sQ, base + (long)h * HS, q0, T, ld);
    load_tile<BR, HS, NT>(sdO, datt + (long)b * T * ld_o + (long)h * HS, q0, T, ld_o);
    cp_async_commit();
    load_tile<BC, HS, NT>(sK, gK, 0, T, ld);
    load_tile<BC, HS, NT>(sV, gV, 0, T, ld);
    cp_async_commit();

    float lse_l2[2], d_row[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_w + g + 8 * r;
        const long idx = ((long)b * Hq + h) * T + row;
        lse_l2[r] = row < T ? lse[idx] * LOG2E : 0.f;  // rows past T: zero q and dO give dS = 0
        d_row[r] = row < T ? dsum[idx] : 0.f;
    }
    unsigned qf[QREG ? KS : 1][4], dof[QREG ? KS : 1][4];
    float dq[HS / 8][4];
#pragma unroll
    for (int nt = 0; nt < HS / 8; ++nt) dq[nt][0] = dq[nt][1] = dq[nt][2] = dq[nt][3] = 0.f;

    for (int j = 0; j < n_kv; ++j) {
        kv_pipeline_step<BC, HS, NT>(sK, sV, gK, gV, j, n_kv, T, ld);
        if constexpr (QREG) {
            if (j == 0) {
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    ld_a<HS>(qf[kk], sQ, warp * 16, kk * 2, lane);
                    ld_a<HS>(dof[kk], sdO, warp * 16, kk * 2, lane);
                }
            }
        }
        const bf16* k_s = sK + (j & 1) * BC * HS;
        const bf16* v_s = sV + (j & 1) * BC * HS;
        const int kv0 = j * BC;
        float s[8][4], dp[8][4];
        if constexpr (QREG) {
            mma_scores<HS>(s, qf, k_s, lane);
            mma_scores<HS>(dp, dof, v_s, lane);
        } else {
            mma_scores_smem_a<HS>(s, sQ, warp * 16, k_s, lane);
            mma_scores_smem_a<HS>(dp, sdO, warp * 16, v_s, lane);
        }
        const bool diag = kv0 + BC - 1 > row_w;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = fast_exp2(fmaf(s[nt][e], sl2, -lse_l2[e >> 1]));
                if (diag && kv0 + nt * 8 + 2 * tq + (e & 1) > row_w + g + 8 * (e >> 1)) p = 0.f;
                s[nt][e] = p * (dp[nt][e] - d_row[e >> 1]);  // dS
            }
        mma_acc_pk<HS>(dq, s, k_s, lane);
        __syncthreads();
    }
    const float mul[2] = {scale, scale};
    store_rows<HS>(dqkv + (long)b * T * ld + (long)h * HS, ld, row_w, T, dq, mul, sQ, warp * 16, lane);
}

// ---- flash backward: dk, dv ------------------------------------------------------------------
// Grid (ceil(T / 64), Hkv, B), block 128 (longest key blocks first: block 0 sees every query).
// For 64 keys of kv head kvh, over each query head of the group and each query block from the
// diagonal on: S^T = K Q^T, P^T = exp(S^T*scale - lse), dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T (dP^T - D), dK += dS^T Q; dk = scale dK. Shared: K [64][HS], V [64][HS], then two
// stages of Q [64][HS], dO [64][HS], lse*log2(e) [64] (+inf past T, so P = 0 there), D [64].
template <int HS>
__device__ __forceinline__ void flash_backward_dkdv(bf16* __restrict__ dqkv, const bf16* __restrict__ datt,
                                                    const bf16* __restrict__ qkv, const float* __restrict__ lse,
                                                    const float* __restrict__ dsum, int T, int Hq, int Hkv,
                                                    float scale) {
    constexpr int BR = 64, BC = 64, NT = 128;
    bf16* sK = reinterpret_cast<bf16*>(att_smem);
    bf16* sV = sK + BC * HS;
    bf16* sQ = sV + BC * HS;       // [2][BR][HS]
    bf16* sdO = sQ + 2 * BR * HS;  // [2][BR][HS]
    float* sL = reinterpret_cast<float*>(sdO + 2 * BR * HS);  // [2][BR]
    float* sD = sL + 2 * BR;                                   // [2][BR]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int kb = blockIdx.x, k0 = kb * BC;
    const int kvh = blockIdx.y, b = blockIdx.z, G = Hq / Hkv;
    const long ld = (long)(Hq + 2 * Hkv) * HS, ld_o = (long)Hq * HS;
    const bf16* base = qkv + (long)b * T * ld;
    const bf16* gdO = datt + (long)b * T * ld_o;
    const int n_qblk = (T + BR - 1) / BR, steps = n_qblk - kb, total = G * steps;
    const int row_w = k0 + warp * 16;  // first key row of this warp
    const float sl2 = scale * LOG2E;

    auto load_stage = [&](int it, int buf) {
        const int h = kvh * G + it / steps, q0 = (kb + it % steps) * BR;
        load_tile<BR, HS, NT>(sQ + buf * BR * HS, base + (long)h * HS, q0, T, ld);
        load_tile<BR, HS, NT>(sdO + buf * BR * HS, gdO + (long)h * HS, q0, T, ld_o);
        if (threadIdx.x < BR) {
            const int q = q0 + threadIdx.x;
            const long idx = ((long)b * Hq + h) * T + q;
            sL[buf * BR + threadIdx.x] = q < T ? lse[idx] * LOG2E : ATT_INF;
            sD[buf * BR + threadIdx.x] = q < T ? dsum[idx] : 0.f;
        }
    };
    load_tile<BC, HS, NT>(sK, base + (long)(Hq + kvh) * HS, k0, T, ld);
    load_tile<BC, HS, NT>(sV, base + (long)(Hq + Hkv + kvh) * HS, k0, T, ld);
    load_stage(0, 0);
    cp_async_commit();

    float dk[HS / 8][4], dv[HS / 8][4];
#pragma unroll
    for (int nt = 0; nt < HS / 8; ++nt) {
        dk[nt][0] = dk[nt][1] = dk[nt][2] = dk[nt][3] = 0.f;
        dv[nt][0] = dv[nt][1] = dv[nt][2] = dv[nt][3] = 0.f;
    }

    for (int it = 0; it < total; ++it) {
        const int buf = it & 1;
        if (it + 1 < total) load_stage(it + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const int qb = kb + it % steps, q0 = qb * BR;
        const bf16* q_s = sQ + buf * BR * HS;
        const bf16* do_s = sdO + buf * BR * HS;
        const float* l_s = sL + buf * BR;
        const float* d_s = sD + buf * BR;
        float s[8][4], dp[8][4];
        mma_scores_smem_a<HS>(s, sK, warp * 16, q_s, lane);
        mma_scores_smem_a<HS>(dp, sV, warp * 16, do_s, lane);
        const bool diag = qb == kb;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = nt * 8 + 2 * tq + (e & 1);
                float p = fast_exp2(fmaf(s[nt][e], sl2, -l_s[qi]));
                if (diag && q0 + qi < row_w + g + 8 * (e >> 1)) p = 0.f;
                s[nt][e] = p;
                dp[nt][e] = p * (dp[nt][e] - d_s[qi]);  // dS^T
            }
        mma_acc_pk<HS>(dv, s, do_s, lane);
        mma_acc_pk<HS>(dk, dp, q_s, lane);
        __syncthreads();
    }
    // Each warp stages dk in its own rows of sK and dv in its own rows of sV (only it read them).
    const float mul_k[2] = {scale, scale}, mul_v[2] = {1.f, 1.f};
    store_rows<HS>(dqkv + (long)b * T * ld + (long)(Hq + kvh) * HS, ld, row_w, T, dk, mul_k, sK, warp * 16, lane);
    store_rows<HS>(dqkv + (long)b * T * ld + (long)(Hq + Hkv + kvh) * HS, ld, row_w, T, dv, mul_v, sV, warp * 16,
                   lane);
}

// ---- simt (any dtype, hs <= 256) ---------------------------------------------------------------
// One warp per row; lane holds elements d = lane + 32 i of the head dim. Blocks of 4 warps.
#define SIMT_NPL 8  // elements per lane: hs <= 256

// The grid's warp w (4 per block) and its lane: the row index of the warp-per-row kernels.
__device__ __forceinline__ long simt_warp() { return (long)blockIdx.x * 4 + (threadIdx.x >> 5); }

// The query row of warp w in the forward and dq kernels: (b, h, t) with t counted from the end (long
// rows first), the packed row stride ld, batch b's first row, and the first k and v rows of h's kv head.
template <typename T_> struct SimtQuery {
    int b, h, t;
    long ld;
    const T_ *base, *K, *V;
    __device__ __forceinline__ SimtQuery(long w, const T_* qkv, int T, int Hq, int Hkv, int hs) {
        t = T - 1 - (int)(w % T), h = (int)((w / T) % Hq), b = (int)(w / ((long)T * Hq));
        const int kvh = h / (Hq / Hkv);
        ld = (long)(Hq + 2 * Hkv) * hs;
        base = qkv + (long)b * T * ld;
        K = base + (long)(Hq + kvh) * hs;
        V = base + (long)(Hq + Hkv + kvh) * hs;
    }
};

template <typename T_>
__device__ __forceinline__ void load_row(float (&x)[SIMT_NPL], const T_* p, int hs, int lane) {
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) {
        const int d = lane + 32 * i;
        x[i] = d < hs ? to_float(p[d]) : 0.f;
    }
}
template <typename T_> __device__ __forceinline__ float dot_row(const float (&x)[SIMT_NPL], const T_* p, int hs, int lane) {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hs) acc = fmaf(x[i], to_float(p[d]), acc);
    }
    return warp_sum(acc);
}
template <typename T_> __device__ __forceinline__ void store_row(T_* p, const float (&x)[SIMT_NPL], float mul, int hs, int lane) {
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) {
        const int d = lane + 32 * i;
        if (d < hs) p[d] = from_float<T_>(x[i] * mul);
    }
}

// Warp w of the grid handles (b, h, t) with t counted from the end (long rows first).
template <typename T_>
__device__ __forceinline__ void simt_forward(T_* __restrict__ att, float* __restrict__ lse, const T_* __restrict__ qkv,
                                             int B, int T, int Hq, int Hkv, int hs, float scale) {
    const long w = simt_warp();
    const int lane = threadIdx.x & 31;
    if (w >= (long)B * Hq * T) return;
    const auto [b, h, t, ld, base, K, V] = SimtQuery<T_>(w, qkv, T, Hq, Hkv, hs);
    float q[SIMT_NPL], acc[SIMT_NPL];
    load_row(q, base + t * ld + (long)h * hs, hs, lane);
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) acc[i] = 0.f;
    float m = -ATT_INF, l = 0.f;
    for (int c = 0; c <= t; ++c) {
        const float s = dot_row(q, K + c * ld, hs, lane) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
        const T_* v = V + c * ld;
#pragma unroll
        for (int i = 0; i < SIMT_NPL; ++i) {
            const int d = lane + 32 * i;
            if (d < hs) acc[i] = fmaf(p, to_float(v[d]), acc[i] * corr);
        }
        m = m_new;
    }
    store_row(att + ((long)b * T + t) * Hq * hs + (long)h * hs, acc, 1.f / l, hs, lane);
    if (lane == 0) lse[((long)b * Hq + h) * T + t] = m + logf(l);
}

// D[b, h, t] = sum_d dO * O (fp32); one warp per (b, t, h). Both families use it.
template <typename T_>
__device__ __forceinline__ void backward_dot(float* __restrict__ dsum, const T_* __restrict__ datt,
                                             const T_* __restrict__ att, int B, int T, int Hq, int hs) {
    const long w = simt_warp();
    const int lane = threadIdx.x & 31;
    if (w >= (long)B * T * Hq) return;
    const int h = (int)(w % Hq), t = (int)((w / Hq) % T), b = (int)(w / ((long)Hq * T));
    const long off = w * hs;  // (b, t, h) rows are consecutive hs-long segments of att
    float acc = 0.f;
    for (int d = lane; d < hs; d += 32) acc = fmaf(to_float(datt[off + d]), to_float(att[off + d]), acc);
    acc = warp_sum(acc);
    if (lane == 0) dsum[((long)b * Hq + h) * T + t] = acc;
}

// dq for (b, h, t): scale * sum_{c <= t} P (dP - D) k_c.
template <typename T_>
__device__ __forceinline__ void simt_backward_dq(T_* __restrict__ dqkv, const T_* __restrict__ datt,
                                                 const T_* __restrict__ qkv, const float* __restrict__ lse,
                                                 const float* __restrict__ dsum, int B, int T, int Hq, int Hkv, int hs,
                                                 float scale) {
    const long w = simt_warp();
    const int lane = threadIdx.x & 31;
    if (w >= (long)B * Hq * T) return;
    const auto [b, h, t, ld, base, K, V] = SimtQuery<T_>(w, qkv, T, Hq, Hkv, hs);
    const long row = ((long)b * Hq + h) * T + t;
    const float lse_t = lse[row], d_t = dsum[row];
    float q[SIMT_NPL], dout[SIMT_NPL], dq[SIMT_NPL];
    load_row(q, base + t * ld + (long)h * hs, hs, lane);
    load_row(dout, datt + ((long)b * T + t) * Hq * hs + (long)h * hs, hs, lane);
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) dq[i] = 0.f;
    for (int c = 0; c <= t; ++c) {
        const float p = expf(dot_row(q, K + c * ld, hs, lane) * scale - lse_t);
        const float ds = p * (dot_row(dout, V + c * ld, hs, lane) - d_t);
        const T_* k = K + c * ld;
#pragma unroll
        for (int i = 0; i < SIMT_NPL; ++i) {
            const int d = lane + 32 * i;
            if (d < hs) dq[i] = fmaf(ds, to_float(k[d]), dq[i]);
        }
    }
    store_row(dqkv + (long)b * T * ld + t * ld + (long)h * hs, dq, scale, hs, lane);
}

// dk, dv for (b, kv head, key c): sums over the group's query heads and queries t >= c.
template <typename T_>
__device__ __forceinline__ void simt_backward_dkdv(T_* __restrict__ dqkv, const T_* __restrict__ datt,
                                                   const T_* __restrict__ qkv, const float* __restrict__ lse,
                                                   const float* __restrict__ dsum, int B, int T, int Hq, int Hkv,
                                                   int hs, float scale) {
    const long w = simt_warp();
    const int lane = threadIdx.x & 31;
    if (w >= (long)B * Hkv * T) return;
    const int c = (int)(w % T), kvh = (int)((w / T) % Hkv), b = (int)(w / ((long)T * Hkv));  // c = 0 first: longest
    const int G = Hq / Hkv;
    const long ld = (long)(Hq + 2 * Hkv) * hs;
    const T_* base = qkv + (long)b * T * ld;
    float k[SIMT_NPL], v[SIMT_NPL], dk[SIMT_NPL], dv[SIMT_NPL];
    load_row(k, base + c * ld + (long)(Hq + kvh) * hs, hs, lane);
    load_row(v, base + c * ld + (long)(Hq + Hkv + kvh) * hs, hs, lane);
#pragma unroll
    for (int i = 0; i < SIMT_NPL; ++i) dk[i] = dv[i] = 0.f;
    for (int h = kvh * G; h < (kvh + 1) * G; ++h) {
        const T_* Q = base + (long)h * hs;
        const T_* dO = datt + (long)b * T * Hq * hs + (long)h * hs;
        const float* lse_h = lse + ((long)b * Hq + h) * T;
        const float* d_h = dsum + ((long)b * Hq + h) * T;
        for (int t = c; t < T; ++t) {
            const T_* q = Q + t * ld;
            const T_* dout = dO + (long)t * Hq * hs;
            const float p = expf(dot_row(k, q, hs, lane) * scale - lse_h[t]);
            const float ds = p * (dot_row(v, dout, hs, lane) - d_h[t]);
#pragma unroll
            for (int i = 0; i < SIMT_NPL; ++i) {
                const int d = lane + 32 * i;
                if (d < hs) {
                    dv[i] = fmaf(p, to_float(dout[d]), dv[i]);
                    dk[i] = fmaf(ds, to_float(q[d]), dk[i]);
                }
            }
        }
    }
    store_row(dqkv + (long)b * T * ld + c * ld + (long)(Hq + kvh) * hs, dk, scale, hs, lane);
    store_row(dqkv + (long)b * T * ld + c * ld + (long)(Hq + Hkv + kvh) * hs, dv, 1.f, hs, lane);
}

// ---- entry points: the names cuengine/kernels/attention.py launches (NW_FWD matches its _FWD_WARPS) ----
#define FLASH_KERNELS(HS, NW_FWD, MIN_BLOCKS_FWD)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW_FWD, MIN_BLOCKS_FWD) attention_forward_flash_hs##HS##_bf16(  \
        bf16* att, float* lse, const bf16* qkv, int T, int Hq, int Hkv, float scale) {                    \
        flash_forward<HS, NW_FWD>(att, lse, qkv, T, Hq, Hkv, scale);                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, 2) attention_backward_dq_flash_hs##HS##_bf16(       \
        bf16* dqkv, const bf16* datt, const bf16* qkv, const float* lse, const float* dsum, int T, int Hq, \
        int Hkv, float scale) {                                                                            \
        flash_backward_dq<HS, HS <= 64>(dqkv, datt, qkv, lse, dsum, T, Hq, Hkv, scale);                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128, 2) attention_backward_dkdv_flash_hs##HS##_bf16(     \
        bf16* dqkv, const bf16* datt, const bf16* qkv, const float* lse, const float* dsum, int T, int Hq, \
        int Hkv, float scale) {                                                                            \
        flash_backward_dkdv<HS>(dqkv, datt, qkv, lse, dsum, T, Hq, Hkv, scale);                            \
    }
FLASH_KERNELS(64, 8, 2)
FLASH_KERNELS(128, 8, 1)

#define SIMT_KERNELS(T_, SUFFIX)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attention_forward_simt_##SUFFIX(                      \
        T_* att, float* lse, const T_* qkv, int B, int T, int Hq, int Hkv, int hs, float scale) {          \
        simt_forward<T_>(att, lse, qkv, B, T, Hq, Hkv, hs, scale);                                          \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dot_##SUFFIX(                      \
        float* dsum, const T_* datt, const T_* att, int B, int T, int Hq, int hs) {                         \
        backward_dot<T_>(dsum, datt, att, B, T, Hq, hs);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_simt_##SUFFIX(                  \
        T_* dqkv, const T_* datt, const T_* qkv, const float* lse, const float* dsum, int B, int T, int Hq, \
        int Hkv, int hs, float scale) {                                                                     \
        simt_backward_dq<T_>(dqkv, datt, qkv, lse, dsum, B, T, Hq, Hkv, hs, scale);                         \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dkdv_simt_##SUFFIX(                \
        T_* dqkv, const T_* datt, const T_* qkv, const float* lse, const float* dsum, int B, int T, int Hq, \
        int Hkv, int hs, float scale) {                                                                     \
        simt_backward_dkdv<T_>(dqkv, datt, qkv, lse, dsum, B, T, Hq, Hkv, hs, scale);                       \
    }
SIMT_KERNELS(float, f32)
SIMT_KERNELS(bf16, bf16)

// launchers: cuengine/kernels/attention.py (attention_forward, then attention_backward; the cpu twin there)
