// The MPI communicator: world and split construction (node of every rank,
// the intra-node and cross-node sub-communicators the hierarchical
// all-to-all uses), error agreement, abort, broadcast, all-gather, barrier,
// and the collective watchdog (comm.timeout_s, after NCCL's): collectives run
// nonblocking and are polled against a deadline, so a stopped or deadlocked
// peer ends the job with a report instead of hanging it. Communicators return
// MPI errors (MPI_ERRORS_RETURN) so that MPI_TRY can report them with the MPI
// error string; without MPI every entry point returns MOE_EINVAL.
#include "comm/comm_internal.h"
#include "moe/error.h"

#ifdef MOE_HAVE_MPI

#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MSG_BYTES = 512 }; // moe_last_error()'s capacity

int moe_comm_mpi_fail(int mpi_rc, const char *call, const char *file, int line) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(mpi_rc, s, &len) != MPI_SUCCESS)
        snprintf(s, sizeof s, "MPI error %d", mpi_rc);
    // "comm/alltoall_flat.c:42: MPI_Alltoallv: <string>": the last two path
    // components and the called function's name.
    const char *f = file + strlen(file);
    for (int slashes = 0; f > file; f--)
        if (f[-1] == '/' && ++slashes == 2) break;
    return moe_fail(MOE_EIO, "%s:%d: %.*s: %s", f, line, (int)strcspn(call, "("), call, s);
}

int moe_comm_mpi_elem_type(moe_comm *c, size_t es, MPI_Datatype *t) {
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        if (c->elem[i] != MPI_DATATYPE_NULL && c->elem_bytes[i] == es) {
            *t = c->elem[i];
            return 0;
        }
    int i = c->elem_next;
    c->elem_next = (i + 1) % MOE_COMM_TYPE_SLOTS;
    if (c->elem[i] != MPI_DATATYPE_NULL) MPI_Type_free(&c->elem[i]);
    c->elem[i] = MPI_DATATYPE_NULL;
    MPI_Datatype e;
    MPI_TRY(MPI_Type_contiguous((int)es, MPI_BYTE, &e));
    MPI_TRY(MPI_Type_commit(&e));
    c->elem[i] = e;
    c->elem_bytes[i] = es;
    *t = e;
    return 0;
}

// --- watchdog -------------------------------------------------------------------------
// One channel per process, a duplicate of MPI_COMM_WORLD: a rank whose
// collective timed out asks every other rank where it waits. Live ranks answer
// from inside their own wait loop, whatever communicator they wait on, and
// start their own report (the job is ending); a stopped, deadlocked or busy
// rank cannot answer, which names it.
enum { TAG_QUERY = 7001, TAG_REPLY, TAG_DONE, TAG_EXCHANGE, WHAT_MAX = 32 };

typedef struct {
    long call; // collectives started on that communicator, this one included
    int size;  // ranks of that communicator
    char what[WHAT_MAX];
} wait_state;

static MPI_Comm watch = MPI_COMM_NULL;
static int watch_refs, watch_me, watch_size;
// Send buffers of the fire-and-forget messages: they outlive the MPI_Isend.
static int watch_token;
static wait_state watch_reply;

static int watch_acquire(void) {
    if (watch_refs > 0) {
        watch_refs++;
        return 0;
    }
    MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &watch)); // collective, as moe_comm_mpi_world is
    MPI_Comm_set_errhandler(watch, MPI_ERRORS_RETURN);
    MPI_Comm_rank(watch, &watch_me);
    MPI_Comm_size(watch, &watch_size);
    watch_refs = 1;
    return 0;
}

static void watch_release(void) {
    if (watch_refs > 0 && --watch_refs == 0) MPI_Comm_free(&watch);
}

static void send_nowait(const void *buf, int bytes, int to, int tag) {
    MPI_Request r;
    if (MPI_Isend(buf, bytes, MPI_BYTE, to, tag, watch, &r) == MPI_SUCCESS) MPI_Request_free(&r);
}

// Answers pending queries with this rank's state; *asker = the first asker.
static void serve(const wait_state *mine, int *asker) {
    for (;;) {
        int flag = 0, q;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, watch, &flag, &st) != MPI_SUCCESS || !flag)
            return;
        MPI_Recv(&q, 1, MPI_INT, st.MPI_SOURCE, TAG_QUERY, watch, MPI_STATUS_IGNORE);
        watch_reply = *mine;
        send_nowait(&watch_reply, (int)sizeof watch_reply, st.MPI_SOURCE, TAG_REPLY);
        if (*asker < 0) *asker = st.MPI_SOURCE;
    }
}

