// The local communicator (every op a copy), the node layout of a
// communicator, the index math of the hierarchical all-to-all (simulated for
// all ranks in one process, compared with flat), the rank-order sum, and the
// traffic predictions on hand-computed cases. MPI runs: tests/mpi_comm.c.
#include "comm/comm_internal.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

START_TEST(test_local_alltoallv_copies_rows) {
    moe_comm *c;
    ck_assert_int_eq(moe_comm_local(&c), 0);
    ck_assert_int_eq(moe_comm_rank(c), 0);
    ck_assert_int_eq(moe_comm_size(c), 1);
    ck_assert_int_eq(moe_comm_ranks_per_node(c), 1);
    float send[6] = {1, 2, 3, 4, 5, 6};
    float *recv = tu_guarded_alloc(8);
    int counts = 3, rc_counts = -1; // rows of 2 floats
    for (moe_a2a_algo a = MOE_A2A_FLAT; a <= MOE_A2A_HIERARCHICAL; a++) {
        memset(recv, 0, 8 * sizeof(float));
        ck_assert_int_eq(
            moe_comm_alltoallv(c, a, send, &counts, recv, &rc_counts, 4, 2 * sizeof(float)), 0);
        ck_assert_int_eq(rc_counts, 3);
        ck_assert_mem_eq(recv, send, sizeof send);
        ck_assert(recv[6] == 0 && recv[7] == 0);
    }
    // Zero rows: nothing written, count 0.
    int zero = 0;
    memset(recv, 0, 8 * sizeof(float));
    ck_assert_int_eq(moe_comm_alltoallv(c, MOE_A2A_FLAT, send, &zero, recv, &rc_counts, 0, 4), 0);
    ck_assert_int_eq(rc_counts, 0);
    for (int i = 0; i < 8; i++)
        ck_assert(recv[i] == 0);
    ck_assert(tu_guards_intact(recv, 8));
    tu_guarded_free(recv, 8);

    moe_comm_stats s;
    moe_comm_stats_get(c, &s);
    ck_assert_int_eq(s.a2a_calls, 3);
    ck_assert_int_eq(s.bytes_sent, 0);
    ck_assert_int_eq(s.msgs_sent, 0);
    moe_comm_stats_reset(c);
    moe_comm_stats_get(c, &s);
    ck_assert_int_eq(s.a2a_calls, 0);
    moe_comm_free(c);
}
END_TEST

START_TEST(test_local_alltoallv_rejects_overflow_and_bad_counts) {
    moe_comm *c;
    ck_assert_int_eq(moe_comm_local(&c), 0);
    float send[4] = {1, 2, 3, 4};
    float *recv = tu_guarded_alloc(3);
    int counts = 4, rc_counts = -1;
    ck_assert_int_eq(moe_comm_alltoallv(c, MOE_A2A_FLAT, send, &counts, recv, &rc_counts, 3, 4),
                     MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "receives 4 elements, its buffer holds 3"));
    for (int i = 0; i < 3; i++)
        ck_assert(recv[i] == 0);
    ck_assert(tu_guards_intact(recv, 3));
    counts = -2;
    ck_assert_int_eq(moe_comm_alltoallv(c, MOE_A2A_FLAT, send, &counts, recv, &rc_counts, 3, 4),
                     MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "send_counts[0] = -2 is negative"));
    counts = 1;
    ck_assert_int_eq(moe_comm_alltoallv(c, 7, send, &counts, recv, &rc_counts, 3, 4), MOE_EINVAL);
    ck_assert_int_eq(moe_comm_alltoallv(c, MOE_A2A_FLAT, send, &counts, recv, &rc_counts, 3, 0),
                     MOE_EINVAL);
    tu_guarded_free(recv, 3);
    moe_comm_free(c);
}
END_TEST

