// Distributed training equals single-process training (run under
// `mpirun -np 4`). The reference is one process with grad_accum = 4: its
// micro-batch r is rank r's batch, routed alone as that rank routes it.
//   ep=4            bit-identical losses and final weights
//   ep=4, 2 nodes   hierarchical all-to-all, bit-identical
//   ep=2 x dp=2     losses within 1e-6 relative, weights within 1e-6 relative
//                   L2 per tensor: each expert's gradient is summed as
//                   (g0 + g1) + (g2 + g3) over the two EP groups instead of
//                   ((g0 + g1) + g2) + g3, so the last bits may differ
// Checkpoints cross over: 4 ranks -> 1 process and 1 process -> 4 ranks; the
// sharded ep=4 save resumes at ep=4 and ep=2 bit for bit (cross_layouts).
#include "moe/checkpoint.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/plan.h"
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
#include <unistd.h>

enum { STEPS = 6, W = 4 };
static int rank;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(int ep, const char *a2a) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {
        "model.d_model=32",      "model.n_layers=2",          "model.d_ff=48",
        "model.seq_len=16",      "moe.num_experts=8",         "train.batch_size=2",
        "train.eval_every=0",    "train.warmup_steps=2",      "router.noise=gumbel",
        "capacity.mode=dynamic", "router.capacity_factor=1.0"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        moe_config_set(&c, NULL, sets[i]);
    c.train.steps = STEPS;
    c.parallel.ep = ep;
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    return c;
}

// Compares two checkpoints' tensors (either layout: one file or shards)
// tensor by tensor.
static void compare_models(const char *a, const char *b, double rel_tol, const char *what) {
    moe_st_set *sa, *sb;
    CHECK(moe_st_set_open(a, &sa) == 0 && moe_st_set_open(b, &sb) == 0, "%s: %s", what,
          moe_last_error());
    size_t na = 0, nb = 0;
    for (int k = 0; k < sa->n_files; k++)
        na += (size_t)sa->files[k]->n_tensors;
    for (int k = 0; k < sb->n_files; k++)
        nb += (size_t)sb->files[k]->n_tensors;
    CHECK(na == nb, "%s: %zu vs %zu tensors", what, na, nb);
    double worst = 0;
    for (int k = 0; k < sa->n_files; k++)
        for (int i = 0; i < sa->files[k]->n_tensors; i++) {
            moe_st_file *fa = sa->files[k], *fb = NULL;
            const moe_st_tensor *ta = &fa->tensors[i], *tb = moe_st_set_find(sb, ta->name, &fb);
            CHECK(tb && tb->nbytes == ta->nbytes, "%s: tensor %s", what, ta->name);
            if (!tb || tb->nbytes != ta->nbytes) continue;
            float *x = malloc(ta->nbytes), *y = malloc(tb->nbytes);
            moe_st_read(fa, ta, x, ta->nbytes);
            moe_st_read(fb, tb, y, tb->nbytes);
            // per-tensor relative L2 error |x - y| / |y|
            double diff = 0, norm = 0;
            for (size_t j = 0; j < ta->nbytes / 4; j++) {
                diff += ((double)x[j] - y[j]) * ((double)x[j] - y[j]);
                norm += (double)y[j] * y[j];
            }
            double rel = norm > 0 ? sqrt(diff / norm) : sqrt(diff);
            if (rel > worst) worst = rel;
            if (rel_tol == 0) CHECK(!memcmp(x, y, ta->nbytes), "%s: %s differs", what, ta->name);
            free(x);
            free(y);
        }
    if (rel_tol > 0) CHECK(worst <= rel_tol, "%s: weights differ by %.3g relative", what, worst);
    if (rank == 0)
        printf("%s: largest per-tensor relative L2 weight difference %.3g\n", what, worst);
    moe_st_set_close(sa);
    moe_st_set_close(sb);
}

// The step records of a run's metrics.jsonl (a JSON array; NULL if unreadable).
static json_t *step_records(const char *run) {
    char path[900], line[1 << 16];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    json_t *all = json_array();
    while (f && fgets(line, sizeof line, f)) {
        json_t *r = json_loads(line, 0, NULL);
        if (r && json_object_get(r, "step")) json_array_append(all, r);
        json_decref(r);
    }
    if (f) fclose(f);
    return all;
}