// Receives one pending message of tag (out: bytes of it, NULL to discard);
// returns its source or -1.
static int take(int tag, void *out, int bytes) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, tag, watch, &flag, &st) != MPI_SUCCESS || !flag) return -1;
    char sink[sizeof(wait_state)];
    MPI_Recv(out ? out : sink, bytes, MPI_BYTE, st.MPI_SOURCE, tag, watch, MPI_STATUS_IGNORE);
    return st.MPI_SOURCE;
}

typedef struct {
    char s[MSG_BYTES];
    size_t n;
} line_buf;

static void add(line_buf *b, const char *fmt, ...) {
    if (b->n >= sizeof b->s) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->s + b->n, sizeof b->s - b->n, fmt, ap);
    va_end(ap);
    b->n = k < 0 ? sizeof b->s : b->n + (size_t)k;
}

static bool same_wait(const wait_state *a, const wait_state *b) {
    return a->call == b->call && a->size == b->size && !strcmp(a->what, b->what);
}

// The collective of c timed out here (asker < 0) or a peer reported its own
// timeout (asker = its world rank): ask every rank where it waits, give the
// others the grace to answer, and record the report. Ranks that answered then
// leave together (TAG_DONE), so each prints its line before one of them ends
// the job.
static int report(moe_comm *c, const wait_state *mine, double waited, int asker) {
    c->broken = true;
    wait_state *st = calloc((size_t)watch_size, sizeof *st);
    char *got = calloc((size_t)watch_size, 1), *done = calloc((size_t)watch_size, 1);
    if (!st || !got || !done) {
        free(st), free(got), free(done);
        return moe_fail(MOE_EIO, "comm.timeout_s = %g s expired in %s #%ld (%d ranks)",
                        c->timeout_s, mine->what, mine->call, c->size);
    }
    watch_token = watch_me;
    for (int w = 0; w < watch_size; w++)
        if (w != watch_me) send_nowait(&watch_token, (int)sizeof watch_token, w, TAG_QUERY);
    const double grace = c->timeout_s < 1 ? 1 : c->timeout_s > 5 ? 5 : c->timeout_s;
    int need = 0, have = 0, ignore = -1;
    for (int r = 0; r < c->size; r++)
        need += c->world_of[r] != watch_me;
    for (double end = moe_comm_now() + grace; have < need && moe_comm_now() < end;) {
        serve(mine, &ignore);
        wait_state w;
        int from = take(TAG_REPLY, &w, (int)sizeof w);
        if (from < 0) {
            sched_yield();
            continue;
        }
        if (got[from]) continue;
        got[from] = 1, st[from] = w;
        for (int r = 0; r < c->size; r++)
            have += c->world_of[r] == from;
    }
    for (int w = 0; w < watch_size; w++)
        if (got[w]) send_nowait(&watch_token, (int)sizeof watch_token, w, TAG_DONE);
    for (double end = moe_comm_now() + grace; moe_comm_now() < end;) {
        int left = 0;
        for (int w = 0; w < watch_size; w++)
            left += got[w] && !done[w];
        if (!left) break;
        serve(mine, &ignore);
        int from = take(TAG_DONE, NULL, (int)sizeof watch_token);
        if (from >= 0)
            done[from] = 1;
        else
            sched_yield();
    }

    line_buf b = {.n = 0};
    if (asker < 0)
        add(&b, "comm.timeout_s = %g s expired: rank %d waited %.1f s in %s #%ld (%d ranks)",
            c->timeout_s, watch_me, waited, mine->what, mine->call, c->size);
    else
        add(&b,
            "rank %d reported a collective timeout (comm.timeout_s = %g s); rank %d waits in "
            "%s #%ld (%d ranks)",
            asker, c->timeout_s, watch_me, mine->what, mine->call, c->size);
    int silent = 0;
    for (int r = 0; r < c->size; r++)
        silent += c->world_of[r] != watch_me && !got[c->world_of[r]];
    if (silent) {
        add(&b, "; no answer from rank");
        for (int r = 0, k = 0; r < c->size; r++) {
            int w = c->world_of[r];
            if (w != watch_me && !got[w]) add(&b, "%s %d", k++ ? "," : silent > 1 ? "s" : "", w);
        }
        add(&b, " (stopped, deadlocked or busy outside communication: it never reached %s #%ld)",
            mine->what, mine->call);
    }
    for (int r = 0; r < c->size; r++) { // peers waiting elsewhere: a mismatch
        int w = c->world_of[r];
        if (w != watch_me && got[w] && !same_wait(&st[w], mine))
            add(&b, "; rank %d waits in %.*s #%ld (%d ranks)", w, WHAT_MAX, st[w].what, st[w].call,
                st[w].size);
    }
    free(st), free(got), free(done);
    return moe_fail(MOE_EIO, "%s", b.s);
}

