// The local communicator (one process, rank 0 of 1): the all-to-all is a copy
// of the rows a rank sends itself; every other op leaves the data as it is.
#include "comm/comm_internal.h"
#include "moe/error.h"

#include <string.h>

int moe_comm_local_alltoallv(moe_comm *c, const void *send, const int *send_counts, void *recv,
                             int *recv_counts, size_t recv_cap, size_t elem_size) {
    (void)c;
    long total;
    MOE_TRY(moe_comm_check_counts(send_counts, 1, "send_counts", &total));
    if ((size_t)total > recv_cap)
        return moe_fail(MOE_EINVAL,
                        "all-to-all: rank 0 receives %ld elements, its buffer holds %zu", total,
                        recv_cap);
    recv_counts[0] = send_counts[0];
    if (total) memmove(recv, send, (size_t)total * elem_size);
    return 0;
}
