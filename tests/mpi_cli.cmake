# The moe binary under mpirun (cmake -DMPIEXEC= -DMOE= -DSRC= -DOUT= -P this):
#  1. `mpirun -np 4 moe train ... --set parallel.ep=4` trains and checkpoints, and one
#     process evaluates, exports and generates from that checkpoint, and its run
#     report charts the all-to-all traffic;
#  2. an invalid config on one rank (MPMD) ends every rank with its message;
#  3. one rank diverging at run time ends the job (MPI_Abort), no hang.
set(run ${MPIEXEC} --allow-run-as-root --oversubscribe)
set(small --set model.d_model=32 --set model.n_layers=2 --set model.d_ff=48
          --set model.seq_len=16 --set train.batch_size=2 --set train.eval_every=0 --quiet)
file(REMOVE_RECURSE ${OUT})

execute_process(COMMAND ${run} -np 4 ${MOE} train ${SRC}/configs/tiny.json ${small}
                        --set parallel.ep=4 --steps 3 --out ${OUT}/ep4
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT EXISTS ${OUT}/ep4/checkpoint/model.safetensors.index.json)
  message(FATAL_ERROR "ep=4 run failed (${rc}):\n${out}")
endif()
if(NOT out MATCHES "validation")
  message(FATAL_ERROR "ep=4 run printed no report:\n${out}")
endif()
# The ep=4 checkpoint (a shard per rank) in one process: eval, export, generate.
foreach(cmd "eval;${OUT}/ep4/checkpoint;--batches;1;--samples;1"
            "export;${OUT}/ep4/checkpoint;--hf;${OUT}/ep4/hf"
            "generate;${OUT}/ep4/checkpoint;--task;copy;--prompt;abc;--max-new;2")
  execute_process(COMMAND ${MOE} ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE out TIMEOUT 60)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "moe ${cmd} of the ep=4 checkpoint in one process failed (${rc}):\n${out}")
  endif()
endforeach()
# The run report of the ep=4 run draws the all-to-all traffic.
execute_process(COMMAND ${MOE} report ${OUT}/ep4 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out TIMEOUT 60)
file(READ ${OUT}/ep4/report.html page)
if(NOT rc EQUAL 0 OR NOT page MATCHES "data-figure=\"a2a_bytes\""
   OR NOT page MATCHES "data-figure=\"a2a_time\"")
  message(FATAL_ERROR "moe report of the ep=4 run: no all-to-all charts (${rc}):\n${out}")
endif()

execute_process(COMMAND ${run} -np 3 ${MOE} train ${SRC}/configs/tiny.json ${small} --steps 3
                        --out ${OUT}/bad : -np 1 ${MOE} train ${SRC}/configs/tiny.json ${small}
                        --steps 3 --out ${OUT}/bad --set parallel.ep=3
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 30)
if(rc MATCHES "timeout|terminated" OR rc EQUAL 0 OR NOT out MATCHES "parallel.ep")
  message(FATAL_ERROR "invalid config on one rank: expected a clean failure naming "
                      "parallel.ep, got ${rc}:\n${out}")
endif()

execute_process(COMMAND ${run} -np 3 ${MOE} train ${SRC}/configs/tiny.json ${small} --steps 50
                        --out ${OUT}/nan : -np 1 ${MOE} train ${SRC}/configs/tiny.json ${small}
                        --steps 50 --out ${OUT}/nan --set train.lr=1e30 --set train.grad_clip=0
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
if(rc MATCHES "timeout|terminated" OR rc EQUAL 0 OR NOT out MATCHES "step [0-9]+:")
  message(FATAL_ERROR "a diverging rank: expected the job to end with its message, "
                      "got ${rc}:\n${out}")
endif()
message("mpi_cli: 3 passed, 0 failed")