int moe_comm_mpi_waitall(moe_comm *c, int n, MPI_Request *reqs, const char *what) {
    if (!c || c->timeout_s <= 0) {
        if (c) c->calls++;
        MPI_TRY(MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE));
        return 0;
    }
    wait_state mine = {.call = ++c->calls, .size = c->size};
    snprintf(mine.what, sizeof mine.what, "%s", what);
    if (c->broken)
        return moe_fail(
            MOE_EIO, "%s: the communicator timed out earlier (comm.timeout_s); end the job", what);
    const double t0 = moe_comm_now(), deadline = t0 + c->timeout_s;
    for (long spin = 0;; spin++) {
        int done = 0, asker = -1;
        MPI_TRY(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
        if (done) return 0;
        serve(&mine, &asker);
        double now = moe_comm_now();
        if (asker >= 0 || now > deadline) return report(c, &mine, now - t0, asker);
        if (spin > 100) sched_yield(); // short collectives keep the core; long waits share it
    }
}

int moe_comm_mpi_wait(moe_comm *c, MPI_Request *req, const char *what) {
    return moe_comm_mpi_waitall(c, 1, req, what);
}

int moe_comm_mpi_exchange(moe_comm *c, MPI_Comm comm, const char *what, const void *send,
                          const int *sc, const int *sd, void *recv, const int *rc, const int *rd,
                          MPI_Datatype T, size_t es) {
    int P, me, n = 0, rc_ = 0;
    MPI_Comm_size(comm, &P);
    MPI_Comm_rank(comm, &me);
    MPI_Request *req = malloc(sizeof *req * 2 * (size_t)P);
    if (!req) return moe_fail(MOE_ENOMEM, "%s: %d requests", what, 2 * P);
    // Receives first, so that no message waits unexpected; one message per
    // non-empty block and peer, matched in order (MPI does not overtake).
    for (int s = 0; s < P && rc_ == 0; s++)
        if (s != me && rc[s] > 0)
            rc_ = MPI_Irecv((char *)recv + (size_t)rd[s] * es, rc[s], T, s, TAG_EXCHANGE, comm,
                            &req[n++]);
    for (int d = 0; d < P && rc_ == 0; d++) {
        int cnt = sc ? sc[d] : rc[me], off = sc ? sd[d] : rd[me];
        if (d != me && cnt > 0)
            rc_ = MPI_Isend((const char *)send + (size_t)off * es, cnt, T, d, TAG_EXCHANGE, comm,
                            &req[n++]);
    }
    if (rc_ != MPI_SUCCESS) {
        free(req); // what was posted is lost with the job: the caller aborts
        return moe_comm_mpi_fail(rc_, "MPI_Isend/MPI_Irecv", __FILE__, __LINE__);
    }
    if (sc && sc[me] > 0)
        memmove((char *)recv + (size_t)rd[me] * es, (const char *)send + (size_t)sd[me] * es,
                (size_t)sc[me] * es);
    int status = moe_comm_mpi_waitall(c, n, req, what);
    free(req);
    return status;
}

// The first failing rank's status and message, on every rank of comm: one
// small all-reduce when all is well, a broadcast of the message otherwise.
// c: the communicator's watchdog (NULL while it is being made).
static int agree_on(MPI_Comm comm, moe_comm *c, int rank, int size, int status) {
    int mine = status ? rank : size, first = size;
    MPI_COLL_TRY(c, "error agreement",
                 MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, MOE_REQ));
    if (first == size) return 0;
    struct {
        int code;
        char msg[MSG_BYTES];
    } m;
    memset(&m, 0, sizeof m);
    if (rank == first) {
        m.code = status;
        snprintf(m.msg, sizeof m.msg, "%s", moe_last_error());
    }
    MPI_COLL_TRY(c, "error agreement",
                 MPI_Ibcast(&m, (int)sizeof m, MPI_BYTE, first, comm, MOE_REQ));
    if (rank != first) moe_fail(m.code, "%s", m.msg);
    return m.code;
}

