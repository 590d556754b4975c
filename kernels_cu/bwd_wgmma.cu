// bwd_wgmma.cu: FlashAttention backward pass on Hopper (sm_90a), FlashAttention-3's structure: one CTA
// per key tile, K and V resident in shared memory, Q and dO tiles streamed by TMA through an mbarrier
// pipeline, warp specialization, wgmma; dQ added to an fp32 buffer by TMA reduce-adds.
//
// flash_bwd_prep (bwd_prep.cuh) runs first (delta_i = rowsum(dO_i * O_i), the zeroed fp32 dQ buffer),
// flash_bwd_dq_convert (bwd_prep.cuh) last (dq = scale * buffer, rounded). The math (c = scale_log2,
// L_i = lse_i * log2 e; rounding model of flash_common.cuh's FC_BWD_PARAMS comment):
//     S^T = K Q^T      P^T = exp2(S^T c - L)      dP^T = V dO^T      dS^T = P^T (dP^T - delta)
//     dV += P^T dO     dK += dS^T Q               dQ += dS K          (dK, dQ times scale at the end)
//
// flash_bwd_dkdvdq_wgmma, grid (ceil(nk / BN), Hkv, B): the CTA owns keys n0 .. n0 + BN - 1 of kv head
// hk and loops over the `group` query heads that share it and over their query tiles of BM = 64 rows,
// or 128 at D = 64 (twice the products per tile for the same per-tile waits and barriers), or 80 at
// D = 128 (FlashAttention-3's, dQ formed transposed: DQT below) (causal: from the first tile that sees
// key n0). Its warpgroups (128 threads each):
//   warpgroup 0, the producer: gives registers back (setmaxnreg.dec); one thread of its warp 0 loads K and
//       V once and, per query tile, Q and dO by TMA and the tile's L and delta (flash_bwd_prep's tiled
//       buffer, FC_BWD_PREP_TILE in bwd_prep.cuh) by one bulk copy into a ring of FC_BWD_STAGES buffers
//       in shared memory, each guarded by a "full" mbarrier (that thread's arrival with the transaction
//       bytes) and an "empty" one (an arrival per consumer thread, after its last read of the stage).
//       Its warp 1, the dQ writer (FlashAttention-3's): per query tile, once each consumer has staged
//       its dQ share in shared memory (named barriers DQ_FULL / DQ_EMPTY), it adds the shares into the
//       fp32 buffer by TMA reduce-adds, and on the deterministic path waits for the tile's turn and
//       releases it, so that the consumers never wait on the TMA unit or on other CTAs directly.
//   warpgroups 1 .. NCWG (NCWG = BN / 64), the consumers: consumer c owns keys n0 + 64c .. n0 + 64c + 63
//       and keeps their dK and dV in registers (m64nD fp32 accumulators) across all query tiles. Per
//       query tile:
//           S^T = K_c Q^T, dP^T = V_c dO^T    wgmma m64n64k16 from shared memory, A = K_c / V_c rows,
//                                             B = Q / dO rows (all K-major: no transpose)
//           P^T, dS^T in registers (fp32; masked keys/queries give P = 0), rounded to the element type
//                                             into A fragments, and dS^T also into shared memory
//           dV += P^T dO, dK += dS^T Q        wgmma m64nDk16, A from registers, B = dO / Q MN-major
//                                             (dV issued as soon as P^T is formed, FC_BWD_EARLY_DV)
//           dQ_c = dS K[:, c-th D / NCWG columns]   wgmma m64n(D/NCWG)k16 over all BN keys of the tile (one
//                                             per 64 queries; FC_BWD_DQ_ROWS at D = 64: dQ_c = dS[c-th 64
//                                             queries, :] K by m64n64k16; BM = 80 at D = 128:
//                                             dQ_c^T = K[:, c-th 64 columns]^T dS^T by m64n80k16, with
//                                             A = K MN-major and B = dS stored by query rows, K-major),
//                                             else A = dS^T and B = K from shared memory, both MN-major;
//                                             needs every consumer's dS^T (named barrier 1;
//                                             FC_BWD_SKEW: the other's DS_READY, after dV and dK)
//           dQ_c stored to shared memory (fp32, swizzled), which the writer warp adds to the fp32
//                                             buffer by one TMA reduce-add per 32 columns
//                                             (cp.reduce.async.bulk.tensor; measured: the threads'
//                                             red.global.add.v2.f32 cost 37% of the kernel's time at
//                                             D = 128, N = 16384)
//       and at the end dk = scale * dK and dv = dV (rows < nk): FC_BWD_KV_STAGE 1 (below) through
//       shared memory and TMA stores, 0 straight from registers.
//   dS^T has two shared-memory buffers (query tile parity): a consumer writes tile i's only after
//   every consumer passed barrier 1 of tile i - 1, so every dQ product of tile i - 2 has landed
//   (FC_BWD_SKEW: only after the other's DS_READY of tile i - 1, which it arrives at after its dQ
//   product of tile i - 2 has completed).
//
// Deterministic dQ, flash_bwd_dkdvdq_ordered_wgmma (dq_sem: int32 (B, Hq, ceil(nq / BM)) zeroed; packed
// sequences: per head, each sequence's tiles as in the tiled L and delta buffer, below): the
// additions into query tile i's rows happen in a fixed key-tile order. A CTA's writer warp waits until
// the tile's counter reads its place in that order, issues its reduce-adds, and increments the counter
// (acquire / release at GPU scope) once they are performed: before its next tile's wait (or at the end).
// A CTA only ever waits for CTAs of lower linear block index, which the hardware started before it, so
// the path needs no co-residency: it cannot hang beside other kernels (another stream's, an NCCL
// collective, a second such backward), whatever the grid and however few SMs are free. The order:
//   non-causal: ascending key tiles (every CTA runs the query tiles from 0; FlashAttention-3's order).
//       Were the key tiles of a head started together, key tile kt would wait about kt reduce latencies
//       before its first addition (up to a quarter of the kernel's time). So the blocks take the
//       (batch, KV head) pairs in sections of dq_heads (the host's rule: bwd_wgmma_ordered_heads in
//       _policy.py) and, inside a section, the key tile slowest: key tile kt + 1 of a head is dq_heads
//       blocks after key tile kt, starts that much later, and finds each query tile already added to.
//       (An earlier form started the CTAs of a head at rotated query tiles and ordered each tile by
//       arrival: no wait at all, but CTAs waited for CTAs of higher index, which hung for as long as
//       another kernel held the SMs they needed.)
//   causal: descending from tile i's diagonal key tile kt_top (CTA kt starts at its own diagonal, so
//       kt + 1 reaches tile i before kt does; the key tiles that see tile i are exactly 0 .. kt_top);
//       block x runs key tile n_kt - 1 - x. Ascending would make every CTA wait for key tile 0 to come
//       down the diagonal (measured: 0.33x the atomic path's speed at N = 4096, D = 128).
// dK, dV sum the query tiles from tile 0 up (non-causal) as the atomic path's plain kernel does, so
// their bits are that kernel's; the atomic path's rotated twin (flash_bwd_dkdvdq_rotated_wgmma, where
// bwd_wgmma_rotated in _policy.py says so) sums them in another order.

