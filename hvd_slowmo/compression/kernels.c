/* The codecs' arithmetic on the CPU as loops over memory, one pass per phase of the compressed
 * mean (see native.py, which builds and loads this file): the bits of the eager torch path of
 * hvd_slowmo/compression/codecs.py, exchange.py and sparse.py.
 *
 * Scaled codecs (int8, fp8): a packet is the scales' bytes (one float32 per block, 4-byte
 * unaligned in general), then the codes (one byte per element); block b of a vector of n
 * elements is [b * block, min(n, (b + 1) * block)). Casts (fp16, bf16): a packet is the codes.
 * The sparse codec (at the end): its encode, error feedback included (hvd_sparse_encode), and the
 * sum of its packets (hvd_sparse_sum).
 *
 * Built with -ffp-contract=off and without -ffast-math: every operation is the IEEE float32
 * operation the eager path runs (a product and a difference are never fused), in its order.
 * Where the compiler targets AVX-512 (-march=native on such a CPU), the sparse codec's sample
 * threshold, threshold pass, ranks, and the sum's decode and stores use its intrinsics;
 * elsewhere the same loops in plain C, with the same bits.
 *
 * The exported functions (hvd_<codec>_{encode,decode}_rows, hvd_<codec>_reduce, hvd_sparse_*)
 * split their blocks between OpenMP threads. Built with -fopenmp, this library names
 * libgomp.so.1, which torch's wheels load first: one OpenMP runtime, whose idle threads do not
 * spin beside ours. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
static int omp_thread(void) { return omp_get_thread_num(); }
#else /* a compiler without OpenMP: the pragmas are ignored, one thread runs every block */
static int omp_thread(void) { return 0; }
#endif

#define INT8_MAX_CODE 127.0f
#define FP8_MAX_CODE 448.0f

/* The bits of |v|: as unsigned integers they order as the magnitudes do, and every NaN's above
 * infinity's, so the block's largest (an integer maximum, which vectorizes where a float
 * maximum that keeps NaNs does not) is torch's amax of abs: the largest magnitude, or a NaN of
 * the block with its sign cleared (of several NaN payloads, the largest). */
static inline uint32_t abs_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u & 0x7fffffffu;
}

/* The block's scale from its largest magnitude's bits: absmax / 127 (or 448), an IEEE
 * division. */
static inline float scale_of(uint32_t max_bits, float code_max) {
    float amax;
    memcpy(&amax, &max_bits, 4);
    return amax / code_max;
}

/* A zero scale divides by one (its codes are 0); a NaN scale too (its block decodes to NaN
 * through the scale); an infinite one divides the finite values to zeros. */
static inline float divisor_of(float scale) { return scale > 0.0f ? scale : 1.0f; }

/* int8's code of v: round(v / divisor) (to nearest, ties to even) clamped to [-127, 127]. For
 * a block of finite values (a finite scale), where no quotient is a NaN. */
static inline int8_t int8_code(float v, float divisor) {
    float q = nearbyintf(v / divisor);
    q = q < -INT8_MAX_CODE ? -INT8_MAX_CODE : q;
    return (int8_t)(int32_t)(q > INT8_MAX_CODE ? INT8_MAX_CODE : q);
}

/* int8_code for a block with a NaN or an infinity: a NaN quotient becomes code 0, as torch's
 * conversion does on x86 and ARM. */
static inline int8_t int8_code_any(float v, float divisor) {
    float q = nearbyintf(v / divisor);
    q = q < -INT8_MAX_CODE ? -INT8_MAX_CODE : q;
    q = q > INT8_MAX_CODE ? INT8_MAX_CODE : q;
    return q == q ? (int8_t)(int32_t)q : 0;
}

static inline float int8_value(int8_t c) { return (float)c; }

static inline float float_of_bits(uint32_t u) {
    float v;
    memcpy(&v, &u, 4);
    return v;
}