int moe_comm_mpi_agree(moe_comm *c, int status) {
    return agree_on(c->comm, c, c->rank, c->size, status);
}

// World rank of each rank of comm.
static int world_ranks(MPI_Comm comm, int size, int *out) {
    MPI_Group g, wg;
    MPI_TRY(MPI_Comm_group(comm, &g));
    int rc = MPI_Comm_group(MPI_COMM_WORLD, &wg);
    if (rc == MPI_SUCCESS) {
        for (int r = 0; r < size; r++)
            out[r] = r;
        rc = MPI_Group_translate_ranks(g, size, out, wg, out);
        MPI_Group_free(&wg);
    }
    MPI_Group_free(&g);
    MPI_TRY(rc);
    return 0;
}

// Takes ownership of comm (every rank of it calls this): ranks, node ids,
// G, and the sub-communicators of the hierarchical all-to-all; the watchdog
// timeout is inherited from the parent (0 for a world).
static int make(moe_comm **out, MPI_Comm comm, int node, double timeout_s) {
    int rc = 0, rank, size;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    moe_comm *c = calloc(1, sizeof *c);
    rc = agree_on(comm, NULL, rank, size, c ? 0 : moe_fail(MOE_ENOMEM, "communicator"));
    if (rc < 0) {
        free(c);
        MPI_Comm_free(&comm);
        return rc;
    }
    c->is_mpi = true;
    c->comm = comm;
    c->local = c->cross = MPI_COMM_NULL;
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        c->elem[i] = MPI_DATATYPE_NULL;
    c->rank = rank;
    c->size = size;
    c->node = node;
    c->timeout_s = timeout_s;
    int ok = moe_comm_alloc_work(c);
    if (ok == 0 && !(c->world_of = malloc(sizeof(int) * (size_t)size)))
        ok = moe_fail(MOE_ENOMEM, "communicator of %d ranks", size);
    if (ok == 0) ok = world_ranks(comm, size, c->world_of);
    MOE_TRY_GOTO(agree_on(comm, c, rank, size, ok), rc);
    MPI_COLL_TRY_GOTO(c, "all-gather (node ids)",
                      MPI_Iallgather(&node, 1, MPI_INT, c->iw, 1, MPI_INT, comm, MOE_REQ), rc);
    c->G = moe_comm_layout_ranks_per_node(c->iw, size);
    if (c->G > 1 && c->G < size) {
        MPI_TRY_GOTO(MPI_Comm_split(comm, rank / c->G, rank, &c->local), rc);
        MPI_TRY_GOTO(MPI_Comm_split(comm, rank % c->G, rank, &c->cross), rc);
    }
    *out = c;
    return 0;
fail:
    moe_comm_free(c);
    return rc;
}

// A node: the ranks sharing memory with this one, named by its lowest rank.
static int shared_node(MPI_Comm comm, int rank, int *node) {
    MPI_Comm shm;
    MPI_TRY(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm));
    int rc = MPI_Allreduce(&rank, node, 1, MPI_INT, MPI_MIN, shm);
    MPI_Comm_free(&shm);
    MPI_TRY(rc);
    return 0;
}

int moe_comm_mpi_world(moe_comm **out, int ranks_per_node) {
    *out = NULL;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
        return moe_fail(MOE_EINVAL, "MPI communicator: MPI is not initialised (call MPI_Init)");
    MPI_Comm comm;
    MPI_TRY(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int rank, size, node = 0, rc = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    // The node layout decides which collectives follow: every rank must pass
    // the same ranks_per_node, checked with fixed-size messages only.
    int lohi[2] = {ranks_per_node, -ranks_per_node}, r0 = ranks_per_node, who, theirs;
    rc = MPI_Allreduce(MPI_IN_PLACE, lohi, 2, MPI_INT, MPI_MIN, comm);
    if (rc == MPI_SUCCESS && lohi[0] != -lohi[1]) {
        rc = MPI_Bcast(&r0, 1, MPI_INT, 0, comm);
        who = ranks_per_node != r0 ? rank : size;
        if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, &who, 1, MPI_INT, MPI_MIN, comm);
        theirs = ranks_per_node;
        if (rc == MPI_SUCCESS) rc = MPI_Bcast(&theirs, 1, MPI_INT, who, comm);
        if (rc == MPI_SUCCESS) {
            MPI_Comm_free(&comm);
            return moe_fail(MOE_EINVAL,
                            "ranks disagree on comm.ranks_per_node: rank 0 has %d, rank %d has %d",
                            r0, who, theirs);
        }
    }
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(&comm);
        return moe_comm_mpi_fail(rc, "MPI_Allreduce", __FILE__, __LINE__);
    }
    if (ranks_per_node < 0) {
        MPI_Comm_free(&comm);
        return moe_fail(MOE_EINVAL, "comm.ranks_per_node = %d is negative", ranks_per_node);
    }
    if (ranks_per_node > 0 && size % ranks_per_node)
        rc = moe_fail(MOE_EINVAL, "comm.ranks_per_node = %d does not divide the %d ranks",
                      ranks_per_node, size);
    else if (ranks_per_node > 0)
        node = rank / ranks_per_node;
    else
        rc = shared_node(comm, rank, &node);
    if (rc == 0) rc = watch_acquire();
    if (rc < 0) {
        MPI_Comm_free(&comm);
        return rc;
    }
    if ((rc = make(out, comm, node, 0)) < 0) {
        watch_release();
        return rc;
    }
    (*out)->owns_watch = true;
    return 0;
}

