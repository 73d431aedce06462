// Quantization kernels for commlayer's compressors (QSGD, EF-SignSGD, 1-bit SGD), loaded by
// commlayer/kernels/cupy_cuda.py through CuPy's RawModule like sparse_kernels.cu. extern "C",
// value type in the name (f32/f64). Ground truth: commlayer/kernels/reference.py.
//
// Layout: codes packed 8 / bits to a byte, little-endian within the byte (code j of a group
// at bits [j*bits, (j+1)*bits)); signs one bit per element (1 = x >= 0), element 32w + t at
// bit t of int32 word w.
//
// FOUR ELEMENTS PER THREAD (thread g: elements 4g .. 4g+3): the values move as 16-byte vectors
// (float4, two double2) where the loader says every vector-read buffer is 16-byte aligned
// (`aligned`; a view at an odd offset is not) and all four elements exist, else element by
// element; packed codes and sign words move as one 8/16/32-bit store. One element per thread
// reached 38-65% of the device copy's bandwidth on an H200 (index arithmetic and one
// division per element, 4-byte accesses); four per thread 92-104%
// (benchmarks/results/kernels_cuda.md, and the numbers in benchmarks/README.md).
//
// 1. qsgd_pack: element e: level = |x| * scale[e / bucket]; rounded up where rand[e] < its
//    fractional part, at most levels; code = levels +- that (levels for x = 0). __fmul_rn: the
//    product is rounded as torch rounds it, never contracted into an FMA with the subtraction
//    after it (that would round up different elements than the reference). A thread's four
//    codes make 4 * bits bits (its bits / 2 bytes; at 1 bit half a byte, which two lanes OR
//    together by __shfl_xor_sync before the even one stores the byte), so no two threads
//    write one byte. The bucket index: one division per thread, then stepped per element.
//    qsgd_levels16: the same, four int16 signed levels (one 8-byte store).
// 2. qsgd_unpack / qsgd_unpack16: four elements, level times step[e / bucket], the largest
//    |level| (the loader refuses a payload with one above levels) reduced within the block
//    (warp shuffles, then shared memory) and merged by at most ONE atomicMax per block,
//    skipped when the block's max is 0 or not above the value already in *top (which only
//    grows, so a stale read costs an atomic, never a wrong result). One atomicMax per element
//    on the single address serialised the whole kernel (49.5 ms for 64 M floats on an H200).
// 3. sign_pack: four predicates x >= 0 make a nibble; the 8 aligned lanes of one word OR their
//    shifted nibbles together by __shfl_xor_sync (lane t's nibble -> bits 4(t % 8) ..) and the
//    first stores the word; elements past n give 0 bits, as the reference pads with zero
//    bits. sign_decode: a nibble of the word to four values; the two values are read from
//    device memory (0-dim tensors), so the caller never waits for them on the host.
//
// Launch: ceil(n / 4) threads; blockDim.x must be a multiple of 32 (at most 1024; the loader
// uses 256) and no thread of a kernel that uses warp-wide primitives (__shfl_*_sync with the
// full mask) or __syncthreads returns early: a lane whose elements are past n takes part with
// neutral values. With blockDim.x % 32 == 0 the global thread index g satisfies g % 32 == lane.

#include "commlayer_types.cuh"
#include "commlayer_vec.cuh"

// a / b for 0 <= a, 0 < b: one 32-bit unsigned division when both fit (every buffer below
// 2^32 elements), the exact same quotient as the 64-bit one, which is a long emulated routine.
__device__ __forceinline__ int64_t index_div(int64_t a, int64_t b) {
    if (((uint64_t)a | (uint64_t)b) <= 0xffffffffull) return (int64_t)((uint32_t)a / (uint32_t)b);
    return a / b;
}

// Largest v over the block into *top (see 2. above). Every thread of the block must call it.
__device__ __forceinline__ void block_max_into(unsigned v, unsigned long long* top) {
    __shared__ unsigned warp_max[32];
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(COMMLAYER_FULL_MASK, v, off));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : 0u;
        for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_down_sync(COMMLAYER_FULL_MASK, v, off));
        if (lane == 0 && v > 0 && (unsigned long long)v > *(volatile unsigned long long*)top)
            atomicMax(top, (unsigned long long)v);
    }
}