// Tensor maps (flashcupy/_tma.py): 4-D (D, N, H, B) over the real strides of q, k, v, dout; boxes
// (64, BM) for q and dout, (64, BN) for k and v; and of the fp32 dQ buffer, box (32, BM) (FC_BWD_DQ_ROWS:
// (32, 64)); 128-byte swizzle. Rows past N arrive as zeros (loads) or are skipped (reduce-adds).
// Shared-memory operands are stacks of 128-byte panels (wgmma_common.cuh); dS^T is BN rows (keys) of
// BM queries, BM / 64 panels, written with the same swizzle (DQT, BM = 80: dS by BM query rows of BN keys,
// BN / 64 panels, one per consumer).
//
// Packed sequences (FC_VARLEN, flashcupy.attention_varlen_backward): grid (ceil(longest nk / BN), Hkv, B),
// CTA (kt, hk, b) on sequence b's keys (a key tile past its end returns at once); every length it masks
// or bounds by is the sequence's (flash_common.cuh's batch entries). The maps of q, k, v, dout, dk, dv
// are over the packed (total, H, D) arrays as (D, total, H, 1), so a tile's TMA loads may read rows of
// the next sequence: its keys are masked and its queries have L = +inf (P = 0), as FlashAttention-3's
// varlen backward reads them (finite values there change nothing; a non-finite one would, 0 x inf). What
// is written by TMA never crosses a sequence: the tiled L and delta buffer, the fp32 dQ buffer and the
// ordered path's counters hold each sequence's rows padded to whole query tiles (bwd_prep.cuh's
// fc_prep_tile0: the reduce-adds of a tile's rows past the sequence's end land in its padding), and a
// consumer warpgroup stores its 64 rows of dk and dv by TMA only if they all lie in the sequence (else
// from registers). The rotated start uses the sequence's own key tile count, so on the same tile and
// path (the packed call picks both from the longest sequence) the bits are those of the sequence's own
// call.
//
// Kernel parameters: seven CUtensorMap (q, k, v, dout, dq_accum: fp32 (B, Hq, nq, D), zeroed (packed
// sequences: (1, Hq, padded rows, D), padding rows not zeroed and never read), and dk, dv:
// box (64, 64), read only by FC_BWD_KV_STAGE 1),
// FC_BWD_PARAMS (the pointers and strides of q, k, v, dout are not read: the maps carry them; lse is not
// read and delta is flash_bwd_prep's tiled buffer of L and delta; dq is not touched); flash_bwd_dkdvdq_ordered_wgmma also dq_sem and dq_heads (>= 1; read without a causal mask).
// Grid: (ceil(nk / BN), Hkv, B). Block: FC_NUM_THREADS = 128 * (1 + BN / 64).
// Dynamic shared memory (bytes), FC_SMEM_DKDVDQ:
//     1024 (alignment slack) + 2 BN D 2 (K, V) + STAGES (2 BM D 2 + 8 BM) (Q, dO, L, delta)
//     + 2 BN BM 2 (dS^T) + 4 BM D (dQ stages) + 8 (1 + 2 STAGES) (mbarriers)
// Supported: FC_DTYPE 1 or 2, fp32 accumulators (no FC_ACCUM_F16); FC_HEAD_DIM 64 or 128; FC_BLOCK_M 64
// (or 128 at D = 64, or 80 at D = 128 with FC_BLOCK_N 128: DQT below); FC_BLOCK_N 64 or 128.

#include "flash_common.cuh"
#include "wgmma_common.cuh"
// flash_bwd_prep writes L (log2 units) and delta laid out by query tile and padded (FC_BWD_PREP_TILE), and
// the producer copies a tile of both with one bulk TMA copy (measured against the producer lanes' row
// loads: docs/design/wgmma_backward.md).
#define FC_BWD_PREP_TILE FC_BLOCK_M
#include "bwd_prep.cuh"

#ifndef FC_BWD_STAGES
#define FC_BWD_STAGES 2
#endif
// FC_BWD_EARLY_DV 1: dV += P^T dO is issued as soon as P^T is formed, so that the tensor cores run it while
// the warpgroup forms dS^T and waits at barrier 1; 0: dV is issued with dK after barrier 1. The same
// products in the same order (the same bits either way). Measured on the H200 at D = 128, before the dQ
// writer warp: 1.006x to 1.018x (docs/design/wgmma_backward.md). P^T's fp32 values stay live beside its fragments until dS^T is
// formed: at BM = 128 (D = 64) that spills 144 bytes, so the default is 1 at BM = 64 only.
#ifndef FC_BWD_EARLY_DV
#define FC_BWD_EARLY_DV (FC_BLOCK_M == 64)
#endif

// FC_BWD_KV_STAGE 1 (KV_STAGE in the body says where it applies): each consumer warpgroup writes its 64
// rows of dk and dv into its own rows of the K and V tiles once every consumer is done with them (a named
// barrier after the last query tile), in the tiles' 128-byte swizzle (conflict-free 4-byte stores), and
// one of its threads stores them by TMA (whole 128-byte lines; rows past nk are not written); 0: straight
// from registers, 4 bytes of half a 32-byte sector per lane and store. The same values either way.
// Measured: docs/design/wgmma_backward.md.
#ifndef FC_BWD_KV_STAGE
#define FC_BWD_KV_STAGE 1
#endif

// FC_BWD_SKEW 1 (two consumer warpgroups): the consumers are no longer held in step. Each issues its dV,
// dK products as soon as its own P^T, dS^T are formed and waits for the other's dS^T only before its dQ
// product (DS_READY below, instead of one barrier of both), so that one may form P^T and dS^T while the
// other's products run. Each accumulator sees the same products in the same order (dQ now after dV and
// dK, into its own registers), so the bits are the same. 0: barrier 1, in step. Measured on the H100
// (docs/design/wgmma_backward.md; two runs): +1.8% to +3.2% on
// the atomic path at D = 64 (BM = 128) and N <= 4096 (N = 16384: +1.1% and -0.9%, within that cell's
// noise), -2.1% to -5% at D = 128 (BM = 64, where early dV already fills the stretch and dQ's staging no
// longer runs under dK), so the default is 1 at BM = 128 (and at BM = 80, which needs it: DQT below).
// Starting warpgroup 2 half a tile late on top of it (a start barrier) measured -0.9% to +1.2%: not kept.
#ifndef FC_BWD_SKEW
#define FC_BWD_SKEW (FC_BLOCK_M == 128 || FC_BLOCK_M == 80)
#endif