// metrics.jsonl's routing figures cover the whole step (every micro-batch of
// every rank): the ranks' run and the one process with grad_accum = ranks
// record equal drop_rate (the step's and each layer's) and load.
static void routing_metrics_equal(const char *dist, const char *ref, const char *name) {
    json_t *a = step_records(dist), *b = step_records(ref);
    CHECK(json_array_size(a) == STEPS && json_array_size(b) == STEPS,
          "%s: %zu and %zu step records, expected %d", name, json_array_size(a), json_array_size(b),
          STEPS);
    double dropped = 0;
    for (size_t s = 0; s < json_array_size(a) && s < json_array_size(b); s++) {
        json_t *x = json_array_get(a, s), *y = json_array_get(b, s);
        double dx = json_real_value(json_object_get(x, "drop_rate"));
        double dy = json_real_value(json_object_get(y, "drop_rate"));
        CHECK(dx == dy, "%s step %zu: drop_rate %g with ranks, %g in one process", name, s + 1, dx,
              dy);
        dropped += dx;
        json_t *lx = json_object_get(x, "layers"), *ly = json_object_get(y, "layers");
        CHECK(json_array_size(lx) > 0 && json_array_size(lx) == json_array_size(ly),
              "%s step %zu: layers", name, s + 1);
        for (size_t l = 0; l < json_array_size(lx) && l < json_array_size(ly); l++) {
            json_t *p = json_array_get(lx, l), *q = json_array_get(ly, l);
            CHECK(json_equal(json_object_get(p, "load"), json_object_get(q, "load")),
                  "%s step %zu layer %zu: load differs", name, s + 1, l);
            CHECK(json_equal(json_object_get(p, "drop_rate"), json_object_get(q, "drop_rate")),
                  "%s step %zu layer %zu: drop_rate differs", name, s + 1, l);
        }
    }
    CHECK(dropped > 0, "%s: no step dropped anything, the comparison proves nothing", name);
    json_decref(a);
    json_decref(b);
}

// Trains cfg on every rank (world) into out; losses of every step.
static int train_dist(moe_comm *world, moe_config c, const char *out, const char *resume,
                      long stop_after, double *losses) {
    moe_train_opts o = {.out_dir = out,
                        .resume_dir = resume,
                        .losses = losses,
                        .stop_after = stop_after,
                        .world = world};
    return mpi_train_with(rank, c, o, NULL, "distributed training");
}

// The single-process reference: the same global batch as grad_accum = W.
static int train_ref(moe_config c, const char *out, const char *resume, long stop_after,
                     double *losses) {
    c.parallel.ep = 1;
    c.train.grad_accum = W;
    moe_train_opts o = {
        .out_dir = out, .resume_dir = resume, .losses = losses, .stop_after = stop_after};
    return mpi_train_with(rank, c, o, NULL, "reference training");
}

static void cross_layouts(moe_comm *world, const char *dir, const char *name, moe_config c,
                          const double *full, const char *ref_half, const char *dist_half);

