// Quantization kernels for commlayer's compressors (QSGD, EF-SignSGD, 1-bit SGD), loaded by
// commlayer/kernels/cupy_cuda.py through CuPy's RawModule like sparse_kernels.cu. extern "C",
// value type in the name (f32/f64). Ground truth: commlayer/kernels/reference.py.
//
// Layout: codes packed 8 / bits to a byte, little-endian within the byte (code j of a group
// at bits [j*bits, (j+1)*bits)); signs one bit per element (1 = x >= 0), element 32w + t at
// bit t of int32 word w.
//
// 1. qsgd_pack: one thread per ELEMENT (x, scale, rand read coalesced); the 8 / bits lanes of
//    one byte OR their shifted codes together by __shfl_xor_sync and the first of them stores
//    the byte (so no two threads write one byte). Element e: level = |x| * scale[e / bucket];
//    rounded up where rand[e] < its fractional part, at most levels; code = levels +- that
//    (levels for x = 0). __fmul_rn: the product is rounded as torch rounds it, never contracted into an FMA with the subtraction after it
//    (that would round up different elements than the reference).
//    qsgd_levels16: the same, one int16 signed level per thread.
// 2. qsgd_unpack / qsgd_unpack16: one thread per element, level times step[e / bucket], the
//    largest |level| (the loader refuses a payload with one above levels) reduced within the
//    block (warp shuffles, then shared memory) and merged by at most ONE atomicMax per block,
//    skipped when the block's max is 0 or not above the value already in *top (which only
//    grows, so a stale read costs an atomic, never a wrong result). One atomicMax per element
//    on the single address serialised the whole kernel (49.5 ms for 64 M floats on an H200).
// 3. sign_pack: one thread per ELEMENT (x read coalesced): the warp's 32 predicates x >= 0 by
//    __ballot_sync (lane t -> bit t), lane 0 stores word e / 32; lanes past n vote 0, as the
//    reference pads with zero bits. sign_decode: one thread per element; the two values are
//    read from device memory (0-dim tensors), so the caller never waits for them on the host.
//
// Launch: blockDim.x must be a multiple of 32 (at most 1024; the loader uses 256) and no
// thread of these kernels returns early, because the warp-wide primitives (__ballot_sync,
// __shfl_*_sync with the full mask) and __syncthreads need every lane of the block: a lane
// whose element is past n takes part with a neutral value. With blockDim.x % 32 == 0 the
// global thread index e satisfies e % 32 == lane.

#include "commlayer_types.cuh"

// a / b for 0 <= a, 0 < b: one 32-bit unsigned division when both fit (every buffer below
// 2^32 elements), the exact same quotient as the 64-bit one, which is a long emulated routine.
__device__ __forceinline__ int64_t index_div(int64_t a, int64_t b) {
    if (((uint64_t)a | (uint64_t)b) <= 0xffffffffull) return (int64_t)((uint32_t)a / (uint32_t)b);
    return a / b;
}

// Largest v over the block into *top (see 2. above). Every thread of the block must call it.
__device__ __forceinline__ void block_max_into(unsigned v, unsigned long long* top) {
    __shared__ unsigned warp_max[32];
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, off));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : 0u;
        for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, off));
        if (lane == 0 && v > 0 && (unsigned long long)v > *(volatile unsigned long long*)top)
            atomicMax(top, (unsigned long long)v);
    }
}

template <typename V>
__device__ int64_t qsgd_code(V x, V scale, V rand, int64_t levels);

template <>
__device__ int64_t qsgd_code<float>(float x, float scale, float rand, int64_t levels) {
    float level = __fmul_rn(fabsf(x), scale);
    float low = floorf(level);
    int64_t step = min((int64_t)low + (rand < level - low ? 1 : 0), levels);
    return x > 0 ? levels + step : (x < 0 ? levels - step : levels);
}

template <>
__device__ int64_t qsgd_code<double>(double x, double scale, double rand, int64_t levels) {
    double level = __dmul_rn(fabs(x), scale);
    double low = floor(level);
    int64_t step = min((int64_t)low + (rand < level - low ? 1 : 0), levels);
    return x > 0 ? levels + step : (x < 0 ? levels - step : levels);
}

