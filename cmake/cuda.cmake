# The CUDA backend's build switch. DBUF_CUDA=AUTO (default) builds it when a
# CUDA compiler is found, ON requires it, OFF leaves it out. Sets
# DBUF_WITH_CUDA for the folders' CMakeLists and, when on, enables the CUDA
# language (default architectures 80 and 90: A100 and H100 / H200; override
# with -DCMAKE_CUDA_ARCHITECTURES=...), finds the toolkit (CUDA::cudart_static,
# CUDA::cuda_driver headers) and nccl.h.
set(DBUF_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when the toolkit is found), ON or OFF")
set_property(CACHE DBUF_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${DBUF_CUDA}" _dbuf_cuda)
if(NOT _dbuf_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "DBUF_CUDA must be AUTO, ON or OFF, got '${DBUF_CUDA}'")
endif()

set(DBUF_WITH_CUDA OFF)
if(NOT _dbuf_cuda STREQUAL "OFF")
  # The toolkit's usual home, for shells that do not have it on PATH.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(DBUF_WITH_CUDA ON)
  elseif(_dbuf_cuda STREQUAL "ON")
    message(FATAL_ERROR "DBUF_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    message(STATUS "dbuf: no CUDA compiler found, building the host backend only (DBUF_CUDA=AUTO)")
  endif()
endif()

if(DBUF_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know that nvcc 13 speaks C++20 (it would refuse
  # CUDA_STANDARD 20 at generate time): teach it the flag.
  if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  find_path(DBUF_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include)
  if(NOT DBUF_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "dbuf: the CUDA backend needs nccl.h (install NCCL or set NCCL_HOME)")
  endif()
  message(STATUS "dbuf: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES}, nccl.h in ${DBUF_NCCL_INCLUDE_DIR})")
endif()
