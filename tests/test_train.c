// Training: loss falls on the synthetic tasks; N straight steps equal N/2 +
// resume + N/2 bit for bit (losses, weights, optimizer); a non-finite loss
// stops the run naming the step and layer and keeps the last good checkpoint;
// mismatched or corrupt checkpoints are refused; gradient accumulation trains
// as the larger batch; evaluation's loss and accuracy match a hand computation.
#include "moe/checkpoint.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/train.h"
#include "testutil.h"

#include <jansson.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static moe_config small(void) {
    return tu_small_config();
}

static char *read_all(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s missing", path);
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    rewind(f);
    char *b = malloc(*n + 1);
    ck_assert_int_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

START_TEST(test_loss_falls_below_baseline) {
    moe_config c = small();
    moe_train_opts o = {0};
    char out[600];
    snprintf(out, sizeof out, "%s/run", tu_tmpdir());
    o.out_dir = out;
    o.quiet = true;
    moe_train_result r;
    int rc = moe_train(&c, &o, &r);
    ck_assert_msg(rc == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.steps, 60);
    // starts near ln(256) = 5.5 and must fall by a wide margin, below the
    // unigram entropy of the answers
    ck_assert_msg(r.first_loss > 5.0 && r.last_loss < r.first_loss - 2.0, "loss %g -> %g",
                  r.first_loss, r.last_loss);
    ck_assert_msg(r.eval.val_loss < r.eval.unigram_entropy, "val %g vs unigram %g", r.eval.val_loss,
                  r.eval.unigram_entropy);
    ck_assert_int_eq(r.eval.n_moe, 2);
    moe_eval_result_free(&r.eval);
}
END_TEST

START_TEST(test_resume_is_bit_exact) {
    moe_config c = small();
    c.train.steps = 8;
    c.train.grad_accum = 2;
    c.router.noise = MOE_NOISE_GUMBEL;
    c.router.capacity_mode = MOE_CAPACITY_DYNAMIC;
    c.router.capacity_factor = 1.0;
    const char *dir = tu_tmpdir();
    char a[600], b[600], ckb[700], pa[700], pb[700];
    snprintf(a, sizeof a, "%s/straight", dir);
    snprintf(b, sizeof b, "%s/halves", dir);
    snprintf(ckb, sizeof ckb, "%s/checkpoint", b);
    double la[8] = {0}, lb[8] = {0};
    moe_train_result r;
    moe_train_opts o = {.out_dir = a, .quiet = true, .losses = la};
    ck_assert_int_eq(moe_train(&c, &o, &r), 0);
    moe_eval_result_free(&r.eval);
    const moe_train_result ra = r;
    ck_assert(ra.drop_rate > 0);
    moe_train_opts h1 = {.out_dir = b, .quiet = true, .losses = lb, .stop_after = 4};
    ck_assert_int_eq(moe_train(&c, &h1, &r), 0);
    ck_assert(r.interrupted);
    ck_assert_int_eq(r.steps, 4);
    moe_train_opts h2 = {.out_dir = b, .resume_dir = ckb, .quiet = true, .losses = lb};
    ck_assert_int_eq(moe_train(&c, &h2, &r), 0);
    ck_assert_int_eq(r.steps, 8);
    moe_eval_result_free(&r.eval);
    // the summary's means are the whole run's, as the uninterrupted run's
    ck_assert_int_eq(r.steps_run, 4);
    ck_assert_int_eq(r.steps_summed, 8);
    ck_assert_double_eq(r.drop_rate, ra.drop_rate);
    ck_assert_double_eq(r.max_vio, ra.max_vio);
    for (int i = 0; i < 8; i++)
        ck_assert_msg(la[i] == lb[i], "step %d: %.9g vs %.9g", i, la[i], lb[i]);
    snprintf(pa, sizeof pa, "%s/checkpoint", a);
    snprintf(pb, sizeof pb, "%s/checkpoint", b);
    tu_assert_same_checkpoint(pa, pb);
}
END_TEST

// Per step of metrics.jsonl (steps 1..n): lr and grad_norm.
static void read_step_metrics(const char *run, int n, double *lr, double *gnorm) {
    char p[800], line[1 << 16];
    snprintf(p, sizeof p, "%s/metrics.jsonl", run);
    FILE *f = fopen(p, "r");
    ck_assert_msg(f != NULL, "%s missing", p);
    int seen = 0;
    while (fgets(line, sizeof line, f)) {
        json_t *doc = json_loads(line, 0, NULL);
        ck_assert_msg(doc != NULL, "%s: not JSON: %s", p, line);
        const json_t *step = json_object_get(doc, "step");
        if (step) {
            const int k = (int)json_integer_value(step);
            ck_assert(k >= 1 && k <= n);
            lr[k - 1] = json_number_value(json_object_get(doc, "lr"));
            gnorm[k - 1] = json_number_value(json_object_get(doc, "grad_norm"));
            seen++;
        }
        json_decref(doc);
    }
    fclose(f);
    ck_assert_int_eq(seen, n);
}

// Gradient accumulation is a larger batch: 2 micro-batches of 2 rows make the
// step that one batch of the same 4 rows makes. Text data scores every token
// and no expert drops or balancing loss couples the rows, so the mean of the
// two micro-batch means is the 4-row mean: the same losses, step by step (the
// loss divided by grad_accum, every micro-batch's gradient in the sum, the
// cursor past both), the same gradient norm (the sum divided by grad_accum),
// and the warmup's lr of steps 1-3 (lr * step / warmup_steps).
START_TEST(test_grad_accum_equals_the_larger_batch) {
    char text[6000], p[700];
    tu_rng g;
    tu_seed(&g, 41);
    for (size_t i = 0; i < sizeof text; i++)
        text[i] = (char)('a' + (int)(tu_uniform(&g) * 26));
    snprintf(p, sizeof p, "%s/corpus.txt", tu_tmpdir());
    FILE *f = fopen(p, "wb");
    ck_assert_uint_eq(fwrite(text, 1, sizeof text, f), sizeof text);
    fclose(f);
    moe_config c = small();
    snprintf(c.data.kind, sizeof c.data.kind, "text");
    snprintf(c.data.path, sizeof c.data.path, "%.500s", p);
    c.train.steps = 3;
    c.train.warmup_steps = 5;
    c.router.capacity_factor = 4.0; // C = T * top_k: no expert can drop
    c.router.aux_loss_coef = 0.0;   // a balancing loss per micro-batch is no 4-row mean
    c.router.z_loss_coef = 0.0;
    double loss[2][3], lr[2][3], gnorm[2][3];
    for (int k = 0; k < 2; k++) {
        c.train.batch_size = k ? 2 : 4;
        c.train.grad_accum = k ? 2 : 1;
        char out[600];
        snprintf(out, sizeof out, "%s/accum%d", tu_tmpdir(), c.train.grad_accum);
        moe_train_opts o = {.out_dir = out, .quiet = true, .losses = loss[k]};
        moe_train_result r;
        ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
        moe_eval_result_free(&r.eval);
        ck_assert_double_eq(r.drop_rate, 0.0);
        read_step_metrics(out, 3, lr[k], gnorm[k]);
    }
    for (int s = 0; s < 3; s++) {
        ck_assert_msg(fabs(loss[1][s] - loss[0][s]) <= 1e-5 * loss[0][s],
                      "step %d: loss %.9g with grad_accum 2, %.9g in one batch", s + 1, loss[1][s],
                      loss[0][s]);
        ck_assert_msg(fabs(gnorm[1][s] - gnorm[0][s]) <= 1e-3 * gnorm[0][s] + 2e-6,
                      "step %d: grad_norm %.9g with grad_accum 2, %.9g in one batch", s + 1,
                      gnorm[1][s], gnorm[0][s]);
        for (int k = 0; k < 2; k++)
            ck_assert_msg(fabs(lr[k][s] - 1e-2 * (s + 1) / 5) <= 1e-9, "step %d: lr %g", s + 1,
                          lr[k][s]);
    }
    ck_assert(loss[0][0] > 5.0); // near ln(256) at the start
}
END_TEST

START_TEST(test_nonfinite_loss_stops_and_keeps_checkpoint) {
    moe_config c = small();
    c.train.steps = 2;
    c.train.ckpt_every = 1;
    const char *dir = tu_tmpdir();
    char good[600], run[600], ck_good[700], ck[700];
    snprintf(good, sizeof good, "%s/good", dir);
    snprintf(run, sizeof run, "%s/run", dir);
    snprintf(ck_good, sizeof ck_good, "%s/checkpoint", good);
    snprintf(ck, sizeof ck, "%s/checkpoint", run);
    moe_train_result r;
    for (int i = 0; i < 2; i++) { // two equal runs: one to compare with
        moe_train_opts o = {.out_dir = i ? run : good, .quiet = true};
        ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
        moe_eval_result_free(&r.eval);
    }
    // The first update of the resumed run blows the weights up: finite but
    // huge, so only a forward with them turns them into NaN.
    c.train.steps = 4;
    c.train.lr = 1e30;
    c.train.grad_clip = 0;
    moe_train_opts o = {.out_dir = run, .resume_dir = ck, .quiet = true};
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_ENUMERIC);
    const char *msg = moe_last_error();
    ck_assert_msg(strstr(msg, "step 3: ") && strstr(msg, "not written"), "message: %s", msg);
    // the checkpoint of step 2 stays as it was, bit for bit, and so does the
    // run's config.json (a plain --resume would take the diverging lr)
    tu_assert_same_checkpoint(ck_good, ck);
    tu_assert_same_file(tu_path(good, "config.json", ""), tu_path(run, "config.json", ""));
}
END_TEST

