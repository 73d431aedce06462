// Fixed-width integer types for ext/cuda/*.cu under both compilers: nvcc (CMakeLists.txt, the
// prebuilt PTX) takes them from the C library; NVRTC (commlayer/kernels/cupy_cuda.py compiling
// the source at run time when no PTX is found) has no C library headers, and `#include
// <stdint.h>` failed there ("could not open source file"), so they are defined here.
#pragma once

#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
