// Expert parallelism on the GPU training path (trainer/train_gpu.c) under
// `mpirun -np 2` and `-np 4` (argv: cpu|cuda and the rank count). The
// reference is one process with grad_accum = ranks, on the host.
//   cpu:  the device path on the CPU op table (its MoE layers are the host's,
//         exchanging through MPI; the trainer reduces as the host EP trainer)
//         with ep = ranks, and ep = 2 x dp = 2 on 4 ranks: losses and final
//         weights bit-identical to the host EP trainer, and to one process
//         (ep = ranks: bit-identical; ep = 2 x dp = 2: 1e-6 relative, the
//         expert gradients summed in another order, as tests/mpi_train.c);
//         and the CUDA layer's expert side (moe/src/moe_ep_rows.c) run on
//         moe_ops_cpu against the CPU layer's expert-parallel path
//   cuda: the CUDA MoE layer with ep = ranks, rows exchanged by MPI through
//         host buffers when ranks share a GPU (moe_gpu_local_device), by
//         NCCL when each has its own (the JSON line says which): 20
//         steps in fp32 within 1e-3 relative of one process on the CPU, the
//         tolerance of CUDA against the CPU in tests/test_train_gpu.c (sums
//         in other orders, compounding through AdamW); on 4 ranks also the
//         hierarchical exchange (2 simulated nodes of 2 ranks); each rank's
//         tracked device peak equals its `moe plan` device total; and data
//         parallelism (ep = 1) on the same ranks. Without
//         a CUDA device every rank exits 77 (ctest: skipped).
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/moe_ep_rows.h"
#include "moe/parallel.h"
#include "moe/plan.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"
#include "trainer/train_gpu.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

enum { CPU_STEPS = 6, GPU_STEPS = 20 };
static int rank, W;

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(int ep, int steps) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {
        "model.d_model=32",      "model.n_layers=2",          "model.d_ff=48",
        "model.seq_len=16",      "moe.num_experts=8",         "train.batch_size=2",
        "train.eval_every=0",    "train.warmup_steps=2",      "router.top_k=2",
        "capacity.mode=dynamic", "router.capacity_factor=1.0"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        CHECK(moe_config_set(&c, NULL, sets[i]) == 0, "%s: %s", sets[i], moe_last_error());
    c.train.steps = steps;
    c.parallel.ep = ep;
    return c;
}

// Every rank trains c over world into dir/name; device_ops NULL with
// train.device = cpu is the host trainer.
// Returns the run's tokens per second (all ranks), 0 on a failure.
static double train_ranks(moe_comm *world, moe_config c, const char *dir, const char *name,
                          const moe_ops *device_ops, double *losses) {
    char out[800];
    snprintf(out, sizeof out, "%s/%s", dir, name);
    moe_train_opts o = {.out_dir = out, .losses = losses, .world = world, .device_ops = device_ops};
    moe_train_result r;
    return mpi_train_with(rank, c, o, &r, name) == 0 ? r.tokens_per_s : 0;
}

// Rank 0 alone: ep = 1, grad_accum = W, on the host.
static void train_reference(moe_config c, const char *dir, const char *name, double *losses) {
    c.parallel.ep = 1;
    c.train.grad_accum = W;
    snprintf(c.train.device, sizeof c.train.device, "cpu");
    char out[800];
    snprintf(out, sizeof out, "%s/%s", dir, name);
    mpi_train_with(rank, c, (moe_train_opts){.out_dir = out, .losses = losses}, NULL, name);
}

static void same_losses(const double *a, const double *b, int n, double tol, const char *what) {
    for (int s = 0; s < n; s++)
        if (tol == 0)
            CHECK(a[s] == b[s], "%s step %d: %.17g vs %.17g", what, s, a[s], b[s]);
        else
            CHECK(fabs(a[s] - b[s]) <= tol * fabs(b[s]), "%s step %d: %.9g vs %.9g (tolerance %g)",
                  what, s, a[s], b[s], tol);
}

