// verity's CUDA kernels, compiled at load by NVRTC. Every kernel computes each activation row through the same
// sequence of operations whatever the number of rows in the launch, so a W-row verify is row-exact against the
// one-row step. Per-forward inputs (token ids, positions, the first new cache slot, the mask) are read from the
// step buffer, never passed by value, so a recorded forward replays with new inputs.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// GGML block types (the values of verity's `GgmlType` tags passed from the host).
#define T_F32 0
#define T_F16 1
#define T_BF16 2
#define T_Q4_0 3
#define T_Q4_1 4
#define T_Q8_0 5

#define NEG_INF __int_as_float(0xff800000)

// The step buffer: int header {base, rows, tree, 0}, then u32 tokens[cap], int positions[cap], u8 mask[cap * cap]
// (row-major, written only for tree masks).
struct Step {
    int base, rows, tree;
    const u32* tokens;
    const int* positions;
    const u8* mask;
};

__device__ __forceinline__ Step read_step(const int* s, int cap) {
    Step st;
    st.base = s[0];
    st.rows = s[1];
    st.tree = s[2];
    st.tokens = (const u32*)(s + 4);
    st.positions = s + 4 + cap;
    st.mask = (const u8*)(s + 4 + 2 * cap);
    return st;
}

// IEEE half to float by bits (no cuda_fp16.h needed under NVRTC).
__device__ __forceinline__ float f16_to_f32(u32 h) {
    u32 sign = (h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float f = m * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
        return sign ? -f : f;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}

__device__ __forceinline__ float bf16_to_f32(u32 h) {
    return __uint_as_float((h & 0xffffu) << 16);
}

// Bytes of one 32-value block.
__host__ __device__ constexpr int block_bytes(int ty) {
    return ty == T_F32 ? 128 : ty == T_F16 || ty == T_BF16 ? 64 : ty == T_Q4_0 ? 18 : ty == T_Q4_1 ? 20 : 34;
}

// Decode block `b` of a row into v[32], with the widest loads the block's alignment allows (rows start at
// multiples of the row size; Q4_1 blocks are 4-byte aligned, Q4_0 and Q8_0 2-byte aligned).
template <int TY>
__device__ __forceinline__ void decode(const u8* row, int b, float* v) {
    const u8* p = row + (size_t)b * block_bytes(TY);
    if (TY == T_F32) {
        const float4* f = (const float4*)p;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float4 q = f[j];
            v[4 * j] = q.x;
            v[4 * j + 1] = q.y;
            v[4 * j + 2] = q.z;
            v[4 * j + 3] = q.w;
        }
    } else if (TY == T_F16 || TY == T_BF16) {
        const uint4* f = (const uint4*)p;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint4 q = f[j];
            u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int t = 0; t < 4; t++) {
                v[8 * j + 2 * t] = TY == T_F16 ? f16_to_f32(w[t] & 0xffff) : bf16_to_f32(w[t]);
                v[8 * j + 2 * t + 1] = TY == T_F16 ? f16_to_f32(w[t] >> 16) : bf16_to_f32(w[t] >> 16);
            }
        }
    } else if (TY == T_Q4_0) {
        const u16* h = (const u16*)p;
        float d = f16_to_f32(h[0]);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = h[1 + j];
            v[2 * j] = ((int)(q & 15) - 8) * d;
            v[2 * j + 16] = ((int)((q >> 4) & 15) - 8) * d;
            v[2 * j + 1] = ((int)((q >> 8) & 15) - 8) * d;
            v[2 * j + 17] = ((int)(q >> 12) - 8) * d;
        }
    } else if (TY == T_Q4_1) {
        const u32* w = (const u32*)p;
        u32 dm = w[0];
        float d = f16_to_f32(dm & 0xffff), m = f16_to_f32(dm >> 16);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 q = w[1 + j];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                u32 byte = (q >> (8 * t)) & 0xff;
                v[4 * j + t] = (byte & 15) * d + m;
                v[4 * j + t + 16] = (byte >> 4) * d + m;
            }
        }
    } else {
        const u16* h = (const u16*)p;
        float d = f16_to_f32(h[0]);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u32 q = h[1 + j];
            v[2 * j] = (float)(signed char)(q & 0xff) * d;
            v[2 * j + 1] = (float)(signed char)(q >> 8) * d;
        }
    }
}

