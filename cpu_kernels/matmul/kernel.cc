// Matmul for the CPU backend over pre-packed weights in four formats, as XLA FFI custom calls:
// y f32[M, N] = x f32[M, K] @ W[K, N], W stored as f32, bf16, int8 or 4-bit with group-wise scales and zeros.
//
// Why not XLA's dot: a decode step multiplies a handful of rows (M = the batch) by every weight matrix, and XLA:CPU
// reaches about a third of the machine's FMA peak at M = 16 on SmolLM2's shapes; at M = 1 the step is bound by the
// bytes of weight it streams, so a weight in fewer bytes is a faster step. This is the plain register-blocked loop
// that small M wants (the weights are read once per row block, from a layout made for it):
//
//   * W arrives pre-packed (`pack`, `pack_quantized` in __init__.py) in panels of kNr = 32 columns, zero-padded past
//     N: [P = ceil(N / 32), K, row] where one k row of a panel holds the panel's 32 columns in
//       f32   float[32]     (128 bytes)
//       bf16  uint16[32]    ( 64 bytes; bf16 bits)
//       int8  int8[32]      ( 32 bytes)
//       int4  uint8[16]     ( 16 bytes; byte j = column j in its low nibble, column j + 16 in its high nibble)
//     so a panel is one sequential stream. int8 and int4 also take scales and zeros f32[P, K / G, 32] (groups of G
//     along K; no zeros = none added): w[k, n] = float(q[k, n]) * scale + zero, the product rounded to f32, then
//     the sum (two roundings, not an FMA: the same values as the Python reference `PackedLinear.unpack`).
//   * A task is a run of panels. For each panel and each block of up to kMr rows of x, the accumulators
//     (rows x 2 vectors of 16) live in registers for the whole k loop: per k, the 32 weights are widened to f32 in
//     two registers (and dequantized with the group's scales and zeros, also in registers), then one broadcast FMA
//     pair per row. The panel stays in L2 between row blocks.
//   * Every y[m, n] is the same sequential FMA chain over k = 0..K-1 from 0, against the same dequantized weights,
//     whatever M, the row block or the thread: a row's result does not depend on what else is in the batch (batch
//     invariance, bit for bit), and equals the f32 kernel's result on the unpacked weight.
//   * Tasks run on XLA's intra-op thread pool, handed out by an atomic counter; the calling thread works too.
//
// Measured and not kept: summing x * q over a group and applying the scale (and zero x the group's sum of x) once at
// the group's end -- no faster at M = 1 (the stream, not the widening, is the limit on the logits' 576 x 49152),
// up to 30% slower at M = 16 (a second set of accumulators halves the row block), and no longer the f32 kernel's
// values. Not tried: vdpbf16ps for bf16, which needs x rounded to bf16 (errors ~1e-3 instead of ~1e-6; x split
// into two bf16 halves takes as many instructions per weight as widening the weight does).
//
// Targets (inputs; the output is y f32[M, N], N its second dimension):
//   JaxserveMatmul      x f32[M, K], w f32[P, K, 32]
//   JaxserveMatmulBf16  x f32[M, K], w bf16[P, K, 32]
//   JaxserveMatmulInt8  x f32[M, K], w s8[P, K, 32], scales f32[P, K / G, 32], zeros f32[P, K / G, 32] or f32[0]
//   JaxserveMatmulInt4  x f32[M, K], w u8[P, K, 16], scales, zeros as for int8

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNr = 32;  // columns per packed panel
constexpr int64_t kTargetTaskFlops = int64_t{1} << 21;  // ~25 us of work: enough to amortize a task hand-out

struct Problem {
  const float* x;       // f32[M, K]
  const void* w;        // panels, the format's storage type
  const float* scales;  // f32[P, K / G, 32] (int8, int4) or null
  const float* zeros;   // f32[P, K / G, 32] or null (no zeros)
  float* y;             // f32[M, N]
  int64_t m, k, n, panels, group;  // group = K for the float formats
};

