// Line and column of every "section.key" in a JSON text. Jansson reports
// positions only for syntax errors; semantic errors (unknown key, wrong type,
// impossible value) need the position of the key, so this scans the already
// validated text once and records where each object member's key starts.
// Keys are user text: every path is allocated to its length, never cut.
#include "trainer/json_pos.h"
#include "moe/error.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *s;
    size_t i;
    int line, col;
    json_pos *out;
    int n, cap;
    int oom;
} scanner;

// Columns count characters, as jansson's syntax errors and editors do: a
// UTF-8 continuation byte (10xxxxxx) adds none.
static void adv(scanner *sc) {
    if (sc->s[sc->i] == '\n')
        sc->line++, sc->col = 1;
    else if (((unsigned char)sc->s[sc->i] & 0xC0) != 0x80)
        sc->col++;
    sc->i++;
}

static void ws(scanner *sc) {
    while (sc->s[sc->i] == ' ' || sc->s[sc->i] == '\t' || sc->s[sc->i] == '\n' ||
           sc->s[sc->i] == '\r')
        adv(sc);
}

// Skips a string literal; *start and *len give its raw content (escapes kept).
static void str(scanner *sc, const char **start, size_t *len) {
    adv(sc); // opening quote
    size_t i0 = sc->i;
    while (sc->s[sc->i] && sc->s[sc->i] != '"') {
        if (sc->s[sc->i] == '\\') adv(sc);
        if (sc->s[sc->i]) adv(sc);
    }
    if (start) *start = sc->s + i0, *len = sc->i - i0;
    if (sc->s[sc->i]) adv(sc);
}

// path + "." + key, allocated; NULL (and oom set) when memory runs out.
static char *join(scanner *sc, const char *path, const char *key, size_t len) {
    size_t pl = strlen(path);
    char *full = malloc(pl + 1 + len + 1);
    if (!full) {
        sc->oom = 1;
        return NULL;
    }
    memcpy(full, path, pl);
    size_t n = pl;
    if (pl) full[n++] = '.';
    memcpy(full + n, key, len);
    full[n + len] = 0;
    return full;
}

static void value(scanner *sc, const char *path, int depth);

static void object(scanner *sc, const char *path, int depth) {
    adv(sc); // {
    for (;;) {
        ws(sc);
        if (sc->s[sc->i] != '"') break;
        int line = sc->line, col = sc->col;
        const char *key;
        size_t len;
        str(sc, &key, &len);
        char *full = path && !sc->oom ? join(sc, path, key, len) : NULL;
        if (full && sc->n == sc->cap) {
            int cap = sc->cap ? 2 * sc->cap : 64;
            json_pos *grown = realloc(sc->out, sizeof *grown * (size_t)cap);
            if (!grown) {
                sc->oom = 1;
                free(full);
                full = NULL;
            } else {
                sc->out = grown, sc->cap = cap;
            }
        }
        if (full) sc->out[sc->n++] = (json_pos){full, line, col};
        ws(sc);
        if (sc->s[sc->i] == ':') adv(sc);
        value(sc, full, depth + 1);
        ws(sc);
        if (sc->s[sc->i] == ',') adv(sc);
    }
    if (sc->s[sc->i] == '}') adv(sc);
}

static void value(scanner *sc, const char *path, int depth) {
    ws(sc);
    char c = sc->s[sc->i];
    if (depth > 64) return; // jansson already bounds nesting; stay safe anyway
    if (c == '{') {
        object(sc, path, depth);
    } else if (c == '[') {
        adv(sc);
        for (;;) {
            ws(sc);
            if (!sc->s[sc->i] || sc->s[sc->i] == ']') break;
            value(sc, NULL, depth + 1); // array items are reported at their key
            ws(sc);
            if (sc->s[sc->i] == ',')
                adv(sc);
            else
                break;
        }
        if (sc->s[sc->i] == ']') adv(sc);
    } else if (c == '"') {
        str(sc, NULL, NULL);
    } else {
        while (sc->s[sc->i] && !strchr(",}] \t\r\n", sc->s[sc->i]))
            adv(sc);
    }
}

void json_pos_free(json_pos *pos, int n) {
    for (int i = 0; i < n; i++)
        free(pos[i].key);
    free(pos);
}

int json_pos_scan(const char *text, json_pos **out) {
    scanner sc = {text, 0, 1, 1, NULL, 0, 0, 0};
    value(&sc, "", 0);
    if (sc.oom) {
        json_pos_free(sc.out, sc.n);
        *out = NULL;
        return MOE_ENOMEM;
    }
    *out = sc.out;
    return sc.n;
}

const json_pos *json_pos_find(const json_pos *pos, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (!strcmp(pos[i].key, key)) return &pos[i];
    return NULL;
}
