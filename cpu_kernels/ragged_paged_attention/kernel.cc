// Ragged paged attention for the CPU backend, as an XLA FFI custom call.
//
// Computes exactly what pallas_kernels/ragged_paged_attention/reference.py::attend computes (read its docstring for
// the semantics); this file owns only the CPU algorithm:
//
//   * Tokens are grouped into *blocks* of one sequence: on the decode path a run of at most kPerTokenRun tokens of a
//     sequence in the step (a decode token, a speculative verify window of K + 1) becomes blocks of one token (tasks
//     spread over the threads); other runs become blocks of up to kBlockTokens tokens. A task is one block, all kv
//     heads.
//   * The decode path (AVX-512 builds, f32 / bf16 / int8 KV, H = 64 or 128: every block of the models served here)
//     walks the block's pages once, in order, each page's contiguous [page_size, K, H] block in groups of up to 16
//     keys aligned to the page. Per group and kv head, each token of the block that sees one of the keys updates
//     its G query rows: their scores (queries held in zmm registers, key rows widened from bf16 / int8 in registers,
//     a 16-way transposing add tree), one online-softmax update per row, and the weighted sum of the group's value
//     rows while they are in L1. As each row of this page is used, the same row of the sequence's next page is
//     prefetched (one prefetch per cache line).
//     Batch invariance: a token's rows go through the same operations -- the same groups, the same tiles of its G
//     rows, keys outside its causal / window range masked to weight exactly 0 -- whatever else its block holds. So
//     its bits do not depend on how the step grouped it: alone or in a busy batch, prefilled in one chunk or two,
//     decoded or verified among drafts. Under a quantized weight scheme a last-bit difference would move an
//     activation's int8 rounding and could flip a greedy near-tie, so this is what makes speculative decoding
//     reproduce plain decoding exactly and a request answer the same under load as alone.
//     Measured on the 2-core EPYC VM (SmolLM2-135M shapes, one layer, medians, noisy shared machine), one-token
//     chunked path -> this one: 512 keys after 3 MB of other traffic per call 158 -> 95 us f32, 119 -> 52 us bf16,
//     86 -> 40 us int8; 512 keys with the pages in L3/L2 61 -> 41, 60 -> 35, 49 -> 26 us; 132 keys cold 38 -> 35,
//     55 -> 20, 28 -> 14 us. With the pages in L2 a 512-key call still costs ~25 us of compute, spread over the
//     scores, add trees, exp and value sums. Prefill blocks (2026-12-05, Intel Xeon VM, `bench.py`, a 512-token
//     chunk at context 1024, 30 layers, min of 7): chunked path -> this one 281 -> 238 / 247 ms f32, 312 -> 281 / 294
//     ms int8. Tried and not kept: prefetching the whole next page in one burst when a page starts (no gain; ~400
//     prefetches at once), prefetching two pages ahead (same as one), prefetching into L2 only (slower for int8).
//     The tile's loops (2026-12-06, AMD EPYC Zen 3 VM, AVX2): per query row with its query in registers, four keys
//     at a time, and the weighted sum in column blocks whose accumulators stay in registers (before: every query row
//     reloaded per key and the 3 x 8 accumulators stored back per key; bf16 / int8 rows now widened once per tile
//     into L1 scratch). Same bits. 30 layers of distinct KV pools, two builds alternating in one process, medians:
//     16 sequences at context 128-256 0.86-1.00x f32 (0.85x with the pools in cache), 0.86-0.97x bf16, 0.89-0.96x
//     int8; a 4-token verify window 0.85-0.97x; one sequence within the noise.
//     Tried and not kept (same VM): keys in segments of 8 pages, each its own online softmax merged in order (the
//     same arithmetic split or not), and a lone decode token split into a task per run of segments, all kv heads:
//     0.53-0.70x per call for one sequence at context 192 in a harness of 30 chained calls, but in the engine's
//     traced batch-1 step its attention read 1.50-1.57 ms against 1.41-1.45 before (two alternations), and at
//     context 1000 with a bf16 / int8 cache 1.05-1.09x slower. Splitting the kv heads of 2 decode tokens into 6
//     tasks measured 1.15-1.20x slower than 2 tasks of all heads (each task then reads a third of every page's lines).
//   * The chunked path (other builds, f16 / fp8 KV, other head dims) walks only the keys its block can see
//     (positions lo..hi: lo = 0, or the oldest key any of its tokens sees through the sliding window; hi = the
//     block's last position; never the batch's longest context), kChunkKeys positions at a time, kv head by kv
//     head, so together the heads read each page's contiguous [page_size, K, H] block. Each key and value row is
//     read (and dequantized, scale folded in) once per chunk and used by all the block's rows for that kv head: B
//     tokens x G query heads. An int8 cache with few rows is not copied at all: its rows are widened in registers
//     where they are used, the key scales multiply the scores and the value scales fold into the softmax weights.
//     Its arithmetic depends on the block (few rows: dot products per key; many: transposed keys), so there a
//     token's bits may depend on how the step grouped it, and a verify window's on its length.
//   * Per row, on either path: f32 scores (decode path and few rows: dot products per key; many rows: against the
//     chunk's transposed keys), optional soft cap, causal / window / validity mask, online softmax with the
//     reference's flush (a weight exp(z) with z <= -80 is exactly 0: its share is < 1e-34 and a subnormal would make
//     the arithmetic ~100x slower), weighted sum of V. Keys past a block's last position and pages outside the pool
//     are never read, and a weight (even 0) is only ever multiplied with a value some token of the block sees or,
//     under a sliding window on the decode path, an older key of the same page (written: the page holds visible
//     keys after it), so NaN in stale slots or unused pages cannot leak.
//   * Tasks run on XLA's intra-op thread pool, largest first, handed out by an atomic counter; the calling thread
//     works too, and waits only for tasks that were actually taken (a helper that starts late finds no work).
//     With fewer decode-path tasks than threads (batch-1 decode), each kv head is a task (`MakeTasks`).
//
// Inputs (shapes as in reference.attend; all row-major):
//   q            f32/bf16/f16[T, N, H]
//   k_pages      f32/bf16/f16/s8/f8e4m3fn[P, page_size, K, H]     v_pages: same
//   k_scales     f32[P, page_size, K] (quantized caches) or f32[0] (float caches)     v_scales: same
//   block_tables s32[S, max_pages]; seq s32[T]; pos s32[T]; is_real pred[T]
// Output: q's dtype [T, N, H]; padding tokens (is_real false) are zero.
// Attributes: sm_scale f32; sliding_window s32 (<= 0: none); soft_cap f32 (<= 0: none).
// Block-table entries that are outside [0, P) for a visible page are treated as masked keys (the engine never
// produces them; reading them would be out of bounds).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;  // the reference's masked score
constexpr float kFlush = -80.0f;   // exp(z) for z <= kFlush is flushed to exactly 0, as in the reference
constexpr int kBlockTokens = 32;   // query tokens of one sequence sharing each page read
constexpr int kMaxBlockRows = 128;  // ... but at most this many (token, query head) rows per block
constexpr int kChunkKeys = 64;     // keys per online-softmax step
constexpr int kPerTokenRun = 16;   // decode path: a sequence's run of at most this many tokens, a task per token