START_TEST(test_local_collectives_are_identity) {
    moe_comm *c;
    ck_assert_int_eq(moe_comm_local(&c), 0);
    float f[3] = {1.5f, -2, 1e30f};
    double d[2] = {0.1, -7};
    int64_t i[2] = {INT64_MAX, -3};
    ck_assert_int_eq(moe_comm_allreduce_f32(c, f, 3), 0);
    ck_assert_int_eq(moe_comm_allreduce_f64(c, d, 2), 0);
    ck_assert_int_eq(moe_comm_allreduce_i64(c, i, 2), 0);
    ck_assert_int_eq(moe_comm_allreduce_f32(c, f, 0), 0);
    ck_assert(f[0] == 1.5f && f[1] == -2 && f[2] == 1e30f);
    ck_assert(d[0] == 0.1 && d[1] == -7);
    ck_assert(i[0] == INT64_MAX && i[1] == -3);
    char msg[8] = "hello";
    ck_assert_int_eq(moe_comm_bcast(c, msg, sizeof msg, 0), 0);
    ck_assert_str_eq(msg, "hello");
    ck_assert_int_eq(moe_comm_bcast(c, msg, sizeof msg, 1), MOE_EINVAL);
    int mine = 42, all = 0;
    ck_assert_int_eq(moe_comm_allgather(c, &mine, &all, sizeof mine), 0);
    ck_assert_int_eq(all, 42);
    ck_assert_int_eq(moe_comm_allgather(c, &all, &all, sizeof all), 0); // in place
    ck_assert_int_eq(all, 42);
    ck_assert_int_eq(moe_comm_barrier(c), 0);
    moe_comm_stats s;
    moe_comm_stats_get(c, &s);
    ck_assert_int_eq(s.allreduce_calls, 4);
    ck_assert_int_eq(s.allreduce_bytes_sent, 0);
    moe_comm_free(c);
}
END_TEST

START_TEST(test_local_agree_split_abort) {
    moe_comm *c, *sub;
    ck_assert_int_eq(moe_comm_local(&c), 0);
    moe_fail(MOE_OK, "nothing wrong");
    ck_assert_int_eq(moe_comm_agree(c, 0), 0);
    ck_assert_str_eq(moe_last_error(), "nothing wrong");
    int st = moe_fail(MOE_EFORMAT, "configs/x.json: bad");
    ck_assert_int_eq(moe_comm_agree(c, st), MOE_EFORMAT);
    ck_assert_str_eq(moe_last_error(), "configs/x.json: bad");
    ck_assert_int_eq(moe_comm_split(c, 3, 0, &sub), 0);
    ck_assert_int_eq(moe_comm_size(sub), 1);
    ck_assert_int_eq(moe_comm_rank(sub), 0);
    moe_comm_free(sub);
    ck_assert_int_eq(moe_comm_split(c, -1, 0, &sub), MOE_EINVAL);
    ck_assert_ptr_null(sub);
    moe_comm_abort(c, 2); // local: returns, the caller exits
    moe_comm_free(c);
    moe_comm_free(NULL);
}
END_TEST

START_TEST(test_mpi_world_needs_mpi) {
    // Without MPI: "built without MPI"; with MPI but no MPI_Init: "not initialised".
    moe_comm *c = (moe_comm *)1;
    ck_assert_int_eq(moe_comm_mpi_world(&c, 0), MOE_EINVAL);
    ck_assert_ptr_null(c);
    ck_assert(strstr(moe_last_error(), "MPI") != NULL);
}
END_TEST

START_TEST(test_layout_ranks_per_node) {
    const int a[] = {0, 0, 1, 1}, b[] = {7, 7, 7, 7}, d[] = {0, 1, 0, 1}, e[] = {0, 0, 1},
              f[] = {0, 0, 1, 1, 0, 0}, g[] = {5, 5, 5, 9, 9, 9}, h[] = {0, 1, 2, 3},
              k[] = {0, 0, 1, 1, 1, 1};
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(a, 4), 2);
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(b, 4), 4);
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(d, 4), 1); // round-robin placement
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(e, 3), 1); // unequal nodes
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(f, 6), 1); // node 0 in two runs
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(g, 6), 3);
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(h, 4), 1);
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(k, 6), 1);
    ck_assert_int_eq(moe_comm_layout_ranks_per_node(b, 1), 1);
}
END_TEST

START_TEST(test_block_transpose) {
    // 2 x 3 blocks [a][b] of lengths len, chars as elements.
    const int len[6] = {1, 0, 2, 3, 1, 0};
    const char in[] = "A"
                      ""
                      "CC"
                      "DDD"
                      "E"
                      "";
    char out[8] = {0};
    size_t work[6];
    moe_comm_block_transpose(out, in, len, 2, 3, 1, work);
    ck_assert_str_eq(out, "ADDDECC"); // [b][a]: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)
    const int x[6] = {1, 2, 3, 4, 5, 6};
    int y[6];
    moe_comm_block_transpose(y, x, NULL, 2, 3, sizeof(int), NULL);
    const int want[6] = {1, 4, 2, 5, 3, 6};
    ck_assert_mem_eq(y, want, sizeof want);
}
END_TEST

