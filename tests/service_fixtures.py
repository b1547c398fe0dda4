"""Helpers for the service tests: a tiny random model with a byte-level tokenizer and chat template, and a
running server (gRPC + HTTP on 127.0.0.1, any free ports) around it.

The tokenizer maps every byte to one token, so any text round-trips and prompts stay short and predictable; the
chat template is a minimal role-tagged one. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import time

from jaxserve import AsyncLLM
from jaxserve.config import EngineConfig
from service.async_engine import ServingEngine
from service.protocol import ServingLimits
from service.server import ServerConfig, ServerThread
from tiny_models import make_tiny_model

MODEL_NAME = "tiny"
CFG = EngineConfig(
    max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=256, precompile=False, num_pages=40
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_tiny_model_with_tokenizer(path: str) -> str:
    """A random llama_gqa checkpoint (vocab 300) plus a byte-level tokenizer: 3 specials, 256 bytes, 41 extras."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    make_tiny_model("llama_gqa", path)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    extras = [f"<extra_{i}>" for i in range(300 - len(vocab))]
    for t in extras:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials + extras)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}, f)
    return path


def start_server(path: str, *, limits: ServingLimits | None = None, **server_kw) -> ServerThread:
    llm = AsyncLLM(path, CFG)
    serving = ServingEngine(llm, MODEL_NAME, limits or ServingLimits(max_in_flight=6), watchdog_interval_s=0.05)
    cfg = ServerConfig(grpc_port=0, http_port=0, drain_timeout_s=5.0, **server_kw)
    return ServerThread(serving, cfg).start()


def wait_engine_idle(server: ServerThread, timeout: float = 10.0) -> None:
    """Wait until the engine holds no request and no KV page, then check the page accounting."""
    engine = server.server.serving.llm.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and engine.block_manager.num_used_pages == 0:
            break
        time.sleep(0.02)
    assert not engine.has_unfinished_requests(), f"requests left in the engine: {list(engine.requests)}"
    assert engine.block_manager.num_used_pages == 0, "KV pages still in use"
    engine.block_manager.check()


class EngineHook:
    """Slows or stalls the engine thread: every step first waits for `gate` (cleared = a stalled engine), then
    sleeps `step_delay` seconds (so a long generation reliably outlasts a client's timeout)."""

    def __init__(self, server: ServerThread, *, paused: bool = False, step_delay: float = 0.0):
        import threading

        self.engine = server.server.serving.llm.engine
        self.gate = threading.Event()
        if not paused:
            self.gate.set()
        self.step_delay = step_delay

    def __enter__(self):
        original = type(self.engine).step.__get__(self.engine)

        def hooked_step():
            self.gate.wait()
            time.sleep(self.step_delay)
            return original()

        self.engine.step = hooked_step
        return self

    def __exit__(self, *exc):
        self.gate.set()
        del self.engine.step
