// flash_common.cuh: what every flashcupy kernel family shares.
//
// Compile-time knobs, set by flashcupy/_variant.py from the variant key (never edit by hand):
//   FC_DTYPE                   element type of q, k, v, o: 0 float32, 1 float16, 2 bfloat16
//   FC_ACCUM_F16               1: the on-chip accumulators are fp16 (rounding model below); 0: fp32
//   FC_BLOCK_M, FC_BLOCK_N     query rows per CTA; key rows per inner iteration
//   FC_HEAD_DIM                head dim of the tensors (a multiple of 8, at most 256)
//   FC_HEAD_DIM_PAD            head dim the kernel computes with (>= FC_HEAD_DIM); lanes past
//                              FC_HEAD_DIM are read as 0 and never written
//   FC_NUM_THREADS             threads per CTA
//   FC_CAUSAL                  1: key j is visible to query i iff j <= i + (nk - nq) (bottom-right)
//   FC_WINDOW                  1: a sliding window of FC_WINDOW_LEFT, FC_WINDOW_RIGHT keys (-1: unbounded)
//                              around i + (nk - nq) (the visibility section below)
//   FC_SCORE_HOOK, FC_SOFTCAP_BITS  a score variant (softcap) or the hook's test arm (the score hook
//                              section below); FC_TANH_APPROX: the softcap's tanh
//   FC_ALIBI                   1: ALiBi, a per-head linear bias on the scores (the score hook section);
//                              the kernels then take two more parameters, the slopes and their batch stride
//   FC_VARLEN                  1 (forwards): the batch entries are packed sequences (the batch entries
//                              section below); the kernels then take four more parameters
//   FC_ABLATE_MAX_SUBTRACTION  1: exponentiate raw scores; sum and output on one fixed scale
//   FC_ABLATE_RESCALING        1: subtract each tile's own max, never rescale the running state
//                              (both act only inside fc_softmax_step below)
//   FC_SMEM_<ROLE>, FC_SMEM_LIMIT  the dynamic shared memory each kernel is launched with and the
//                              device's opt-in limit (bytes); each kernel static_asserts its own
//                              layout against its figure, so a drift fails the compile
//
// Rounding model (the NumPy twin in flashcupy/_twin.py implements the same one):
//   accum fp32: S = Q K^T accumulated in fp32; m, l, O in fp32; P = exp2(S*scale_log2 - m*scale_log2)
//               in fp32; l gets rowsum(P) from fp32 P; P is rounded to the element type before P V.
//   accum fp16: S, O accumulators are fp16, rounded after every 16 products along the reduction
//               axis (d for S, keys for O), as mma.m16n8k16 and wgmma k16 with f16 accumulators do
//               (measured: analysis/tensorcore.py); m and l are
//               stored as fp16 and each update (alpha*l + rowsum, alpha*O) is computed in fp32 and
//               rounded once. P, alpha are computed in fp32 from the fp16 state; P is rounded to the
//               element type before P V.
//   Subnormal fp32 values are flushed to zero (cupy.RawModule compiles with -ftz=true).
//   Final: o = O / l in fp32, rounded to the element type; o = 0 and lse = -inf where l == 0.
//   lse = m * scale + ln(l) (natural log); with FC_ABLATE_MAX_SUBTRACTION, lse = ln(l).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

#if FC_DTYPE == 0
typedef float elem_t;
#elif FC_DTYPE == 1
typedef __half elem_t;
#elif FC_DTYPE == 2
typedef __nv_bfloat16 elem_t;
#else
#error "FC_DTYPE must be 0 (float32), 1 (float16) or 2 (bfloat16)"
#endif

#if FC_ABLATE_MAX_SUBTRACTION && FC_ABLATE_RESCALING
#error "at most one ablation per variant"
#endif

#if FC_HEAD_DIM % 8 != 0 || FC_HEAD_DIM > 256 || FC_HEAD_DIM_PAD < FC_HEAD_DIM
#error "FC_HEAD_DIM must be a multiple of 8 up to 256, FC_HEAD_DIM_PAD >= FC_HEAD_DIM"
#endif

__device__ __forceinline__ float fc_to_float(float x) { return x; }
__device__ __forceinline__ float fc_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float fc_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T fc_from_float(float x);
template <> __device__ __forceinline__ float fc_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half fc_from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 fc_from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Round a value to the element type and back: the precision P has when it enters P V.
__device__ __forceinline__ float fc_round_elem(float x) { return fc_to_float(fc_from_float<elem_t>(x)); }

// Round to the accumulator precision: identity for fp32 accumulators, fp16 round trip otherwise.
__device__ __forceinline__ float fc_round_acc(float x) {
#if FC_ACCUM_F16
    return __half2float(__float2half_rn(x));
#else
    return x;
#endif
}

// ln 2 and log2 e, the two constants between the natural-log LSE and the base-2 exponentials.
constexpr float FC_LN2 = 0.6931471805599453f;
constexpr float FC_LOG2E = 1.4426950408889634f;

