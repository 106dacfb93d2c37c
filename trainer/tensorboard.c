// TensorBoard event files: TFRecord framing with masked CRC-32C and a minimal
// protobuf encoding of tensorflow.Event (wall_time = 1 double, step = 2
// int64, file_version = 3 string, summary = 5 Summary{value = 1 Value{tag = 1
// string, simple_value = 2 float}}, session_log = 7 SessionLog{status = 1}),
// the subset TensorBoard's scalars and its purge on a restart use.
#include "moe/tensorboard.h"
#include "moe/error.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

uint32_t moe_crc32c(const void *data, size_t n) {
    static uint32_t table[256];
    static int ready;
    if (!ready) { // reflected polynomial 0x82F63B78 (Castagnoli)
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++)
                c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    const unsigned char *p = data;
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++)
        c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

// TFRecord masks the CRC so a CRC of data holding CRCs stays well spread.
uint32_t moe_tb_masked_crc(const void *data, size_t n) {
    uint32_t c = moe_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// A growing byte buffer for one encoded message.
typedef struct {
    unsigned char *p;
    size_t n, cap;
    int bad;
} buf;

static void put(buf *b, const void *src, size_t n) {
    if (b->bad || n == 0) return;
    if (b->n + n > b->cap) {
        size_t cap = (b->cap ? 2 * b->cap : 256) + n;
        unsigned char *q = realloc(b->p, cap);
        if (!q) {
            b->bad = 1;
            return;
        }
        b->p = q, b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void varint(buf *b, uint64_t v) {
    unsigned char t[10];
    int n = 0;
    do {
        t[n++] = (unsigned char)((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
        v >>= 7;
    } while (v);
    put(b, t, n);
}

static void le(buf *b, uint64_t v, int bytes) {
    unsigned char t[8];
    for (int i = 0; i < bytes; i++)
        t[i] = (unsigned char)(v >> (8 * i));
    put(b, t, bytes);
}

// Field `field` of wire type 2 (length-delimited).
static void bytes_field(buf *b, int field, const void *p, size_t n) {
    varint(b, (uint64_t)field << 3 | 2);
    varint(b, n);
    put(b, p, n);
}

static int write_record(moe_tb_writer *w, const buf *data) {
    unsigned char len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (unsigned char)((uint64_t)data->n >> (8 * i));
    uint32_t c1 = moe_tb_masked_crc(len, 8), c2 = moe_tb_masked_crc(data->p, data->n);
    unsigned char crc[8];
    for (int i = 0; i < 4; i++)
        crc[i] = (unsigned char)(c1 >> (8 * i)), crc[4 + i] = (unsigned char)(c2 >> (8 * i));
    fwrite(len, 1, 8, w->f);
    fwrite(crc, 1, 4, w->f);
    fwrite(data->p, 1, data->n, w->f);
    fwrite(crc + 4, 1, 4, w->f);
    if (fflush(w->f) != 0 || ferror(w->f))
        return moe_fail(MOE_EIO, "%s: write failed: %s", w->path, strerror(errno));
    return 0;
}

// Event header: wall_time (field 1, fixed64 double) and step (field 2, varint).
static void event_head(buf *b, double wall_time, long step) {
    uint64_t bits;
    memcpy(&bits, &wall_time, 8);
    varint(b, 1 << 3 | 1);
    le(b, bits, 8);
    varint(b, 2 << 3 | 0);
    varint(b, (uint64_t)step);
}

// The seconds in the name of the latest event file of dir (0: none).
// TensorBoard reads a folder's event files in name order, so a resume's file
// must sort after the files it supersedes, even when it opens in their second.
static long long latest_seconds(const char *dir) {
    static const char prefix[] = "events.out.tfevents.";
    long long latest = 0;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, sizeof prefix - 1)) continue;
        char *end;
        long long t = strtoll(e->d_name + sizeof prefix - 1, &end, 10);
        if (*end == '.' && t > latest) latest = t;
    }
    if (d) closedir(d);
    return latest;
}

int moe_tb_open(moe_tb_writer *w, const char *dir, long purge_step) {
    memset(w, 0, sizeof *w);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long secs = ts.tv_sec;
    const long long latest = latest_seconds(dir);
    if (secs <= latest) secs = latest + 1;
    if (snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%lld.moe.%ld", dir, secs,
                 (long)getpid()) >= (int)sizeof w->path)
        return moe_fail(MOE_EINVAL, "%s: path too long for its event file", dir);
    if (!(w->f = fopen(w->path, "wb")))
        return moe_fail(MOE_EIO, "%s: cannot create: %s", w->path, strerror(errno));
    const double now = ts.tv_sec + 1e-9 * ts.tv_nsec;
    buf b = {0};
    event_head(&b, now, 0);
    bytes_field(&b, 3, "brain.Event:2", 13);
    int rc = b.bad ? moe_fail(MOE_ENOMEM, "%s: out of memory", w->path) : write_record(w, &b);
    if (rc == 0 && purge_step > 0) {
        // session_log (field 7) = SessionLog{status (1) = START (1)} at
        // purge_step: TensorBoard then drops the points of every earlier file
        // at that step or later (torch's SummaryWriter(purge_step=N) does so).
        static const unsigned char start[] = {1 << 3 | 0, 1};
        b.n = 0;
        event_head(&b, now, purge_step);
        bytes_field(&b, 7, start, sizeof start);
        rc = b.bad ? moe_fail(MOE_ENOMEM, "%s: out of memory", w->path) : write_record(w, &b);
    }
    free(b.p);
    return rc;
}

int moe_tb_scalars(moe_tb_writer *w, long step, double wall_time, const char *const *tags,
                   const float *values, int n) {
    buf ev = {0}, sum = {0}, val = {0};
    for (int i = 0; i < n; i++) {
        val.n = 0;
        bytes_field(&val, 1, tags[i], strlen(tags[i]));
        uint32_t bits;
        memcpy(&bits, &values[i], 4);
        varint(&val, 2 << 3 | 5);
        le(&val, bits, 4);
        bytes_field(&sum, 1, val.p, val.n);
    }
    event_head(&ev, wall_time, step);
    bytes_field(&ev, 5, sum.p, sum.n);
    int rc = ev.bad || sum.bad || val.bad ? moe_fail(MOE_ENOMEM, "%s: out of memory", w->path)
                                          : write_record(w, &ev);
    free(ev.p);
    free(sum.p);
    free(val.p);
    return rc;
}

int moe_tb_close(moe_tb_writer *w) {
    if (!w->f) return 0;
    int bad = ferror(w->f) != 0;
    int rc = fclose(w->f) != 0 || bad
                 ? moe_fail(MOE_EIO, "%s: write failed: %s", w->path, strerror(errno))
                 : 0;
    w->f = NULL;
    return rc;
}