// Dynamic-type decode for the embedding lookup (one row per token, not on the hot path).
__device__ __forceinline__ void decode_any(int ty, const u8* row, int b, float* v) {
    switch (ty) {
        case T_F32: decode<T_F32>(row, b, v); break;
        case T_F16: decode<T_F16>(row, b, v); break;
        case T_BF16: decode<T_BF16>(row, b, v); break;
        case T_Q4_0: decode<T_Q4_0>(row, b, v); break;
        case T_Q4_1: decode<T_Q4_1>(row, b, v); break;
        default: decode<T_Q8_0>(row, b, v);
    }
}

// 1 / sqrt(mean(x^2) + eps) of one dim-long row, by a block of 256 threads: strided partial sums, then a fixed
// tree in `part` (256 floats). The one definition of the norm's scale: the rms_norm kernel and the norm fused
// into the projections compute bitwise the same normed rows.
__device__ __forceinline__ float rms_scale(const float* xr, int dim, float eps, float* part) {
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    float scale = rsqrtf(part[0] / dim + eps);
    __syncthreads();  // `part` may be reused at once
    return scale;
}

// The projection kernel's blocks: MM_WARPS warps, each owning whole output columns (lane l takes the column's
// weight blocks l, l + 32, ...), all applying each decoded block to the block's group of up to ROWS_PER_GROUP
// rows. The group's rows of x are staged once in shared memory, each 32-value block padded to XPAD floats so
// that 32 lanes reading 32 different blocks hit distinct banks.
#define MM_WARPS 8
#define ROWS_PER_GROUP 8
#define XPAD 36

