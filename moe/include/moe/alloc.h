// Tracked allocations: every buffer whose size follows the model, the batch
// or the data goes through these, so the library's memory in use and its
// high-water mark are known exactly (moe plan's estimate is checked against
// them). Small transient allocations (file headers, names) use malloc.
#ifndef MOE_ALLOC_H
#define MOE_ALLOC_H

#include <stddef.h>

void *moe_malloc(size_t bytes);
void *moe_calloc(size_t n, size_t size);
void *moe_aligned_alloc(size_t align, size_t bytes); // align: power of two, >= sizeof(void *)
void *moe_realloc(void *p, size_t bytes);
void moe_mfree(void *p); // NULL is fine

size_t moe_mem_in_use(void); // bytes requested and not yet freed
size_t moe_mem_peak(void);   // high-water mark of moe_mem_in_use since the last reset
void moe_mem_reset_peak(void);

#endif
