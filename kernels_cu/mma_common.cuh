// mma_common.cuh: the tensor-core building blocks shared by fwd_mma.cu and bwd_mma.cu: cp.async,
// ldmatrix and mma.sync m16n8k16 wrappers and the accumulator-fragment helpers. Include after
// flash_common.cuh (it uses elem_t, FC_DTYPE and FC_ACCUM_F16).
#pragma once

typedef unsigned int u32;

#if FC_ACCUM_F16
constexpr int ACC_REGS = 2;  // two half2: row g, row g+8 of an m16n8 tile
typedef u32 acc_t;
#else
constexpr int ACC_REGS = 4;  // c0 c1 (row g), c2 c3 (row g+8); columns 2t, 2t+1
typedef float acc_t;
#endif

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

// *addr += (a, b) as one 8-byte reduction in global memory (sm_90; addr 8-byte aligned).
__device__ __forceinline__ void red_add_f32x2(float *addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
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

// ------------------------------------ accumulator helpers ------------------------------------
__device__ __forceinline__ void acc_zero(acc_t (&c)[ACC_REGS]) {
#pragma unroll
    for (int i = 0; i < ACC_REGS; ++i) c[i] = 0;
}
// Element i of an m16n8 accumulator in the f32 C layout (i = 0, 1: row g; 2, 3: row g+8), as float.
__device__ __forceinline__ float acc_get(const acc_t (&c)[ACC_REGS], int i) {
#if FC_ACCUM_F16
    const __half2 h = *reinterpret_cast<const __half2 *>(&c[i >> 1]);
    return (i & 1) ? __high2float(h) : __low2float(h);
#else
    return c[i];
#endif
}
// Two floats rounded to the element type and packed (lo in the low half: lower column index).
__device__ __forceinline__ u32 pack_elem2(float lo, float hi) {
#if FC_DTYPE == 1
    __half2 v = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<u32 *>(&v);
}
