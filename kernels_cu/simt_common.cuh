// simt_common.cuh: shared by the scalar kernels fwd_simt.cu and bwd_simt.cu. Include after
// flash_common.cuh.
#pragma once

// Stage a ROWS x D tile (global, row stride `stride` elements, last axis contiguous) into shared
// memory as fp32 with row pitch PITCH, the head dim padded to DP = 16 * ceil(D / 16). Rows >= n_valid
// and columns >= D are written as zeros and never read from global memory. Consecutive threads move
// consecutive 16-byte vectors; views that are not 16-byte aligned fall back to scalar loads.
template <int ROWS, int PITCH>
__device__ __forceinline__ void stage_tile(float* __restrict__ dst, const elem_t* __restrict__ src,
                                           long long stride, int n_valid) {
    constexpr int D = FC_HEAD_DIM;
    constexpr int DP = (FC_HEAD_DIM + 15) / 16 * 16;  // rows padded to whole 16-chunks with zeros
    constexpr int VEC = 16 / sizeof(elem_t);  // 4 fp32 or 8 fp16/bf16; divides D (a multiple of 8)
    constexpr int VPR = DP / VEC;             // vectors per padded row
    const bool vec_ok = reinterpret_cast<unsigned long long>(src) % 16 == 0 && stride % VEC == 0;
    for (int idx = threadIdx.x; idx < ROWS * VPR; idx += FC_NUM_THREADS) {
        const int r = idx / VPR, d = idx % VPR * VEC;
        float x[VEC];
        if (r < n_valid && d < D) {
            const elem_t* p = src + r * stride + d;
            alignas(16) elem_t e[VEC];
            if (vec_ok) {
                *reinterpret_cast<int4*>(e) = *reinterpret_cast<const int4*>(p);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) e[j] = p[j];
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) x[j] = fc_to_float(e[j]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) x[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < VEC; j += 4)
            *reinterpret_cast<float4*>(dst + r * PITCH + d + j) = make_float4(x[j], x[j + 1], x[j + 2], x[j + 3]);
    }
}