// 2^x by the SFU (ex2.approx.ftz.f32: about 2 ulp, subnormal results flushed to 0). Every
// exponential in the kernels goes through here: exp(x) = fc_exp2(x * log2(e)).
__device__ __forceinline__ float fc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#if FC_DTYPE != 0
// Two floats rounded to the 16-bit element type and packed in one register (lo in the low half:
// the lower column index), as the tensor-core fragments hold them.
__device__ __forceinline__ unsigned int pack_elem2(float lo, float hi) {
#if FC_DTYPE == 1
    __half2 v = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<unsigned int *>(&v);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core accumulator tiles, shared by the mma and wgmma families. An m16n8 tile of mma.sync and
// each 8-column slice of a wgmma m64nN accumulator (per warp) hold the same elements per lane
// (g = lane / 4, t = lane % 4): i = 0, 1 -> row g, columns 2t, 2t + 1; i = 2, 3 -> row g + 8, same
// columns. With fp32 accumulators they are 4 floats; with fp16 accumulators (FC_ACCUM_F16) 2 half2
// registers (row g, row g + 8), which is also the layout of a 16-bit A fragment's half.
// ---------------------------------------------------------------------------------------------
typedef unsigned int u32;
#if FC_ACCUM_F16
constexpr int ACC_REGS = 2;  // two half2: row g, row g+8
typedef u32 acc_t;
#else
constexpr int ACC_REGS = 4;  // c0 c1 (row g), c2 c3 (row g+8); columns 2t, 2t+1
typedef float acc_t;
#endif

__device__ __forceinline__ void acc_zero(acc_t (&c)[ACC_REGS]) {
#pragma unroll
    for (int i = 0; i < ACC_REGS; ++i) c[i] = 0;
}
// Element i of a tile (i = 0, 1: row g; 2, 3: row g+8), as float.
__device__ __forceinline__ float acc_get(const acc_t (&c)[ACC_REGS], int i) {
#if FC_ACCUM_F16
    const __half2 h = *reinterpret_cast<const __half2 *>(&c[i >> 1]);
    return (i & 1) ? __high2float(h) : __low2float(h);
#else
    return c[i];
#endif
}
// Element i := v, rounded to the accumulator type.
__device__ __forceinline__ void acc_set(acc_t (&c)[ACC_REGS], int i, float v) {
#if FC_ACCUM_F16
    __half2 h = *reinterpret_cast<const __half2 *>(&c[i >> 1]);
    if (i & 1) h.y = __float2half_rn(v); else h.x = __float2half_rn(v);
    c[i >> 1] = *reinterpret_cast<const u32 *>(&h);
#else
    c[i] = v;
#endif
}
// Element i := -inf (a masked score).
__device__ __forceinline__ void acc_set_neg_inf(acc_t (&c)[ACC_REGS], int i) {
#if FC_ACCUM_F16
    c[i >> 1] = (i & 1) ? ((c[i >> 1] & 0x0000ffffu) | 0xfc000000u) : ((c[i >> 1] & 0xffff0000u) | 0x0000fc00u);
#else
    c[i] = -INFINITY;
#endif
}
// Row g times a0, row g+8 times a1; in fp32, rounded once to the accumulator type.
__device__ __forceinline__ void acc_scale(acc_t (&c)[ACC_REGS], float a0, float a1) {
#if FC_ACCUM_F16
    float2 lo = __half22float2(*reinterpret_cast<const __half2 *>(&c[0]));
    float2 hi = __half22float2(*reinterpret_cast<const __half2 *>(&c[1]));
    __half2 rlo = __floats2half2_rn(lo.x * a0, lo.y * a0);
    __half2 rhi = __floats2half2_rn(hi.x * a1, hi.y * a1);
    c[0] = *reinterpret_cast<u32 *>(&rlo);
    c[1] = *reinterpret_cast<u32 *>(&rhi);
#else
    c[0] *= a0; c[1] *= a0; c[2] *= a1; c[3] *= a1;
#endif
}
// Elements 2 hf, 2 hf + 1 (row g for hf = 0, row g + 8 for hf = 1) := x0, x1, rounded to the
// accumulator type.
__device__ __forceinline__ void acc_set_pair(acc_t (&c)[ACC_REGS], int hf, float x0, float x1) {
#if FC_ACCUM_F16
    const __half2 h = __floats2half2_rn(x0, x1);
    c[hf] = *reinterpret_cast<const u32 *>(&h);
#else
    c[2 * hf] = x0;
    c[2 * hf + 1] = x1;
#endif
}
// Elements 2 hf, 2 hf + 1 rounded to the element type and packed (pack_elem2), as one register of a
// 16-bit A fragment holds them; fp16 accumulators (fp16 elements) already are.
__device__ __forceinline__ u32 acc_pair_elem2(const acc_t (&c)[ACC_REGS], int hf) {
#if FC_ACCUM_F16
    return c[hf];
#else
    return pack_elem2(c[2 * hf], c[2 * hf + 1]);
#endif
}
#endif  // FC_DTYPE != 0

// Max / sum over the 4 lanes (xor 1, 2) that share a row of a tensor-core accumulator fragment
// (mma.sync m16n8 and wgmma m64nN: lane 4g + t holds columns 2t, 2t + 1 of row g).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// *addr += (a, b) as one 8-byte reduction in global memory (sm_90; addr 8-byte aligned): the atomic
// dQ path of bwd_mma.cu (bwd_wgmma.cu lets the TMA unit add whole tiles instead).
__device__ __forceinline__ void red_add_f32x2(float *addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Visibility, the one place the rule is written. With i' = i + (nk - nq) (bottom-right aligned,
// FlashAttention-2's convention), query row i (0 <= i < nq) sees key j (0 <= j < nk) iff
//   FC_CAUSAL   j <= i'
//   FC_WINDOW   i' - FC_WINDOW_LEFT <= j <= i' + FC_WINDOW_RIGHT   (a side of -1: unbounded there)
// and every key with neither (the host compiles a causal window (left, 0) as FC_WINDOW, never both; the
// window's sides are compile-time constants, one module per window). A row that sees no key (every
// family) gets o = 0 and lse = -inf.
// ---------------------------------------------------------------------------------------------
#ifndef FC_CAUSAL  // (sources that use flash_common.cuh without a variant: tc_probe.cu)
#define FC_CAUSAL 0
#endif
#ifndef FC_WINDOW
#define FC_WINDOW 0
#endif
#ifndef FC_WINDOW_LEFT
#define FC_WINDOW_LEFT -1
#endif
#ifndef FC_WINDOW_RIGHT
#define FC_WINDOW_RIGHT -1
#endif
static_assert(FC_WINDOW || (FC_WINDOW_LEFT == -1 && FC_WINDOW_RIGHT == -1), "FC_WINDOW_LEFT/RIGHT without FC_WINDOW");
static_assert(!(FC_WINDOW && FC_CAUSAL), "a causal window is FC_WINDOW with FC_WINDOW_RIGHT 0, FC_CAUSAL 0");
static_assert(!FC_WINDOW || (FC_WINDOW_LEFT >= -1 && FC_WINDOW_RIGHT >= -1 && FC_WINDOW_LEFT < (1 << 30) &&
                             FC_WINDOW_RIGHT < (1 << 30) && FC_WINDOW_LEFT + FC_WINDOW_RIGHT > -2),
              "FC_WINDOW_LEFT, FC_WINDOW_RIGHT: -1 (unbounded) or a reach below 2^30, not both -1");
// Whether keys left of the row's reach (j < i' - left) or right of it (j > i' + right) are hidden,
// and the right reach (0 when causal).
constexpr bool FC_BOUND_LEFT = FC_WINDOW && FC_WINDOW_LEFT >= 0;
constexpr bool FC_BOUND_RIGHT = FC_CAUSAL || (FC_WINDOW && FC_WINDOW_RIGHT >= 0);
constexpr int FC_REACH_RIGHT = FC_CAUSAL ? 0 : FC_WINDOW_RIGHT;

// Last key index query row `row` may see (inclusive; < 0 when it sees none).
__device__ __forceinline__ int fc_last_key(int row, int nq, int nk) {
    if constexpr (FC_BOUND_RIGHT) return min(row + (nk - nq) + FC_REACH_RIGHT, nk - 1);
    return nk - 1;
}
// First key index query row `row` may see (> fc_last_key when it sees none).
__device__ __forceinline__ int fc_first_key(int row, int nq, int nk) {
    if constexpr (FC_BOUND_LEFT) return max(row + (nk - nq) - FC_WINDOW_LEFT, 0);
    return 0;
}
__device__ __forceinline__ bool fc_visible(int row, int key, int nq, int nk) {
    if constexpr (FC_BOUND_LEFT)
        if (key < fc_first_key(row, nq, nk)) return false;
    return key <= fc_last_key(row, nq, nk);
}
// The rows that may see key `key` (0 <= key < nk), the same rule read from the key's side: a row sees
// it iff fc_first_query <= row <= fc_last_query (first > nq - 1 or last < 0: no row).
__device__ __forceinline__ int fc_first_query(int key, int nq, int nk) {
    if constexpr (FC_BOUND_RIGHT) return max(key - (nk - nq) - FC_REACH_RIGHT, 0);
    return 0;
}
__device__ __forceinline__ int fc_last_query(int key, int nq, int nk) {
    if constexpr (FC_BOUND_LEFT) return min(key - (nk - nq) + FC_WINDOW_LEFT, nq - 1);
    return nq - 1;
}

// ---------------------------------------------------------------------------------------------
// The range hooks: which tiles a loop visits and which of those it masks, the one place every family
// asks (a mask with another shape, such as packed sequences, changes these functions, not the loops).
//
// Key-tile-outer loops (the dK/dV kernels): the query tiles (of BM rows; n_qt = ceil(nq / BM)) that
// the key tile of keys [n0, n0 + BN) visits: tiles [first, end) hold a row that sees some key of the
// tile (from the tile of fc_first_query(n0) to that of fc_last_query of the tile's last key; none when
// no row sees them). The two hooks agree exactly, tile pair by tile pair (a query tile visits a key
// tile iff the key tile visits it: the rows, and the keys, that a window's band reaches from a tile
// form one interval), which the deterministic backward's count of additions per query tile relies on.
// FC_QUERY_TILE_MASKED: whether the visited query tile of rows [m0, m0 + BM) needs the mask (some of its
// rows miss some key of the tile): it holds rows past nq, or the kernel's own condition `also` holds
// (bwd_wgmma: keys past nk, which bwd_mma's zeroed loads make harmless; false there), or, causal, its
// first row misses the tile's last key, or, in a window, its first row misses the tile's last key
// (right reach) or its last row the tile's first key (left reach). A macro, so that the test is
// compiled where it stands in the loop: as an inline function NVVM evaluates it otherwise (mma's dK/dV
// kernels then took 2 to 4 more registers, and the terms in another order cost bwd_wgmma 0.5-0.9% at
// N=4096 causal).
struct FcQueryTiles {
    int first, end;
};
template <int BM, int BN>
__device__ __forceinline__ FcQueryTiles fc_query_tiles(int n0, int nq, int nk) {
    const int n_qt = (nq + BM - 1) / BM;
    int first = 0, end = n_qt;
    if constexpr (FC_BOUND_RIGHT) {
        const int q_first = fc_first_query(n0, nq, nk);
        first = q_first < nq ? q_first / BM : n_qt;
    }
    if constexpr (FC_BOUND_LEFT) {  // (the rows that see a key of the tile are [q_first, q_last], when any)
        const int q_first = fc_first_query(n0, nq, nk), q_last = fc_last_query(min(n0 + BN, nk) - 1, nq, nk);
        end = q_last >= q_first ? q_last / BM + 1 : first;
    }
    return {first, end};
}
#define FC_QUERY_TILE_MASKED(m0, BM, BN, n0, nq, nk, also)                                           \
    (((m0) + (BM) > (nq)) || (also) || (FC_CAUSAL && (m0) < (n0) + (BN) - 1 - ((nk) - (nq))) ||       \
     (FC_WINDOW && FC_WINDOW_RIGHT >= 0 && (m0) + ((nk) - (nq)) + FC_WINDOW_RIGHT < (n0) + (BN) - 1) || \
     (FC_BOUND_LEFT && (m0) + (BM) - 1 + ((nk) - (nq)) - FC_WINDOW_LEFT > (n0)))

// The query tile run x-th of n (x = blockIdx.x of a grid of n = ceil(nq / BM) tiles, or a persistent
// CTA's x-th tile of a head). Causal grids run the heaviest tiles (the last query rows, which see the
// most keys) first.
__device__ __forceinline__ int fc_query_tile(int x, int n) {
#if FC_CAUSAL
    return n - 1 - x;
#else
    return x;
#endif
}
__device__ __forceinline__ int fc_query_tile() { return fc_query_tile(blockIdx.x, gridDim.x); }

// Query-tile-outer loops (every forward, the dQ kernels): the key tiles (BN keys each) that the query
// rows [m0, min(m0 + rows, nq)) of one CTA visit: tiles [first, end) hold a key visible to some of
// those rows (end - first of them; none when end <= first), and keys [0, key_end) include every key
// visible to one of them; a visited tile j is masked (masked(j): some key of it is invisible to some
// row: at the causal or window edges, past nk) before mask_below and from mask_from on, and visible to
// every row between.
struct FcKeyTiles {
    int first, end, mask_from, key_end, mask_below;
    __device__ __forceinline__ int count() const { return end - first; }
    __device__ __forceinline__ bool masked(int j) const { return (FC_BOUND_LEFT && j < mask_below) || j >= mask_from; }
};
template <int BN>
__device__ __forceinline__ FcKeyTiles fc_key_tiles(int m0, int rows, int nq, int nk) {
    const int row_last = min(m0 + rows, nq) - 1;
    const int last_key = fc_last_key(row_last, nq, nk);
    const int keys_all = fc_last_key(m0, nq, nk) + 1;  // keys before it are right of no row's reach
    const int end = last_key >= 0 ? last_key / BN + 1 : 0;
    int first = 0, mask_below = 0;
    if constexpr (FC_BOUND_LEFT) {
        const int first_key = fc_first_key(m0, nq, nk);  // (the rows see keys [first_key, last_key], if any)
        first = first_key <= last_key ? first_key / BN : end;
        mask_below = (fc_first_key(row_last, nq, nk) + BN - 1) / BN;  // tiles from it: left of no row's reach
    }
    return {first, end, keys_all > 0 ? keys_all / BN : 0, last_key + 1, mask_below};
}

// The masked-tile routine of the tensor-core forwards, for the tiles masked(j) names: NT accumulator
// tiles (tile(i): an m16n8 tile of mma.sync, or 8-column slice i of a wgmma m64nN accumulator, which hold
// the same elements per lane) of this lane's rows row and row + 8, whose columns start at key key0 + 8 i;
// every score whose key the row cannot see (fc_first_key, fc_last_key: the causal or window edges, keys
// >= nk) becomes -inf.
template <int NT, typename Tile>
__device__ __forceinline__ void fc_mask_scores(int row, int key0, int nq, int nk, Tile tile) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int last = fc_last_key(row + 8 * hf, nq, nk) - key0;
        const int first = fc_first_key(row + 8 * hf, nq, nk) - key0;
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (8 * i + e > last || (FC_BOUND_LEFT && 8 * i + e < first)) acc_set_neg_inf(tile(i), 2 * hf + e);
    }
}

