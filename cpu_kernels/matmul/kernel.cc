// Matmul for the CPU backend over pre-packed weights in four formats, as XLA FFI custom calls:
// y f32[M, N] = x f32[M, K] @ W[K, N], W stored as f32, bf16, int8 or 4-bit with group-wise scales and zeros.
//
// Why not XLA's dot: a decode step multiplies a handful of rows (M = the batch) by every weight matrix, and XLA:CPU
// reaches about a third of the machine's FMA peak at M = 16 on SmolLM2's shapes; at M = 1 the step is bound by the
// bytes of weight it streams, so a weight in fewer bytes is a faster step. W arrives pre-packed (`pack`,
// `pack_quantized` in __init__.py) in panels of kNr = 32 columns, zero-padded past N, each panel one sequential
// stream over K. Tasks are runs of panels on XLA's intra-op thread pool, handed out by an atomic counter; the calling
// thread works too. Every y[m, n] is computed by the same sequence of float operations whatever M, the row block or
// the thread: a row's result does not depend on what else is in the batch (batch invariance, bit for bit).
//
// Three builds of the same arithmetic, chosen by -march=native at build time: AVX-512 (+ VNNI, BF16 where the CPU
// has them), AVX2 + FMA + F16C (8-lane vectors, 2 rows per register block; integer dot products from vpmaddubsw
// and vpmaddwd, below), and portable C++ loops. All three give the same bits for every format (the tests build
// the kernel for x86-64 and x86-64-v3 and compare them with the library in use).
//
// Float formats (f32, bf16): panels [P, K, 32] of float or bf16 bits. For each panel and each block of up to kMr
// rows of x, the accumulators (rows x 2 vectors of 16) live in registers for the whole k loop: per k, the 32 weights
// are widened to f32 in two registers, then one broadcast FMA pair per row (an in-order FMA chain over k).
//
// Integer formats (int8, int4), as llama.cpp does it: activations quantized per row and block of 32 k, integer dot
// products with vpdpbusd (u8 x s8, four k per 32-bit lane), scales applied once per sub-block.
//   * x is quantized once per call into scratch (`QuantizeRows`): per row m and block b of 32 k,
//       d[m, b] = max|x| / 127,  xq[m, k] = clamp(round_half_even(x[m, k] * (d > 0 ? 1 / d : 0)), -127, 127)
//     (true f32 divisions; `quantize_activations` in __init__.py is the same arithmetic in jnp).
//   * One array per weight (the jitted step's host dispatch costs per array): a panel is one sequential stream of
//     K / G groups, each [head][quants]. The head is the group's 32 scales, then (with zeros) its 32 zeros, as f16
//     (`scale_bytes` = 2: chosen at pack time when every scale and zero of the weight is exactly an f16, e.g. a
//     GGUF block's, widened exactly with vcvtph2ps, so the same f32 arithmetic and the same bits) or f32 (4). The
//     quants put 4 consecutive k of one column in each 32-bit lane, [G / 4, 32 columns, 4 k]:
//       int8  u8[G / 4][32][4]  (128 bytes per 4 k; q + 128, so vpdpbusd's unsigned operand; the offset is removed
//                                exactly by starting the int32 sum at -128 * sum(xq) of the sub-block)
//       int4  u8[G / 4][16][4]  ( 64 bytes per 4 k; byte [j][i]: column j, k = 4 kq + i in its low nibble, column
//                                j + 16 in its high one: one 64-byte load, an and and a shift give both vectors)
//     Heads are 64, 128 or 256 bytes, so with a 64-byte aligned buffer every group starts on a cache line. The
//     activations' 4 bytes are a 32-bit broadcast.
//   * Sub-blocks of S = 32 k (16 when G is not a multiple of 32) lie in one weight group and one activation block.
//     Per sub-block j of group g and block b, the exact int32 sums isum[m, n] = sum_k q[k, n] xq[m, k] are folded
//     into the f32 accumulator in this order (the same in the portable path, so the same bits):
//       acc = fma(float(isum) * d[m, b], scale[g, n], acc)
//       acc = fma(float(sum_k xq[m, k]) * d[m, b], zeros[g, n], acc)      (with zeros)
//     so y approximates dequant(quant(x)) @ dequant(W), float rounding aside.
//
// Measured and not kept (the widening path, before the integer one): summing x * q over a group in f32 and applying
// the scale once at the group's end -- no faster than dequantizing each weight.
//
// M = 1 on cold weights (`python -m cpu_kernels.matmul.bench --cold`: 30 distinct copies per shape in one jitted
// chain; K x N = 576 x 960, 576 x 576, 576 x 3072, 1536 x 576 in bf16, int8 G = 32, int4 G = 32 + zeros, and
// 576 x 49152 int8). Measured on 2 cores shared with other processes: medians moved by up to +-25% between runs of
// the same code, so only the minimum over 9 runs of 15 rounds is quoted. Kept: one array per weight with f16 heads
// (int4 G = 32 + zeros 6.0 -> 5.0 bits per weight, int8 G = 32 9.0 -> 8.5): 576 x 576 int4 21.5 -> 15.8 us, int8
// 26.0 -> 22.0 us; 576 x 3072 int4 64.0 -> 50.6, int8 93.6 -> 79.3 us. Not kept, no gain above the noise in 3-4
// interleaved runs each (as often slower as faster):
//   * software prefetch (_mm_prefetch T0 of each quad's / k row's lines 256, 512 or 1024 bytes ahead in the panel
//     stream), on an AMD EPYC VM: the stream is sequential, the hardware prefetchers already followed it there. On
//     an Intel Xeon VM (2026-12-05) 4 KB ahead did pay, at every row count and format (`Prefetch`, kept);
//   * (with the caller then sleeping on a condition variable until the helpers were done) splitting M <= 4
//     products into 2, 4 or 8 tasks whatever their size: at 0.2-1 MB per call the wake-up cost what the second
//     core's bandwidth saved. With the caller spinning on the `done` counter instead (kept, `Shared::Wait`),
//     splitting every M <= 4 product pays (medians, one run each, 2026-12-05, a VM with a 300 MiB L3): cold M = 1
//     bf16 576 x 960 106 -> 57 us, 576 x 3072 301 -> 156 us, int8 576 x 576 34 -> 18 us, int4 576 x 576 30 -> 17
//     us; batch-1 decode of the default model (fresh processes alternating, 2 rounds) gguf 1.14-1.30x, bf16 1.75x,
//     int8 1.10-1.35x, identical tokens; `python -m bench ab` (docs/benchmarks/ab_split.md, 3 rounds) batch 1
//     1.15x, batch 16 0.99x (products of more than 4 rows wait as before). A helper thread of our own that spun
//     between products (instead of XLA's pool) measured slower end to end (gguf batch 1 ~200 vs ~300 tok/s): it
//     took the second core from the host thread and XLA's own workers. The attention kernel's caller spinning
//     likewise measured no gain (3 alternating rounds, batch 1 and 16), so it still waits on a condition variable;
//   * (2026-12-06, Intel Xeon VM) for M <= 4, a contiguous range of panels per thread (the others' last panels
//     taken at the end) and a helper that stays 10-50 us after its share, polling a one-slot mailbox the next
//     product posts to instead of pool.Schedule (which held the caller ~3 us per product, instrumented): a chain of
//     the 150-layer int4 model's 600 products per step (no attention) 1.13-1.39x, paired in one process; the
//     engine's batch-1 decode of that model 1.00-1.06x (4 paired runs, 10 rounds each), inside the noise: the
//     lingering helper's polling (14% of perf samples) took the core from the host thread and the attention
//     kernel's workers. Cold M = 1 products cost ~6.7 us + bytes / 21 GB/s each (576 x 576 .. 1536 x 3072).
//   * AVX2 builds (AMD EPYC Zen 3 VM, 2026-12-06; hot 576 x 1536 products in one process, two builds alternating,
//     same bits): the integer blocks' scales and zeros loaded in the sub-block's epilogue instead of once per group
//     (fewer live registers): int4 M = 1 1.22x slower; 3 or 4 rows per integer block instead of 2: M = 16
//     1.07-1.20x slower (M = 3-4 up to 10% faster); bf16 through the two-FMA path with x widened once per call
//     (broadcast from memory) instead of PairBlock's per-row split of x's pairs: 1.0-1.4x slower at 1 / 2 / 16 rows.
//     int8 with 3-4 rows per block, one vector of 8 columns at a time over the whole panel (a row holding one s32 sum
//     and one f32 accumulator): M = 16 1.10x, M = 8 1.13x, M = 3-4 1.12-1.19x slower hot, 1.22x cold.
//
// Targets (inputs; the output is y f32[M, N], N its second dimension):
//   JaxserveMatmul      x f32[M, K], w f32[P, K, 32]
//   JaxserveMatmulBf16  x f32[M, K], w bf16[P, K, 32] (k pairs interleaved, above)
//   JaxserveMatmulInt8  x f32[M, K], w s8[P, K / G, B] (B = head + G / 4 x 128), attributes scale_bytes (s32: 2 or
//                       4) and has_zeros (pred); G = K / w's second dimension
//   JaxserveMatmulInt4  x f32[M, K], w u8[P, K / G, B] (B = head + G / 4 x 64), the same attributes
// K must be a multiple of 32 for the integer formats and G a multiple of 16.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNr = 32;     // columns per packed panel
constexpr int64_t kBlock = 32;  // k per activation quantization block (integer formats)
constexpr int64_t kTargetTaskFlops = int64_t{1} << 21;  // ~25 us of work: enough to amortize a task hand-out
// Products of at most kStreamRows rows (decode) are bound by streaming the weight: split over every core whatever
// their size, kStreamTasksPerWorker tasks per core.
constexpr int64_t kStreamRows = 4, kStreamTasksPerWorker = 4;
// Polls of `done` (with a pause each, ~40 ns) before a waiting caller starts yielding its core.
constexpr int64_t kSpinPolls = int64_t{1} << 12;

