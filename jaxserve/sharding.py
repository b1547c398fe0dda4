"""Device meshes from mesh configs, and logical axes -> mesh axes: the only module that names a mesh axis.

A mesh config (`MeshConfig`, `configs/mesh/*.yaml`, or a preset name such as "tp2" or "dp2_pp2") gives the sizes
of the three mesh axes, `dp` (engine replicas), `pp` (pipeline stages) and `tp` (tensor parallel), and the rules
that map the model's logical axes onto them. Arrays declare logical axes once, where they are defined (the model's
weights in `model/llama.py`, the KV cache in `kv_cache.py`): "vocab", "embed", "heads", "kv_heads", "head_dim",
"mlp", "layers", "batch". `partition_spec` turns an array's logical axes into a `PartitionSpec` under the rules.

Sharding is by whole slices only: a dimension whose units (whole heads for the flattened head dimensions, see
`model_units`) the mesh axis does not divide is replicated instead, and a mesh axis of size 1 shards nothing. For
the KV heads the engine applies vLLM's rule first (`kv_head_replicas`): when tp is a multiple of the KV heads, each
is stored tp / K times so every shard holds one; tp must divide the query heads.

flax's logical-partitioning helpers (`flax.linen.logical_to_mesh_axes`) are not used: they serve linen modules'
boxed parameter metadata, while our weights are plain pytrees whose axes are declared in a table, and the mapping
itself is a dictionary lookup plus the divisibility rule above, which flax does not apply.

Tensor parallelism (`tp` > 1): weights and the KV cache are placed by these rules and XLA's SPMD partitioner
splits the dense layers (column-parallel q/k/v/gate/up, row-parallel o/down: two all-reduces of the hidden state per
layer, plus one for the vocabulary-parallel embedding); attention runs per shard on its own heads under `shard_map`
(`heads_shard_map`), so the native CPU kernel and the Pallas kernel see only local heads.
Pipeline parallelism (`pp` > 1): each stage is its own engine runner on its own sub-mesh (`MeshConfig.stage`, the
stage's tp devices), holding a contiguous slice of the layers (`jaxserve/pipeline.py`).
Data parallelism (`dp` > 1): each replica is an engine of its own on its own slice of the devices
(`MeshConfig.replica`); one engine refuses dp > 1 (`factory.check_mesh`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

MESH_AXES = ("dp", "pp", "tp")  # outermost first: replicas, then pipeline stages, then tensor-parallel shards
LOGICAL_AXES = ("batch", "layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp")
DEFAULT_RULES = (
    ("batch", "dp"),
    ("layers", "pp"),
    ("vocab", "tp"),  # vocabulary-parallel embedding and LM head
    ("embed", None),
    ("heads", "tp"),  # column-parallel q, row-parallel o
    ("kv_heads", "tp"),  # column-parallel k / v, the KV cache by heads
    ("head_dim", None),
    ("mlp", "tp"),  # column-parallel gate / up, row-parallel down
)
_PRESET = re.compile(r"^(?:dp(\d+))?_?(?:pp(\d+))?_?(?:tp(\d+))?$")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    rules: tuple[tuple[str, str | None], ...] = DEFAULT_RULES  # logical axis -> mesh axis (None = replicated)
    name: str | None = None  # the preset or file it came from, for messages
    # which of `jax.devices()` the mesh uses, by index, dp-pp-tp order (None: the first dp * pp * tp); a data-parallel
    # replica's config names its own slice (`replica`)
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        for axis in MESH_AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"mesh.{axis} must be an integer >= 1 (got {v!r})")
        rules = dict(self.rules.items() if isinstance(self.rules, dict) else self.rules)
        for logical, axis in rules.items():
            if logical not in LOGICAL_AXES:
                raise ValueError(f"mesh.rules: unknown logical axis {logical!r}; known: {', '.join(LOGICAL_AXES)}")
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(
                    f"mesh.rules.{logical}: unknown mesh axis {axis!r}; one of {', '.join(MESH_AXES)} or null"
                )
        object.__setattr__(self, "rules", tuple((k, rules.get(k)) for k in LOGICAL_AXES))
        if self.device_ids is not None:
            ids = tuple(self.device_ids)
            if len(ids) != self.num_devices or len(set(ids)) != len(ids) or any(
                    not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"mesh.device_ids must be {self.num_devices} distinct device indices >= 0 "
                                 f"(dp * pp * tp), got {list(ids)}")
            object.__setattr__(self, "device_ids", ids)

    @property
    def shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return self.dp * self.pp * self.tp

    @classmethod
    def preset(cls, name: str) -> "MeshConfig":
        """"single", or axis sizes in dp-pp-tp order joined by "_": "tp2", "pp2_tp2", "dp2_pp2", ..."""
        m = _PRESET.match(name) if name != "single" else None
        if name != "single" and (m is None or not any(m.groups())):
            raise ValueError(
                f"mesh: {name!r} is neither a mesh preset (single, tp2, pp2_tp2, dp2, ...) nor a .yaml file"
            )
        sizes = {} if m is None else {a: int(v) for a, v in zip(MESH_AXES, m.groups()) if v}
        return cls(**sizes, name=name)

    @classmethod
    def from_dict(cls, values: dict, source: str = "mesh") -> "MeshConfig":
        known = {f.name for f in dataclasses.fields(cls)} - {"name"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown mesh key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = dict(values)
        if "rules" in values:  # a file's rules override the defaults one logical axis at a time
            if not isinstance(values["rules"], dict):
                raise ValueError(f"{source}: mesh.rules must be a mapping of logical axis -> mesh axis or null")
            values["rules"] = tuple({**dict(DEFAULT_RULES), **values["rules"]}.items())
        return cls(**values, name=source)

    @classmethod
    def from_value(cls, value) -> "MeshConfig | None":
        """An `EngineConfig.mesh` value: None, a MeshConfig, a dict, a preset name or a .yaml path."""
        if value is None or isinstance(value, MeshConfig):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if not isinstance(value, str):
            raise ValueError(f"mesh must be a preset name, a .yaml path or a mapping (got {type(value).__name__})")
        if value.endswith((".yaml", ".yml")):
            import yaml

            with open(value) as f:
                values = yaml.safe_load(f) or {}
            if not isinstance(values, dict):
                raise ValueError(f"{value}: expected a mapping of mesh options, got {type(values).__name__}")
            return cls.from_dict(values, value)
        return cls.preset(value)

    def replica(self, i: int) -> "MeshConfig":
        """Data-parallel replica `i`'s own mesh: dp = 1, the same pp x tp, on its slice of this mesh's devices."""
        if not 0 <= i < self.dp:
            raise ValueError(f"replica {i} of a mesh with dp={self.dp}")
        n = self.pp * self.tp
        ids = self.device_ids or tuple(range(self.num_devices))
        name = f"{self.name or 'mesh'}[replica {i}]"
        return dataclasses.replace(self, dp=1, device_ids=ids[i * n:(i + 1) * n], name=name)

    def stage(self, s: int) -> "MeshConfig":
        """Pipeline stage `s`'s own mesh (of replica 0): dp = pp = 1, the same tp, on that stage's devices."""
        if not 0 <= s < self.pp:
            raise ValueError(f"stage {s} of a mesh with pp={self.pp}")
        ids = self.device_ids or tuple(range(self.num_devices))
        return dataclasses.replace(self, dp=1, pp=1, device_ids=ids[s * self.tp:(s + 1) * self.tp],
                                   name=f"{self.name or 'mesh'}[stage {s}]")

    def first_device(self) -> "MeshConfig":
        """One device: this mesh's first (for a small model beside a sharded one, e.g. a draft model)."""
        ids = self.device_ids or tuple(range(self.num_devices))
        return MeshConfig(device_ids=ids[:1], name=f"{self.name or 'mesh'}[first device]")

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis `logical` is sharded over, None if replicated (no rule, or the axis has size 1)."""
        axis = dict(self.rules).get(logical) if logical is not None else None
        return axis if axis is not None and getattr(self, axis) > 1 else None


def partition_spec(cfg: MeshConfig, logical_axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None,
                   units: dict[str, int] | None = None):
    """The PartitionSpec of an array with these logical axes (one per dimension; None = never sharded). With
    `shape`, a dimension is replicated unless the mesh axis divides its indivisible units: `units[logical]` of them
    (the head count of a flattened [heads * head_dim] dimension), else its size. A mesh axis shards one dimension."""
    from jax.sharding import PartitionSpec

    spec, used = [], set()
    for i, logical in enumerate(logical_axes):
        axis = cfg.mesh_axis(logical)
        n = None if shape is None else (units or {}).get(logical, shape[i])
        if axis is not None and (axis in used or (n is not None and n % getattr(cfg, axis))):
            axis = None
        used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def make_mesh(cfg: MeshConfig, devices=None):
    """The `jax.sharding.Mesh` of `cfg` over `devices` (default: every device of the job, `jax.devices()`): the
    ones `cfg.device_ids` names, else the first dp * pp * tp; raises, naming the mesh, if there are too few."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices() if devices is None else list(devices)
    n = cfg.num_devices
    if cfg.device_ids is not None:
        if max(cfg.device_ids) >= len(devices):
            raise ValueError(f"mesh {cfg.name or ''}: device_ids {list(cfg.device_ids)} name devices beyond the "
                             f"{len(devices)} available")
        devices = [devices[i] for i in cfg.device_ids]
    if len(devices) < n:
        sizes = " x ".join(f"{a}={getattr(cfg, a)}" for a in MESH_AXES)
        raise ValueError(
            f"mesh {cfg.name or ''} ({sizes}) needs {n} devices but {len(devices)} are available"
            + (" (on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
               if devices and devices[0].platform == "cpu" else "")
        )
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(cfg.dp, cfg.pp, cfg.tp), MESH_AXES)


