// Every rank of a job must train the same run: the same resolved config (every
// key), --out, --resume and data files (names and sizes of what the globs
// resolve to). A careless launch otherwise crashes in a mismatched collective,
// hangs, or trains silently with rank 0's settings recorded.
// Protocol: one fixed-size all-gather of a hash; only on a mismatch rank 0's
// text is broadcast (its length first) and every rank compares it with its own.
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/shards.h"
#include "moe/train.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// The run as "name\tvalue\n" lines, in a fixed order.
typedef struct {
    char *s;
    size_t n, cap;
} text;

static int put(text *t, const char *name, const char *value) {
    size_t need = t->n + strlen(name) + strlen(value) + 3;
    if (need > t->cap) {
        size_t cap = need * 2;
        char *p = realloc(t->s, cap);
        if (!p) return moe_fail(MOE_ENOMEM, "run check: out of memory");
        t->s = p, t->cap = cap;
    }
    t->n += (size_t)sprintf(t->s + t->n, "%s\t%s\n", name, value);
    return 0;
}

// A value as JSON; a number in the fewest digits that read back as it (0.003,
// not 0.0030000000000000001), which still tells every two values apart.
static char *real_text(json_t *v) {
    if (!json_is_real(v))
        return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    char buf[40];
    double x = json_real_value(v);
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, x);
        if (strtod(buf, NULL) == x) break;
    }
    return strdup(buf);
}

// Every key of the resolved config, as the run's config.json holds it.
static int put_config(text *t, const moe_config *cfg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return moe_fail(MOE_ENOMEM, "run check: out of memory");
    int rc = moe_config_write(cfg, f);
    fclose(f);
    json_t *root = rc == 0 ? json_loadb(buf, len, 0, NULL) : NULL;
    free(buf);
    if (rc < 0) return rc;
    if (!root) return moe_fail(MOE_EINVAL, "run check: the resolved config is not JSON");
    const char *sec, *key;
    json_t *obj, *v;
    json_object_foreach(root, sec, obj) {
        json_object_foreach(obj, key, v) {
            char name[160];
            snprintf(name, sizeof name, "%s.%s", sec, key);
            char *val = real_text(v);
            rc = val ? put(t, name, val) : moe_fail(MOE_ENOMEM, "run check: out of memory");
            free(val);
            if (rc < 0) break;
        }
        if (rc < 0) break;
    }
    json_decref(root);
    return rc;
}

// The files a data glob resolves to: their count first (so that the lines
// after it stay aligned between ranks), then each name and size. A pattern
// that matches nothing is left to the data loader, which names it.
static int put_files(text *t, const char *key, const char *pattern) {
    if (!pattern[0]) return 0;
    char **paths = NULL, name[160], val[64];
    int n = 0;
    if (moe_glob_paths(key, pattern, &paths, &n) < 0) n = 0;
    // the pattern (equal on all ranks when their configs are) names what a
    // rank with no match lacks
    snprintf(name, sizeof name, "pattern of %s", key);
    int rc = put(t, name, pattern);
    snprintf(name, sizeof name, "files of %s", key);
    snprintf(val, sizeof val, "%d", n);
    if (rc == 0) rc = put(t, name, val);
    for (int i = 0; i < n && rc == 0; i++) {
        struct stat st;
        char *line = malloc(strlen(paths[i]) + 48);
        if (!line) {
            rc = moe_fail(MOE_ENOMEM, "run check: out of memory");
            break;
        }
        sprintf(line, "%s (%lld bytes)", paths[i],
                stat(paths[i], &st) == 0 ? (long long)st.st_size : -1LL);
        snprintf(name, sizeof name, "file %d of %s", i + 1, key);
        rc = put(t, name, line);
        free(line);
    }
    moe_glob_free(paths, n);
    return rc;
}

