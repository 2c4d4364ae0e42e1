// verity's CUDA kernels, compiled at load by NVRTC. Every kernel computes each activation row through the same
// sequence of operations whatever the number of rows in the launch, so a W-row verify is row-exact against the
// one-row step. Per-forward inputs (token ids, positions, the first new cache slot, the mask) are read from the
// step buffer, never passed by value, so a recorded forward replays with new inputs.
//
// Programmatic dependent launch (sm_90): every kernel waits for the grid before it (`wait_inputs`) before it
// reads anything an earlier kernel wrote, then lets the next grid start (`release_dependents`), whose blocks
// fetch their weights (which no kernel writes) while this one runs. Every kernel waits, so completion stays
// transitive along the stream.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// The weight type tags (`T_F32`, `T_Q4_K`, `T_TQ4_K`, ...) are defined ahead of this source by the host, from
// its one table (`types.rs`): GGML blocks as stored (`T_<type>`), repacked into tensor-core tiles (`T_TQ<type>`,
// `tiles.rs`), MLX affine re-laid into 32-value blocks [scale f32][bias f32][quants] (`T_AFF4`, `T_AFF8`,
// `affine.rs`).

// IQ4_NL's and IQ4_XS's 16 levels (ggml `kvalues_iq4nl`).
__device__ __constant__ signed char IQ4_GRID[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                    1,    13,   25,  38,  53,  69,  89,  113};

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void wait_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel that only orders itself after the grid before and returns (the measurement switches below).
#define WAIT_AND_RETURN        \
    {                          \
        wait_inputs();         \
        release_dependents();  \
        return;                \
    }
// `-DLAUNCH_FLOOR` (through `VERITY_CUDA_NVRTC`): every kernel does only that, so a forward costs its launch
// boundaries alone — a measurement of the floor, never a result.
#ifdef LAUNCH_FLOOR
#define FLOOR_EXIT WAIT_AND_RETURN
#else
#define FLOOR_EXIT
#endif
// Knockouts, for the same kind of measurement: `-DKO_STAGE` (the projections' staging of x: no norm, no
// quantization), `-DKO_ATT` (attention returns after its wait),
// `-DKO_ATT_ONEHEAD` (attention's dot products and value sums for a block's first head only), `-DKO_ATT_NOCOMBINE`
// (no combine of the chunks).
// Each removes one part's time from a forward and computes garbage — never a result (the host admits every
// shape unchecked under one, so W-row launches are timed as they would run).

// The step buffer: int header {base, rows, tree, views offset in bytes}, then u32 tokens[cap], int positions[cap],
// per prepared rotation its rows' (cos, sin) pairs (`CudaStep`), and under a tree mask each row's view of the
// step's rows (`views.rs`): u16 counts[rows], then u16 seen[rows][rows], row i's seen rows in increasing order.
struct Step {
    int base, rows, tree;
    const u32* tokens;
    const int* positions;
    const unsigned short* counts;
    const unsigned short* seen;
};

__device__ __forceinline__ Step read_step(const int* s, int cap) {
    Step st;
    st.base = s[0];
    st.rows = s[1];
    st.tree = s[2];
    st.tokens = (const u32*)(s + 4);
    st.positions = s + 4 + cap;
    st.counts = (const unsigned short*)((const u8*)s + s[3]);
    st.seen = st.counts + st.rows;
    return st;
}

// The slot holding key j of step row i's view: committed slots [0, base) as they are; from base on, the step rows
// the row sees in row order (under a tree mask; causally, the slots themselves), so that every key has the index
// it has in a one-row step at the row's position and a row's sums associate as AR's (`views.rs`); past the keys
// the row sees, slot j itself (a finite value for loads whose weight is zero).
__device__ __forceinline__ int view_slot(const Step& st, int i, int j) {
    int k = j - st.base;
    return st.tree && k >= 0 && k < (int)st.counts[i] ? st.base + st.seen[i * st.rows + k] : j;
}

// How many of the step's rows row i sees.
__device__ __forceinline__ int step_keys(const Step& st, int i) { return st.tree ? (int)st.counts[i] : i + 1; }

// IEEE half (the low 16 bits of h) to float: one exact conversion instruction, no branches (no cuda_fp16.h
// needed under NVRTC). Branch-free matters: it sits inside the projections' per-block chains.
__device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    unsigned short s = (unsigned short)(h & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u32 h) {
    return __uint_as_float((h & 0xffffu) << 16);
}

// Bytes of one 32-value block of the block formats, of one 256-value super-block of the K-quants.
__host__ __device__ constexpr int block_bytes(int ty) {
    return ty == T_F32 ? 128
         : ty == T_F16 || ty == T_BF16 ? 64
         : ty == T_Q4_0 ? 18
         : ty == T_Q4_1 ? 20
         : ty == T_Q5_0 ? 22
         : ty == T_Q5_1 ? 24
         : ty == T_IQ4_NL ? 18
         : ty == T_AFF4 ? 24
         : ty == T_AFF8 ? 40
         : 34;
}

__host__ __device__ constexpr int super_bytes(int ty) {
    return ty == T_Q4_K    ? 144
           : ty == T_Q5_K  ? 176
           : ty == T_IQ4_XS ? 136
           : ty == T_Q2_K  ? 84
           : ty == T_Q3_K  ? 110
                           : 210;
}

// The 256-value super-block formats (a block b is sub-block b % 8 of super-block b / 8).
__host__ __device__ constexpr bool is_k_quant(int ty) {
    return ty == T_Q4_K || ty == T_Q5_K || ty == T_Q6_K || ty == T_IQ4_XS || ty == T_Q2_K || ty == T_Q3_K;
}

// 32 values on the IQ4 grid scaled by d from 16 bytes of nibbles (low nibbles first), as the host decodes them.
__device__ __forceinline__ void decode_iq4(const u8* qs, float d, float* v) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 byte = qs[j];
        v[j] = d * (float)IQ4_GRID[byte & 15];
        v[j + 16] = d * (float)IQ4_GRID[byte >> 4];
    }
}
__host__ __device__ constexpr bool is_tiled(int ty) {
    return ty == T_TQ4_0 || ty == T_TQ4_1 || ty == T_TQ8_0 || (ty >= T_TQ5_0 && ty <= T_TQ6_K);
}

// The tiled layout of an n × k matrix (`tiles.rs` documents it byte by byte; nb = k / 32 blocks per row, `tiles`
// = ceil(n / 16)): first the quants, per (tile, block) `tile_quant_bytes` bytes in the order the lanes of an
// m16n8k32 MMA load them as its A fragment (lane = 4 * g + i holds values 4i..4i+3 and 16 + 4i.. of rows g and
// g + 8 of the tile: Q8_0 as signed bytes, the others as nibbles, then the 5- and 6-bit formats' high bits);
// then per tile its scales, `tile_scale_bytes`: legacy formats 16 words per block (f16 d, and Q4_1/Q5_1's f16
// m in the high half), K-quants per super-block 16 words (f16 d, Q4_K/Q5_K's dmin in the high half) and per
// block 16 u16 (Q4_K/Q5_K: 6-bit scale | min << 8; Q6_K: the signed scales of the two 16-value halves). Rows
// past n are zero.
__host__ __device__ constexpr bool tiled_k(int ty) { return ty == T_TQ4_K || ty == T_TQ5_K || ty == T_TQ6_K; }
__host__ __device__ constexpr int tile_planes(int ty) {
    return ty == T_TQ6_K ? 2 : ty == T_TQ5_0 || ty == T_TQ5_1 || ty == T_TQ5_K ? 1 : 0;
}
__host__ __device__ constexpr int tile_quant_bytes(int ty) { return ty == T_TQ8_0 ? 512 : 256 + 64 * tile_planes(ty); }
__host__ __device__ constexpr int tile_scale_bytes(int ty, int nb) { return tiled_k(ty) ? nb * 40 : nb * 64; }
// Integer sums per (block, row, column): Q6_K's halves have their own scales.
__host__ __device__ constexpr int tile_sums(int ty) { return ty == T_TQ6_K ? 2 : 1; }
// What each value is offset by, in every byte (subtracted exactly in the fragment).
__host__ __device__ constexpr u32 tile_offset(int ty) {
    return ty == T_TQ4_0 ? 0x08080808u : ty == T_TQ5_0 ? 0x10101010u : ty == T_TQ6_K ? 0x20202020u : 0u;
}
__host__ __device__ constexpr bool tile_has_min(int ty) {
    return ty == T_TQ4_1 || ty == T_TQ5_1 || ty == T_TQ4_K || ty == T_TQ5_K;
}

// A pointer inside block b of output column `col` (for prefetching).
__device__ __forceinline__ const u8* block_ptr(int ty, const u8* w, int col, int nb, int tiles, int b) {
    if (is_tiled(ty)) return w + ((size_t)(col >> 4) * nb + b) * tile_quant_bytes(ty);
    if (is_k_quant(ty)) return w + ((size_t)col * (nb / 8) + b / 8) * super_bytes(ty);
    return w + ((size_t)col * nb + b) * block_bytes(ty);
}

// Tile `lt`'s scales.
__device__ __forceinline__ const u8* tile_scales(int ty, const u8* w, int tiles, int nb, int lt) {
    return w + (size_t)tiles * nb * tile_quant_bytes(ty) + (size_t)lt * tile_scale_bytes(ty, nb);
}

// Block b's stored scales for column c (0..15) of a tile whose scales are at `ts` (global or shared memory):
// the word (legacy: per block; K-quants: per super-block) and the K-quants' per-block pair.
struct ScaleRaw {
    u32 w, p;
};
template <int TY>
__device__ __forceinline__ ScaleRaw scale_raw(const u8* ts, int b, int c) {
    if (tiled_k(TY)) {
        const u8* sup = ts + (b >> 3) * 320;
        return {((const u32*)sup)[c], ((const u16*)(sup + 64))[(b & 7) * 16 + c]};
    }
    return {((const u32*)ts)[b * 16 + c], 0u};
}

// A block's exact scales (products of an f16 and an integer of at most 8 bits, exact in f32): d0 of values
// 0..15, d1 of values 16..31 (different for Q6_K only), the additive term m (Q4_1/Q5_1's m, the K-quants'
// -dmin * min) — the CPU's integer view (`IntBlock`) of the same block.
struct BlockScale {
    float d0, d1, m;
};
template <int TY>
__device__ __forceinline__ BlockScale block_scale(ScaleRaw s) {
    float d = f16_to_f32(s.w & 0xffff);
    if (TY == T_TQ4_K || TY == T_TQ5_K)
        return {d * (float)(s.p & 0xff), d * (float)(s.p & 0xff), -(f16_to_f32(s.w >> 16) * (float)(s.p >> 8))};
    if (TY == T_TQ6_K) return {d * (float)(signed char)(s.p & 0xff), d * (float)(signed char)(s.p >> 8), 0.f};
    return {d, d, tile_has_min(TY) ? f16_to_f32(s.w >> 16) : 0.f};
}

