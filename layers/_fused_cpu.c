/* Fused CPU passes of the corrected layers (float32 and float64).

   The layers cost a GEMM or convolution (forward) or two (backward) plus a few passes over
   their tensors; in plain torch each pass is its own kernel with its own temporary. These fuse
   them. Dense layers, each row of a row-major (rows x cols) tensor in cache:

     scale_outputs  s_i = 1/sqrt(|x_i|^2 + 1)  (mode 0, AffineLike)  or  k/max(|x_i|, eps)
                    (mode 1, NormLike), then z_i = (z_i + pre) * s_i or z_i * s_i + post in place
     scale_grad     gy_i = s_i * g_i,  colsum = sum_i gy_i (or sum_i g_i),  dot_i = <gy_i, v>
     minus_radial   u_i -= a_i * (<u_i, x_i> + c_i) * x_i  in place,
                    a_i = (m * s_i)^2 where s_i < limit, else 0

   PatchNorm convolutions, on NCHW or channels_last tensors: group_squares (the per-position
   sums of x^2 over each group's channels), box (1/sqrt(box sum + 1) over each receptive field)
   and its transpose, scale_and_dot (gy = r * gz with the per-position <gz, z>), group_update;
   and, for an NCHW layer whose backward convolution runs channels_last, scale_and_dot_to_cl
   (gy written channels_last; also a plain transpose) and group_update_from_cl (d + src * r
   written back NCHW).

   The stacked CNN engine's first block (experiments.runs.conv_pool): K models' one-channel
   convolutions, each followed by a 2x2 max-pool, without the full-resolution convolution
   output (conv_pool, conv_pool_backward); and its later 2x2 max-pools with the ReLU after them
   (max_pool2, max_pool2_backward).

   The stacked vision transformer's attention on short sequences: the scores of each
   (sequence, head), in float32 with their softmax (attention_probabilities), its weighted
   values and their backward (attention_scores, attention_values, attention_backward), reading
   and writing the projections' row layout;
   and its LayerNorms with each model's affine (layer_norm, layer_norm_backward).

   The stacked engine's tanh activation in float32 (tanh_f32).

   Dot products are accumulated in LANES partial sums in T, combined pairwise (as torch's own
   vectorised sums: float32 rounding for float32); column sums in per-thread partials in T
   (as torch's sum), reduced in thread order, so results are deterministic for a given thread
   count. Rows (planes) are split over `threads` OpenMP threads: loaded after torch, this
   library shares torch's libgomp (one thread pool); the caller passes torch.get_num_threads().
   The Python side (_fused.py) checks dtype, device and layout and loads this file with ctypes;
   it is also a (method-less) CPython extension module only so that setuptools builds and
   installs it. */

#include <Python.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_fused_cpu.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Vector clones picked at load time: AVX2 (x86-64-v3) for every pass; the transposing passes
   (the attention passes and the 32-entry LayerNorm rows among them) also get an AVX-512 (v4)
   clone, for its 32 vector registers (with AVX2's 16 their register transposes spill: 1.2-2.5x
   slower in a harness, see docs/FINDINGS.md), and so does tanh, for AVX-512's 8-wide double
   vectors. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 12
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define WIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#define WIDE_CLONES
#endif

/* A function whose double operations must be the ones written, in every clone: no contraction of
   a product and a sum into one fused multiply-add (which some clones would make and others not):
   EXACT_DOUBLES before it and EXACT_DOUBLES_PRAGMAS first in its body, whichever the compiler
   takes (GCC's optimize attribute, clang's pragma, the standard pragma). GCC also gets
   no-trapping-math there, without which it does not vectorise a select on a comparison (tanh's
   clamp) for AVX2. */
#if defined(__GNUC__) && !defined(__clang__)
#define EXACT_DOUBLES __attribute__((optimize("no-trapping-math", "fp-contract=off")))
#define EXACT_DOUBLES_PRAGMAS
#elif defined(__clang__)
#define EXACT_DOUBLES
#define EXACT_DOUBLES_PRAGMAS _Pragma("clang fp contract(off)")
#else
#define EXACT_DOUBLES
#define EXACT_DOUBLES_PRAGMAS _Pragma("STDC FP_CONTRACT OFF")
#endif

/* Partial sums per dot product: two AVX2 registers of float. */
#define LANES 16

/* Below this many elements a pass runs on one thread (as ATen's grain size). */
#define PARALLEL_GRAIN 32768

static int team_size(int64_t elements, int threads) {
    return elements < PARALLEL_GRAIN || threads < 1 ? 1 : threads;
}

/* This thread's share [*first, *last) of `rows`, in contiguous static blocks. */
static void my_rows(int64_t rows, int64_t *first, int64_t *last) {
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t team = 1, me = 0;
#endif
    const int64_t block = (rows + team - 1) / team;
    *first = me * block < rows ? me * block : rows;
    *last = *first + block < rows ? *first + block : rows;
}

static int my_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* One buffer of `n` elements of `size` bytes for each of `team` threads, each starting on a cache
   line of its own: *stride (elements) apart; NULL where it cannot be had, its size overflowing
   size_t or beyond PTRDIFF_MAX included. */