static unsigned char byte_of(int s, int d, int i, int b) {
    return (unsigned char)(s * 67 + d * 29 + i * 7 + b * 3 + 1);
}

// Runs the two steps of alltoall_hier.c for all P = N G ranks in one process
// (the MPI_Alltoall(v)s become copies) and checks every rank receives what
// flat delivers: counts C[s][me] and the rows of rank 0, 1, ... in order.
static void simulate_hierarchical(int P, int G, const int *C, size_t es) {
    const int N = P / G;
    size_t *work = malloc(sizeof(size_t) * P);
    int *cs1 = malloc(sizeof(int) * P * P), *cr1 = malloc(sizeof(int) * P * P),
        *cs2 = malloc(sizeof(int) * P * P), *rcnt = malloc(sizeof(int) * P * P);
    unsigned char **pack = calloc(P, sizeof *pack), **fwd = calloc(P, sizeof *fwd),
                  **fwd2 = calloc(P, sizeof *fwd2), **recv = calloc(P, sizeof *recv);
    size_t cap = 0;
    for (int i = 0; i < P * P; i++)
        cap += (size_t)C[i];
    cap = (cap + 1) * es;
    for (int r = 0; r < P; r++) {
        pack[r] = malloc(cap), fwd[r] = malloc(cap), fwd2[r] = malloc(cap), recv[r] = malloc(cap);
        // The caller's send buffer: [d] rows for rank d, packed [l'][m].
        unsigned char *send = malloc(cap);
        size_t o = 0;
        for (int d = 0; d < P; d++)
            for (int i = 0; i < C[r * P + d]; i++)
                for (size_t b = 0; b < es; b++)
                    send[o++] = byte_of(r, d, i, (int)b);
        moe_comm_block_transpose(cs1 + r * P, C + r * P, NULL, N, G, sizeof(int), NULL);
        moe_comm_block_transpose(pack[r], send, C + r * P, N, G, es, work);
        free(send);
    }
    // Step 1: rank (n, l) gets, from local peer j = (n, j), run l of its pack.
    for (int r = 0; r < P; r++) {
        int n = r / G, l = r % G;
        size_t o = 0;
        for (int j = 0; j < G; j++) {
            int src = n * G + j;
            size_t off = 0, len = 0;
            for (int q = 0; q < G * N; q++) {
                if (q / N < l) off += (size_t)cs1[src * P + q];
                if (q / N == l) len += (size_t)cs1[src * P + q];
            }
            memcpy(cr1 + r * P + j * N, cs1 + src * P + l * N, sizeof(int) * N);
            memcpy(fwd[r] + o * es, pack[src] + off * es, len * es);
            o += len;
        }
        moe_comm_block_transpose(cs2 + r * P, cr1 + r * P, NULL, G, N, sizeof(int), NULL);
        moe_comm_block_transpose(fwd2[r], fwd[r], cr1 + r * P, G, N, es, work);
    }
    // Step 2: rank (m, l) gets, from rank (k, l) of every node k, run m of its fwd2.
    for (int r = 0; r < P; r++) {
        int m = r / G, l = r % G;
        size_t o = 0;
        for (int k = 0; k < N; k++) {
            int src = k * G + l;
            size_t off = 0, len = 0;
            for (int q = 0; q < N * G; q++) {
                if (q / G < m) off += (size_t)cs2[src * P + q];
                if (q / G == m) len += (size_t)cs2[src * P + q];
            }
            memcpy(rcnt + r * P + k * G, cs2 + src * P + m * G, sizeof(int) * G);
            memcpy(recv[r] + o * es, fwd2[src] + off * es, len * es);
            o += len;
        }
        // Flat's answer.
        size_t at = 0;
        for (int s = 0; s < P; s++) {
            ck_assert_int_eq(rcnt[r * P + s], C[s * P + r]);
            for (int i = 0; i < C[s * P + r]; i++)
                for (size_t b = 0; b < es; b++, at++)
                    ck_assert_msg(recv[r][at] == byte_of(s, r, i, (int)b),
                                  "P %d G %d: rank %d, row %d from %d", P, G, r, i, s);
        }
        ck_assert_uint_eq(at, o * es);
    }
    for (int r = 0; r < P; r++)
        free(pack[r]), free(fwd[r]), free(fwd2[r]), free(recv[r]);
    free(pack), free(fwd), free(fwd2), free(recv);
    free(cs1), free(cr1), free(cs2), free(rcnt), free(work);
}