__device__ __forceinline__ void k4_scale_min(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Decode the 32 values of block b of output column `col` into v[32] (the host decoders' arithmetic), with the
// widest loads the block's alignment allows (rows start at multiples of the row size; Q4_1 and Q5_1 blocks are
// 4-byte aligned, Q4_0, Q5_0 and Q8_0 2-byte aligned). K-quant block b is sub-block b % 8 of super-block b / 8.
template <int TY>
__device__ __forceinline__ void decode(const u8* w, int col, int nb, int tiles, int b, float* v) {
    if (is_tiled(TY)) {
        // The integer view read back from the tile (`tiles.rs`), then the host decoder's arithmetic: every
        // product of a value and its scale is exact, so how the compiler contracts it changes no bits.
        int j = col & 15, g = j & 7, hi = j >> 3;
        const u8* q = w + ((size_t)(col >> 4) * nb + b) * tile_quant_bytes(TY);
        BlockScale s = block_scale<TY>(scale_raw<TY>(tile_scales(TY, w, tiles, nb, col >> 4), b, j));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int lane = 4 * g + i;
            if (TY == T_TQ8_0) {
                u32 lo = *(const u32*)(q + lane * 16 + hi * 4), up = *(const u32*)(q + lane * 16 + 8 + hi * 4);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    v[4 * i + e] = (float)(signed char)((lo >> (8 * e)) & 0xff) * s.d0;
                    v[16 + 4 * i + e] = (float)(signed char)((up >> (8 * e)) & 0xff) * s.d0;
                }
                continue;
            }
            u32 word = *(const u32*)(q + lane * 8 + hi * 4);
            u32 h = tile_planes(TY) == 1 ? (u32)((const u16*)(q + 256))[lane]
                  : tile_planes(TY) == 2 ? ((const u32*)(q + 256))[lane]
                                          : 0u;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int lo = (word >> (8 * e)) & 15, up = (word >> (8 * e + 4)) & 15;
                if (tile_planes(TY) == 1) {
                    lo |= ((h >> (4 * e + 2 * hi)) & 1) << 4;
                    up |= ((h >> (4 * e + 2 * hi + 1)) & 1) << 4;
                } else if (tile_planes(TY) == 2) {
                    lo |= ((h >> (8 * e + 4 * hi)) & 3) << 4;
                    up |= ((h >> (8 * e + 4 * hi + 2)) & 3) << 4;
                }
                int off = (int)(tile_offset(TY) & 0xff);
                if (tile_has_min(TY)) {
                    v[4 * i + e] = __fadd_rn(__fmul_rn((float)lo, s.d0), s.m);
                    v[16 + 4 * i + e] = __fadd_rn(__fmul_rn((float)up, s.d1), s.m);
                } else {
                    v[4 * i + e] = (float)(lo - off) * s.d0;
                    v[16 + 4 * i + e] = (float)(up - off) * s.d1;
                }
            }
        }
        return;
    }
    if (is_k_quant(TY)) {
        const u8* p = w + ((size_t)col * (nb / 8) + b / 8) * super_bytes(TY);
        int j = b & 7;
        if (TY == T_IQ4_XS) {
            // [d][2 high bits of 8 scales][4 low bits of 8 scales][8 × 16 bytes of nibbles]
            u32 sh = *(const u16*)(p + 2);
            int ls = ((p[4 + (j >> 1)] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            decode_iq4(p + 8 + 16 * j, f16_to_f32(*(const u16*)p) * (float)(ls - 32), v);
            return;
        }
        if (TY == T_Q2_K) {
            // [16 scale bytes: scale low nibble, min high][64 bytes of 2-bit values][d][dmin]
            float d = f16_to_f32(*(const u16*)(p + 80)), dmin = f16_to_f32(*(const u16*)(p + 82));
            const u8* qs = p + 16 + (j >> 2) * 32;
            int shift = 2 * (j & 3);
#pragma unroll
            for (int l = 0; l < 32; l++) {
                int sc = p[2 * j + l / 16];
                v[l] = d * (float)(sc & 15) * (float)((qs[l] >> shift) & 3) - dmin * (float)(sc >> 4);
            }
            return;
        }
        if (TY == T_Q3_K) {
            // [32 bytes of high bits][64 bytes of 2-bit values][12 bytes of 6-bit scales][d]
            float d = f16_to_f32(*(const u16*)(p + 108));
            const u8* qs = p + 32 + (j >> 2) * 32;
            const u8* sc = p + 96;
            int shift = 2 * (j & 3);
#pragma unroll
            for (int l = 0; l < 32; l++) {
                int s = 2 * j + l / 16;
                int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
                int scale = (low | (((sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3) << 4)) - 32;
                int q = (int)((qs[l] >> shift) & 3) + (int)(((p[l] >> j) & 1) << 2) - 4;
                v[l] = d * (float)scale * (float)q;
            }
            return;
        }
        if (TY == T_Q6_K) {
            const u8* ql = p + (j >> 2) * 64;
            const u8* qh = p + 128 + (j >> 2) * 32;
            const signed char* sc = (const signed char*)(p + 192 + (j >> 2) * 8);
            float d = f16_to_f32(*(const u16*)(p + 208));
            int qq = j & 3;
            const u8* lo = ql + (qq & 1) * 32;
#pragma unroll
            for (int l = 0; l < 32; l++) {
                int low = qq < 2 ? lo[l] & 0x0f : lo[l] >> 4;
                int q = (low | (((qh[l] >> (2 * qq)) & 3) << 4)) - 32;
                v[l] = d * (float)sc[l / 16 + 2 * qq] * (float)q;
            }
            return;
        }
        float d = f16_to_f32(*(const u16*)p), dmin = f16_to_f32(*(const u16*)(p + 2));
        int sc, mi;
        k4_scale_min(j, p + 4, &sc, &mi);
        float d1 = d * (float)sc, m1 = dmin * (float)mi;
        const u8* qs = p + (TY == T_Q4_K ? 16 : 48) + (j >> 1) * 32;
        const u8* qh = p + 16;
        int shift = (j & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; l++) {
            int q = (qs[l] >> shift) & 0x0f;
            if (TY == T_Q5_K) q += ((qh[l] >> j) & 1) << 4;
            v[l] = d1 * (float)q - m1;
        }
        return;
    }
    const u8* p = w + ((size_t)col * nb + b) * block_bytes(TY);
    if (TY == T_AFF4 || TY == T_AFF8) {
        // scale * q + bias, rounded after the multiply and after the add (no FMA): the CPU decoder's bits.
        const float* sb = (const float*)p;
        float scale = sb[0], bias = sb[1];
        const u32* q = (const u32*)(p + 8);
#pragma unroll
        for (int j = 0; j < (TY == T_AFF4 ? 4 : 8); j++) {
            u32 word = q[j];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                u32 byte = (word >> (8 * e)) & 0xff;
                if (TY == T_AFF4) {
                    v[8 * j + 2 * e] = __fadd_rn(__fmul_rn(scale, (float)(byte & 15)), bias);
                    v[8 * j + 2 * e + 1] = __fadd_rn(__fmul_rn(scale, (float)(byte >> 4)), bias);
                } else {
                    v[4 * j + e] = __fadd_rn(__fmul_rn(scale, (float)byte), bias);
                }
            }
        }
    } else if (TY == T_F32) {
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
        const u32* words = (const u32*)p;
        u32 dm = words[0];
        float d = f16_to_f32(dm & 0xffff), m = f16_to_f32(dm >> 16);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 q = words[1 + j];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                u32 byte = (q >> (8 * t)) & 0xff;
                v[4 * j + t] = (byte & 15) * d + m;
                v[4 * j + t + 16] = (byte >> 4) * d + m;
            }
        }
    } else if (TY == T_IQ4_NL) {
        decode_iq4(p + 2, f16_to_f32(*(const u16*)p), v);
    } else if (TY == T_Q5_0 || TY == T_Q5_1) {
        // [d][m, Q5_1 only][32 high bits][16 bytes of low nibbles]: value i is nibble i with high bit i as its
        // fifth bit; (q - 16) * d for Q5_0, q * d + m for Q5_1, rounded as the host decoder rounds (no FMA).
        const u16* h = (const u16*)p;
        float d = f16_to_f32(h[0]);
        const int at = TY == T_Q5_1 ? 2 : 1;
        float m = TY == T_Q5_1 ? f16_to_f32(h[1]) : 0.f;
        u32 qh = (u32)h[at] | ((u32)h[at + 1] << 16);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            u32 q = h[at + 2 + j];
#pragma unroll
            for (int t = 0; t < 2; t++) {
                int i = 2 * j + t;
                u32 byte = (q >> (8 * t)) & 0xff;
                int lo = (int)((byte & 15) | (((qh >> i) & 1) << 4));
                int hi = (int)((byte >> 4) | (((qh >> (i + 16)) & 1) << 4));
                if (TY == T_Q5_0) {
                    v[i] = (float)(lo - 16) * d;
                    v[i + 16] = (float)(hi - 16) * d;
                } else {
                    v[i] = __fadd_rn(__fmul_rn((float)lo, d), m);
                    v[i + 16] = __fadd_rn(__fmul_rn((float)hi, d), m);
                }
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
__device__ __forceinline__ void decode_any(int ty, const u8* w, int col, int nb, int tiles, int b, float* v) {
    switch (ty) {
        case T_F32: decode<T_F32>(w, col, nb, tiles, b, v); break;
        case T_F16: decode<T_F16>(w, col, nb, tiles, b, v); break;
        case T_BF16: decode<T_BF16>(w, col, nb, tiles, b, v); break;
        case T_Q4_0: decode<T_Q4_0>(w, col, nb, tiles, b, v); break;
        case T_Q4_1: decode<T_Q4_1>(w, col, nb, tiles, b, v); break;
        case T_Q5_0: decode<T_Q5_0>(w, col, nb, tiles, b, v); break;
        case T_Q5_1: decode<T_Q5_1>(w, col, nb, tiles, b, v); break;
        case T_IQ4_NL: decode<T_IQ4_NL>(w, col, nb, tiles, b, v); break;
        case T_IQ4_XS: decode<T_IQ4_XS>(w, col, nb, tiles, b, v); break;
        case T_Q8_0: decode<T_Q8_0>(w, col, nb, tiles, b, v); break;
        case T_Q4_K: decode<T_Q4_K>(w, col, nb, tiles, b, v); break;
        case T_Q5_K: decode<T_Q5_K>(w, col, nb, tiles, b, v); break;
        case T_Q6_K: decode<T_Q6_K>(w, col, nb, tiles, b, v); break;
        case T_Q2_K: decode<T_Q2_K>(w, col, nb, tiles, b, v); break;
        case T_Q3_K: decode<T_Q3_K>(w, col, nb, tiles, b, v); break;
        case T_TQ4_0: decode<T_TQ4_0>(w, col, nb, tiles, b, v); break;
        case T_TQ4_1: decode<T_TQ4_1>(w, col, nb, tiles, b, v); break;
        case T_TQ5_0: decode<T_TQ5_0>(w, col, nb, tiles, b, v); break;
        case T_TQ5_1: decode<T_TQ5_1>(w, col, nb, tiles, b, v); break;
        case T_TQ4_K: decode<T_TQ4_K>(w, col, nb, tiles, b, v); break;
        case T_TQ5_K: decode<T_TQ5_K>(w, col, nb, tiles, b, v); break;
        case T_TQ6_K: decode<T_TQ6_K>(w, col, nb, tiles, b, v); break;
        case T_AFF4: decode<T_AFF4>(w, col, nb, tiles, b, v); break;
        case T_AFF8: decode<T_AFF8>(w, col, nb, tiles, b, v); break;
        default: decode<T_TQ8_0>(w, col, nb, tiles, b, v);
    }
}

// The one definition of the RMS norm's scale, 1 / sqrt(mean(x^2) + eps), for `rows` rows of x (k values each)
// into rscale[r], by the whole block (a multiple of 8 threads); `ss` is rows * k / 32 floats of scratch. Per
// row it is canonical: each 32-value block's sum of squares by 8 lanes (4 values each, in order, then a fixed
// butterfly), then the blocks' sums in index order — so a row's scale never depends on the rows beside it, and
// the rms_norm kernel and the norms fused into the projections give bitwise the same normed rows. The loads
// go four per thread at a time: a block-wide pass costs one memory round trip, not a warp's serial loop.
__device__ __forceinline__ void norm_scales(const float* x, int k, int rows, float eps, float* ss, float* rscale) {
    int nb = k / 32, lane = threadIdx.x & 31;
    unsigned group = 0xffu << (lane & 24);
    int items = rows * nb * 8;
    for (int item0 = 0; item0 < items; item0 += blockDim.x * 4) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int item = item0 + u * blockDim.x + threadIdx.x;
            if (item < items) {
                int rb = item >> 3, r = rb / nb, b = rb % nb;
                v[u] = ((const float4*)(x + (size_t)r * k + b * 32))[item & 7];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int item = item0 + u * blockDim.x + threadIdx.x;
            if (item < items) {  // whole 8-lane groups: items and blockDim are multiples of 8
                float t = v[u].x * v[u].x;
                t = fmaf(v[u].y, v[u].y, t);
                t = fmaf(v[u].z, v[u].z, t);
                t = fmaf(v[u].w, v[u].w, t);
#pragma unroll
                for (int off = 4; off > 0; off >>= 1) t += __shfl_xor_sync(group, t, off);
                if ((item & 7) == 0) ss[item >> 3] = t;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < rows) {
        // In block order (the rms_norm contract); unrolled so the loads issue ahead of the dependent adds.
        float total = 0.f;
#pragma unroll 8
        for (int b = 0; b < nb; b++) total += ss[threadIdx.x * nb + b];
        rscale[threadIdx.x] = rsqrtf(total / k + eps);
    }
    __syncthreads();
}

// The projection kernel's blocks: MM_WARPS warps, each owning whole output columns (lane l takes the column's
// weight blocks l, l + 32, ...), all applying each decoded block to the block's group of up to ROWS_PER_GROUP
// rows. The group's rows of x are staged once in shared memory, each 32-value block padded to XPAD floats so
// that 32 lanes reading 32 different blocks hit distinct banks.
#define MM_WARPS 8
#define ROWS_PER_GROUP 8
#define XPAD 36

// The staged row count of a group of rn rows (the kernel's row-count variants: 1, 2, 4, 8).
__device__ __forceinline__ int rn_pow2(int rn) { return rn <= 1 ? 1 : rn <= 2 ? 2 : rn <= 4 ? 4 : 8; }

// One output column for RN staged rows (RN >= the group's rows; rows past them are computed from stale shared
// memory and never stored): acc[r] = sum over the lane's blocks of 32 fused multiply-adds in index order, then a
// fixed butterfly over the warp. The rows' chains are interleaved (independent, so they hide each other's
// latency) without changing any row's order of operations: a row gets the same bits for every RN.
template <int TY, int RN>
__device__ __forceinline__ void column(const u8* w, int col, int tiles, int nb, int lane, const float* xs,
                                       float (&acc)[ROWS_PER_GROUP]) {
    float v[32];
#pragma unroll
    for (int r = 0; r < ROWS_PER_GROUP; r++) acc[r] = 0.f;
    for (int b = lane; b < nb; b += 32) {
        decode<TY>(w, col, nb, tiles, b, v);
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

#define COLUMN_ARGS w, col, tiles, nb, lane, xs, acc
template <int RN>
__device__ __forceinline__ void column_rows(int ty, const u8* w, int col, int tiles, int nb, int lane,
                                            const float* xs, float (&acc)[ROWS_PER_GROUP]) {
    switch (ty) {
        case T_F32: column<T_F32, RN>(COLUMN_ARGS); break;
        case T_F16: column<T_F16, RN>(COLUMN_ARGS); break;
        case T_BF16: column<T_BF16, RN>(COLUMN_ARGS); break;
        case T_Q4_0: column<T_Q4_0, RN>(COLUMN_ARGS); break;
        case T_Q4_1: column<T_Q4_1, RN>(COLUMN_ARGS); break;
        case T_Q5_0: column<T_Q5_0, RN>(COLUMN_ARGS); break;
        case T_Q5_1: column<T_Q5_1, RN>(COLUMN_ARGS); break;
        case T_IQ4_NL: column<T_IQ4_NL, RN>(COLUMN_ARGS); break;
        case T_IQ4_XS: column<T_IQ4_XS, RN>(COLUMN_ARGS); break;
        case T_Q8_0: column<T_Q8_0, RN>(COLUMN_ARGS); break;
        case T_Q4_K: column<T_Q4_K, RN>(COLUMN_ARGS); break;
        case T_Q5_K: column<T_Q5_K, RN>(COLUMN_ARGS); break;
        case T_Q6_K: column<T_Q6_K, RN>(COLUMN_ARGS); break;
        case T_Q2_K: column<T_Q2_K, RN>(COLUMN_ARGS); break;
        case T_Q3_K: column<T_Q3_K, RN>(COLUMN_ARGS); break;
        case T_TQ4_0: column<T_TQ4_0, RN>(COLUMN_ARGS); break;
        case T_TQ4_1: column<T_TQ4_1, RN>(COLUMN_ARGS); break;
        case T_TQ5_0: column<T_TQ5_0, RN>(COLUMN_ARGS); break;
        case T_TQ5_1: column<T_TQ5_1, RN>(COLUMN_ARGS); break;
        case T_TQ4_K: column<T_TQ4_K, RN>(COLUMN_ARGS); break;
        case T_TQ5_K: column<T_TQ5_K, RN>(COLUMN_ARGS); break;
        case T_TQ6_K: column<T_TQ6_K, RN>(COLUMN_ARGS); break;
        case T_AFF4: column<T_AFF4, RN>(COLUMN_ARGS); break;
        case T_AFF8: column<T_AFF8, RN>(COLUMN_ARGS); break;
        default: column<T_TQ8_0, RN>(COLUMN_ARGS);
    }
}

__device__ __forceinline__ void column_any(int ty, const u8* w, int col, int tiles, int nb, int lane,
                                           const float* xs, int rn, float (&acc)[ROWS_PER_GROUP]) {
    if (rn <= 1) column_rows<1>(ty, COLUMN_ARGS);
    else if (rn <= 2) column_rows<2>(ty, COLUMN_ARGS);
    else if (rn <= 4) column_rows<4>(ty, COLUMN_ARGS);
    else column_rows<8>(ty, COLUMN_ARGS);
}

// A gated MLP's activation of gate g times up u: `glu` 1 SwiGLU, silu(g) u = g / (1 + e^-g) u; 2 GeGLU with GELU's
// tanh form, which equals g / (1 + e^(-sqrt(8/pi) g (1 + 0.044715 g^2))) u (the CPU backend's definition).
__device__ __forceinline__ float glu_of(int glu, float g, float u) {
    float z = glu == 2 ? -1.5957692f * (g * fmaf(0.044715f, g * g, 1.f)) : -g;
    return g / (1.f + __expf(z)) * u;
}

// One to three projections of the same input x (`rows` rows of k values), or of its RMS norm when
// norm_w is non-null (its scale from `norm_scales`, as the rms_norm kernel computes it):
// o_m[r * n_m + c] (+)= sum_kk x[r * k + kk] * w_m[c, kk], with `accumulate` adding the finished sum to o_m.
// With `glu`, w0 and w1 are the gate and up projections (n0 == n1) and o0[r * n0 + c] = glu_of(glu, gate, up).
// Grid: (column tiles of MM_WARPS * cols_per_warp columns, row groups). A row's arithmetic never depends on
// `rows` or on the grid.
extern "C" __global__ void matmuls(const float* x, int k, int rows, int accumulate, const float* norm_w,
                                   float eps, int glu, int cols_per_warp,
                                   const u8* w0, int ty0, int n0, float* o0,
                                   const u8* w1, int ty1, int n1, float* o1,
                                   const u8* w2, int ty2, int n2, float* o2) {
    FLOOR_EXIT
    extern __shared__ float xs[];  // staged rows, then (with a norm) rows * nb floats of scratch
    __shared__ float scales[ROWS_PER_GROUP];
    int nb = k / 32;
    int r0 = blockIdx.y * ROWS_PER_GROUP;
    int rn = min(ROWS_PER_GROUP, rows - r0);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int total = glu ? n0 : n0 + n1 + n2;
    int t0 = (n0 + 15) / 16, t1 = (n1 + 15) / 16, t2 = (n2 + 15) / 16;
    {
        // Start this warp's first weight blocks on their way from memory while the grid before finishes.
        int col = (blockIdx.x * MM_WARPS + warp) * cols_per_warp;
        if (col < total && lane < nb) {
            const u8* w = w0;
            int ty = ty0, tiles = t0;
            if (!glu && col >= n0 + n1) {
                col -= n0 + n1; w = w2; ty = ty2; tiles = t2;
            } else if (!glu && col >= n0) {
                col -= n0; w = w1; ty = ty1; tiles = t1;
            }
            asm volatile("prefetch.global.L2 [%0];" ::"l"(block_ptr(ty, w, col, nb, tiles, lane)));
            if (glu) asm volatile("prefetch.global.L2 [%0];" ::"l"(block_ptr(ty1, w1, col, nb, t1, lane)));
        }
    }
    wait_inputs();
    release_dependents();
    if (norm_w) norm_scales(x + (size_t)r0 * k, k, rn, eps, xs + (size_t)rn_pow2(rn) * nb * XPAD, scales);
    for (int r = 0; r < rn; r++) {
        const float* xr = x + (size_t)(r0 + r) * k;
        float* sr = xs + (size_t)r * nb * XPAD;
        for (int i = threadIdx.x; i < k; i += blockDim.x)
            sr[(i >> 5) * XPAD + (i & 31)] = norm_w ? xr[i] * scales[r] * norm_w[i] : xr[i];
    }
    __syncthreads();
    for (int c = 0; c < cols_per_warp; c++) {
        int col = (blockIdx.x * MM_WARPS + warp) * cols_per_warp + c;
        if (col >= total) break;  // uniform across the warp
        const u8* w = w0;
        int ty = ty0, n = n0, tiles = t0;
        float* o = o0;
        if (!glu && col >= n0 + n1) {
            col -= n0 + n1; w = w2; ty = ty2; n = n2; o = o2; tiles = t2;
        } else if (!glu && col >= n0) {
            col -= n0; w = w1; ty = ty1; n = n1; o = o1; tiles = t1;
        }
        float acc[ROWS_PER_GROUP];
        column_any(ty, w, col, tiles, nb, lane, xs, rn, acc);
        if (glu) {
            float up[ROWS_PER_GROUP];
            column_any(ty1, w1, col, t1, nb, lane, xs, rn, up);
#pragma unroll
            for (int r = 0; r < ROWS_PER_GROUP; r++) acc[r] = glu_of(glu, acc[r], up[r]);
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

// ---- 8-bit integer projections on tensor cores (sm_80+), for weights in the tiled layout ----
//
// x is quantized per row and 32-value block exactly as the CPU's 8-bit kernels quantize it (d = max|x| / 127,
// q = round-half-even(x / d) through 1 / d, s = d * sum q), each block's integer dot product comes exact from an
// m16n8k32 MMA (16 output columns x 8 rows), and each (column, row) then accumulates its blocks in runs
// (`run_start`): per block acc = fma(dw * dx, dot, acc), and for Q4_1 acc = fma(mw, s, acc), acc restarting at 0
// for each run, the runs' sums added in order. That is the CPU contract operation for operation, so a row is
// bitwise the CPU backend's 8-bit result, whatever the rows beside it (row-exact), and the cost hardly grows
// with the rows: one MMA serves 8 of them.
//
// Two schedules, chosen by the host per launch (neither changes any row's arithmetic):
// - narrow (a CTA per 16-column tile): its warps take the runs, each streaming its run's blocks and keeping the
//   chains in its MMA fragment registers; the runs' sums are added through shared memory.
// - wide (a warp per tile): each warp runs its tile's blocks in order and keeps the chains (and the runs' total)
//   in registers. For the output layer, whose tiles are many. QM_WARPS (16) warps per CTA, one CTA per SM.
#ifndef QM_WARPS
#define QM_WARPS 16  // warps (tiles) of a wide-schedule CTA (set by the host: its `wide_warps`)
#endif
// Warps of a narrow-schedule CTA (set by the host at compilation: 16, or 4..32 for side-by-side measurements).
#ifndef NQ_WARPS
#define NQ_WARPS 16
#endif
// Blocks a wide-schedule warp loads ahead. Two: at six its chains spilled (128 registers, ~4 KB of spill
// loads); with the narrow schedule's PIPE, the 8B Q4_K_M one-row step on an H100 took 4.74-4.85 vs 4.90 ms.
#ifndef QM_AHEAD
#define QM_AHEAD 2
#endif
// Blocks a narrow-schedule warp loads ahead without the pipeline (`-DNQ_PIPE=0`). One was fastest at every size
// measured (8B Q4_K_M one-row step on an H100: 5.18 / 5.68 / 6.21 / 6.82 / 8.85 ms at 1 / 2 / 3 / 4 / 8): fewer
// registers, more warps resident.
#ifndef NQ_AHEAD
#define NQ_AHEAD 1
#endif
// Whether a narrow-schedule warp loads its next block (in the run, the next matrix's, or its next run's) while
// the current block's chains run. On (1): the 8B Q4_K_M one-row step on an H100 4.90 vs 4.95 ms without, 1B
// 1.12 vs 1.16 ms; SmolLM2's shape 0.92 vs 0.90 ms (BENCHMARKS.md section 8).
#ifndef NQ_PIPE
#define NQ_PIPE 1
#endif
static_assert(!NQ_PIPE || NQ_AHEAD == 1, "the pipelined narrow schedule loads one block ahead");

__device__ __forceinline__ void mma_s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
#else
    d[0] = d[1] = d[2] = d[3] = 0;
#endif
}

// The same for m16n8k16 (8 values per lane: a0 row g, a1 row g + 8, values 4i..4i+3; b0 values 4i.. of row g).
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], u32 a0, u32 a1, u32 b0) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#else
    d[0] = d[1] = d[2] = d[3] = 0;
#endif
}

// A block's exact integer dot products for 16 columns x 8 rows: d over the whole block, or (Q6_K) d over
// values 0..15 and e over values 16..31.
template <int TY>
__device__ __forceinline__ void block_dots(const u32 (&a)[4], u32 b0, u32 b1, int (&d)[4], int (&e)[4]) {
    if (tile_sums(TY) == 2) {
        mma_s8_k16(d, a[0], a[1], b0);
        mma_s8_k16(e, a[2], a[3], b1);
    } else {
        mma_s8(d, a, b0, b1);
    }
}

// This lane's share of a (tile, block)'s quants, as loaded: Q8_0's 16 bytes, or 8 bytes of nibbles (rows g and
// g + 8) and the lane's high bits (a u16 for the 5-bit formats, a word for the 6-bit ones) in raw[2]; from global
// memory through the read-only cache, or (GLOBAL false) from shared memory.
template <int TY, bool GLOBAL = true>
__device__ __forceinline__ void load_quants(const u8* q, int lane, u32 (&raw)[4]) {
    if (TY == T_TQ8_0) {
        uint4 v = GLOBAL ? __ldg((const uint4*)q + lane) : ((const uint4*)q)[lane];
        raw[0] = v.x; raw[1] = v.y; raw[2] = v.z; raw[3] = v.w;
    } else {
        uint2 v = GLOBAL ? __ldg((const uint2*)q + lane) : ((const uint2*)q)[lane];
        raw[0] = v.x; raw[1] = v.y; raw[3] = 0;
        const unsigned short* h16 = (const unsigned short*)(q + 256) + lane;
        const u32* h32 = (const u32*)(q + 256) + lane;
        raw[2] = tile_planes(TY) == 1 ? (u32)(GLOBAL ? __ldg(h16) : *h16)
               : tile_planes(TY) == 2 ? (GLOBAL ? __ldg(h32) : *h32)
                                      : 0u;
    }
}

// The A fragment from the loaded quants: nibbles split into bytes, the high bits put in place (bit 4, or bits
// 4-5), and the format's offset subtracted from every byte, exactly (the values then fit a signed byte).
template <int TY>
__device__ __forceinline__ void fragment(const u32 (&raw)[4], u32 (&a)[4]) {
    if (TY == T_TQ8_0) {
        a[0] = raw[0]; a[1] = raw[1]; a[2] = raw[2]; a[3] = raw[3];
        return;
    }
    const u32 lo = 0x0f0f0f0fu;
    a[0] = raw[0] & lo;
    a[1] = raw[1] & lo;
    a[2] = (raw[0] >> 4) & lo;
    a[3] = (raw[1] >> 4) & lo;
    if (tile_planes(TY) == 1) {
        // Nibble e of the u16 (bits: row g low value, row g high value, row g + 8 low, row g + 8 high) to byte e.
        u32 h = raw[2];
        u32 t = (h & 0xfu) | ((h & 0xf0u) << 4) | ((h & 0xf00u) << 8) | ((h & 0xf000u) << 12);
        a[0] |= (t << 4) & 0x10101010u;
        a[2] |= (t << 3) & 0x10101010u;
        a[1] |= (t << 2) & 0x10101010u;
        a[3] |= (t << 1) & 0x10101010u;
    } else if (tile_planes(TY) == 2) {
        u32 h = raw[2];
        a[0] |= (h << 4) & 0x30303030u;
        a[2] |= (h << 2) & 0x30303030u;
        a[1] |= h & 0x30303030u;
        a[3] |= (h >> 2) & 0x30303030u;
    }
    if (tile_offset(TY)) {
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = __vsub4(a[i], tile_offset(TY));
    }
}

// One block's step of a (column, row) chain: the contract's FMAs (`packed.rs`), first half first for Q6_K.
template <int TY>
__device__ __forceinline__ float chain_step(float acc, const BlockScale& s, float xd, float xs, int dot0, int dot1) {
    acc = fmaf(s.d0 * xd, (float)dot0, acc);
    if (tile_sums(TY) == 2) acc = fmaf(s.d1 * xd, (float)dot1, acc);
    if (tile_has_min(TY)) acc = fmaf(s.m, xs, acc);
    return acc;
}

// Four scaled values as four 8-bit integers in one word: each clamped to +-127 and rounded half to even by adding
// 1.5 * 2^23 (the sum's ulp is 1, so IEEE rounding leaves round-half-even(v) in the low mantissa bits, the
// integer's two's-complement byte in the lowest), the bytes gathered by byte permutes. The CPU's `round_even`,
// operation for operation; on the GPU it keeps the rounding and the conversion to integer off the conversion
// unit, which runs at a quarter of the FP32 rate and was the staging's bottleneck once a launch has 8 rows.
__device__ __forceinline__ u32 pack_q8(float v0, float v1, float v2, float v3) {
    const float magic = 12582912.f;
    u32 b0 = __float_as_uint(__fadd_rn(fminf(fmaxf(v0, -127.f), 127.f), magic));
    u32 b1 = __float_as_uint(__fadd_rn(fminf(fmaxf(v1, -127.f), 127.f), magic));
    u32 b2 = __float_as_uint(__fadd_rn(fminf(fmaxf(v2, -127.f), 127.f), magic));
    u32 b3 = __float_as_uint(__fadd_rn(fminf(fmaxf(v3, -127.f), 127.f), magic));
    return __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
}

// Quantization with L = 4 or 2 threads per 32-value block, 32 / L values each: log2(L) butterfly steps instead
// of three, and the block's scale divided out once per 32 / L values instead of once per 4 — quantization is
// bound by its instructions, not its loads (fewer lanes per block were faster at every width; measured:
// BENCHMARKS.md, "Verify cost by width"). Max is exact in any order and the integer sums are exact, so L changes
// no bit.
//
// With `norm_once` (a norm, and every item in one pass: the caller checks) the RMS norm's sums come from the
// values this pass loads: x is read once, not once for the norm and again for the quantization. The sums keep
// `norm_scales`' order: each block's 4-value partials t_0..t_7 reduced as ((t0 + t4) + (t2 + t6)) + ((t1 + t5)
// + (t3 + t7)), the blocks then added in order, so the same bits.
template <int L>
__device__ __forceinline__ void quantize_row(const float* x, int k, const float* norm_w, bool norm_once, float eps,
                                             float* ss, float* rscale, signed char* xq, float* xd, float* xs) {
    constexpr int V = 32 / L;
    int nb = k / 32, items = nb * L;
    for (int item0 = 0; item0 < items; item0 += blockDim.x) {  // uniform: every lane reaches the shuffles
        int item = item0 + threadIdx.x, b = item / L, h = item % L;
        bool live = item < items;
        float q[V];
#pragma unroll
        for (int e = 0; e < V; e++) q[e] = 0.f;
        if (live) {
            const float4* src = (const float4*)(x + b * 32 + h * V);
#pragma unroll
            for (int u = 0; u < V / 4; u++) {
                float4 v = src[u];
                q[4 * u] = v.x, q[4 * u + 1] = v.y, q[4 * u + 2] = v.z, q[4 * u + 3] = v.w;
            }
        }
        if (norm_once) {
            // This thread's partials t_j, j = h V / 4 + u (four squares each, as `norm_scales` sums them), then
            // the butterfly.
            float t[V / 4];
#pragma unroll
            for (int u = 0; u < V / 4; u++) {
                t[u] = q[4 * u] * q[4 * u];
                t[u] = fmaf(q[4 * u + 1], q[4 * u + 1], t[u]);
                t[u] = fmaf(q[4 * u + 2], q[4 * u + 2], t[u]);
                t[u] = fmaf(q[4 * u + 3], q[4 * u + 3], t[u]);
            }
            float sum;
            if (L == 4) {  // thread h: t_{2h} and t_{2h+1}
                float ev = t[0], od = t[V / 4 - 1];
                ev += __shfl_xor_sync(0xffffffffu, ev, 2);
                od += __shfl_xor_sync(0xffffffffu, od, 2);
                ev += __shfl_xor_sync(0xffffffffu, ev, 1);
                od += __shfl_xor_sync(0xffffffffu, od, 1);
                sum = ev + od;
            } else {  // L == 2, thread h: t_{4h} .. t_{4h+3} (the modulo only keeps L = 4's dead copy in bounds)
                float w[4];
#pragma unroll
                for (int p = 0; p < 4; p++) w[p] = t[p % (V / 4)] + __shfl_xor_sync(0xffffffffu, t[p % (V / 4)], 1);
                sum = (w[0] + w[2]) + (w[1] + w[3]);
            }
            if (live && h == 0) ss[b] = sum;
            __syncthreads();
            if (threadIdx.x == 0) {
                float tt = 0.f;
#pragma unroll 8
                for (int bb = 0; bb < nb; bb++) tt += ss[bb];
                *rscale = rsqrtf(tt / k + eps);
            }
            __syncthreads();
        }
        if (live && norm_w) {
            const float4* wv = (const float4*)(norm_w + b * 32 + h * V);
            float sc = *rscale;
#pragma unroll
            for (int u = 0; u < V / 4; u++) {
                float4 w = wv[u];
                q[4 * u] = q[4 * u] * sc * w.x;
                q[4 * u + 1] = q[4 * u + 1] * sc * w.y;
                q[4 * u + 2] = q[4 * u + 2] * sc * w.z;
                q[4 * u + 3] = q[4 * u + 3] * sc * w.w;
            }
        }
        float amax = fabsf(q[0]);
#pragma unroll
        for (int e = 1; e < V; e++) amax = fmaxf(amax, fabsf(q[e]));
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        float d = amax / 127.f;
        float id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        u32* dst = (u32*)(xq + b * 32 + h * V);
#pragma unroll
        for (int u = 0; u < V / 4; u++) {
            u32 word = pack_q8(q[4 * u] * id, q[4 * u + 1] * id, q[4 * u + 2] * id, q[4 * u + 3] * id);
            sum = __dp4a((int)word, 0x01010101, sum);
            if (live) dst[u] = word;
        }
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (live && h == 0) {
            xd[b] = d;
            xs[b] = d * (float)sum;
        }
    }
}

// 32-value blocks `0..nb` of x quantized as `quantize_x` quantizes them without a norm, a warp per block (the
// whole CTA): the block's max and the integer sum of its bytes are exact in any order and each value is rounded
// alone, so the same bits as `quantize_row`'s 4- or 2-thread layout.
__device__ __forceinline__ void quantize_blocks(const float* x, int nb, signed char* xq, float* xd, float* xs) {
    int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < nb; b += blockDim.x >> 5) {
        float v = x[b * 32 + lane];
        float amax = fabsf(v);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        float d = amax / 127.f;
        float id = d > 0.f ? 1.f / d : 0.f;
        int q = (signed char)(pack_q8(v * id, 0.f, 0.f, 0.f) & 0xffu);
        xq[b * 32 + lane] = (signed char)q;
        int sum = q;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) {
            xd[b] = d;
            xs[b] = d * (float)sum;
        }
    }
}

// The integer projections' input: row blockIdx.x of x (k values; RMS-normed with norm_w when non-null)
// quantized to 8 bits per 32-value block, once per launch for all the projection's CTAs — xq holds k bytes per
// row, xd and xs (the blocks' scales d and d * sum q) k / 32 floats per row. Four threads per block, or two
// where four would take more than one pass of the CTA's threads. Dynamic shared memory: k / 32 floats (the
// norm's scratch).
// Row r of x quantized as `quantize_x` quantizes it (into the rows' buffers xq, xd, xs), by the whole block.
__device__ __forceinline__ void quantize_x_row(const float* x, int k, const float* norm_w, float eps, signed char* xq,
                                               float* xd, float* xs, int r, float* ss, float* rscale) {
    int nb = k / 32;
    x += (size_t)r * k;
    xq += (size_t)r * k;
    xd += (size_t)r * nb;
    xs += (size_t)r * nb;
    bool two = nb * 4 > (int)blockDim.x;
    bool once = norm_w && nb * (two ? 2 : 4) <= (int)blockDim.x;
    if (norm_w && !once) norm_scales(x, k, 1, eps, ss, rscale);
    if (two) quantize_row<2>(x, k, norm_w, once, eps, ss, rscale, xq, xd, xs);
    else quantize_row<4>(x, k, norm_w, once, eps, ss, rscale, xq, xd, xs);
}

extern "C" __global__ void quantize_x(const float* x, int k, const float* norm_w, float eps, signed char* xq,
                                      float* xd, float* xs) {
    FLOOR_EXIT
    extern __shared__ float ss[];
    __shared__ float rscale;
    wait_inputs();
    release_dependents();
#ifdef KO_STAGE
    return;
#endif
    quantize_x_row(x, k, norm_w, eps, xq, xd, xs, blockIdx.x, ss, &rscale);
}

// A projection launch's quantized x (`quantize_x`'s output, from the launch's first row): k bytes per row, k / 32
// scales and sums per row. Rows past the launch's are read (their MMA columns and chains computed, never stored):
// the host's buffer has room for them.
struct Staged {
    const signed char* xq;
    const float* xd;
    const float* xs;
    int k, nb;
};

// The scale and d * sum of (row r, block b).
__device__ __forceinline__ float staged_d(const Staged& st, int r, int b) { return st.xd[r * st.nb + b]; }
__device__ __forceinline__ float staged_s(const Staged& st, int r, int b) { return st.xs[r * st.nb + b]; }

// The B fragment of n-tile `nt` (rows 8 nt .. 8 nt + 7) for block b.
__device__ __forceinline__ void x_fragment(const Staged& st, int nt, int b, int lane, u32* b0, u32* b1) {
    const signed char* p = st.xq + (size_t)(8 * nt + (lane >> 2)) * st.k + b * 32 + (lane & 3) * 4;
    *b0 = *(const u32*)p;
    *b1 = *(const u32*)(p + 16);
}

// Which matrix tile `tile` of the launch is: its weights, type, tile count, width, output; false past the end.
struct TileOf {
    const u8* w;
    int ty, tiles, n, lt;
    float* o;
    int m;    // which of the launch's matrices
    int glu;  // the launch's gated activation (`glu_of`)
};

__device__ __forceinline__ bool tile_of(int tile, int glu, const u8* w0, int ty0, int n0, float* o0,
                                        const u8* w1, int ty1, int n1, float* o1, const u8* w2, int ty2,
                                        int n2, float* o2, TileOf* t) {
    int t0 = (n0 + 15) / 16, t1 = glu ? 0 : (n1 + 15) / 16, t2 = (n2 + 15) / 16;
    if (tile < t0) {
        *t = {w0, ty0, t0, n0, tile, o0, 0, glu};
    } else if (tile < t0 + t1) {
        *t = {w1, ty1, t1, n1, tile - t0, o1, 1, glu};
    } else if (tile < t0 + t1 + t2) {
        *t = {w2, ty2, t2, n2, tile - t0 - t1, o2, 2, glu};
    } else {
        return false;
    }
    return true;
}

__device__ __forceinline__ void store_out(float* o, int n, int col, int r, float v, int accumulate) {
    float* dst = o + (size_t)r * n + col;
    *dst = accumulate ? *dst + v : v;
}

// RoPE and the cache write fused into the Q/K/V projection (interleaved pairs, which a tile never splits): what
// `rope_and_cache` does, with the same (cos, sin) table. `hd` = 0: no fusion.
struct RopeFusion {
    int table;  // the step's (cos, sin) table of the step's rows (f32 offset)
    int hd;
    float* kc;
    float* vc;
    const int* step;
    int cap, r0;  // the step's row of the launch's row 0
};

// What the output of (column col, launch row r) needs from the step: its rotation's (cos, sin) and the step's
// first cache slot. The step is written before the forward's first launch, so this is read before the grid
// before has finished, off the epilogue's critical path.
struct QkvStore {
    float2 cs;
    int base;
};

__device__ __forceinline__ QkvStore qkv_inputs(const RopeFusion& f, const TileOf& t, int col, int r) {
    QkvStore q = {make_float2(0.f, 0.f), read_step(f.step, f.cap).base};
    if (t.m < 2) q.cs = ((const float2*)(f.step + f.table))[(f.r0 + r) * (f.hd >> 1) + ((col % f.hd) >> 1)];
    return q;
}

// The output of (column col, launch row r) of matrix m with value v, whose pair partner holds `partner`: q
// rotated in place, k rotated into its cache slot, v copied into its slot (k and v buffers are scratch).
__device__ __forceinline__ void store_qkv(const RopeFusion& f, const TileOf& t, const QkvStore& in, int col, int r,
                                          float v, float partner) {
    int row = f.r0 + r;
    float out = v;
    if (t.m < 2) {
        int cin = col % f.hd;
        float c = in.cs.x, s = in.cs.y;
        float x0 = (cin & 1) ? partner : v, x1 = (cin & 1) ? v : partner;
        out = (cin & 1) ? x0 * s + x1 * c : x0 * c - x1 * s;
    }
    if (t.m == 0) t.o[(size_t)r * t.n + col] = out;
    else (t.m == 1 ? f.kc : f.vc)[(size_t)(in.base + row) * t.n + col] = out;
}

// Blocks b0 .. b0 + N (those before `end`) of the tile whose quants start at `q` and scales at `sc`: this
// lane's quants and the scales of columns g and g + 8.
template <int TY, int N>
__device__ __forceinline__ void load_blocks(const u8* q, const u8* sc, int b0, int end, int lane, u32 (&raw)[N][4],
                                            ScaleRaw (&sw)[N][2]) {
    int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < N; i++) {
        int b = b0 + i;
        if (b < end) {
            load_quants<TY>(q + (size_t)b * tile_quant_bytes(TY), lane, raw[i]);
            sw[i][0] = scale_raw<TY>(sc, b, g);
            sw[i][1] = scale_raw<TY>(sc, b, g + 8);
        }
    }
}

// x as the GEMM schedule stages it in shared memory (`qmatmuls_gemm`): GM_KC blocks of up to 64 rows from block
// b0, GM_XROW bytes a row (padded: a fragment's eight rows start in eight different banks), and each row's
// (scale, sum) pairs, GM_SROW floats a row.
#define GM_KC 4
#define GM_XROW (GM_KC * 32 + 16)
#define GM_SROW (GM_KC * 2 + 2)
struct SharedX {
    const u8* q;
    const float* ds;
    int b0;
};
__device__ __forceinline__ float staged_d(const SharedX& s, int r, int b) { return s.ds[r * GM_SROW + 2 * (b - s.b0)]; }
__device__ __forceinline__ float staged_s(const SharedX& s, int r, int b) {
    return s.ds[r * GM_SROW + 2 * (b - s.b0) + 1];
}
__device__ __forceinline__ void x_fragment(const SharedX& s, int nt, int b, int lane, u32* b0, u32* b1) {
    const u8* p = s.q + (8 * nt + (lane >> 2)) * GM_XROW + (b - s.b0) * 32 + (lane & 3) * 4;
    *b0 = *(const u32*)p;
    *b1 = *(const u32*)(p + 16);
}

// One block of a tile in a warp's chains: the block's loaded quants and scales (`load_quants`, `scale_raw` for
// columns g and g + 8) against x's n-tiles (x read where `st` keeps it: global `Staged` or `SharedX`), each
// (n-tile nt, slot j) chain taking the contract's step.
template <int TY, int NT, class X>
__device__ __forceinline__ void tile_block(const u32 (&raw)[4], const ScaleRaw (&sw)[2], const X& st, int b,
                                           int lane, int ntiles, bool odd_rows, float (&acc)[NT][4]) {
    constexpr int SUMS = tile_sums(TY);
    int i2 = 2 * (lane & 3);
    u32 a[4];
    fragment<TY>(raw, a);
    BlockScale bs[2] = {block_scale<TY>(sw[0]), block_scale<TY>(sw[1])};
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        if (nt < ntiles) {
            u32 x0, x1;
            x_fragment(st, nt, b, lane, &x0, &x1);
            int d[SUMS][4];
            block_dots<TY>(a, x0, x1, d[0], d[SUMS - 1]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                // A one-row launch stores no odd fragment row (row i2 + 1 >= 1): its chains are skipped.
                if ((j & 1) && !odd_rows) continue;
                int r = 8 * nt + i2 + (j & 1);
                acc[nt][j] = chain_step<TY>(acc[nt][j], bs[j >> 1], staged_d(st, r, b), staged_s(st, r, b), d[0][j],
                                            d[SUMS - 1][j]);
            }
        }
    }
}

