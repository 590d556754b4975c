// bwd_simt.cu: the FlashAttention backward pass with scalar fp32 FMAs (no tensor cores).
//
// This is flashcupy's teaching backward. Neither kernel stores the nq x nk matrices P, dP or dS:
// both recompute them tile by tile from Q, K, V, dO and the row statistics the forward saved
// (lse, natural log) plus delta_i = rowsum(dO_i * O_i). For a query tile i and a key tile j:
//
//     S  = Q_i K_j^T                                raw scores                   (1)
//     P  = exp2(S * scale_log2 - lse_i * log2(e))   the forward's probabilities  (2)
//     dP = dO_i V_j^T                                                            (3)
//     dS = P * (dP - delta_i)                       softmax backward             (4)
//     dV_j += P^T dO_i     dK_j += dS^T Q_i     dQ_i += dS K_j                   (5)
//
// and at the end dK and dQ are multiplied by the softmax scale. Equations (1)-(4) live in
// p_ds_tile, shared by both kernels; (5) is three calls of accumulate_tn.
//
//   flash_bwd_dkdv_simt  grid (ceil(nk / BN), Hkv, B): one CTA owns BN keys of one kv head, keeps
//                        K_j, V_j in shared memory and dK_j, dV_j in registers, and walks the
//                        `group` query heads that share the kv head and all their query tiles.
//   flash_bwd_dq_simt    grid (ceil(nq / BM), Hq, B): one CTA owns BM query rows, keeps Q_i, dO_i
//                        in shared memory and dQ_i in registers, and walks the key tiles.
// Every output element is written once by one thread: no atomics, bitwise deterministic.
//
// Rounding model (flash_common.cuh): P and dS are computed in fp32 (dS from the fp32 P) and
// rounded to the element type (fc_round_elem) before they enter a product. The accumulators S, dP
// (reduced over the head dim), dV, dK (reduced over query rows: 16-row chunks of each query tile,
// tiles in order, query heads g = 0..group-1 in order) and dQ (reduced over keys: 16-key chunks of
// each key tile, tiles in order) take the products in fp32 partial sums of 16 and add each partial
// sum with one fc_round_acc (identity for fp32 accumulators, an fp16 round trip for FC_ACCUM_F16).
// Chunks that hold only masked / padded entries contribute exact zeros and are skipped, which
// changes no accumulator (round(acc + 0) == acc).
//
// Launch contract (what flashcupy computes on the Python side):
//   FC_NUM_THREADS = 256                     (16 row groups of 16 lanes, for every tile)
//   DP             = 16 * ceil(FC_HEAD_DIM / 16)
//   dynamic smem, dkdv = 4 * (2 * BN * (DP + 4) + 2 * BM * DP + 2 * BM * (BN + 4) + 2 * BM)  bytes
//                         [ K_j, V_j ]          [ Q_i, dO_i ]  [ P, dS ]            [lse, delta]
//   dynamic smem, dq   = 4 * (2 * BM * DP + 2 * BN * (DP + 4) + BN * (BM + 4) + 2 * BM)      bytes
//                         [ Q_i, dO_i ]  [ K_j, V_j ]          [ P, then dS^T ]  [lse, delta]
//   Register limits: the dkdv accumulators take 2 * BN * DP / 256 registers per thread and the dq
//   accumulator BM * DP / 256; both must stay <= 128 (BN * DP <= 16384, BM * DP <= 32768).
//
// Thread layout. A row group is half a warp (16 lanes, c = threadIdx.x % 16, rg = threadIdx.x / 16).
//   In a score tile (S, P, dP, dS; BM x BN) row group rg owns the SR = BM / 16 consecutive query
//   rows rg*SR.., and lane c the keys c, c+16, c+32, ... (as the forward's S_j).
//   In an accumulator (dV, dK: BN x D; dQ: BM x D) row group rg owns TR = rows / 16 consecutive
//   rows rg*TR.., and lane c the head-dim columns c, c+16, c+32, ... (as the forward's O).
// Shared memory holds fp32 (converted once when staged), zero-padded to DP columns and to whole
// tiles of rows. Reads in the inner loops are conflict-free: broadcasts of one row group's rows
// (float4 along the reduction axis for S, dP; float4 along the rows for the accumulator updates),
// K/V rows read as float4 by 16 lanes at pitch DP + 4 (an odd number of 16-byte units), and
// consecutive columns of Q, dO, K for the accumulator updates.
#include "flash_common.cuh"
#include "simt_common.cuh"
#include "bwd_prep.cuh"