def shardings(mesh, cfg: MeshConfig, tree, axes_tree, units: dict[str, int] | None = None):
    """NamedShardings for every array of `tree`, given a same-structured tree of logical-axes tuples (`units`: see
    `partition_spec`; for a model, `model_units(model_config)`)."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda a, axes: NamedSharding(mesh, partition_spec(cfg, axes, a.shape, units)), tree, axes_tree)


def model_units(model_cfg) -> dict[str, int]:
    """Indivisible units per logical axis of a Llama-family model: whole query and KV heads."""
    return {"heads": model_cfg.num_heads, "kv_heads": model_cfg.num_kv_heads}


def tensor_parallel_size(mesh) -> int:
    """The mesh's tensor-parallel degree (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["tp"]


def kv_head_replicas(cfg: MeshConfig, num_heads: int, num_kv_heads: int) -> int:
    """How many copies of each KV head tensor parallelism needs (vLLM's rule): 1 when tp divides the KV heads;
    tp / K when tp is a multiple of them (each shard then holds one copy of the KV head its query heads use).
    Raises, naming `mesh.tp`, when tp does not divide the query heads or neither rule applies."""
    tp = cfg.tp
    if num_heads % tp:
        raise ValueError(f"mesh.tp={tp} must divide the model's {num_heads} attention heads")
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads:
        raise ValueError(
            f"mesh.tp={tp} must divide the model's {num_kv_heads} KV heads or be a multiple of them (KV heads are "
            "then replicated)"
        )
    return tp // num_kv_heads