struct Problem {
  const float* x;       // f32[M, K]
  const void* w;        // panels, the format's storage type (integer formats: scales, zeros and quants interleaved)
  float* y;             // f32[M, N]
  int64_t m, k, n, panels, group;  // group = K for the float formats
  // Integer formats: bytes per group of a panel (head + quants) and of its head (32 scales, then 32 zeros if any).
  int64_t group_bytes = 0, head_bytes = 0;
  // Integer formats: x quantized (scratch filled by QuantizeRows), sub-blocks of `sub` (32 or 16) k.
  const int8_t* xq = nullptr;   // s8[M, K]
  const float* xd = nullptr;    // f32[M, K / 32]: the blocks' d
  const int32_t* xoff = nullptr;  // s32[M, K / sub]: -128 * sum(xq) per sub-block (int8's offset), else 0
  const float* xz = nullptr;    // f32[M, K / sub]: float(sum(xq)) * d per sub-block (for the zeros)
  int64_t sub = kBlock;
  // bf16 format: x rounded to bf16 (`RoundRowsBf16`), two consecutive k per 32-bit word: u32[M, ceil(K / 2)].
  const uint32_t* xb = nullptr;
  // bf16 format, the FMA path (`Bf16Fma`): the same rounded x widened back to f32, f32[M, K].
  const float* xw = nullptr;
};

#if defined(__AVX2__)
// AVX2 blocks: y[m0 .. m0 + R, the panel's columns] = acc[r][0..3] (8 columns each); the last panel's past N are
// not written.
template <int R>
inline void StoreRows8(const Problem& p, int64_t panel, int64_t m0, const __m256 (*acc)[4]) {
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    if (cols == kNr) {
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + 8 * v, acc[r][v]);
    } else {
      alignas(32) float row[kNr];
      for (int v = 0; v < 4; ++v) _mm256_store_ps(row + 8 * v, acc[r][v]);
      std::memcpy(y, row, cols * sizeof(float));
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Float formats: storage type, elements per k row of a panel, kMr = rows of x per register block (2 kMr accumulators
// + 2 weight vectors + a broadcast <= 32). F32::Widen loads one k row (columns 0-15 and 16-31); Bf16::Widen widens
// one bf16 exactly.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define JAXSERVE_AVX2_FLOAT 1
constexpr int64_t kFloatMr = 2;  // AVX2: 4 accumulators per row (32 columns of 8 lanes) + weights in 16 registers
#else
constexpr int64_t kFloatMr = 12;
#endif

struct F32 {
  using T = float;
  static constexpr int64_t kRow = 32, kMr = kFloatMr, kWidenFlops = 0;
  static constexpr bool kInt = false;
#if defined(__AVX512F__)
  static void Widen(const T* w, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(w);
    hi = _mm512_loadu_ps(w + 16);
  }
#endif
};

struct Bf16 {  // a bf16 is the top half of an f32: shifting its bits left by 16 widens it exactly
  using T = uint16_t;
  static constexpr int64_t kRow = 32, kMr = kFloatMr, kWidenFlops = 0;
  static constexpr bool kInt = false;
  static float Widen(T v) {
    const uint32_t bits = uint32_t{v} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};
// bf16 weights in the same panels, multiplied by two f32 FMAs per k pair instead of one vdpbf16ps (`Bf16AsFma`).
// AVX2: 4 rows per block, each half of the panel (16 columns) in turn: 8 accumulators + 4 widened weights.
struct Bf16Fma : Bf16 {
#if defined(JAXSERVE_AVX2_FLOAT)
  static constexpr int64_t kMr = 4;
#endif
};

// x rounded to bf16 for the bf16 format: to nearest even, NaN stays a (quiet) NaN, and zero or subnormal inputs
// become a signed zero (vdpbf16ps reads subnormal inputs as zero; flushing here makes every path agree). Integer
// arithmetic, so the same bits whatever the build or the MXCSR.
inline uint16_t RoundToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7F800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Rows of x [M, K] -> bf16 pairs u32[M, ceil(K / 2)] (word kq: k = 2 kq in its low half, 2 kq + 1 in its high
// half; an odd K's last word has a zero high half).
void RoundRowsBf16(const float* x, int64_t m, int64_t k, uint32_t* xb) {
  const int64_t words = (k + 1) / 2;
  for (int64_t r = 0; r < m; ++r, x += k, xb += words) {
    for (int64_t kq = 0; kq < words; ++kq) {
      const uint32_t hi = 2 * kq + 1 < k ? RoundToBf16(x[2 * kq + 1]) : 0;
      xb[kq] = uint32_t{RoundToBf16(x[2 * kq])} | hi << 16;
    }
  }
}

// The same rounding, each value widened back to f32: x [M, K] -> xw f32[M, K].
void RoundRowsBf16F32(const float* x, int64_t m, int64_t k, float* xw) {
  for (int64_t i = 0; i < m * k; ++i) xw[i] = Bf16::Widen(RoundToBf16(x[i]));
}

#if defined(__AVX512F__)
// Software prefetch of the weight stream: kBytes (the lines a loop step reads) kPrefetchBytes ahead of `at`. Past
// the end of the weight it is a hint that does nothing. Measured on an Intel Xeon VM (2026-12-05, one step's linear
// maps, fresh processes alternating, medians of 7-9): bf16 (two-FMA path) at M = 1 / 4 / 16 / 64 rows 19-20 / 25 /
// 40-43 / 108-123 ms without, 14-18 / 16-18 / 28-36 / 80-112 with, 2-16 KB ahead all alike; at M = 16 f32 57-89 ->
// 42-45, int8 G = 32 24-27 -> 21, int4 20-40 -> 14-19; M = 1 as fast or faster. Without it the loads of a panel's
// first row block stalled (perf: ~46% of the two-FMA block's samples on its two weight loads at M = 16).
constexpr int64_t kPrefetchBytes = 4096;
template <int64_t kBytes>
inline void Prefetch(const void* at) {
  const char* line = static_cast<const char*>(at) + kPrefetchBytes;
  for (int64_t i = 0; i < kBytes; i += 64) _mm_prefetch(line + i, _MM_HINT_T0);
}

// y[m0 .. m0 + R, the panel's columns] = the accumulators (columns 0-15, 16-31); masked past N in the last panel.
template <int R>
inline void StoreRows(const Problem& p, int64_t panel, int64_t m0, const __m512* acc0, const __m512* acc1) {
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    _mm512_mask_storeu_ps(y, lo, acc0[r]);
    _mm512_mask_storeu_ps(y + 16, hi, acc1[r]);
  }
}

// Rows [m0, m0 + R) x panel p. R is a compile-time constant so the accumulators are registers.
template <class Fmt, bool kZeros, int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const typename Fmt::T* w = static_cast<const typename Fmt::T*>(p.w) + panel * p.k * Fmt::kRow;
  const float* x = p.x + m0 * p.k;
  for (int64_t k = 0; k < p.k; ++k, w += Fmt::kRow) {
    __m512 b0, b1;
    Prefetch<Fmt::kRow * sizeof(typename Fmt::T)>(w);
    Fmt::Widen(w, b0, b1);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * p.k + k]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
    }
  }
  StoreRows<R>(p, panel, m0, acc0, acc1);
}
#elif defined(JAXSERVE_AVX2_FLOAT)
// AVX2: a panel's 32 columns as 4 vectors of 8, the same FMA chain per element as below.

