# psx::cuda: the CUDA kernel layer (include/psx/cuda/*.cuh), its tests and
# its benchmark. Include this file from the top-level CMakeLists.txt when
# PSX_WITH_CUDA is ON, after `enable_language(CUDA)` and after the psx target:
#
#   if(PSX_WITH_CUDA)
#     enable_language(CUDA)
#     include(cmake/cuda.cmake)
#   endif()
#
# Architectures: the targets here build for CMAKE_CUDA_ARCHITECTURES when the
# user set it, else for sm_90 (H100/H200), not for CMake's default.
# PSX_BUILD_TESTS / PSX_BUILD_BENCHMARKS (ON when undefined) choose what is built.

find_package(CUDAToolkit REQUIRED)

# --- psx::cuda: headers only, plus the CUDA runtime -------------------------
add_library(psx_cuda INTERFACE)
add_library(psx::cuda ALIAS psx_cuda)
set_target_properties(psx_cuda PROPERTIES EXPORT_NAME cuda)
target_link_libraries(psx_cuda INTERFACE psx CUDA::cudart)
# The host code of CUDA sources (the CPU references of the kernel tests among
# it) with no fused multiply-adds either, as psx::psx compiles C++.
target_compile_options(psx_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-ffp-contract=off>)
# CMake before 3.26 does not know nvcc's C++20 flag: then only our own
# targets get it, below, and users set -std=c++20 for their CUDA sources.
if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  target_compile_features(psx_cuda INTERFACE cuda_std_20)
endif()
target_sources(psx_cuda INTERFACE FILE_SET HEADERS BASE_DIRS ${CMAKE_CURRENT_LIST_DIR}/../include FILES
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/aggregate.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/convert.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/kernels.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/memory.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/optim.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/rows.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/storage.cuh
  ${CMAKE_CURRENT_LIST_DIR}/../include/psx/cuda/detail/launch.cuh)

include(GNUInstallDirs)
install(TARGETS psx_cuda EXPORT psx-cuda-targets FILE_SET HEADERS)
install(EXPORT psx-cuda-targets NAMESPACE psx:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/psx)

# enable_language(CUDA) fills CMAKE_CUDA_ARCHITECTURES with the compiler's
# default (cache help "CUDA architectures") when nobody set it: then psx
# builds for sm_90. A value from -D, a preset, CUDAARCHS or the project is kept.
get_property(psx_cuda_arch_help CACHE CMAKE_CUDA_ARCHITECTURES PROPERTY HELPSTRING)
if(DEFINED ENV{CUDAARCHS} OR NOT psx_cuda_arch_help STREQUAL "CUDA architectures"
   OR NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "$CACHE{CMAKE_CUDA_ARCHITECTURES}")
  set(psx_cuda_architectures ${CMAKE_CUDA_ARCHITECTURES})
else()
  set(psx_cuda_architectures 90)
endif()

function(psx_cuda_executable name source)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE psx::cuda ${ARGN})
  set_target_properties(${name} PROPERTIES CUDA_ARCHITECTURES "${psx_cuda_architectures}")
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    set_target_properties(${name} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  else()
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # Warnings of the host compiler, for our own translation units only.
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endfunction()

if(NOT DEFINED PSX_BUILD_TESTS OR PSX_BUILD_TESTS)
  find_package(doctest REQUIRED)
  enable_testing()
  psx_cuda_executable(psx_cuda_tests ${CMAKE_CURRENT_LIST_DIR}/../tests/cuda/kernels.cu doctest::doctest)
  # Exits 77 without a CUDA device: ctest reports the test as skipped.
  add_test(NAME cuda.kernels COMMAND psx_cuda_tests)
  psx_cuda_executable(psx_cuda_storage_tests ${CMAKE_CURRENT_LIST_DIR}/../tests/cuda/storage.cu doctest::doctest)
  add_test(NAME cuda.storage COMMAND psx_cuda_storage_tests)
  set_tests_properties(cuda.kernels cuda.storage PROPERTIES LABELS gpu SKIP_RETURN_CODE 77)
endif()

if(NOT DEFINED PSX_BUILD_BENCHMARKS OR PSX_BUILD_BENCHMARKS)
  psx_cuda_executable(psx_bench_gpu ${CMAKE_CURRENT_LIST_DIR}/../benchmarks/gpu/bench_kernels.cu)
  psx_cuda_executable(psx_bench_gpu_storage ${CMAKE_CURRENT_LIST_DIR}/../benchmarks/gpu/bench_storage.cu)
endif()
