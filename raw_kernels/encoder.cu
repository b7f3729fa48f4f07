// Token embedding (the encoder): a row gather forward, a deterministic scatter-add backward.
//
//   forward:  out[n, :] = wte[tokens[n], :]                          (=; an id outside [0, V) gives a zero row)
//             with elements of wte outside the flat range [lo, hi) read as zero: one rank's rows of a
//             ZeRO-sharded embedding (lo, hi multiples of the 16-byte vector; 0, V * C for the whole table)
//   backward: dwte[v, :] += sum of dout[n, :] over n with tokens[n] == v    (+=, a parameter gradient)
//
// The backward gives the same bits on every run and is graph-capturable (no host sync, no allocation).
// It does not sort: most ids of a batch occur once, so it counts them and streams dout in position order.
// Steps 0-1b read only the tokens (the plan, encoder.py's encoder_backward_plan: the model runs it beside
// its LM head); step 2 reads dout. Every step after 0 is a dependent launch (programmatic, sm_90): it
// starts while the one before finishes.
//   0. encoder_backward_clear: zero the counters and the hash table at the head of the scratch.
//   1. encoder_backward_count, a thread per position: insert the id into an open-addressing hash table
//      (4N slots, linear probing, claimed by a 64-bit atomicCAS of key and count; a warp's lanes with
//      one id as one atomic), count it, and keep its first INLINE positions in arrival order. The
//      INLINE + 1st arrival puts the slot on the "hot" queue. Which slot an id lands in, the arrival
//      order and the queue order depend on timing; what is read from the table (the count, the set of
//      positions) does not, and the sums below only use that. The last block to finish plans the hot
//      ids' work: an id with at most `rows` positions is one "medium" item; a "big" one (more than
//      `rows`) is cut into position tiles of tile_width(k) positions (about `rows` of its positions
//      each when they are spread), one item per tile; the items are listed (medium first) by a block
//      scan over the queue.
//   1b. encoder_backward_mark, a thread per position: its part in step 2's stream role, one int (the id
//      occurs once; it is the first of an id's 2..INLINE positions: the slot; or nothing).
//   2. encoder_backward_sum, one kernel with two roles, stream then hot in every block (the first
//      hot_blocks blocks only take the hot role):
//      - stream: the (position, 16-byte vector) pairs of a contiguous range per block, two per thread in
//        flight. A position whose id occurs once adds its vector (dout read, the dwte vector read and
//        written: the access pattern of a plain scatter); the first position of an id with 2..INLINE
//        positions sums them all (sorted by position from the table's set); the others do nothing;
//      - hot: the block takes hot items (x channel chunks) from a shared counter until none is left;
//        it scans the item's token range in order, compacting the id's positions there (a block scan
//        of per-thread match counts) into shared memory, and sums them over 128 vectors of channels; a
//        medium item adds its sum to dwte, a tile writes it to an fp32 partial in the scratch, and the
//        block that finishes an id's last tile adds the id's tile partials to dwte.
//   Summation order (the NumPy twin's): sum4(rows) deals rows in order to 4 partials (rank k to partial
//   k % 4), each summed in order in fp32 from 0.f, and returns ((p0 + p1) + p2) + p3. An id with at most
//   `rows` positions adds sum4(its rows by position) to dwte; a big id adds sum4(its tiles' sum4s, by
//   tile; an empty tile is +0.f, which leaves every sum unchanged: none of them is -0.f). One rounding
//   to dwte's dtype per row. Ids outside [0, V) are skipped and touch no memory.
// Why 4N slots (at most a quarter full), not 2N: shorter linear-probing chains, each link a dependent
// atomic. A CPU simulation (32768 uniform ids of 151936, inserted in order) gave the slowest insert 14-16
// chained atomics at 2N, 5-6 at 4N; on the H200, clear + count went from 16.0 to 11.5 us at 32768 uniform
// ids (the whole backward 70.3 -> 64.8 us), for 16 more zeroed ints per position. Prefetching the rows
// into L2 ahead of the sum (by the count kernel or by each sum warp, bulk or per line, 24-48 MB) and
// evict-first dout loads were all slower (the H200 sweep, tools/PERF_NOTES.md).
// Scratch (int32, see encoder_scratch_shape): 8 counters, the table (4N slots of 8 ints), the hot queue,
// per queued id its first tile and an arrival count, the item lists, a mark per position, then one fp32
// row of C per tile.
// Sizes: C a multiple of the 16-byte vector width of dout / wte.
#include "common.cuh"

