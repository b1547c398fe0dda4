"""Packing many small step arrays into one transfer buffer round-trips exactly, inside jit."""

import jax
import numpy as np
import pytest

from jaxserve.packing import Layout, as_float, pack_outputs


def test_round_trip_all_dtypes():
    rng = np.random.default_rng(0)
    arrays = dict(
        ids=rng.integers(-5, 50, (3, 4)).astype(np.int32),
        seeds=rng.integers(0, 2**32, 5, dtype=np.uint32),
        flags=rng.random(6) > 0.5,
        temps=rng.normal(size=(2, 3)).astype(np.float32),
        scalar=np.asarray(7, np.int32),
    )
    arrays["temps"][0, 0] = np.nan
    lay = Layout.of({k: (v.shape, v.dtype.name) for k, v in arrays.items()})
    buf = lay.pack(arrays)
    assert buf.dtype == np.int32 and buf.shape == (lay.size,)
    out = jax.jit(lay.unpack)(buf)
    for k, v in arrays.items():
        got = np.asarray(out[k])
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)  # NaN bit pattern survives too


def test_shape_mismatch_and_bad_dtype():
    lay = Layout.of({"a": ((3,), "int32")})
    with pytest.raises(ValueError, match="layout expects"):
        lay.pack({"a": np.zeros(4, np.int32)})
    with pytest.raises(TypeError, match="cannot pack"):
        Layout.of({"x": ((2,), "float64")})


def test_pack_outputs():
    ints = jax.numpy.asarray([[1, 2], [3, 4]], jax.numpy.int32)
    floats = jax.numpy.asarray([0.5, -1.25], jax.numpy.float32)
    out = np.asarray(pack_outputs([ints], [floats]))
    assert out[:, :2].tolist() == [[1, 2], [3, 4]]
    assert as_float(out[:, 2]).tolist() == [0.5, -1.25]