// ---------------------------------------------------------------------------------------------
// The score hook: what a variant does to each raw score s = q_i . k_j of query row i and key j (the
// softmax scale stays folded into the exponent's c) before the mask and the softmax, t = hook(s), and
// the derivative by which the backward turns dL/dt into dL/ds:  dS = P (dP - delta) hook'(t). Every
// kernel makes one hook from its scale (`const FcScoreHook hook(scale_log2)`) and applies it where its
// loop holds the raw scores (the forwards in place before the mask, fc_hook_scores; the backwards per
// element where they recompute P) and multiplies its dS; with no hook that code is discarded at compile
// time. A backward takes t and the derivative g = hook'(t) together (softcap's depends on the score,
// and is taken from the tanh itself: recovered from a rounded t, 1 - tanh^2 would lose its relative
// accuracy where tanh saturates) and keeps g from the P it forms to the dS it forms (where P overwrites
// S, the kernel keeps P g there and P elsewhere: bwd_simt, bwd_wgmma).
//   FC_SCORE_HOOK 0  none: t = s (the package's build without a softcap)
//   FC_SCORE_HOOK 1  t = s / 2: the attention of scale / 2, computed another way; a test arm, through
//                    which tests/kernels checks that every kernel applies the hook and its derivative
//   FC_SCORE_HOOK 2  the softcap of flash_attn_func, cap = FC_SOFTCAP (a float32 given by its bits,
//                    FC_SOFTCAP_BITS) on the scaled scores: scale t = cap tanh(scale s / cap), so in
//                    raw units t = (cap / scale) tanh(scale s / cap) and hook'(t) = 1 - tanh^2.
//                    tanh is fc_tanh (below).
// FC_ALIBI 1 adds ALiBi after the arm: t <- t - a |max(i', 0) - j| with i' = i + nk - nq and a the head's
// slope in raw units (slope / scale, computed by the host in float64 and rounded to float32, one per
// (batch, head): FC_ALIBI_PARAMS), the product and the difference each rounded (no FMA: the twin's two
// roundings), then rounded to the accumulator type. A row with i' < 0 (Nq > Nk) sees only keys ahead of
// i', all at |i' - j| = j + d0 with d0 = -i': measuring from key 0 instead takes a d0 off every score of
// the row, which the softmax does not see and which keeps the scores small where the accumulator type
// holds them (fp16 rounds a score near 1000 to 0.5; analysis alibi measures it). The LSE gets a d0 back:
// fc_hook_lse in the forwards, fc_hook_lq in the backwards (FcScoreHook::row_shift). Its derivative is 1 (g unchanged; FC_HOOK_SCALES_DS says
// whether g can differ from 1). The head and batch change inside a CTA (the persistent forward's
// tiles, the dK/dV loops over the GQA group), so a kernel names them where they change:
// FC_HOOK_SET_HEAD(hook, b, h, nq, nk) (b: the batch entry, whose slopes it takes; nq, nk: its lengths),
// nothing without ALiBi. Sinks are no score hook: they are merged after
// the key loop (flashcupy/_sinks.py).
#ifndef FC_SCORE_HOOK
#define FC_SCORE_HOOK 0
#endif
#ifndef FC_ALIBI
#define FC_ALIBI 0
#endif
#if FC_ALIBI
// the slopes in raw units, float32 (B or 1, Hq) with batch stride alibi_sb (0: one row for every batch)
#define FC_ALIBI_PARAMS , const float *__restrict__ alibi, const int alibi_sb
#define FC_ALIBI_ARGS , alibi, alibi_sb
#define FC_HOOK_SET_HEAD(hook, b, h, nq, nk) (hook).set_head(alibi, alibi_sb, (b), (h), (nq), (nk))
// a device function that makes the hook itself takes the slopes and its head through these
#define FC_HEAD_PARAMS , const float *__restrict__ alibi, const int alibi_sb, const int head_b, const int head_h
#define FC_HEAD_ARGS(b, h) , alibi, alibi_sb, (b), (h)
#else
#define FC_HEAD_PARAMS
#define FC_HEAD_ARGS(b, h)
#define FC_ALIBI_PARAMS
#define FC_ALIBI_ARGS
#define FC_HOOK_SET_HEAD(hook, b, h, nq, nk) ((void)0)
#endif
static_assert(FC_SCORE_HOOK >= 0 && FC_SCORE_HOOK <= 2, "FC_SCORE_HOOK: 0 (none), 1 (the test arm) or 2 (softcap)");
#if FC_SCORE_HOOK == 2 && !defined(FC_SOFTCAP_BITS)
#error "FC_SCORE_HOOK 2 (softcap) needs FC_SOFTCAP_BITS, the cap's float32 bits"
#endif

