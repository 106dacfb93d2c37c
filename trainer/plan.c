// Memory and communication plan of a run (see moe/plan.h). Memory comes from
// the layouts the trainer allocates (moe_model_memory and the buffers of the
// loop), communication from the all-to-all algorithm's traffic formulas.
#include "moe/plan.h"
#include "kernels/cpu/cpu.h"
#include "moe/checkpoint.h"
#include "moe/cuda_sizes.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/model.h"
#include "moe/placement.h"
#include "moe/router.h"
#include "moe/task_experts.h"
#include "moe/train.h"
#include "trainer/train_gpu.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

// "s" after a count other than 1: "1 rank", "2 ranks".
static const char *plural(long n) {
    return n == 1 ? "" : "s";
}

// placement.mode = replicate | move: per MoE layer the table, the replicas' weights
// and gradients, the dispatch scratch (trainer/placement.c's allocations);
// the load EMA and the step's load; and the staging of the replica gradients at its largest,
// every spare slot a distinct expert, or under move the migration's (every
// home expert out and in, with both moments) when larger (an upper bound).
static size_t placement_bytes(const moe_config *cfg, int B, int T) {
    const int P = cfg->parallel.ep, S0 = cfg->placement.slots_per_rank;
    if (!strcmp(cfg->placement.mode, "static") || P < 2) return 0;
    const bool move = !strcmp(cfg->placement.mode, "move");
    const bool bf16 = !strcmp(cfg->train.optimizer_state, "bf16");
    size_t b = 0, stage = 0, mig = 0, n_moe = 0, E_max = 0;
    const size_t D = (size_t)cfg->model.d_model;
    const size_t H = cfg->moe.d_expert ? (size_t)cfg->moe.d_expert : (size_t)cfg->model.d_ff;
    for (int l = 0; l < cfg->model.n_layers; l++) {
        const int E = moe_config_experts(cfg, l);
        if (!E) continue;
        const int S = S0 > E / P ? S0 : E / P;
        const size_t X = (size_t)(S - E / P), numel = 3 * H * D, PS = (size_t)P * S;
        const size_t rows = (size_t)moe_router_rows_max(&cfg->router, B * T, E);
        b += sizeof(moe_place_layer) + (PS + (size_t)E + (size_t)E * P) * sizeof(int);
        b += 2 * (X * numel + 1) * sizeof(float) + (rows * D + 1) * sizeof(float);
        b += (5 * PS + 2 * (size_t)P + (size_t)E) * sizeof(int); // + this source's capacities
        // migrate's unit: the weights and both moments (bf16: in numel floats)
        const size_t unit = bf16 ? 2 * numel : 3 * numel;
        const size_t st = (X * P < (size_t)E ? X * P : (size_t)E) * numel,
                     mv = move ? 2 * (size_t)(E / P) * unit + 1 : 0;
        stage += st, mig = mv > mig ? mv : mig;
        n_moe++, E_max = (size_t)E > E_max ? (size_t)E : E_max;
    }
    stage = mig > stage ? mig : stage; // one buffer serves both
    // the load EMA and the step's accumulated load
    return b + (n_moe * E_max + 1 + n_moe * E_max + MOE_MAX_LAYERS + 1) * sizeof(double) +
           stage * sizeof(float);
}

// The dedup_G of rank's expert-parallel group under comm.node_dedup (0: off)
// on nodes of g consecutive ranks (g <= 0: all ranks on one node), as the
// communicator finds it (comm/topology.c): the ranks of the group's first
// node, when every node of the group holds as many and no node two runs.
static int plan_dedup_G(const moe_config *cfg, int rank, int g) {
    const int ep = cfg->parallel.ep, base = rank - rank % ep;
    if (!cfg->comm.node_dedup || ep < 2) return 0;
    if (g <= 0) return ep;
    int G = 1;
    while (G < ep && (base + G) / g == base / g)
        G++;
    if (ep % G) return 1;
    for (int r = 0; r < ep; r++) {
        const int lead = r - r % G;
        if ((base + r) / g != (base + lead) / g) return 1;
    }
    return G;
}

