// The data movements of one variable all-to-all for a communicator whose
// transport is point-to-point (NCCL): a list of copies, sends and receives per
// rank in phases, derived from the full count matrix. Flat: one phase, a send
// and a receive per peer. Hierarchical (the algorithm of comm/alltoall_hier.c
// on ranks r = n G + l): pack the send blocks by local peer, exchange inside
// the node, transpose the forwarded blocks by node, exchange across nodes
// between ranks of one local index. Pure and host-only, so tests/test_comm.c
// runs every rank's schedule on the CPU and checks what arrives where.
#include "comm/comm_internal.h"
#include "moe/error.h"

static void add_op(moe_a2a_op *ops, int *n, int phase, int kind, int peer, moe_a2a_buf sb,
                   size_t so, moe_a2a_buf db, size_t dof, size_t bytes) {
    if (!bytes) return;
    ops[(*n)++] = (moe_a2a_op){phase, kind, peer, sb, so, db, dof, bytes};
}

// One exchange with peer: a copy when peer is this rank, else a send and a receive.
static void exchange(moe_a2a_op *ops, int *n, int phase, int me, int peer, moe_a2a_buf sb,
                     size_t so, size_t sbytes, moe_a2a_buf db, size_t dof, size_t rbytes) {
    if (peer == me) {
        add_op(ops, n, phase, MOE_A2A_COPY, -1, sb, so, db, dof, sbytes);
        return;
    }
    add_op(ops, n, phase, MOE_A2A_SEND, peer, sb, so, db, 0, sbytes);
    add_op(ops, n, phase, MOE_A2A_RECV, peer, sb, 0, db, dof, rbytes);
}

int moe_a2a_schedule(moe_a2a_op *ops, int *n_ops, size_t *stage_bytes, const int *C, int P, int G,
                     int me, size_t es, bool hierarchical) {
    *n_ops = 0;
    *stage_bytes = 0;
    if (P < 1 || me < 0 || me >= P || G < 1 || P % G)
        return moe_fail(MOE_EINVAL, "all-to-all schedule: P=%d G=%d rank %d", P, G, me);
    int n = 0;
    if (!hierarchical || G == 1 || G == P) {
        size_t so = 0, ro = 0;
        for (int p = 0; p < P; p++) {
            size_t sb = (size_t)C[(size_t)me * P + p] * es, rb = (size_t)C[(size_t)p * P + me] * es;
            exchange(ops, &n, 0, me, p, MOE_A2A_BUF_SEND, so, sb, MOE_A2A_BUF_RECV, ro, rb);
            so += sb, ro += rb;
        }
        *n_ops = n;
        return 0;
    }
    const int N = P / G, nd = me / G, l = me % G;
#define CNT(s, d) ((size_t)C[(size_t)(s)*P + (d)] * es)
    size_t stotal = 0, ftotal = 0;
    for (int d = 0; d < P; d++)
        stotal += CNT(me, d);
    for (int j = 0; j < G; j++)
        for (int m = 0; m < N; m++)
            ftotal += CNT(nd * G + j, m * G + l);
    // staging: pack [stotal] | fwd [ftotal] | fwd2 [ftotal]
    const size_t pack = 0, fwd = stotal, fwd2 = stotal + ftotal;
    *stage_bytes = stotal + 2 * ftotal;
    // phase 0: pack [l'][m] from send [m][l'] (send is in destination order)
    size_t off = 0;
    for (int lp = 0; lp < G; lp++)
        for (int m = 0; m < N; m++) {
            size_t so = 0;
            for (int d = 0; d < m * G + lp; d++)
                so += CNT(me, d);
            add_op(ops, &n, 0, MOE_A2A_COPY, -1, MOE_A2A_BUF_SEND, so, MOE_A2A_BUF_STAGE,
                   pack + off, CNT(me, m * G + lp));
            off += CNT(me, m * G + lp);
        }
    // phase 1: to local peer l' its run of pack; from local peer j the blocks
    // C[(nd, j)][(m, l)] over m into fwd [j][m]
    size_t so = 0, ro = 0;
    for (int lp = 0; lp < G; lp++) {
        size_t sb = 0, rb = 0;
        for (int m = 0; m < N; m++) {
            sb += CNT(me, m * G + lp);
            rb += CNT(nd * G + lp, m * G + l);
        }
        exchange(ops, &n, 1, me, nd * G + lp, MOE_A2A_BUF_STAGE, pack + so, sb, MOE_A2A_BUF_STAGE,
                 fwd + ro, rb);
        so += sb, ro += rb;
    }
    // phase 2: fwd [j][m] -> fwd2 [m][j]
    off = 0;
    for (int m = 0; m < N; m++)
        for (int j = 0; j < G; j++) {
            size_t fo = 0; // offset of block (j, m) in fwd
            for (int jj = 0; jj <= j; jj++)
                for (int mm = 0; mm < (jj < j ? N : m); mm++)
                    fo += CNT(nd * G + jj, mm * G + l);
            add_op(ops, &n, 2, MOE_A2A_COPY, -1, MOE_A2A_BUF_STAGE, fwd + fo, MOE_A2A_BUF_STAGE,
                   fwd2 + off, CNT(nd * G + j, m * G + l));
            off += CNT(nd * G + j, m * G + l);
        }
    // phase 3: to rank (m, l) the run fwd2[m]; from it the blocks C[(m, j)][me]
    // over j, which land in source-rank order
    so = 0, ro = 0;
    for (int m = 0; m < N; m++) {
        size_t sb = 0, rb = 0;
        for (int j = 0; j < G; j++) {
            sb += CNT(nd * G + j, m * G + l);
            rb += CNT(m * G + j, me);
        }
        exchange(ops, &n, 3, me, m * G + l, MOE_A2A_BUF_STAGE, fwd2 + so, sb, MOE_A2A_BUF_RECV, ro,
                 rb);
        so += sb, ro += rb;
    }
#undef CNT
    *n_ops = n;
    return 0;
}
