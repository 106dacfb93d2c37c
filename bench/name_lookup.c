// Name look-ups at scale (issue: linear scans per name were quadratic): for n
// names, the time to build and to resolve every name through the hashed name
// index, a parameter table, a safetensors file (write, open, find all) and a
// two-shard index (open, find all). One JSON line per (case, n).
//   build/bench/name_lookup [--max N]      (default 1000000)
// The file cases stop at 10^5: a header of 10^6 Mixtral-length names is about
// 118 MB, over the 100 MB header limit the reader enforces.
#include "moe/error.h"
#include "moe/name_map.h"
#include "moe/params.h"
#include "moe/safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { NAME_LEN = 64 };

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char *name_at(const void *names, uint32_t i) {
    return ((const char(*)[NAME_LEN])names)[i];
}

static void line(const char *bench, size_t n, double build_ms, double find_ms) {
    printf("{\"bench\": \"name_lookup\", \"case\": \"%s\", \"names\": %zu, \"build_ms\": %.2f, "
           "\"find_all_ms\": %.2f, \"ns_per_find\": %.1f}\n",
           bench, n, build_ms, find_ms, find_ms * 1e6 / (double)n);
    fflush(stdout);
}

static int bench_map(char (*names)[NAME_LEN], size_t n) {
    moe_name_map m = {0};
    double t0 = now_ms();
    for (size_t i = 0; i < n; i++) {
        long dup;
        MOE_TRY(moe_name_map_add(&m, names, name_at, i, &dup));
    }
    double t1 = now_ms();
    long miss = 0;
    for (size_t i = 0; i < n; i++)
        miss += moe_name_map_find(&m, names, name_at, names[i]) != (long)i;
    double t2 = now_ms();
    moe_name_map_free(&m);
    if (miss) return moe_fail(MOE_EINVAL, "%ld names not found", miss);
    line("name_map", n, t1 - t0, t2 - t1);
    return 0;
}

static int bench_params(char (*names)[NAME_LEN], size_t n) {
    moe_param_table t;
    moe_param_table_init(&t);
    int64_t shape[1] = {1};
    int rc = 0;
    double t0 = now_ms();
    for (size_t i = 0; i < n && rc == 0; i++)
        rc = moe_param_table_add(&t, NULL, names[i], 1, shape);
    double t1 = now_ms();
    long miss = 0;
    for (size_t i = 0; i < n && rc == 0; i++)
        miss += moe_param_table_find(&t, names[i]) != &t.views[i];
    double t2 = now_ms();
    moe_param_table_free(&t);
    if (rc == 0 && miss) rc = moe_fail(MOE_EINVAL, "%ld views not found", miss);
    if (rc == 0) line("param_table", n, t1 - t0, t2 - t1);
    return rc;
}

static int write_file(const char *path, char (*names)[NAME_LEN], size_t from, size_t n,
                      const float *v) {
    moe_st_entry *e = calloc(n, sizeof *e);
    if (!e) return moe_fail(MOE_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        e[i] = (moe_st_entry){names[from + i], MOE_ST_F32, 1, {1}, &v[from + i]};
    int rc = moe_st_write(path, e, (int)n, NULL);
    free(e);
    return rc;
}

static int bench_file(const char *dir, char (*names)[NAME_LEN], size_t n, const float *v) {
    char p[1024];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    double t0 = now_ms();
    MOE_TRY(write_file(p, names, 0, n, v));
    double t1 = now_ms();
    moe_st_file *f;
    MOE_TRY(moe_st_open(p, &f));
    double t2 = now_ms();
    long miss = 0;
    for (size_t i = 0; i < n; i++)
        miss += moe_st_find(f, names[i]) != &f->tensors[i];
    double t3 = now_ms();
    moe_st_close(f);
    unlink(p);
    if (miss) return moe_fail(MOE_EINVAL, "%ld tensors not found", miss);
    line("safetensors_write", n, t1 - t0, 0);
    line("safetensors_open_find", n, t2 - t1, t3 - t2);
    return 0;
}

static int bench_shards(const char *dir, char (*names)[NAME_LEN], size_t n, const float *v) {
    char p[1024];
    const size_t half = n / 2;
    snprintf(p, sizeof p, "%s/s1.safetensors", dir);
    MOE_TRY(write_file(p, names, 0, half, v));
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    MOE_TRY(write_file(p, names, half, n - half, v));
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *ix = fopen(p, "w");
    if (!ix) return moe_fail(MOE_EIO, "%s: cannot create", p);
    fprintf(ix, "{\"weight_map\": {");
    for (size_t i = 0; i < n; i++)
        fprintf(ix, "%s\"%s\": \"s%d.safetensors\"", i ? ", " : "", names[i], i < half ? 1 : 2);
    fprintf(ix, "}}\n");
    fclose(ix);
    moe_st_set *s;
    double t0 = now_ms();
    MOE_TRY(moe_st_set_open(dir, &s));
    double t1 = now_ms();
    long miss = 0;
    for (size_t i = 0; i < n; i++)
        miss += moe_st_set_find(s, names[i], NULL) == NULL;
    double t2 = now_ms();
    moe_st_set_close(s);
    unlink(p);
    snprintf(p, sizeof p, "%s/s1.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/s2.safetensors", dir);
    unlink(p);
    if (miss) return moe_fail(MOE_EINVAL, "%ld tensors not found", miss);
    line("sharded_index_open_find", n, t1 - t0, t2 - t1);
    return 0;
}

int main(int argc, char **argv) {
    size_t max = 1000000;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--max") && i + 1 < argc) max = strtoull(argv[++i], NULL, 10);
    char dir[] = "/tmp/moe-bench-names-XXXXXX";
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    char(*names)[NAME_LEN] = malloc(max * sizeof *names);
    // "model.layers.L.block_sparse_moe.experts.E.wK.weight": at most 63 characters
    float *v = malloc(max * sizeof *v);
    if (!names || !v) return fputs("out of memory\n", stderr), 1;
    for (size_t i = 0; i < max; i++) {
        snprintf(names[i], NAME_LEN, "model.layers.%u.block_sparse_moe.experts.%u.w%u.weight",
                 (unsigned)(i / 3000 % 100000), (unsigned)(i / 3 % 1000), (unsigned)(i % 3 + 1));
        v[i] = (float)i;
    }
    int rc = 0;
    for (size_t n = 10000; n <= max && rc == 0; n *= 10) {
        rc = bench_map(names, n);
        if (rc == 0) rc = bench_params(names, n);
        if (rc == 0 && n <= 100000) rc = bench_file(dir, names, n, v);
        if (rc == 0 && n <= 100000) rc = bench_shards(dir, names, n, v);
    }
    rmdir(dir);
    free(names);
    free(v);
    if (rc < 0) fprintf(stderr, "name_lookup: %s\n", moe_last_error());
    return rc < 0;
}
