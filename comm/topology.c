// Node topology of a communicator and the index math of the hierarchical
// all-to-all (DeepSpeed-MoE / Tutel 2DH): ranks r = n G + l on N nodes of G;
// block transposes between destination order and the per-step orders; and
// the traffic model both algorithms follow (moe_comm_a2a_predict).
#include "comm/comm_internal.h"
#include "moe/error.h"

#include <string.h>

int moe_comm_layout_ranks_per_node(const int *node_of, int size) {
    int G = 1;
    while (G < size && node_of[G] == node_of[0])
        G++;
    if (size % G) return 1;
    // Every group of G consecutive ranks on one node, no node in two groups.
    for (int r = 0; r < size; r++) {
        int lead = r - r % G;
        if (node_of[r] != node_of[lead]) return 1;
        if (r == lead)
            for (int q = 0; q < lead; q += G)
                if (node_of[q] == node_of[r]) return 1;
    }
    return G;
}

void moe_comm_block_transpose(void *out, const void *in, const int *len, int A, int B, size_t es,
                              size_t *work) {
    char *o = out;
    const char *p = in;
    if (!len) {
        for (int a = 0; a < A; a++)
            for (int b = 0; b < B; b++)
                memcpy(o + ((size_t)b * A + a) * es, p + ((size_t)a * B + b) * es, es);
        return;
    }
    // work[a * B + b] = offset of block (a, b) in the output, in elements.
    size_t off = 0;
    for (int b = 0; b < B; b++)
        for (int a = 0; a < A; a++) {
            work[(size_t)a * B + b] = off;
            off += (size_t)len[(size_t)a * B + b];
        }
    size_t at = 0;
    for (size_t i = 0; i < (size_t)A * B; i++) {
        size_t bytes = (size_t)len[i] * es;
        if (bytes) memcpy(o + work[i] * es, p + at, bytes);
        at += bytes;
    }
}

int moe_comm_a2a_predict(int size, int ranks_per_node, moe_a2a_algo algo, const int *counts,
                         size_t elem_size, int rank, long *bytes, long *msgs) {
    int G = ranks_per_node;
    if (size < 1 || G < 1 || size % G || rank < 0 || rank >= size)
        return moe_fail(MOE_EINVAL, "a2a predict: size %d, ranks_per_node %d, rank %d", size, G,
                        rank);
    for (long i = 0; i < (long)size * size; i++)
        if (counts[i] < 0)
            return moe_fail(MOE_EINVAL, "a2a predict: counts[%ld][%ld] = %d is negative", i / size,
                            i % size, counts[i]);
    long b = 0, k = 0;
    const int *row = counts + (size_t)rank * size;
    if (algo != MOE_A2A_HIERARCHICAL || G == 1 || G == size) {
        for (int d = 0; d < size; d++)
            if (d != rank && row[d] > 0) b += row[d], k++;
    } else {
        int N = size / G, n = rank / G, l = rank % G;
        // Step 1: to local peer l', everything for ranks of local index l'.
        for (int lp = 0; lp < G; lp++) {
            if (lp == l) continue;
            long s = 0;
            for (int m = 0; m < N; m++)
                s += row[m * G + lp];
            if (s > 0) b += s, k++;
        }
        // Step 2: to node m, what the ranks of node n send to rank (m, l).
        for (int m = 0; m < N; m++) {
            if (m == n) continue;
            long s = 0;
            for (int j = 0; j < G; j++)
                s += counts[(size_t)(n * G + j) * size + m * G + l];
            if (s > 0) b += s, k++;
        }
    }
    *bytes = b * (long)elem_size;
    *msgs = k;
    return 0;
}
