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
//
// Packed sequences with tiles (FC_VARLEN, bwd_wgmma.cu): a head's rows are its B sequences' rows, each
// padded to whole tiles, so that no tile (nor the backward kernel's TMA box over the fp32 dQ buffer,
// laid out the same way) holds rows of two sequences. Sequence b's first tile is
// fc_prep_tile0(cu_q[b], b) = floor(cu_q[b] / T) + b: a closed form that leaves the n_b tokens of
// sequence b ceil(n_b / T) whole tiles before sequence b + 1's first (floor(cu_q[b + 1] / T) -
// floor(cu_q[b] / T) + 1 >= ceil(n_b / T)); a head has fc_prep_tiles(total_q, B) = floor(total_q / T) + B.
#if FC_BWD_PREP_TILE && FC_VARLEN
__device__ __forceinline__ int fc_prep_tile0(int q0, int b) { return q0 / FC_BWD_PREP_TILE + b; }
__device__ __forceinline__ int fc_prep_tiles(int total_q, int entries) { return total_q / FC_BWD_PREP_TILE + entries; }
// the sequence that holds tile `tile` of a head (the last whose first tile is at or before it)
__device__ __forceinline__ int fc_prep_seq_of_tile(const int *__restrict__ cu_q, int entries, int tile) {
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (fc_prep_tile0(cu_q[mid], mid) <= tile) lo = mid; else hi = mid - 1;
    }
    return lo;
}
// the sequence that holds token t (the last whose first token is at or before it)
__device__ __forceinline__ int fc_prep_seq_of_token(const int *__restrict__ cu_q, int entries, int t) {
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_q[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}
#endif

extern "C" __global__ void flash_bwd_prep(const elem_t *__restrict__ dout, const elem_t *__restrict__ o,
                                          float *__restrict__ delta, float *__restrict__ dq_accum,
                                          const long long rows, const int heads, const int nq,
                                          const long long do_sb, const long long do_sh, const long long do_sn,
                                          const long long o_sb, const long long o_sh, const long long o_sn
#if FC_BWD_PREP_TILE
                                          , const float *__restrict__ lse
#endif
                                          , const float *__restrict__ dlse
#if FC_BWD_PREP_TILE && FC_VARLEN
                                          , const int *__restrict__ cu_q, const int entries
#endif
                                          ) {
    constexpr int G = 8;                                // threads per row (divides the warp size)
    constexpr int EPC = 16 / (int)sizeof(elem_t);      // elements per 16-byte chunk
    constexpr int CHUNKS = FC_HEAD_DIM / EPC;
    const long long rp = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / G;
    const int c0 = threadIdx.x % G;
#if FC_BWD_PREP_TILE
    // this thread's row ip of head bh = b * heads + h, padded to whole tiles, and its query i and index r
    // in (B, Hq, nq) (packed sequences: row ip of head bh of the one batch, the token i, and r in
    // (Hq, total_q); the fp32 dQ buffer's row is rp, padded as the tiles are)
    constexpr int T = FC_BWD_PREP_TILE;
#if FC_VARLEN
    const int row_len = fc_prep_tiles(nq, entries) * T;
    const long long bh = rp / row_len;
    const int ip = (int)(rp - bh * row_len);
    const int sq = fc_prep_seq_of_tile(cu_q, entries, ip / T);
    const int row_i = cu_q[sq] + ip - fc_prep_tile0(cu_q[sq], sq) * T;
    const long long r = bh * nq + row_i, dq_row = rp;
    const bool real = rp < rows && row_i < cu_q[sq + 1];
#else
    const int row_len = (nq + T - 1) / T * T;
    const long long bh = rp / row_len;
    const int ip = (int)(rp - bh * row_len), row_i = ip;
    const long long r = bh * nq + row_i, dq_row = r;
    const bool real = rp < rows && ip < nq;
#endif
#else
    const long long r = rp, dq_row = r;
    const bool real = r < rows;
#endif
    auto zero_dq_row = [&] {  // this thread's chunks of the fp32 dQ buffer's row
        for (int c = c0; c < FC_HEAD_DIM / 4; c += G)
            reinterpret_cast<float4 *>(dq_accum + dq_row * FC_HEAD_DIM)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    };
    float acc = 0.f;
    if (real) {
#if FC_BWD_PREP_TILE
        const int i = row_i, h = (int)(bh % heads);
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
        if (dq_accum != nullptr) zero_dq_row();
    }
#if FC_BWD_PREP_TILE && FC_VARLEN
    // (packed sequences: the padding rows too, which take the reduce-adds of a tile's rows past its
    // sequence's end and are never read, so that every row of the buffer is defined)
    if (!real && rp < rows && dq_accum != nullptr) zero_dq_row();
#endif
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
// sequences (FC_VARLEN): dq is flash_attn's (total_q, Hq, FC_HEAD_DIM), and dq_accum holds its rows in
// lse's order, (Hq, total_q), where element (h, t, d) goes to ((t heads + h) FC_HEAD_DIM + d), or, with
// tiles (FC_BWD_PREP_TILE), padded by sequence as the tiles are (above): then each thread gathers its
// four elements of dq from the padded row of its token.
extern "C" __global__ void flash_bwd_dq_convert(const float *__restrict__ dq_accum, elem_t *__restrict__ dq,
                                               const long long n4, const float scale_log2
#if FC_VARLEN
                                               , const int heads, const int total
#if FC_BWD_PREP_TILE
                                               , const int *__restrict__ cu_q, const int entries
#endif
#endif
                                               ) {
    const float mul = scale_log2 * FC_LN2;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        // the four elements' place in dq_accum (from) and in dq (to)
#if FC_VARLEN
        constexpr int Q4 = FC_HEAD_DIM / 4;  // (D % 8 == 0: the 4 elements stay in one row)
#if FC_BWD_PREP_TILE
        const long long row = i / Q4;  // (token t, head h) of dq
        const int t = (int)(row / heads), h = (int)(row - (long long)t * heads);
        const int sq = fc_prep_seq_of_token(cu_q, entries, t);
        const long long src = ((long long)h * fc_prep_tiles(total, entries) + fc_prep_tile0(cu_q[sq], sq)) *
                                  FC_BWD_PREP_TILE + (t - cu_q[sq]);
        const long long from = src * Q4 + (i - row * Q4), to = i;
#else
        const long long row = i / Q4;  // (head h, token t) of dq_accum
        const long long h = row / total, t = row - h * total;
        const long long from = i, to = (t * heads + h) * Q4 + (i - row * Q4);
#endif
#else
        const long long from = i, to = i;
#endif
        const float4 x = reinterpret_cast<const float4 *>(dq_accum)[from];
        uint2 out;
        out.x = pack_elem2(x.x * mul, x.y * mul);
        out.y = pack_elem2(x.z * mul, x.w * mul);
        reinterpret_cast<uint2 *>(dq)[to] = out;
    }
}
#endif
