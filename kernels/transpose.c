/* A transposing copy of a 2D matrix, for the CPU weight loader (kernels/transpose.py says why).

   warpspec_transpose_N(src, dst, rows, cols, src_row_stride, dst_row_stride), N the element's bytes:
   dst[c * dst_row_stride + r] = src[r * src_row_stride + c] for r < rows, c < cols, a [rows, cols]
   matrix in and its [cols, rows] transpose out, each with rows of unit stride.

   2- and 4-byte elements go by 8 x 8 and 4 x 4 blocks transposed in 16-byte vectors (GCC and Clang
   vector extensions: SSE2 on x86-64, NEON on ARM), the blocks of one TILE x TILE tile in turn so
   that the tile's source and destination lines stay in the L1 cache until they are used up. An
   element by element copy with the same tiles runs at about 0.6x of it; 1- and 8-byte elements (FP8
   experts, rare on a CPU) take that path. */

#include <stdint.h>
#include <string.h>

#define TILE 32

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v4u32 __attribute__((vector_size(16)));
typedef uint64_t v2u64 __attribute__((vector_size(16)));

/* Rows a0..a7 -> columns: interleave 16-bit, then 32-bit, then 64-bit lanes.
   t0 = [a00 a10 a01 a11 a02 a12 a03 a13], u0 = [a00 a10 a20 a30 a01 a11 a21 a31], o0 = column 0. */
static inline void block_2(const uint16_t *src, uint16_t *dst, int64_t src_row_stride, int64_t dst_row_stride) {
    v8u16 a[8], t[8];
    v4u32 u[8];
    for (int i = 0; i < 8; i++)
        memcpy(&a[i], src + i * src_row_stride, sizeof(v8u16));
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(a[i], a[i + 1], 0, 8, 1, 9, 2, 10, 3, 11);
        t[i + 1] = __builtin_shufflevector(a[i], a[i + 1], 4, 12, 5, 13, 6, 14, 7, 15);
    }
    for (int h = 0; h < 8; h += 4) /* rows 0-3, then 4-7 */
        for (int k = 0; k < 2; k++) { /* columns 0-3, then 4-7 */
            v4u32 x = (v4u32)t[h + k], y = (v4u32)t[h + 2 + k];
            u[h + 2 * k] = __builtin_shufflevector(x, y, 0, 4, 1, 5);
            u[h + 2 * k + 1] = __builtin_shufflevector(x, y, 2, 6, 3, 7);
        }
    for (int j = 0; j < 4; j++) {
        v2u64 x = (v2u64)u[j], y = (v2u64)u[4 + j];
        v2u64 even = __builtin_shufflevector(x, y, 0, 2), odd = __builtin_shufflevector(x, y, 1, 3);
        memcpy(dst + 2 * j * dst_row_stride, &even, sizeof(v2u64));
        memcpy(dst + (2 * j + 1) * dst_row_stride, &odd, sizeof(v2u64));
    }
}

/* Rows a0..a3 -> columns: t0 = [a00 a10 a01 a11], t2 = [a20 a30 a21 a31], o0 = [a00 a10 a20 a30]. */
static inline void block_4(const uint32_t *src, uint32_t *dst, int64_t src_row_stride, int64_t dst_row_stride) {
    v4u32 a[4], t[4];
    for (int i = 0; i < 4; i++)
        memcpy(&a[i], src + i * src_row_stride, sizeof(v4u32));
    for (int i = 0; i < 4; i += 2) {
        t[i] = __builtin_shufflevector(a[i], a[i + 1], 0, 4, 1, 5);
        t[i + 1] = __builtin_shufflevector(a[i], a[i + 1], 2, 6, 3, 7);
    }
    for (int k = 0; k < 2; k++) {
        v2u64 x = (v2u64)t[k], y = (v2u64)t[2 + k];
        v2u64 even = __builtin_shufflevector(x, y, 0, 2), odd = __builtin_shufflevector(x, y, 1, 3);
        memcpy(dst + 2 * k * dst_row_stride, &even, sizeof(v2u64));
        memcpy(dst + (2 * k + 1) * dst_row_stride, &odd, sizeof(v2u64));
    }
}

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Whole BLOCK x BLOCK blocks by BLOCK_FN, tile by tile; the rows and columns past the last whole
   block element by element. BLOCK 1 with no BLOCK_FN: every element one by one, in tiles. */
#define DEFINE_TRANSPOSE(NAME, T, BLOCK, BLOCK_FN)                                                      \
    void NAME(const T *src, T *dst, int64_t rows, int64_t cols, int64_t src_row_stride,                 \
              int64_t dst_row_stride) {                                                                \
        const int64_t block_rows = rows - rows % BLOCK, block_cols = cols - cols % BLOCK;               \
        for (int64_t r0 = 0; r0 < block_rows; r0 += TILE)                                              \
            for (int64_t c0 = 0; c0 < block_cols; c0 += TILE)                                          \
                for (int64_t r = r0; r < MIN(r0 + TILE, block_rows); r += BLOCK)                       \
                    for (int64_t c = c0; c < MIN(c0 + TILE, block_cols); c += BLOCK)                   \
                        BLOCK_FN(src + r * src_row_stride + c, dst + c * dst_row_stride + r,           \
                                 src_row_stride, dst_row_stride);                                      \
        for (int64_t r = 0; r < rows; r++)                                                             \
            for (int64_t c = r < block_rows ? block_cols : 0; c < cols; c++)                           \
                dst[c * dst_row_stride + r] = src[r * src_row_stride + c];                             \
    }

#define COPY_ONE(src, dst, src_row_stride, dst_row_stride) (*(dst) = *(src))

#ifdef __cplusplus
extern "C" {
#endif
DEFINE_TRANSPOSE(warpspec_transpose_1, uint8_t, 1, COPY_ONE)
DEFINE_TRANSPOSE(warpspec_transpose_2, uint16_t, 8, block_2)
DEFINE_TRANSPOSE(warpspec_transpose_4, uint32_t, 4, block_4)
DEFINE_TRANSPOSE(warpspec_transpose_8, uint64_t, 1, COPY_ONE)
#ifdef __cplusplus
}
#endif