START_TEST(test_hierarchical_index_math_matches_flat) {
    const int shapes[][2] = {{4, 2}, {6, 2}, {6, 3}, {8, 2}, {8, 4}, {4, 1}, {4, 4}, {12, 3}};
    tu_rng g;
    tu_seed(&g, 5);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int P = shapes[k][0], G = shapes[k][1];
        int *C = malloc(sizeof(int) * P * P);
        for (int trial = 0; trial < 3; trial++) {
            for (int i = 0; i < P * P; i++) {
                C[i] = tu_uniform(&g) < 0.35f ? 0 : (int)(tu_uniform(&g) * 9);
                if (trial == 1 && (i / P == 1 || i % P == P - 1)) C[i] = 0; // silent rank 1,
            }                                                               // empty rank P-1
            simulate_hierarchical(P, G, C, trial == 2 ? 5 : 1);
        }
        free(C);
    }
}
END_TEST

START_TEST(test_sum_rows_in_rank_order) {
    // Column 0 in rank order: ((1 + 1e8) - 1e8) + 1 = 1 in fp32; a tree
    // (1 + 1e8) + (-1e8 + 1) gives 0. Column 1: ((1e8 + 1) - 1e8) + 0 = 0;
    // adding 1e8 - 1e8 first would give 1.
    const float rows[4][2] = {{1, 1e8f}, {1e8f, 1}, {-1e8f, -1e8f}, {1, 0}};
    float out[2];
    moe_comm_sum_rows(MOE_AR_F32, out, rows, 4, 2, sizeof rows[0]);
    ck_assert(out[0] == 1.0f);
    ck_assert(out[1] == 0.0f);
    const int64_t ir[2][1] = {{INT64_MAX}, {1}};
    int64_t io;
    moe_comm_sum_rows(MOE_AR_I64, &io, ir, 2, 1, sizeof ir[0]); // wraps, no UB
    ck_assert(io == INT64_MIN);
}
END_TEST

START_TEST(test_predict_hand_computed) {
    // P = 4, G = 2: ranks 0 1 on node 0, 2 3 on node 1. C[s][d]:
    const int C[16] = {1, 2, 0, 3, /**/ 0, 0, 4, 5, /**/ 6, 0, 0, 0, /**/ 0, 7, 8, 0};
    long b, m;
    // Flat rank 0: 2 + 3 elements to ranks 1 and 3.
    ck_assert_int_eq(moe_comm_a2a_predict(4, 2, MOE_A2A_FLAT, C, 2, 0, &b, &m), 0);
    ck_assert(b == 10 && m == 2);
    // Hierarchical rank 0: step 1 to rank 1, C[0][1] + C[0][3] = 5; step 2 to
    // rank 2, C[0][2] + C[1][2] = 4.
    ck_assert_int_eq(moe_comm_a2a_predict(4, 2, MOE_A2A_HIERARCHICAL, C, 2, 0, &b, &m), 0);
    ck_assert(b == 18 && m == 2);
    // Rank 2: step 1 to rank 3 nothing (C[2][1] + C[2][3] = 0); step 2 to rank 0,
    // C[2][0] + C[3][0] = 6.
    ck_assert_int_eq(moe_comm_a2a_predict(4, 2, MOE_A2A_HIERARCHICAL, C, 2, 2, &b, &m), 0);
    ck_assert(b == 12 && m == 1);
    // Rank 3: step 1 to rank 2, C[3][0] + C[3][2] = 8; step 2 to rank 1, C[2][1] + C[3][1] = 7.
    ck_assert_int_eq(moe_comm_a2a_predict(4, 2, MOE_A2A_HIERARCHICAL, C, 2, 3, &b, &m), 0);
    ck_assert(b == 30 && m == 2);
    // G = 1 and G = P are flat.
    for (int r = 0; r < 4; r++) {
        long fb, fm;
        ck_assert_int_eq(moe_comm_a2a_predict(4, 1, MOE_A2A_FLAT, C, 3, r, &fb, &fm), 0);
        for (int G = 1; G <= 4; G *= 4) {
            ck_assert_int_eq(moe_comm_a2a_predict(4, G, MOE_A2A_HIERARCHICAL, C, 3, r, &b, &m), 0);
            ck_assert(b == fb && m == fm);
        }
    }
    ck_assert_int_eq(moe_comm_a2a_predict(4, 3, MOE_A2A_FLAT, C, 2, 0, &b, &m), MOE_EINVAL);
    const int neg[1] = {-1};
    ck_assert_int_eq(moe_comm_a2a_predict(1, 1, MOE_A2A_FLAT, neg, 2, 0, &b, &m), MOE_EINVAL);
}
END_TEST