// FC_BWD_DQ_ROWS 1 (BM = 128, two consumer warpgroups: D = 64): consumer c forms the dQ share of query
// rows 64c .. 64c + 63, all HD columns (8 m64n64k16 products over the tile's keys), instead of all BM
// rows and columns c HD / 2 .. (16 m64n32k16). The same FLOPs in half the wgmma instructions, and each
// reads 4 KB of shared memory per 32 tensor cycles instead of 3 KB per 16 (A = dS^T is 2 KB either way),
// which is within the 128 bytes a cycle shared memory delivers. The writer adds each share as two boxes
// of 32 columns x 64 rows, so the host builds the buffer's map with 64-row boxes (flashcupy/_launch.py
// reads FC_BWD_DQ_BOX_ROWS, which the build layer derives and the kernel checks below). Measured on the H100
// (docs/design/wgmma_backward.md): +2.9% to +6.1% on the atomic path at D = 64,
// +2.4% to +5.0% deterministic (N = 16384: -0.8%, within that cell's noise); under ncu at N = 4096 the
// kernel went from 3081 to 2877 us, tensor pipe active 46.9% -> 50.2%. dk, dv and the deterministic dq
// are bit for bit those of the column split.
#if !defined(FC_BWD_DQ_ROWS) || !defined(FC_BWD_DQ_BOX_ROWS)
#error "bwd_wgmma: FC_BWD_DQ_ROWS and FC_BWD_DQ_BOX_ROWS must be defined by the build layer (flashcupy/_families.py)"
#endif

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int HD = FC_HEAD_DIM;
constexpr int STAGES = FC_BWD_STAGES;
constexpr bool EARLY_DV = FC_BWD_EARLY_DV;
// P^T's A fragments are formed with P^T (for the early dV, or because a score hook whose derivative is
// not 1 leaves P hook'(t) in P^T's registers for dS: flash_common.cuh), else from those registers when
// dS^T is formed
constexpr bool P_FRAG_EARLY = EARLY_DV || FC_HOOK_SCALES_DS;
constexpr int NCWG = BN / 64;            // consumer warpgroups, 64 keys each
constexpr int NTHR = 128 * (1 + NCWG);
constexpr int NCTHR = 128 * NCWG;        // consumer threads
constexpr bool SKEW = FC_BWD_SKEW && NCWG == 2;
constexpr int PANELS = HD / 64;          // 128-byte column panels per row of Q, dO, K, V
constexpr int KSTEPS = HD / 16;          // k16 steps of S^T, dP^T (over d)
constexpr int QSTEPS = BM / 16;          // k16 steps of dV, dK (over queries)
constexpr int NSTEPS = BN / 16;          // k16 steps of dQ (over keys)
constexpr int MB = BM / 64;              // 64-query blocks of a tile (m64 products of dQ; unused at BM = 80)
constexpr bool DQ_ROWS = FC_BWD_DQ_ROWS && MB == 2 && NCWG == 2;
constexpr int DQN = DQ_ROWS ? HD : HD / NCWG;  // dQ columns per consumer warpgroup
constexpr int DQB = DQ_ROWS ? 1 : MB;          // its 64-query blocks (one: block c)
// BM = 80 (the tile FlashAttention-3 runs at D = 128 without a causal mask): dQ formed
// transposed, dQ^T_c = K[:, c-th 64 columns]^T dS^T (m64n80k16 over the keys, A = K MN-major, B = dS
// stored by query rows through transposing stmatrix, K-major), staged as BM query rows of the share's 64
// columns. On an H100: 1.01-1.04x the 64-query tile, 1.06-1.07x deterministic (a6c6dc3:reports/h100/bm80.md); the
// default without a causal mask, and with one from 2048 query rows up (flashcupy/_policy.py).
constexpr bool DQT = BM == 80;
static_assert(!DQT || SKEW, "bwd_wgmma: block_m 80 needs FC_BWD_SKEW (in step, ptxas serializes every wgmma)");
constexpr int DQR = DQT ? BM : 64 * DQB;       // rows (queries) of a consumer's staged dQ share
// Consumer c's dQ share: its first column and first row in the tile (the writer's box coordinates and
// the consumer's B columns and A panel of dS^T follow from these two).
__host__ __device__ constexpr int dq_share_col(int c) { return DQ_ROWS ? 0 : c * DQN; }
__host__ __device__ constexpr int dq_share_row(int c) { return DQ_ROWS ? 64 * c : 0; }
// The rows of the fp32 dQ buffer's TMA box, which the host builds from the same define.
static_assert(FC_BWD_DQ_BOX_ROWS == DQR, "bwd_wgmma: FC_BWD_DQ_BOX_ROWS differs from the dQ share's rows");
constexpr int SN = WgMma<BM>::REGS;      // S^T, dP^T registers per thread
constexpr int DN = WgMma<HD>::REGS;      // dK, dV registers per thread
constexpr int QN = WgMma<DQN>::REGS;     // dQ share registers per thread and 64-query block

#if FC_ACCUM_F16
#error "bwd_wgmma: fp32 accumulators only (the build layer routes accum='fp16' to the mma family)"
#endif
static_assert(HD == 64 || HD == 128, "bwd_wgmma: FC_HEAD_DIM must be 64 or 128");
static_assert(BM == 64 || (BM == 128 && HD == 64) || (BM == 80 && HD == 128 && BN == 128),
              "bwd_wgmma: FC_BLOCK_M must be 64, 128 at D = 64, or 80 at D = 128 with FC_BLOCK_N 128");
static_assert(BN == 64 || BN == 128, "bwd_wgmma: FC_BLOCK_N must be 64 or 128");
static_assert(DQN % 32 == 0, "bwd_wgmma: dQ columns per warpgroup");
static_assert(STAGES >= 2, "bwd_wgmma: FC_BWD_STAGES must be at least 2");
static_assert(FC_NUM_THREADS == NTHR, "bwd_wgmma: FC_NUM_THREADS must be 128 * (1 + FC_BLOCK_N / 64)");

// Shared-memory layout (offsets from a 1024-byte aligned base).
constexpr int KV_PANEL = BN * 128, Q_PANEL = BM * 128;   // bytes of one panel
constexpr int KV_BYTES = BN * HD * 2, Q_BYTES = BM * HD * 2;
constexpr int DS_BYTES = BN * BM * 2, DS_PANEL = BN * 128;  // dS^T: MB panels of 64 queries
constexpr int OFF_V = KV_BYTES;
constexpr int OFF_Q = 2 * KV_BYTES;                      // STAGES Q tiles
constexpr int OFF_DO = OFF_Q + STAGES * Q_BYTES;         // STAGES dO tiles
constexpr int OFF_DS = OFF_DO + STAGES * Q_BYTES;        // 2 dS^T tiles
// a consumer's dQ stage: DQN / 32 fp32 panels of its DQR rows
constexpr int DQ_PANEL = DQR * 128, DQ_BYTES = DQR * DQN * 4;
constexpr int DST_PANEL = BM * 128;  // DQT: dS by query rows, a panel of 64 keys (consumer c's: panel c)
constexpr int OFF_DQ = OFF_DS + 2 * DS_BYTES;            // NCWG dQ stages
constexpr int OFF_LD = OFF_DQ + NCWG * DQ_BYTES;         // STAGES x (BM values of L, BM of delta), fp32
constexpr int OFF_BAR = OFF_LD + STAGES * 2 * BM * 4;
constexpr int N_BARS = 1 + 2 * STAGES;                   // kv_full, q_full[], q_empty[]
constexpr int SMEM_NEEDED = 1024 + OFF_BAR + 8 * N_BARS;
static_assert(FC_SMEM_DKDVDQ == SMEM_NEEDED, "shared memory differs from the build layer's FC_SMEM_DKDVDQ");

constexpr int PRODUCER_REGS = 24;
constexpr int CONSUMER_REGS = 240;
// setmaxnreg moves registers within what the CTA was launched with (NTHR x the kernel's count, at most
// 65536 / NTHR rounded down to 8: 168 at 384 threads); a split that needs more makes setmaxnreg.inc
// wait forever (measured: producer 32 + 2 x 240 hung every launch).
static_assert(128 * (PRODUCER_REGS + NCWG * CONSUMER_REGS) <= NTHR * (65536 / NTHR / 8 * 8), "register split");