// ---- kernels ------------------------------------------------------------------------------

// Grid-stride over (position n, vector cv) pairs; the pair is advanced by the stride's quotient and
// remainder with one carry, so there is no 64-bit division per 16-byte vector.
template <typename T>
__device__ void encoder_forward_impl(T* out, const int* tokens, const T* wte, long long N, int C, int V,
                                     long long lo, long long hi) {
    constexpr int VN = Pack16<T>::N;
    const int vecs = C / VN;
    if (vecs == 0) return;
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long n = start / vecs;
    int cv = (int)(start - n * vecs);
    const long long dn = stride / vecs;
    const int dc = (int)(stride - dn * vecs);
    while (n < N) {
        const int c = cv * VN;
        const int t = tokens[n];
        const long long e = (long long)t * C + c;
        Pack16<T> v;
        if (t >= 0 && t < V && e >= lo && e < hi) {
            v = Pack16<T>::load(wte + e);
        } else {
            for (int k = 0; k < VN; ++k) v.v[k] = from_float<T>(0.f);
        }
        v.store(out + (size_t)n * C + c);
        n += dn, cv += dc;
        if (cv >= vecs) cv -= vecs, ++n;
    }
}

constexpr int INLINE = 6;       // positions an id's slot keeps; more make the id "hot"
constexpr int SLOT_INTS = 8;    // key + 1 (0: empty), count, INLINE positions: one 32-byte sector
constexpr int HEAD_INTS = 8;    // counters before the table (HEAD_*)
constexpr int HEAD_QUEUED = 0;  // hot ids queued (step 1)
constexpr int HEAD_MEDIUM = 1;  // medium items listed (step 1's last block)
constexpr int HEAD_TILES = 2;   // tile items listed (step 1's last block)
constexpr int HEAD_NEXT = 3;    // the next hot unit to take (step 2)
constexpr int HEAD_DONE = 4;    // count blocks finished (step 1)
constexpr int PARTIALS = 4;     // partial sums per id and vector (the twin's summation order)
constexpr int SUM_THREADS = 512;
constexpr int SUM_WARPS = SUM_THREADS / 32;
constexpr int HOT_VECS = SUM_THREADS / PARTIALS;  // 16-byte vectors per hot block: a thread per (partial, vector)
constexpr int SCAN_ITEMS = 8;                      // consecutive tokens per thread in the hot scan
constexpr int SCAN_CHUNK = SUM_THREADS * SCAN_ITEMS;
constexpr int LIST = 2 * SCAN_CHUNK;               // positions a hot block holds before it sums them
constexpr int HOT_UNROLL = 4;   // dout rows in flight per thread in a hot sum
constexpr int COMBINE_UNROLL = 4;  // tile partials in flight per thread where a big id's tiles are added
constexpr int COUNT_THREADS = 256;
constexpr int TILE_ALIGN = 32;  // a tile's width is a multiple of this
constexpr int MARK_SKIP = -1;  // a position that adds nothing in the stream role (encoder_backward_mark)
constexpr int MARK_ONE = -2;   // a position whose id occurs once: it adds its row
constexpr int STREAM_U = 2;    // (position, vector) pairs per thread in flight in the stream role (at 4 the
                               // bf16 kernel spills under __launch_bounds__(SUM_THREADS, 2)'s 64 registers)
constexpr int STREAM_PAIRS = 32;  // pairs per thread at most (encoder.py: _STREAM_PAIRS): one bit each
static_assert(INLINE + 2 == SLOT_INTS, "a slot is key, count and INLINE positions");
static_assert(INLINE <= 2 * PARTIALS, "an inline id has at most two terms per partial");
static_assert(SUM_WARPS == 16, "the hot scan's block prefix sums 16 warp totals");
static_assert(COUNT_THREADS == 256, "the plan's block scan sums 8 warp totals");

__device__ __forceinline__ int* hash_table(int* scratch) { return scratch + HEAD_INTS; }
__device__ __forceinline__ unsigned hash_slot(int t, int H) {  // multiplicative hash, mapped onto [0, H)
    return (unsigned)(((unsigned long long)((unsigned)t * 2654435769u) * (unsigned)H) >> 32);
}
// Positions per tile of a big id with k > rows positions out of N: about `rows` of its positions each
// where they are spread evenly; a multiple of TILE_ALIGN, at most N rounded up to it.
__device__ __forceinline__ int tile_width(int k, int N, int rows) {
    const long long num = (long long)N * rows, den = (long long)TILE_ALIGN * k;
    return (int)(TILE_ALIGN * ((num + den - 1) / den));
}

