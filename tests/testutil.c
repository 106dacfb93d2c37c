// Test helpers (see testutil.h).
#include "testutil.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/safetensors.h"
#include "moe/train.h"

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define TU_GUARD 64
static const uint32_t tu_sentinel = 0x7fbadbadu; // a NaN pattern no op writes

int tu_checks, tu_failures;

void tu_seed(tu_rng *r, uint64_t seed) {
    r->s = seed * 0x9E3779B97F4A7C15ull + 1;
}

static uint64_t tu_next(tu_rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

float tu_uniform(tu_rng *r) {
    return (float)((tu_next(r) >> 40) * (1.0 / 16777216.0));
}

float tu_normal(tu_rng *r) {
    double u1 = ((tu_next(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (tu_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void tu_fill_normal(tu_rng *r, float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++)
        x[i] = scale * tu_normal(r);
}

float *tu_guarded_alloc(size_t n) {
    uint32_t *b = malloc((n + 2 * TU_GUARD) * sizeof(float));
    if (!b) return NULL;
    for (size_t i = 0; i < TU_GUARD; i++)
        b[i] = b[TU_GUARD + n + i] = tu_sentinel;
    memset(b + TU_GUARD, 0, n * sizeof(float));
    return (float *)(b + TU_GUARD);
}

int tu_guards_intact(const float *p, size_t n) {
    const uint32_t *b = (const uint32_t *)p - TU_GUARD;
    for (size_t i = 0; i < TU_GUARD; i++)
        if (b[i] != tu_sentinel || b[TU_GUARD + n + i] != tu_sentinel) return 0;
    return 1;
}

void tu_guarded_free(float *p, size_t n) {
    (void)n;
    if (p) free((uint32_t *)p - TU_GUARD);
}

// Folders from tu_tmpdir, each removed with all it holds when the process
// that made it exits: a forked test case removes its own, not its parent's.
// Without this every run of the suite left some GB of checkpoints behind.
static struct {
    char path[512];
    pid_t pid;
} * tu_made;
static int tu_n_made;

// Removes path and, for a folder, all it holds (links are not followed);
// what cannot go stays behind.
static void tu_remove_tree(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return;
    DIR *dp = S_ISDIR(sb.st_mode) ? opendir(path) : NULL;
    struct dirent *de;
    char p[1024];
    while (dp && (de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
            snprintf(p, sizeof p, "%s/%s", path, de->d_name) < (int)sizeof p)
            tu_remove_tree(p);
    if (dp) closedir(dp);
    remove(path);
}

static void tu_remove_made(void) {
    const char *keep = getenv("MOE_KEEP_TMP");
    if (keep && *keep && strcmp(keep, "0")) return;
    for (int i = 0; i < tu_n_made; i++)
        if (tu_made[i].pid == getpid()) tu_remove_tree(tu_made[i].path);
}

const char *tu_tmpdir(void) {
    static char path[512];
    const char *base = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/moe-test-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(path)) return NULL;
    void *grown = realloc(tu_made, sizeof *tu_made * (size_t)(tu_n_made + 1));
    if (!grown) return path; // the folder stays behind; the test still runs
    if (!tu_made && atexit(tu_remove_made)) abort();
    tu_made = grown;
    snprintf(tu_made[tu_n_made].path, sizeof tu_made[0].path, "%s", path);
    tu_made[tu_n_made++].pid = getpid();
    return path;
}

char tu_dir[512];

void tu_dir_setup(void) {
    const char *d = tu_tmpdir();
    ck_assert_ptr_nonnull(d);
    snprintf(tu_dir, sizeof tu_dir, "%s", d);
}

void tu_dir_teardown(void) {
    DIR *dp = opendir(tu_dir);
    if (!dp) return;
    struct dirent *de;
    char p[1024];
    while ((de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", tu_dir, de->d_name);
            unlink(p);
        }
    closedir(dp);
    rmdir(tu_dir);
}

const char *tu_in_dir(const char *name) {
    static char buf[8][1024];
    static int i;
    i = (i + 1) % 8;
    snprintf(buf[i], sizeof buf[i], "%s/%s", tu_dir, name);
    return buf[i];
}

int tu_count_entries(const char *dir) {
    DIR *dp = opendir(dir);
    if (!dp) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(dp);
    return n;
}

int tu_run(Suite *s) {
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}

int tu_run_gpu(Suite *s, const char *what) {
#ifdef MOE_HAVE_CUDA
    char why[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0) {
        printf("SKIP: no CUDA device (%s); %s is compiled but not run\n", why, what);
        srunner_free(srunner_create(s));
        return 77;
    }
    // cudaGetDeviceCount initialised the driver in this process, which a forked
    // test could not use: run in-process even outside ctest.
    setenv("CK_FORK", "no", 1);
    int rc = tu_run(s);
    moe_cuda_shutdown();
    return rc;
#else
    printf("SKIP: built without CUDA (configure with -DMOE_CUDA=ON and a CUDA toolkit); %s is not "
           "compiled\n",
           what);
    srunner_free(srunner_create(s));
    return 77;
#endif
}

int tu_run_moe(const char *dir, const char *args) {
    const char *bin = getenv("MOE_BIN");
    ck_assert_msg(bin != NULL, "MOE_BIN is not set (run under ctest)");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s/out.txt' 2>'%s/err.txt'", bin, args, dir, dir);
    int st = system(cmd);
    ck_assert(WIFEXITED(st));
    return WEXITSTATUS(st);
}

int tu_run_moe_in(const char *dir, const char *fmt, ...) {
    const char *bin = getenv("MOE_BIN");
    ck_assert_msg(bin != NULL, "MOE_BIN is not set (run under ctest)");
    char args[4096], cmd[6000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s >out.txt 2>err.txt", dir, bin, args);
    int st = system(cmd);
    ck_assert(WIFEXITED(st));
    return WEXITSTATUS(st);
}

const char *tu_file_text(const char *dir, const char *name) {
    static char buf[65536];
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "r");
    if (!f) return "";
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

moe_config tu_small_config(void) {
    moe_config c;
    moe_config_default(&c);
    c.model.d_model = 32;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.d_ff = 48;
    c.model.seq_len = 32;
    c.moe.num_experts[0] = 4;
    c.train.batch_size = 4;
    c.train.steps = 60;
    c.train.warmup_steps = 5;
    c.train.eval_every = 0;
    c.train.lr = 1e-2;
    return c;
}

moe_config tu_ckpt_config(void) {
    moe_config c = tu_small_config();
    c.model.seq_len = 16;
    c.train.batch_size = 2;
    return c;
}

void tu_save_checkpoint(const moe_config *c, const char *dir) {
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    moe_train_state st = {0};
    ck_assert_msg(moe_ckpt_save(dir, &m, &opt, &st, NULL) == 0, "%s", moe_last_error());
    moe_adamw_free(&opt);
    moe_model_free(&m);
}

void tu_refresh_manifest(const char *dir) {
    char p[1024], f[1200];
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    json_error_t err;
    json_t *doc = json_load_file(p, 0, &err);
    ck_assert_msg(doc, "%s: %s", p, err.text);
    json_t *files = json_object_get(doc, "files"), *v;
    const char *name;
    void *tmp;
    json_object_foreach_safe(files, tmp, name, v) {
        struct stat sb;
        snprintf(f, sizeof f, "%s/%s", dir, name);
        if (lstat(f, &sb) == 0)
            json_object_set_new(files, name, json_integer((json_int_t)sb.st_size));
        else
            json_object_del(files, name);
    }
    ck_assert_int_eq(json_dump_file(doc, p, JSON_INDENT(1)), 0);
    json_decref(doc);
}

void tu_assert_same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    ck_assert_msg(fa && fb, "cannot open %s or %s", a, b);
    long at = 0;
    for (int ca, cb;; at++) {
        ca = fgetc(fa), cb = fgetc(fb);
        ck_assert_msg(ca == cb, "%s and %s differ at byte %ld", a, b, at);
        if (ca == EOF) break;
    }
    fclose(fa);
    fclose(fb);
}

void tu_assert_same_checkpoint(const char *a, const char *b) {
    char pa[1200], pb[1200];
    const char *files[] = {"model.safetensors", "optimizer.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(pa, sizeof pa, "%s/%s", a, files[i]);
        snprintf(pb, sizeof pb, "%s/%s", b, files[i]);
        tu_assert_same_file(pa, pb);
    }
    snprintf(pa, sizeof pa, "%s/trainer_state.json", a);
    snprintf(pb, sizeof pb, "%s/trainer_state.json", b);
    json_t *ja = json_load_file(pa, 0, NULL), *jb = json_load_file(pb, 0, NULL);
    ck_assert_msg(ja && jb, "cannot read %s or %s", pa, pb);
    ck_assert(json_number_value(json_object_get(jb, "train_seconds")) > 0);
    for (int i = 0; i < 2; i++) { // timings: the MFU sum is one too
        const char *k = i ? "mfu_sum" : "train_seconds";
        json_object_del(ja, k);
        json_object_del(jb, k);
    }
    ck_assert_msg(json_equal(ja, jb), "%s and %s differ", pa, pb);
    json_decref(ja);
    json_decref(jb);
}

static size_t st_set_tensors(const moe_st_set *s) {
    return s->n_refs ? s->n_refs : (size_t)s->files[0]->n_tensors;
}

int tu_st_dirs_differ(const char *a, const char *b, char *why, size_t cap) {
    moe_st_set *sa = NULL, *sb = NULL;
    int differ = 0;
    if (moe_st_set_open(a, &sa) || moe_st_set_open(b, &sb)) {
        snprintf(why, cap, "%s", moe_last_error());
        moe_st_set_close(sa);
        return 1;
    }
    if (st_set_tensors(sa) != st_set_tensors(sb)) {
        snprintf(why, cap, "%zu tensors in %s, %zu in %s", st_set_tensors(sa), a,
                 st_set_tensors(sb), b);
        differ = 1;
    }
    for (int k = 0; k < sa->n_files && !differ; k++)
        for (int i = 0; i < sa->files[k]->n_tensors && !differ; i++) {
            moe_st_file *fa = sa->files[k], *fb = NULL;
            const moe_st_tensor *ta = &fa->tensors[i], *tb = moe_st_set_find(sb, ta->name, &fb);
            if (!tb || tb->nbytes != ta->nbytes) {
                snprintf(why, cap, "tensor %s: missing or of another size in %s", ta->name, b);
                differ = 1;
                break;
            }
            char *x = malloc(ta->nbytes), *y = malloc(tb->nbytes);
            if (!x || !y) {
                snprintf(why, cap, "out of memory");
                differ = 1;
            } else if (moe_st_read(fa, ta, x, ta->nbytes) || moe_st_read(fb, tb, y, tb->nbytes)) {
                snprintf(why, cap, "%s", moe_last_error());
                differ = 1;
            } else if (memcmp(x, y, ta->nbytes)) {
                snprintf(why, cap, "%s differs between %s and %s", ta->name, a, b);
                differ = 1;
            }
            free(x);
            free(y);
        }
    moe_st_set_close(sa);
    moe_st_set_close(sb);
    return differ;
}

void tu_write_text(const char *dir, const char *name, const char *text) {
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_msg(f != NULL, "%s: cannot create", p);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

const char *tu_path(const char *dir, const char *a, const char *b) {
    static char p[4][1200];
    static int k;
    k = (k + 1) % 4;
    int n = snprintf(p[k], sizeof p[k], "%s/%s%s%s", dir, a, b[0] ? "/" : "", b);
    ck_assert(n > 0 && (size_t)n < sizeof p[k]);
    return p[k];
}

long tu_train(const moe_config *c, const char *out, const char *resume, double *losses,
              int stop_after) {
    moe_train_opts o = {.out_dir = out,
                        .resume_dir = resume,
                        .quiet = true,
                        .losses = losses,
                        .stop_after = stop_after};
    moe_train_result r;
    ck_assert_msg(moe_train(c, &o, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    return r.checkpoints;
}