// The epilogue's runs (`packed.rs`'s `Runs`; RUNS is set by the host): min(RUNS, nb) runs of consecutive blocks,
// run s being blocks run_start(s) .. run_start(s + 1); each run's chain starts at 0 and the runs' sums are added
// in order.
#ifndef RUNS
#define RUNS 16
#endif
__device__ __forceinline__ int run_start(int s, int nb) { return s * nb / min(RUNS, nb); }

// A warp summing a tile's blocks in order, after block b: at the end of a run (`run`, ending before block `end`)
// the run's chains join the totals, runs in order, and start again from 0.
template <int NT>
__device__ __forceinline__ void run_step(int b, int nb, int& run, int& end, float (&acc)[NT][4],
                                         float (&total)[NT][4]) {
    if (b + 1 != end) return;
    run++;
    end = run_start(run + 1, nb);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            total[nt][j] = __fadd_rn(total[nt][j], acc[nt][j]);
            acc[nt][j] = 0.f;
        }
}

// The narrow schedule's weight stream: NQ_STREAM blocks of each warp's run in flight through shared memory
// (`cp.async`: a load in flight holds no register), or with 0 the blocks loaded into registers NQ_AHEAD at a
// time. Set by the host (`CudaOptions::narrow_stream`).
#ifndef NQ_STREAM
#define NQ_STREAM 0
#endif
// One streamed block: its tile quants (at most Q8_0's 512 bytes), then its scales as `scale_raw` reads them at
// block 0 (the legacy formats' 16 words; the K-quants' super-block words and this block's 16 pairs).
#define STREAM_SLOT 640

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    unsigned to = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    unsigned to = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(to), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Block b of the tile whose quants start at `q` and scales at `sc` into a stream slot, 16 bytes a lane.
__device__ __forceinline__ void stream_block(int ty, u8* slot, const u8* q, const u8* sc, int b, int lane) {
    const int QB = tile_quant_bytes(ty), QC = QB / 16, SC = tiled_k(ty) ? 6 : 4;
    for (int c = lane; c < QC + SC; c += 32) {
        const u8* src;
        if (c < QC) src = q + (size_t)b * QB + 16 * c;
        else if (!tiled_k(ty)) src = sc + (size_t)b * 64 + 16 * (c - QC);
        else if (c - QC < 4) src = sc + (size_t)(b >> 3) * 320 + 16 * (c - QC);
        else src = sc + (size_t)(b >> 3) * 320 + 64 + (b & 7) * 32 + 16 * (c - QC - 4);
        cp_async16(slot + 16 * c, src);
    }
}