// One output column for RN staged rows (RN >= the group's rows; rows past them are computed from stale shared
// memory and never stored): acc[r] = sum over the lane's blocks of 32 fused multiply-adds in index order, then a
// fixed butterfly over the warp. The rows' chains are interleaved (independent, so they hide each other's
// latency) without changing any row's order of operations: a row gets the same bits for every RN.
template <int TY, int RN>
__device__ __forceinline__ void column(const u8* row, int nb, int lane, const float* xs,
                                       float (&acc)[ROWS_PER_GROUP]) {
    float v[32];
#pragma unroll
    for (int r = 0; r < ROWS_PER_GROUP; r++) acc[r] = 0.f;
    for (int b = lane; b < nb; b += 32) {
        decode<TY>(row, b, v);
        float s[RN];
#pragma unroll
        for (int r = 0; r < RN; r++) s[r] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int r = 0; r < RN; r++) {
                float4 a = ((const float4*)(xs + ((size_t)r * nb + b) * XPAD))[j];
                s[r] = fmaf(v[4 * j], a.x, s[r]);
                s[r] = fmaf(v[4 * j + 1], a.y, s[r]);
                s[r] = fmaf(v[4 * j + 2], a.z, s[r]);
                s[r] = fmaf(v[4 * j + 3], a.w, s[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < RN; r++) acc[r] += s[r];
    }
#pragma unroll
    for (int r = 0; r < RN; r++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
    }
}

template <int RN>
__device__ __forceinline__ void column_rows(int ty, const u8* row, int nb, int lane, const float* xs,
                                            float (&acc)[ROWS_PER_GROUP]) {
    switch (ty) {
        case T_F32: column<T_F32, RN>(row, nb, lane, xs, acc); break;
        case T_F16: column<T_F16, RN>(row, nb, lane, xs, acc); break;
        case T_BF16: column<T_BF16, RN>(row, nb, lane, xs, acc); break;
        case T_Q4_0: column<T_Q4_0, RN>(row, nb, lane, xs, acc); break;
        case T_Q4_1: column<T_Q4_1, RN>(row, nb, lane, xs, acc); break;
        default: column<T_Q8_0, RN>(row, nb, lane, xs, acc);
    }
}

__device__ __forceinline__ void column_any(int ty, const u8* row, int nb, int lane, const float* xs, int rn,
                                           float (&acc)[ROWS_PER_GROUP]) {
    if (rn <= 1) column_rows<1>(ty, row, nb, lane, xs, acc);
    else if (rn <= 2) column_rows<2>(ty, row, nb, lane, xs, acc);
    else if (rn <= 4) column_rows<4>(ty, row, nb, lane, xs, acc);
    else column_rows<8>(ty, row, nb, lane, xs, acc);
}

// One to three projections of the same input x (`rows` rows of k values), or of its RMS norm when
// norm_w is non-null (computed exactly as the rms_norm kernel does: 256 strided partial sums, a fixed tree):
// o_m[r * n_m + c] (+)= sum_kk x[r * k + kk] * w_m[c, kk], with `accumulate` adding the finished sum to o_m.
// With `glu`, w0 and w1 are the gate and up projections (n0 == n1) and o0[r * n0 + c] = silu(gate) * up.
// Grid: (column tiles of MM_WARPS * cols_per_warp columns, row groups). A row's arithmetic never depends on
// `rows` or on the grid.
extern "C" __global__ void matmuls(const float* x, int k, int rows, int accumulate, const float* norm_w,
                                   float eps, int glu, int cols_per_warp,
                                   const u8* w0, int ty0, int n0, float* o0,
                                   const u8* w1, int ty1, int n1, float* o1,
                                   const u8* w2, int ty2, int n2, float* o2) {
    extern __shared__ float xs[];
    __shared__ float part[256];
    int nb = k / 32;
    int r0 = blockIdx.y * ROWS_PER_GROUP;
    int rn = min(ROWS_PER_GROUP, rows - r0);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int total = glu ? n0 : n0 + n1 + n2;
    {
        // Start this warp's first weight blocks on their way from memory while x is staged.
        int col = (blockIdx.x * MM_WARPS + warp) * cols_per_warp;
        if (col < total && lane < nb) {
            const u8* w = w0;
            int ty = ty0;
            if (!glu && col >= n0 + n1) {
                col -= n0 + n1; w = w2; ty = ty2;
            } else if (!glu && col >= n0) {
                col -= n0; w = w1; ty = ty1;
            }
            const u8* p = w + ((size_t)col * nb + lane) * block_bytes(ty);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
            if (glu) asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + ((size_t)col * nb + lane) * block_bytes(ty1)));
        }
    }
    for (int r = 0; r < rn; r++) {
        const float* xr = x + (size_t)(r0 + r) * k;
        float* sr = xs + (size_t)r * nb * XPAD;
        float scale = norm_w ? rms_scale(xr, k, eps, part) : 1.f;
        for (int i = threadIdx.x; i < k; i += blockDim.x)
            sr[(i >> 5) * XPAD + (i & 31)] = norm_w ? xr[i] * scale * norm_w[i] : xr[i];
    }
    __syncthreads();
    for (int c = 0; c < cols_per_warp; c++) {
        int col = (blockIdx.x * MM_WARPS + warp) * cols_per_warp + c;
        if (col >= total) break;  // uniform across the warp
        const u8* w = w0;
        int ty = ty0, n = n0;
        float* o = o0;
        if (!glu && col >= n0 + n1) {
            col -= n0 + n1; w = w2; ty = ty2; n = n2; o = o2;
        } else if (!glu && col >= n0) {
            col -= n0; w = w1; ty = ty1; n = n1; o = o1;
        }
        float acc[ROWS_PER_GROUP];
        column_any(ty, w + (size_t)col * nb * block_bytes(ty), nb, lane, xs, rn, acc);
        if (glu) {
            float up[ROWS_PER_GROUP];
            column_any(ty1, w1 + (size_t)col * nb * block_bytes(ty1), nb, lane, xs, rn, up);
#pragma unroll
            for (int r = 0; r < ROWS_PER_GROUP; r++) acc[r] = acc[r] / (1.f + __expf(-acc[r])) * up[r];
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS_PER_GROUP; r++) {
                if (r < rn) {
                    float* dst = o + (size_t)(r0 + r) * n + col;
                    *dst = accumulate ? *dst + acc[r] : acc[r];
                }
            }
        }
    }
}

// out[r, :] = table row step.tokens[r] (one block of threads per row, one thread per 32-value block).
extern "C" __global__ void embed(const u8* w, int ty, int k, const int* step, int cap, float* out) {
    Step st = read_step(step, cap);
    int r = blockIdx.x;
    int nb = k / 32;
    const u8* row = w + (size_t)st.tokens[r] * nb * block_bytes(ty);
    float v[32];
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        decode_any(ty, row, b, v);
        for (int j = 0; j < 32; j++) out[(size_t)r * k + b * 32 + j] = v[j];
    }
}

