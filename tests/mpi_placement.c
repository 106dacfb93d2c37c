// Load-driven expert placement (placement.*) under `mpirun -np 4`, ep = 4,
// on a skewed load (one synthetic task, task-routed first layer: its tokens
// all go to the same two experts):
//   static / never triggered   bit-identical losses and checkpoints to a run
//                              without placement keys
//   replicate, dropless        losses within 1e-6 relative of the static run
//   replicate, with drops      capacity follows replicas: the drop rate
//                              falls, checkpoints keep the same tensors,
//                              max/mean of the rows the ranks compute falls
//   every step                 each replica holds its home expert's bits
//   resume (sync, async save)  N/2 steps + resume N/2: the losses and
//                              checkpoint of N steps, bit for bit
//   resume, other ep / bad     static table (logged) / refused naming the field
//   grad_accum = 2             the load observed sums both micro-batches
//   every forward              no slot computes more rows than one expert's
//                              capacity budget, replicated experts more
//   move (homes swap)          each expert's weights and moments (fp32 or
//                              bf16), found by name, unchanged by a move
//                              and held once;
//                              dropless losses and checkpoints (by name)
//                              as static; resume bit for bit
#include "moe/comm.h"
#include "moe/data.h"
#include "moe/error.h"
#include "moe/optim.h"
#include "moe/parallel.h"
#include "moe/placement.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <jansson.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { STEPS = 6, W = 4 };
static int rank;
static bool homes_moved(const char *ckpt);

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(const char *const *extra, int n_extra) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32",   "model.n_layers=2",   "model.d_ff=48",
                          "model.seq_len=16",   "moe.num_experts=8",  "moe.task_layers=[0]",
                          "train.batch_size=2", "train.eval_every=0", "train.warmup_steps=2",
                          "data.tasks=copy",    "parallel.ep=4",      "capacity.mode=dynamic",
                          "train.lr=1e-4"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        CHECK(moe_config_set(&c, NULL, sets[i]) == 0, "%s: %s", sets[i], moe_last_error());
    for (int i = 0; i < n_extra; i++)
        CHECK(moe_config_set(&c, NULL, extra[i]) == 0, "%s: %s", extra[i], moe_last_error());
    c.train.steps = STEPS;
    return c;
}

// Resume continues bit for bit: STEPS steps with replicas (table updates
// every 2 steps, drops) against STEPS/2, then a resume to STEPS; the same
// with the asynchronous save. Without the saved EMA and tables the resumed
// half would start static and drop other rows.
static void resume_is_bit_identical(moe_comm *world, const char *dir, bool async,
                                    const char *mode) {
    const char *rep[] = {mode, "placement.slots_per_rank=3", "placement.update_every=2",
                         "router.capacity_factor=1.0",
                         async ? "train.async_checkpoint=true" : "train.async_checkpoint=false"};
    moe_config c = base(rep, 5);
    char full[800], half[800], res[800], ck[900];
    const char *tag = strstr(mode, "move") ? "move" : async ? "async" : "sync";
    snprintf(full, sizeof full, "%s/resume-%s-full", dir, tag);
    snprintf(half, sizeof half, "%s/resume-%s-half", dir, tag);
    snprintf(res, sizeof res, "%s/resume-%s-res", dir, tag);
    double lf[STEPS] = {0}, lr[STEPS] = {0};
    mpi_train(rank, world, c, full, lf, NULL);
    mpi_train_with(rank, c,
                   (moe_train_opts){.out_dir = half, .stop_after = STEPS / 2, .world = world}, NULL,
                   half);
    snprintf(ck, sizeof ck, "%s/checkpoint", half);
    mpi_train_with(rank, c,
                   (moe_train_opts){.out_dir = res, .resume_dir = ck, .losses = lr, .world = world},
                   NULL, res);
    for (int s = STEPS / 2; s < STEPS; s++)
        CHECK(lr[s] == lf[s], "%s resume step %d: loss %.17g vs %.17g", tag, s, lr[s], lf[s]);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        char a[900], b[900], why[512];
        snprintf(a, sizeof a, "%s/checkpoint", full);
        snprintf(b, sizeof b, "%s/checkpoint", res);
        CHECK(!tu_st_dirs_differ(a, b, why, sizeof why), "%s resume: %s", tag, why);
        snprintf(a, sizeof a, "%s/checkpoint", half);
        if (strstr(mode, "move")) CHECK(homes_moved(a), "move: the half run moved no home");
    }
}