static int plan_memory(const moe_config *cfg, int world, int rank, int ranks_per_node,
                       moe_mem_plan *out) {
    memset(out, 0, sizeof *out);
    MOE_TRY(moe_config_check(cfg, NULL));
    const int ep = cfg->parallel.ep, B = cfg->train.batch_size, T = cfg->model.seq_len;
    if (world < 1 || world % ep || rank < 0 || rank >= world)
        return moe_fail(MOE_EINVAL, "plan: %d rank%s cannot hold expert-parallel groups of %d",
                        world, plural(world), ep);
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    int n_tasks = moe_config_task_names(cfg, names);
    moe_model_mem mm;
    MOE_TRY(moe_model_memory(cfg, B, T, n_tasks, ep, rank % ep,
                             plan_dedup_G(cfg, rank, ranks_per_node), &mm));
    const size_t n = mm.n_params;
    out->n_params = n;
    out->params = mm.params;
    out->grads = mm.grads;
    // m, v as train.optimizer_state stores them (the decay ranges are a few words)
    const size_t mom = strcmp(cfg->train.optimizer_state, "bf16") ? sizeof(float) : 2;
    out->optimizer = 2 * (n ? n : 1) * mom;
    out->activations = mm.activations;
    out->moe = mm.moe;
    out->step = 2 * (size_t)B * T * sizeof(int32_t) + (size_t)B * sizeof(int32_t) +
                (cfg->train.grad_accum > 1 ? n : 1) * sizeof(float);
    // A save finds each token-routed layer's task experts (moe_task_route):
    // one router plan of n_tasks rows at a time, alive with all of the above.
    size_t route = 0;
    for (int i = 0; i < cfg->moe.n_task_layers; i++) {
        const int l = cfg->moe.task_layers[i];
        const size_t b = moe_plan_bytes(n_tasks, moe_config_experts(cfg, l), cfg->router.top_k);
        route = b > route ? b : route;
    }
    out->step += route;
    int stride;
    const size_t routing = moe_train_routing_len(cfg, &stride);
    out->step += sizeof(int64_t) * (routing ? routing : 1); // the step's routing counts
    out->data = 0; // token files are memory-mapped (page cache), not allocated
    // The all-reduce staging grows to the larger of the dense gradients
    // (summed over the world) and the expert gradients (over the DP group).
    size_t expert = 0;
    for (int l = 0; l < cfg->model.n_layers; l++) {
        int E = moe_config_experts(cfg, l);
        size_t H = cfg->moe.d_expert ? cfg->moe.d_expert : cfg->model.d_ff;
        expert += (size_t)(E / ep) * 3 * H * cfg->model.d_model;
    }
    size_t pack = 0;
    if (world > 1) pack = n - expert;
    if (world / ep > 1 && expert > pack) pack = expert;
    out->grad_pack = pack * sizeof(float);
    // The asynchronous save's snapshot (moe/checkpoint.h): on the ranks that
    // write tensors, a copy of the parameters and both moments (as stored).
    if (cfg->train.async_checkpoint && moe_ckpt_writes_tensors(rank, ep))
        out->ckpt_snapshot = n * (sizeof(float) + 2 * mom);
    out->moe += placement_bytes(cfg, B, T);
    out->total = out->params + out->grads + out->optimizer + out->activations + out->moe +
                 out->step + out->data + out->grad_pack + out->ckpt_snapshot;
    return 0;
}

int moe_plan_memory(const moe_config *cfg, int world, int rank, moe_mem_plan *out) {
    return plan_memory(cfg, world, rank, cfg->comm.ranks_per_node, out);
}

int moe_plan_device_memory(const moe_config *cfg, const moe_ops *ops, moe_gpu_mem_plan *out) {
    memset(out, 0, sizeof *out);
    MOE_TRY(moe_config_check(cfg, NULL));
    if (!ops) ops = &moe_ops_cuda_sizes;
    if (strcmp(cfg->train.optimizer_state, "fp32"))
        return moe_fail(MOE_EINVAL, "train.optimizer_state = bf16: the GPU trainer keeps fp32 "
                                    "moments (use train.optimizer_state = fp32)");
    const int B = cfg->train.batch_size, T = cfg->model.seq_len;
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    int n_tasks = moe_config_task_names(cfg, names);
    moe_model_mem mm;
    MOE_TRY(moe_model_device_memory(cfg, B, T, n_tasks, ops, &mm));
    out->params = mm.params;
    out->grads = mm.grads;
    out->activations = mm.activations;
    out->moe = mm.moe;
    const size_t all = moe_gpu_trainer_bytes(mm.n_params, (size_t)B * T, ops, &out->optimizer);
    out->trainer = all - out->optimizer;
    out->total =
        out->params + out->grads + out->optimizer + out->activations + out->moe + out->trainer;
    if (out->moe) {
        bool exact = true;
        moe_cuda_sort_tmp_bytes(B * T, &exact);
        out->sort_tmp_estimated = !exact;
    }
    return 0;
}

