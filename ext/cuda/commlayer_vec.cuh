// Four elements a thread (ext/cuda/quantize_kernels.cu, the threshold mask of
// sparse_kernels.cu): thread g moves elements 4g .. 4g+3 as one 16-byte vector (float4, two
// double2) where the caller says all four exist and the buffer is 16-byte aligned (`whole`),
// else element by element. Included by the .cu files (nvcc and NVRTC find it beside them).
#pragma once

#include "commlayer_types.cuh"

#define COMMLAYER_FULL_MASK 0xffffffffu  // every lane of a warp (__shfl_*_sync)

// Elements 4g .. 4g+3 of p: one vector load when `whole` (all four exist, p 16-byte aligned),
// else one by one, `fill` for those at or past n.
template <typename V>
__device__ __forceinline__ void load4(const V* p, int64_t g, int64_t n, bool whole, V fill,
                                      V v[4]);

template <>
__device__ __forceinline__ void load4<float>(const float* p, int64_t g, int64_t n, bool whole,
                                             float fill, float v[4]) {
    if (whole) {
        float4 t = reinterpret_cast<const float4*>(p)[g];
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        return;
    }
    for (int k = 0; k < 4; ++k) v[k] = 4 * g + k < n ? p[4 * g + k] : fill;
}

template <>
__device__ __forceinline__ void load4<double>(const double* p, int64_t g, int64_t n, bool whole,
                                              double fill, double v[4]) {
    if (whole) {
        double2 a = reinterpret_cast<const double2*>(p)[2 * g];
        double2 b = reinterpret_cast<const double2*>(p)[2 * g + 1];
        v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
        return;
    }
    for (int k = 0; k < 4; ++k) v[k] = 4 * g + k < n ? p[4 * g + k] : fill;
}

// The four values into elements 4g .. 4g+3 of p (those below n), as load4.
template <typename V>
__device__ __forceinline__ void store4(V* p, int64_t g, int64_t n, bool whole, const V v[4]);

template <>
__device__ __forceinline__ void store4<float>(float* p, int64_t g, int64_t n, bool whole,
                                              const float v[4]) {
    if (whole) {
        reinterpret_cast<float4*>(p)[g] = make_float4(v[0], v[1], v[2], v[3]);
        return;
    }
    for (int k = 0; k < 4; ++k)
        if (4 * g + k < n) p[4 * g + k] = v[k];
}

template <>
__device__ __forceinline__ void store4<double>(double* p, int64_t g, int64_t n, bool whole,
                                               const double v[4]) {
    if (whole) {
        reinterpret_cast<double2*>(p)[2 * g] = make_double2(v[0], v[1]);
        reinterpret_cast<double2*>(p)[2 * g + 1] = make_double2(v[2], v[3]);
        return;
    }
    for (int k = 0; k < 4; ++k)
        if (4 * g + k < n) p[4 * g + k] = v[k];
}
