// The CuPy backend's hand-written kernels (compiled by NVRTC through cupy.RawModule; see cupy_ops.py).
//
// * strata_flash_attn: causal / sliding-window GQA attention, its scores optionally soft-capped (gemma2), on
//   the tensor cores (mma.sync m16n8k16, f16 operands, f32 accumulation), FlashAttention-2 style: a warp owns 16 query rows, keeps its
//   scores, running max / sum and output accumulator in registers, and walks the keys in tiles staged
//   through shared memory. Rows are (position, head-in-group) pairs of one K/V head, so the G query
//   heads that share a K/V head share each K/V tile. Keys are read where they are stored (a pool slice
//   or a ring addressed by position % capacity), in f16, bf16 or f32, converted to f16 on the way in.
//   With several key splits (decode, short chunks) each split writes an unnormalised partial result
//   and strata_attn_combine (many rows) or strata_attn_combine_wide (few rows: decode) merges them.
// * strata_store_kv: the chunk's K/V into the pool's slots (ring slots by position % capacity);
//   strata_store_kv_rows: a batched decode step's rows, each into its own slot's region of the arena.
//   strata_flash_attn with `batch` attends such a step's rows, each over its own slot, in one launch.
// * strata_rms_norm / strata_add_rms_norm: one warp per row; the fused form adds the residual (after
//   an optional norm of the branch, gemma3's post-norms) and normalises the sum for the next block.
// * strata_qk_norm_rope: one warp per (token, head): optional per-head RMS norm, then RoPE (neox or
//   interleaved), for the Q and K heads of one fused QKV projection.
// * strata_gated_act: act(gate) * up over the two halves of one fused [Wg; Wu] product.
// * strata_argmax_parts / strata_argmax_rows: each logits row's first maximal index (NaN first, as np.argmax)
//   and its value, so a greedy step downloads a token id, not the row (spans of a row in parallel, then the row).
// * strata_add_rms_norm_row / strata_gemv: the same norm and the products for steps of a few token rows
//   (decode): a block per row, a warp per output column (the gated activation fused into the gate/up one).
//
// Arithmetic is float32 whatever the storage type; every stored value is rounded once, to the
// storage type, at the point where the NumPy twin rounds it.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The value as the storage type T would hold it (the NumPy twin rounds intermediate arrays to T).
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f32(from_f32<T>(x)); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// ---- RMS norm ----------------------------------------------------------------------------------
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of n values; x and out rows `stride` apart.
template <typename T>
__global__ void strata_rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                                int n_rows, int n, int x_stride, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    const T* xr = x + (size_t)row * x_stride;
    T* outr = out + (size_t)row * n;
    float ss = 0.f;
    for (int i = lane; i < n; i += 32) { const float v = to_f32(xr[i]); ss += v * v; }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)n + eps);
    for (int i = lane; i < n; i += 32) outr[i] = from_f32<T>(to_f32(xr[i]) * inv * to_f32(w[i]));
}

// x_out = x + (w_post ? rms_norm(y) * w_post : y);  h = rms_norm(x_out) * w_next.
template <typename T>
__global__ void strata_add_rms_norm(const T* __restrict__ x, const T* __restrict__ y,
                                    const T* __restrict__ w_post, const T* __restrict__ w_next,
                                    T* __restrict__ x_out, T* __restrict__ h, int n_rows, int n,
                                    int x_stride, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    const T* xr = x + (size_t)row * x_stride;
    const T* yr = y + (size_t)row * n;
    T* xo = x_out + (size_t)row * n;
    T* hr = h + (size_t)row * n;
    float inv_y = 1.f;
    if (w_post != nullptr) {
        float ss = 0.f;
        for (int i = lane; i < n; i += 32) { const float v = to_f32(yr[i]); ss += v * v; }
        inv_y = 1.0f / sqrtf(warp_sum(ss) / (float)n + eps);
    }
    float ss = 0.f;
    for (int i = lane; i < n; i += 32) {
        float branch = to_f32(yr[i]);
        if (w_post != nullptr) branch = round_to<T>(branch * inv_y * to_f32(w_post[i]));
        const float s = round_to<T>(to_f32(xr[i]) + branch);
        xo[i] = from_f32<T>(s);
        ss += s * s;
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)n + eps);
    for (int i = lane; i < n; i += 32) hr[i] = from_f32<T>(to_f32(xo[i]) * inv * to_f32(w_next[i]));
}

