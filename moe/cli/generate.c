// `moe generate CKPT --task NAME --prompt TEXT | --input FILE`: loads only the
// experts the task needs, generates with a KV cache (greedy or sampled), and
// reports what it loaded (bytes read, experts per layer, peak RSS) on stderr.
#include "moe/checkpoint.h"
#include "moe/cli/cli.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/infer.h"
#include "moe/shards.h"
#include "moe/task_experts.h"
#include "moe/tokenizer.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

enum { MAX_LINES = 4096, MAX_LINE = 1 << 20, BATCH = 64 };

static const char *generate_help =
    "usage: moe generate CKPT_DIR [--task NAME] (--prompt TEXT | --input FILE)\n"
    "                    [--max-new N] [--temperature T] [--top-k K] [--seed S]\n"
    "                    [--full-load] [--expert-budget P] [--quantize int8] [--raw] [--quiet]\n"
    "\n"
    "Generates the continuation of TEXT (or of every line of FILE, at most 4096, one\n"
    "answer per line, decoded in batches of 64) for task NAME, loading from the\n"
    "checkpoint only the experts the task needs: in task-routed layers\n"
    "(moe.task_layers) the task's top_k experts recorded in task_experts.json, in\n"
    "token-routed layers every expert unless --expert-budget P keeps only the experts\n"
    "that carried at least the share P of the task's routed tokens on validation data\n"
    "(an approximation: moe eval CKPT --expert-budget P reports its loss). --full-load\n"
    "reads every expert (same output bit for bit when no budget is set). --quantize\n"
    "int8 keeps experts as int8 with one scale per output row.\n"
    "\n"
    "With model.tokenizer = bytes tokens are bytes. With the synthetic tasks the task's\n"
    "marker byte is put before the prompt (not with --raw) and an answer ends at a\n"
    "newline; a prompt is the task input and '=', e.g. --task reverse --prompt 'abcd='.\n"
    "Greedy by default; --temperature T > 0 samples (among the --top-k K most likely\n"
    "tokens when K > 0) with --seed S (default 0): an answer's draws depend on S and its\n"
    "line of FILE (--prompt: line 1), not on the other lines. Only ids the tokenizer\n"
    "decodes are produced (bytes: 0..255), also when model.vocab_size is larger.\n"
    "--max-new N (default 32) caps the tokens per answer; an answer also ends at the\n"
    "model's context (model.seq_len tokens, prompt included), noted once on stderr.\n"
    "Every prompt is checked (not empty, fits the context with BOS; UTF-8 for a\n"
    "SentencePiece model) before the first answer; a bad one is refused naming its\n"
    "line. Options that cannot change the answers (--top-k or --seed without\n"
    "--temperature, --raw without task markers) are named in a note.\n"
    "Answers go to stdout, bytes outside printable ASCII as \\xNN; what was loaded and\n"
    "the speed go to stderr (--quiet: not printed). A checkpoint trained with a\n"
    "SentencePiece tokenizer keeps it (tokenizer.model): prompts are encoded with it\n"
    "after its BOS token, an answer ends at its EOS token and is printed decoded\n"
    "(UTF-8; control bytes as \\xNN).\n"
    "\n"
    "exit status: 0 ok, 1 runtime failure, 2 bad usage or input (unknown task, missing\n"
    "or truncated checkpoint, missing expert tensor)\n";

// An answer of a SentencePiece model, decoded: one line of UTF-8 text.
static int print_text(FILE *f, const moe_tokenizer *tok, const int32_t *t, int n, int stop) {
    if (n > 0 && t[n - 1] == stop) n--;
    char *s;
    size_t len;
    MOE_TRY(moe_tok_decode(tok, t, (size_t)n, &s, &len));
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 32 || c == 127)
            fprintf(f, "\\x%02x", c);
        else
            fputc(c, f);
    }
    fputc('\n', f);
    free(s);
    return 0;
}

static void print_answer(FILE *f, const int32_t *t, int n, int stop) {
    if (n > 0 && t[n - 1] == stop) n--; // the newline that ends an answer
    for (int i = 0; i < n; i++) {
        if (t[i] >= 32 && t[i] < 127)
            fputc(t[i], f);
        else
            fprintf(f, "\\x%02x", (unsigned)t[i]); // ids past 255 are never sampled
    }
    fputc('\n', f);
}

