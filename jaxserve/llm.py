"""LLM: the offline batch API, with vLLM's names and conventions.

    llm = LLM()                                     # the default model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
"""

from __future__ import annotations

import itertools
from typing import Sequence

from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine
from jaxserve.engine import PromptType
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None, **engine_args):
        """`engine_args` are EngineConfig fields (vLLM's names: max_model_len, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, kv_cache_dtype, dtype, ...); an unknown name raises ValueError listing the known ones.
        max_model_len defaults to the model's context length. A mesh with dp > 1 (mesh="dp2_tp2") runs dp engine
        replicas behind `llm_engine` (`jaxserve.data_parallel.DataParallelEngine`)."""
        if engine_config is None:
            engine_args.setdefault("max_model_len", None)
            if engine_args["max_model_len"] is None:
                engine_args["max_model_len"] = 1 << 30  # capped at the model's context length
            engine_config = EngineConfig.from_dict(engine_args, "LLM()")
        elif engine_args:
            raise ValueError(
                f"pass engine options either in engine_config or as arguments, not both: {sorted(engine_args)}"
            )
        self.llm_engine = make_engine(model, engine_config)  # a Data- or PipelineEngine when mesh.dp or pp > 1
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's `LLM.reset_prefix_cache`): the next prompts are computed in
        full. Returns False, forgetting nothing, while requests still hold KV pages."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order of `prompts`.

        All prompts are validated before any runs, so one bad prompt raises without starting the batch.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")

        engine = self.llm_engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, prio in zip(ids, prompts, params, priority):
                engine.add_request(rid, prompt, p, priority=prio)
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort_request(rid)
            raise

        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generating", unit="req")
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            # Message content is tokenized as plain text (no role forging); the template writes any BOS itself.
            text, ids = tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt,
                                              chat_template=chat_template)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