// RMS norm of each dim-long row (one block of 256 threads per row).
extern "C" __global__ void rms_norm(const float* x, const float* w, int dim, float eps, float* out) {
    __shared__ float part[256];
    int r = blockIdx.x;
    const float* xr = x + (size_t)r * dim;
    float scale = rms_scale(xr, dim, eps, part);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)r * dim + i] = xr[i] * scale * w[i];
}

// RoPE of every Q head (in place) and K head (into the cache slot step.base + r), and V copied to its slot.
// Threads [0, rows * (n_heads + n_kv_heads) * half) rotate one pair each; the next rows * kv_dim copy V. The
// angle is computed in double precision and rounded once, as the host's `rope_angle` does.
extern "C" __global__ void rope_and_cache(float* q, const float* k, const float* v, float* kc, float* vc,
                                          int rows, int n_heads, int n_kv_heads, int head_dim, float theta,
                                          int interleaved, const int* step, int cap) {
    Step st = read_step(step, cap);
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int half = head_dim / 2;
    int heads = n_heads + n_kv_heads;
    int kv_dim = n_kv_heads * head_dim;
    int rotations = rows * heads * half;
    if (t >= rotations) {
        t -= rotations;
        if (t < rows * kv_dim) {
            int r = t / kv_dim;
            vc[(size_t)(st.base + r) * kv_dim + t % kv_dim] = v[t];
        }
        return;
    }
    int i = t % half;
    int h = (t / half) % heads;
    int r = t / (half * heads);
    double a = (double)st.positions[r] * pow((double)theta, -2.0 * i / (double)head_dim);
    float c = (float)cos(a), s = (float)sin(a);
    int ia = interleaved ? 2 * i : i;
    int ib = interleaved ? 2 * i + 1 : i + half;
    if (h < n_heads) {
        float* head = q + ((size_t)r * n_heads + h) * head_dim;
        float x0 = head[ia], x1 = head[ib];
        head[ia] = x0 * c - x1 * s;
        head[ib] = x0 * s + x1 * c;
    } else {
        h -= n_heads;
        const float* head = k + ((size_t)r * n_kv_heads + h) * head_dim;
        float* dst = kc + (size_t)(st.base + r) * kv_dim + h * head_dim;
        float x0 = head[ia], x1 = head[ib];
        dst[ia] = x0 * c - x1 * s;
        dst[ib] = x0 * s + x1 * c;
    }
}

// Attention of each (row, head) over committed slots [0, base) and the batch rows the row sees (causal, or the
// step's tree mask), split over the slots for parallelism (flash-decoding), deterministically:
// - slots are cut into chunks of ATT_CHUNK by absolute index; ATT_SPLIT blocks per (row, head) take chunks
//   c = blockIdx.x, + ATT_SPLIT, ...; each chunk's max, exp-sum and value sums are written to `work`;
// - the block that finishes last (a counter per (row, head), reset by that block) combines the chunks in
//   chunk order.
// Every sum's order depends on slot indices alone, never on the number of slots or rows, and slots a row does
// not see add exact zeros, so a row gives the same bits alone or in a batch. Rows row0 .. row0 + gridDim.y /
// n_heads of the step; `work` holds 16 * n_heads counters, then per (row, head) `chunks` records of
// {max, sum, head_dim value sums}.
#define ATT_CHUNK 64
#define ATT_SPLIT 8
#define MAX_HEAD_DIM 256

extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, int row0, int n_heads,
                                     int n_kv_heads, int head_dim, float scale, const int* step, int cap,
                                     float* work, int chunks, float* out) {
    __shared__ float sc[ATT_CHUNK];
    __shared__ float red[ATT_CHUNK];
    __shared__ float quarter[4][MAX_HEAD_DIM];
    __shared__ int last;
    Step st = read_step(step, cap);
    int base = st.base, rows = st.rows, n = base + rows;
    int t = threadIdx.x;
    int rh = blockIdx.y;
    int i = row0 + rh / n_heads, h = rh % n_heads;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * head_dim;
    int rec = head_dim + 2;
    const float* qv = q + ((size_t)i * n_heads + h) * head_dim;
    const float* kh = kc + kvh * head_dim;
    const float* vh = vc + kvh * head_dim;
    unsigned int* counters = (unsigned int*)work;
    float* records = work + 16 * n_heads + (size_t)rh * chunks * rec;
    for (int c = blockIdx.x; c * ATT_CHUNK < n; c += ATT_SPLIT) {
        int j0 = c * ATT_CHUNK;
        // Scores: four threads per slot, each a quarter of the head's dims, then a fixed butterfly.
        int js = t >> 2, sub = t & 3, j = j0 + js;
        bool sees = j < n && (j < base || (st.tree ? st.mask[i * rows + (j - base)] != 0 : (j - base) <= i));
        float d = 0.f;
        if (sees) {
            const float* kv = kh + (size_t)j * kv_dim;
            if ((head_dim & 15) == 0) {
                int w = head_dim / 16;  // float4s per quarter
                const float4* k4 = (const float4*)kv + sub * w;
                const float4* q4 = (const float4*)qv + sub * w;
                for (int e = 0; e < w; e++) {
                    float4 a = q4[e], b = k4[e];
                    d = fmaf(a.x, b.x, d);
                    d = fmaf(a.y, b.y, d);
                    d = fmaf(a.z, b.z, d);
                    d = fmaf(a.w, b.w, d);
                }
            } else {
                for (int e = sub; e < head_dim; e += 4) d = fmaf(qv[e], kv[e], d);
            }
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        if (sub == 0) sc[js] = sees ? d * scale : NEG_INF;
        __syncthreads();
        if (t < ATT_CHUNK) red[t] = sc[t];
        __syncthreads();
        for (int o = ATT_CHUNK / 2; o > 0; o >>= 1) {
            if (t < o) red[t] = fmaxf(red[t], red[t + o]);
            __syncthreads();
        }
        float m = red[0];
        __syncthreads();
        if (t < ATT_CHUNK) {
            float p = sc[t] == NEG_INF ? 0.f : __expf(sc[t] - m);
            sc[t] = p;
            red[t] = p;
        }
        __syncthreads();
        for (int o = ATT_CHUNK / 2; o > 0; o >>= 1) {
            if (t < o) red[t] += red[t + o];
            __syncthreads();
        }
        // Value sums: each quarter of the chunk's slots in order, then the quarters in order.
        for (int u = t; u < 4 * head_dim; u += blockDim.x) {
            int qq = u / head_dim, e = u % head_dim;
            float a = 0.f;
            for (int jj = qq * (ATT_CHUNK / 4); jj < (qq + 1) * (ATT_CHUNK / 4); jj++) {
                if (j0 + jj < n) a = fmaf(sc[jj], vh[(size_t)(j0 + jj) * kv_dim + e], a);
            }
            quarter[qq][e] = a;
        }
        __syncthreads();
        float* r = records + (size_t)c * rec;
        for (int e = t; e < head_dim; e += blockDim.x)
            r[2 + e] = ((quarter[0][e] + quarter[1][e]) + quarter[2][e]) + quarter[3][e];
        if (t == 0) {
            r[0] = m;
            r[1] = red[0];
        }
        __syncthreads();
    }
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(&counters[rh], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (t == 0) counters[rh] = 0;
    int nc = (n + ATT_CHUNK - 1) / ATT_CHUNK;
    float big = NEG_INF;
    for (int c = 0; c < nc; c++) big = fmaxf(big, __ldcg(records + (size_t)c * rec));
    float den = 0.f;
    for (int c = 0; c < nc; c++) {
        float mc = __ldcg(records + (size_t)c * rec);
        float f = mc == NEG_INF ? 0.f : __expf(mc - big);
        den = fmaf(f, __ldcg(records + (size_t)c * rec + 1), den);
    }
    for (int e = t; e < head_dim; e += blockDim.x) {
        float num = 0.f;
        for (int c = 0; c < nc; c++) {
            float mc = __ldcg(records + (size_t)c * rec);
            float f = mc == NEG_INF ? 0.f : __expf(mc - big);
            num = fmaf(f, __ldcg(records + (size_t)c * rec + 2 + e), num);
        }
        out[((size_t)i * n_heads + h) * head_dim + e] = num / den;
    }
}

extern "C" __global__ void add_bias(float* x, const float* b, int dim, int n) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) x[t] += b[t % dim];
}
