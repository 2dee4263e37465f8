# Stand-in for CANN's ascendc.cmake (tests/npu/test_kernel_cmake.py): records every ascendc_library and
# ascendc_include_directories call, and what CANN's file requires, to ${CMAKE_BINARY_DIR}/ascendc_calls.txt
# (one call a line, fields separated by `|`). Builds nothing.
if(NOT DEFINED ASCEND_CANN_PACKAGE_PATH OR NOT ASCEND_CANN_PACKAGE_PATH)
  message(FATAL_ERROR "fake ascendc.cmake: ASCEND_CANN_PACKAGE_PATH is not set")
endif()
file(WRITE ${CMAKE_BINARY_DIR}/ascendc_calls.txt
     "include|ASCEND_CANN_PACKAGE_PATH=${ASCEND_CANN_PACKAGE_PATH}|SOC_VERSION=${SOC_VERSION}|RUN_MODE=${RUN_MODE}\n")

function(ascendc_library target type)
  string(REPLACE ";" "|" sources "${ARGN}")
  file(APPEND ${CMAKE_BINARY_DIR}/ascendc_calls.txt "ascendc_library|${target}|${type}|${sources}\n")
endfunction()

function(ascendc_include_directories target scope)
  string(REPLACE ";" "|" dirs "${ARGN}")
  file(APPEND ${CMAKE_BINARY_DIR}/ascendc_calls.txt "ascendc_include_directories|${target}|${scope}|${dirs}\n")
endfunction()