// tanh for the softcap. FC_TANH_APPROX 1: the MUFU's tanh.approx.f32 (one instruction; documented to a
// relative 2^-11, measured on an H100 to an absolute 2^-17); 0: the libdevice tanhf (about 1 ulp, some
// twenty instructions). The default follows the element type: approx for 16-bit inputs, whose scores the
// softcap's users round to 16 bits anyway, accurate for float32 inputs, whose kernels answer to 1e-6.
// `python -m analysis softcap` measures both.
#ifndef FC_TANH_APPROX
#define FC_TANH_APPROX (FC_DTYPE != 0)
#endif
__device__ __forceinline__ float fc_tanh(float x) {
#if FC_TANH_APPROX
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}

// whether the hook's g = hook'(t) can differ from 1 (not for ALiBi alone: a bias has derivative 1)
#define FC_HOOK_SCALES_DS (FC_SCORE_HOOK != 0)

struct FcScoreHook {
    static constexpr bool active = FC_SCORE_HOOK != 0 || FC_ALIBI;
    float pre, post;  // softcap: scale / cap and cap / scale (unused otherwise)
#if FC_ALIBI
    float slope = 0.f;  // the current head's slope, raw units
    int offset = 0;     // nk - nq: query row i sits at i' = i + offset
    __device__ __forceinline__ void set_head(const float *slopes, int sb, int b, int h, int nq, int nk) {
        slope = slopes[(long long)b * sb + h];
        offset = nk - nq;
    }
#endif
    __device__ __forceinline__ explicit FcScoreHook(float scale_log2) {
#if FC_SCORE_HOOK == 2
        const float cap = __int_as_float(FC_SOFTCAP_BITS);
        pre = scale_log2 * FC_LN2 / cap;
        post = cap / (scale_log2 * FC_LN2);
#else
        pre = post = 1.f;
#endif
    }
    // t = hook(s) of query row and key, and g = hook'(t). (An active hook rounds t to the accumulator
    // type, as the forwards' tiles hold it, so that every kernel and direction sees the same t.)
    __device__ __forceinline__ float apply(float s, int row, int key, float &g) const {
        return apply_at(s, pos(row), key, g);
    }
    // query row `row`'s position for the bias, max(i', 0) (the row itself without ALiBi): a tile works
    // it out once per row and calls apply_at
    __device__ __forceinline__ int pos(int row) const {
#if FC_ALIBI
        return max(row + offset, 0);
#else
        return row;
#endif
    }
    // apply for the row at position `p` (pos)
    __device__ __forceinline__ float apply_at(float s, int p, int key, float &g) const {
#if FC_ALIBI
        const float t = arm(s, g);
        const float dist = fabsf((float)(p - key));
        return fc_round_acc(__fsub_rn(t, __fmul_rn(slope, dist)));
#else
        (void)p, (void)key;
        return arm(s, g);
#endif
    }
#if FC_ALIBI
    // a d0 in raw units: what apply took off every score of query row `row` (d0 = max(-i', 0))
    __device__ __forceinline__ float row_shift(int row) const {
        return __fmul_rn(slope, (float)max(-(row + offset), 0));
    }
#endif
    // the FC_SCORE_HOOK arm alone
    __device__ __forceinline__ float arm(float s, float &g) const {
        if constexpr (FC_SCORE_HOOK == 1) {
            g = 0.5f;
            return fc_round_acc(0.5f * s);
        }
        if constexpr (FC_SCORE_HOOK == 2) {
            const float u = fc_tanh(pre * s);
            g = fmaf(-u, u, 1.f);
            return fc_round_acc(post * u);
        }
        g = 1.f;
        return s;
    }
    // t alone (the forwards)
    __device__ __forceinline__ float apply(float s, int row, int key) const {
        float g;
        return apply(s, row, key, g);
    }
};