// Named barriers: 1 (every consumer's dS^T of a tile stored, in step; with SKEW only the epilogue's:
// every consumer done with K and V), and per consumer warpgroup c the dQ stage's
// DQ_FULL + c (its 128 threads arrive once the share is staged, the writer warp waits) and DQ_EMPTY + c
// (the writer warp arrives once the TMA unit has read the stage, the 128 threads wait before staging the
// next share), each counting DQ_BAR_THREADS.
constexpr int DQ_FULL = 2, DQ_EMPTY = DQ_FULL + NCWG, DQ_BAR_THREADS = 128 + 32;
// FC_BWD_KV_STAGE 1: KV_OUT + c, consumer warpgroup c's 128 threads, once their dk, dv rows are written
constexpr int KV_OUT = DQ_EMPTY + NCWG;
// SKEW: DS_READY + 2 c + p, consumer warpgroup c's dS^T of a tile of parity p is stored (c's 128 threads
// arrive, the other warpgroup's wait; by parity, so that c cannot arrive twice on one barrier before the
// other has waited: c's tile it + 2 needs the other's dS^T of tile it + 1, stored after its wait for
// tile it). The sync on the other's DS_READY also waits for all four warps of c, each past its own dS^T
// stores, so c's dQ product needs no barrier of its own (measured with one: 0.985x to 1.006x, three rounds
// on the H100 at D = 64, a6c6dc3:reports/h100/wgds.md).
constexpr int DS_READY = KV_OUT + NCWG;
static_assert(KV_OUT + NCWG <= 16 && (!SKEW || DS_READY + 4 <= 16), "named barriers");

// A compile-time bool as a value (an argument of a generic lambda).
template <bool B>
struct FcBool {
    static constexpr bool value = B;
};