// Reads FILE's lines (without their newline) into lines[]; returns the count.
// Bounded: a line over MAX_LINE bytes, more than cap lines, a NUL byte or a
// file that is not a regular file (a folder, a FIFO, /dev/zero) is refused with
// the file and line named, before anything grows without bound.
static int read_lines(const char *path, char **lines, int cap) {
    FILE *f;
    MOE_TRY(moe_fopen_regular(path, &f));
    char *buf = malloc(MAX_LINE + 1);
    int n = 0, rc = buf ? 0 : moe_fail(MOE_ENOMEM, "%s: out of memory", path);
    for (int c = 0; rc == 0 && c != EOF;) {
        size_t len = 0;
        while ((c = getc(f)) != EOF && c != '\n') {
            if (c == '\0') {
                rc = moe_fail(MOE_EINVAL, "%s:%d: NUL byte at column %zu (prompts are text)", path,
                              n + 1, len + 1);
                break;
            }
            if (len == MAX_LINE) {
                rc =
                    moe_fail(MOE_EINVAL, "%s:%d: line longer than %d bytes", path, n + 1, MAX_LINE);
                break;
            }
            buf[len++] = (char)c;
        }
        if (rc < 0) break;
        if (ferror(f)) {
            rc = moe_fail(MOE_EIO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (c == EOF && len == 0) break; // no partial last line
        while (len > 0 && buf[len - 1] == '\r')
            len--;
        buf[len] = '\0';
        if (n == cap)
            rc = moe_fail(MOE_EINVAL, "%s: more than %d lines (--input takes at most %d prompts)",
                          path, cap, cap);
        else if (!(lines[n] = strdup(buf)))
            rc = moe_fail(MOE_ENOMEM, "%s: out of memory", path);
        else
            n++;
    }
    free(buf);
    fclose(f);
    if (rc < 0) {
        while (n > 0)
            free(lines[--n]);
        return rc;
    }
    return n;
}

typedef struct {
    const char *dir, *task, *prompt, *input;
    moe_infer_opts io;
    moe_gen_opts go;
    bool raw, quiet;
    bool top_k, seed; // given (they only matter when sampling)
} gen_args;

static int parse(int argc, char **argv, gen_args *a) {
    long long v;
    const char *max_new = NULL, *top_k = NULL, *seed = NULL, *temp = NULL, *budget = NULL,
               *quant = NULL;
    for (int i = 1; i < argc; i++) {
        int m;
        if ((m = moe_cli_opt_once(argc, argv, &i, "--task", &a->task)) != 0 ||
            (m = moe_cli_opt_once(argc, argv, &i, "--prompt", &a->prompt)) != 0 ||
            (m = moe_cli_opt_path(argc, argv, &i, "--input", &a->input)) != 0) {
            if (m < 0) return -1;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--max-new", &max_new)) != 0) {
            if (m < 0) return -1;
            if (!moe_cli_parse_long(max_new, 0, 1 << 20, &v))
                return moe_fail(MOE_EINVAL, "--max-new needs an integer in [0, %d]", 1 << 20), -1;
            a->go.max_new = (int)v;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--top-k", &top_k)) != 0) {
            if (m < 0) return -1;
            if (!moe_cli_parse_long(top_k, 0, 1 << 20, &v))
                return moe_fail(MOE_EINVAL, "--top-k needs an integer in [0, %d]", 1 << 20), -1;
            a->go.top_k = (int)v;
            a->top_k = true;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--seed", &seed)) != 0) {
            if (m < 0) return -1;
            if (!moe_cli_parse_long(seed, 0, INT64_MAX, &v))
                return moe_fail(MOE_EINVAL, "--seed needs an integer in [0, %lld]",
                                (long long)INT64_MAX),
                       -1;
            a->go.seed = (uint64_t)v;
            a->seed = true;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--temperature", &temp)) != 0) {
            if (m < 0) return -1;
            if (!moe_cli_parse_double(temp, 0, 1e6, false, &a->go.temperature))
                return moe_fail(MOE_EINVAL, "--temperature needs a number in [0, 1e6]"), -1;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--expert-budget", &budget)) != 0) {
            if (m < 0) return -1;
            if (!moe_cli_parse_double(budget, 0, 1, true, &a->io.expert_budget))
                return moe_fail(MOE_EINVAL, "--expert-budget needs a share in (0, 1]"), -1;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--quantize", &quant)) != 0) {
            if (m < 0) return -1;
            if (strcmp(quant, "int8"))
                return moe_fail(MOE_EINVAL, "--quantize: only int8 is supported, not '%s'", quant),
                       -1;
            a->io.quantize_int8 = true;
        } else if ((m = moe_cli_flag(argv[i], "--full-load", &a->io.full_load)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--raw", &a->raw)) != 0 ||
                   (m = moe_cli_flag(argv[i], "--quiet", &a->quiet)) != 0) {
            if (m < 0) return -1;
        } else if (argv[i][0] == '-') {
            return moe_cli_option_error("generate", argv[i], generate_help), -1;
        } else if (!a->dir) {
            a->dir = argv[i];
        } else {
            return moe_fail(MOE_EINVAL, "more than one checkpoint ('%s', '%s')", a->dir, argv[i]),
                   -1;
        }
    }
    if (!a->dir) return moe_fail(MOE_EINVAL, "no checkpoint folder given"), -1;
    if (!*a->dir) return moe_fail(MOE_EINVAL, "the checkpoint folder name is empty"), -1;
    if (!a->prompt == !a->input)
        return moe_fail(MOE_EINVAL, "give exactly one of --prompt TEXT and --input FILE"), -1;
    if (a->io.full_load && a->io.expert_budget > 0)
        return moe_fail(MOE_EINVAL, "--full-load and --expert-budget exclude each other"), -1;
    a->io.task = a->task;
    return 0;
}

static void print_stats(const moe_infer *m, const moe_gen_stats *gs) {
    const moe_infer_stats *s = &m->stats;
    char names[MOE_MAX_TASKS][MOE_NAME_MAX];
    moe_config_task_names(&m->cfg, names);
    fprintf(stderr, "moe generate: task %s; experts loaded per MoE layer:", names[m->task]);
    for (int l = 0; l < m->L; l++)
        if (s->experts[l])
            fprintf(stderr, " %d: %d/%d%s", l, s->loaded[l], s->experts[l],
                    s->task_routed[l] ? " (task)" : "");
    fputc('\n', stderr);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr,
            "moe generate: read %llu of %llu checkpoint bytes (%.1f%%); resident weights %.2f MB "
            "dense + %.2f MB experts%s; peak RSS %.1f MiB\n",
            (unsigned long long)s->bytes_read, (unsigned long long)s->ckpt_bytes,
            s->ckpt_bytes ? 100.0 * s->bytes_read / s->ckpt_bytes : 0.0, s->dense_bytes / 1e6,
            s->expert_bytes / 1e6, s->expert_bytes < s->expert_bytes_fp32 ? " (int8)" : "",
            ru.ru_maxrss / 1024.0);
    fprintf(stderr,
            "moe generate: prefill %ld tokens at %.0f tokens/s, decode %ld tokens at %.0f "
            "tokens/s\n",
            gs->prefill_tokens, gs->prefill_s > 0 ? gs->prefill_tokens / gs->prefill_s : 0.0,
            gs->decode_tokens, gs->decode_s > 0 ? gs->decode_tokens / gs->decode_s : 0.0);
}

// Where prompt i comes from, for messages: FILE:LINE (1-based) or --prompt.
static const char *prompt_where(const gen_args *a, int i, char *buf, size_t cap) {
    if (!a->input) return "--prompt";
    snprintf(buf, cap, "--input %s:%d", a->input, i + 1);
    return buf;
}

// Every prompt as token ids, each checked (not empty, bytes within the
// vocabulary, fits the context) before anything is generated: a bad line is
// refused naming its file and line, before any answer is printed.
static int encode_prompts(const gen_args *a, const moe_infer *m, const moe_tokenizer *tok,
                          bool marker, char **lines, int n, int32_t **prompt, int *n_prompt) {
    char wb[PATH_MAX + 32];
    for (int i = 0; i < n; i++) {
        const char *where = prompt_where(a, i, wb, sizeof wb);
        const unsigned char *s = (const unsigned char *)lines[i];
        const int len = (int)strlen(lines[i]);
        int j = 0;
        if (tok) { // BOS, then the text's pieces (transformers' add_bos_token)
            // SentencePiece would encode a bad sequence as U+FFFD, a prompt the
            // user did not write. The byte path below takes any bytes: there a
            // token is a byte, so every byte string is exactly representable
            // (and byte models are trained on file data that need not be text).
            const long bad = moe_utf8_bad(s, len);
            if (bad >= 0)
                return moe_fail(MOE_EINVAL,
                                "%s: the prompt is not valid UTF-8 at byte %ld (offset from 0; "
                                "a SentencePiece model takes UTF-8 text)",
                                where, bad);
            int32_t *ids;
            size_t n_ids;
            MOE_TRY(moe_tok_encode(tok, lines[i], (size_t)len, &ids, &n_ids));
            const int bos = moe_tok_bos_id(tok);
            // what the model is fed: the pieces and the BOS token before them
            const size_t n_fed = n_ids + (bos >= 0);
            if (n_ids == 0 || n_fed > (size_t)m->max_seq) {
                free(ids);
                return n_ids == 0
                           ? moe_fail(MOE_EINVAL, "%s: the prompt is empty", where)
                           : moe_fail(MOE_EINVAL,
                                      "%s: the prompt has %zu tokens%s; at most %d fit the "
                                      "context (model.seq_len)",
                                      where, n_fed, bos >= 0 ? " (with BOS)" : "", m->max_seq);
            }
            if (!(prompt[i] = malloc(sizeof(int32_t) * (n_ids + 1)))) {
                free(ids);
                return moe_fail(MOE_ENOMEM, "out of memory");
            }
            if (bos >= 0) prompt[i][j++] = bos;
            memcpy(prompt[i] + j, ids, sizeof(int32_t) * n_ids);
            free(ids);
            j += (int)n_ids;
        } else {
            if (len == 0 && !marker) return moe_fail(MOE_EINVAL, "%s: the prompt is empty", where);
            if (len + marker > m->max_seq)
                return moe_fail(MOE_EINVAL,
                                "%s: the prompt has %d tokens%s; at most %d fit the context "
                                "(model.seq_len)",
                                where, len + marker, marker ? " (with the task's marker byte)" : "",
                                m->max_seq);
            if (!(prompt[i] = malloc(sizeof(int32_t) * (len + 1))))
                return moe_fail(MOE_ENOMEM, "out of memory");
            if (marker) prompt[i][j++] = 128 + m->task; // the task's marker byte
            for (int c = 0; c < len; c++) {
                if (s[c] >= m->V)
                    return moe_fail(MOE_EINVAL,
                                    "%s: byte %d of the prompt is %u, beyond the vocabulary of %d",
                                    where, c + 1, s[c], m->V);
                prompt[i][j++] = s[c];
            }
        }
        n_prompt[i] = j;
    }
    return 0;
}

// One stderr line naming the options given that cannot change the answers.
static void note_ignored(const gen_args *a, bool synth, bool spm) {
    char what[256] = "";
    size_t n = 0;
    if (a->go.temperature <= 0 && (a->top_k || a->seed))
        n += snprintf(what + n, sizeof what - n,
                      "%s%s%s%s (greedy decoding; they apply with "
                      "--temperature T > 0)",
                      n ? ", " : "", a->top_k ? "--top-k" : "", a->top_k && a->seed ? " and " : "",
                      a->seed ? "--seed" : "");
    if (a->raw && !synth)
        n += snprintf(what + n, sizeof what - n, "%s--raw (%s puts no task marker byte)",
                      n ? ", " : "", spm ? "a SentencePiece model" : "a model of file data");
    if (n) fprintf(stderr, "moe generate: note: ignored: %s\n", what);
}

int moe_cli_generate(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(generate_help, stdout);
            return MOE_EXIT_OK;
        }
    gen_args a = {0};
    a.go.max_new = 32;
    if (parse(argc, argv, &a) < 0)
        return moe_cli_fail("generate", MOE_EXIT_USAGE, "%s", moe_last_error());
    char *lines[MAX_LINES];
    int n_lines = 1, code = MOE_EXIT_OK;
    if (a.input) {
        n_lines = read_lines(a.input, lines, MAX_LINES);
        if (n_lines < 0)
            return moe_cli_fail("generate", moe_cli_input_exit_code(n_lines), "%s",
                                moe_last_error());
        if (n_lines == 0)
            return moe_cli_fail("generate", MOE_EXIT_USAGE, "--input %s: no prompt lines", a.input);
    } else {
        if (!(lines[0] = strdup(a.prompt)))
            return moe_cli_fail("generate", MOE_EXIT_RUNTIME, "out of memory");
    }
    int32_t **prompt = calloc((size_t)n_lines, sizeof *prompt);
    int *n_prompt = calloc((size_t)n_lines, sizeof *n_prompt);
    moe_tokenizer *tok = NULL; // NULL: bytes
    moe_infer m;
    bool opened = false;
    int rc = 0, synth = 0;
    if (!prompt || !n_prompt) {
        code = moe_cli_fail("generate", MOE_EXIT_RUNTIME, "out of memory");
        goto done;
    }
    a.io.max_batch = n_lines < BATCH ? n_lines : BATCH;
    // A checkpoint that cannot be read (missing, truncated) is bad input.
    if ((rc = moe_infer_open(&m, a.dir, &a.io)) < 0) {
        code = moe_cli_fail("generate", moe_cli_input_exit_code(rc), "%s", moe_last_error());
        goto done;
    }
    opened = true;
    synth = !strcmp(m.cfg.data.kind, "synthetic");
    a.go.stop = synth ? '\n' : -1;
    a.go.n_vocab = 256; // the byte tokenizer decodes ids 0..255
    if (strcmp(m.cfg.model.tokenizer, "bytes")) {
        if ((rc = moe_ckpt_tokenizer(a.dir, &m.cfg, &tok)) < 0) {
            code = moe_cli_fail("generate", moe_cli_input_exit_code(rc), "%s", moe_last_error());
            goto done;
        }
        a.go.stop = moe_tok_eos_id(tok);
        a.go.n_vocab = moe_tok_vocab_size(tok); // vocab_size may be rounded up past it
    }
    // a wrong prompt is the user's input; a failure of the model is runtime
    if ((rc = encode_prompts(&a, &m, tok, synth && !a.raw, lines, n_lines, prompt, n_prompt)) < 0) {
        code = moe_cli_fail("generate", moe_cli_input_exit_code(rc), "%s", moe_last_error());
        goto done;
    }
    note_ignored(&a, synth, tok != NULL);
    moe_gen_stats total = {0};
    int32_t *out = malloc(sizeof(int32_t) * BATCH * (a.go.max_new + 1));
    int n_cut = 0, cut_line = 0, cut_prompt = 0, cut_new = 0;
    if (!out) rc = moe_fail(MOE_ENOMEM, "out of memory");
    for (int b0 = 0; b0 < n_lines && rc == 0; b0 += BATCH) {
        const int B = n_lines - b0 < BATCH ? n_lines - b0 : BATCH;
        int n_out[BATCH];
        moe_gen_stats gs;
        a.go.first = (uint64_t)b0; // the draws are keyed by the line, not the batch row
        rc = moe_generate(&m, B, (const int32_t *const *)prompt + b0, n_prompt + b0, &a.go, out,
                          n_out, &gs);
        for (int b = 0; rc == 0 && b < B; b++) {
            const int32_t *t = out + (size_t)b * a.go.max_new;
            const int n = n_out[b];
            if (n < a.go.max_new && (n == 0 || t[n - 1] != a.go.stop) && n_cut++ == 0)
                cut_line = b0 + b + 1, cut_prompt = n_prompt[b0 + b], cut_new = n;
            if (tok)
                rc = print_text(stdout, tok, t, n, a.go.stop);
            else
                print_answer(stdout, t, n, a.go.stop);
        }
        if (rc == 0) {
            total.prefill_tokens += gs.prefill_tokens, total.decode_tokens += gs.decode_tokens;
            total.prefill_s += gs.prefill_s, total.decode_s += gs.decode_s;
        }
    }
    free(out);
    if (rc < 0) {
        code = moe_cli_fail("generate", moe_cli_exit_code(rc), "%s", moe_last_error());
        goto done;
    }
    if (n_cut) { // the context ends an answer before --max-new: say so, once
        char wb[PATH_MAX + 32];
        fprintf(stderr,
                "moe generate: note: %d answer%s stopped at the model's context of %d tokens "
                "before --max-new %d (first: %s, a prompt of %d tokens, %d new)\n",
                n_cut, n_cut > 1 ? "s" : "", m.max_seq, a.go.max_new,
                prompt_where(&a, cut_line - 1, wb, sizeof wb), cut_prompt, cut_new);
    }
    if (!a.quiet) print_stats(&m, &total);
done:
    moe_tok_free(tok);
    if (opened) moe_infer_free(&m);
    for (int i = 0; i < n_lines; i++) {
        free(lines[i]);
        if (prompt) free(prompt[i]);
    }
    free(prompt);
    free(n_prompt);
    return code;
}
