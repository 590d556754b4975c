// bwd_mma.cu: FlashAttention-2 backward pass on tensor cores (mma.sync.m16n8k16, sm_80+ / sm_90).
//
// Two paths (flash_bwd_prep of bwd_prep.cuh runs first: delta, and the zeroed dQ buffer):
// deterministic, no atomics (every sum has one fixed order, so results are bitwise reproducible):
//   flash_bwd_dkdv_mma  grid (ceil(nk/BN), Hkv, B): one CTA owns BN keys of one kv head, loops over
//                       the `group` query heads sharing it and over their query tiles of BM rows,
//                       and accumulates dK, dV in registers.
//   flash_bwd_dq_mma    grid (ceil(nq/BM), Hq, B): one CTA owns BM query rows, loops over key tiles
//                       of BN keys and accumulates dQ in registers.
// atomic dQ (FlashAttention-2's; fp32 accumulators only; 5 products per tile pair instead of 7):
//   flash_bwd_dkdvdq_mma  as flash_bwd_dkdv_mma, plus per query tile dQ_tile = dS K (dS^T staged in
//                         shared memory) added to an fp32 buffer by red.global.add.v2.f32;
//   flash_bwd_dq_convert (bwd_prep.cuh)  dq = scale * buffer, rounded. dK, dV are bitwise those of the other
//                         path; dq's fp32 sums run in a varying order.
// Both recompute P from the saved log-sum-exp (c = scale_log2, L_i = lse_i * log2 e):
//     S  = Q K^T                      P  = exp2(S c - L_i)   (0: masked key, row >= nq, lse_i = -inf)
//     dV = sum P^T dO                 dP = dO V^T            dS = P * (dP - delta_i)
//     dK = scale * sum dS^T Q         dQ = scale * dS K      (delta_i = rowsum(dO_i * O_i), given)
// P and dS are computed in fp32 and rounded to the element type before they enter a product;
// accumulators are fp32, or with FC_ACCUM_F16 mma f16 accumulators (rounding model of
// flash_common.cuh).
//
// Warp roles. Every warp owns 16 rows of the product it accumulates, so that the C fragments of
// S (or S^T) turn into the A fragments of the next product in registers and P, dS never touch
// shared memory:
//   dkdv: warp (kg, dh, qs) owns keys kg*16..kg*16+15 and computes S^T = K Q^T and dP^T = V dO^T
//         for them (16 x queries), then dV += P^T dO and dK += dS^T Q over its d tiles. With
//         D_pad > 128 (DSPLIT = 2) the two warps of a key group share the S^T / dP^T work
//         redundantly and each keeps half of the d16 tiles of dK, dV (interleaved: tile pairs
//         2p + dh), which keeps the accumulators at <= 128 fp32 registers. If the CTA has more
//         warps than key groups x DSPLIT, warp qs takes the query rows qs*BM/QSPLIT.. of every tile
//         (QSPLIT > 1) and the partial dK, dV are summed in a fixed order at the end.
//   dq:   warp (rg, ks) owns query rows rg*16..rg*16+15; computes S = Q K^T, dP = dO V^T over the
//         keys ks*BN/KSPLIT.. of each key tile, dQ += dS K; KSPLIT partials summed at the end.
//   A warp walks its query (dkdv) or key (dq) slice in chunks of QC / KC columns so that S, dP
//   stay small next to the accumulators.
// Operands (all tiles row-major [rows][head dim] in shared memory, 16-byte chunks XOR-swizzled
// per row as in fwd_mma.cu; ldmatrix lane l points at row l & 15, chunk 2p + (l >> 4)):
//   dkdv: S^T:  A = K (ldmatrix),   B = Q (ldmatrix)          dV: A = P^T (regs), B = dO (.trans)
//         dP^T: A = V (ldmatrix),   B = dO (ldmatrix)         dK: A = dS^T (regs), B = Q (.trans)
//   dq:   S:    A = Q,  B = K       dP: A = dO, B = V         dQ: A = dS (regs),  B = K (.trans)
//
// Pipelines (cp.async, 16-byte chunks; loads of the next tile overlap the math of this one when
// two stages fit in shared memory, otherwise one stage and a load between tiles):
//   dkdv: K, V once; per (head, query tile) Q, dO, lse, delta in STAGES_KV buffers.
//   dq:   Q, dO once (lse, delta per row in registers); per key tile K, V in STAGES_Q buffers.
// Causal: dkdv starts at the first query tile that can see its first key; dq stops after the
// tile holding its last visible key. Keys no query sees get dk = dv = 0; rows that see no key
// get dq = 0. Masking (causal edge, rows >= nq, keys >= nk) runs only on tiles that need it.
//
// Supported: FC_DTYPE 1 or 2; FC_ACCUM_F16 only with FC_DTYPE 1; FC_BLOCK_M, FC_BLOCK_N in {64, 128};
// FC_NUM_THREADS = 256 (8 warps) for every supported tile; FC_BLOCK_N = 128 needs FC_HEAD_DIM_PAD
// <= 128 (D_pad > 128: FC_BLOCK_N = 64). Geometry: DSPLIT = (D_pad > 128 ? 2 : 1);
// dkdv needs (BN/16) * DSPLIT to divide the warp count, dq needs BM/16 to divide it.
//
// Dynamic shared memory (bytes; P = FC_HEAD_DIM_PAD, e = 2 = sizeof(elem_t)):
//   dkdv: 2*BN*P*e + STAGES_KV*(2*BM*P*e + 8*BM),  STAGES_KV = 2 if that fits in FC_SMEM_LIMIT else 1
//   dkdvdq: as dkdv plus BN*BM*e for dS^T (the stage count decided with it included)
//   dq:   2*BM*P*e + STAGES_Q*(2*BN*P*e),          STAGES_Q  = 2 if that fits in FC_SMEM_LIMIT else 1
// (each kernel needs only its own figure; launching both with the max is fine.)

