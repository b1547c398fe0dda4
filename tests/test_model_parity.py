"""Model parity with HF transformers on tiny random checkpoints, through the paged cache and the ragged step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.batch import Bucket, ScheduledSeq, build_step_inputs
from paged_harness import PagedModel
from tiny_models import VARIANTS, make_tiny_model

ATOL = 1e-4


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, str(path))
    return request.param, str(path), hf


@pytest.mark.parametrize("layers", ["scanned", "unrolled", "packed"])
def test_prefill_and_decode_match_hf(variant, layers):
    """Two sequences prefilled together in one ragged step, then decoded together: logits match HF at every step,
    with the layers scanned over stacked weights, unrolled over per-layer weights, and unrolled with every linear
    map on the native CPU matmul (the CPU default)."""
    name, path, hf = variant
    m = PagedModel(path, layers=layers)
    rng = np.random.default_rng(1)
    seqs = {0: rng.integers(3, 300, 13).tolist(), 1: rng.integers(3, 300, 6).tolist()}
    out = m.step(seqs, num_tokens=32)  # padded tokens must not disturb anything
    for i, ids in seqs.items():
        ref = _hf_logits(hf, ids)
        assert np.abs(ref).max() > 1.0, "weights too small to discriminate"
        np.testing.assert_allclose(out[i], ref, atol=ATOL, err_msg=f"{name} prefill seq {i}")
    for _ in range(6):
        nxt = {i: [int(out[i][-1].argmax())] for i in seqs}
        for i in seqs:
            seqs[i] = seqs[i] + nxt[i]
        out = m.step(nxt)
        for i, ids in seqs.items():
            ref = _hf_logits(hf, ids)[-1]
            np.testing.assert_allclose(out[i][-1], ref, atol=ATOL, err_msg=f"{name} decode seq {i}")
            assert int(out[i][-1].argmax()) == int(ref.argmax())


def test_chunked_prefill_matches_one_shot(variant):
    """A prompt fed in chunks across steps, sharing each step with another sequence's decodes, gives the same logits."""
    _, path, _ = variant
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 300, 23).tolist()
    other = rng.integers(3, 300, 5).tolist()

    one = PagedModel(path).step({0: prompt})[0]

    m = PagedModel(path)
    m.step({1: other})
    chunks, got = [7, 4, 9, 3], []
    t = 0
    for c in chunks:
        out = m.step({0: prompt[t : t + c], 1: [int(rng.integers(3, 300))]})
        got.append(out[0])
        t += c
    np.testing.assert_allclose(np.concatenate(got), one, atol=ATOL)


def test_hidden_states_match_hf(tmp_path):
    """The forward can return the residual stream entering chosen layers (EAGLE-3 needs three of them)."""
    import functools

    import jax

    from jaxserve.model.llama import forward

    hf = make_tiny_model("llama_gqa", str(tmp_path))
    m = PagedModel(str(tmp_path))
    ids = list(range(3, 15))
    bucket = Bucket(num_tokens=len(ids), num_seqs=1, max_pages=m.pages_per_seq)
    host = build_step_inputs([ScheduledSeq(ids, 0, m.pages(0))], bucket, m.page_size)
    fwd = jax.jit(functools.partial(forward, m.cfg, hidden_layer_ids=(0, 1, 2)))
    h, _, hidden = fwd(m.weights, m.kv, host)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # HF's hidden_states[i] enters layer i; its last entry is after the final norm, ours (id == L) is before it.
    for j in (0, 1):
        np.testing.assert_allclose(np.asarray(hidden[j]), ref[j][0].numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(h), ref[-1][0].numpy(), atol=ATOL)


@pytest.mark.parametrize("materialize", [False, True])
def test_rope_tables_are_computed_once_per_step(materialize):
    """`rope_tables(..., materialize=True)` (the CPU step): the cos and sin reach every layer's RoPE as buffers, so
    XLA:CPU evaluates them once per step, not inside each layer's fusion (layers apart: a product between them, as
    the step's matmuls are); the values agree with the plain tables, and a position's bits do not depend on how many
    tokens the step holds (batch invariance)."""
    from jaxserve.model.layers import apply_rope, rope_tables

    inv_freq = jnp.asarray(1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16), jnp.float32)
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((4, 16, 16)) / 4, jnp.float32)

    def layers(x, positions, materialize):
        rope = rope_tables(positions, inv_freq, materialize=materialize)
        for w in ws:  # four "layers": a product, then RoPE
            x = apply_rope((x.reshape(-1, 16) @ w).reshape(x.shape), rope)
        return x

    fn = jax.jit(layers, static_argnums=2)
    x = jnp.asarray(rng.standard_normal((16, 3, 16)), jnp.float32)
    positions = jnp.arange(16, dtype=jnp.int32) * 37 + 5
    num_cos = fn.lower(x, positions, materialize).compile().as_text().count(" cosine(")
    if materialize:
        assert num_cos <= 2  # the conditional's two branches
    else:
        assert num_cos >= 4  # XLA:CPU's fusion copies it into each layer: what materialize is for
    np.testing.assert_allclose(np.asarray(fn(x, positions, materialize)), np.asarray(fn(x, positions, False)),
                               rtol=1e-5, atol=1e-5)
    tables = jax.jit(rope_tables, static_argnames="materialize")
    alone = [np.asarray(t) for t in tables(positions[5:6], inv_freq, materialize=materialize)]
    among = [np.asarray(t) for t in tables(positions, inv_freq, materialize=materialize)]
    for a, b in zip(alone, among):
        np.testing.assert_array_equal(a[0], b[5])