// The saved tables (trainer_state.json) have some expert away from its
// contiguous home block.
static bool homes_moved(const char *ckpt) {
    char path[1000];
    snprintf(path, sizeof path, "%s/trainer_state.json", ckpt);
    json_t *doc = json_load_file(path, 0, NULL);
    json_t *ls = json_object_get(json_object_get(doc, "placement"), "layers");
    bool moved = false;
    for (size_t i = 0; i < json_array_size(ls); i++) {
        json_t *sl = json_object_get(json_array_get(ls, i), "slots");
        for (size_t j = 0; j < json_array_size(sl); j++) // S = 3, El = 2
            moved |= j % 3 < 2 &&
                     json_integer_value(json_array_get(sl, j)) != (json_int_t)(j / 3 * 2 + j % 3);
    }
    json_decref(doc);
    return moved;
}

// Every expert tensor of the EP group by name (layer, expert, w1 w3 w2):
// weights and both moments into all [L][E][3][numel] x 3, and how many ranks
// hold each into cnt (sums of zeros elsewhere: exact).
static void gather_experts(const moe_model *m, const moe_adamw *opt, float *all, int *cnt,
                           size_t tn) {
    const int E = 8;
    const size_t per = (size_t)m->L * E * 3 * tn;
    memset(all, 0, 3 * per * sizeof(float));
    memset(cnt, 0, sizeof(int) * (size_t)m->L * E * 3);
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        const char *x = strstr(v->name, ".experts.");
        if (!x) continue;
        int l = atoi(v->name + strlen("model.layers.")), e = atoi(x + 9);
        const char *w = strchr(x + 9, '.') + 1;
        int k = w[1] == '1' ? 0 : w[1] == '3' ? 1 : 2;
        const size_t at = (((size_t)l * E + e) * 3 + k) * tn;
        CHECK(v->numel == tn, "%s: %zu floats", v->name, v->numel);
        memcpy(all + at, m->params + v->offset, tn * sizeof(float));
        moe_adamw_moment_get(opt, 0, v->offset, tn, all + per + at); // bf16: widened, exact
        moe_adamw_moment_get(opt, 1, v->offset, tn, all + 2 * per + at);
        cnt[(at / tn)]++;
    }
    MPI_Allreduce(MPI_IN_PLACE, all, (int)(3 * per), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, cnt, m->L * E * 3, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
}