// ---- per-head norm + RoPE on a fused QKV projection ----------------------------------------------
// q_src rows hold H query heads, k_src rows Hkv key heads, of D values (rows `stride` values apart:
// both are column blocks of one fused projection). Writes q [T, H, D] and k [T, Hkv, D].
// cos/sin [T, half] float32; the first 2*half dims rotate: neox pairs (j, j + half), interleaved
// pairs (2j, 2j + 1).
template <typename T>
__global__ void strata_qk_norm_rope(const T* __restrict__ q_src, const T* __restrict__ k_src,
                                    T* __restrict__ q_out, T* __restrict__ k_out,
                                    const T* __restrict__ q_norm, const T* __restrict__ k_norm,
                                    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                    int n_tok, int H, int Hkv, int D, int half, int neox, int stride,
                                    float eps) {
    const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int heads = H + Hkv;
    if (item >= n_tok * heads) return;
    const int t = item / heads, hd = item % heads;
    const bool is_q = hd < H;
    const T* src = is_q ? q_src + (size_t)t * stride + (size_t)hd * D : k_src + (size_t)t * stride + (size_t)(hd - H) * D;
    T* dst = is_q ? q_out + ((size_t)t * H + hd) * D : k_out + ((size_t)t * Hkv + (hd - H)) * D;
    const T* wn = is_q ? q_norm : k_norm;
    float inv = 1.f;
    if (wn != nullptr) {
        float ss = 0.f;
        for (int i = lane; i < D; i += 32) { const float v = to_f32(src[i]); ss += v * v; }
        inv = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
    }
    // the normed value as the twin stores it (rounded to T) before rotating
#define STRATA_VAL(i) (wn != nullptr ? round_to<T>(to_f32(src[i]) * inv * to_f32(wn[i])) : to_f32(src[i]))
    for (int j = lane; j < half; j += 32) {
        const int i0 = neox ? j : 2 * j;
        const int i1 = neox ? j + half : 2 * j + 1;
        const float c = cos_t[t * half + j], s = sin_t[t * half + j];
        const float a = STRATA_VAL(i0), b = STRATA_VAL(i1);
        dst[i0] = from_f32<T>(a * c - b * s);
        dst[i1] = from_f32<T>(b * c + a * s);
    }
    for (int i = 2 * half + lane; i < D; i += 32) dst[i] = from_f32<T>(STRATA_VAL(i));
#undef STRATA_VAL
}

// ---- K/V store -------------------------------------------------------------------------------------
// New K and V rows ([n_tok, row] of the compute type, rows k_stride / v_stride values apart) into the
// pool ([slots, row] of the storage type, rounded once): position p = pos0 + t goes to slot p, or
// p % ring_cap in a ring. pos0 is read from dyn[0] when dyn is given (a captured decode step).
template <typename T, typename S>
__global__ void strata_store_kv(const T* __restrict__ k, const T* __restrict__ v, S* __restrict__ k_pool,
                                S* __restrict__ v_pool, int n_tok, int row, int k_stride, int v_stride, int pos0,
                                int ring_cap, const int* __restrict__ dyn) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * row) return;
    const int t = (int)(i / row), c = (int)(i % row);
    const int p = (dyn != nullptr ? dyn[0] : pos0) + t;
    const size_t slot = ring_cap > 0 ? (size_t)(p % ring_cap) : (size_t)p;
    k_pool[slot * row + c] = from_f32<S>(to_f32(k[(size_t)t * k_stride + c]));
    v_pool[slot * row + c] = from_f32<S>(to_f32(v[(size_t)t * v_stride + c]));
}

// A batched decode step (one row per slot): row t's K and V (of the compute type, rows k_stride / v_stride
// values apart) into its slot's region of the layer's arena (slot regions slot_stride values apart), at its
// position (p % ring_cap in a ring). rows = [n_real, position[n_rows], slot[n_rows]] on the device: rows
// t >= n_real (a step padded to its captured size) store nothing.
template <typename T, typename S>
__global__ void strata_store_kv_rows(const T* __restrict__ k, const T* __restrict__ v, S* __restrict__ k_arena,
                                     S* __restrict__ v_arena, int n_rows, int row, int k_stride, int v_stride,
                                     long long slot_stride, int ring_cap, const int* __restrict__ rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * row) return;
    const int t = (int)(i / row), c = (int)(i % row);
    if (t >= rows[0]) return;
    const int p = rows[1 + t];
    const size_t at = (size_t)rows[1 + n_rows + t] * slot_stride + (size_t)(ring_cap > 0 ? p % ring_cap : p) * row + c;
    k_arena[at] = from_f32<S>(to_f32(k[(size_t)t * k_stride + c]));
    v_arena[at] = from_f32<S>(to_f32(v[(size_t)t * v_stride + c]));
}

// ---- flash attention -----------------------------------------------------------------------------
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// d[0..3] += A (16x16, row) * B (16x8, col), f16 operands, f32 accumulators.
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 b16 matrices from shared memory into mma fragments; lane l gives the address of row l % 8
// of matrix l / 8. Plain: thread t gets (row t/4, cols 2(t%4), +1) of each; .trans: (rows 2(t%4), +1,
// col t/4), i.e. the B fragment of a row-major [k][n] tile.
__device__ __forceinline__ void ldsm_x4(u32* r, const __half* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const __half* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// 8 consecutive values of a row, converted to f16 (scaled by `mul`), stored at dst (16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8_to_half(const T* __restrict__ src, __half* dst, float mul) {
#pragma unroll
    for (int e = 0; e < 8; e++) dst[e] = __float2half_rn(to_f32(src[e]) * mul);
}
template <>
__device__ __forceinline__ void load8_to_half<__half>(const __half* __restrict__ src, __half* dst, float mul) {
    if (mul == 1.f) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
        return;
    }
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const __half* h = reinterpret_cast<const __half*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; e++) dst[e] = __float2half_rn(__half2float(h[e]) * mul);
}
template <>
__device__ __forceinline__ void load8_to_half<__nv_bfloat16>(const __nv_bfloat16* __restrict__ src, __half* dst,
                                                             float mul) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; e++) dst[e] = __float2half_rn(__bfloat162float(h[e]) * mul);
}

