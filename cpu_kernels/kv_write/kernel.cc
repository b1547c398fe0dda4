// One layer's new KV rows into the paged cache, in place: the cache operand aliases the result (`__init__.py`).
// XLA:CPU scatters bf16 / f16 / fp8 by converting the whole cache to f32 and back; this copies each row's bytes
// into its slot (any dtype: the rows arrive in the cache's dtype). Slots outside the layer are not written.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error KvWriteImpl(ffi::AnyBuffer cache, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions();  // [L, P, ps, K, H]
  const auto rd = rows.dimensions();   // [T, K, H]
  if (cd.size() != 5 || rd.size() != 3 || rows.element_type() != cache.element_type() || rd[1] != cd[3] ||
      rd[2] != cd[4] || slots.element_count() != static_cast<size_t>(rd[0])) {
    return ffi::Error::InvalidArgument("kv_write: cache [L, P, ps, K, H], rows [T, K, H] of its dtype, slots [T]");
  }
  const int64_t L = cd[0], slots_per_layer = cd[1] * cd[2];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("kv_write: layer out of range");
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());  // not aliased
  const size_t row_bytes = rows.size_bytes() / (rd[0] > 0 ? rd[0] : 1);
  const char* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < rd[0]; ++t) {
    const int64_t s = slots.typed_data()[t];
    if (s < 0 || s >= slots_per_layer) continue;
    std::memcpy(dst + (l * slots_per_layer + s) * row_bytes, src + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // cache
                                  .Arg<ffi::AnyBuffer>()            // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()     // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()     // slots
                                  .Ret<ffi::AnyBuffer>());          // the cache, written
