// Row statistics of logits for the sampler, as an XLA FFI custom call.
//
// For each row of x f32[R, V]:  m = max (NaN if the row holds a NaN), first = the lowest index whose value equals m
// (V when none does: a NaN row), log_z = log(sum_v exp(x[v] - m)), nonfinite = whether the row holds a NaN or +inf.
// These are what the sampler's greedy pick, normaliser and non-finite check compute in XLA (`sampler._normaliser`,
// `model.layers.argmax`), where XLA:CPU makes about six passes over the row at 2-3 GB/s each (~2 ms for 16 rows of
// SmolLM2's 49,152 logits, ~0.35 ms at one row); here it is two passes, the second over a row still in L2.
//
// Each row is computed alone, with the same operations whatever R (batch invariance). The exps are summed in f64
// (8 lanes, then folded in order), so log_z is the correctly rounded log of a near-exact sum. exp: range reduction by ln 2 (two-part constant), a degree-6 polynomial on
// [-ln2/2, ln2/2] (relative error ~1e-7, about an ulp, vs XLA's own approximation: the two agree to float rounding,
// not bit for bit), 2^n applied by vscalefps (exact, underflowing to 0 below -87). A row holding a NaN gets m = NaN,
// first = V and log_z = NaN (XLA's max skips NaNs instead; either way the sampler fails the row on `nonfinite`); a
// row whose maximum is +-inf gets log_z = NaN (inf - inf), as in XLA.
//
// Targets: JaxserveRowStats  x f32[R, V] -> m f32[R], first s32[R], log_z f32[R], nonfinite pred[R];
//          JaxserveRowSumSquares  x f32[R, D] -> f32[R] (below, for RMSNorm).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

struct Stats {
  float m, log_z;
  int32_t first;
  bool nonfinite;
};

#if defined(__AVX512F__)
inline __m512 Exp(__m512 x) {  // x <= 0 or NaN
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-88.0f), x);  // NaN in x stays (vmaxps returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), t);  // ln 2, high part (exact in f32)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);    // ln 2, the rest
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