// Narrow schedule: this CTA's tile (`up`: the up projection for glu, gate in t; MATS = 1 or 2) over up to 8 NT
// rows (NT MMA n-tiles: 2 for launches of up to 16 rows, 8 for the tall schedule's), its blocks' runs spread
// over the warps (warp w sums runs w, w + WARPS, ...). A warp streams its run's contiguous bytes (the first
// blocks requested before the grid before has finished), and keeps the run's chains in its MMA fragment
// registers (n-tile nt, column g / g + 8, row 2i / 2i + 1); the runs' sums meet in shared memory and one thread
// per (column, row) adds them in run order. Every warp of every CTA streams weights the whole time: no (column,
// row) waits on one thread's chain over all its blocks.
// Shared memory (`q_geometry`): with NQ_STREAM, WARPS x NQ_STREAM stream slots; then runs x MATS x n-tiles x 4 x
// 32 floats.
template <int TY, int MATS, int WARPS, int NT>
__device__ void split_tile(const TileOf& t, const u8* up, const Staged& st, int rows, u8* smem, int accumulate,
                           const RopeFusion& rope) {
    constexpr int QB = tile_quant_bytes(TY);
    int nb = st.nb, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int ntiles = min(NT, (rows + 7) / 8), runs = min(RUNS, nb);
    float* part = (float*)(smem + WARPS * NQ_STREAM * STREAM_SLOT);
#if NQ_STREAM > 0
    int g = lane >> 2;
    u8* ring = smem + warp * NQ_STREAM * STREAM_SLOT;
    // The load cursor runs NQ_STREAM blocks ahead over this warp's (run, matrix, block) sequence; every lane
    // commits one group per block, empty past the end, so `cp_async_wait` counts alike everywhere.
    int ls = warp, lm = 0, lb = run_start(warp, nb), slot = 0;
    auto load_next = [&](int into) {
        if (ls < runs) {
            const u8* w = lm ? up : t.w;
            stream_block(TY, ring + into * STREAM_SLOT, w + (size_t)t.lt * nb * QB, tile_scales(TY, w, t.tiles, nb, t.lt),
                             lb, lane);
            if (++lb == run_start(ls + 1, nb)) {
                if (++lm == MATS) lm = 0, ls += WARPS;
                lb = run_start(ls, nb);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < NQ_STREAM; i++) load_next(i);
#else
    const u8* wq[2] = {t.w, up};
    u32 raw[NQ_AHEAD][4];
    ScaleRaw sw[NQ_AHEAD][2];
    // Blocks b0 .. b0 + NQ_AHEAD of matrix m, those before `end`.
    auto load_group = [&](int m, int b0, int end) {
        load_blocks<TY, NQ_AHEAD>(wq[m] + (size_t)t.lt * nb * QB, tile_scales(TY, wq[m], t.tiles, nb, t.lt), b0, end,
                                  lane, raw, sw);
    };
    if (warp < runs) load_group(0, run_start(warp, nb), run_start(warp + 1, nb));
#endif
    wait_inputs();
    release_dependents();
    for (int s = warp; s < runs; s += WARPS) {
        int lo = run_start(s, nb), hi = run_start(s + 1, nb);
#pragma unroll
        for (int m = 0; m < MATS; m++) {
            float acc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[nt][j] = 0.f;
#if NQ_STREAM > 0
            for (int b = lo; b < hi; b++) {
                cp_async_wait<NQ_STREAM - 1>();
                __syncwarp();
                const u8* in = ring + slot * STREAM_SLOT;
                u32 raw[4];
                load_quants<TY, false>(in, lane, raw);
                ScaleRaw sw[2] = {scale_raw<TY>(in + QB, 0, g), scale_raw<TY>(in + QB, 0, g + 8)};
                __syncwarp();  // every lane has read the slot before it is refilled
                load_next(slot);
                slot = slot + 1 == NQ_STREAM ? 0 : slot + 1;
                tile_block<TY>(raw, sw, st, b, lane, ntiles, rows > 1, acc);
            }
#elif NQ_PIPE
            // The warp's next block (in this run, the next matrix's, or its next run's) loaded while this block's
            // chains run.
            for (int b = lo; b < hi; b++) {
                u32 nraw[1][4];
                ScaleRaw nsw[1][2];
                int nm = m, nbk = b + 1, nhi = hi;
                if (nbk == hi) {
                    nbk = lo;
                    if (++nm == MATS) {
                        nm = 0;
                        nbk = run_start(s + WARPS, nb);
                        nhi = s + WARPS < runs ? run_start(s + WARPS + 1, nb) : 0;
                    }
                }
                load_blocks<TY, 1>(wq[nm] + (size_t)t.lt * nb * QB, tile_scales(TY, wq[nm], t.tiles, nb, t.lt), nbk,
                                   nhi, lane, nraw, nsw);
                tile_block<TY>(raw[0], sw[0], st, b, lane, ntiles, rows > 1, acc);
#pragma unroll
                for (int i = 0; i < 4; i++) raw[0][i] = nraw[0][i];
                sw[0][0] = nsw[0][0];
                sw[0][1] = nsw[0][1];
            }
#else
            for (int b0 = lo; b0 < hi; b0 += NQ_AHEAD) {
                if (s != warp || m > 0 || b0 > lo) load_group(m, b0, hi);
#pragma unroll
                for (int i = 0; i < NQ_AHEAD; i++)
                    if (b0 + i < hi) tile_block<TY>(raw[i], sw[i], st, b0 + i, lane, ntiles, rows > 1, acc);
            }
#endif
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                if (nt < ntiles)
#pragma unroll
                    for (int j = 0; j < 4; j++) part[(((s * MATS + m) * ntiles + nt) * 4 + j) * 32 + lane] = acc[nt][j];
        }
    }
    __syncthreads();
    // Entry e: lane l of fragment slot (nt, j) = e / 32, as the warps left it. The trip count is the same for a
    // warp's 32 threads (blockDim and the entries are multiples of 32), so the RoPE partner's shuffle has them all.
    for (int e = threadIdx.x; e < ntiles * 128; e += blockDim.x) {
        int l = e & 31, nt = e >> 7, j = (e >> 5) & 3;
        int r = 8 * nt + 2 * (l & 3) + (j & 1), col = t.lt * 16 + (l >> 2) + 8 * (j >> 1);
        float v[2] = {0.f, 0.f};
#pragma unroll
        for (int m = 0; m < MATS; m++)
            for (int s = 0; s < runs; s++)
                v[m] = __fadd_rn(v[m], part[(((s * MATS + m) * ntiles + nt) * 4 + j) * 32 + l]);
        bool live = r < rows && col < t.n;
        if (MATS == 1 && rope.hd > 0) {
            // The pair partner is the neighbouring column: g ^ 1, lane l ^ 4 of the same slot.
            float partner = __shfl_xor_sync(0xffffffffu, v[0], 4);
            if (live) store_qkv(rope, t, qkv_inputs(rope, t, col, r), col, r, v[0], partner);
            continue;
        }
        if (live) store_out(t.o, t.n, col, r, MATS == 2 ? glu_of(t.glu, v[0], v[1]) : v[0], accumulate);
    }
}

// Wide schedule: this warp's tile (when `mine`), its chains in registers (n-tile nt, column g / g + 8, row
// 2i / 2i + 1); QM_AHEAD blocks' quants and scales loaded at a time, the first ones before the grid before has
// finished.
template <int TY, int MATS>
__device__ void wide_tile(const TileOf& t, const u8* up, const Staged& st, int rows, int accumulate) {
    int nb = st.nb, lane = threadIdx.x & 31, g = lane >> 2, i2 = 2 * (lane & 3);
    int rows_pad = rows <= 8 ? 8 : 16, ntiles = rows_pad / 8;
    const u8* wq[2] = {t.w, up};
    u32 raw[QM_AHEAD][4];
    ScaleRaw sw[QM_AHEAD][2];
    auto load_group = [&](int m, int b0) {
        load_blocks<TY, QM_AHEAD>(wq[m] + (size_t)t.lt * nb * tile_quant_bytes(TY),
                                  tile_scales(TY, wq[m], t.tiles, nb, t.lt), b0, nb, lane, raw, sw);
    };
    load_group(0, 0);
    wait_inputs();
    release_dependents();
    float acc[2][2][4], total[2][2][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[m][nt][j] = total[m][nt][j] = 0.f;
#pragma unroll
    for (int m = 0; m < MATS; m++) {
        int run = 0, end = run_start(1, nb);
        for (int b0 = 0; b0 < nb; b0 += QM_AHEAD) {
            if (m > 0 || b0 > 0) load_group(m, b0);
#pragma unroll
            for (int i = 0; i < QM_AHEAD; i++) {
                int b = b0 + i;
                if (b < nb) {
                    tile_block<TY>(raw[i], sw[i], st, b, lane, ntiles, rows > 1, acc[m]);
                    run_step(b, nb, run, end, acc[m], total[m]);
                }
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = 8 * nt + i2 + (j & 1), col = t.lt * 16 + g + 8 * (j >> 1);
            if (nt < ntiles && r < rows && col < t.n) {
                float v = total[0][nt][j];
                if (MATS == 2) v = glu_of(t.glu, v, total[1][nt][j]);
                store_out(t.o, t.n, col, r, v, accumulate);
            }
        }
    }
}

// RUN(TY) with the tiled type `ty` as a compile-time constant.
#define TILED_SWITCH(ty, RUN)                   \
    switch (ty) {                               \
        case T_TQ4_0: RUN(T_TQ4_0); break;      \
        case T_TQ4_1: RUN(T_TQ4_1); break;      \
        case T_TQ5_0: RUN(T_TQ5_0); break;      \
        case T_TQ5_1: RUN(T_TQ5_1); break;      \
        case T_TQ4_K: RUN(T_TQ4_K); break;      \
        case T_TQ5_K: RUN(T_TQ5_K); break;      \
        case T_TQ6_K: RUN(T_TQ6_K); break;      \
        default: RUN(T_TQ8_0);                  \
    }

// Row group blockIdx.y of a launch split into gridDim.y groups: rows [lo, lo + per) of the launch, as a launch
// of its own (x, the outputs and the RoPE rows moved to its first row). False, with the whole CTA released before
// any barrier, where the group is empty.
__device__ __forceinline__ bool row_group(int& rows, int k, const signed char*& xq, const float*& xd,
                                          const float*& xs, float*& o0, int n0, float*& o1, int n1, float*& o2,
                                          int n2, RopeFusion& rp) {
    if (gridDim.y == 1) return true;
    int nb = k / 32, per = (rows + gridDim.y - 1) / gridDim.y, lo = blockIdx.y * per;
    if (lo >= rows) {
        wait_inputs();
        release_dependents();
        return false;
    }
    rows = min(rows, lo + per) - lo;
    xq += (size_t)lo * k;
    xd += (size_t)lo * nb;
    xs += (size_t)lo * nb;
    o0 += (size_t)lo * n0;
    if (o1) o1 += (size_t)lo * n1;
    if (o2) o2 += (size_t)lo * n2;
    rp.r0 += lo;
    return true;
}

template <bool WIDE, int WARPS, int NT = 2>
__device__ __forceinline__ void qmatmuls_body(const signed char* xq, const float* xd, const float* xs, int k,
                                              int rows, int accumulate, int glu, const u8* w0, int ty0,
                                              int n0, float* o0, const u8* w1, int ty1, int n1, float* o1,
                                              const u8* w2, int ty2, int n2, float* o2, const RopeFusion& rope) {
    extern __shared__ __align__(16) u8 smem[];
    int warp = threadIdx.x >> 5, nb = k / 32;
    RopeFusion rp = rope;
    if (!WIDE && !row_group(rows, k, xq, xd, xs, o0, n0, o1, n1, o2, n2, rp)) return;
    Staged st = {xq, xd, xs, k, nb};
    TileOf t;
    if (!tile_of(WIDE ? blockIdx.x * QM_WARPS + warp : blockIdx.x, glu, w0, ty0, n0, o0, w1, ty1, n1, o1, w2, ty2,
                 n2, o2, &t)) {
        // A wide CTA's warps past the last tile (a narrow CTA always has one: the grid is the tile count).
        wait_inputs();
        release_dependents();
        return;
    }
    const u8* up = glu ? w1 : nullptr;
#define QM_RUN(TY)                                                                                   \
    if (WIDE) {                                                                                      \
        if (glu) wide_tile<TY, 2>(t, up, st, rows, accumulate);                                      \
        else wide_tile<TY, 1>(t, up, st, rows, accumulate);                                          \
    } else {                                                                                         \
        if (glu) split_tile<TY, 2, WARPS, NT>(t, up, st, rows, smem, accumulate, rp);                \
        else split_tile<TY, 1, WARPS, NT>(t, up, st, rows, smem, accumulate, rp);                    \
    }
    TILED_SWITCH(t.ty, QM_RUN)
#undef QM_RUN
}

// One to three tiled projections of the same x (`rows` <= 16 rows of k values, quantized by `quantize_x` into
// xq, xd, xs), as `matmuls` computes them but with 8-bit activations: o_m[r * n_m + c] (+)= ..., or with `glu`
// (gate w0 and up w1 of one type) o0 = glu_of(glu, gate, up).
// - qmatmuls_narrow: a CTA per tile (grid: the tile count, times the row groups); shared memory as `split_tile`
//   lays it out.
// - qmatmuls_wide: a warp per tile (grid: tiles / QM_WARPS), no shared memory. Its grids are large: two CTAs
//   per SM where they have 8 warps or fewer.
#define QM_PARAMS                                                                                              \
    const signed char *xq, const float *xd, const float *xs, int k, int rows, int accumulate, int glu,          \
        const u8 *w0, int ty0, int n0, float *o0, const u8 *w1, int ty1, int n1, float *o1,                    \
        const u8 *w2, int ty2, int n2, float *o2, int rope_table, int rope_hd, float *kc, float *vc,            \
        const int *step, int cap, int r0
#define QM_ARGS xq, xd, xs, k, rows, accumulate, glu, w0, ty0, n0, o0, w1, ty1, n1, o1, w2, ty2, n2, o2

// The last parameters fuse RoPE and the cache write into a narrow Q/K/V launch (w0, w1, w2 = q, k, v; see
// `RopeFusion`); rope_hd = 0 for every other launch.
// Up to 16 warps, two CTAs share an SM (their registers capped to fit).
extern "C" __global__ void __launch_bounds__(NQ_WARPS * 32, NQ_WARPS <= 16 ? 2 : 1) qmatmuls_narrow(QM_PARAMS) {
    FLOOR_EXIT
    qmatmuls_body<false, NQ_WARPS>(QM_ARGS, RopeFusion{rope_table, rope_hd, kc, vc, step, cap, r0});
}

// The narrow schedule for launches (row groups) of at most 8 rows: one MMA n-tile, so its chains take half the
// registers and nothing spills at two CTAs per SM (decode, narrow verifies).
extern "C" __global__ void __launch_bounds__(NQ_WARPS * 32, NQ_WARPS <= 16 ? 2 : 1) qmatmuls_narrow8(QM_PARAMS) {
    FLOOR_EXIT
    qmatmuls_body<false, NQ_WARPS, 1>(QM_ARGS, RopeFusion{rope_table, rope_hd, kc, vc, step, cap, r0});
}

extern "C" __global__ void __launch_bounds__(QM_WARPS * 32, QM_WARPS <= 8 ? 2 : 1) qmatmuls_wide(QM_PARAMS) {
    FLOOR_EXIT
    qmatmuls_body<true, QM_WARPS>(QM_ARGS, RopeFusion{0, 0, nullptr, nullptr, nullptr, 0, 0});
}

// The tall schedule (prefill chunks): the narrow one over up to 64 rows per row group (8 n-tiles), every weight
// block loaded once for them all. One CTA per SM: its chains take twice the registers.
extern "C" __global__ void __launch_bounds__(NQ_WARPS * 32, 1) qmatmuls_tall(QM_PARAMS) {
    FLOOR_EXIT
    qmatmuls_body<false, NQ_WARPS, 8>(QM_ARGS, RopeFusion{rope_table, rope_hd, kc, vc, step, cap, r0});
}

// The GEMM schedule (prefill chunks with tiles enough to fill the SMs by whole tiles): a CTA of GM_WARPS warps
// holds GM_WARPS tiles (or GM_WARPS / 2 gate/up pairs, a warp per matrix) over up to 64 rows, each warp summing
// its tile's blocks in order with its runs' chains in registers — the wide schedule's arithmetic over 8 n-tiles.
// The CTA stages x's quants and (scale, sum) pairs once for all its warps, and each warp its own tile's blocks,
// GM_KC blocks a stage through GM_STAGES shared-memory stages of asynchronous copies: the chains wait on shared
// memory, where the tall schedule's warps each load x from L2 for their own run. Dynamic shared memory:
// GM_STAGES x GM_STAGE_BYTES.
#define GM_WARPS 8
#define GM_STAGES 3
#define GM_X_BYTES (64 * GM_XROW)
#define GM_S_BYTES (64 * GM_SROW * 4)
#define GM_STAGE_BYTES (GM_X_BYTES + GM_S_BYTES + GM_WARPS * GM_KC * STREAM_SLOT)
static_assert(GM_STAGES * GM_STAGE_BYTES == GM_SHARED_BYTES, "the host's geometry (`GEMM_SHARED_BYTES`)");

// The blocks b0 .. b0 + GM_KC (those below nb) of one stage in a warp's chains: `slots` the warp's staged blocks,
// the runs' bookkeeping `run_step`'s, as in `wide_tile`.
template <int TY>
__device__ __forceinline__ void gemm_blocks(const u8* slots, const SharedX& sx, int nb, int lane, int ntiles, int& run,
                                            int& end, float (&acc)[8][4], float (&total)[8][4]) {
    constexpr int QB = tile_quant_bytes(TY);
    int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < GM_KC; i++) {
        int b = sx.b0 + i;
        if (b < nb) {
            const u8* in = slots + i * STREAM_SLOT;
            u32 raw[4];
            load_quants<TY, false>(in, lane, raw);
            ScaleRaw sw[2] = {scale_raw<TY>(in + QB, 0, g), scale_raw<TY>(in + QB, 0, g + 8)};
            tile_block<TY>(raw, sw, sx, b, lane, ntiles, true, acc);
            run_step(b, nb, run, end, acc, total);
        }
    }
}

extern "C" __global__ void __launch_bounds__(GM_WARPS * 32, 2) qmatmuls_gemm(QM_PARAMS) {
    FLOOR_EXIT
    extern __shared__ __align__(16) u8 smem[];
    RopeFusion rp = {rope_table, rope_hd, kc, vc, step, cap, r0};
    if (!row_group(rows, k, xq, xd, xs, o0, n0, o1, n1, o2, n2, rp)) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nb = k / 32;
    int ntiles = min(8, (rows + 7) / 8), xrows = 8 * ntiles, chunks = (nb + GM_KC - 1) / GM_KC;
    // This warp's tile and matrix (gate/up pairs: the even warp the gate, the odd one the up projection).
    TileOf t;
    bool mine = tile_of(blockIdx.x * (glu ? GM_WARPS / 2 : GM_WARPS) + (glu ? warp >> 1 : warp), glu, w0, ty0, n0, o0,
                        w1, ty1, n1, o1, w2, ty2, n2, o2, &t);
    int m = glu ? warp & 1 : 0;
    const u8 *tq = nullptr, *tsc = nullptr;  // this warp's tile's quants and scales
    if (mine) {
        const u8* wm = m ? w1 : t.w;
        tq = wm + (size_t)t.lt * nb * tile_quant_bytes(t.ty);
        tsc = tile_scales(t.ty, wm, t.tiles, nb, t.lt);
    }
    // Stage c's copies (every thread commits one group per stage, empty past the last, so the waits count alike).
    auto stage = [&](int c) {
        if (c < chunks) {
            u8* base = smem + (c % GM_STAGES) * GM_STAGE_BYTES;
            int b0 = c * GM_KC;
            for (int i = threadIdx.x; i < xrows * GM_KC * 2; i += blockDim.x) {
                int r = i / (GM_KC * 2), e = i % (GM_KC * 2), b = b0 + e / 2;
                if (b < nb) {
                    cp_async16(base + r * GM_XROW + e * 16, xq + (size_t)r * k + b0 * 32 + e * 16);
                    cp_async4(base + GM_X_BYTES + (r * GM_SROW + e) * 4, (e & 1 ? xs : xd) + (size_t)r * nb + b);
                }
            }
            if (mine) {
                u8* ws = base + GM_X_BYTES + GM_S_BYTES + warp * GM_KC * STREAM_SLOT;
                for (int i = 0; i < GM_KC && b0 + i < nb; i++)
                    stream_block(t.ty, ws + i * STREAM_SLOT, tq, tsc, b0 + i, lane);
            }
        }
        cp_async_commit();
    };
    wait_inputs();
    release_dependents();
#pragma unroll
    for (int c = 0; c < GM_STAGES - 1; c++) stage(c);
    float acc[8][4], total[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[nt][j] = total[nt][j] = 0.f;
    int run = 0, end = run_start(1, nb);
    for (int c = 0; c < chunks; c++) {
        cp_async_wait<GM_STAGES - 2>();
        __syncthreads();
        // Into the stage read at c - 1, which every warp has left (the barrier).
        stage(c + GM_STAGES - 1);
        if (mine) {
            const u8* base = smem + (c % GM_STAGES) * GM_STAGE_BYTES;
            SharedX sx = {base, (const float*)(base + GM_X_BYTES), c * GM_KC};
            const u8* ws = base + GM_X_BYTES + GM_S_BYTES + warp * GM_KC * STREAM_SLOT;
#define GM_RUN(TY) gemm_blocks<TY>(ws, sx, nb, lane, ntiles, run, end, acc, total)
            TILED_SWITCH(t.ty, GM_RUN)
#undef GM_RUN
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    // The epilogue: a gate/up pair's up sums pass through shared memory to the gate's warp.
    int g = lane >> 2, i2 = 2 * (lane & 3);
    float* ups = (float*)smem + (warp >> 1) * 32 * 32;
    if (glu) {
        if (mine && m == 1)
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int j = 0; j < 4; j++) ups[(nt * 4 + j) * 32 + lane] = total[nt][j];
        __syncthreads();
    }
    if (!mine || m == 1) return;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        if (nt < ntiles) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int r = 8 * nt + i2 + (j & 1), col = t.lt * 16 + g + 8 * (j >> 1);
                float v = total[nt][j];
                bool live = r < rows && col < t.n;
                if (glu) {
                    v = glu_of(t.glu, v, ups[(nt * 4 + j) * 32 + lane]);
                } else if (rp.hd > 0) {
                    // The pair partner is the neighbouring column: g ^ 1, lane ^ 4 (every lane is here).
                    float partner = __shfl_xor_sync(0xffffffffu, v, 4);
                    if (live) store_qkv(rp, t, qkv_inputs(rp, t, col, r), col, r, v, partner);
                    continue;
                }
                if (live) store_out(t.o, t.n, col, r, v, accumulate);
            }
        }
    }
}

// out[r, :] = table row step.tokens[r] (one block of threads per row, one thread per 32-value block).
extern "C" __global__ void embed(const u8* w, int ty, int k, int tiles, const int* step, int cap, float* out) {
    FLOOR_EXIT
    wait_inputs();
    release_dependents();
    Step st = read_step(step, cap);
    int r = blockIdx.x;
    int nb = k / 32;
    float v[32];
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        decode_any(ty, w, (int)st.tokens[r], nb, tiles, b, v);
        for (int j = 0; j < 32; j++) out[(size_t)r * k + b * 32 + j] = v[j];
    }
}

// The RMS norm's scale of the dim-long row xr into *scale, by the whole block (`ss`: dim / 32 floats of shared
// scratch): rows of a multiple of 32 values by `norm_scales`, as the fused norms do; shorter or ragged ones by a
// warp's lane-strided sums and butterfly.
__device__ __forceinline__ void row_norm_scale(const float* xr, int dim, float eps, float* ss, float* scale) {
    if (dim % 32 == 0) {
        norm_scales(xr, dim, 1, eps, ss, scale);
    } else {
        if (threadIdx.x < 32) {
            float t = 0.f;
            for (int i = threadIdx.x; i < dim; i += 32) t = fmaf(xr[i], xr[i], t);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
            if (threadIdx.x == 0) *scale = rsqrtf(t / dim + eps);
        }
        __syncthreads();
    }
}

// RMS norm of each dim-long row (a block per row; dynamic shared memory: dim / 32 floats of scratch).
extern "C" __global__ void rms_norm(const float* x, const float* w, int dim, float eps, float* out) {
    FLOOR_EXIT
    extern __shared__ float ss[];
    __shared__ float scale;
    wait_inputs();
    release_dependents();
    size_t r = blockIdx.x;
    const float* xr = x + r * dim;
    row_norm_scale(xr, dim, eps, ss, &scale);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[r * dim + i] = xr[i] * scale * w[i];
}

// A post-norm's residual add, x += rms_norm(t) * w (a block per row; dynamic shared memory: k / 32 floats); with
// `norm_w` (rows of a multiple of 32 values), each updated row is then quantized for the projection that follows,
// through its input norm, exactly as `quantize_x` quantizes it in the same block shape (that projection skips its
// own launch). Every row count takes this kernel, so a row's sum never depends on how many come along.
extern "C" __global__ void rms_norm_add(const float* t, const float* w, float eps, float* x, int k,
                                        const float* norm_w, float norm_eps, signed char* xq, float* xd, float* xs) {
    FLOOR_EXIT
    extern __shared__ float ss[];
    __shared__ float scale, rscale;
    wait_inputs();
    release_dependents();
    size_t r = blockIdx.x;
    const float* tr = t + r * k;
    float* xr = x + r * k;
    row_norm_scale(tr, k, eps, ss, &scale);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float v = tr[i] * scale * w[i];
        xr[i] = xr[i] + v;
    }
    if (!norm_w) return;
    __syncthreads();  // the row's new values, written by the whole block, read back by it below
    quantize_x_row(x, k, norm_w, norm_eps, xq, xd, xs, (int)r, ss, &rscale);
}

