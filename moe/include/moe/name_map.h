// A hash index from names to item numbers over an array the caller owns
// (parameter views, a file's tensors, a checkpoint's shards), so that looking
// a name up costs O(1) instead of a scan: 10^6 names build and resolve in
// well under a second where a linear scan per name took hours.
#ifndef MOE_NAME_MAP_H
#define MOE_NAME_MAP_H

#include <stddef.h>
#include <stdint.h>

// The name of item i of items. The map stores only (hash, item number) pairs
// and asks for names to confirm a match, so the items may move (realloc)
// between calls as long as their numbers stay.
typedef const char *(*moe_name_key_fn)(const void *items, uint32_t i);

typedef struct {
    uint64_t *slot; // hash << 32 | (item + 1); 0 = empty
    size_t cap;     // slots: 0 or a power of two, at most half full
    size_t count;
} moe_name_map;

// A zeroed map is an empty map; init only zeroes it.
void moe_name_map_init(moe_name_map *m);
void moe_name_map_free(moe_name_map *m);
// Room for n names without rehashing (MOE_ENOMEM).
int moe_name_map_reserve(moe_name_map *m, size_t n);
// Adds item i under the name key(items, i). When an item of that name is
// already present nothing is added and *dup gets its number; otherwise *dup is
// -1. Returns 0, MOE_ENOMEM, or MOE_EINVAL when i does not fit (>= 2^32 - 1).
int moe_name_map_add(moe_name_map *m, const void *items, moe_name_key_fn key, size_t i, long *dup);
// The number of the item called name, or -1.
long moe_name_map_find(const moe_name_map *m, const void *items, moe_name_key_fn key,
                       const char *name);

#endif
