// The MPI communicator under `mpirun -np 4`: flat and hierarchical
// all-to-all deliver exactly the rows every rank is known to send (uneven and
// zero counts, several element sizes, 1, 2 and 4 ranks per node, EP x DP
// sub-communicators); the all-reduce is bit-identical to the rank-order sum;
// the traffic counters equal moe_comm_a2a_predict / moe_comm_allreduce_predict;
// errors are agreed by every rank. Every rank regenerates what every other
// rank sends from a seed, so each knows exactly what it must receive.
// Under `mpirun -np 6` (ctest mpi_comm_np6) the hierarchical all-to-all and
// the all-reduce run on nodes of 2 and of 3 ranks: N != G, which 4 ranks
// (N = G = 2) cannot tell from a transpose with the two swapped, and slices
// of the reduce-scatter that do not divide evenly.
#include "moe/comm.h"
#include "moe/error.h"
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { W = 4, W6 = 6, WMAX = 6 };
static int wrank;

#define CHECK(cond, ...) TU_MPI_CHECK(wrank, cond, __VA_ARGS__)

static uint64_t mix(uint64_t x) { // splitmix64 finaliser
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Byte b of element i that rank s sends to rank d in trial t.
static unsigned char payload(uint64_t t, int s, int d, size_t i, size_t b) {
    return (unsigned char)mix(mix(mix(t * 1000003u + (uint64_t)s) * 31 + (uint64_t)d) + i * 977 +
                              b);
}

static void fill_rows(unsigned char *p, uint64_t t, int s, int d, int count, size_t es) {
    for (int i = 0; i < count; i++)
        for (size_t b = 0; b < es; b++)
            p[(size_t)i * es + b] = payload(t, s, d, (size_t)i, b);
}

// Count matrix C[s * P + d] of trial t. Patterns: 0 random with ~1/3 zeros,
// 1 rank 1 sends nothing and rank P-1 receives nothing, 2 all zero, 3 only
// self, 4 one large block.
static void make_counts(int *C, int P, uint64_t t, int pattern) {
    tu_rng r;
    tu_seed(&r, t);
    for (int s = 0; s < P; s++)
        for (int d = 0; d < P; d++) {
            int v = (int)(tu_uniform(&r) * 40);
            if (tu_uniform(&r) < 0.33f) v = 0;
            if (pattern == 1 && (s == 1 % P || d == P - 1)) v = 0;
            if (pattern == 2) v = 0;
            if (pattern == 3) v = s == d ? v + 1 : 0;
            if (pattern == 4) v = (s == 0 && d == P - 1) ? 5000 : (v % 3);
            C[s * P + d] = v;
        }
}

// Every rank of c receives the same string as rank 0 of c.
static int same_everywhere(moe_comm *c, const char *s) {
    char mine[512], root[512];
    snprintf(mine, sizeof mine, "%s", s);
    memcpy(root, mine, sizeof root);
    if (moe_comm_bcast(c, root, sizeof root, 0)) return 0;
    int same = strcmp(mine, root) == 0;
    int64_t all = same;
    moe_comm_allreduce_i64(c, &all, 1);
    return all == moe_comm_size(c);
}

// One all-to-all of trial t over c with algo; checks recv, recv_counts, the
// bytes past the received rows, and the counters against the prediction.
// Returns the received buffer (malloc'd) for flat/hierarchical comparison.
static unsigned char *a2a_case(moe_comm *c, moe_a2a_algo algo, const int *C, size_t es, uint64_t t,
                               const char *label, int *got_counts) {
    const int P = moe_comm_size(c), me = moe_comm_rank(c);
    const int *row = C + (size_t)me * P;
    long stotal = 0, rtotal = 0;
    for (int d = 0; d < P; d++)
        stotal += row[d];
    for (int s = 0; s < P; s++)
        rtotal += C[s * P + me];
    unsigned char *send = malloc((size_t)stotal * es + 1),
                  *expect = malloc((size_t)rtotal * es + 1);
    const size_t slack = 16;
    unsigned char *recv = malloc(((size_t)rtotal + slack) * es);
    for (long o = 0, d = 0; d < P; o += row[d], d++)
        fill_rows(send + (size_t)o * es, t, me, (int)d, row[d], es);
    for (long o = 0, s = 0; s < P; o += C[s * P + me], s++)
        fill_rows(expect + (size_t)o * es, t, (int)s, me, C[s * P + me], es);
    memset(recv, 0xA5, ((size_t)rtotal + slack) * es);
    for (int s = 0; s < P; s++)
        got_counts[s] = -7;

    moe_comm_stats before, after;
    moe_comm_stats_get(c, &before);
    int rc = moe_comm_alltoallv(c, algo, send, row, recv, got_counts, (size_t)rtotal + slack, es);
    moe_comm_stats_get(c, &after);
    CHECK(rc == 0, "%s: %s", label, moe_last_error());
    for (int s = 0; s < P; s++)
        CHECK(got_counts[s] == C[s * P + me], "%s: recv_counts[%d] = %d, expected %d", label, s,
              got_counts[s], C[s * P + me]);
    CHECK(memcmp(recv, expect, (size_t)rtotal * es) == 0, "%s: received rows differ", label);
    int untouched = 1;
    for (size_t i = (size_t)rtotal * es; i < ((size_t)rtotal + slack) * es; i++)
        untouched &= recv[i] == 0xA5;
    CHECK(untouched, "%s: bytes past the %ld received rows were written", label, rtotal);

    long bytes, msgs;
    CHECK(moe_comm_a2a_predict(P, moe_comm_ranks_per_node(c), algo, C, es, me, &bytes, &msgs) == 0,
          "%s: predict: %s", label, moe_last_error());
    CHECK(after.bytes_sent - before.bytes_sent == bytes, "%s: bytes sent %ld, predicted %ld", label,
          after.bytes_sent - before.bytes_sent, bytes);
    CHECK(after.msgs_sent - before.msgs_sent == msgs, "%s: messages %ld, predicted %ld", label,
          after.msgs_sent - before.msgs_sent, msgs);
    CHECK(after.a2a_calls == before.a2a_calls + 1, "%s: a2a_calls", label);
    free(send);
    free(expect);
    return recv;
}

// Flat and hierarchical on trials of every pattern and several element sizes.
static void test_alltoall(moe_comm *c, const char *name, uint64_t seed) {
    const int P = moe_comm_size(c);
    const size_t sizes[] = {1, 4, 12, 2048, 8}; // 5 sizes: the type cache (4) recycles
    int *C = malloc(sizeof(int) * P * P), *cf = malloc(sizeof(int) * P),
        *ch = malloc(sizeof(int) * P);
    for (int pattern = 0; pattern < 5; pattern++)
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            uint64_t t = seed * 100 + (uint64_t)pattern * 10 + k;
            make_counts(C, P, t, pattern);
            char label[128];
            snprintf(label, sizeof label, "%s pattern %d es %zu flat", name, pattern, sizes[k]);
            unsigned char *f = a2a_case(c, MOE_A2A_FLAT, C, sizes[k], t, label, cf);
            snprintf(label, sizeof label, "%s pattern %d es %zu hierarchical", name, pattern,
                     sizes[k]);
            unsigned char *h = a2a_case(c, MOE_A2A_HIERARCHICAL, C, sizes[k], t, label, ch);
            long total = 0;
            for (int s = 0; s < P; s++)
                total += cf[s];
            CHECK(memcmp(cf, ch, sizeof(int) * P) == 0 &&
                      memcmp(f, h, (size_t)total * sizes[k]) == 0,
                  "%s: flat and hierarchical differ", label);
            free(f);
            free(h);
        }
    free(C);
    free(cf);
    free(ch);
}