namespace bwd_simt {

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int D = FC_HEAD_DIM;
constexpr int DP = SIMT_DP;

constexpr int TN = SIMT_TN;                     // lanes per row group (half a warp)
constexpr int NRG = FC_NUM_THREADS / TN;        // row groups per CTA: 16
constexpr int CHUNK = SIMT_CHUNK;               // products per fp32 partial sum (mma k-extent)
constexpr int DPT = DP / TN;                    // accumulator columns per lane: d = c + TN * i
constexpr int SR = BM / NRG;                    // score-tile query rows per row group
constexpr int KPT = BN / TN;                    // score-tile keys per lane:   key = c + TN * i
constexpr int GS = KPT < 2 ? KPT : 2;          // score-tile keys per register block

constexpr int ROW_PITCH = DP;      // Q_i, dO_i      [BM][DP]
constexpr int KV_PITCH = DP + 4;   // K_j, V_j       [BN][DP + 4]
constexpr int S_PITCH = BN + 4;    // P, dS (dkdv)   [BM][BN + 4]
constexpr int ST_PITCH = BM + 4;   // dS^T (dq)      [BN][BM + 4]


static_assert(BM == 16 || BM == 32 || BM == 64 || BM == 128, "FC_BLOCK_M must be 16, 32, 64 or 128");
static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128, "FC_BLOCK_N must be 16, 32, 64 or 128");
static_assert(FC_NUM_THREADS == 256, "bwd_simt needs FC_NUM_THREADS == 256");
static_assert(FC_HEAD_DIM_PAD == FC_HEAD_DIM, "bwd_simt computes with the true head dim");
static_assert(2 * BN * DP <= 128 * FC_NUM_THREADS, "bwd_simt: dK, dV accumulators need BN * DP <= 16384");
static_assert(BM * DP <= 128 * FC_NUM_THREADS, "bwd_simt: dQ accumulator needs BM * DP <= 32768");
// The two layouts carved in the kernels below, against the build layer's figures (floats).
static_assert(4 * (2 * BN * KV_PITCH + 2 * BM * ROW_PITCH + 2 * BM * S_PITCH + 2 * BM) == FC_SMEM_DKDV,
              "dkdv shared memory differs from FC_SMEM_DKDV");
static_assert(4 * (2 * BM * ROW_PITCH + 2 * BN * KV_PITCH + BN * ST_PITCH + 2 * BM) == FC_SMEM_DQ,
              "dq shared memory differs from FC_SMEM_DQ");


// Stage the row statistics of query rows m0 .. m0+BM-1: the exponent offset fc_lse_log2(lse) (+inf
// for rows that saw no key and rows past nq: their P is exp2(-inf) = 0), for the score hook's scores of
// the head `hook` holds (fc_hook_lq), and delta (0 past nq).
__device__ __forceinline__ void stage_row_stats(float* __restrict__ lse_s, float* __restrict__ delta_s,
                                                const float* __restrict__ lse_head,
                                                const float* __restrict__ delta_head, int m0, int nq,
                                                const FcScoreHook &hook, float scale_log2) {
    for (int r = threadIdx.x; r < BM; r += FC_NUM_THREADS) {
        const int row = m0 + r;
        lse_s[r] = fc_hook_lq(hook, fc_row_lse_log2(lse_head, row, nq), row, scale_log2);
        delta_s[r] = row < nq ? delta_head[row] : 0.f;
    }
}

// f(row, t, i, d) for each accumulator cell this thread owns in the epilogue: row = first + rg * TR
// + t (rows >= limit skipped) and head-dim column d = c + TN * i (< D).
template <int TR, typename F>
__device__ __forceinline__ void for_each_own_cell(int first, int limit, F f) {
    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
#pragma unroll
    for (int t = 0; t < TR; ++t) {
        const int r = first + rg * TR + t;
        if (r >= limit) continue;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            const int d = c + TN * i;
            if (d < D) f(r, t, i, d);
        }
    }
}

