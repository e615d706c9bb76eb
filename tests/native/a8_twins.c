/* Runs the int8 kernels of two builds of cpu_q4a8_gemm.c on the same inputs, for a test that
 * cannot load them into its own process: an aarch64 build run under qemu-user on an x86 machine
 * (tests/test_arm_kernels.py). Both libraries are loaded side by side (RTLD_LOCAL: each keeps its
 * own symbols) and every case goes through both.
 *
 *   a8_twins LIB_A LIB_B CASES
 *
 * First prints "build I ISA DPBUSD" for each library (its tandem_q4a8_isa and _dpbusd), then
 * "tile N" and "block FORMAT BYTES" for FORMAT 0..15 from LIB_A (tiles are laid out by the
 * caller, so the caller checks it laid them out for this width), then runs each line of CASES:
 *
 *   KIND FORMAT ROWS IN OUT THREADS WEIGHTS BIAS X Y_A Y_B
 *
 * KIND gemv (tandem_a8_gemv) or gemm (tandem_q4a8_gemm); WEIGHTS, BIAS ("-" for none) and X raw
 * files (uint8 tiles, float32 [tiles * TILE], float32 [ROWS, IN]); Y_A, Y_B written as float32
 * [ROWS, OUT]. Exits non-zero, saying why, when a file or call fails. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*matmul_fn)(int, const float *, int64_t, const uint8_t *, const float *, float *,
                         int64_t, int64_t, int64_t, int);

static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *data = malloc(n > 0 ? (size_t)n : 1);
    if (data && fread(data, 1, (size_t)n, f) != (size_t)n) {
        free(data);
        data = NULL;
    }
    fclose(f);
    if (size) *size = (size_t)n;
    return data;
}

static int write_file(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    const size_t written = fwrite(data, 1, size, f);
    return fclose(f) == 0 && written == size ? 0 : -1;
}

static void *symbol(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "missing symbol %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s LIB_A LIB_B CASES\n", argv[0]);
        return 2;
    }
    void *libs[2];
    for (int i = 0; i < 2; i++) {
        libs[i] = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
        if (!libs[i]) {
            fprintf(stderr, "dlopen %s: %s\n", argv[1 + i], dlerror());
            return 2;
        }
    }
    for (int i = 0; i < 2; i++)
        printf("build %d %s %d\n", i, ((const char *(*)(void))symbol(libs[i], "tandem_q4a8_isa"))(),
               ((int (*)(void))symbol(libs[i], "tandem_q4a8_dpbusd"))());
    printf("tile %d\n", ((int (*)(void))symbol(libs[0], "tandem_q4a8_tile"))());
    int64_t (*block_bytes)(int) = (int64_t(*)(int))symbol(libs[0], "tandem_qgemv_block_bytes");
    for (int fmt = 0; fmt < 16; fmt++) printf("block %d %lld\n", fmt, (long long)block_bytes(fmt));
    FILE *cases = fopen(argv[3], "r");
    if (!cases) {
        fprintf(stderr, "cannot open %s\n", argv[3]);
        return 2;
    }
    char kind[8], wpath[4096], bpath[4096], xpath[4096], ypaths[2][4096];
    int format, threads;
    long long rows, in, out;
    int n = 0;
    while (fscanf(cases, "%7s %d %lld %lld %lld %d %4095s %4095s %4095s %4095s %4095s", kind,
                  &format, &rows, &in, &out, &threads, wpath, bpath, xpath, ypaths[0],
                  ypaths[1]) == 11) {
        const char *name = strcmp(kind, "gemm") == 0 ? "tandem_q4a8_gemm" : "tandem_a8_gemv";
        size_t xsize = 0;
        uint8_t *w = read_file(wpath, NULL);
        float *bias = strcmp(bpath, "-") == 0 ? NULL : read_file(bpath, NULL);
        float *x = read_file(xpath, &xsize);
        float *y = malloc((size_t)(rows * out) * sizeof(float) + 1);
        if (!w || !x || !y || (strcmp(bpath, "-") != 0 && !bias) ||
            xsize != (size_t)(rows * in) * sizeof(float)) {
            fprintf(stderr, "case %d: bad input files\n", n);
            return 2;
        }
        for (int i = 0; i < 2; i++) {
            memset(y, 0xFF, (size_t)(rows * out) * sizeof(float)); /* NaN: an output not written */
            const int rc = ((matmul_fn)symbol(libs[i], name))(format, x, in, w, bias, y, rows, in,
                                                             out, threads);
            if (rc != 0 || write_file(ypaths[i], y, (size_t)(rows * out) * sizeof(float)) != 0) {
                fprintf(stderr, "case %d: %s in %s returned %d\n", n, name, argv[1 + i], rc);
                return 1;
            }
        }
        free(w), free(bias), free(x), free(y);
        n++;
    }
    fclose(cases);
    printf("cases %d\n", n);
    return 0;
}
