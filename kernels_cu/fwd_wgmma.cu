// fwd_wgmma.cu: FlashAttention forward pass on Hopper (sm_90a), FlashAttention-3's structure: TMA
// loads from tensor maps, an mbarrier pipeline, warp specialization, wgmma, setmaxnreg.
//
// Tiles: the ceil(nq / FC_BLOCK_M) x Hq x B (query tile, head, batch) tiles. With FC_WG_PERSISTENT 1
// (below) CTA x runs the tiles x, x + gridDim.x, ..., the query tile fastest (so the CTAs running at
// once share a head's K and V in L2; causal runs each head's heaviest tiles first); with
// FC_WG_PERSISTENT 2 CTA x runs tile x, then whichever tile a global counter hands it next (the
// producer fetches it while the consumers run this one) in an order that puts the heaviest tiles of
// a few heads first (FlashAttention-3's dynamic scheduler; "the tile order" below). Either way any grid
// size gives the same bits (the launch uses one CTA per SM). Without it each CTA runs the one tile of
// its block index.
// A tile is FC_BLOCK_M query rows of one (batch, query head). The CTA's warpgroups (128 threads):
//   warpgroup 0, the producer: gives registers back (setmaxnreg.dec) and one thread issues every TMA
//       load: per tile the Q tile (once the consumers have seen the previous tile's last S: the
//       "q_empty" mbarrier), then K_j and V_j for each key tile j into a ring of FC_KV_STAGES
//       buffers, each guarded by a "full" mbarrier (TMA transaction bytes) and an "empty" mbarrier
//       (one arrival per consumer warp once its wgmma has read the buffer). The ring runs on across
//       tiles, so the next tile's Q, K and V load while the consumers finish this one.
//   warpgroups 1 .. NCWG, the consumers (NCWG = FC_BLOCK_M / 64): take registers (setmaxnreg.inc);
//       consumer c owns query rows 64c .. 64c+63 of the tile; per key tile j:
//           S = Q K_j^T            wgmma m64nBNk16, A = Q, B = K_j, both from shared memory (K-major)
//           mask, online softmax   fc_softmax_step per row, P = exp2(S c - sub) (fc_softmax_p)
//           O *= alpha             skipped when every alpha of the warp is 1
//           O += P V_j             wgmma m64nDk16, A = P from registers (rounded to the element type),
//                                  B = V_j from shared memory, MN-major (transpose bit)
//       and at the end o = O / l, lse = m * scale + ln l (o = 0, lse = -inf for rows that see no key):
//       lse straight from registers, o (FC_WG_O_STAGE, below) through shared memory and a TMA store, or
//       straight from registers.
// Schedule (FlashAttention-3's step 2; knobs FC_WG_* below, none changes a bit of the result):
//   inside a consumer warpgroup, S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together and the
//   softmax of tile j runs while P_{j-1} V_{j-1} is on the tensor cores (wait_group<1>); P_j is
//   rounded into the A fragments only after wait_group<0> (writing A registers of a wgmma while a group
//   is in flight makes ptxas serialize all wgmma: C7513). With two consumer warpgroups they take turns
//   to issue their products (pingpong, named barriers 1 and 2).
//
// Tensor maps (flashcupy/_tma.py): 4-D (D, N, H, B) over the real strides of q, k, v, box (64, rows,
// 1, 1), 128-byte swizzle. Tiles are addressed by coordinates (64 p, n0, h, b), so rows past N come
// back as zeros from TMA's out-of-bounds fill and (B, N, H, D) views need no copy. A tile of D
// columns is D / 64 panels of rows x 128 bytes (wgmma_common.cuh), one TMA box each.
//
// Rounding model (flash_common.cuh): accum fp32: S and O in fp32 wgmma accumulators; m, l in fp32;
// P in fp32, l takes the fp32 row sums, P is rounded to the element type before P V. accum fp16
// (fp16 inputs): S and O in fp16 wgmma accumulators (each k16 instruction rounds its result to
// fp16); P computed in fp32 from the fp16 scores and rounded to fp16 in place, which is both its
// accumulator and its element rounding, so the S registers become P V's A fragments by a copy; l
// keeps the full fp32 row sum of the unrounded P, rounded to fp16 once per tile (fc_softmax_l).
//
// Kernel parameters: four CUtensorMap (128 bytes, by value) for q, k, v and o (box (64, 64, 1, 1), read
// only by FC_WG_O_STAGE 1 and 2), then FC_FWD_PARAMS
// (the pointers and strides of q, k, v are not read: the tensor maps carry them), then Hq, B and
// tile_counter (read only by FC_WG_PERSISTENT 2).
// Grid: persistent, (any number of CTAs, 1, 1), e.g. min(tiles, SMs), every grid size writing the same
// bits; one tile per CTA, (ceil(nq / FC_BLOCK_M), Hq, B).
// Block: FC_NUM_THREADS = 128 * (1 + FC_BLOCK_M / 64).
// Dynamic shared memory (bytes), to be passed at launch and as FC_SMEM_FWD:
//     1024 (alignment slack) + (FC_BLOCK_M + 2 * FC_KV_STAGES * FC_BLOCK_N) * FC_HEAD_DIM * 2
//     + FC_BLOCK_M * FC_HEAD_DIM * 2  (only with FC_WG_O_STAGE 2: the o buffer)
//     + 8 * (2 + 4 * FC_KV_STAGES)  (mbarriers) + 8  (the tile slot of FC_WG_PERSISTENT 2)
// Supported: FC_DTYPE 1 or 2; FC_ACCUM_F16 only with FC_DTYPE 1; FC_HEAD_DIM in {64, 128, 256};
// FC_BLOCK_M in {64, 128, 192}, FC_BLOCK_N in {64, 128}, and FlashAttention-3's wide key tiles: 176 at
// D=128 (FC_BLOCK_M <= 128) and 80 at D=256 (D=256: FC_BLOCK_M 64 or 128, FC_BLOCK_N 64 or 80, so that
// the O accumulator and the K/V stages fit); FC_KV_STAGES >= 2 (default 2).
//
// fp8 (FC_FP8 = 1; FlashAttention-3's fp8 forward, issue 13): q, k, v are e4m3 bytes, FC_DTYPE the
// output's type; D = 128 or 256, FC_BLOCK_N = 128, fp32 accumulators (flashcupy/_families.py keeps D=256 to
// single-level accumulation on 128 rows: its O takes 128 registers a thread). Differences from the
// 16-bit path:
//   * wgmma m64nNk32 on e4m3 (k32 steps of 32 bytes: 128 elements of a row are one 128-byte panel);
//   * V is read transposed: e4m3 wgmma takes K-major operands only, so flash_fwd_fp8_v_transpose (end of
//     this file) first writes V^T (d x keys) with the keys of each group of 16 in the column order of P's
//     register fragment, and P V is an rs wgmma with B = V^T K-major (the producer loads V^T tiles);
//   * S = (Q8 K8^T) * (q descale per row) * (k descale per key or per key tile), folded into the
//     exponent where the k descale is constant over the tile; P comes out multiplied by the static
//     p_scale (log2 p_scale added to the exponent) and is rounded to e4m3 (cvt.rn.satfinite) into the A
//     fragments; l sums that P, and o = O * (v descale per head) / l, lse = m scale + ln(l / p_scale);
//   * FC_FP8_TWO_LEVEL: each tile's P V in a fresh accumulator, added to O by fp32 adds (two-level
//     accumulation), instead of the tensor core's 14-bit truncating accumulator carrying O across tiles.
// Rounding model: flashcupy._twin.forward_fp8 (tests/flashcupy/test_fp8_gpu.py checks the agreement).