// A backward's dS times the hook's derivative g (dS itself without a hook).
__device__ __forceinline__ float fc_hook_ds(float ds, float g) {
    if constexpr (FC_HOOK_SCALES_DS) return ds * g;
    return ds;
}

// The hook over NT accumulator tiles of a lane's rows row and row + 8 (fc_mask_scores's layout: columns
// key0 + 8 i, + 1), in place; nothing without a hook.
template <int NT, typename Tile>
__device__ __forceinline__ void fc_hook_scores(const FcScoreHook &hook, int row, int key0, Tile tile) {
    if constexpr (FcScoreHook::active) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int p = hook.pos(row + 8 * hf);  // (once per row)
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float g;
                    acc_set(tile(i), 2 * hf + e, hook.apply_at(acc_get(tile(i), 2 * hf + e), p, key0 + 8 * i + e, g));
                }
        }
    }
}

// The value subtracted from every scaled score before exp2 for a row whose running max is m
// (in raw-score units). -inf (no key seen yet) maps to 0 so that exp2(-inf - (-inf)) never occurs.
__device__ __forceinline__ float fc_safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// ---------------------------------------------------------------------------------------------
// The online softmax, one step per query row and key tile j, for every family (c = scale_log2 =
// scale * log2 e; m in raw-score units):
//     m_new = max(m, rowmax(S_j))                 the running max
//     sub   = m_new * c                           the exponent offset: P_j = exp2(S_j c - sub)
//     alpha = exp2(m c - sub)                     the rescale factor of the old l and O
//     l     = alpha * l + rowsum(P_j),   O = alpha * O + P_j V_j,   m = m_new
// and after the last tile  o = O / l,  lse = m * scale + ln(l). A max of -inf (nothing seen
// yet) subtracts 0, so -inf - (-inf) never occurs; alpha is then 0 (l = 0, O = 0 anyway).
//
// The two breaks are the two lines of fc_softmax_step marked REMOVED:
//   FC_ABLATE_MAX_SUBTRACTION: sub = 0. No max is tracked at all (m keeps its initial -inf and
//       is never read): scores are exponentiated raw on the fixed scale exp(0), nothing is ever
//       rescaled (alpha = 1), and lse = ln(l). exp overflows once a score passes ln(max finite).
//   FC_ABLATE_RESCALING: alpha = 1. Each tile subtracts its own max (finite: nothing overflows)
//       and the running l and O are never brought to the new max, so tiles are summed on
//       different scales: finite and wrong. m still tracks the max over tiles (used by lse).
// ---------------------------------------------------------------------------------------------
// Whether alpha can differ from 1: with either break it is the constant 1, and a family skips its
// O *= alpha loop (the identity) by testing this.
constexpr bool FC_SOFTMAX_RESCALES = !FC_ABLATE_MAX_SUBTRACTION && !FC_ABLATE_RESCALING;