#include "flash_common.cuh"
#include "mma_common.cuh"
#include "bwd_prep.cuh"

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int SMEM_MAX = FC_SMEM_LIMIT;  // the device's opt-in limit, from the build layer

static_assert(BM % 16 == 0 && BN % 16 == 0, "tiles must be multiples of 16");

// ---- dkdv geometry ----
constexpr int KV_DSPLIT = FC_HEAD_DIM_PAD > 128 ? 2 : 1;           // warps sharing one key group
constexpr int KV_KG = BN / 16;                                      // key groups (16 keys each)
constexpr int KV_QSPLIT = NWARPS / (KV_KG * KV_DSPLIT);             // warps splitting a query tile
constexpr int KV_DK = (FC_HEAD_DIM + 16 * KV_DSPLIT - 1) / (16 * KV_DSPLIT) * (16 * KV_DSPLIT);
constexpr int KV_KS = KV_DK / 16;                                   // k16 steps of S^T, dP^T
constexpr int KV_DP = KV_DK / 16 / KV_DSPLIT;                       // d16 tile pairs per warp
constexpr int KV_QW = BM / KV_QSPLIT;                               // queries per warp per tile
#if FC_ACCUM_F16
constexpr int KV_QC = KV_QW < 64 ? KV_QW : 64;
#else
constexpr int KV_QC = (KV_DP >= 6 || KV_QW < 64) ? (KV_QW < 32 ? KV_QW : 32) : 64;  // query chunk
#endif
static_assert(KV_QSPLIT >= 1 && KV_KG * KV_DSPLIT * KV_QSPLIT == NWARPS,
              "dkdv: (FC_BLOCK_N/16) * DSPLIT must divide the warp count");
static_assert(KV_QW % KV_QC == 0 && KV_QC % 16 == 0, "dkdv: query chunking");
static_assert(KV_DK <= FC_HEAD_DIM_PAD, "dkdv: head dim");

// ---- dq geometry ----
constexpr int Q_RG = BM / 16;                        // row groups (16 query rows each)
constexpr int Q_KSPLIT = NWARPS / Q_RG;              // warps splitting a key tile
constexpr int Q_DK = (FC_HEAD_DIM + 15) / 16 * 16;   // head dim multiplied (zero tail < 16)
constexpr int Q_KS = Q_DK / 16;
constexpr int Q_KW = BN / Q_KSPLIT;                  // keys per warp per tile
#if FC_ACCUM_F16
constexpr int Q_KC = Q_KW < 64 ? Q_KW : 64;
#else
constexpr int Q_KC = (Q_KS > 8 || Q_KW < 64) ? (Q_KW < 32 ? Q_KW : 32) : 64;  // key chunk
#endif
static_assert(Q_KSPLIT >= 1 && Q_RG * Q_KSPLIT == NWARPS, "dq: FC_BLOCK_M/16 must divide the warp count");
static_assert(Q_KW % Q_KC == 0 && Q_KC % 16 == 0, "dq: key chunking");

// ---- dkdvdq: dQ_tile = dS K (BM x Q_DK) inside the dK/dV kernel ----
constexpr int DQ_RG = BM / 16;                                 // row groups (16 query rows each)
constexpr int DQ_DSPLIT = NWARPS / DQ_RG;                      // warps splitting the head dim
constexpr int DQ_D16 = Q_DK / 16;                              // d16 column pairs of dQ
constexpr int DQ_D16W = (DQ_D16 + DQ_DSPLIT - 1) / DQ_DSPLIT;  // per warp
constexpr int DQ_D16C = DQ_D16W < 4 ? DQ_D16W : 4;             // per pass: <= 64 columns of accumulators
static_assert(DQ_DSPLIT >= 1 && DQ_RG * DQ_DSPLIT == NWARPS, "dkdvdq: FC_BLOCK_M/16 must divide the warp count");

