// Tracked allocations (see alloc.h): a dense array of live (pointer, size)
// pairs under a mutex. Tracked buffers are few and large (sized once, reused
// every step), so a linear search on free is plenty.
#include "moe/alloc.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static struct live {
    void *p;
    size_t bytes;
} * live;
static size_t n_live, cap_live;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t in_use, peak;

static void *track(void *p, size_t bytes) {
    if (!p) return NULL;
    pthread_mutex_lock(&lock);
    if (n_live == cap_live) {
        size_t cap = cap_live ? 2 * cap_live : 256;
        struct live *q = realloc(live, cap * sizeof *q);
        if (!q) { // refuse rather than lose track
            pthread_mutex_unlock(&lock);
            free(p);
            return NULL;
        }
        live = q, cap_live = cap;
    }
    live[n_live++] = (struct live){p, bytes};
    in_use += bytes;
    if (in_use > peak) peak = in_use;
    pthread_mutex_unlock(&lock);
    return p;
}

// Removes p from the table; returns its size (0 if untracked).
static size_t untrack(void *p) {
    size_t bytes = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = n_live; i-- > 0;)
        if (live[i].p == p) {
            bytes = live[i].bytes;
            live[i] = live[--n_live];
            in_use -= bytes;
            break;
        }
    pthread_mutex_unlock(&lock);
    return bytes;
}

void *moe_malloc(size_t bytes) {
    return track(malloc(bytes ? bytes : 1), bytes);
}

void *moe_calloc(size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) return NULL;
    return track(calloc(n ? n : 1, size ? size : 1), n * size);
}

void *moe_aligned_alloc(size_t align, size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, align, bytes ? bytes : align)) return NULL;
    return track(p, bytes);
}

void *moe_realloc(void *p, size_t bytes) {
    if (!p) return moe_malloc(bytes);
    size_t old = untrack(p);
    void *q = realloc(p, bytes ? bytes : 1);
    if (!q) { // p is still valid: track it again
        track(p, old);
        return NULL;
    }
    return track(q, bytes);
}

void moe_mfree(void *p) {
    if (!p) return;
    untrack(p);
    free(p);
}

size_t moe_mem_in_use(void) {
    pthread_mutex_lock(&lock);
    size_t n = in_use;
    pthread_mutex_unlock(&lock);
    return n;
}

size_t moe_mem_peak(void) {
    pthread_mutex_lock(&lock);
    size_t n = peak;
    pthread_mutex_unlock(&lock);
    return n;
}

void moe_mem_reset_peak(void) {
    pthread_mutex_lock(&lock);
    peak = in_use;
    pthread_mutex_unlock(&lock);
}