// Step 0: zero the counters and the table, n4 16-byte vectors (grid-stride).
extern "C" __global__ void __launch_bounds__(256) encoder_backward_clear(int4* head, long long n4) {
    launch_dependents();
    const int4 zero = make_int4(0, 0, 0, 0);
    for (long long i = blockIdx.x * 256LL + threadIdx.x; i < n4; i += gridDim.x * 256LL) head[i] = zero;
}

// Step 1's last block: list the hot items. Queued id q (slot hot[q], count k) is one medium item
// (items[0, medium)) if k <= rows, else ceil(N / tile_width(k)) tile items from first[q] =
// qinfo[2q] on (items[qcap + first[q] + t] = q for tile t); qinfo[2q + 1] counts the id's finished tiles.
// Everything read here was written by other blocks of this grid: through L2.
__device__ void encoder_backward_plan(int* scratch, const int* hot, int* qinfo, int* items, int N, int rows,
                                      int qcap) {
    __shared__ int s_warp[2][COUNT_THREADS / 32];
    const int* table = hash_table(scratch);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int queued = __ldcg(&scratch[HEAD_QUEUED]);
    int medium = 0, tiles = 0;  // items listed by earlier rounds
    for (int q0 = 0; q0 < queued; q0 += COUNT_THREADS) {
        const int q = q0 + threadIdx.x;
        int m = 0, b = 0;
        if (q < queued) {
            const int k = __ldcg(&table[__ldcg(&hot[q]) * SLOT_INTS + 1]);
            if (k > rows) {
                const int w = tile_width(k, N, rows);
                b = (N + w - 1) / w;
            } else {
                m = 1;
            }
        }
        int im = m, ib = b;  // inclusive scans within the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int vm = __shfl_up_sync(0xffffffffu, im, o), vb = __shfl_up_sync(0xffffffffu, ib, o);
            if (lane >= o) im += vm, ib += vb;
        }
        if (lane == 31) s_warp[0][warp] = im, s_warp[1][warp] = ib;
        __syncthreads();
        int om = im - m, ob = ib - b, tm = 0, tb = 0;
#pragma unroll
        for (int v = 0; v < COUNT_THREADS / 32; ++v) {
            om += v < warp ? s_warp[0][v] : 0;
            ob += v < warp ? s_warp[1][v] : 0;
            tm += s_warp[0][v];
            tb += s_warp[1][v];
        }
        if (m) {
            items[medium + om] = q;
        } else if (b) {
            qinfo[2 * q] = tiles + ob;
            qinfo[2 * q + 1] = 0;
            for (int t = 0; t < b; ++t) items[qcap + tiles + ob + t] = q;
        }
        medium += tm, tiles += tb;
        __syncthreads();  // s_warp is reused by the next round
    }
    if (threadIdx.x == 0) scratch[HEAD_MEDIUM] = medium, scratch[HEAD_TILES] = tiles;
}

// Step 1: count the ids and keep their first INLINE positions. H = 4N slots: at most a quarter are used.
// The token is read before the wait: it was written before step 0 started (an ordinary launch).
// A slot's key + 1 and count are one 64-bit word (key low: the sum reads them as two ints). The lanes
// of a warp with the same id act as one: the lowest one probes, claiming an empty slot with the group's
// count by one compare-and-swap or adding the group's count to the id's slot, and each lane takes the
// rank base + (its place among the group's lanes). A hot id costs one atomic a warp, not two a position.
// The last block to finish (a fenced counter) plans the hot sums (encoder_backward_plan).
extern "C" __global__ void __launch_bounds__(COUNT_THREADS)
    encoder_backward_count(int* scratch, int* hot, int* qinfo, int* items, const int* tokens, int N, int V, int H,
                           int rows, int qcap) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const int t = n < N ? tokens[n] : -1;
    grid_dependency_wait();
    launch_dependents();
    const bool valid = t >= 0 && t < V;
    const unsigned group = __match_any_sync(0xffffffffu, valid ? t : -1);
    const int leader = __ffs(group) - 1;
    int* table = hash_table(scratch);
    unsigned s = 0;
    int base = 0;
    if (valid && lane == leader) {
        const unsigned long long key = (unsigned)(t + 1), add = (unsigned long long)__popc(group) << 32;
        s = hash_slot(t, H);
        for (;;) {
            auto* word = reinterpret_cast<unsigned long long*>(&table[s * SLOT_INTS]);
            const unsigned long long k = atomicCAS(word, 0ull, add | key);
            if (k == 0) break;
            if ((k & 0xffffffffull) == key) {
                base = (int)(atomicAdd(word, add) >> 32);
                break;
            }
            s = s + 1 == (unsigned)H ? 0 : s + 1;
        }
    }
    s = (unsigned)__shfl_sync(0xffffffffu, (int)s, leader);
    base = __shfl_sync(0xffffffffu, base, leader);
    if (valid) {
        const int r = base + __popc(group & ((1u << lane) - 1u));
        if (r < INLINE) {
            table[s * SLOT_INTS + 2 + r] = n;
        } else if (r == INLINE) {
            hot[atomicAdd(&scratch[HEAD_QUEUED], 1)] = (int)s;
        }
    }
    // the block's table and queue writes, then (fenced, as cooperative groups' grid sync does) its count
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(&scratch[HEAD_DONE], 1) == (int)gridDim.x - 1;
        if (s_last) __threadfence();
    }
    __syncthreads();
    if (s_last) encoder_backward_plan(scratch, hot, qinfo, items, N, rows, qcap);
}

