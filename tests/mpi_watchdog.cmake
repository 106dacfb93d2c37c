# Runs `mpirun -np 3 PROG MODE` (cmake -DMPIEXEC=... -DPROG=... -DMODE=stop|sleep -P this)
# for tests/mpi_watchdog.c: passes when the job ends by itself (the ctest
# TIMEOUT guards a hang), non-zero, with a live rank's report naming the stuck
# rank 1 and the collective it never reached.
execute_process(
  COMMAND ${MPIEXEC} --allow-run-as-root --oversubscribe -np 3 ${PROG} ${MODE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 50)
message("${out}")
if(rc MATCHES "timeout|Process terminated")
  message(FATAL_ERROR "mpi_watchdog ${MODE}: the job hung (${rc})")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "mpi_watchdog ${MODE}: the job exited 0; expected a failure")
endif()
set(expect "rank [02]: comm.timeout_s = 1 s expired: rank [02] waited [0-9.]+ s in all-reduce #[0-9]+ .3 ranks.; no answer from rank 1 .stopped")
if(NOT out MATCHES "${expect}")
  message(FATAL_ERROR "mpi_watchdog ${MODE}: no report naming rank 1 and the all-reduce")
endif()
if(out MATCHES "completed without rank 1|healthy call failed|barrier after timeout ok")
  message(FATAL_ERROR "mpi_watchdog ${MODE}: wrong behaviour (see output)")
endif()
message("mpi_watchdog ${MODE}: exit status ${rc}, stuck rank named")
