/* The passes of _fused_cpu.c (see there) that the C++ autograd nodes of _autograd_nodes.cpp
   call: the dense layers' row passes and the PatchNorm convolution's. _fused_cpu.c includes this file, so the compiler checks its
   definitions against these prototypes, and the nodes take their function types from here.
   (_fused.py declares the same signatures for ctypes.) */
#ifndef AFFDIV_FUSED_CPU_H
#define AFFDIV_FUSED_CPU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AFFDIV_DECLARE_ROWOPS(T, SUFFIX)                                                           \
    int64_t scale_outputs_##SUFFIX(T *z, const T *x, int64_t rows, int64_t in_cols,               \
                                   int64_t out_cols, int mode, double k, double eps, double small, \
                                   double big, const T *pre, const T *post, T *scale, int threads); \
    int scale_grad_##SUFFIX(const T *g, const T *scale, int64_t rows, int64_t cols, T *gy,         \
                            T *colsum, int sum_input, const T *v, T *dot, int threads);            \
    void minus_radial_##SUFFIX(T *u, const T *x, int64_t rows, int64_t cols, const T *s,          \
                               double m, double limit, const T *c, int threads);

#define AFFDIV_DECLARE_CONVOPS(T, SUFFIX, LAYOUT)                                                  \
    int64_t group_squares##LAYOUT##_##SUFFIX(const T *x, int64_t batch, int64_t channels,         \
                                             int64_t size, int64_t groups, double big, T *out,     \
                                             int threads);                                         \
    void scale_and_dot##LAYOUT##_##SUFFIX(const T *gz, const T *z, const T *r, int64_t batch,      \
                                          int64_t channels, int64_t size, int64_t groups, T *gy,   \
                                          T *e, int threads);                                      \
    void group_update##LAYOUT##_##SUFFIX(T *dst, const T *src, const T *r, int64_t batch,          \
                                         int64_t channels, int64_t size, int64_t groups,           \
                                         int threads);

#define AFFDIV_DECLARE_CONV_TRANSPOSING_OPS(T, SUFFIX)                                             \
    void box_##SUFFIX(const T *in, T *out, int64_t planes, const int64_t *geometry, int transpose, \
                      int threads);                                                                \
    void scale_and_dot_to_cl_##SUFFIX(const T *gz, const T *z, const T *r, int64_t batch,          \
                                      int64_t channels, int64_t positions, int64_t groups, T *gy,  \
                                      T *e, int threads);                                          \
    void group_update_from_cl_##SUFFIX(const T *d, const T *src, const T *r, int64_t batch,        \
                                       int64_t channels, int64_t positions, int64_t groups,        \
                                       T *out, int threads);

AFFDIV_DECLARE_ROWOPS(float, f32)
AFFDIV_DECLARE_ROWOPS(double, f64)
AFFDIV_DECLARE_CONVOPS(float, f32, )
AFFDIV_DECLARE_CONVOPS(double, f64, )
AFFDIV_DECLARE_CONVOPS(float, f32, _cl)
AFFDIV_DECLARE_CONVOPS(double, f64, _cl)
AFFDIV_DECLARE_CONV_TRANSPOSING_OPS(float, f32)
AFFDIV_DECLARE_CONV_TRANSPOSING_OPS(double, f64)

/* The version of the library's interface: every pass's signature and meaning, those above and
   those only _fused.py declares. _fused.py loads, and the C++ nodes bind, a library only of the
   version they were written for (a stale build is refused, never called with other arguments).
   Raise it with any such change, here and in _fused.py's FUSED_ABI. */
#define AFFDIV_FUSED_ABI 5
int affdiv_fused_abi(void);

#undef AFFDIV_DECLARE_ROWOPS
#undef AFFDIV_DECLARE_CONVOPS
#undef AFFDIV_DECLARE_CONV_TRANSPOSING_OPS

#ifdef __cplusplus
}
#endif

#endif
