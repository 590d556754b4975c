// fwd_mma.cu: FlashAttention-2 forward pass on tensor cores (mma.sync.m16n8k16, sm_80+ / sm_90).
//
// One CTA owns FC_BLOCK_M query rows of one (batch, query head); each of its warps owns
// RW = FC_BLOCK_M / num_warps rows (16 or 32, i.e. MT = 1 or 2 m16 tiles) and never shares
// them: scores, probabilities, the running max m, the running sum l and the output accumulator O
// all live in that warp's registers. K and V stream through shared memory in tiles of
// FC_BLOCK_N keys.
//
// Online softmax, per query row, over key tiles j = 0, 1, ... (c = scale_log2 = scale * log2 e):
//     S_j     = q K_j^T                                   (tensor cores)
//     m_new   = max(m, rowmax(S_j))
//     P_j     = exp2(S_j * c - m_new * c)                 (m_new = -inf maps to 0: fc_safe_max)
//     alpha   = exp2(m * c - m_new * c)                   (0 while m = -inf)
//     l       = alpha * l + rowsum(P_j)
//     O       = alpha * O + P_j V_j                       (P_j rounded to fp16/bf16 first)
//     m       = m_new
//   end: o = O / l, lse = m * scale + ln(l); o = 0 and lse = -inf where l == 0.
// The rounding model of flash_common.cuh is followed: with FC_ACCUM_F16 the S and O accumulators
// are mma f16 accumulators, m and l are kept at fp16 precision and every state update is computed
// in fp32 and rounded once.
//
// Pipeline of one CTA (single K, V and Q buffers; the loads of one operand overlap the math of
// the other):
//     prologue: cp.async Q, K_0; cp.async V_0
//     for j:  wait K_j | sync | cp.async V_j (j>0) | S = Q K_j^T, mask, softmax, P -> registers
//             wait V_j | sync | cp.async K_{j+1}   | O += P V_j
//     epilogue: O / l -> smem (the warp's own Q rows) -> 16-byte coalesced stores; lse.
// Shared-memory tiles are row-major with 16-byte chunks XOR-swizzled inside each row, so that
// ldmatrix (8 rows x 16 bytes per 8x8 matrix) and the epilogue's 4-byte writes are free of bank
// conflicts. P goes from the S accumulators straight into A fragments (the C layout of
// m16n8k16 pairs up with its A layout), never through shared memory.
//
// Dynamic shared memory (bytes), to be passed at launch:
//     (FC_BLOCK_M + 2 * FC_BLOCK_N) * FC_HEAD_DIM_PAD * sizeof(elem_t)
// Supported: FC_DTYPE 1 or 2; FC_ACCUM_F16 only with FC_DTYPE 1; FC_BLOCK_M / (FC_NUM_THREADS/32)
// in {16, 32}; FC_BLOCK_N a multiple of 16; FC_HEAD_DIM_PAD a multiple of 32.
// Head dims: copies move the FC_HEAD_DIM real columns only; the math runs over
// DK = FC_HEAD_DIM rounded up to 16 (columns [FC_HEAD_DIM, DK) are zeroed once in shared memory,
// columns >= DK are never touched), which gives the same result as computing over the full pad.
// Final division: o = O * (1/l) with one correctly rounded reciprocal per row (__frcp_rn) instead of an
// IEEE divide per element (kept normal under -ftz by a 2^-64 prescale when l > 2^126).

#include "flash_common.cuh"
#include "mma_common.cuh"

constexpr int BM = FC_BLOCK_M;
constexpr int BN = FC_BLOCK_N;
constexpr int RW = BM / NWARPS;                  // query rows per warp
constexpr int MT = RW / 16;                      // m16 tiles per warp
constexpr int NT = BN / 8;                       // n8 tiles of S per m16 tile
constexpr int DK = (FC_HEAD_DIM + 15) / 16 * 16; // head dim actually multiplied (zero tail < 16)
constexpr int KS = DK / 16;                      // k16 steps of Q K^T == d16 column pairs of O
constexpr int ON = DK / 8;                       // n8 tiles of O per m16 tile
// Q fragments stay in registers when they are cheap (one m16 tile, d <= 128); else ldmatrix.
constexpr bool Q_IN_REGS = (MT == 1) && (KS <= 8);

