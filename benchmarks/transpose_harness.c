/* The fused CPU passes that change layout, timed alone against the same-layout passes they
   replace (docs/FINDINGS.md quotes its output): 16 MB float32 tensors (N=64, C=64, 32x32),
   2 OpenMP threads, best and mean of 20 calls each, data hot in cache between calls.

   Build and run from the repository root (it compiles layers/_fused_cpu.c in):
     gcc -O3 -fwrapv -fopenmp $(python3-config --includes) benchmarks/transpose_harness.c \
         -o transpose_harness $(python3-config --embed --ldflags) -lm \
         -Wl,-rpath,$(python3-config --prefix)/lib && ./transpose_harness */

#include "../layers/_fused_cpu.c"

#include <stdio.h>

int main(void) {
    const int64_t batch = 64, channels = 64, positions = 1024;
    const size_t n = (size_t)(batch * channels * positions), scales = (size_t)(batch * positions);
    float *x = aligned_alloc(64, n * 4), *z = aligned_alloc(64, n * 4), *out = aligned_alloc(64, n * 4);
    float *d = aligned_alloc(64, n * 4), *r = aligned_alloc(64, scales * 4), *e = aligned_alloc(64, scales * 4);
    for (size_t i = 0; i < n; ++i) x[i] = (float)(i % 7), z[i] = (float)(i % 5), d[i] = 1.0f, out[i] = 0.0f;
    for (size_t i = 0; i < scales; ++i) r[i] = 0.5f;
    const char *names[] = {"x to channels_last (plain transpose)", "gy = r*g and e, to channels_last",
                           "dx = d + x*r, from channels_last", "same-layout gy = r*g and e (NCHW)",
                           "same-layout dx += x*r (NCHW)"};
    for (int pass = 0; pass < 5; ++pass) {
        double best = 1e9, total = 0.0;
        for (int call = 0; call < 20; ++call) {
            const double start = omp_get_wtime();
            switch (pass) {
                case 0: scale_and_dot_to_cl_f32(x, NULL, NULL, batch, channels, positions, 1, out, NULL, 2); break;
                case 1: scale_and_dot_to_cl_f32(x, z, r, batch, channels, positions, 1, out, e, 2); break;
                case 2: group_update_from_cl_f32(d, x, r, batch, channels, positions, 1, out, 2); break;
                case 3: scale_and_dot_f32(x, z, r, batch, channels, positions, 1, out, e, 2); break;
                default: group_update_f32(out, x, r, batch, channels, positions, 1, 2);
            }
            const double elapsed = omp_get_wtime() - start;
            best = elapsed < best ? elapsed : best;
            total += elapsed;
        }
        printf("%-40s best %.2f ms, mean %.2f ms\n", names[pass], 1e3 * best, 1e3 * total / 20);
    }
    return 0;
}
