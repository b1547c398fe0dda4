"""The engine end to end on a tiny random Llama: greedy parity with HF, batching invariance, preemption,
logprobs, stop conditions, bad input handling, and no recompilation in steady state."""

import gc
import math

import jax
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_model("llama_gqa", str(path))
    return str(path), hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[0], max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=128, precompile=False)


def _prompts(n, seed=0, lo=2, hi=45):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_greedy_matches_hf_generate(llm, tiny):
    prompts = _prompts(6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(tiny[1], p, 10)
        assert o.outputs[0].finish_reason == "length"
        assert o.prompt_token_ids == p


def generate_busy(eng, prompts, params) -> list[list[int]]:
    """Token ids of each prompt when one new request arrives per step while the others decode or prefill."""
    return [o.token_ids for o in generate_busy_outputs(eng, prompts, params)]


def generate_busy_outputs(eng, prompts, params) -> list:
    """`generate_busy`, returning each request's CompletionOutput."""
    got, pending = {}, list(enumerate(prompts))
    while pending or eng.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            eng.add_request(f"busy-{i}", p if isinstance(p, dict) else {"prompt_token_ids": p}, params)
        for out in eng.step():
            if out.finished:
                got[int(out.request_id.split("-")[1])] = out.outputs[0]
    return [got[i] for i in range(len(prompts))]


def test_alone_equals_in_busy_batch(llm):
    """Each request's output is the same alone and mixed with others that arrive at different steps."""
    prompts = _prompts(7, seed=1)
    alone = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert generate_busy(llm.llm_engine, prompts, GREEDY) == alone


def test_preemption_keeps_outputs_and_pages(tiny):
    """With KV memory for barely two sequences, requests are preempted and recomputed; outputs do not change."""
    path, _ = tiny
    prompts = _prompts(6, seed=2, lo=10, hi=30)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = LLM(path, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, precompile=False)
    want = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
    tight = LLM(path, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=64, num_pages=1 + 24,
                precompile=False)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = tight.llm_engine
    assert eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    eng.block_manager.check()
    assert eng.block_manager.num_free_pages == eng.config.num_pages - 1


def test_logprobs(llm, tiny):
    p = _prompts(1, seed=3)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=3, logprobs=5),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    with torch.no_grad():
        ref = torch.log_softmax(tiny[1](torch.tensor([p])).logits[0, -1], -1).numpy()
    top = np.argsort(-ref)[:5]
    first = c.logprobs[0]
    assert list(first)[:5] == top.tolist()
    for rank, t in enumerate(top, 1):
        assert first[int(t)].rank == rank
        assert math.isclose(first[int(t)].logprob, float(ref[t]), abs_tol=1e-4)
    assert math.isclose(c.cumulative_logprob, sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)),
                        abs_tol=1e-4)


def test_stop_token_ids_and_max_tokens(llm):
    p = _prompts(1, seed=4)[0]
    full = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = full[4]
    k = full.index(stop_at)
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == full[: k + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    short = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    assert short[0].outputs[0].token_ids == full[:3]


def test_n_greater_than_one(llm):
    p = _prompts(1, seed=5)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(n=3, temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt is empty"),
        ({"prompt_token_ids": list(range(3, 200))}, GREEDY, "max_model_len is 128"),
        ({"prompt_token_ids": [5, 100000]}, GREEDY, r"token ids must be in \[0, 300\)"),
        ({"prompt_token_ids": "abc"}, GREEDY, "list of integers"),
        ({"text": "x"}, GREEDY, "needs 'prompt_token_ids'"),
        ({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=50), "max_logprobs"),
    ],
)
def test_bad_requests_fail_alone(llm, prompt, params, match):
    """A bad prompt raises a clear error before anything runs; the engine keeps serving others."""
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [7, 8, 9]}, prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    ok = llm.generate({"prompt_token_ids": [7, 8, 9]}, GREEDY, use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 10


def test_bad_request_mid_flight_leaves_others_untouched(llm):
    eng = llm.llm_engine
    p = _prompts(1, seed=6)[0]
    want = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("good", {"prompt_token_ids": p}, GREEDY)
    eng.step()
    with pytest.raises(ValueError):
        eng.add_request("bad", {"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("good", {"prompt_token_ids": p}, GREEDY)
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            done = out
    assert done.request_id == "good" and done.outputs[0].token_ids == want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=-1), "max_tokens must be an integer >= 1"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-0.5), r"temperature must be in \[0, 100\]"),
        (dict(top_k=-3), "top_k must be"),
        (dict(n=0), "n must be"),
        (dict(min_p=1.5), "min_p must be"),
        (dict(logprobs=-1), "logprobs must be"),
        (dict(stop=[""]), "stop must be a non-empty string"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="page_buckets must be >= 1 and the largest must hold max_model_len=2048"):
        EngineConfig(page_buckets=(8, 64))
    assert EngineConfig().page_buckets == (8, 16, 32, 64, 128)
    assert EngineConfig(max_model_len=1000, page_buckets=(4, 32, 64, 128)).page_buckets == (4, 32, 64)


