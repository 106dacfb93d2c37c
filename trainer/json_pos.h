// Positions of object keys in a JSON text (see json_pos.c).
#ifndef MOE_JSON_POS_H
#define MOE_JSON_POS_H

#define JSON_POS_KEY 128

typedef struct {
    char key[JSON_POS_KEY]; // dotted path, e.g. "router.top_k"
    int line, col;          // 1-based, of the key's opening quote
} json_pos;

// Scans text (valid JSON) and fills at most max entries; returns the count.
int json_pos_scan(const char *text, json_pos *out, int max);
const json_pos *json_pos_find(const json_pos *pos, int n, const char *key);

#endif