int moe_comm_mpi_split(moe_comm *c, int color, int key, moe_comm **out) {
    MPI_Comm nc;
    MPI_TRY(MPI_Comm_split(c->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc));
    if (color < 0) return moe_fail(MOE_EINVAL, "comm split: color %d is negative", color);
    return make(out, nc, c->node, c->timeout_s);
}

void moe_comm_mpi_free(moe_comm *c) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return; // too late to free; the MPI library released everything
    for (int i = 0; i < MOE_COMM_TYPE_SLOTS; i++)
        if (c->elem[i] != MPI_DATATYPE_NULL) MPI_Type_free(&c->elem[i]);
    if (c->local != MPI_COMM_NULL) MPI_Comm_free(&c->local);
    if (c->cross != MPI_COMM_NULL) MPI_Comm_free(&c->cross);
    if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    if (c->owns_watch) watch_release();
}

void moe_comm_mpi_abort(moe_comm *c, int code) {
    MPI_Abort(c->comm, code);
}

int moe_comm_mpi_bcast(moe_comm *c, void *buf, size_t bytes, int root) {
    for (size_t o = 0; o < bytes; o += 1u << 30) {
        size_t n = bytes - o < (1u << 30) ? bytes - o : (1u << 30);
        MPI_COLL_TRY(c, "broadcast",
                     MPI_Ibcast((char *)buf + o, (int)n, MPI_BYTE, root, c->comm, MOE_REQ));
    }
    return 0;
}

int moe_comm_mpi_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each) {
    const void *s = send == (char *)recv + (size_t)c->rank * bytes_each ? MPI_IN_PLACE : send;
    if (bytes_each == 0) return 0; // (an empty collective would upset libnbc's tags)
    MPI_COLL_TRY(c, "all-gather",
                 MPI_Iallgather(s, (int)bytes_each, MPI_BYTE, recv, (int)bytes_each, MPI_BYTE,
                                c->comm, MOE_REQ));
    return 0;
}

int moe_comm_mpi_barrier(moe_comm *c) {
    MPI_COLL_TRY(c, "barrier", MPI_Ibarrier(c->comm, MOE_REQ));
    return 0;
}

#else // built without MPI

static int no_mpi(const char *what) {
    return moe_fail(MOE_EINVAL, "%s: moe was built without MPI (install libopenmpi-dev, rebuild)",
                    what);
}

int moe_comm_mpi_world(moe_comm **out, int ranks_per_node) {
    (void)ranks_per_node;
    *out = NULL;
    return no_mpi("MPI communicator");
}
int moe_comm_mpi_split(moe_comm *c, int color, int key, moe_comm **out) {
    (void)c, (void)color, (void)key;
    *out = NULL;
    return no_mpi("comm split");
}
void moe_comm_mpi_free(moe_comm *c) {
    (void)c;
}
int moe_comm_mpi_agree(moe_comm *c, int status) {
    (void)c;
    return status;
}
void moe_comm_mpi_abort(moe_comm *c, int code) {
    (void)c, (void)code;
}
int moe_comm_mpi_bcast(moe_comm *c, void *buf, size_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
    return no_mpi("broadcast");
}
int moe_comm_mpi_allgather(moe_comm *c, const void *send, void *recv, size_t bytes_each) {
    (void)c, (void)send, (void)recv, (void)bytes_each;
    return no_mpi("all-gather");
}
int moe_comm_mpi_barrier(moe_comm *c) {
    (void)c;
    return no_mpi("barrier");
}

#endif