// A receive buffer too small on one rank, or a negative count on one rank:
// every rank returns MOE_EINVAL with one message, and the communicator works on.
static void test_alltoall_errors(moe_comm *c, const char *name) {
    const int P = moe_comm_size(c), me = moe_comm_rank(c);
    int counts[WMAX], rc_counts[WMAX];
    float send[WMAX * 3], recv[WMAX * 3];
    for (int d = 0; d < P; d++)
        counts[d] = 3;
    for (int i = 0; i < P * 3; i++)
        send[i] = (float)i;
    for (int a = 0; a < 2; a++) {
        moe_a2a_algo algo = a ? MOE_A2A_HIERARCHICAL : MOE_A2A_FLAT;
        size_t cap = me == 1 ? (size_t)P * 3 - 1 : (size_t)P * 3;
        int rc = moe_comm_alltoallv(c, algo, send, counts, recv, rc_counts, cap, sizeof(float));
        CHECK(rc == MOE_EINVAL, "%s algo %d: overflow on rank 1 returned %d", name, a, rc);
        CHECK(strstr(moe_last_error(), "rank 1 receives") != NULL, "%s: message \"%s\"", name,
              moe_last_error());
        CHECK(same_everywhere(c, moe_last_error()), "%s: overflow messages differ", name);

        counts[0] = me == P - 1 ? -1 : 3;
        rc = moe_comm_alltoallv(c, algo, send, counts, recv, rc_counts, (size_t)P * 3,
                                sizeof(float));
        counts[0] = 3;
        CHECK(rc == MOE_EINVAL, "%s algo %d: negative count returned %d", name, a, rc);
        CHECK(strstr(moe_last_error(), "-1") != NULL, "%s: message \"%s\"", name, moe_last_error());
        CHECK(same_everywhere(c, moe_last_error()), "%s: negative-count messages differ", name);

        rc = moe_comm_alltoallv(c, algo, send, counts, recv, rc_counts, (size_t)P * 3,
                                sizeof(float));
        int ok = rc == 0;
        for (int s = 0; s < P; s++)
            for (int j = 0; j < 3; j++)
                ok &= recv[s * 3 + j] == (float)(me * 3 + j);
        CHECK(ok, "%s algo %d: all-to-all after an error: %s", name, a, moe_last_error());
    }
}

