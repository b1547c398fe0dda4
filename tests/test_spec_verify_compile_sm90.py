"""Every speculative-verification kernel configuration the entry can choose compiles for sm_90 (H100/H200) without
a GPU: deviceless AOT through the CUDA PJRT plugin, down to PTX (harness: tests/sm90_aot.py).

Configurations: each BLOCK_TABLE kind and draft form (logits + one-hot; probs + probabilistic q; probs + one-hot)
at R in {16, 64, 256} verify rows x V in {32000, 49152, 128256, 152064}; `block_sizes_for` picks the vocabulary
split, so both the one-pass (split 1) and split + XLA-epilogue launches are compiled.

The kernel stages nothing in shared memory (a register stream with small cross-warp reductions), so there is no
shared-memory limit for a bad tiling to trip; the control instead checks that a tiling the Triton lowering refuses
(a non-power-of-two block, which the entry's validation would reject) is reported as a failure.
"""

from __future__ import annotations

import json

import pytest

from sm90_aot import compile_config, h200_spec_factory, run_compile_child

ROWS = (16, 64, 256)
VOCABS = (32000, 49152, 128256, 152064)
FORMS = ("logits-one_hot", "probs-probabilistic", "probs-one_hot")


def configs() -> list[dict]:
    return [dict(form=f, rows=r, vocab=v) for f in FORMS for r in ROWS for v in VOCABS]


def config_id(c: dict) -> str:
    return f"{c['form']}-R{c['rows']}-V{c['vocab']}"


def _args(spec, form: str, R: int, V: int):
    row, vec_i, vec_f = spec((R, V), "float32"), spec((R,), "int32"), spec((R,), "float32")
    if form == "logits-one_hot":  # scaled, greedy, is_random, draft_ids, uniform, gumbel
        return [row, vec_i, spec((R,), "bool"), vec_i, vec_f, row]
    if form == "probs-probabilistic":  # p, q, draft_ids, uniform, gumbel
        return [row, row, vec_i, vec_f, row]
    return [row, vec_i, vec_f, row]  # p, draft_ids, uniform, gumbel


def _compile_all() -> list[dict]:
    """Child process: one JSON result per config, then the control."""
    from pallas_kernels import spec_verify as sv
    from pallas_kernels.spec_verify.kernel import BlockSizes, spec_verify_kernel

    spec = h200_spec_factory()
    fns = {
        "logits-one_hot": lambda *a: sv.verify_one_hot(*a, impl="kernel"),
        "probs-probabilistic": lambda p, q, d, u, g: sv.rejection_sample(p, q, d, u, g, impl="kernel"),
        "probs-one_hot": lambda p, d, u, g: sv.rejection_sample(p, None, d, u, g, impl="kernel"),
    }
    results = []
    for c in configs():
        kind = c["form"].split("-")[0]
        bs = sv.block_sizes_for(num_rows=c["rows"], vocab=c["vocab"], target_kind=kind)
        results.append(compile_config(config_id(c), fns[c["form"]], _args(spec, c["form"], c["rows"], c["vocab"]),
                                      expect_in_hlo="spec_verify", note=str(bs)))
    R, V = 64, 152064
    bad = BlockSizes(block_v=3000)
    args = _args(spec, "probs-probabilistic", R, V) + [spec((R,), "int32"), spec((R,), "bool")]
    results.append(compile_config(
        "control-non-power-of-two-block",
        lambda *a: spec_verify_kernel(*a, target_kind="probs", block_sizes=bad), args,
        expect_in_hlo="spec_verify", note=str(bad)))
    return results


@pytest.fixture(scope="module")
def compile_results() -> dict[str, dict]:
    return run_compile_child(__file__, timeout=900)


@pytest.mark.parametrize("config", configs(), ids=config_id)
def test_kernel_compiles_for_sm90(config, compile_results):
    result = compile_results[config_id(config)]
    assert result["ok"], f"{result['id']} ({result['note']}) did not compile for sm_90:\n{result['error']}"


def test_refused_tiling_is_reported(compile_results):
    result = compile_results["control-non-power-of-two-block"]
    assert not result["ok"], "a non-power-of-two block compiled: the harness would not report failures"
    assert "power of 2" in result["error"], result["error"]


if __name__ == "__main__":
    for r in _compile_all():
        print(json.dumps(r), flush=True)