static_assert(NTHR % 32 == 0 && BM % NWARPS == 0, "FC_NUM_THREADS must split FC_BLOCK_M evenly");
static_assert(RW == 16 || RW == 32, "each warp must own 16 or 32 query rows");
static_assert(BN % 16 == 0, "FC_BLOCK_N must be a multiple of 16");
static_assert(DK <= FC_HEAD_DIM_PAD, "FC_HEAD_DIM_PAD covers the multiplied head dim");
static_assert((BM + 2 * BN) * ROW_BYTES == FC_SMEM_FWD, "shared memory (Q, K, V tiles) differs from FC_SMEM_FWD");

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(FC_NUM_THREADS) flash_fwd_mma(FC_FWD_PARAMS) {
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sQ = (u32)__cvta_generic_to_shared(smem);  // [BM][CPR]
    const u32 sK = sQ + BM * ROW_BYTES;                    // [BN][CPR]
    const u32 sV = sK + BN * ROW_BYTES;                    // [BN][CPR]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row g (and g+8), columns 2t, 2t+1

    const int h = blockIdx.y, hk = h / group;
    const FcSeq seq = FC_ENTRIES(blockIdx.z);  // this CTA's batch entry (flash_common.cuh)
    const int m0 = fc_query_tile() * BM;
    if (FC_VARLEN && m0 >= seq.nq) return;     // (packed sequences shorter than the longest: no rows here)
    // The key tiles this CTA visits and masks (the range hook, flash_common.cuh): [j0, j_end).
    const FcKeyTiles tiles = fc_key_tiles<BN>(m0, BM, seq.nq, seq.nk);
    const int j0 = tiles.first, j_end = tiles.end;
    FcScoreHook hook(scale_log2);
    FC_HOOK_SET_HEAD(hook, blockIdx.z, h, seq.nq, seq.nk);

    // This thread's load chunk lc and first load row lr (see load_tile); K and V pointers start at key
    // tile j0 and advance by one tile per iteration.
    const int lc = tid % CHP, lr = tid / CHP;
    const elem_t *q_ld = q + seq.b * q_sb + h * q_sh + (long long)(seq.q0 + m0 + lr) * q_sn + lc * 8;
    const elem_t *k_ld = k + seq.b * k_sb + hk * k_sh + (long long)(seq.k0 + j0 * BN + lr) * k_sn + lc * 8;
    const elem_t *v_ld = v + seq.b * v_sb + hk * v_sh + (long long)(seq.k0 + j0 * BN + lr) * v_sn + lc * 8;

    const int wrow = warp * RW;            // first CTA row of this warp
    const int row_g = m0 + wrow + g;       // query row of accumulator row g of m16 tile 0

    // ldmatrix.x4 addresses: lane l points at row l & 15, chunk 2kk + (l >> 4) of a 16 x 16 block
    // (matrices 0..3 = rows 0-7 | 8-15 x chunks 2kk | 2kk+1), the same for all three operands:
    //   Q (A operand):               r0..r3 = a0, a1, a2, a3
    //   K (B operand, keys x d):     r0, r2 = b0, b1 of n8 tile 2np; r1, r3 = those of 2np+1
    //   V (B operand .trans, keys x d): r0, r1 = b0, b1 of d8 tile 2dp; r2, r3 = those of 2dp+1
    // Fragment rows start at multiples of 16, so the swizzle key is that of row l & 7.
    const u32 frag_row = (lane & 15) * ROW_BYTES;
    const int frag_w = (lane >> 4) ^ swz_key(lane & 7);
    const u32 a_base = sQ + wrow * ROW_BYTES + frag_row;
    const u32 k_base = sK + frag_row;
    const u32 v_base = sV + frag_row;

    // Running state: m in raw-score units, l (per-thread partial with fp32 accumulators, the full
    // row sum with fp16 accumulators, where it must be rounded every tile), O.
    float m_run[MT][2], l_run[MT][2];
    acc_t acc_o[MT][ON][ACC_REGS];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) { m_run[mt][hf] = -INFINITY; l_run[mt][hf] = 0.f; }
