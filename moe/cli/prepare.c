// `moe prepare INPUT... --out DIR`: text files or folders -> llm.c token
// shards split into train and validation by document, with a manifest and a
// progress bar on stderr (a bar on a terminal, a line per 10% otherwise).
#include "moe/prepare.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static const char *prepare_help =
    "usage: moe prepare INPUT... --out DIR [--tokenizer bytes|PATH] [--val-fraction F]\n"
    "                   [--doc file|paragraph|line] [--shard-tokens N] [--seed N] [--quiet]\n"
    "\n"
    "Tokenizes UTF-8 text files and folders (walked recursively in name order, hidden\n"
    "entries skipped, a folder reached again through a link not entered twice) into llm.c shards "
    "DIR/train_000000.bin, DIR/val_000000.bin, ...\n"
    "(256 x int32 header: magic 20240520, version 1 = uint16 tokens, 2 = uint32 when\n"
    "the vocabulary exceeds 65536; token count; then the tokens) and DIR/manifest.json\n"
    "(files, bytes, documents and tokens per split). A document (--doc: a whole file,\n"
    "the default; a paragraph ending at a blank line; a line) goes to validation when\n"
    "a hash of the seed and its bytes falls below --val-fraction (default 0.1; 0: no\n"
    "validation shards): the split is deterministic and does not depend on the order\n"
    "of the inputs. Documents keep every byte, so train and validation together hold\n"
    "the input exactly. Train on the shards with data.kind = llmc, data.path =\n"
    "\"DIR/train_*.bin\" and data.val_path = \"DIR/val_*.bin\".\n"
    "\n"
    "  --tokenizer bytes   one token per byte (vocab 256; the default)\n"
    "  --tokenizer PATH    a SentencePiece .model (spm_train; README \"Tokenizers\"): each\n"
    "                      document starts with its BOS; train with model.tokenizer = PATH\n"
    "  --shard-tokens N    tokens per shard (default 100000000)\n"
    "  --seed N            seed of the train/validation split (default 1337)\n"
    "  --quiet             no progress display\n"
    "\n"
    "Invalid UTF-8 is refused naming the file and the byte offset, before anything\n"
    "is written, and so is a file included twice. DIR may hold other files but not a\n"
    "manifest.json or train_*.bin / val_*.bin files (nor their .tmp): shards are written\n"
    "as NAME.tmp (created exclusively) and renamed into place with the manifest once all\n"
    "are complete, never over an existing NAME: a second prepare into DIR at once fails\n"
    "and removes only its own files.\n"
    "Ctrl-C or SIGTERM stops prepare and removes what it wrote (exit status 130).\n"
    "\n"
    "exit status: 0 ok, 1 runtime failure, 2 bad usage or input, 130 stopped by a signal\n";

typedef struct {
    int tty, last_tenth;
} bar_state;

static int term_width(void) {
    struct winsize ws;
    if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
    const char *c = getenv("COLUMNS");
    int n = c ? atoi(c) : 0;
    return n > 0 ? n : 80;
}

