"""Every ragged paged attention kernel configuration in the block-size table compiles for sm_90 (H100/H200)
without a GPU: deviceless AOT through the CUDA PJRT plugin, down to PTX, so a kernel that fails to lower or
exceeds shared memory / registers fails CI (`shared/notes/jax-on-cpu.md` §2).

The plugin (`jax-cuda12-plugin` + `jax-cuda12-pjrt`, same version as jaxlib, no CUDA libraries) lives outside the
main environment so that no other process sees it: `scripts/setup.sh --test` installs it into `.venv/cuda-aot`,
and the compiles run in a child process (this file run as a script) with that folder on its path.
"""

from __future__ import annotations

import json

import pytest

from sm90_aot import compile_config, h200_spec_factory, run_compile_child

# Production-like shapes per shape class: (num_tokens, num_seqs, max_pages at page_size 16).
SHAPES = {"decode": (64, 64, 256), "verify": (256, 64, 128), "prefill": (1024, 4, 128)}


def configs() -> list[dict]:
    """Each table entry at every supported page size (bf16 KV), and at page size 16 with every other KV dtype;
    plus sliding window / soft-cap, MQA and MHA variants."""
    from pallas_kernels import ragged_paged_attention as rpa

    out = []
    for mode, head_dim in rpa.BLOCK_TABLE:
        base = dict(mode=mode, head_dim=head_dim, num_q_heads=32, num_kv_heads=8, q_dtype="bfloat16")
        for page_size in rpa.SUPPORTED_PAGE_SIZES:
            out.append(dict(base, page_size=page_size, kv_dtype="bfloat16"))
        for kv_dtype in rpa.SUPPORTED_KV_DTYPES:
            if kv_dtype != "bfloat16":
                q_dtype = "float32" if kv_dtype == "float32" else "bfloat16"
                out.append(dict(base, page_size=16, kv_dtype=kv_dtype, q_dtype=q_dtype))
        out.append(dict(base, page_size=16, kv_dtype="int8", sliding_window=1024, soft_cap=50.0))
    out.append(dict(mode="decode", head_dim=128, num_q_heads=64, num_kv_heads=1, q_dtype="bfloat16",
                    page_size=16, kv_dtype="float8_e4m3fn"))  # MQA: 64 query heads on one kv head
    out.append(dict(mode="prefill", head_dim=64, num_q_heads=12, num_kv_heads=12, q_dtype="float16",
                    page_size=32, kv_dtype="float16"))  # MHA
    return out


def config_id(c: dict) -> str:
    extra = "-window-cap" if c.get("sliding_window") else ""
    return (f"{c['mode']}-h{c['head_dim']}-p{c['page_size']}-{c['kv_dtype']}-q{c['q_dtype']}"
            f"-{c['num_q_heads']}x{c['num_kv_heads']}{extra}")


def _compile_all() -> list[dict]:
    """Child process: compile every config for the H200 target; one JSON result per config."""
    import jax.numpy as jnp

    from pallas_kernels import ragged_paged_attention as rpa

    spec = h200_spec_factory()
    results = [_oversized_control(spec)]
    for c in configs():
        T, S, max_pages = SHAPES[c["mode"]]
        max_pages = max_pages * 16 // c["page_size"]
        N, K, H, page_size = c["num_q_heads"], c["num_kv_heads"], c["head_dim"], c["page_size"]
        num_pages = S * max_pages + 1
        args = [
            spec((T, N, H), c["q_dtype"]),
            spec((num_pages, page_size, K, H), c["kv_dtype"]),
            spec((num_pages, page_size, K, H), c["kv_dtype"]),
            spec((S, max_pages), jnp.int32),
            spec((S,), jnp.int32),
            spec((S + 1,), jnp.int32),
            spec((), jnp.int32),
        ]
        if c["kv_dtype"] in ("int8", "float8_e4m3fn"):
            args += [spec((num_pages, page_size, K), jnp.float32)] * 2
        block_sizes = rpa.block_sizes_for(num_tokens=T, num_seqs=S, num_q_heads=N, num_kv_heads=K, head_dim=H,
                                          page_size=page_size, max_pages=max_pages)

        def f(*a, c=c):
            return rpa.ragged_paged_attention(*a, sm_scale=H**-0.5, impl="kernel", sliding_window=c.get(
                "sliding_window"), soft_cap=c.get("soft_cap"))

        results.append(compile_config(config_id(c), f, args, expect_in_hlo="ragged_paged_attention",
                                      note=str(block_sizes)))
    return results


def _oversized_control(spec) -> dict:
    """A deliberately oversized tiling (16 query tokens x 256 f32 keys of head dim 128 in 8 pipeline stages, ~1 MB of
    shared memory against the H200's 227 KB): the compile must refuse it, proving that this harness catches what
    only the GPU compiler sees (shared memory / registers). Small tiles in deep stages: it fails in ~3 s, where a
    1024-key tile took ~60 s to fail the same way."""
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention.kernel import BlockSizes, ragged_paged_attention_kernel

    T, S, N, K, H, page_size, max_pages = 512, 2, 32, 8, 128, 16, 128
    num_pages = S * max_pages + 1
    args = [spec((T, N, H), jnp.float32), spec((num_pages, page_size, K, H), jnp.float32),
            spec((num_pages, page_size, K, H), jnp.float32), spec((S, max_pages), jnp.int32),
            spec((S,), jnp.int32), spec((S + 1,), jnp.int32), spec((), jnp.int32)]
    block_sizes = BlockSizes(block_q=16, chunk_pages=16, num_stages=8)
    return compile_config("oversized-control", lambda *a: ragged_paged_attention_kernel(
        *a, sm_scale=0.1, block_sizes=block_sizes), args, expect_in_hlo="ragged_paged_attention",
        note=str(block_sizes))


@pytest.fixture(scope="module")
def compile_results() -> dict[str, dict]:
    return run_compile_child(__file__)


@pytest.mark.parametrize("config", configs(), ids=config_id)
def test_kernel_compiles_for_sm90(config, compile_results):
    result = compile_results[config_id(config)]
    assert result["ok"], f"{result['id']} ({result['note']}) did not compile for sm_90:\n{result['error']}"


def test_oversized_tiling_fails_to_compile(compile_results):
    result = compile_results["oversized-control"]
    assert not result["ok"], "an oversized tiling compiled: the sm_90 check would not catch resource errors"
    assert "shared memory" in result["error"].lower() or "resource" in result["error"].lower(), result["error"]


if __name__ == "__main__":
    for r in _compile_all():
        print(json.dumps(r), flush=True)