// The formats: storage type, elements per k row of a panel, whether scales apply, and the widening of one k row to
// 32 floats (two vectors: columns 0-15 and 16-31; `Value` is the scalar version for the portable path). kMr = rows
// of x per register block: 2 kMr accumulators + 2 weight vectors (+ 4 scale/zero vectors) + a broadcast <= 32.
struct F32 {
  using T = float;
  static constexpr int64_t kRow = 32, kMr = 12, kWidenFlops = 0;
  static constexpr bool kQuant = false;
  static float Value(const T* w, int64_t j) { return w[j]; }
#if defined(__AVX512F__)
  static void Widen(const T* w, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(w);
    hi = _mm512_loadu_ps(w + 16);
  }
#endif
};

struct Bf16 {  // a bf16 is the top half of an f32: shifting its bits left by 16 widens it exactly
  using T = uint16_t;
  static constexpr int64_t kRow = 32, kMr = 12, kWidenFlops = 2;
  static constexpr bool kQuant = false;
  static float Value(const T* w, int64_t j) {
    const uint32_t bits = uint32_t{w[j]} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
#if defined(__AVX512F__)
  static void Widen(const T* w, __m512& lo, __m512& hi) {
    const auto load = [](const T* p) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    };
    lo = load(w);
    hi = load(w + 16);
  }
#endif
};

struct Int8 {
  using T = int8_t;
  static constexpr int64_t kRow = 32, kMr = 12, kWidenFlops = 4;
  static constexpr bool kQuant = true;
  static float Value(const T* w, int64_t j) { return static_cast<float>(w[j]); }
#if defined(__AVX512F__)
  static void Widen(const T* w, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
  }
#endif
};

struct Int4 {  // byte j of a k row: column j in the low nibble, column j + 16 in the high nibble
  using T = uint8_t;
  static constexpr int64_t kRow = 16, kMr = 12, kWidenFlops = 4;
  static constexpr bool kQuant = true;
  static float Value(const T* w, int64_t j) { return static_cast<float>(j < 16 ? w[j] & 15 : w[j - 16] >> 4); }
#if defined(__AVX512F__)
  static void Widen(const T* w, __m512& lo, __m512& hi) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)w));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
#endif
};