// The device path on the CPU table with parallel.ep = ep equals the host EP
// trainer bit for bit and one process within tol_ref.
static void device_path_expert_parallel(moe_comm *world, const char *dir, int ep, double tol_ref) {
    moe_config c = base(ep, CPU_STEPS);
    double host[CPU_STEPS] = {0}, dev[CPU_STEPS] = {0}, ref[CPU_STEPS] = {0};
    char hname[64], dname[64], rname[64];
    snprintf(hname, sizeof hname, "ep%d-host", ep);
    snprintf(dname, sizeof dname, "ep%d-device", ep);
    snprintf(rname, sizeof rname, "ep%d-ref", ep);
    train_ranks(world, c, dir, hname, NULL, host);
    train_ranks(world, c, dir, dname, &moe_ops_cpu, dev);
    same_losses(dev, host, CPU_STEPS, 0, "device path vs host EP trainer");
    char a[900], b[900];
    snprintf(a, sizeof a, "%s/%s", dir, dname);
    snprintf(b, sizeof b, "%s/%s", dir, hname);
    if (rank == 0) mpi_same_weights(rank, a, b);
    if (rank == 0) {
        train_reference(c, dir, rname, ref);
        same_losses(dev, ref, CPU_STEPS, tol_ref, "device path vs one process");
        printf("device path, ep=%d of %d ranks: step %d loss %.9g (host EP %.9g, one process "
               "%.9g)\n",
               ep, W, CPU_STEPS, dev[CPU_STEPS - 1], host[CPU_STEPS - 1], ref[CPU_STEPS - 1]);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

static int copy(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

// Largest |a - b| / max(|b|, 1e-3) over n floats.
static double max_rel(const float *a, const float *b, size_t n) {
    double w = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]) / fmax(fabs((double)b[i]), 1e-3);
        if (d > w) w = d;
    }
    return w;
}