#pragma unroll
        for (int on = 0; on < ON; ++on) acc_zero(acc_o[mt][on]);
    }
    u32 q_frag[Q_IN_REGS ? KS : 1][4];

    // ---- prologue: groups {Q, K_j0} and {V_j0} in flight; zero the 8-column tail of a head dim
    //      that is 8 mod 16 (the copies never write it, the math reads it) ----
    if (j0 < j_end) {
        if (FC_HEAD_DIM % 16 != 0) {
            for (int r = tid; r < BM + 2 * BN; r += NTHR)
                *reinterpret_cast<uint4 *>(smem + smem_off(r, CH)) = make_uint4(0u, 0u, 0u, 0u);
        }
        load_tile<BM>(sQ, q_ld, q_sn, seq.nq - m0 - lr, q, lr, lc);
        load_tile<BN>(sK, k_ld, k_sn, seq.nk - j0 * BN - lr, k, lr, lc);
        cp_async_commit();
        load_tile<BN>(sV, v_ld, v_sn, seq.nk - j0 * BN - lr, v, lr, lc);
        cp_async_commit();
    }

    for (int j = j0; j < j_end; ++j) {
        // ---- K_j (and Q) have landed; every warp is done with V_{j-1}: start V_j (V_j0 is
        //      already in flight from the prologue) ----
        if (j == j0) {
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j > j0) {
            v_ld += BN * v_sn;
            load_tile<BN>(sV, v_ld, v_sn, seq.nk - j * BN - lr, v, lr, lc);
            cp_async_commit();
        }

        if (Q_IN_REGS && j == j0) {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) ldsm_x4(q_frag[kk], a_base + chunk_off(2 * kk, frag_w));
        }

        // ---- S = Q K_j^T ----
        acc_t acc_s[MT][NT][ACC_REGS];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) acc_zero(acc_s[mt][nt]);
        warp_gemm_abt<KS, MT, NT / 2>(acc_s, [&](int kk, int mt, u32(&a)[4]) {
            if (Q_IN_REGS) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = q_frag[Q_IN_REGS ? kk : 0][i];
            } else {
                ldsm_x4(a, a_base + mt * 16 * ROW_BYTES + chunk_off(2 * kk, frag_w));
            }
        }, k_base, frag_w);
        // ---- the score hook (flash_common.cuh), then the mask: invisible keys (causal edge, keys >= nk)
        //      score -inf ----
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            fc_hook_scores<NT>(hook, row_g + mt * 16, j * BN + 2 * t,
                               [&](int nt) -> acc_t(&)[ACC_REGS] { return acc_s[mt][nt]; });
        if (tiles.masked(j)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fc_mask_scores<NT>(row_g + mt * 16, j * BN + 2 * t, seq.nq, seq.nk,
                                   [&](int nt) -> acc_t(&)[ACC_REGS] { return acc_s[mt][nt]; });
        }

        // ---- online softmax, one row (mt, hf) at a time. P goes straight into the A fragments
        //      of P V (element type): the k16 step kk of P V is S tiles 2kk (a0: row g, a1: row
        //      g+8) and 2kk+1 (a2, a3), so S dies as P is made and never leaves registers ----
        float alpha[MT][2];
        u32 p_frag[MT][BN / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float sub = fc_softmax_step(m_run[mt][hf], alpha[mt][hf], scale_log2, [&] {
                    float mx = -INFINITY;  // rowmax(S_j), quad-reduced (a row lives in 4 lanes)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        mx = fmaxf(mx, fmaxf(acc_get(acc_s[mt][nt], 2 * hf), acc_get(acc_s[mt][nt], 2 * hf + 1)));
                    return quad_max(mx);
                });
                // P = exp2(S c - sub) in fp32; l takes the rowsum of the fp32 P
                float rs = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const float p0 = fc_softmax_p(acc_get(acc_s[mt][nt], 2 * hf), scale_log2, sub);
                    const float p1 = fc_softmax_p(acc_get(acc_s[mt][nt], 2 * hf + 1), scale_log2, sub);
                    rs += p0;
                    rs += p1;
                    p_frag[mt][nt >> 1][hf + 2 * (nt & 1)] = pack_elem2(p0, p1);
                }
                // fp32: l is this lane's partial, reduced at the end; fp16: the full row sum,
                // rounded every tile
                l_run[mt][hf] = fc_softmax_l(l_run[mt][hf], alpha[mt][hf], FC_ACCUM_F16 ? quad_sum(rs) : rs);
            }
        }

        // ---- O *= alpha (skipped, warp-uniformly, when every alpha is exactly 1: a multiplication
        //      by 1 is exact, so the result is bitwise the same; compiled out by both breaks) ----
        if (FC_SOFTMAX_RESCALES) {
            bool rescale = false;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) rescale |= (alpha[mt][0] != 1.f) | (alpha[mt][1] != 1.f);
            if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int on = 0; on < ON; ++on) acc_scale(acc_o[mt][on], alpha[mt][0], alpha[mt][1]);
            }
        }

        // ---- V_j has landed; every warp is done with K_j: start K_{j+1} ----
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j_end) {
            k_ld += BN * k_sn;
            load_tile<BN>(sK, k_ld, k_sn, seq.nk - (j + 1) * BN - lr, k, lr, lc);
            cp_async_commit();
        }

        // ---- O += P V_j ----
        warp_gemm_ab<BN / 16, KS>(acc_o, p_frag, v_base, frag_w, [](int dp) { return dp; });
    }

    // ---- epilogue: o = O / l (0 where l == 0), staged through the warp's own Q rows (only this
    //      warp ever reads them, and no copy is in flight) for 16-byte coalesced stores ----
    const FcRows rows = fc_rows(seq, h, gridDim.y, nq);  // where this head's rows of o and lse go
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2], pre[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = l_run[mt][hf];
#if !FC_ACCUM_F16
            l = quad_sum(l);
#endif
            // o = (O * pre) * (1 / (l * pre)): one IEEE reciprocal per row. CuPy compiles with
            // -ftz=true, so 1/l must stay normal: for l > 2^126 (reached by the max-subtraction
            // break in bf16 before exp overflows at ln(max) ~ 88.7) both are scaled by 2^-64 first.
            pre[hf] = (l > 0x1p126f) ? 0x1p-64f : 1.f;
            inv[hf] = (l == 0.f) ? 0.f : __frcp_rn(l * pre[hf]);
            const int row = row_g + mt * 16 + 8 * hf;
            if (t == 0 && row < seq.nq) lse[rows.lse0 + row] = fc_hook_lse(hook, m_run[mt][hf], l, scale_log2, row);
        }
