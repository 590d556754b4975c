// simt_common.cuh: shared by the scalar kernels fwd_simt.cu and bwd_simt.cu: tile staging and the
// dot-product loop with the tensor cores' rounding granularity. Include after flash_common.cuh.
#pragma once

constexpr int SIMT_DP = (FC_HEAD_DIM + 15) / 16 * 16;  // head dim padded to whole 16-chunks (smem only)
constexpr int SIMT_CHUNK = 16;  // products per fp32 partial sum (the mma.m16n8k16 k-extent)
constexpr int SIMT_TN = 16;     // lanes of a row group (half a warp)

// Stage a ROWS x D tile (global, row stride `stride` elements, last axis contiguous) into shared
// memory as fp32 with row pitch PITCH, the head dim padded to DP = 16 * ceil(D / 16). Rows >= n_valid
// and columns >= D are written as zeros and never read from global memory. Consecutive threads move
// consecutive 16-byte vectors; views that are not 16-byte aligned fall back to scalar loads.
template <int ROWS, int PITCH>
__device__ __forceinline__ void stage_tile(float* __restrict__ dst, const elem_t* __restrict__ src,
                                           long long stride, int n_valid) {
    constexpr int D = FC_HEAD_DIM;
    constexpr int DP = SIMT_DP;  // rows padded to whole 16-chunks with zeros
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

// acc[t][g] = sum_d A[t][d] * B[g][d] over the padded head dim for R rows of A (pitch A_PITCH) and
// G rows of B (SIMT_TN rows apart at pitch B_PITCH: this lane's keys), in accumulator precision:
// the products are summed in fp32 over SIMT_CHUNK head-dim columns, and each partial sum enters the
// accumulator with one rounding (fc_round_acc, the identity for fp32 accumulators).
template <int R, int G, int A_PITCH, int B_PITCH>
__device__ __forceinline__ void simt_dot_rows(const float* __restrict__ a_rows, const float* __restrict__ b_rows,
                                              float (&acc)[R][G]) {
#pragma unroll
    for (int t = 0; t < R; ++t)
#pragma unroll
        for (int g = 0; g < G; ++g) acc[t][g] = 0.f;
#pragma unroll 1
    for (int d0 = 0; d0 < SIMT_DP; d0 += SIMT_CHUNK) {
        float part[R][G] = {};
#pragma unroll
        for (int d = d0; d < d0 + SIMT_CHUNK; d += 4) {
            float4 bv[G];
#pragma unroll
            for (int g = 0; g < G; ++g) bv[g] = *reinterpret_cast<const float4*>(b_rows + g * SIMT_TN * B_PITCH + d);
#pragma unroll
            for (int t = 0; t < R; ++t) {
                const float4 av = *reinterpret_cast<const float4*>(a_rows + t * A_PITCH + d);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    part[t][g] += av.x * bv[g].x;
                    part[t][g] += av.y * bv[g].y;
                    part[t][g] += av.z * bv[g].z;
                    part[t][g] += av.w * bv[g].w;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < R; ++t)
#pragma unroll
            for (int g = 0; g < G; ++g) acc[t][g] = fc_round_acc(acc[t][g] + part[t][g]);
    }
}

// acc[t][i] = round(acc[t][i] + sum_k A(t, k) * B[k][c + SIMT_TN * i]) for R accumulator rows and
// this lane's NCOL columns (b_cols = B + c, row pitch B_PITCH), over k < n_k (a multiple of
// SIMT_CHUNK): products summed in fp32 over SIMT_CHUNK consecutive k, each partial sum added to the
// accumulator with one rounding (P V, P^T dO, dS^T Q, dS K). A(t, k) is a[t * A_PITCH + k] when
// A_ROWS (rows of P: float4 loads along k), else a[k * A_PITCH + t] (a transposed operand: float4
// loads along t when R % 4 == 0). GO columns per register block.
template <int R, int NCOL, int GO, bool A_ROWS, int A_PITCH, int B_PITCH>
__device__ __forceinline__ void simt_accumulate(const float* __restrict__ a, const float* __restrict__ b_cols,
                                                int n_k, float (&acc)[R][NCOL]) {
#pragma unroll
    for (int i0 = 0; i0 < NCOL; i0 += GO) {
        // Reload A for every column block rather than keep a chunk of it live next to acc.
        asm volatile("" ::: "memory");
#pragma unroll 1
        for (int k0 = 0; k0 < n_k; k0 += SIMT_CHUNK) {
            float part[R][GO] = {};
#pragma unroll
            for (int kq = k0; kq < k0 + SIMT_CHUNK; kq += 4) {
                float4 a4[A_ROWS ? R : 1];
                if constexpr (A_ROWS) {
#pragma unroll
                    for (int t = 0; t < R; ++t) a4[t] = *reinterpret_cast<const float4*>(a + t * A_PITCH + kq);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int kk = kq + j;
                    float av[R];
                    if constexpr (A_ROWS) {
#pragma unroll
                        for (int t = 0; t < R; ++t)
                            av[t] = j == 0 ? a4[t].x : j == 1 ? a4[t].y : j == 2 ? a4[t].z : a4[t].w;
                    } else if constexpr (R % 4 == 0) {
#pragma unroll
                        for (int t = 0; t < R; t += 4) {
                            const float4 x = *reinterpret_cast<const float4*>(a + kk * A_PITCH + t);
                            av[t] = x.x;
                            av[t + 1] = x.y;
                            av[t + 2] = x.z;
                            av[t + 3] = x.w;
                        }
                    } else {
#pragma unroll
                        for (int t = 0; t < R; ++t) av[t] = a[kk * A_PITCH + t];
                    }
                    float bv[GO];
#pragma unroll
                    for (int g = 0; g < GO; ++g) bv[g] = i0 + g < NCOL ? b_cols[kk * B_PITCH + (i0 + g) * SIMT_TN] : 0.f;
#pragma unroll
                    for (int t = 0; t < R; ++t)
#pragma unroll
                        for (int g = 0; g < GO; ++g) part[t][g] += av[t] * bv[g];
                }
            }
#pragma unroll
            for (int t = 0; t < R; ++t)
#pragma unroll
                for (int g = 0; g < GO; ++g)
                    if (i0 + g < NCOL) acc[t][i0 + g] = fc_round_acc(acc[t][i0 + g] + part[t][g]);
        }
    }
}