// Input of rank r for an all-reduce case: values over 7 decades, so that the
// order of the additions shows in the last bits.
static void ar_input(void *x, int type, size_t n, int r, uint64_t seed) {
    tu_rng g;
    tu_seed(&g, seed * 7919 + (uint64_t)r);
    for (size_t i = 0; i < n; i++) {
        double v = tu_normal(&g) * pow(10.0, (int)(tu_uniform(&g) * 7) - 3);
        if (type == 0) ((float *)x)[i] = (float)v;
        if (type == 1) ((double *)x)[i] = v * (1 + 1e-9 * tu_uniform(&g));
        if (type == 2) ((int64_t *)x)[i] = (int64_t)(v * 1e9);
    }
}

static void test_allreduce(moe_comm *c, const char *name) {
    const int P = moe_comm_size(c), me = moe_comm_rank(c);
    const size_t ns[] = {0, 1, 3, 1000, 4097, 70001, (1u << 22) + 777};
    const size_t es[] = {sizeof(float), sizeof(double), sizeof(int64_t)};
    const char *tn[] = {"f32", "f64", "i64"};
    for (int type = 0; type < 3; type++)
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            size_t n = ns[k];
            if (type > 0 && n > 100000) continue; // one multi-segment case is enough
            uint64_t seed = k * 3 + (uint64_t)type;
            void *buf = malloc(n * es[type] + 8), *want = malloc(n * es[type] + 8),
                 *x = malloc(n * es[type] + 8);
            ar_input(buf, type, n, me, seed);
            for (int s = 0; s < P; s++) { // the rank-order sum, from the regenerated inputs
                ar_input(s ? x : want, type, n, s, seed);
                for (size_t i = 0; s && i < n; i++) {
                    if (type == 0) ((float *)want)[i] += ((float *)x)[i];
                    if (type == 1) ((double *)want)[i] += ((double *)x)[i];
                    if (type == 2) ((int64_t *)want)[i] += ((int64_t *)x)[i];
                }
            }
            moe_comm_stats before, after;
            moe_comm_stats_get(c, &before);
            int rc = type == 0   ? moe_comm_allreduce_f32(c, buf, n)
                     : type == 1 ? moe_comm_allreduce_f64(c, buf, n)
                                 : moe_comm_allreduce_i64(c, buf, n);
            moe_comm_stats_get(c, &after);
            CHECK(rc == 0, "%s %s n=%zu: %s", name, tn[type], n, moe_last_error());
            CHECK(memcmp(buf, want, n * es[type]) == 0,
                  "%s %s n=%zu: not bit-identical to the rank-order sum", name, tn[type], n);
            long bytes;
            moe_comm_allreduce_predict(P, me, n, es[type], &bytes);
            CHECK(after.allreduce_bytes_sent - before.allreduce_bytes_sent == bytes,
                  "%s %s n=%zu: all-reduce bytes %ld, predicted %ld", name, tn[type], n,
                  after.allreduce_bytes_sent - before.allreduce_bytes_sent, bytes);
            CHECK(after.allreduce_calls == before.allreduce_calls + 1, "allreduce_calls");
            free(buf);
            free(want);
            free(x);
        }
}