#define COMMLAYER_QUANTIZE(V, VN)                                                              \
extern "C" __global__ void qsgd_pack_##VN(const V* x, const V* scale, const V* rand, int64_t n, \
                                          int64_t bucket, int64_t levels, int bits,             \
                                          uint8_t* out, int64_t nbytes) {                       \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* one thread per element */    \
    int per_byte = 8 / bits; /* 1, 2, 4 or 8: divides 32, so a byte's lanes share a warp */     \
    int j = threadIdx.x & (per_byte - 1); /* == e % per_byte (blockDim.x % 32 == 0) */          \
    unsigned acc = 0; /* past n: code 0, as the reference pads with zero codes */               \
    if (e < n)                                                                                  \
        acc = (unsigned)qsgd_code<V>(x[e], scale[index_div(e, bucket)], rand[e], levels)        \
              << (j * bits);                                                                    \
    /* OR over the per_byte aligned lanes of one byte; every lane runs it (no early return) */  \
    for (int off = 1; off < per_byte; off <<= 1) acc |= __shfl_xor_sync(0xffffffffu, acc, off); \
    int64_t b = index_div(e, per_byte);                                                         \
    if (j == 0 && b < nbytes) out[b] = (uint8_t)acc;                                            \
}                                                                                               \
extern "C" __global__ void qsgd_levels16_##VN(const V* x, const V* scale, const V* rand,       \
                                              int64_t n, int64_t bucket, int64_t levels,        \
                                              int16_t* out) {                                   \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e < n) out[e] = (int16_t)(qsgd_code<V>(x[e], scale[index_div(e, bucket)], rand[e], levels) - levels); \
}                                                                                               \
extern "C" __global__ void qsgd_unpack_##VN(const uint8_t* packed, const V* step, int64_t n,   \
                                            int64_t bucket, int64_t levels, int bits, V* out,   \
                                            unsigned long long* top) {                          \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    unsigned mag = 0; /* no early return: block_max_into needs every thread */                  \
    if (e < n) {                                                                                \
        int per_byte = 8 / bits;                                                                \
        int64_t byte = index_div(e, per_byte);                                                  \
        int64_t code = (packed[byte] >> ((e - byte * per_byte) * bits)) & ((1 << bits) - 1);    \
        int64_t level = code - levels;                                                          \
        mag = (unsigned)(level < 0 ? -level : level);                                           \
        out[e] = (V)level * step[index_div(e, bucket)];                                         \
    }                                                                                           \
    block_max_into(mag, top);                                                                   \
}                                                                                               \
extern "C" __global__ void qsgd_unpack16_##VN(const int16_t* packed, const V* step, int64_t n, \
                                              int64_t bucket, V* out, unsigned long long* top) {\
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    unsigned mag = 0; /* no early return: block_max_into needs every thread */                  \
    if (e < n) {                                                                                \
        int64_t level = packed[e];                                                              \
        mag = (unsigned)(level < 0 ? -level : level);                                           \
        out[e] = (V)level * step[index_div(e, bucket)];                                         \
    }                                                                                           \
    block_max_into(mag, top);                                                                   \
}                                                                                               \
extern "C" __global__ void sign_pack_##VN(const V* x, int64_t n, int32_t* words,               \
                                          int64_t nwords) {                                     \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* one thread per element */    \
    /* every lane votes (no early return); past n a lane votes 0, like the reference's pad */   \
    unsigned acc = __ballot_sync(0xffffffffu, e < n && x[e] >= 0);                              \
    if ((threadIdx.x & 31) == 0 && (e >> 5) < nwords) words[e >> 5] = (int32_t)acc;             \
}                                                                                               \
extern "C" __global__ void sign_decode_##VN(const int32_t* words, int64_t n, const V* positive, \
                                            const V* negative, V* out) {                        \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e < n) out[e] = ((unsigned)words[e >> 5] >> (e & 31)) & 1u ? *positive : *negative;     \
}

COMMLAYER_QUANTIZE(float, f32)
COMMLAYER_QUANTIZE(double, f64)