def vocab_lookup(mesh, table, ids):
    """`table[ids]` (table f[V, D] split on V over "tp" when tp divides V, ids i32[T]) -> f[T, D] replicated, as a
    vocabulary-parallel embedding: each shard looks up the ids in its own rows (zeros elsewhere) and one all-reduce
    of [T, D] sums them. Left to itself, XLA's GPU partitioner all-gathers the whole table for a gather of a few
    ids (1 GB per step for Llama-3-8B's at T = 1; bench/collectives.py found it); this fixes the plan."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    tp = tensor_parallel_size(mesh)
    if tp == 1 or table.shape[0] % tp:
        return table[ids]

    def local(rows, ids):  # rows f[V / tp, D]: this shard's slice of the vocabulary
        at = ids - jax.lax.axis_index("tp") * rows.shape[0]
        here = (at >= 0) & (at < rows.shape[0])
        x = jnp.where(here[:, None], rows[jnp.where(here, at, 0)], jnp.zeros((), rows.dtype))
        return jax.lax.psum(x, "tp")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("tp", None), P()), out_specs=P(), check_vma=False)(table, ids)


def heads_shard_map(mesh, fn, q, k_pages, v_pages, k_scales, v_scales, *replicated):
    """`fn(q, k_pages, v_pages, k_scales, v_scales, *replicated)` once per tensor-parallel shard, each on its own
    query heads and KV heads (q f[T, N, H] and pages [P, page_size, K, H] split on their head axes, scales on K;
    `replicated`: block tables and per-token metadata, whole on every shard). The kernel sees only local heads."""
    import jax
    from jax.sharding import PartitionSpec as P

    heads, pages, scales = P(None, "tp", None), P(None, None, "tp", None), P(None, None, "tp")
    quantized = k_scales is not None

    def local(q, k, v, *rest):
        ks, vs, rest = (rest[0], rest[1], rest[2:]) if quantized else (None, None, rest)
        return fn(q, k, v, ks, vs, *rest)

    args = (q, k_pages, v_pages) + ((k_scales, v_scales) if quantized else ()) + replicated
    specs = (heads, pages, pages) + ((scales, scales) if quantized else ()) + tuple(
        jax.tree.map(lambda _: P(), r) for r in replicated)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)(*args)
