# `cmake --install` into PREFIX, then PREFIX/bin/moe --version run from another
# folder: the installed binary, headers and library are all there, and moe
# runs without the build tree. (ctest test install_runs.)
file(REMOVE_RECURSE ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD} --prefix ${PREFIX}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
foreach(f bin/moe include/moe/train.h include/moe/checkpoint.h include/kernels/ops.h)
  if(NOT EXISTS ${PREFIX}/${f})
    message(FATAL_ERROR "not installed: ${f}")
  endif()
endforeach()
file(GLOB libs ${PREFIX}/lib*/libmoe.a)
if(NOT libs)
  message(FATAL_ERROR "not installed: lib/libmoe.a")
endif()
execute_process(COMMAND ${PREFIX}/bin/moe --version WORKING_DIRECTORY ${PREFIX}/include
                RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT out MATCHES "^moe ${VERSION}")
  message(FATAL_ERROR "installed moe --version: exit ${rc}, output '${out}'")
endif()
file(REMOVE_RECURSE ${PREFIX})