template <class Fmt, bool kZeros, int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  static_assert(std::is_same_v<Fmt, F32>);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const float* w = static_cast<const float*>(p.w) + panel * p.k * kNr;
  const float* x = p.x + m0 * p.k;
  for (int64_t k = 0; k < p.k; ++k, w += kNr) {
    for (int v = 0; v < 4; ++v) {
      const __m256 b = _mm256_loadu_ps(w + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * p.k + k]), b, acc[r][v]);
    }
  }
  StoreRows8<R>(p, panel, m0, acc);
}
#else
// Portable version: the same per-element FMA chain order (std::fma keeps one rounding per step, like the vector FMA).
template <class Fmt, bool kZeros, int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  float acc[R][kNr] = {};
  const typename Fmt::T* w = static_cast<const typename Fmt::T*>(p.w) + panel * p.k * Fmt::kRow;
  const float* x = p.x + m0 * p.k;
  for (int64_t k = 0; k < p.k; ++k, w += Fmt::kRow) {
    float b[kNr];
    for (int64_t j = 0; j < kNr; ++j) b[j] = w[j];
    for (int r = 0; r < R; ++r) {
      const float a = x[r * p.k + k];
      for (int64_t j = 0; j < kNr; ++j) acc[r][j] = std::fma(a, b[j], acc[r][j]);
    }
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], cols * sizeof(float));
}
#endif

// bf16: a panel holds its k rows in pairs, [K / 2][32 columns][2 k] (then, for an odd K, the last row [32] alone),
// so one 32-bit lane holds a column's two weights of a pair, as vdpbf16ps takes them. Per pair and row, with x's
// pair broadcast: acc = fma(x[2kq + 1], w[2kq + 1], acc), then acc = fma(x[2kq], w[2kq], acc) -- vdpbf16ps's order
// (each product of two bf16 is exact in f32), measured on this machine kind to be bit for bit two FMAs in that
// order; the other paths do exactly that. An odd K's last row: one FMA with the widened weight.
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
inline __m512 PairFma(__m512 acc, __m512i x2, __m512i w2) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x2, (__m512bh)w2);
}
#else
inline __m512 PairFma(__m512 acc, __m512i x2, __m512i w2) {  // the same two FMAs, on widened halves
  const __m512i lo = _mm512_set1_epi32(0xFFFF0000);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x2, lo)), _mm512_castsi512_ps(_mm512_and_si512(w2, lo)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x2, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(w2, 16)),
                         acc);
}
#endif

// An odd K's last k row (after the pairs, at w): one FMA per row with the widened weights; x_of(r) is row r's x.
template <int R, class XOf>
inline void OddRow(const uint16_t* w, __m512* acc0, __m512* acc1, XOf x_of) {
  const auto widen = [](const uint16_t* q) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)q)), 16));
  };
  const __m512 b0 = widen(w), b1 = widen(w + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(x_of(r));
    acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
    acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
  }
}

template <int R>
void PairBlock(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + panel * p.k * kNr;
  const int64_t pairs = p.k / 2, words = (p.k + 1) / 2;
  const uint32_t* xb = p.xb + m0 * words;
  for (int64_t kq = 0; kq < pairs; ++kq, w += 2 * kNr) {
    Prefetch<2 * kNr * sizeof(uint16_t)>(w);
    const __m512i b0 = _mm512_loadu_si512(w), b1 = _mm512_loadu_si512(w + kNr);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(xb[r * words + kq]));
      acc0[r] = PairFma(acc0[r], a, b0);
      acc1[r] = PairFma(acc1[r], a, b1);
    }
  }
  if (p.k % 2) {
    OddRow<R>(w, acc0, acc1, [&](int r) { return Bf16::Widen(static_cast<uint16_t>(xb[r * words + pairs])); });
  }
  StoreRows<R>(p, panel, m0, acc0, acc1);
}