// x[i] *= s for i < n (Gemma's embedding scale).
extern "C" __global__ void scale(float* x, float s, int n) {
    FLOOR_EXIT
    wait_inputs();
    release_dependents();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// The scale the rms_norm kernel gives a dim-long row, 1 / sqrt(mean(x^2) + eps), by one warp with the same arithmetic:
// rows of a multiple of 32 values as norm_scales sums them (each 32-value block's squares by 8 lanes, 4 values
// each in order, a fixed butterfly; the blocks' sums added in block order), others lane-strided and a butterfly.
__device__ __forceinline__ float warp_norm_scale(const float* x, int dim, float eps) {
    int lane = threadIdx.x & 31;
    float total = 0.f;
    if (dim % 32 == 0) {
        int nb = dim / 32;
        for (int b0 = 0; b0 < nb; b0 += 4) {
            int b = b0 + (lane >> 3);
            float t = 0.f;
            if (b < nb) {
                float4 v = ((const float4*)(x + b * 32))[lane & 7];
                t = v.x * v.x;
                t = fmaf(v.y, v.y, t);
                t = fmaf(v.z, v.z, t);
                t = fmaf(v.w, v.w, t);
            }
#pragma unroll
            for (int off = 4; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
            for (int j = 0; j < 4 && b0 + j < nb; j++) total += __shfl_sync(0xffffffffu, t, j * 8);
        }
    } else {
        for (int i = lane; i < dim; i += 32) total = fmaf(x[i], x[i], total);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    }
    return rsqrtf(total / dim + eps);
}

// Per (row, head), one warp each, Q heads then K heads then V heads: with norm weights `qn` and `kn` (else null),
// each Q and K head RMS-normed first, every value exactly as the rms_norm kernel norms a head_dim-long row; RoPE of the
// first `rotated` values of every Q head (in place; the normed values past them kept) and K head (into the cache
// slot step.base + r, the rest of the head copied), and each V head copied to its slot; a cache of `slots` slots
// is a ring (slot j at j mod slots: a local layer's). The (cos, sin) pairs are the step's table at f32 offset
// `table`, head_dim / 2 pairs per row (the host's `rope_angle` values).
__device__ __forceinline__ void rope_and_cache_head(float* q, const float* k, const float* v, float* kc, float* vc,
                                                    int r, int h, int n_heads, int n_kv_heads, int head_dim,
                                                    int rotated, int table, int interleaved, const int* step,
                                                    int cap, int slots, const float* qn, const float* kn,
                                                    float eps) {
    Step st = read_step(step, cap);
    int lane = threadIdx.x & 31;
    int kv_dim = n_kv_heads * head_dim;
    size_t slot = (size_t)((st.base + r) % slots) * kv_dim;
    if (h >= n_heads + n_kv_heads) {
        h -= n_heads + n_kv_heads;
        const float* src = v + (size_t)r * kv_dim + h * head_dim;
        float* dst = vc + slot + h * head_dim;
        for (int i = lane; i < head_dim; i += 32) dst[i] = src[i];
        return;
    }
    bool is_q = h < n_heads;
    const float* src;
    float* dst;
    const float* nw;
    if (is_q) {
        src = dst = q + ((size_t)r * n_heads + h) * head_dim;
        nw = qn;
    } else {
        h -= n_heads;
        src = k + ((size_t)r * n_kv_heads + h) * head_dim;
        dst = kc + slot + h * head_dim;
        nw = kn;
    }
    // Every load of a Q head's values happens before the shuffles that end the sum, so writing it in place
    // after them is safe; each lane then reads and writes only its own pairs and values.
    float scale = nw ? warp_norm_scale(src, head_dim, eps) : 1.f;
    int half = rotated / 2;
    const float2* cs = (const float2*)(step + table) + (size_t)r * (head_dim / 2);
    for (int i = lane; i < half; i += 32) {
        float c = cs[i].x, s = cs[i].y;
        int ia = interleaved ? 2 * i : i;
        int ib = interleaved ? 2 * i + 1 : i + half;
        float x0 = nw ? src[ia] * scale * nw[ia] : src[ia];
        float x1 = nw ? src[ib] * scale * nw[ib] : src[ib];
        dst[ia] = x0 * c - x1 * s;
        dst[ib] = x0 * s + x1 * c;
    }
    if (is_q && !nw) return;
    for (int j = rotated + lane; j < head_dim; j += 32) dst[j] = nw ? src[j] * scale * nw[j] : src[j];
}

extern "C" __global__ void rope_and_cache(float* q, const float* k, const float* v, float* kc, float* vc,
                                          int rows, int n_heads, int n_kv_heads, int head_dim, int rotated,
                                          int table, int interleaved, const int* step, int cap, int slots,
                                          const float* qn, const float* kn, float eps) {
    FLOOR_EXIT
    wait_inputs();
    release_dependents();
    int heads = n_heads + 2 * n_kv_heads;
    int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= rows * heads) return;
    rope_and_cache_head(q, k, v, kc, vc, w / heads, w % heads, n_heads, n_kv_heads, head_dim, rotated, table,
                        interleaved, step, cap, slots, qn, kn, eps);
}

// Several sequences in one launch (a batched forward's decoding sequences): each its own step, cache layer and
// attention scratch, its rows a run of the launch's rows (`SeqLaunch`, passed by value: no upload, so a launch
// is ready as soon as the host knows the batch). The same per-(row, head) and per-block work as the
// one-sequence kernels, so every value is the same bits as that sequence's own launch gives.
#define MAX_SEQS 32
struct SeqLaunch {
    const int* step;
    float* kc;
    float* vc;
    float* work;
    int cap, table, slots, chunks;  // its step's capacity and rotation table, its cache's slots and 64-slot chunks
    int first_row, rows;            // its rows in q, k, v and out
    int first_item, first_block;    // its first row among the launch's sequences' rows, its first blockIdx.y
};
struct Seqs {
    SeqLaunch s[MAX_SEQS];
    int n;
};

// The sequence whose run (of the launch's rows, or of its attention blocks) holds `x` (the runs ascend).
__device__ __forceinline__ int seq_of(const Seqs& seqs, int x, bool blocks) {
    int i = 0;
    while (i + 1 < seqs.n && (blocks ? seqs.s[i + 1].first_block : seqs.s[i + 1].first_item) <= x) i++;
    return i;
}

// `rope_and_cache` of every sequence of `seqs` (`items`: their rows in all): q, k and v hold the batch's rows,
// each sequence's from its `first_row`.
extern "C" __global__ void rope_and_cache_seqs(float* q, const float* k, const float* v, int items, int n_heads,
                                               int n_kv_heads, int head_dim, int rotated, int interleaved,
                                               const float* qn, const float* kn, float eps, const Seqs seqs) {
    FLOOR_EXIT
    wait_inputs();
    release_dependents();
    int heads = n_heads + 2 * n_kv_heads;
    int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= items * heads) return;
    int item = w / heads;
    const SeqLaunch& sq = seqs.s[seq_of(seqs, item, false)];
    size_t r0 = sq.first_row, kv_dim = (size_t)n_kv_heads * head_dim;
    rope_and_cache_head(q + r0 * n_heads * head_dim, k + r0 * kv_dim, v + r0 * kv_dim, sq.kc, sq.vc,
                        item - sq.first_item, w % heads, n_heads, n_kv_heads, head_dim, rotated, sq.table,
                        interleaved, sq.step, sq.cap, sq.slots, qn, kn, eps);
}