// The expert side of the CUDA layer (moe/src/moe_ep_rows.c: exchange,
// per-source grouped GEMMs, per-source weight gradients) run on moe_ops_cpu
// with memcpy as its transfers, against the CPU layer's own expert parallel
// path on the same rows: the same expert outputs, input gradients and
// expert weight gradients (1e-5 relative: the CPU layer's fused expert op
// adds each source's weight gradient formed apart, the grouped GEMM
// accumulates in place). Top-2 routing with capacity 1.0 drops rows.
static void ep_rows_match_cpu_layer(moe_comm *world) {
    moe_config c = base(W, 1);
    moe_parallel par;
    CHECK(moe_parallel_init(&par, world, &c) == 0, "grid: %s", moe_last_error());
    moe_layer_config lc = {0};
    lc.T_max = 24, lc.D = 8, lc.H = 12, lc.E = 2 * W, lc.ep_size = W, lc.ep_rank = par.ep_rank;
    moe_router_config_default(&lc.router);
    lc.router.top_k = 2;
    lc.router.capacity_factor = 1.0;
    const int T = lc.T_max, D = lc.D;
    const size_t np = moe_layer_num_params(&lc), rows_max = (size_t)T * 2;
    float *pb = calloc(np, 4), *g_cpu = calloc(np, 4), *g_ep = calloc(np, 4);
    float *x = calloc((size_t)T * D, 4), *y = calloc((size_t)T * D, 4);
    float *dy = calloc((size_t)T * D, 4), *dx = calloc((size_t)T * D, 4);
    float *ye = calloc(rows_max * D, 4), *dxe = calloc(rows_max * D, 4);
    tu_rng rng;
    tu_seed(&rng, 1000 + (uint64_t)rank);
    tu_fill_normal(&rng, pb, np, 0.5f);
    tu_fill_normal(&rng, x, (size_t)T * D, 1.0f);
    tu_fill_normal(&rng, dy, (size_t)T * D, 1.0f);
    moe_layer_params p, gc, ge;
    moe_layer_params_view(&p, pb, &lc);
    moe_layer_params_view(&gc, g_cpu, &lc);
    moe_layer_params_view(&ge, g_ep, &lc);
    moe_layer_acts a;
    moe_ep_rows r;
    CHECK(moe_layer_acts_alloc(&a, &lc, &moe_ops_cpu) == 0, "acts: %s", moe_last_error());
    CHECK(moe_ep_rows_alloc(&r, &lc, &moe_ops_cpu, &(moe_ep_backend){.down = copy, .up = copy}) ==
              0,
          "rows: %s", moe_last_error());
    a.ep = r.ep = &par.group;
    CHECK(moe_layer_forward(y, x, NULL, NULL, T, &p, &a, false, 0) == 0, "forward: %s",
          moe_last_error());
    const int rows = a.plan.offsets[lc.E];
    int dropped = 0;
    for (int e = 0; e < lc.E; e++)
        dropped += a.plan.counts[e] - a.plan.kept[e];
    CHECK(moe_ep_rows_forward(&r, ye, a.xe, a.plan.offsets, &p) == 0, "ep forward: %s",
          moe_last_error());
    const double fwd = max_rel(ye, a.ye, (size_t)rows * D);
    CHECK(fwd <= 1e-5, "rank %d: expert outputs differ by %.3g", rank, fwd);
    CHECK(moe_layer_backward(dx, &gc, dy, x, NULL, T, &p, &a, 0, 0) == 0, "backward: %s",
          moe_last_error());
    CHECK(moe_ep_rows_backward(&r, dxe, a.dye, &ge, &p) == 0, "ep backward: %s", moe_last_error());
    const size_t ne = (size_t)moe_layer_local_experts(&lc) * p.expert_numel;
    const double bx = max_rel(dxe, a.dxe, (size_t)rows * D),
                 bw = max_rel(ge.experts, gc.experts, ne);
    CHECK(bx <= 1e-5 && bw <= 1e-5, "rank %d: input gradients differ by %.3g, weights by %.3g",
          rank, bx, bw);
    if (rank == 0)
        printf("expert rows on moe_ops_cpu vs the CPU layer, %d ranks: %d rows here, %d dropped; "
               "max rel diff %.3g (ye), %.3g (dxe), %.3g (expert grads)\n",
               W, rows, dropped, fwd, bx, bw);
    moe_ep_rows_free(&r);
    // comm.overlap_degree: the exchange in d rounds of peers (d = W: one peer a
    // round; W = 4 also 3 uneven rounds) gives the same bits as one exchange
    float *ye2 = calloc(rows_max * D, 4), *dxe2 = calloc(rows_max * D, 4), *g2 = calloc(np, 4);
    for (int d = 2; d <= W; d++) {
        moe_layer_config ld = lc;
        ld.overlap_degree = d;
        moe_layer_params g2v;
        moe_layer_params_view(&g2v, g2, &ld);
        memset(g2, 0, np * 4);
        CHECK(moe_ep_rows_alloc(&r, &ld, &moe_ops_cpu,
                                &(moe_ep_backend){.down = copy, .up = copy}) == 0,
              "rows d=%d: %s", d, moe_last_error());
        r.ep = &par.group;
        CHECK(moe_ep_rows_forward(&r, ye2, a.xe, a.plan.offsets, &p) == 0, "d=%d forward: %s", d,
              moe_last_error());
        CHECK(moe_ep_rows_backward(&r, dxe2, a.dye, &g2v, &p) == 0, "d=%d backward: %s", d,
              moe_last_error());
        CHECK(!memcmp(ye2, ye, (size_t)rows * D * 4) && !memcmp(dxe2, dxe, (size_t)rows * D * 4) &&
                  !memcmp(g2, g_ep, np * 4),
              "rank %d: overlap degree %d changed the bits", rank, d);
        moe_ep_rows_free(&r);
    }
    moe_layer_config bad = lc;
    bad.overlap_degree = W + 1;
    CHECK(moe_ep_rows_alloc(&r, &bad, &moe_ops_cpu, &(moe_ep_backend){.down = copy, .up = copy}) ==
                  MOE_EINVAL &&
              strstr(moe_last_error(), "comm.overlap_degree"),
          "overlap degree %d of %d ranks: %s", W + 1, W, moe_last_error());
    moe_ep_rows_free(&r);
    free(ye2), free(dxe2), free(g2);
    moe_layer_acts_free(&a);
    moe_parallel_free(&par);
    free(pb), free(g_cpu), free(g_ep), free(x), free(y), free(dy), free(dx), free(ye), free(dxe);
}

