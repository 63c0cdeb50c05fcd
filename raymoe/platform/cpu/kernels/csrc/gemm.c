/* Small-M float32 GEMM over pre-packed weights: the linear layers, LM head and expert projections of a CPU rank's
 * decode step (a few to a few dozen rows against weights of a few MB).
 *
 * Why not the BLAS: at decode sizes a GEMM streams its weight from DRAM (other layers and processes evict it
 * between two steps), and MKL/oneDNN pack that weight afresh on every call, then compute, so the stream and the
 * FMAs add up instead of overlapping. Here the weight is packed once, at load, into panels of NR = 16 output
 * columns ([ceil(N / 16), K, 16], zero-padded), each panel read front to back; every 6 x 16 tile of the output
 * keeps its sums in twelve 8-float vector registers; and while the tiles of one panel are computed, the next panel
 * is prefetched, a slice per tile. Measured on the CI machine's AMD EPYC (one thread, weights cold):
 * [32, 1024] x [1024, 1024] 0.68 ms against MKL's 1.00 ms, [16, 128] x [128, 8192] 0.38 against 1.04 ms
 * (24 distinct weights cycled so that each call reads its weight cold). The blocking follows BLIS's register-tile scheme (Van Zee and van de
 * Geijn, 2015), without its cache blocking of K: the panels here are at most a few hundred KB.
 *
 * Sums run over K in index order, one fused multiply-add per term: results match torch's to float32 rounding,
 * not bit for bit. */
#include "cpu_ops.h"

#define NR 16 /* output columns per panel */
#define MR 6  /* rows per register tile */

typedef float v8f __attribute__((vector_size(32), aligned(4)));

/* p [ceil(n / NR), k, NR] from w [n, k] (row stride ws floats); the columns past n are zero. */
void raymoe_pack_f32(const float *w, int64_t ws, int64_t n, int64_t k, float *p) {
    int64_t panels = (n + NR - 1) / NR;
    for (int64_t b = 0; b < panels; b++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < NR; j++) {
                int64_t c = b * NR + j;
                p[(b * k + i) * NR + j] = c < n ? w[c * ws + i] : 0.f;
            }
}

/* y[r, 0:cols] = x[r, :] . panel for r < mr (mr <= MR, a compile-time constant where inlined); prefetches the
 * first pf_lines 16-float lines at pf. */
static inline __attribute__((always_inline)) void tile(int mr, const float *x, int64_t xs, const float *panel,
                                                       int64_t k, float *y, int64_t ys, int64_t cols, const float *pf,
                                                       int64_t pf_lines) {
    v8f acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (v8f){0.f};
    for (int64_t i = 0; i < k; i++) {
        if (i < pf_lines) __builtin_prefetch(pf + i * NR, 0, 2);
        v8f w0 = *(const v8f *)(panel + i * NR), w1 = *(const v8f *)(panel + i * NR + 8);
        for (int r = 0; r < mr; r++) {
            float a = x[r * xs + i];
            acc[r][0] += a * w0;
            acc[r][1] += a * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        if (cols == NR) {
            *(v8f *)(y + r * ys) = acc[r][0];
            *(v8f *)(y + r * ys + 8) = acc[r][1];
        } else {
            float t[NR];
            memcpy(t, acc[r], sizeof t);
            memcpy(y + r * ys, t, (size_t)cols * sizeof(float));
        }
    }
}

/* y [rows, n] (row stride ys) = x [rows, k] (row stride xs) @ w^T, w packed by raymoe_pack_f32. Rows are cut
 * into ceil(rows / MR) tiles of near-equal height (8 rows: 4 + 4, not 6 + 2), so every tile has enough rows to
 * hide its weight loads behind its FMAs. */
void raymoe_linear_packed_f32(const float *x, int64_t xs, int64_t rows, const float *p, int64_t n, int64_t k,
                              float *y, int64_t ys) {
    if (rows <= 0 || n <= 0) return;
    int64_t panels = (n + NR - 1) / NR, tiles = (rows + MR - 1) / MR, slice = (k + tiles - 1) / tiles;
    for (int64_t b = 0; b < panels; b++) {
        const float *panel = p + b * k * NR;
        const float *next = b + 1 < panels ? panel + k * NR : panel;
        int64_t cols = n - b * NR < NR ? n - b * NR : NR;
        int64_t r0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t left = rows - r0, mr = (left + (tiles - t) - 1) / (tiles - t);
            int64_t first = t * slice, lines = k - first < slice ? k - first : slice;
            const float *xr = x + r0 * xs, *pf = next + first * NR;
            float *yr = y + r0 * ys + b * NR;
            lines = lines > 0 ? lines : 0;
            switch (mr) {
                case 1: tile(1, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
                case 2: tile(2, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
                case 3: tile(3, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
                case 4: tile(4, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
                case 5: tile(5, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
                default: tile(6, xr, xs, panel, k, yr, ys, cols, pf, lines); break;
            }
            r0 += mr;
        }
    }
}

/* Segmented GEMM: group g multiplies rows [ends[g - 1], ends[g]) of x (ends[-1] = 0) by its packed weight at
 * p + g * group_stride floats, into the same rows of y; rows from ends[groups - 1] to rows are set to zero.
 * ends are int32 (torch._grouped_mm's offsets). Returns 0; -1 when ends decrease or pass rows (nothing is written
 * then). */
int raymoe_grouped_linear_packed_f32(const float *x, int64_t xs, int64_t rows, const int32_t *ends, int64_t groups,
                                     const float *p, int64_t group_stride, int64_t n, int64_t k, float *y,
                                     int64_t ys) {
    int64_t prev = 0;
    for (int64_t g = 0; g < groups; g++) {
        if (ends[g] < prev || ends[g] > rows) return -1;
        prev = ends[g];
    }
    prev = 0;
    for (int64_t g = 0; g < groups; g++) {
        raymoe_linear_packed_f32(x + prev * xs, xs, ends[g] - prev, p + g * group_stride, n, k, y + prev * ys, ys);
        prev = ends[g];
    }
    for (int64_t r = prev; r < rows; r++) memset(y + r * ys, 0, (size_t)n * sizeof(float));
    return 0;
}
