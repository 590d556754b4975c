// fwd_simt.cu: the FlashAttention forward pass with scalar fp32 FMAs (no tensor cores).
//
// This is flashcupy's teaching kernel. One CTA owns BM query rows of one (batch, head) and streams
// the keys/values past them in tiles of BN rows, never materialising the nq x nk score matrix.
// For every KV tile j, with S_j = Q K_j^T (raw, unscaled scores) and per query row:
//
//     m_new = max(m, rowmax(S_j))          running max of the scores seen so far
//     alpha = exp(m - m_new)               how much the old state shrinks under the new max
//     P     = exp(S_j - m_new)             this tile's unnormalised probabilities
//     l     = alpha * l + rowsum(P)        running softmax denominator
//     O     = alpha * O + P V_j            running unnormalised output
//     m     = m_new
//
// and at the end  o = O / l,  lse = m * scale + ln(l).  Exponentials are taken base 2 with the
// softmax scale folded in: exp(scale * x) = exp2(x * scale_log2).  The rounding model (fp32 or
// fp16 accumulators) is the one stated in flash_common.cuh.  The two ablations are #if branches
// at exactly the lines they remove (search for FC_ABLATE_).
//
// Launch contract (what flashcupy computes on the Python side):
//   FC_NUM_THREADS = min(4 * BM, 256)          (64, 128, 256, 256 for BM = 16, 32, 64, 128)
//   DP             = 16 * ceil(FC_HEAD_DIM / 16)
//   dynamic smem   = 4 * (BM * DP + BN * (DP + 4) + BM * (BN + 4))  bytes
//                    [ Q tile ]  [ K_j, then V_j ]  [ S_j, then P_j ], all fp32
//   BM = 128 requires FC_HEAD_DIM <= 128 (its O accumulators would not fit in registers).
//
// Thread layout: a row group is half a warp (16 lanes, c = threadIdx.x % 16) and owns TM = 4
// consecutive query rows (TM = 8 at BM = 128). In S_j lane c owns keys c, c+16, c+32, ...; in O
// it owns head-dim columns c, c+16, c+32, ... Row statistics (max, sum) are reduced across the
// 16 lanes with xor shuffles, which leave every lane with the same bits, so all 16 lanes keep
// identical copies of m and l for their rows.
//
// Shared memory holds fp32 (converted once when staged), padded for conflict-free access: K rows
// are read as float4 by 16 different lanes (pitch DP + 4 = an odd number of 16-byte units); S/P
// rows of the two row groups of a warp sit 16 banks apart (pitch BN + 4; at TM = 8 they share
// banks, a 2-way conflict on the softmax's few scalar accesses only); Q and P reads in the inner
// loops are broadcasts and V reads are consecutive. The head dim is zero-padded to DP, so every
// S chunk is 16 wide; the padded products are exact zeros and change no sum.
#include "flash_common.cuh"
#include "simt_common.cuh"

namespace fwd_simt {

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int D = FC_HEAD_DIM;
constexpr int DP = SIMT_DP;

constexpr int TN = SIMT_TN;                     // lanes sharing a row group (half a warp)
constexpr int TM = BM * TN / FC_NUM_THREADS;    // query rows per row group: 4, or 8 at BM = 128
constexpr int KPT = BN / TN;   // keys of S_j per thread:       key  = c + TN * i
constexpr int DPT = DP / TN;   // head-dim columns per thread:  dim  = c + TN * i
constexpr int CHUNK = SIMT_CHUNK;  // products per fp32 partial sum (the mma.m16n8k16 k-extent)

constexpr int GS = KPT < 2 ? KPT : 2;  // keys per register block in Q K^T
constexpr int GO = DPT < 2 ? DPT : 2;  // head-dim columns per register block in P V

constexpr int Q_PITCH = DP;
constexpr int KV_PITCH = DP + 4;
constexpr int S_PITCH = BN + 4;

static_assert(BM == 16 || BM == 32 || BM == 64 || BM == 128, "FC_BLOCK_M must be 16, 32, 64 or 128");
static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128, "FC_BLOCK_N must be 16, 32, 64 or 128");
static_assert(FC_NUM_THREADS == (BM < 64 ? 4 * BM : 256), "fwd_simt needs FC_NUM_THREADS == min(4 * BM, 256)");
static_assert(FC_HEAD_DIM_PAD == FC_HEAD_DIM, "fwd_simt computes with the true head dim");
static_assert(BM < 128 || D <= 128, "fwd_simt: FC_BLOCK_M = 128 needs FC_HEAD_DIM <= 128");
static_assert(4 * (BM * Q_PITCH + BN * KV_PITCH + BM * S_PITCH) == FC_SMEM_FWD,
              "shared memory (Q, K/V, S/P tiles) differs from FC_SMEM_FWD");

