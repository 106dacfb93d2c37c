// Open addressing with linear probing over a power-of-two table kept at most
// half full (expected probes < 2.5 for a miss). The hash is 64-bit FNV-1a with
// murmur3's finaliser, so that names differing in one digit ("experts.17" vs
// "experts.71") spread over all bits; its high 32 bits pick the slot and ride
// in it, so a rehash needs no names and most mismatches cost no strcmp.
// Chosen over uthash: no new dependency, and an index over the caller's array
// (no link field in the item) keeps parameter views and tensors unchanged.
#include "moe/name_map.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

static uint32_t hash_name(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return (uint32_t)(h >> 32);
}

void moe_name_map_init(moe_name_map *m) {
    memset(m, 0, sizeof *m);
}

void moe_name_map_free(moe_name_map *m) {
    free(m->slot);
    memset(m, 0, sizeof *m);
}

// The slot holding the item called name (hash h), or the empty slot ending its probe run.
static size_t probe(const moe_name_map *m, uint32_t h, const void *items, moe_name_key_fn key,
                    const char *name) {
    const size_t mask = m->cap - 1;
    for (size_t j = h & mask;; j = (j + 1) & mask) {
        uint64_t s = m->slot[j];
        if (!s) return j;
        if (s >> 32 == h && !strcmp(key(items, (uint32_t)(s & 0xffffffffu) - 1), name)) return j;
    }
}

static int rehash(moe_name_map *m, size_t cap) {
    uint64_t *slot = calloc(cap, sizeof *slot);
    if (!slot) return moe_fail(MOE_ENOMEM, "name index: out of memory at %zu slots", cap);
    for (size_t i = 0; i < m->cap; i++) {
        uint64_t s = m->slot[i];
        if (!s) continue;
        size_t j = (size_t)(s >> 32) & (cap - 1);
        while (slot[j])
            j = (j + 1) & (cap - 1);
        slot[j] = s;
    }
    free(m->slot);
    m->slot = slot;
    m->cap = cap;
    return 0;
}

int moe_name_map_reserve(moe_name_map *m, size_t n) {
    if (n > UINT32_MAX / 2) return moe_fail(MOE_ENOMEM, "name index: %zu names", n);
    size_t cap = m->cap ? m->cap : 16;
    while (cap < 2 * n)
        cap *= 2;
    return cap == m->cap ? 0 : rehash(m, cap);
}

int moe_name_map_add(moe_name_map *m, const void *items, moe_name_key_fn key, size_t i, long *dup) {
    *dup = -1;
    if (i >= UINT32_MAX) return moe_fail(MOE_EINVAL, "name index: item %zu is too many", i);
    MOE_TRY(moe_name_map_reserve(m, m->count + 1));
    const char *name = key(items, (uint32_t)i);
    uint32_t h = hash_name(name);
    size_t j = probe(m, h, items, key, name);
    if (m->slot[j]) {
        *dup = (long)(m->slot[j] & 0xffffffffu) - 1;
        return 0;
    }
    m->slot[j] = (uint64_t)h << 32 | (uint64_t)(i + 1);
    m->count++;
    return 0;
}

long moe_name_map_find(const moe_name_map *m, const void *items, moe_name_key_fn key,
                       const char *name) {
    if (!m->count) return -1;
    size_t j = probe(m, hash_name(name), items, key, name);
    return m->slot[j] ? (long)(m->slot[j] & 0xffffffffu) - 1 : -1;
}
