"""Test setup: CPU devices, float32 everywhere, a persistent compilation cache under .jax_cache/."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault(
    "JAXSERVE_COMPILE_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)

import warnings  # noqa: E402

import pytest  # noqa: E402

# A donated buffer XLA cannot reuse means the KV cache was silently copied: fail loudly.
warnings.filterwarnings("error", message="Some donated buffers were not usable")

# The slowest test files (seconds on 2 cores from a fresh clone, measured 2026-12-07), run first, longest first:
# scripts/test.sh gives whole files to 2 workers (pytest-xdist --dist loadfile) in collection order, so starting the
# long ones early keeps one worker from finishing alone with a long file at the end. Within a file the order is
# unchanged.
SLOW_FILES_FIRST = (
    "test_weight_quant_engine.py",  # 360
    "test_eagle3.py",  # 305
    "test_smollm2.py",  # 255
    "test_spec_decode.py",  # 245
    "test_cpu_attention_kernel.py",  # 215
    "test_eagle3_training.py",  # 215
    "test_shipped_head.py",  # 205
    "test_cpu_matmul_quant.py",  # ~200
    "test_tensor_parallel.py",  # 190
    "test_engine.py",  # 190
    "test_kv_quant.py",  # 185
    "test_rpa_kernel.py",  # 150
    "test_model_parity.py",  # 145
    "test_async_scheduling.py",  # 135
    "test_rpa_compile_sm90.py",  # 130
    "test_step_compile_sm90.py",  # 80
    "test_pipeline_parallel.py",  # 70
    "test_weight_quant.py",  # 65
    "test_spec_verify_kernel.py",  # 65
    "test_soak.py",  # 60
    "test_multihost.py",  # 55
    "test_data_parallel.py",  # 50
    "test_gguf.py",  # 50
    "test_bench_collectives.py",  # 45
    "test_trainer_mesh.py",  # 40
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their own order


@pytest.fixture
def alternating_controller(monkeypatch):
    """The speculation controller decides K = max and K = 0 in turn, whatever the timings and acceptance (an
    optimistic call, a proposer's hint, predicts the next decision): steps that speculate and steps that do not
    both occur, deterministically."""
    from jaxserve.spec_decode import controller

    def alternate(self, base_tokens, draft_lens, optimistic=False, room=None):  # the budget's room is ignored
        decision = self.num_decisions + 1
        if not optimistic:
            self.num_decisions = decision
        return self.k_max if decision % 2 else 0

    monkeypatch.setattr(controller.SpecController, "choose_k", alternate)
