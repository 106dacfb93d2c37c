// Task-routed inference: prefill and decode tokens/s and peak RSS of a full
// load against a task-routed load (and its int8 variant) of one checkpoint
// with E = 32 experts in every layer, every layer task-routed. Each load runs
// in its own child process, so peak RSS is per load; one JSON line each, then
// the target: RSS(task) <= k/E * expert bytes(full) + (RSS(full) - expert
// bytes(full)), i.e. the dense part plus k/E of the experts.
// Tokens/s are the median of --reps generations (default 5) with one load.
//   build/bench/generate [--dir DIR] [--batch B] [--prompt P] [--new N] [--experts E] [--reps R]
#include "moe/checkpoint.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/optim.h"
#include "moe/task_experts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static int E = 32, batch = 4, prompt = 64, n_new = 64, reps = 5;

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int make_config(moe_config *c) {
    moe_config_default(c);
    char ex[64];
    snprintf(ex, sizeof ex, "moe.num_experts=%d", E);
    const char *sets[] = {"model.d_model=256",
                          "model.n_layers=4",
                          "model.n_heads=8",
                          "model.n_kv_heads=2",
                          "model.d_ff=512",
                          "model.seq_len=192",
                          ex,
                          "moe.every=1",
                          "moe.task_layers=[0,1,2,3]",
                          "router.top_k=2",
                          "router.capacity_factor=0",
                          "train.batch_size=2"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        MOE_TRY(moe_config_set(c, NULL, sets[i]));
    return moe_config_check(c, NULL);
}

// Child: a checkpoint of initialised weights (with the per-task records).
static int write_ckpt(const char *dir) {
    moe_config c;
    moe_data d;
    moe_model m;
    moe_adamw opt;
    MOE_TRY(make_config(&c));
    MOE_TRY(moe_data_open(&d, &c));
    MOE_TRY(moe_model_init(&m, &c, d.B, d.T, d.n_tasks));
    MOE_TRY(moe_adamw_init(&opt, &m.table, false));
    MOE_TRY(moe_task_share_measure(&m, &d, 1));
    moe_train_state st = {0};
    MOE_TRY(moe_ckpt_save(dir, &m, &opt, &st, NULL));
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_data_close(&d);
    return 0;
}

// Child: one load, B prompts of P tokens, N new tokens each (greedy).
static int run_load(const char *dir, const char *mode) {
    moe_infer m;
    moe_infer_opts o = {.task = "sort", .max_batch = batch, .max_seq = prompt + n_new};
    o.full_load = !strcmp(mode, "full");
    o.quantize_int8 = !strcmp(mode, "task+int8");
    MOE_TRY(moe_infer_open(&m, dir, &o));
    int32_t *pr[64], *out = malloc(sizeof(int32_t) * batch * n_new);
    const int32_t *cp[64];
    int np[64], no[64];
    for (int b = 0; b < batch; b++) {
        pr[b] = malloc(sizeof(int32_t) * prompt);
        pr[b][0] = 128 + m.task;
        for (int i = 1; i < prompt; i++)
            pr[b][i] = 'a' + (i * 7 + b * 3) % 26;
        cp[b] = pr[b], np[b] = prompt;
    }
    moe_gen_opts g = {.max_new = n_new, .stop = -1};
    moe_gen_stats gs;
    double pre[64], dec[64]; // tokens/s of each repetition; the median is reported
    for (int r = 0; r < reps; r++) {
        MOE_TRY(moe_generate(&m, batch, cp, np, &g, out, no, &gs));
        pre[r] = gs.prefill_tokens / gs.prefill_s;
        dec[r] = gs.decode_tokens / gs.decode_s;
    }
    qsort(pre, (size_t)reps, sizeof(double), cmp_dbl);
    qsort(dec, (size_t)reps, sizeof(double), cmp_dbl);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    int loaded = 0, all = 0;
    for (int l = 0; l < m.L; l++)
        loaded += m.stats.loaded[l], all += m.stats.experts[l];
    printf("{\"bench\": \"generate\", \"load\": \"%s\", \"shape\": \"L=%d D=%d H=%d E=%d k=%d\", "
           "\"batch\": %d, \"prompt\": %d, \"new\": %d, \"experts_loaded\": %d, \"experts\": %d, "
           "\"bytes_read\": %llu, \"ckpt_bytes\": %llu, \"dense_MiB\": %.2f, \"expert_MiB\": %.2f, "
           "\"cache_MiB\": %.2f, \"peak_rss_MiB\": %.2f, \"prefill_tok_s\": %.0f, "
           "\"decode_tok_s\": %.0f}\n",
           mode, m.L, m.D, m.layer[0].H, m.layer[0].E, m.k, batch, prompt, n_new, loaded, all,
           (unsigned long long)m.stats.bytes_read, (unsigned long long)m.stats.ckpt_bytes,
           m.stats.dense_bytes / 1048576.0, m.stats.expert_bytes / 1048576.0,
           m.stats.cache_bytes / 1048576.0, ru.ru_maxrss / 1024.0, pre[reps / 2], dec[reps / 2]);
    fflush(stdout);
    // the parent reads RSS and expert bytes back from the exit pipe
    FILE *f = fdopen(3, "w");
    if (f) {
        fprintf(f, "%ld %zu\n", ru.ru_maxrss, m.stats.expert_bytes);
        fclose(f);
    }
    for (int b = 0; b < batch; b++)
        free(pr[b]);
    free(out);
    moe_infer_free(&m);
    return 0;
}

// Runs fn in a child; *rss_kb and *expert get what it reported (when asked).
static int in_child(const char *dir, const char *mode, long *rss_kb, size_t *expert) {
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 3);
        int rc = mode ? run_load(dir, mode) : write_ckpt(dir);
        if (rc < 0) fprintf(stderr, "generate bench: %s\n", moe_last_error());
        _exit(rc < 0);
    }
    close(fds[1]);
    char buf[128] = {0};
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    int st;
    waitpid(pid, &st, 0);
    if (n > 0 && rss_kb) sscanf(buf, "%ld %zu", rss_kb, expert);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    const char *dir = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--dir"))
            dir = argv[i + 1];
        else if (!strcmp(argv[i], "--batch"))
            batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prompt"))
            prompt = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--new"))
            n_new = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--experts"))
            E = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: generate [--dir DIR] [--batch B] [--prompt P] [--new N] "
                            "[--experts E] [--reps R]\n");
            return 2;
        }
    }
    if (batch < 1 || batch > 64 || prompt < 2 || n_new < 1 || prompt + n_new > 192 || E < 2 ||
        reps < 1 || reps > 64) {
        fprintf(stderr, "generate: batch 1..64, prompt >= 2, new >= 1, prompt + new <= 192, "
                        "reps 1..64\n");
        return 2;
    }
    char tmp[512] = "";
    if (!dir) {
        const char *base = getenv("TMPDIR");
        snprintf(tmp, sizeof tmp, "%s/moe-bench-generate-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(tmp)) return 1;
        dir = tmp;
    }
    char ck[600];
    snprintf(ck, sizeof ck, "%s/checkpoint", dir);
    if (access(ck, F_OK) != 0 && in_child(ck, NULL, NULL, NULL) < 0) return 1;
    long rss_full = 0, rss_task = 0, rss_q = 0;
    size_t ex_full = 0, ex_task = 0, ex_q = 0;
    if (in_child(ck, "full", &rss_full, &ex_full) < 0 ||
        in_child(ck, "task", &rss_task, &ex_task) < 0 ||
        in_child(ck, "task+int8", &rss_q, &ex_q) < 0)
        return 1;
    // target: the dense part (everything but the experts) plus k/E of them
    const double full_mb = rss_full / 1024.0, ex_mb = ex_full / 1048576.0, k = 2;
    const double target = (full_mb - ex_mb) + k / E * ex_mb;
    // Peak RSS of two processes running the same code varies by ~0.1 MiB
    // (allocator and page granularity): the target allows 0.25 MiB of it.
    printf("{\"bench\": \"generate_rss\", \"E\": %d, \"k\": 2, \"rss_full_MiB\": %.2f, "
           "\"rss_task_MiB\": %.2f, \"rss_task_int8_MiB\": %.2f, \"expert_full_MiB\": %.2f, "
           "\"target_MiB\": %.2f, \"over_target_MiB\": %.2f, \"meets_target\": %s, "
           "\"ratio_task_to_full\": %.3f}\n",
           E, full_mb, rss_task / 1024.0, rss_q / 1024.0, ex_mb, target, rss_task / 1024.0 - target,
           rss_task / 1024.0 <= target + 0.25 ? "true" : "false", (double)rss_task / rss_full);
    if (tmp[0]) {
        const char *files[] = {"model.safetensors", "optimizer.safetensors", "config.json",
                               "trainer_state.json", "task_experts.json"};
        char p[700];
        for (int i = 0; i < 5; i++) {
            snprintf(p, sizeof p, "%s/%s", ck, files[i]);
            unlink(p);
        }
        rmdir(ck);
        rmdir(tmp);
    }
    return 0;
}
