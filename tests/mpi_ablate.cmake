# `moe ablate` under mpirun (cmake -DMPIEXEC= -DMOE= -DSRC= -DOUT= -P this): every
# rank would train every run into the same folders, so more than one rank is
# refused with exit 2 before any run, naming mpirun; one rank trains the grid.
# Every other command but train is refused on more than one rank alike.
set(run ${MPIEXEC} --allow-run-as-root --oversubscribe)
set(small --set model.d_model=32 --set model.n_layers=1 --set model.d_ff=32
          --set model.seq_len=16 --set train.batch_size=2 --set train.eval_every=0 --steps 1)
file(REMOVE_RECURSE ${OUT})
execute_process(COMMAND ${run} -np 2 ${MOE} ablate ${SRC}/configs/tiny.json ${small}
                        --grid parallel.ep=1,2 --out ${OUT}/np2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
if(NOT rc EQUAL 2 OR NOT out MATCHES "2 MPI ranks" OR NOT out MATCHES "without mpirun"
   OR EXISTS ${OUT}/np2)
  message(FATAL_ERROR "ablate on 2 ranks: expected exit 2 naming mpirun, no folder; got ${rc}:\n${out}")
endif()
execute_process(COMMAND ${run} -np 1 ${MOE} ablate ${SRC}/configs/tiny.json ${small}
                        --grid router.top_k=1,2 --out ${OUT}/np1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT EXISTS ${OUT}/np1/results.csv)
  message(FATAL_ERROR "ablate on 1 rank: expected the grid to train, got ${rc}:\n${out}")
endif()
foreach(cmd "plan;${SRC}/configs/tiny.json" "route;--example" "eval;${OUT}/np1")
  execute_process(COMMAND ${run} -np 2 ${MOE} ${cmd}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
  if(NOT rc EQUAL 2 OR NOT out MATCHES "2 MPI ranks" OR NOT out MATCHES "without mpirun")
    message(FATAL_ERROR "${cmd} on 2 ranks: expected exit 2 naming mpirun, got ${rc}:\n${out}")
  endif()
endforeach()
message("mpi_ablate: 5 passed, 0 failed")