// (this kernel reads its key tiles through fc_key_token: it may be built with FC_PAGED)
#define FC_READS_PAGES 1
#include "flash_common.cuh"
#include "wgmma_common.cuh"

#ifndef FC_KV_STAGES
#define FC_KV_STAGES 2
#endif
// Scheduling knobs (optional; they change only the order in which the products are issued, never a
// result: every variant writes the same bits):
//   FC_WG_OVERLAP   1: software pipeline inside a consumer warpgroup: S_j = Q K_j^T and O += P_{j-1} V_{j-1}
//                   are issued together and the softmax of tile j runs while P_{j-1} V_{j-1} is on the
//                   tensor cores, and O *= alpha_{j-1} runs while S_j is on them (just before P_{j-1} V_{j-1}
//                   is issued). Default: 1 when FC_BLOCK_M <= 128.
//   FC_WG_PINGPONG  1: with two consumer warpgroups, they take turns to issue their products (named
//                   barriers 1 and 2), so one's softmax runs while the other's products run. Default 1
//                   when FC_BLOCK_M == 128.
//   FC_WG_PERSISTENT  (set by the build layer, flashcupy/_policy.py wgmma_persistent) 1: the CTA loops over
//                   tiles, a static split (any grid size; the launch uses one CTA per SM); 2: the CTA
//                   loops over the tiles a global counter hands out (tile_counter: two ints, zero
//                   before the launch, zero again after it: the last CTA to finish resets them); 0: one
//                   tile per CTA, grid (ceil(nq / FC_BLOCK_M), Hq, B).
#ifndef FC_WG_PERSISTENT
#error "fwd_wgmma: FC_WG_PERSISTENT (0, 1 or 2) must be defined by the build layer"
#endif
//   FC_WG_O_STAGE   (set by the build layer, wgmma_o_stage) how o leaves the CTA. 1 and 2: each consumer
//                   warpgroup writes its 64 rows of o into shared memory (HD / 64 panels of 64 rows x 128
//                   bytes, 128-byte swizzle, conflict-free 4-byte stores), and one of its threads stores
//                   them with TMA (whole 128-byte lines; rows past nq are not written): 1 into its own rows
//                   of the Q buffer (one tile per CTA: Q is not read after the warpgroup's last S), 2 into
//                   a buffer of its own (the tile loops, whose next Q loads during this tile's end);
//                   measured on the H200 (docs/design/wgmma_forward.md). 0: straight from registers, 4-byte
//                   stores of half 32-byte sectors (fp8, and loops whose tile leaves no room for a buffer).
#ifndef FC_WG_O_STAGE
#error "fwd_wgmma: FC_WG_O_STAGE (0, 1 or 2) must be defined by the build layer"
#endif
#ifndef FC_WG_OVERLAP
#define FC_WG_OVERLAP (FC_BLOCK_M <= 128)
#endif
#ifndef FC_WG_PINGPONG
#define FC_WG_PINGPONG (FC_BLOCK_M == 128)
#endif

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int HD = FC_HEAD_DIM;
constexpr int STAGES = FC_KV_STAGES;
constexpr int NCWG = BM / 64;              // consumer warpgroups, 64 query rows each
constexpr int NTHR = 128 * (1 + NCWG);
constexpr int EB = FC_FP8 ? 1 : 2;         // bytes of an MMA operand element
constexpr int PANEL_ELEMS = 128 / EB;      // elements of a 128-byte panel row
constexpr int PANELS = HD / PANEL_ELEMS;   // 128-byte column panels per Q / K tile row
constexpr int KSTEPS = HD * EB / 32;       // k steps (32 bytes each: k16, or k32 on e4m3) of S = Q K^T
constexpr int PSTEPS = BN * EB / 32;       // k steps of O += P V
constexpr int SN = WgMma<BN>::REGS;        // S accumulator registers per thread (BN / 8 tiles)
constexpr int ON = WgMma<HD>::REGS;        // O accumulator registers per thread (HD / 8 tiles)

static_assert(HD == 64 || HD == 128 || HD == 256, "fwd_wgmma: FC_HEAD_DIM must be 64, 128 or 256");
static_assert(FC_HEAD_DIM_PAD >= HD, "FC_HEAD_DIM_PAD must cover FC_HEAD_DIM");
static_assert(BM == 64 || BM == 128 || BM == 192, "fwd_wgmma: FC_BLOCK_M must be 64, 128 or 192");
static_assert(BN == 64 || BN == 80 || BN == 128 || BN == 176,
              "fwd_wgmma: FC_BLOCK_N must be 64, 80, 128 or 176");
static_assert(HD < 256 || (BM <= 128 && (BN == 64 || BN == 80 || FC_FP8)),
              "fwd_wgmma: D=256 runs FC_BLOCK_M 64 or 128, FC_BLOCK_N 64 or 80 (128 with e4m3 operands)");
static_assert((BN != 80 || HD == 256) && (BN != 176 || (HD == 128 && BM <= 128)),
              "fwd_wgmma: FC_BLOCK_N 80 runs at D=256, 176 at D=128 with FC_BLOCK_M <= 128");
static_assert(STAGES >= 2, "fwd_wgmma: FC_KV_STAGES must be at least 2");
static_assert(FC_WG_O_STAGE == 0 || (!FC_FP8 && (FC_WG_O_STAGE == 2 || !FC_WG_PERSISTENT)),
              "fwd_wgmma: o goes through the Q buffer (FC_WG_O_STAGE 1) with one tile per CTA only, and "
              "e4m3 variants write it from registers");
static_assert(FC_NUM_THREADS == NTHR, "fwd_wgmma: FC_NUM_THREADS must be 128 * (1 + FC_BLOCK_M / 64)");
static_assert(!FC_VARLEN || !FC_FP8, "fwd_wgmma: packed sequences (FC_VARLEN) run 16-bit operands");
#if FC_FP8
static_assert((HD == 128 || HD == 256) && BN == 128 && !FC_ACCUM_F16,
              "fwd_wgmma fp8: D 128 or 256, FC_BLOCK_N 128, fp32 accumulators");