// The saved placement state: under another ep the run starts from the static
// table (logged); a table no update could build is refused, naming the field.
static void resume_checks_the_state(moe_comm *world, const char *dir) {
    char ck[900], out[800], path[1000];
    snprintf(ck, sizeof ck, "%s/resume-sync-half/checkpoint", dir);
    const char *ep2[] = {"placement.mode=replicate", "placement.slots_per_rank=5",
                         "placement.update_every=2", "router.capacity_factor=1.0", "parallel.ep=2"};
    moe_config c = base(ep2, 5);
    snprintf(out, sizeof out, "%s/resume-ep2", dir);
    moe_train_opts o = {.out_dir = out, .resume_dir = ck, .quiet = true, .world = world};
    moe_train_result r;
    mpi_train_with(rank, c, o, NULL, "resume under ep = 2");
    // Expert 2's holders listed as rank 0 (its home is rank 1).
    snprintf(path, sizeof path, "%s/trainer_state.json", ck);
    if (rank == 0) {
        json_t *doc = json_load_file(path, 0, NULL);
        json_t *h = json_array_get(
            json_object_get(
                json_array_get(json_object_get(json_object_get(doc, "placement"), "layers"), 0),
                "holders"),
            2);
        CHECK(h && json_array_set_new(h, 0, json_integer(0)) == 0, "editing %s", path);
        CHECK(json_dump_file(doc, path, JSON_INDENT(2)) == 0, "writing %s", path);
        json_decref(doc);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const char *rep[] = {"placement.mode=replicate", "placement.slots_per_rank=3",
                         "placement.update_every=2", "router.capacity_factor=1.0"};
    c = base(rep, 4);
    snprintf(out, sizeof out, "%s/resume-bad", dir);
    o = (moe_train_opts){.out_dir = out, .resume_dir = ck, .quiet = true, .world = world};
    int rc = moe_train(&c, &o, &r);
    CHECK(rc == MOE_EFORMAT && strstr(moe_last_error(), "placement.layers[layer 0].holders"),
          "a bad holder list: rc %d, '%s'", rc, moe_last_error());
    // A negative ep is no other layout (which would start from the static table).
    if (rank == 0) {
        json_t *doc = json_load_file(path, 0, NULL);
        CHECK(doc &&
                  !json_object_set_new(json_object_get(doc, "placement"), "ep", json_integer(-1)),
              "editing %s", path);
        CHECK(json_dump_file(doc, path, JSON_INDENT(2)) == 0, "writing %s", path);
        json_decref(doc);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    snprintf(out, sizeof out, "%s/resume-bad-ep", dir);
    o = (moe_train_opts){.out_dir = out, .resume_dir = ck, .quiet = true, .world = world};
    rc = moe_train(&c, &o, &r);
    CHECK(rc == MOE_EFORMAT && strstr(moe_last_error(), "ep = -1"),
          "a negative ep in the placement state: rc %d, '%s'", rc, moe_last_error());
}

// Largest per-tensor relative L2 difference of two checkpoints (same tensor
// names required); -1 when they do not hold the same tensors.
static double max_rel_diff(const char *a, const char *b) {
    moe_st_set *sa, *sb;
    if (moe_st_set_open(a, &sa) || moe_st_set_open(b, &sb)) return -1;
    double worst = 0;
    int na = 0, nb = 0;
    for (int k = 0; k < sb->n_files; k++)
        nb += sb->files[k]->n_tensors;
    for (int k = 0; k < sa->n_files && worst >= 0; k++)
        for (int i = 0; i < sa->files[k]->n_tensors && worst >= 0; i++, na++) {
            moe_st_file *fa = sa->files[k], *fb = NULL;
            const moe_st_tensor *ta = &fa->tensors[i], *tb = moe_st_set_find(sb, ta->name, &fb);
            if (!tb || tb->nbytes != ta->nbytes) {
                worst = -1;
                break;
            }
            float *x = malloc(ta->nbytes), *y = malloc(tb->nbytes);
            moe_st_read(fa, ta, x, ta->nbytes);
            moe_st_read(fb, tb, y, tb->nbytes);
            double d = 0, n = 0;
            for (size_t j = 0; j < ta->nbytes / 4; j++)
                d += ((double)x[j] - y[j]) * ((double)x[j] - y[j]), n += (double)y[j] * y[j];
            double rel = n > 0 ? sqrt(d / n) : sqrt(d);
            if (rel > worst) worst = rel;
            free(x);
            free(y);
        }
    moe_st_set_close(sa);
    moe_st_set_close(sb);
    return worst >= 0 && na == nb ? worst : -1;
}

static void static_placement_is_bit_identical(moe_comm *world, const char *dir) {
    static const char *const off_keys[] = {"placement.mode=static", "placement.slots_per_rank=3"};
    static const char *const never[] = {"placement.mode=replicate", "placement.slots_per_rank=3",
                                        "placement.update_every=1000"};
    char out[3][800], why[512];
    double l[3][STEPS];
    const char *const *extra[3] = {NULL, off_keys, never};
    const int n_extra[3] = {0, 2, 3};
    for (int i = 0; i < 3; i++) {
        snprintf(out[i], sizeof out[i], "%s/static%d", dir, i);
        mpi_train(rank, world, base(extra[i], n_extra[i]), out[i], l[i], NULL);
    }
    for (int i = 1; i < 3; i++) {
        for (int s = 0; s < STEPS; s++)
            CHECK(l[i][s] == l[0][s], "placement %d step %d: loss %.17g vs %.17g", i, s, l[i][s],
                  l[0][s]);
        char a[900], b[900];
        snprintf(a, sizeof a, "%s/checkpoint", out[0]);
        snprintf(b, sizeof b, "%s/checkpoint", out[i]);
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) CHECK(!tu_st_dirs_differ(a, b, why, sizeof why), "placement %d: %s", i, why);
    }
}

// Replicas from the first step on against the same run with a table never
// updated (static placement, rows measured).
static void replicate_matches_static(moe_comm *world, const char *dir, const char *factor,
                                     const char *name, const char *mode) {
    const char *cf = strcmp(factor, "capacity.mode=static") ? "router.capacity_factor=1.0"
                                                            : "router.capacity_factor=0";
    const char *rep[] = {factor, cf, mode, "placement.slots_per_rank=3",
                         "placement.update_every=1"};
    char o0[800], o1[800];
    double l0[STEPS], l1[STEPS];
    moe_train_result r0 = {0}, r1 = {0};
    snprintf(o0, sizeof o0, "%s/%s-static", dir, name);
    snprintf(o1, sizeof o1, "%s/%s-replicate", dir, name);
    // The static run with the replicate keys and no update measures the rows too.
    const char *st_measured[] = {factor, cf, "placement.mode=replicate",
                                 "placement.slots_per_rank=3", "placement.update_every=1000"};
    mpi_train(rank, world, base(st_measured, 5), o0, l0, &r0);
    mpi_train(rank, world, base(rep, 5), o1, l1, &r1);
    // Dropless: the same rows computed elsewhere. With drops a replicated
    // expert's capacity grows with its holders: fewer drops, other losses.
    const bool dropless = r0.drop_rate == 0;
    for (int s = 0; s < STEPS && dropless; s++)
        CHECK(fabs(l1[s] - l0[s]) <= 1e-6 * fabs(l0[s]), "%s step %d: loss %.9g vs %.9g", name, s,
              l1[s], l0[s]);
    CHECK(r1.rank_imbalance < 0.8 * r0.rank_imbalance,
          "%s: max/mean rank rows %.3f with replicas, %.3f without", name, r1.rank_imbalance,
          r0.rank_imbalance);
    if (dropless)
        CHECK(r1.drop_rate == 0, "%s: drop rate %.6f with replicas", name, r1.drop_rate);
    else
        CHECK(r1.drop_rate < 0.5 * r0.drop_rate, "%s: drop rate %.6f with replicas, %.6f without",
              name, r1.drop_rate, r0.drop_rate);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        char a[900], b[900];
        snprintf(a, sizeof a, "%s/checkpoint", o0);
        snprintf(b, sizeof b, "%s/checkpoint", o1);
        double d = max_rel_diff(b, a);
        CHECK(d >= 0 && (!dropless || d <= 1e-6),
              "%s: checkpoints differ by %.3g (-1: not the same tensors)", name, d);
        if (strstr(mode, "move")) CHECK(homes_moved(b), "%s: no expert changed its home", name);
        printf("%s: max/mean rank rows %.3f static, %.3f replicate; drop rate %.4f vs %.4f; "
               "expert rows a2a bytes per step per rank %.0f vs %.0f; weights within %.3g\n",
               name, r0.rank_imbalance, r1.rank_imbalance, r0.drop_rate, r1.drop_rate,
               r0.place_a2a_bytes, r1.place_a2a_bytes, d);
    }
}