__device__ __forceinline__ void zero8(__half* dst) { *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); }

template <typename T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<__half> { static constexpr bool value = true; };

// 16 bytes global -> shared without passing through registers (sm_80+); zero-filled when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Stage keys [jb, jb + BC) of one K/V head into shared memory as f16 (zeros past j_hi). f16 storage
// (the pool's) is copied asynchronously, so the next tile loads while this one is multiplied; other
// types are converted on the way through registers.
template <typename KT, int D, int NW, int BC>
__device__ __forceinline__ void stage_kv_tile(const KT* __restrict__ k, const KT* __restrict__ v, __half* Ks,
                                              __half* Vs, int jb, int j_hi, int k_pos0, int ring_cap, int Hkv,
                                              int kvh) {
    constexpr int LD = D + 8;
    for (int idx = threadIdx.x; idx < BC * (D / 8); idx += NW * 32) {
        const int r = idx / (D / 8), c8 = (idx % (D / 8)) * 8;
        const int j = jb + r;
        const bool valid = j < j_hi;
        size_t off = 0;
        if (valid) {
            const int kp = k_pos0 + j;
            const size_t slot = ring_cap > 0 ? (size_t)(kp % ring_cap) : (size_t)j;
            off = (slot * Hkv + kvh) * D + c8;
        }
        if constexpr (is_half<KT>::value) {
            cp_async16(Ks + r * LD + c8, k + off, valid);
            cp_async16(Vs + r * LD + c8, v + off, valid);
        } else if (valid) {
            load8_to_half<KT>(k + off, Ks + r * LD + c8, 1.f);
            load8_to_half<KT>(v + off, Vs + r * LD + c8, 1.f);
        } else {
            zero8(Ks + r * LD + c8);
            zero8(Vs + r * LD + c8);
        }
    }
}

