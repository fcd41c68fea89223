/* The dense row passes of _fused_cpu.c (see there), as the C++ autograd nodes of
   _dense_autograd.cpp call them. _fused_cpu.c includes this file, so the compiler checks its
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

AFFDIV_DECLARE_ROWOPS(float, f32)
AFFDIV_DECLARE_ROWOPS(double, f64)

#undef AFFDIV_DECLARE_ROWOPS

#ifdef __cplusplus
}
#endif

#endif