#endif
// fp8 knobs (FC_FP8 = 1, e4m3 q, k, v; see "fp8" at the top):
//   FC_FP8_TWO_LEVEL  1: each key tile's P V in a fresh accumulator, added to an fp32 O by fp32 adds;
//                     0: the tensor core's accumulator carries O across the key tiles.
//   FC_FP8_KSCALE_KEY 1: k's descale varies within a key tile (one per key); 0: constant over each
//                     key tile (per tensor, head, or blocks of a multiple of FC_BLOCK_N keys).
#ifndef FC_FP8_TWO_LEVEL
#define FC_FP8_TWO_LEVEL 0
#endif
#ifndef FC_FP8_KSCALE_KEY
#define FC_FP8_KSCALE_KEY 0
#endif

// Shared-memory layout (offsets from a 1024-byte aligned base).
constexpr int Q_PANEL = BM * 128, KV_PANEL = BN * 128;   // bytes of one panel
constexpr int Q_BYTES = BM * HD * EB, KV_BYTES = BN * HD * EB;
constexpr int OFF_K = Q_BYTES;
constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
constexpr int OFF_O = OFF_V + STAGES * KV_BYTES;     // FC_WG_O_STAGE 2: o, laid out as the Q tile
constexpr int O_PANEL = BM * 128;                    // bytes of one panel of o (64 columns)
constexpr int OFF_BAR = OFF_O + (FC_WG_O_STAGE == 2 ? BM * HD * 2 : 0);
constexpr int N_BARS = 2 + 4 * STAGES;     // q_full, q_empty, k_full[], k_empty[], v_full[], v_empty[]
constexpr int OFF_SLOT = OFF_BAR + 8 * N_BARS;  // FC_WG_PERSISTENT 2: the next tile's index
constexpr int SMEM_NEEDED = 1024 + OFF_SLOT + 8;
static_assert(FC_SMEM_FWD == SMEM_NEEDED,
              "shared memory (Q, K/V stages, o buffer, mbarriers, tile slot) differs from FC_SMEM_FWD");

// Registers per thread after setmaxnreg: the producer keeps few, the consumers share the rest of the
// registers the CTA was launched with (128 * (PRODUCER_REGS + NCWG * CONSUMER_REGS) <= NTHR x 65536 / NTHR
// rounded down to 8, multiples of 8; bwd_wgmma.cu asserts it).
constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = NCWG == 3 ? 160 : 240;


// ------------------------------------------------------------------ tile schedule ---------------
// A tile: query rows m0 .. m0 + BM - 1 of head h of batch entry b (seq: its place and lengths, the batch
// entries of flash_common.cuh), and the key tiles it visits and masks (the range hook, flash_common.cuh;
// none where the entry has no row m0, which only a packed sequence shorter than the longest has).
struct FwdTile {
    int m0, h, b;
    FcKeyTiles keys;
    FcSeq seq;
};

__device__ __forceinline__ FwdTile fwd_tile(int m_tile, int h, int b, const FcEntries &entries) {
    const FcSeq seq = entries(b);
    const int m0 = m_tile * BM;
    const FcKeyTiles keys = FC_VARLEN && m0 >= seq.nq ? FcKeyTiles{0, 0, 0, 0, 0}
                                                      : fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk);
    return FwdTile{m0, h, b, keys, seq};
}

// The walk: the tiles a CTA runs, named by an index w: first(), has(w), at(w) (the tile), and next(w)
// for the static walks. nq and nk are the extent of the tiles (FC_GRID_NQ, FC_GRID_NK: the longest
// packed sequence's, with FC_VARLEN); each tile's own lengths come from its entry. The dynamic walk's
// next index is not the CTA's to compute: the producer takes it from the counter and hands it to the
// consumers through shared memory (the kernel's slot).
#if FC_WG_PERSISTENT == 0
// One tile per CTA: (blockIdx.x, blockIdx.y, blockIdx.z) = (query tile, head, batch); causal grids run
// the heaviest query tiles first (fc_query_tile).
struct FwdWalk {
    FcEntries entries;
    __device__ __forceinline__ FwdWalk(const FcEntries &e, int, int, int, int, int) : entries(e) {}
    __device__ __forceinline__ int first() const { return 0; }
    __device__ __forceinline__ bool has(int w) const { return w == 0; }
    __device__ __forceinline__ int next(int) const { return 1; }
    __device__ __forceinline__ FwdTile at(int) const {
        return fwd_tile(fc_query_tile(), blockIdx.y, blockIdx.z, entries);
    }
};
#elif FC_WG_PERSISTENT == 1
// A static split: CTA x runs tiles x, x + gridDim.x, ... of the n_mt * heads_q * batch (query tile,
// head, batch) tiles, the query tile fastest (neighbouring CTAs share a head's K and V in L2).
struct FwdWalk {
    FcEntries entries;
    int heads_q, n_mt, n_work;
    __device__ __forceinline__ FwdWalk(const FcEntries &e, int nq, int, int heads_q_, int batch, int)
        : entries(e), heads_q(heads_q_), n_mt((nq + BM - 1) / BM), n_work(n_mt * heads_q_ * batch) {}
    __device__ __forceinline__ int first() const { return blockIdx.x; }
    __device__ __forceinline__ bool has(int w) const { return n_work > w; }
    __device__ __forceinline__ int next(int w) const { return w + gridDim.x; }
    __device__ __forceinline__ FwdTile at(int w) const {
        const int bh = w / n_mt;
        return fwd_tile(fc_query_tile(w - bh * n_mt, n_mt), bh % heads_q, bh / heads_q, entries);
    }
};
#else
// The dynamic walk: the CTA's first tile is blockIdx.x, each next one comes from a global counter.
// The tile order: the (batch, query head) pairs in sections of hs, the query heads of a power of two of
// KV heads whose K and V fit in 32 MB (of the H200's 50 MB of L2) together (at most all the pairs, so
// that hs n_mt <= n_work); inside a section the query tile is the slow index (causal: the heaviest
// first), so the CTAs running at once read a few heads' K and V and the heaviest tiles of a section
// start first (longest processing time first). The last section holds the remaining pairs.
struct FwdWalk {
    FcEntries entries;
    int heads_q, n_mt, n_bh, n_work, hs;
    __device__ __forceinline__ FwdWalk(const FcEntries &e, int nq, int nk, int heads_q_, int batch, int group)
        : entries(e), heads_q(heads_q_), n_mt((nq + BM - 1) / BM), n_bh(heads_q_ * batch),
          n_work(n_mt * n_bh) {
        const long long kv_head_bytes = 2ll * max(nk, 1) * HD * EB, l2_kv = 32ll << 20;
        const long long hs_l2 =
            group * (kv_head_bytes >= l2_kv ? 1ll : 1ll << (31 - __clz((int)(l2_kv / kv_head_bytes))));
        hs = (int)min(hs_l2, (long long)n_bh);
    }
    __device__ __forceinline__ int first() const { return blockIdx.x; }
    __device__ __forceinline__ bool has(int w) const { return n_work > w; }
    __device__ __forceinline__ FwdTile at(int w) const {
        const int sec = w / (hs * n_mt), first = sec * hs, in_sec = min(hs, n_bh - first);
        const int r = w - first * n_mt, mt = r / in_sec, bh = first + (r - mt * in_sec);
        return fwd_tile(fc_query_tile(mt, n_mt), bh % heads_q, bh / heads_q, entries);
    }
};
#endif