static void test_agree(moe_comm *c, const char *name) {
    const int me = moe_comm_rank(c), P = moe_comm_size(c);
    moe_fail(MOE_OK, "untouched %d", me);
    int rc = moe_comm_agree(c, 0);
    char expect[64];
    snprintf(expect, sizeof expect, "untouched %d", me);
    CHECK(rc == 0 && strcmp(moe_last_error(), expect) == 0, "%s: agree(0) = %d, \"%s\"", name, rc,
          moe_last_error());
    // Ranks 1 and 3 fail with different codes: rank 1's wins everywhere.
    int st = 0;
    if (me == 1 % P) st = moe_fail(MOE_EFORMAT, "rank %d: bad header", me);
    if (me == 3 % P && me != 1 % P) st = moe_fail(MOE_EIO, "rank %d: disk full", me);
    rc = moe_comm_agree(c, st);
    snprintf(expect, sizeof expect, "rank %d: bad header", 1 % P);
    CHECK(rc == MOE_EFORMAT, "%s: agree returned %d", name, rc);
    CHECK(strcmp(moe_last_error(), expect) == 0, "%s: message \"%s\"", name, moe_last_error());
}

static void test_bcast_allgather(moe_comm *c, const char *name) {
    const int me = moe_comm_rank(c), P = moe_comm_size(c), root = P - 1;
    char msg[32] = "";
    if (me == root) snprintf(msg, sizeof msg, "from %d", root);
    CHECK(moe_comm_bcast(c, msg, sizeof msg, root) == 0, "%s: bcast", name);
    char want[32];
    snprintf(want, sizeof want, "from %d", root);
    CHECK(strcmp(msg, want) == 0, "%s: bcast got \"%s\"", name, msg);
    CHECK(moe_comm_bcast(c, msg, 1, P) == MOE_EINVAL, "%s: bcast from rank %d", name, P);
    int mine[2] = {me, 10 * me}, all[2 * WMAX];
    CHECK(moe_comm_allgather(c, mine, all, sizeof mine) == 0, "%s: allgather", name);
    int ok = 1;
    for (int r = 0; r < P; r++)
        ok &= all[2 * r] == r && all[2 * r + 1] == 10 * r;
    int inplace[2 * WMAX] = {0};
    inplace[2 * me] = me, inplace[2 * me + 1] = 10 * me;
    CHECK(moe_comm_allgather(c, inplace + 2 * me, inplace, 2 * sizeof(int)) == 0, "%s", name);
    ok &= memcmp(inplace, all, (size_t)P * 2 * sizeof(int)) == 0;
    CHECK(ok, "%s: allgather contents", name);
    CHECK(moe_comm_barrier(c) == 0, "%s: barrier", name);
}

