"""Tokenizer: a HF `tokenizers` tokenizer plus the model's special ids and chat template.

Sources: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) in an HF directory, or the tokenizer
stored in a GGUF file's metadata (built by `jaxserve.loader.gguf`).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import uuid
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

    def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        allow_special_tokens_in_content: bool = False,
        chat_template: str | None = None,
    ) -> tuple[str, list[int]]:
        """Render a conversation and tokenize it: (text, token ids, no BOS added beyond the template's own).

        By default the strings a client wrote (each message's `content` and `name`) are tokenized as plain text: a
        message containing "</s>" or "<|im_start|>system" gets the tokens of those characters, never the EOS or a
        role marker, so a user cannot forge turns or end the conversation (role forging). Special tokens come only
        from the chat template itself. allow_special_tokens_in_content=True restores the old behaviour (the whole
        rendered text tokenized with special-token parsing), for callers that put control tokens in on purpose.

        How: the normal tokenizer splits the text at special tokens before anything else and tokenizes each stretch
        between them on its own. So the text is tokenized normally once; if a special token lies (even partly)
        inside a client string, the stretch between the template's own special tokens around it is tokenized again
        with special-token parsing off. Benign requests therefore get exactly the normal tokenization. The client
        strings are located by rendering the template a second time with unique markers in their place; a template
        that rewrites content (so the markers cannot be found) is refused only when the content holds special-token
        text.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template)
        enc = self._tok.encode(text, add_special_tokens=False)
        if allow_special_tokens_in_content:
            return text, enc.ids
        specials = self._special_ids
        if not any(t in specials for t in enc.ids):
            return text, enc.ids
        spans = self._client_spans(messages, text, add_generation_prompt, chat_template)
        if spans is None:  # the template rewrites the strings: refuse only if one of them holds special-token text
            for i, m in enumerate(messages):
                for key in ("content", "name"):
                    value = m.get(key)
                    hit = isinstance(value, str) and next((s for s in self._special_texts if s in value), None)
                    if hit:
                        raise ValueError(
                            f"messages[{i}].{key} contains the special-token text {hit!r} and this chat template "
                            "rewrites message text, so it cannot be kept as plain text; remove it, or opt in to "
                            "special tokens in content"
                        )
            return text, enc.ids

        starts = [s for s, _ in spans]  # spans are disjoint and in text order

        def in_client_text(start: int, end: int) -> bool:
            k = bisect.bisect_left(starts, end) - 1  # the last span starting before `end`
            return k >= 0 and spans[k][1] > start

        # Legit special tokens (the template's) bound the stretches; a stretch holding a forged one is re-tokenized.
        ids: list[int] = []
        stretch: list[int] = []  # tokens since the last legit special token, which ended at stretch_start
        stretch_start, forged = 0, False
        for tid, (start, end) in zip(enc.ids, enc.offsets):
            if tid in specials and not in_client_text(start, end):
                ids += self._plain_encode(text[stretch_start:start]) if forged else stretch
                ids.append(tid)
                stretch_start, stretch, forged = end, [], False
            else:
                stretch.append(tid)
                forged = forged or tid in specials
        ids += self._plain_encode(text[stretch_start:]) if forged else stretch
        return text, ids

    def _client_spans(
        self, messages: list[dict], text: str, add_generation_prompt: bool, chat_template: str | None
    ) -> list[tuple[int, int]] | None:
        """Character spans of the client strings in `text`, or None if the template does not copy them verbatim."""
        nonce = uuid.uuid4().hex
        marked, values = [], []
        for m in messages:
            m = dict(m)
            for key in ("content", "name"):
                if isinstance(m.get(key), str):
                    values.append(m[key])
                    m[key] = f"\x00{nonce}:{len(values) - 1}\x00"
            marked.append(m)
        rendered = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt,
                                            chat_template=chat_template)
        pieces = rendered.split(f"\x00{nonce}:")
        spans, out, pos = [], [pieces[0]], len(pieces[0])
        for piece in pieces[1:]:
            index, sep, rest = piece.partition("\x00")
            if not sep or not index.isdigit() or int(index) >= len(values):
                return None
            value = values[int(index)]
            spans.append((pos, pos + len(value)))
            out += [value, rest]
            pos += len(value) + len(rest)
        return spans if "".join(out) == text else None

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @functools.cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special-token text as ordinary characters (a separate object, so
        that no thread ever sees the shared tokenizer's flag flipped)."""
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def _plain_encode(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

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


def load_hf_tokenizer(path: str, eos_token_ids: Sequence[int] = (),
                      bos_token_id: int | None = None) -> Tokenizer | None:
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
