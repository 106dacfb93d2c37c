// One logger for the library and CLI. Level from MOE_LOG=error|warn|info|debug
// (default info); everything goes to stderr.
#ifndef MOE_LOG_H
#define MOE_LOG_H

typedef enum { MOE_LOG_ERROR = 0, MOE_LOG_WARN, MOE_LOG_INFO, MOE_LOG_DEBUG } moe_log_level;

void moe_log(moe_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int moe_log_enabled(moe_log_level level);

#endif
