// verity's CUDA kernels, compiled at load by NVRTC. Every kernel computes each activation row through the same
// sequence of operations whatever the number of rows in the launch, so a W-row verify is row-exact against the
// one-row step.

typedef unsigned char u8;
typedef unsigned short u16;

// GGML block types (the values of verity's `GgmlType` tags passed from the host).
#define T_F32 0
#define T_F16 1
#define T_BF16 2
#define T_Q4_0 3
#define T_Q4_1 4
#define T_Q8_0 5

#define MAX_ROWS 8

#define NEG_INF __int_as_float(0xff800000)

// IEEE half to float by bits (no cuda_fp16.h needed under NVRTC).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float f = m * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
        return sign ? -f : f;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ u16 ld16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

// Bytes of one 32-value block.
__device__ __forceinline__ int block_bytes(int ty) {
    switch (ty) {
        case T_F32: return 128;
        case T_F16: return 64;
        case T_BF16: return 64;
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        default: return 34;  // Q8_0
    }
}

// Decode block `b` of a row into v[32].
__device__ __forceinline__ void decode(int ty, const u8* row, int b, float* v) {
    const u8* p = row + (size_t)b * block_bytes(ty);
    switch (ty) {
        case T_F32: {
            const float* f = (const float*)p;
            for (int j = 0; j < 32; j++) v[j] = f[j];
            break;
        }
        case T_F16:
            for (int j = 0; j < 32; j++) v[j] = f16_to_f32(ld16(p + 2 * j));
            break;
        case T_BF16:
            for (int j = 0; j < 32; j++) v[j] = bf16_to_f32(ld16(p + 2 * j));
            break;
        case T_Q4_0: {
            float d = f16_to_f32(ld16(p));
            for (int j = 0; j < 16; j++) {
                u8 q = p[2 + j];
                v[j] = ((int)(q & 15) - 8) * d;
                v[j + 16] = ((int)(q >> 4) - 8) * d;
            }
            break;
        }
        case T_Q4_1: {
            float d = f16_to_f32(ld16(p)), m = f16_to_f32(ld16(p + 2));
            for (int j = 0; j < 16; j++) {
                u8 q = p[4 + j];
                v[j] = (q & 15) * d + m;
                v[j + 16] = (q >> 4) * d + m;
            }
            break;
        }
        default: {
            float d = f16_to_f32(ld16(p));
            for (int j = 0; j < 32; j++) v[j] = (float)(signed char)p[2 + j] * d;
        }
    }
}

// out[r * n + col] = sum_k x[r * k + kk] * w[col, kk] for rows r in [0, rows) (rows <= MAX_ROWS).
// One warp per output column: lane l takes blocks l, l + 32, ... in order, decodes each once and applies it to
// every row; the 32 partial sums are reduced in a fixed butterfly. A row's arithmetic never depends on `rows`.
extern "C" __global__ void matmul(const u8* w, int ty, int n, int k, const float* x, int rows, float* out) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    int nb = k / 32;
    const u8* row = w + (size_t)warp * nb * block_bytes(ty);
    float acc[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = 0.f;
    float v[32];
    for (int b = lane; b < nb; b += 32) {
        decode(ty, row, b, v);
        for (int r = 0; r < MAX_ROWS; r++) {
            if (r < rows) {
                const float* xr = x + (size_t)r * k + b * 32;
                float s = 0.f;
                for (int j = 0; j < 32; j++) s = fmaf(v[j], xr[j], s);
                acc[r] += s;
            }
        }
    }
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r < rows) {
            float s = acc[r];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) out[(size_t)r * n + warp] = s;
        }
    }
}

// out[r, :] = table row tokens[r] (one block of threads per row, one thread per 32-value block).
extern "C" __global__ void embed(const u8* w, int ty, int k, const unsigned int* tokens, float* out) {
    int r = blockIdx.x;
    int nb = k / 32;
    const u8* row = w + (size_t)tokens[r] * nb * block_bytes(ty);
    float v[32];
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        decode(ty, row, b, v);
        for (int j = 0; j < 32; j++) out[(size_t)r * k + b * 32 + j] = v[j];
    }
}

// RMS norm of each dim-long row (one block of 256 threads per row; fixed reduction tree).
extern "C" __global__ void rms_norm(const float* x, const float* w, int dim, float eps, float* out) {
    __shared__ float part[256];
    int r = blockIdx.x;
    const float* xr = x + (size_t)r * dim;
    float s = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    float scale = rsqrtf(part[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)r * dim + i] = xr[i] * scale * w[i];
}

// Rotate pairs of each head by the row's angles: cs[r * half + i] = (cos, sin) computed on the host.
extern "C" __global__ void rope(float* x, const float2* cs, int n_heads, int head_dim, int interleaved, int total) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int half = head_dim / 2;
    if (t >= total) return;
    int i = t % half;
    int h = (t / half) % n_heads;
    int r = t / (half * n_heads);
    float2 c = cs[r * half + i];
    float* head = x + ((size_t)r * n_heads + h) * head_dim;
    int a = interleaved ? 2 * i : i;
    int b = interleaved ? 2 * i + 1 : i + half;
    float x0 = head[a], x1 = head[b];
    head[a] = x0 * c.x - x1 * c.y;
    head[b] = x0 * c.y + x1 * c.x;
}

// Attention of row i, head h over committed slots [0, base) and the batch rows it sees (causal, or `mask` when
// non-null). One block per (row, head); scores in dynamic shared memory; every sum in a fixed order.
extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, int rows, int n_heads,
                                     int n_kv_heads, int head_dim, int base, float scale, const u8* mask,
                                     float* out) {
    extern __shared__ float sh[];
    __shared__ float red[128];
    int i = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    int kvh = h / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * head_dim;
    const float* qv = q + ((size_t)i * n_heads + h) * head_dim;
    int n = base + rows;
    // Scores (-inf where not visible).
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        bool sees = j < base || (mask ? mask[i * rows + (j - base)] != 0 : (j - base) <= i);
        float s = NEG_INF;
        if (sees) {
            const float* kv = kc + (size_t)j * kv_dim + kvh * head_dim;
            float d = 0.f;
            for (int e = 0; e < head_dim; e++) d = fmaf(qv[e], kv[e], d);
            s = d * scale;
        }
        sh[j] = s;
    }
    __syncthreads();
    // Max over slots: per-thread strided maxima, then a fixed tree.
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sh[j]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) sh[j] = sh[j] == NEG_INF ? 0.f : __expf(sh[j] - m);
    __syncthreads();
    float t = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) t += sh[j];
    red[threadIdx.x] = t;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    float inv = 1.f / red[0];
    // Output: each thread owns dims e, summing slots in order.
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < n; j++) acc = fmaf(sh[j], vc[(size_t)j * kv_dim + kvh * head_dim + e], acc);
        out[((size_t)i * n_heads + h) * head_dim + e] = acc * inv;
    }
}

extern "C" __global__ void swiglu(const float* g, const float* u, int n, float* out) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) {
        float x = g[t];
        out[t] = x / (1.f + __expf(-x)) * u[t];
    }
}

extern "C" __global__ void add_assign(float* x, const float* y, int n) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) x[t] += y[t];
}

extern "C" __global__ void add_bias(float* x, const float* b, int dim, int n) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) x[t] += b[t % dim];
}
