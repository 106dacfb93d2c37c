// Memory estimate vs measurement: for each config, the predicted peak of the
// library's allocations (moe plan), the measured high-water mark of those
// allocations over a few training steps, and the process's peak RSS (each
// config trains in a child process, so RSS is per config). One JSON line each.
//   build/bench/memory [--steps N]
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/plan.h"
#include "moe/train.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *configs[][3] = {
    {"seq_len=64", "model.seq_len=64", ""},
    {"seq_len=128", "model.seq_len=128", ""},
    {"seq_len=256", "model.seq_len=256", ""},
    {"batch=16", "train.batch_size=16", ""},
    {"experts=32", "moe.num_experts=32", ""},
    {"top_k=1", "router.top_k=1", ""},
    {"top_k=4", "router.top_k=4", ""},
    {"capacity=0.5", "router.capacity_factor=0.5", ""},
    {"capacity=2.0", "router.capacity_factor=2.0", ""},
    {"dropless", "router.capacity_factor=0", ""},
    {"cce", "loss.impl=cce", ""},
    {"cce,seq_len=256", "loss.impl=cce", "model.seq_len=256"},
    {"dense", "moe.every=0", ""},
    {"pyramid+shared", "moe.num_experts=[4,4,8,8]", "moe.shared_experts=1"},
    {"mini_seq=4", "memory.mini_seq=4", "memory.recompute=moe"},
    {"mini_seq=8", "memory.mini_seq=8", "memory.recompute=moe"},
    {"mini_seq=8,all", "memory.mini_seq=8", "memory.recompute=all"},
};

int main(int argc, char **argv) {
    int steps = 3;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    const int n = sizeof configs / sizeof configs[0];
    double err_sum = 0;
    for (int i = 0; i < n; i++) {
        moe_config c;
        moe_config_default(&c);
        char st[32];
        snprintf(st, sizeof st, "train.steps=%d", steps);
        const char *sets[] = {"model.d_model=128",
                              "model.n_layers=4",
                              "model.d_ff=256",
                              "model.seq_len=64",
                              "train.batch_size=8",
                              "train.eval_every=0",
                              st,
                              configs[i][1],
                              configs[i][2]};
        for (size_t j = 0; j < sizeof sets / sizeof sets[0]; j++)
            if (sets[j][0] && moe_config_set(&c, NULL, sets[j])) {
                fprintf(stderr, "memory: %s\n", moe_last_error());
                return 1;
            }
        moe_mem_plan plan;
        if (moe_plan_memory(&c, 1, 0, &plan)) {
            fprintf(stderr, "memory: %s\n", moe_last_error());
            return 1;
        }
        int fd[2];
        if (pipe(fd)) return 1;
        pid_t pid = fork();
        if (pid == 0) { // child: train, report the allocation peak and RSS
            close(fd[0]);
            char out[64];
            snprintf(out, sizeof out, "/tmp/moe-bench-memory-%d", (int)getpid());
            moe_mem_reset_peak();
            moe_train_opts o = {.out_dir = out, .quiet = true, .stop_after = steps};
            moe_train_result r;
            long long v[2] = {-1, -1};
            if (moe_train(&c, &o, &r) == 0) {
                struct rusage ru;
                getrusage(RUSAGE_SELF, &ru);
                v[0] = (long long)moe_mem_peak();
                v[1] = (long long)ru.ru_maxrss * 1024;
            } else {
                fprintf(stderr, "memory: %s\n", moe_last_error());
            }
            if (write(fd[1], v, sizeof v) != sizeof v) _exit(1);
            char cmd[128];
            snprintf(cmd, sizeof cmd, "rm -rf %s", out);
            if (system(cmd)) _exit(1);
            _exit(0);
        }
        close(fd[1]);
        long long v[2] = {-1, -1};
        if (read(fd[0], v, sizeof v) != sizeof v || v[0] < 0) return 1;
        close(fd[0]);
        waitpid(pid, NULL, 0);
        double err = ((double)plan.total - (double)v[0]) / (double)v[0];
        err_sum += err < 0 ? -err : err;
        printf("{\"bench\":\"memory\",\"config\":\"%s\",\"predicted_bytes\":%zu,"
               "\"measured_bytes\":%lld,\"error\":%.5f,\"peak_rss_bytes\":%lld,"
               "\"breakdown\":{\"params\":%zu,\"grads\":%zu,\"optimizer\":%zu,"
               "\"activations\":%zu,\"moe\":%zu,\"step\":%zu}}\n",
               configs[i][0], plan.total, v[0], err, v[1], plan.params, plan.grads, plan.optimizer,
               plan.activations, plan.moe, plan.step);
        fflush(stdout);
    }
    printf("{\"bench\":\"memory\",\"configs\":%d,\"mean_abs_error\":%.5f}\n", n, err_sum / n);
    return 0;
}