def test_layers_unrolled_on_cpu_read_weights_in_place(tiny):
    """On the CPU the layers run unrolled over per-layer weights (same outputs as the scanned stack), and no compiled
    step slices a layer's weight matrices out of a stacked array: under `lax.scan`, XLA:CPU copies them every step.
    With the native attention kernel the engine compiles one page bucket."""
    import re

    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_model_len=64, precompile=False)
    scanned, unrolled = LLM(tiny[0], scan_layers=True, **kw), LLM(tiny[0], **kw)
    assert not unrolled.llm_engine.runner.scan_layers and scanned.llm_engine.runner.scan_layers
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in unrolled.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in scanned.generate(prompts, params, use_tqdm=False)
    ]

    layers = scanned.llm_engine.runner.weights.layers
    matrices = {f"f32[1,{a},{b}]" for a, b in (layers.wq.shape[1:], layers.w_up.shape[1:], layers.w_down.shape[1:])}

    def weight_slices(llm) -> list[str]:
        r = llm.llm_engine.runner
        hlo = r.executable(r.all_buckets()[0]).as_text()
        return [m for m in re.findall(r"= (f32\[[\d,]+\])\S* dynamic-slice\(", hlo) if m in matrices]

    assert weight_slices(scanned), "the scanned step should slice stacked weights (else this test checks nothing)"
    assert weight_slices(unrolled) == []
    if unrolled.llm_engine.runner.backends.attention == "native":
        assert unrolled.llm_engine.config.page_buckets == (16,)


def test_abort_frees_everything(llm):
    eng = llm.llm_engine
    for i, p in enumerate(_prompts(5, seed=7)):
        eng.add_request(f"ab-{i}", {"prompt_token_ids": p}, GREEDY)
    eng.step()
    eng.step()
    for i in range(5):
        eng.abort_request(f"ab-{i}")
    assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    eng.block_manager.check()
    assert eng.block_manager.num_free_pages == eng.config.num_pages - 1


def test_no_recompile_after_warmup(tiny):
    """Every bucket compiles at start; afterwards a varied workload runs without a single new compilation."""
    llm = LLM(tiny[0], max_num_seqs=4, max_num_batched_tokens=16, page_size=8, max_model_len=64)
    eng = llm.llm_engine
    n = eng.runner.num_compiles
    assert n == len(eng.runner.all_buckets())
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if name.endswith("backend_compile_duration") else None
    )
    prompts = _prompts(9, seed=8, lo=1, hi=40)
    params = [SamplingParams(temperature=t, max_tokens=20, logprobs=lp) for t, lp in [(0, None), (0.8, 3), (1.0, None)]]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params * 3, use_tqdm=False)
    assert eng.runner.num_compiles == n
    assert compiles == [], "XLA compiled something during steady-state serving"


def test_prefix_caching_same_outputs_and_hits(tiny):
    """A shared prefix is computed once; outputs equal those with caching off."""
    path, _ = tiny
    rng = np.random.default_rng(9)
    system = rng.integers(3, 300, 24).tolist()
    prompts = [system + rng.integers(3, 300, int(rng.integers(1, 9))).tolist() for _ in range(6)]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=128, precompile=False)
    outs = {}
    for caching in (False, True):
        llm = LLM(path, engine_config=EngineConfig(enable_prefix_caching=caching, **kw))
        first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)  # warms the cache
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
        outs[caching] = [o.outputs[0].token_ids for o in first + rest]
        bm = llm.llm_engine.block_manager
        if caching:
            assert bm.num_prefix_hits >= 5 * 24  # every later prompt reuses the 24-token prefix (6 pages)
            assert 0 < bm.prefix_hit_rate < 1
            llm.llm_engine.add_request("holder", {"prompt_token_ids": prompts[0]}, GREEDY)
            llm.llm_engine.step()  # scheduled: it holds pages
            hits = bm.num_prefix_hits
            assert not llm.reset_prefix_cache()  # a request holds pages: nothing is forgotten
            assert bm.num_cached_prefix_tokens(prompts[1]) >= 24
            llm.llm_engine.abort_request("holder")
            assert llm.reset_prefix_cache() and bm.num_cached_pages == 0
            assert bm.num_cached_prefix_tokens(prompts[1]) == 0
            again = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)
            assert bm.num_prefix_hits == hits and again[0].outputs[0].token_ids == outs[True][1]
        else:
            assert bm.num_prefix_hits == 0
        bm.check()
    assert outs[True] == outs[False]