static inline uint32_t bits_of_float(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

/* float8_e4m3fn (bias 7, 3 mantissa bits, no infinities, NaN S.1111.111, largest 448) of v,
 * rounded to nearest, ties to even, as torch's cast: magnitudes from 480 up and NaNs become
 * NaN, those under 2^-6 (the smallest normal) subnormal codes. Branch-free, to vectorize. */
static inline uint8_t fp8_of(float v) {
    uint32_t u = bits_of_float(v), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    /* Subnormal: adding 2^14 leaves the code in the sum's low bits, rounded by the addition. */
    const uint32_t subnormal_bias = 141u << 23;
    uint32_t sub = bits_of_float(float_of_bits(a) + float_of_bits(subnormal_bias)) - subnormal_bias;
    /* Normal: rebias the exponent (127 to 7) and round the 20 dropped bits to even. */
    uint32_t odd = (a >> 20) & 1u;
    uint32_t normal = (a + 0xc4000000u + 0x7ffffu + odd) >> 20; /* 0xc4000000: (7 - 127) << 23 */
    uint32_t code = a >= (1087u << 20) ? 0x7fu : (a < (121u << 23) ? sub : normal);
    return (uint8_t)(code | sign);
}

/* The float32 value of a float8_e4m3fn code (exact; S.1111.111 is a NaN), with no float32
 * subnormal on the way (so flushing those to zero changes nothing): a normal code's exponent
 * rebiased (7 to 127) beside its mantissa; a subnormal one, m * 2^-9, as (1 + m/8) 2^-6 less
 * 2^-6. Integer selects and one exact difference: it vectorizes. */
static inline float fp8_value(uint8_t c) {
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u, subnormal = e == 0;
    float value = float_of_bits((e + subnormal + 120u) << 23 | m << 20) -
                  float_of_bits(subnormal * 0x3c800000u); /* 2^-6, or +0 */
    uint32_t bits = (c & 0x7fu) == 0x7fu ? 0x7fc00000u : bits_of_float(value);
    return float_of_bits(bits | (uint32_t)(c & 0x80u) << 24);
}

/* fp8's code of v: v / divisor clamped to [-448, 448], cast (a NaN stays a NaN code). */
static inline uint8_t fp8_code(float v, float divisor) {
    float q = v / divisor;
    q = q < -FP8_MAX_CODE ? -FP8_MAX_CODE : q;
    return fp8_of(q > FP8_MAX_CODE ? FP8_MAX_CODE : q);
}

static int64_t block_len(int64_t b, int64_t n, int64_t block) {
    int64_t start = b * block;
    return n - start < block ? n - start : block;
}

static int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

/* A scaled codec (int8, fp8): codes of type CODE, scale absmax / MAX per block, code and
 * value functions NAME##_code (a finite block), CODE_ANY (any block), NAME##_value. A packet is
 * the blocks' scales (4-byte unaligned in general), then the codes.
 *
 * NAME##_block: one block's codes and scale (returned). With feedback (fb), x + r into r
 * first, and r - value(code) * scale after: what the codes lost. */
#define SCALED_CODEC(NAME, CODE, MAX, CODE_ANY)                                                  \
    static float NAME##_block(const float *restrict x, float *restrict r, int64_t len,          \
                              CODE *restrict codes) {                                            \
        uint32_t max_bits = 0;                                                                   \
        const float *v = x;                                                                      \
        if (r) {                                                                                 \
            for (int64_t i = 0; i < len; i++) {                                                  \
                r[i] = x[i] + r[i];                                                              \
                uint32_t u = abs_bits(r[i]);                                                     \
                max_bits = u > max_bits ? u : max_bits;                                          \
            }                                                                                    \
            v = r;                                                                               \
        } else {                                                                                 \
            for (int64_t i = 0; i < len; i++) {                                                  \
                uint32_t u = abs_bits(x[i]);                                                     \
                max_bits = u > max_bits ? u : max_bits;                                          \
            }                                                                                    \
        }                                                                                        \
        float scale = scale_of(max_bits, MAX), divisor = divisor_of(scale);                      \
        if (isfinite(scale)) {                                                                   \
            for (int64_t i = 0; i < len; i++) codes[i] = NAME##_code(v[i], divisor);             \
        } else {                                                                                 \
            for (int64_t i = 0; i < len; i++) codes[i] = CODE_ANY(v[i], divisor);                \
        }                                                                                        \
        if (r) {                                                                                 \
            for (int64_t i = 0; i < len; i++) r[i] = r[i] - NAME##_value(codes[i]) * scale;      \
        }                                                                                        \
        return scale;                                                                            \
    }                                                                                            \
                                                                                                 \
    /* The blocks [b0, b1) of x (n elements) encoded into packet; with residual (another        \
     * buffer than x), error feedback. */                                                        \
    static void NAME##_encode(const float *restrict x, float *restrict residual, int64_t n,     \
                              int64_t block, uint8_t *restrict packet, int64_t b0, int64_t b1) { \
        CODE *codes = (CODE *)(packet + 4 * num_blocks(n, block));                               \
        for (int64_t b = b0; b < b1; b++) {                                                      \
            int64_t start = b * block;                                                           \
            float scale = NAME##_block(x + start, residual ? residual + start : NULL,            \
                                       block_len(b, n, block), codes + start);                   \
            memcpy(packet + 4 * b, &scale, 4);                                                   \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* The blocks [b0, b1) of packet (n elements) decoded into out: value(code) * scale. */     \
    static void NAME##_decode(const uint8_t *restrict packet, int64_t n, int64_t block,         \
                              float *restrict out, int64_t b0, int64_t b1) {                     \
        const CODE *restrict codes = (const CODE *)(packet + 4 * num_blocks(n, block));          \
        for (int64_t b = b0; b < b1; b++) {                                                      \
            int64_t start = b * block, len = block_len(b, n, block);                             \
            float scale;                                                                         \
            memcpy(&scale, packet + 4 * b, 4);                                                   \
            for (int64_t i = start; i < start + len; i++)                                        \
                out[i] = NAME##_value(codes[i]) * scale;                                         \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* The blocks [b0, b1) of the mean of m packets (n elements each, at packets[0..m)):        \
     * decoded, summed in rank order, divided by m, encoded into out. scratch: block floats. */  \
    static void NAME##_reduce(const uint8_t *const *packets, int64_t m, int64_t n,              \
                              int64_t block, uint8_t *restrict out, float *restrict scratch,     \
                              int64_t b0, int64_t b1) {                                          \
        int64_t codes_at = 4 * num_blocks(n, block);                                             \
        float count = (float)m;                                                                  \
        for (int64_t b = b0; b < b1; b++) {                                                      \
            int64_t start = b * block, len = block_len(b, n, block);                             \
            for (int64_t w = 0; w < m; w++) {                                                    \
                const CODE *restrict codes = (const CODE *)(packets[w] + codes_at) + start;      \
                float scale;                                                                     \
                memcpy(&scale, packets[w] + 4 * b, 4);                                           \
                if (w == 0) {                                                                    \
                    for (int64_t i = 0; i < len; i++) scratch[i] = NAME##_value(codes[i]) * scale; \
                } else {                                                                         \
                    for (int64_t i = 0; i < len; i++)                                            \
                        scratch[i] = scratch[i] + NAME##_value(codes[i]) * scale;                \
                }                                                                                \
            }                                                                                    \
            for (int64_t i = 0; i < len; i++) scratch[i] = scratch[i] / count;                   \
            float scale = NAME##_block(scratch, NULL, len, (CODE *)(out + codes_at) + start);    \
            memcpy(out + 4 * b, &scale, 4);                                                      \
        }                                                                                        \
    }

SCALED_CODEC(int8, int8_t, INT8_MAX_CODE, int8_code_any)
/* fp8's code keeps a NaN quotient a NaN code: one code function for every block. */
SCALED_CODEC(fp8, uint8_t, FP8_MAX_CODE, fp8_code)

/* The cast codecs (fp16, bf16): a packet is the codes alone, and [b0, b1) are chunks of block
 * elements, the threads' shares (a cast has no scales). Each function is the eager path's
 * cast, its error feedback (r <- x + r, then r - decode(code)) and its reduce (decode, sum in
 * rank order, divide by m, cast), one pass. */

/* bf16: the upper half of the float32, rounded to nearest, ties to even, as torch's
 * round_to_nearest_even (a NaN becomes the quiet NaN 0x7fc0; its payload is not promised). */
static inline uint16_t bf16_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return v != v ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

static inline float bf16_value(uint16_t c) {
    uint32_t u = (uint32_t)c << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

#define CAST_CODEC(NAME, CODE, TO, FROM)                                                         \
    static void NAME##_encode(const float *restrict x, float *restrict r, int64_t n,              \
                             int64_t block, uint8_t *restrict packet, int64_t b0, int64_t b1) {  \
        CODE *restrict codes = (CODE *)packet;                                                   \
        int64_t i0 = b0 * block, i1 = b1 * block < n ? b1 * block : n;                           \
        if (r) {                                                                                 \
            for (int64_t i = i0; i < i1; i++) {                                                  \
                float v = x[i] + r[i];                                                           \
                CODE c = TO(v);                                                                  \
                codes[i] = c;                                                                    \
                r[i] = v - FROM(c);                                                              \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t i = i0; i < i1; i++) codes[i] = TO(x[i]);                               \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    static void NAME##_decode(const uint8_t *restrict packet, int64_t n, int64_t block,           \
                             float *restrict out, int64_t b0, int64_t b1) {                      \
        const CODE *restrict codes = (const CODE *)packet;                                       \
        int64_t i0 = b0 * block, i1 = b1 * block < n ? b1 * block : n;                           \
        for (int64_t i = i0; i < i1; i++) out[i] = FROM(codes[i]);                               \
    }                                                                                            \
                                                                                                 \
    static void NAME##_reduce(const uint8_t *const *packets, int64_t m, int64_t n, int64_t block, \
                             uint8_t *restrict out, float *restrict scratch, int64_t b0,         \
                             int64_t b1) {                                                       \
        float count = (float)m;                                                                  \
        CODE *restrict mean = (CODE *)out;                                                       \
        for (int64_t b = b0; b < b1; b++) {                                                      \
            int64_t start = b * block, len = block_len(b, n, block);                             \
            for (int64_t w = 0; w < m; w++) {                                                    \
                const CODE *restrict codes = (const CODE *)packets[w] + start;                   \
                if (w == 0) {                                                                    \
                    for (int64_t i = 0; i < len; i++) scratch[i] = FROM(codes[i]);               \
                } else {                                                                         \
                    for (int64_t i = 0; i < len; i++) scratch[i] = scratch[i] + FROM(codes[i]);  \
                }                                                                                \
            }                                                                                    \
            for (int64_t i = 0; i < len; i++) mean[start + i] = TO(scratch[i] / count);          \
        }                                                                                        \
    }

CAST_CODEC(bf16, uint16_t, bf16_of, bf16_value)

/* fp16 by float arithmetic on bits, branch-free so that it vectorizes, and exactly IEEE's cast
 * (to nearest, ties to even; overflow to infinity; subnormal halves), as torch's own. */

static inline uint16_t fp16_of(float v) {
    uint32_t u = bits_of_float(v), twice = u + u, sign = u & 0x80000000u;
    /* |v| scaled up then down by powers of two: a value beyond the half range overflows to
     * infinity on the way up, and the rest comes back unchanged. */
    float magnitude = (fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;
    /* Adding 2^(e + 13) (e: v's exponent, at least the smallest normal half's) leaves exactly
     * the half's mantissa bits in the sum's low bits, rounded by the float addition itself. */
    uint32_t exponent = twice & 0xff000000u;
    exponent = exponent < 0x71000000u ? 0x71000000u : exponent;
    uint32_t sum = bits_of_float(float_of_bits((exponent >> 1) + 0x07800000u) + magnitude);
    uint32_t half = ((sum >> 13) & 0x7c00u) + (sum & 0x0fffu);
    return (uint16_t)((sign >> 16) | (twice > 0xff000000u ? 0x7e00u : half));
}

static inline float fp16_value(uint16_t c) {
    uint32_t w = (uint32_t)c << 16, sign = w & 0x80000000u, twice = w + w;
    /* A normal half: its exponent rebiased by a shift and a product by 2^-112. */
    float normal = float_of_bits((twice >> 4) + 0x70000000u) * 0x1.0p-112f;
    /* A subnormal half: its mantissa as the low bits of 0.5's, less 0.5. */
    float subnormal = float_of_bits((twice >> 17) | 0x3f000000u) - 0.5f;
    return float_of_bits(sign |
                         (twice < 0x08000000u ? bits_of_float(subnormal) : bits_of_float(normal)));
}

CAST_CODEC(fp16, uint16_t, fp16_of, fp16_value)

/* The exported phases: every block of every row, split between `threads` OpenMP threads (one
 * block is one iteration: blocks are independent, so the split changes no bit). Rows are
 * contiguous: row k of the values at x + k * size, of the packets at out + k * stride. */
#define ROWS_DRIVERS(NAME)                                                                       \
    void hvd_##NAME##_encode_rows(const float *x, float *r, int64_t count, int64_t size,         \
                                  int64_t unit, uint8_t *out, int64_t stride, int threads) {     \
        int64_t units = num_blocks(size, unit), total = count * units;                           \
        (void)threads; /* unused without OpenMP */                                               \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                        \
        for (int64_t k = 0; k < total; k++) {                                                    \
            int64_t row = k / units, u = k % units;                                              \
            NAME##_encode(x + row * size, r ? r + row * size : NULL, size, unit,                 \
                          out + row * stride, u, u + 1);                                         \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    void hvd_##NAME##_decode_rows(const uint8_t *packets, int64_t stride, int64_t count,         \
                                  int64_t size, int64_t unit, float *out, int threads) {         \
        int64_t units = num_blocks(size, unit), total = count * units;                           \
        (void)threads;                                                                           \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                        \
        for (int64_t k = 0; k < total; k++) {                                                    \
            int64_t row = k / units, u = k % units;                                              \
            NAME##_decode(packets + row * stride, size, unit, out + row * size, u, u + 1);       \
        }                                                                                        \
    }                                                                                            \
                                                                                                 \
    /* scratch: unit floats per thread. */                                                       \
    void hvd_##NAME##_reduce(const uint8_t *const *packets, int64_t m, int64_t size,             \
                             int64_t unit, uint8_t *out, float *scratch, int threads) {          \
        int64_t units = num_blocks(size, unit);                                                  \
        (void)threads;                                                                           \
        _Pragma("omp parallel num_threads(threads)") {                                           \
            float *mine = scratch + unit * omp_thread();                                         \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t u = 0; u < units; u++)                                                  \
                NAME##_reduce(packets, m, size, unit, out, mine, u, u + 1);                      \
        }                                                                                        \
    }