START_TEST(test_nonfinite_dense_run_writes_no_checkpoint) {
    moe_config c = small();
    c.moe.every = 0; // no router to notice non-finite logits
    c.train.steps = 1;
    c.train.lr = 1e30;
    c.train.warmup_steps = 0;
    c.train.grad_clip = 0;
    char out[600], ck[700];
    snprintf(out, sizeof out, "%s/dense", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    moe_train_opts o = {.out_dir = out, .quiet = true};
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "step 1: "), "message: %s", moe_last_error());
    ck_assert_int_ne(access(ck, F_OK), 0);
}
END_TEST

// A record cut off by a crash (no final newline) is dropped before a resume
// appends, so every line stays JSON; a resume with no step left, or with
// the tasks reordered, is refused.
START_TEST(test_resume_drops_cut_record_and_needs_steps) {
    moe_config c = small();
    c.train.steps = 2;
    char out[600], ck[700], p[800];
    snprintf(out, sizeof out, "%s/run", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    snprintf(p, sizeof p, "%s/metrics.jsonl", out);
    moe_train_result r;
    moe_train_opts o = {.out_dir = out, .quiet = true};
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    long n;
    free(read_all(p, &n));
    ck_assert_int_eq(truncate(p, n - 10), 0); // the final eval record, cut
    c.train.steps = 4;
    moe_train_opts h = {.out_dir = out, .resume_dir = ck, .quiet = true};
    ck_assert_msg(moe_train(&c, &h, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    FILE *f = fopen(p, "r");
    char line[1 << 16];
    int lines = 0, last_step = 0;
    while (fgets(line, sizeof line, f)) {
        json_error_t err;
        json_t *doc = json_loads(line, 0, &err);
        ck_assert_msg(doc != NULL, "line %d: %s", lines + 1, err.text);
        if (json_object_get(doc, "step"))
            last_step = (int)json_integer_value(json_object_get(doc, "step"));
        json_decref(doc);
        lines++;
    }
    fclose(f);
    ck_assert_int_eq(lines, 5); // steps 1-4 and the final eval
    ck_assert_int_eq(last_step, 4);
    // a whole last record that lost only its newline is kept
    free(read_all(p, &n));
    ck_assert_int_eq(truncate(p, n - 1), 0);
    c.train.steps = 5;
    ck_assert_msg(moe_train(&c, &h, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    f = fopen(p, "r");
    for (lines = 0; fgets(line, sizeof line, f); lines++) {
        json_t *doc = json_loads(line, 0, NULL);
        ck_assert_msg(doc != NULL, "line %d is not JSON", lines + 1);
        json_decref(doc);
    }
    fclose(f);
    ck_assert_int_eq(lines, 7); // the eval of step 4 kept, step 5 and its eval
    c.train.steps = 3;
    ck_assert_int_eq(moe_train(&c, &h, &r), MOE_EINVAL); // at step 4 already
    ck_assert_msg(strstr(moe_last_error(), "nothing to train"), "%s", moe_last_error());
    c.train.steps = 6; // the same tasks in another order: other task ids
    ck_assert_int_ge(c.data.n_tasks, 2);
    char first[MOE_NAME_MAX];
    memcpy(first, c.data.tasks[0], sizeof first);
    memcpy(c.data.tasks[0], c.data.tasks[1], sizeof first);
    memcpy(c.data.tasks[1], first, sizeof first);
    ck_assert_int_eq(moe_train(&c, &h, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "another order"), "%s", moe_last_error());
}
END_TEST

// A resume with capacity.mode switched names the switch, not a corrupt file.
START_TEST(test_resume_with_another_capacity_mode_names_it) {
    moe_config c = small();
    c.train.steps = 1;
    c.router.capacity_mode = MOE_CAPACITY_STATIC;
    char out[600], ck[700];
    snprintf(out, sizeof out, "%s/run", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    moe_train_result r;
    moe_train_opts o = {.out_dir = out, .quiet = true};
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    moe_eval_result_free(&r.eval);
    c.train.steps = 2;
    c.router.capacity_mode = MOE_CAPACITY_DYNAMIC;
    moe_train_opts h = {.out_dir = out, .resume_dir = ck, .quiet = true};
    ck_assert_int_eq(moe_train(&c, &h, &r), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "capacity.mode"), "%s", moe_last_error());
}
END_TEST

START_TEST(test_checkpoint_mismatch_and_corruption) {
    moe_config c = small();
    c.train.steps = 2;
    char out[600], ck[700], p[800];
    snprintf(out, sizeof out, "%s/ck", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    moe_train_opts o = {.out_dir = out, .quiet = true};
    moe_train_result r;
    ck_assert_int_eq(moe_train(&c, &o, &r), 0);
    moe_eval_result_free(&r.eval);
    moe_model m;

    moe_config wider = c; // different shapes
    wider.model.d_ff = 64;
    ck_assert_int_eq(moe_model_init(&m, &wider, 4, 32, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &m, NULL, NULL), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "the config expects"));
    moe_model_free(&m);

    moe_config deeper = c; // a tensor the checkpoint lacks
    deeper.model.n_layers = 3;
    ck_assert_int_eq(moe_model_init(&m, &deeper, 4, 32, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &m, NULL, NULL), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "missing tensor 'model.layers.2."));
    moe_model_free(&m);

    moe_config shallower = c; // tensors the config lacks
    shallower.model.n_layers = 1;
    ck_assert_int_eq(moe_model_init(&m, &shallower, 4, 32, 5), 0);
    ck_assert_int_eq(moe_ckpt_load(ck, &m, NULL, NULL), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "does not belong"));
    moe_model_free(&m);

    // truncate model.safetensors
    snprintf(p, sizeof p, "%s/model.safetensors", ck);
    long n;
    char *bytes = read_all(p, &n);
    FILE *f = fopen(p, "wb");
    fwrite(bytes, 1, n / 2, f);
    fclose(f);
    free(bytes);
    ck_assert_int_eq(moe_model_init(&m, &c, 4, 32, 5), 0);
    ck_assert_int_lt(moe_ckpt_load(ck, &m, NULL, NULL), 0);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "model.safetensors"));
    moe_model_free(&m);
    ck_assert_int_eq(moe_model_init(&m, &c, 4, 32, 5), 0);
    ck_assert_int_eq(moe_ckpt_load("/nonexistent/ckpt", &m, NULL, NULL), MOE_ENOTFOUND);
    moe_model_free(&m);
}
END_TEST

// The GPU training path (a device copy of the model, the optimizer step on
// the op table: trainer/train_gpu.c) run on the CPU table: the same losses as
// the host trainer step by step, and a checkpoint that holds its parameters.
START_TEST(test_device_training_path_on_cpu_matches_host) {
    moe_config c = small();
    c.train.steps = 20;
    c.router.capacity_factor = 1.0; // drops on some steps
    double host[20], dev[20];
    char out[600];
    moe_train_result r;
    moe_train_opts o = {0};
    o.quiet = true;
    snprintf(out, sizeof out, "%s/host", tu_tmpdir());
    o.out_dir = out;
    o.losses = host;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    double val_host = r.eval.val_loss;
    moe_eval_result_free(&r.eval);
    snprintf(out, sizeof out, "%s/dev", tu_tmpdir());
    o.out_dir = out;
    o.losses = dev;
    o.device_ops = &moe_ops_cpu;
    ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s", moe_last_error());
    for (int s = 0; s < 20; s++)
        ck_assert_msg(fabs(dev[s] - host[s]) <= 1e-6 * fabs(host[s]), "step %d: %.9g vs %.9g", s,
                      dev[s], host[s]);
    // the evaluation runs on the host model refreshed from the copy
    ck_assert_msg(fabs(r.eval.val_loss - val_host) <= 1e-6 * fabs(val_host), "val %.9g vs %.9g",
                  r.eval.val_loss, val_host);
    moe_eval_result_free(&r.eval);
    c.router.score = MOE_SCORE_SIGMOID; // not on the device path yet: refused by name
    snprintf(out, sizeof out, "%s/sigmoid", tu_tmpdir());
    o.out_dir = out;
    ck_assert_int_eq(moe_train(&c, &o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "router.score = sigmoid"), "%s", moe_last_error());
}
END_TEST

// The device training path (the GPU's) on the CPU table with the settings
// sets: the host trainer's losses within 1e-6 over 10 steps.
static void device_path_matches_host(const char *const *sets, const char *name) {
    moe_config c = small();
    c.train.steps = 10;
    c.router.capacity_factor = 1.0;
    for (; *sets; sets++)
        ck_assert_msg(moe_config_set(&c, NULL, *sets) == 0, "%s", moe_last_error());
    double host[10], dev[10];
    char out[600];
    moe_train_result r;
    moe_train_opts o = {0};
    o.quiet = true;
    for (int d = 0; d < 2; d++) {
        snprintf(out, sizeof out, "%s/%s_%s", tu_tmpdir(), name, d ? "dev" : "host");
        o.out_dir = out;
        o.losses = d ? dev : host;
        o.device_ops = d ? &moe_ops_cpu : NULL;
        ck_assert_msg(moe_train(&c, &o, &r) == 0, "%s: %s", name, moe_last_error());
        moe_eval_result_free(&r.eval);
    }
    for (int s = 0; s < 10; s++)
        ck_assert_msg(fabs(dev[s] - host[s]) <= 1e-6 * fabs(host[s]), "%s step %d: %.9g vs %.9g",
                      name, s, dev[s], host[s]);
}

// Task-level routing, router jitter and BPR task priorities (the CUDA layer
// routes by task with noise): the device copy passes the task ids and the
// step through.
START_TEST(test_device_training_path_with_tasks_and_noise_matches_host) {
    const char *tasks_jitter[] = {"moe.task_layers=[0]", "router.noise=jitter", NULL};
    device_path_matches_host(tasks_jitter, "task_jitter");
    const char *gumbel_bpr[] = {"router.noise=gumbel", "router.top_k=2",
                                "router.slot_order=priority", "router.task_priority=1,3,2,3,0",
                                NULL};
    device_path_matches_host(gumbel_bpr, "gumbel_bpr");
}
END_TEST

// loss.impl = cce on the device path (the GPU's since cut cross-entropy runs
// there, kernels/cuda/cce.cu) with the CPU table: the host trainer's losses.
START_TEST(test_device_training_path_with_cce_matches_host) {
    const char *cce[] = {"loss.impl=cce", NULL};
    device_path_matches_host(cce, "cce");
}
END_TEST

// memory.mini_seq with recompute = moe and all on the device path: the chunked
// MoE layer (the CUDA layer's chunks run on the GPU), the chunked dense FFN and
// LM head, whose loss sums read the targets back from the device copy.
START_TEST(test_device_training_path_with_mini_seq_matches_host) {
    const char *moe[] = {"memory.mini_seq=4", "memory.recompute=moe", "moe.shared_experts=1", NULL};
    device_path_matches_host(moe, "mini_seq_moe");
    const char *all[] = {"memory.mini_seq=3", "memory.recompute=all", "moe.every=2", NULL};
    device_path_matches_host(all, "mini_seq_all");
}
END_TEST

// moe_eval against the same numbers computed here. The validation loss is
// the mean of -log softmax(logits)[target] over the scored targets only
// (target -1 is no token), overall and per task (each row's task). Accuracy
// is exact-match greedy decoding: a model whose blocks are all zero predicts
// from the current token alone, through one-hot embeddings and an untied LM
// head wired as a chain '=' -> answer[0] -> ... -> '\n' for one validation
// sample; every sample of a task whose answer that chain spells is right.
START_TEST(test_eval_loss_and_accuracy_by_hand) {
    moe_config c = small();
    c.model.tie_embeddings = false;
    moe_data d;
    ck_assert_int_eq(moe_data_open(&d, &c), 0);
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &c, d.B, d.T, d.n_tasks), 0);
    enum { NB = 2, NS = 20 };
    const int N = d.B * d.T, V = m.V;
    moe_eval_result r;
    ck_assert_msg(moe_eval(&m, &d, NB, 0, &r) == 0, "%s", moe_last_error());
    double sum[MOE_MAX_TASKS] = {0}, all = 0;
    long cnt[MOE_MAX_TASKS] = {0}, n_all = 0, ignored = 0;
    int32_t *in = malloc(sizeof(int32_t) * N), *tg = malloc(sizeof(int32_t) * N), task[16];
    for (int b = 0; b < NB; b++) {
        ck_assert_int_eq(moe_data_batch(&d, MOE_SPLIT_VAL, (uint64_t)b, in, tg, task), 0);
        ck_assert_int_eq(moe_model_forward(&m, in, tg, task, d.B, d.T, false, 0), 0);
        for (int i = 0; i < N; i++) {
            if (tg[i] < 0) {
                ignored++;
                continue;
            }
            const float *row = m.logits + (size_t)i * V;
            double mx = row[0], z = 0;
            for (int v = 1; v < V; v++)
                mx = fmax(mx, row[v]);
            for (int v = 0; v < V; v++)
                z += exp(row[v] - mx);
            const double l = mx + log(z) - row[tg[i]];
            sum[task[i / d.T]] += l, cnt[task[i / d.T]]++, all += l, n_all++;
        }
    }
    ck_assert_int_gt(ignored, 0); // prompts are not scored
    ck_assert_msg(fabs(r.val_loss - all / n_all) <= 1e-5 * all / n_all, "val loss %.9g vs %.9g",
                  r.val_loss, all / n_all);
    int seen = 0;
    for (int t = 0; t < d.n_tasks; t++) {
        ck_assert_double_eq(r.accuracy[t], -1); // no samples asked for
        if (!cnt[t]) {
            ck_assert(isnan(r.task_loss[t]));
            continue;
        }
        seen++;
        const double want = sum[t] / cnt[t];
        ck_assert_msg(fabs(r.task_loss[t] - want) <= 1e-5 * want, "task %d: loss %.9g vs %.9g", t,
                      r.task_loss[t], want);
    }
    ck_assert_int_ge(seen, 2);
    moe_eval_result_free(&r);

    // The chain of copy's first validation sample whose answer repeats no token.
    int32_t next[256]; // the predicted successor; -1: none (all-zero logits: token 0)
    moe_sample s;
    for (int i = 0;; i++) {
        ck_assert_int_lt(i, NS);
        moe_synth_sample(&d, MOE_SPLIT_VAL, 0, (uint64_t)i, &s);
        int distinct = 1;
        for (int a = s.n_prompt - 1; a < s.n_prompt + s.n_answer - 1; a++)
            for (int b = a + 1; b < s.n_prompt + s.n_answer - 1; b++)
                distinct &= s.tok[a] != s.tok[b];
        if (distinct) break;
    }
    ck_assert_int_le(s.n_prompt - 1 + s.n_answer, m.D); // one dimension per chain token
    memset(m.params, 0, sizeof(float) * moe_model_numel(&m));
    for (int v = 0; v < V; v++)
        next[v] = -1;
    float *embed = m.params + moe_param_table_find(&m.table, "model.embed_tokens.weight")->offset;
    float *head = m.params + moe_param_table_find(&m.table, "lm_head.weight")->offset;
    float *norm = m.params + moe_param_table_find(&m.table, "model.norm.weight")->offset;
    for (int k = 0; k < m.D; k++)
        norm[k] = 1.0f;
    for (int k = 0; k < s.n_answer; k++) {
        const int32_t x = s.tok[s.n_prompt - 1 + k], y = s.tok[s.n_prompt + k];
        embed[(size_t)x * m.D + k] = 1.0f; // x -> dimension k -> logit of y
        head[(size_t)y * m.D + k] = 1.0f;
        next[x] = y;
    }
    ck_assert_msg(moe_eval(&m, &d, 1, NS, &r) == 0, "%s", moe_last_error());
    for (int t = 0; t < d.n_tasks; t++) {
        int right = 0;
        for (int i = 0; i < NS; i++) {
            moe_sample u;
            moe_synth_sample(&d, MOE_SPLIT_VAL, t, (uint64_t)i, &u);
            int ok = 1;
            for (int n = u.n_prompt; n < u.n_prompt + u.n_answer; n++)
                ok &= next[u.tok[n - 1]] == u.tok[n];
            right += ok;
        }
        if (t == 0) ck_assert_int_ge(right, 1); // the wired sample at least
        ck_assert_msg(fabs(r.accuracy[t] - (double)right / NS) < 1e-12,
                      "task %d: accuracy %g, expected %d of %d", t, r.accuracy[t], right, NS);
    }
    moe_eval_result_free(&r);
    free(in), free(tg);
    moe_model_free(&m);
    moe_data_close(&d);
}
END_TEST