// The exchange the GPU trainer picks: NCCL only when no two ranks name the
// same device on the same host.
static void devices_distinct_by_host_and_index(moe_comm *world) {
    bool d = false;
    CHECK(moe_gpu_devices_distinct(world, rank, &d) == 0 && d, "device = rank: not distinct");
    CHECK(moe_gpu_devices_distinct(world, 0, &d) == 0 && !d, "device 0 on every rank: distinct");
    CHECK(moe_gpu_devices_distinct(world, rank == W - 1 ? 0 : rank, &d) == 0 && !d,
          "the last rank shares device 0: distinct");
}

// The CUDA MoE layer with parallel.ep = ep against one process on the CPU,
// the exchange flat or hierarchical (a2a); ep = 1 is data parallelism (on a
// shared GPU its gradients are summed through host memory too).
static void cuda_expert_parallel(moe_comm *world, const char *dir, const char *a2a, int ep) {
    moe_config c = base(ep, GPU_STEPS);
    snprintf(c.comm.all_to_all, sizeof c.comm.all_to_all, "%s", a2a);
    snprintf(c.train.device, sizeof c.train.device, "cuda");
    snprintf(c.train.compute, sizeof c.train.compute, "fp32");
    double gpu[GPU_STEPS] = {0}, ref[GPU_STEPS] = {0};
    bool nccl = false; // the trainer's choice: NCCL when no two ranks share a GPU
    CHECK(moe_gpu_devices_distinct(world, moe_gpu_local_device(), &nccl) == 0, "%s",
          moe_last_error());
    char name[64];
    snprintf(name, sizeof name, "cuda-ep%d-%s", ep, a2a);
#ifdef MOE_HAVE_CUDA
    // every rank's tracked device peak is its plan (moe plan with parallel.ep);
    // the plan's cub size query opens a context, so on this rank's device
    CHECK(moe_cuda_init(moe_gpu_local_device()) == 0, "%s", moe_last_error());
    moe_gpu_mem_plan plan;
    CHECK(moe_plan_device_memory(&c, NULL, &plan) == 0, "plan: %s", moe_last_error());
    const size_t base = moe_cuda_mem_in_use();
    moe_cuda_mem_reset_peak();
#endif
    const double tps = train_ranks(world, c, dir, name, NULL, gpu);
#ifdef MOE_HAVE_CUDA
    const size_t peak = moe_cuda_mem_peak() - base;
    CHECK(peak == plan.total, "rank %d: tracked device peak %zu bytes, plan %zu", rank, peak,
          plan.total);
    CHECK(moe_cuda_mem_in_use() == base, "rank %d: %zu device bytes not freed", rank,
          moe_cuda_mem_in_use() - base);
#endif
    if (rank == 0) {
        snprintf(name, sizeof name, "cuda-ref-ep%d-%s", ep, a2a);
        train_reference(c, dir, name, ref);
        double worst = 0;
        for (int s = 0; s < GPU_STEPS; s++)
            if (fabs(gpu[s] - ref[s]) / fabs(ref[s]) > worst)
                worst = fabs(gpu[s] - ref[s]) / fabs(ref[s]);
        same_losses(gpu, ref, GPU_STEPS, 1e-3, "CUDA EP vs one process on the CPU");
        char dev[128] = "?";
#ifdef MOE_HAVE_CUDA
        int sms;
        double gbps;
        moe_cuda_device_info(dev, sizeof dev, &sms, &gbps);
#endif
        printf("{\"test\": \"mpi_gpu_ep\", \"device\": \"%s\", \"ranks\": %d, \"ep\": %d, "
               "\"exchange\": \"%s\", "
               "\"all_to_all\": \"%s\", "
               "\"steps\": %d, \"max_rel_loss_diff\": %.3g, \"first_loss\": %.6f, "
               "\"last_loss\": %.6f, \"tokens_per_s\": %.1f}\n",
               dev, W, ep, nccl ? "nccl" : "host-staged", a2a, GPU_STEPS, worst, gpu[0],
               gpu[GPU_STEPS - 1], tps);
    }
    MPI_Barrier(MPI_COMM_WORLD);
}