ROWS_DRIVERS(int8)
ROWS_DRIVERS(fp16)
ROWS_DRIVERS(bf16)
ROWS_DRIVERS(fp8)

/* The sparse codec's choice: in each chunk of `chunk` elements (the last one zero-padded), the k
 * entries of the largest keys, key = |x|'s bits (sign cleared: ordered as the magnitudes, NaN
 * above infinity) * 2^16 + (chunk - 1 - position). No two keys tie, so the k largest, in
 * decreasing order, are one list: torch's topk(sorted=True) of the same keys
 * (hvd_slowmo/compression/sparse.py). scratch: 2 * chunk keys per thread.
 *
 * Per chunk: a threshold from a sample of the keys (every 16th: the magnitude of the key of
 * rank about 2k/16 among them; with AVX-512 one of rank about 1.5k/16 first, the looser one
 * only where fewer than k pass it), then the positions whose magnitude is at or above it,
 * gathered without a branch; when at least k pass, the k largest keys of the chunk are theirs
 * (the k-th largest key's magnitude is at or above the threshold), else every key is a
 * candidate. Up to
 * RANK_MAX candidates are ordered by their counted ranks (rank_largest); more go through a
 * min-heap of k keys, which they leave in decreasing order. The sample's threshold is counted
 * too with AVX-512 (sample_threshold), else a heap finds it. Any threshold gives the same
 * entries (at least k at or above it hold the k largest); a good one only keeps the candidates
 * few. */
