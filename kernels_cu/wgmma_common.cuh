// wgmma_common.cuh: Hopper (sm_90a) building blocks for the wgmma family: warpgroup MMA
// (wgmma.mma_async) wrappers and their fences, shared-memory matrix descriptors (128-byte
// swizzle), mbarriers, TMA tensor loads (and reduce-adds) through a CUtensorMap kernel parameter, named barriers,
// the async-proxy fence and setmaxnreg. Include after flash_common.cuh (it uses FC_DTYPE).
// Needs -arch=sm_90a (wgmma and setmaxnreg do not exist on plain sm_90).
//
// Conventions used by every wrapper here:
//   * Shared-memory addresses are 32-bit .shared::cta addresses (__cvta_generic_to_shared).
//   * A tile stored with 128-byte swizzle is a stack of "panels": rows of exactly 128 bytes
//     (64 fp16/bf16 elements), row r of a panel at byte 128 r, the 16-byte chunk c of row r stored
//     at chunk c ^ (r % 8) (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B). Panels start on
//     1024-byte boundaries (the swizzle pattern repeats every 8 rows = 1024 bytes and is taken
//     from the absolute address bits).
//   * Accumulator fragment of m64nN, per warp w of the warpgroup (rows 16w .. 16w+15), lane l
//     (g = l / 4, t = l % 4): N / 8 tiles, tile i holding row g and row g + 8 at columns 8i + 2t,
//     8i + 2t + 1 in the accumulator-tile layout of flash_common.cuh (fp32: d[4i + 0, 1] = row g,
//     d[4i + 2, 3] = row g + 8; fp16: d[2i] = row g, d[2i + 1] = row g + 8 as half2).
//   * A fragment from registers (m64k16, 16-bit elements), per warp: a[0] = (row g, k 2t, 2t+1),
//     a[1] = (row g+8, k 2t, 2t+1), a[2] = (row g, k 2t+8, 2t+9), a[3] = (row g+8, k 2t+8, 2t+9):
//     the k16 step kk of P V takes accumulator tiles 2kk (a[0], a[1]) and 2kk+1 (a[2], a[3]).
//     8-bit elements (m64k32, four bytes a register, byte e of a word at k + e): a[0] = (row g, k 4t ..
//     4t+3), a[1] = (row g+8, k 4t .. 4t+3), a[2] = (row g, k 16+4t .. 16+4t+3), a[3] = (row g+8, the
//     same). A thread's accumulator columns of a 32-column block are 2t, 2t+1, 8+2t, 9+2t (and the same
//     +16): the fp8 forward packs them in that order into a[0] (a[2]), so the fragment's k position
//     4t+e holds column 2t + (e & 1) + 8 (e >> 1), and V's rows are stored in the same order
//     (fwd_wgmma.cu, fc_fp8_key_of).
#pragma once

// FC_FP8 = 1: the MMA operands are e4m3 (one byte; k32 a step, so a 128-byte panel row holds 128
// elements and a k step still spans 32 bytes of it); FC_DTYPE stays the type of the 16-bit tensors
// around them. Otherwise the operands are FC_DTYPE's (k16 a step).
#ifndef FC_FP8
#define FC_FP8 0
#endif
#if FC_DTYPE != 1 && FC_DTYPE != 2
#error "the wgmma family needs FC_DTYPE 1 (float16) or 2 (bfloat16)"
#endif
#if FC_FP8
#define WG_AB "e4m3"
#define WG_K "k32"
#elif FC_DTYPE == 1
#define WG_AB "f16"
#define WG_K "k16"
#else
#define WG_AB "bf16"
#define WG_K "k16"
#endif

typedef unsigned long long u64;

// The 128-byte CUtensorMap, passed by value as a `const __grid_constant__` kernel parameter (the
// TMA unit reads it from the parameter space; its generic address is what cp.async.bulk.tensor
// takes). Built on the host by flashcupy/_tma.py.
struct __align__(64) FcTensorMap {
    u64 raw[16];
};

