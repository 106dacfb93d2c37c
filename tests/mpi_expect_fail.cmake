# Runs `mpirun -np 4 PROG MODE` (cmake -DMPIEXEC=... -DPROG=... -DMODE=agree|abort -P this)
# for tests/mpi_fail.c: passes when the job ends by itself within 30 s, with a
# non-zero exit status and the failing rank's message in its output.
execute_process(
  COMMAND ${MPIEXEC} --allow-run-as-root --oversubscribe -np 4 ${PROG} ${MODE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 30)
message("${out}")
if(rc MATCHES "timeout|Process terminated")
  message(FATAL_ERROR "mpi_fail ${MODE}: the job hung (${rc})")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "mpi_fail ${MODE}: the job exited 0; expected a failure")
endif()
if(MODE STREQUAL "agree")
  set(expect "mpi_fail: every rank got: rank 2: simulated failure") # printed by rank 0
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "mpi_fail agree: exit status ${rc}, expected 2 from every rank")
  endif()
else()
  set(expect "mpi_fail: rank 2: simulated failure") # printed by rank 2 before MPI_Abort
endif()
if(NOT out MATCHES "${expect}")
  message(FATAL_ERROR "mpi_fail ${MODE}: the failing rank's message is missing")
endif()
message("mpi_fail ${MODE}: exit status ${rc}, message delivered")