static void sift_down(uint64_t *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t least = i, left = 2 * i + 1, right = left + 1;
        if (left < size && heap[left] < heap[least]) least = left;
        if (right < size && heap[right] < heap[least]) least = right;
        if (least == i) return;
        uint64_t t = heap[i];
        heap[i] = heap[least];
        heap[least] = t;
        i = least;
    }
}

static void sift_up(uint64_t *heap, int64_t i) {
    while (i > 0 && heap[(i - 1) / 2] > heap[i]) {
        uint64_t t = heap[i];
        heap[i] = heap[(i - 1) / 2];
        heap[(i - 1) / 2] = t;
        i = (i - 1) / 2;
    }
}

/* heap[0, k) becomes the k largest of keys[0, n) (n >= k), the least at heap[0]. */
static void heap_largest(const uint64_t *keys, int64_t n, int64_t k, uint64_t *heap) {
    for (int64_t i = 0; i < k; i++) {
        heap[i] = keys[i];
        sift_up(heap, i);
    }
    for (int64_t i = k; i < n; i++) {
        if (keys[i] > heap[0]) {
            heap[0] = keys[i];
            sift_down(heap, k, 0);
        }
    }
}

/* out[0, k) becomes the k largest of keys[0, n) (n >= k, no two equal), in decreasing order:
 * each key's rank is the count of keys above it. Branch-free compares, which vectorize: for
 * the few candidates past a threshold, faster than a heap, whose every comparison is a branch
 * that a random order mispredicts half the time. */
static void rank_largest(const uint64_t *keys, int64_t n, int64_t k, uint64_t *out) {
    enum { SWEEP = 8 }; /* keys a sweep: each load serves SWEEP compares */
    int64_t i = 0;
    for (; i + SWEEP <= n; i += SWEEP) {
        int64_t above[SWEEP] = {0};
        for (int64_t j = 0; j < n; j++)
            for (int s = 0; s < SWEEP; s++) above[s] += keys[j] > keys[i + s];
        for (int s = 0; s < SWEEP; s++)
            if (above[s] < k) out[above[s]] = keys[i + s];
    }
    for (; i < n; i++) {
        int64_t above = 0;
        for (int64_t j = 0; j < n; j++) above += keys[j] > keys[i];
        if (above < k) out[above] = keys[i];
    }
}

/* Candidates up to which ranks are counted (n^2 compares), beyond them the heap. */
#define RANK_MAX 512

#ifdef __AVX512F__
/* rank_largest by the magnitudes alone (a key's upper bits), sixteen 32-bit lanes a compare:
 * each key's slot is the count of magnitudes at or above its own, less one. Every slot is at
 * least the key's rank, and they sum to the ranks' sum (n (n - 1) / 2) only where no two
 * magnitudes are equal: then out is rank_largest's; else (returns 0) nothing is written.
 * The magnitudes are padded with zeros to whole vectors (a zero magnitude's count less them).
 * n <= RANK_MAX. */