// Grid: x = query row tile (BR = 16 * NW rows of one K/V head), y = K/V head, z = key split.
// q [T, H, D]; k, v: key slots of [Hkv, D] each; key index j (0 <= j < n_keys) is position
// k_pos0 + j, stored in slot j (ring_cap == 0) or slot (k_pos0 + j) % ring_cap. A query at position p
// sees keys at kp <= p with p - kp < window (window 0: unlimited). out [T, H, D] when n_splits == 1;
// else part_o [n_splits, Hkv, rows_pad, D] (unnormalised) and part_ml [n_splits, Hkv, rows_pad, 2].
// `scale_log2` is the softmax scale times log2(e): scores are kept in base 2. CAPPED: `softcap_log2` (gemma2's
// attention logit soft-cap times log2(e)) caps each scaled score s as softcap_log2 * tanh(s / softcap_log2),
// which is log2(e) * cap * tanh(s_e / cap) of the natural score s_e. With `dyn` (a step
// captured in a CUDA graph) q_pos0 = dyn[0], and the keys are every position up to the last query's:
// from slot 0 of a full layer's pool, or from the window's start in a ring. With `batch` ([n_real,
// position[B], slot[B]]: a batched decode step) grid z is B x n_splits: batch row b's n_q queries (q and out
// rows b * n_q ..) attend as with dyn = position[b] over k, v + slot[b] * slot_stride (its slot's region
// of the layer's arena); its partial results are splits b * n_splits .. of part_o / part_ml.
template <typename QT, typename KT, typename OT, int D, int NW, int BC, bool CAPPED>
__global__ void __launch_bounds__(NW * 32)
strata_flash_attn(const QT* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
                  OT* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
                  int n_q, int H, int Hkv, int q_pos0, int k_pos0, int n_keys, int ring_cap, int window,
                  float scale_log2, float softcap_log2, int n_splits, int rows_pad, const int* __restrict__ dyn,
                  const int* __restrict__ batch, long long slot_stride) {
    int split = blockIdx.z;
    int b = 0;  // the batch row (a batched decode step), else 0
    if (batch != nullptr) {  // grid z = batch rows x splits; row b: n_q queries of slot batch[1 + B + b]
        const int n_batch = gridDim.z / n_splits;
        b = blockIdx.z / n_splits;
        split = blockIdx.z - b * n_splits;
        const size_t off = (size_t)batch[1 + n_batch + b] * slot_stride;
        k += off;
        v += off;
        q += (size_t)b * n_q * H * D;
        out += (size_t)b * n_q * H * D;
        dyn = batch + 1 + b;
    }
    if (dyn != nullptr) {  // a captured step: the position is read at replay time
        q_pos0 = dyn[0];
        k_pos0 = ring_cap > 0 && window > 0 ? max(0, q_pos0 - window + 1) : 0;
        n_keys = q_pos0 + n_q - k_pos0;
    }
    constexpr int BR = 16 * NW;
    constexpr int LD = D + 8;  // row pitch in halves: 16-byte aligned rows, staggered banks
    constexpr int NT_S = BC / 8;  // score n-tiles per warp
    constexpr int NT_O = D / 8;   // output n-tiles per warp
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __half* Qs = reinterpret_cast<__half*>(smem_raw);  // [BR][LD], then K and V tiles [2][BC][LD] each
    __half* Kbuf = Qs + BR * LD;
    __half* Vbuf = Kbuf + 2 * BC * LD;

    const int G = H / Hkv;
    const int rows = n_q * G;
    const int tile = gridDim.x - 1 - blockIdx.x;  // the costliest (latest) tiles start first
    const int kvh = blockIdx.y;
    const int r0 = tile * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane >> 2, tig = lane & 3;

    // Keys any row of this tile can see, then this split's share (whole BC tiles).
    const int t_lo = r0 / G;
    const int t_hi = min(n_q - 1, (r0 + BR - 1) / G);
    int j_lo = 0;
    if (window > 0) j_lo = max(0, q_pos0 + t_lo - window + 1 - k_pos0);
    const int j_hi = min(n_keys, q_pos0 + t_hi - k_pos0 + 1);
    const int n_tiles = j_hi > j_lo ? (j_hi - j_lo + BC - 1) / BC : 0;
    // The first n_used splits share the tiles; the rest (fewer tiles than splits: a captured step's splits
    // are sized for the whole pool) only mark themselves empty, so the combine stops at the last used one.
    const int n_used = min(n_splits, n_tiles);
    if (n_splits > 1 && split >= n_used) {
        const size_t base = ((size_t)(b * n_splits + split) * Hkv + kvh) * rows_pad;
        for (int r = threadIdx.x; r < BR; r += NW * 32) {
            if (r0 + r < rows) {
                part_ml[(base + r0 + r) * 2] = -INFINITY;
                part_ml[(base + r0 + r) * 2 + 1] = 0.f;
            }
        }
        return;
    }
    const int tile_a = n_used > 0 ? (int)(((long long)n_tiles * split) / n_used) : 0;
    const int tile_b = n_used > 0 ? (int)(((long long)n_tiles * (split + 1)) / n_used) : 0;

    // Q tile, scaled, to f16.
    for (int idx = threadIdx.x; idx < BR * (D / 8); idx += NW * 32) {
        const int r = idx / (D / 8), c8 = (idx % (D / 8)) * 8;
        const int R = r0 + r;
        __half* dst = Qs + r * LD + c8;
        if (R < rows) {
            const int t = R / G, g = R % G;
            load8_to_half<QT>(q + ((size_t)t * H + kvh * G + g) * D + c8, dst, scale_log2);
        } else {
            zero8(dst);
        }
    }

    // This thread's two rows (grp and grp + 8 of the warp's 16) and their query positions.
    const int row_a = r0 + warp * 16 + grp, row_b = row_a + 8;
    const int qp_a = row_a < rows ? q_pos0 + row_a / G : -0x40000000;
    const int qp_b = row_b < rows ? q_pos0 + row_b / G : -0x40000000;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
    float o[NT_O][4];
#pragma unroll
    for (int i = 0; i < NT_O; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    // Double-buffered key tiles: tile i + 1 is in flight while tile i is multiplied.
    const int n_mine = tile_b - tile_a;
    if (n_mine > 0) {
        stage_kv_tile<KT, D, NW, BC>(k, v, Kbuf, Vbuf, j_lo + tile_a * BC, j_hi, k_pos0, ring_cap, Hkv, kvh);
        cp_async_commit();
    }
    for (int i = 0; i < n_mine; i++) {
        const int jb = j_lo + (tile_a + i) * BC;
        const __half* Ks = Kbuf + (i & 1) * BC * LD;
        const __half* Vs = Vbuf + (i & 1) * BC * LD;
        if (i + 1 < n_mine) {
            const int nb = (i + 1) & 1;
            stage_kv_tile<KT, D, NW, BC>(k, v, Kbuf + nb * BC * LD, Vbuf + nb * BC * LD, jb + BC, j_hi, k_pos0,
                                         ring_cap, Hkv, kvh);
            cp_async_commit();
            cp_async_wait<1>();  // this tile's group has landed; the next one may still be in flight
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's part of this tile (and of Q, the first time) is staged

        // S = Q K^T for the warp's 16 rows x BC keys.
        float s[NT_S][4];
#pragma unroll
        for (int i = 0; i < NT_S; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        const __half* qw = Qs + (warp * 16) * LD;
        const int mat = lane >> 3, mrow = lane & 7;  // the ldmatrix row this lane addresses
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            u32 a[4];  // rows +0/+8 by mat & 1, columns +0/+8 by mat >> 1
            ldsm_x4(a, qw + (mrow + 8 * (mat & 1)) * LD + kk * 16 + 8 * (mat >> 1));
#pragma unroll
            for (int nt = 0; nt < NT_S; nt += 2) {
                u32 b[4];  // keys of n-tile nt (mat 0, 1) and nt + 1 (mat 2, 3); dims +0/+8 by mat & 1
                ldsm_x4(b, Ks + ((nt + (mat >> 1)) * 8 + mrow) * LD + kk * 16 + 8 * (mat & 1));
                mma_16816(s[nt], a, b);
                mma_16816(s[nt + 1], a, b + 2);
            }
        }

        if constexpr (CAPPED) {  // an instance of its own: the uncapped one is the kernel it was without a cap
            const float inv_cap = 1.f / softcap_log2;
#pragma unroll
            for (int nt = 0; nt < NT_S; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = softcap_log2 * tanhf(s[nt][e] * inv_cap);
            }
        }

        // Mask, running max, exponentials (base 2), running sum, rescale of the accumulator.
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT_S; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = jb + nt * 8 + tig * 2 + e;
                const int kp = k_pos0 + j;
                const bool in = j < j_hi;
                if (!(in && kp <= qp_a && (window == 0 || qp_a - kp < window))) s[nt][e] = -INFINITY;
                if (!(in && kp <= qp_b && (window == 0 || qp_b - kp < window))) s[nt][2 + e] = -INFINITY;
                mx_a = fmaxf(mx_a, s[nt][e]);
                mx_b = fmaxf(mx_b, s[nt][2 + e]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        // A row with no visible key so far keeps max -inf: shift by 0 so exp2 gives 0, not NaN.
        const float sh_a = mn_a == -INFINITY ? 0.f : mn_a;
        const float sh_b = mn_b == -INFINITY ? 0.f : mn_b;
        const float al_a = exp2f(m_a - sh_a), al_b = exp2f(m_b - sh_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT_S; nt++) {
            s[nt][0] = exp2f(s[nt][0] - sh_a);
            s[nt][1] = exp2f(s[nt][1] - sh_a);
            s[nt][2] = exp2f(s[nt][2] - sh_b);
            s[nt][3] = exp2f(s[nt][3] - sh_b);
            sum_a += s[nt][0] + s[nt][1];
            sum_b += s[nt][2] + s[nt][3];
        }
        l_a = l_a * al_a + sum_a;
        l_b = l_b * al_b + sum_b;
#pragma unroll
        for (int i = 0; i < NT_O; i++) {
            o[i][0] *= al_a;
            o[i][1] *= al_a;
            o[i][2] *= al_b;
            o[i][3] *= al_b;
        }

        // O += P V: the score accumulators of two adjacent n-tiles are the A fragment of one k-step.
#pragma unroll
        for (int ks = 0; ks < BC / 16; ks++) {
            u32 a[4];
            a[0] = pack_half2(s[2 * ks][0], s[2 * ks][1]);
            a[1] = pack_half2(s[2 * ks][2], s[2 * ks][3]);
            a[2] = pack_half2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
            a[3] = pack_half2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
            for (int dt = 0; dt < NT_O; dt += 2) {
                u32 b[4];  // keys +0/+8 by mat & 1; dims of n-tile dt (mat 0, 1) and dt + 1 (mat 2, 3)
                ldsm_x4_trans(b, Vs + (ks * 16 + mrow + 8 * (mat & 1)) * LD + (dt + (mat >> 1)) * 8);
                mma_16816(o[dt], a, b);
                mma_16816(o[dt + 1], a, b + 2);
            }
        }
        __syncthreads();  // done reading this buffer: the next iteration stages into it
    }

    // Row sums: each thread summed its own columns; the 4 threads of a row group hold the rest.
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);

    if (n_splits == 1) {
        const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
        if (row_a < rows) {
            OT* dst = out + ((size_t)(row_a / G) * H + kvh * G + row_a % G) * D;
#pragma unroll
            for (int dt = 0; dt < NT_O; dt++) {
                dst[dt * 8 + tig * 2] = from_f32<OT>(o[dt][0] * inv_a);
                dst[dt * 8 + tig * 2 + 1] = from_f32<OT>(o[dt][1] * inv_a);
            }
        }
        if (row_b < rows) {
            OT* dst = out + ((size_t)(row_b / G) * H + kvh * G + row_b % G) * D;
#pragma unroll
            for (int dt = 0; dt < NT_O; dt++) {
                dst[dt * 8 + tig * 2] = from_f32<OT>(o[dt][2] * inv_b);
                dst[dt * 8 + tig * 2 + 1] = from_f32<OT>(o[dt][3] * inv_b);
            }
        }
        return;
    }
    const size_t base = ((size_t)(b * n_splits + split) * Hkv + kvh) * rows_pad;
    if (row_a < rows) {
        float* dst = part_o + (base + row_a) * D;
#pragma unroll
        for (int dt = 0; dt < NT_O; dt++) {
            dst[dt * 8 + tig * 2] = o[dt][0];
            dst[dt * 8 + tig * 2 + 1] = o[dt][1];
        }
        if (tig == 0) {
            part_ml[(base + row_a) * 2] = m_a;
            part_ml[(base + row_a) * 2 + 1] = l_a;
        }
    }
    if (row_b < rows) {
        float* dst = part_o + (base + row_b) * D;
#pragma unroll
        for (int dt = 0; dt < NT_O; dt++) {
            dst[dt * 8 + tig * 2] = o[dt][2];
            dst[dt * 8 + tig * 2 + 1] = o[dt][3];
        }
        if (tig == 0) {
            part_ml[(base + row_b) * 2] = m_b;
            part_ml[(base + row_b) * 2 + 1] = l_b;
        }
    }
}

// Merge the key splits: out = sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s.
// One thread per (batch row, K/V head, row, d); n_batch > 1: a batched step's parts (strata_flash_attn); for
// launches of many output rows (prefill chunks), where the rows alone fill the device.
template <typename OT>
__global__ void strata_attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                    OT* __restrict__ out, int n_q, int H, int Hkv, int D, int n_splits,
                                    int rows_pad, int n_batch) {
    const int G = H / Hkv;
    const int rows = n_q * G;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_batch * Hkv * rows * D) return;
    const int d = (int)(i % D);
    const int R = (int)((i / D) % rows);
    const int kvh = (int)((i / ((long long)D * rows)) % Hkv);
    const int b = (int)(i / ((long long)D * rows * Hkv));
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++)
        M = fmaxf(M, part_ml[(((size_t)(b * n_splits + s) * Hkv + kvh) * rows_pad + R) * 2]);
    float num = 0.f, den = 0.f;
    if (M != -INFINITY) {
        for (int s = 0; s < n_splits; s++) {
            const size_t at = ((size_t)(b * n_splits + s) * Hkv + kvh) * rows_pad + R;
            const float m = part_ml[at * 2];
            if (m == -INFINITY) continue;  // an empty split (part_o unwritten) or one that saw no key
            const float w = exp2f(m - M);
            den += part_ml[at * 2 + 1] * w;
            num += part_o[at * D + d] * w;
        }
    }
    out[(((size_t)b * n_q + R / G) * H + kvh * G + R % G) * D + d] = from_f32<OT>(den > 0.f ? num / den : 0.f);
}