// Attention of each (row, head) over committed slots [0, base) and the batch rows the row sees (causal, or the
// step's tree mask; with a local layer's `window` > 0, only keys at positions qpos - window + 1 ..= qpos, slot j
// < base holding position j; a cache of `slots` slots is a ring, slot j at j mod slots), split over the slots for parallelism (flash-decoding), deterministically:
// - a block serves HEADS query heads of one KV head in one row (the host's choice per launch): each K and V
//   value it loads feeds every one of those heads, so a chunk is read once per block rather than per head;
// - slots are cut into chunks of ATT_CHUNK by absolute index; gridDim.x blocks per (row, head block) (the
//   host's split, for the cache's capacity) take chunks c = blockIdx.x, + gridDim.x, ... (which block takes a
//   chunk changes no bits), and blocks past the step's chunks return at once; each (head, chunk)'s max,
//   exp-sum and value sums are written to `work`;
// - the block that finishes last (a counter per (row, head block), reset by that block) combines each head's
//   chunks in chunk order;
// - a block's first chunk of committed K and V (slots below base, written by earlier forwards) is loaded before
//   griddepcontrol.wait, so it is in flight while the Q/K/V launch before finishes (`attention_ahead_*`; the
//   loaded values go through the same arithmetic, so the results are the same bits either way).
// Every sum's order depends on slot indices alone, never on the number of slots, rows or heads per block, and
// slots a row does not see add exact zeros, so a row gives the same bits alone or in a batch. Rows row0 ..
// row0 + gridDim.y * HEADS / n_heads of the step (at most ATT_ROWS); `work` holds ATT_ROWS * n_heads counters,
// then per (row, head) `chunks` records of {max, sum, head_dim value sums}. Dynamic shared memory: HEADS * 4 *
// head_dim floats.
#ifndef ATT_ROWS
#define ATT_ROWS 16
#endif
#define ATT_CHUNK 64
#define MAX_HEAD_DIM 256
#define ATT_AHEAD_DIM 64  // heads up to this size load their first chunk before waiting for the grid before

// d + a . b, the four products in order: one step of a score's quarter chain.
__device__ __forceinline__ float fma4(float4 a, float4 b, float d) {
    d = fmaf(a.x, b.x, d);
    d = fmaf(a.y, b.y, d);
    d = fmaf(a.z, b.z, d);
    return fmaf(a.w, b.w, d);
}

// Whether step row i (at position qpos) sees key j of its view (`view_slot`): committed slots below base, then
// the step's rows it sees, none at or past n = base + rows; a local layer's `window` keeps only the last positions.
__device__ __forceinline__ bool slot_seen(const Step& st, int i, int j, int n, int window, int qpos) {
    int base = st.base;
    bool sees = j < n && (j < base || j - base < step_keys(st, i));
    if (window > 0 && sees) sees = qpos - (j < base ? j : st.positions[view_slot(st, i, j) - base]) < window;
    return sees;
}