// The bf16 panels with f32 FMAs (`Bf16Fma`): per k pair, the two weight vectors are widened once (4 vectors: the
// pair's odd and even k, columns 0-15 and 16-31) for all R rows, then per row the two FMAs vdpbf16ps does, in its
// order, on x's rounded values widened once per call (p.xw): the same bits. Two FMAs per pair and lane instead of
// one vdpbf16ps, but where vdpbf16ps issues at a quarter of the FMA rate it does twice the work per cycle once the
// widening is shared by enough rows (`Bf16AsFma`).
template <int R>
void WideBlock(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + panel * p.k * kNr;
  const int64_t pairs = p.k / 2;
  const float* x = p.xw + m0 * p.k;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kq = 0; kq < pairs; ++kq, w += 2 * kNr) {
    Prefetch<2 * kNr * sizeof(uint16_t)>(w);
    const __m512i b0 = _mm512_loadu_si512(w), b1 = _mm512_loadu_si512(w + kNr);
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(b0, high));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(b1, high));
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(b0, 16));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16));
    for (int r = 0; r < R; ++r) {
      const __m512 xo = _mm512_set1_ps(x[r * p.k + 2 * kq + 1]), xe = _mm512_set1_ps(x[r * p.k + 2 * kq]);
      acc0[r] = _mm512_fmadd_ps(xe, even0, _mm512_fmadd_ps(xo, odd0, acc0[r]));
      acc1[r] = _mm512_fmadd_ps(xe, even1, _mm512_fmadd_ps(xo, odd1, acc1[r]));
    }
  }
  if (p.k % 2) OddRow<R>(w, acc0, acc1, [&](int r) { return x[r * p.k + pairs * 2]; });
  StoreRows<R>(p, panel, m0, acc0, acc1);
}
#elif defined(JAXSERVE_AVX2_FLOAT)
// AVX2: per k pair and vector of 8 columns, the weights' odd and even k widened once for the R rows, then the two
// FMAs of PairFma's order on x's pair split the same way.
template <int R>
void PairBlock(const Problem& p, int64_t panel, int64_t m0) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + panel * p.k * kNr;
  const int64_t pairs = p.k / 2, words = (p.k + 1) / 2;
  const uint32_t* xb = p.xb + m0 * words;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kq = 0; kq < pairs; ++kq, w += 2 * kNr) {
    __m256 xo[R], xe[R];
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_set1_epi32(static_cast<int>(xb[r * words + kq]));
      xo[r] = _mm256_castsi256_ps(_mm256_and_si256(a, high));
      xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    }
    for (int v = 0; v < 4; ++v) {
      const __m256i b = _mm256_loadu_si256((const __m256i*)(w + 16 * v));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(b, high));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
      for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(xe[r], even, _mm256_fmadd_ps(xo[r], odd, acc[r][v]));
    }
  }
  if (p.k % 2) {  // the last k row alone: one FMA per row with the widened weights
    for (int v = 0; v < 4; ++v) {
      const __m256 b = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + 8 * v))), 16));
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(Bf16::Widen(static_cast<uint16_t>(xb[r * words + pairs])));
        acc[r][v] = _mm256_fmadd_ps(a, b, acc[r][v]);
      }
    }
  }
  StoreRows8<R>(p, panel, m0, acc);
}

// AVX2, the FMA path for products of more rows (`Bf16AsFma`): R rows against one half of the panel (16 columns,
// one 64-byte line per k pair) at a time, x's rounded values (p.xw) broadcast from memory. Per k pair 16 FMAs for 2
// loads and 4 widening operations, where PairBlock spends 8 widening and 6 splitting operations on x per 16 FMAs.
// The same FMAs in the same order per output, so the same bits as PairBlock.
template <int R>
void WideBlock(const Problem& p, int64_t panel, int64_t m0) {
  __m256 out[R][4];
  const uint16_t* panel_w = static_cast<const uint16_t*>(p.w) + panel * p.k * kNr;
  const int64_t pairs = p.k / 2;
  const float* x = p.xw + m0 * p.k;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint16_t* w = panel_w + 32 * h;
    for (int64_t kq = 0; kq < pairs; ++kq, w += 2 * kNr) {
      const __m256i b0 = _mm256_loadu_si256((const __m256i*)w), b1 = _mm256_loadu_si256((const __m256i*)(w + 16));
      const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(b0, high));
      const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(b1, high));
      const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(b0, 16));
      const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(b1, 16));
      for (int r = 0; r < R; ++r) {
        const __m256 xo = _mm256_broadcast_ss(x + r * p.k + 2 * kq + 1), xe = _mm256_broadcast_ss(x + r * p.k + 2 * kq);
        acc[r][0] = _mm256_fmadd_ps(xe, even0, _mm256_fmadd_ps(xo, odd0, acc[r][0]));
        acc[r][1] = _mm256_fmadd_ps(xe, even1, _mm256_fmadd_ps(xo, odd1, acc[r][1]));
      }
    }
    if (p.k % 2) {  // the last k row: 32 bf16, one per column
      const uint16_t* last = panel_w + pairs * 2 * kNr + 16 * h;
      for (int v = 0; v < 2; ++v) {
        const __m256 b = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(last + 8 * v))), 16));
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * p.k + 2 * pairs]), b, acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) out[r][2 * h] = acc[r][0], out[r][2 * h + 1] = acc[r][1];
  }
  StoreRows8<R>(p, panel, m0, out);
}
#else
template <int R>
void PairBlock(const Problem& p, int64_t panel, int64_t m0) {
  float acc[R][kNr] = {};
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + panel * p.k * kNr;
  const int64_t pairs = p.k / 2, words = (p.k + 1) / 2;
  for (int64_t kq = 0; kq < pairs; ++kq, w += 2 * kNr) {
    for (int r = 0; r < R; ++r) {
      const uint32_t x2 = p.xb[(m0 + r) * words + kq];
      const float x0 = Bf16::Widen(static_cast<uint16_t>(x2)), x1 = Bf16::Widen(static_cast<uint16_t>(x2 >> 16));
      for (int64_t j = 0; j < kNr; ++j) {
        acc[r][j] = std::fma(x1, Bf16::Widen(w[2 * j + 1]), acc[r][j]);
        acc[r][j] = std::fma(x0, Bf16::Widen(w[2 * j]), acc[r][j]);
      }
    }
  }
  if (p.k % 2) {
    for (int r = 0; r < R; ++r) {
      const float a = Bf16::Widen(static_cast<uint16_t>(p.xb[(m0 + r) * words + pairs]));
      for (int64_t j = 0; j < kNr; ++j) acc[r][j] = std::fma(a, Bf16::Widen(w[j]), acc[r][j]);
    }
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], cols * sizeof(float));
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Integer formats. kQuad = bytes per 4 k of a panel; `Value(w, j, i)` = column j's unsigned weight byte at k = 4 kq
// + i of the quad at w (portable path); `Load` gives the two u8 vectors (columns 0-15 and 16-31, 4 k per lane).
// kMr = 6: 2 int32 + 2 f32 accumulators per row + 2 weights + scales and zeros + a broadcast <= 32 registers.
#if !defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_AVX2_INT 1  // the integer blocks below take their AVX2 form
constexpr int64_t kIntMr = 2;  // AVX2: 4 s32 (or s16) sums + 4 f32 accumulators per row, in 16 registers
#else
constexpr int64_t kIntMr = 6;
#endif

struct Int8 {  // lane j of vector h: column 16 h + j, bytes = q + 128 at k = 4 kq .. 4 kq + 3
  using T = int8_t;
  static constexpr int64_t kQuad = 128, kMr = kIntMr, kWidenFlops = 2;
  static constexpr bool kInt = true, kOffset = true;
  static int32_t Value(const uint8_t* w, int64_t j, int64_t i) { return w[4 * j + i]; }
#if defined(__AVX512VNNI__)
  static void Load(const uint8_t* w, __m512i& lo, __m512i& hi) {
    lo = _mm512_loadu_si512(w);
    hi = _mm512_loadu_si512(w + 64);
  }
#endif
};

