"""Packing a step's typed inputs into one transfer buffer, and outputs into one fetch, round-trips exactly."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import Bucket, StepBatch, build_step_inputs
from jaxserve.packing import Layout, RowLayout
from jaxserve.sampler import SamplerOutput, SamplingInputs


@jax.tree_util.register_dataclass
@dataclass
class _Tree:
    ids: object
    seeds: object
    flags: object
    temps: object
    scalar: object
    nested: object = None


def _random_tree(rng, nested=None):
    t = _Tree(
        ids=rng.integers(-5, 50, (3, 4)).astype(np.int32),
        seeds=rng.integers(0, 2**32, 5, dtype=np.uint32),
        flags=rng.random(6) > 0.5,
        temps=rng.normal(size=(2, 3)).astype(np.float32),
        scalar=np.asarray(7, np.int32),
        nested=nested,
    )
    t.temps[0, 0] = np.nan
    return t


def test_round_trip_all_dtypes_and_nesting():
    rng = np.random.default_rng(0)
    tree = _random_tree(rng, nested={"inner": rng.integers(0, 9, (2, 2)).astype(np.int32)})
    lay = Layout.of(tree)
    buf = lay.pack(tree)
    assert buf.dtype == np.int32 and buf.shape == (lay.size,)
    out = jax.jit(lay.unpack)(buf)
    assert isinstance(out, _Tree)  # the same dataclass comes back
    for want, got in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)  # NaN bit pattern survives too


def test_shape_structure_and_dtype_mismatch():
    rng = np.random.default_rng(1)
    lay = Layout.of(_random_tree(rng))
    bad = _random_tree(rng)
    bad.ids = np.zeros((3, 5), np.int32)
    with pytest.raises(ValueError, match="layout expects"):
        lay.pack(bad)
    with pytest.raises(ValueError, match="does not match"):
        lay.pack(_random_tree(rng, nested=np.zeros(2, np.int32)))  # an optional field present: another layout
    with pytest.raises(TypeError, match="cannot pack"):
        Layout.of({"x": np.zeros(2, np.float64)})


def test_step_batch_layout_is_derived_from_its_fields():
    """The runner's layout covers every StepInputs / SamplingInputs field; optional fields change the layout."""
    b = Bucket(num_tokens=8, num_seqs=2, max_pages=2)
    plain = StepBatch(build_step_inputs([], b, 4), SamplingInputs.neutral(b.rows, 8))
    names = {f.name for f in Layout.of(plain).fields}
    assert ".inputs.slot_mapping" in names and ".sampling.history_is_output" in names
    with_drafts = StepBatch(plain.inputs, plain.sampling, np.full(b.rows, -1, np.int32))
    assert Layout.of(with_drafts).size == Layout.of(plain).size + b.rows
    assert Layout.of(with_drafts) != Layout.of(plain)


def test_row_layout_round_trip_any_row_count():
    def out(R, k):
        return SamplerOutput(
            token_ids=jnp.arange(R, dtype=jnp.int32), logprobs=-jnp.arange(R, dtype=jnp.float32) / 3,
            ranks=jnp.arange(R, dtype=jnp.int32) + 1, top_ids=jnp.ones((R, k), jnp.int32),
            top_logprobs=jnp.full((R, k), -0.5, jnp.float32), accepted=jnp.arange(R) % 2 == 0,
            nonfinite=jnp.arange(R) == 1,
        )

    rows = RowLayout.of(jax.eval_shape(lambda: out(1, 3)))  # derived once, from one row
    assert rows.width == 5 + 2 * 3
    for R in (1, 4):
        want = out(R, 3)
        packed = np.asarray(jax.jit(rows.pack)(want))
        assert packed.shape == (R, rows.width) and packed.dtype == np.int32
        got = rows.unpack(packed)
        assert isinstance(got, SamplerOutput)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, np.asarray(w))
