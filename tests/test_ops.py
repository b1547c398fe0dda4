"""`jaxserve.ops`, the one door to the kernels: the backend fields of `EngineConfig`, their resolution into
`ops.Backends`, the model taking that value as a static argument, and the rule that no other module of jaxserve,
service, training or bench imports a kernel package (DESIGN.md "Decisions added in December 2026")."""

from __future__ import annotations

import ast
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import ops
from jaxserve.config import BACKEND_ENV, EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION_ENV, MATMUL_ENV = BACKEND_ENV["attention_backend"], BACKEND_ENV["matmul_backend"]


@pytest.fixture
def no_backend_env(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    monkeypatch.delenv(MATMUL_ENV, raising=False)
    return monkeypatch


# --- EngineConfig fields ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["attention_backend", "matmul_backend"])
def test_backend_fields_are_validated(no_backend_env, field):
    for bad in ("triton", "", "pallas", 1):
        with pytest.raises(ValueError, match=f"^{field} must be one of auto, xla, native"):
            EngineConfig(**{field: bad})
    assert getattr(EngineConfig(**{field: " Native "}), field) == "native"  # as forgiving as the variables were
    assert getattr(EngineConfig.from_dict({field: "xla"}), field) == "xla"


@pytest.mark.parametrize("field", ["attention_backend", "matmul_backend"])
def test_backend_fields_default_to_the_environment(no_backend_env, field):
    env = BACKEND_ENV[field]
    assert getattr(EngineConfig(), field) == "auto"
    for value, expected in (("xla", "xla"), ("NATIVE", "native"), ("", "auto"), ("auto", "auto")):
        no_backend_env.setenv(env, value)
        assert getattr(EngineConfig(), field) == expected
    no_backend_env.setenv(env, "onednn")
    with pytest.raises(ValueError, match=f"^{env} \\(the default of {field}\\) must be one of auto, xla, native"):
        EngineConfig()


@pytest.mark.parametrize("field", ["attention_backend", "matmul_backend"])
def test_explicit_field_overrides_the_environment(no_backend_env, field):
    no_backend_env.setenv(BACKEND_ENV[field], "native")
    assert getattr(EngineConfig(**{field: "xla"}), field) == "xla"
    no_backend_env.setenv(BACKEND_ENV[field], "not-a-backend")  # not even read when the field is given
    assert getattr(EngineConfig(**{field: "auto"}), field) == "auto"
    # replace() keeps the resolved value rather than re-reading the environment
    assert getattr(EngineConfig(**{field: "xla"}).replace(seed=1), field) == "xla"


# --- resolution ----------------------------------------------------------------------------------------------------


def test_resolve_on_cpu(no_backend_env):
    """On this CPU machine (g++ present): native attention and matmul for float32 unrolled layers, XLA dots for
    bfloat16 or scanned layers, and the explicit choices raise for what cannot run."""
    assert jax.default_backend() == "cpu" and ops.native_attention_available() and ops.native_matmul_available()
    cfg = EngineConfig()
    assert ops.resolve_backends(cfg, "float32", scan_layers=False) == ops.Backends(attention="native", matmul="native")
    assert ops.resolve_backends(cfg, "bfloat16", scan_layers=False) == ops.Backends(attention="native", matmul="xla")
    assert ops.resolve_backends(cfg, jnp.float32, scan_layers=True) == ops.Backends(attention="native", matmul="xla")
    xla = EngineConfig(attention_backend="xla", matmul_backend="xla")
    assert ops.resolve_backends(xla, "float32", scan_layers=False) == ops.Backends(attention="xla", matmul="xla")
    native = EngineConfig(attention_backend="native", matmul_backend="native")
    assert ops.resolve_backends(native, "float32", scan_layers=False) == ops.Backends(attention="native",
                                                                                      matmul="native")
    with pytest.raises(ValueError, match="matmul_backend=native .* cannot be used: dtype is bfloat16, not float32"):
        ops.resolve_backends(native, "bfloat16", scan_layers=False)
    with pytest.raises(ValueError, match="matmul_backend=native .* cannot be used: layers are scanned"):
        ops.resolve_backends(native, "float32", scan_layers=True)
    no_backend_env.setenv(MATMUL_ENV, "xla")  # the environment reaches resolution through the config's default
    assert ops.resolve_backends(EngineConfig(), "float32", scan_layers=False).matmul == "xla"


def test_default_for_callers_without_an_engine(no_backend_env):
    """`Backends.default`: attention from the environment (else auto), matmul from the weights' form; a matmul
    variable meant for serving does not stop a direct model call on unpacked weights."""
    assert ops.Backends.default() == ops.Backends(attention="native", matmul="xla")
    assert ops.Backends.default(packed_weights=True) == ops.Backends(attention="native", matmul="native")
    no_backend_env.setenv(MATMUL_ENV, "native")
    no_backend_env.setenv(ATTENTION_ENV, "xla")
    assert ops.Backends.default() == ops.Backends(attention="xla", matmul="xla")
    no_backend_env.setenv(ATTENTION_ENV, "triton")
    with pytest.raises(ValueError, match="JAXSERVE_ATTENTION_BACKEND .* must be one of"):
        ops.Backends.default()


def test_resolve_on_a_gpu(no_backend_env):
    """What a GPU process resolves to (jax.default_backend faked): Pallas attention, the Pallas matmul for group-wise
    quantized weights (XLA dots for the rest), XLA dots when asked; native raises."""
    no_backend_env.setattr(jax, "default_backend", lambda: "gpu")
    assert ops.resolve_backends(EngineConfig(), "bfloat16", scan_layers=True) == ops.Backends(attention="pallas",
                                                                                              matmul="pallas")
    assert ops.resolve_backends(EngineConfig(matmul_backend="xla"), "bfloat16", scan_layers=True).matmul == "xla"
    with pytest.raises(ValueError, match="attention_backend=native .* needs the CPU backend \\(running on gpu\\)"):
        ops.resolve_backends(EngineConfig(attention_backend="native"), "float32", scan_layers=False)
    with pytest.raises(ValueError, match="matmul_backend=native .* the backend is gpu, not cpu"):
        ops.resolve_backends(EngineConfig(matmul_backend="native"), "float32", scan_layers=False)


def test_backends_value():
    """Concrete choices only, hashable (a static jit argument), equal by value."""
    b = ops.Backends(attention="pallas", matmul="xla")
    assert hash(b) == hash(ops.Backends(attention="pallas", matmul="xla")) and b in {b}
    with pytest.raises(ValueError, match="Backends.attention must be one of pallas, native, xla .*'auto'"):
        ops.Backends(attention="auto", matmul="xla")
    with pytest.raises(ValueError, match="Backends.matmul must be one of native, xla, pallas"):
        ops.Backends(attention="xla", matmul="triton")
    with pytest.raises(TypeError):
        ops.Backends("xla", "xla")  # keyword-only


# --- the model takes the resolved value -----------------------------------------------------------------------------


def test_forward_runs_the_backend_it_is_given(tmp_path, no_backend_env):
    """`forward(..., backends=...)` traces the native attention kernel exactly when told to, whatever the
    environment says, and both paths give the same hidden states."""
    from jaxserve.batch import Bucket, ScheduledSeq, StepInputs, build_step_inputs
    from jaxserve.kv_cache import init_kv_cache
    from jaxserve.loader import load_checkpoint
    from jaxserve.loader.weights import to_weights
    from jaxserve.model.llama import forward, unstack_layers
    from tiny_models import make_tiny_model

    make_tiny_model("llama_gqa", str(tmp_path))
    ckpt = load_checkpoint(str(tmp_path))
    weights = unstack_layers(to_weights(ckpt.config, ckpt.tensors, np.dtype("float32")))
    kv = init_kv_cache(ckpt.config, 9, 4, jnp.float32)
    rng = np.random.default_rng(0)
    seqs = [ScheduledSeq(rng.integers(3, 300, 7).tolist(), 0, [1, 2]), ScheduledSeq([5], 0, [3])]
    host = build_step_inputs(seqs, Bucket(num_tokens=8, num_seqs=2, max_pages=2), 4)
    inputs = host if isinstance(host, StepInputs) else StepInputs(**host)  # (a dict of arrays in older batch.py)
    no_backend_env.setenv(ATTENTION_ENV, "native")  # must not matter: the argument decides
    out = {}
    for attention in ("xla", "native"):
        backends = ops.Backends(attention=attention, matmul="xla")
        step = jax.jit(functools.partial(forward, ckpt.config, backends=backends))
        hlo = step.lower(weights, kv, inputs).as_text()
        assert ("jaxserve_ragged_paged_attention" in hlo) == (attention == "native"), attention
        out[attention] = np.asarray(step(weights, kv, inputs)[0])
    np.testing.assert_allclose(out["native"], out["xla"], rtol=1e-5, atol=1e-5)


# --- one door ------------------------------------------------------------------------------------------------------

KERNEL_PACKAGES = ("pallas_kernels", "cpu_kernels")
KNOWN_OFFENDERS: dict[str, str] = {}  # path -> reason, for a strict xfail while a module moves behind the door


def _python_files() -> list[str]:
    out = []
    for pkg in ("jaxserve", "service", "training", "bench"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in sorted(filenames) if f.endswith(".py")]
    return [p for p in out if p != os.path.join("jaxserve", "ops.py")]


def _case(path: str):
    reason = KNOWN_OFFENDERS.get(path.replace(os.sep, "/"))
    return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else path


def _imported_modules(tree: ast.AST):
    """(line, module) of every absolute import anywhere in the file, lazy ones and `import_module("...")` too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


@pytest.mark.parametrize("path", [_case(p) for p in _python_files()])
def test_only_ops_imports_kernel_packages(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = [f"{path}:{line} imports {m}" for line, m in _imported_modules(tree)
             if m.split(".")[0] in KERNEL_PACKAGES]
    assert not found, f"only jaxserve/ops.py may import {' or '.join(KERNEL_PACKAGES)}; call jaxserve.ops: {found}"