// One step: `tile_max()` returns rowmax(S_j) of this row over the lanes that share it (it is not
// called when the max is not used). Updates m; returns the exponent offset, sets alpha.
template <typename TileMax>
__device__ __forceinline__ float fc_softmax_step(float &m, float &alpha, float c, TileMax tile_max) {
#if FC_ABLATE_MAX_SUBTRACTION
    alpha = 1.f;
    return 0.f;  // REMOVED: the max subtraction (sub = max(m, rowmax S_j) * c)
#else
    const float mx = tile_max();
    const float m_new = fmaxf(m, mx);
#if FC_ABLATE_RESCALING
    const float sub = fc_safe_max(mx) * c;  // each tile on its own max
    alpha = 1.f;                            // REMOVED: the rescaling (alpha = exp2(m c - sub))
#else
    const float sub = fc_safe_max(m_new) * c;
    alpha = fc_exp2(m * c - sub);  // 0 while m = -inf
#endif
    m = m_new;
    return sub;
#endif
}

// P = exp2(S c - sub) in fp32, for one score S of the row.
__device__ __forceinline__ float fc_softmax_p(float s, float c, float sub) { return fc_exp2(fmaf(s, c, -sub)); }

// l = alpha * l + rowsum(P): fp32 accumulators keep it as one fma (a family may hold per-lane
// partials and reduce them at the end); fp16 accumulators round alpha * l and the sum in fp32
// and the result once to fp16, as the NumPy twin does.
__device__ __forceinline__ float fc_softmax_l(float l, float alpha, float rowsum) {
#if FC_ACCUM_F16
    return fc_round_acc(__fadd_rn(__fmul_rn(alpha, l), rowsum));
#else
    return alpha * l + rowsum;
#endif
}

// The final LSE (natural log) of a row from its m and l: -inf for a row that saw no key (l = 0).
__device__ __forceinline__ float fc_softmax_lse(float m, float l, float c) {
#if FC_ABLATE_MAX_SUBTRACTION
    const float lse = logf(l);  // no max was subtracted: l sits on the fixed scale exp(0)
#else
    const float lse = m * (c * FC_LN2) + logf(l);
#endif
    return l == 0.f ? -INFINITY : lse;
}

// The backward's exponent offset from a saved LSE: P = exp2(S c - fc_lse_log2(lse)). A row that
// saw no key (lse = -inf) maps to +inf, so that its P is exp2(-inf) = 0 with no test and
// inf - inf never occurs. Rows past nq use +inf too.
__device__ __forceinline__ float fc_lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * FC_LOG2E; }
// The same for query row `row` of a row of LSEs, +inf for rows past nq as well.
__device__ __forceinline__ float fc_row_lse_log2(const float *lse, int row, int nq) {
    return (row < nq && lse[row] != -INFINITY) ? lse[row] * FC_LOG2E : INFINITY;
}

// The LSE of query row `row` from the forward's m and l (fc_softmax_lse), with what the score hook took
// off the row given back (ALiBi's a d0, FcScoreHook::row_shift, times the scale c ln 2). -inf stays.
__device__ __forceinline__ float fc_hook_lse(const FcScoreHook &hook, float m, float l, float c, int row) {
    const float lse = fc_softmax_lse(m, l, c);
#if FC_ALIBI
    return __fsub_rn(lse, __fmul_rn(hook.row_shift(row), c * FC_LN2));
#else
    return lse;
#endif
}

// The backward's exponent offset lq = lse log2 e of query row `row` (fc_lse_log2) for the hook's scores:
// lq + a d0 c with ALiBi (+inf stays), so that P = exp2(t c - lq) with the forward's shifted t.
__device__ __forceinline__ float fc_hook_lq(const FcScoreHook &hook, float lq, int row, float c) {
#if FC_ALIBI
    return __fadd_rn(lq, __fmul_rn(hook.row_shift(row), c));
#else
    return lq;
#endif
}

