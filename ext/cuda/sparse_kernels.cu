// Sparse-gradient kernels for commlayer (loaded by commlayer/kernels/cupy_cuda.py through CuPy's
// RawModule: the PTX that CMakeLists.txt builds with nvcc, or this source compiled by NVRTC).
//
// Sparse lists are (index, value) arrays with strictly increasing indices. Every kernel is
// extern "C" with the value and index types in its name (f32/f64, i32/i64), so the loader can
// find each by name without C++ mangling. The torch reference (commlayer/kernels/reference.py)
// is the ground truth for all of them.
//
// 1. scatter_add: dense[idx[i]] += val[i], one thread per entry, atomicAdd (memory-bound:
//    reads 8 bytes and does one atomic per entry).
// 2. threshold: one thread per element; |x| >= threshold takes an output slot from an atomic
//    counter (the set is exact, the order arbitrary: the loader sorts it). Warp-aggregated:
//    the warp's selected lanes (__ballot_sync) take __popc(mask) slots by ONE atomicAdd of
//    their first lane, broadcast by __shfl_sync; each lane's slot is base + the number of
//    selected lanes below it. Needs blockDim.x % 32 == 0 and no early return (every lane of
//    the warp must reach the ballot; the loader launches 256 threads).
// 3. merge with summation, "merge path" in two passes over both lists plus a scan:
//    a. match_a[i] = 1 when a[i] also occurs in b (binary search of b);
//    b. the host computes M = exclusive prefix sum of match_a (CuPy's cumsum);
//    c. merge_a: a[i] goes to i + lower_bound(b, a[i]) - M[i], its value summed with b's
//       when matched; merge_b: an unmatched b[j] goes to j + lower_bound(a, b[j]) -
//       M[lower_bound(a, b[j])] (the matched a's before it pair with b's before it).
//    The output has na + nb - M[na] entries, sorted, with no repeated index.

#include "commlayer_types.cuh"

template <typename I>
__device__ int64_t lower_bound(const I* keys, int64_t n, I key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) >> 1;
        if (keys[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

#define COMMLAYER_KERNELS(V, I, VN, IN)                                                        \
extern "C" __global__ void scatter_add_##VN##_##IN(V* dense, const I* idx, const V* val,       \
                                                   int64_t n) {                                \
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                \
    if (i < n) atomicAdd(dense + idx[i], val[i]);                                              \
}                                                                                              \
extern "C" __global__ void threshold_##VN##_##IN(const V* x, V threshold, I* out,              \
                                                 unsigned long long* count, int64_t n) {       \
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                \
    bool take = i < n && fabs(x[i]) >= threshold;                                              \
    unsigned mask = __ballot_sync(0xffffffffu, take);                                          \
    if (mask) { /* warp-uniform branch: the whole warp enters, so the shuffle is safe */       \
        int lane = threadIdx.x & 31, first = __ffs(mask) - 1;                                  \
        unsigned long long base = 0;                                                           \
        if (lane == first) base = atomicAdd(count, (unsigned long long)__popc(mask));          \
        base = __shfl_sync(0xffffffffu, base, first);                                          \
        if (take) out[base + __popc(mask & ((1u << lane) - 1u))] = (I)i;                       \
    }                                                                                          \
}                                                                                              \
extern "C" __global__ void match_##VN##_##IN(const I* a, int64_t na, const I* b, int64_t nb,   \
                                             int64_t* match) {                                 \
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                \
    if (i < na) {                                                                              \
        int64_t at = lower_bound(b, nb, a[i]);                                                 \
        match[i] = (at < nb && b[at] == a[i]) ? 1 : 0;                                         \
    }                                                                                          \
}                                                                                              \
extern "C" __global__ void merge_a_##VN##_##IN(const I* a, const V* va, int64_t na,            \
                                               const I* b, const V* vb, int64_t nb,            \
                                               const int64_t* before, I* out_i, V* out_v) {    \
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                \
    if (i < na) {                                                                              \
        int64_t at = lower_bound(b, nb, a[i]);                                                 \
        bool matched = at < nb && b[at] == a[i];                                               \
        int64_t pos = i + at - before[i];                                                      \
        out_i[pos] = a[i];                                                                     \
        out_v[pos] = matched ? va[i] + vb[at] : va[i];                                         \
    }                                                                                          \
}                                                                                              \
extern "C" __global__ void merge_b_##VN##_##IN(const I* a, int64_t na, const I* b,             \
                                               const V* vb, int64_t nb, const int64_t* before, \
                                               I* out_i, V* out_v) {                           \
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                \
    if (j < nb) {                                                                              \
        int64_t at = lower_bound(a, na, b[j]);                                                 \
        if (at < na && a[at] == b[j]) return; /* written, summed, by merge_a */                \
        int64_t pos = j + at - before[at];                                                     \
        out_i[pos] = b[j];                                                                     \
        out_v[pos] = vb[j];                                                                    \
    }                                                                                          \
}

COMMLAYER_KERNELS(float, int32_t, f32, i32)
COMMLAYER_KERNELS(float, int64_t, f32, i64)
COMMLAYER_KERNELS(double, int32_t, f64, i32)
COMMLAYER_KERNELS(double, int64_t, f64, i64)