// Sub-communicators of a world with 2 ranks per node: EP groups {0,1} {2,3}
// (one node each), expert-DP groups {0,2} {1,3} (one rank per node), the
// whole world reversed (still 2 per node) and interleaved (no structure).
static void test_split(moe_comm *world) {
    const int r = moe_comm_rank(world);
    struct {
        const char *name;
        int color, key, size, G;
    } cases[] = {
        {"ep group", r / 2, r % 2, 2, 2},
        {"expert dp group", r % 2, r / 2, 2, 1},
        {"reversed world", 0, -r, 4, 2},
        {"interleaved world", 0, (r % 2) * 2 + r / 2, 4, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_comm *sub;
        int rc = moe_comm_split(world, cases[i].color, cases[i].key, &sub);
        CHECK(rc == 0, "%s: %s", cases[i].name, moe_last_error());
        if (rc) continue;
        CHECK(moe_comm_size(sub) == cases[i].size && moe_comm_ranks_per_node(sub) == cases[i].G,
              "%s: size %d G %d, expected %d and %d", cases[i].name, moe_comm_size(sub),
              moe_comm_ranks_per_node(sub), cases[i].size, cases[i].G);
        char name[64];
        snprintf(name, sizeof name, "%s (color %d)", cases[i].name, cases[i].color);
        test_alltoall(sub, name, 50 + i * 10 + (uint64_t)cases[i].color);
        test_allreduce(sub, name);
        test_agree(sub, name);
        moe_comm_free(sub);
    }
    moe_comm *bad = NULL;
    int rc = moe_comm_split(world, r == 3 ? -1 : 0, r, &bad);
    CHECK(r == 3 ? rc == MOE_EINVAL && !bad : rc == 0 && moe_comm_size(bad) == 3,
          "split with a negative color on rank 3: %d", rc);
    moe_comm_free(bad);
}

// The world of 4 ranks: ranks_per_node 0, 1, 2, 4, sub-communicators.
static void four_ranks(void) {
    moe_comm *bad = NULL;
    CHECK(moe_comm_mpi_world(&bad, 3) == MOE_EINVAL && !bad, "ranks_per_node 3 of 4 accepted");
    CHECK(strstr(moe_last_error(), "does not divide") != NULL, "message \"%s\"", moe_last_error());
    CHECK(moe_comm_mpi_world(&bad, -1) == MOE_EINVAL && !bad, "ranks_per_node -1 accepted");

    // ranks_per_node: 0 (shared memory: one machine, G = 4), 1, 2, 4.
    const int rpns[] = {0, 1, 2, 4}, Gs[] = {4, 1, 2, 4};
    for (int i = 0; i < 4; i++) {
        moe_comm *world;
        int rc = moe_comm_mpi_world(&world, rpns[i]);
        CHECK(rc == 0, "world rpn %d: %s", rpns[i], moe_last_error());
        if (rc) continue;
        char name[64];
        snprintf(name, sizeof name, "world rpn %d", rpns[i]);
        CHECK(moe_comm_size(world) == W && moe_comm_rank(world) == wrank &&
                  moe_comm_ranks_per_node(world) == Gs[i],
              "%s: size %d rank %d G %d", name, moe_comm_size(world), moe_comm_rank(world),
              moe_comm_ranks_per_node(world));
        test_alltoall(world, name, 1 + (uint64_t)i);
        test_alltoall_errors(world, name);
        if (rpns[i] == 2) {
            test_allreduce(world, name);
            test_agree(world, name);
            test_bcast_allgather(world, name);
            test_split(world);
            moe_comm_stats s;
            moe_comm_stats_reset(world);
            moe_comm_stats_get(world, &s);
            CHECK(s.bytes_sent == 0 && s.msgs_sent == 0 && s.a2a_calls == 0 &&
                      s.allreduce_calls == 0 && s.t_alltoall == 0 && s.allreduce_bytes_sent == 0,
                  "stats after reset");
        }
        moe_comm_free(world);
    }
}

// The world of 6 ranks (ctest mpi_comm_np6).
static void six_ranks(void) {
    // Nodes of 2 (N = 3) and of 3 (N = 2): step 1 and step 2 of the
    // hierarchical exchange have different widths, so a block transpose or
    // a run sum with N and G swapped delivers rows to the wrong ranks.
    const int rpns6[] = {2, 3};
    for (int i = 0; i < 2; i++) {
        moe_comm *world;
        int rc = moe_comm_mpi_world(&world, rpns6[i]);
        CHECK(rc == 0, "6 ranks, rpn %d: %s", rpns6[i], moe_last_error());
        if (rc) continue;
        char name[64];
        snprintf(name, sizeof name, "6 ranks rpn %d", rpns6[i]);
        CHECK(moe_comm_ranks_per_node(world) == rpns6[i], "%s: G %d", name,
              moe_comm_ranks_per_node(world));
        test_alltoall(world, name, 200 + (uint64_t)i);
        test_alltoall_errors(world, name);
        if (i == 0) test_allreduce(world, name);
        moe_comm_free(world);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int size;
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != W && size != W6) {
        if (wrank == 0) fprintf(stderr, "mpi_comm: run with mpirun -np %d or %d\n", W, W6);
        MPI_Finalize();
        return 2;
    }
    if (size == W)
        four_ranks();
    else
        six_ranks();

    int total[2] = {tu_failures, tu_checks};
    MPI_Allreduce(MPI_IN_PLACE, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (wrank == 0) printf("mpi_comm: %d passed, %d failed\n", total[1] - total[0], total[0]);
    MPI_Finalize();
    return total[0] ? 1 : 0;
}