// ------------------------------------------------------------------ scalar conversions

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    mag = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    uint32_t bits = ((exp + 112u) << 23) | (mant << 13);
    std::memcpy(&mag, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToF16(float f) {  // round to nearest even, overflow to inf, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {                        // below 2^-14: f16 subnormal (or zero)
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));  // units of 2^-24, ties to even
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>(((rounded >> 13) - (112u << 10)) & 0xffffu);
}

struct Fp8E4m3fnTable {
  float value[256];
  Fp8E4m3fnTable() {
    for (int b = 0; b < 256; ++b) {
      const int exp = (b >> 3) & 0xf, mant = b & 7;
      float mag;
      if (exp == 15 && mant == 7) {
        mag = std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        mag = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 * 2^-6
      } else {
        mag = std::ldexp(1.0f + mant / 8.0f, exp - 7);
      }
      value[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const Fp8E4m3fnTable kFp8;

// ------------------------------------------------------------------ the problem and its tasks

enum class KvKind { kF32, kBf16, kF16, kS8, kFp8 };

struct Problem {
  const void* q;  // [T, N, H]
  ffi::DataType q_type;
  void* out;  // [T, N, H], q's dtype
  const void* k_pages;  // [P, page_size, K, H]
  const void* v_pages;
  KvKind kv_kind;
  const float* k_scales;  // [P, page_size, K] or null
  const float* v_scales;
  const int32_t* block_tables;  // [S, max_pages]
  const int32_t* seq;  // [T]
  const int32_t* pos;  // [T]
  const bool* is_real;  // [T]
  int64_t T, N, H, K, G, P, page_size, S, max_pages;
  float sm_scale, soft_cap;
  int32_t window;
};

struct Task {
  int64_t t0, num_tokens, seq, lo, hi;  // tokens t0 .. t0 + num_tokens - 1, keys at positions lo..hi
  int64_t cost;
  int64_t kv0 = 0, kv1 = 0;  // kv heads kv0 .. kv1 - 1 (MakeTasks sets them: all, or one on the decode path)
};

inline float LoadQ(const Problem& p, int64_t i) {
  switch (p.q_type) {
    case ffi::DataType::BF16: return Bf16ToF32(static_cast<const uint16_t*>(p.q)[i]);
    case ffi::DataType::F16: return F16ToF32(static_cast<const uint16_t*>(p.q)[i]);
    default: return static_cast<const float*>(p.q)[i];
  }
}

inline void StoreOut(const Problem& p, int64_t i, float x) {
  switch (p.q_type) {
    case ffi::DataType::BF16: static_cast<uint16_t*>(p.out)[i] = F32ToBf16(x); break;
    case ffi::DataType::F16: static_cast<uint16_t*>(p.out)[i] = F32ToF16(x); break;
    default: static_cast<float*>(p.out)[i] = x;
  }
}

// 8-lane float vectors (GCC/Clang vector extensions: AVX registers with -march=native on x86, pairs elsewhere).
typedef float V8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores
constexpr int kLanes = 8;

inline V8 Load8(const float* p) { return *reinterpret_cast<const V8u*>(p); }
inline void Store8(float* p, V8 v) { *reinterpret_cast<V8u*>(p) = v; }
typedef int32_t V8i __attribute__((vector_size(32)));
inline V8 Splat8(float x) { return V8{x, x, x, x, x, x, x, x}; }
inline float Sum8(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp(x) for x in [kFlush, 0] (lanes outside are selected away by the caller): Cody-Waite range reduction around
// the nearest integer n (by the 1.5 * 2^23 rounding trick, whose low mantissa bits are n) and a degree-6 polynomial,
// ~1 ulp, on all lanes at once (8 here; 16 in the decode path).
template <typename V, typename VI>
inline V ExpV(V x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = x < -87.0f ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f + kRound;
  const V n = t - kRound;
  const V r = x - n * 0.693359375f - n * -2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const VI e = (reinterpret_cast<VI>(t) - 0x4b400000 + 127) << 23;  // 0x4b400000: kRound's bits
  return y * reinterpret_cast<V>(e);  // vector casts reinterpret the bits
}
inline V8 Exp8(V8 x) { return ExpV<V8, V8i>(x); }

inline float Exp(float x) { return Exp8(Splat8(x))[0]; }

// 8 int8 / bfloat16 values widened to f32 lanes at once (sign-extend + convert; bf16 is the high half of an f32).
typedef int8_t V8s8u __attribute__((vector_size(8), aligned(1)));
typedef uint16_t V8u16u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t V8u32 __attribute__((vector_size(32)));
#if defined(__AVX2__)
// GCC scalarizes the generic int8 -> f32 vector conversion (byte loads, scalar converts, inserts): spell it out.
inline V8 LoadS8x8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<V8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}
#else
inline V8 LoadS8x8(const int8_t* p) { return __builtin_convertvector(*reinterpret_cast<const V8s8u*>(p), V8); }
#endif
inline V8 Load8(const int8_t* p) { return LoadS8x8(p); }  // a raw int8 KV row, widened (scale applied apart)
inline V8 LoadBf16x8(const uint16_t* p) {
#if defined(__AVX2__)
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<V8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
#else
  const V8u32 wide = __builtin_convertvector(*reinterpret_cast<const V8u16u*>(p), V8u32) << 16;
  return reinterpret_cast<V8>(wide);
#endif
}

// One key or value row (H values at pool row `row` = (page * page_size + offset) * K + kv head) as f32 times
// `scale`, zero-padded to Hp (a multiple of 8) columns: a pointer into the page itself when that is already the
// case (f32 cache, no scale, H % 8 == 0), else a converted copy in `buf`.
inline const float* LoadRow(const Problem& p, const void* pages, int64_t row, const float* scales, float* buf,
                            int64_t Hp) {
  const int64_t H = p.H, base = row * H;
  const float scale = scales ? scales[row] : 1.0f;
  switch (p.kv_kind) {
    case KvKind::kF32: {
      const float* src = static_cast<const float*>(pages) + base;
      if (H == Hp) return src;
      for (int64_t h = 0; h < H; ++h) buf[h] = src[h];
      break;
    }
    case KvKind::kBf16: {
      const uint16_t* src = static_cast<const uint16_t*>(pages) + base;
      int64_t h = 0;
      for (; h + kLanes <= H; h += kLanes) Store8(buf + h, LoadBf16x8(src + h));
      for (; h < H; ++h) buf[h] = Bf16ToF32(src[h]);
      break;
    }
    case KvKind::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(pages) + base;
      int64_t h = 0;
#if defined(__F16C__)
      for (; h + kLanes <= H; h += kLanes) {
        Store8(buf + h, reinterpret_cast<V8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + h)))));
      }
#endif
      for (; h < H; ++h) buf[h] = F16ToF32(src[h]);
      break;
    }
    case KvKind::kS8: {
      const int8_t* src = static_cast<const int8_t*>(pages) + base;
      int64_t h = 0;
      for (; h + kLanes <= H; h += kLanes) Store8(buf + h, LoadS8x8(src + h) * scale);
      for (; h < H; ++h) buf[h] = static_cast<float>(src[h]) * scale;
      break;
    }
    case KvKind::kFp8: {
      const uint8_t* src = static_cast<const uint8_t*>(pages) + base;
      for (int64_t h = 0; h < H; ++h) buf[h] = kFp8.value[src[h]] * scale;
      break;
    }
  }
  for (int64_t h = H; h < Hp; ++h) buf[h] = 0.0f;
  return buf;
}