def test_random_aborts_never_leak(tiny):
    """Abort random requests at random moments over a long run; the page accounting holds after every step."""
    path, _ = tiny
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_model_len=64, num_pages=1 + 30,
              precompile=False)
    eng = llm.llm_engine
    rng = np.random.default_rng(10)
    live, n_aborted, n_finished = set(), 0, 0
    for step in range(150):
        if rng.random() < 0.4:
            rid = f"ra-{step}"
            eng.add_request(rid, {"prompt_token_ids": rng.integers(3, 300, int(rng.integers(1, 30))).tolist()},
                            SamplingParams(temperature=1.0, max_tokens=int(rng.integers(1, 20))),
                            priority=int(rng.integers(0, 3)))
            live.add(rid)
        if live and rng.random() < 0.15:
            rid = sorted(live)[int(rng.integers(len(live)))]
            eng.abort_request(rid)
            live.discard(rid)
            n_aborted += 1
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
                n_finished += 1
        eng.block_manager.check()
    while eng.has_unfinished_requests():
        for out in eng.step():
            live.discard(out.request_id)
        eng.block_manager.check()
    assert n_aborted > 5 and n_finished > 10 and not live
    assert not eng.scheduler.has_unfinished() and eng.block_manager.num_used_pages == 0


def test_seeded_sampling_reproduces_with_other_companions(llm):
    p = _prompts(1, seed=11)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in _prompts(5, seed=12)]
    mixed = llm.generate(others[:2] + [{"prompt_token_ids": p}] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=12)] * 2 + [params]
                         + [SamplingParams(temperature=1.2, max_tokens=12)] * 3, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    unseeded = [llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1, "unseeded requests should differ"


def test_min_tokens_suppresses_stop_tokens(llm):
    p = _prompts(1, seed=13)[0]
    full = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = full[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                               stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_engine_config_from_yaml(tmp_path):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    for f in sorted((root / "configs" / "engine").glob("*.yaml")):
        EngineConfig.from_yaml(str(f))
    cfg = EngineConfig.from_yaml(str(root / "configs" / "engine" / "cpu-small-memory.yaml"))
    assert cfg.num_pages == 65 and cfg.max_num_seqs == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqs: 4\nblock_sise: 16\n")
    with pytest.raises(ValueError, match="unknown engine option.*block_sise"):
        EngineConfig.from_yaml(str(bad))


def test_prompt_logprobs_match_hf(llm, tiny):
    """prompt_logprobs over a prompt longer than the step budget (so it is computed in chunks)."""
    p = _prompts(1, seed=14, lo=40, hi=45)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(tiny[1](torch.tensor([p])).logits[0], -1).numpy()
    plp = out.prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        entry = plp[i]
        assert math.isclose(entry[p[i]].logprob, float(ref[i - 1, p[i]]), abs_tol=1e-4)
        assert entry[p[i]].rank == 1 + int((ref[i - 1] > ref[i - 1, p[i]]).sum())
        top2 = np.argsort(-ref[i - 1])[:2].tolist()
        assert [t for t in entry if entry[t].rank in (1, 2)][:2] == top2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float16", "fp8", "int8"])
def test_kv_cache_is_never_copied(tiny, kv_cache_dtype):
    """The donated cache is updated in place: no compiled bucket copies or converts it (a copy per step would double
    memory traffic; XLA inserts one when it cannot prove in-place updates safe; and XLA:CPU scattered bf16 / f16 /
    fp8 caches by converting them to f32 and back in every layer, a step ~400x slower, until the native KV write)."""
    import re

    llm = LLM(tiny[0], max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_model_len=64, precompile=False,
              kv_cache_dtype=kv_cache_dtype)
    r = llm.llm_engine.runner
    L, P, ps, K, H = r.kv.k.shape
    shapes = {f"[{L},{P},{ps},{K},{H}]", f"[{L * P},{ps},{K},{H}]"}
    for b in r.all_buckets():
        hlo = r.executable(b).as_text()
        copies = [m for m in re.findall(r"= \w+(\[[\d,]+\])\S* (?:copy|convert)\(", hlo) if m in shapes]
        assert not copies, f"{b}: the KV cache is copied or converted {len(copies)} times"


def test_engine_moves_its_startup_heap_out_of_the_garbage_collector(tiny):
    """What loading leaves on the heap (tokenizer, weight pytrees, executables) is frozen once the engine is built,
    so the collections triggered by steps' short-lived objects do not walk it; the engine still runs after."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    llm = LLM(tiny[0], max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_model_len=64, precompile=False)
    assert gc.get_freeze_count() > 1000
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