// Bytes and messages of one all-to-all call with c elements of es bytes to
// every peer, over P ranks in nodes of G (the formulas of comm.h's
// moe_comm_a2a_predict for a uniform count matrix), and its alpha-beta time.
static void a2a_call(long c, size_t es, int P, int G, moe_a2a_algo algo, const moe_machine *mc,
                     long *bytes, long *msgs, double *sec, long *cross) {
    const int N = P / G;
    const double a[2] = {mc->latency_us[0] * 1e-6, mc->latency_us[1] * 1e-6};
    const double b[2] = {8.0 / (mc->gbps[0] * 1e9), 8.0 / (mc->gbps[1] * 1e9)}; // s per byte
    if (c <= 0 || P == 1) return;
    if (algo == MOE_A2A_FLAT || G == 1 || G == P) {
        long per = c * (long)es;
        int intra = G - 1, inter = P - G; // peers on my node, on other nodes
        *bytes += per * (P - 1);
        *cross += per * (P - G);
        *msgs += P - 1;
        *sec += intra * (a[0] + per * b[0]) + inter * (a[1] + per * b[1]);
        return;
    }
    // step 1: to each local peer, my rows for its index on every node (N c);
    // step 2: to each other node, my node's rows for my index there (G c).
    long s1 = (long)N * c * (long)es, s2 = (long)G * c * (long)es;
    *bytes += s1 * (G - 1) + s2 * (N - 1);
    *cross += s2 * (N - 1);
    *msgs += (G - 1) + (N - 1);
    *sec += (G - 1) * (a[0] + s1 * b[0]) + (N - 1) * (a[1] + s2 * b[1]);
}

// One node-deduplicated dispatch (comm.node_dedup, moe/src/moe_dispatch_node.c)
// of `rows` per-choice rows to every rank, whose tokens (`tokens` per rank)
// reach rn other nodes each: to each other node one row per token that goes
// there (and, with the rows to the experts, an index: G counts and 8 bytes per
// choice), then each rank forwards its N source nodes' rows to its G - 1
// local peers. Either algorithm: both send these sparse counts directly.
static void dedup_call(long rows, long tokens, double rn, bool index, size_t rb, int P, int G,
                       const moe_machine *mc, long *bytes, long *msgs, double *sec, long *cross) {
    const int N = P / G;
    const double a[2] = {mc->latency_us[0] * 1e-6, mc->latency_us[1] * 1e-6};
    const double b[2] = {8.0 / (mc->gbps[0] * 1e9), 8.0 / (mc->gbps[1] * 1e9)};
    if (rows <= 0 || P == 1) return;
    long x = llround(tokens * rn * (double)rb), xi = 0; // across nodes, all nodes together
    if (index) xi = (long)(N - 1) * G * (long)sizeof(int) + 2L * rows * (P - G) * (long)sizeof(int);
    const long in = (long)N * rows * (long)rb; // to each local peer
    *bytes += x + xi + in * (G - 1);
    *cross += x + xi;
    *msgs += (N - 1) * (index ? 2 : 1) + (G - 1);
    if (N > 1) *sec += (N - 1) * a[1] * (index ? 2 : 1) + (double)(x + xi) * b[1];
    *sec += (G - 1) * (a[0] + in * b[0]);
}

// log C(n, r) (r <= n), for the ratios of binomials below.
static double lchoose(int n, int r) {
    return lgamma(n + 1.0) - lgamma(r + 1.0) - lgamma(n - r + 1.0);
}

// Expected nodes other than its own reached by a token's k choices, when the
// experts (E / N per node, E / ng per group, consecutive) are equally likely:
// the token's tg groups are any tg of ng, its k experts any k of theirs
// (tg = 0: every group). A remote node m is missed with probability
//   ng >= N: sum_j P(j of m's ng/N groups chosen) C(tg s - j s, k) / C(tg s, k)
//   ng <  N: 1 - tg/ng + tg/ng C(tg s - E/N, k) / C(tg s, k)
// with s = E / ng. -1 when groups and nodes do not nest.
static double remote_nodes(int E, int k, int N, int ng, int tg) {
    if (tg <= 0 || tg >= ng) ng = 1, tg = 1; // no limit: one group of every expert
    const int s = E / ng, pool = tg * s;
    if (N < 1 || E % N || E % ng || pool < k || (ng >= N ? ng % N : N % ng)) return -1;
    double miss = 0.0;
    if (ng >= N) {
        const int t = ng / N;
        for (int j = 0; j <= t && j <= tg; j++) {
            if (tg - j > ng - t || pool - j * s < k) continue;
            double pj = exp(lchoose(t, j) + lchoose(ng - t, tg - j) - lchoose(ng, tg));
            miss += pj * exp(lchoose(pool - j * s, k) - lchoose(pool, k));
        }
    } else {
        const double pick = (double)tg / ng;
        const int w = E / N;
        miss =
            1.0 - pick + (pool - w >= k ? pick * exp(lchoose(pool - w, k) - lchoose(pool, k)) : 0);
    }
    return (N - 1) * (1.0 - miss);
}

