// TensorBoard event files (train.tensorboard = true): scalars written as
// TFRecord frames (length, masked CRC-32C, data, masked CRC-32C) holding
// hand-encoded Event{wall_time, step, summary{value{tag, simple_value}}}
// protocol buffers, so no TensorFlow or protobuf library is needed.
#ifndef MOE_TENSORBOARD_H
#define MOE_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    FILE *f;
    char path[4096];
} moe_tb_writer;

// Creates dir/events.out.tfevents.SECONDS.moe.PID (SECONDS past those of the
// folder's earlier event files, so it is read after them) and writes the
// file_version event TensorBoard expects first. purge_step > 0 (a resumed
// run's first step) then writes a session_log START event at purge_step:
// TensorBoard drops the earlier files' points at purge_step and later, the
// steps the resume redoes, as the run's metrics.jsonl drops their records.
int moe_tb_open(moe_tb_writer *w, const char *dir, long purge_step);
// One event at step holding n scalars (tags[i] = values[i]); flushed, so a
// TensorBoard watching the run sees it at once.
int moe_tb_scalars(moe_tb_writer *w, long step, double wall_time, const char *const *tags,
                   const float *values, int n);
// Closes the file; 0 when every write reached it.
int moe_tb_close(moe_tb_writer *w);

// CRC-32C (Castagnoli) of n bytes, and the masked form TFRecord stores.
uint32_t moe_crc32c(const void *data, size_t n);
uint32_t moe_tb_masked_crc(const void *data, size_t n);

#endif