#if defined(__AVX512F__)
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Rows [m0, m0 + R) x panel p. R is a compile-time constant so the accumulators are registers.
template <class Fmt, bool kZeros, int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const int64_t groups = p.k / p.group;
  const typename Fmt::T* w = static_cast<const typename Fmt::T*>(p.w) + panel * p.k * Fmt::kRow;
  const float* s = Fmt::kQuant ? p.scales + panel * groups * kNr : nullptr;
  const float* z = kZeros ? p.zeros + panel * groups * kNr : nullptr;
  const float* x = p.x + m0 * p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += p.group) {
    __m512 s0, s1, z0, z1;  // this group's scales and zeros for the panel's 32 columns
    if constexpr (Fmt::kQuant) {
      s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16), s += kNr;
    }
    if constexpr (kZeros) {
      z0 = _mm512_loadu_ps(z), z1 = _mm512_loadu_ps(z + 16), z += kNr;
    }
    for (int64_t k = k0; k < k0 + p.group; ++k, w += Fmt::kRow) {
      __m512 b0, b1;
      Fmt::Widen(w, b0, b1);
      // Explicit rounding mode: the compiler may not contract these two into one FMA (one rounding, other values).
      if constexpr (Fmt::kQuant) b0 = _mm512_mul_round_ps(b0, s0, kRound), b1 = _mm512_mul_round_ps(b1, s1, kRound);
      if constexpr (kZeros) b0 = _mm512_add_round_ps(b0, z0, kRound), b1 = _mm512_add_round_ps(b1, z1, kRound);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * p.k + k]);
        acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
      }
    }
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  if (cols == kNr) {
    for (int r = 0; r < R; ++r) {
      float* y = p.y + (m0 + r) * p.n + n0;
      _mm512_storeu_ps(y, acc0[r]);
      _mm512_storeu_ps(y + 16, acc1[r]);
    }
  } else {  // the last panel of an N that is not a multiple of 32
    const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 hi = cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
    for (int r = 0; r < R; ++r) {
      float* y = p.y + (m0 + r) * p.n + n0;
      _mm512_mask_storeu_ps(y, lo, acc0[r]);
      _mm512_mask_storeu_ps(y + 16, hi, acc1[r]);
    }
  }
}
#else
// Portable version: the same dequantization and per-element FMA chain order (std::fma keeps one rounding per step,
// like the vector FMA). A compiler may contract q * s + z into one FMA (GCC does, even across a detour through
// double), so the product is formed as q * hi + q * lo, s = hi + lo split into 12-bit halves of its significand: both
// products are exact in f32 (q has <= 8 bits), so their sum rounds once to q * s, FMA or not, and the sum with z
// that follows adds an add's result, which cannot be contracted. (`PackedLinear.unpack` does the same in XLA.)
template <class Fmt, bool kZeros, int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  float acc[R][kNr] = {};
  const int64_t groups = p.k / p.group;
  const typename Fmt::T* w = static_cast<const typename Fmt::T*>(p.w) + panel * p.k * Fmt::kRow;
  const float* s = Fmt::kQuant ? p.scales + panel * groups * kNr : nullptr;
  const float* z = kZeros ? p.zeros + panel * groups * kNr : nullptr;
  const float* x = p.x + m0 * p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += p.group) {
    float hi[kNr], lo[kNr];  // this group's scales, split
    if constexpr (Fmt::kQuant) {
      for (int64_t j = 0; j < kNr; ++j, ++s) {
        uint32_t bits;
        std::memcpy(&bits, s, sizeof bits);
        bits &= 0xFFFFF000u;
        std::memcpy(&hi[j], &bits, sizeof bits);
        lo[j] = *s - hi[j];
      }
    }
    for (int64_t k = k0; k < k0 + p.group; ++k, w += Fmt::kRow) {
      float b[kNr];
      for (int64_t j = 0; j < kNr; ++j) {
        b[j] = Fmt::Value(w, j);
        if constexpr (Fmt::kQuant) b[j] = b[j] * hi[j] + b[j] * lo[j];
        if constexpr (kZeros) b[j] = b[j] + z[j];
      }
      for (int r = 0; r < R; ++r) {
        const float a = x[r * p.k + k];
        for (int64_t j = 0; j < kNr; ++j) acc[r][j] = std::fma(a, b[j], acc[r][j]);
      }
    }
    if constexpr (kZeros) z += kNr;
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], cols * sizeof(float));
}
#endif

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

template <class Fmt, bool kZeros, int... Rs>
constexpr auto MakeBlockTable(std::integer_sequence<int, Rs...>) {
  return std::array<BlockFn, sizeof...(Rs)>{&Block<Fmt, kZeros, Rs + 1>...};
}

template <class Fmt, bool kZeros>
void Panels(const Problem& p, int64_t begin, int64_t end) {
  static constexpr auto blocks_of =
      MakeBlockTable<Fmt, kZeros>(std::make_integer_sequence<int, static_cast<int>(Fmt::kMr)>{});
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
    if (finished && done.fetch_add(finished) + finished == tasks) {
      std::lock_guard<std::mutex> lock(mu);
      all_done.notify_all();
    }
  }
};

using Dims = ffi::Span<const int64_t>;

