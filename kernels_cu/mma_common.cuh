// mma_common.cuh: the tensor-core building blocks shared by fwd_mma.cu and bwd_mma.cu: cp.async,
// ldmatrix and mma.sync m16n8k16 wrappers, the accumulator-fragment helpers, the swizzled
// shared-memory tile layout, global -> shared tile copies and the warp-level GEMM loops. Include
// after flash_common.cuh (it uses elem_t and the FC_* knobs).
#pragma once

#if FC_DTYPE != 1 && FC_DTYPE != 2
#error "the mma family needs FC_DTYPE 1 (float16) or 2 (bfloat16)"
#endif
#if FC_ACCUM_F16 && FC_DTYPE != 1
#error "the mma family: FC_ACCUM_F16 requires FC_DTYPE 1 (float16)"
#endif

constexpr int NTHR = FC_NUM_THREADS;
constexpr int NWARPS = NTHR / 32;
constexpr int CPR = FC_HEAD_DIM_PAD / 8;  // 16-byte chunks per shared-memory row
constexpr int CH = FC_HEAD_DIM / 8;       // chunks per row that hold data
constexpr int ROW_BYTES = CPR * 16;
static_assert(NTHR % 32 == 0, "FC_NUM_THREADS must be a multiple of 32");
static_assert(CPR % 4 == 0, "FC_HEAD_DIM_PAD must be a multiple of 32");

