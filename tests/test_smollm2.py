"""The real default model, SmolLM2-135M-Instruct (GGUF), against HF transformers on the same weights."""

import json
import subprocess
import sys

import pytest
import torch

from hf_smollm2 import hf_smollm2_model
from jaxserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl who",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def llm():
    # float32 widening of the GGUF's blocks: the values HF holds (the default, quantization="gguf", also rounds
    # activations to int8; tests/test_weight_quant_engine.py covers it)
    return LLM(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, precompile=False, quantization="none")


def test_greedy_continuations_equal_hf(llm):
    """Three prompts batched together (with chunked prefill): every token equals HF's greedy continuation."""
    hf = hf_smollm2_model()
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=2)
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist(), prompt


def test_known_answer_and_eos(llm):
    """The greedy answer HF, llama.cpp and vLLM all give on these weights; generation stops at EOS by itself."""
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == " Paris.\n\nThe answer is: 2018-01-22 12:12:53."
    assert c.finish_reason == "stop" and c.token_ids[-1] == 2


def test_stop_string_is_excluded(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=64, stop=["answer"]),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == " Paris.\n\nThe " and c.finish_reason == "stop" and c.stop_reason == "answer"


def test_cli_generate():
    r = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "The capital of France is", "--max-tokens", "5",
         "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["text"] == " Paris.\n\nThe" and record["token_ids"] == [7042, 30, 198, 198, 504]


def test_cli_generate_with_speculation_and_int8_kv():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    r = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "The capital of France is", "--max-tokens", "5",
         "--json", "--speculative-config", spec, "--kv-cache-dtype", "int8"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == [7042, 30, 198, 198, 504]
    bad = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--prompt", "x", "--speculative-config", "{method: ngram}"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr


def test_cli_reports_bad_model_path():
    r = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--model", "/no/such/model", "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert "model '/no/such/model' not found" in r.stderr


def test_chat_template_and_reply(llm):
    from hf_smollm2 import hf_smollm2_tokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    want = hf_smollm2_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == want
    assert out.prompt_token_ids == hf_smollm2_tokenizer()(want, add_special_tokens=False)["input_ids"]
    assert out.outputs[0].text == "The capital of France is Paris." and out.outputs[0].finish_reason == "stop"


def test_chat_rejects_malformed_messages(llm):
    with pytest.raises(ValueError, match="must be a dict with 'role' and 'content'"):
        llm.chat([{"content": "no role"}], use_tqdm=False)


def test_streamed_text_never_retracted(llm):
    """Step by step, every partial text is a prefix of the final one, even when a stop string cuts it."""
    eng = llm.llm_engine
    eng.add_request("stream", "The capital of France is",
                    SamplingParams(temperature=0, max_tokens=64, stop=["The answer"]))
    texts = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            texts.append(out.outputs[0].text)
    final = texts[-1]
    assert final == " Paris.\n\n"
    assert all(final.startswith(t) for t in texts)


def test_replies_are_batch_invariant_and_speculation_exact():
    """Under the default scheme (the GGUF's own 4-bit blocks, activations rounded to int8 per block of 32), eight
    chat replies are the same bits alone (max_num_seqs=1), in a batch of 8 (prompts prefilled side by side, chunked
    by the token budget), and with n-gram speculation in that batch: every token and its logprob. Before 2026-12-05
    every reply's logprobs changed from its second token on between alone and batched, and most replies' tokens:
    int8 rounding turned last-bit differences (a norm summed in another order for another row count, attention
    grouped another way) into flipped near-ties."""
    from training.eagle3.ship import chat_prompts

    def replies(llm, **params):
        assert llm.llm_engine.config.quantization == "gguf"
        prompts = chat_prompts(llm.get_tokenizer(), 8)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=64, logprobs=0, **params), use_tqdm=False)
        return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    alone = replies(LLM(max_model_len=1024, precompile=False, max_num_seqs=1))
    llm = LLM(max_model_len=1024, precompile=False, max_num_seqs=8,
              speculative_config=dict(method="ngram", num_speculative_tokens=3, adaptive=False))
    batched = replies(llm, num_speculative_tokens=0)  # each request opts out of speculation
    assert sum(llm.llm_engine.spec.metrics.num_drafts) == 0
    spec = replies(llm)  # the same prompts again: now from the prefix cache too
    assert sum(llm.llm_engine.spec.metrics.num_accepted) > 10
    assert batched == alone
    assert spec == alone