static int rank_largest_magnitudes(const uint64_t *keys, int64_t n, int64_t k, uint64_t *out) {
    enum { SWEEP = 8 };
    uint32_t magnitudes[RANK_MAX + 16] __attribute__((aligned(64)));
    int32_t slots[RANK_MAX];
    int64_t padded = (n + 15) & ~(int64_t)15, total = 0;
    for (int64_t i = 0; i < padded; i++) magnitudes[i] = i < n ? (uint32_t)(keys[i] >> 16) : 0u;
    const __m512i one = _mm512_set1_epi32(1);
    for (int64_t i = 0; i < n; i += SWEEP) {
        __m512i mine[SWEEP], at_or_above[SWEEP];
        for (int s = 0; s < SWEEP; s++) {
            mine[s] = _mm512_set1_epi32((int)magnitudes[i + s < n ? i + s : i]);
            at_or_above[s] = _mm512_setzero_si512();
        }
        for (int64_t j = 0; j < padded; j += 16) {
            __m512i v = _mm512_load_si512(magnitudes + j);
            for (int s = 0; s < SWEEP; s++)
                at_or_above[s] = _mm512_mask_add_epi32(
                    at_or_above[s], _mm512_cmpge_epu32_mask(v, mine[s]), at_or_above[s], one);
        }
        for (int s = 0; s < SWEEP && i + s < n; s++) {
            int32_t count = _mm512_reduce_add_epi32(at_or_above[s]);
            slots[i + s] = count - 1 - (magnitudes[i + s] == 0u ? (int32_t)(padded - n) : 0);
        }
    }
    for (int64_t i = 0; i < n; i++) total += slots[i];
    if (total != n * (n - 1) / 2) return 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < k) out[slots[i]] = keys[i];
    return 1;
}
#else
static int rank_largest_magnitudes(const uint64_t *keys, int64_t n, int64_t k, uint64_t *out) {
    (void)keys, (void)n, (void)k, (void)out;
    return 0; /* rank_largest's 64-bit compares instead */
}
#endif

/* The positions i < len whose |row[i]|'s bits are at or above least, in increasing order, into
 * passing (room for len); returns their count. With AVX-512, sixteen at a time: a mask of those
 * that pass compresses the positions in a register, which is stored whole (its lanes past the
 * count, still below i + 16 <= len, are overwritten by the next store). */
static int64_t pass_threshold(const float *row, int64_t len, uint32_t least, uint32_t *passing) {
    int64_t passed = 0, i = 0;
#ifdef __AVX512F__
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), bar = _mm512_set1_epi32((int)least);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= len; i += 16) {
        __m512i bits = _mm512_and_si512(_mm512_loadu_si512(row + i), magnitude);
        __mmask16 pass = _mm512_cmpge_epu32_mask(bits, bar);
        _mm512_storeu_si512(passing + passed, _mm512_maskz_compress_epi32(pass, index));
        passed += __builtin_popcount((unsigned)pass);
        index = _mm512_add_epi32(index, sixteen);
    }
#endif
    for (; i < len; i++) { /* without a branch: every position written, the count moves on */
        passing[passed] = (uint32_t)i;
        passed += abs_bits(row[i]) >= least;
    }
    return passed;
}

#define SAMPLE_STRIDE 16

#ifdef __AVX512F__
/* The want-th and the tight-th largest (tight <= want) of the sampled magnitudes
 * |row[s * SAMPLE_STRIDE]| (0 past len), s < samples, into least and first; returns 0 (nothing
 * written) where want > 16. Without a heap, whose sift branches mispredict: the least of
 * sixteen lanes' largest samples is at or below the sixteenth largest, so the samples at or
 * above it (compressed into m, room for samples + 16 words) hold both; each is the largest of
 * them with at least want (tight) at or above it, counted sixteen at a time. */
static int sample_threshold(const float *row, int64_t len, int64_t samples, int64_t tight,
                            int64_t want, uint32_t *m, uint32_t *first, uint32_t *least) {
    if (want > 16) return 0;
    int64_t padded = (samples + 15) & ~(int64_t)15, kept = 0;
    for (int64_t s = 0; s < padded; s++) {
        int64_t i = s * SAMPLE_STRIDE;
        m[s] = s < samples && i < len ? abs_bits(row[i]) : 0u;
    }
    __m512i top = _mm512_setzero_si512();
    for (int64_t s = 0; s < padded; s += 16) top = _mm512_max_epu32(top, _mm512_loadu_si512(m + s));
    const __m512i bar = _mm512_set1_epi32((int)_mm512_reduce_min_epu32(top));
    for (int64_t s = 0; s < padded; s += 16) { /* in place: kept <= s */
        __m512i v = _mm512_loadu_si512(m + s);
        __mmask16 pass = _mm512_cmpge_epu32_mask(v, bar);
        _mm512_mask_compressstoreu_epi32(m + kept, pass, v);
        kept += __builtin_popcount((unsigned)pass);
    }
    for (int64_t s = kept; s < ((kept + 15) & ~(int64_t)15); s++) m[s] = 0u; /* never counted */
    __m512i best = _mm512_setzero_si512(), best_tight = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1), enough = _mm512_set1_epi32((int)want - 1);
    const __m512i enough_tight = _mm512_set1_epi32((int)tight - 1);
    for (int64_t i = 0; i < kept; i += 16) {
        __m512i mine = _mm512_loadu_si512(m + i), at_or_above = _mm512_setzero_si512();
        for (int64_t j = 0; j < kept; j++)
            at_or_above = _mm512_mask_add_epi32(
                at_or_above, _mm512_cmpge_epu32_mask(_mm512_set1_epi32((int)m[j]), mine),
                at_or_above, one);
        __mmask16 valid = (__mmask16)(kept - i >= 16 ? 0xffffu : (1u << (kept - i)) - 1u);
        __mmask16 ranked = _mm512_mask_cmpgt_epi32_mask(valid, at_or_above, enough);
        best = _mm512_mask_max_epu32(best, ranked, best, mine);
        ranked = _mm512_mask_cmpgt_epi32_mask(valid, at_or_above, enough_tight);
        best_tight = _mm512_mask_max_epu32(best_tight, ranked, best_tight, mine);
    }
    *least = _mm512_reduce_max_epu32(best);
    *first = _mm512_reduce_max_epu32(best_tight);
    return 1;
}
#else
static int sample_threshold(const float *row, int64_t len, int64_t samples, int64_t tight,
                            int64_t want, uint32_t *m, uint32_t *first, uint32_t *least) {
    (void)row, (void)len, (void)samples, (void)tight, (void)want, (void)m, (void)first;
    (void)least;
    return 0; /* the heap of keys instead */
}
#endif

static inline uint64_t key_at(const float *row, int64_t len, int64_t chunk, int64_t i) {
    uint64_t bits = i < len ? abs_bits(row[i]) : 0u;
    return bits << 16 | (uint64_t)(chunk - 1 - i);
}