// The deterministic path's counters: an acquire load and a release increment at GPU scope.
__device__ __forceinline__ int ld_acquire_gpu(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int *p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The (key tile kt, KV head hk, batch b) of linear block index lin when the n_hb (batch, KV head) pairs are
// taken in sections of hs and, inside a section, the key tile slowest (n_kt key tiles).
__device__ __forceinline__ void sectioned_tile(int lin, int n_kt, int n_hb, int hs, int &kt, int &hk, int &b) {
    const int sec = lin / (hs * n_kt), first = sec * hs, in_sec = min(hs, n_hb - first);
    const int r = lin - first * n_kt, hb = first + r % in_sec;
    kt = r / in_sec, hk = hb % gridDim.y, b = hb / gridDim.y;
}

// The key tile a CTA runs (kt, its first key n0), with its KV head hk and batch b, on a grid of (key
// tiles, KV heads, batch). The order: block x on the atomic path without a causal mask; on the causal
// deterministic path block x runs key tile n_kt - 1 - x (its CTAs wait only on CTAs of lower block index;
// see the header); on the non-causal deterministic path the blocks take the (batch, KV head) pairs in
// sections of dq_heads, key tile slowest (the header); and on the causal atomic path they take them in
// FlashAttention-3's LPT order: sections of hs, a power of two of heads whose Q, dO and fp32 dQ fit in
// 40 MB (of the H200's 50 MB of L2) together, and inside a section the key tile slowest, from key tile 0,
// the heaviest (it sees every query tile), so that the hardware's block scheduler hands the heaviest
// tiles of all the section's heads out first.
struct BwdBlock {
    int kt, n0, hk, b;
};

template <bool ORDERED>
__device__ __forceinline__ BwdBlock bwd_block(int nq, int group, int dq_heads) {
    const int n_kt = gridDim.x, n_hb = gridDim.y * gridDim.z;
    const int lin = blockIdx.x + n_kt * (blockIdx.y + gridDim.y * blockIdx.z);
#if FC_CAUSAL
    int kt, hk, b;
    if (ORDERED) {
        kt = (int)(gridDim.x - 1 - blockIdx.x), hk = blockIdx.y, b = blockIdx.z;
    } else {
        const long long head_bytes = (long long)group * max(nq, 1) * HD * (2 + 2 + 4), l2_bytes = 40ll << 20;
        const int hs = min(head_bytes >= l2_bytes ? 1 : 1 << (31 - __clz((int)(l2_bytes / head_bytes))), n_hb);
        sectioned_tile(lin, n_kt, n_hb, hs, kt, hk, b);
    }
    const int n0 = kt * BN;
#else
    int kt, n0, hk, b;
    if (ORDERED) {
        sectioned_tile(lin, n_kt, n_hb, max(dq_heads, 1), kt, hk, b);
        n0 = kt * BN;
    } else {
        kt = (int)blockIdx.x;
        n0 = kt * BN, hk = blockIdx.y, b = blockIdx.z;
    }
#endif
    return BwdBlock{kt, n0, hk, b};
}

// The kernels' body; ORDERED: the deterministic path (dq_sem, dq_heads read), a compile-time switch so
// that the default path carries none of its bookkeeping (measured: 2-3% of the default path's time when
// it was a run-time switch); ROTATE: the atomic path without a causal mask starts CTA kt at query tile
// floor(kt n_qt / n_kt) and wraps around, so that a head's CTAs read different query tiles at each step,
// also compile-time (a run-time flag cost 2.3% at D = 64 with rotation off, measured on the H200). The maps stay references to the kernels'
// __grid_constant__ parameters.
template <bool ORDERED, bool ROTATE>
__device__ __forceinline__ void dkdvdq_body(const FcTensorMap &tm_q, const FcTensorMap &tm_k, const FcTensorMap &tm_v,
                                            const FcTensorMap &tm_do, const FcTensorMap &tm_dq,
                                            const FcTensorMap &tm_dk, const FcTensorMap &tm_dv, FC_BWD_PARAMS,
                                            int *__restrict__ dq_sem, int dq_heads) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    unsigned char *const smem = smem_raw + (base - (u32)__cvta_generic_to_shared(smem_raw));
    const u32 sK = base, sV = base + OFF_V;
    const u32 bar_kv = base + OFF_BAR;
    auto q_full = [&](int s) { return bar_kv + 8 * (1 + s); };
    auto q_empty = [&](int s) { return bar_kv + 8 * (1 + STAGES + s); };
    auto s_q = [&](int s) { return base + OFF_Q + s * Q_BYTES; };
    auto s_do = [&](int s) { return base + OFF_DO + s * Q_BYTES; };
    auto s_ld = [&](int s) { return reinterpret_cast<float *>(smem + OFF_LD + s * 2 * BM * 4); };

    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
    // dk, dv through shared memory and TMA stores (FC_BWD_KV_STAGE) everywhere but on the atomic path at
    // D = 64 without a causal mask and unrotated, where the register stores measured faster (rows of dk
    // and dv of 128 bytes, whose register stores fill whole sectors, and CTAs in lock-step; a hypothesis,
    // docs/design/wgmma_backward.md)
    constexpr bool KV_STAGE = FC_BWD_KV_STAGE && (ORDERED || ROTATE || FC_CAUSAL || HD != 64);
    const BwdBlock blk = bwd_block<ORDERED>(FC_GRID_NQ, group, dq_heads);
    const int kt = blk.kt, n0 = blk.n0, hk = blk.hk, b = blk.b;
    const FcSeq seq = FC_ENTRIES(b);  // this CTA's batch entry (flash_common.cuh)
    if (FC_VARLEN && n0 >= seq.nk) return;  // (packed sequences shorter than the longest: no keys here)
    const int heads_kv = gridDim.y;
    [[maybe_unused]] const int heads_q = heads_kv * group;  // (packed sequences: not read)

    // The query tiles of each of the group's heads this key tile visits and masks (the range hook,
    // flash_common.cuh): [qt0, qtiles.end) of the n_qt query tiles of a head (the tiled L and delta
    // buffer and the counters have n_qt per head).
    const FcQueryTiles qtiles = fc_query_tiles<BM, BN>(n0, seq.nq, seq.nk);
    [[maybe_unused]] const int n_qt = (seq.nq + BM - 1) / BM;  // (read by the rotation and the unpacked layout)
    const int qt0 = qtiles.first, qt_per_head = qtiles.end - qt0;
    // query tile qt of head hq in the tiled L and delta buffer and among the counters (n_qt per head and
    // batch entry; packed sequences: sequence b's first tile is fc_prep_tile0 of a head's fc_prep_tiles,
    // bwd_prep.cuh), and the fp32 dQ buffer's first row of the entry (packed: that tile's first row)
    auto tile_index = [&](int hq, int qt) -> long long {
#if FC_VARLEN
        return (long long)hq * fc_prep_tiles(nq, gridDim.z) + fc_prep_tile0(seq.q0, b) + qt;
#else
        return ((long long)b * heads_q + hq) * n_qt + qt;
#endif
    };
#if FC_VARLEN
    const int dq_row0 = fc_prep_tile0(seq.q0, b) * BM;
#else
    constexpr int dq_row0 = 0;
#endif
    const int n_it = group * qt_per_head;
    // iteration it: query head hk * group + it / qt_per_head, query tile qt0 + it % qt_per_head
    auto head_of = [&](int it) { return hk * group + it / qt_per_head; };
#if FC_CAUSAL || FC_WINDOW
    const int rot = 0;  // (a window's CTAs start on different query tiles anyway)
#else
    // ROTATE (the atomic path, no mask): CTA kt starts at query tile rot = floor(kt n_qt / n_kt) and
    // wraps around, so that a head's CTAs read different query tiles at each step
    // (packed sequences: n_kt is the sequence's own key tile count, as in its own call)
    const int n_kt = FC_VARLEN ? (seq.nk + BN - 1) / BN : (int)gridDim.x;
    const int rot = ROTATE ? (int)((long long)kt * n_qt / n_kt) : 0;
#endif
    auto tile_of = [&](int it) {
        const int j = it % qt_per_head + rot;
        return qt0 + (j >= qt_per_head ? j - qt_per_head : j);
    };

    if (tid == 0) {
        mbar_init(bar_kv, 1);
        for (int s = 0; s < STAGES; ++s) {
            // full: the producer's arrival with the transaction bytes of Q, dO, L and delta; empty: every
            // consumer thread once done with the stage (its plain loads of L and delta included)
            mbar_init(q_full(s), 1);
            mbar_init(q_empty(s), NCTHR);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {
        // ------------------------------------------------------------------ producer ----------
        setmaxnreg_dec<PRODUCER_REGS>();
        if (tid < 32 && n_it > 0) {
            if (lane == 0) {  // ---- warp 0, lane 0: the loads ----
                tma_prefetch_map(&tm_q);
                tma_prefetch_map(&tm_k);
                tma_prefetch_map(&tm_v);
                tma_prefetch_map(&tm_do);
                if (KV_STAGE) {
                    tma_prefetch_map(&tm_dk);
                    tma_prefetch_map(&tm_dv);
                }
                mbar_arrive_expect_tx(bar_kv, 2 * KV_BYTES);
#pragma unroll
                for (int p = 0; p < PANELS; ++p) {
                    tma_load_4d(sK + p * KV_PANEL, &tm_k, bar_kv, 64 * p, seq.k0 + n0, hk, seq.b);
                    tma_load_4d(sV + p * KV_PANEL, &tm_v, bar_kv, 64 * p, seq.k0 + n0, hk, seq.b);
                }
                for (int it = 0; it < n_it; ++it) {
                    const int s = it % STAGES;
                    const int hq = head_of(it), qt = tile_of(it);
                    // stage s was last used by tile it - STAGES: wait until every consumer warp released it
                    if (it >= STAGES) mbar_wait(q_empty(s), (u32)(((it / STAGES) & 1) ^ 1));
                    // Q and dO by TMA, and the tile's L and delta (flash_bwd_prep's tiled buffer: BM values
                    // of L in log2 units, +inf past nq and for rows that see no key, so that P = 0; then BM
                    // of delta, 0 past nq) by one bulk copy, all on the stage's "full" barrier
                    mbar_arrive_expect_tx(q_full(s), 2 * Q_BYTES + 2 * BM * 4);
#pragma unroll
                    for (int p = 0; p < PANELS; ++p) {
                        tma_load_4d(s_q(s) + p * Q_PANEL, &tm_q, q_full(s), 64 * p, seq.q0 + qt * BM, hq, seq.b);
                        tma_load_4d(s_do(s) + p * Q_PANEL, &tm_do, q_full(s), 64 * p, seq.q0 + qt * BM, hq, seq.b);
                    }
                    bulk_load(base + OFF_LD + s * 2 * BM * 4, delta + tile_index(hq, qt) * 2 * BM, 2 * BM * 4, q_full(s));
                }
            }
        } else if (tid < 64 && n_it > 0) {
            // ---- the dQ writer warp (FlashAttention-3's): per tile, once consumer c has staged its dQ
            //      share, lane 0 adds it into the fp32 buffer by TMA reduce-adds (rows past nq are skipped
            //      by the TMA unit); once the unit has read the stages, the warp lets the consumers stage
            //      the next ones. Deterministic: before a tile's additions lane 0 waits until the tile's
            //      counter reads this key tile's place in the order, and it increments the counter once
            //      they are performed (at the next tile, or at the end), so that neither wait is the
            //      consumers' ----
            tma_prefetch_map(&tm_dq);
            for (int c = 0; c < NCWG; ++c) named_bar_arrive(DQ_EMPTY + c, DQ_BAR_THREADS);  // empty stages
            int *sem = nullptr;  // deterministic: the counter of the tile being added, not yet released
            for (int it = 0; it < n_it; ++it) {
                const int hq = head_of(it), qt = tile_of(it), m0 = qt * BM;
                if (ORDERED && lane == 0) {
                    if (sem != nullptr) {  // the last tile's additions performed: next key tile's turn
                        tma_wait_all();
                        fence_proxy_async_global();
                        red_release_gpu_add(sem, 1);
                    }
                    sem = dq_sem + tile_index(hq, qt);
                    // this key tile's place in the order of query tile qt's additions
#if FC_CAUSAL
                    const int place = fc_last_key(min(m0 + BM, seq.nq) - 1, seq.nq, seq.nk) / BN - kt;  // diagonal first
#else
                    // ascending key tiles, from the first that query tile qt visits
                    const int place = kt - fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk).first;
#endif
                    while (ld_acquire_gpu(sem) != place) {
                    }
                    fence_proxy_async_global();  // the acquire before this thread's TMA reductions
                }
                for (int c = 0; c < NCWG; ++c) {
                    named_bar_sync(DQ_FULL + c, DQ_BAR_THREADS);  // consumer c's share is staged
                    if (lane == 0) {
#pragma unroll
                        for (int p = 0; p < DQN / 32; ++p)
                            tma_reduce_add_4d(&tm_dq, base + OFF_DQ + c * DQ_BYTES + p * DQ_PANEL,
                                              dq_share_col(c) + 32 * p, dq_row0 + m0 + dq_share_row(c), hq, seq.b);
                        tma_commit();
                    }
                }
                if (it + 1 < n_it) {  // (the last tile's stages are not written again)
                    if (lane == 0) tma_wait_read();
                    __syncwarp();
                    for (int c = 0; c < NCWG; ++c) named_bar_arrive(DQ_EMPTY + c, DQ_BAR_THREADS);
                }
            }
            if (lane == 0) {
                tma_wait_all();  // the reductions performed (the stages read) before the CTA ends
                if (ORDERED) {
                    fence_proxy_async_global();
                    red_release_gpu_add(sem, 1);
                }
            }
        }
    } else {
        // ------------------------------------------------------------------ consumers ---------
        setmaxnreg_inc<CONSUMER_REGS>();
        const int cw = wg - 1;                   // keys n0 + 64 cw ..
        const int wq = (tid & 127) >> 5;         // warp in the warpgroup: rows 16 wq .. of an m64 product
        const int g = lane >> 2, t = lane & 3;
        const u32 k_rows = sK + 64 * cw * 128, v_rows = sV + 64 * cw * 128;  // this warpgroup's 64 rows
        const int key_g = n0 + 64 * cw + 16 * wq + g;  // keys key_g and key_g + 8 (rows of S^T)
        const int dcol0 = dq_share_col(cw);            // this warpgroup's dQ columns
        FcScoreHook hook(scale_log2);  // (its head: each iteration's, FC_HOOK_SET_HEAD)
        // query row r < nq sees key key_g + 8 hf iff q_first_vis[hf] <= r <= q_last_vis[hf] (keys past
        // nk: no row)
        const int q_first_vis[2] = {key_g < seq.nk ? fc_first_query(key_g, seq.nq, seq.nk) : seq.nq,
                                    key_g + 8 < seq.nk ? fc_first_query(key_g + 8, seq.nq, seq.nk) : seq.nq};
        const int q_last_vis[2] = {fc_last_query(key_g, seq.nq, seq.nk), fc_last_query(key_g + 8, seq.nq, seq.nk)};

        acc_t dk_acc[DN], dv_acc[DN];
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            acc_zero(wg_tile(dk_acc, i));
            acc_zero(wg_tile(dv_acc, i));
        }
        if (n_it > 0) mbar_wait(bar_kv, 0);

#pragma unroll 1
        for (int it = 0; it < n_it; ++it) {
            const int s = it % STAGES;
            const int hq = head_of(it), qt = tile_of(it), m0 = qt * BM;
            FC_HOOK_SET_HEAD(hook, b, hq, seq.nq, seq.nk);
            // masking: the range hook's (queries past nq, keys past nk, the causal edge)
            const bool need_mask = FC_QUERY_TILE_MASKED(m0, BM, BN, n0, seq.nq, seq.nk, n0 + BN > seq.nk);
            const u32 sq = s_q(s), sdo = s_do(s);
            const u32 kr = opaque_u32(k_rows), vr = opaque_u32(v_rows), kd = opaque_u32(sK);  // not hoisted
            const u32 sds = base + OFF_DS + (it & 1) * DS_BYTES;
            mbar_wait(q_full(s), (u32)((it / STAGES) & 1));

            // ---- S^T = K_c Q^T, then dP^T = V_c dO^T: two wgmma groups, so that P^T is formed while
            //      the tensor cores still compute dP^T ----
            // one group: acc = rows (this warpgroup's 64 keys of K or V) times tile^T (Q or dO), over d
            auto key_product = [&](acc_t (&acc)[SN], u32 rows, u32 tile) {
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    const u32 off = (kk / 4) * KV_PANEL + (kk % 4) * 32;
                    const u32 offq = (kk / 4) * Q_PANEL + (kk % 4) * 32;
                    WgMma<BM>::ss(acc, wg_desc_sw128(rows + off, 16, 1024), wg_desc_sw128(tile + offq, 16, 1024), kk > 0);
                }
                wg_commit();
            };
            acc_t s_acc[SN], p_acc[SN];
            wg_fence();
            key_product(s_acc, kr, sq);
            key_product(p_acc, vr, sdo);

            // ---- P^T = exp2(S^T c - L_query) (fp32, in place; masked keys/queries give 0) while the
            //      tensor cores compute dP^T. Two copies of the loop, with and without the mask, behind a
            //      branch on need_mask: the branch ends a basic block, which keeps dP^T's wait below the
            //      loop. In one block ptxas (13.0 and 13.5) hoisted the wait above all but the first exp2,
            //      so that P^T was formed after dP^T had finished, and at BM = 128 it also hoisted all 32
            //      loads of L, which spilled. Measured on the H200 at BM = 64: 0.96x to 1.02x the single
            //      block; at BM = 128 the split is what keeps the kernel free of spills ----
            wg_wait<1>();
            reg_fence(s_acc);
            const float *ld = s_ld(s);
            u32 p_frag[QSTEPS][4], ds_frag[QSTEPS][4];
            auto form_p = [&](auto masked) {
#pragma unroll
                for (int i = 0; i < BM / 8; ++i) {
                    const int qc = 8 * i + 2 * t;  // queries qc, qc + 1 of the tile (columns of S^T)
                    const float2 l2 = *reinterpret_cast<const float2 *>(ld + qc);
                    const float lq[2] = {fc_hook_lq(hook, l2.x, m0 + qc, scale_log2),
                                         fc_hook_lq(hook, l2.y, m0 + qc + 1, scale_log2)};
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        // (the score hook first, flash_common.cuh: key key_g + 8 hf, queries m0 + qc + e; a
                        // query sees the key between the key's first and last visible query)
                        float p[2], pg[2];
                        fc_keyrow_p(hook, wg_tile(s_acc, i), hf, m0 + qc, key_g + 8 * hf, scale_log2, lq, p,
                                    [&](int e, float &pe, float gs) {
                                        if constexpr (decltype(masked)::value) {
                                            const int query = m0 + qc + e;
                                            pe = (query < seq.nq && query >= q_first_vis[hf] &&
                                                  (!FC_BOUND_LEFT || query <= q_last_vis[hf])) ? pe : 0.f;
                                        }
                                        pg[e] = fc_hook_ds(pe, gs);  // P hook'(t)
                                    });
                        acc_set_pair(wg_tile(s_acc, i), hf, pg[0], pg[1]);
                        if constexpr (P_FRAG_EARLY) p_frag[i >> 1][hf + 2 * (i & 1)] = pack_elem2(p[0], p[1]);
                    }
                }
            };
            if (need_mask)
                form_p(FcBool<true>{});
            else
                form_p(FcBool<false>{});

            // ---- dV += P^T dO (B = dO: rows = queries, MN-major), one wgmma group ----
            auto issue_dv = [&] {
#pragma unroll
                for (int kk = 0; kk < QSTEPS; ++kk)
                    WgMma<HD>::rs_tb(dv_acc, p_frag[kk], wg_desc_sw128(sdo + kk * 16 * 128, Q_PANEL, 1024), 1);
            };
            if constexpr (EARLY_DV) {  // the tensor cores run it while dS^T is formed and at barrier 1
                wg_fence();
                issue_dv();
                wg_commit();
            }

            // ---- dS^T = P^T (dP^T - delta_query) (fp32); P^T and dS^T rounded to the element type into
            //      the A fragments of dV, dK (k16 step kk: accumulator tiles 2kk, 2kk + 1), dS^T also into
            //      shared memory (row = key; 16-byte chunk i of queries in panel i / 8, at chunk
            //      (i % 8) ^ (row % 8) = (i % 8) ^ g; DQT: dS by query rows, below) ----
            wg_wait<EARLY_DV ? 1 : 0>();  // dP^T (an early dV may still run)
            reg_fence(p_acc);
#pragma unroll
            for (int i = 0; i < BM / 8; ++i) {
                const int qc = 8 * i + 2 * t;
                const float2 d2 = *reinterpret_cast<const float2 *>(ld + BM + qc);
                const float dl[2] = {d2.x, d2.y};
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    float ds[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e)  // (the score hook's derivative is in P's place already)
                        ds[e] = acc_get(wg_tile(s_acc, i), 2 * hf + e) * (acc_get(wg_tile(p_acc, i), 2 * hf + e) - dl[e]);
                    if constexpr (!P_FRAG_EARLY) p_frag[i >> 1][hf + 2 * (i & 1)] = acc_pair_elem2(wg_tile(s_acc, i), hf);
                    ds_frag[i >> 1][hf + 2 * (i & 1)] = pack_elem2(ds[0], ds[1]);
                }
                // At odd i, ds_frag[i / 2] is complete: four 8x8 tiles of dS^T, tile m (written at steps i - 1
                // and i as element hf + 2 (step % 2), so m % 2 = hf): keys 64 cw + 16 wq + 8 (m % 2) .. + 7 x
                // queries 8 ii .. + 7, ii = i - 1 + m / 2; one stmatrix stores them (lane 8m + c gives row c
                // of tile m), 16 bytes per row, conflict-free:
                //   dS^T (key rows): key row 64 cw + 16 wq + 8 (m % 2) + c (row % 8 = c), chunk ii of the
                //       queries: panel ii / 8, chunk (ii % 8) ^ c (measured on the H100 with the one-select dQ
                //       staging below, against a 4-byte store per thread and value: +4.6% to +6.4% at D = 64,
                //       N = 4096 without a mask, +2.8% to +3.3% with one, a6c6dc3:reports/h100/d64instr.md);
                //   DQT, dS (query rows; .trans): query row 8 ii + c of panel cw, chunk (2 wq + m % 2) ^ c.
                if (i & 1) {
                    const int m = lane >> 3, c = lane & 7, ii = i - 1 + (m >> 1);
                    if constexpr (DQT) {
                        const int q = 8 * (i - 1) + 8 * (m >> 1) + c;  // 8 ii + c
                        stmatrix_x4_trans(sds + cw * DST_PANEL + q * 128 + (((2 * wq + (m & 1)) ^ c) << 4), ds_frag[i >> 1]);
                    } else
                        stmatrix_x4(sds + (ii >> 3) * DS_PANEL + (64 * cw + 16 * wq + 8 * (m & 1) + c) * 128 + (((ii & 7) ^ c) << 4),
                                    ds_frag[i >> 1]);
                }
            }

            // ---- dQ_c = dS K[:, dcol0 ..] (A = dS^T tile (keys x queries), B = K (keys x d), both
            //      MN-major; needs every consumer's dS^T) and dV += P^T dO, dK += dS^T Q (B = dO, Q: rows
            //      = queries, MN-major) as two groups: in step, dQ_c first and dV, dK under its staging;
            //      SKEW, dV, dK first (they need this warpgroup's P^T, dS^T only) and dQ_c last ----
            fence_proxy_async();          // this thread's dS^T stores before the async proxy reads them
            acc_t q_acc[DQB][QN];  // block mb: queries dq_share_row(cw) + 64 mb .. of the tile
            acc_t qt_acc[WgMma<BM>::REGS];  // DQT: dQ^T_c, D columns 64 cw .. x the BM queries (else unused)
            auto issue_dq = [&] {
                if constexpr (DQT) {  // dQ^T_c = K[:, 64 cw ..]^T dS^T
#pragma unroll
                    for (int kk = 0; kk < NSTEPS; ++kk) {
                        const u64 da = wg_desc_sw128(kd + cw * KV_PANEL + kk * 16 * 128, KV_PANEL, 1024);
                        const u64 db = wg_desc_sw128(sds + (kk / 4) * DST_PANEL + (kk % 4) * 32, 16, 1024);
                        WgMma<BM>::template ss_t<1, 0>(qt_acc, da, db, kk > 0);
                    }
                } else {
#pragma unroll
                    for (int mb = 0; mb < DQB; ++mb) {
#pragma unroll
                        for (int kk = 0; kk < NSTEPS; ++kk) {
                            const u64 da = wg_desc_sw128(sds + (dq_share_row(cw) / 64 + mb) * DS_PANEL + kk * 16 * 128,
                                                         DS_PANEL, 1024);
                            const u64 db = wg_desc_sw128(kd + (dcol0 / 64) * KV_PANEL + (dcol0 % 64) * 2 + kk * 16 * 128,
                                                         KV_PANEL, 1024);
                            WgMma<DQN>::template ss_t<1, 1>(q_acc[mb], da, db, kk > 0);
                        }
                    }
                }
                wg_commit();
            };
            auto issue_dv_dk = [&] {
                if constexpr (!EARLY_DV) issue_dv();
#pragma unroll
                for (int kk = 0; kk < QSTEPS; ++kk)
                    WgMma<HD>::rs_tb(dk_acc, ds_frag[kk], wg_desc_sw128(sq + kk * 16 * 128, Q_PANEL, 1024), 1);
                wg_commit();
            };
            // ---- dQ share: staged in shared memory (fp32, DQN / 32 panels of DQR rows x 128 bytes, the
            //      128-byte swizzle), for the writer warp to add into the fp32 buffer. A thread holds
            //      columns 8i + 2t, +1 of its rows r (r % 8 = g; r + 64 mb in query block mb): 32 bytes per
            //      row g, one chunk pair p = (i % 4) ^ (g >> 1) of the swizzled row. A half-warp's 64-bit
            //      stores cover rows g = 0..3 (or 4..7), so in the same i rows g and g ^ 1 hit the same
            //      banks (2-way conflicts: at D = 128 all of the loop's, ncu on the H200). At step j a lane
            //      stores block i % 4 = j ^ sel instead, sel = 2 (g % 2), so p = j ^ sel ^ (g >> 1): distinct
            //      over the four rows of each half-warp; the block is chosen by one select per value
            //      (registers cannot be indexed at run time; a permutation of four blocks took two) ----
            auto stage_dq = [&] {
                const u32 sdq = base + OFF_DQ + cw * DQ_BYTES;
                named_bar_sync(DQ_EMPTY + cw, DQ_BAR_THREADS);  // the TMA unit has read the previous share
                if constexpr (DQT) {  // element (D column m, query n) to row n of panel m / 32: 4-byte stores,
                                      // without bank conflicts (rows 2t + e, chunks ((m % 32) / 4) ^ (n % 8))
#pragma unroll
                    for (int i = 0; i < BM / 8; ++i)
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const int m = 16 * wq + g + 8 * hf, n = 8 * i + 2 * t + e;
                                const u32 addr = sdq + (m >> 5) * DQ_PANEL + n * 128 + ((((m & 31) >> 2) ^ (n & 7)) << 4) + (m & 3) * 4;
                                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(acc_get(wg_tile(qt_acc, i), 2 * hf + e))
                                             : "memory");
                            }
                    fence_proxy_async();
                    named_bar_arrive(DQ_FULL + cw, DQ_BAR_THREADS);
                    return;
                }
                const int sel = 2 * (g & 1);