int moe_plan_a2a(const moe_config *cfg, const moe_machine *mc, moe_a2a_algo algo,
                 moe_a2a_plan *out) {
    memset(out, 0, sizeof *out);
    const int P = cfg->parallel.ep, G0 = mc->ranks_per_node;
    if (mc->world % P)
        return moe_fail(MOE_EINVAL, "plan: parallel.ep = %d does not divide %d rank%s", P,
                        mc->world, plural(mc->world));
    // Nodes as the EP group (P consecutive ranks) sees them.
    int G = P <= G0 ? (G0 % P == 0 ? P : 1) : (P % G0 == 0 ? G0 : 1);
    const long tokens = (long)cfg->train.batch_size * cfg->model.seq_len;
    const int k = cfg->router.top_k, N = P / G;
    // router.n_groups = 0: one group per node, as the trainer resolves it
    out->nodes = N;
    out->n_groups = cfg->router.n_groups ? cfg->router.n_groups : N;
    out->topk_groups = cfg->router.topk_groups < out->n_groups ? cfg->router.topk_groups : 0;
    out->remote_nodes = 0;
    for (int l = 0; l < cfg->model.n_layers; l++) {
        const int E = moe_config_experts(cfg, l);
        if (!E || P == 1) continue;
        double rn = remote_nodes(E, k, N, out->n_groups, out->topk_groups);
        if (rn < 0 || out->remote_nodes < 0) {
            out->remote_nodes = -1;
        } else {
            out->remote_nodes = rn; // the last MoE layer's (equal when E is)
            out->bytes_inter_node_copy += (long)llround(4.0 * cfg->train.grad_accum * tokens * rn *
                                                        cfg->model.d_model * sizeof(float));
        }
        int C = cfg->router.type == MOE_ROUTER_EXPERT_CHOICE
                    ? moe_expert_choice_capacity(&cfg->router, (int)tokens, E)
                    : moe_capacity_static(&cfg->router, (int)tokens, E);
        if (C < 0) C = (int)((k * tokens + E - 1) / E); // dropless: balanced estimate
        const long El = E / P, rows = El * C;
        const size_t row_bytes = (size_t)cfg->model.d_model * sizeof(float);
        const bool dedup = cfg->comm.node_dedup && rn >= 0;
        out->node_dedup = cfg->comm.node_dedup;
        for (int a = 0; a < cfg->train.grad_accum; a++) {
            a2a_call(El, sizeof(int), P, G, algo, mc, &out->bytes, &out->msgs, &out->seconds,
                     &out->bytes_inter);
            for (int i = 0; i < 4; i++) {  // rows out, back; in backward the same two
                if (dedup && i % 2 == 0) { // to the experts: rows, then dy
                    dedup_call(rows, tokens, rn, i == 0, row_bytes, P, G, mc, &out->bytes,
                               &out->msgs, &out->seconds, &out->bytes_inter);
                    out->calls += i == 0 ? 2 : 1;
                    continue;
                }
                a2a_call(rows, row_bytes, P, G, algo, mc, &out->bytes, &out->msgs, &out->seconds,
                         &out->bytes_inter);
            }
            out->calls += 5;
        }
    }
    return 0;
}

// The first number of a one-line file; false when missing or "max".
static bool read_bytes(const char *path, unsigned long long *v) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fscanf(f, "%llu", v) == 1;
    fclose(f);
    return ok;
}