// A slot's score from its four quarter dots on lanes 4s .. 4s + 3: (q0 + q1) + (q2 + q3) on every lane of the
// four.
__device__ __forceinline__ float quarter_sum(float d) {
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    return d + __shfl_xor_sync(0xffffffffu, d, 2);
}

// One head's chunk of 64 scores in a warp, slots lane and lane + 32 in `a` and `b` (NEG_INF: unseen): its max
// (exact in any order) into `m`, the two slots' weights exp(score - m) back into `a` and `b`, and on lane 0 the
// exp-sum in the order of a halving tree (slot lane + 32 onto lane, then shfl_down 16 ... 1).
__device__ __forceinline__ float chunk_weights(float& a, float& b, float& m) {
    m = fmaxf(a, b);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    a = a == NEG_INF ? 0.f : __expf(a - m);
    b = b == NEG_INF ? 0.f : __expf(b - m);
    float sum = a + b;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    return sum;
}

// The combine, for the last block of a (row, head block): each head's chunk records c_lo .. nc - 1 in chunk order,
// with big the largest chunk max and f_c = exp(m_c - big): den = fmaf(f_c, sum_c, den), num = fmaf(f_c,
// value_c[e], num), out = num / den. Each (head, chunk)'s f_c and sum are computed once into shared memory,
// COMBINE_CHUNKS chunks at a time, and each thread's value loads run ahead of its chains (one chain per thread
// and chunk loaded in turn waits on every load): the same arithmetic, the same bits. ITEMS: the most (head, dim)
// outputs a thread holds (HEADS * MAX_HEAD_DIM / threads). `out`: the row's first head of the block; with `xq`,
// the outputs are also quantized there for the output projection (`xd`, `xs` at the same block).
#define COMBINE_CHUNKS 32
template <int HEADS, int ITEMS>
__device__ void combine_chunks(const float* records, int chunks, int rec, int c_lo, int nc, int head_dim,
                               float* out, signed char* xq, float* xd, float* xs) {
    __shared__ float wmax[32][HEADS], big[HEADS];
    __shared__ float wf[HEADS][COMBINE_CHUNKS], wsum[HEADS][COMBINE_CHUNKS];
    __shared__ int off[COMBINE_CHUNKS];
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, n = HEADS * head_dim;
#ifdef KO_ATT_NOCOMBINE
    for (int u = t; u < n; u += blockDim.x) out[u] = 0.f;  // knockout: no combine
    return;
#endif
    float mx[HEADS];
#pragma unroll
    for (int g = 0; g < HEADS; g++) mx[g] = NEG_INF;
    for (int c = c_lo + t; c < nc; c += blockDim.x)
#pragma unroll
        for (int g = 0; g < HEADS; g++) mx[g] = fmaxf(mx[g], __ldcg(records + ((size_t)g * chunks + c % chunks) * rec));
#pragma unroll
    for (int g = 0; g < HEADS; g++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], o));
        if (lane == 0) wmax[warp][g] = mx[g];
    }
    __syncthreads();
    if (t < HEADS) {
        float m = NEG_INF;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, wmax[w][t]);
        big[t] = m;
    }
    float num[ITEMS], den[ITEMS];
#pragma unroll
    for (int it = 0; it < ITEMS; it++) num[it] = den[it] = 0.f;
    for (int c0 = c_lo; c0 < nc; c0 += COMBINE_CHUNKS) {
        int cn = min(COMBINE_CHUNKS, nc - c0);
        __syncthreads();  // big is set; the last batch's weights are read
        for (int u = t; u < HEADS * cn; u += blockDim.x) {
            int g = u / cn, k = u % cn;
            const float* r = records + ((size_t)g * chunks + (c0 + k) % chunks) * rec;
            float mc = __ldcg(r);
            wf[g][k] = mc == NEG_INF ? 0.f : __expf(mc - big[g]);
            wsum[g][k] = __ldcg(r + 1);
            if (g == 0) off[k] = (c0 + k) % chunks * rec;
        }
        __syncthreads();
#pragma unroll
        for (int it = 0; it < ITEMS; it++) {
            int u = t + it * (int)blockDim.x;
            if (u < n) {
                int g = u / head_dim, e = u % head_dim;
                const float* rv = records + (size_t)g * chunks * rec + 2 + e;
#pragma unroll 8
                for (int k = 0; k < cn; k++) {
                    float f = wf[g][k];
                    den[it] = fmaf(f, wsum[g][k], den[it]);
                    num[it] = fmaf(f, __ldcg(rv + off[k]), num[it]);
                }
            }
        }
    }
#pragma unroll
    for (int it = 0; it < ITEMS; it++) {
        int u = t + it * (int)blockDim.x;
        if (u < n) out[u] = num[it] / den[it];
    }
    if (xq) {  // staged for the output projection (whole 32-value blocks: the host checks)
        __syncthreads();  // the outputs, written by every thread of the block, read back by its warps
        quantize_blocks(out, n / 32, xq, xd, xs);
    }
}