START_TEST(test_allreduce_predict_hand_computed) {
    long b;
    ck_assert_int_eq(moe_comm_allreduce_predict(1, 0, 1000000, 4, &b), 0);
    ck_assert_int_eq(b, 0);
    ck_assert_int_eq(moe_comm_allreduce_predict(4, 2, 10, 4, &b), 0); // gathered: 40 B to 3 peers
    ck_assert_int_eq(b, 120);
    ck_assert_int_eq(moe_comm_allreduce_predict(4, 1, 100000, 4, &b), 0); // slices of 25000
    ck_assert_int_eq(b, 4 * (100000 - 25000 + 3 * 25000));
    // Two segments: 2^22 (slices of 2^20), then 2 elements: slices 0 1 0 1.
    const long seg = 4L * ((1 << 22) + 2 * (1 << 20));
    ck_assert_int_eq(moe_comm_allreduce_predict(4, 0, (1 << 22) + 2, 4, &b), 0);
    ck_assert_int_eq(b, seg + 4 * 2);
    ck_assert_int_eq(moe_comm_allreduce_predict(4, 1, (1 << 22) + 2, 4, &b), 0);
    ck_assert_int_eq(b, seg + 4 * (2 - 1 + 3));
    ck_assert_int_eq(moe_comm_allreduce_predict(4, 4, 1, 4, &b), MOE_EINVAL);
}
END_TEST

// The point-to-point schedule of the NCCL all-to-all (comm/a2a_schedule.c)
// run for every rank on the CPU: copies as memcpy, each send paired with the
// receive its peer posts in the same phase. Flat and hierarchical must deliver
// what every rank sends to every other, in source-rank order, for uneven and
// zero counts, several node sizes and element sizes.
static unsigned char sched_byte(int s, int d, size_t i) {
    return (unsigned char)(s * 31 + d * 7 + i * 13 + 1);
}