// Equations (1)-(4) for query rows m0.. (Q_i, dO_i, row stats staged) and keys n0.. (K_j, V_j
// staged), in two passes over this thread's score-tile entries, GS keys at a time:
//   PASS 1: S = Q K^T and P, kept in fp32 in this thread's slots of p_s;
//   PASS 2: dP = dO V^T and dS from the P of pass 1.
// TRANSPOSED = false (dkdv): round(P) goes to p_s[row][key] and round(dS) to ds_s[row][key] (pitch
// S_PITCH). TRANSPOSED = true (dq): round(dS) goes to ds_s[key][row] (pitch ST_PITCH); p_s must
// equal ds_s and only holds the fp32 P between the two passes.
// With a score hook, pass 1 also keeps the hook's derivative g = hook'(t) (flash_common.cuh) for pass 2:
// dkdv in its ds_s slot (which pass 2 writes last), dq as P g in place of P (it needs no P itself).
// Each thread reads back only slots it wrote itself, so no barrier is needed inside.
template <bool TRANSPOSED, int PASS>
__device__ __forceinline__ void score_pass(const float* __restrict__ a_s, const float* __restrict__ b_s,
                                           const float* __restrict__ lse_s, const float* __restrict__ delta_s,
                                           float* p_s, float* ds_s, int m0, int n0, int nq, int nk,
                                           float scale_log2 FC_HEAD_PARAMS) {
    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
    const int r0 = rg * SR;  // first tile row of this row group
    FcScoreHook hook(scale_log2);
    FC_HOOK_SET_HEAD(hook, head_b, head_h, nq, nk);
    auto slot = [&](int t, int kcol) { return TRANSPOSED ? kcol * ST_PITCH + r0 + t : (r0 + t) * S_PITCH + kcol; };
#pragma unroll 1
    for (int i0 = 0; i0 < KPT; i0 += GS) {
        float x[SR][GS];  // pass 1: S (1); pass 2: dP (3)
        simt_dot_rows<SR, GS, ROW_PITCH, KV_PITCH>(a_s + r0 * ROW_PITCH, b_s + (c + TN * i0) * KV_PITCH, x);
#pragma unroll
        for (int t = 0; t < SR; ++t)
#pragma unroll
            for (int g = 0; g < GS; ++g) {
                const int kcol = c + TN * (i0 + g);
                if constexpr (PASS == 1) {
                    const int row = m0 + r0 + t, key = n0 + kcol;
                    const float lse_log2 = lse_s[r0 + t];
                    // (P would be exp2(-inf) = 0 for rows past nq and rows that saw no key anyway;
                    // testing it costs fewer registers than computing it)
                    const bool visible = row < nq && fc_visible(row, key, nq, nk) && lse_log2 != INFINITY;
                    // (2) P = exp2(S * scale_log2 - lse * log2(e)); 0 where masked or the row saw no key
                    // (the score hook first, flash_common.cuh)
                    float gs;  // hook'(t)
                    const float ts = hook.apply(x[t][g], row, key, gs);
                    const float p = visible ? fc_softmax_p(ts, scale_log2, lse_log2) : 0.f;
                    if constexpr (FC_HOOK_SCALES_DS && !TRANSPOSED) ds_s[slot(t, kcol)] = gs;
                    p_s[slot(t, kcol)] = (FC_HOOK_SCALES_DS && TRANSPOSED) ? p * gs : p;
                } else {
                    const float p = p_s[slot(t, kcol)];  // (dq with a hook: P g)
                    // (4) dS = P * (dP - delta) (times the score hook's derivative); exactly 0 where P is
                    // (masked entries never see dP)
                    float ds = p == 0.f ? 0.f : p * (x[t][g] - delta_s[r0 + t]);
                    if constexpr (FC_HOOK_SCALES_DS && !TRANSPOSED) ds *= ds_s[slot(t, kcol)];
                    if (!TRANSPOSED) p_s[slot(t, kcol)] = fc_round_elem(p);
                    ds_s[slot(t, kcol)] = fc_round_elem(ds);
                }
            }
    }
}

