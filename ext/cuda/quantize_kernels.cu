// Quantization kernels for commlayer's compressors (QSGD, EF-SignSGD, 1-bit SGD), loaded by
// commlayer/kernels/cupy_cuda.py through CuPy's RawModule like sparse_kernels.cu. extern "C",
// value type in the name (f32/f64). Ground truth: commlayer/kernels/reference.py.
//
// Layout: codes packed 8 / bits to a byte, little-endian within the byte (code j of a group
// at bits [j*bits, (j+1)*bits)); signs one bit per element (1 = x >= 0), element 32w + t at
// bit t of int32 word w.
//
// 1. qsgd_pack: one thread per output byte (so no two threads write one byte): for each of its
//    8 / bits elements e, level = |x| * scale[e / bucket]; rounded up where rand[e] < its
//    fractional part, at most levels; code = levels +- that (levels for x = 0). __fmul_rn: the product is
//    rounded as torch rounds it, never contracted into an FMA with the subtraction after it
//    (that would round up different elements than the reference).
//    qsgd_levels16: the same, one int16 signed level per thread.
// 2. qsgd_unpack / qsgd_unpack16: one thread per element, level times step[e / bucket], the
//    largest |level| by atomicMax (the loader refuses a payload with one above levels).
// 3. sign_pack: one thread per word (32 elements); sign_decode: one thread per element.

#include <stdint.h>

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
    int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (b >= nbytes) return;                                                                    \
    int per_byte = 8 / bits;                                                                    \
    unsigned acc = 0;                                                                           \
    for (int j = 0; j < per_byte; ++j) {                                                        \
        int64_t e = b * per_byte + j;                                                           \
        if (e < n) acc |= (unsigned)qsgd_code<V>(x[e], scale[e / bucket], rand[e], levels)      \
                          << (j * bits);                                                        \
    }                                                                                           \
    out[b] = (uint8_t)acc;                                                                      \
}                                                                                               \
extern "C" __global__ void qsgd_levels16_##VN(const V* x, const V* scale, const V* rand,       \
                                              int64_t n, int64_t bucket, int64_t levels,        \
                                              int16_t* out) {                                   \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e < n) out[e] = (int16_t)(qsgd_code<V>(x[e], scale[e / bucket], rand[e], levels) - levels); \
}                                                                                               \
extern "C" __global__ void qsgd_unpack_##VN(const uint8_t* packed, const V* step, int64_t n,   \
                                            int64_t bucket, int64_t levels, int bits, V* out,   \
                                            unsigned long long* top) {                          \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e >= n) return;                                                                         \
    int per_byte = 8 / bits;                                                                    \
    int64_t code = (packed[e / per_byte] >> ((e % per_byte) * bits)) & ((1 << bits) - 1);      \
    int64_t level = code - levels;                                                              \
    atomicMax(top, (unsigned long long)(level < 0 ? -level : level));                           \
    out[e] = (V)level * step[e / bucket];                                                       \
}                                                                                               \
extern "C" __global__ void qsgd_unpack16_##VN(const int16_t* packed, const V* step, int64_t n, \
                                              int64_t bucket, V* out, unsigned long long* top) {\
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e >= n) return;                                                                         \
    int64_t level = packed[e];                                                                  \
    atomicMax(top, (unsigned long long)(level < 0 ? -level : level));                           \
    out[e] = (V)level * step[e / bucket];                                                       \
}                                                                                               \
extern "C" __global__ void sign_pack_##VN(const V* x, int64_t n, int32_t* words,               \
                                          int64_t nwords) {                                     \
    int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (w >= nwords) return;                                                                    \
    unsigned acc = 0;                                                                           \
    for (int t = 0; t < 32 && 32 * w + t < n; ++t)                                              \
        if (x[32 * w + t] >= 0) acc |= 1u << t;                                                 \
    words[w] = (int32_t)acc;                                                                    \
}                                                                                               \
extern "C" __global__ void sign_decode_##VN(const int32_t* words, int64_t n, V positive,       \
                                            V negative, V* out) {                               \
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (e < n) out[e] = ((unsigned)words[e >> 5] >> (e & 31)) & 1u ? positive : negative;       \
}

COMMLAYER_QUANTIZE(float, f32)
COMMLAYER_QUANTIZE(double, f64)