int moe_plan_mem_available(size_t *bytes, char *source, size_t n) {
    unsigned long long best = 0, lim, used;
    bool have = false;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                best = kb * 1024, have = true;
                snprintf(source, n, "MemAvailable in /proc/meminfo");
                break;
            }
        fclose(f);
    }
    static const char *const cg[2][3] = {
        {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "cgroup memory.max"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes", "cgroup memory.limit_in_bytes"}};
    for (int i = 0; i < 2; i++) {
        if (!read_bytes(cg[i][0], &lim)) continue; // absent, or "max" (no limit)
        if (!read_bytes(cg[i][1], &used)) used = 0;
        unsigned long long room = lim > used ? lim - used : 0;
        // v1 reports "no limit" as a huge page-rounded number: min() drops it.
        if (!have || room < best) {
            best = room, have = true;
            snprintf(source, n, "%s minus current usage", cg[i][2]);
        }
        break;
    }
    if (!have) return moe_fail(MOE_ENOTFOUND, "available memory: no /proc/meminfo nor cgroup");
    *bytes = best > SIZE_MAX ? SIZE_MAX : (size_t)best;
    return 0;
}

static double mib(size_t b) {
    return b / 1048576.0;
}

// train.device = cuda: the device memory of each rank, or why it is not computed.
static int device_print(const moe_config *cfg, FILE *f) {
    moe_gpu_mem_plan g;
    fprintf(f, "\ndevice memory per rank (train.device = cuda), MiB:\n");
    if (moe_plan_device_memory(cfg, NULL, &g) < 0) {
        fprintf(f, "  not computed: %s\n", moe_last_error());
        return 0;
    }
    fprintf(f, "  %-34s %10.2f\n", "parameters", mib(g.params));
    fprintf(f, "  %-34s %10.2f\n", "gradients", mib(g.grads));
    fprintf(f, "  %-34s %10.2f\n", "optimizer (AdamW m, v, decay mask)", mib(g.optimizer));
    fprintf(f, "  %-34s %10.2f  (attention probabilities [B, Hq, T, T])\n", "activations (dense)",
            mib(g.activations));
    fprintf(f, "  %-34s %10.2f%s\n", "MoE layers and router plans", mib(g.moe),
            g.sort_tmp_estimated ? "  (cub sort temp estimated: no CUDA device here)" : "");
    fprintf(f, "  %-34s %10.2f\n", "trainer token buffers", mib(g.trainer));
    fprintf(f, "  %-34s %10.2f  (%zu bytes)\n", "total (predicted peak)", mib(g.total), g.total);
    fprintf(f,
            "  (the backend's allocations, 256-byte granules, as moe_cuda_mem_peak counts them;\n"
            "  not counted: the CUDA context, cuBLAS workspace, NCCL, per-op cudaMallocAsync "
            "scratch)\n");
    return 0;
}

int moe_plan_print(const moe_config *cfg, const moe_machine *mc, FILE *f) {
    moe_mem_plan m;
    MOE_TRY(plan_memory(cfg, mc->world, 0, mc->ranks_per_node, &m));
    const int ep = cfg->parallel.ep;
    fprintf(f, "plan: %d node%s x %d rank%s = %d rank%s; expert parallel %d x data parallel %d\n",
            mc->nodes, plural(mc->nodes), mc->ranks_per_node, plural(mc->ranks_per_node), mc->world,
            plural(mc->world), ep, mc->world / ep);
    fprintf(f, "\nmemory per rank (every rank the same), MiB:\n");
    fprintf(f, "  %-34s %10.2f  (%zu parameters)\n", "parameters", mib(m.params), m.n_params);
    fprintf(f, "  %-34s %10.2f\n", "gradients", mib(m.grads));
    fprintf(f, "  %-34s %10.2f\n", "optimizer (AdamW m, v)", mib(m.optimizer));
    if (!strcmp(cfg->train.device, "cpu")) // its attention scratch has one slot per thread
        fprintf(f, "  %-34s %10.2f  (attention scratch for %d CPU thread%s: this machine's)\n",
                "activations (dense)", mib(m.activations), moe_cpu_threads(),
                plural(moe_cpu_threads()));
    else
        fprintf(f, "  %-34s %10.2f\n", "activations (dense)", mib(m.activations));
    fprintf(f, "  %-34s %10.2f\n", "MoE routing and expert buffers", mib(m.moe));
    fprintf(f, "  %-34s %10.2f\n", "step buffers", mib(m.step));
    fprintf(f, "  %-34s %10.2f\n", "data", mib(m.data));
    fprintf(f, "  %-34s %10.2f\n", "gradient all-reduce staging", mib(m.grad_pack));
    if (m.ckpt_snapshot) // rank 0's figure: ranks that write no tensor file hold none
        fprintf(f, "  %-34s %10.2f  (ranks writing tensor files)\n", "async checkpoint snapshot",
                mib(m.ckpt_snapshot));
    fprintf(f, "  %-34s %10.2f  (%zu bytes)\n", "total (predicted peak)", mib(m.total), m.total);
    if (!strcmp(cfg->train.device, "cuda")) MOE_TRY(device_print(cfg, f));
    if (ep == 1) {
        fprintf(f, "\nall-to-all: none (parallel.ep = 1: every expert is local)\n");
        return 0;
    }
    fprintf(f,
            "\nall-to-all per optimizer step per rank (links: intra %g Gb/s %g us, inter "
            "%g Gb/s %g us):\n",
            mc->gbps[0], mc->latency_us[0], mc->gbps[1], mc->latency_us[1]);
    fprintf(f, "  %-13s %8s %14s %10s %12s\n", "algorithm", "calls", "bytes", "messages",
            "est. time");
    for (int algo = 0; algo < 2; algo++) {
        moe_a2a_plan a;
        MOE_TRY(moe_plan_a2a(cfg, mc, (moe_a2a_algo)algo, &a));
        fprintf(f, "  %-13s %8ld %14ld %10ld %9.3f ms\n", algo ? "hierarchical" : "flat", a.calls,
                a.bytes, a.msgs, 1e3 * a.seconds);
    }
    fprintf(f, "  (every expert filled to its capacity: exact when all overflow, else an upper "
               "bound)\n");
    moe_a2a_plan a;
    MOE_TRY(moe_plan_a2a(cfg, mc, MOE_A2A_HIERARCHICAL, &a));
    if (a.nodes < 2) return 0;
    fprintf(f, "\ninter-node all-to-all per optimizer step per rank, %d nodes in the EP group:\n",
            a.nodes);
    for (int algo = 0; algo < 2; algo++) {
        moe_a2a_plan b;
        MOE_TRY(moe_plan_a2a(cfg, mc, (moe_a2a_algo)algo, &b));
        fprintf(f, "  %-13s %14ld bytes (rows to experts on other nodes)\n",
                algo ? "hierarchical" : "flat", b.bytes_inter);
    }
    fprintf(f, "  router.n_groups = %d, router.topk_groups = %d%s\n", a.n_groups, a.topk_groups,
            a.topk_groups ? "" : " (every group: no limit)");
    if (a.remote_nodes < 0) {
        fprintf(f, "  (groups and nodes do not nest: no model of the nodes a token reaches)\n");
        return 0;
    }
    if (a.node_dedup) {
        fprintf(f,
                "  comm.node_dedup: the rows to the experts and the combine's gradients cross "
                "nodes once\n  per token and node (a token's %d choice%s reach%s %.2f other "
                "nodes, balanced routing),\n  with an index; the return paths stay one row "
                "per choice (%.2f per token)\n",
                cfg->router.top_k, plural(cfg->router.top_k), cfg->router.top_k == 1 ? "es" : "",
                a.remote_nodes, cfg->router.top_k * (a.nodes - 1.0) / a.nodes);
        return 0;
    }
    fprintf(f,
            "  balanced routing: a token's %d choice%s reach%s %.2f other nodes; one copy per "
            "token and node\n  (DeepSeek-V3 dispatch) would send %ld bytes across nodes; this "
            "exchange sends one row\n  per choice to other nodes (%.2f per token, whatever "
            "the groups; comm.node_dedup sends one)\n",
            cfg->router.top_k, plural(cfg->router.top_k), cfg->router.top_k == 1 ? "es" : "",
            a.remote_nodes, a.bytes_inter_node_copy, cfg->router.top_k * (a.nodes - 1.0) / a.nodes);
    return 0;
}

int moe_plan_placement(const moe_config *cfg, double skew, const double *load,
                       moe_place_plan *out) {
    double *keep[2] = {out->tokens[0], out->tokens[1]};
    memset(out, 0, sizeof *out);
    out->tokens[0] = keep[0], out->tokens[1] = keep[1];
    MOE_TRY(moe_config_check(cfg, NULL));
    int E = 0, n_moe = 0;
    for (int l = 0; l < cfg->model.n_layers; l++)
        if (moe_config_experts(cfg, l)) E = E ? E : moe_config_experts(cfg, l), n_moe++;
    if (!E) return moe_fail(MOE_EINVAL, "plan: the model has no MoE layer to place");
    if (!(skew >= 0 && skew < 1))
        return moe_fail(MOE_EINVAL, "plan: skew = %g, expected a share in [0, 1)", skew);
    const int P = cfg->parallel.ep, El = E / P, k = cfg->router.top_k;
    int S = cfg->placement.slots_per_rank > El ? cfg->placement.slots_per_rank : El + 1;
    if (S > E) S = E;
    const long Ts = (long)cfg->train.batch_size * cfg->model.seq_len; // tokens per source rank
    double share[E], total = 0;
    for (int e = 0; e < E; e++) {
        share[e] = load ? load[e] : skew > 0 ? (e ? (1 - skew) / (E - 1) : skew) : 1.0 / E;
        if (!(share[e] >= 0))
            return moe_fail(MOE_EINVAL, "plan: load of expert %d is %g", e, share[e]);
        total += share[e];
    }
    if (!(total > 0)) return moe_fail(MOE_EINVAL, "plan: the load sums to %g", total);
    // Token choice gives an expert at most one of a token's k assignments.
    for (int e = 0; e < E && cfg->router.type != MOE_ROUTER_EXPERT_CHOICE; e++)
        if (share[e] / total > 1.0 / k + 1e-12)
            return moe_fail(MOE_EINVAL,
                            "plan: expert %d takes %.1f%% of the assignments, but with "
                            "router.top_k = %d an expert gets at most one of a token's %d "
                            "(%.1f%%)",
                            e, 100 * share[e] / total, k, k, 100.0 / k);
    int C = cfg->router.type == MOE_ROUTER_EXPERT_CHOICE
                ? moe_expert_choice_capacity(&cfg->router, (int)Ts, E)
                : moe_capacity_static(&cfg->router, (int)Ts, E);
    // Per source rank: routed rows, capacity, kept rows (static table). The
    // dynamic controller, fed this load, settles at its capacities.
    double routed[E], kept[E];
    int Ce[E];
    for (int e = 0; e < E; e++)
        routed[e] = (double)Ts * k * share[e] / total, Ce[e] = C;
    if (cfg->router.capacity_mode == MOE_CAPACITY_DYNAMIC && C >= 0 &&
        cfg->router.type != MOE_ROUTER_EXPERT_CHOICE) {
        moe_capacity_ctl ctl;
        MOE_TRY(moe_capacity_ctl_init(&ctl, &cfg->router, (int)Ts, E));
        ctl.steps = cfg->router.update_every - 1; // the next update sets capacities
        moe_capacity_ctl_update_mean(&ctl, &cfg->router, routed, (int)Ts);
        memcpy(Ce, ctl.capacity, sizeof Ce);
        moe_capacity_ctl_free(&ctl);
    }
    for (int e = 0; e < E; e++)
        kept[e] = Ce[e] >= 0 && routed[e] > Ce[e] ? Ce[e] : routed[e];
    out->E = E, out->P = P, out->S = S;
    moe_placement t;
    MOE_TRY(moe_placement_init(&t, E, P, S));
    t.moves = !strcmp(cfg->placement.mode, "move");
    double glob[E], tok[P];
    for (int e = 0; e < E; e++)
        glob[e] = kept[e] * P; // the measured load: rows kept over the group
    const size_t row = (size_t)cfg->model.d_model * sizeof(float);
    for (int i = 0; i < 2; i++) {
        int rc = i ? moe_placement_update(&t, glob) : 0;
        if (rc < 0) {
            moe_placement_free(&t);
            return rc;
        }
        // Each source keeps up to its capacity of each expert (grown for a
        // replicated one) and sends it to the holder the deal names.
        double remote = 0, sent = 0, got = 0;
        for (int r = 0; r < P; r++)
            tok[r] = 0;
        for (int s = 0; s < P; s++)
            for (int e = 0; e < E; e++) {
                const int cs = Ce[e] >= 0 ? moe_placement_capacity(&t, e, s, Ce[e]) : -1;
                const double ks = cs >= 0 && routed[e] > cs ? cs : routed[e];
                const int d = moe_placement_dest(&t, e, s);
                tok[d] += ks, sent += routed[e], got += ks;
                if (d != s) remote += ks;
            }
        double mx = 0, mean = 0;
        for (int r = 0; r < P; r++) {
            mx = tok[r] > mx ? tok[r] : mx, mean += tok[r] / P;
            if (out->tokens[i]) out->tokens[i][r] = tok[r];
        }
        out->max_mean[i] = mean > 0 ? mx / mean : 0;
        out->drop_rate[i] = sent > 0 ? 1 - got / sent : 0;
        // out, back, and the same two in backward; every MoE layer, every micro-batch
        out->a2a_bytes[i] = 4.0 * remote / P * row * n_moe * cfg->train.grad_accum;
    }
    int used = 0;
    for (int j = 0; j < P * S; j++)
        used += t.slot[j] >= 0;
    out->replicas = used - E;
    for (int e = 0; e < E; e++)
        out->moved += moe_placement_home(&t, e) != e / El;
    moe_placement_free(&t);
    return 0;
}

int moe_plan_placement_print(const moe_config *cfg, double skew, const double *load, FILE *f) {
    const int P = cfg->parallel.ep;
    if (P < 2) {
        fprintf(f, "\nexpert placement: none (parallel.ep = 1: every expert is local)\n");
        return 0;
    }
    double t0[P], t1[P];
    moe_place_plan pp = {.tokens = {t0, t1}};
    MOE_TRY(moe_plan_placement(cfg, skew, load, &pp));
    fprintf(f, "\nexpert placement over the EP group of %d ranks (first MoE layer, %d experts; ", P,
            pp.E);
    if (load)
        fprintf(f, "the given load):\n");
    else if (skew > 0)
        fprintf(f, "expert 0 takes %.0f%% of the assignments):\n", 100 * skew);
    else
        fprintf(f, "balanced routing):\n");
    fprintf(f, "  %-6s %14s %14s\n", "rank", "static",
            strcmp(cfg->placement.mode, "move") ? "replicate" : "move");
    for (int r = 0; r < P; r++)
        fprintf(f, "  %-6d %14.1f %14.1f\n", r, t0[r], t1[r]);
    fprintf(f, "  %-6s %14.3f %14.3f   (max rank tokens / mean rank tokens)\n", "max/mean",
            pp.max_mean[0], pp.max_mean[1]);
    fprintf(f, "  %-6s %14.0f %14.0f   (all-to-all row bytes per step per rank, all layers)\n",
            "bytes", pp.a2a_bytes[0], pp.a2a_bytes[1]);
    fprintf(f,
            "  %-6s %13.1f%% %13.1f%%   (a replicated expert's capacity grows with its "
            "holders)\n",
            "drops", 100 * pp.drop_rate[0], 100 * pp.drop_rate[1]);
    fprintf(f, "  %d slot%s per rank, %d replica%s, %d expert%s moved home\n", pp.S, plural(pp.S),
            pp.replicas, plural(pp.replicas), pp.moved, plural(pp.moved));
    return 0;
}

int moe_plan_machine(const moe_config *cfg, int nodes, int ranks_per_node, moe_machine *mc) {
    const int cfg_g = cfg->comm.ranks_per_node, ep = cfg->parallel.ep;
    if (ranks_per_node > 0 && cfg_g > 0 && ranks_per_node != cfg_g)
        return moe_fail(MOE_EINVAL,
                        "--ranks-per-node %d disagrees with comm.ranks_per_node = %d (the node "
                        "size a run of this config simulates): give one",
                        ranks_per_node, cfg_g);
    int g = ranks_per_node > 0 ? ranks_per_node : cfg_g;
    if (nodes <= 0 && g <= 0) { // one node of parallel.ep ranks
        nodes = 1, g = ep;
    } else if (nodes <= 0 && ranks_per_node > 0) { // one node of the ranks given
        nodes = 1;
        if (g % ep) {          // the smallest number of such nodes whose ranks the groups fill
            int a = ep, b = g; // gcd(ep, g), Euclid: nodes * g is a multiple of ep
            while (b) {
                const int r = a % b;
                a = b;
                b = r;
            }
            const long long n = ep / a;
            return moe_fail(MOE_EINVAL,
                            "plan: %d rank%s (one node of --ranks-per-node %d) cannot hold "
                            "expert-parallel groups of %d: give --nodes %lld for %lld ranks",
                            g, plural(g), g, ep, n, n * g);
        }
    } else if (nodes <= 0) { // parallel.ep ranks in the config's nodes
        if (ep % g)
            return moe_fail(MOE_EINVAL,
                            "comm.ranks_per_node = %d does not divide parallel.ep = %d ranks "
                            "(moe plan --nodes N models N nodes of %d ranks)",
                            g, ep, g);
        nodes = ep / g;
    } else if (g <= 0) {
        g = ep;
    }
    if ((long long)nodes * g > INT_MAX)
        return moe_fail(MOE_EINVAL, "--nodes x --ranks-per-node is too large");
    mc->nodes = nodes;
    mc->ranks_per_node = g;
    mc->world = nodes * g;
    return 0;
}
