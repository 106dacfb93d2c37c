# The moe binary under mpirun (cmake -DMPIEXEC= -DMOE= -DSRC= -DOUT= -P this):
#  1. `mpirun -np 4 moe train ... --set parallel.ep=4` (with replicated expert
#     placement) trains and checkpoints, and one process evaluates, exports and
#     generates from that checkpoint, and its run report charts the all-to-all traffic;
#  2. an invalid config on one rank (MPMD) ends every rank with its message;
#  3. ranks diverging at run time end the job, no hang;
#  4. ranks launched with different configs, --out or data files are refused at
#     startup (exit 2, one message naming the first difference);
#  5. setup failures (and --dry-run's plan) are printed once, by rank 0.
set(run ${MPIEXEC} --allow-run-as-root --oversubscribe)
set(small --set model.d_model=32 --set model.n_layers=2 --set model.d_ff=48
          --set model.seq_len=16 --set train.batch_size=2 --set train.eval_every=0 --quiet)
file(REMOVE_RECURSE ${OUT})

execute_process(COMMAND ${run} -np 4 ${MOE} train ${SRC}/configs/tiny.json ${small}
                        --set parallel.ep=4 --set placement.mode=replicate
                        --set placement.slots_per_rank=3 --set placement.update_every=1
                        --steps 3 --out ${OUT}/ep4
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

# Every rank diverging at run time ends the job with its message, no hang.
execute_process(COMMAND ${run} -np 4 ${MOE} train ${SRC}/configs/tiny.json ${small} --steps 50
                        --out ${OUT}/nan --set train.lr=1e30 --set train.grad_clip=0
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
if(rc MATCHES "timeout|terminated" OR rc EQUAL 0 OR NOT out MATCHES "step [0-9]+:")
  message(FATAL_ERROR "a diverging run: expected the job to end with its message, "
                      "got ${rc}:\n${out}")
endif()

# Ranks that do not run the same run are refused at startup: exit 2, rank 0's
# and the differing rank's values named once, nothing written (MPMD launches:
# rank 0 runs A, rank 1 runs B). Without the check these crash (ep 2 : 1),
# hang (ep 1 : 2, train.steps) or train silently with rank 0's settings.
function(expect_refused name pattern)
  cmake_parse_arguments(X "" "" "A;B;WDIR_A;WDIR_B" ${ARGN})
  set(wa "")
  set(wb "")
  if(X_WDIR_A)
    set(wa --wdir ${X_WDIR_A})
    set(wb --wdir ${X_WDIR_B})
  endif()
  # (train.steps by --set: the steps case sets it again, which --steps refuses)
  execute_process(COMMAND ${run} -np 1 ${wa} ${MOE} train ${SRC}/configs/tiny.json ${small}
                          --set train.steps=3 ${X_A} : -np 1 ${wb} ${MOE} train
                          ${SRC}/configs/tiny.json ${small} --set train.steps=3 ${X_B}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
  string(REGEX MATCHALL "moe train: [^\n]*" lines "${out}")
  list(LENGTH lines n)
  if(NOT rc EQUAL 2 OR NOT n EQUAL 1 OR NOT out MATCHES "${pattern}")
    message(FATAL_ERROR "${name}: expected exit 2 and one line matching '${pattern}', got "
                        "${rc} and ${n} lines:\n${out}")
  endif()
endfunction()
expect_refused(ep_2_1 "ranks disagree on parallel.ep: rank 0 has 2, rank 1 has 1"
               A --set parallel.ep=2 --out ${OUT}/mm B --set parallel.ep=1 --out ${OUT}/mm)
expect_refused(ep_1_2 "ranks disagree on parallel.ep: rank 0 has 1, rank 1 has 2"
               A --set parallel.ep=1 --out ${OUT}/mm B --set parallel.ep=2 --out ${OUT}/mm)
expect_refused(steps "ranks disagree on train.steps: rank 0 has 10, rank 1 has 8"
               A --out ${OUT}/mm --set train.steps=10 B --out ${OUT}/mm --set train.steps=8)
expect_refused(lr "ranks disagree on train.lr: rank 0 has 0.003, rank 1 has 0.002"
               A --out ${OUT}/mm B --out ${OUT}/mm --set train.lr=0.002)
expect_refused(out "ranks disagree on --out: rank 0 has [^ ]*/mm, rank 1 has [^ ]*/mm2"
               A --out ${OUT}/mm B --out ${OUT}/mm2)
expect_refused(ranks_per_node "ranks disagree on comm.ranks_per_node: rank 0 has 1, rank 1 has 0"
               A --out ${OUT}/mm --set comm.ranks_per_node=1 B --out ${OUT}/mm)
expect_refused(bad_set_on_one_rank "--set: unknown key 'no.such'"
               A --out ${OUT}/mm B --out ${OUT}/mm --set no.such=1)
# The same glob resolving to files of other sizes (each rank in its own folder).
file(WRITE ${OUT}/wa/t.txt "abcdefghij0123456789")
file(WRITE ${OUT}/wb/t.txt "abcdefghij012345678")
expect_refused(data "ranks disagree on file 1 of data.path: rank 0 has t.txt \\(20 bytes\\), rank 1 has t.txt \\(19 bytes\\)"
               WDIR_A ${OUT}/wa WDIR_B ${OUT}/wb
               A --set data.kind=text --set data.path=t.txt --out ${OUT}/mm
               B --set data.kind=text --set data.path=t.txt --out ${OUT}/mm)
# A glob matching files on rank 0 only, or fewer on rank 1: the message names
# what rank 1 lacks (it used to give the counts alone).
file(WRITE ${OUT}/we/t.txt "abcdefghij0123456789")
file(WRITE ${OUT}/we/v.txt "abcdefghij0123456789")
file(WRITE ${OUT}/wf/v.txt "abcdefghij0123456789")
file(MAKE_DIRECTORY ${OUT}/wg)
expect_refused(data_none "ranks disagree on files of data.path: rank 0 has 1, rank 1 has 0 \\(rank 1: no file matches t.txt\\)"
               WDIR_A ${OUT}/wa WDIR_B ${OUT}/wg
               A --set data.kind=text --set data.path=t.txt --out ${OUT}/mm
               B --set data.kind=text --set data.path=t.txt --out ${OUT}/mm)
expect_refused(data_fewer "ranks disagree on files of data.path: rank 0 has 2, rank 1 has 1 \\(rank 1 lacks t.txt, which rank 0 has\\)"
               WDIR_A ${OUT}/we WDIR_B ${OUT}/wf
               A --set data.kind=text --set "data.path=*.txt" --out ${OUT}/mm
               B --set data.kind=text --set "data.path=*.txt" --out ${OUT}/mm)
# The same relative --out from other working folders (as ranks on node-local
# disks): rank 1 does not see the folder rank 0 created, refused before training
# (it used to fail at the first save, naming a shard it could not create).
file(MAKE_DIRECTORY ${OUT}/wc ${OUT}/wd)
expect_refused(out_not_shared "rank 1 does not see --out rel, the run folder rank 0 created"
               WDIR_A ${OUT}/wc WDIR_B ${OUT}/wd
               A --set parallel.ep=2 --out rel B --set parallel.ep=2 --out rel)
if(EXISTS ${OUT}/wc/rel OR EXISTS ${OUT}/wd/rel)
  message(FATAL_ERROR "out_not_shared: the refused launch left its run folder")
endif()
if(EXISTS ${OUT}/mm OR EXISTS ${OUT}/mm2)
  message(FATAL_ERROR "a refused launch wrote a run folder")
endif()

# Setup failures every rank meets are reported once (rank 0), with the same
# exit code on every rank; a --dry-run prints its plan once.
function(expect_once name code pattern)
  execute_process(COMMAND ${run} -np 4 ${MOE} train ${SRC}/configs/tiny.json ${small} --steps 3
                          ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 60)
  string(REGEX MATCHALL "${pattern}" hits "${out}")
  list(LENGTH hits n)
  if(NOT rc EQUAL code OR NOT n EQUAL 1)
    message(FATAL_ERROR "${name}: expected exit ${code} and '${pattern}' once, got ${rc} and "
                        "${n} times:\n${out}")
  endif()
endfunction()
expect_once(ranks_per_node 2 "moe train: comm.ranks_per_node = 3 does not divide the 4 ranks"
            --set parallel.ep=4 --set comm.ranks_per_node=3 --out ${OUT}/once)
expect_once(bad_ep 2 "moe train: [^\n]*parallel.ep" --set parallel.ep=3 --out ${OUT}/once)
expect_once(experts 2 "moe train: [^\n]*moe.num_experts"
            --set parallel.ep=4 --set moe.num_experts=6 --out ${OUT}/once)
expect_once(no_resume 2 "moe train: --resume" --resume ${OUT}/no-such-run --out ${OUT}/once)
expect_once(out_holds_run 2 "moe train: --out [^\n]*already holds a run" --out ${OUT}/ep4)
expect_once(dry_run 0 "memory per rank" --set parallel.ep=4 --dry-run --out ${OUT}/once)
if(EXISTS ${OUT}/once)
  message(FATAL_ERROR "a refused launch wrote a run folder")
endif()

message("mpi_cli: 5 passed, 0 failed")