#pragma unroll
        for (int on = 0; on < ON; ++on) {
            const acc_t(&c)[ACC_REGS] = acc_o[mt][on];
            const int r = wrow + mt * 16 + g;
            *reinterpret_cast<u32 *>(smem + smem_off(r, on) + 4 * t) =
                pack_elem2(acc_get(c, 0) * pre[0] * inv[0], acc_get(c, 1) * pre[0] * inv[0]);
            *reinterpret_cast<u32 *>(smem + smem_off(r + 8, on) + 4 * t) =
                pack_elem2(acc_get(c, 2) * pre[1] * inv[1], acc_get(c, 3) * pre[1] * inv[1]);
        }
    }
    __syncwarp();
    elem_t *og = o + (rows.o0 + m0 * rows.o_step + wrow * rows.o_step) * FC_HEAD_DIM;
#pragma unroll
    for (int it = 0; it < (RW * CH + 31) / 32; ++it) {
        const int idx = lane + it * 32;
        const int r = idx / CH, c = idx - (idx / CH) * CH;
        if (((RW * CH) % 32 == 0 || idx < RW * CH) && m0 + wrow + r < seq.nq)
            *reinterpret_cast<uint4 *>(og + r * rows.o_step * FC_HEAD_DIM + c * 8) =
                *reinterpret_cast<const uint4 *>(smem + smem_off(wrow + r, c));
    }
}
