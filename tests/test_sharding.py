"""Mesh configs and logical-axis sharding rules (jaxserve/sharding.py), on 1 device here and 8 simulated ones in a
subprocess (the device count is fixed when jax starts)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig
from jaxserve.sharding import DEFAULT_RULES, MeshConfig, partition_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("single", "tp2", "tp4", "tp8", "pp2", "pp2_tp2", "pp4", "dp2", "dp2_tp2", "dp2_pp2")


def test_every_config_file_is_its_preset():
    files = {os.path.basename(p)[:-5]: p for p in glob.glob(os.path.join(ROOT, "configs", "mesh", "*.yaml"))}
    assert set(files) == set(PRESETS)
    for name, path in files.items():
        from_file, preset = MeshConfig.from_value(path), MeshConfig.preset(name)
        assert (from_file.shape, from_file.rules) == (preset.shape, preset.rules), name


def test_engine_config_takes_a_mesh_as_name_path_or_mapping():
    assert EngineConfig().mesh is None
    assert EngineConfig(mesh="pp2_tp2").mesh.shape == {"dp": 1, "pp": 2, "tp": 2}
    assert EngineConfig(mesh=os.path.join(ROOT, "configs/mesh/dp2.yaml")).mesh.num_devices == 2
    m = EngineConfig(mesh={"tp": 4, "rules": {"kv_heads": None}}).mesh
    assert m.tp == 4 and dict(m.rules)["kv_heads"] is None and dict(m.rules)["heads"] == "tp"  # others default


@pytest.mark.parametrize(
    "mesh, match",
    [
        ("tp0", "mesh.tp must be an integer >= 1"),
        ("tensor2", "neither a mesh preset"),
        ({"tp": 2, "sp": 2}, "unknown mesh key.*sp"),
        ({"tp": 2, "rules": {"experts": "tp"}}, "unknown logical axis 'experts'"),
        ({"tp": 2, "rules": {"heads": "model"}}, r"mesh.rules.heads: unknown mesh axis 'model'"),
        ({"tp": 2, "rules": ["heads"]}, "mesh.rules must be a mapping"),
        ({"tp": "2"}, "mesh.tp must be an integer"),
        (3, "mesh must be a preset name"),
    ],
)
def test_bad_mesh_configs_name_the_field(mesh, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(mesh=mesh)


def test_partition_specs_follow_the_rules_and_replicate_what_does_not_divide():
    from jax.sharding import PartitionSpec as P

    tp2, pp2_tp2 = MeshConfig.preset("tp2"), MeshConfig.preset("pp2_tp2")
    units = {"heads": 9, "kv_heads": 3}  # the default model: 9 query heads, 3 KV heads of 64
    assert partition_spec(tp2, ("embed", "heads"), (576, 576), units) == P(None, None)  # 9 heads: replicated
    assert partition_spec(MeshConfig.preset("tp3"), ("embed", "heads"), (576, 576), units) == P(None, "tp")
    assert partition_spec(tp2, ("embed", "kv_heads"), (576, 192), units) == P(None, None)  # 3 KV heads, not 192 cols
    assert partition_spec(tp2, ("embed", "mlp"), (576, 1536), units) == P(None, "tp")
    assert partition_spec(tp2, ("vocab", "embed"), (49152, 576)) == P("tp", None)
    assert partition_spec(pp2_tp2, ("layers", "mlp", "embed"), (30, 1536, 576)) == P("pp", "tp", None)
    assert partition_spec(pp2_tp2, ("layers", "mlp", "embed"), (29, 1536, 576)) == P(None, "tp", None)  # odd layers
    assert partition_spec(MeshConfig.preset("single"), ("vocab", "embed"), (8, 4)) == P(None, None)
    assert dict(DEFAULT_RULES)["embed"] is None


def test_an_engine_refuses_a_mesh_it_cannot_run(tmp_path):
    """On this process's one device: a mesh needing more devices fails at start naming the mesh instead of silently
    running on fewer; a one-device mesh runs (sharded engines: tests/test_tensor_parallel.py)."""
    from jaxserve import LLM
    from jaxserve.factory import check_mesh

    with pytest.raises(ValueError, match=r"mesh tp2 \(dp=1 x pp=1 x tp=2\) needs 2 devices but 1 are available"):
        check_mesh(EngineConfig(mesh="tp2"))
    check_mesh(EngineConfig(mesh="single"))  # fits
    from tiny_models import make_tiny_model

    make_tiny_model("llama_gqa", str(tmp_path))
    with pytest.raises(ValueError, match="needs 4 devices"):
        LLM(str(tmp_path), mesh="dp2_tp2", precompile=False)
    llm = LLM(str(tmp_path), mesh="single", max_model_len=64, precompile=False)
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0].token_ids


_EIGHT_DEVICES = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KV_AXES, init_kv_cache
from jaxserve.model.llama import weight_axes, Weights, LayerWeights
from jaxserve import sharding
assert len(jax.devices()) == 8
cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=8, num_kv_heads=int(sys.argv[1]), head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=(1,))
D, F, N, K, H, L, V = 64, 128, 8, cfg.num_kv_heads, 8, 4, 512
z = lambda *s: jnp.zeros(s, jnp.float32)
w = Weights(embed=z(V, D), final_norm=z(D), lm_head=z(D, V), layers=LayerWeights(
    attn_norm=z(L, D), wq=z(L, D, N * H), wk=z(L, D, K * H), wv=z(L, D, K * H), wo=z(L, N * H, D), mlp_norm=z(L, D),
    w_gate=z(L, D, F), w_up=z(L, D, F), w_down=z(L, F, D)))
out = {}
for name in sys.argv[2:]:
    m = sharding.MeshConfig.preset(name)
    mesh = sharding.make_mesh(m)
    sh = sharding.shardings(mesh, m, w, weight_axes(w), sharding.model_units(cfg))
    placed = jax.device_put(w, sh)
    kv = init_kv_cache(cfg, 16, 4, jnp.float32)
    kv_sh = sharding.shardings(mesh, m, kv.k, KV_AXES)
    kv_k = jax.device_put(kv.k, kv_sh)
    per_dev = {}
    for leaf in jax.tree.leaves(placed) + [kv_k]:
        for s in leaf.addressable_shards:
            per_dev[s.device.id] = per_dev.get(s.device.id, 0) + s.data.nbytes
    out[name] = {"devices": sorted(per_dev), "bytes": [per_dev[d] for d in sorted(per_dev)],
                 "wq": list(placed.layers.wq.sharding.spec), "wk": list(placed.layers.wk.sharding.spec),
                 "embed": list(placed.embed.sharding.spec), "kv": list(kv_k.sharding.spec)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("kv_heads", [1, 4, 8])
def test_eight_device_meshes_place_exactly_the_promised_bytes(kv_heads):
    """On 8 simulated CPU devices, every preset's mesh places a tiny model's weights and KV cache so each device
    holds exactly the bytes the rules promise: sharded arrays divided by their mesh axes, the rest replicated."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "-c", _EIGHT_DEVICES, str(kv_heads), *PRESETS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    D, F, N, H, L, V, K = 64, 128, 8, 8, 4, 512, kv_heads
    f = 4  # float32
    for name in PRESETS:
        m = MeshConfig.preset(name)
        tp, pp = m.tp, m.pp
        kv_tp = tp if K % tp == 0 else 1  # KV heads replicated when tp does not divide them
        layer = (2 * D + N * H * D * 2 / tp + 2 * K * H * D / kv_tp + 3 * D * F / tp) * f
        want = layer * L / pp + (2 * V * D / tp + D) * f + L * 16 * 4 * K * H * f / (kv_tp * pp)
        assert got[name]["devices"] == list(range(m.num_devices)), name
        assert got[name]["bytes"] == [want] * m.num_devices, (name, got[name])
        pp_axis, tp_axis, kv_axis = "pp" if pp > 1 else None, "tp" if tp > 1 else None, "tp" if kv_tp > 1 else None
        assert got[name]["wq"] == [pp_axis, None, tp_axis] and got[name]["wk"] == [pp_axis, None, kv_axis], name
        assert got[name]["embed"] == [tp_axis, None] and got[name]["kv"] == [pp_axis, None, None, kv_axis, None], name