#pragma unroll
                for (int mb = 0; mb < DQB; ++mb)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = 64 * mb + 16 * wq + g + 8 * hf;  // r % 8 == g
#pragma unroll
                    for (int pn = 0; pn < DQN / 32; ++pn) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            float v[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {  // element e of block 4 pn + (j ^ sel)
                                auto a = [&](int jj) { return acc_get(wg_tile(q_acc[mb], 4 * pn + jj), 2 * hf + e); };
                                v[e] = (g & 1) ? a(j ^ 2) : a(j);  // block j ^ sel
                            }
                            const u32 addr = sdq + pn * DQ_PANEL + r * 128 + (((2 * (j ^ sel) + (t >> 1)) ^ g) << 4) + 8 * (t & 1);
                            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v[0]), "f"(v[1]) : "memory");
                        }
                    }
                }
                fence_proxy_async();            // the stores before the TMA unit reads them
                named_bar_arrive(DQ_FULL + cw, DQ_BAR_THREADS);
            };
            auto dv_dk_done = [&] {  // stage s's Q and dO are read
                reg_fence(dv_acc);
                reg_fence(dk_acc);
#pragma unroll
                for (int kk = 0; kk < QSTEPS; ++kk) {
                    reg_fence(p_frag[kk]);
                    reg_fence(ds_frag[kk]);
                }
            };
            if constexpr (SKEW) {
                // dV, dK need this warpgroup's P^T, dS^T only; dQ needs the other's dS^T rows too
                named_bar_arrive(DS_READY + 2 * cw + (it & 1), NCTHR);
                wg_fence();
                issue_dv_dk();
                // DQT: the P^T, dS^T fragments free before dQ^T's 40 accumulators; without this wait, or in
                // step (dQ and dV, dK in flight together), ptxas serializes every wgmma (C7512), measured locally.
                // FlashAttention-3's order (dV, dQ^T, dK from shared memory, so no fragment outlives dV)
                // compiles clean but measured 0.95-0.98x this one (a6c6dc3:reports/h100/bm80_fa3_order.md; not profiled)
                if constexpr (DQT) {
                    wg_wait<0>();
                    dv_dk_done();
                    mbar_arrive(q_empty(s));  // dQ^T reads K and dS only: stage s (Q, dO) is done
                }
                named_bar_sync(DS_READY + 2 * (1 - cw) + (it & 1), NCTHR);
                wg_fence();
                issue_dq();
                wg_wait<0>();  // dQ_c, and dV, dK before it
                if constexpr (DQT) {
                    reg_fence(qt_acc);
                } else {
#pragma unroll
                    for (int mb = 0; mb < DQB; ++mb) reg_fence(q_acc[mb]);
                    dv_dk_done();
                    mbar_arrive(q_empty(s));  // this thread is done with stage s
                }
                stage_dq();
            } else {
                named_bar_sync(1, NCTHR);
                wg_fence();
                issue_dq();
                issue_dv_dk();
                wg_wait<1>();  // dQ_c (and an early dV; dK, or dV and dK, may still run)
#pragma unroll
                for (int mb = 0; mb < DQB; ++mb) reg_fence(q_acc[mb]);
                stage_dq();
                wg_wait<0>();
                dv_dk_done();
                mbar_arrive(q_empty(s));  // this thread is done with stage s
            }
        }

        // ---- epilogue: dk = scale * dK, dv = dV (rows < nk) ----
        const float scale = scale_log2 * FC_LN2;
        if constexpr (KV_STAGE) {
            // Every consumer's last products have read K (dQ reads all BN rows) and V: this warpgroup's
            // rows of both tiles take its dk and dv, laid out as TMA loaded them (row r % 8 = g: columns
            // 8i + 2t, 8i + 2t + 1 in 16-byte chunk (i % 8) ^ g of panel i / 8), then one thread stores
            // them (rows past nk are not written) and waits for the reads before the CTA ends. Packed
            // sequences: only a warpgroup whose 64 keys all lie in its sequence; one that holds the
            // sequence's last, partial rows stores them from registers below (the box would write into
            // the next sequence's rows).
            named_bar_sync(1, NCTHR);
            if (!FC_VARLEN || n0 + 64 * (cw + 1) <= seq.nk) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const u32 row = (16 * wq + g + 8 * hf) * 128 + 4 * t;
#pragma unroll
                    for (int i = 0; i < HD / 8; ++i) {
                        const u32 off = (i >> 3) * KV_PANEL + row + (((i & 7) ^ g) << 4);
                        st_shared_b32(k_rows + off, pack_elem2(acc_get(wg_tile(dk_acc, i), 2 * hf) * scale,
                                                               acc_get(wg_tile(dk_acc, i), 2 * hf + 1) * scale));
                        st_shared_b32(v_rows + off, pack_elem2(acc_get(wg_tile(dv_acc, i), 2 * hf),
                                                               acc_get(wg_tile(dv_acc, i), 2 * hf + 1)));
                    }
                }
                fence_proxy_async();
                named_bar_sync(KV_OUT + cw, 128);
                if ((tid & 127) == 0) {
#pragma unroll
                    for (int p = 0; p < PANELS; ++p) {
                        tma_store_4d(&tm_dk, k_rows + p * KV_PANEL, 64 * p, seq.k0 + n0 + 64 * cw, hk, seq.b);
                        tma_store_4d(&tm_dv, v_rows + p * KV_PANEL, 64 * p, seq.k0 + n0 + 64 * cw, hk, seq.b);
                    }
                    tma_commit();
                    tma_wait_read();
                }
                return;
            }
        }
        const FcRows out = fc_key_rows(seq, hk, heads_kv, nk);  // where this head's rows of dk and dv go
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int key = key_g + 8 * hf;
            if (key < seq.nk) {
                elem_t *dkr = dk + (out.o0 + key * out.o_step) * HD + 2 * t;
                elem_t *dvr = dv + (out.o0 + key * out.o_step) * HD + 2 * t;
#pragma unroll
                for (int i = 0; i < HD / 8; ++i) {
                    *reinterpret_cast<u32 *>(dkr + 8 * i) = pack_elem2(acc_get(wg_tile(dk_acc, i), 2 * hf) * scale,
                                                                       acc_get(wg_tile(dk_acc, i), 2 * hf + 1) * scale);
                    *reinterpret_cast<u32 *>(dvr + 8 * i) = pack_elem2(acc_get(wg_tile(dv_acc, i), 2 * hf),
                                                                       acc_get(wg_tile(dv_acc, i), 2 * hf + 1));
                }
            }
        }
    }
}