// ---- shared memory ----
constexpr int KV_STAGE_BYTES = 2 * BM * ROW_BYTES + 8 * BM;  // Q, dO, lse, delta
constexpr int DS_ROW = BM * 2;                                // dkdvdq: dS^T tile [BN][BM] elements
constexpr int DS_BYTES = BN * DS_ROW;
// Stages of the dK/dV kernels: two when they fit; with_ds: room for the dS^T tile (dkdvdq).
__host__ __device__ constexpr int kv_stages(bool with_ds) {
    return (2 * BN * ROW_BYTES + 2 * KV_STAGE_BYTES + (with_ds ? DS_BYTES : 0) <= SMEM_MAX) ? 2 : 1;
}
__host__ __device__ constexpr int kv_smem(bool with_ds) {
    return 2 * BN * ROW_BYTES + kv_stages(with_ds) * KV_STAGE_BYTES + (with_ds ? DS_BYTES : 0);
}
constexpr int KV_SMEM = kv_smem(false);
constexpr int Q_STAGE_BYTES = 2 * BN * ROW_BYTES;            // K, V
constexpr int STAGES_Q = (2 * BM * ROW_BYTES + 2 * Q_STAGE_BYTES <= SMEM_MAX) ? 2 : 1;
constexpr int Q_SMEM = 2 * BM * ROW_BYTES + STAGES_Q * Q_STAGE_BYTES;
static_assert(KV_SMEM <= SMEM_MAX && Q_SMEM <= SMEM_MAX, "tiles do not fit in shared memory");
static_assert(kv_smem(true) <= SMEM_MAX, "dkdvdq: tiles do not fit in shared memory");
// The layouts above against the figures the build layer launches with (flashcupy/_families.py).
static_assert(KV_SMEM == FC_SMEM_DKDV, "dkdv shared memory differs from the build layer's FC_SMEM_DKDV");
static_assert(Q_SMEM == FC_SMEM_DQ, "dq shared memory differs from the build layer's FC_SMEM_DQ");
#if !FC_ACCUM_F16
static_assert(kv_smem(true) == FC_SMEM_DKDVDQ, "dkdvdq shared memory differs from the build layer's FC_SMEM_DKDVDQ");
#endif


// Epilogue scratch: the output staging tile [rows][CPR] plus (split - 1) fp32 partials per warp slot.
static_assert(BN * ROW_BYTES + (KV_QSPLIT - 1) * (NWARPS / KV_QSPLIT) * (2 * KV_DP) * 4 * 32 * 4 <= KV_SMEM,
              "dkdv epilogue scratch");
static_assert(BM * ROW_BYTES + (Q_KSPLIT - 1) * Q_RG * (2 * Q_KS) * 4 * 32 * 4 <= Q_SMEM, "dq epilogue scratch");

extern __shared__ __align__(128) unsigned char smem[];  // dynamic shared memory of every kernel here

// The two score products of one warp, 16 rows x 8 NT8 columns over KS k16 steps, all operands read
// with ldmatrix from row-major tiles (rows a_s, a_p: this lane's rows of the 16-row A blocks; b_s,
// b_p: of the (8 NT8)-row B blocks): acc_s = A_s B_s^T and acc_p = A_p B_p^T.
//   dkdv: S^T = K Q^T and dP^T = V dO^T;   dq: S = Q K^T and dP = dO V^T.
template <int KS, int NT8>
__device__ __forceinline__ void scores_and_dp(acc_t (&acc_s)[1][NT8][ACC_REGS], acc_t (&acc_p)[1][NT8][ACC_REGS],
                                              u32 a_s, u32 b_s, u32 a_p, u32 b_p, int w) {
#pragma unroll
    for (int n = 0; n < NT8; ++n) { acc_zero(acc_s[0][n]); acc_zero(acc_p[0][n]); }
    warp_gemm_abt<KS, 1, NT8 / 2>(acc_s, [&](int kk, int, u32(&a)[4]) { ldsm_x4(a, a_s + chunk_off(2 * kk, w)); }, b_s, w);
    warp_gemm_abt<KS, 1, NT8 / 2>(acc_p, [&](int kk, int, u32(&a)[4]) { ldsm_x4(a, a_p + chunk_off(2 * kk, w)); }, b_p, w);
}