// The same merge for launches of few output rows (decode, batched decode steps): one block per output row
// (batch row, K/V head, query row), blockDim a multiple of D / 4 and of 32. The splits' weights are made once,
// in parallel, into shared memory; then blockDim / (D / 4) groups of threads each sum float4 columns of every
// such group-th used split (loads independent of each other, not a serial chain per value), and the groups'
// sums are added. Dynamic shared memory: (round4(n_splits) + (blockDim / (D / 4)) * D) floats.
template <typename OT>
__global__ void strata_attn_combine_wide(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                         OT* __restrict__ out, int n_q, int H, int Hkv, int D, int n_splits,
                                         int rows_pad, int n_batch) {
    extern __shared__ __align__(16) float comb_smem[];
    __shared__ float red[32];
    __shared__ int red_i[32];
    const int G = H / Hkv;
    const int rows = n_q * G;
    const int R = blockIdx.x % rows;
    const int kvh = (blockIdx.x / rows) % Hkv;
    const int b = blockIdx.x / (rows * Hkv);
    const size_t stride = (size_t)Hkv * rows_pad;  // rows between one split's part and the next's
    const size_t at0 = ((size_t)b * n_splits * Hkv + kvh) * rows_pad + R;  // split 0's row
    float* w = comb_smem;
    float* acc = comb_smem + ((n_splits + 3) & ~3);
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, n_warps = blockDim.x >> 5;

    // M, and the last split with a visible key (the used splits come first: strata_flash_attn).
    float mx = -INFINITY;
    int last = -1;
    for (int s = tid; s < n_splits; s += blockDim.x) {
        const float m = part_ml[(at0 + s * stride) * 2];
        w[s] = m;
        mx = fmaxf(mx, m);
        if (m != -INFINITY) last = s;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    }
    if (lane == 0) {
        red[wid] = mx;
        red_i[wid] = last;
    }
    __syncthreads();
    mx = -INFINITY;
    last = -1;
    for (int i = 0; i < n_warps; i++) {
        mx = fmaxf(mx, red[i]);
        last = max(last, red_i[i]);
    }
    __syncthreads();  // red is reused below

    // Weights, and den = sum_s l_s w_s.
    float den = 0.f;
    for (int s = tid; s <= last; s += blockDim.x) {
        const float m = w[s];
        const float ws = m == -INFINITY ? 0.f : exp2f(m - mx);
        w[s] = ws;
        den += part_ml[(at0 + s * stride) * 2 + 1] * ws;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
    if (lane == 0) red[wid] = den;
    __syncthreads();  // also: every w[s] is written
    den = 0.f;
    for (int i = 0; i < n_warps; i++) den += red[i];

    // num = sum_s o_s w_s: group g sums splits g, g + n_groups, ... of columns 4c .. 4c + 3.
    const int D4 = D >> 2, n_groups = blockDim.x / D4;
    const int c = tid % D4, g = tid / D4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = g; s <= last; s += n_groups) {
        const float ws = w[s];  // 0 for a used split that saw no key (its o is 0, finite)
        const float4 o = *reinterpret_cast<const float4*>(part_o + (at0 + s * stride) * D + 4 * c);
        a.x += o.x * ws;
        a.y += o.y * ws;
        a.z += o.z * ws;
        a.w += o.w * ws;
    }
    *reinterpret_cast<float4*>(acc + g * D + 4 * c) = a;
    __syncthreads();
    OT* dst = out + (((size_t)b * n_q + R / G) * H + kvh * G + R % G) * D;
    for (int d = tid; d < D; d += blockDim.x) {
        float num = 0.f;
        for (int i = 0; i < n_groups; i++) num += acc[i * D + d];
        dst[d] = from_f32<OT>(den > 0.f ? num / den : 0.f);
    }
}