// `by`: the block's (row, head block) index in the launch (blockIdx.y, or its place in its sequence's run).
template <bool AHEAD, int HEADS>
__device__ __forceinline__ void attention_body(int by, const float* q, const float* kc, const float* vc, int row0,
                                               int n_heads, int n_kv_heads, int head_dim, float scale,
                                               int window, int slots, const int* step, int cap, float* work,
                                               int chunks, float* out, signed char* xq, float* xd, float* xs) {
    __shared__ __align__(16) float sc[HEADS][ATT_CHUNK];
    __shared__ float red[HEADS][2];  // each head's chunk max and exp-sum
    __shared__ int last;
    extern __shared__ float quarter[];  // [HEADS][4][head_dim]: each head's value sums per quarter of the chunk
    // The step (written by the host before the forward) and the committed slots [0, base) (written by earlier
    // forwards) are read before waiting for the grid before: this block's first chunk of K and V is in flight
    // while the Q/K/V projection finishes. Only q and this step's slots wait.
    Step st = read_step(step, cap);
    int base = st.base, rows = st.rows, n = base + rows;
    int t = threadIdx.x;
#ifdef KO_ATT_ONEHEAD
    constexpr int HC = 1;  // knockout: the first head's dot products and value sums only
#else
    constexpr int HC = HEADS;
#endif
    int per_row = n_heads / HEADS;
    int ri = by / per_row, h0 = by % per_row * HEADS;
    int i = row0 + ri;
    int kvh = h0 / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * head_dim;
    int rec = head_dim + 2;
    const float* qv = q + ((size_t)i * n_heads + h0) * head_dim;  // head h0 + g at qv + g * head_dim
    // A local layer's window: keys before position qpos - window + 1 are not seen; chunks wholly before it are
    // neither computed nor combined (their records would add exact zeros).
    int qpos = st.positions[i];
    int c_lo = window > 0 ? max(0, qpos - window + 1) / ATT_CHUNK : 0;
    const float* kh = kc + kvh * head_dim;
    const float* vh = vc + kvh * head_dim;
    unsigned int* counters = (unsigned int*)work;
    // Head h0 + g's records at records + g * chunks * rec; chunk c's at c mod chunks (`chunks` covers the cache's
    // slots: in a local layer's ring, more than the chunks a row's window and the step's rows span).
    float* records = work + ATT_ROWS * n_heads + (size_t)(ri * n_heads + h0) * chunks * rec;
    // The first chunk's committed K (this thread's quarter of its slot) and V (this thread's first value-sum
    // item's 16 slots), for heads of up to ATT_AHEAD_DIM values (more would cost occupancy in registers).
    bool vec = (head_dim & 15) == 0;
    bool ahead = AHEAD && head_dim <= ATT_AHEAD_DIM && 4 * head_dim <= (int)blockDim.x;
    float4 kq[AHEAD ? ATT_AHEAD_DIM / 16 : 1];
    float vq[AHEAD ? ATT_CHUNK / 4 : 1];
    {
        int j0 = blockIdx.x * ATT_CHUNK, j = j0 + (t >> 2), w = head_dim / 16;
        if (ahead && vec && j < base) {
            const float4* k4 = (const float4*)(kh + (size_t)(j % slots) * kv_dim) + (t & 3) * w;
#pragma unroll
            for (int e = 0; e < ATT_AHEAD_DIM / 16; e++)
                if (e < w) kq[e] = k4[e];
        }
        if (ahead && t < 4 * head_dim) {
            int jq = j0 + t / head_dim * (ATT_CHUNK / 4), e = t % head_dim;
#pragma unroll
            for (int jj = 0; jj < ATT_CHUNK / 4; jj++)
                if (jq + jj < base) vq[jj] = vh[(size_t)((jq + jj) % slots) * kv_dim + e];
        }
    }
    // A recorded launch serves every context its cache holds: blocks past the step's chunks have no work (and
    // loaded nothing above: their slots are past base).
    if ((int)blockIdx.x * ATT_CHUNK >= n) return;
    wait_inputs();
    release_dependents();
    for (int c = blockIdx.x; c * ATT_CHUNK < n; c += gridDim.x) {
        if (c < c_lo) continue;  // uniform across the block
        int j0 = c * ATT_CHUNK;
        bool first = c == (int)blockIdx.x;
        // Scores: four threads per slot, each a quarter of the head's dims (every head from the same loaded K),
        // then a fixed butterfly.
        int js = t >> 2, sub = t & 3, j = j0 + js;
        bool sees = slot_seen(st, i, j, n, window, qpos);
        float d[HEADS];
#pragma unroll
        for (int g = 0; g < HEADS; g++) d[g] = 0.f;
        if (sees) {
            const float* kv = kh + (size_t)(view_slot(st, i, j) % slots) * kv_dim;
            if (vec) {
                int w = head_dim / 16;  // float4s per quarter
                const float4* k4 = (const float4*)kv + sub * w;
                bool held = ahead && first && j < base;
#pragma unroll
                for (int e = 0; e < MAX_HEAD_DIM / 16; e++) {
                    if (e < w) {
                        float4 b = AHEAD && held && e < ATT_AHEAD_DIM / 16 ? kq[AHEAD ? e : 0] : k4[e];
#pragma unroll
                        for (int g = 0; g < HC; g++) {
                            d[g] = fma4(((const float4*)(qv + g * head_dim))[sub * w + e], b, d[g]);
                        }
                    }
                }
            } else {
                for (int e = sub; e < head_dim; e += 4) {
                    float b = kv[e];
#pragma unroll
                    for (int g = 0; g < HC; g++) d[g] = fmaf(qv[g * head_dim + e], b, d[g]);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < HEADS; g++) {
            float s = quarter_sum(d[g]);
            if (sub == 0) sc[g][js] = sees ? s * scale : NEG_INF;
        }
        __syncthreads();
        // Each head's chunk max and exp-sum in a warp of its own, two slots per lane: the sum in the order of a
        // halving tree (slot lane + 32 onto lane, then shfl_down 16 ... 1), the max exact in any order.
        int g = t >> 5, lane = t & 31;
        if (g < HEADS) {
            float a = sc[g][lane], b = sc[g][lane + 32], m;
            float sum = chunk_weights(a, b, m);
            sc[g][lane] = a;
            sc[g][lane + 32] = b;
            if (lane == 0) {
                red[g][0] = m;
                red[g][1] = sum;
            }
        }
        __syncthreads();
        // Value sums: each quarter of the chunk's slots in order (every head from the same loaded V), then the
        // quarters in order.
        for (int u = t; u < 4 * head_dim; u += blockDim.x) {
            int qq = u / head_dim, e = u % head_dim;
            int jq = j0 + qq * (ATT_CHUNK / 4);
            bool held = ahead && first && u == t;
            float a[HEADS];
#pragma unroll
            for (int g = 0; g < HEADS; g++) a[g] = 0.f;
            // The weights four slots at a time: one shared load per head for four FMAs, the same FMAs in order;
            // fewer shared loads, faster at every width measured (BENCHMARKS.md, "Verify cost by width").
#pragma unroll
            for (int j4 = 0; j4 < ATT_CHUNK / 16; j4++) {
                float4 p[HEADS];
#pragma unroll
                for (int g = 0; g < HC; g++) p[g] = ((const float4*)&sc[g][qq * (ATT_CHUNK / 4)])[j4];
#pragma unroll
                for (int s4 = 0; s4 < 4; s4++) {
                    int jj = 4 * j4 + s4;
                    if (jq + jj < n) {
                        float v = AHEAD && held && jq + jj < base
                                      ? vq[AHEAD ? jj : 0]
                                      : vh[(size_t)(view_slot(st, i, jq + jj) % slots) * kv_dim + e];
#pragma unroll
                        for (int g = 0; g < HC; g++) {
                            float w = s4 == 0 ? p[g].x : s4 == 1 ? p[g].y : s4 == 2 ? p[g].z : p[g].w;
                            a[g] = fmaf(w, v, a[g]);
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < HEADS; g++) quarter[(g * 4 + qq) * head_dim + e] = a[g];
        }
        __syncthreads();
        for (int u = t; u < HEADS * head_dim; u += blockDim.x) {
            int g = u / head_dim, e = u % head_dim;
            const float* qg = quarter + g * 4 * head_dim;
            records[((size_t)g * chunks + c % chunks) * rec + 2 + e] =
                ((qg[e] + qg[head_dim + e]) + qg[2 * head_dim + e]) + qg[3 * head_dim + e];
        }
        if (t < HEADS) {
            float* r = records + ((size_t)t * chunks + c % chunks) * rec;
            r[0] = red[t][0];
            r[1] = red[t][1];
        }
        __syncthreads();
    }
    __threadfence();
    __syncthreads();
    // The working blocks: one per chunk up to the grid's width.
    int nc = (n + ATT_CHUNK - 1) / ATT_CHUNK;
    if (t == 0) last = atomicAdd(&counters[by], 1u) == min(gridDim.x, (unsigned)nc) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (t == 0) counters[by] = 0;
    size_t o = ((size_t)i * n_heads + h0) * head_dim, ob = o / 32;  // the block's first value, 32-value block
    combine_chunks<HEADS, HEADS * MAX_HEAD_DIM / 256>(records, chunks, rec, c_lo, nc, head_dim, out + o, xq ? xq + o : xq,
        xq ? xd + ob : xd, xq ? xs + ob : xs);
}

// The attention kernels, one per count of heads a block serves: the same arithmetic (the same bits), with the
// first chunk of committed K/V loaded before griddepcontrol.wait (`attention_ahead_*`, for small grids) or after
// (`attention_*`: fewer registers, so wide verifies keep their blocks per SM).
#define ATT_PARAMS                                                                                             \
    const float *q, const float *kc, const float *vc, int row0, int n_heads, int n_kv_heads, int head_dim,     \
        float scale, int window, int slots, const int *step, int cap, float *work, int chunks, float *out,       \
        signed char *xq, float *xd, float *xs
#define ATT_ARGS \
    q, kc, vc, row0, n_heads, n_kv_heads, head_dim, scale, window, slots, step, cap, work, chunks, out, xq, xd, xs

#ifdef KO_ATT
#define ATT_EXIT WAIT_AND_RETURN
#else
#define ATT_EXIT FLOOR_EXIT
#endif
// The shared launch's block: its sequence's rows from `first_row` on in q, out and the staging target (whole
// 32-value blocks: a row's values start at a multiple of n_heads * head_dim, itself a multiple of 32 where the
// host stages), its step, cache layer and scratch.
template <bool AHEAD, int HEADS>
__device__ __forceinline__ void attention_seq_block(const float* q, int n_heads, int n_kv_heads, int head_dim,
                                                    float scale, int window, float* out, signed char* xq, float* xd,
                                                    float* xs, const Seqs& seqs) {
    const SeqLaunch& sq = seqs.s[seq_of(seqs, blockIdx.y, true)];
    size_t o = (size_t)sq.first_row * n_heads * head_dim;
    attention_body<AHEAD, HEADS>(blockIdx.y - sq.first_block, q + o, sq.kc, sq.vc, 0, n_heads, n_kv_heads, head_dim,
                                 scale, window, sq.slots, sq.step, sq.cap, sq.work, sq.chunks, out + o,
                                 xq ? xq + o : xq, xq ? xd + o / 32 : xd, xq ? xs + o / 32 : xs);
}
#define ATT_SEQ_PARAMS                                                                                         \
    const float *q, int n_heads, int n_kv_heads, int head_dim, float scale, int window, float *out,            \
        signed char *xq, float *xd, float *xs, const Seqs seqs
#define ATT_SEQ_ARGS q, n_heads, n_kv_heads, head_dim, scale, window, out, xq, xd, xs, seqs

#define ATT_KERNELS(H)                                                                                         \
    extern "C" __global__ void attention_##H(ATT_PARAMS) {                                                     \
        ATT_EXIT attention_body<false, H>(blockIdx.y, ATT_ARGS);                                               \
    }                                                                                                          \
    extern "C" __global__ void attention_ahead_##H(ATT_PARAMS) {                                               \
        ATT_EXIT attention_body<true, H>(blockIdx.y, ATT_ARGS);                                                \
    }                                                                                                          \
    extern "C" __global__ void attention_seqs_##H(ATT_SEQ_PARAMS) {                                            \
        ATT_EXIT attention_seq_block<false, H>(ATT_SEQ_ARGS);                                                  \
    }                                                                                                          \
    extern "C" __global__ void attention_seqs_ahead_##H(ATT_SEQ_PARAMS) {                                      \
        ATT_EXIT attention_seq_block<true, H>(ATT_SEQ_ARGS);                                                   \
    }
ATT_KERNELS(1)
ATT_KERNELS(2)
ATT_KERNELS(3)
ATT_KERNELS(4)

// Attention of many rows (prefill chunks, wide verifies): the same chunk records and combine as `attention_body`,
// bit for bit, with a warp per (row, head block, chunk) instead of a block of 256 threads per chunk. A chunk's
// record needs no barrier but the warp's own: the scores with four lanes per slot (lane 4 s + u: slot s of the
// pass, quarter u of the head's dims, the same fmaf chain and butterfly as the block's four threads), each head's
// max and halving-tree exp-sum in the warp (two slots per lane, as there), the value sums with the lanes over
// the head's dims, each quarter of 16 slots in order and the quarters added in order. So a block's warps work on
// their chunks independently, and where `attention_body` spends three block barriers per chunk, these pass none.
// Grid: (blocks per (row, head block), rows of the launch x head blocks); warp w of block x takes chunks
// x * ATT_WARPS + w, then every ATT_WARPS * gridDim.x-th; the block that finishes last for its (row, head block)
// combines as `attention_body` does. A row's chunks past the last slot it sees are skipped, exactly: their
// records would add exact zeros. DPL: the head's dims per lane (32 * DPL >= head_dim). Dynamic shared memory: none.
#define ATT_WARPS 4
template <int HEADS, int DPL>
__device__ __forceinline__ void attention_warps_body(const float* q, const float* kc, const float* vc, int row0,
                                                     int n_heads, int n_kv_heads, int head_dim, float scale,
                                                     int window, int slots, const int* step, int cap, float* work,
                                                     int chunks, float* out, signed char* xq, float* xd,
                                                     float* xs) {
    // The heads' q, each quarter of a head's dims padded by four floats (the score pass's four quarters fall in
    // different banks).
    __shared__ __align__(16) float qs[HEADS * (MAX_HEAD_DIM + 16)];
    __shared__ __align__(16) float sc[ATT_WARPS][HEADS][ATT_CHUNK];
    __shared__ int last;
    Step st = read_step(step, cap);
    int base = st.base, rows = st.rows, n = base + rows;
    int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    int per_row = n_heads / HEADS;
    int ri = blockIdx.y / per_row, h0 = blockIdx.y % per_row * HEADS;
    int i = row0 + ri;
    int kvh = h0 / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * head_dim;
    int rec = head_dim + 2;
    int qpos = st.positions[i];
    // The chunks this row reads: from its window's first (local layers) to the one holding the last slot it can
    // see (its own, causally; a tree row may see any of the step's rows).
    int c_lo = window > 0 ? max(0, qpos - window + 1) / ATT_CHUNK : 0;
    int nc = (base + step_keys(st, i) - 1) / ATT_CHUNK + 1;
    int workers = min((int)gridDim.x, (nc + ATT_WARPS - 1) / ATT_WARPS);
    if ((int)blockIdx.x >= workers) return;
    const float* kh = kc + kvh * head_dim;
    const float* vh = vc + kvh * head_dim;
    unsigned int* counters = (unsigned int*)work;
    float* records = work + ATT_ROWS * n_heads + (size_t)(ri * n_heads + h0) * chunks * rec;
    wait_inputs();
    release_dependents();
    const float* qv = q + ((size_t)i * n_heads + h0) * head_dim;
    bool vec = (head_dim & 15) == 0;
    int qd = head_dim / 4, qstride = 4 * (qd + 4);  // a quarter's dims; a head's floats in qs (vec)
    for (int u = t; u < HEADS * head_dim; u += blockDim.x) {
        int g = u / head_dim, e = u % head_dim;
        qs[vec ? g * qstride + e / qd * (qd + 4) + e % qd : u] = qv[u];
    }
    __syncthreads();
    int sub = lane & 3;
    float(*ws)[ATT_CHUNK] = sc[warp];
    for (int c = blockIdx.x * ATT_WARPS + warp; c < nc; c += ATT_WARPS * gridDim.x) {
        if (c < c_lo) continue;
        int j0 = c * ATT_CHUNK;
        // Scores, eight slots a pass. Every lane loads a slot's keys (past the step's slots, the last one's), so
        // the loads of a pass issue together; slots the row does not see keep NEG_INF, their dots unused.
#pragma unroll 2
        for (int pass = 0; pass < ATT_CHUNK / 8; pass++) {
            int js = pass * 8 + (lane >> 2), j = j0 + js;
            bool sees = slot_seen(st, i, j, n, window, qpos);
            float d[HEADS];
#pragma unroll
            for (int g = 0; g < HEADS; g++) d[g] = 0.f;
            const float* kv = kh + (size_t)(view_slot(st, i, min(j, n - 1)) % slots) * kv_dim;
            if (vec) {
                int w = head_dim / 16;
                const float4* k4 = (const float4*)kv + sub * w;
#pragma unroll
                for (int e = 0; e < MAX_HEAD_DIM / 16; e++) {
                    if (e < w) {
                        float4 b = k4[e];
#pragma unroll
                        for (int g = 0; g < HEADS; g++) {
                            d[g] = fma4(((const float4*)(qs + g * qstride + sub * (qd + 4)))[e], b, d[g]);
                        }
                    }
                }
            } else {
                for (int e = sub; e < head_dim; e += 4) {
                    float b = kv[e];
#pragma unroll
                    for (int g = 0; g < HEADS; g++) d[g] = fmaf(qs[g * head_dim + e], b, d[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < HEADS; g++) {
                float s = quarter_sum(d[g]);
                if (sub == 0) ws[g][js] = sees ? s * scale : NEG_INF;
            }
        }
        __syncwarp();
        // Each head's max and exp-sum: two slots per lane, the halving tree.
#pragma unroll
        for (int g = 0; g < HEADS; g++) {
            float a = ws[g][lane], b = ws[g][lane + 32], m;
            float sum = chunk_weights(a, b, m);
            ws[g][lane] = a;
            ws[g][lane + 32] = b;
            if (lane == 0) {
                float* r = records + ((size_t)g * chunks + c % chunks) * rec;
                r[0] = m;
                r[1] = sum;
            }
        }
        __syncwarp();
        // Value sums: lane l holds dims l + 32 dd; each quarter's 16 slots in order, the quarters added in order.
        float tot[HEADS][DPL];
#pragma unroll
        for (int qq = 0; qq < 4; qq++) {
            float a[HEADS][DPL];
#pragma unroll
            for (int g = 0; g < HEADS; g++)
#pragma unroll
                for (int dd = 0; dd < DPL; dd++) a[g][dd] = 0.f;
            // Eight slots' values loaded at a time (past the step's slots, the last one's: loaded, never added),
            // then their FMAs in slot order.
#pragma unroll
            for (int j8 = 0; j8 < ATT_CHUNK / 32; j8++) {
                int jb = j0 + qq * (ATT_CHUNK / 4) + 8 * j8;
                float v[8][DPL];
#pragma unroll
                for (int s8 = 0; s8 < 8; s8++) {
                    const float* vr = vh + (size_t)(view_slot(st, i, min(jb + s8, n - 1)) % slots) * kv_dim;
#pragma unroll
                    for (int dd = 0; dd < DPL; dd++) v[s8][dd] = lane + 32 * dd < head_dim ? vr[lane + 32 * dd] : 0.f;
                }
#pragma unroll
                for (int h4 = 0; h4 < 2; h4++) {
                    float4 p[HEADS];
#pragma unroll
                    for (int g = 0; g < HEADS; g++)
                        p[g] = ((const float4*)&ws[g][qq * (ATT_CHUNK / 4) + 8 * j8])[h4];
#pragma unroll
                    for (int s4 = 0; s4 < 4; s4++) {
                        int s8 = 4 * h4 + s4;
                        if (jb + s8 < n) {
#pragma unroll
                            for (int g = 0; g < HEADS; g++) {
                                float w = s4 == 0 ? p[g].x : s4 == 1 ? p[g].y : s4 == 2 ? p[g].z : p[g].w;
#pragma unroll
                                for (int dd = 0; dd < DPL; dd++) a[g][dd] = fmaf(w, v[s8][dd], a[g][dd]);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < HEADS; g++)
#pragma unroll
                for (int dd = 0; dd < DPL; dd++) tot[g][dd] = qq == 0 ? a[g][dd] : tot[g][dd] + a[g][dd];
        }
#pragma unroll
        for (int g = 0; g < HEADS; g++)
#pragma unroll
            for (int dd = 0; dd < DPL; dd++) {
                int e = lane + 32 * dd;
                if (e < head_dim) records[((size_t)g * chunks + c % chunks) * rec + 2 + e] = tot[g][dd];
            }
        __syncwarp();  // the slot weights are read before the next chunk's scores overwrite them
    }
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(&counters[blockIdx.y], 1u) == workers - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (t == 0) counters[blockIdx.y] = 0;
    size_t o = ((size_t)i * n_heads + h0) * head_dim, ob = o / 32;  // the block's first value, 32-value block
    combine_chunks<HEADS, HEADS * MAX_HEAD_DIM / (ATT_WARPS * 32)>(records, chunks, rec, c_lo, nc, head_dim, out + o, xq ? xq + o : xq,
        xq ? xd + ob : xd, xq ? xs + ob : xs);
}

#define ATT_WARP_KERNEL(H, D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention_warps_##H##_##D(ATT_PARAMS) {       \
        ATT_EXIT attention_warps_body<H, D>(ATT_ARGS);                                                         \
    }
#define ATT_WARP_KERNELS(H) ATT_WARP_KERNEL(H, 1) ATT_WARP_KERNEL(H, 2) ATT_WARP_KERNEL(H, 4) ATT_WARP_KERNEL(H, 8)
ATT_WARP_KERNELS(1)
ATT_WARP_KERNELS(2)
ATT_WARP_KERNELS(3)
ATT_WARP_KERNELS(4)

extern "C" __global__ void add_bias(float* x, const float* b, int dim, int n) {
    FLOOR_EXIT
    wait_inputs();
    release_dependents();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) x[t] += b[t % dim];
}

// Whether candidate (v, i) beats the best so far (b, bi; bi < 0: none yet) under `sample::argmax`'s choice: the
// largest value, the lowest index among equals, NaN never chosen.
__device__ __forceinline__ bool beats(float v, int i, float b, int bi) {
    return !isnan(v) && (bi < 0 || v > b || (v == b && i < bi));
}

// The argmax of values [lo, hi) of row xr by the whole block, as (b, bi), bi = -1 for none; four 16-byte loads in
// flight per thread where the row allows them (n a multiple of 4, lo too).
__device__ __forceinline__ void argmax_range(const float* xr, int n, int lo, int hi, float* b, int* bi) {
    __shared__ float sb[32];
    __shared__ int si[32];
    float bv = 0.f;
    int bix = -1;
    int lo4 = n % 4 == 0 ? lo / 4 : 0, hi4 = n % 4 == 0 ? hi / 4 : 0;
    for (int i0 = lo4 + threadIdx.x; i0 < hi4; i0 += 4 * blockDim.x) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = i0 + u * blockDim.x;
            if (i < hi4) v[u] = ((const float4*)xr)[i];
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int i = 4 * (i0 + u * blockDim.x);
            if (i < 4 * hi4) {
                if (beats(v[u].x, i, bv, bix)) bv = v[u].x, bix = i;
                if (beats(v[u].y, i + 1, bv, bix)) bv = v[u].y, bix = i + 1;
                if (beats(v[u].z, i + 2, bv, bix)) bv = v[u].z, bix = i + 2;
                if (beats(v[u].w, i + 3, bv, bix)) bv = v[u].w, bix = i + 3;
            }
        }
    }
    for (int i = (hi4 > lo4 ? 4 * hi4 : lo) + threadIdx.x; i < hi; i += blockDim.x) {
        float v = xr[i];
        if (beats(v, i, bv, bix)) bv = v, bix = i;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, bv, off);
        int i = __shfl_xor_sync(0xffffffffu, bix, off);
        if (i >= 0 && beats(v, i, bv, bix)) bv = v, bix = i;
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (lane == 0) sb[warp] = bv, si[warp] = bix;
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? sb[lane] : 0.f;
        bix = lane < warps ? si[lane] : -1;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float v = __shfl_xor_sync(0xffffffffu, bv, off);
            int i = __shfl_xor_sync(0xffffffffu, bix, off);
            if (i >= 0 && beats(v, i, bv, bix)) bv = v, bix = i;
        }
    }
    *b = bv;
    *bi = bix;  // valid in thread 0
}

// out[r] = the index of row r's largest of n values, as an exact float, picked as `sample::argmax` picks it: its
// serial scan never moves off a NaN first value (index 0); otherwise it finds the lowest index of the largest
// non-NaN value, which is what this order-free reduction finds. Grid (rows, parts): each block takes a slice of
// its row (a multiple of 4 values, so slices stay 16-byte aligned) and leaves its best in `work` (per row:
// parts values, parts indices, as floats); the row's last block (`counters[row]`, zero between launches: that
// block resets it) reduces them.
extern "C" __global__ void argmax_rows(const float* x, int n, float* out, float* work, unsigned* counters) {
    FLOOR_EXIT
    __shared__ bool last;
    wait_inputs();
    release_dependents();
    int row = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
    const float* xr = x + (size_t)row * n;
    int per = ((n + parts - 1) / parts + 3) & ~3;
    int lo = min(n, part * per), hi = min(n, lo + per);
    float b;
    int bi;
    argmax_range(xr, n, lo, hi, &b, &bi);
    float* rec = work + (size_t)row * 2 * parts;
    unsigned* counter = counters + row;
    if (threadIdx.x == 0) {
        rec[part] = b;
        rec[parts + part] = __int_as_float(bi);
        __threadfence();
        last = atomicAdd(counter, 1u) == (unsigned)parts - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();
    int lane = threadIdx.x;
    b = lane < parts ? __ldcg(rec + lane) : 0.f;
    bi = lane < parts ? __float_as_int(__ldcg(rec + parts + lane)) : -1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, b, off);
        int i = __shfl_xor_sync(0xffffffffu, bi, off);
        if (i >= 0 && beats(v, i, b, bi)) b = v, bi = i;
    }
    if (lane == 0) {
        out[row] = (float)(isnan(xr[0]) || bi < 0 ? 0 : bi);
        *counter = 0;
    }
}

// A greedy draft picked on the device (`Backend::draft_token`): token = table[src[0]] (or src[0] itself without a
// table), to log[0] and, where given, into a step's first token slot — the next draft step's input. No
// LAUNCH_FLOOR exit: even a floor measurement must hand the next step a token inside the vocabulary.
extern "C" __global__ void draft_token(const float* src, const float* table, float* log, int* step_token) {
    wait_inputs();
    release_dependents();
    if (threadIdx.x != 0) return;
    int i = (int)src[0];
    float token = table ? table[i] : (float)i;
    log[0] = token;
    if (step_token) *step_token = (int)token;
}
