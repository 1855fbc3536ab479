// RAMSTREAM_HD / RAMSTREAM_HD_INLINE: mark a function callable from host and CUDA device code.
//
// Under nvcc (__CUDACC__) RAMSTREAM_HD is `__host__ __device__`; in plain C++ it is empty.
// RAMSTREAM_HD_INLINE adds `__forceinline__` (device) / `inline` (host) for small header functions.
#pragma once

#ifdef __CUDACC__
#define RAMSTREAM_HD __host__ __device__
#define RAMSTREAM_HD_INLINE __host__ __device__ __forceinline__
#else
#define RAMSTREAM_HD
#define RAMSTREAM_HD_INLINE inline
#endif