// ----------------------------------------- PTX wrappers --------------------------------------
__device__ __forceinline__ void cp_async_16(u32 dst, const void *src, bool pred) {
    // src-size 0 zero-fills the 16 bytes without reading global memory.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>  // wait until at most N of this thread's committed groups are pending
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }
// 4-byte copy (lse, delta rows), zero-filled when pred is false.
__device__ __forceinline__ void cp_async_4(u32 dst, const void *src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// D = A B + D for one m16n8k16 tile (A row-major, B column-major), accumulators of acc_t.
__device__ __forceinline__ void mma_16816(acc_t (&d)[ACC_REGS], const u32 (&a)[4], u32 b0, u32 b1) {
#if FC_ACCUM_F16
    asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, "
                 "{%0, %1};\n"
                 : "+r"(d[0]), "+r"(d[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif FC_DTYPE == 1
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tiles are row-major [rows][CPR chunks of 16 bytes]; chunk c of row r is stored at
// position c ^ key(r) within its row. 8 consecutive rows (starting at a multiple of 8) hit 8
// distinct 128-byte bank groups: with CPR % 8 == 0 through key = r & 7; with CPR % 8 == 4 the
// row pitch alternates by half a bank cycle, and key = (r >> 1) & 3 covers the other half. So
// ldmatrix (8 rows x 16 bytes per 8x8 matrix) and 4-byte epilogue writes are conflict-free.
// ---------------------------------------------------------------------------------------------
constexpr int SWZ_GROUP = (CPR % 8 == 0) ? 8 : 4;
__device__ __forceinline__ int swz_key(int row) { return (CPR % 8 == 0) ? (row & 7) : ((row >> 1) & 3); }
__device__ __forceinline__ u32 smem_off(int row, int chunk) {
    return (u32)((row * CPR + (chunk ^ swz_key(row))) * 16);
}
// Byte offset inside a row of chunk c for a compile-time chunk index c and a lane (or warp)
// dependent w < SWZ_GROUP that holds the XOR with the row key: the XOR only touches the low bits
// of c, so the lane-dependent part takes few values and the rest folds into the ldmatrix
// immediate offset (bits of c below SWZ_GROUP must be disjoint from those w stands for).
__device__ __forceinline__ u32 chunk_off(int c, int w) {
    return (u32)((c & ~(SWZ_GROUP - 1)) * 16 + (((c & (SWZ_GROUP - 1)) ^ w) << 4));
}

// Global -> shared tile copies. Thread tid always copies chunk lc = tid % CHP of rows
// lr = tid / CHP + i * LD_RSTEP (chunk slots rounded up to a power of two, so that the per-thread
// offsets are loop invariant and cheap; slots lc >= CH idle). Rows >= nvalid are zero-filled
// (src-size 0, the source then is just some valid address `fallback`); chunks past FC_HEAD_DIM are
// never written by the copies.
constexpr int CHP = CH <= 1 ? 1 : CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
constexpr int LD_RSTEP = NTHR / CHP;  // rows covered by one pass of the CTA

template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst_tile, const elem_t *src, long long stride, int nvalid,
                                          const elem_t *fallback, int lr, int lc) {
    // src: this thread's chunk in its first row lr; nvalid: valid rows counted from lr.
    // Unrolled only partially: fully unrolled, the per-pass offsets are loop invariant for the
    // compiler and get hoisted out of the KV loop into registers the main loop needs.
#pragma unroll 4
    for (int i = 0; i < (ROWS + LD_RSTEP - 1) / LD_RSTEP; ++i) {
        const bool in_tile = (ROWS % LD_RSTEP == 0 || lr + i * LD_RSTEP < ROWS) && (CHP == CH || lc < CH);
        if (in_tile) {
            const bool ok = i * LD_RSTEP < nvalid;
            cp_async_16(dst_tile + smem_off(lr + i * LD_RSTEP, lc), ok ? src + i * LD_RSTEP * stride : fallback, ok);
        }
    }
}

// Rows [row0, row0 + ROWS) of head (b, h) of x (strides in elements; rows >= n zero-filled) into
// the tile at dst.
template <int ROWS>
__device__ __forceinline__ void load_head_rows(u32 dst, const elem_t *x, int b, long long sb, int h, long long sh,
                                               long long sn, int row0, int n, int lr, int lc) {
    load_tile<ROWS>(dst, x + b * sb + h * sh + (long long)(row0 + lr) * sn + lc * 8, sn, n - row0 - lr, x, lr, lc);
}

// The steps of a cp.async pipeline over n tiles in STAGES (1 or 2) buffers of stage_bytes from st0;
// load(i, buf) issues the copies of tile i into buf. Before the loop: tile 0, committed as one group
// with the copies the caller issued before it.
template <typename Load>
__device__ __forceinline__ void pipeline_begin(int n, u32 st0, Load load) {
    if (n > 0) {
        load(0, st0);
        cp_async_commit();
    }
}
// Top of iteration it: wait for tile it and
// sync (every warp is then done with the other buffer), then with two buffers start tile it + 1 in
// it. Returns the buffer of tile it.
template <int STAGES, typename Load>
__device__ __forceinline__ u32 pipeline_top(int it, int n, u32 st0, u32 stage_bytes, Load load) {
    cp_async_wait_all();
    __syncthreads();
    if (STAGES == 2 && it + 1 < n) {
        load(it + 1, st0 + ((it + 1) & 1) * stage_bytes);
        cp_async_commit();
    }
    return st0 + (STAGES == 2 ? (it & 1) * stage_bytes : 0);
}
// Bottom of iteration it: with a single buffer, start tile it + 1 once every warp is done with it.
template <int STAGES, typename Load>
__device__ __forceinline__ void pipeline_bottom(int it, int n, u32 st0, Load load) {
    if (STAGES == 1 && it + 1 < n) {
        __syncthreads();
        load(it + 1, st0);
        cp_async_commit();
    }
}

// ---------------------------------------------------------------------------------------------
// Warp-level GEMM loops. Operand tiles are swizzled row-major tiles as above; `*_row` is this
// lane's ldmatrix row address (row lane & 15 of a 16-row block) and `w` = (lane >> 4) ^ key, so
// that lane l points at chunk 2p + (l >> 4): matrices 0..3 of an x4 load are rows 0-7 | 8-15 x
// chunks 2p | 2p+1.
// ---------------------------------------------------------------------------------------------

// acc[mt][n8 tile] += A_mt B^T over KS k16 steps, where B is 16 * NP rows at b_row, read with
// ldmatrix (rows = the n dimension, the reduction along the row: Q K^T, dO V^T, K Q^T, V dO^T).
// a_frag(kk, mt, a) supplies the A fragment of m16 tile mt at k16 step kk (ldmatrix or registers).
// B fragment r0, r2 = b0, b1 of n8 tile 2np; r1, r3 = those of 2np + 1.
template <int KS, int MT, int NP, typename AFrag>
__device__ __forceinline__ void warp_gemm_abt(acc_t (&acc)[MT][2 * NP][ACC_REGS], AFrag a_frag, u32 b_row, int w) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) a_frag(kk, mt, a[mt]);
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            u32 b[4];
            ldsm_x4(b, b_row + np * 16 * ROW_BYTES + chunk_off(2 * kk, w));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(acc[mt][2 * np], a[mt], b[0], b[2]);
                mma_16816(acc[mt][2 * np + 1], a[mt], b[1], b[3]);
            }
        }
    }
}

// acc[mt][2 dp + x] += A_mt B over KK k16 steps, with A in registers (a[mt][kk]: P, dS, dS^T) and
// B row-major at b_row (rows = the reduction dimension) read with ldmatrix.trans, DP d16 column
// pairs at chunk pairs chunk_pair(dp): r0, r1 = b0, b1 of n8 tile 2dp; r2, r3 = those of 2dp+1.
// Column pairs outermost: each accumulator still sums its k16 steps in order (the same bits as
// any other nesting), and ptxas keeps fewer address registers live (measured: 225 -> 224
// registers at D = 256, where k16-outer gave 236).
template <int KK, int DP, int MT, typename ChunkPair>
__device__ __forceinline__ void warp_gemm_ab(acc_t (&acc)[MT][2 * DP][ACC_REGS], const u32 (&a)[MT][KK][4],
                                             u32 b_row, int w, ChunkPair chunk_pair) {
#pragma unroll
    for (int dp = 0; dp < DP; ++dp) {
#pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
            u32 b[4];
            ldsm_x4_trans(b, b_row + kk * 16 * ROW_BYTES + chunk_off(2 * chunk_pair(dp), w));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816(acc[mt][2 * dp], a[mt][kk], b[0], b[1]);
                mma_16816(acc[mt][2 * dp + 1], a[mt][kk], b[2], b[3]);
            }
        }
    }
}