template <bool TRANSPOSED>
__device__ __forceinline__ void p_ds_tile(const float* __restrict__ q_s, const float* __restrict__ k_s,
                                          const float* __restrict__ do_s, const float* __restrict__ v_s,
                                          const float* __restrict__ lse_s, const float* __restrict__ delta_s,
                                          float* p_s, float* ds_s, int m0, int n0, int nq, int nk,
                                          float scale_log2 FC_HEAD_PARAMS) {
    score_pass<TRANSPOSED, 1>(q_s, k_s, lse_s, delta_s, p_s, ds_s, m0, n0, nq, nk,
                              scale_log2 FC_HEAD_ARGS(head_b, head_h));
    score_pass<TRANSPOSED, 2>(do_s, v_s, lse_s, delta_s, p_s, ds_s, m0, n0, nq, nk,
                              scale_log2 FC_HEAD_ARGS(head_b, head_h));
}

// (5) acc[t][i] += sum_k A[k][r0 + t] * B[k][c + TN * i] over the first n_k rows k of A and B
// (a multiple of 16), for this row group's TR accumulator rows r0 = rg * TR and this lane's
// head-dim columns: fp32 partial sums over 16 consecutive k, each added with one rounding.
template <int TR, int A_PITCH, int B_PITCH>
__device__ __forceinline__ void accumulate_tn(const float* __restrict__ a, const float* __restrict__ b, int n_k,
                                              float (&acc)[TR][DPT]) {
    constexpr int GO_MAX = 32 / TR < 8 ? 32 / TR : 8;
    constexpr int GO = DPT < GO_MAX ? DPT : GO_MAX;  // head-dim columns per register block
    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
    simt_accumulate<TR, DPT, GO, false, A_PITCH, B_PITCH>(a + rg * TR, b + c, n_k, acc);
}

// Number of rows (of a tile of `tile` rows starting at global row `first`, `limit` rows in all)
// that hold data, rounded up to whole 16-row chunks.
__device__ __forceinline__ int chunked_rows(int tile, int first, int limit) {
    return (min(tile, limit - first) + CHUNK - 1) / CHUNK * CHUNK;
}

}  // namespace bwd_simt

extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1) flash_bwd_dkdv_simt(FC_BWD_PARAMS) {
    using namespace bwd_simt;
    constexpr int TR = BN / NRG;  // dK, dV rows (keys) per row group

    extern __shared__ float4 smem_f4[];
    float* k_s = reinterpret_cast<float*>(smem_f4);  // [BN][KV_PITCH]   K_j, staged once
    float* v_s = k_s + BN * KV_PITCH;                 // [BN][KV_PITCH]   V_j, staged once
    float* q_s = v_s + BN * KV_PITCH;                 // [BM][ROW_PITCH]  Q_i
    float* do_s = q_s + BM * ROW_PITCH;               // [BM][ROW_PITCH]  dO_i
    float* p_s = do_s + BM * ROW_PITCH;               // [BM][S_PITCH]    P (rounded)
    float* ds_s = p_s + BM * S_PITCH;                 // [BM][S_PITCH]    dS (rounded)
    float* lse_s = ds_s + BM * S_PITCH;               // [BM]             lse_i * log2(e)
    float* delta_s = lse_s + BM;                      // [BM]             delta_i

    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
    const int n0 = blockIdx.x * BN;  // first key of this CTA
    const int hk = blockIdx.y, b = blockIdx.z;
    const long long hkv = gridDim.y, hq = hkv * group;
    const FcSeq seq = FC_ENTRIES(b);       // this CTA's batch entry (flash_common.cuh)
    if (FC_VARLEN && n0 >= seq.nk) return;  // (packed sequences shorter than the longest: no keys here)

    stage_tile<BN, KV_PITCH>(k_s, k + seq.b * k_sb + hk * k_sh + (seq.k0 + n0) * k_sn, k_sn, seq.nk - n0);
    stage_tile<BN, KV_PITCH>(v_s, v + seq.b * v_sb + hk * v_sh + (seq.k0 + n0) * v_sn, v_sn, seq.nk - n0);

    float dk_acc[TR][DPT], dv_acc[TR][DPT];
#pragma unroll
    for (int t = 0; t < TR; ++t)
#pragma unroll
        for (int i = 0; i < DPT; ++i) dk_acc[t][i] = dv_acc[t][i] = 0.f;

    // The query tiles this key tile visits (the range hook, flash_common.cuh: from the one holding the
    // first row that sees a key of the tile to the one holding the last; none at all when no row sees
    // one: dK = dV = 0); every tile is masked row by row (fc_visible).
    const FcQueryTiles qtiles = fc_query_tiles<BM, BN>(n0, seq.nq, seq.nk);

    for (int g = 0; g < group; ++g) {
        const long long h = (long long)hk * group + g;
        const elem_t* q_head = q + seq.b * q_sb + h * q_sh + seq.q0 * q_sn;
        const elem_t* do_head = dout + seq.b * do_sb + h * do_sh + seq.q0 * do_sn;
        const float* lse_head = lse + (seq.b * hq + h) * nq + seq.q0;  // (fc_rows' lse0)
        const float* delta_head = delta + (seq.b * hq + h) * nq + seq.q0;

        for (int m0 = qtiles.first * BM; m0 < qtiles.end * BM; m0 += BM) {
            // 1. Q_i, dO_i and their row statistics -> shared memory (the first pass also
            //    publishes K_j and V_j).
            stage_tile<BM, ROW_PITCH>(q_s, q_head + m0 * q_sn, q_sn, seq.nq - m0);
            stage_tile<BM, ROW_PITCH>(do_s, do_head + m0 * do_sn, do_sn, seq.nq - m0);
            FcScoreHook rows_hook(scale_log2);  // (the row statistics of this head: fc_hook_lq)
            FC_HOOK_SET_HEAD(rows_hook, b, (int)h, seq.nq, seq.nk);
            stage_row_stats(lse_s, delta_s, lse_head, delta_head, m0, seq.nq, rows_hook, scale_log2);
            __syncthreads();

            // 2. P and dS of this (query tile, key tile) pair.
            p_ds_tile<false>(q_s, k_s, do_s, v_s, lse_s, delta_s, p_s, ds_s, m0, n0, seq.nq, seq.nk,
                             scale_log2 FC_HEAD_ARGS(b, (int)h));
            __syncthreads();

            // 3. (5) dV += P^T dO,  dK += dS^T Q  (reduced over this tile's query rows)
            const int n_rows = chunked_rows(BM, m0, seq.nq);
            accumulate_tn<TR, S_PITCH, ROW_PITCH>(p_s, do_s, n_rows, dv_acc);
            accumulate_tn<TR, S_PITCH, ROW_PITCH>(ds_s, q_s, n_rows, dk_acc);
            __syncthreads();  // Q_i, dO_i, P, dS are overwritten by the next tile
        }
    }

    // Epilogue: dk = scale * dK, dv = dV in the element type; keys past nk are not written.
    // (Written out: through for_each_own_cell's lambda ptxas spends up to 24 more registers here.)
    const float scale = scale_log2 * FC_LN2;
#pragma unroll
    for (int t = 0; t < TR; ++t) {
        const int key = n0 + rg * TR + t;
        if (key >= seq.nk) continue;
        const FcRows rows = fc_key_rows(seq, hk, hkv, nk);  // where this head's rows of dk and dv go
        const long long row_id = rows.o0 + key * rows.o_step;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            const int d = c + TN * i;
            if (d < D) {
                dk[row_id * D + d] = fc_from_float<elem_t>(dk_acc[t][i] * scale);
                dv[row_id * D + d] = fc_from_float<elem_t>(dv_acc[t][i]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1) flash_bwd_dq_simt(FC_BWD_PARAMS) {
    using namespace bwd_simt;
    constexpr int TR = BM / NRG;  // dQ rows (queries) per row group

    extern __shared__ float4 smem_f4[];
    float* q_s = reinterpret_cast<float*>(smem_f4);  // [BM][ROW_PITCH]  Q_i, staged once
    float* do_s = q_s + BM * ROW_PITCH;               // [BM][ROW_PITCH]  dO_i, staged once
    float* k_s = do_s + BM * ROW_PITCH;               // [BN][KV_PITCH]   K_j
    float* v_s = k_s + BN * KV_PITCH;                 // [BN][KV_PITCH]   V_j
    float* ds_s = v_s + BN * KV_PITCH;                // [BN][ST_PITCH]   P, then dS^T (rounded)
    float* lse_s = ds_s + BN * ST_PITCH;              // [BM]             lse_i * log2(e)
    float* delta_s = lse_s + BM;                      // [BM]             delta_i

    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
    const int m0 = blockIdx.x * BM;  // first query row of this CTA
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const long long hq = gridDim.y;
    const FcSeq seq = FC_ENTRIES(b);       // this CTA's batch entry (flash_common.cuh)
    if (FC_VARLEN && m0 >= seq.nq) return;  // (packed sequences shorter than the longest: no rows here)
    const elem_t* k_head = k + seq.b * k_sb + h_kv * k_sh + seq.k0 * k_sn;
    const elem_t* v_head = v + seq.b * v_sb + h_kv * v_sh + seq.k0 * v_sn;

    stage_tile<BM, ROW_PITCH>(q_s, q + seq.b * q_sb + h * q_sh + (seq.q0 + m0) * q_sn, q_sn, seq.nq - m0);
    stage_tile<BM, ROW_PITCH>(do_s, dout + seq.b * do_sb + h * do_sh + (seq.q0 + m0) * do_sn, do_sn, seq.nq - m0);
    FcScoreHook rows_hook(scale_log2);  // (the row statistics of this head: fc_hook_lq)
    FC_HOOK_SET_HEAD(rows_hook, b, h, seq.nq, seq.nk);
    stage_row_stats(lse_s, delta_s, lse + (seq.b * hq + h) * nq + seq.q0, delta + (seq.b * hq + h) * nq + seq.q0,
                    m0, seq.nq, rows_hook, scale_log2);

    float dq_acc[TR][DPT];
#pragma unroll
    for (int t = 0; t < TR; ++t)
#pragma unroll
        for (int i = 0; i < DPT; ++i) dq_acc[t][i] = 0.f;

    // The key tiles this CTA visits (the range hook, flash_common.cuh; causal: fewer tiles, none at all
    // when every row sees nothing, and then dq = 0); every tile is masked key by key (fc_visible).
    const FcKeyTiles tiles = fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk);
    const int n_keys = tiles.key_end;

    for (int j = tiles.first; j < tiles.end; ++j) {
        const int n0 = j * BN;  // first key of tile j

        // 1. K_j, V_j -> shared memory (the first pass also publishes Q_i, dO_i, row stats).
        stage_tile<BN, KV_PITCH>(k_s, k_head + n0 * k_sn, k_sn, seq.nk - n0);
        stage_tile<BN, KV_PITCH>(v_s, v_head + n0 * v_sn, v_sn, seq.nk - n0);
        __syncthreads();

        // 2. dS^T of this (query tile, key tile) pair.
        p_ds_tile<true>(q_s, k_s, do_s, v_s, lse_s, delta_s, ds_s, ds_s, m0, n0, seq.nq, seq.nk,
                        scale_log2 FC_HEAD_ARGS(b, h));
        __syncthreads();

        // 3. (5) dQ += dS K  (reduced over this tile's keys)
        accumulate_tn<TR, ST_PITCH, KV_PITCH>(ds_s, k_s, chunked_rows(BN, n0, n_keys), dq_acc);
        __syncthreads();  // K_j, V_j, dS^T are overwritten by the next tile
    }

    // Epilogue: dq = scale * dQ in the element type; rows past nq are not written.
    const float scale = scale_log2 * FC_LN2;
    const FcRows rows = fc_rows(seq, h, hq, nq);  // where this head's rows of dq go
    for_each_own_cell<TR>(m0, seq.nq, [&](int row, int t, int i, int d) {
        dq[(rows.o0 + row * rows.o_step) * D + d] = fc_from_float<elem_t>(dq_acc[t][i] * scale);
    });
}
