# Compiles each host kernel source once per ISA (scalar, AVX2+FMA+F16C, AVX-512) into object
# libraries linked into a target. Each copy lives in namespace ramstream::cpu::<isa> (macro
# RAMSTREAM_ISA_NS) so that no inline function compiled for a wider ISA can leak into another.
# -ffp-contract=off: the compiler must not fuse a*b+c; kernels use explicit FMAs where torch does.
include_guard(GLOBAL)

if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  set(RAMSTREAM_ISAS scalar avx2 avx512)
else()
  set(RAMSTREAM_ISAS scalar)
endif()

set(_rs_flags_scalar "")
set(_rs_level_scalar 0)
set(_rs_flags_avx2 -mavx2 -mfma -mf16c)
set(_rs_level_avx2 1)
set(_rs_flags_avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c)
set(_rs_level_avx512 2)

function(ramstream_add_isa_kernels target)
  if(NOT ARGN)
    return()
  endif()
  foreach(isa ${RAMSTREAM_ISAS})
    set(lib ${target}_kernels_${isa})
    add_library(${lib} OBJECT ${ARGN})
    target_include_directories(${lib} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/cpp/include
                                              ${CMAKE_CURRENT_SOURCE_DIR}/cpp/src)
    target_compile_definitions(${lib} PRIVATE RAMSTREAM_ISA_NS=${isa}
                                              RAMSTREAM_ISA_LEVEL=${_rs_level_${isa}})
    target_compile_options(${lib} PRIVATE ${_rs_flags_${isa}} -O3 -ffp-contract=off
                                          -fno-math-errno -fno-trapping-math -Wall -Wextra)
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:${lib}>)
  endforeach()
  list(LENGTH RAMSTREAM_ISAS n)
  if(n GREATER 1)
    target_compile_definitions(${target} PRIVATE RAMSTREAM_HAVE_X86_ISAS=1)
  endif()
endfunction()