// Step 1b: each position's part in the stream role, once the table is complete: MARK_ONE (its id occurs
// once: it adds its row), its id's slot (it is the first of 2..INLINE positions: it sums them) or
// MARK_SKIP (an invalid id, a hot id's position, a later position of a 2..INLINE id). The sum then reads
// one coalesced int per position instead of probing the table before each row.
extern "C" __global__ void __launch_bounds__(COUNT_THREADS)
    encoder_backward_mark(const int* scratch, int* marks, const int* tokens, int N, int V, int H) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = n < N ? tokens[n] : -1;
    grid_dependency_wait();
    launch_dependents();
    if (n >= N) return;
    int mark = MARK_SKIP;
    if (t >= 0 && t < V) {
        const int* table = scratch + HEAD_INTS;
        unsigned s = hash_slot(t, H);
        while (table[s * SLOT_INTS] != t + 1) s = s + 1 == (unsigned)H ? 0 : s + 1;
        const int4 a = *reinterpret_cast<const int4*>(table + s * SLOT_INTS);
        const int4 z = *reinterpret_cast<const int4*>(table + s * SLOT_INTS + 4);
        if (a.y == 1) {
            mark = MARK_ONE;
        } else if (a.y <= INLINE) {
            const int p[INLINE] = {a.z, a.w, z.x, z.y, z.z, z.w};
            int first = p[0];
#pragma unroll
            for (int r = 1; r < INLINE; ++r)
                if (r < a.y) first = min(first, p[r]);
            if (first == n) mark = (int)s;
        }
    }
    marks[n] = mark;
}

// VN elements of T kept as loaded (16-byte packs where VN elements fill them): a dwte vector beside
// dout's VN-element 16-byte vector, converted to fp32 only where it is added to.
template <typename T, int VN>
struct alignas(VN * sizeof(T) % 16 == 0 ? 16 : alignof(T)) Elems {
    T v[VN];
    __device__ __forceinline__ void load(const T* p) {
        if constexpr (VN * sizeof(T) % 16 == 0) {
#pragma unroll
            for (int q = 0; q < VN * (int)sizeof(T) / 16; ++q)
                reinterpret_cast<Pack16<T>*>(v)[q] = Pack16<T>::load(p + q * Pack16<T>::N);
        } else {
#pragma unroll
            for (int e = 0; e < VN; ++e) v[e] = p[e];
        }
    }
    __device__ __forceinline__ void store(T* p) const {
        if constexpr (VN * sizeof(T) % 16 == 0) {
#pragma unroll
            for (int q = 0; q < VN * (int)sizeof(T) / 16; ++q)
                reinterpret_cast<const Pack16<T>*>(v)[q].store(p + q * Pack16<T>::N);
        } else {
#pragma unroll
            for (int e = 0; e < VN; ++e) p[e] = v[e];
        }
    }
};

__device__ __forceinline__ void sort2(int& a, int& b) {
    const int lo = min(a, b);
    b = max(a, b);
    a = lo;
}