static int describe(text *t, const moe_config *cfg, const char *out_dir, const char *resume_dir) {
    MOE_TRY(put_config(t, cfg));
    MOE_TRY(put(t, "--out", out_dir ? out_dir : "(none)"));
    MOE_TRY(put(t, "--resume", resume_dir ? resume_dir : "(none)"));
    MOE_TRY(put_files(t, "data.path", cfg->data.path));
    MOE_TRY(put_files(t, "data.val_path", cfg->data.val_path));
    for (int i = 0; i < cfg->data.n_tasks; i++) {
        char key[MOE_NAME_MAX + 16];
        snprintf(key, sizeof key, "data.tasks.%s", cfg->data.tasks[i]);
        MOE_TRY(put_files(t, key, cfg->data.task_paths[i]));
    }
    return 0;
}

static uint64_t fnv1a(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

// Line i of a text: *name, *value (lengths nn, nv); false past the end.
static bool line_at(const char **p, const char *end, const char **name, int *nn, const char **value,
                    int *nv) {
    if (*p >= end) return false;
    const char *tab = memchr(*p, '\t', (size_t)(end - *p));
    const char *nl = memchr(*p, '\n', (size_t)(end - *p));
    if (!nl) nl = end;
    if (!tab || tab > nl) tab = nl;
    *name = *p, *nn = (int)(tab - *p);
    *value = tab < nl ? tab + 1 : nl, *nv = (int)(nl - *value);
    *p = nl < end ? nl + 1 : end;
    return true;
}

// The "file I of KEY" lines after a count line, p advanced past them: the
// first n names (without their " (N bytes)") into names/lens.
static int file_names(const char **p, const char *end, const char **names, int *lens, int max) {
    int n = 0;
    const char *q = *p, *name, *value;
    int nn, nv;
    while (line_at(&q, end, &name, &nn, &value, &nv) && nn > 5 && !memcmp(name, "file ", 5)) {
        int k = nv;
        while (k > 1 && memcmp(value + k - 2, " (", 2))
            k--;
        if (n < max) names[n] = value, lens[n] = k > 1 ? k - 2 : nv;
        n++;
        *p = q;
    }
    return n < max ? n : max;
}

// The first file one list has and the other lacks: -1 when every name of a is
// in b.
static int first_missing(const char **a, const int *la, int na, const char **b, const int *lb,
                         int nb) {
    for (int i = 0; i < na; i++) {
        int j = 0;
        while (j < nb && (lb[j] != la[i] || memcmp(b[j], a[i], (size_t)la[i])))
            j++;
        if (j == nb) return i;
    }
    return -1;
}

// Ranks whose globs resolve to different file counts: the message names the
// first file this rank lacks (or has beyond rank 0's), or the pattern that
// matches nothing here, as a counts-only message did not.
static int files_differ(const char *a, const char *ea, const char *b, const char *eb,
                        const char *key, int lkey, const char *count0, int lc0, const char *mine,
                        int lmine, const char *pat, int lpat, int rank) {
    enum { MAX = 4096 };
    const char **fa = malloc(sizeof *fa * MAX), **fb = malloc(sizeof *fb * MAX);
    int *la = malloc(sizeof *la * MAX), *lb = malloc(sizeof *lb * MAX);
    int rc;
    if (!fa || !fb || !la || !lb) {
        rc = moe_fail(MOE_ENOMEM, "run check: out of memory");
        goto done;
    }
    int na = file_names(&a, ea, fa, la, MAX), nb = file_names(&b, eb, fb, lb, MAX);
    int i = first_missing(fa, la, na, fb, lb, nb), j = i < 0 ? first_missing(fb, lb, nb, fa, la, na)
                                                             : -1;
    if (nb == 0)
        rc = moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has %.*s, rank %d has %.*s "
                                  "(rank %d: no file matches %.*s)",
                      lkey, key, lc0, count0, rank, lmine, mine, rank, lpat, pat);
    else if (i >= 0)
        rc = moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has %.*s, rank %d has %.*s "
                                  "(rank %d lacks %.*s, which rank 0 has)",
                      lkey, key, lc0, count0, rank, lmine, mine, rank, la[i], fa[i]);
    else if (j >= 0)
        rc = moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has %.*s, rank %d has %.*s "
                                  "(rank %d has %.*s, which rank 0 lacks)",
                      lkey, key, lc0, count0, rank, lmine, mine, rank, lb[j], fb[j]);
    else
        rc = moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has %.*s, rank %d has %.*s",
                      lkey, key, lc0, count0, rank, lmine, mine);