// A backward's P of one score s (query row `row`, key `key`): the hook's t first, then exp2(t c - lq)
// (fc_softmax_p, lq from fc_hook_lq); g = hook'(t) for dS (fc_hook_ds). The mask is the caller's.
__device__ __forceinline__ float fc_hook_p(const FcScoreHook &hook, float s, int row, int key, float c, float lq,
                                           float &g) {
    return fc_softmax_p(hook.apply(s, row, key, g), c, lq);
}

// The backwards' P^T of one row pair of an S^T accumulator tile (elements 2 hf and 2 hf + 1: key `key`,
// queries q0 and q0 + 1, lq[e] theirs), element by element: fc_hook_p, then `each(e, p, g)`, which
// masks p in place (the family's own test: the mma backward tests each element, the wgmma one each
// key's first and last visible query) and uses it.
template <typename Acc, typename Each>
__device__ __forceinline__ void fc_keyrow_p(const FcScoreHook &hook, const Acc &acc, int hf, int q0, int key, float c,
                                            const float (&lq)[2], float (&p)[2], const Each &each) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float g;  // hook'(t)
        p[e] = fc_hook_p(hook, acc_get(acc, 2 * hf + e), q0 + e, key, c, lq[e], g);
        each(e, p[e], g);
    }
}

// ---------------------------------------------------------------------------------------------
// Batch entries (the forwards and the backwards). Entry b of a call is, by default, slice b of
// (B, H, N, D) arrays: nq queries and nk keys. With FC_VARLEN 1 (packed sequences,
// flashcupy.attention_varlen) it is sequence b of packed arrays, flash_attn's (total, H, D) seen as
// (1, H, total, D): its queries are the tokens cu_q[b] .. cu_q[b + 1] - 1 of q, o, dO (and those columns
// of lse, delta and the mma and simt backwards' fp32 dQ buffer, all (Hq, total_q) in rows; the wgmma
// backward pads its buffers per sequence: bwd_prep.cuh), its keys the tokens
// cu_k[b] .. cu_k[b + 1] - 1 of k and v (or the first used_k[b] of them). The kernel's nq and nk are
// then the packed totals, max_nq and max_nk the longest sequence's lengths (the extent of the grid and
// of the tile walks: FC_GRID_NQ, FC_GRID_NK), and the outputs o, dq (total_q, Hq, FC_HEAD_DIM) and dk, dv (total_k, Hkv, FC_HEAD_DIM)
// are contiguous. FcEntries gives entry b's FcSeq; every length a kernel masks or bounds by is its
// entry's.
#ifndef FC_VARLEN
#define FC_VARLEN 0
#endif
// FC_PAGED 1 (with FC_VARLEN; fwd_wgmma): the keys are read in place from a paged KV cache, k and v
// (num_pages page_size, Hkv, D) seen as packed arrays. Entry b's k0 is then a position in its own
// sequence (a multiple of page_size where the entry has keys), and its key k0 + j lives at row
// pages[(k0 + j) / page_size] page_size + (k0 + j) % page_size, `pages` its row of the block table
// (table_row[b] entries into block_table). page_size is a multiple of FC_BLOCK_N, so no key tile spans
// two pages.
#ifndef FC_PAGED
#define FC_PAGED 0
#endif
static_assert(!FC_PAGED || FC_VARLEN, "FC_PAGED reads a paged cache through the packed entries: FC_VARLEN 1");
#if FC_PAGED && !defined(FC_READS_PAGES)
#error "FC_PAGED: only a kernel that reads its key tiles through fc_key_token (fwd_wgmma) runs a paged cache"
#endif
struct FcSeq {
    int b;       // the batch index of the arrays (0 for packed arrays: one batch of every token)
    int q0, k0;  // the entry's first query token and first key token (0 but for packed arrays; FC_PAGED:
                 // its first key's position in its own sequence)
    int nq, nk;  // its query and key counts
#if FC_PAGED
    const int *pages;  // its row of the block table
    int page_size;
#endif
};
// The token of k and v (a row of the packed arrays) that holds key `key` (from 0) of entry s.
__device__ __forceinline__ int fc_key_token(const FcSeq &s, int key) {
#if FC_PAGED
    const int j = s.k0 + key;
    return s.pages[j / s.page_size] * s.page_size + j % s.page_size;
#else
    return s.k0 + key;
#endif
}
#if FC_VARLEN
// used_k (may be null; flash_attn's seqused_k): entry b uses only the first used_k[b] keys of its range,
// so that a cache of a fixed capacity per entry is read in place (attention_with_kvcache)
#if FC_PAGED
// (paged: cu_k[b] is the entry's first key in its own sequence and used_k its key count)
#define FC_VARLEN_PARAMS , const int *__restrict__ cu_q, const int *__restrict__ cu_k, \
    const int *__restrict__ used_k, const int max_nq, const int max_nk, \
    const int *__restrict__ block_table, const int *__restrict__ table_row, const int page_size
#define FC_VARLEN_ARGS , cu_q, cu_k, used_k, max_nq, max_nk, block_table, table_row, page_size
struct FcEntries {
    const int *cu_q, *cu_k, *used_k, *block_table, *table_row;
    int page_size;
    __device__ __forceinline__ FcSeq operator()(int b) const {
        const int q0 = cu_q[b];
        return FcSeq{0, q0, cu_k[b], cu_q[b + 1] - q0, used_k[b], block_table + table_row[b], page_size};
    }
};
#define FC_ENTRIES (FcEntries{cu_q, cu_k, used_k, block_table, table_row, page_size})
#else
#define FC_VARLEN_PARAMS , const int *__restrict__ cu_q, const int *__restrict__ cu_k, \
    const int *__restrict__ used_k, const int max_nq, const int max_nk