/* The position a key names and the value there (zero in the padding). */
static inline void entry_of(const float *row, int64_t len, int64_t chunk, uint64_t key,
                            int64_t *index, float *kept) {
    int64_t position = chunk - 1 - (int64_t)(key & 0xffffu);
    *index = position;
    *kept = position < len ? row[position] : 0.0f;
}

/* pass_threshold over the chunk's padding too: past len every magnitude is 0, which passes
 * only a threshold of 0. */
static int64_t pass_padded(const float *row, int64_t len, int64_t chunk, uint32_t least,
                           uint32_t *passing) {
    int64_t passed = pass_threshold(row, len, least, passing);
    for (int64_t i = len; i < chunk && least == 0u; i++) passing[passed++] = (uint32_t)i;
    return passed;
}

/* Chunk `row` (len of its chunk elements are the vector's, the rest zeros): its k positions by
 * decreasing key (index) and their values (kept). keys: 2 * chunk words of scratch. */
static void top_k_chunk(const float *row, int64_t len, int64_t chunk, int64_t k, uint64_t *keys,
                        int64_t *index, float *kept) {
    uint64_t *candidates = keys + chunk, *heap = NULL;
    int64_t samples = chunk / SAMPLE_STRIDE, want = 2 * k / SAMPLE_STRIDE + 1, count = 0;
    int64_t tight = 3 * k / (2 * SAMPLE_STRIDE) + 1;
    if (samples >= 2 * want && want >= 1) {
        /* The want-th largest sample's magnitude (about 2k pass it), and a tighter threshold
         * tried first (about 1.5k pass; the ranks cost the square of the candidates). */
        uint32_t least, first;
        if (!sample_threshold(row, len, samples, tight, want, (uint32_t *)candidates, &first,
                              &least)) {
            for (int64_t s = 0; s < samples; s++)
                candidates[s] = key_at(row, len, chunk, s * SAMPLE_STRIDE);
            heap_largest(candidates, samples, want, candidates + samples);
            least = first = (uint32_t)(candidates[samples] >> 16);
        }
        uint32_t *passing = (uint32_t *)keys; /* positions: the first half of keys */
        int64_t passed = pass_padded(row, len, chunk, first, passing);
        if (passed < k && least != first) passed = pass_padded(row, len, chunk, least, passing);
        if (passed >= k) {
            for (int64_t c = 0; c < passed; c++)
                candidates[c] = key_at(row, len, chunk, passing[c]);
            heap = keys; /* the positions are read */
            count = passed;
        }
    }
    if (heap == NULL) { /* every key a candidate */
        for (int64_t i = 0; i < chunk; i++) keys[i] = key_at(row, len, chunk, i);
        heap = candidates;
        candidates = keys;
        count = chunk;
    }
    if (count <= RANK_MAX) {
        if (!rank_largest_magnitudes(candidates, count, k, heap)) /* two magnitudes equal */
            rank_largest(candidates, count, k, heap);             /* a list, decreasing, here */
        for (int64_t s = 0; s < k; s++) entry_of(row, len, chunk, heap[s], index + s, kept + s);
        return;
    }
    heap_largest(candidates, count, k, heap);
    for (int64_t s = k; s > 0; s--) { /* the least key last: decreasing order */
        uint64_t key = heap[0];
        heap[0] = heap[s - 1];
        sift_down(heap, s - 1, 0);
        entry_of(row, len, chunk, key, index + s - 1, kept + s - 1);
    }
}

/* Bits [e * width, (e + 1) * width) of a little-endian bit stream (bit t is bit t % 8 of byte
 * t / 8: sparse.py's pack_bits), width <= 8. */
static inline uint32_t stream_bits(const uint8_t *stream, int64_t e, int width) {
    int64_t t = e * width;
    const uint8_t *at = stream + (t >> 3);
    uint32_t v = at[0];
    if ((t & 7) + width > 8) v |= (uint32_t)at[1] << 8; /* the value runs into the next byte */
    return (v >> (t & 7)) & ((1u << width) - 1u);
}

/* -v where negative is 1, v where 0: the sign bit flipped without a branch (a sign is as likely
 * one way as the other, so a branch on it mispredicts half the time). */
static inline float with_sign(float v, uint32_t negative) {
    return float_of_bits(bits_of_float(v) ^ negative << 31);
}

/* A sparse packet's layout (sparse.py: every chunk's lo, then every chunk's step, float32; the
 * positions, their low bytes first where they take more than 8 bits; the codes). */
typedef struct {
    int64_t chunks, k, chunk;
    int bits, index_bits;
    int64_t index_at, codes_at, end; /* byte offsets in the packet; end: its codes' end */
} SparseLayout;

static SparseLayout sparse_layout(int64_t n, int64_t chunk, int64_t k, int bits, int index_bits) {
    SparseLayout s = {num_blocks(n, chunk), k, chunk, bits, index_bits, 0, 0, 0};
    int64_t entries = s.chunks * k;
    s.index_at = 8 * s.chunks;
    int64_t index_bytes = index_bits <= 8 ? (entries * index_bits + 7) / 8
                                          : entries + (entries * (index_bits - 8) + 7) / 8;
    s.codes_at = s.index_at + index_bytes;
    s.end = s.codes_at + (entries * bits + 7) / 8;
    return s;
}

/* Entry e's position in its chunk. */
static inline int64_t sparse_position(const uint8_t *packet, const SparseLayout *s, int64_t e) {
    const uint8_t *index = packet + s->index_at;
    if (s->index_bits <= 8) return stream_bits(index, e, s->index_bits);
    int64_t entries = s->chunks * s->k;
    return (int64_t)index[e] | (int64_t)stream_bits(index + entries, e, s->index_bits - 8) << 8;
}

/* dst[0, len) = acc[i] / divisor (1: acc itself). With AVX-512 and dst on 64 bytes, sixteen at a
 * time by non-temporal stores: dst's lines go to memory without being read first (the whole sum
 * is written once, where a store through the cache reads each line before it writes it). The
 * same IEEE division either way. */