static void progress(void *ctx, const moe_prepare_progress *p) {
    bar_state *b = ctx;
    double frac = p->bytes_total ? (double)p->bytes_done / (double)p->bytes_total : 1.0;
    char tail[96];
    snprintf(tail, sizeof tail, " %3.0f%% %.1f/%.1f MiB, %d/%d files", 100 * frac,
             p->bytes_done / 1048576.0, p->bytes_total / 1048576.0, p->files_done, p->files_total);
    if (!b->tty) { // a plain line each time another tenth is done
        int tenth = (int)(frac * 10);
        if (tenth > b->last_tenth) fprintf(stderr, "prepare:%s\n", tail);
        if (tenth > b->last_tenth) b->last_tenth = tenth;
        return;
    }
    int width = term_width() - (int)strlen(tail) - 12; // "prepare [" + "]" + margin
    if (width > 60) width = 60;
    char bar[64] = "";
    if (width > 0) {
        int fill = (int)(frac * width);
        for (int i = 0; i < width; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[width] = 0;
    }
    if (width > 0)
        fprintf(stderr, "\rprepare [%s]%s", bar, tail);
    else
        fprintf(stderr, "\rprepare%.*s", term_width() > 9 ? term_width() - 9 : 0, tail);
    fflush(stderr);
}

int moe_cli_prepare(int argc, char **argv) {
    const char *out = NULL, *tok = NULL, *vf = NULL, *doc = NULL, *shard = NULL, *seed = NULL;
    bool quiet = false;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    int n_in = 0, rc;
    if (!inputs) return moe_cli_fail("prepare", MOE_EXIT_RUNTIME, "out of memory");
    for (int i = 1; i < argc; i++) {
        int m = 0;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(prepare_help, stdout);
            free(inputs);
            return MOE_EXIT_OK;
        }
        if ((m = moe_cli_opt_once(argc, argv, &i, "--out", &out)) ||
            (m = moe_cli_opt_once(argc, argv, &i, "--tokenizer", &tok)) ||
            (m = moe_cli_opt_once(argc, argv, &i, "--val-fraction", &vf)) ||
            (m = moe_cli_opt_once(argc, argv, &i, "--doc", &doc)) ||
            (m = moe_cli_opt_once(argc, argv, &i, "--shard-tokens", &shard)) ||
            (m = moe_cli_opt_once(argc, argv, &i, "--seed", &seed)) ||
            (m = moe_cli_flag(argv[i], "--quiet", &quiet))) {
            if (m < 0) {
                free(inputs);
                return moe_cli_fail("prepare", MOE_EXIT_USAGE, "%s", moe_last_error());
            }
        } else if (argv[i][0] == '-' && argv[i][1]) {
            free(inputs);
            return moe_cli_unknown_option("prepare", argv[i], prepare_help);
        } else {
            inputs[n_in++] = argv[i];
        }
    }
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = inputs,
                          .n_inputs = n_in,
                          .val_fraction = 0.1,
                          .seed = 1337,
                          .doc = MOE_DOC_FILE,
                          .shard_tokens = 100000000};
    long long v;
    const char *bad = NULL, *want = NULL, *given = NULL; // the option, its range, its value
    if (vf && (!moe_cli_parse_double(vf, 0, 1, false, &o.val_fraction) || o.val_fraction >= 1))
        bad = "--val-fraction", want = "a number in [0, 1)", given = vf;
    if (!bad && shard && !moe_cli_parse_long(shard, 1, 2147483647, &v))
        bad = "--shard-tokens", want = "an integer in [1, 2147483647]", given = shard;
    if (shard && !bad) o.shard_tokens = (long)v;
    if (!bad && seed && !moe_cli_parse_long(seed, 0, INT64_MAX, &v))
        bad = "--seed", want = "an integer in [0, 9223372036854775807]", given = seed;
    if (seed && !bad) o.seed = (uint64_t)v;
    if (doc && strcmp(doc, "file") && strcmp(doc, "paragraph") && strcmp(doc, "line")) {
        free(inputs);
        return moe_cli_fail("prepare", MOE_EXIT_USAGE, "--doc %s: expected file, paragraph or line",
                            doc);
    }
    // "--out --quiet" would make a folder named --quiet: a path option takes
    // no option-looking value (./-name still names one).
    const char *path_opt[][2] = {{"--out", out}, {"--tokenizer", tok}};
    for (int k = 0; k < 2; k++)
        if (path_opt[k][1] && path_opt[k][1][0] == '-') {
            free(inputs);
            return moe_cli_fail("prepare", MOE_EXIT_USAGE,
                                "%s needs a value, got the option '%s' (write ./%s for a path "
                                "starting with '-')",
                                path_opt[k][0], path_opt[k][1], path_opt[k][1]);
        }
    if (bad) {
        free(inputs);
        return moe_cli_fail("prepare", MOE_EXIT_USAGE, "%s needs %s, got '%s'", bad, want, given);
    }
    for (int k = 0; k < 2; k++)
        if (path_opt[k][1] && !path_opt[k][1][0]) {
            free(inputs);
            return moe_cli_fail("prepare", MOE_EXIT_USAGE, "%s needs a path%s", path_opt[k][0],
                                k ? " (or bytes): it is empty" : ", not an empty value");
        }
    if (doc)
        o.doc = !strcmp(doc, "line")        ? MOE_DOC_LINE
                : !strcmp(doc, "paragraph") ? MOE_DOC_PARAGRAPH
                                            : MOE_DOC_FILE;
    if (!out || n_in == 0) {
        free(inputs);
        return moe_cli_fail("prepare", MOE_EXIT_USAGE, "usage: moe prepare INPUT... --out DIR");
    }
    moe_prepare_tokenizer tk;
    rc = moe_prepare_tokenizer_open(&tk, tok ? tok : "bytes");
    if (rc < 0) {
        free(inputs);
        return moe_cli_fail("prepare", MOE_EXIT_USAGE, "%s", moe_last_error());
    }
    bar_state b = {isatty(STDERR_FILENO), 0};
    o.tokenizer = &tk;
    if (!quiet) o.progress = progress, o.progress_ctx = &b;
    moe_prepare_result r;
    o.stop = moe_cli_stop_catch(); // prepare stops and removes what it wrote
    rc = moe_prepare(&o, &r);
    moe_cli_stop_release();
    if (!quiet && b.tty) fputc('\n', stderr);
    moe_prepare_tokenizer_close(&tk);
    free(inputs);
    // A missing, non-regular or non-UTF-8 input is bad input (2); a failed
    // write, a failed mapping or no memory is a runtime failure (1).
    if (rc < 0 && *o.stop) return moe_cli_fail("prepare", 130, "%s", moe_last_error());
    if (rc < 0) return moe_cli_fail("prepare", moe_cli_exit_code(rc), "%s", moe_last_error());
    if (r.skipped)
        fprintf(stderr,
                "moe prepare: note: skipped %d entr%s of the input folders that %s no regular "
                "file or folder (the first %s)\n",
                r.skipped, r.skipped == 1 ? "y" : "ies", r.skipped == 1 ? "is" : "are", r.skip);
    printf("prepared %d files (%zu bytes, tokenizer %s): train %ld documents, %ld tokens in %d "
           "shards; validation %ld documents, %ld tokens in %d shards; %ld <unk> tokens; "
           "%s/manifest.json\n",
           r.files, r.bytes, tk.name, r.documents[0], r.tokens[0], r.shards[0], r.documents[1],
           r.tokens[1], r.shards[1], r.unk_tokens, out);
    const long all = r.tokens[0] + r.tokens[1];
    if (r.unk_tokens)
        fprintf(stderr,
                "moe prepare: warning: %ld of %ld tokens (%.2f%%) are <unk>: text tokenizer %s "
                "cannot represent (a model without byte fallback); training never sees it\n",
                r.unk_tokens, all, 100.0 * (double)r.unk_tokens / (double)(all ? all : 1), tk.name);
    return MOE_EXIT_OK;
}