static void *team_buffer(size_t n, size_t size, int team, size_t *stride) {
    const size_t line = 64 / size;
    size_t bytes;
    *stride = (n + line - 1) / line * line;
    if (*stride < n || __builtin_mul_overflow(*stride, size, &bytes)
        || __builtin_mul_overflow(bytes, (size_t)team, &bytes) || bytes > PTRDIFF_MAX)
        return NULL;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* Each pass: an exported entry that opens the parallel region, and a per-thread row-range
   worker compiled twice (AVX2+FMA and baseline, picked at load time) holding the loops. */
#define DEFINE_ROWOPS(T, SUFFIX)                                                                   \
    /* The LANES partial sums in `lane` combined pairwise (in place; the total in lane[0]). */    \
    static inline T lanes_total_##SUFFIX(T *lane) {                                                \
        for (int width = LANES / 2; width > 0; width /= 2)                                         \
            for (int l = 0; l < width; ++l) lane[l] += lane[l + width];                            \
        return lane[0];                                                                            \
    }                                                                                              \
                                                                                                   \
    /* <a, b> in LANES independent partial sums in T (vectorisable without reassociating a    \
       single sum), combined pairwise (a short dependency chain: rows of a few dozen entries,    \
       as channels_last positions are, are bound by it), plus the tail in double. */             \
    static inline double dot_##SUFFIX(const T *a, const T *b, int64_t n) {                        \
        T lane[LANES] = {0};                                                                       \
        int64_t j = 0;                                                                             \
        for (; j + LANES <= n; j += LANES)                                                         \
            for (int l = 0; l < LANES; ++l) lane[l] += a[j + l] * b[j + l];                        \
        double acc = lanes_total_##SUFFIX(lane);                                                   \
        for (; j < n; ++j) acc += (double)a[j] * (double)b[j];                                     \
        return acc;                                                                                \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static int64_t scale_outputs_range_##SUFFIX(                                    \
        T *restrict z, const T *restrict x, int64_t first, int64_t last, int64_t in_cols,          \
        int64_t out_cols, int mode, double k, double eps, double small, double big,               \
        const T *restrict pre, const T *restrict post, T *restrict scale) {                       \
        int64_t unsafe = 0;                                                                        \
        for (int64_t i = first; i < last; ++i) {                                                   \
            const T *xi = x + i * in_cols;                                                         \
            const double sq = dot_##SUFFIX(xi, xi, in_cols), norm = sqrt(sq);                      \
            unsafe += !(sq <= big) || norm < small; /* !(sq <= big): also NaN */                   \
            const T s = (T)(mode == 0 ? 1.0 / sqrt(sq + 1.0) : k / (norm > eps ? norm : eps));    \
            scale[i] = s;                                                                          \
            T *zi = z + i * out_cols;                                                              \
            if (pre)                                                                               \
                for (int64_t j = 0; j < out_cols; ++j) zi[j] = (zi[j] + pre[j]) * s;               \
            else if (post)                                                                         \
                for (int64_t j = 0; j < out_cols; ++j) zi[j] = zi[j] * s + post[j];                \
            else                                                                                   \
                for (int64_t j = 0; j < out_cols; ++j) zi[j] *= s;                                 \
        }                                                                                          \
        return unsafe;                                                                             \
    }                                                                                              \
                                                                                                   \
    /* z = x W^T (rows x out_cols) on entry. Returns how many rows are unsafe: |x|^2 above `big` \
       (the dtype's maximum: the GEMM on x may have overflowed) or NaN, or |x| below `small`;    \
       then z and scale must be discarded and the caller takes its rescaling path. */            \
    int64_t scale_outputs_##SUFFIX(T *z, const T *x, int64_t rows, int64_t in_cols,             \
                                   int64_t out_cols, int mode, double k, double eps, double small, \
                                   double big, const T *pre, const T *post, T *scale, int threads) { \
        int64_t unsafe = 0;                                                                        \
        _Pragma("omp parallel num_threads(team_size(rows * (in_cols + out_cols), threads)) reduction(+ : unsafe)") { \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            unsafe += scale_outputs_range_##SUFFIX(z, x, first, last, in_cols, out_cols, mode, k,   \
                                                   eps, small, big, pre, post, scale);             \
        }                                                                                          \
        return unsafe;                                                                             \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void scale_grad_range_##SUFFIX(                                          \
        const T *restrict g, const T *restrict scale, int64_t first, int64_t last, int64_t cols, T *restrict gy, T *restrict colsum,  \
        int sum_input, const T *restrict v, T *restrict dot) {                                                       \
        for (int64_t i = first; i < last; ++i) {                                                   \
            const T *restrict gi = g + i * cols;                                                   \
            T *restrict yi = gy + i * cols;                                                        \
            const T s = scale[i];                                                                  \
            for (int64_t j = 0; j < cols; ++j) yi[j] = gi[j] * s;                                  \
            if (colsum) {                                                                          \
                const T *summed = sum_input ? gi : yi;                                             \
                for (int64_t j = 0; j < cols; ++j) colsum[j] += summed[j];                         \
            }                                                                                      \
            if (dot) dot[i] = (T)dot_##SUFFIX(yi, v, cols);                                        \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* colsum (optional, cols entries) sums g itself when sum_input, else gy, over per-thread   \
       partials in T (as torch's sum); dot (optional, rows entries) is <gy_i, v>. Returns       \
       nonzero if the partials could not be allocated. */                                         \
    int scale_grad_##SUFFIX(const T *g, const T *scale, int64_t rows, int64_t cols, T *gy,       \
                            T *colsum, int sum_input, const T *v, T *dot, int threads) {          \
        const int team = team_size(rows * cols, threads);                                          \
        /* each thread's partials on cache lines of their own: no split vectors, no false sharing   \
           between the threads' row updates */                                                     \
        size_t stride = 0;                                                                         \
        T *partial = colsum ? team_buffer((size_t)cols, sizeof(T), team, &stride) : NULL;          \
        if (colsum && !partial) return 1;                                                          \
        if (partial) memset(partial, 0, stride * (size_t)team * sizeof(T));                        \
        _Pragma("omp parallel num_threads(team)") {                                                \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            T *mine = partial ? partial + (size_t)my_thread() * stride : NULL;                     \
            scale_grad_range_##SUFFIX(g, scale, first, last, cols, gy, mine, sum_input, v, dot);   \
        }                                                                                          \
        if (colsum) {                                                                              \
            for (int64_t j = 0; j < cols; ++j) {                                                   \
                T acc = 0;                                                                         \
                for (int t = 0; t < team; ++t) acc += partial[(size_t)t * stride + j];             \
                colsum[j] = acc;                                                                   \
            }                                                                                      \
            free(partial);                                                                         \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void minus_radial_range_##SUFFIX(                                        \
        T *restrict u, const T *restrict x, int64_t first, int64_t last, int64_t cols,            \
        const T *restrict s, double m, double limit, const T *restrict c) {                       \
        for (int64_t i = first; i < last; ++i) {                                                   \
            T *ui = u + i * cols;                                                                  \
            const T *xi = x + i * cols;                                                            \
            /* s < limit compared in T, as the torch formula compares s with its T-rounded limit;  \
               (m s)(m s d) in that order: (m s)^2 alone may overflow where the product does not */ \
            const double ms = s[i] < (T)limit ? m * (double)s[i] : 0.0;                            \
            const T alpha = (T)(-ms * (ms * (dot_##SUFFIX(ui, xi, cols) + (c ? (double)c[i] : 0.0)))); \
            for (int64_t j = 0; j < cols; ++j) ui[j] += alpha * xi[j];                             \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void minus_radial_##SUFFIX(T *u, const T *x, int64_t rows, int64_t cols, const T *s,        \
                               double m, double limit, const T *c, int threads) {                 \
        _Pragma("omp parallel num_threads(team_size(rows * cols, threads))") {                     \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            minus_radial_range_##SUFFIX(u, x, first, last, cols, s, m, limit, c);                  \
        }                                                                                          \
    }

/* [*first, *last): the kernel taps k whose input index o*stride - pad + k*dilation lies in
   [0, size), for output index o (the taps in bounds form one contiguous range). */
static void taps(int64_t o, int64_t size, int64_t kernel, int64_t stride, int64_t pad,
                 int64_t dilation, int64_t *first, int64_t *last) {
    const int64_t start = o * stride - pad;
    int64_t k0 = 0, k1 = kernel;
    while (k0 < kernel && start + k0 * dilation < 0) ++k0;
    while (k1 > k0 && start + (k1 - 1) * dilation >= size) --k1;
    *first = k0;
    *last = k1;
}

/* The convolution passes work on NCHW planes (1-D convolutions as H = 1). The box geometry is
   an int64[12]: in_h, in_w, out_h, out_w, k_h, k_w, stride_h, stride_w, pad_h, pad_w, dil_h,
   dil_w; box sums run over the receptive field's in-bounds positions (zero padding). */
#define DEFINE_CONVOPS(T, SUFFIX)                                                                  \
    /* How many samples of squares (batch, per_sample) sum above `big` (the dtype's maximum: the \
       convolution on x may overflow) or to NaN. */                                                \
    static int64_t unsafe_samples_##SUFFIX(const T *squares, int64_t batch, int64_t per_sample,   \
                                           double big) {                                           \
        int64_t unsafe = 0;                                                                        \
        for (int64_t n = 0; n < batch; ++n) {                                                      \
            double total = 0.0;                                                                    \
            for (int64_t s = 0; s < per_sample; ++s) total += squares[n * per_sample + s];         \
            unsafe += !(total <= big);                                                             \
        }                                                                                          \
        return unsafe;                                                                             \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void group_squares_plane_##SUFFIX(const T *restrict x, int64_t channels,  \
                                                          int64_t size, T *restrict out) {         \
        for (int64_t s = 0; s < size; ++s) out[s] = 0;                                             \
        for (int64_t c = 0; c < channels; ++c)                                                     \
            for (int64_t s = 0; s < size; ++s) out[s] += x[c * size + s] * x[c * size + s];        \
    }                                                                                              \
                                                                                                   \
    /* out (N, groups, size) = sum over each group's channels of x^2; x (N, C, size). Returns    \
       the unsafe_samples count. */                                                                \
    int64_t group_squares_##SUFFIX(const T *x, int64_t batch, int64_t channels, int64_t size,     \
                                   int64_t groups, double big, T *out, int threads) {             \
        const int64_t per_group = channels / groups, planes = batch * groups;                      \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(batch * channels * size, threads))") \
        for (int64_t q = 0; q < planes; ++q)                                                       \
            group_squares_plane_##SUFFIX(x + q * per_group * size, per_group, size, out + q * size); \
        return unsafe_samples_##SUFFIX(out, batch, groups * size, big);                            \
    }                                                                                              \
                                                                                                   \
    /* One plane: transpose = 0 gathers `in` (in_h, in_w) over each output position's field     \
       into `out` (out_h, out_w) as 1/sqrt(sum + 1); transpose = 1 scatters each `in`            \
       (out_h, out_w) value over its field of `out` (in_h, in_w). */                              \
    static inline void box_plane_##SUFFIX(const T *restrict in, T *restrict out,                 \
                                          const int64_t *g, int transpose) {                       \
        if (transpose)                                                                             \
            for (int64_t s = 0; s < g[0] * g[1]; ++s) out[s] = 0;                                  \
        for (int64_t oh = 0; oh < g[2]; ++oh) {                                                    \
            int64_t i0, i1;                                                                        \
            taps(oh, g[0], g[4], g[6], g[8], g[10], &i0, &i1);                                     \
            for (int64_t ow = 0; ow < g[3]; ++ow) {                                                \
                int64_t j0, j1;                                                                    \
                taps(ow, g[1], g[5], g[7], g[9], g[11], &j0, &j1);                                 \
                const int64_t corner = (oh * g[6] - g[8]) * g[1] + ow * g[7] - g[9];               \
                const T v = transpose ? in[oh * g[3] + ow] : 0;                                    \
                double acc = 0.0;                                                                  \
                for (int64_t i = i0; i < i1; ++i)                                                  \
                    for (int64_t j = j0; j < j1; ++j) {                                            \
                        const int64_t at = corner + i * g[10] * g[1] + j * g[11];                  \
                        if (transpose)                                                             \
                            out[at] += v;                                                          \
                        else                                                                       \
                            acc += in[at];                                                         \
                    }                                                                              \
                if (!transpose) out[oh * g[3] + ow] = (T)(1.0 / sqrt(acc + 1.0));                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Stride 1, dilation 1: dst (dh, dw)[y][x] = sum of src (sh, sw)[y + oy + i][x + ox + j]    \
       over i < kh, j < kw in bounds (the box sum with oy = -pad_h; its transpose, a gather too  \
       at stride 1, with oy = pad_h - kh + 1), as 1/sqrt(sum + 1) if `finish`: row sums, then    \
       column sums of them, both in double and along rows (vectorised), in `rows` (sh + 1 rows  \
       of dw doubles). O(kh + kw) per output, not O(kh * kw) with a bounds check per position. */ \
    /* sum of in[c] for c in [start, start + width) within [0, size), in double. */            \
    static inline double clipped_row_sum_##SUFFIX(const T *in, int64_t size, int64_t start,      \
                                                  int64_t width) {                               \
        double sum = 0;                                                                            \
        for (int64_t c = start < 0 ? 0 : start; c < start + width && c < size; ++c) sum += in[c];  \
        return sum;                                                                                \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void box_sum_plane_##SUFFIX(                                             \
        const T *restrict src, int64_t sh, int64_t sw, T *restrict dst, int64_t dh, int64_t dw,    \
        int64_t oy, int64_t ox, int64_t kh, int64_t kw, int finish, double *restrict rows) {       \
        const int64_t x0 = ox < 0 ? (-ox < dw ? -ox : dw) : 0; /* [x0, x1): every tap in bounds */ \
        int64_t x1 = sw - ox - kw + 1 < dw ? sw - ox - kw + 1 : dw;                               \
        x1 = x1 > x0 ? x1 : x0;                                                                    \
        for (int64_t r = 0; r < sh; ++r) {                                                         \
            const T *in = src + r * sw;                                                            \
            double *h = rows + r * dw;                                                             \
            for (int64_t x = 0; x < dw; ++x) h[x] = 0;                                             \
            for (int64_t j = 0; j < kw; ++j)                                                       \
                for (int64_t x = x0; x < x1; ++x) h[x] += in[x + ox + j];                          \
            for (int64_t x = 0; x < x0; ++x) h[x] = clipped_row_sum_##SUFFIX(in, sw, x + ox, kw);   \
            for (int64_t x = x1; x < dw; ++x) h[x] = clipped_row_sum_##SUFFIX(in, sw, x + ox, kw);  \
        }                                                                                          \
        double *acc = rows + sh * dw;                                                              \
        for (int64_t y = 0; y < dh; ++y) {                                                         \
            for (int64_t x = 0; x < dw; ++x) acc[x] = 0;                                           \
            for (int64_t i = 0; i < kh; ++i) {                                                     \
                const int64_t r = y + oy + i;                                                      \
                if (r < 0 || r >= sh) continue;                                                    \
                for (int64_t x = 0; x < dw; ++x) acc[x] += rows[r * dw + x];                       \
            }                                                                                      \
            T *out = dst + y * dw;                                                                 \
            if (finish)                                                                            \
                for (int64_t x = 0; x < dw; ++x) out[x] = (T)(1.0 / sqrt(acc[x] + 1.0));           \
            else                                                                                   \
                for (int64_t x = 0; x < dw; ++x) out[x] = (T)acc[x];                               \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Per plane: transpose = 0: out (out_h, out_w) = 1/sqrt(box(in (in_h, in_w)) + 1);         \
       transpose = 1: out (in_h, in_w) = box^T(in (out_h, out_w)). Stride 1 and dilation 1 take  \
       box_sum_plane (unless its row buffer cannot be allocated), others box_plane. */             \
    void box_##SUFFIX(const T *in, T *out, int64_t planes, const int64_t *geometry, int transpose, \
                      int threads) {                                                               \
        const int64_t *g = geometry;                                                               \
        const int64_t in_size = g[0] * g[1], out_size = g[2] * g[3];                               \
        const int64_t work = planes * out_size * g[4] * g[5];                                      \
        const int unit = g[6] == 1 && g[7] == 1 && g[10] == 1 && g[11] == 1;                       \
        _Pragma("omp parallel num_threads(team_size(work, threads))") {                            \
            /* per thread: the rows of one plane's row sums, and one more */                       \
            const int64_t sh = transpose ? g[2] : g[0], dw = transpose ? g[1] : g[3];              \
            double *rows = unit ? malloc(sizeof(double) * (size_t)((sh + 1) * dw)) : NULL;         \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t q = 0; q < planes; ++q) {                                                 \
                if (rows && transpose)                                                             \
                    box_sum_plane_##SUFFIX(in + q * out_size, g[2], g[3], out + q * in_size, g[0],  \
                                           g[1], g[8] - g[4] + 1, g[9] - g[5] + 1, g[4], g[5], 0,  \
                                           rows);                                                  \
                else if (rows)                                                                     \
                    box_sum_plane_##SUFFIX(in + q * in_size, g[0], g[1], out + q * out_size, g[2],  \
                                           g[3], -g[8], -g[9], g[4], g[5], 1, rows);               \
                else if (transpose) /* (two call sites: each inlined with its constant flags) */   \
                    box_plane_##SUFFIX(in + q * out_size, out + q * in_size, geometry, 1);         \
                else                                                                               \
                    box_plane_##SUFFIX(in + q * in_size, out + q * out_size, geometry, 0);         \
            }                                                                                      \
            free(rows);                                                                            \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void scale_and_dot_plane_##SUFFIX(                                       \
        const T *restrict gz, const T *restrict z, const T *restrict r, int64_t channels,         \
        int64_t size, T *restrict gy, T *restrict e) {                                             \
        if (e)                                                                                     \
            for (int64_t s = 0; s < size; ++s) e[s] = 0;                                           \
        for (int64_t c = 0; c < channels; ++c) {                                                   \
            const T *gc = gz + c * size, *zc = z + c * size;                                       \
            T *yc = gy + c * size;                                                                 \
            for (int64_t s = 0; s < size; ++s) yc[s] = gc[s] * r[s];                               \
            if (e)                                                                                 \
                for (int64_t s = 0; s < size; ++s) e[s] += gc[s] * zc[s];                          \
        }                                                                                          \
        if (e)                                                                                     \
            for (int64_t s = 0; s < size; ++s) e[s] *= -r[s] * r[s];                               \
    }                                                                                              \
                                                                                                   \
    /* gz, z (N, O, size), r (N, groups, size): gy = r * gz (each group's r over its channels)   \
       and, when e is given, e (N, groups, size) = -r^2 * sum over the group's channels of gz*z. */ \
    void scale_and_dot_##SUFFIX(const T *gz, const T *z, const T *r, int64_t batch,               \
                                int64_t channels, int64_t size, int64_t groups, T *gy, T *e,      \
                                int threads) {                                                     \
        const int64_t per_group = channels / groups, planes = batch * groups;                      \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(batch * channels * size, threads))") \
        for (int64_t q = 0; q < planes; ++q) {                                                     \
            const int64_t offset = q * per_group * size;                                           \
            scale_and_dot_plane_##SUFFIX(gz + offset, z + offset, r + q * size, per_group, size,    \
                                         gy + offset, e ? e + q * size : NULL);                    \
        }                                                                                          \
    }                                                                                           \
                                                                                                   \
    VECTOR_CLONES static void group_update_plane_##SUFFIX(T *restrict dst, const T *restrict src,  \
                                                         const T *restrict r, int64_t channels,    \
                                                         int64_t size) {                           \
        for (int64_t c = 0; c < channels; ++c) {                                                   \
            T *d = dst + c * size;                                                                 \
            if (src)                                                                               \
                for (int64_t s = 0; s < size; ++s) d[s] += src[c * size + s] * r[s];               \
            else                                                                                   \
                for (int64_t s = 0; s < size; ++s) d[s] *= r[s];                                   \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* dst (N, C, size) in place: dst *= r, or dst += src * r when src is given; r (N, groups,    \
       size), each group's over its channels. */                                                   \
    void group_update_##SUFFIX(T *dst, const T *src, const T *r, int64_t batch, int64_t channels,  \
                               int64_t size, int64_t groups, int threads) {                        \
        const int64_t per_group = channels / groups, planes = batch * groups;                      \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(batch * channels * size, threads))") \
        for (int64_t q = 0; q < planes; ++q) {                                                     \
            const int64_t offset = q * per_group * size;                                           \
            group_update_plane_##SUFFIX(dst + offset, src ? src + offset : NULL, r + q * size,      \
                                        per_group, size);                                          \
        }                                                                                          \
    }

/* Channels-last twins of group_squares, scale_and_dot and group_update: x (N, C, H, W)
   stored as rows of C channels per position (N*P rows, P = H*W); the per-(group, position)
   results stay planar, (N, groups, P), as the box passes expect. */
#define DEFINE_CHANNELS_LAST_OPS(T, SUFFIX)                                                        \
    VECTOR_CLONES static void group_squares_cl_rows_##SUFFIX(                                      \
        const T *restrict x, int64_t first, int64_t last, int64_t positions, int64_t channels,    \
        int64_t groups, T *restrict out) {                                                         \
        const int64_t per_group = channels / groups;                                               \
        for (int64_t row = first; row < last; ++row) {                                             \
            const int64_t n = row / positions, p = row % positions;                                \
            for (int64_t g = 0; g < groups; ++g) {                                                 \
                const T *xg = x + row * channels + g * per_group;                                  \
                out[(n * groups + g) * positions + p] = (T)dot_##SUFFIX(xg, xg, per_group);        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    int64_t group_squares_cl_##SUFFIX(const T *x, int64_t batch, int64_t channels,                \
                                      int64_t positions, int64_t groups, double big, T *out,      \
                                      int threads) {                                               \
        const int64_t rows = batch * positions;                                                    \
        _Pragma("omp parallel num_threads(team_size(rows * channels, threads))") {                 \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            group_squares_cl_rows_##SUFFIX(x, first, last, positions, channels, groups, out);      \
        }                                                                                          \
        return unsafe_samples_##SUFFIX(out, batch, groups * positions, big);                       \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void scale_and_dot_cl_rows_##SUFFIX(                                      \
        const T *restrict gz, const T *restrict z, const T *restrict r, int64_t first,            \
        int64_t last, int64_t positions, int64_t channels, int64_t groups, T *restrict gy,        \
        T *restrict e) {                                                                           \
        const int64_t per_group = channels / groups;                                               \
        for (int64_t row = first; row < last; ++row) {                                             \
            const int64_t n = row / positions, p = row % positions;                                \
            for (int64_t g = 0; g < groups; ++g) {                                                 \
                const int64_t at = row * channels + g * per_group, plane = (n * groups + g) * positions + p; \
                const T rg = r[plane];                                                             \
                for (int64_t c = 0; c < per_group; ++c) gy[at + c] = gz[at + c] * rg;              \
                if (e) e[plane] = (T)(-(double)rg * rg * dot_##SUFFIX(gz + at, z + at, per_group)); \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void scale_and_dot_cl_##SUFFIX(const T *gz, const T *z, const T *r, int64_t batch,            \
                                   int64_t channels, int64_t positions, int64_t groups, T *gy,    \
                                   T *e, int threads) {                                            \
        const int64_t rows = batch * positions;                                                    \
        _Pragma("omp parallel num_threads(team_size(rows * channels, threads))") {                 \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            scale_and_dot_cl_rows_##SUFFIX(gz, z, r, first, last, positions, channels, groups, gy, e); \
        }                                                                                          \
    }                                                                                           \
                                                                                                   \
    VECTOR_CLONES static void group_update_cl_rows_##SUFFIX(                                       \
        T *restrict dst, const T *restrict src, const T *restrict r, int64_t first, int64_t last, \
        int64_t positions, int64_t channels, int64_t groups) {                                     \
        const int64_t per_group = channels / groups;                                               \
        for (int64_t row = first; row < last; ++row) {                                             \
            const int64_t n = row / positions, p = row % positions;                                \
            for (int64_t g = 0; g < groups; ++g) {                                                 \
                const int64_t at = row * channels + g * per_group;                                 \
                const T rg = r[(n * groups + g) * positions + p];                                  \
                if (src)                                                                           \
                    for (int64_t c = 0; c < per_group; ++c) dst[at + c] += src[at + c] * rg;       \
                else                                                                               \
                    for (int64_t c = 0; c < per_group; ++c) dst[at + c] *= rg;                     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void group_update_cl_##SUFFIX(T *dst, const T *src, const T *r, int64_t batch,                \
                                  int64_t channels, int64_t positions, int64_t groups, int threads) { \
        const int64_t rows = batch * positions;                                                    \
        _Pragma("omp parallel num_threads(team_size(rows * channels, threads))") {                 \
            int64_t first, last;                                                                   \
            my_rows(rows, &first, &last);                                                          \
            group_update_cl_rows_##SUFFIX(dst, src, r, first, last, positions, channels, groups);  \
        }                                                                                          \
    }

/* Between the two layouts, fused into the passes around a channels_last backward convolution
   of NCHW tensors (P = H*W positions, each sample's planes (C, P) against its rows (P, C)):
   scale_and_dot_to_cl writes gy = r * gz in rows and e as scale_and_dot (no r: a plain
   transpose, e.g. x itself); group_update_from_cl writes out = d + src * r in planes from d
   in rows (group_update with src, across the layouts). Square blocks of V = 32 bytes /
   sizeof(T) channels by V positions are transposed in vector registers, so that reads and
   writes both run along memory, two blocks at a time (a whole cache line of each plane);
   blocks cut by the edge of a group or of the positions go element by element. e sums each
   position's channels in channel order, as scale_and_dot. */
typedef float vec_f32 __attribute__((vector_size(32)));
typedef double vec_f64 __attribute__((vector_size(32)));

#if defined(__has_builtin) && !defined(AFFDIV_NO_SHUFFLE) /* (the tests build the fallback so) */
#if __has_builtin(__builtin_shufflevector) /* (nested: an undefined __has_builtin(...) is a syntax error) */
#define HAVE_SHUFFLE 1
#endif
#endif

#ifdef HAVE_SHUFFLE
#define SHUFFLE __builtin_shufflevector
/* r[i] (lane j) <-> r[j] (lane i): unpack pairs, then quadruples, then halves. */
static inline void transpose_f32(vec_f32 r[8]) {
    vec_f32 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = SHUFFLE(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = SHUFFLE(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int k = 0; k < 2; ++k) {
            u[i + 2 * k] = SHUFFLE(t[i + k], t[i + k + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * k + 1] = SHUFFLE(t[i + k], t[i + k + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int i = 0; i < 4; ++i) {
        r[i] = SHUFFLE(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = SHUFFLE(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

static inline void transpose_f64(vec_f64 r[4]) {
    const vec_f64 t0 = SHUFFLE(r[0], r[1], 0, 4, 2, 6), t1 = SHUFFLE(r[0], r[1], 1, 5, 3, 7);
    const vec_f64 t2 = SHUFFLE(r[2], r[3], 0, 4, 2, 6), t3 = SHUFFLE(r[2], r[3], 1, 5, 3, 7);
    r[0] = SHUFFLE(t0, t2, 0, 1, 4, 5);
    r[1] = SHUFFLE(t1, t3, 0, 1, 4, 5);
    r[2] = SHUFFLE(t0, t2, 2, 3, 6, 7);
    r[3] = SHUFFLE(t1, t3, 2, 3, 6, 7);
}
#else /* (compilers without the shuffle builtin, e.g. GCC < 12, or built with AFFDIV_NO_SHUFFLE) */
#define DEFINE_LANE_TRANSPOSE(T, SUFFIX, V)                                                        \
    static inline void transpose_##SUFFIX(vec_##SUFFIX r[V]) {                                    \
        for (int i = 0; i < V; ++i)                                                                \
            for (int j = 0; j < i; ++j) {                                                          \
                const T swap = r[i][j];                                                            \
                r[i][j] = r[j][i];                                                                 \
                r[j][i] = swap;                                                                    \
            }                                                                                      \
    }
DEFINE_LANE_TRANSPOSE(float, f32, 8)
DEFINE_LANE_TRANSPOSE(double, f64, 4)
#endif

/* Positions per parallel work item (a multiple of 2 V for both types). */
#define TILE 64
#define DEFINE_TRANSPOSING_OPS(T, SUFFIX, V)                                                       \
    /* One sample, positions [p0, p0 + np) (np <= TILE): see scale_and_dot_to_cl. Vector blocks    \
       take 2 V positions (a cache line of each plane, used up at once) by V channels. */          \
    WIDE_CLONES static void scale_and_dot_to_cl_tile_##SUFFIX(                                     \
        const T *restrict gz, const T *restrict z, const T *restrict r, int64_t channels,          \
        int64_t positions, int64_t groups, int64_t p0, int64_t np, T *restrict gy,                 \
        T *restrict e) {                                                                           \
        const int64_t per_group = channels / groups;                                               \
        for (int64_t g = 0; g < groups; ++g) {                                                     \
            const T *rg = r ? r + g * positions + p0 : NULL;                                       \
            T *eg = e ? e + g * positions + p0 : NULL;                                             \
            if (eg)                                                                                \
                for (int64_t p = 0; p < np; ++p) eg[p] = 0;                                        \
            const int64_t end = (g + 1) * per_group;                                               \
            for (int64_t c0 = g * per_group; c0 < end; c0 += V)                                    \
                for (int64_t q = 0; q < np; q += 2 * V) {                                          \
                    const int64_t at = c0 * positions + p0 + q;                                    \
                    T *out = gy + (p0 + q) * channels + c0;                                        \
                    if (end - c0 >= V && np - q >= 2 * V) {                                        \
                        vec_##SUFFIX rows[2][V], scale[2] = {0}, dot[2] = {0};                     \
                        for (int h = 0; h < 2; ++h) {                                              \
                            if (rg) memcpy(&scale[h], rg + q + h * V, sizeof scale[h]);            \
                            if (eg) memcpy(&dot[h], eg + q + h * V, sizeof dot[h]);                \
                        }                                                                          \
                        for (int i = 0; i < V; ++i)                                                \
                            for (int h = 0; h < 2; ++h) {                                          \
                                memcpy(&rows[h][i], gz + at + i * positions + h * V, sizeof rows[h][i]); \
                                if (eg) {                                                          \
                                    vec_##SUFFIX zi;                                               \
                                    memcpy(&zi, z + at + i * positions + h * V, sizeof zi);        \
                                    dot[h] += rows[h][i] * zi;                                     \
                                }                                                                  \
                                if (rg) rows[h][i] *= scale[h];                                    \
                            }                                                                      \
                        for (int h = 0; h < 2; ++h) {                                              \
                            if (eg) memcpy(eg + q + h * V, &dot[h], sizeof dot[h]);                \
                            transpose_##SUFFIX(rows[h]);                                           \
                            for (int i = 0; i < V; ++i)                                            \
                                memcpy(out + (h * V + i) * channels, &rows[h][i], sizeof rows[h][i]); \
                        }                                                                          \
                        continue;                                                                  \
                    }                                                                              \
                    for (int64_t c = 0; c < V && c0 + c < end; ++c)                                \
                        for (int64_t p = 0; p < 2 * V && q + p < np; ++p) {                        \
                            const T v = gz[at + c * positions + p];                                \
                            out[p * channels + c] = rg ? v * rg[q + p] : v;                        \
                            if (eg) eg[q + p] += v * z[at + c * positions + p];                    \
                        }                                                                          \
                }                                                                                  \
            if (eg)                                                                                \
                for (int64_t p = 0; p < np; ++p) eg[p] *= -rg[p] * rg[p];                          \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* gz, z (N, O, P) planes, r and e (N, groups, P), gy (N, P, O) rows: gy = r * gz (gz      \
       itself without r) and, when e is given (with r), e = -r^2 * sum over the group's         \
       channels of gz*z. gy must not overlap gz. */                                               \
    void scale_and_dot_to_cl_##SUFFIX(const T *gz, const T *z, const T *r, int64_t batch,          \
                                      int64_t channels, int64_t positions, int64_t groups, T *gy,  \
                                      T *e, int threads) {                                         \
        const int64_t tiles = (positions + TILE - 1) / TILE;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(batch * channels * positions, threads))") \
        for (int64_t q = 0; q < batch * tiles; ++q) {                                              \
            const int64_t n = q / tiles, p0 = (q % tiles) * TILE;                                  \
            const int64_t planes = n * channels * positions, scales = n * groups * positions;      \
            scale_and_dot_to_cl_tile_##SUFFIX(gz + planes, z ? z + planes : NULL,                  \
                                              r ? r + scales : NULL, channels, positions, groups,  \
                                              p0, positions - p0 < TILE ? positions - p0 : TILE,   \
                                              gy + planes, e ? e + scales : NULL);                 \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* One sample, positions [p0, p0 + np): see group_update_from_cl; blocks as above. */          \
    WIDE_CLONES static void group_update_from_cl_tile_##SUFFIX(                                    \
        const T *restrict d, const T *restrict src, const T *restrict r, int64_t channels,         \
        int64_t positions, int64_t groups, int64_t p0, int64_t np, T *restrict out) {              \
        const int64_t per_group = channels / groups;                                               \
        for (int64_t c0 = 0; c0 < channels; c0 += V)                                               \
            for (int64_t q = 0; q < np; q += 2 * V) {                                              \
                const T *dc = d + (p0 + q) * channels + c0;                                        \
                const int64_t at = c0 * positions + p0 + q;                                        \
                if (channels - c0 >= V && np - q >= 2 * V) {                                       \
                    vec_##SUFFIX rows[2][V];                                                       \
                    for (int h = 0; h < 2; ++h) {                                                  \
                        for (int i = 0; i < V; ++i)                                                \
                            memcpy(&rows[h][i], dc + (h * V + i) * channels, sizeof rows[h][i]);   \
                        transpose_##SUFFIX(rows[h]);                                               \
                    }                                                                              \
                    for (int i = 0; i < V; ++i)                                                    \
                        for (int h = 0; h < 2; ++h) {                                              \
                            const int64_t k = at + i * positions + h * V;                          \
                            vec_##SUFFIX x, scale;                                                 \
                            memcpy(&x, src + k, sizeof x);                                         \
                            memcpy(&scale, r + (c0 + i) / per_group * positions + p0 + q + h * V, sizeof scale); \
                            rows[h][i] += x * scale;                                               \
                            memcpy(out + k, &rows[h][i], sizeof rows[h][i]);                       \
                        }                                                                          \
                    continue;                                                                      \
                }                                                                                  \
                for (int64_t c = 0; c < V && c0 + c < channels; ++c) {                             \
                    const T *rg = r + (c0 + c) / per_group * positions + p0 + q;                   \
                    for (int64_t p = 0; p < 2 * V && q + p < np; ++p)                              \
                        out[at + c * positions + p] = dc[p * channels + c] + src[at + c * positions + p] * rg[p]; \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    /* d (N, P, C) rows; src and out (N, C, P) planes; r (N, groups, P): out = d + src * r. */     \
    void group_update_from_cl_##SUFFIX(const T *d, const T *src, const T *r, int64_t batch,        \
                                     int64_t channels, int64_t positions, int64_t groups, T *out,  \
                                     int threads) {                                                \
        const int64_t tiles = (positions + TILE - 1) / TILE;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(batch * channels * positions, threads))") \
        for (int64_t q = 0; q < batch * tiles; ++q) {                                              \
            const int64_t n = q / tiles, p0 = (q % tiles) * TILE;                                  \
            const int64_t planes = n * channels * positions;                                       \
            group_update_from_cl_tile_##SUFFIX(d + planes, src + planes, r + n * groups * positions, \
                                             channels, positions, groups, p0,                      \
                                             positions - p0 < TILE ? positions - p0 : TILE,        \
                                             out + planes);                                        \
        }                                                                                          \
    }

DEFINE_ROWOPS(float, f32)
DEFINE_ROWOPS(double, f64)
DEFINE_CONVOPS(float, f32)
DEFINE_CONVOPS(double, f64)
DEFINE_CHANNELS_LAST_OPS(float, f32)
DEFINE_CHANNELS_LAST_OPS(double, f64)
DEFINE_TRANSPOSING_OPS(float, f32, 8)
DEFINE_TRANSPOSING_OPS(double, f64, 4)

/* The stacked CNN engine's first block: K models' convolutions of one input channel each, C
   output channels per model, each followed by a 2x2 max-pool of stride 2 (a monotone activation
   after the pool: the engine's order), without the full-resolution convolution output. The input
   is zero-padded beforehand: xp (K, B, Hq, Wq), Hq = H + 2 pad_h; the conv output at (oh, ow)
   reads xp[oh .. oh + kh) x [ow .. ow + kw) (with `patchnorm`, PatchNormConv2d's: times
   r = 1/sqrt(|patch|^2 + 1)), and pooled position (ph, pw) takes the max over the conv outputs
   (2ph + a, 2pw + b), a, b in {0, 1}, scanned row by row: the first maximum, or the last NaN (as
   torch's max_pool2d). Weights wt (K, kh*kw, Cp) and bias (K*Cp), Cp = C rounded up to whole
   vectors of V lanes, the spare channels zero; the backward's dwt and db in the same layout.
   Output (B, Hp, Wp, K*C), Hp = (Hq - kh + 1) / 2: the channels_last order of (B, K*C, Hp, Wp);
   argmax (a*2 + b) in the same order, as bytes. Channels run in vectors of V lanes, the last
   block partial: its spare lanes read the zero padding of wt and bias (and zeros for g and
   argmax) and are never stored by the forward; the backward stores them in dwt's and db's
   padded columns (0, or NaN where a window reads a NaN or inf), which the caller drops. Each conv
   output is the bias plus its taps in (i, j) order, times r, in T. */
typedef int32_t ivec_f32 __attribute__((vector_size(32)));
typedef int64_t ivec_f64 __attribute__((vector_size(32)));
typedef uint8_t bytes_f32 __attribute__((vector_size(8)));
typedef uint8_t bytes_f64 __attribute__((vector_size(4)));

/* Each lane's low byte, a window position (0..4), as the argmax's bytes: one shuffle of the
   lanes' bytes (32- or 64-bit lanes) where the compiler has it, else __builtin_convertvector,
   which GCC compiles as a shift and an or per lane (a quarter of conv_pool's time in a profile).
   The AVX2 clone runs the shuffle as two byte shuffles and a permute; the baseline clone, without
   a byte shuffle, still goes lane by lane. Inlined, so no vector crosses a clone's ABI. */
#if defined(HAVE_SHUFFLE) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
typedef uint8_t lane_bytes __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) bytes_f32 positions_f32(ivec_f32 lanes) {
    const lane_bytes b = (lane_bytes)lanes;
    return SHUFFLE(b, b, 0, 4, 8, 12, 16, 20, 24, 28);
}
static inline __attribute__((always_inline)) bytes_f64 positions_f64(ivec_f64 lanes) {
    const lane_bytes b = (lane_bytes)lanes;
    return SHUFFLE(b, b, 0, 8, 16, 24);
}
#else
static inline __attribute__((always_inline)) bytes_f32 positions_f32(ivec_f32 lanes) {
    return __builtin_convertvector(lanes, bytes_f32);
}
static inline __attribute__((always_inline)) bytes_f64 positions_f64(ivec_f64 lanes) {
    return __builtin_convertvector(lanes, bytes_f64);
}
#endif

/* 1: conv_pool's passes take a 3 x 3 kernel with its size as constants (conv_pool_row_ and
   conv_pool_grads_); 0 with -DAFFDIV_GENERIC_TAPS, which the tests build to check that both give
   the same numbers. */
#ifdef AFFDIV_GENERIC_TAPS
#define SPECIALISE_3X3 0
#else
#define SPECIALISE_3X3 1
#endif

/* The position byte of a pooled value whose ReLU passes no gradient (no window position). */
#define POOL_NO_GRADIENT 4

/* Taps of a kernel conv_pool_backward takes (its per-tap accumulators; it refuses more). */
#define MAX_TAPS 49

/* sum_d m[d] * (the tap's input at the window's conv output d): one tap's gradient terms. */
#define WINDOW_TERMS(m, q, wq) ((m)[0] * (q)[0] + (m)[1] * (q)[1] + (m)[2] * (q)[wq] + (m)[3] * (q)[(wq) + 1])

#define DEFINE_CONV_POOL(T, SUFFIX, V)                                                             \
    /* PatchNorm's r = 1/sqrt(|patch|^2 + 1) of the conv outputs of one row of pooled positions,  \
       the conv outputs' columns as vector lanes: r[a * cols + ow] for the output at rows 2ph + a  \
       (p: the padded input at row 2ph) and columns ow < cols, each |patch|^2 summed in (i, j)     \
       order (the AVX2 clone fuses its products and sums, the baseline clone cannot: their last   \
       bits may differ, as in the other passes). */                                               \
    VECTOR_CLONES static void row_scales_##SUFFIX(const T *restrict p, int64_t wq, int64_t kh,    \
                                                  int64_t kw, int64_t cols, T *restrict r) {      \
        for (int64_t a = 0; a < 2; ++a) {                                                          \
            T *restrict ra = r + a * cols;                                                         \
            for (int64_t ow = 0; ow < cols; ++ow) ra[ow] = 0;                                      \
            for (int64_t i = 0; i < kh; ++i)                                                       \
                for (int64_t j = 0; j < kw; ++j) {                                                 \
                    const T *restrict q = p + (a + i) * wq + j;                                    \
                    for (int64_t ow = 0; ow < cols; ++ow) ra[ow] += q[ow] * q[ow];                 \
                }                                                                                  \
            for (int64_t ow = 0; ow < cols; ++ow) ra[ow] = (T)1 / (T)sqrt(ra[ow] + (T)1);          \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* r[d] of the window at pooled column pw: its four conv outputs' from a row of row_scales    \
       (2 wp columns each), or 1 each without a row (no patchnorm). */                            \
    static inline void window_scales_##SUFFIX(const T *row, int64_t wp, int64_t pw, T r[4]) {      \
        for (int d = 0; d < 4; ++d) r[d] = row ? row[(d / 2) * 2 * wp + 2 * pw + d % 2] : (T)1;    \
    }                                                                                              \
                                                                                                   \
    /* Channels rounded up to whole vectors: the weights', bias's and gradients' rows. */       \
    static inline int64_t padded_##SUFFIX(int64_t channels) { return (channels + V - 1) / V * V; } \
                                                                                                   \
    /* *v = the first n (<= V) lanes from src, the others 0; and back (vectors by pointer: by   \
       value they would cross the baseline clone's ABI). */                                       \
    static inline void load_lanes_##SUFFIX(vec_##SUFFIX *v, const T *src, int64_t n) {             \
        if (n == V) {                                                                              \
            memcpy(v, src, sizeof *v);                                                             \
            return;                                                                                \
        }                                                                                          \
        *v = (vec_##SUFFIX){0};                                                                    \
        for (int64_t l = 0; l < n; ++l) (*v)[l] = src[l];                                          \
    }                                                                                              \
    static inline void store_lanes_##SUFFIX(T *dst, const vec_##SUFFIX *v, int64_t n) {            \
        if (n == V)                                                                                \
            memcpy(dst, v, sizeof *v);                                                             \
        else                                                                                       \
            for (int64_t l = 0; l < n; ++l) dst[l] = (*v)[l];                                      \
    }                                                                                              \
                                                                                                   \
    /* The ReLU after a pool, on its maxima m and their positions: m = 0 where m < 0 (-0 and NaN   \
       kept, as torch's relu), position POOL_NO_GRADIENT where the ReLU passes no gradient (m not  \
       > 0 and not NaN, as threshold_backward reads its output). */                               \
    static inline void relu_lanes_##SUFFIX(vec_##SUFFIX *m, ivec_##SUFFIX *best) {                 \
        const ivec_##SUFFIX off = *m <= 0, negative = *m < 0;                                      \
        *best = (POOL_NO_GRADIENT & off) | (*best & ~off);                                         \
        *m = (vec_##SUFFIX)((ivec_##SUFFIX)*m & ~negative);                                        \
    }                                                                                              \
                                                                                                   \
    /* The maximum of a window's four values a[d] (the first, or the last NaN, as max_pool2d),     \
       with relu the ReLU after it, stored in the first n lanes of out; its position d (or        \
       POOL_NO_GRADIENT) in those of which, unless NULL. */                                        \
    static inline void store_window_max_##SUFFIX(const vec_##SUFFIX *a, int relu, T *out,          \
                                                 uint8_t *which, int64_t n) {                      \
        ivec_##SUFFIX best = {0};                                                                  \
        vec_##SUFFIX m = a[0];                                                                     \
        for (int d = 1; d < 4; ++d) {                                                              \
            const ivec_##SUFFIX take = (a[d] > m) | (a[d] != a[d]);                                \
            m = (vec_##SUFFIX)(((ivec_##SUFFIX)a[d] & take) | ((ivec_##SUFFIX)m & ~take));         \
            best = (d & take) | (best & ~take);                                                    \
        }                                                                                          \
        if (relu) relu_lanes_##SUFFIX(&m, &best);                                                  \
        store_lanes_##SUFFIX(out, &m, n);                                                          \
        if (!which) return;                                                                        \
        const bytes_##SUFFIX b = positions_##SUFFIX(best);                                         \
        if (n == V)                                                                                \
            memcpy(which, &b, sizeof b);                                                           \
        else                                                                                       \
            for (int64_t l = 0; l < n; ++l) which[l] = b[l];                                       \
    }                                                                                              \
                                                                                                   \
    /* *position = the first n window positions from src as lanes, the others 0. */              \
    static inline void load_positions_##SUFFIX(ivec_##SUFFIX *position, const uint8_t *src,       \
                                               int64_t n) {                                        \
        bytes_##SUFFIX b = {0};                                                                    \
        if (n == V)                                                                                \
            memcpy(&b, src, sizeof b);                                                             \
        else                                                                                       \
            for (int64_t l = 0; l < n; ++l) b[l] = src[l];                                         \
        *position = __builtin_convertvector(b, ivec_##SUFFIX);                                     \
    }                                                                                              \
                                                                                                   \
    /* One row of pooled positions (ph) of one sample: out and argmax (argmax NULL: not kept)    \
       at (ph, 0..Wp), all K models; channels in blocks of V, the last block partial. With        \
       patchnorm, scales (K * 4 Wp) takes the row's r of every model first (row_scales). */       \
    static inline __attribute__((always_inline)) void conv_pool_row_body_##SUFFIX(                \
        const T *restrict xp, int64_t plane, int64_t models, int64_t wq, int64_t kh, int64_t kw,  \
        const T *restrict wt, const T *restrict bias, int64_t channels, int64_t ph, int64_t wp,   \
        T *restrict scales, int relu, T *restrict out, uint8_t *restrict argmax) {                \
        const int64_t kc = models * channels, taps = kh * kw, cp = padded_##SUFFIX(channels);     \
        if (scales)                                                                                \
            for (int64_t k = 0; k < models; ++k)                                                   \
                row_scales_##SUFFIX(xp + k * plane + 2 * ph * wq, wq, kh, kw, 2 * wp, scales + k * 4 * wp); \
        for (int64_t pw = 0; pw < wp; ++pw)                                                       \
            for (int64_t k = 0; k < models; ++k) {                                                \
                const T *p = xp + k * plane + 2 * ph * wq + 2 * pw;                               \
                const T *wk = wt + k * taps * cp, *bk = bias ? bias + k * cp : NULL;              \
                const int64_t at = pw * kc + k * channels;                                        \
                T r[4];                                                                            \
                window_scales_##SUFFIX(scales ? scales + k * 4 * wp : NULL, wp, pw, r);            \
                for (int64_t c = 0; c < channels; c += V) {                                       \
                    const int64_t n = channels - c < V ? channels - c : V;                        \
                    vec_##SUFFIX a[4], w;                                                          \
                    if (bk)                                                                        \
                        memcpy(&a[0], bk + c, sizeof a[0]);                                        \
                    else                                                                           \
                        a[0] = (vec_##SUFFIX){0};                                                  \
                    a[1] = a[2] = a[3] = a[0];                                                     \
                    for (int64_t i = 0; i < kh; ++i)                                               \
                        for (int64_t j = 0; j < kw; ++j) {                                         \
                            const T *q = p + i * wq + j;                                           \
                            memcpy(&w, wk + (i * kw + j) * cp + c, sizeof w);                      \
                            for (int d = 0; d < 4; ++d) a[d] += w * q[(d / 2) * wq + d % 2];       \
                        }                                                                          \
                    for (int d = 0; d < 4; ++d) a[d] *= r[d];                                      \
                    store_window_max_##SUFFIX(a, relu, out + at + c, argmax ? argmax + at + c : NULL, n); \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    /* The row, inlined with the kernel's size as constants where it is 3 x 3 (the harness's     \
       CNNs; SPECIALISE_3X3), so that the compiler unrolls the taps; the same sums, in the same   \
       order. */                                                                                  \
    VECTOR_CLONES static void conv_pool_row_##SUFFIX(                                             \
        const T *restrict xp, int64_t plane, int64_t models, int64_t wq, int64_t kh, int64_t kw,  \
        const T *restrict wt, const T *restrict bias, int64_t channels, int64_t ph, int64_t wp,   \
        T *restrict scales, int relu, T *restrict out, uint8_t *restrict argmax) {                \
        if (SPECIALISE_3X3 && kh == 3 && kw == 3)                                                  \
            conv_pool_row_body_##SUFFIX(xp, plane, models, wq, 3, 3, wt, bias, channels, ph, wp,  \
                                        scales, relu, out, argmax);                                \
        else                                                                                       \
            conv_pool_row_body_##SUFFIX(xp, plane, models, wq, kh, kw, wt, bias, channels, ph, wp, \
                                        scales, relu, out, argmax);                                \
    }                                                                                              \
                                                                                                   \
    /* out = maxpool((conv(xp, wt) + bias) * r) (r = 1 without patchnorm; layouts above), then  \
       the ReLU with relu (argmax POOL_NO_GRADIENT where it passes none); argmax may be NULL.     \
       Returns -2 (and computes nothing) if PatchNorm's scales could not be allocated, else 0. */ \
    int conv_pool_##SUFFIX(const T *xp, int64_t models, int64_t batch, int64_t channels,          \
                           int64_t hq, int64_t wq, int64_t kh, int64_t kw, const T *wt,           \
                           const T *bias, int patchnorm, int relu, T *out, uint8_t *argmax,       \
                           int threads) {                                                         \
        const int64_t hp = (hq - kh + 1) / 2, wp = (wq - kw + 1) / 2, kc = models * channels;     \
        const int64_t work = batch * hp * wp * kc * kh * kw * 4;                                   \
        const int team = team_size(work, threads);                                                 \
        size_t row = 0; /* (elements between the threads' r of one row, every model) */          \
        T *scales = patchnorm ? team_buffer((size_t)(models * 4 * wp), sizeof(T), team, &row) : NULL; \
        if (patchnorm && !scales) return -2;                                                       \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(team)")                 \
        for (int64_t n = 0; n < batch; ++n)                                                        \
            for (int64_t ph = 0; ph < hp; ++ph) {                                                  \
                const int64_t at = (n * hp + ph) * wp * kc;                                        \
                conv_pool_row_##SUFFIX(xp + n * hq * wq, batch * hq * wq, models, wq, kh, kw, wt,   \
                                       bias, channels, ph, wp,                                     \
                                       scales ? scales + (size_t)my_thread() * row : NULL, relu,   \
                                       out + at, argmax ? argmax + at : NULL);                     \
            }                                                                                      \
        free(scales);                                                                              \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    /* One model: dw (kh*kw, Cp) = sum over samples and pooled positions of g * r times the patch \
       at the argmax's conv output, db (Cp) = sum of g * r (db NULL: not wanted); summed per       \
       sample, then over samples (error (Hp*Wp + B) u, not B*Hp*Wp*u as one running sum's).       \
       Channels in blocks of V, the last partial: its spare lanes load g and argmax as 0 and      \
       store dw's and db's padded columns (see above). With patchnorm, scales (B * Hp * 4 Wp)     \
       takes every window's r first (row_scales), for all the channel blocks. */                  \
    static inline __attribute__((always_inline)) void conv_pool_grads_body_##SUFFIX(              \
        const T *restrict xp, int64_t batch, int64_t hq, int64_t wq, int64_t kh, int64_t kw,      \
        int64_t channels, int64_t hp, int64_t wp, int64_t kc, T *restrict scales,                 \
        const T *restrict g, const uint8_t *restrict argmax, T *restrict dw, T *restrict db) {    \
        const int64_t taps = kh * kw, cp = padded_##SUFFIX(channels);                              \
        if (scales)                                                                                \
            for (int64_t n = 0; n < batch; ++n)                                                    \
                for (int64_t ph = 0; ph < hp; ++ph)                                                \
                    row_scales_##SUFFIX(xp + (n * hq + 2 * ph) * wq, wq, kh, kw, 2 * wp,           \
                                        scales + (n * hp + ph) * 4 * wp);                          \
        for (int64_t c = 0; c < channels; c += V) {                                               \
            const int64_t lanes = channels - c < V ? channels - c : V;                            \
            vec_##SUFFIX acc[MAX_TAPS], part[MAX_TAPS], sum = {0}, part_sum;                       \
            for (int64_t t = 0; t < taps; ++t) acc[t] = (vec_##SUFFIX){0};                         \
            for (int64_t n = 0; n < batch; ++n) {                                                  \
                for (int64_t t = 0; t < taps; ++t) part[t] = (vec_##SUFFIX){0};                    \
                part_sum = (vec_##SUFFIX){0};                                                      \
                for (int64_t ph = 0; ph < hp; ++ph)                                                \
                    for (int64_t pw = 0; pw < wp; ++pw) {                                          \
                        const T *p = xp + (n * hq + 2 * ph) * wq + 2 * pw;                         \
                        const int64_t at = ((n * hp + ph) * wp + pw) * kc + c;                     \
                        vec_##SUFFIX gv, m[4];                                                     \
                        load_lanes_##SUFFIX(&gv, g + at, lanes);                                   \
                        ivec_##SUFFIX which;                                                       \
                        load_positions_##SUFFIX(&which, argmax + at, lanes);                       \
                        T r[4];                                                                    \
                        window_scales_##SUFFIX(scales ? scales + (n * hp + ph) * 4 * wp : NULL, wp, pw, r); \
                        for (int d = 0; d < 4; ++d)                                                \
                            m[d] = (vec_##SUFFIX)((ivec_##SUFFIX)gv & (which == d)) * r[d];        \
                        part_sum += m[0] + m[1] + m[2] + m[3];                                     \
                        for (int64_t i = 0; i < kh; ++i)                                           \
                            for (int64_t j = 0; j < kw; ++j) {                                     \
                                const T *q = p + i * wq + j;                                       \
                                part[i * kw + j] += WINDOW_TERMS(m, q, wq);                        \
                            }                                                                      \
                    }                                                                              \
                for (int64_t t = 0; t < taps; ++t) acc[t] += part[t];                              \
                sum += part_sum;                                                                   \
            }                                                                                      \
            for (int64_t t = 0; t < taps; ++t) memcpy(dw + t * cp + c, &acc[t], sizeof acc[t]);   \
            if (db) memcpy(db + c, &sum, sizeof sum);                                              \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* The body, inlined with the kernel's size as constants where it is 3 x 3 (the harness's    \
       CNNs; SPECIALISE_3X3): the compiler then keeps the nine taps' partial sums in registers,   \
       where with the size a variable each += was a load and a store the next one waited on. The  \
       same sums, in the same order. */                                                           \
    VECTOR_CLONES static void conv_pool_grads_##SUFFIX(                                           \
        const T *restrict xp, int64_t batch, int64_t hq, int64_t wq, int64_t kh, int64_t kw,      \
        int64_t channels, int64_t hp, int64_t wp, int64_t kc, T *restrict scales,                 \
        const T *restrict g, const uint8_t *restrict argmax, T *restrict dw, T *restrict db) {    \
        if (SPECIALISE_3X3 && kh == 3 && kw == 3)                                                  \
            conv_pool_grads_body_##SUFFIX(xp, batch, hq, wq, 3, 3, channels, hp, wp, kc, scales, g, \
                                          argmax, dw, db);                                         \
        else                                                                                       \
            conv_pool_grads_body_##SUFFIX(xp, batch, hq, wq, kh, kw, channels, hp, wp, kc, scales, \
                                          g, argmax, dw, db);                                      \
    }                                                                                              \
                                                                                                   \
    /* dwt (K, kh*kw, Cp) and db (K*Cp, or NULL) of conv_pool at its output's gradient g (its    \
       layout) and argmax; one model per thread. Returns -1 (and computes nothing) for a kernel  \
       of more than MAX_TAPS taps, -2 if PatchNorm's scales could not be allocated, else 0. */   \
    int conv_pool_backward_##SUFFIX(const T *xp, const T *g, const uint8_t *argmax, int64_t models, \
                                    int64_t batch, int64_t channels, int64_t hq, int64_t wq,      \
                                    int64_t kh, int64_t kw, int patchnorm, T *dwt, T *db,         \
                                    int threads) {                                                \
        if (kh * kw > MAX_TAPS) return -1;                                                         \
        const int64_t hp = (hq - kh + 1) / 2, wp = (wq - kw + 1) / 2, kc = models * channels;     \
        const int64_t work = batch * hp * wp * kc * kh * kw * 4;                                   \
        int team = team_size(work, threads);                                                       \
        if (team > models) team = models > 0 ? (int)models : 1; /* (one model per thread) */        \
        size_t model = 0; /* (elements between the threads' r of one model) */                   \
        T *scales = patchnorm ? team_buffer((size_t)(batch * hp * 4 * wp), sizeof(T), team, &model) : NULL; \
        if (patchnorm && !scales) return -2;                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(team)")                             \
        for (int64_t k = 0; k < models; ++k)                                                       \
            conv_pool_grads_##SUFFIX(xp + k * batch * hq * wq, batch, hq, wq, kh, kw, channels, hp, wp, \
                                     kc, scales ? scales + (size_t)my_thread() * model : NULL,    \
                                     g + k * channels, argmax + k * channels,                     \
                                     dwt + k * kh * kw * padded_##SUFFIX(channels),               \
                                     db ? db + k * padded_##SUFFIX(channels) : NULL);             \
        free(scales);                                                                              \
        return 0;                                                                                  \
    }

DEFINE_CONV_POOL(float, f32, 8)
DEFINE_CONV_POOL(double, f64, 4)

/* The batched CNN's 2x2 max-pool (stride 2, floor mode) and the ReLU after it, on x (B, H, W, C):
   the channels_last order of (B, C, H, W). out (B, Hp, Wp, C), Hp = H / 2, Wp = W / 2: each
   window's maximum, the first in row order or the last NaN (as max_pool2d), then with relu the
   ReLU (relu_lanes); which (B, Hp, Wp, C) bytes: the maximum's window position 2a + b, or
   POOL_NO_GRADIENT (NULL: not kept). The backward writes every element of dx (B, H, W, C): g at
   each window's position `which`, 0 at its other three and in the row and column past the last
   window (an odd size). Channels run in vectors of V lanes, the last block partial; the passes
   only move and compare values, so their numbers are exactly torch's. */
#define DEFINE_MAX_POOL2(T, SUFFIX, V)                                                             \
    /* One row of windows (ph) of one sample: x at its rows 2ph and 2ph + 1. */                    \
    VECTOR_CLONES static void max_pool2_row_##SUFFIX(const T *restrict x, int64_t w, int64_t channels, \
                                                      int64_t wp, int relu, T *restrict out,       \
                                                      uint8_t *restrict which) {                   \
        for (int64_t pw = 0; pw < wp; ++pw)                                                       \
            for (int64_t c = 0; c < channels; c += V) {                                           \
                const int64_t n = channels - c < V ? channels - c : V, at = pw * channels + c;    \
                vec_##SUFFIX a[4];                                                                 \
                for (int d = 0; d < 4; ++d)                                                        \
                    load_lanes_##SUFFIX(&a[d], x + ((d / 2) * w + 2 * pw + d % 2) * channels + c, n); \
                store_window_max_##SUFFIX(a, relu, out + at, which ? which + at : NULL, n);        \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    void max_pool2_##SUFFIX(const T *x, int64_t batch, int64_t h, int64_t w, int64_t channels,    \
                            int relu, T *out, uint8_t *which, int threads) {                      \
        const int64_t hp = h / 2, wp = w / 2;                                                      \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(team_size(batch * h * w * channels, threads))") \
        for (int64_t n = 0; n < batch; ++n)                                                        \
            for (int64_t ph = 0; ph < hp; ++ph) {                                                  \
                const int64_t row = ((n * hp + ph) * wp) * channels;                               \
                max_pool2_row_##SUFFIX(x + (n * h + 2 * ph) * w * channels, w, channels, wp, relu,   \
                                       out + row, which ? which + row : NULL);                     \
            }                                                                                      \
    }                                                                                              \
                                                                                                   \
    /* dx's rows 2ph and 2ph + 1 of one sample from that row of windows' g and which. */          \
    VECTOR_CLONES static void max_pool2_grad_row_##SUFFIX(const T *restrict g,                     \
                                                           const uint8_t *restrict which, int64_t w, \
                                                           int64_t channels, int64_t wp,           \
                                                           T *restrict dx) {                       \
        for (int64_t pw = 0; pw < wp; ++pw)                                                       \
            for (int64_t c = 0; c < channels; c += V) {                                           \
                const int64_t n = channels - c < V ? channels - c : V, at = pw * channels + c;    \
                vec_##SUFFIX gv, v;                                                                \
                load_lanes_##SUFFIX(&gv, g + at, n);                                               \
                ivec_##SUFFIX position;                                                            \
                load_positions_##SUFFIX(&position, which + at, n);                                 \
                for (int d = 0; d < 4; ++d) {                                                      \
                    v = (vec_##SUFFIX)((ivec_##SUFFIX)gv & (position == d));                       \
                    store_lanes_##SUFFIX(dx + ((d / 2) * w + 2 * pw + d % 2) * channels + c, &v, n); \
                }                                                                                  \
            }                                                                                      \
        if (w % 2)                                                                                 \
            for (int a = 0; a < 2; ++a) memset(dx + (a * w + w - 1) * channels, 0, sizeof(T) * channels); \
    }                                                                                              \
                                                                                                   \
    void max_pool2_backward_##SUFFIX(const T *g, const uint8_t *which, int64_t batch, int64_t h,  \
                                     int64_t w, int64_t channels, T *dx, int threads) {           \
        const int64_t hp = h / 2, wp = w / 2;                                                      \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(team_size(batch * h * w * channels, threads))") \
        for (int64_t n = 0; n < batch; ++n)                                                        \
            for (int64_t ph = 0; ph < hp + h % 2; ++ph) {                                          \
                T *rows = dx + (n * h + 2 * ph) * w * channels;                                    \
                if (ph == hp) /* the row past the last window */                                   \
                    memset(rows, 0, sizeof(T) * w * channels);                                     \
                else                                                                               \
                    max_pool2_grad_row_##SUFFIX(g + (n * hp + ph) * wp * channels,                 \
                                                which + (n * hp + ph) * wp * channels, w, channels, wp, rows); \
            }                                                                                      \
    }

DEFINE_MAX_POOL2(float, f32, 8)
DEFINE_MAX_POOL2(double, f64, 4)

/* Multi-head self-attention of short sequences (the stacked vision transformer's,
   experiments.runs.stacked_attention). N sequences of `tokens` rows; each row of q, k, v, y and
   their gradients holds `width` = heads * size entries, head h's at h*size .. (h+1)*size - 1,
   all row-major (N*tokens, width); scores and probabilities (N, heads, tokens, tokens)
   contiguous. For one (sequence, head), with q_t, k_u, v_u, y_t its rows' head entries:
     attention_scores    s_tu = <q_t, k_u> * scale      (scale = 1/sqrt(size))
     attention_values    y_t = sum_u p_tu v_u
     attention_backward  gv_u = sum_t p_tu gy_t,   dp_tu = <gy_t, v_u>,
                         ds_tu = p_tu (dp_tu - sum_u' p_tu' dp_tu') * scale,
                         gq_t = sum_u ds_tu k_u,   gk_u = sum_t ds_tu q_t
   (the softmax p = softmax_u(s_tu) between them is torch's; in float32 attention_probabilities
   computes the scores and their softmax in one pass). One (sequence, head) per work
   item, its sums in the order written (the same for any thread count); each item transposes
   its keys (values, in backward) into this thread's `scratch` ((size + tokens) * tokens
   entries per thread, the rest for ds) so that a row of scores is a sum of vectors over the
   u's. */
#define DEFINE_ATTENTION_ITEMS(T, SUFFIX)                                                          \
    /* bt (size x tokens) = a head's rows b (tokens of `size` entries, `width` apart), transposed. */ \
    static inline __attribute__((always_inline)) void head_transposed_##SUFFIX(                   \
        const T *restrict b, int64_t tokens, int64_t width, int64_t size, T *restrict bt) {       \
        for (int64_t u = 0; u < tokens; ++u)                                                       \
            for (int64_t j = 0; j < size; ++j) bt[j * tokens + u] = b[u * width + j];              \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_scores_item_##SUFFIX(             \
        const T *restrict q, const T *restrict k, int64_t tokens, int64_t width, int64_t size,    \
        T scale, T *restrict s, T *restrict kt) {                                                   \
        head_transposed_##SUFFIX(k, tokens, width, size, kt);                                      \
        for (int64_t t = 0; t < tokens; ++t) {                                                     \
            T *row = s + t * tokens;                                                               \
            for (int64_t u = 0; u < tokens; ++u) row[u] = 0;                                       \
            for (int64_t j = 0; j < size; ++j)                                                     \
                for (int64_t u = 0; u < tokens; ++u) row[u] += q[t * width + j] * kt[j * tokens + u]; \
            for (int64_t u = 0; u < tokens; ++u) row[u] *= scale;                                  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_values_item_##SUFFIX(             \
        const T *restrict p, const T *restrict v, int64_t tokens, int64_t width, int64_t size,    \
        T *restrict y) {                                                                           \
        for (int64_t t = 0; t < tokens; ++t) {                                                     \
            T *yt = y + t * width;                                                                 \
            for (int64_t j = 0; j < size; ++j) yt[j] = 0;                                          \
            for (int64_t u = 0; u < tokens; ++u) {                                                 \
                const T a = p[t * tokens + u];                                                     \
                for (int64_t j = 0; j < size; ++j) yt[j] += a * v[u * width + j];                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_backward_item_##SUFFIX(           \
        const T *restrict q, const T *restrict k, const T *restrict v, const T *restrict p,       \
        const T *restrict gy, int64_t tokens, int64_t width, int64_t size, T scale,                \
        T *restrict gq, T *restrict gk, T *restrict gv, T *restrict vt, T *restrict ds) {          \
        head_transposed_##SUFFIX(v, tokens, width, size, vt);                                      \
        for (int64_t t = 0; t < tokens; ++t) { /* ds's row t, and gq_t */                         \
            const T *pt = p + t * tokens, *gyt = gy + t * width;                                   \
            T *dst = ds + t * tokens, *gqt = gq + t * width;                                       \
            for (int64_t u = 0; u < tokens; ++u) dst[u] = 0;                                       \
            for (int64_t j = 0; j < size; ++j)                                                     \
                for (int64_t u = 0; u < tokens; ++u) dst[u] += gyt[j] * vt[j * tokens + u];        \
            T mean = 0;                                                                            \
            for (int64_t u = 0; u < tokens; ++u) mean += pt[u] * dst[u];                           \
            for (int64_t u = 0; u < tokens; ++u) dst[u] = pt[u] * (dst[u] - mean) * scale;        \
            for (int64_t j = 0; j < size; ++j) gqt[j] = 0;                                         \
            for (int64_t u = 0; u < tokens; ++u)                                                   \
                for (int64_t j = 0; j < size; ++j) gqt[j] += dst[u] * k[u * width + j];           \
        }                                                                                          \
        for (int64_t u = 0; u < tokens; ++u) { /* gk_u and gv_u, summed over t */                  \
            T *gku = gk + u * width, *gvu = gv + u * width;                                        \
            for (int64_t j = 0; j < size; ++j) gku[j] = gvu[j] = 0;                                \
            for (int64_t t = 0; t < tokens; ++t) {                                                 \
                const T d = ds[t * tokens + u], a = p[t * tokens + u];                             \
                for (int64_t j = 0; j < size; ++j) {                                               \
                    gku[j] += d * q[t * width + j];                                                \
                    gvu[j] += a * gy[t * width + j];                                               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \

/* Rows of 16 and of 8 entries as vectors (GCC's vector extension), for the passes below that keep
   a short row in registers: in float32 a row of 16 is one AVX-512 register in the v4 clones, two
   AVX2 ones in the v3 clones (which spill some); float64's span twice as many, and those paths
   are the float64 checks', measured for their numbers, not their speed. */
#define DEFINE_ROW_VECTORS(T, SUFFIX)                                                              \
    typedef T SUFFIX##_row16 __attribute__((vector_size(16 * sizeof(T))));                        \
    typedef T SUFFIX##_row8 __attribute__((vector_size(8 * sizeof(T))));                          \
                                                                                                   \
    static inline __attribute__((always_inline)) SUFFIX##_row8 load8_##SUFFIX(const T *p) {       \
        SUFFIX##_row8 r;                                                                           \
        memcpy(&r, p, sizeof r);                                                                   \
        return r;                                                                                  \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) SUFFIX##_row16 load16_##SUFFIX(const T *p) {     \
        SUFFIX##_row16 r;                                                                          \
        memcpy(&r, p, sizeof r);                                                                   \
        return r;                                                                                  \
    }                                                                                              \

DEFINE_ROW_VECTORS(float, f32)
DEFINE_ROW_VECTORS(double, f64)

#ifdef HAVE_SHUFFLE
#define SCORES_16X8 1
#define DEFINE_HEADS_16X8(T, SUFFIX)                                                               \
    /* The harness vit's heads (16 tokens, 8 entries): a row of 16 scores is one vector, a head's \
       row of 8 entries another, and a head's keys (values, in backward) are transposed in        \
       registers, so that every sum accumulates in registers (the generic items keep their rows  \
       in memory, each += a store that the next one waits on: 2-3x slower in a quick             \
       measurement). gk and gv are summed transposed (entry j of every u at once) and transposed \
       back. Every sum runs over j, u or t from 0 up, as the generic items', except <p_t, dp_t>  \
       (pairwise over u).                                                                         */ \
    /* A head's 16 rows of 8 entries, a[m] = rows m and m + 8, transposed in registers (and back: \
       the permutation is its own inverse): entry (m + 8h, j) at lane 8h + j of a[m] goes to lane \
       8h + m of a[j], so that a[j] holds entry j of rows 0..15 in order. Three stages, each       \
       trading bit b of the vector's index for bit b of the lane's (one two-vector shuffle per    \
       output vector). */                                                                          \
    static inline __attribute__((always_inline)) void swap_bits_16x8_##SUFFIX(SUFFIX##_row16 *a) { \
        for (int v = 0; v < 8; v += 2) {                                                           \
            const SUFFIX##_row16 x = a[v], y = a[v + 1];                                           \
            a[v] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30); \
            a[v + 1] = __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); \
        }                                                                                          \
        for (int i = 0; i < 4; ++i) { /* vectors 0, 1, 4, 5 with 2, 3, 6, 7 */                    \
            const int v = i + (i / 2) * 2;                                                         \
            const SUFFIX##_row16 x = a[v], y = a[v + 2];                                           \
            a[v] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29); \
            a[v + 2] = __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); \
        }                                                                                          \
        for (int v = 0; v < 4; ++v) {                                                              \
            const SUFFIX##_row16 x = a[v], y = a[v + 4];                                           \
            a[v] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27); \
            a[v + 4] = __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31); \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* a[j] = entry j of a head's 16 rows (`width` apart), in row order */                         \
    static inline __attribute__((always_inline)) void head_columns_16x8_##SUFFIX(                 \
        const T *restrict b, int64_t width, SUFFIX##_row16 *a) {                                   \
        for (int m = 0; m < 8; ++m) {                                                              \
            a[m] = __builtin_shufflevector(load8_##SUFFIX(b + m * width),                         \
                                           load8_##SUFFIX(b + (m + 8) * width), 0, 1, 2, 3, 4, 5, \
                                           6, 7, 8, 9, 10, 11, 12, 13, 14, 15);                    \
        }                                                                                          \
        swap_bits_16x8_##SUFFIX(a);                                                                \
    }                                                                                              \
                                                                                                   \
    /* The inverse: a head's 16 rows (`width` apart) from a[j] = entry j of each (a overwritten) */ \
    static inline __attribute__((always_inline)) void store_head_rows_16x8_##SUFFIX(              \
        SUFFIX##_row16 *a, int64_t width, T *restrict b) {                                         \
        swap_bits_16x8_##SUFFIX(a);                                                                \
        for (int m = 0; m < 8; ++m) {                                                              \
            const SUFFIX##_row8 low = __builtin_shufflevector(a[m], a[m], 0, 1, 2, 3, 4, 5, 6, 7); \
            const SUFFIX##_row8 high = __builtin_shufflevector(a[m], a[m], 8, 9, 10, 11, 12, 13, 14, 15); \
            memcpy(b + m * width, &low, sizeof low);                                               \
            memcpy(b + (m + 8) * width, &high, sizeof high);                                       \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* s_t = sum_j q_tj kt_j, a row of 16 scores from the 8 rows of kt (a head's keys, transposed) */ \
    static inline __attribute__((always_inline)) SUFFIX##_row16 head_row_16x8_##SUFFIX(           \
        const T *restrict q, const SUFFIX##_row16 *kt) {                                           \
        SUFFIX##_row16 row = kt[0] * q[0];                                                         \
        for (int j = 1; j < 8; ++j) row += kt[j] * q[j];                                           \
        return row;                                                                                \
    }                                                                                              \
                                                                                                   \
    /* sum_u a_u b_u (u < 16), b rows of 8 entries `width` apart */                                \
    static inline __attribute__((always_inline)) SUFFIX##_row8 weighted_rows_16x8_##SUFFIX(       \
        const T *restrict a, const T *restrict b, int64_t width) {                                 \
        SUFFIX##_row8 acc = load8_##SUFFIX(b) * a[0];                                              \
        for (int u = 1; u < 16; ++u) acc += load8_##SUFFIX(b + u * width) * a[u];                  \
        return acc;                                                                                \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_scores_16x8_##SUFFIX(             \
        const T *restrict q, const T *restrict k, int64_t width, T scale, T *restrict s,          \
        T *restrict scratch) { /* (no scratch: the keys are transposed in registers) */           \
        (void)scratch;                                                                             \
        SUFFIX##_row16 kt[8];                                                                      \
        head_columns_16x8_##SUFFIX(k, width, kt);                                                  \
        for (int t = 0; t < 16; ++t) {                                                             \
            const SUFFIX##_row16 row = head_row_16x8_##SUFFIX(q + t * width, kt) * scale;          \
            memcpy(s + t * 16, &row, sizeof row);                                                  \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_values_16x8_##SUFFIX(             \
        const T *restrict p, const T *restrict v, int64_t width, T *restrict y) {                  \
        for (int t = 0; t < 16; ++t) {                                                             \
            const SUFFIX##_row8 yt = weighted_rows_16x8_##SUFFIX(p + t * 16, v, width);            \
            memcpy(y + t * width, &yt, sizeof yt);                                                 \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_backward_16x8_##SUFFIX(           \
        const T *restrict q, const T *restrict k, const T *restrict v, const T *restrict p,       \
        const T *restrict gy, int64_t width, T scale, T *restrict gq, T *restrict gk,              \
        T *restrict gv, T *restrict ds) {                                                          \
        SUFFIX##_row16 vt[8];                                                                      \
        head_columns_16x8_##SUFFIX(v, width, vt);                                                  \
        SUFFIX##_row16 gkt[8]; /* gk transposed: entry j of each u */                              \
        for (int t = 0; t < 16; ++t) { /* ds's row t, and the t-th terms of gk_u, every u at once */ \
            const SUFFIX##_row16 dp = head_row_16x8_##SUFFIX(gy + t * width, vt);                 \
            const SUFFIX##_row16 pt = load16_##SUFFIX(p + t * 16);                                 \
            SUFFIX##_row16 w = pt * dp; /* <p_t, dp_t> pairwise, every lane the same total */     \
            w += __builtin_shufflevector(w, w, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); \
            w += __builtin_shufflevector(w, w, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); \
            w += __builtin_shufflevector(w, w, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); \
            w += __builtin_shufflevector(w, w, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); \
            const SUFFIX##_row16 dst = pt * (dp - w) * scale;                                      \
            memcpy(ds + t * 16, &dst, sizeof dst);                                                 \
            for (int j = 0; j < 8; ++j) gkt[j] = t ? gkt[j] + dst * q[t * width + j] : dst * q[j]; \
        }                                                                                          \
        store_head_rows_16x8_##SUFFIX(gkt, width, gk);                                             \
        for (int t = 0; t < 16; ++t) {                                                             \
            const SUFFIX##_row8 gqt = weighted_rows_16x8_##SUFFIX(ds + t * 16, k, width);          \
            memcpy(gq + t * width, &gqt, sizeof gqt);                                              \
        }                                                                                          \
        SUFFIX##_row16 gvt[8]; /* gv transposed */                                                 \
        for (int j = 0; j < 8; ++j) gvt[j] = load16_##SUFFIX(p) * gy[j];                           \
        for (int t = 1; t < 16; ++t)                                                               \
            for (int j = 0; j < 8; ++j) gvt[j] += load16_##SUFFIX(p + t * 16) * gy[t * width + j]; \
        store_head_rows_16x8_##SUFFIX(gvt, width, gv);                                             \
    }
#else /* (without the shuffle builtin: the generic items with their sizes as constants, except
         the scores', which ran slower with constant sizes than with the sizes read at run time:
         SCORES_16X8 0, a branch never taken) */
#define SCORES_16X8 0
#define DEFINE_HEADS_16X8(T, SUFFIX)                                                               \
    static inline __attribute__((always_inline)) void attention_scores_16x8_##SUFFIX(             \
        const T *restrict q, const T *restrict k, int64_t width, T scale, T *restrict s,          \
        T *restrict scratch) {                                                                     \
        attention_scores_item_##SUFFIX(q, k, 16, width, 8, scale, s, scratch);                     \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_values_16x8_##SUFFIX(             \
        const T *restrict p, const T *restrict v, int64_t width, T *restrict y) {                  \
        attention_values_item_##SUFFIX(p, v, 16, width, 8, y);                                     \
    }                                                                                              \
                                                                                                   \
    static inline __attribute__((always_inline)) void attention_backward_16x8_##SUFFIX(           \
        const T *restrict q, const T *restrict k, const T *restrict v, const T *restrict p,       \
        const T *restrict gy, int64_t width, T scale, T *restrict gq, T *restrict gk,              \
        T *restrict gv, T *restrict scratch) {                                                     \
        attention_backward_item_##SUFFIX(q, k, v, p, gy, 16, width, 8, scale, gq, gk, gv, scratch, \
                                         scratch + 8 * 16);                                        \
    }
#endif

#define DEFINE_ATTENTION_PASSES(T, SUFFIX)                                                         \
    /* Items [first, last) of each pass, the item bodies inlined: the 16 x 8 items above where    \
       the sizes are these, else the generic ones. */                                              \
    WIDE_CLONES static void attention_scores_range_##SUFFIX(                                       \
        const T *q, const T *k, int64_t first, int64_t last, int64_t tokens, int64_t heads,       \
        int64_t size, T scale, T *s, T *kt) {                                                      \
        for (int64_t item = first; item < last; ++item) {                                          \
            const int64_t at = (item / heads * tokens * heads + item % heads) * size;              \
            if (SCORES_16X8 && tokens == 16 && size == 8)                                          \
                attention_scores_16x8_##SUFFIX(q + at, k + at, heads * 8, scale, s + item * 256,  \
                                               kt);                                                \
            else                                                                                   \
                attention_scores_item_##SUFFIX(q + at, k + at, tokens, heads * size, size, scale,  \
                                               s + item * tokens * tokens, kt);                    \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    WIDE_CLONES static void attention_values_range_##SUFFIX(                                       \
        const T *p, const T *v, int64_t first, int64_t last, int64_t tokens, int64_t heads,       \
        int64_t size, T *y) {                                                                      \
        for (int64_t item = first; item < last; ++item) {                                          \
            const int64_t at = (item / heads * tokens * heads + item % heads) * size;              \
            const T *pi = p + item * tokens * tokens;                                              \
            if (tokens == 16 && size == 8)                                                         \
                attention_values_16x8_##SUFFIX(pi, v + at, heads * 8, y + at);                     \
            else                                                                                   \
                attention_values_item_##SUFFIX(pi, v + at, tokens, heads * size, size, y + at);    \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    WIDE_CLONES static void attention_backward_range_##SUFFIX(                                     \
        const T *q, const T *k, const T *v, const T *p, const T *gy, int64_t first, int64_t last,  \
        int64_t tokens, int64_t heads, int64_t size, T scale, T *gq, T *gk, T *gv, T *scratch) {   \
        for (int64_t item = first; item < last; ++item) {                                          \
            const int64_t at = (item / heads * tokens * heads + item % heads) * size;              \
            const T *pi = p + item * tokens * tokens;                                              \
            if (tokens == 16 && size == 8)                                                         \
                attention_backward_16x8_##SUFFIX(q + at, k + at, v + at, pi, gy + at, heads * 8,   \
                                                 scale, gq + at, gk + at, gv + at, scratch);       \
            else                                                                                   \
                attention_backward_item_##SUFFIX(q + at, k + at, v + at, pi, gy + at, tokens,     \
                                                 heads * size, size, scale, gq + at, gk + at,     \
                                                 gv + at, scratch, scratch + size * tokens);      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    /* Each pass: its items split over the team in contiguous blocks (my_rows); `scratch` holds   \
       (size + tokens) * tokens entries per thread. */                                           \
    void attention_scores_##SUFFIX(const T *q, const T *k, int64_t sequences, int64_t tokens,     \
                                   int64_t heads, int64_t size, double scale, T *s, T *scratch,   \
                                   int threads) {                                                  \
        _Pragma("omp parallel num_threads(team_size(sequences * heads * tokens * tokens * size, threads))") { \
            int64_t first, last;                                                                   \
            my_rows(sequences * heads, &first, &last);                                             \
            attention_scores_range_##SUFFIX(q, k, first, last, tokens, heads, size, (T)scale, s,   \
                                            scratch + my_thread() * (size + tokens) * tokens);     \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void attention_values_##SUFFIX(const T *p, const T *v, int64_t sequences, int64_t tokens,     \
                                   int64_t heads, int64_t size, T *y, int threads) {              \
        _Pragma("omp parallel num_threads(team_size(sequences * heads * tokens * tokens * size, threads))") { \
            int64_t first, last;                                                                   \
            my_rows(sequences * heads, &first, &last);                                             \
            attention_values_range_##SUFFIX(p, v, first, last, tokens, heads, size, y);           \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void attention_backward_##SUFFIX(const T *q, const T *k, const T *v, const T *p, const T *gy, \
                                     int64_t sequences, int64_t tokens, int64_t heads,            \
                                     int64_t size, double scale, T *gq, T *gk, T *gv, T *scratch, \
                                     int threads) {                                                \
        _Pragma("omp parallel num_threads(team_size(sequences * heads * tokens * tokens * size, threads))") { \
            int64_t first, last;                                                                   \
            my_rows(sequences * heads, &first, &last);                                             \
            attention_backward_range_##SUFFIX(q, k, v, p, gy, first, last, tokens, heads, size,    \
                                              (T)scale, gq, gk, gv,                                \
                                              scratch + my_thread() * (size + tokens) * tokens);   \
        }                                                                                          \
    }

DEFINE_ATTENTION_ITEMS(float, f32)
DEFINE_ATTENTION_ITEMS(double, f64)
DEFINE_HEADS_16X8(float, f32)
DEFINE_HEADS_16X8(double, f64)
DEFINE_ATTENTION_PASSES(float, f32)
DEFINE_ATTENTION_PASSES(double, f64)

/* Each of 16 rows' total: lane r of the result = the sum of v[r]'s 16 lanes, pairwise (lanes l
   and l + 8, then l and l + 4, l + 2, l + 1: every row in the same order). With the shuffle
   builtin, the 16 rows at once (each stage pairs the rows' partial sums two vectors at a time);
   without it, row by row in that order. */
#ifdef HAVE_SHUFFLE
/* The four stages over 16 vectors v[0..15] of type T16, COMBINE(a, b) pairing two of them: lane r
   of the result combines v[r]'s lanes (lanes 8h + l of w[i]: row 2i + h, its lanes l and l + 8;
   then lanes 4h + l of x[i]: row 4i + h; lanes 2h + l of y[i]: row 8i + h). */
#define ROWS_PAIRWISE(T16, v, COMBINE)                                                             \
    ({                                                                                             \
        T16 w_[8], x_[4], y_[2];                                                                   \
        for (int i = 0; i < 8; ++i)                                                                \
            w_[i] = COMBINE(__builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6,  \
                                                    7, 16, 17, 18, 19, 20, 21, 22, 23),            \
                            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, \
                                                    14, 15, 24, 25, 26, 27, 28, 29, 30, 31));      \
        for (int i = 0; i < 4; ++i)                                                                \
            x_[i] = COMBINE(__builtin_shufflevector(w_[2 * i], w_[2 * i + 1], 0, 1, 2, 3, 8, 9,   \
                                                    10, 11, 16, 17, 18, 19, 24, 25, 26, 27),       \
                            __builtin_shufflevector(w_[2 * i], w_[2 * i + 1], 4, 5, 6, 7, 12, 13, \
                                                    14, 15, 20, 21, 22, 23, 28, 29, 30, 31));      \
        for (int i = 0; i < 2; ++i)                                                                \
            y_[i] = COMBINE(__builtin_shufflevector(x_[2 * i], x_[2 * i + 1], 0, 1, 4, 5, 8, 9,   \
                                                    12, 13, 16, 17, 20, 21, 24, 25, 28, 29),       \
                            __builtin_shufflevector(x_[2 * i], x_[2 * i + 1], 2, 3, 6, 7, 10, 11, \
                                                    14, 15, 18, 19, 22, 23, 26, 27, 30, 31));      \
        COMBINE(__builtin_shufflevector(y_[0], y_[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,  \
                                        24, 26, 28, 30),                                           \
                __builtin_shufflevector(y_[0], y_[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,  \
                                        25, 27, 29, 31));                                          \
    })
#define ROWS_ADD(a, b) ((a) + (b))
#define DEFINE_ROW_TOTALS(T, SUFFIX)                                                               \
    static inline __attribute__((always_inline)) SUFFIX##_row16 row_totals_##SUFFIX(              \
        const SUFFIX##_row16 *v) {                                                                 \
        return ROWS_PAIRWISE(SUFFIX##_row16, v, ROWS_ADD);                                         \
    }
#else
#define DEFINE_ROW_TOTALS(T, SUFFIX)                                                               \
    static inline SUFFIX##_row16 row_totals_##SUFFIX(const SUFFIX##_row16 *v) {                    \
        SUFFIX##_row16 totals;                                                                     \
        for (int r = 0; r < 16; ++r) {                                                             \
            T lane[16];                                                                            \
            memcpy(lane, &v[r], sizeof lane);                                                      \
            for (int half = 8; half > 0; half /= 2)                                                \
                for (int l = 0; l < half; ++l) lane[l] += lane[l + half];                          \
            totals[r] = lane[0];                                                                   \
        }                                                                                          \
        return totals;                                                                             \
    }
#endif
DEFINE_ROW_TOTALS(float, f32)
DEFINE_ROW_TOTALS(double, f64)

/* The softmax of the harness vit's scores with them (float32; where the compiler has the shuffle
   builtin): for each (sequence, head) of 16 tokens and heads of 8 entries,
     attention_probabilities   p_tu = e^(s_tu - m_t) / sum_u' e^(s_tu' - m_t),
                               s_tu = <q_t, k_u> * scale,  m_t = max_u s_tu
   each score summed as attention_scores sums it, never written; a head's 16 rows' maxima and
   sums pairwise over their lanes, the 16 rows reduced together (ROWS_PAIRWISE); each row times
   the reciprocal of its sum (as torch's softmax). e^x for x <= 0 (exp_nonpositive_f32):
     x = k ln2 + r,  k = round(x log2(e)),  |r| <= ln2/2 + 2^-9  (ln2 in two parts, k ln2_hi
                     exact for |k| < 2^9)
     e^r = 1 + r + r^2/2! + ... + r^7/7!  (the next term under 7.7e-9 of e^r: 0.13 of float32's
                     unit roundoff u = 6e-8; Horner's rounding adds a few u)
     e^x = 2^k e^r  (2^k by the exponent field, -126 <= k <= 0: always a normal number)
   x below -87 gives 0 (so that k >= -126; e^x there is under 1.7e-38, an absolute error the
   row's sum, at least 1, cannot see), x above 0 (only in a row with a NaN, which comes out NaN)
   is taken as 0, and a NaN stays NaN. The NaN test needs IEEE arithmetic (no -ffast-math or
   -ffinite-math-only).
   Returns -1, having done nothing, for other sizes or without the shuffle builtin (the caller
   asks first, and otherwise takes attention_scores and its own softmax). */
#if defined(__FAST_MATH__) || (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error "_fused_cpu.c needs IEEE arithmetic (NaN tests): build it without -ffast-math or -ffinite-math-only"
#endif
#ifdef HAVE_SHUFFLE
typedef int32_t i32_row16 __attribute__((vector_size(16 * sizeof(int32_t))));

/* lanes of a where `mask` (a comparison's: all bits set) is true, else of b (C has no vector ?:) */
static inline __attribute__((always_inline)) f32_row16 select_f32(i32_row16 mask, f32_row16 a,
                                                                  f32_row16 b) {
    i32_row16 ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const i32_row16 bits = (ia & mask) | (ib & ~mask);
    f32_row16 out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline __attribute__((always_inline)) f32_row16 exp_nonpositive_f32(f32_row16 x) {
    const i32_row16 keep = x >= -87.0f; /* (false for NaN: restored below) */
    f32_row16 y = select_f32(keep, x, (f32_row16){0} - 87.0f);
    y = select_f32(y > 0.0f, (f32_row16){0}, y);
    /* k = round(y log2 e), y log2 e <= 0: -(0.5 - y log2 e) truncated towards 0 (no rounding trick
       that reassociation could undo) */
    const f32_row16 k = __builtin_convertvector(-__builtin_convertvector(0.5f - y * 1.44269504f, i32_row16),
                                                f32_row16);
    const f32_row16 r = (y - k * 0.693145752f) - k * 1.42860677e-6f;
    f32_row16 p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i32_row16 bits = (__builtin_convertvector(k, i32_row16) + 127) << 23;
    f32_row16 two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    const f32_row16 e = p * two_k;
    return select_f32(keep, e, select_f32(x == x, (f32_row16){0}, x));
}

#define ROWS_MAX(a, b) max_f32((a), (b))
static inline __attribute__((always_inline)) f32_row16 max_f32(f32_row16 a, f32_row16 b) {
    return select_f32(a > b, a, b);
}

WIDE_CLONES static void attention_probabilities_range_f32(const float *q, const float *k,
                                                          int64_t first, int64_t last,
                                                          int64_t heads, float scale, float *p) {
    /* a (sequence, head)'s 16 rows at a time: their maxima and sums reduced together */
    for (int64_t item = first; item < last; ++item) {
        const int64_t at = (item / heads * 16 * heads + item % heads) * 8, width = heads * 8;
        f32_row16 kt[8], s[16];
        head_columns_16x8_f32(k + at, width, kt);
        for (int t = 0; t < 16; ++t) s[t] = head_row_16x8_f32(q + at + t * width, kt) * scale;
        const f32_row16 m = ROWS_PAIRWISE(f32_row16, s, ROWS_MAX);
        for (int t = 0; t < 16; ++t) s[t] = exp_nonpositive_f32(s[t] - m[t]);
        const f32_row16 inverse = 1.0f / row_totals_f32(s);
        for (int t = 0; t < 16; ++t) {
            const f32_row16 row = s[t] * inverse[t];
            memcpy(p + (item * 16 + t) * 16, &row, sizeof row);
        }
    }
}
#endif

int attention_probabilities_f32(const float *q, const float *k, int64_t sequences, int64_t tokens,
                                int64_t heads, int64_t size, double scale, float *p, int threads) {
#ifdef HAVE_SHUFFLE
    if (tokens != 16 || size != 8)
        return -1;
    _Pragma("omp parallel num_threads(team_size(sequences * heads * 16 * 16 * 8, threads))") {
        int64_t first, last;
        my_rows(sequences * heads, &first, &last);
        attention_probabilities_range_f32(q, k, first, last, heads, (float)scale, p);
    }
    return 0;
#else
    (void)q, (void)k, (void)sequences, (void)tokens, (void)heads, (void)size, (void)scale, (void)p,
        (void)threads;
    return -1;
#endif
}

/* The stacked LayerNorm over each row's d entries with each model's affine
   (experiments.runs.stacked_layer_norm): K models' rows x (K, M, d) row-major, gamma and beta
   (K, d). Per row, its mean and rstd = 1/sqrt(var + eps) (var the biased variance about the
   mean), xhat = (x - mean) * rstd:
     layer_norm           y = xhat * gamma_k + beta_k                      (mean, rstd kept)
     layer_norm_backward  g = gy * gamma_k, gx = rstd * (g - <g>/d - xhat * <g, xhat>/d),
                          dgamma_k = sum_rows gy * xhat, dbeta_k = sum_rows gy
   Row sums in LANES partial sums in T combined pairwise, their tails in double (as dot_); the
   column sums in T over blocks of LAYER_NORM_BLOCK rows (in `partial`, 2 * d entries per
   model), the blocks summed in double. Rows of d = 32 entries go 16 at a time
   (layer_norm_model32), their sums in the same pairwise tree in T and their square roots 16 at a
   time (a row at a time, the generic path waits on each row's horizontal additions and double
   square root: 1.7-1.9x slower in a quick measurement).
   One model per work item, its rows in order (the same for any thread count). */
#define LAYER_NORM_BLOCK 64
_Static_assert(LAYER_NORM_BLOCK % 16 == 0, "the rows of 32 entries go 16 at a time within a block");
#define DEFINE_LAYER_NORM(T, SUFFIX)                                                               \
    /* Rows of d = 32 entries (the harness vit's width), 16 rows at a time (the last group of 16 \
       padded with zero rows, never stored): each row's sums are pairwise, its 32 entries first  \
       in two vectors added, then their lanes by row_totals; mean = total / 32, exactly. The     \
       column sums run over the rows in order, in blocks of LAYER_NORM_BLOCK as for any d. */    \
    static inline __attribute__((always_inline)) void rows32_##SUFFIX(                            \
        const T *restrict x, int64_t n, SUFFIX##_row16 *lo, SUFFIX##_row16 *hi) {                 \
        for (int r = 0; r < 16; ++r)                                                               \
            if (r < n) {                                                                           \
                lo[r] = load16_##SUFFIX(x + 32 * r);                                               \
                hi[r] = load16_##SUFFIX(x + 32 * r + 16);                                          \
            } else                                                                                 \
                lo[r] = hi[r] = (SUFFIX##_row16){0};                                               \
    }                                                                                              \
                                                                                                   \
    WIDE_CLONES static void layer_norm_model32_##SUFFIX(                                           \
        const T *restrict x, const T *restrict gamma, const T *restrict beta, int64_t rows,       \
        T eps, T *restrict y, T *restrict mean, T *restrict rstd) {                                \
        const SUFFIX##_row16 gamma_lo = load16_##SUFFIX(gamma), gamma_hi = load16_##SUFFIX(gamma + 16); \
        const SUFFIX##_row16 beta_lo = load16_##SUFFIX(beta), beta_hi = load16_##SUFFIX(beta + 16); \
        for (int64_t i = 0; i < rows; i += 16) {                                                   \
            const int64_t n = rows - i < 16 ? rows - i : 16;                                       \
            SUFFIX##_row16 lo[16], hi[16], part[16], r;                                            \
            rows32_##SUFFIX(x + 32 * i, n, lo, hi);                                                \
            for (int k = 0; k < 16; ++k) part[k] = lo[k] + hi[k];                                  \
            const SUFFIX##_row16 m = row_totals_##SUFFIX(part) * (T)(1.0 / 32);                    \
            for (int k = 0; k < 16; ++k) {                                                         \
                const SUFFIX##_row16 c_lo = lo[k] - m[k], c_hi = hi[k] - m[k];                     \
                part[k] = c_lo * c_lo + c_hi * c_hi;                                               \
            }                                                                                      \
            const SUFFIX##_row16 var = row_totals_##SUFFIX(part) * (T)(1.0 / 32);                  \
            for (int l = 0; l < 16; ++l) r[l] = (T)(1 / sqrt((double)var[l] + eps));              \
            for (int k = 0; k < n; ++k) {                                                          \
                const SUFFIX##_row16 y_lo = (lo[k] - m[k]) * r[k] * gamma_lo + beta_lo;            \
                const SUFFIX##_row16 y_hi = (hi[k] - m[k]) * r[k] * gamma_hi + beta_hi;            \
                memcpy(y + 32 * (i + k), &y_lo, sizeof y_lo);                                      \
                memcpy(y + 32 * (i + k) + 16, &y_hi, sizeof y_hi);                                 \
            }                                                                                      \
            memcpy(mean + i, &m, n * sizeof(T));                                                   \
            memcpy(rstd + i, &r, n * sizeof(T));                                                   \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    WIDE_CLONES static void layer_norm_backward_model32_##SUFFIX(                                  \
        const T *restrict x, const T *restrict gy, const T *restrict gamma,                       \
        const T *restrict mean, const T *restrict rstd, int64_t rows, T *restrict gx,              \
        double *restrict dgamma, double *restrict dbeta) {                                         \
        const SUFFIX##_row16 gamma_lo = load16_##SUFFIX(gamma), gamma_hi = load16_##SUFFIX(gamma + 16); \
        SUFFIX##_row16 col_gamma_lo = {0}, col_gamma_hi = {0}, col_beta_lo = {0}, col_beta_hi = {0}; \
        for (int j = 0; j < 32; ++j) dgamma[j] = dbeta[j] = 0;                                     \
        for (int64_t i = 0; i < rows; i += 16) {                                                   \
            const int64_t n = rows - i < 16 ? rows - i : 16;                                       \
            SUFFIX##_row16 lo[16], hi[16], g_lo[16], g_hi[16], g_sum[16], g_dot[16];               \
            rows32_##SUFFIX(x + 32 * i, n, lo, hi);                                                \
            rows32_##SUFFIX(gy + 32 * i, n, g_lo, g_hi);                                           \
            for (int k = 0; k < 16; ++k) {                                                         \
                const T m = k < n ? mean[i + k] : 0, r = k < n ? rstd[i + k] : 0;                  \
                lo[k] = (lo[k] - m) * r; /* xhat */                                                \
                hi[k] = (hi[k] - m) * r;                                                           \
                col_gamma_lo += g_lo[k] * lo[k];                                                   \
                col_gamma_hi += g_hi[k] * hi[k];                                                   \
                col_beta_lo += g_lo[k];                                                            \
                col_beta_hi += g_hi[k];                                                            \
                g_lo[k] *= gamma_lo; /* g */                                                       \
                g_hi[k] *= gamma_hi;                                                               \
                g_sum[k] = g_lo[k] + g_hi[k];                                                      \
                g_dot[k] = g_lo[k] * lo[k] + g_hi[k] * hi[k];                                      \
            }                                                                                      \
            const SUFFIX##_row16 mean_g = row_totals_##SUFFIX(g_sum) * (T)(1.0 / 32);              \
            const SUFFIX##_row16 mean_gx = row_totals_##SUFFIX(g_dot) * (T)(1.0 / 32);             \
            for (int k = 0; k < n; ++k) {                                                          \
                const T r = rstd[i + k];                                                           \
                const SUFFIX##_row16 gx_lo = r * (g_lo[k] - mean_g[k] - lo[k] * mean_gx[k]);       \
                const SUFFIX##_row16 gx_hi = r * (g_hi[k] - mean_g[k] - hi[k] * mean_gx[k]);       \
                memcpy(gx + 32 * (i + k), &gx_lo, sizeof gx_lo);                                   \
                memcpy(gx + 32 * (i + k) + 16, &gx_hi, sizeof gx_hi);                              \
            }                                                                                      \
            if ((i + 16) % LAYER_NORM_BLOCK == 0 || i + 16 >= rows) { /* a block's column sums */  \
                for (int j = 0; j < 16; ++j) {                                                     \
                    dgamma[j] += col_gamma_lo[j];                                                  \
                    dgamma[j + 16] += col_gamma_hi[j];                                             \
                    dbeta[j] += col_beta_lo[j];                                                    \
                    dbeta[j + 16] += col_beta_hi[j];                                               \
                }                                                                                  \
                col_gamma_lo = col_gamma_hi = col_beta_lo = col_beta_hi = (SUFFIX##_row16){0};     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void layer_norm_model_##SUFFIX(                                           \
        const T *restrict x, const T *restrict gamma, const T *restrict beta, int64_t rows,       \
        int64_t d, T eps, T *restrict y, T *restrict mean, T *restrict rstd) {                     \
        const int64_t body = d / LANES * LANES;                                                    \
        for (int64_t i = 0; i < rows; ++i) {                                                       \
            const T *xi = x + i * d;                                                               \
            T *yi = y + i * d, lane[LANES] = {0};                                                  \
            for (int64_t j = 0; j < body; j += LANES)                                              \
                for (int l = 0; l < LANES; ++l) lane[l] += xi[j + l];                              \
            double sum = lanes_total_##SUFFIX(lane);                                               \
            for (int64_t j = body; j < d; ++j) sum += xi[j];                                       \
            const T m = (T)(sum / d);                                                              \
            for (int l = 0; l < LANES; ++l) lane[l] = 0;                                           \
            for (int64_t j = 0; j < body; j += LANES)                                              \
                for (int l = 0; l < LANES; ++l) lane[l] += (xi[j + l] - m) * (xi[j + l] - m);      \
            double squares = lanes_total_##SUFFIX(lane);                                           \
            for (int64_t j = body; j < d; ++j) squares += (double)(xi[j] - m) * (xi[j] - m);      \
            const T r = (T)(1 / sqrt(squares / d + eps));                                          \
            mean[i] = m;                                                                           \
            rstd[i] = r;                                                                           \
            for (int64_t j = 0; j < d; ++j) yi[j] = (xi[j] - m) * r * gamma[j] + beta[j];          \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void layer_norm_##SUFFIX(const T *x, const T *gamma, const T *beta, int64_t models,           \
                             int64_t rows, int64_t d, double eps, T *y, T *mean, T *rstd,         \
                             int threads) {                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(models * rows * d, threads))") \
        for (int64_t k = 0; k < models; ++k)                                                       \
            if (d == 32)                                                                           \
                layer_norm_model32_##SUFFIX(x + k * rows * d, gamma + k * d, beta + k * d, rows,  \
                                            (T)eps, y + k * rows * d, mean + k * rows,            \
                                            rstd + k * rows);                                      \
            else                                                                                   \
                layer_norm_model_##SUFFIX(x + k * rows * d, gamma + k * d, beta + k * d, rows, d, \
                                          (T)eps, y + k * rows * d, mean + k * rows,              \
                                          rstd + k * rows);                                        \
    }                                                                                              \
                                                                                                   \
    VECTOR_CLONES static void layer_norm_backward_model_##SUFFIX(                                  \
        const T *restrict x, const T *restrict gy, const T *restrict gamma,                       \
        const T *restrict mean, const T *restrict rstd, int64_t rows, int64_t d, T *restrict gx,  \
        double *restrict dgamma, double *restrict dbeta, T *restrict partial) {                    \
        T *part_gamma = partial, *part_beta = partial + d;                                        \
        const int64_t body = d / LANES * LANES;                                                    \
        for (int64_t j = 0; j < d; ++j) dgamma[j] = dbeta[j] = 0;                                  \
        for (int64_t start = 0; start < rows; start += LAYER_NORM_BLOCK) {                         \
            const int64_t stop = start + LAYER_NORM_BLOCK < rows ? start + LAYER_NORM_BLOCK : rows; \
            for (int64_t j = 0; j < d; ++j) part_gamma[j] = part_beta[j] = 0;                      \
            for (int64_t i = start; i < stop; ++i) {                                               \
                const T *xi = x + i * d, *gi = gy + i * d;                                         \
                T *gxi = gx + i * d, lane_g[LANES] = {0}, lane_gx[LANES] = {0};                    \
                const T m = mean[i], r = rstd[i];                                                  \
                for (int64_t j = 0; j < body; j += LANES)                                          \
                    for (int l = 0; l < LANES; ++l) {                                              \
                        const T xhat = (xi[j + l] - m) * r, g = gi[j + l] * gamma[j + l];          \
                        lane_g[l] += g;                                                            \
                        lane_gx[l] += g * xhat;                                                    \
                        part_gamma[j + l] += gi[j + l] * xhat;                                     \
                        part_beta[j + l] += gi[j + l];                                             \
                    }                                                                              \
                double g_sum = lanes_total_##SUFFIX(lane_g), g_dot = lanes_total_##SUFFIX(lane_gx); \
                for (int64_t j = body; j < d; ++j) {                                               \
                    const T xhat = (xi[j] - m) * r, g = gi[j] * gamma[j];                          \
                    g_sum += g;                                                                    \
                    g_dot += (double)g * xhat;                                                     \
                    part_gamma[j] += gi[j] * xhat;                                                 \
                    part_beta[j] += gi[j];                                                         \
                }                                                                                  \
                const T mean_g = (T)(g_sum / d), mean_gx = (T)(g_dot / d);                         \
                for (int64_t j = 0; j < d; ++j)                                                    \
                    gxi[j] = r * (gi[j] * gamma[j] - mean_g - (xi[j] - m) * r * mean_gx);          \
            }                                                                                      \
            for (int64_t j = 0; j < d; ++j) {                                                      \
                dgamma[j] += part_gamma[j];                                                        \
                dbeta[j] += part_beta[j];                                                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    void layer_norm_backward_##SUFFIX(const T *x, const T *gy, const T *gamma, const T *mean,     \
                                      const T *rstd, int64_t models, int64_t rows, int64_t d,     \
                                      T *gx, double *dgamma, double *dbeta, T *partial,           \
                                      int threads) {                                               \
        _Pragma("omp parallel for schedule(static) num_threads(team_size(models * rows * d, threads))") \
        for (int64_t k = 0; k < models; ++k)                                                       \
            if (d == 32)                                                                           \
                layer_norm_backward_model32_##SUFFIX(x + k * rows * d, gy + k * rows * d,          \
                                                     gamma + k * d, mean + k * rows,              \
                                                     rstd + k * rows, rows, gx + k * rows * d,    \
                                                     dgamma + k * d, dbeta + k * d);              \
            else                                                                                   \
                layer_norm_backward_model_##SUFFIX(x + k * rows * d, gy + k * rows * d,            \
                                                   gamma + k * d, mean + k * rows,                \
                                                   rstd + k * rows, rows, d, gx + k * rows * d,   \
                                                   dgamma + k * d, dbeta + k * d,                 \
                                                   partial + k * 2 * d);                           \
    }

DEFINE_LAYER_NORM(float, f32)
DEFINE_LAYER_NORM(double, f64)

/* tanh of float32 values (the stacked engine's activation, experiments.runs.activations), each
   computed in double and rounded once to float:
     a = min(|x|, 20)          (tanh rounds to 1 in float from |x| = 9.0109 on)
     -2a = k ln2 + r           k = round(-2a / ln2), |r| <= ln2/2
     expm1(r) = r + r^2 (1/2! + r/3! + ... + r^10/12!)   (the next Taylor term: < 6e-16 relative)
     u = expm1(-2a) = 2^k expm1(r) + (2^k - 1)
     tanh(x) = sign(x) (-u)/(2 + u)
   with no cancellation (-u >= 0, 2 + u >= 1, and 2^k expm1(r) is at most half of 1 - 2^k in size
   for k < 0): the double value is within 1e-15 of tanh(x) (relative), and the float result is the
   correctly rounded tanh on every float32 input (benchmarks/tanh_accuracy.py checks them all).
   NaN stays NaN, +-inf gives +-1, -0 stays -0. Elementwise: the same result for any thread
   count. The double operations are the ones written, with no contraction into fused
   multiply-adds (EXACT_DOUBLES), so every vector clone computes the same values. torch's float32
   tanh (MKL's vector math in torch's CPU wheels) took 2.36 ns an element on one core of an AMD
   processor in the accuracy benchmark's run, this pass 0.98 with AVX-512's 8-wide double vectors;
   on an Intel processor MKL's own code is the faster (experiments/runs/activations.py). */
WIDE_CLONES EXACT_DOUBLES static void tanh_range_f32(const float *restrict x, float *restrict y,
                                                      int64_t first, int64_t last) {
    EXACT_DOUBLES_PRAGMAS
    for (int64_t i = first; i < last; ++i) {
        const double d = x[i];
        double a = fabs(d);
        a = a < 20.0 ? a : 20.0; /* (NaN: 20, restored below) */
        const double v = -2.0 * a;
        const double shifted = v * 1.4426950408889634 + 0x1.8p52; /* k in its low mantissa bits */
        const double k = shifted - 0x1.8p52;
        const double r = v - k * 0.6931471805599453;
        double p = 1.0 / 479001600.0;
        p = p * r + 1.0 / 39916800.0;
        p = p * r + 1.0 / 3628800.0;
        p = p * r + 1.0 / 362880.0;
        p = p * r + 1.0 / 40320.0;
        p = p * r + 1.0 / 5040.0;
        p = p * r + 1.0 / 720.0;
        p = p * r + 1.0 / 120.0;
        p = p * r + 1.0 / 24.0;
        p = p * r + 1.0 / 6.0;
        p = p * r + 0.5;
        const double expm1_r = p * r * r + r;
        uint64_t bits; /* 2^k: k + 1023 in the exponent field (k >= -58) */
        memcpy(&bits, &shifted, sizeof bits);
        bits = (bits + 1023) << 52;
        double two_k;
        memcpy(&two_k, &bits, sizeof two_k);
        const double u = two_k * expm1_r + (two_k - 1.0);
        y[i] = (float)(d == d ? copysign(-u / (2.0 + u), d) : d);
    }
}

void tanh_f32(const float *x, float *y, int64_t n, int threads) {
    _Pragma("omp parallel num_threads(team_size(n, threads))") {
        int64_t first, last;
        my_rows(n, &first, &last);
        tanh_range_f32(x, y, first, last);
    }
}

int affdiv_fused_abi(void) { return AFFDIV_FUSED_ABI; }

static struct PyModuleDef fused_cpu_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fused_cpu",
    .m_doc = "Fused CPU row passes; loaded with ctypes by affdiv.layers._fused.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__fused_cpu(void) { return PyModule_Create(&fused_cpu_module); }
