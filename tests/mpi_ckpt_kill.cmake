# A rank killed in the middle of a sharded save (cmake -DMPIEXEC= -DPROG=mpi_ckpt_shard
# -DOUT= -P this): the reference run records each rank's counted file-system calls;
# then, for points inside the second save, one rank aborts there (MOE_FAULT=N:abort:R,
# a crash with no cleanup), mpirun must end the job non-zero without hanging, and the
# checkpoint a reader resolves must be complete and bitwise the step-2 or step-4 save.
# -DVARIANT=async: the periodic saves are asynchronous, so the rank dies in its save
# thread (or in the commit) while training goes on.
set(run ${MPIEXEC} --allow-run-as-root --oversubscribe -np 4)
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
execute_process(COMMAND ${run} ${PROG} ref ${OUT} ${VARIANT} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out TIMEOUT 120)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "reference run failed (${rc}):\n${out}")
endif()
file(READ ${OUT}/ops ops)
list(GET ops 0 r0_one)
list(GET ops 2 r2_one)
# Rank 2 writes only its shards: the same calls every save. Its second save is
# calls r2_one+1 .. 2*r2_one: the first (creating the model shard's temp file),
# one in the tensor writes, the optimizer shard's rename, the last.
math(EXPR a "${r2_one} + 1")
math(EXPR b "${r2_one} + ${r2_one} / 2")
math(EXPR c "2 * ${r2_one} - 1")
math(EXPR d "2 * ${r2_one}")
# Rank 0's second save starts after r0_one calls and is longer than the first
# (it also swaps the previous checkpoint out): points from its shard writes to
# the manifest and the renames.
math(EXPR e "${r0_one} + 2")
math(EXPR f "${r0_one} + ${r0_one} / 2")
math(EXPR g "2 * ${r0_one} - 2")
math(EXPR h "2 * ${r0_one} + 2")
set(n 0)
foreach(point "2;${a}" "2;${b}" "2;${c}" "2;${d}" "0;${e}" "0;${f}" "0;${g}" "0;${h}")
  list(GET point 0 who)
  list(GET point 1 at)
  file(REMOVE_RECURSE ${OUT}/kill)
  execute_process(COMMAND ${run} -x MOE_FAULT=${at}:abort:${who} ${PROG} kill ${OUT} ${VARIANT}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 90)
  if(rc MATCHES "timeout|terminated")
    message(FATAL_ERROR "rank ${who} killed at call ${at}: the job hung (${rc})\n${out}")
  endif()
  if(rc EQUAL 0)
    message(FATAL_ERROR "rank ${who} armed at call ${at}: the job finished; the point was "
                        "never reached")
  endif()
  execute_process(COMMAND ${MPIEXEC} --allow-run-as-root -np 1 ${PROG} check ${OUT}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "rank ${who} killed at call ${at}:\n${out}")
  endif()
  string(REGEX MATCH "holds the step-[0-9] save" held "${out}")
  message("rank ${who} killed at call ${at}: the checkpoint ${held}")
  math(EXPR n "${n} + 1")
endforeach()
message("mpi_ckpt_kill ${VARIANT}: ${n} passed, 0 failed")