#if FC_FP8
// fp8: the descales (float32): q_ds (B, Hq, nq) per query row, k_ds (B, Hkv, nk) per key, v_ds (B, Hkv)
// per head, and P's static scale with its log2.
#define FC_FP8_PARAMS , const float *__restrict__ q_ds, const float *__restrict__ k_ds, \
    const float *__restrict__ v_ds, const float p_scale, const float p_scale_log2
#else
#define FC_FP8_PARAMS
#endif

extern "C" __global__ void __launch_bounds__(NTHR, 1)
    flash_fwd_wgmma(const __grid_constant__ FcTensorMap tm_q, const __grid_constant__ FcTensorMap tm_k,
                    const __grid_constant__ FcTensorMap tm_v, const __grid_constant__ FcTensorMap tm_o,
                    FC_FWD_PARAMS, const int heads_q,
                    const int batch, int *__restrict__ tile_counter FC_FP8_PARAMS) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base, sK = base + OFF_K, sV = base + OFF_V;
    const u32 bar_q = base + OFF_BAR, bar_q_empty = bar_q + 8;
    // stage s: k_full = bar_q + 8 (2 + s), k_empty, v_full, v_empty follow in blocks of STAGES
    auto k_full = [&](int s) { return bar_q + 8 * (2 + s); };
    auto k_empty = [&](int s) { return bar_q + 8 * (2 + STAGES + s); };
    auto v_full = [&](int s) { return bar_q + 8 * (2 + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return bar_q + 8 * (2 + 3 * STAGES + s); };
    // K/V load number `it` (counted over all the tiles this CTA runs) uses stage it % STAGES, phase:
    auto stage = [](int it) { return it % STAGES; };
    auto phase = [](int it) { return (u32)((it / STAGES) & 1); };

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const FwdWalk walk(FC_ENTRIES, FC_GRID_NQ, FC_GRID_NK, heads_q, batch, group);
#if FC_WG_PERSISTENT == 2
    // Tile k > 0 of a CTA: its index, which the producer writes into the slot before its arrival on
    // bar_q for that tile (the arrival releases, the wait acquires); n_work or more: no tile left.
    volatile int *const slot =
        reinterpret_cast<volatile int *>(smem_raw + (base + OFF_SLOT - (u32)__cvta_generic_to_shared(smem_raw)));
#endif

    if (tid == 0) {
        mbar_init(bar_q, 1);
        mbar_init(bar_q_empty, 4 * NCWG);  // one arrival per consumer warp once its last S has landed
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), 4 * NCWG);  // one arrival per consumer warp
            mbar_init(v_empty(s), 4 * NCWG);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------------ producer ----------
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid == 0) {
            tma_prefetch_map(&tm_q);
            tma_prefetch_map(&tm_k);
            tma_prefetch_map(&tm_v);
            if (FC_WG_O_STAGE) tma_prefetch_map(&tm_o);
            int it = 0, tq = 0;  // K/V loads and Q loads so far
            auto load_q = [&](const FwdTile &tl) {
                mbar_arrive_expect_tx(bar_q, Q_BYTES);
#pragma unroll
                for (int p = 0; p < PANELS; ++p)
                    tma_load_4d(sQ + p * Q_PANEL, &tm_q, bar_q, PANEL_ELEMS * p, tl.seq.q0 + tl.m0, tl.h,
                                tl.seq.b);
            };
            auto load_kv = [&](const FwdTile &tl, int hk) {  // (hk = tl.h / group, the KV head)
                for (int j = tl.keys.first; j < tl.keys.end; ++j, ++it) {
                    const int s = stage(it);
                    const u32 ph = phase(it);
                    // buffer s was last used by load it - STAGES: wait for every consumer warp to
                    // release it
                    if (it >= STAGES) mbar_wait(k_empty(s), ph ^ 1u);
                    mbar_arrive_expect_tx(k_full(s), KV_BYTES);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_4d(sK + s * KV_BYTES + p * KV_PANEL, &tm_k, k_full(s), PANEL_ELEMS * p,
                                    fc_key_token(tl.seq, j * BN), hk, tl.seq.b);
                    if (it >= STAGES) mbar_wait(v_empty(s), ph ^ 1u);
                    mbar_arrive_expect_tx(v_full(s), KV_BYTES);
#if FC_FP8
                    // V^T (d x keys, one 128-byte panel of HD rows: the keys j BN .. j BN + 127)
                    tma_load_4d(sV + s * KV_BYTES, &tm_v, v_full(s), j * BN, 0, hk, tl.b);
#else
#pragma unroll
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_4d(sV + s * KV_BYTES + p * KV_PANEL, &tm_v, v_full(s), 64 * p,
                                    fc_key_token(tl.seq, j * BN), hk, tl.seq.b);
#endif
                }
            };
#if FC_WG_PERSISTENT == 2
            // Every tile, and the stop after the last, takes one phase of bar_q (an arrival without
            // bytes where the tile loads nothing) and, but for the first, the release of the previous
            // tile's Q; the next tile's index is fetched as soon as this one is known.
            for (int w = walk.first();; ++tq) {
                if (tq > 0) {
                    mbar_wait(bar_q_empty, (u32)((tq - 1) & 1));
                    *slot = w;
                }
                if (!walk.has(w)) {
                    if (tq > 0) mbar_arrive(bar_q);
                    break;
                }
                const FwdTile tl = walk.at(w);
                w = atomicAdd(tile_counter, 1) + (int)gridDim.x;
                if (tl.keys.count() > 0) {
                    const int hk = tl.h / group;
                    load_q(tl);
                    load_kv(tl, hk);
                } else {
                    mbar_arrive(bar_q);
                }
            }
            // Every fetch of this CTA precedes its count; the last CTA to count zeroes the counter and
            // the count for the next launch on the stream.
            __threadfence();
            if (atomicAdd(tile_counter + 1, 1) == (int)gridDim.x - 1) {
                __threadfence();
                atomicExch(tile_counter, 0);
                atomicExch(tile_counter + 1, 0);
            }
#else
            for (int w = walk.first(); walk.has(w); w = walk.next(w)) {
                const FwdTile tl = walk.at(w);
                if (tl.keys.count() > 0) {  // (rows that see no key: nothing to load)
                    const int hk = tl.h / group;
                    // the Q buffer is free once every consumer warp has seen the previous tile's last S
                    if (tq > 0) mbar_wait(bar_q_empty, (u32)((tq - 1) & 1));
                    load_q(tl);
                    ++tq;
                    load_kv(tl, hk);
                }
            }
#endif
        }
    } else {
        // ------------------------------------------------------------------ consumers ---------
        setmaxnreg_inc<CONSUMER_REGS>();
        FcScoreHook hook(scale_log2);  // (its head: each tile's, FC_HOOK_SET_HEAD)
        const int cw = wg - 1;                       // consumer warpgroup: tile rows 64 cw ..
        const int lt = tid & 127, lane = tid & 31;
        const int g = lane >> 2, t = lane & 3;
        const u32 q_rows = sQ + 64 * cw * 128;       // this warpgroup's 64 rows of each Q panel
        // FC_WG_O_STAGE 1, 2: this warpgroup's 64 rows of each o panel (in the Q buffer or its own)
        const u32 o_rows = (FC_WG_O_STAGE == 1 ? sQ : base + OFF_O) + 64 * cw * 128;
        int it = 0, tq = 0;                          // K/V loads and Q loads consumed so far
        // the next tile's index (FC_WG_PERSISTENT 2: the producer's, from the slot once bar_q's phase
        // for it has completed; lane 0, which makes the warp's arrival on bar_q_empty, reads it)
        auto next_tile = [&](int w) {
#if FC_WG_PERSISTENT == 2
            mbar_wait(bar_q, (u32)(tq & 1));
            w = 0;
            if (lane == 0) w = *slot;
            return __shfl_sync(0xffffffffu, w, 0);
#else
            return walk.next(w);
#endif
        };
        for (int w = walk.first(); walk.has(w); w = next_tile(w)) {
            const FwdTile tl = walk.at(w);
            FC_HOOK_SET_HEAD(hook, tl.b, tl.h, tl.seq.nq, tl.seq.nk);
            // iteration j (0 .. n_tiles - 1) of this tile runs key tile j0 + j, pipeline slot it0 + j
            const int j0 = tl.keys.first, n_tiles = tl.keys.count(), it0 = it;
            const int row_g = tl.m0 + 64 * cw + 16 * (lt >> 5) + g;  // query rows row_g and row_g + 8

            acc_t o_acc[ON];
#pragma unroll
            for (int i = 0; i < HD / 8; ++i) acc_zero(wg_tile(o_acc, i));
#if FC_FP8
            const int hk = tl.h / group;
            const float *k_scales = k_ds + ((long long)tl.b * (heads_q / group) + hk) * nk;
            float q_scale[2];  // the descales of rows row_g and row_g + 8
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = row_g + 8 * hf;
                q_scale[hf] = row < nq ? q_ds[((long long)tl.b * heads_q + tl.h) * nq + row] : 1.f;
            }
#if FC_FP8_TWO_LEVEL
            acc_t pv_acc[ON];  // one key tile's P V, added to o_acc in fp32 once it has landed
#endif
#endif
            // l: this lane's partial sums with fp32 accumulators, the full row sum with fp16 ones
            float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

            // (FC_WG_PERSISTENT 2: every phase of bar_q is waited for in turn, also a tile's without keys:
            // a wait for the parity of the phase before the current one returns at once)
            if (FC_WG_PERSISTENT == 2 || n_tiles > 0) mbar_wait(bar_q, (u32)(tq & 1));

            // S = Q K^T from stage s into sacc: one wgmma group, committed, not waited for.
            auto issue_s = [&](acc_t(&sacc)[SN], int s) {
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    const u32 off = (kk % 4) * 32;  // k16 step inside the panel
                    const u64 da = wg_desc_sw128(q_rows + (kk / 4) * Q_PANEL + off, 16, 1024);
                    const u64 db = wg_desc_sw128(sK + s * KV_BYTES + (kk / 4) * KV_PANEL + off, 16, 1024);
                    WgMma<BN>::ss(sacc, da, db, kk > 0);
                }
                wg_commit();
            };
            // O += P V from stage s: one wgmma group, committed, not waited for.
            auto issue_pv = [&](u32(&p)[PSTEPS][4], int s) {
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < PSTEPS; ++kk) {
#if FC_FP8
                    // V^T: HD rows of BN key bytes (K-major), the k32 step kk 32 bytes further
                    const u64 db = wg_desc_sw128(sV + s * KV_BYTES + kk * 32, 16, 1024);
#if FC_FP8_TWO_LEVEL
                    WgMma<HD>::rs(pv_acc, p[kk], db, kk > 0);
#else
                    WgMma<HD>::rs(o_acc, p[kk], db, 1);
#endif
#else
                    const u64 db = wg_desc_sw128(sV + s * KV_BYTES + kk * 16 * 128, KV_PANEL, 1024);
                    WgMma<HD>::rs_tb(o_acc, p[kk], db, 1);
#endif
                }
                wg_commit();
            };
            // After the wait for a P V group: pin the registers it wrote (two-level fp8: add the tile's
            // product into O by fp32 adds, O = (alpha O) + P V as the twin rounds it).
            auto land_pv = [&]() {
#if FC_FP8 && FC_FP8_TWO_LEVEL
                reg_fence(pv_acc);
#pragma unroll
                for (int i = 0; i < ON; ++i) o_acc[i] = __fadd_rn(o_acc[i], pv_acc[i]);
#else
                reg_fence(o_acc);
#endif
            };
            // After the wait for a group: pin its registers, then release its buffer (one arrival per warp).
            auto release = [&](u32 bar) {
                __syncwarp();
                if (lane == 0) mbar_arrive(bar);
            };
            // Mask tile j (invisible keys: causal edge, keys >= nk score -inf), then one online-softmax step
            // per row (fc_softmax_step): sacc becomes P in place (fp32, or rounded to fp16 with fp16
            // accumulators, which is P's rounding to the element type); l takes the fp32 row sums.
            auto softmax = [&](acc_t(&sacc)[SN], int j, float(&alpha)[2]) {
                // Per row: P = exp2(S_raw c_p - (sub - p_shift)) and rowmax(S) = rowmax(S_raw) mx_f. 16-bit
                // inputs: S_raw = S, c_p = scale_log2, mx_f = 1, p_shift = 0. fp8: S = S_raw f with f the
                // product of the q and k descales. With k's descale constant over the tile, f is folded
                // into the exponent (c_p = f scale_log2, mx_f = f; scales are positive, so the max
                // commutes with f); per key, S_raw is descaled element by element (c_p = scale_log2).
                // p_shift = log2(p_scale): P comes out multiplied by p_scale, ready for its e4m3 rounding,
                // and l sums the multiplied P (the epilogue divides it out).
                float c_p[2] = {scale_log2, scale_log2}, mx_f[2] = {1.f, 1.f};
                // S_raw is descaled element by element where k's descale varies per key, and where a score
                // hook (the softcap) needs S itself; otherwise f is folded into the exponent
                constexpr bool FOLD_F = FC_FP8 && !FC_FP8_KSCALE_KEY && !FcScoreHook::active;
#if FC_FP8
                const float p_shift = p_scale_log2;
#else
                constexpr float p_shift = 0.f;
#endif
#if FC_FP8
                if constexpr (!FOLD_F) {  // S = S_raw (sq sk), two roundings
#pragma unroll
                    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float ks = k_scales[FC_FP8_KSCALE_KEY ? min(j * BN + 8 * i + 2 * t + e, nk - 1)
                                                                        : j * BN];
#pragma unroll
                            for (int hf = 0; hf < 2; ++hf)
                                wg_tile(sacc, i)[2 * hf + e] =
                                    __fmul_rn(wg_tile(sacc, i)[2 * hf + e], __fmul_rn(q_scale[hf], ks));
                        }
                } else {
                    // f and f c are kept at least FLT_MIN: for tiny inputs (descales near 1e-33) they would
                    // flush to zero, and a masked key's -inf times 0 is NaN. The exponents they then give
                    // (at most 448^2 D FLT_MIN) round P to what the true ones do: 2^p_shift, a uniform row.
                    const float ks = k_scales[j * BN];  // constant over the key tile
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        mx_f[hf] = fmaxf(__fmul_rn(q_scale[hf], ks), 1.17549435e-38f);
                        c_p[hf] = fmaxf(__fmul_rn(mx_f[hf], scale_log2), 1.17549435e-38f);
                    }
                }