// Eight vectors -> one vector of their horizontal sums (lane i = the sum of v[i]'s lanes): a transposing add tree,
// 7 adds and 14 shuffles instead of eight separate horizontal sums.
inline V8 TransposeSum8(const V8* v) {
  V8 p[4], q[2];
  for (int i = 0; i < 4; ++i) {  // lanes A B A B A B A B: pairs of (v[2i], v[2i+1]) partial sums
    p[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {  // lanes A B C D A B C D
    q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// scores[r][j] = q[r] . k[j] for RT rows (stride Hp) and keys j in [j0, j1): eight keys at a time for up to three
// rows (a decode token's query heads sharing a kv head; 8 x RT accumulators), then two at a time. Key rows are f32,
// or raw int8 (E = int8_t: widened in registers; the caller multiplies the scores by the keys' scales).
template <int RT, typename E>
void Scores(const float* q, const E* const* krow, int64_t j0, int64_t j1, int64_t Hp, float* scores,
            int64_t scores_stride) {
  int64_t j = j0;
  if constexpr (RT <= 3) {
    for (; j + 8 <= j1; j += 8) {
      V8 a[RT][8] = {};
      for (int64_t h = 0; h < Hp; h += kLanes) {
        V8 y[RT];
        for (int r = 0; r < RT; ++r) y[r] = Load8(q + r * Hp + h);
        for (int c = 0; c < 8; ++c) {
          const V8 x = Load8(krow[j + c] + h);
          for (int r = 0; r < RT; ++r) a[r][c] += y[r] * x;
        }
      }
      for (int r = 0; r < RT; ++r) Store8(scores + r * scores_stride + j, TransposeSum8(a[r]));
    }
  }
  for (; j + 2 <= j1; j += 2) {
    V8 a[RT][2] = {};
    const E* k0 = krow[j];
    const E* k1 = krow[j + 1];
    for (int64_t h = 0; h < Hp; h += kLanes) {
      const V8 x0 = Load8(k0 + h), x1 = Load8(k1 + h);
      for (int r = 0; r < RT; ++r) {
        const V8 y = Load8(q + r * Hp + h);
        a[r][0] += y * x0;
        a[r][1] += y * x1;
      }
    }
    for (int r = 0; r < RT; ++r) {
      scores[r * scores_stride + j] = Sum8(a[r][0]);
      scores[r * scores_stride + j + 1] = Sum8(a[r][1]);
    }
  }
  if (j < j1) {
    V8 a[RT] = {};
    const E* k0 = krow[j];
    for (int64_t h = 0; h < Hp; h += kLanes) {
      const V8 x0 = Load8(k0 + h);
      for (int r = 0; r < RT; ++r) a[r] += Load8(q + r * Hp + h) * x0;
    }
    for (int r = 0; r < RT; ++r) scores[r * scores_stride + j] = Sum8(a[r]);
  }
}

// The same from a transposed chunk kt[h][j] (stride C keys, zero past the chunk's keys), 16 keys at a time: no
// horizontal sums, which pays when many rows (a prefill block) share the chunk and amortize the transpose.
template <int RT>
void ScoresTransposed(const float* q, const float* kt, int64_t C, int64_t j0, int64_t j1, int64_t Hp,
                      float* scores, int64_t scores_stride) {
  for (int64_t j = j0 / (2 * kLanes) * (2 * kLanes); j < j1; j += 2 * kLanes) {
    V8 a[RT][2] = {};
    for (int64_t h = 0; h < Hp; ++h) {
      const V8 x0 = Load8(kt + h * C + j), x1 = Load8(kt + h * C + j + kLanes);
      for (int r = 0; r < RT; ++r) {
        const V8 y = Splat8(q[r * Hp + h]);
        a[r][0] += y * x0;
        a[r][1] += y * x1;
      }
    }
    for (int r = 0; r < RT; ++r) {
      Store8(scores + r * scores_stride + j, a[r][0]);
      Store8(scores + r * scores_stride + j + kLanes, a[r][1]);
    }
  }
}

// acc[r] += sum_j w[r][j] * v[j] for RT rows and keys j in [j0, j1), 32 columns at a time. Value rows are f32, or
// raw int8 (E = int8_t; the caller has folded the values' scales into w).
template <int RT, typename E>
void WeightedSum(const float* w, int64_t w_stride, const E* const* vrow, int64_t j0, int64_t j1, int64_t Hp,
                 float* acc) {
  int64_t h = 0;
  for (; h + 4 * kLanes <= Hp; h += 4 * kLanes) {
    V8 a[RT][4];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = Load8(acc + r * Hp + h + c * kLanes);
    for (int64_t j = j0; j < j1; ++j) {
      const E* v = vrow[j] + h;
      const V8 x0 = Load8(v), x1 = Load8(v + kLanes), x2 = Load8(v + 2 * kLanes), x3 = Load8(v + 3 * kLanes);
      for (int r = 0; r < RT; ++r) {
        const V8 b = Splat8(w[r * w_stride + j]);
        a[r][0] += b * x0;
        a[r][1] += b * x1;
        a[r][2] += b * x2;
        a[r][3] += b * x3;
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < 4; ++c) Store8(acc + r * Hp + h + c * kLanes, a[r][c]);
  }
  for (; h < Hp; h += kLanes) {
    V8 a[RT];
    for (int r = 0; r < RT; ++r) a[r] = Load8(acc + r * Hp + h);
    for (int64_t j = j0; j < j1; ++j) {
      const V8 x = Load8(vrow[j] + h);
      for (int r = 0; r < RT; ++r) a[r] += Splat8(w[r * w_stride + j]) * x;
    }
    for (int r = 0; r < RT; ++r) Store8(acc + r * Hp + h, a[r]);
  }
}

struct Workspace {
  std::vector<float> qf, m, l, acc;  // per row of every kv head: f32[K*R, Hp] queries, f32[K*R] max and sum, acc
  std::vector<float> kbuf, vbuf, kt, s;  // the chunk: f32[C, Hp] converted keys/values, f32[Hp, C] keys^T, [R, C]
  std::vector<const float*> krow, vrow;  // [C] the chunk's key / value rows (into the pages or the buffers)
  std::vector<const int8_t*> krow8, vrow8;  // [C] int8 decode: raw key / value rows in the pages ...
  std::vector<float> kscale, vscale;  // [C] ... and their scales
  std::vector<int64_t> kpos, row_j0, row_j1;  // [C] key positions; [R] each row's visible range in the chunk
};

// Online-softmax update of row r with its scores sr[u0, u1) (visible: [j0, j1)); leaves the weights in sr, exactly 0
// outside [j0, j1) and where exp underflows past kFlush (the reference's flush), and rescales the row's sum and acc.
void SoftmaxRow(const Problem& p, Workspace& ws, int64_t r, float* sr, int64_t u0, int64_t u1, int64_t j0,
                int64_t j1, int64_t Hp) {
  if (j0 >= j1) {
    std::fill(sr + u0, sr + u1, 0.0f);
    return;
  }
  if (p.soft_cap > 0.0f) {
    for (int64_t j = j0; j < j1; ++j) sr[j] = p.soft_cap * std::tanh(sr[j] / p.soft_cap);
  }
  // Whole 8-lane groups covering [j0, j1) (a row holds kChunkKeys floats); lanes outside the range are masked.
  const int64_t g0 = j0 / kLanes * kLanes, g1 = (j1 + kLanes - 1) / kLanes * kLanes;
  const V8i iota = {0, 1, 2, 3, 4, 5, 6, 7};
  const int32_t lo = static_cast<int32_t>(j0), hi = static_cast<int32_t>(j1);
  V8 vmax = Splat8(ws.m[r]);
  for (int64_t j = g0; j < g1; j += kLanes) {
    const V8i idx = iota + static_cast<int32_t>(j);
    const V8 x = Load8(sr + j);
    vmax = ((idx >= lo) & (idx < hi) & (x > vmax)) ? x : vmax;
  }
  float m_new = vmax[0];
  for (int lane = 1; lane < kLanes; ++lane) m_new = std::max(m_new, vmax[lane]);
  V8 vsum = {};
  for (int64_t j = g0; j < g1; j += kLanes) {
    const V8i idx = iota + static_cast<int32_t>(j);
    const V8 z = Load8(sr + j) - m_new;
    const V8 w = ((idx >= lo) & (idx < hi) & (z > kFlush)) ? Exp8(z) : Splat8(0.0f);
    Store8(sr + j, w);
    vsum += w;
  }
  std::fill(sr + u0, sr + std::max(u0, j0), 0.0f);
  std::fill(sr + std::min(u1, j1), sr + u1, 0.0f);
  const float dm = ws.m[r] - m_new;
  const float alpha = dm > kFlush ? Exp(dm) : 0.0f;  // the same flush for the rescale
  ws.m[r] = m_new;
  ws.l[r] = ws.l[r] * alpha + Sum8(vsum);
  if (alpha != 1.0f) {
    float* acc = &ws.acc[r * Hp];
    for (int64_t h = 0; h < Hp; ++h) acc[h] *= alpha;
  }
}

// One chunk of keys (positions c0 .. c0 + kChunkKeys - 1, clipped to the task's range) for kv head kv: gather the
// key and value rows once, then for row tiles of up to 4 rows: scores over the union of the tile's visible ranges,
// each row's online softmax, and the weighted sum of V. Only keys inside a tile's union -- each visible to some
// token of this block, so holding written data -- are ever multiplied. Returns false if the chunk has no keys in
// valid pages (then it has none for any kv head).
bool AttendChunk(const Problem& p, const Task& task, Workspace& ws, int64_t kv, int64_t c0, bool transposed) {
  const int64_t G = p.G, B = task.num_tokens, R = B * G, K = p.K, ps = p.page_size;
  const int64_t Hp = (p.H + kLanes - 1) / kLanes * kLanes;
  constexpr int64_t C = kChunkKeys;
  const int32_t* table = p.block_tables + task.seq * p.max_pages;
  // int8 rows with few query rows (decode): no converted copies; rows are widened in registers inside Scores /
  // WeightedSum and the scales are applied to the scores and folded into the weights.
  const bool raw8 = p.kv_kind == KvKind::kS8 && !transposed && p.H == Hp;
  int64_t n = 0;
  for (int64_t kp = c0, c1 = std::min(c0 + C, task.hi + 1); kp < c1;) {
    const int64_t pg = kp / ps, end = std::min(c1, (pg + 1) * ps);
    const int32_t page = pg < p.max_pages ? table[pg] : -1;
    if (page < 0 || page >= p.P) {  // masked: never read
      kp = end;
      continue;
    }
    for (int64_t row = ((static_cast<int64_t>(page) * ps + kp - pg * ps) * K + kv); kp < end; ++kp, row += K) {
      if (raw8) {
        ws.krow8[n] = static_cast<const int8_t*>(p.k_pages) + row * p.H;
        ws.vrow8[n] = static_cast<const int8_t*>(p.v_pages) + row * p.H;
        ws.kscale[n] = p.k_scales[row];
        ws.vscale[n] = p.v_scales[row];
      } else {
        ws.krow[n] = LoadRow(p, p.k_pages, row, p.k_scales, &ws.kbuf[n * Hp], Hp);
        ws.vrow[n] = LoadRow(p, p.v_pages, row, p.v_scales, &ws.vbuf[n * Hp], Hp);
      }
      ws.kpos[n] = kp;
      ++n;
    }
  }
  if (n == 0) return false;
  if (transposed) {
    float* kt = ws.kt.data();
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < Hp; ++h) kt[h * C + j] = ws.krow[j][h];
    }
    for (int64_t h = 0; h < Hp; ++h) std::fill(kt + h * C + n, kt + (h + 1) * C, 0.0f);
  }
  // A token's visible keys in the chunk (positions in (pos - window, pos]) are a contiguous range [j0, j1).
  for (int64_t b = 0; b < B; ++b) {
    const int64_t last = p.pos[task.t0 + b];
    const int64_t first = p.window > 0 ? last - p.window + 1 : INT64_MIN;
    int64_t j0 = 0, j1 = n;
    while (j0 < n && ws.kpos[j0] < first) ++j0;
    while (j1 > j0 && ws.kpos[j1 - 1] > last) --j1;
    std::fill(&ws.row_j0[b * G], &ws.row_j0[(b + 1) * G], j0);
    std::fill(&ws.row_j1[b * G], &ws.row_j1[(b + 1) * G], j1);
  }
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int rt = static_cast<int>(std::min<int64_t>(4, R - r0));
    int64_t u0 = n, u1 = 0;
    for (int i = 0; i < rt; ++i) {
      if (ws.row_j0[r0 + i] < ws.row_j1[r0 + i]) {
        u0 = std::min(u0, ws.row_j0[r0 + i]);
        u1 = std::max(u1, ws.row_j1[r0 + i]);
      }
    }
    if (u0 >= u1) continue;
    float* s = &ws.s[r0 * C];
    const float* q = &ws.qf[(kv * R + r0) * Hp];
    if (transposed) {
      switch (rt) {
        case 1: ScoresTransposed<1>(q, ws.kt.data(), C, u0, u1, Hp, s, C); break;
        case 2: ScoresTransposed<2>(q, ws.kt.data(), C, u0, u1, Hp, s, C); break;
        case 3: ScoresTransposed<3>(q, ws.kt.data(), C, u0, u1, Hp, s, C); break;
        default: ScoresTransposed<4>(q, ws.kt.data(), C, u0, u1, Hp, s, C); break;
      }
    } else if (raw8) {
      switch (rt) {
        case 1: Scores<1>(q, ws.krow8.data(), u0, u1, Hp, s, C); break;
        case 2: Scores<2>(q, ws.krow8.data(), u0, u1, Hp, s, C); break;
        case 3: Scores<3>(q, ws.krow8.data(), u0, u1, Hp, s, C); break;
        default: Scores<4>(q, ws.krow8.data(), u0, u1, Hp, s, C); break;
      }
      for (int i = 0; i < rt; ++i) {
        for (int64_t j = u0; j < u1; ++j) s[i * C + j] *= ws.kscale[j];
      }
    } else {
      switch (rt) {
        case 1: Scores<1>(q, ws.krow.data(), u0, u1, Hp, s, C); break;
        case 2: Scores<2>(q, ws.krow.data(), u0, u1, Hp, s, C); break;
        case 3: Scores<3>(q, ws.krow.data(), u0, u1, Hp, s, C); break;
        default: Scores<4>(q, ws.krow.data(), u0, u1, Hp, s, C); break;
      }
    }
    for (int i = 0; i < rt; ++i) {
      SoftmaxRow(p, ws, kv * R + r0 + i, s + i * C, u0, u1, ws.row_j0[r0 + i], ws.row_j1[r0 + i], Hp);
    }
    float* acc = &ws.acc[(kv * R + r0) * Hp];
    if (raw8) {
      for (int i = 0; i < rt; ++i) {
        for (int64_t j = u0; j < u1; ++j) s[i * C + j] *= ws.vscale[j];
      }
      switch (rt) {  // all the tile's rows in one pass over the chunk's values
        case 1: WeightedSum<1>(s, C, ws.vrow8.data(), u0, u1, Hp, acc); break;
        case 2: WeightedSum<2>(s, C, ws.vrow8.data(), u0, u1, Hp, acc); break;
        case 3: WeightedSum<3>(s, C, ws.vrow8.data(), u0, u1, Hp, acc); break;
        default: WeightedSum<4>(s, C, ws.vrow8.data(), u0, u1, Hp, acc); break;
      }
    } else {
      switch (rt) {
        case 1: WeightedSum<1>(s, C, ws.vrow.data(), u0, u1, Hp, acc); break;
        case 2: WeightedSum<2>(s, C, ws.vrow.data(), u0, u1, Hp, acc); break;
        case 3: WeightedSum<3>(s, C, ws.vrow.data(), u0, u1, Hp, acc); break;
        default: WeightedSum<4>(s, C, ws.vrow.data(), u0, u1, Hp, acc); break;
      }
    }
  }
  return true;
}

// ------------------------------------------------------------------ decode: one query token, page by page

// A decode token's task walks its pages in order and each page's contiguous [page_size, K, H] block once: per kv
// head, up to kWide keys at a time (16 with AVX-512, 8 with AVX2: one register's lanes), the G query rows' scores
// (queries in registers), one online-softmax update, and the weighted sum of those keys' values while they are in
// L1. A build's width is fixed, so a token's bits do not depend on the batch; AVX-512 and AVX2 builds group keys
// differently and agree to float rounding. Other builds, other KV dtypes and other head dims take the chunked path.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define JAXSERVE_DECODE_PATH 1
struct Bf16 {  // a bfloat16 KV element (the high half of an f32)
  uint16_t bits;
};

#if defined(__AVX512F__)
typedef float VW __attribute__((vector_size(64)));
typedef float VWu __attribute__((vector_size(64), aligned(4)));
typedef int32_t VWi __attribute__((vector_size(64)));
constexpr int kWide = 16;

inline VW LoadW(const Bf16* p) {  // widened in registers
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<VW>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline VW LoadW(const int8_t* p) {  // raw int8, widened in registers (scales applied apart)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline float SumW(VW v) { return _mm512_reduce_add_ps(v); }
inline float MaxW(VW v) { return _mm512_reduce_max_ps(v); }
inline VW SplatW(float x) { return reinterpret_cast<VW>(_mm512_set1_ps(x)); }

// Sixteen vectors -> one vector of their horizontal sums (lane i = the sum of v[i]'s lanes), a transposing add tree.
inline VW TransposeSumW(const VW* v) {
  VW p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: [A B A B], A = v[2i], B = v[2i+1] partial sums
    p[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  for (int i = 0; i < 4; ++i) {  // per block: [v[4i] .. v[4i+3]] partial sums
    q[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // blocks: [v[8i..8i+3], v[8i+4..8i+7]] twice, each half of the sums
    r[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  return __builtin_shufflevector(r[0], r[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(r[0], r[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#else  // AVX2: the 8-lane vectors of the chunked path
typedef V8 VW;
typedef V8u VWu;
typedef V8i VWi;
constexpr int kWide = 8;

inline VW LoadW(const Bf16* p) { return LoadBf16x8(&p->bits); }
inline VW LoadW(const int8_t* p) { return LoadS8x8(p); }
inline float SumW(VW v) { return Sum8(v); }
inline float MaxW(VW v) {
  const __m256 s = reinterpret_cast<__m256>(v);
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline VW SplatW(float x) { return Splat8(x); }
inline VW TransposeSumW(const VW* v) { return TransposeSum8(v); }
#endif

inline VW LoadW(const float* p) { return *reinterpret_cast<const VWu*>(p); }
inline void StoreW(float* p, VW v) { *reinterpret_cast<VWu*>(p) = v; }
template <int NC, typename E>
inline void PrefetchRow(const E* row) {  // the cache lines of one H-element row
  const char* b = reinterpret_cast<const char*>(row);
  for (int i = 0; i < NC * kWide * static_cast<int>(sizeof(E)); i += 64) __builtin_prefetch(b + i);
}

// A tile's n key or value rows (row j at rows + j * stride) as f32 rows (*out_stride apart): an f32 cache's in place
// (the caller prefetches), a bf16 / int8 cache's widened once into buf (kWide rows of H, in L1) for every query row,
// each row's twin `prefetch` elements ahead prefetched as it is read.
template <int NC, typename E>
inline const float* F32Rows(const E* rows, int64_t stride, int n, int64_t prefetch, float* buf, int64_t* out_stride) {
  if constexpr (std::is_same_v<E, float>) {
    *out_stride = stride;
    return rows;
  } else {
    constexpr int H = NC * kWide;
    for (int j = 0; j < n; ++j) {
      if (prefetch) PrefetchRow<NC>(rows + j * stride + prefetch);
      for (int c = 0; c < NC; ++c) StoreW(buf + j * H + c * kWide, LoadW(rows + j * stride + c * kWide));
    }
    *out_stride = H;
    return buf;
  }
}

// RT query rows (q: f32[RT, H], times sm_scale) of one kv head against n <= kWide consecutive keys of one page (row j
// of k / v at k + j * stride), of which j0 .. n - 1 are visible: scores, one online-softmax update of m / l / acc
// (f32[RT], [RT], [RT, H]), and the weighted sum of the values (weight exactly 0 outside the visible ones). kscale /
// vscale: the keys' scales (int8) or null. Only the n rows are read.
template <int RT, int NC, typename E>
void DecodeTile(const float* q, const E* k, const E* v, int64_t stride, int j0, int n, const float* kscale,
                const float* vscale, float soft_cap, int64_t prefetch, float* m, float* l, float* acc) {
  constexpr int H = NC * kWide;
  constexpr bool kF32 = std::is_same_v<E, float>;
  alignas(64) float kbuf[kF32 ? 1 : kWide * H];
  int64_t kstride;
  const float* kf = F32Rows<NC>(k, stride, n, prefetch, kbuf, &kstride);
  if constexpr (kF32) {
    // The tile's value rows are read in column blocks below, each block's lines in turn: ask for all of them now,
    // while the scores compute, so a cold page's misses overlap instead of coming in one wave per block.
    for (int j = 0; j < n; ++j) PrefetchRow<NC>(v + j * stride);
  }
  alignas(64) VW part[RT][kWide];  // per key: lanes of q . k, summed across lanes below
  // Row by row, the row's query in registers (NC of them), four keys' partial sums at a time: the key rows are read
  // once per row from L1 instead of every query row being reloaded from the stack per key (RT x NC registers do
  // not fit AVX2's 16). Each lane's chain a = y0 x0 + y1 x1 + ... is the same whatever the grouping.
  for (int r = 0; r < RT; ++r) {
    VW y[NC];
    for (int c = 0; c < NC; ++c) y[c] = LoadW(q + r * H + c * kWide);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      VW a[4];
      if (kF32 && prefetch && r == 0)
        for (int u = 0; u < 4; ++u) PrefetchRow<NC>(k + (j + u) * stride + prefetch);
      for (int u = 0; u < 4; ++u) a[u] = y[0] * LoadW(kf + (j + u) * kstride);
      for (int c = 1; c < NC; ++c)
        for (int u = 0; u < 4; ++u) a[u] += y[c] * LoadW(kf + (j + u) * kstride + c * kWide);
      for (int u = 0; u < 4; ++u) part[r][j + u] = a[u];
    }
    for (; j < n; ++j) {
      if (kF32 && prefetch && r == 0) PrefetchRow<NC>(k + j * stride + prefetch);
      VW a = y[0] * LoadW(kf + j * kstride);
      for (int c = 1; c < NC; ++c) a += y[c] * LoadW(kf + j * kstride + c * kWide);
      part[r][j] = a;
    }
    for (j = n; j < kWide; ++j) part[r][j] = VW{};
  }
  VWi lane;
  for (int i = 0; i < kWide; ++i) lane[i] = i;
  const VWi live = (lane >= j0) & (lane < n);  // keys j0 .. n - 1 are visible (the others: outside the window)
  alignas(64) float w[RT][kWide];
  float alpha[RT];
  for (int r = 0; r < RT; ++r) {
    VW s = TransposeSumW(part[r]);
    if (kscale) s *= LoadW(kscale);
    if (soft_cap > 0.0f) {
      for (int j = 0; j < n; ++j) s[j] = soft_cap * std::tanh(s[j] / soft_cap);
    }
    s = live ? s : VW{} + kMasked;
    const float m_new = std::max(m[r], MaxW(s));
    const VW z = s - m_new;
    VW wr = (live & (z > kFlush)) ? ExpV<VW, VWi>(z) : VW{};  // the reference's flush
    const float dm = m[r] - m_new;
    alpha[r] = dm == 0.0f ? 1.0f : dm > kFlush ? Exp(dm) : 0.0f;  // the same flush for the rescale; Exp(0) = 1
    m[r] = m_new;
    l[r] = l[r] * alpha[r] + SumW(wr);
    if (vscale) wr *= LoadW(vscale);
    StoreW(w[r], wr);
  }
  // The weighted sum in column blocks of CB vectors whose RT x CB accumulators stay in registers over the keys
  // (all NC at once would spill them on AVX2 and store every accumulator back per key); per element the same FMA
  // chain over j.
  alignas(64) float vbuf[kF32 ? 1 : kWide * H];
  int64_t vstride;
  const float* vf = F32Rows<NC>(v, stride, n, prefetch, vbuf, &vstride);
  constexpr int kRegs = kWide == 16 ? 32 : 16;
  constexpr int CB = NC <= (kRegs - 4) / RT ? NC : (kRegs - 4) / RT >= 4 ? 4 : (kRegs - 4) / RT >= 2 ? 2 : 1;
  static_assert(NC % CB == 0);
  for (int c0 = 0; c0 < NC; c0 += CB) {
    VW a[RT][CB];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CB; ++c) a[r][c] = LoadW(acc + r * H + (c0 + c) * kWide) * alpha[r];
    for (int j = 0; j < n; ++j) {
      if (kF32 && prefetch && c0 == 0) PrefetchRow<NC>(v + j * stride + prefetch);
      for (int r = 0; r < RT; ++r) {
        const VW b = SplatW(w[r][j]);
        for (int c = 0; c < CB; ++c) a[r][c] += b * LoadW(vf + j * vstride + (c0 + c) * kWide);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CB; ++c) StoreW(acc + r * H + (c0 + c) * kWide, a[r][c]);
  }
}

// A task on the decode path (H = NC * kWide; token b's rows for kv head kv are kv * R + b * G + g in ws): the block's
// pages are walked once, in order, in groups of up to kWide keys aligned to the page (a group never depends on the
// block: the same for a token alone or among others). Per group and kv head, each token that sees one of the keys
// updates its G rows, tiles of up to 4 (DecodeTile), while the group's rows are in L1. So a token's rows go through
// exactly the operations they would alone, whatever else is in its block: the bits do not depend on how the step
// grouped tokens (decode, verify window, prefill chunk of any length).
template <int NC, typename E>
void DecodeTask(const Problem& p, const Task& task, Workspace& ws) {
  constexpr int64_t H = NC * kWide;
  const int64_t K = p.K, G = p.G, B = task.num_tokens, R = B * G, ps = p.page_size, stride = K * H;
  const E* k_pages = static_cast<const E*>(p.k_pages);
  const E* v_pages = static_cast<const E*>(p.v_pages);
  const int32_t* table = p.block_tables + task.seq * p.max_pages;
  alignas(64) float ksc[kWide] = {}, vsc[kWide] = {};
  for (int64_t pg = task.lo / ps; pg <= task.hi / ps; ++pg) {
    const int32_t page = pg < p.max_pages ? table[pg] : -1;
    if (page < 0 || page >= p.P) continue;  // masked: never read
    // The next page's rows, prefetched row by row while this page computes (prefetches never fault).
    int64_t next_delta = 0;
    if (pg < task.hi / ps) {
      const int32_t next = pg + 1 < p.max_pages ? table[pg + 1] : -1;
      if (next >= 0 && next < p.P) next_delta = (static_cast<int64_t>(next) - page) * ps * stride;
    }
    const int64_t end = std::min(task.hi + 1, (pg + 1) * ps);
    // Groups start at multiples of kWide keys into the page; keys before the block's first visible one are not read
    // when a whole group lies before it.
    for (int64_t s0 = pg * ps + (std::max(task.lo, pg * ps) - pg * ps) / kWide * kWide; s0 < end; s0 += kWide) {
      const int n = static_cast<int>(std::min<int64_t>(kWide, end - s0));
      const int64_t row0 = (static_cast<int64_t>(page) * ps + s0 - pg * ps) * K;  // pool row of (key s0, kv head 0)
      for (int64_t kv = task.kv0; kv < task.kv1; ++kv) {
        const float *ks = nullptr, *vs = nullptr;
        if (p.k_scales) {
          for (int j = 0; j < n; ++j) {
            ksc[j] = p.k_scales[row0 + j * K + kv];
            vsc[j] = p.v_scales[row0 + j * K + kv];
          }
          ks = ksc;
          vs = vsc;
        }
        const E* k = k_pages + (row0 + kv) * H;
        const E* v = v_pages + (row0 + kv) * H;
        int64_t pf = next_delta;  // prefetch once per kv head, with the first tile
        for (int64_t b = 0; b < B; ++b) {
          const int64_t last = p.pos[task.t0 + b];
          const int64_t first = p.window > 0 ? last - p.window + 1 : 0;
          const int nb = static_cast<int>(std::min<int64_t>(n, last + 1 - s0));  // keys s0 .. last
          const int jb = static_cast<int>(std::clamp<int64_t>(first - s0, 0, kWide));  // keys from first
          if (jb >= nb) continue;  // the token sees none of the group
          for (int64_t g0 = 0; g0 < G; g0 += 4, pf = 0) {
            const int64_t r = kv * R + b * G + g0;
            float *m = &ws.m[r], *l = &ws.l[r], *acc = &ws.acc[r * H];
            const float* q = &ws.qf[r * H];
            switch (std::min<int64_t>(4, G - g0)) {
              case 1: DecodeTile<1, NC>(q, k, v, stride, jb, nb, ks, vs, p.soft_cap, pf, m, l, acc); break;
              case 2: DecodeTile<2, NC>(q, k, v, stride, jb, nb, ks, vs, p.soft_cap, pf, m, l, acc); break;
              case 3: DecodeTile<3, NC>(q, k, v, stride, jb, nb, ks, vs, p.soft_cap, pf, m, l, acc); break;
              default: DecodeTile<4, NC>(q, k, v, stride, jb, nb, ks, vs, p.soft_cap, pf, m, l, acc); break;
            }
          }
        }
      }
    }
  }
}

template <int NC>
bool DecodeTaskOfKind(const Problem& p, const Task& task, Workspace& ws) {
  switch (p.kv_kind) {
    case KvKind::kF32: DecodeTask<NC, float>(p, task, ws); return true;
    case KvKind::kBf16: DecodeTask<NC, Bf16>(p, task, ws); return true;
    case KvKind::kS8: DecodeTask<NC, int8_t>(p, task, ws); return true;
    default: return false;
  }
}
#endif

// Whether tasks take the decode path: AVX-512 or AVX2 builds, head dim 64 or 128, f32 / bf16 / int8 KV.
bool DecodePathApplies(const Problem& p) {
#if defined(JAXSERVE_DECODE_PATH)
  return (p.H == 64 || p.H == 128) &&
         (p.kv_kind == KvKind::kF32 || p.kv_kind == KvKind::kBf16 || p.kv_kind == KvKind::kS8);
#else
  (void)p;
  return false;
#endif
}

// Runs a task on the decode path; false (nothing done) where that path does not apply.
bool TryDecodeTask(const Problem& p, const Task& task, Workspace& ws) {
#if defined(JAXSERVE_DECODE_PATH)
  switch (p.H) {
    case 64: return DecodeTaskOfKind<64 / kWide>(p, task, ws);
    case 128: return DecodeTaskOfKind<128 / kWide>(p, task, ws);
    default: return false;
  }
#else
  (void)p, (void)task, (void)ws;
  return false;
#endif
}

// One task: a block of B tokens of one sequence, kv heads kv0 .. kv1 - 1. Rows per kv head: R = B x G (row b * G + g
// is token t0 + b, query head kv * G + g); kv head kv's rows are at offset kv * R in the workspace.
void RunTask(const Problem& p, const Task& task, Workspace& ws) {
  const int64_t H = p.H, G = p.G, B = task.num_tokens, R = B * G, K = p.K;
  const int64_t Hp = (H + kLanes - 1) / kLanes * kLanes;
  constexpr int64_t C = kChunkKeys;
  const bool transposed = R >= 8;  // enough rows to amortize transposing each chunk's keys
  ws.qf.assign(K * R * Hp, 0.0f);
  ws.m.assign(K * R, kMasked);
  ws.l.assign(K * R, 0.0f);
  ws.acc.assign(K * R * Hp, 0.0f);
  ws.kbuf.resize(C * Hp);
  ws.vbuf.resize(C * Hp);
  if (transposed) ws.kt.resize(Hp * C);
  ws.s.resize(R * C);
  ws.krow.resize(C);
  ws.vrow.resize(C);
  ws.krow8.resize(C);
  ws.vrow8.resize(C);
  ws.kscale.resize(C);
  ws.vscale.resize(C);
  ws.kpos.resize(C);
  ws.row_j0.resize(R);
  ws.row_j1.resize(R);
  // Queries in f32 times sm_scale, like the reference; zero-padded to Hp.
  for (int64_t kv = task.kv0; kv < task.kv1; ++kv) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t src = ((task.t0 + r / G) * p.N + kv * G + r % G) * H;
      float* dst = &ws.qf[(kv * R + r) * Hp];
      for (int64_t h = 0; h < H; ++h) dst[h] = LoadQ(p, src + h) * p.sm_scale;
    }
  }
  // The decode path where it applies (TryDecodeTask); otherwise all kv heads of a chunk in turn: together they read
  // the pages' contiguous [page_size, K, H] blocks.
  if (!TryDecodeTask(p, task, ws)) {
    for (int64_t c0 = task.lo; c0 <= task.hi; c0 += C) {
      for (int64_t kv = task.kv0; kv < task.kv1; ++kv) {
        if (!AttendChunk(p, task, ws, kv, c0, transposed)) break;
      }
    }
  }
  for (int64_t kv = task.kv0; kv < task.kv1; ++kv) {
    for (int64_t r = 0; r < R; ++r) {
      const float l = ws.l[kv * R + r] > 0.0f ? ws.l[kv * R + r] : 1.0f;  // 0: no visible key, output 0
      const float* acc = &ws.acc[(kv * R + r) * Hp];
      const int64_t dst = ((task.t0 + r / G) * p.N + kv * G + r % G) * H;
      for (int64_t h = 0; h < H; ++h) StoreOut(p, dst + h, acc[h] / l);
    }
  }
}

// `workers`: the threads that run the tasks, the caller among them (the pool's size, as the matmul counts them).
std::vector<Task> MakeTasks(const Problem& p, int64_t workers) {
  std::vector<Task> tasks;
  const int64_t max_tokens = std::max<int64_t>(1, std::min<int64_t>(kBlockTokens, kMaxBlockRows / p.G));
  const auto seq_of = [&](int64_t t) { return std::clamp<int64_t>(p.seq[t], 0, p.S - 1); };
  const bool split = DecodePathApplies(p);
  for (int64_t t = 0; t < p.T;) {
    if (!p.is_real[t]) {
      ++t;
      continue;
    }
    // This step's run of consecutive tokens of one sequence: on the decode path a short one (a decode token, a
    // speculative verify window) becomes one-token tasks, spread over the threads; otherwise blocks of up to
    // max_tokens (on the chunked path a block's arithmetic depends on its size, so a run is blocked as before).
    int64_t run = t + 1;
    while (run < p.T && p.is_real[run] && seq_of(run) == seq_of(t)) ++run;
    const int64_t block = split && run - t <= kPerTokenRun ? 1 : max_tokens;
    for (int64_t b = t; b < run; b += block) {
      const int64_t end = std::min(run, b + block);
      int64_t lo = INT64_MAX, hi = -1;
      for (int64_t u = b; u < end; ++u) {
        hi = std::max<int64_t>(hi, p.pos[u]);
        lo = std::min<int64_t>(lo, p.window > 0 ? p.pos[u] - p.window + 1 : 0);
      }
      lo = std::max<int64_t>(lo, 0);
      hi = std::min<int64_t>(hi, p.max_pages * p.page_size - 1);
      if (hi >= lo) {
        tasks.push_back(Task{b, end - b, seq_of(t), lo, hi, (end - b) * (hi - lo + 1 + p.page_size), 0, p.K});
      }
    }
    t = run;
  }
  // Fewer tasks than threads (a step of a single decode or verify window): on the decode path each kv head becomes
  // a task of its own, so the threads share the keys' traffic (a decode token alone was one thread's work, ~25 us
  // per layer at 192 keys with the pages out of cache, while the other core waited). The kv heads' arithmetic is
  // independent (each reads only its own rows of a page), so a token's bits are the same split or not. Measured
  // (2026-12-06, 2-core Xeon VM): batch-1 int4 decode of a 150-layer SmolLM2-shaped model 1.054x tokens/s, the
  // median of 10 paired rounds in one process (the old kernel as a second FFI target), the same tokens.
  if (split && p.K > 1 && static_cast<int64_t>(tasks.size()) < workers) {
    std::vector<Task> heads;
    for (const Task& task : tasks) {
      for (int64_t kv = 0; kv < p.K; ++kv) {
        Task one = task;
        one.kv0 = kv, one.kv1 = kv + 1, one.cost = task.cost / p.K;
        heads.push_back(one);
      }
    }
    tasks.swap(heads);
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

struct Shared {
  Problem problem;
  std::vector<Task> tasks;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Work() {
    thread_local Workspace ws;
    const size_t n = tasks.size();
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      RunTask(problem, tasks[i], ws);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

bool KvKindOf(ffi::DataType t, KvKind* kind) {
  switch (t) {
    case ffi::DataType::F32: *kind = KvKind::kF32; return true;
    case ffi::DataType::BF16: *kind = KvKind::kBf16; return true;
    case ffi::DataType::F16: *kind = KvKind::kF16; return true;
    case ffi::DataType::S8: *kind = KvKind::kS8; return true;
    case ffi::DataType::F8E4M3FN: *kind = KvKind::kFp8; return true;
    default: return false;
  }
}

ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                    ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq,
                                    ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::PRED> is_real,
                                    ffi::Result<ffi::AnyBuffer> out, float sm_scale, int32_t sliding_window,
                                    float soft_cap) {
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->problem;
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: expected q rank 3, pages rank 4, block_tables rank 2");
  }
  p.T = qd[0], p.N = qd[1], p.H = qd[2];
  p.P = kd[0], p.page_size = kd[1], p.K = kd[2];
  p.S = bd[0], p.max_pages = bd[1];
  if (kd[3] != p.H || p.K <= 0 || p.N % p.K != 0 || v_pages.dimensions().size() != 4 ||
      v_pages.element_count() != k_pages.element_count() || v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent q / k_pages / v_pages shapes or dtypes");
  }
  if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16 &&
      q.element_type() != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: q must be float32, bfloat16 or float16");
  }
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: output must match q's shape and dtype");
  }
  if (!KvKindOf(k_pages.element_type(), &p.kv_kind)) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: unsupported KV dtype");
  }
  const bool quantized = p.kv_kind == KvKind::kS8 || p.kv_kind == KvKind::kFp8;
  const size_t scale_count = static_cast<size_t>(p.P * p.page_size * p.K);
  if (quantized && (k_scales.element_count() != scale_count || v_scales.element_count() != scale_count ||
                    k_scales.element_type() != ffi::DataType::F32 || v_scales.element_type() != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: quantized KV needs f32[P, page_size, K] scales");
  }
  if (seq.element_count() != static_cast<size_t>(p.T) || pos.element_count() != static_cast<size_t>(p.T) ||
      is_real.element_count() != static_cast<size_t>(p.T) || p.S <= 0) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: seq / pos / is_real must be [T], S >= 1");
  }
  p.G = p.N / p.K;
  p.q = q.untyped_data();
  p.q_type = q.element_type();
  p.out = out->untyped_data();
  p.k_pages = k_pages.untyped_data();
  p.v_pages = v_pages.untyped_data();
  p.k_scales = quantized ? static_cast<const float*>(k_scales.untyped_data()) : nullptr;
  p.v_scales = quantized ? static_cast<const float*>(v_scales.untyped_data()) : nullptr;
  p.block_tables = block_tables.typed_data();
  p.seq = seq.typed_data();
  p.pos = pos.typed_data();
  p.is_real = is_real.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;

  // Tokens no task covers (padding, or no visible key) output zero.
  std::memset(p.out, 0, out->size_bytes());
  shared->tasks = MakeTasks(p, pool.num_threads());
  const size_t n = shared->tasks.size();
  if (n == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(n) - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared] { shared->Work(); });
  }
  shared->Work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load() == n; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::AnyBuffer>()  // k_scales
                                  .Arg<ffi::AnyBuffer>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // is_real
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
