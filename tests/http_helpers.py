"""Raw HTTP for the endpoint tests: any method, bytes and headers (what a hostile client sends), and the greedy probe
whose text must not change whatever was sent before it."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp

# A fixed greedy request: its text is the reference that every malformed request must leave unchanged.
PROBE = {"prompt": "The answer is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


async def send(
    port: int, method: str, route: str, body=None, headers: dict | None = None, timeout: float = 60
) -> tuple[int, str]:
    """One request; a dict/list body is sent as JSON, str / bytes as they are. Returns (status, body text)."""
    if body is not None and not isinstance(body, (str, bytes)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    hdrs = {"Content-Type": "application/json"} if headers is None else headers
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.request(method, f"http://127.0.0.1:{port}{route}", data=body, headers=hdrs) as r:
            return r.status, await r.text(errors="replace")


def call(port: int, method: str, route: str, body=None, headers: dict | None = None) -> tuple[int, str]:
    return asyncio.run(send(port, method, route, body, headers))


def probe_text(port: int) -> str:
    status, text = call(port, "POST", "/v1/completions", PROBE)
    assert status == 200, text
    return json.loads(text)["choices"][0]["text"]


class BlockingTokenizer:
    """Stands in for a Tokenizer's HF tokenizer: `encode` blocks until `release` is set (or 20 s), so a test can
    tell whether tokenization runs on the event loop (then nothing else is served meanwhile) or off it."""

    def __init__(self, inner):
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        self.release.wait(20)
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)