// ---- gated activation --------------------------------------------------------------------------
// out[r, c] = act(g) * u with g = gu[r, c] and u = gu[r, F + c], the two halves of a fused [Wg; Wu]
// product (rows `stride` apart); act is SiLU (ACT 0) or GELU in its tanh form (ACT 1), in float32 as
// the NumPy twin computes it, rounded once. One thread per column, block rows over the token rows:
// no index division (CuPy's element-wise kernels over the strided halves divide per element).
constexpr float GELU_C = 0.7978845608028654f;  // sqrt(2 / pi)

template <typename T, int ACT>
__global__ void strata_gated_act(const T* __restrict__ gu, T* __restrict__ out, int n_rows, int F, int stride) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= F) return;
    for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const T* row = gu + (size_t)r * stride;
        const float g = to_f32(row[c]), u = to_f32(row[F + c]);
        const float a = ACT == 0 ? g / (1.0f + expf(-g))
                                 : 0.5f * g * (1.0f + tanhf(GELU_C * (g + 0.044715f * g * g * g)));
        out[(size_t)r * F + c] = from_f32<T>(a * u);
    }
}

// ---- decode-sized kernels (a few token rows) -------------------------------------------------------
// A step of a few tokens is latency-bound: one warp walking a 576-value row issues its loads one after
// another, and cuBLAS's products of one row leave most of the device idle. These spread a row over a
// block and a product over one warp per output column, keeping values in registers.