// ------------------------------------------------------------------------------- wgmma ------
// Order for every group: wg_fence() -> WgMma<N>::... (one or more) -> wg_commit() -> wg_wait<k>().
// wg_fence orders this warpgroup's earlier register writes (accumulators, A fragments) before the
// async MMA reads them. After wg_wait, reg_fence() on the accumulators (and the A fragments) keeps
// the compiler from moving their reads before the wait or reusing the registers early.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // wait until at most N committed groups of this warpgroup are pending
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void reg_fence(float (&r)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int R>
__device__ __forceinline__ void reg_fence(u32 (&r)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// x, opaque to the compiler: descriptors built from it inside a loop are rebuilt there (a few integer
// operations) instead of being hoisted out and held in registers across the loop, which can spill when
// the consumer's accumulators fill the register file.
__device__ __forceinline__ u32 opaque_u32(u32 x) {
    asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
    return x;
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset (LBO),
// stride byte offset (SBO), all >> 4, and swizzle mode 1 in bits 62-63 (base offset 0: panels are
// 1024-byte aligned).
//   K-major operand (rows of 128-byte panels, K contiguous): SBO = 1024 (the next 8 rows), LBO is
//       not used; the k16 step s inside a panel starts 32 s bytes further (the hardware applies the
//       swizzle to the full address).
//   MN-major operand (read with the transpose bit; rows = K, 64 MN-elements per panel row):
//       SBO = 1024 (the next 8 K rows), LBO = the byte distance between panels (the next 64 MN
//       elements); the k16 step s starts 16 * 128 s bytes further.
__device__ __forceinline__ u64 wg_desc_sw128(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3FFFu) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Fixed-shape wrappers m64nNk16, A and B of the element type (FC_DTYPE), accumulators of acc_t
// (flash_common.cuh): fp32 (N / 2 registers a thread) or, with FC_ACCUM_F16 (fp16 or e4m3 inputs:
// wgmma has no bf16 form with fp16 accumulators), packed half2 (N / 4 registers). Either way the
// register array is N / 8 accumulator tiles of ACC_REGS (wg_tile below). With FC_FP8 the shapes are
// m64nNk32 on e4m3 operands and only ss and rs exist: 8-bit operands must both be K-major (the
// instruction has no transpose immediates for them; ss_t and rs_tb would not assemble).
//   ss(d, da, db, scale_d):    d = A B + (scale_d ? d : 0); A and B from shared memory, both
//                              K-major (S = Q K^T: A = Q rows, B = K rows).
//   rs(d, a, db, scale_d):     A from registers, B from shared memory K-major: the fp8 forward's
//                              O += P V with V stored transposed (d x keys, keys contiguous).
//   rs_tb(d, a, db, scale_d):  A from registers and B MN-major (transpose bit): O += P V
//                              with V stored keys x d, d contiguous (16-bit operands only).
//   ss_t<TA, TB>(d, da, db, scale_d): A and B from shared memory, A MN-major where TA = 1 and B
//                              where TB = 1 (the transpose bits): the backward's dQ = dS K with dS
//                              stored as dS^T (keys x queries, queries contiguous) and K stored keys x d
//                              (<1, 1>), and its dQ^T = K^T dS^T with dS stored by query rows (<1, 0>).
// scale_d = 0 ignores the old accumulator: the first k16 step of a product needs no zeroing.
// Each shape is written once, by WG_MMA_SHAPE below, from two operand lists shared by both forms:
//   WG_REGS<R>: the asm string "%0, %1, ..., %R-1" of the R accumulator registers (16 a chunk),
//   WG_ACC<R>(0): the matching operand list WG_C(d[0]), ..., WG_C(d[R - 1]).
// The operands after the accumulators are numbered from R on; the macro takes those numbers as
// tokens (R, R+1, .. R+5) because an asm string can only name operands by number.
#if FC_ACCUM_F16
#if FC_DTYPE != 1 && !FC_FP8
#error "the wgmma family: FC_ACCUM_F16 requires FC_DTYPE 1 (float16) or e4m3 operands (FC_FP8)"
#endif
#define WG_D "f16"
#define WG_C "+r"
#else
#define WG_D "f32"
#define WG_C "+f"
#endif
// the immediates after scale-d in ss: imm-scale-a, imm-scale-b (and imm-trans-a, imm-trans-b = 0 for
// 16-bit operands; 8-bit operands take none)
#if FC_FP8
#define WG_SS_IMM ", p, 1, 1;\n}\n"
#define WG_RS_IMM ", p, 1, 1;\n}\n"
#else
#define WG_SS_IMM ", p, 1, 1, 0, 0;\n}\n"
#define WG_RS_IMM ", p, 1, 1, 0;\n}\n"
#endif

template <int N>
struct WgMma;

#define WG_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_REGS16_1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS32 WG_REGS16 "," WG_REGS16_1
#define WG_REGS16_2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define WG_REGS16_3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS64 WG_REGS32 "," WG_REGS16_2 "," WG_REGS16_3
#define WG_REGS16_4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define WG_REGS16_5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_REGS16_6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define WG_REGS16_7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_REGS128 WG_REGS64 "," WG_REGS16_4 "," WG_REGS16_5 "," WG_REGS16_6 "," WG_REGS16_7
// the key tiles of 80 and 176 columns: 40 and 88 fp32 registers, 20 and 44 packed fp16 ones
#define WG_REGS20 WG_REGS16 ", %16, %17, %18, %19"
#define WG_REGS40 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define WG_REGS44 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43"
#define WG_REGS88 WG_REGS64 "," WG_REGS16_4 ", %80, %81, %82, %83, %84, %85, %86, %87"

#define WG_ACC4(i) WG_C(d[i]), WG_C(d[i + 1]), WG_C(d[i + 2]), WG_C(d[i + 3])
#define WG_ACC16(i) WG_ACC4(i), WG_ACC4(i + 4), WG_ACC4(i + 8), WG_ACC4(i + 12)
#define WG_ACC32(i) WG_ACC16(i), WG_ACC16(i + 16)
#define WG_ACC64(i) WG_ACC32(i), WG_ACC32(i + 32)
#define WG_ACC128(i) WG_ACC64(i), WG_ACC64(i + 64)
#define WG_ACC20(i) WG_ACC16(i), WG_ACC4(i + 16)
#define WG_ACC40(i) WG_ACC32(i), WG_ACC4(i + 32), WG_ACC4(i + 36)
#define WG_ACC44(i) WG_ACC40(i), WG_ACC4(i + 40)
#define WG_ACC88(i) WG_ACC64(i), WG_ACC16(i + 64), WG_ACC4(i + 80), WG_ACC4(i + 84)

// "{ .reg .pred p; p = (operand I != 0)": the scale-d predicate, then the instruction of shape m64nNk16
// (m64nNk32 with e4m3 operands).
#define WG_MMA_HEAD(N, I) "{\n.reg .pred p;\nsetp.ne.b32 p, %" #I ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N WG_K "." WG_D "." WG_AB "." WG_AB " "

// WgMma<N> with R accumulator registers a thread; R0 .. R5 are the tokens R, R + 1, .. R + 5.
//   ss:    operands {d}, da = %R0, db = %R1, scale_d = %R2; imm-scale-a/b 1, tnspA 0, tnspB 0
//   rs:    operands {d}, {a} = %R0 .. %R3, db = %R4, scale_d = %R5; imm-scale-a/b 1, tnspB 0
//   rs_tb: operands {d}, {a} = %R0 .. %R3, db = %R4, scale_d = %R5; imm-scale-a/b 1, tnspB 1
//   ss_t<TA, TB>: as ss with tnspA TA, tnspB TB (immediates %R3, %R4)
#define WG_MMA_SHAPE(N, R0, R1, R2, R3, R4, R5)                                                    \
    template <> struct WgMma<N> {                                                                  \
        static constexpr int REGS = R0;                                                            \
        static __device__ __forceinline__ void ss(acc_t (&d)[R0], u64 da, u64 db, int scale_d) {  \
            asm volatile(WG_MMA_HEAD(N, R2) "{" WG_REGS##R0 "}, %" #R0 ", %" #R1 WG_SS_IMM         \
                         : WG_ACC##R0(0)                                                           \
                         : "l"(da), "l"(db), "r"(scale_d));                                        \
        }                                                                                          \
        template <int TA, int TB>                                                                  \
        static __device__ __forceinline__ void ss_t(acc_t (&d)[R0], u64 da, u64 db, int scale_d) {  \
            asm volatile(WG_MMA_HEAD(N, R2) "{" WG_REGS##R0 "}, %" #R0 ", %" #R1                   \
                         ", p, 1, 1, %" #R3 ", %" #R4 ";\n}\n"                                     \
                         : WG_ACC##R0(0)                                                           \
                         : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));                      \
        }                                                                                          \
        static __device__ __forceinline__ void rs(acc_t (&d)[R0], const u32 (&a)[4], u64 db,      \
                                                  int scale_d) {                                   \
            asm volatile(WG_MMA_HEAD(N, R5) "{" WG_REGS##R0 "}, {%" #R0 ", %" #R1 ", %" #R2        \
                         ", %" #R3 "}, %" #R4 WG_RS_IMM                                            \
                         : WG_ACC##R0(0)                                                           \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));    \
        }                                                                                          \
        static __device__ __forceinline__ void rs_tb(acc_t (&d)[R0], const u32 (&a)[4], u64 db,   \
                                                     int scale_d) {                                \
            asm volatile(WG_MMA_HEAD(N, R5) "{" WG_REGS##R0 "}, {%" #R0 ", %" #R1 ", %" #R2        \
                         ", %" #R3 "}, %" #R4 ", p, 1, 1, 1;\n}\n"                                 \
                         : WG_ACC##R0(0)                                                           \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));    \
        }                                                                                          \
    };
#if FC_ACCUM_F16
WG_MMA_SHAPE(64, 16, 17, 18, 19, 20, 21)
WG_MMA_SHAPE(80, 20, 21, 22, 23, 24, 25)
WG_MMA_SHAPE(128, 32, 33, 34, 35, 36, 37)
WG_MMA_SHAPE(176, 44, 45, 46, 47, 48, 49)
WG_MMA_SHAPE(256, 64, 65, 66, 67, 68, 69)
#else
WG_MMA_SHAPE(32, 16, 17, 18, 19, 20, 21)  // the backward's dQ share at D=64 (fp32 accumulators only)
WG_MMA_SHAPE(64, 32, 33, 34, 35, 36, 37)
WG_MMA_SHAPE(80, 40, 41, 42, 43, 44, 45)     // the forward's key tiles at D=256 (80) and D=128 (176)
WG_MMA_SHAPE(128, 64, 65, 66, 67, 68, 69)
WG_MMA_SHAPE(176, 88, 89, 90, 91, 92, 93)
WG_MMA_SHAPE(256, 128, 129, 130, 131, 132, 133)
#endif

// Four floats rounded to e4m3 (to nearest even, saturating at +-448) and packed into one register, x0
// in the lowest byte: one 32-bit word of an 8-bit A fragment (cvt's first source goes to the upper byte).
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(lo) : "f"(x0), "f"(x1));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;\n" : "=h"(hi) : "f"(x2), "f"(x3));
    return (u32)lo | ((u32)hi << 16);
}

// Accumulator tile i (8 columns) of a wgmma register array, for the acc_* helpers of flash_common.cuh.
template <int R>
__device__ __forceinline__ acc_t (&wg_tile(acc_t (&d)[R], int i))[ACC_REGS] {
    return *reinterpret_cast<acc_t(*)[ACC_REGS]>(&d[i * ACC_REGS]);
}

// ------------------------------------------------------------------------------ mbarrier ----
// An mbarrier completes a phase when its pending arrivals reach 0 and its expected transaction
// bytes have all arrived (TMA's complete_tx). Waiters poll the parity of the phase they expect
// (0 for the first completion, then 1, 0, ...).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make the initialisations visible to the async proxy (TMA) and the other threads; a CTA barrier
// must follow before first use.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Raise the transaction bytes the current phase waits for, without arriving.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// --------------------------------------------------------------------------------- TMA ------
// Start loading the box at coordinates (c0 innermost .. c3) of the 4-D tensor map into shared
// memory at dst; the bytes are counted against mbarrier `bar`. Elements outside the tensor's
// extents arrive as zeros (and still count as transaction bytes).
__device__ __forceinline__ void tma_load_4d(u32 dst, const FcTensorMap *map, u32 bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
// Shared -> global by the TMA unit: the box at src (shared memory, laid out as the map's box and swizzle)
// goes to the tensor at coordinates (c0 .. c3), tracked by the issuing thread's bulk groups (tma_commit /
// tma_wait_*); one request per 128-byte line.
//   tma_reduce_add_4d  adds the fp32 box into the tensor element by element (instead of a reduction per 8
//                      or 16 bytes from the threads); elements outside the tensor's extents are skipped.
//   tma_store_4d       writes the box; elements outside the tensor's extents are not written.
#define FC_TMA_OUT_4D(NAME, INSTRUCTION)                                                                    \
    __device__ __forceinline__ void NAME(const FcTensorMap *map, u32 src, int c0, int c1, int c2, int c3) { \
        asm volatile(INSTRUCTION " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<u64>(map)),     \
                     "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)                                           \
                     : "memory");                                                                           \
    }
FC_TMA_OUT_4D(tma_reduce_add_4d, "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group")
FC_TMA_OUT_4D(tma_store_4d, "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group")
#undef FC_TMA_OUT_4D
// A contiguous global -> shared copy by the TMA unit (no tensor map), completing on `bar` with `bytes`
// transaction bytes: 16-byte aligned addresses, bytes a multiple of 16.
__device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until the shared memory of every committed group of this thread has been read (it may be reused).
__device__ __forceinline__ void tma_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until every committed group of this thread has completed (its writes to global memory performed).
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Bring the tensor map's descriptor into the TMA unit's cache ahead of the first load.
__device__ __forceinline__ void tma_prefetch_map(const FcTensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ----------------------------------------------------------------- fences, barriers, regs ----
// Order this thread's ordinary (generic-proxy) shared-memory writes before later async-proxy
// accesses (wgmma operand reads, TMA stores) of the same bytes.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Order this thread's generic-proxy global memory accesses with its later async-proxy (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// A 32-bit store to shared memory at a 32-bit shared-window address.
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 x) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}
// Four 8x8 tiles of 16-bit elements to shared memory (stmatrix, sm_90): r[j] holds the lane's pair
// (row lane / 4, columns 2 (lane % 4), +1) of tile j, the mma fragment layout, and lane 8j + c gives the
// 16-byte-aligned address where row c of tile j goes as 8 consecutive elements.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}
// The same with each tile transposed (.trans): lane 8j + c gives the address where column c of tile j
// goes as 8 consecutive elements.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}
// Named barriers 1..15 (0 is __syncthreads): `threads` (a multiple of 32) take part.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Hand registers back (producer) or take them (consumers); every warp of the warpgroup executes it.
// Needs __launch_bounds__(threads, 1) and one role per branch, else ptxas ignores it (C7508).
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

