// Positions of object keys in a JSON text (see json_pos.c).
#ifndef MOE_JSON_POS_H
#define MOE_JSON_POS_H

typedef struct {
    char *key;     // dotted path, e.g. "router.top_k" (allocated, any length)
    int line, col; // 1-based, of the key's opening quote
} json_pos;

// Scans text (valid JSON) into *out (allocated); returns the count, or
// MOE_ENOMEM with *out NULL. Free with json_pos_free.
int json_pos_scan(const char *text, json_pos **out);
void json_pos_free(json_pos *pos, int n);
const json_pos *json_pos_find(const json_pos *pos, int n, const char *key);

#endif