static void run_schedule_on_cpu(const int *C, int P, int G, size_t es, bool hier) {
    moe_a2a_op *ops[16];
    int n_ops[16];
    size_t stage_bytes[16];
    unsigned char *send[16], *recv[16], *stage[16];
    for (int r = 0; r < P; r++) {
        ops[r] = malloc(sizeof(moe_a2a_op) * moe_a2a_schedule_max_ops(P));
        ck_assert_int_eq(moe_a2a_schedule(ops[r], &n_ops[r], &stage_bytes[r], C, P, G, r, es, hier),
                         0);
        ck_assert_int_le(n_ops[r], moe_a2a_schedule_max_ops(P));
        size_t sb = 0, rb = 0;
        for (int p = 0; p < P; p++)
            sb += (size_t)C[r * P + p] * es, rb += (size_t)C[p * P + r] * es;
        send[r] = malloc(sb + 1), recv[r] = malloc(rb + 1), stage[r] = malloc(stage_bytes[r] + 1);
        memset(recv[r], 0xEE, rb + 1);
        size_t o = 0;
        for (int d = 0; d < P; d++)
            for (size_t i = 0; i < (size_t)C[r * P + d] * es; i++)
                send[r][o++] = sched_byte(r, d, i);
    }
    int *matched = calloc((size_t)P * moe_a2a_schedule_max_ops(P), sizeof(int));
    for (int phase = 0; phase < 4; phase++) {
        for (int r = 0; r < P; r++) { // copies
            unsigned char *b[3] = {send[r], recv[r], stage[r]};
            for (int i = 0; i < n_ops[r]; i++) {
                const moe_a2a_op *o = &ops[r][i];
                if (o->phase == phase && o->kind == MOE_A2A_COPY)
                    memcpy(b[o->dst] + o->dst_off, b[o->src] + o->src_off, o->bytes);
            }
        }
        for (int r = 0; r < P; r++) // sends, each to the matching receive
            for (int i = 0; i < n_ops[r]; i++) {
                const moe_a2a_op *o = &ops[r][i];
                if (o->phase != phase || o->kind != MOE_A2A_SEND) continue;
                int q = o->peer, found = -1;
                for (int x = 0; x < n_ops[q]; x++)
                    if (ops[q][x].phase == phase && ops[q][x].kind == MOE_A2A_RECV &&
                        ops[q][x].peer == r)
                        found = x;
                ck_assert_msg(found >= 0, "P=%d G=%d: rank %d sends to %d in phase %d, no recv", P,
                              G, r, q, phase);
                ck_assert_uint_eq(ops[q][found].bytes, o->bytes);
                matched[q * moe_a2a_schedule_max_ops(P) + found]++;
                unsigned char *sb[3] = {send[r], recv[r], stage[r]};
                unsigned char *db[3] = {send[q], recv[q], stage[q]};
                memcpy(db[ops[q][found].dst] + ops[q][found].dst_off, sb[o->src] + o->src_off,
                       o->bytes);
            }
    }
    for (int r = 0; r < P; r++) {
        for (int i = 0; i < n_ops[r]; i++)
            if (ops[r][i].kind == MOE_A2A_RECV)
                ck_assert_int_eq(matched[r * moe_a2a_schedule_max_ops(P) + i], 1);
        size_t o = 0;
        for (int s = 0; s < P; s++)
            for (size_t i = 0; i < (size_t)C[s * P + r] * es; i++, o++)
                ck_assert_msg(recv[r][o] == sched_byte(s, r, i),
                              "P=%d G=%d hier=%d es=%zu: rank %d byte %zu from rank %d", P, G, hier,
                              es, r, i, s);
        free(ops[r]), free(send[r]), free(recv[r]), free(stage[r]);
    }
    free(matched);
}

START_TEST(test_p2p_schedule_delivers_like_flat) {
    tu_rng rng;
    tu_seed(&rng, 99);
    const int sizes[] = {1, 2, 3, 4, 6, 8, 12, 16};
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        const int P = sizes[si];
        int *C = malloc(sizeof(int) * P * P);
        for (int trial = 0; trial < 3; trial++) {
            for (int i = 0; i < P * P; i++) // ~1/3 zeros; trial 2: all zero but self
                C[i] = trial == 2 ? (i / P == i % P) * 3
                                  : (tu_uniform(&rng) < 0.33f ? 0 : (int)(tu_uniform(&rng) * 9));
            for (int G = 1; G <= P; G++) {
                if (P % G) continue;
                for (int hier = 0; hier < 2; hier++)
                    for (size_t es = 1; es <= 8; es += 7)
                        run_schedule_on_cpu(C, P, G, es, hier);
            }
        }
        free(C);
    }
    moe_a2a_op ops[8];
    int n;
    size_t st;
    ck_assert_int_eq(moe_a2a_schedule(ops, &n, &st, NULL, 4, 3, 0, 4, true), MOE_EINVAL);
}
END_TEST

static Suite *comm_suite(void) {
    Suite *s = suite_create("comm");
    TCase *tc = tcase_create("local");
    tcase_add_test(tc, test_local_alltoallv_copies_rows);
    tcase_add_test(tc, test_local_alltoallv_rejects_overflow_and_bad_counts);
    tcase_add_test(tc, test_local_collectives_are_identity);
    tcase_add_test(tc, test_local_agree_split_abort);
    tcase_add_test(tc, test_mpi_world_needs_mpi);
    suite_add_tcase(s, tc);
    tc = tcase_create("topology");
    tcase_add_test(tc, test_layout_ranks_per_node);
    tcase_add_test(tc, test_block_transpose);
    tcase_add_test(tc, test_hierarchical_index_math_matches_flat);
    tcase_add_test(tc, test_p2p_schedule_delivers_like_flat);
    tcase_add_test(tc, test_sum_rows_in_rank_order);
    tcase_add_test(tc, test_predict_hand_computed);
    tcase_add_test(tc, test_allreduce_predict_hand_computed);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(comm_suite());
}