struct Int4 {  // byte [j][i]: column j (k = 4 kq + i) in the low nibble, column j + 16 in the high nibble
  using T = uint8_t;
  static constexpr int64_t kQuad = 64, kMr = kIntMr, kWidenFlops = 3;
  static constexpr bool kInt = true, kOffset = false;
  static int32_t Value(const uint8_t* w, int64_t j, int64_t i) {
    return j < 16 ? w[4 * j + i] & 15 : w[4 * (j - 16) + i] >> 4;
  }
#if defined(__AVX512VNNI__)
  static void Load(const uint8_t* w, __m512i& lo, __m512i& hi) {
    const __m512i v = _mm512_loadu_si512(w), mask = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(v, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
#endif
};

// One row of x [K] -> xq [K], d [K / 32], and per sub-block of `sub` k: off = -128 * sum(xq) (or 0 without the int8
// offset) and zx = float(sum(xq)) * d. Every operation is exact or one correctly rounded f32 operation, so the
// vector and portable versions agree bit for bit (and with `quantize_activations`).
void QuantizeRow(const float* x, int64_t k, int64_t sub, bool offset, int8_t* xq, float* d, int32_t* off,
                 float* zx) {
  for (int64_t b = 0; b < k / kBlock; ++b, x += kBlock, xq += kBlock) {
    int32_t sums[2];  // sum(xq) over each half (16 k) of the block
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(db > 0 ? 1.0f / db : 0.0f);
    const __m512i lim = _mm512_set1_epi32(127);
    const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inv),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inv),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    _mm_storeu_si128((__m128i*)xq, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(xq + 16), _mm512_cvtepi32_epi8(q1));
    sums[0] = _mm512_reduce_add_epi32(q0), sums[1] = _mm512_reduce_add_epi32(q1);
#elif defined(__AVX2__)
    __m256 v[4], amax8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float db = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(db > 0 ? 1.0f / db : 0.0f);
    const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {  // vcvtps2dq rounds to nearest even (the default MXCSR), as nearbyint does
      q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lim), neg);
    }
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)xq, bytes);
    for (int h = 0; h < 2; ++h) {
      __m256i t = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
    }
#else
    float amax = 0;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float db = amax / 127.0f;
    const float inv = db > 0 ? 1.0f / db : 0.0f;
    sums[0] = sums[1] = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = std::nearbyint(x[i] * inv);  // the default rounding mode: to nearest, ties to even
      const int32_t q = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
      xq[i] = static_cast<int8_t>(q);
      sums[i / 16] += q;
    }
#endif
    d[b] = db;
    for (int64_t h = 0; h < kBlock / sub; ++h) {
      const int32_t s = sub == kBlock ? sums[0] + sums[1] : sums[h];
      *off++ = offset ? -128 * s : 0;
      *zx++ = static_cast<float>(s) * db;
    }
  }
}

// Scale (and zero) storage: f32, or f16 when every scale and zero of the weight is exactly an f16 (then widened
// exactly: the f32 arithmetic that follows is the same, so are the results). `Half` is the portable widening.
using Half = uint16_t;

inline float HalfToFloat(Half h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else {  // zero or subnormal: mant * 2^-24, exact in f32
    float f = static_cast<float>(mant) * 0x1p-24f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float ScaleValue(float s) { return s; }
inline float ScaleValue(Half s) { return HalfToFloat(s); }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
inline __m512 LoadScales(const float* s) { return _mm512_loadu_ps(s); }
inline __m512 LoadScales(const Half* s) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s)); }

// Rows [m0, m0 + R) x panel p, sub-blocks of kSub k (a constant: the k loop unrolls, the accumulators stay put).
// ST: the scales' storage type (float or Half). The panel is one sequential stream: per group, its head (32 scales,
// then 32 zeros), then its quants.
template <class Fmt, bool kZeros, int64_t kSub, class ST, int R>
void IntBlock(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const int64_t groups = p.k / p.group, subs = p.group / kSub, nsub = p.k / kSub, nblk = p.k / kBlock;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + panel * groups * p.group_bytes;
  for (int64_t g = 0, sb = 0; g < groups; ++g) {
    const ST* s = reinterpret_cast<const ST*>(w);
    const __m512 s0 = LoadScales(s), s1 = LoadScales(s + 16);
    __m512 z0, z1;
    if constexpr (kZeros) z0 = LoadScales(s + kNr), z1 = LoadScales(s + kNr + 16);
    Prefetch<(kZeros ? 2 : 1) * kNr * sizeof(ST)>(w);
    w += p.head_bytes;
    for (int64_t j = 0; j < subs; ++j, ++sb) {
      const int64_t k0 = sb * kSub;
      // int32 sums; with few rows, even and odd quads go to separate sums (kChains), added at the end (exact):
      // more independent vpdpbusd chains to cover their latency.
      constexpr int kChains = R <= 2 ? 2 : 1;
      __m512i i0[kChains][R], i1[kChains][R];
      for (int r = 0; r < R; ++r) {
        i0[0][r] = i1[0][r] = Fmt::kOffset ? _mm512_set1_epi32(p.xoff[(m0 + r) * nsub + sb]) : _mm512_setzero_si512();
        for (int c = 1; c < kChains; ++c) i0[c][r] = i1[c][r] = _mm512_setzero_si512();
      }
      const int8_t* xq = p.xq + m0 * p.k + k0;
#pragma GCC unroll 8
      for (int64_t kq = 0; kq < kSub; kq += 4, w += Fmt::kQuad) {
        __m512i b0, b1;
        Prefetch<Fmt::kQuad>(w);
        Fmt::Load(w, b0, b1);
        const int c = (kq / 4) % kChains;
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * p.k + kq, sizeof four);
          const __m512i a = _mm512_set1_epi32(four);
          i0[c][r] = _mm512_dpbusd_epi32(i0[c][r], b0, a);
          i1[c][r] = _mm512_dpbusd_epi32(i1[c][r], b1, a);
        }
      }
      for (int c = 1; c < kChains; ++c) {
        for (int r = 0; r < R; ++r) {
          i0[0][r] = _mm512_add_epi32(i0[0][r], i0[c][r]);
          i1[0][r] = _mm512_add_epi32(i1[0][r], i1[c][r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(p.xd[(m0 + r) * nblk + k0 / kBlock]);
        acc0[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i0[0][r]), dx), s0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i1[0][r]), dx), s1, acc1[r]);
        if constexpr (kZeros) {
          const __m512 zx = _mm512_set1_ps(p.xz[(m0 + r) * nsub + sb]);
          acc0[r] = _mm512_fmadd_ps(zx, z0, acc0[r]);
          acc1[r] = _mm512_fmadd_ps(zx, z1, acc1[r]);
        }
      }
    }
  }
  StoreRows<R>(p, panel, m0, acc0, acc1);
}
#elif defined(JAXSERVE_AVX2_INT)
// AVX2 without VNNI (e.g. AMD Zen 2 / 3): the same exact int32 sums from vpmaddubsw (u8 x s8 -> s16 pairs) and
// vpmaddwd (s16 pairs -> s32), then the same float epilogue as above, so the same bits. A panel's 32 columns are 4
// vectors of 8 (int8: 4 loads of a quad; int4: one 64-byte quad's low nibbles are columns 0-15, its high ones 16-31).
//   int4: u8 weights (0..15) x s8 activations: a pair sums to at most 2 x 15 x 127 = 3,810 in magnitude, so a whole
//         sub-block (at most 8 quads: 30,480) adds up in s16 lanes, widened once per sub-block.
//   int8: the weights are q + 128 (u8, for vpdpbusd); vpmaddubsw would saturate on them, so the signed q = byte ^
//         0x80 is taken apart as |q| (u8: 128 stays 128) times x with q's sign (|x| <= 127: no overflow), and a pair
//         sums to at most 2 x 128 x 127 = 32,512; without the + 128 there is no offset to remove, and sum(q x) is
//         the same integer as sum((q + 128) x) - 128 sum(x).
// Measured on an AMD EPYC (Zen 3, AVX2 only, 32 MiB L3) VM, M = 1 on cold weights (`bench --cold`, medians, the
// first version of these blocks), us per call before (the portable loops) -> after: int4 G = 32 + zeros 576 x 576
// 105.5 -> 24.4, 576 x 960 176.1 -> 39.2, 576 x 3072 560.8 -> 59.8, 1536 x 576 280.4 -> 43.4; int8 G = 32 52.1 ->
// 30.2, 78.7 -> 39.1, 215.6 -> 80.4, 118.1 -> 54.5, 576 x 49152 3312 -> 1045 (2.0 -> 18.5 GB/s for int4 at
// 576 x 3072). The default model's batch-1 decode (gguf): 21 -> 88 tok/s.
inline __m256 LoadScales8(const float* s) { return _mm256_loadu_ps(s); }
inline __m256 LoadScales8(const Half* s) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)); }