// Zero the chunks [CH, DKC) of `rows` rows from `tile` on: the head-dim tail the math reads but the
// copies never write.
template <int DKC>
__device__ __forceinline__ void zero_tail(unsigned char *smem, u32 tile_off, int rows, int tid) {
    constexpr int TC = DKC - CH;
    if constexpr (TC > 0) {
        for (int i = tid; i < rows * TC; i += NTHR)
            *reinterpret_cast<uint4 *>(smem + tile_off + smem_off(i / TC, CH + i % TC)) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// Epilogue of both kernels: `acc` holds, per warp, 16 rows x NT8 n8 tiles (tile n at columns
// col_of(n)); warps with split index sp > 0 hand their partials to the warp with sp = 0 through
// shared memory (fixed order sp = 1, 2, ..: deterministic), which scales, rounds and stages the
// tile [ROWS][CPR] for 16-byte coalesced stores of rows < nvalid, `step` elements apart from `out` on.
// smem is free when it is called.
template <int ROWS, int NT8, int NSPLIT, int SLOTS, int DSPL>
__device__ __forceinline__ void store_tile(unsigned char *smem, const acc_t (&acc)[NT8][ACC_REGS], int slot, int sp,
                                           int row0, int dh, float mul, elem_t *out, int nvalid, long long step) {
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    float *red = reinterpret_cast<float *>(smem + ROWS * ROW_BYTES);
    __syncthreads();  // every warp is done with the previous use of smem
    if (NSPLIT > 1 && sp > 0) {
#pragma unroll
        for (int n = 0; n < NT8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[((((sp - 1) * SLOTS + slot) * NT8 + n) * 4 + i) * 32 + lane] = acc_get(acc[n], i);
    }
    if (NSPLIT > 1) __syncthreads();
    if (sp == 0) {
#pragma unroll
        for (int n = 0; n < NT8; ++n) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                v[i] = acc_get(acc[n], i);
                for (int s = 1; s < NSPLIT; ++s) v[i] += red[((((s - 1) * SLOTS + slot) * NT8 + n) * 4 + i) * 32 + lane];
            }
            // n8 tile n = 2 dp + x of the warp covers chunk 2 (dp * DSPL + dh) + x
            const int chunk = 2 * ((n >> 1) * DSPL + dh) + (n & 1);
            *reinterpret_cast<u32 *>(smem + smem_off(row0 + g, chunk) + 4 * t) = pack_elem2(v[0] * mul, v[1] * mul);
            *reinterpret_cast<u32 *>(smem + smem_off(row0 + g + 8, chunk) + 4 * t) = pack_elem2(v[2] * mul, v[3] * mul);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < ROWS * CH; idx += NTHR) {
        const int r = idx / CH, c = idx - (idx / CH) * CH;
        if (r < nvalid)
            *reinterpret_cast<uint4 *>(out + r * step + c * 8) =
                *reinterpret_cast<const uint4 *>(smem + smem_off(r, c));
    }
}

// =============================================================================================
// dK, dV
// =============================================================================================
// DQ_ATOMIC (flash_bwd_dkdvdq_mma): the CTA also forms dQ_tile = dS K for every query tile it visits
// (dS^T goes through shared memory once per tile) and adds it, unscaled, to the fp32 buffer dq_accum
// with vector reductions (red.global.add.v2.f32); flash_bwd_dq_convert then writes dq = scale *
// dq_accum. The order of those additions varies from run to run: results are not bitwise repeatable.
template <bool DQ_ATOMIC>
__device__ __forceinline__ void dkdv_body(FC_BWD_PARAMS, float *__restrict__ dq_accum) {
    constexpr int STAGES_KV = kv_stages(DQ_ATOMIC);
    const u32 s_base = (u32)__cvta_generic_to_shared(smem);
    const u32 sK = s_base;                       // [BN][CPR]
    const u32 sV = sK + BN * ROW_BYTES;          // [BN][CPR]
    const u32 st0 = sV + BN * ROW_BYTES;         // stages: Q [BM][CPR], dO [BM][CPR], lse [BM], delta [BM]
    const u32 sDS = st0 + STAGES_KV * KV_STAGE_BYTES;  // DQ_ATOMIC: dS^T [BN][BM], 16-byte chunks swizzled
    constexpr u32 ST_DO = BM * ROW_BYTES, ST_L = 2 * BM * ROW_BYTES, ST_D = ST_L + 4 * BM;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kg = warp % KV_KG, dh = (warp / KV_KG) % KV_DSPLIT, qs = warp / (KV_KG * KV_DSPLIT);

    const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
    const int Hq = gridDim.y * group;
    const FcSeq seq = FC_ENTRIES(b);       // this CTA's batch entry (flash_common.cuh)
    if (FC_VARLEN && n0 >= seq.nk) return;  // (packed sequences shorter than the longest: no keys here)

    // The query tiles this key tile visits and masks (the range hook, flash_common.cuh): [qt0, qtiles.end).
    const FcQueryTiles qtiles = fc_query_tiles<BM, BN>(n0, seq.nq, seq.nk);
    const int qt0 = qtiles.first;
    const int qt_per_head = qtiles.end - qt0;
    const int n_it = group * qt_per_head;
    FcScoreHook hook(scale_log2);  // (its head: each iteration's, FC_HOOK_SET_HEAD)

    const int lc = tid % CHP, lr = tid / CHP;

    // ldmatrix lane addressing: row lane & 15 of a 16-row block, chunk 2p + (lane >> 4).
    const u32 frag_row = (lane & 15) * ROW_BYTES;
    const int frag_w = (lane >> 4) ^ swz_key(lane & 7);
    const int frag_wd = frag_w ^ (2 * dh);                // for the interleaved d split (chunk pair 2dp+dh)
    const u32 k_base = sK + kg * 16 * ROW_BYTES + frag_row;
    const u32 v_base = sV + kg * 16 * ROW_BYTES + frag_row;

    acc_t acc_dk[1][2 * KV_DP][ACC_REGS], acc_dv[1][2 * KV_DP][ACC_REGS];
#pragma unroll
    for (int n = 0; n < 2 * KV_DP; ++n) { acc_zero(acc_dk[0][n]); acc_zero(acc_dv[0][n]); }

    // Loads of iteration `it` (query head hk*group + it / qt_per_head, tile qt0 + it % qt_per_head).
    auto load_stage = [&](int it, u32 st) {
        const int hq = hk * group + it / qt_per_head;
        const int m0 = (qt0 + it % qt_per_head) * BM;
        load_head_rows<BM>(st, q + seq.q0 * q_sn, seq.b, q_sb, hq, q_sh, q_sn, m0, seq.nq, lr, lc);
        load_head_rows<BM>(st + ST_DO, dout + seq.q0 * do_sn, seq.b, do_sb, hq, do_sh, do_sn, m0, seq.nq, lr, lc);
        const long long rb = fc_rows(seq, hq, Hq, nq).lse0 + m0;
        for (int i = tid; i < 2 * BM; i += NTHR) {
            const int r = i % BM;
            const bool ok = m0 + r < seq.nq;
            const float *src = (i < BM ? lse : delta) + (ok ? rb + r : 0);
            cp_async_4(st + (i < BM ? ST_L : ST_D) + 4 * r, src, ok);
        }
    };

    if (n_it > 0) {
        // zero the head-dim tail the math reads ([FC_HEAD_DIM, KV_DK)), then K, V and stage 0
        zero_tail<KV_DK / 8>(smem, 0, 2 * BN, tid);
        for (int s = 0; s < STAGES_KV; ++s) zero_tail<KV_DK / 8>(smem, st0 - s_base + s * KV_STAGE_BYTES, 2 * BM, tid);
        load_head_rows<BN>(sK, k + seq.k0 * k_sn, seq.b, k_sb, hk, k_sh, k_sn, n0, seq.nk, lr, lc);
        load_head_rows<BN>(sV, v + seq.k0 * v_sn, seq.b, v_sb, hk, v_sh, v_sn, n0, seq.nk, lr, lc);
    }
    pipeline_begin(n_it, st0, load_stage);  // K, V and stage 0: the first commit group

#pragma unroll 1
    for (int it = 0; it < n_it; ++it) {
        // ---- tile `it` has landed; every warp is done with the other stage: prefetch it + 1 ----
        const u32 st = pipeline_top<STAGES_KV>(it, n_it, st0, KV_STAGE_BYTES, load_stage);
        const int m0 = (qt0 + it % qt_per_head) * BM;
        FC_HOOK_SET_HEAD(hook, b, hk * group + it / qt_per_head, seq.nq, seq.nk);
        const bool need_mask = FC_QUERY_TILE_MASKED(m0, BM, BN, n0, seq.nq, seq.nk, false);
        const float *s_lse = reinterpret_cast<const float *>(smem + (st - s_base) + ST_L);
        const float *s_del = reinterpret_cast<const float *>(smem + (st - s_base) + ST_D);

#pragma unroll 1
        for (int qc = 0; qc < KV_QW / KV_QC; ++qc) {
            const int qr0 = qs * KV_QW + qc * KV_QC;  // first query row (in the tile) of this chunk
            const u32 q_base = st + qr0 * ROW_BYTES + frag_row;
            const u32 do_base = q_base + ST_DO;

            // ---- S^T = K Q^T and dP^T = V dO^T (16 keys x KV_QC queries) ----
            acc_t acc_s[1][KV_QC / 8][ACC_REGS], acc_p[1][KV_QC / 8][ACC_REGS];
            scores_and_dp<KV_KS>(acc_s, acc_p, k_base, q_base, v_base, do_base, frag_w);

            // ---- P^T = exp2(S^T c - L_query), dS^T = P^T (dP^T - delta_query); both go straight
            //      into A fragments: k16 step kk of the next products is n8 tiles 2kk, 2kk+1 ----
            u32 p_frag[1][KV_QC / 16][4], ds_frag[1][KV_QC / 16][4];
#pragma unroll
            for (int n = 0; n < KV_QC / 8; ++n) {
                const int qcol = qr0 + n * 8 + 2 * t;  // query (in the tile) of elements 0, 2; +1: 1, 3
                const float2 l2 = *reinterpret_cast<const float2 *>(s_lse + qcol);
                const float2 d2 = *reinterpret_cast<const float2 *>(s_del + qcol);
                const float lq[2] = {fc_hook_lq(hook, fc_lse_log2(l2.x), m0 + qcol, scale_log2),
                                     fc_hook_lq(hook, fc_lse_log2(l2.y), m0 + qcol + 1, scale_log2)};
                const float dq2[2] = {d2.x, d2.y};
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    // (S^T's elements: key n0 + kg 16 + g + 8 hf, queries m0 + qcol + e; the score hook
                    // first, flash_common.cuh, and its derivative in dS)
                    float p[2], ds[2];
                    fc_keyrow_p(hook, acc_s[0][n], hf, m0 + qcol, n0 + kg * 16 + g + 8 * hf, scale_log2, lq, p,
                                [&](int e, float &pe, float gs) {
                                    if (need_mask) {
                                        const int key = n0 + kg * 16 + g + 8 * hf, query = m0 + qcol + e;
                                        const bool vis = query < seq.nq && fc_visible(query, key, seq.nq, seq.nk);
                                        pe = vis ? pe : 0.f;
                                    }
                                    ds[e] = fc_hook_ds(pe * (acc_get(acc_p[0][n], 2 * hf + e) - dq2[e]), gs);
                                });
                    p_frag[0][n >> 1][hf + 2 * (n & 1)] = pack_elem2(p[0], p[1]);
                    ds_frag[0][n >> 1][hf + 2 * (n & 1)] = pack_elem2(ds[0], ds[1]);
                    if (DQ_ATOMIC && dh == 0) {
                        // dS^T row = key kg*16 + g + 8hf, 16-byte chunk of queries qr0/8 + n, XOR g
                        const int krow = kg * 16 + g + 8 * hf;
                        *reinterpret_cast<u32 *>(smem + (sDS - s_base) + krow * DS_ROW +
                                                 (((qr0 / 8 + n) ^ g) << 4) + 4 * t) = ds_frag[0][n >> 1][hf + 2 * (n & 1)];
                    }
                }
            }

            // ---- dV += P^T dO, dK += dS^T Q (B operands: dO, Q rows = queries, by ldmatrix.trans) ----
            const auto d16 = [](int dp) { return KV_DSPLIT * dp; };  // this warp's d16 column pairs
            warp_gemm_ab<KV_QC / 16, KV_DP>(acc_dv, p_frag, do_base, frag_wd, d16);
            warp_gemm_ab<KV_QC / 16, KV_DP>(acc_dk, ds_frag, q_base, frag_wd, d16);
        }

        if constexpr (DQ_ATOMIC) {
            // ---- dQ_tile += dS K, added to dq_accum. Warp (qg, qd) owns query rows qg*16.. and the
            //      d16 pairs qd*DQ_D16W..; A = dS from the dS^T tile (ldmatrix.trans: matrix i of lane
            //      l covers keys 8*(i >> 1).., queries 8*(i & 1)..), B = K (ldmatrix.trans) ----
            __syncthreads();  // dS^T of every warp is in shared memory
            const int qg = warp % DQ_RG, qd = warp / DQ_RG;
            const u32 ds_lane = sDS + ((lane >> 4) * 8 + (lane & 7)) * DS_ROW +
                                (((qg * 2 + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
            const int row = m0 + qg * 16 + g;
            float *dqa = dq_accum + (fc_rows(seq, hk * group + it / qt_per_head, Hq, nq).lse0 + row) * FC_HEAD_DIM;
#pragma unroll
            for (int c0 = 0; c0 < DQ_D16W; c0 += DQ_D16C) {
                acc_t acc_q[2 * DQ_D16C][ACC_REGS];
#pragma unroll
                for (int n = 0; n < 2 * DQ_D16C; ++n) acc_zero(acc_q[n]);
#pragma unroll
                for (int kk = 0; kk < BN / 16; ++kk) {
                    u32 a[4];
                    ldsm_x4_trans(a, ds_lane + kk * 16 * DS_ROW);
#pragma unroll
                    for (int dp = 0; dp < DQ_D16C; ++dp) {
                        const int d16 = qd * DQ_D16W + c0 + dp;
                        if (c0 + dp < DQ_D16W && d16 < DQ_D16) {
                            u32 bk[4];
                            ldsm_x4_trans(bk, sK + kk * 16 * ROW_BYTES + frag_row + chunk_off(2 * d16, frag_w));
                            mma_16816(acc_q[2 * dp], a, bk[0], bk[1]);
                            mma_16816(acc_q[2 * dp + 1], a, bk[2], bk[3]);
                        }
                    }
                }
#pragma unroll
                for (int n = 0; n < 2 * DQ_D16C; ++n) {
                    const int col = (2 * (qd * DQ_D16W + c0) + n) * 8 + 2 * t;
                    if (c0 + n / 2 < DQ_D16W && col < FC_HEAD_DIM) {
                        if (row < seq.nq) red_add_f32x2(dqa + col, acc_get(acc_q[n], 0), acc_get(acc_q[n], 1));
                        if (row + 8 < seq.nq)
                            red_add_f32x2(dqa + 8 * FC_HEAD_DIM + col, acc_get(acc_q[n], 2), acc_get(acc_q[n], 3));
                    }
                }
            }
        }

        pipeline_bottom<STAGES_KV>(it, n_it, st0, load_stage);
    }

    // ---- epilogue: sum the QSPLIT partials, dK *= scale, round, 16-byte stores of keys < nk ----
    const FcRows rows = fc_key_rows(seq, hk, gridDim.y, nk);  // where this head's rows of dk and dv go
    const long long out_off = (rows.o0 + n0 * rows.o_step) * FC_HEAD_DIM;
    const long long step = rows.o_step * FC_HEAD_DIM;
    const int slot = kg + KV_KG * dh;
    store_tile<BN, 2 * KV_DP, KV_QSPLIT, KV_KG * KV_DSPLIT, KV_DSPLIT>(smem, acc_dv[0], slot, qs, kg * 16, dh, 1.f,
                                                                        dv + out_off, seq.nk - n0, step);
    store_tile<BN, 2 * KV_DP, KV_QSPLIT, KV_KG * KV_DSPLIT, KV_DSPLIT>(smem, acc_dk[0], slot, qs, kg * 16, dh,
                                                                        scale_log2 * FC_LN2, dk + out_off, seq.nk - n0,
                                                                        step);
}

extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1) flash_bwd_dkdv_mma(FC_BWD_PARAMS) {
    dkdv_body<false>(FC_BWD_ARGS, nullptr);
}

#if !FC_ACCUM_F16
// dK, dV and the dQ partials (fp32 accumulators only: with FC_ACCUM_F16 the rounding model keeps
// dQ in one fp16 accumulator along all keys, which the two-kernel path does). dq_accum: fp32,
// (B, Hq, nq, FC_HEAD_DIM) contiguous, zeroed before the launch; the dq argument is not touched.
extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1)
    flash_bwd_dkdvdq_mma(FC_BWD_PARAMS, float *__restrict__ dq_accum) {
    dkdv_body<true>(FC_BWD_ARGS, dq_accum);
}
#endif

// =============================================================================================
// dQ
// =============================================================================================
extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1) flash_bwd_dq_mma(FC_BWD_PARAMS) {
    const u32 s_base = (u32)__cvta_generic_to_shared(smem);
    const u32 sQ = s_base;                      // [BM][CPR]
    const u32 sDO = sQ + BM * ROW_BYTES;        // [BM][CPR]
    const u32 st0 = sDO + BM * ROW_BYTES;       // stages: K [BN][CPR], V [BN][CPR]
    constexpr u32 ST_V = BN * ROW_BYTES;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rg = warp % Q_RG, ks = warp / Q_RG;

    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const FcSeq seq = FC_ENTRIES(b);       // this CTA's batch entry (flash_common.cuh)
    const int m0 = fc_query_tile() * BM;
    if (FC_VARLEN && m0 >= seq.nq) return;  // (packed sequences shorter than the longest: no rows here)

    // The key tiles this CTA visits and masks (the range hook, flash_common.cuh): iteration it runs key
    // tile j0 + it, n_tiles of them.
    const FcKeyTiles tiles = fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk);
    const int j0 = tiles.first, n_tiles = tiles.count();
    FcScoreHook hook(scale_log2);
    FC_HOOK_SET_HEAD(hook, b, h, seq.nq, seq.nk);

    const int lc = tid % CHP, lr = tid / CHP;
    const u32 frag_row = (lane & 15) * ROW_BYTES;
    const int frag_w = (lane >> 4) ^ swz_key(lane & 7);
    const u32 q_base = sQ + rg * 16 * ROW_BYTES + frag_row;
    const u32 do_base = sDO + rg * 16 * ROW_BYTES + frag_row;

    // Per-row L = lse * log2 e and delta of rows g, g+8 (rows >= nq: P = 0).
    const FcRows rows = fc_rows(seq, h, gridDim.y, nq);  // where this head's rows go (lse, delta, dq)
    const int row_g = m0 + rg * 16 + g;
    float lrow[2], drow[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = row_g + 8 * hf;
        lrow[hf] = fc_hook_lq(hook, fc_row_lse_log2(lse + rows.lse0, row, seq.nq), row, scale_log2);
        drow[hf] = row < seq.nq ? delta[rows.lse0 + row] : 0.f;
    }

    acc_t acc_dq[1][2 * Q_KS][ACC_REGS];
#pragma unroll
    for (int n = 0; n < 2 * Q_KS; ++n) acc_zero(acc_dq[0][n]);

    auto load_kv = [&](int it, u32 st) {
        load_head_rows<BN>(st, k + seq.k0 * k_sn, seq.b, k_sb, hk, k_sh, k_sn, (j0 + it) * BN, seq.nk, lr, lc);
        load_head_rows<BN>(st + ST_V, v + seq.k0 * v_sn, seq.b, v_sb, hk, v_sh, v_sn, (j0 + it) * BN, seq.nk, lr,
                           lc);
    };

    if (n_tiles > 0) {
        load_head_rows<BM>(sQ, q + seq.q0 * q_sn, seq.b, q_sb, h, q_sh, q_sn, m0, seq.nq, lr, lc);
        load_head_rows<BM>(sDO, dout + seq.q0 * do_sn, seq.b, do_sb, h, do_sh, do_sn, m0, seq.nq, lr, lc);
        // the head-dim tail the math reads ([FC_HEAD_DIM, Q_DK)), which no copy writes
        zero_tail<Q_DK / 8>(smem, 0, 2 * BM + STAGES_Q * 2 * BN, tid);
    }
    pipeline_begin(n_tiles, st0, load_kv);  // Q, dO and stage 0: the first commit group

#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
        // ---- K_j, V_j have landed; every warp is done with the other stage: prefetch j + 1 ----
        const int j = j0 + it;
        const u32 st = pipeline_top<STAGES_Q>(it, n_tiles, st0, Q_STAGE_BYTES, load_kv);
        const bool need_mask = tiles.masked(j);

#pragma unroll 1
        for (int kc = 0; kc < Q_KW / Q_KC; ++kc) {
            const int kr0 = ks * Q_KW + kc * Q_KC;  // first key (in the tile) of this chunk
            const u32 k_base = st + kr0 * ROW_BYTES + frag_row;
            const u32 v_base = k_base + ST_V;

            // ---- S = Q K^T and dP = dO V^T (16 rows x Q_KC keys) ----
            acc_t acc_s[1][Q_KC / 8][ACC_REGS], acc_p[1][Q_KC / 8][ACC_REGS];
            scores_and_dp<Q_KS>(acc_s, acc_p, q_base, k_base, do_base, v_base, frag_w);

            // ---- P = exp2(S c - L_row) (masked: 0), dS = P (dP - delta_row) -> A fragments ----
            u32 ds_frag[1][Q_KC / 16][4];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int last = fc_last_key(row_g + 8 * hf, seq.nq, seq.nk) - (j * BN + kr0 + 2 * t);
                const int first = fc_first_key(row_g + 8 * hf, seq.nq, seq.nk) - (j * BN + kr0 + 2 * t);
#pragma unroll
                for (int n = 0; n < Q_KC / 8; ++n) {
                    float ds[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        // (row row_g + 8 hf, key j BN + kr0 + 2 t + 8 n + e; the score hook first,
                        // flash_common.cuh, and its derivative in dS)
                        const int key = j * BN + kr0 + 2 * t + 8 * n + e;
                        float gs;  // hook'(t)
                        float p = fc_hook_p(hook, acc_get(acc_s[0][n], 2 * hf + e), row_g + 8 * hf, key, scale_log2,
                                            lrow[hf], gs);
                        if (need_mask && (n * 8 + e > last || (FC_BOUND_LEFT && n * 8 + e < first))) p = 0.f;
                        ds[e] = fc_hook_ds(p * (acc_get(acc_p[0][n], 2 * hf + e) - drow[hf]), gs);
                    }
                    ds_frag[0][n >> 1][hf + 2 * (n & 1)] = pack_elem2(ds[0], ds[1]);
                }
            }

            // ---- dQ += dS K (B operand: K rows = keys, by ldmatrix.trans) ----
            warp_gemm_ab<Q_KC / 16, Q_KS>(acc_dq, ds_frag, k_base, frag_w, [](int dp) { return dp; });
        }

        pipeline_bottom<STAGES_Q>(it, n_tiles, st0, load_kv);
    }

    // ---- epilogue: sum the KSPLIT partials, dQ *= scale, round, 16-byte stores of rows < nq ----
    store_tile<BM, 2 * Q_KS, Q_KSPLIT, Q_RG, 1>(smem, acc_dq[0], rg, ks, rg * 16, 0, scale_log2 * FC_LN2,
                                               dq + (rows.o0 + m0 * rows.o_step) * FC_HEAD_DIM, seq.nq - m0,
                                               rows.o_step * FC_HEAD_DIM);
}
