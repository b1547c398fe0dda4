"""Loading streams the checkpoint: the host holds the weights as stored plus about one tensor, never the model in
float32 (issue 22: a model larger than half the host's RAM still loads). numpy registers its buffers with
tracemalloc, so the peak of a load is measured exactly, in-process. bench/load.py measures the default model's
peak RSS against the previous loader (docs/benchmarks/load_memory.md).
"""

from __future__ import annotations

import json
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.loader.hf import read_hf_dir
from jaxserve.loader.weights import hf_tensor_shapes, to_weights

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=4096, hidden_size=256, intermediate_size=1024,
              num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False)


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = dict(dtype="F32", shape=list(a.shape), data_offsets=[offset, offset + a.nbytes])
        offset += a.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, np.float32).tobytes())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A float32 Llama checkpoint of ~50 MB in two safetensors shards."""
    from jaxserve.loader.hf import config_from_hf

    path = tmp_path_factory.mktemp("stream")
    (path / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    shapes = hf_tensor_shapes(config_from_hf(CONFIG))
    tensors = {n: rng.standard_normal(s, np.float32) * 0.02 for n, s in shapes.items()}
    names = list(tensors)
    half = len(names) // 2
    shards = {"model-1.safetensors": names[:half], "model-2.safetensors": names[half:]}
    for file, ns in shards.items():
        _write_safetensors(path / file, {n: tensors[n] for n in ns})
    index = {"weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    float32_bytes = sum(a.nbytes for a in tensors.values())
    largest = max(a.nbytes for a in tensors.values())
    return str(path), tensors, float32_bytes, largest


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8"), ("float32", "int4")])
def test_a_load_holds_the_stored_weights_and_one_tensor(checkpoint, dtype, quantization):
    path, _, float32_bytes, largest = checkpoint
    tracemalloc.start()
    try:
        config, tensors = read_hf_dir(path)
        weights = to_weights(config, tensors, jnp.dtype(dtype), path, quantization)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stored = sum(a.nbytes for a in jax.tree.leaves(weights))
    assert stored < 0.6 * float32_bytes
    # the largest tensor (the embedding / logits projection, 4 MiB) read, converted and quantized: a few copies
    assert peak <= stored + 3 * largest, (peak / 2**20, stored / 2**20, largest / 2**20)
    assert peak < float32_bytes, "the load held as much as the whole model in float32"


def test_streamed_weights_equal_the_in_memory_conversion(checkpoint):
    """The streaming path (tensors read from the files one at a time) builds what a dict of arrays builds."""
    path, arrays, _, _ = checkpoint
    config, tensors = read_hf_dir(path)
    for q in ("none", "int8"):
        a = to_weights(config, tensors, jnp.bfloat16, path, q)
        b = to_weights(config, arrays, jnp.bfloat16, path, q)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_truncated_shard_is_named(checkpoint, tmp_path):
    import shutil

    path = checkpoint[0]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    shard = broken / "model-2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    config, tensors = read_hf_dir(str(broken))
    with pytest.raises(ValueError, match="truncated"):
        to_weights(config, tensors, jnp.float32, str(broken))
