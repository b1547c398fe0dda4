"""Tokenizer: a HF `tokenizers` tokenizer plus the model's special ids and chat template.

Sources: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) in an HF directory, or the tokenizer
stored in a GGUF file's metadata (built by `jaxserve.loader.gguf`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

import tokenizers


class Tokenizer:
    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        use_post_processor: bool = False,
    ):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        # HF tokenizer.json files carry a post-processor that adds BOS itself; GGUF-built ones do not.
        self._use_post_processor = use_post_processor

    @classmethod
    def from_gguf(cls, gt) -> "Tokenizer":
        """From the `GGUFTokenizer` that `jaxserve.loader.gguf.read_gguf` builds out of GGUF metadata."""
        return cls(
            gt.tokenizer,
            bos_token_id=gt.bos_token_id,
            eos_token_ids=gt.eos_token_ids,
            add_bos=gt.add_bos,
            chat_template=gt.chat_template,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended when the model wants it."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens and self._use_post_processor).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> str:
        """Render a conversation with the model's Jinja chat template (sandboxed, as transformers renders it)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=... or use generate() with text")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content' (got {m!r})")
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        }
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def _special_id(tok: tokenizers.Tokenizer, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return tok.token_to_id(value)


def load_hf_tokenizer(path: str, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None) -> Tokenizer | None:
    """Tokenizer from an HF directory, or None if it holds no `tokenizer.json`."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        return None
    tok = tokenizers.Tokenizer.from_file(tok_file)
    cfg = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
    eos = list(eos_token_ids)
    cfg_eos = _special_id(tok, cfg.get("eos_token"))
    if cfg_eos is not None and cfg_eos not in eos:
        eos.append(cfg_eos)
    bos = bos_token_id if bos_token_id is not None else _special_id(tok, cfg.get("bos_token"))
    return Tokenizer(
        tok,
        bos_token_id=bos,
        eos_token_ids=eos,
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=template,
        use_post_processor=True,
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    A few prompt tokens seed the context so that tokenizers whose decoding depends on the previous token (leading
    spaces in SentencePiece) render the first output token correctly. Text is only released once the decoded
    window no longer ends in U+FFFD, i.e. once a multi-byte character is complete.
    """

    CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