// A task no validation row held (batch_size below the task count) prints as
// "-" with a note saying the loss covers the others, not as nan.
START_TEST(test_eval_table_marks_tasks_without_validation_rows) {
    moe_eval_result r = {.n_tasks = 2, .val_loss = 5.25};
    snprintf(r.task[0], sizeof r.task[0], "copy");
    snprintf(r.task[1], sizeof r.task[1], "caesar");
    r.task_loss[0] = 5.25, r.task_loss[1] = NAN;
    r.accuracy[0] = 0.5, r.accuracy[1] = 0;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ck_assert_ptr_nonnull(f);
    moe_eval_print(&r, f);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_msg(!strstr(buf, "nan"), "%s", buf);
    ck_assert_msg(strstr(buf, "caesar") && strstr(buf, "had no validation row"), "%s", buf);
    ck_assert_msg(strstr(buf, "5.2500") && strstr(buf, "50.0%"), "%s", buf);
    free(buf);
}
END_TEST

static Suite *train_suite(void) {
    Suite *s = suite_create("train");
    TCase *tc = tcase_create("train");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_loss_falls_below_baseline);
    tcase_add_test(tc, test_eval_table_marks_tasks_without_validation_rows);
    tcase_add_test(tc, test_eval_loss_and_accuracy_by_hand);
    tcase_add_test(tc, test_device_training_path_on_cpu_matches_host);
    tcase_add_test(tc, test_device_training_path_with_cce_matches_host);
    tcase_add_test(tc, test_device_training_path_with_tasks_and_noise_matches_host);
    tcase_add_test(tc, test_device_training_path_with_mini_seq_matches_host);
    tcase_add_test(tc, test_resume_is_bit_exact);
    tcase_add_test(tc, test_grad_accum_equals_the_larger_batch);
    tcase_add_test(tc, test_nonfinite_loss_stops_and_keeps_checkpoint);
    tcase_add_test(tc, test_nonfinite_dense_run_writes_no_checkpoint);
    tcase_add_test(tc, test_resume_drops_cut_record_and_needs_steps);
    tcase_add_test(tc, test_resume_with_another_capacity_mode_names_it);
    tcase_add_test(tc, test_checkpoint_mismatch_and_corruption);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(train_suite());
}