static void store_divided(const float *acc, int64_t len, float divisor, float *dst) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (((uintptr_t)dst & 63u) == 0 && ((uintptr_t)acc & 63u) == 0) {
        const __m512 d = _mm512_set1_ps(divisor);
        for (; i + 16 <= len; i += 16) {
            __m512 v = _mm512_load_ps(acc + i);
            _mm512_stream_ps(dst + i, divisor != 1.0f ? _mm512_div_ps(v, d) : v);
        }
    }
#endif
    for (; i < len; i++) dst[i] = divisor != 1.0f ? acc[i] / divisor : acc[i];
}

#ifdef __AVX512F__
/* Bits [e * width, (e + 1) * width) of the stream for the sixteen entries e0 + lane (width <= 8):
 * stream_bits of each, from four bytes gathered at its first byte. The caller makes sure those
 * bytes lie inside the packet. */
static inline __m512i stream_bits16(const uint8_t *stream, int64_t e0, int width) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t t0 = e0 * width;
    __m512i t = _mm512_add_epi32(_mm512_set1_epi32((int)(t0 & 7)),
                                 _mm512_mullo_epi32(lane, _mm512_set1_epi32(width)));
    __m512i v = _mm512_i32gather_epi32(_mm512_srli_epi32(t, 3), stream + (t0 >> 3), 1);
    v = _mm512_srlv_epi32(v, _mm512_and_si512(t, _mm512_set1_epi32(7)));
    return _mm512_and_si512(v, _mm512_set1_epi32((1 << width) - 1));
}

/* Entries [e0, e0 + 16) of a packet decoded as in sparse_sum_chunk's loop: positions into pos,
 * signed values into value (the same product, sum and sign flip, sixteen at a time). */
static inline void decode16(const uint8_t *packet, const SparseLayout *s, int64_t e0, float lo,
                            float step, int32_t *pos, float *value) {
    __m512i position;
    if (s->index_bits <= 8) {
        position = stream_bits16(packet + s->index_at, e0, s->index_bits);
    } else { /* the low bytes, then the high bits' stream */
        const uint8_t *index = packet + s->index_at;
        __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(index + e0)));
        __m512i high = stream_bits16(index + s->chunks * s->k, e0, s->index_bits - 8);
        position = _mm512_or_si512(low, _mm512_slli_epi32(high, 8));
    }
    __m512i code = stream_bits16(packet + s->codes_at, e0, s->bits);
    __m512i level = _mm512_and_si512(code, _mm512_set1_epi32((1 << (s->bits - 1)) - 1));
    __m512 size = _mm512_add_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(level), _mm512_set1_ps(step)), _mm512_set1_ps(lo));
    __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(code, s->bits - 1), 31);
    _mm512_storeu_si512(pos, position);
    _mm512_storeu_si512(value, _mm512_xor_si512(_mm512_castps_si512(size), sign));
}
#endif

/* Adds chunk j of every packet (m, in order) into acc (chunk floats, zeroed here), then stores
 * it divided into out[j * chunk, (j + 1) * chunk): decoded as sparse.py's _decode_rows (|v| =
 * lo + q * step, one rounding each, then the sign) and added as index_add_ does, one float32
 * add per entry, the packets in rank order. */
static void sparse_sum_chunk(const uint8_t *packets, int64_t stride, int64_t m,
                             const SparseLayout *s, int64_t j, float divisor, float *acc,
                             float *out) {
    memset(acc, 0, (size_t)s->chunk * sizeof(float));
    uint32_t magnitude = (1u << (s->bits - 1)) - 1u;
    for (int64_t r = 0; r < m; r++) {
        const uint8_t *packet = packets + r * stride;
        float lo, step;
        memcpy(&lo, packet + 4 * j, 4);
        memcpy(&step, packet + 4 * (s->chunks + j), 4);
        int64_t e = j * s->k;
#ifdef __AVX512F__
        /* Sixteen entries decoded at a time (the scalar decode's branchy bit reads cost most of
         * the sum), then added one by one in their order, as the loop below adds them. The
         * gathers read four bytes from each value's first: only where the group's last code
         * starts at least four bytes before the packet's codes end. */
        int32_t pos[16];
        float value[16];
        for (; e + 16 <= (j + 1) * s->k &&
               s->codes_at + (((e + 15) * s->bits) >> 3) + 4 <= s->end;
             e += 16) {
            decode16(packet, s, e, lo, step, pos, value);
            for (int i = 0; i < 16; i++) acc[pos[i]] += value[i];
        }
#endif
        for (; e < (j + 1) * s->k; e++) {
            uint32_t code = stream_bits(packet + s->codes_at, e, s->bits);
            float size = (float)(code & magnitude) * step + lo;
            acc[sparse_position(packet, s, e)] += with_sign(size, code >> (s->bits - 1));
        }
    }
    store_divided(acc, s->chunk, divisor, out + j * s->chunk);
}

/* The sum of m sparse packets (rows `stride` bytes apart) of vectors of n elements into out
 * (whole chunks: num_blocks(n, chunk) * chunk floats), every element's adds in rank order from
 * +0.0, then divided by divisor (an IEEE division; 1: none): the bits of sparse.py's
 * sparse_sum. Each thread adds a chunk in a buffer of its own, which stays in its cache; one
 * it cannot have (no memory) adds in out itself. */
void hvd_sparse_sum(const uint8_t *packets, int64_t stride, int64_t m, int64_t n, int64_t chunk,
                    int64_t k, int bits, int index_bits, float divisor, float *out,
                    int threads) {
    SparseLayout s = sparse_layout(n, chunk, k, bits, index_bits);
    (void)threads;
    _Pragma("omp parallel num_threads(threads)") {
        size_t bytes = ((size_t)chunk * sizeof(float) + 63u) & ~(size_t)63u;
        float *acc = aligned_alloc(64, bytes);
        _Pragma("omp for schedule(static)") for (int64_t j = 0; j < s.chunks; j++)
            sparse_sum_chunk(packets, stride, m, &s, j, divisor,
                             acc ? acc : out + j * chunk, out);
        free(acc);
#ifdef __AVX512F__
        _mm_sfence(); /* the non-temporal stores seen before the threads join */
#endif
    }
}