template <class Fmt, bool kZeros, int64_t kSub, class ST, int R>
void IntBlock(const Problem& p, int64_t panel, int64_t m0) {
  static_assert(kSub / 4 * 2 * 15 * 127 <= 32767, "int4's s16 sums of a sub-block must not overflow");
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const int64_t groups = p.k / p.group, subs = p.group / kSub, nsub = p.k / kSub, nblk = p.k / kBlock;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + panel * groups * p.group_bytes;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(-128);
  for (int64_t g = 0, sb = 0; g < groups; ++g) {
    const ST* head = reinterpret_cast<const ST*>(w);
    __m256 s[4], z[4];
    for (int v = 0; v < 4; ++v) {
      s[v] = LoadScales8(head + 8 * v);
      if constexpr (kZeros) z[v] = LoadScales8(head + kNr + 8 * v);
    }
    w += p.head_bytes;
    for (int64_t j = 0; j < subs; ++j, ++sb) {
      const int64_t k0 = sb * kSub;
      __m256i isum[R][4];  // int8: s32 sums; int4: s16 pair sums until the sub-block's end
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < 4; ++v) isum[r][v] = _mm256_setzero_si256();
      }
      const int8_t* xq = p.xq + m0 * p.k + k0;
#pragma GCC unroll 8
      for (int64_t kq = 0; kq < kSub; kq += 4, w += Fmt::kQuad) {
        __m256i a[R];  // each row's 4 activations, in every lane
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * p.k + kq, sizeof four);
          a[r] = _mm256_set1_epi32(four);
        }
        // The asm statements keep each sum in a register, added in place: without them GCC stored every product of
        // the unrolled sub-block to the stack and summed them afterwards (R = 2: 64 spills per sub-block).
        if constexpr (std::is_same_v<Fmt, Int4>) {
          const __m256i v0 = _mm256_loadu_si256((const __m256i*)w), v1 = _mm256_loadu_si256((const __m256i*)(w + 32));
          const __m256i b[4] = {_mm256_and_si256(v0, nibble), _mm256_and_si256(v1, nibble),
                                _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
                                _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble)};
          for (int r = 0; r < R; ++r) {
            for (int v = 0; v < 4; ++v) {
              isum[r][v] = _mm256_add_epi16(isum[r][v], _mm256_maddubs_epi16(b[v], a[r]));
              __asm__("" : "+x"(isum[r][v]));
            }
          }
        } else {
          // One vector of weights at a time, its magnitude taken once for the R rows: fewer live registers than
          // all four vectors' (hot 576 x 1536, two builds alternating in one process: M = 16 0.89-1.03x the time,
          // median of 8 runs 0.95x; M = 2 0.92-0.96x; M = 1 cold the same).
          for (int v = 0; v < 4; ++v) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + 32 * v)), flip);
            const __m256i mag = _mm256_abs_epi8(q);
            for (int r = 0; r < R; ++r) {
              const __m256i pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(a[r], q));
              isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(pairs, ones));
              __asm__("" : "+x"(isum[r][v]));
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(p.xd[(m0 + r) * nblk + k0 / kBlock]);
        for (int v = 0; v < 4; ++v) {
          const __m256i i32 = std::is_same_v<Fmt, Int4> ? _mm256_madd_epi16(isum[r][v], ones) : isum[r][v];
          acc[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i32), dx), s[v], acc[r][v]);
          if constexpr (kZeros) acc[r][v] = _mm256_fmadd_ps(_mm256_set1_ps(p.xz[(m0 + r) * nsub + sb]), z[v], acc[r][v]);
        }
      }
    }
  }
  StoreRows8<R>(p, panel, m0, acc);
}
#else
// Portable version: the same exact integer sums and the same float operations in the same order.
template <class Fmt, bool kZeros, int64_t kSub, class ST, int R>
void IntBlock(const Problem& p, int64_t panel, int64_t m0) {
  float acc[R][kNr] = {};
  const int64_t groups = p.k / p.group, subs = p.group / kSub, nsub = p.k / kSub, nblk = p.k / kBlock;
  const uint8_t* w = static_cast<const uint8_t*>(p.w) + panel * groups * p.group_bytes;
  for (int64_t g = 0, sb = 0; g < groups; ++g) {
    float s[kNr], z[kNr];
    const ST* head = reinterpret_cast<const ST*>(w);
    for (int64_t c = 0; c < kNr; ++c) s[c] = ScaleValue(head[c]);
    if constexpr (kZeros) {
      for (int64_t c = 0; c < kNr; ++c) z[c] = ScaleValue(head[kNr + c]);
    }
    w += p.head_bytes;
    for (int64_t j = 0; j < subs; ++j, ++sb) {
      const int64_t k0 = sb * kSub;
      int32_t isum[R][kNr];
      for (int r = 0; r < R; ++r) {
        for (int64_t c = 0; c < kNr; ++c) isum[r][c] = p.xoff[(m0 + r) * nsub + sb];
      }
      for (int64_t kq = 0; kq < kSub; kq += 4, w += Fmt::kQuad) {
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = p.xq + (m0 + r) * p.k + k0 + kq;
          for (int64_t c = 0; c < kNr; ++c) {
            for (int64_t i = 0; i < 4; ++i) isum[r][c] += Fmt::Value(w, c, i) * int32_t{xq[i]};
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const float dx = p.xd[(m0 + r) * nblk + k0 / kBlock];
        for (int64_t c = 0; c < kNr; ++c) {
          const float t = static_cast<float>(isum[r][c]) * dx;
          acc[r][c] = std::fma(t, s[c], acc[r][c]);
          if constexpr (kZeros) acc[r][c] = std::fma(p.xz[(m0 + r) * nsub + sb], z[c], acc[r][c]);
        }
      }
    }
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], cols * sizeof(float));
}
#endif

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

template <class Fmt, bool kZeros, int64_t kSub, class ST, int... Rs>
constexpr auto MakeBlockTable(std::integer_sequence<int, Rs...>) {
  if constexpr (Fmt::kInt) {
    return std::array<BlockFn, sizeof...(Rs)>{&IntBlock<Fmt, kZeros, kSub, ST, Rs + 1>...};
  } else if constexpr (std::is_same_v<Fmt, Bf16>) {
    return std::array<BlockFn, sizeof...(Rs)>{&PairBlock<Rs + 1>...};
  } else if constexpr (std::is_same_v<Fmt, Bf16Fma>) {
#if defined(__AVX512F__) || defined(JAXSERVE_AVX2_FLOAT)
    return std::array<BlockFn, sizeof...(Rs)>{&WideBlock<Rs + 1>...};
#else
    return std::array<BlockFn, sizeof...(Rs)>{&PairBlock<Rs + 1>...};  // never chosen (Bf16AsFma)
#endif
  } else {
    return std::array<BlockFn, sizeof...(Rs)>{&Block<Fmt, kZeros, Rs + 1>...};
  }
}

