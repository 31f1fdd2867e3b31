# Builds and runs tests/package/consumer against psx.
#   MODE=install:       install psx to a prefix, then find_package(psx CONFIG)
#   MODE=subdirectory:  add_subdirectory(psx)
# Arguments: SOURCE_DIR (psx), WORK_DIR (scratch), GENERATOR.
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer ${SOURCE_DIR}/tests/package/consumer)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

if(MODE STREQUAL "install")
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/psx-build -G ${GENERATOR}
      -DPSX_BUILD_TESTS=OFF -DPSX_BUILD_EXAMPLES=OFF -DPSX_BUILD_BENCHMARKS=OFF -DPSX_DEVELOPER=OFF
      -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/psx-build)
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/consumer-build -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
else()
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/consumer-build -G ${GENERATOR}
      -DPSX_SOURCE_DIR=${SOURCE_DIR})
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer-build)
run(${WORK_DIR}/consumer-build/consumer)