// Checks the shapes common to every format (x [M, K], w [P, K, row], y [M, N]) and, for the quantized formats, the
// scales [P, K / G, 32] and zeros (the same shape, or empty for none); fills `p`'s sizes.
template <class Fmt>
ffi::Error Shapes(Dims xd, Dims wd, Dims yd, Dims sd, Dims zd, bool has_zeros, Problem& p) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != Fmt::kRow) {
    return ffi::Error::InvalidArgument("matmul: expected x f32[M, K], w [P, K, row] (row 32, or 16 for int4), y "
                                       "f32[M, N]");
  }
  p.m = xd[0], p.k = xd[1], p.n = yd[1], p.panels = wd[0], p.group = p.k;
  if (wd[1] != p.k || yd[0] != p.m || wd[0] != (p.n + kNr - 1) / kNr) {
    return ffi::Error::InvalidArgument("matmul: shapes disagree (need w [ceil(N/32), K, row] and y [M, N])");
  }
  if constexpr (Fmt::kQuant) {
    if (sd.size() != 3 || sd[0] != p.panels || sd[1] < 1 || p.k % sd[1] != 0 || sd[2] != kNr) {
      return ffi::Error::InvalidArgument("matmul: expected scales f32[P, K / G, 32] with G dividing K");
    }
    p.group = p.k / sd[1];
    if (has_zeros && !(zd == sd)) {
      return ffi::Error::InvalidArgument("matmul: zeros must have the shape of scales (or be f32[0] for none)");
    }
  }
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool& pool, const Problem& p, PanelsFn panels_fn, int64_t widen_flops) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::memset(p.y, 0, p.m * p.n * sizeof(float));
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->panels_fn = panels_fn;
  // Widening counts as `widen_flops` per weight, on top of the 2 M FMA flops.
  const int64_t panel_flops = (2 * p.m + widen_flops) * p.k * kNr;
  // Tasks of about kTargetTaskFlops: a small product is one task on the calling thread (no hand-off at all). A
  // larger one gets a multiple of `workers` near-equal tasks, run by the caller and workers - 1 helpers (one thread
  // per pool thread: 3 tasks on 2 cores, or 3 threads on 2 cores, leave one core idle for a third of the time).
  int64_t per = std::max<int64_t>(1, (kTargetTaskFlops + panel_flops - 1) / panel_flops);
  int64_t tasks = (p.panels + per - 1) / per;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  if (tasks > 1) {
    tasks = (tasks + workers - 1) / workers * workers;
    per = (p.panels + tasks - 1) / tasks;
    tasks = (p.panels + per - 1) / per;
  }
  shared->panels_per_task = per;
  shared->tasks = tasks;
  const int64_t helpers = std::min<int64_t>(workers - 1, tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load() == shared->tasks; });
  return ffi::Error::Success();
}

template <class Fmt, ffi::DataType kType>
ffi::Error DenseImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> w,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  Problem p{x.typed_data(), w.typed_data(), nullptr, nullptr, y->typed_data()};
  if (auto e = Shapes<Fmt>(x.dimensions(), w.dimensions(), y->dimensions(), {}, {}, false, p); e.failure()) {
    return e;
  }
  return Run(pool, p, &Panels<Fmt, false>, Fmt::kWidenFlops);
}

template <class Fmt, ffi::DataType kType>
ffi::Error QuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> w,
                     ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> zeros,
                     ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const bool has_zeros = zeros.element_count() != 0;
  Problem p{x.typed_data(), w.typed_data(), scales.typed_data(), has_zeros ? zeros.typed_data() : nullptr,
            y->typed_data()};
  if (auto e = Shapes<Fmt>(x.dimensions(), w.dimensions(), y->dimensions(), scales.dimensions(), zeros.dimensions(),
                          has_zeros, p);
      e.failure()) {
    return e;
  }
  return Run(pool, p, has_zeros ? &Panels<Fmt, true> : &Panels<Fmt, false>, Fmt::kWidenFlops);
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
                                    .Arg<ffi::Buffer<ffi::F32>>() /* scales */       \
                                    .Arg<ffi::Buffer<ffi::F32>>() /* zeros or f32[0] */ \
                                    .Ret<ffi::Buffer<ffi::F32>>()); /* y */

JAXSERVE_DENSE(JaxserveMatmul, F32, ffi::F32)
JAXSERVE_DENSE(JaxserveMatmulBf16, Bf16, ffi::BF16)
JAXSERVE_QUANT(JaxserveMatmulInt8, Int8, ffi::S8)
JAXSERVE_QUANT(JaxserveMatmulInt4, Int4, ffi::U8)