// kSub: the integer formats' sub-block (32, or 16 when G is not a multiple of 32), ST their scales' storage type;
// both unused by the float formats.
template <class Fmt, bool kZeros, int64_t kSub = kBlock, class ST = float>
void Panels(const Problem& p, int64_t begin, int64_t end) {
  static constexpr auto blocks_of =
      MakeBlockTable<Fmt, kZeros, kSub, ST>(std::make_integer_sequence<int, static_cast<int>(Fmt::kMr)>{});
  for (int64_t panel = begin; panel < end; ++panel) {
    // Row blocks of near-equal size (16 rows: 8 + 8, not 12 + 4): a short block has too few accumulators to hide
    // the FMA latency.
    const int64_t blocks = (p.m + Fmt::kMr - 1) / Fmt::kMr;
    for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
      const int64_t rows = (p.m - m0 + (blocks - b) - 1) / (blocks - b);
      blocks_of[rows - 1](p, panel, m0);
      m0 += rows;
    }
  }
}

using PanelsFn = void (*)(const Problem&, int64_t, int64_t);

struct Shared {
  Problem p;
  PanelsFn panels_fn;
  int64_t panels_per_task = 1, tasks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Work() {
    int64_t finished = 0;
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t begin = t * panels_per_task;
      panels_fn(p, begin, std::min(p.panels, begin + panels_per_task));
      ++finished;
    }
    if (finished && done.fetch_add(finished, std::memory_order_acq_rel) + finished == tasks) {
      std::lock_guard<std::mutex> lock(mu);
      all_done.notify_all();
    }
  }

  // Until every task has run. `spin` (short products): polls the counter, as a sleep's wake-up costs more than such
  // a product's second half saves; the caller only waits for tasks a helper has taken (it runs the rest itself), so
  // at most one task's time, and past kSpinPolls polls it yields its core, in case that helper was descheduled.
  // Otherwise it sleeps, as before: a long wait spun would take the core from the host thread building the next
  // step (batch-16 decode spinning measured 1.05x, then 0.90x: within this VM's noise, so not changed).
  void Wait(bool spin) {
    if (!spin) {
      std::unique_lock<std::mutex> lock(mu);
      all_done.wait(lock, [&] { return done.load() == tasks; });
      return;
    }
    for (int64_t polls = 0; done.load(std::memory_order_acquire) != tasks; ++polls) {
      if (polls < kSpinPolls) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
};

using Dims = ffi::Span<const int64_t>;

// Checks the shapes (float formats: x [M, K], w [P, K, 32], y [M, N]; integer formats: w [P, K / G, head + G / 4 *
// kQuad] with head = 32 scales (+ 32 zeros) of `scale_bytes` each) and fills `p`'s sizes.
template <class Fmt>
ffi::Error Shapes(Dims xd, Dims wd, Dims yd, int64_t scale_bytes, bool has_zeros, Problem& p) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("matmul: expected x f32[M, K], w [P, K, 32] (f32, bf16) or [P, K / G, bytes "
                                       "per group] (int8, int4), y f32[M, N]");
  }
  p.m = xd[0], p.k = xd[1], p.n = yd[1], p.panels = wd[0], p.group = p.k;
  if constexpr (Fmt::kInt) {
    if (scale_bytes != 2 && scale_bytes != 4) {
      return ffi::Error::InvalidArgument("matmul: scale_bytes must be 2 (f16) or 4 (f32)");
    }
    if (p.k % kBlock != 0 || wd[1] < 1 || p.k % wd[1] != 0 || (p.k / wd[1]) % 16 != 0) {
      return ffi::Error::InvalidArgument("matmul: expected w [P, K / G, bytes per group] with K a multiple of 32 and "
                                         "G a multiple of 16 dividing K");
    }
    p.group = p.k / wd[1];
    p.sub = p.group % kBlock == 0 ? kBlock : 16;
    p.head_bytes = kNr * scale_bytes * (has_zeros ? 2 : 1);
    p.group_bytes = p.head_bytes + p.group / 4 * Fmt::kQuad;
    if (wd[2] != p.group_bytes) {
      return ffi::Error::InvalidArgument("matmul: w's groups must be 32 scales (+ 32 zeros) of scale_bytes, then G / "
                                         "4 x 128 (int8) or 64 (int4) bytes of quants");
    }
  } else if (wd[2] != kNr || wd[1] != p.k) {
    return ffi::Error::InvalidArgument("matmul: expected w [P, K, 32] for f32 and bf16");
  }
  if (yd[0] != p.m || wd[0] != (p.n + kNr - 1) / kNr) {
    return ffi::Error::InvalidArgument("matmul: shapes disagree (need P = ceil(N / 32) panels and y [M, N])");
  }
  return ffi::Error::Success();
}

// `mac_flops`: cost of one multiply-add per weight and row (2 for an f32 FMA; less for vpdpbusd's 4-way products);
// `widen_flops`: cost per weight of widening or unpacking it.
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p, PanelsFn panels_fn, int64_t mac_flops, int64_t widen_flops) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::memset(p.y, 0, p.m * p.n * sizeof(float));
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->panels_fn = panels_fn;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const bool stream = p.m <= kStreamRows;
  int64_t tasks;
  if (stream) {
    // Bound by the weight's bytes: every core streams a share, whatever the size (a few tasks per core, so a helper
    // that starts late costs little).
    tasks = workers > 1 ? std::min<int64_t>(p.panels, kStreamTasksPerWorker * workers) : 1;
  } else {
    // Tasks of about kTargetTaskFlops: a small product is one task on the calling thread. A larger one gets a
    // multiple of `workers` near-equal tasks, run by the caller and workers - 1 helpers (one thread per pool
    // thread: 3 tasks on 2 cores, or 3 threads on 2 cores, leave one core idle for a third of the time).
    const int64_t panel_flops = (mac_flops * p.m + widen_flops) * p.k * kNr;
    const int64_t per = std::max<int64_t>(1, (kTargetTaskFlops + panel_flops - 1) / panel_flops);
    tasks = (p.panels + per - 1) / per;
    if (tasks > 1) tasks = (tasks + workers - 1) / workers * workers;
  }
  shared->panels_per_task = (p.panels + tasks - 1) / tasks;
  shared->tasks = (p.panels + shared->panels_per_task - 1) / shared->panels_per_task;
  const int64_t helpers = std::min<int64_t>(workers - 1, shared->tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  shared->Wait(/*spin=*/stream);
  return ffi::Error::Success();
}

#if defined(__AVX512BF16__)
// Instructions per second of 12 independent chains of vdpbf16ps (kDp) or vfmadd231ps, accumulators in registers
// (the asm barriers keep the operands from being folded and the results from being dropped). A probe slowed by
// memory traffic would read both rates alike, which chooses vdpbf16ps: the path used before.
template <bool kDp>
__attribute__((noinline)) double ChainRate(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    __asm__ volatile("" : "+v"(a), "+v"(b));
    for (int i = 0; i < 12; ++i) {
      if constexpr (kDp) {
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)b);
      } else {
        acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 0; i < 12; ++i) __asm__ volatile("" : : "v"(acc[i]));
  return 12.0 * static_cast<double>(iters) / std::max(seconds, 1e-9);
}
#endif