// The positions n in [lo, hi) with tokens[n] == key, summed by the whole block: thread (partial w,
// vector cvl) adds to acc the dout rows of rank = w mod 4 among them, over its channels c (active: c < C).
// Chunks of SCAN_CHUNK tokens are compacted in order into s_list (a block scan of per-thread match
// counts), summed once it may not take another chunk. Returns how many positions matched.
template <typename TD>
__device__ int encoder_backward_scan_sum(float (&acc)[Pack16<TD>::N], const TD* __restrict__ dout,
                                         const int* tokens, int key, int lo, int hi, int C, int c, bool active,
                                         int w) {
    constexpr int VN = Pack16<TD>::N;
    __shared__ int s_list[LIST];
    __shared__ int s_warp[SUM_WARPS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int r0 = 0, fill = 0;  // rank of s_list[0] among the matches; entries in s_list
    for (int base = lo; base < hi; base += SCAN_CHUNK) {
        const int first = base + tid * SCAN_ITEMS;
        unsigned mask = 0;
#pragma unroll
        for (int i = 0; i < SCAN_ITEMS; ++i)
            if (first + i < hi && tokens[first + i] == key) mask |= 1u << i;
        const int cnt = __popc(mask);
        int incl = cnt;  // inclusive scan within the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        int off = fill + incl - cnt, m = 0;
#pragma unroll
        for (int q = 0; q < SUM_WARPS; ++q) {
            const int x = s_warp[q];
            off += q < warp ? x : 0;
            m += x;
        }
        for (int i = 0; i < SCAN_ITEMS; ++i)
            if (mask >> i & 1u) s_list[off++] = first + i;
        fill += m;
        __syncthreads();  // s_list is complete; s_warp is read before the next chunk writes it
        if (fill > LIST - SCAN_CHUNK || base + SCAN_CHUNK >= hi) {
            if (active) {
                for (int i = (w - r0) & (PARTIALS - 1); i < fill; i += PARTIALS * HOT_UNROLL) {
                    Pack16<TD> v[HOT_UNROLL];
#pragma unroll
                    for (int u = 0; u < HOT_UNROLL; ++u) {
                        const int j = i + u * PARTIALS;
                        if (j < fill) {
                            v[u] = Pack16<TD>::load(dout + (size_t)s_list[j] * C + c);
                        } else {
#pragma unroll
                            for (int e = 0; e < VN; ++e) v[u].v[e] = from_float<TD>(0.f);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < HOT_UNROLL; ++u)
                        if (i + u * PARTIALS < fill)
#pragma unroll
                            for (int e = 0; e < VN; ++e) acc[e] += to_float(v[u].v[e]);
                }
            }
            r0 += fill, fill = 0;
            __syncthreads();  // s_list is refilled from 0
        }
    }
    return r0;
}

// ((p0 + p1) + p2) + p3 of the 4 partials the threads (w, cvl) hold, into acc of the w == 0 threads.
template <int VN>
__device__ __forceinline__ void encoder_backward_combine4(float (&acc)[VN], int w, int cvl, bool active) {
    __shared__ float s_part[PARTIALS - 1][VN][HOT_VECS];
    if (w > 0 && active)
#pragma unroll
        for (int e = 0; e < VN; ++e) s_part[w - 1][e][cvl] = acc[e];
    __syncthreads();
    if (w == 0 && active)
#pragma unroll
        for (int p = 1; p < PARTIALS; ++p)
#pragma unroll
            for (int e = 0; e < VN; ++e) acc[e] = acc[e] + s_part[p - 1][e][cvl];
    __syncthreads();  // s_part is reused by the block's next sum
}

// dwte row key, channels c..c + VN: += total, rounded once.
template <typename TG, int VN>
__device__ __forceinline__ void encoder_backward_add_row(TG* dwte, int key, int C, int c, const float (&total)[VN]) {
    TG* row = dwte + (size_t)key * C + c;
    Elems<TG, VN> old;
    old.load(row);
#pragma unroll
    for (int e = 0; e < VN; ++e) old.v[e] = from_float<TG>(to_float(old.v[e]) + total[e]);
    old.store(row);
}

// The hot role: blocks take units (item, channel chunk y of HOT_VECS vectors) from a counter until none
// is left. A medium item sums its id over all tokens into dwte. Tile t of a big id sums the id's
// positions in [t * width, (t + 1) * width) into its fp32 partial row (zeros where none); the block
// that finishes the id's last unit (a fenced counter) adds the id's partials to dwte: partial w of
// sum4 takes tiles w, w + 4, ... in order (loads through L2: other blocks wrote them in this launch).
// Not inlined: with it the stream role spills at the kernel's 64 registers.
template <typename TG, typename TD>
__device__ __noinline__ void encoder_backward_hot_role(TG* __restrict__ dwte, const TD* __restrict__ dout,
                                                       const int* tokens, int* scratch, const int* hot, int* qinfo,
                                                       const int* items, float* partials, int N, int C, int rows,
                                                       int ychunks, int qcap) {
    constexpr int VN = Pack16<TD>::N;
    __shared__ int s_unit, s_last;
    const int* table = hash_table(scratch);
    const int tid = threadIdx.x, w = tid / HOT_VECS, cvl = tid % HOT_VECS;
    const int medium = scratch[HEAD_MEDIUM], units = (medium + scratch[HEAD_TILES]) * ychunks;
    for (;;) {
        if (tid == 0) s_unit = atomicAdd(&scratch[HEAD_NEXT], 1);
        __syncthreads();
        const int u = s_unit;
        __syncthreads();  // s_unit is read before thread 0 writes the next one
        if (u >= units) return;
        const int item = u / ychunks, y = u % ychunks;
        const int c = (y * HOT_VECS + cvl) * VN;
        const bool active = c < C;
        float acc[VN];
#pragma unroll
        for (int e = 0; e < VN; ++e) acc[e] = 0.f;
        if (item < medium) {
            const int key = table[hot[items[item]] * SLOT_INTS] - 1;
            encoder_backward_scan_sum<TD>(acc, dout, tokens, key, 0, N, C, c, active, w);
            encoder_backward_combine4<VN>(acc, w, cvl, active);
            if (w == 0 && active) encoder_backward_add_row<TG, VN>(dwte, key, C, c, acc);
            continue;
        }
        const int i = item - medium, q = items[qcap + i];
        const int* slot = table + hot[q] * SLOT_INTS;
        const int key = slot[0] - 1, width = tile_width(slot[1], N, rows), first = qinfo[2 * q];
        const int lo = (i - first) * width, tiles = (N + width - 1) / width;
        encoder_backward_scan_sum<TD>(acc, dout, tokens, key, lo, min(lo + width, N), C, c, active, w);
        encoder_backward_combine4<VN>(acc, w, cvl, active);
        if (w == 0 && active)
#pragma unroll
            for (int e = 0; e < VN; e += 4)
                *reinterpret_cast<float4*>(partials + (size_t)i * C + c + e) =
                    make_float4(acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
        __syncthreads();  // the block's partial, then (fenced) the unit counted done
        if (tid == 0) {
            __threadfence();
            s_last = atomicAdd(&qinfo[2 * q + 1], 1) == tiles * ychunks - 1;
            if (s_last) __threadfence();
        }
        __syncthreads();
        if (!s_last) continue;
        for (int yy = 0; yy < ychunks; ++yy) {  // the last unit: every tile's partial is written
            const int cc = (yy * HOT_VECS + cvl) * VN;
            const bool on = cc < C;
#pragma unroll
            for (int e = 0; e < VN; ++e) acc[e] = 0.f;
            if (on) {
                for (int t = w; t < tiles; t += PARTIALS * COMBINE_UNROLL) {
                    float4 v[COMBINE_UNROLL][VN / 4];
#pragma unroll
                    for (int r = 0; r < COMBINE_UNROLL; ++r)
#pragma unroll
                        for (int e = 0; e < VN / 4; ++e)
                            v[r][e] = t + r * PARTIALS < tiles
                                          ? __ldcg(reinterpret_cast<const float4*>(
                                                partials + (size_t)(first + t + r * PARTIALS) * C + cc) + e)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                    for (int r = 0; r < COMBINE_UNROLL; ++r)
                        if (t + r * PARTIALS < tiles)
#pragma unroll
                            for (int e = 0; e < VN / 4; ++e) {
                                acc[4 * e] += v[r][e].x, acc[4 * e + 1] += v[r][e].y;
                                acc[4 * e + 2] += v[r][e].z, acc[4 * e + 3] += v[r][e].w;
                            }
                }
            }
            encoder_backward_combine4<VN>(acc, w, cvl, on);
            if (w == 0 && on) encoder_backward_add_row<TG, VN>(dwte, key, C, cc, acc);
        }
    }
}

// Vector c..c + VN of an id with k = 2..INLINE positions, its slot's (sorted here), summed in the
// twin's order: partial p takes ranks p and p + 4 from 0.f, total ((p0 + p1) + p2) + p3, one rounding.
// Not inlined: the stream role keeps STREAM_U pairs in flight in the registers this would take.
template <typename TG, typename TD>
__device__ __noinline__ void encoder_backward_few(TG* __restrict__ dwte, const TD* __restrict__ dout,
                                                  const int* slot, int key, int C, int c) {
    constexpr int VN = Pack16<TD>::N;
    const int4 a = *reinterpret_cast<const int4*>(slot), z = *reinterpret_cast<const int4*>(slot + 4);
    const int k = a.y;
    int q[INLINE] = {a.z, a.w, z.x, z.y, z.z, z.w};
#pragma unroll
    for (int r = 0; r < INLINE; ++r)
        if (r >= k) q[r] = 0x7fffffff;
    // sorting network for 6 (12 comparators)
    sort2(q[0], q[5]), sort2(q[1], q[3]), sort2(q[2], q[4]);
    sort2(q[1], q[2]), sort2(q[3], q[4]);
    sort2(q[0], q[3]), sort2(q[2], q[5]);
    sort2(q[0], q[1]), sort2(q[2], q[3]), sort2(q[4], q[5]);
    sort2(q[1], q[2]), sort2(q[3], q[4]);
    Pack16<TD> d[INLINE];
#pragma unroll
    for (int r = 0; r < INLINE; ++r) {
        if (r < k) {
            d[r] = Pack16<TD>::load(dout + (size_t)q[r] * C + c);
        } else {
#pragma unroll
            for (int e = 0; e < VN; ++e) d[r].v[e] = from_float<TD>(0.f);
        }
    }
    TG* row = dwte + (size_t)key * C + c;
    Elems<TG, VN> old;
    old.load(row);
#pragma unroll
    for (int e = 0; e < VN; ++e) {
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < PARTIALS; ++p) {
            float part = 0.f;  // ranks p and p + 4 (INLINE <= 2 * PARTIALS), from 0.f as the twin
#pragma unroll
            for (int r = p; r < INLINE; r += PARTIALS)
                if (r < k) part += to_float(d[r].v[e]);
            total = p == 0 ? part : total + part;
        }
        old.v[e] = from_float<TG>(to_float(old.v[e]) + total);
    }
    old.store(row);
}

// Pair q's vector offset c within its row, its mark and its id (MARK_SKIP past end).
template <int VN>
__device__ __forceinline__ void stream_pair(const int* marks, const int* tokens, unsigned q, unsigned end,
                                            unsigned vecs, int& c, int& mark, int& key) {
    const int n = (int)(q / vecs);
    c = (int)(q - n * vecs) * VN;
    mark = q < end ? marks[n] : MARK_SKIP;
    key = q < end ? tokens[n] : 0;
}

// The stream role: the (position n, vector cv) pairs [begin, end) of the flat N x vecs range, one 16-byte
// vector per pair, in rounds of U pairs per thread SUM_THREADS apart (at most STREAM_PAIRS pairs per
// thread: the launcher sizes the grid so). A round's dout and dwte vectors are in flight together with
// the next round's marks and ids, so a round costs one round trip. A MARK_ONE position adds its dout
// vector to its id's dwte vector as (0.f + d), rounded once; the first position of a 2..INLINE id is
// flagged and, after the rounds, sums the id's vectors (encoder_backward_few: a call inside the rounds
// made the compiler spill them); the rest touch nothing. Every dwte vector has one writer.
template <typename TG, typename TD>
__device__ void encoder_backward_stream(TG* __restrict__ dwte, const TD* __restrict__ dout, const int* tokens,
                                        const int* marks, const int* table, int C, unsigned begin, unsigned end) {
    constexpr int VN = Pack16<TD>::N;
    constexpr int U = STREAM_U;
    const unsigned vecs = (unsigned)(C / VN), first = begin + threadIdx.x;
    unsigned multi = 0;  // bit i: this thread's pair first + i * SUM_THREADS is a 2..INLINE id's first position
    int c[U], mark[U], key[U];
#pragma unroll
    for (int u = 0; u < U; ++u) stream_pair<VN>(marks, tokens, first + u * SUM_THREADS, end, vecs, c[u], mark[u], key[u]);
    for (int r = 0; first + r * U * SUM_THREADS < end; ++r) {
        const unsigned p0 = first + r * U * SUM_THREADS;
        Pack16<TD> d[U];
        Elems<TG, VN> o[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (mark[u] == MARK_ONE) {
                d[u] = Pack16<TD>::load(dout + (size_t)(p0 + u * SUM_THREADS) * VN);
                o[u].load(dwte + (size_t)key[u] * C + c[u]);
            }
            if (mark[u] >= 0) multi |= 1u << (r * U + u);
        }
        int c2[U], mark2[U], key2[U];  // the next round's, in flight beside this round's vectors
#pragma unroll
        for (int u = 0; u < U; ++u)
            stream_pair<VN>(marks, tokens, p0 + (U + u) * SUM_THREADS, end, vecs, c2[u], mark2[u], key2[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (mark[u] == MARK_ONE) {
#pragma unroll
                for (int e = 0; e < VN; ++e) o[u].v[e] = from_float<TG>(to_float(o[u].v[e]) + (0.f + to_float(d[u].v[e])));
                o[u].store(dwte + (size_t)key[u] * C + c[u]);
            }
            c[u] = c2[u], mark[u] = mark2[u], key[u] = key2[u];
        }
    }
    while (multi) {
        const int i = __ffs(multi) - 1;
        multi &= multi - 1;
        const unsigned q = first + i * SUM_THREADS;
        const int n = (int)(q / vecs), mark1 = marks[n];
        encoder_backward_few<TG, TD>(dwte, dout, table + mark1 * SLOT_INTS, tokens[n], C, (int)(q - n * vecs) * VN);
    }
}

// Step 2. Blocks [0, hot_blocks) take hot units only; the others stream per_block pairs each, in order,
// then take hot units too (if there are any: the counts are read before the stream).
template <typename TG, typename TD>
__device__ void encoder_backward_sum_impl(TG* dwte, const TD* dout, const int* tokens, int* scratch, const int* marks,
                                          const int* hot, int* qinfo, const int* items, float* partials, int N,
                                          int C, int rows, int qcap, int hot_blocks, int ychunks, int per_block) {
    grid_dependency_wait();
    if ((int)blockIdx.x < hot_blocks) {
        encoder_backward_hot_role<TG, TD>(dwte, dout, tokens, scratch, hot, qinfo, items, partials, N, C, rows,
                                          ychunks, qcap);
        return;
    }
    const bool hot_units = scratch[HEAD_MEDIUM] + scratch[HEAD_TILES] > 0;
    const unsigned pairs = (unsigned)N * (unsigned)(C / Pack16<TD>::N);
    const unsigned begin = min((blockIdx.x - hot_blocks) * (unsigned)per_block, pairs);
    const unsigned end = min(begin + (unsigned)per_block, pairs);
    encoder_backward_stream<TG, TD>(dwte, dout, tokens, marks, hash_table(scratch), C, begin, end);
    if (hot_units)
        encoder_backward_hot_role<TG, TD>(dwte, dout, tokens, scratch, hot, qinfo, items, partials, N, C, rows,
                                          ychunks, qcap);
}

// ---- launchers ----------------------------------------------------------------------------

#define ENCODER_FORWARD(SUF, T)                                                                         \
    extern "C" __global__ void encoder_forward_##SUF(T* out, const int* tokens, const T* wte, long long N, \
                                                     int C, int V, long long lo, long long hi) {        \
        encoder_forward_impl<T>(out, tokens, wte, N, C, V, lo, hi);                                    \
    }
ENCODER_FORWARD(f32, float)
ENCODER_FORWARD(bf16, bf16)
ENCODER_FORWARD(f16, half)

#define ENCODER_BACKWARD_SUM(SUFG, TG, SUFD, TD)                                                            \
    extern "C" __global__ void __launch_bounds__(SUM_THREADS, 2) encoder_backward_sum_##SUFG##_##SUFD(      \
        TG* dwte, const TD* dout, const int* tokens, int* scratch, const int* marks, const int* hot, int* qinfo, \
        const int* items, float* partials, int N, int C, int rows, int qcap, int hot_blocks, int ychunks,     \
        int per_block) {                                                                                    \
        encoder_backward_sum_impl<TG, TD>(dwte, dout, tokens, scratch, marks, hot, qinfo, items, partials, N, C, \
                                          rows, qcap, hot_blocks, ychunks, per_block);                       \
    }
#define ENCODER_BACKWARD_SUM_ALL(SUFG, TG)          \
    ENCODER_BACKWARD_SUM(SUFG, TG, f32, float)      \
    ENCODER_BACKWARD_SUM(SUFG, TG, bf16, bf16)      \
    ENCODER_BACKWARD_SUM(SUFG, TG, f16, half)
ENCODER_BACKWARD_SUM_ALL(f32, float)
ENCODER_BACKWARD_SUM_ALL(bf16, bf16)
ENCODER_BACKWARD_SUM_ALL(f16, half)