#endif
                // the score hook (flash_common.cuh; with fp8 operands the softcap, not ALiBi), then the mask
                static_assert(!(FC_FP8 && FC_ALIBI), "fwd_wgmma: no ALiBi with fp8 operands");
                fc_hook_scores<BN / 8>(hook, row_g, j * BN + 2 * t,
                                       [&](int i) -> acc_t(&)[ACC_REGS] { return wg_tile(sacc, i); });
                if (tl.keys.masked(j))
                    fc_mask_scores<BN / 8>(row_g, j * BN + 2 * t, tl.seq.nq, tl.seq.nk,
                                           [&](int i) -> acc_t(&)[ACC_REGS] { return wg_tile(sacc, i); });
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float sub = fc_softmax_step(m_run[hf], alpha[hf], scale_log2, [&] {
                        float mx = -INFINITY;  // rowmax(S_j) over the 4 lanes holding the row
#pragma unroll
                        for (int i = 0; i < BN / 8; ++i)
                            mx = fmaxf(mx, fmaxf(acc_get(wg_tile(sacc, i), 2 * hf), acc_get(wg_tile(sacc, i), 2 * hf + 1)));
                        return FOLD_F ? __fmul_rn(quad_max(mx), mx_f[hf]) : quad_max(mx);
                    });
                    const float sub_p = sub - p_shift;
                    float rs = 0.f;