// The bucket of element 4g .. 4g+3: one division, then stepped (bucket may be below 4).
__device__ __forceinline__ void buckets4(int64_t g, int64_t bucket, int64_t idx[4]) {
    int64_t e = 4 * g, b = index_div(e, bucket), rem = e - b * bucket;
    for (int k = 0; k < 4; ++k) {
        idx[k] = b;
        if (++rem == bucket) { rem = 0; ++b; }
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

// Codes of elements 4g .. 4g+3 (levels + signed level), those past n left 0 (the reference
// pads with zero codes). Returns whether all four exist.
template <typename V>
__device__ __forceinline__ bool qsgd_codes4(const V* x, const V* scale, const V* rand,
                                            int64_t n, int64_t bucket, int64_t levels,
                                            bool aligned, int64_t g, int64_t code[4]) {
    bool whole = aligned && 4 * g + 3 < n;
    V xs[4], rs[4];
    load4<V>(x, g, n, whole, (V)0, xs);
    load4<V>(rand, g, n, whole, (V)0, rs);
    int64_t idx[4];
    buckets4(g, bucket, idx);
    for (int k = 0; k < 4; ++k)
        code[k] = 4 * g + k < n ? qsgd_code<V>(xs[k], scale[idx[k]], rs[k], levels) : 0;
    return 4 * g + 3 < n;
}

#define COMMLAYER_QUANTIZE(V, VN)                                                              \
extern "C" __global__ void qsgd_pack_##VN(const V* x, const V* scale, const V* rand, int64_t n, \
                                          int64_t bucket, int64_t levels, int bits,             \
                                          uint8_t* out, int64_t nbytes, int aligned) {          \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* elements 4g .. 4g+3 */      \
    int64_t code[4] = {0, 0, 0, 0};                                                             \
    bool whole = false; /* past n: codes 0; every lane runs the shuffle (no early return) */  \
    if (4 * g < n) whole = qsgd_codes4<V>(x, scale, rand, n, bucket, levels, aligned, g, code); \
    unsigned acc = 0; /* the four codes, code k at bits [k*bits, (k+1)*bits) */                 \
    for (int k = 0; k < 4; ++k) acc |= (unsigned)code[k] << (k * bits);                         \
    if (bits == 1) { /* half a byte: lanes 2i and 2i+1 make byte g / 2 */                     \
        acc <<= 4 * (g & 1);                                                                    \
        acc |= __shfl_xor_sync(COMMLAYER_FULL_MASK, acc, 1);                                    \
        if ((g & 1) == 0 && (g >> 1) < nbytes) out[g >> 1] = (uint8_t)acc;                     \
        return;                                                                                 \
    }                                                                                           \
    int per = bits / 2; /* bytes per thread: 1, 2 or 4 (out is the loader's, aligned) */       \
    int64_t first = g * per;                                                                    \
    if (whole && first + per <= nbytes) {                                                       \
        if (per == 4) reinterpret_cast<uint32_t*>(out)[g] = acc;                                \
        else if (per == 2) reinterpret_cast<uint16_t*>(out)[g] = (uint16_t)acc;                 \
        else out[g] = (uint8_t)acc;                                                             \
        return;                                                                                 \
    }                                                                                           \
    for (int k = 0; k < per; ++k)                                                               \
        if (first + k < nbytes) out[first + k] = (uint8_t)(acc >> (8 * k));                    \
}                                                                                               \
extern "C" __global__ void qsgd_levels16_##VN(const V* x, const V* scale, const V* rand,       \
                                              int64_t n, int64_t bucket, int64_t levels,        \
                                              int16_t* out, int aligned) {                      \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (4 * g >= n) return; /* no warp primitives here */                                      \
    int64_t code[4];                                                                            \
    bool whole = qsgd_codes4<V>(x, scale, rand, n, bucket, levels, aligned, g, code);           \
    if (whole) { /* out is the loader's (aligned) */                                           \
        reinterpret_cast<short4*>(out)[g] = make_short4(                                        \
            (short)(code[0] - levels), (short)(code[1] - levels),                              \
            (short)(code[2] - levels), (short)(code[3] - levels));                             \
        return;                                                                                 \
    }                                                                                           \
    for (int k = 0; k < 4; ++k)                                                                 \
        if (4 * g + k < n) out[4 * g + k] = (int16_t)(code[k] - levels);                        \
}                                                                                               \
extern "C" __global__ void qsgd_unpack_##VN(const uint8_t* packed, const V* step, int64_t n,   \
                                            int64_t bucket, int64_t levels, int bits, V* out,   \
                                            unsigned long long* top, int aligned) {             \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    unsigned mag = 0; /* no early return: block_max_into needs every thread */                  \
    if (4 * g < n) {                                                                            \
        bool whole = 4 * g + 3 < n;                                                             \
        unsigned acc; /* the four codes, as qsgd_pack stored them */                           \
        if (bits == 1) {                                                                        \
            acc = (unsigned)packed[g >> 1] >> (4 * (g & 1));                                    \
        } else if (whole && aligned) {                                                          \
            int per = bits / 2;                                                                 \
            if (per == 4) acc = reinterpret_cast<const uint32_t*>(packed)[g];                   \
            else if (per == 2) acc = reinterpret_cast<const uint16_t*>(packed)[g];              \
            else acc = packed[g];                                                               \
        } else { /* the bytes of this thread's codes (those holding an element below n) */   \
            int per = bits / 2;                                                                 \
            int used = (int)min((int64_t)per, ((n - 4 * g) * bits + 7) / 8);                    \
            acc = 0;                                                                            \
            for (int k = 0; k < used; ++k) acc |= (unsigned)packed[g * per + k] << (8 * k);     \
        }                                                                                       \
        int64_t idx[4];                                                                         \
        buckets4(g, bucket, idx);                                                               \
        V vals[4];                                                                              \
        for (int k = 0; k < 4; ++k) { /* 32-bit ints: a 64-bit one converts slowly */          \
            int level = (int)((acc >> (k * bits)) & ((1u << bits) - 1u)) - (int)levels;         \
            if (4 * g + k < n) mag = max(mag, (unsigned)abs(level));                            \
            vals[k] = 4 * g + k < n ? (V)level * step[idx[k]] : (V)0;                           \
        }                                                                                       \
        store4<V>(out, g, n, whole, vals); /* out is the loader's (aligned) */                 \
    }                                                                                           \
    block_max_into(mag, top);                                                                   \
}                                                                                               \
extern "C" __global__ void qsgd_unpack16_##VN(const int16_t* packed, const V* step, int64_t n, \
                                              int64_t bucket, V* out, unsigned long long* top,  \
                                              int aligned) {                                    \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    unsigned mag = 0; /* no early return: block_max_into needs every thread */                  \
    if (4 * g < n) {                                                                            \
        bool whole = 4 * g + 3 < n;                                                             \
        int lv[4] = {0, 0, 0, 0}; /* 32-bit: a 64-bit int converts slowly */                  \
        if (whole && aligned) {                                                                 \
            short4 t = reinterpret_cast<const short4*>(packed)[g];                              \
            lv[0] = t.x; lv[1] = t.y; lv[2] = t.z; lv[3] = t.w;                                 \
        } else {                                                                                \
            for (int k = 0; k < 4; ++k)                                                         \
                if (4 * g + k < n) lv[k] = packed[4 * g + k];                                   \
        }                                                                                       \
        int64_t idx[4];                                                                         \
        buckets4(g, bucket, idx);                                                               \
        V vals[4];                                                                              \
        for (int k = 0; k < 4; ++k) {                                                           \
            mag = max(mag, (unsigned)abs(lv[k]));                                               \
            vals[k] = 4 * g + k < n ? (V)lv[k] * step[idx[k]] : (V)0;                           \
        }                                                                                       \
        store4<V>(out, g, n, whole, vals);                                                      \
    }                                                                                           \
    block_max_into(mag, top);                                                                   \
}                                                                                               \
extern "C" __global__ void sign_pack_##VN(const V* x, int64_t n, int32_t* words,               \
                                          int64_t nwords, int aligned) {                        \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* elements 4g .. 4g+3 */      \
    unsigned acc = 0; /* every lane runs the shuffles (no early return); past n: bits 0 */     \
    if (4 * g < n) {                                                                            \
        V xs[4];                                                                                \
        load4<V>(x, g, n, aligned && 4 * g + 3 < n, (V)-1, xs); /* -1: a 0 bit past n */       \
        for (int k = 0; k < 4; ++k) acc |= (xs[k] >= 0 ? 1u : 0u) << k;                         \
    }                                                                                           \
    acc <<= 4 * (g & 7); /* word g / 8: lanes 8i .. 8i+7 of the warp */                         \
    acc |= __shfl_xor_sync(COMMLAYER_FULL_MASK, acc, 1);                                        \
    acc |= __shfl_xor_sync(COMMLAYER_FULL_MASK, acc, 2);                                        \
    acc |= __shfl_xor_sync(COMMLAYER_FULL_MASK, acc, 4);                                        \
    if ((g & 7) == 0 && (g >> 3) < nwords) words[g >> 3] = (int32_t)acc;                        \
}                                                                                               \
extern "C" __global__ void sign_decode_##VN(const int32_t* words, int64_t n, const V* positive, \
                                            const V* negative, V* out) {                        \
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                                 \
    if (4 * g >= n) return; /* no warp primitives here */                                      \
    V p = *positive, q = *negative, vals[4];                                                    \
    unsigned nibble = ((unsigned)words[g >> 3] >> (4 * (g & 7))) & 15u;                         \
    for (int k = 0; k < 4; ++k) vals[k] = (nibble >> k) & 1u ? p : q;                           \
    store4<V>(out, g, n, 4 * g + 3 < n, vals); /* out is the loader's (aligned) */             \
}

COMMLAYER_QUANTIZE(float, f32)
COMMLAYER_QUANTIZE(double, f64)