// Whether a bf16 product of m rows runs as two FMAs per k pair (`WideBlock`) rather than one vdpbf16ps
// (`PairBlock`); both give the same bits (vdpbf16ps is two FMAs in that order on normal numbers; the tests compare
// the paths bit for bit at 1-40 rows), so a row's result still does not depend on m. Two FMAs win once the widening
// of each k pair is shared by enough rows, where vdpbf16ps issues at less than half the FMA rate: 1.35 vs 5.6 G
// instructions/s per core on an Intel Xeon with AVX512_BF16 (2026-12-05), where a step's bf16 linear maps at 16 / 64
// rows took 35-42 / 89-104 ms against vdpbf16ps's 44-47 / 160-174 (min / median of 9, fresh processes alternating);
// at 1-4 rows (bound by the weight's bytes) vdpbf16ps stays, as it measured ~10% faster at one row. CPUs that run
// vdpbf16ps at the FMA rate keep it throughout. Decided once per process by timing both (~1 ms, best of 3), or by
// the environment: JAXSERVE_MATMUL_BF16=fma | dpbf16 (either at every row count). Without AVX512_BF16 the FMA path
// is the fast one at any m (PairFma would widen per row). AVX2 builds keep PairBlock (x's pairs split per row) up to
// kStreamRows rows: the FMA path with x widened once per call, on the same 2 x 4 register block, measured 1.0-1.4x
// slower at 1 / 2 / 16 rows; above that, the FMA path's own block of 4 rows x 16 columns (AVX2 `WideBlock`) takes
// 0.82-0.99x PairBlock's time (hot 576 x 1536, two builds alternating in one process, AMD EPYC Zen 3, 2026-12-06: 16
// rows 0.87-0.99x over 5 runs, 64 rows 0.82-0.93x over 3; 6 rows x 16 columns measured 1.2-1.4x slower than 4).
bool Bf16AsFma(int64_t m) {
#if defined(JAXSERVE_AVX2_FLOAT)
  return m > kStreamRows;
#elif !defined(__AVX512F__)
  return false;
#elif !defined(__AVX512BF16__)
  return true;
#else
  enum Choice { kProbe, kFma, kDpbf16 };
  static const Choice choice = [] {
    const char* env = std::getenv("JAXSERVE_MATMUL_BF16");
    if (env && std::strcmp(env, "fma") == 0) return kFma;
    if (env && std::strcmp(env, "dpbf16") == 0) return kDpbf16;
    double dp = 0, fma = 0;
    for (int round = 0; round < 3; ++round) {
      dp = std::max(dp, ChainRate<true>(20000));
      fma = std::max(fma, ChainRate<false>(20000));
    }
    return fma > 2.5 * dp ? kProbe : kDpbf16;
  }();
  return choice == kFma || (choice == kProbe && m > kStreamRows);
#endif
}

template <class Fmt, ffi::DataType kType>
ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> w,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p{x.typed_data(), w.typed_data(), y->typed_data()};
  if (auto e = Shapes<Fmt>(x.dimensions(), w.dimensions(), y->dimensions(), 0, false, p); e.failure()) {
    return e;
  }
  if constexpr (std::is_same_v<Fmt, Bf16>) {
    // x rounded once per call, into this thread's scratch (kept between calls).
    if (Bf16AsFma(p.m)) {  // as f32 values; two FMAs per k pair, the weights widened once per pair for all rows
      thread_local std::vector<float> xw;
      if (xw.size() < static_cast<size_t>(p.m * p.k)) xw.resize(p.m * p.k);
      RoundRowsBf16F32(p.x, p.m, p.k, xw.data());
      p.xw = xw.data();
      return Run(pool, p, &Panels<Bf16Fma, false>, 2, 0);
    }
    // As bf16 pairs; vdpbf16ps: 2 multiply-adds per f32 lane and instruction, no widening of the weights.
    thread_local std::vector<uint32_t> scratch;
    const size_t words = static_cast<size_t>(p.m * ((p.k + 1) / 2));
    if (scratch.size() < words) scratch.resize(words);
    RoundRowsBf16(p.x, p.m, p.k, scratch.data());
    p.xb = scratch.data();
    return Run(pool, p, &Panels<Fmt, false>, 1, 0);
  }
  return Run(pool, p, &Panels<Fmt, false>, 2, Fmt::kWidenFlops);
}

template <class Fmt, bool kZeros, class ST>
PanelsFn IntPanels(int64_t sub) {
  return sub == kBlock ? &Panels<Fmt, kZeros, kBlock, ST> : &Panels<Fmt, kZeros, 16, ST>;
}

template <class Fmt, ffi::DataType kType>
ffi::Error QuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> w,
                     ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t scale_bytes, bool has_zeros) {
  Problem p{x.typed_data(), w.typed_data(), y->typed_data()};
  if (auto e = Shapes<Fmt>(x.dimensions(), w.dimensions(), y->dimensions(), scale_bytes, has_zeros, p);
      e.failure()) {
    return e;
  }
  // x quantized once per call (on the calling thread: ~M K / 16 vector steps, small next to the product), into
  // this thread's scratch (kept between calls: no allocation per call at decode): xq s8[M, K], then 4-byte arrays
  // d f32[M, K / 32], off s32[M, K / sub], zx f32[M, K / sub].
  const int64_t nblk = p.k / kBlock, nsub = p.k / p.sub;
  thread_local std::vector<int32_t> scratch;
  const size_t words = static_cast<size_t>((p.m * p.k + 3) / 4 + p.m * (nblk + 2 * nsub));
  if (scratch.size() < words) scratch.resize(words);
  int8_t* xq = reinterpret_cast<int8_t*>(scratch.data());
  float* xd = reinterpret_cast<float*>(scratch.data() + (p.m * p.k + 3) / 4);
  int32_t* xoff = reinterpret_cast<int32_t*>(xd + p.m * nblk);
  float* xz = reinterpret_cast<float*>(xoff + p.m * nsub);
  for (int64_t m = 0; m < p.m; ++m) {
    QuantizeRow(p.x + m * p.k, p.k, p.sub, Fmt::kOffset, xq + m * p.k, xd + m * nblk, xoff + m * nsub,
                xz + m * nsub);
  }
  p.xq = xq, p.xd = xd, p.xoff = xoff, p.xz = xz;
  // vpdpbusd: 64 multiply-adds per instruction (4 per f32 FMA lane), plus a per-sub-block epilogue.
  const PanelsFn panels_fn =
      scale_bytes == 2 ? (has_zeros ? IntPanels<Fmt, true, Half>(p.sub) : IntPanels<Fmt, false, Half>(p.sub))
                       : (has_zeros ? IntPanels<Fmt, true, float>(p.sub) : IntPanels<Fmt, false, float>(p.sub));
  return Run(pool, p, panels_fn, 1, Fmt::kWidenFlops);
}

}  // namespace

#define JAXSERVE_DENSE(symbol, Fmt, type)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, (DenseImpl<Fmt, type>),                     \
                                ffi::Ffi::Bind()                                    \
                                    .Ctx<ffi::ThreadPool>()                         \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */           \
                                    .Arg<ffi::Buffer<type>>()     /* w (packed) */  \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y */

#define JAXSERVE_QUANT(symbol, Fmt, type)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, (QuantImpl<Fmt, type>),                      \
                                ffi::Ffi::Bind()                                     \
                                    .Ctx<ffi::ThreadPool>()                          \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* x */            \
                                    .Arg<ffi::Buffer<type>>()     /* w (packed) */   \
                                    .Ret<ffi::Buffer<ffi::F32>>() /* y */            \
                                    .Attr<int32_t>("scale_bytes")                    \
                                    .Attr<bool>("has_zeros"));

JAXSERVE_DENSE(JaxserveMatmul, F32, ffi::F32)
JAXSERVE_DENSE(JaxserveMatmulBf16, Bf16, ffi::BF16)
JAXSERVE_QUANT(JaxserveMatmulInt8, Int8, ffi::S8)
JAXSERVE_QUANT(JaxserveMatmulInt4, Int4, ffi::U8)