#pragma unroll
                    for (int i = 0; i < BN / 8; ++i) {
                        const float p0 = fc_softmax_p(acc_get(wg_tile(sacc, i), 2 * hf), c_p[hf], sub_p);
                        const float p1 = fc_softmax_p(acc_get(wg_tile(sacc, i), 2 * hf + 1), c_p[hf], sub_p);
                        rs += p0;
                        rs += p1;
                        acc_set_pair(wg_tile(sacc, i), hf, p0, p1);
                    }
                    l_run[hf] = fc_softmax_l(l_run[hf], alpha[hf], FC_ACCUM_F16 ? quad_sum(rs) : rs);
                }
            };
            // P (accumulator layout) rounded to the element type into the A fragments of P V: the k16
            // step kk takes accumulator tiles 2kk and 2kk + 1 (with fp16 accumulators a plain copy). Done
            // only while no wgmma is in flight (registers an in-flight wgmma group may read are never
            // written: ptxas would serialize, C7513).
            auto pack_p = [&](acc_t(&sacc)[SN], u32(&p)[PSTEPS][4]) {
#if FC_FP8
                // P (already multiplied by p_scale) rounded to e4m3; the k32 step kk takes accumulator tiles
                // 4kk .. 4kk + 3 in the column order of wgmma_common.cuh's 8-bit A fragment
#pragma unroll
                for (int kk = 0; kk < PSTEPS; ++kk)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const acc_t(&a)[ACC_REGS] = wg_tile(sacc, 4 * kk + 2 * half);
                            const acc_t(&b)[ACC_REGS] = wg_tile(sacc, 4 * kk + 2 * half + 1);
                            p[kk][hf + 2 * half] = pack_e4m3x4(a[2 * hf], a[2 * hf + 1], b[2 * hf], b[2 * hf + 1]);
                        }
#else
#pragma unroll
                for (int i = 0; i < BN / 8; ++i)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) p[i >> 1][hf + 2 * (i & 1)] = acc_pair_elem2(wg_tile(sacc, i), hf);
                // fp16 accumulators make this a plain copy, which ptxas would otherwise sink past the next
                // S_j issue into the wgmma pipeline stage (C7513: every wgmma serialized, 0.62x the fp32
                // path's speed measured); pin it here. fp32's conversions stay where they are.
                if (FC_ACCUM_F16) {
#pragma unroll
                    for (int kk = 0; kk < PSTEPS; ++kk) reg_fence(p[kk]);
                }