// Max / sum over the 16 lanes of a row group.
__device__ __forceinline__ float row_group_max(float x) {
#pragma unroll
    for (int off = TN / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
__device__ __forceinline__ float row_group_sum(float x) {
#pragma unroll
    for (int off = TN / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}


// S_j = Q K_j^T for this thread's TM rows x KPT keys, in accumulator precision: products are
// summed in fp32 over 16 head-dim columns, and each partial sum enters the accumulator with one
// rounding (fc_round_acc, the identity for fp32 accumulators). Keys a row may not see (past nk,
// or past its causal diagonal) score -inf. The scores go to this thread's own slots of s_s.
__device__ __forceinline__ void scores_tile(const float* __restrict__ q_s, const float* __restrict__ k_s,
                                            float* __restrict__ s_s, int rg, int c, int row0, int key0,
                                            int nq, int nk, const FcScoreHook &hook) {
    const float* q_rows = q_s + rg * TM * Q_PITCH;
    const float* k_rows = k_s + c * KV_PITCH;
#pragma unroll
    for (int i0 = 0; i0 < KPT; i0 += GS) {
        float acc[TM][GS];
        simt_dot_rows<TM, GS, Q_PITCH, KV_PITCH>(q_rows, k_rows + i0 * TN * KV_PITCH, acc);
#pragma unroll
        for (int t = 0; t < TM; ++t)
#pragma unroll
            for (int g = 0; g < GS; ++g) {
                const int key = key0 + (i0 + g) * TN;
                const bool visible = fc_visible(row0 + t, key, nq, nk);
                // the score hook (flash_common.cuh), then the mask
                s_s[(rg * TM + t) * S_PITCH + c + (i0 + g) * TN] =
                    visible ? hook.apply(acc[t][g], row0 + t, key) : -INFINITY;
            }
    }
}

// O += P_j V_j for this thread's TM rows x DPT head-dim columns: products summed in fp32 over
// 16 keys, each partial sum added to the accumulator with one rounding. Only the first n_keys
// keys of the tile are visited: past them P is 0 for every row of the CTA (round(O + 0) == O).
__device__ __forceinline__ void pv_tile(const float* __restrict__ p_s, const float* __restrict__ v_s,
                                        int rg, int c, int n_keys, float (&o)[TM][DPT]) {
    simt_accumulate<TM, DPT, GO, true, S_PITCH, KV_PITCH>(p_s + rg * TM * S_PITCH, v_s + c, n_keys, o);
}

}  // namespace fwd_simt

extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS, 1) flash_fwd_simt(FC_FWD_PARAMS) {
    using namespace fwd_simt;

    extern __shared__ float4 smem_f4[];
    float* q_s = reinterpret_cast<float*>(smem_f4);  // [BM][Q_PITCH]   Q tile, staged once
    float* kv_s = q_s + BM * Q_PITCH;                 // [BN][KV_PITCH]  K_j, then V_j (same buffer)
    float* s_s = kv_s + BN * KV_PITCH;                // [BM][S_PITCH]   S_j, then P_j (in place)

    const int rg = threadIdx.x / TN, c = threadIdx.x % TN;
    const int m0 = blockIdx.x * BM;  // first query row of this CTA
    const int h = blockIdx.y, h_kv = h / group;
    const FcSeq seq = FC_ENTRIES(blockIdx.z);  // this CTA's batch entry (flash_common.cuh)
    if (FC_VARLEN && m0 >= seq.nq) return;     // (packed sequences shorter than the longest: no rows here)
    const elem_t* k_head = k + seq.b * k_sb + h_kv * k_sh + (long long)seq.k0 * k_sn;
    const elem_t* v_head = v + seq.b * v_sb + h_kv * v_sh + (long long)seq.k0 * v_sn;

    // The key tiles this CTA visits (the range hook, flash_common.cuh; causal: fewer tiles, none at all
    // when every row sees nothing); every tile is masked key by key (fc_visible).
    const FcKeyTiles tiles = fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk);
    const int n_keys = tiles.key_end;
    FcScoreHook hook(scale_log2);
    FC_HOOK_SET_HEAD(hook, blockIdx.z, h, seq.nq, seq.nk);

    // Running state of this thread's rows: m, l (identical in the 16 lanes of the row group) and
    // its DPT columns of O.
    float m[TM], l[TM], o_acc[TM][DPT];
#pragma unroll
    for (int t = 0; t < TM; ++t) {
        m[t] = -INFINITY;
        l[t] = 0.f;
#pragma unroll
        for (int i = 0; i < DPT; ++i) o_acc[t][i] = 0.f;
    }

    stage_tile<BM, Q_PITCH>(q_s, q + seq.b * q_sb + h * q_sh + (seq.q0 + m0) * q_sn, q_sn, seq.nq - m0);

    for (int j = tiles.first; j < tiles.end; ++j) {
        const int n0 = j * BN;  // first key of tile j

        // 1. K_j -> shared memory (the first pass also publishes Q).
        stage_tile<BN, KV_PITCH>(kv_s, k_head + n0 * k_sn, k_sn, seq.nk - n0);
        __syncthreads();

        // 2. S_j = Q K_j^T (masked) into s_s. Each thread later reads back only its own slots.
        scores_tile(q_s, kv_s, s_s, rg, c, m0 + rg * TM, n0 + c, seq.nq, seq.nk, hook);
        __syncthreads();  // every thread is done with K_j

        // 3. V_j -> shared memory (over K_j), while each row group runs the online softmax and
        //    turns its S_j slots into P_j.
        stage_tile<BN, KV_PITCH>(kv_s, v_head + n0 * v_sn, v_sn, seq.nk - n0);
#pragma unroll
        for (int t = 0; t < TM; ++t) {
            float* s_row = s_s + (rg * TM + t) * S_PITCH + c;  // keys c + TN * i of this row
            float s[KPT];
#pragma unroll
            for (int i = 0; i < KPT; ++i) s[i] = s_row[TN * i];

            // the online-softmax step (flash_common.cuh): m, alpha and the exponent offset
            float alpha;
            const float sub = fc_softmax_step(m[t], alpha, scale_log2, [&] {
                float tile_max = -INFINITY;
#pragma unroll
                for (int i = 0; i < KPT; ++i) tile_max = fmaxf(tile_max, s[i]);
                return row_group_max(tile_max);
            });

            // P = exp(S_j - m_new), l = alpha * l + rowsum(P) (from the fp32 P)
            float row_sum = 0.f;
#pragma unroll
            for (int i = 0; i < KPT; ++i) {
                const float p = fc_softmax_p(s[i], scale_log2, sub);
                row_sum += p;
                s_row[TN * i] = fc_round_elem(p);  // P enters P V_j at the element precision
            }
            l[t] = fc_softmax_l(l[t], alpha, row_group_sum(row_sum));

            // O = alpha * O   (+ P V_j in step 4; the identity under both breaks)
            if (FC_SOFTMAX_RESCALES) {
#pragma unroll
                for (int i = 0; i < DPT; ++i) o_acc[t][i] = fc_round_acc(alpha * o_acc[t][i]);
            }
        }
        __syncthreads();

        // 4. O += P_j V_j
        pv_tile(s_s, kv_s, rg, c, min(BN, n_keys - n0), o_acc);
        __syncthreads();  // V_j and P_j are overwritten by the next tile
    }

    // Epilogue: o = O / l,  lse = m * scale + ln(l);  rows that saw no key get o = 0, lse = -inf.
    const long long hq = gridDim.y;
#pragma unroll
    for (int t = 0; t < TM; ++t) {
        const int row = m0 + rg * TM + t;
        if (row >= seq.nq) continue;
        const FcRows rows = fc_rows(seq, h, hq, nq);  // where this head's rows of o and lse go
        const bool empty = l[t] == 0.f;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            const int d = c + TN * i;
            if (d < D) o[(rows.o0 + row * rows.o_step) * D + d] = fc_from_float<elem_t>(empty ? 0.f : o_acc[t][i] / l[t]);
        }
        if (c == 0) lse[rows.lse0 + row] = fc_hook_lse(hook, m[t], l[t], scale_log2, row);
    }
}