done:
    free(fa), free(fb), free(la), free(lb);
    return rc;
}

// This rank's first difference from rank 0's text, as the message.
static int first_difference(const char *r0, size_t n0, const char *mine, size_t n1, int rank) {
    const char *a = r0, *b = mine, *ea = r0 + n0, *eb = mine + n1;
    const char *pat = "";
    int lpat = 0;
    for (;;) {
        const char *na = NULL, *va = NULL, *nb = NULL, *vb = NULL;
        int lna = 0, lva = 0, lnb = 0, lvb = 0;
        bool ha = line_at(&a, ea, &na, &lna, &va, &lva), hb = line_at(&b, eb, &nb, &lnb, &vb, &lvb);
        if (!ha && !hb) break;
        if (hb && lnb > 11 && !memcmp(nb, "pattern of ", 11)) pat = vb, lpat = lvb;
        if (ha && hb && lna == lnb && !memcmp(na, nb, (size_t)lna) &&
            (lva != lvb || memcmp(va, vb, (size_t)lva))) {
            if (lna > 9 && !memcmp(na, "files of ", 9))
                return files_differ(a, ea, b, eb, na, lna, va, lva, vb, lvb, pat, lpat, rank);
            return moe_fail(MOE_EINVAL,
                            "ranks disagree on %.*s: rank 0 has %.*s, rank %d has %.*s (every "
                            "rank of a job must run the same config, --out, --resume and data "
                            "files)",
                            lna, na, lva, va, rank, lvb, vb);
        }
        if (!hb)
            return moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has %.*s, rank %d has none",
                            lna, na, lva, va, rank);
        if (!ha)
            return moe_fail(MOE_EINVAL, "ranks disagree on %.*s: rank 0 has none, rank %d has %.*s",
                            lnb, nb, rank, lvb, vb);
        if (lna != lnb || memcmp(na, nb, (size_t)lna))
            return moe_fail(MOE_EINVAL,
                            "ranks disagree on the run: rank 0 has %.*s where rank %d has %.*s "
                            "(every rank must run the same moe build, config and data files)",
                            lna, na, rank, lnb, nb);
    }
    // (equal texts: a hash collision elsewhere, or rank 0's own line)
    return 0;
}

int moe_train_check_same(struct moe_comm *world, const moe_config *cfg, const char *out_dir,
                         const char *resume_dir) {
    const int size = moe_comm_size(world), rank = moe_comm_rank(world);
    if (size == 1) return 0;
    text t = {NULL, 0, 0};
    int local = describe(&t, cfg, out_dir, resume_dir);
    // Fixed-size first: a failure to describe is agreed, then the hashes.
    uint64_t *h = malloc(sizeof *h * (size_t)size);
    if (local == 0 && !h) local = moe_fail(MOE_ENOMEM, "run check: out of memory");
    int rc = moe_comm_agree(world, local);
    if (rc < 0) goto done;
    h[rank] = fnv1a(t.s, t.n);
    if ((rc = moe_comm_allgather(world, &h[rank], h, sizeof *h)) < 0) goto done;
    bool same = true;
    for (int r = 1; r < size; r++)
        same = same && h[r] == h[0];
    if (same) goto done;
    // Rank 0's text on every rank: its length, then the bytes.
    int64_t n0 = (int64_t)t.n;
    if ((rc = moe_comm_bcast(world, &n0, sizeof n0, 0)) < 0) goto done;
    char *r0 = rank == 0 ? t.s : malloc((size_t)n0 + 1);
    rc = moe_comm_agree(world, r0 ? 0 : moe_fail(MOE_ENOMEM, "run check: out of memory"));
    if (rc == 0) rc = moe_comm_bcast(world, r0, (size_t)n0, 0);
    if (rc == 0) {
        int mine = h[rank] != h[0] ? first_difference(r0, (size_t)n0, t.s, t.n, rank) : 0;
        rc = moe_comm_agree(world, mine);
    }
    if (r0 != t.s) free(r0);
done:
    free(h);
    free(t.s);
    return rc;
}