Stats RowStats(const float* x, int64_t v) {
  const __m512 pinf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 bad = 0, nan = 0;
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    bad |= _mm512_cmp_ps_mask(a, pinf, _CMP_EQ_OQ);
    mx = _mm512_max_ps(mx, a);
  }
  float m = _mm512_reduce_max_ps(mx);
  for (; i < v; ++i) {
    nan |= std::isnan(x[i]);
    bad |= x[i] == std::numeric_limits<float>::infinity();
    m = std::max(m, x[i]);
  }
  if (nan) m = std::numeric_limits<float>::quiet_NaN();
  Stats s{m, 0.0f, static_cast<int32_t>(v), nan != 0 || bad != 0};
  const __m512 mv = _mm512_set1_ps(m);
  __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();  // f64: the sum is exact to ~1e-12
  const auto add = [&](__m512 e) {
    sum0 = _mm512_add_pd(sum0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    sum1 = _mm512_add_pd(sum1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
  };
  for (i = 0; i + 16 <= v; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __mmask16 eq = _mm512_cmp_ps_mask(a, mv, _CMP_EQ_OQ);
    if (eq && s.first == v) s.first = static_cast<int32_t>(i + __builtin_ctz(eq));
    add(Exp(_mm512_sub_ps(a, mv)));
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (v - i)) - 1);
  if (tail) {
    const __m512 a = _mm512_maskz_loadu_ps(tail, x + i);
    const __mmask16 eq = _mm512_mask_cmp_ps_mask(tail, a, mv, _CMP_EQ_OQ);
    if (eq && s.first == v) s.first = static_cast<int32_t>(i + __builtin_ctz(eq));
    add(_mm512_maskz_mov_ps(tail, Exp(_mm512_sub_ps(a, mv))));
  }
  double lanes[8];
  _mm512_storeu_pd(lanes, _mm512_add_pd(sum0, sum1));
  double total = 0;
  for (double l : lanes) total += l;
  s.log_z = static_cast<float>(std::log(total));
  return s;
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the same two passes over 8 lanes. exp as above, 2^n built in the exponent bits (n in [-127, 0] here, as
// x <= 0: 2^-127 reads 0 instead of a subnormal, which no sum of at least 1 can tell).
inline __m256 Exp(__m256 x) {  // x <= 0 or NaN
  const __m256 t = _mm256_max_ps(_mm256_set1_ps(-88.0f), x);  // vmaxps returns its second operand for a NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), t);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

Stats RowStats(const float* x, int64_t v) {
  const __m256 pinf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps(), nan = bad;
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, pinf, _CMP_EQ_OQ));
    mx = _mm256_max_ps(mx, a);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  bool any_nan = _mm256_movemask_ps(nan) != 0, any_bad = _mm256_movemask_ps(bad) != 0;
  for (; i < v; ++i) {
    any_nan |= std::isnan(x[i]);
    any_bad |= x[i] == std::numeric_limits<float>::infinity();
    m = std::max(m, x[i]);
  }
  if (any_nan) m = std::numeric_limits<float>::quiet_NaN();
  Stats s{m, 0.0f, static_cast<int32_t>(v), any_nan || any_bad};
  const __m256 mv = _mm256_set1_ps(m);
  __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();  // f64, as above
  for (i = 0; i + 8 <= v; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(a, mv, _CMP_EQ_OQ));
    if (eq && s.first == v) s.first = static_cast<int32_t>(i + __builtin_ctz(eq));
    const __m256 e = Exp(_mm256_sub_ps(a, mv));
    sum0 = _mm256_add_pd(sum0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    sum1 = _mm256_add_pd(sum1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, _mm256_add_pd(sum0, sum1));
  double total = 0;
  for (double l : lanes) total += l;
  for (; i < v; ++i) {
    if (x[i] == m && s.first == v) s.first = static_cast<int32_t>(i);
    total += static_cast<double>(std::exp(x[i] - m));
  }
  s.log_z = static_cast<float>(std::log(total));
  return s;
}
#else
Stats RowStats(const float* x, int64_t v) {  // portable: the same results up to the exp's rounding
  bool nan = false, bad = false;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < v; ++i) {
    nan |= std::isnan(x[i]);
    bad |= x[i] == std::numeric_limits<float>::infinity();
    m = std::max(m, x[i]);
  }
  if (nan) m = std::numeric_limits<float>::quiet_NaN();
  Stats s{m, 0.0f, static_cast<int32_t>(v), nan || bad};
  double total = 0;
  for (int64_t i = 0; i < v; ++i) {
    if (x[i] == m && s.first == v) s.first = static_cast<int32_t>(i);
    total += static_cast<double>(std::exp(x[i] - m));
  }
  s.log_z = static_cast<float>(std::log(total));
  return s;
}
#endif

ffi::Error RowStatsImpl(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> m,
                        ffi::Result<ffi::Buffer<ffi::S32>> first, ffi::Result<ffi::Buffer<ffi::F32>> log_z,
                        ffi::Result<ffi::Buffer<ffi::PRED>> nonfinite) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] < 1 || m->element_count() != static_cast<size_t>(d[0])) {
    return ffi::Error::InvalidArgument("row_stats: expected x f32[R, V] with V >= 1 and [R] outputs");
  }
  for (int64_t r = 0; r < d[0]; ++r) {
    const Stats s = RowStats(x.typed_data() + r * d[1], d[1]);
    m->typed_data()[r] = s.m;
    first->typed_data()[r] = s.first;
    log_z->typed_data()[r] = s.log_z;
    nonfinite->typed_data()[r] = s.nonfinite;
  }
  return ffi::Error::Success();
}

// Each row's sum of squares, by one fixed sequence of operations whatever R: 16 lanes, lane l summing x[k] * x[k]
// for k = l, l + 16, ... in order, then the lanes folded pairwise (8, 4, 2, 1). What RMSNorm needs to stay batch-
// invariant (jaxserve/model/layers.py::rms_norm): XLA:CPU picks a reduction order by shape, so a row's sum would
// change in its last bit with the number of rows in the step.
ffi::Error RowSumSquaresImpl(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || out->element_count() != static_cast<size_t>(d[0])) {
    return ffi::Error::InvalidArgument("row_sum_squares: expected x f32[R, D] and an [R] output");
  }
  const int64_t D = d[1];
  for (int64_t r = 0; r < d[0]; ++r) {
    const float* row = x.typed_data() + r * D;
    float acc[16] = {};
    int64_t k = 0;
    for (; k + 16 <= D; k += 16) {
      for (int l = 0; l < 16; ++l) acc[l] += row[k + l] * row[k + l];
    }
    for (int l = 0; k + l < D; ++l) acc[l] += row[k + l] * row[k + l];
    for (int w = 8; w >= 1; w /= 2) {
      for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    }
    out->typed_data()[r] = acc[0];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRowSumSquares, RowSumSquaresImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // sum of squares per row

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRowStats, RowStatsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x
                                  .Ret<ffi::Buffer<ffi::F32>>()     // m
                                  .Ret<ffi::Buffer<ffi::S32>>()     // first
                                  .Ret<ffi::Buffer<ffi::F32>>()     // log_z
                                  .Ret<ffi::Buffer<ffi::PRED>>());  // nonfinite