/* Chunk j's kept entries quantized as sparse.py's _encode: lo = the least kept magnitude,
 * step = (the largest - lo) / levels, each magnitude's level round((|v| - lo) / step) (step 0 or
 * NaN: divided by 1; a NaN level 0, clamped to [0, levels]), its code the level with the sign
 * (v < 0) above it; decoded = lo + level * step, one rounding each, then the sign. */
static void sparse_quantize(const float *kept, int64_t k, int bits, float *lo_out,
                            float *step_out, uint8_t *codes, float *decoded) {
    float levels = (float)((1 << (bits - 1)) - 1);
    float lo = fabsf(kept[k - 1]), step = (fabsf(kept[0]) - lo) / levels;
    float divisor = step > 0.0f ? step : 1.0f;
    for (int64_t i = 0; i < k; i++) {
        float level = nearbyintf((fabsf(kept[i]) - lo) / divisor);
        level = level == level ? level : 0.0f;
        level = level < 0.0f ? 0.0f : (level > levels ? levels : level);
        int negative = kept[i] < 0.0f;
        codes[i] = (uint8_t)((uint32_t)level | (uint32_t)negative << (bits - 1));
        decoded[i] = with_sign(level * step + lo, (uint32_t)negative);
    }
    *lo_out = lo;
    *step_out = step;
}

/* Eight values, `width` bits each (taken from v16 >> shift, or v8), packed into `width` bytes of
 * the stream at group g: groups write disjoint bytes, so threads pack them in any order. The
 * bits past the last value are zeros, as pack_bits pads; bytes past out_bytes are not written. */
static void pack_group(const uint16_t *v16, const uint8_t *v8, int shift, int width,
                       int64_t entries, int64_t g, uint8_t *out, int64_t out_bytes) {
    uint64_t acc = 0, mask = (1u << width) - 1u;
    for (int64_t i = 0; i < 8 && 8 * g + i < entries; i++) {
        uint64_t v = v16 ? (uint64_t)(v16[8 * g + i] >> shift) : v8[8 * g + i];
        acc |= (v & mask) << (i * width);
    }
    for (int64_t b = 0; b < width && g * width + b < out_bytes; b++)
        out[g * width + b] = (uint8_t)(acc >> (8 * b));
}

/* The sparse codec's packet of x (n > 0 elements; sparse.py's sparse_encode) into packet
 * (packet_nbytes bytes): per chunk the top-k (top_k_chunk), lo and step, then the positions and
 * codes packed into their bit streams. With residual (which may be x itself), the decoded kept
 * entries inside the vector are subtracted from it (sparse_encode_feedback). With add (then x
 * is residual), each chunk of the residual is first set to decay * residual + add (sparse.py's
 * with_feedback; decay 1: no product). scratch: per thread 2 * chunk + 2 * k 8-byte words;
 * positions (uint16) and codes (uint8): chunks * k each. */
void hvd_sparse_encode(const float *x, float *residual, const float *add, float decay, int64_t n,
                       int64_t chunk, int64_t k, int bits, int index_bits, uint8_t *packet,
                       uint16_t *positions, uint8_t *codes, uint64_t *scratch,
                       int64_t packet_bytes, int threads) {
    SparseLayout s = sparse_layout(n, chunk, k, bits, index_bits);
    int64_t entries = s.chunks * k;
    (void)threads;
    _Pragma("omp parallel num_threads(threads)") {
        uint64_t *keys = scratch + (2 * chunk + 2 * k) * omp_thread();
        int64_t *index = (int64_t *)(keys + 2 * chunk);
        float *kept = (float *)(index + k), *decoded = kept + k;
        _Pragma("omp for schedule(static)") for (int64_t j = 0; j < s.chunks; j++) {
            int64_t len = n - j * chunk < chunk ? n - j * chunk : chunk;
            float lo, step;
            if (add) { /* the error feedback's sum, a chunk at a time: read from the cache */
                float *r = residual + j * chunk;
                const float *a = add + j * chunk;
                if (decay != 1.0f)
                    for (int64_t i = 0; i < len; i++) r[i] = r[i] * decay + a[i];
                else
                    for (int64_t i = 0; i < len; i++) r[i] = r[i] + a[i];
            }
            top_k_chunk(x + j * chunk, len, chunk, k, keys, index, kept);
            sparse_quantize(kept, k, bits, &lo, &step, codes + j * k, decoded);
            memcpy(packet + 4 * j, &lo, 4);
            memcpy(packet + 4 * (s.chunks + j), &step, 4);
            for (int64_t i = 0; i < k; i++) {
                positions[j * k + i] = (uint16_t)index[i];
                if (residual && index[i] < len) residual[j * chunk + index[i]] -= decoded[i];
            }
        }
        /* The streams, eight entries (whole bytes) at a time. */
        uint8_t *at = packet + s.index_at;
        int64_t groups = (entries + 7) / 8, low = index_bits > 8 ? 8 : index_bits;
        if (index_bits > 8) { /* the low bytes, then the high bits' stream */
            _Pragma("omp for schedule(static)") for (int64_t e = 0; e < entries; e++)
                at[e] = (uint8_t)positions[e];
            at += entries;
            low = index_bits - 8;
        }
        int shift = index_bits > 8 ? 8 : 0;
        _Pragma("omp for schedule(static)") for (int64_t g = 0; g < groups; g++) {
            pack_group(positions, NULL, shift, (int)low, entries, g, at, (entries * low + 7) / 8);
            pack_group(NULL, codes, 0, bits, entries, g, packet + s.codes_at,
                       (entries * bits + 7) / 8);
        }
    }
    int64_t end = s.codes_at + (entries * bits + 7) / 8;
    memset(packet + end, 0, (size_t)(packet_bytes - end)); /* the padding to 4 bytes */
}
