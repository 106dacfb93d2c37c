// The CPU backend's own thread pool. OpenBLAS's pthread build keeps its idle
// workers in a sched_yield loop between calls, which on a small or shared
// machine turns into system time and steals the cores from the thread doing
// the non-GEMM work. So OpenBLAS is set to one thread at start-up and the
// kernels split their work over this pool, whose idle workers spin a few
// microseconds (no syscalls) and then sleep on a condition variable.
#include "kernels/cpu/cpu.h"

#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

enum { MAX_THREADS = 64, SPIN = 4000 }; // SPIN pauses: some tens of microseconds

// Everything but the spin reads is under mu: a worker that wakes late finds
// the items of whatever generation is current, or none, and the caller waits
// only for the items that were claimed, never for a worker still asleep.
static struct {
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int n_threads;             // workers + the calling thread
    _Atomic unsigned long gen; // bumped once per parallel_for
    moe_cpu_task fn;
    void *ctx;
    int n_items, next;
    _Atomic int remaining; // items not finished
    atomic_flag busy;      // one parallel_for at a time; others run serially
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1,
          0, NULL, NULL, 0, 0, 0, ATOMIC_FLAG_INIT};
static pthread_once_t once = PTHREAD_ONCE_INIT;
static _Thread_local int in_pool; // nested calls (a task that calls a kernel) run serially
static _Thread_local int thread_id; // 0: any thread outside the pool

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Claims and runs items until none is left; called and returns with mu held.
static void run_items(void) {
    while (pool.next < pool.n_items) {
        int i = pool.next++;
        moe_cpu_task fn = pool.fn;
        void *ctx = pool.ctx;
        pthread_mutex_unlock(&pool.mu);
        fn(ctx, i);
        pthread_mutex_lock(&pool.mu);
        if (atomic_fetch_sub(&pool.remaining, 1) == 1) pthread_cond_signal(&pool.done);
    }
}

static void *worker(void *arg) {
    thread_id = (int)(intptr_t)arg;
    in_pool = 1;
    unsigned long seen = 0;
    for (;;) {
        for (int s = 0; atomic_load(&pool.gen) == seen && s < SPIN; s++)
            cpu_relax();
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.gen) == seen)
            pthread_cond_wait(&pool.go, &pool.mu);
        seen = atomic_load(&pool.gen);
        run_items();
        pthread_mutex_unlock(&pool.mu);
    }
    return NULL;
}

// Cores this process may run on (its affinity mask, so taskset and cgroup
// cpusets are honoured), capped by MOE_NUM_THREADS when that is set.
static int cores(void) {
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (!sched_getaffinity(0, sizeof set, &set)) n = CPU_COUNT(&set);
#endif
    if (n < 1) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    const char *env = getenv("MOE_NUM_THREADS");
    if (env && atoi(env) > 0 && (n < 1 || atoi(env) < n)) n = atoi(env);
    if (n < 1) n = 1;
    return n > MAX_THREADS ? MAX_THREADS : n;
}

static void init(void) {
    openblas_set_num_threads(1); // single-threaded BLAS inside our threads
    int n = cores();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int started = 1;
    for (int i = 1; i < n; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker, (void *)(intptr_t)started)) break; // fewer threads still work
        started++;
    }
    pthread_attr_destroy(&attr);
    pool.n_threads = started;
}

int moe_cpu_threads(void) {
    pthread_once(&once, init);
    return pool.n_threads;
}

int moe_cpu_thread_id(void) { return thread_id; }

void moe_cpu_parallel_for(int n, moe_cpu_task fn, void *ctx) {
    if (n <= 0) return;
    if (n == 1 || in_pool || moe_cpu_threads() == 1 || atomic_flag_test_and_set(&pool.busy)) {
        for (int i = 0; i < n; i++)
            fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn, pool.ctx = ctx, pool.n_items = n, pool.next = 0;
    atomic_store(&pool.remaining, n);
    atomic_fetch_add(&pool.gen, 1);
    pthread_cond_broadcast(&pool.go);
    in_pool = 1;
    run_items();
    in_pool = 0;
    pthread_mutex_unlock(&pool.mu);
    for (int s = 0; atomic_load(&pool.remaining) > 0 && s < SPIN; s++)
        cpu_relax();
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.remaining) > 0)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    atomic_flag_clear(&pool.busy);
}
