// Dense f32 matmul for the CPU backend, as an XLA FFI custom call: y[M, N] = x[M, K] @ W[K, N].
//
// Why not XLA's dot: a decode step multiplies a handful of rows (M = the batch) by every weight matrix, and XLA:CPU
// reaches about a third of the machine's FMA peak at M = 16 on SmolLM2's shapes. This kernel is the plain register-
// blocked loop that small M wants (the weights are read once per row block, from a layout made for it):
//
//   * W arrives pre-packed (`pack` in __init__.py): panels of kNr = 32 columns, each panel K rows of 32 contiguous
//     floats -- f32[ceil(N / 32), K, 32], zero-padded past N. A panel is one sequential 128 * K byte stream.
//   * A task is a run of panels. For each panel and each block of up to kMr rows of x, the accumulators
//     (rows x 2 vectors of 16) live in registers for the whole k loop: per k, two vector loads of W and one
//     broadcast FMA pair per row. The panel (K x 128 bytes) stays in L2 between row blocks.
//   * Every y[m, n] is the same sequential FMA chain over k = 0..K-1 from 0, whatever M, the row block or the thread:
//     a row's result does not depend on what else is in the batch (batch invariance, bit for bit).
//   * Tasks run on XLA's intra-op thread pool, handed out by an atomic counter; the calling thread works too.
//
// Inputs: x f32[M, K] row-major; w f32[P, K, 32] (P = ceil(N / 32)). Output: y f32[M, N]. Attribute: none (N is
// the output's second dimension).

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
constexpr int64_t kMr = 12;  // rows of x per register block (12 x 2 accumulators + 2 W vectors <= 32 registers)
constexpr int64_t kTargetTaskFlops = int64_t{1} << 21;  // ~25 us of work: enough to amortize a task hand-out

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, panels;
};

#if defined(__AVX512F__)
// Rows [m0, m0 + R) x panel p. R is a compile-time constant so the accumulators are registers.
template <int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const float* w = p.w + panel * p.k * kNr;
  const float* x = p.x + m0 * p.k;
  for (int64_t k = 0; k < p.k; ++k, w += kNr) {
    const __m512 b0 = _mm512_loadu_ps(w), b1 = _mm512_loadu_ps(w + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * p.k + k]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
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
// Portable version: the same per-element FMA chain order (std::fma keeps one rounding per step, like the vector FMA).
template <int R>
void Block(const Problem& p, int64_t panel, int64_t m0) {
  float acc[R][kNr] = {};
  const float* w = p.w + panel * p.k * kNr;
  const float* x = p.x + m0 * p.k;
  for (int64_t k = 0; k < p.k; ++k, w += kNr) {
    for (int r = 0; r < R; ++r) {
      const float a = x[r * p.k + k];
      for (int64_t j = 0; j < kNr; ++j) acc[r][j] = std::fma(a, w[j], acc[r][j]);
    }
  }
  const int64_t n0 = panel * kNr, cols = std::min(kNr, p.n - n0);
  for (int r = 0; r < R; ++r) std::memcpy(p.y + (m0 + r) * p.n + n0, acc[r], cols * sizeof(float));
}
#endif

using BlockFn = void (*)(const Problem&, int64_t, int64_t);

template <int... Rs>
constexpr auto MakeBlockTable(std::integer_sequence<int, Rs...>) {
  return std::array<BlockFn, sizeof...(Rs)>{&Block<Rs + 1>...};
}
const auto kBlocks = MakeBlockTable(std::make_integer_sequence<int, kMr>{});

void Panels(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t panel = begin; panel < end; ++panel) {
    // Row blocks of near-equal size (16 rows: 8 + 8, not 12 + 4): a short block has too few accumulators to hide
    // the FMA latency.
    const int64_t blocks = (p.m + kMr - 1) / kMr;
    for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
      const int64_t rows = (p.m - m0 + (blocks - b) - 1) / (blocks - b);
      kBlocks[rows - 1](p, panel, m0);
      m0 += rows;
    }
  }
}

struct Shared {
  Problem p;
  int64_t panels_per_task = 1, tasks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Work() {
    int64_t finished = 0;
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t begin = t * panels_per_task;
      Panels(p, begin, std::min(p.panels, begin + panels_per_task));
      ++finished;
    }
    if (finished && done.fetch_add(finished) + finished == tasks) {
      std::lock_guard<std::mutex> lock(mu);
      all_done.notify_all();
    }
  }
};

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNr) {
    return ffi::Error::InvalidArgument("matmul: expected x f32[M, K], w f32[P, K, 32], y f32[M, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (wd[1] != k || yd[0] != m || wd[0] != (n + kNr - 1) / kNr) {
    return ffi::Error::InvalidArgument("matmul: shapes disagree (need w [ceil(N/32), K, 32] and y [M, N])");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(y->typed_data(), 0, y->size_bytes());
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  shared->p = Problem{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n, wd[0]};
  const int64_t panel_flops = 2 * m * k * kNr;
  // Tasks of about kTargetTaskFlops: a small product is one task on the calling thread (no hand-off at all).
  const int64_t per = std::max<int64_t>(1, (kTargetTaskFlops + panel_flops - 1) / panel_flops);
  shared->panels_per_task = per;
  shared->tasks = (shared->p.panels + per - 1) / per;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load() == shared->tasks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w (packed)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