// After a forward under replicas: no slot computes more rows than one
// expert's budget, P times the capacity C_e the controller gave the layer
// (sources keep at most C_e rows of a lone expert); returns the replicated
// experts' kept rows beyond P * C_e, summed over the group (capacity grew).
static long slot_rows_within_capacity(const moe_model *m, const moe_parallel *par, int step) {
    long beyond = 0;
    for (int l = 0; l < m->L; l++) {
        const moe_place_layer *pl = par->place[l];
        if (!pl || !pl->active || !m->cap[l].capacity) continue;
        const moe_placement *t = &pl->t;
        for (int j = 0; j < t->S; j++) {
            const int e = t->slot[par->ep_rank * t->S + j];
            if (e < 0) continue;
            long rows = 0, budget = (long)t->P * m->cap[l].capacity[e];
            for (int s = 0; s < t->P; s++)
                rows += pl->blk_n[s * t->S + j];
            CHECK(rows <= budget,
                  "step %d layer %d: slot %d (expert %d) computes %ld rows, %ld "
                  "allowed",
                  step, l, j, e, rows, budget);
        }
        long kept[64] = {0};
        for (int e = 0; e < t->E && e < 64; e++)
            kept[e] = m->a[l].moe.plan.kept[e];
        MPI_Allreduce(MPI_IN_PLACE, kept, 64, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        for (int e = 0; e < t->E && e < 64; e++) {
            const long over = kept[e] - (long)t->P * m->cap[l].capacity[e];
            if (t->n_hold[e] > 1 && over > 0) beyond += over;
        }
    }
    return beyond;
}

// The training step by hand. replicas: after each step every replica holds
// its home expert's weights, bit for bit; else (with drops) after each
// forward every slot stays within its capacity, and some replicated expert
// keeps more rows than a lone one could.
static void hand_steps(moe_comm *world, bool replicas, bool move, bool bf16) {
    const char *rep[] = {"placement.mode=replicate", "placement.slots_per_rank=3",
                         "placement.update_every=1", "router.capacity_factor=0",
                         "capacity.mode=static"};
    const char *cap[] = {"placement.mode=replicate", "placement.slots_per_rank=3",
                         "placement.update_every=1", "router.capacity_factor=1.0",
                         "capacity.mode=dynamic",    "capacity.capacity_factor_max=1.0"};
    // (factor_max 1: C_e = 8 of a source's 32 tokens, so the budget binds.)
    if (move) rep[0] = "placement.mode=move";
    moe_config c = replicas ? base(rep, 5) : base(cap, 6);
    long beyond = 0;
    moe_parallel par;
    moe_data d;
    moe_model m;
    moe_adamw opt;
    int rc = moe_parallel_init(&par, world, &c);
    CHECK(rc == 0, "parallel: %s", moe_last_error());
    if (rc) return;
    CHECK(moe_data_open(&d, &c) == 0, "data: %s", moe_last_error());
    CHECK(moe_model_init_ep(&m, &c, d.B, d.T, d.n_tasks, &par.group) == 0, "model: %s",
          moe_last_error());
    CHECK(moe_adamw_init_state(&opt, &m.table, false, bf16 ? MOE_ADAMW_BF16 : MOE_ADAMW_FP32) == 0,
          "adamw: %s", moe_last_error());
    CHECK(moe_parallel_placement_init(&par, &m, &c) == 0, "placement: %s", moe_last_error());
    const size_t nt = (size_t)d.B * d.T, n = m.table.numel;
    int32_t *in = malloc(nt * 4), *tg = malloc(nt * 4), *task = malloc((size_t)d.B * 4);
    int replicated = 0, moved = 0;
    const size_t tn = (size_t)m.moe_cfg[0].H * m.moe_cfg[0].D, per = (size_t)m.L * 8 * 3 * tn;
    float *before = malloc(3 * per * sizeof(float)), *after = malloc(3 * per * sizeof(float));
    int *cb = malloc(sizeof(int) * (size_t)m.L * 24), *ca = malloc(sizeof(int) * (size_t)m.L * 24);
    for (int step = 0; step < STEPS; step++) {
        memset(m.grads, 0, n * sizeof(float));
        CHECK(moe_data_batch(&d, MOE_SPLIT_TRAIN, (uint64_t)step * W + par.rank, in, tg, task) == 0,
              "batch");
        CHECK(moe_model_forward(&m, in, tg, task, d.B, d.T, true, (uint64_t)step) == 0, "fwd: %s",
              moe_last_error());
        if (!replicas) beyond += slot_rows_within_capacity(&m, &par, step);
        CHECK(moe_model_backward(&m, in, tg, task) == 0, "bwd: %s", moe_last_error());
        CHECK(moe_parallel_allreduce_grads(&par, &m) == 0, "allreduce: %s", moe_last_error());
        for (size_t i = 0; i < n; i++)
            m.grads[i] /= W;
        CHECK(moe_parallel_placement_observe(&par, &m) == 0, "observe: %s", moe_last_error());
        if (!replicas) {
            MPI_Allreduce(MPI_IN_PLACE, m.load, (int)moe_model_load_len(&m), MPI_DOUBLE, MPI_SUM,
                          MPI_COMM_WORLD);
            MPI_Allreduce(MPI_IN_PLACE, &m.load_calls, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
            moe_model_capacity_step(&m); // every rank's load, as the trainer does
        }
        moe_adamw_update_clipped(&opt, m.params, m.grads, 0, 0, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f);
        if (move) gather_experts(&m, &opt, before, cb, tn);
        CHECK(moe_parallel_placement_step(&par, &m, &opt, step + 1) == 0, "step: %s",
              moe_last_error());
        if (move) { // the same tensors under the same names, once each
            gather_experts(&m, &opt, after, ca, tn);
            for (int i = 0; i < m.L * 24; i++)
                CHECK(ca[i] == (m.is_moe[i / 24] ? 1 : 0) && cb[i] == ca[i],
                      "step %d: expert tensor %d held %d times (%d before)", step, i, ca[i], cb[i]);
            size_t diff = 0;
            for (size_t i = 0; i < 3 * per; i++)
                diff += after[i] != before[i];
            CHECK(diff == 0, "step %d: %zu expert floats changed in the move", step, diff);
            for (int l = 0; l < m.L; l++)
                if (par.place[l])
                    for (int e = 0; e < 8; e++)
                        moved += moe_placement_home(&par.place[l]->t, e) != e / 2;
        }
        for (int l = 0; l < m.L && replicas; l++) {
            moe_place_layer *pl = par.place[l];
            if (!pl || !pl->active) continue;
            const moe_placement *t = &pl->t;
            float *home = malloc(pl->numel * sizeof(float));
            for (int e = 0; e < t->E; e++) {
                if (t->n_hold[e] < 2) continue;
                const int h = t->hold[(size_t)e * t->P];
                if (h == par.ep_rank)
                    memcpy(home, moe_layer_w13(&m.p[l].moe, moe_placement_slot_of(t, h, e)),
                           pl->numel * sizeof(float));
                MPI_Bcast(home, (int)pl->numel, MPI_FLOAT, h, MPI_COMM_WORLD);
                const int j = moe_placement_slot_of(t, par.ep_rank, e);
                if (j >= t->El) {
                    replicated++;
                    CHECK(!memcmp(home, pl->rep_w + (size_t)(j - t->El) * pl->numel,
                                  pl->numel * sizeof(float)),
                          "step %d layer %d: the replica of expert %d differs from rank %d's", step,
                          l, e, h);
                }
            }
            free(home);
        }
    }
    int all = replicated;
    MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (replicas) CHECK(all > 0, "no replica was ever placed: the skewed load should make some");
    if (!replicas)
        CHECK(beyond > 0, "no replicated expert kept more rows than one expert's capacity");
    if (move) CHECK(moved > 0, "no expert changed its home under placement.mode = move");
    free(before), free(after), free(cb), free(ca);
    free(in), free(tg), free(task);
    moe_adamw_free(&opt);
    moe_model_free(&m);
    moe_data_close(&d);
    moe_parallel_free(&par);
}

// grad_accum: the load a placement balances is the step's, every
// micro-batch's kept rows (summed over the ranks), not the last one's.
static void load_sums_micro_batches(moe_comm *world) {
    const char *rep[] = {"placement.mode=replicate", "placement.slots_per_rank=3",
                         "placement.update_every=1", "train.grad_accum=2"};
    moe_config c = base(rep, 4);
    moe_parallel par;
    moe_data d;
    moe_model m;
    int rc = moe_parallel_init(&par, world, &c);
    CHECK(rc == 0, "parallel: %s", moe_last_error());
    if (rc) return;
    CHECK(moe_data_open(&d, &c) == 0, "data: %s", moe_last_error());
    CHECK(moe_model_init_ep(&m, &c, d.B, d.T, d.n_tasks, &par.group) == 0, "model: %s",
          moe_last_error());
    CHECK(moe_parallel_placement_init(&par, &m, &c) == 0, "placement: %s", moe_last_error());
    const size_t nt = (size_t)d.B * d.T, n = moe_model_load_len(&m);
    int32_t *in = malloc(nt * 4), *tg = malloc(nt * 4), *task = malloc((size_t)d.B * 4);
    double *want = calloc(n, sizeof(double)), last = 0;
    for (int a = 0; a < 2; a++) {
        CHECK(moe_data_batch(&d, MOE_SPLIT_TRAIN, (uint64_t)a * W + par.rank, in, tg, task) == 0,
              "batch");
        CHECK(moe_model_forward(&m, in, tg, task, d.B, d.T, true, 0) == 0, "fwd: %s",
              moe_last_error());
        CHECK(moe_parallel_placement_accumulate(&par, &m) == 0, "accumulate: %s", moe_last_error());
        for (int l = 0, idx = 0; l < m.L; l++)
            if (m.is_moe[l]) {
                for (int e = 0; e < m.moe_cfg[l].E; e++)
                    want[(size_t)idx * m.usage_E + e] += m.a[l].moe.plan.kept[e];
                idx++;
            }
    }
    last = m.a[0].moe.plan.kept[2]; // a hot expert of the task-routed layer
    MPI_Allreduce(MPI_IN_PLACE, want, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &last, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    CHECK(moe_parallel_placement_observe(&par, &m) == 0, "observe: %s", moe_last_error());
    for (size_t i = 0; i < n; i++)
        CHECK(par.place_ema[i] == want[i], "load %zu: %g, the two micro-batches sum to %g", i,
              par.place_ema[i], want[i]);
    CHECK(want[2] > last, "expert 2's load %g should exceed the last micro-batch's %g", want[2],
          last);
    free(in), free(tg), free(task), free(want);
    moe_model_free(&m);
    moe_data_close(&d);
    moe_parallel_free(&par);
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_placement", W, &rank, dir);
    if (rc) return rc;
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        fprintf(stderr, "world: %s\n", moe_last_error());
        MPI_Finalize();
        return 1;
    }
    static_placement_is_bit_identical(world, dir);
    replicate_matches_static(world, dir, "capacity.mode=static", "dropless",
                             "placement.mode=replicate");
    replicate_matches_static(world, dir, "capacity.mode=dynamic", "drops",
                             "placement.mode=replicate");
    replicate_matches_static(world, dir, "capacity.mode=static", "dropless-move",
                             "placement.mode=move");
    replicate_matches_static(world, dir, "capacity.mode=dynamic", "drops-move",
                             "placement.mode=move");
    resume_is_bit_identical(world, dir, false, "placement.mode=replicate");
    resume_is_bit_identical(world, dir, true, "placement.mode=replicate");
    resume_is_bit_identical(world, dir, false, "placement.mode=move");
    resume_checks_the_state(world, dir);
    hand_steps(world, true, false, false);  // replicas stay identical
    hand_steps(world, true, true, false);   // moves carry weights and moments, by name
    hand_steps(world, true, true, true);    // bf16 moments too, bit for bit
    hand_steps(world, false, false, false); // slots within capacity, and capacity grows
    load_sums_micro_batches(world);
    moe_comm_free(world);
    return mpi_test_end("mpi_placement", rank);
}