// Sum over the block (blockDim.x a multiple of 32, at most 1024); sh holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    float t = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.f;
    t = warp_sum(t);
    __syncthreads();  // sh is reused by the next sum
    return t;
}

// strata_add_rms_norm with one block per row (NV values per thread, in registers).
template <typename T, int NV>
__global__ void strata_add_rms_norm_row(const T* __restrict__ x, const T* __restrict__ y,
                                        const T* __restrict__ w_post, const T* __restrict__ w_next,
                                        T* __restrict__ x_out, T* __restrict__ h, int n, int x_stride, float eps) {
    __shared__ float sh[32];
    const int row = blockIdx.x;
    const T* xr = x + (size_t)row * x_stride;
    const T* yr = y + (size_t)row * n;
    T* xo = x_out + (size_t)row * n;
    T* hr = h + (size_t)row * n;
    float yv[NV], xv[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        yv[k] = i < n ? to_f32(yr[i]) : 0.f;
        xv[k] = i < n ? to_f32(xr[i]) : 0.f;
    }
    float inv_y = 1.f;
    if (w_post != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NV; k++) ss += yv[k] * yv[k];
        inv_y = 1.0f / sqrtf(block_sum(ss, sh) / (float)n + eps);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) {
            float branch = yv[k];
            if (w_post != nullptr) branch = round_to<T>(branch * inv_y * to_f32(w_post[i]));
            const float s = round_to<T>(xv[k] + branch);
            xo[i] = from_f32<T>(s);
            xv[k] = s;
            ss += s * s;
        }
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, sh) / (float)n + eps);
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) hr[i] = from_f32<T>(xv[k] * inv * to_f32(w_next[i]));
    }
}

// 8 values of T from a 16-byte aligned address, as floats.
template <typename T> __device__ __forceinline__ void load8(const T* __restrict__ p, float* v);
template <> __device__ __forceinline__ void load8<__half>(const __half* __restrict__ p, float* v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; e++) { const float2 f = __half22float2(h[e]); v[2 * e] = f.x; v[2 * e + 1] = f.y; }
}
template <> __device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* __restrict__ p, float* v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; e++) { const float2 f = __bfloat1622float2(h[e]); v[2 * e] = f.x; v[2 * e + 1] = f.y; }
}