// 1 when every rank sees a CUDA device (ranks may share it), else prints why
// on rank 0.
// comm.overlap_degree on the GPU (issue 14 item 2): the exchange in rounds of
// peers overlapped with the expert GEMMs gives the same losses bit for bit as
// one exchange; tokens/s of both runs in one JSON line (ranks share the GPU:
// the host-staged exchange).
static void cuda_overlap_same_bits(moe_comm *world, const char *dir) {
    double one[GPU_STEPS] = {0}, rounds[GPU_STEPS] = {0};
    moe_config c = base(W, GPU_STEPS);
    snprintf(c.train.device, sizeof c.train.device, "cuda");
    snprintf(c.train.compute, sizeof c.train.compute, "fp32");
    const double t1 = train_ranks(world, c, dir, "cuda-overlap1", NULL, one);
    c.comm.overlap_degree = W;
    const double tw = train_ranks(world, c, dir, "cuda-overlapW", NULL, rounds);
    same_losses(rounds, one, GPU_STEPS, 0, "overlap degree W vs 1");
    if (rank == 0) {
        char dev[128] = "?";
#ifdef MOE_HAVE_CUDA
        moe_cuda_device_info(dev, sizeof dev, NULL, NULL);
#endif
        printf("{\"test\": \"mpi_gpu_ep_overlap\", \"device\": \"%s\", \"ranks\": %d, "
               "\"ep\": %d, \"steps\": %d, \"tokens_per_s_overlap1\": %.1f, "
               "\"tokens_per_s_overlap%d\": %.1f, \"same_bits\": %s}\n",
               dev, W, W, GPU_STEPS, t1, W, tw, memcmp(one, rounds, sizeof one) ? "false" : "true");
    }
}

static int cuda_present(void) {
    int ok = 0;
    char why[256] = "built without CUDA";
#ifdef MOE_HAVE_CUDA
    ok = moe_cuda_device_count(why, sizeof why) > 0;
#endif
    int all_ok;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok && rank == 0) printf("SKIP: mpi_gpu_ep cuda needs a CUDA device (%s)\n", why);
    return all_ok;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    const int want = argc > 2 ? atoi(argv[2]) : 0;
    if (strcmp(mode, "cpu") && strcmp(mode, "cuda")) {
        fprintf(stderr, "usage: mpirun -np N mpi_gpu_ep cpu|cuda N\n");
        return 2;
    }
    char dir[512];
    int rc = mpi_test_begin(&argc, &argv, "mpi_gpu_ep", want, &rank, dir);
    if (rc) return rc;
    W = want;
    if (!strcmp(mode, "cuda") && !cuda_present()) {
        MPI_Finalize();
        return 77;
    }
    moe_comm *world;
    if (moe_comm_mpi_world(&world, 0)) {
        CHECK(0, "world: %s", moe_last_error());
        return mpi_test_end("mpi_gpu_ep", rank);
    }
    if (!strcmp(mode, "cpu")) {
        devices_distinct_by_host_and_index(world);
        ep_rows_match_cpu_layer(world);
        device_path_expert_parallel(world, dir, W, 0);
        if (W == 4) device_path_expert_parallel(world, dir, 2, 1e-6);
    } else {
        cuda_expert_parallel(world, dir, "flat", W);
        cuda_expert_parallel(world, dir, "flat", 1);
        cuda_overlap_same_bits(world, dir);
    }
    moe_comm_free(world);
    if (!strcmp(mode, "cuda") && W == 4) { // two simulated nodes of 2 ranks
        if (moe_comm_mpi_world(&world, 2)) {
            CHECK(0, "world: %s", moe_last_error());
            return mpi_test_end("mpi_gpu_ep", rank);
        }
        cuda_expert_parallel(world, dir, "hierarchical", W);
        moe_comm_free(world);
    }
    return mpi_test_end("mpi_gpu_ep", rank);
}