#endif
            };
            // O *= alpha (skipped, warp-uniformly, when every alpha is exactly 1; compiled out by both
            // breaks)
            auto rescale = [&](const float(&alpha)[2]) {
                if (FC_SOFTMAX_RESCALES) {
                    const bool any = (alpha[0] != 1.f) | (alpha[1] != 1.f);
                    if (__any_sync(0xffffffffu, any)) {
#pragma unroll
                        for (int i = 0; i < HD / 8; ++i) acc_scale(wg_tile(o_acc, i), alpha[0], alpha[1]);
                    }
                }
            };
            // Pingpong: a warpgroup issues its products only on its turn (named barrier 1 + cw) and then
            // hands the turn to the other (barrier 2 - cw). Warpgroup 1 gives the first turn to warpgroup 0;
            // each barrier then sees one arrive per sync, and warpgroup 1 skips its last hand-over.
            constexpr bool PINGPONG = FC_WG_PINGPONG && NCWG == 2;
            auto turn_wait = [&]() {
                if (PINGPONG) named_bar_sync(1 + cw, 256);
            };
            auto turn_pass = [&](bool last) {
                if (PINGPONG && !(last && cw == 1)) named_bar_arrive(2 - cw, 256);
            };
            // Packed sequences: a V tile's rows past its sequence's keys hold the next sequence's keys or a
            // cache's unwritten slots (any bits; attention_with_kvcache reads a cache in place), and P = 0
            // does not cancel a NaN or an inf there in P V. So before the P V of key tile jt when it is the
            // sequence's last, partial one (always the last of a tile's key tiles), the consumers zero those
            // rows of V's stage s, fence them to the async proxy and meet at a barrier of all consumer
            // warpgroups (which all reach it on the same tile), outside the pingpong turn, so that no
            // warpgroup waits inside its turn. (K's rows there are masked: S = -inf whatever they hold.)
            auto clear_v_tail = [&](int s, int jt) {
                if constexpr (FC_VARLEN) {
                    // (named barriers: 1 and 2 the pingpong turns, 3 + cw the warpgroups' epilogues)
                    constexpr int V_CLEAR_BAR = 3 + NCWG;
                    static_assert(V_CLEAR_BAR < 16, "named barriers");
                    const int valid = tl.seq.nk - jt * BN;  // (>= 1: a visited tile starts inside the keys)
                    if (valid < BN) {
                        const int chunks = (BN - valid) * 8;  // 16-byte chunks of a panel's rows past the keys
                        for (int c = tid - 128; c < chunks * PANELS; c += NCWG * 128) {
                            const u32 row = valid + (c % chunks) / 8;
                            const u32 addr = sV + s * KV_BYTES + (c / chunks) * KV_PANEL + row * 128 + (c % 8) * 16;
                            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
                        }
                        fence_proxy_async();
                        named_bar_sync(V_CLEAR_BAR, NCWG * 128);
                    }
                }
            };
            // after the last S of the tile has landed, this warp is done with Q
            auto release_q = [&](int j) {
                if (j == n_tiles - 1) release(bar_q_empty);
            };
            // The epilogue (after the tile's last P V): o = O / l (0 where l == 0) and lse, o from
            // registers (FC_WG_O_STAGE 0) or through shared memory and a TMA store (1, 2).
            auto finish = [&]() {
                const FcRows rows = fc_rows(tl.seq, tl.h, heads_q, nq);  // where its rows of o and lse go
                // packed sequences: only a warpgroup whose 64 rows all lie in its sequence stores them by
                // TMA (the box would otherwise write the next sequence's rows); the others from registers
                const bool staged = FC_WG_O_STAGE && (!FC_VARLEN || tl.m0 + 64 * cw + 64 <= tl.seq.nq);
                if (FC_WG_O_STAGE == 2) {  // the previous tile's TMA stores have read the o buffer
                    if (lt == 0) tma_wait_read();
                    named_bar_sync(3 + cw, 128);
                }
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float l = FC_ACCUM_F16 ? l_run[hf] : quad_sum(l_run[hf]);
                    // o = (O * pre) * (1 / (l * pre)): one reciprocal per row, kept normal under -ftz by a
                    // 2^-64 prescale when l > 2^126 (reachable by the max-subtraction break)
#if FC_FP8
                    // l sums P p_scale: o = O * (v descale / l) (the max-subtraction break can take l to inf
                    // or past 2^126, where the quotient flushes to 0: so does the twin's o once rounded)
                    const float pre = 1.f;
                    const float v_scale = v_ds[(long long)tl.b * (heads_q / group) + hk];
                    const float inv = (l == 0.f) ? 0.f : __fdiv_rn(v_scale, l);
#else
                    const float pre = (l > 0x1p126f) ? 0x1p-64f : 1.f;
                    const float inv = (l == 0.f) ? 0.f : __frcp_rn(l * pre);
#endif
                    const int row = row_g + 8 * hf;
                    auto o_pair = [&](int i) {
                        return pack_elem2(acc_get(wg_tile(o_acc, i), 2 * hf) * pre * inv,
                                          acc_get(wg_tile(o_acc, i), 2 * hf + 1) * pre * inv);
                    };
                    if (row < tl.seq.nq) {
#if FC_FP8
                        if (t == 0)
                            lse[rows.lse0 + row] = fc_hook_lse(hook, m_run[hf], l / p_scale, scale_log2, row);
#else
                        if (t == 0) lse[rows.lse0 + row] = fc_hook_lse(hook, m_run[hf], l, scale_log2, row);
#endif
                        elem_t *orow = o + (rows.o0 + row * rows.o_step) * HD + 2 * t;
#pragma unroll
                        for (int i = 0; !staged && i < HD / 8; ++i)
                            *reinterpret_cast<u32 *>(orow + 8 * i) = o_pair(i);
                    }
                    if (staged) {
                        // row r of the warpgroup's 64 (r % 8 = g): columns 8i + 2t, 8i + 2t + 1 in 16-byte
                        // chunk (i % 8) ^ g of panel i / 8
                        const u32 orow = o_rows + (16 * (lt >> 5) + 8 * hf + g) * 128 + 4 * t;
#pragma unroll
                        for (int i = 0; i < HD / 8; ++i)
                            st_shared_b32(orow + (i >> 3) * O_PANEL + (((i & 7) ^ g) << 4), o_pair(i));
                    }
                }
                if (staged) {
                    // every thread's writes, then one thread's TMA stores (rows past nq are not written);
                    // with one tile per CTA it waits for their reads before the CTA's shared memory goes
                    fence_proxy_async();
                    named_bar_sync(3 + cw, 128);
                    if (lt == 0) {
#pragma unroll
                        for (int p = 0; p < HD / 64; ++p)
                            tma_store_4d(&tm_o, o_rows + p * O_PANEL, 64 * p, tl.seq.q0 + tl.m0 + 64 * cw, tl.h,
                                         tl.seq.b);
                        tma_commit();
                        if (FC_WG_O_STAGE == 1) tma_wait_read();
                    }
                }
            };
            if (PINGPONG && cw == 1 && n_tiles > 0) named_bar_arrive(1, 256);
            if (FC_WG_PERSISTENT == 2 && n_tiles == 0) release(bar_q_empty);  // (one bar_q phase a tile)

