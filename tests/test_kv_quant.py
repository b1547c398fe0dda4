"""Quantized KV cache on the real default model (SmolLM2-135M-Instruct): what int8 / fp8 (e4m3) keys and values
cost in output quality against a float32 cache, and what they buy in capacity at the same KV memory budget.

Quality, per KV dtype, on the same prompts:
  * greedy agreement: generated tokens equal to the float32-KV run's (and where the first difference is);
  * log-prob drift, teacher-forced: every engine scores the float32 run's full sequences (prompt + greedy
    continuation) as prompts, so both sides see identical contexts; |delta log p(token)| over every position.
The numbers are printed and written to docs/benchmarks/kv_quant.md.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.kv_cache import kv_cache_bytes
from jaxserve.loader import load_checkpoint

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl who",
    "def fibonacci(n):",
    "Here are three tips for staying healthy:",
]
MAX_TOKENS = 32
KV_DTYPES = ["auto", "bfloat16", "int8", "fp8"]  # "auto" = float32, the model's dtype on CPU
MAX_MODEL_LEN = 512
BUDGET_SEQS_BF16 = 4  # the KV budget: exactly this many max_model_len sequences in bf16
REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "kv_quant.md")


def _engine(kv_cache_dtype: str, budget: int) -> LLM:
    return LLM(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64, precompile=False,
        kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget, quantization="none",  # KV effects alone
    )


def _token_logprobs(llm: LLM, sequences: list[list[int]]) -> list[np.ndarray]:
    """log p(token_i | tokens_<i) for i >= 1 of each sequence, scored as a prompt."""
    outs = llm.generate(
        [{"prompt_token_ids": s} for s in sequences],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False,
    )
    return [np.array([lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]) for s, o in zip(sequences, outs)]


@pytest.fixture(scope="module")
def runs():
    # The budget: exactly BUDGET_SEQS_BF16 sequences of max_model_len in bf16, plus the padding page 0.
    cfg = EngineConfig(max_model_len=MAX_MODEL_LEN)
    pages = 1 + BUDGET_SEQS_BF16 * cfg.max_pages_per_seq
    budget = kv_cache_bytes(load_checkpoint(None).config, pages, cfg.page_size, "bfloat16")
    results, sequences = {}, None
    for dtype in KV_DTYPES:
        llm = _engine(dtype, budget)
        eng = llm.llm_engine
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        if sequences is None:  # the float32-KV run defines the sequences everyone scores
            sequences = [o.prompt_token_ids + t for o, t in zip(outs, tokens)]
        kv = eng.runner.kv
        results[dtype] = dict(
            tokens=tokens,
            texts=[o.outputs[0].text for o in outs],
            logprobs=_token_logprobs(llm, sequences),
            num_pages=eng.config.num_pages,
            max_seqs=(eng.config.num_pages - 1) // eng.config.max_pages_per_seq,
            kv_bytes=sum(x.nbytes for x in (kv.k, kv.v, kv.k_scale, kv.v_scale) if x is not None),
            storage=str(kv.k.dtype),
        )
        del llm, eng, kv
    return results, budget


def _summary(results, budget) -> str:
    base = results["auto"]
    lines = [
        "# Quantized KV cache: quality and capacity on SmolLM2-135M-Instruct",
        "",
        f"Written by `tests/test_kv_quant.py` (CPU, float32 model, XLA reference attention). {len(PROMPTS)} prompts, "
        f"{MAX_TOKENS} greedy tokens each. KV budget {budget / 2**20:.2f} MiB = {BUDGET_SEQS_BF16} sequences of "
        f"{MAX_MODEL_LEN} tokens in bf16. Log-prob drift is teacher-forced on the float32-KV sequences "
        "(prompt + continuation), over every position.",
        "",
        "| KV dtype | stored as | pages | max_model_len seqs | bytes/token vs bf16 | greedy tokens = float32 KV "
        "| first divergence (per prompt) | mean abs dlogp | max abs dlogp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def per_token(r):
        return r["kv_bytes"] / r["num_pages"]

    for dtype, r in results.items():
        same = [sum(a == b for a, b in zip(t, bt)) for t, bt in zip(r["tokens"], base["tokens"])]
        first = [next((i for i, (a, b) in enumerate(zip(t, bt)) if a != b), None)
                 for t, bt in zip(r["tokens"], base["tokens"])]
        d = np.concatenate([np.abs(a - b) for a, b in zip(r["logprobs"], base["logprobs"])])
        r.update(agree=sum(same) / (len(PROMPTS) * MAX_TOKENS), mean_drift=float(d.mean()), max_drift=float(d.max()))
        lines.append(
            f"| {dtype if dtype != 'auto' else 'auto (float32)'} | {r['storage']} | {r['num_pages']} | {r['max_seqs']} "
            f"| {per_token(r) / per_token(results['bfloat16']):.3f} | {sum(same)}/{len(PROMPTS) * MAX_TOKENS} "
            f"| {', '.join('none' if f is None else str(f) for f in first)} | {r['mean_drift']:.4f} "
            f"| {r['max_drift']:.4f} |"
        )
    lines += [
        "",
        "Bytes per token and kv head: float32 4H, bf16 2H, int8/fp8 H + 4 (one f32 scale). At head_dim 64 the scale",
        "costs 6%: int8 holds 1.88x the tokens of bf16 (1.94x at head_dim 128), not a full 2x.",
        "",
    ]
    return "\n".join(lines)


def test_quantized_kv_quality_and_capacity(runs):
    results, budget = runs
    text = _summary(results, budget)
    print("\n" + text)
    os.makedirs(os.path.dirname(REPORT), exist_ok=True)
    with open(REPORT, "w") as f:
        f.write(text)

    base = results["auto"]
    assert results["bfloat16"]["max_seqs"] == BUDGET_SEQS_BF16
    for dtype in ("int8", "fp8"):
        r = results[dtype]
        # Capacity: same budget, every byte accounted (values + scales), 1.88x the pages of bf16 at head_dim 64.
        assert r["kv_bytes"] <= budget
        assert (r["num_pages"] - 1) >= 1.85 * (results["bfloat16"]["num_pages"] - 1)
        assert r["max_seqs"] >= 2 * BUDGET_SEQS_BF16 - 1
        # Quality: the continuation starts the same and the per-token log-probs move little.
        for t, bt in zip(r["tokens"], base["tokens"]):
            assert t[:4] == bt[:4], f"{dtype} KV changed the first greedy tokens"
    # Measured (CPU, 2026-11-29): int8 mean 0.016 / max 0.095, fp8 mean 0.039 / max 0.23, bf16 mean 0.003.
    assert results["int8"]["mean_drift"] < 0.05 and results["int8"]["max_drift"] < 0.5
    assert results["fp8"]["mean_drift"] < 0.12 and results["fp8"]["max_drift"] < 1.0
    assert results["bfloat16"]["mean_drift"] < results["fp8"]["mean_drift"] + 0.05
