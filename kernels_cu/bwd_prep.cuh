// bwd_prep.cuh: the backward's preprocessing kernel, shared by bwd_mma.cu, bwd_simt.cu and bwd_wgmma.cu.
//
//   flash_bwd_prep  delta_r = sum_d dO[r, d] * O[r, d] - dlse_r  (fp32 products and sums; dlse, the LSE's
//                   gradient, only where not null) for every query row
//                   r = (b, h, i) of the rows = B * Hq * nq rows (FC_BWD_PREP_TILE: rows padded to whole
//                   tiles, and L_r beside delta_r, below), and, when dq_accum is not null, the zeroing of
//                   dq_accum row r (the fp32 buffer the atomic-dQ path adds into).
//   flash_bwd_dq_convert  dq = scale * dq_accum, rounded to the element type (16-bit types): the last
//                   step of the atomic-dQ paths (bwd_mma.cu, bwd_wgmma.cu).
// One pass over dO and O (16-byte loads; rows need 16-byte aligned starts) instead of fp32 copies,
// a product array and a reduction. G = 8 threads share a row (chunks c0, c0 + 8, ...), and their
// partial sums meet by shuffles within the warp. Grid: ceil(8 * rows / blockDim.x) blocks.
#pragma once

//
// FC_BWD_PREP_TILE = T > 0 (bwd_wgmma.cu: its query tile): the rows are the B * Hq heads' query rows
// padded to whole tiles of T (rows = B * Hq * ceil(nq / T) * T), and `delta` is a tiled buffer that the
// backward kernel's producer copies a tile at a time into its stage with one bulk TMA copy: per head and
// query tile, T values of L = lse * log2 e (+inf where lse = -inf and on padding rows: P = 0), then T of
// delta (minus dlse where given; 0 on padding rows). lse and dlse are read there only.
#ifndef FC_BWD_PREP_TILE
#define FC_BWD_PREP_TILE 0
#endif

extern "C" __global__ void flash_bwd_prep(const elem_t *__restrict__ dout, const elem_t *__restrict__ o,
                                          float *__restrict__ delta, float *__restrict__ dq_accum,
                                          const long long rows, const int heads, const int nq,
                                          const long long do_sb, const long long do_sh, const long long do_sn,
                                          const long long o_sb, const long long o_sh, const long long o_sn
#if FC_BWD_PREP_TILE
                                          , const float *__restrict__ lse
#endif
                                          , const float *__restrict__ dlse) {
    constexpr int G = 8;                                // threads per row (divides the warp size)
    constexpr int EPC = 16 / (int)sizeof(elem_t);      // elements per 16-byte chunk
    constexpr int CHUNKS = FC_HEAD_DIM / EPC;
    const long long rp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / G;
    const int c0 = threadIdx.x % G;
#if FC_BWD_PREP_TILE
    // this thread's row i of head bh = b * heads + h, padded to whole tiles, and its index r in (B, Hq, nq)
    constexpr int T = FC_BWD_PREP_TILE;
    const int row_len = (nq + T - 1) / T * T;
    const long long bh = rp / row_len;
    const int ip = (int)(rp - bh * row_len);
    const long long r = bh * nq + ip;
    const bool real = rp < rows && ip < nq;
#else
    const long long r = rp;
    const bool real = r < rows;
#endif
    float acc = 0.f;
    if (real) {
#if FC_BWD_PREP_TILE
        const int i = ip, h = (int)(bh % heads);
        const long long b = bh / heads;
#else
        const int i = (int)(r % nq), h = (int)((r / nq) % heads);
        const long long b = r / nq / heads;
#endif
        const elem_t *dp = dout + b * do_sb + h * do_sh + i * do_sn;
        const elem_t *op = o + b * o_sb + h * o_sh + i * o_sn;
        for (int c = c0; c < CHUNKS; c += G) {
            const uint4 x = *reinterpret_cast<const uint4 *>(dp + c * EPC);
            const uint4 y = *reinterpret_cast<const uint4 *>(op + c * EPC);
            const elem_t *ex = reinterpret_cast<const elem_t *>(&x), *ey = reinterpret_cast<const elem_t *>(&y);
#pragma unroll
            for (int e = 0; e < EPC; ++e) acc = fmaf(fc_to_float(ex[e]), fc_to_float(ey[e]), acc);
        }
        if (dq_accum != nullptr) {
            for (int c = c0; c < FC_HEAD_DIM / 4; c += G)
                reinterpret_cast<float4 *>(dq_accum + r * FC_HEAD_DIM)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
#pragma unroll
    for (int s = G / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
#if FC_BWD_PREP_TILE
    if (rp < rows && c0 == 0) {
        float *tile = delta + (bh * (row_len / T) + ip / T) * 2 * T;  // this row's tile: T of L, T of delta
        tile[ip % T] = real ? fc_lse_log2(lse[r]) : INFINITY;
        tile[T + ip % T] = real ? (dlse != nullptr ? acc - dlse[r] : acc) : 0.f;
    }
#else
    if (real && c0 == 0) delta[r] = dlse != nullptr ? acc - dlse[r] : acc;
#endif
}

#if FC_DTYPE != 0
// dq = (scale_log2 ln 2) * dq_accum rounded to the element type; n4 = number of elements / 4. Packed
// sequences (FC_VARLEN): dq_accum holds its rows in lse's order, (Hq, total_q), and dq is flash_attn's
// (total_q, Hq, FC_HEAD_DIM): element (h, t, d) goes to ((t heads + h) FC_HEAD_DIM + d).
extern "C" __global__ void flash_bwd_dq_convert(const float *__restrict__ dq_accum, elem_t *__restrict__ dq,
                                               const long long n4, const float scale_log2
#if FC_VARLEN
                                               , const int heads, const int total
#endif
                                               ) {
    const float mul = scale_log2 * FC_LN2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const float4 x = reinterpret_cast<const float4 *>(dq_accum)[i];
        uint2 out;
        out.x = pack_elem2(x.x * mul, x.y * mul);
        out.y = pack_elem2(x.z * mul, x.w * mul);
#if FC_VARLEN
        constexpr int Q4 = FC_HEAD_DIM / 4;  // (D % 8 == 0: the 4 elements stay in one row)
        const long long row = i / Q4;
        const long long h = row / total, t = row - h * total;
        reinterpret_cast<uint2 *>(dq)[(t * heads + h) * Q4 + (i - row * Q4)] = out;
#else
        reinterpret_cast<uint2 *>(dq)[i] = out;
#endif
    }
}
#endif