#if FC_WG_OVERLAP
            // Software pipeline: P_{j-1} V_{j-1} runs on the tensor cores during the softmax of tile j.
            // Per element of O the operations keep their order, O = alpha_j (O + P_{j-1} V_{j-1}), so the
            // result is bitwise that of the plain loop.
            if (n_tiles > 0) {
                acc_t s_acc[SN];
                u32 p_frag[PSTEPS][4];
                float alpha[2];
                mbar_wait(k_full(stage(it0)), phase(it0));
                turn_wait();
                issue_s(s_acc, stage(it0));
                turn_pass(false);
                wg_wait<0>();
                reg_fence(s_acc);
                release(k_empty(stage(it0)));
                release_q(0);
                softmax(s_acc, j0, alpha);  // O = 0: nothing to rescale
                pack_p(s_acc, p_frag);
                for (int j = 1; j < n_tiles; ++j) {
                    const int s = stage(it0 + j), sp = stage(it0 + j - 1);
                    mbar_wait(k_full(s), phase(it0 + j));
                    mbar_wait(v_full(sp), phase(it0 + j - 1));
                    clear_v_tail(sp, j0 + j - 1);
                    turn_wait();
                    issue_s(s_acc, s);      // S_j = Q K_j^T
                    rescale(alpha);         // alpha of tile j - 1, while S_j runs
                    issue_pv(p_frag, sp);   // O += P_{j-1} V_{j-1}
                    turn_pass(false);
                    wg_wait<1>();           // S_j has landed; P V still running
                    reg_fence(s_acc);
                    release(k_empty(s));
                    release_q(j);
                    softmax(s_acc, j0 + j, alpha);
                    wg_wait<0>();           // P_{j-1} V_{j-1} has landed
                    land_pv();
#pragma unroll
                    for (int kk = 0; kk < PSTEPS; ++kk) reg_fence(p_frag[kk]);
                    release(v_empty(sp));
                    pack_p(s_acc, p_frag);
                }
                const int sl = stage(it0 + n_tiles - 1);
                mbar_wait(v_full(sl), phase(it0 + n_tiles - 1));
                clear_v_tail(sl, j0 + n_tiles - 1);
                turn_wait();
                if (n_tiles > 1) rescale(alpha);
                issue_pv(p_frag, sl);
                turn_pass(true);
                wg_wait<0>();
                land_pv();
#pragma unroll
                for (int kk = 0; kk < PSTEPS; ++kk) reg_fence(p_frag[kk]);
                release(v_empty(sl));
            }
#else
            // Plain loop: each product is waited for before the softmax / the next tile.
            for (int j = 0; j < n_tiles; ++j) {
                const int s = stage(it0 + j);
                acc_t s_acc[SN];
                u32 p_frag[PSTEPS][4];
                float alpha[2];
                mbar_wait(k_full(s), phase(it0 + j));
                turn_wait();
                issue_s(s_acc, s);
                turn_pass(false);
                wg_wait<0>();
                reg_fence(s_acc);
                release(k_empty(s));  // this warp is done reading K_j
                release_q(j);
                softmax(s_acc, j0 + j, alpha);
                pack_p(s_acc, p_frag);
                rescale(alpha);
                mbar_wait(v_full(s), phase(it0 + j));
                clear_v_tail(s, j0 + j);
                turn_wait();
                issue_pv(p_frag, s);
                turn_pass(j == n_tiles - 1);
                wg_wait<0>();
                land_pv();
#pragma unroll
                for (int kk = 0; kk < PSTEPS; ++kk) reg_fence(p_frag[kk]);
                release(v_empty(s));  // this warp is done reading V_j
            }
#endif

            finish();
            it += n_tiles;
            tq += FC_WG_PERSISTENT == 2 || n_tiles > 0;
        }  // tiles
        if (FC_WG_O_STAGE == 2 && lt == 0) tma_wait_read();  // (the CTA's shared memory outlives the reads)
    }
}

#if FC_FP8
// ------------------------------------------------------------------ fp8: V transposed -----------
// e4m3 wgmma reads both operands K-major, so P V needs V^T (d x keys, keys contiguous). Its keys are
// stored in the column order of the fp8 P fragment (wgmma_common.cuh): position p = 4 u + e of each
// group of 16 keys holds key 2 u + (e & 1) + 8 (e >> 1). P V sums over keys, so permuting the keys of
// P and of V alike leaves the sum unchanged, and P's accumulator registers become A fragments without
// a shuffle.
__device__ __forceinline__ int fc_fp8_key_of(int p) { return 2 * (p >> 2) + (p & 1) + 8 * ((p >> 1) & 1); }

// vt[b, hk, d, n] = v[b, hk, 16 (n / 16) + fc_fp8_key_of(n % 16), d] for keys below nk, 0 up to nk_pad.
// v: bytes (B, Hkv, nk, FC_HEAD_DIM), element strides v_sb, v_sh, v_sn, rows 16-byte aligned; vt: bytes
// (B, Hkv, FC_HEAD_DIM, nk_pad) contiguous, nk_pad a multiple of FP8_VT_KEYS. Grid (nk_pad / FP8_VT_KEYS,
// Hkv, B), block FC_NUM_THREADS (the forward's, so that one launch geometry serves the module).
constexpr int FP8_VT_KEYS = 64, FP8_VT_THREADS = NTHR;
extern "C" __global__ void __launch_bounds__(FP8_VT_THREADS)
    flash_fwd_fp8_v_transpose(const unsigned char *__restrict__ v, unsigned char *__restrict__ vt, const int nk,
                              const int nk_pad, const long long v_sb, const long long v_sh, const long long v_sn) {
    __shared__ __align__(16) unsigned char tile[FP8_VT_KEYS][HD + 16];
    const int n0 = blockIdx.x * FP8_VT_KEYS, hk = blockIdx.y, b = blockIdx.z;
    const unsigned char *src = v + b * v_sb + hk * v_sh;
    for (int idx = threadIdx.x; idx < FP8_VT_KEYS * HD / 16; idx += FP8_VT_THREADS) {
        const int r = idx / (HD / 16), c = idx % (HD / 16);
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (n0 + r < nk) x = *reinterpret_cast<const uint4 *>(src + (n0 + r) * v_sn + 16 * c);
        *reinterpret_cast<uint4 *>(&tile[r][16 * c]) = x;
    }
    __syncthreads();
    unsigned char *dst = vt + ((long long)b * gridDim.y + hk) * HD * nk_pad + n0;
    for (int idx = threadIdx.x; idx < HD * FP8_VT_KEYS / 4; idx += FP8_VT_THREADS) {
        const int d = idx / (FP8_VT_KEYS / 4), w = idx % (FP8_VT_KEYS / 4);
        u32 word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int p = 4 * w + e;
            word |= (u32)tile[16 * (p >> 4) + fc_fp8_key_of(p & 15)][d] << (8 * e);
        }
        *reinterpret_cast<u32 *>(dst + (long long)d * nk_pad + 4 * w) = word;
    }
}
#endif