static void scenario(const char *dir, int ep, int ranks_per_node, const char *a2a, double tol) {
    moe_comm *world;
    if (moe_comm_mpi_world(&world, ranks_per_node)) {
        CHECK(0, "world: %s", moe_last_error());
        return;
    }
    char name[64], dist[800], ref[800], ck[900], ref_half[800], cross[800];
    snprintf(name, sizeof name, "ep%d-rpn%d-%s", ep, ranks_per_node, a2a);
    snprintf(dist, sizeof dist, "%s/%s-dist", dir, name);
    snprintf(ref, sizeof ref, "%s/%s-ref", dir, name);
    moe_config c = base(ep, a2a);
    double ld[STEPS] = {0}, lr[STEPS] = {0};
    train_dist(world, c, dist, NULL, 0, ld);
    if (rank == 0) {
        train_ref(c, ref, NULL, 0, lr);
        for (int s = 0; s < STEPS; s++) {
            if (tol == 0)
                CHECK(ld[s] == lr[s], "%s step %d: loss %.17g vs %.17g", name, s, ld[s], lr[s]);
            else
                CHECK(fabs(ld[s] - lr[s]) <= tol * fabs(lr[s]), "%s step %d: %.9g vs %.9g", name, s,
                      ld[s], lr[s]);
        }
        char a[900], b[900];
        snprintf(a, sizeof a, "%s/checkpoint", dist);
        snprintf(b, sizeof b, "%s/checkpoint", ref);
        compare_models(a, b, tol, name);
        if (tol == 0) routing_metrics_equal(dist, ref, name);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    // 1 process -> 4 ranks: the reference stops halfway, the ranks go on.
    snprintf(ref_half, sizeof ref_half, "%s/%s-ref-half", dir, name);
    snprintf(cross, sizeof cross, "%s/%s-cross", dir, name);
    if (rank == 0) train_ref(c, ref_half, NULL, STEPS / 2, NULL);
    MPI_Barrier(MPI_COMM_WORLD);
    snprintf(ck, sizeof ck, "%s/checkpoint", ref_half);
    train_dist(world, c, cross, ck, 0, NULL);
    // 4 ranks -> 1 process: the ranks stop halfway, the reference goes on.
    char dist_half[800], cross2[800];
    snprintf(dist_half, sizeof dist_half, "%s/%s-dist-half", dir, name);
    snprintf(cross2, sizeof cross2, "%s/%s-cross2", dir, name);
    train_dist(world, c, dist_half, NULL, STEPS / 2, NULL);
    if (rank == 0) {
        snprintf(ck, sizeof ck, "%s/checkpoint", dist_half);
        train_ref(c, cross2, ck, 0, NULL);
        char a[900], b[900];
        snprintf(a, sizeof a, "%s/checkpoint", ref);
        snprintf(b, sizeof b, "%s/checkpoint", cross);
        compare_models(a, b, tol, "1 process -> 4 ranks");
        snprintf(b, sizeof b, "%s/checkpoint", cross2);
        compare_models(a, b, tol, "4 ranks -> 1 process");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (ep == 4 && ranks_per_node == 0) cross_layouts(world, dir, name, c, ld, ref_half, dist_half);
    moe_comm_free(world);
}

// Any layout resumes any other bit for bit. The ep=4 half-way checkpoint
// (sharded: a shard per rank) and the one-process one (one file) hold the
// same bits, so every layout resumed from either must end with the same
// weights and losses: ep=4 equals the uninterrupted ep=4 run, and ep=2 x dp=2
// (two EP groups, each rank of the first writing its shard) resumed from
// either checkpoint gives identical runs.
static void cross_layouts(moe_comm *world, const char *dir, const char *name, moe_config c,
                          const double *full, const char *ref_half, const char *dist_half) {
    char ck1[900], ck4[900], out[1200], a[2048], b[2048];
    snprintf(ck1, sizeof ck1, "%s/checkpoint", ref_half);
    snprintf(ck4, sizeof ck4, "%s/checkpoint", dist_half);
    char idx[1000];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", ck4);
    CHECK(access(idx, F_OK) == 0, "%s: the ep=4 save is not sharded (no %s)", name, idx);
    // ep=4 -> ep=4: the losses of the resumed steps are those of the uninterrupted run.
    double l4[STEPS] = {0};
    snprintf(out, sizeof out, "%s/%s-resume4", dir, name);
    train_dist(world, c, out, ck4, 0, l4);
    for (int s = STEPS / 2; s < STEPS; s++)
        CHECK(l4[s] == full[s], "%s: ep=4 resumed step %d: loss %.17g vs %.17g", name, s, l4[s],
              full[s]);
    if (rank == 0) {
        snprintf(a, sizeof a, "%s/%s-dist/checkpoint", dir, name);
        snprintf(b, sizeof b, "%s/checkpoint", out);
        compare_models(a, b, 0, "4 ranks -> 4 ranks");
    }
    // ep=2 x dp=2 from the sharded and from the single-file checkpoint.
    moe_config c2 = c;
    c2.parallel.ep = 2;
    double la[STEPS] = {0}, lb[STEPS] = {0};
    char oa[1200], ob[1200];
    snprintf(oa, sizeof oa, "%s/%s-resume2-from4", dir, name);
    snprintf(ob, sizeof ob, "%s/%s-resume2-from1", dir, name);
    train_dist(world, c2, oa, ck4, 0, la);
    train_dist(world, c2, ob, ck1, 0, lb);
    for (int s = STEPS / 2; s < STEPS; s++)
        CHECK(la[s] == lb[s], "%s: ep=2 resumed step %d: loss %.17g (from ep=4) vs %.17g (from 1)",
              name, s, la[s], lb[s]);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        snprintf(a, sizeof a, "%s/checkpoint", oa);
        snprintf(b, sizeof b, "%s/checkpoint", ob);
        compare_models(a, b, 0, "4 ranks -> ep=2 vs 1 process -> ep=2");
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

// Data parallelism (parallel.ep = 1) through the GPU training path
// (trainer/train_gpu.c) run on the CPU op table: the device copy's gradients
// summed over the ranks give the losses of the host trainer on 4 ranks.
static void device_path_data_parallel(const char *dir) {
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        CHECK(0, "world: %s", moe_last_error());
        return;
    }
    moe_config c = base(1, "flat");
    moe_config_set(&c, NULL, "router.noise=none"); // not on the device path yet
    double host[STEPS] = {0}, dev[STEPS] = {0};
    char out[800];
    snprintf(out, sizeof out, "%s/dp-host", dir);
    train_dist(world, c, out, NULL, 0, host);
    snprintf(out, sizeof out, "%s/dp-device", dir);
    moe_train_opts o = {.out_dir = out, .losses = dev, .world = world, .device_ops = &moe_ops_cpu};
    mpi_train_with(rank, c, o, NULL, "device path, data parallel");
    for (int s = 0; s < STEPS; s++)
        CHECK(fabs(dev[s] - host[s]) <= 1e-6 * fabs(host[s]), "dp step %d: %.9g vs %.9g", s, dev[s],
              host[s]);
    MPI_Barrier(MPI_COMM_WORLD);
    moe_comm_free(world);
}

// moe plan's all-to-all bytes and messages equal the measured counters when
// every expert overflows its capacity (then every count is the capacity).
static void plan_matches_counters(const char *dir, moe_a2a_algo algo) {
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 2)) { // two simulated nodes of 2 ranks
        CHECK(0, "world: %s", moe_last_error());
        return;
    }
    moe_config c = base(4, algo == MOE_A2A_FLAT ? "flat" : "hierarchical");
    moe_config_set(&c, NULL, "capacity.mode=static");
    moe_config_set(&c, NULL, "router.capacity_factor=0.05"); // C = 1 of ~16 per expert
    moe_config_set(&c, NULL, "router.min_capacity=1");
    moe_config_set(&c, NULL, "train.batch_size=4");
    c.train.steps = 3;
    char out[800];
    snprintf(out, sizeof out, "%s/plan-%d", dir, (int)algo);
    moe_train_result r;
    mpi_train(rank, world, c, out, NULL, &r);
    moe_machine mc = {4, 2, 2, {400, 100}, {2, 5}};
    moe_a2a_plan p;
    CHECK(moe_plan_a2a(&c, &mc, algo, &p) == 0, "plan: %s", moe_last_error());
    CHECK(r.a2a_bytes == 3 * p.bytes && r.a2a_msgs == 3 * p.msgs,
          "%s: measured %ld bytes %ld messages over 3 steps, plan %ld and %ld per step",
          algo == MOE_A2A_FLAT ? "flat" : "hierarchical", r.a2a_bytes, r.a2a_msgs, p.bytes, p.msgs);
    if (rank == 0)
        printf("plan vs measured (%s, 3 steps): %ld bytes, %ld messages per step predicted; "
               "%ld, %ld measured\n",
               algo == MOE_A2A_FLAT ? "flat" : "hierarchical", p.bytes, p.msgs, r.a2a_bytes / 3,
               r.a2a_msgs / 3);
    moe_comm_free(world);
}

int main(int argc, char **argv) {
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_train", W, &rank, dir);
    if (rc) return rc;
    scenario(dir, 4, 0, "flat", 0);
    scenario(dir, 4, 2, "hierarchical", 0);
    scenario(dir, 2, 0, "flat", 1e-6);
    plan_matches_counters(dir, MOE_A2A_FLAT);
    plan_matches_counters(dir, MOE_A2A_HIERARCHICAL);
    device_path_data_parallel(dir);
    return mpi_test_end("mpi_train", rank);
}
