// Line and column of every "section.key" in a JSON text. Jansson reports
// positions only for syntax errors; semantic errors (unknown key, wrong type,
// impossible value) need the position of the key, so this scans the already
// validated text once and records where each object member's key starts.
#include "trainer/json_pos.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *s;
    int i, line, col;
    json_pos *out;
    int n, max;
} scanner;

static void adv(scanner *sc) {
    if (sc->s[sc->i] == '\n')
        sc->line++, sc->col = 1;
    else
        sc->col++;
    sc->i++;
}

static void ws(scanner *sc) {
    while (sc->s[sc->i] == ' ' || sc->s[sc->i] == '\t' || sc->s[sc->i] == '\n' ||
           sc->s[sc->i] == '\r')
        adv(sc);
}

// Reads a string literal; copies its raw content (escapes kept) into buf.
static void str(scanner *sc, char *buf, size_t cap) {
    size_t n = 0;
    adv(sc); // opening quote
    while (sc->s[sc->i] && sc->s[sc->i] != '"') {
        if (sc->s[sc->i] == '\\') {
            if (buf && n + 1 < cap) buf[n++] = sc->s[sc->i];
            adv(sc);
        }
        if (buf && n + 1 < cap) buf[n++] = sc->s[sc->i];
        if (sc->s[sc->i]) adv(sc);
    }
    if (sc->s[sc->i]) adv(sc);
    if (buf) buf[n] = 0;
}

static void value(scanner *sc, const char *path, int depth);

static void object(scanner *sc, const char *path, int depth) {
    adv(sc); // {
    for (;;) {
        ws(sc);
        if (sc->s[sc->i] != '"') break;
        int line = sc->line, col = sc->col;
        char key[96], full[JSON_POS_KEY];
        str(sc, key, sizeof key);
        if (path) snprintf(full, sizeof full, "%s%s%s", path, *path ? "." : "", key);
        if (path && sc->n < sc->max) {
            json_pos *p = &sc->out[sc->n++];
            snprintf(p->key, sizeof p->key, "%s", full);
            p->line = line, p->col = col;
        }
        ws(sc);
        if (sc->s[sc->i] == ':') adv(sc);
        value(sc, path ? full : NULL, depth + 1);
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
        str(sc, NULL, 0);
    } else {
        while (sc->s[sc->i] && !strchr(",}] \t\r\n", sc->s[sc->i]))
            adv(sc);
    }
}

int json_pos_scan(const char *text, json_pos *out, int max) {
    scanner sc = {text, 0, 1, 1, out, 0, max};
    value(&sc, "", 0);
    return sc.n;
}

const json_pos *json_pos_find(const json_pos *pos, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (!strcmp(pos[i].key, key)) return &pos[i];
    return NULL;
}
