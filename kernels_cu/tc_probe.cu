// tc_probe.cu: one k16 step of each tensor-core instruction the kernels use, on inputs the host
// chooses, so that analysis/tensorcore.py can measure how the hardware accumulates (alignment width,
// rounding of the result) instead of assuming it. Not an attention kernel: a measuring instrument.
//
// Case i computes d[i] = sum_{k < K} a[i][k] b[i][k] + c[i] as element (0, 0) of one instruction,
// with every other element of A, B and C zero:
//   tc_probe_mma:    mma.sync.m16n8k16 (mma_common.cuh's mma_16816), one warp per case (K = 16);
//   tc_probe_wgmma:  wgmma.mma_async m64n64k16 (K = 16), or m64n64k32 on e4m3 with FC_FP8 (K = 32),
//                    A and B from shared memory (the ss form of S = Q K^T, wgmma_common.cuh), one
//                    warpgroup per case. Needs sm_90a.
// a, b: the raw bit patterns of row 0 of A and column 0 of B, 32 bytes a case: 16 elements of the
// 16-bit type (FC_DTYPE 1 fp16, 2 bf16) or, with FC_FP8, 32 e4m3 bytes; c: float, which the host makes
// exactly representable in the accumulator type (FC_ACCUM_F16: fp16); d: the result as float.
// Compile with the knobs of a kernel variant (FC_DTYPE, FC_ACCUM_F16, FC_HEAD_DIM=64,
// FC_HEAD_DIM_PAD=64, FC_NUM_THREADS=128, both FC_ABLATE_* 0; FC_FP8 for e4m3, which builds the wgmma
// probe only) so that the shared headers apply unchanged.

#include "flash_common.cuh"
#include "mma_common.cuh"
#if !FC_TC_PROBE_NO_WGMMA  // set where the GPU is not sm_90a
#include "wgmma_common.cuh"
#endif

#if !FC_FP8
typedef unsigned short u16;

// Two consecutive 16-bit elements as one fragment register (the lower index in the low half).
__device__ __forceinline__ u32 pair16(const u16 *x) { return (u32)x[0] | ((u32)x[1] << 16); }

extern "C" __global__ void tc_probe_mma(const u16 *__restrict__ a, const u16 *__restrict__ b,
                                        const float *__restrict__ c, float *__restrict__ d, int n) {
    const int cs = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x & 31;
    if (cs >= n) return;
    const int g = lane >> 2, t = lane & 3;
    // A (row-major m16k16): a[0] = (row g, k 2t..2t+1), a[2] = (row g, k 2t+8..2t+9); rows g+8 zero.
    // B (column-major k16n8): b0 = (k 2t..2t+1, column g), b1 = (k 2t+8..2t+9, column g).
    u32 af[4] = {0u, 0u, 0u, 0u}, b0 = 0u, b1 = 0u;
    if (g == 0) {
        af[0] = pair16(a + 16 * cs + 2 * t);
        af[2] = pair16(a + 16 * cs + 2 * t + 8);
        b0 = pair16(b + 16 * cs + 2 * t);
        b1 = pair16(b + 16 * cs + 2 * t + 8);
    }
    acc_t acc[ACC_REGS];
    acc_zero(acc);
    if (lane == 0) acc_set_pair(acc, 0, c[cs], 0.f);
    mma_16816(acc, af, b0, b1);
    if (lane == 0) d[cs] = acc_get(acc, 0);
}
#endif

#if !FC_TC_PROBE_NO_WGMMA
extern "C" __global__ void __launch_bounds__(128, 1)
    tc_probe_wgmma(const u32 *__restrict__ a, const u32 *__restrict__ b, const float *__restrict__ c,
                   float *__restrict__ d, int n) {
    // A and B: one 128-byte-swizzled panel of 64 rows each (wgmma_common.cuh's layout); only the first
    // 32 bytes of row 0 (k 0..15, or k 0..31 of e4m3) are non-zero, and row 0's chunks are not permuted
    // (chunk c ^ 0).
    __shared__ __align__(1024) unsigned char smem[2 * 64 * 128 + 1024];
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    unsigned char *gen = smem + (base - (u32)__cvta_generic_to_shared(smem));
    const int cs = blockIdx.x, tid = threadIdx.x;
    if (cs >= n) return;
    for (int i = tid; i < 2 * 64 * 128 / 4; i += 128) reinterpret_cast<u32 *>(gen)[i] = 0u;
    __syncthreads();
    if (tid < 8) {  // a row 0, then b row 0, as 8 words each
        reinterpret_cast<u32 *>(gen)[tid] = a[8 * cs + tid];
        reinterpret_cast<u32 *>(gen + 64 * 128)[tid] = b[8 * cs + tid];
    }
    fence_proxy_async();  // ordinary stores, read next by wgmma (async proxy)
    __syncthreads();
    acc_t acc[WgMma<64>::REGS];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc_zero(wg_tile(acc, i));
    if (tid == 0) acc_set_pair(wg_tile(acc, 0), 0, c[cs], 0.f);
    wg_fence();
    WgMma<64>::ss(acc, wg_desc_sw128(base, 16, 1024), wg_desc_sw128(base + 64 * 128, 16, 1024), 1);
    wg_commit();
    wg_wait<0>();
    reg_fence(acc);
    if (tid == 0) d[cs] = acc_get(wg_tile(acc, 0), 0);
}
#endif