#define FC_VARLEN_ARGS , cu_q, cu_k, used_k, max_nq, max_nk
struct FcEntries {
    const int *cu_q, *cu_k, *used_k;
    __device__ __forceinline__ FcSeq operator()(int b) const {
        const int q0 = cu_q[b], k0 = cu_k[b];
        return FcSeq{0, q0, k0, cu_q[b + 1] - q0, used_k != nullptr ? used_k[b] : cu_k[b + 1] - k0};
    }
};
#define FC_ENTRIES (FcEntries{cu_q, cu_k, used_k})
#endif
#define FC_GRID_NQ max_nq
#define FC_GRID_NK max_nk
#else
#define FC_VARLEN_PARAMS
#define FC_VARLEN_ARGS
struct FcEntries {
    int nq, nk;
    __device__ __forceinline__ FcSeq operator()(int b) const { return FcSeq{b, 0, 0, nq, nk}; }
};
#define FC_ENTRIES (FcEntries{nq, nk})
#define FC_GRID_NQ nq
#define FC_GRID_NK nk
#endif
// Where the rows of entry s, query head h (of heads_q; nq: the kernel's parameter) go: row r's lse is
// lse[lse0 + r] (so are its delta and, times FC_HEAD_DIM, its row of the backward's fp32 dQ buffer) and
// its o row starts at element (o0 + r o_step) FC_HEAD_DIM of o (and of dq). fc_key_rows: the same for
// the rows of dk and dv (key head hk of heads_kv; nk: the kernel's parameter).
struct FcRows {
    long long lse0, o0, o_step;
};
__device__ __forceinline__ FcRows fc_rows_at(int b, int t0, int h, long long heads, int n) {
    const long long lse0 = ((long long)b * heads + h) * n + t0;
    if constexpr (FC_VARLEN) return FcRows{lse0, (long long)t0 * heads + h, heads};
    return FcRows{lse0, lse0, 1};
}
__device__ __forceinline__ FcRows fc_rows(const FcSeq &s, int h, long long heads_q, int nq) {
    return fc_rows_at(s.b, s.q0, h, heads_q, nq);
}
__device__ __forceinline__ FcRows fc_key_rows(const FcSeq &s, int hk, long long heads_kv, int nk) {
    return fc_rows_at(s.b, s.k0, hk, heads_kv, nk);
}

// The one parameter list of every forward kernel. Strides are in elements; the last axis of
// q, k, v is contiguous. o is (B, Hq, nq, FC_HEAD_DIM) contiguous; lse is (B, Hq, nq) float32 (packed
// sequences: the batch entries above). Grid: (ceil(FC_GRID_NQ / FC_BLOCK_M), Hq, B); block:
// FC_NUM_THREADS. Query head h reads kv head h / group.
#define FC_FWD_PARAMS                                                                             \
    const elem_t *__restrict__ q, const elem_t *__restrict__ k, const elem_t *__restrict__ v,     \
        elem_t *__restrict__ o, float *__restrict__ lse, const int nq, const int nk,              \
        const int group, const long long q_sb, const long long q_sh, const long long q_sn,        \
        const long long k_sb, const long long k_sh, const long long k_sn, const long long v_sb,   \
        const long long v_sh, const long long v_sn, const float scale_log2 FC_ALIBI_PARAMS FC_VARLEN_PARAMS

// ------------------------------------------------------------------------------------------------
// Backward pass (kernels_cu/bwd_*.cu). Each backward family source holds two kernels:
//   flash_bwd_dkdv_<family>: grid (ceil(nk / FC_BLOCK_N), Hkv, B). One CTA owns FC_BLOCK_N keys of
//       one kv head and loops over the `group` query heads that share it and over their query tiles
//       of FC_BLOCK_M rows, accumulating dK and dV on chip (sums over the group included: no atomics;
//       bwd_mma.cu also has an atomic-dQ variant of it, see there).
//   flash_bwd_dq_<family>:   grid (ceil(nq / FC_BLOCK_M), Hq, B). One CTA owns FC_BLOCK_M query rows
//       and loops over key tiles of FC_BLOCK_N, accumulating dQ on chip.
// Both recompute P from the saved LSE and never store P, dP or dS in device memory:
//   P  = exp2(S * scale_log2 - lse_i * log2(e))     (P = 0 for rows with lse_i = -inf: they see no key)
//   dV = sum_i P^T dO          dP = dO V^T          dS = P * (dP - delta_i)
//   dK = scale * sum_i dS^T Q  dQ = scale * dS K    with delta_i = rowsum(dO_i * O_i) (fp32, given)
// Rounding model: as the forward. P and dS are computed in fp32 and rounded to the element type
// before they enter a product; accum fp32 accumulates S, dP, dV, dK, dQ in fp32; accum fp16 keeps
// them in fp16 accumulators rounded after every 16 products of the reduction axis. dq, dk, dv are
// written in the element type, contiguous: dq (B, Hq, nq, D), dk and dv (B, Hkv, nk, D).
#define FC_BWD_PARAMS                                                                             \
    const elem_t *__restrict__ q, const elem_t *__restrict__ k, const elem_t *__restrict__ v,     \
        const elem_t *__restrict__ dout, const float *__restrict__ lse,                           \
        const float *__restrict__ delta, elem_t *__restrict__ dq, elem_t *__restrict__ dk,        \
        elem_t *__restrict__ dv, const int nq, const int nk, const int group, const long long q_sb, \
        const long long q_sh, const long long q_sn, const long long k_sb, const long long k_sh,   \
        const long long k_sn, const long long v_sb, const long long v_sh, const long long v_sn,   \
        const long long do_sb, const long long do_sh, const long long do_sn,                      \
        const float scale_log2 FC_ALIBI_PARAMS FC_VARLEN_PARAMS
// The same list as arguments (a kernel handing its parameters to a device function).
#define FC_BWD_ARGS                                                                               \
    q, k, v, dout, lse, delta, dq, dk, dv, nq, nk, group, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, \
        v_sh, v_sn, do_sb, do_sh, do_sn, scale_log2 FC_ALIBI_ARGS FC_VARLEN_ARGS