// The seven tensor maps every entry point takes (kernel parameters, by value) and passes on.
#define FC_BWD_MAPS                                                                                                 \
    const __grid_constant__ FcTensorMap tm_q, const __grid_constant__ FcTensorMap tm_k,                            \
        const __grid_constant__ FcTensorMap tm_v, const __grid_constant__ FcTensorMap tm_do,                       \
        const __grid_constant__ FcTensorMap tm_dq, const __grid_constant__ FcTensorMap tm_dk,                      \
        const __grid_constant__ FcTensorMap tm_dv
#define FC_BWD_MAP_ARGS tm_q, tm_k, tm_v, tm_do, tm_dq, tm_dk, tm_dv

extern "C" __global__ void __launch_bounds__(NTHR, 1) flash_bwd_dkdvdq_wgmma(FC_BWD_MAPS, FC_BWD_PARAMS) {
    dkdvdq_body<false, false>(FC_BWD_MAP_ARGS, FC_BWD_ARGS, nullptr, 0);
}

#if !FC_CAUSAL && !FC_WINDOW
// The atomic path with rotated key-tile starts (ROTATE): variants without a causal mask or window only.
extern "C" __global__ void __launch_bounds__(NTHR, 1) flash_bwd_dkdvdq_rotated_wgmma(FC_BWD_MAPS, FC_BWD_PARAMS) {
    dkdvdq_body<false, true>(FC_BWD_MAP_ARGS, FC_BWD_ARGS, nullptr, 0);
}
#endif

extern "C" __global__ void __launch_bounds__(NTHR, 1)
    flash_bwd_dkdvdq_ordered_wgmma(FC_BWD_MAPS, FC_BWD_PARAMS, int *__restrict__ dq_sem, int dq_heads) {
    dkdvdq_body<true, false>(FC_BWD_MAP_ARGS, FC_BWD_ARGS, dq_sem, dq_heads);
}