// y[t, o] = sum_i x[t, i] * w[o, i] for t < n_tok <= MAXT: one warp per output column o, 16-byte loads
// of w's row, accumulated in float32, rounded once to O. x rows are x_stride values apart; n_in a
// multiple of 8 and every row 16-byte aligned (the caller checks). ACT >= 0: w is a fused [Wg; Wu]
// ([2F, n_in]) and column o < F of the output is act(g) * u of its gate and up rows, each rounded to T
// first as the twin's [T, 2F] product is (ACT as strata_gated_act's).
template <typename T, typename O, int MAXT, int ACT>
__global__ void strata_gemv(const T* __restrict__ x, const T* __restrict__ w, O* __restrict__ y, int n_tok,
                            int n_in, int n_out, int x_stride) {
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (o >= n_out) return;
    constexpr int NW = ACT >= 0 ? 2 : 1;
    const T* wr[NW];
    wr[0] = w + (size_t)o * n_in;
    if constexpr (ACT >= 0) wr[1] = w + (size_t)(o + n_out) * n_in;
    float acc[NW][MAXT];
#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int t = 0; t < MAXT; t++) acc[r][t] = 0.f;
    for (int c = lane * 8; c < n_in; c += 256) {
        float wv[NW][8];
#pragma unroll
        for (int r = 0; r < NW; r++) load8<T>(wr[r] + c, wv[r]);
#pragma unroll
        for (int t = 0; t < MAXT; t++) {
            if (t < n_tok) {
                float xv[8];
                load8<T>(x + (size_t)t * x_stride + c, xv);
#pragma unroll
                for (int r = 0; r < NW; r++)
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[r][t] = fmaf(wv[r][e], xv[e], acc[r][t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAXT; t++) {
        if (t < n_tok) {
            float s[NW];
#pragma unroll
            for (int r = 0; r < NW; r++) s[r] = warp_sum(acc[r][t]);
            if (lane == 0) {
                float v = s[0];
                if constexpr (ACT >= 0) {
                    const float g = round_to<T>(s[0]), u = round_to<T>(s[1]);
                    v = (ACT == 0 ? g / (1.0f + expf(-g))
                                  : 0.5f * g * (1.0f + tanhf(GELU_C * (g + 0.044715f * g * g * g)))) * u;
                }
                y[(size_t)t * n_out + o] = from_f32<O>(v);
            }
        }
    }
}

// a better than b as np.argmax ranks them: a NaN beats any number (the first NaN wins), then the larger
// value, then on a tie the lower index.
__device__ __forceinline__ bool argmax_better(float a, int ai, float b, int bi) {
    const bool an = isnan(a), bn = isnan(b);
    if (an != bn) return an;
    if (!an && a != b) return a > b;
    return ai < bi;
}

// The best (value, index) of a block of NT threads by argmax_better, in thread 0.
template <int NT>
__device__ __forceinline__ void block_argmax(float& best, int& best_i) {
    __shared__ float s_val[NT / 32];
    __shared__ int s_idx[NT / 32];
    for (int off = 16; off > 0; off >>= 1) {
        const float v = __shfl_down_sync(0xffffffffu, best, off);
        const int vi = __shfl_down_sync(0xffffffffu, best_i, off);
        if (argmax_better(v, vi, best, best_i)) { best = v; best_i = vi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { s_val[warp] = best; s_idx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < NT / 32; w++)
            if (argmax_better(s_val[w], s_idx[w], best, best_i)) { best = s_val[w]; best_i = s_idx[w]; }
    }
}

// Argmax of logits [rows, n] in two launches, so a row of 262K values is read by many blocks: block (p, row)
// of strata_argmax_parts takes the p-th of gridDim.x spans of the row and writes its first maximal index and
// that value to part_idx / part_val [rows, parts]; strata_argmax_rows (a block per row) reduces a row's parts
// in order: out[row] = the row's first maximal index, out[rows + row] = its value's bits (one int32 buffer).
template <int NT>
__global__ void __launch_bounds__(NT) strata_argmax_parts(const float* __restrict__ logits, int n,
                                                          float* __restrict__ part_val, int* __restrict__ part_idx) {
    const float* row = logits + (size_t)blockIdx.y * n;
    const int span = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * span, hi = min(n, lo + span);
    float best = -INFINITY;
    int best_i = 0x7fffffff;  // an empty span loses to any index
    for (int i = lo + threadIdx.x; i < hi; i += NT) {  // ascending: a tie keeps the earlier index
        const float v = row[i];
        if (argmax_better(v, i, best, best_i)) { best = v; best_i = i; }
    }
    block_argmax<NT>(best, best_i);
    if (threadIdx.x == 0) {
        part_val[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = best;
        part_idx[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = best_i;
    }
}

template <int NT>
__global__ void __launch_bounds__(NT) strata_argmax_rows(const float* __restrict__ part_val,
                                                         const int* __restrict__ part_idx, int parts,
                                                         int* __restrict__ out) {
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < parts; i += NT) {
        const size_t at = (size_t)blockIdx.x * parts + i;
        if (argmax_better(part_val[at], part_idx[at], best, best_i)) { best = part_val[at]; best_i = part_idx[at]; }
    }
    block_argmax<NT>(best, best_i);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = best_i;
        out[gridDim.x + blockIdx.x] = __float_as_int(best);
    }
}
