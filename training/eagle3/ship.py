"""`python -m training.eagle3 ship`: a trained head -> the directory jaxserve ships for its target.

    .venv/bin/python -m training.eagle3 ship --head data/eagle3/head --features data/eagle3/feats \
        --out jaxserve/spec_decode/heads/smollm2-135m-instruct-eagle3

writes, in `--out`:
  config.json, model.safetensors   the head in the speculators format, weights in bfloat16 (half the bytes; a head's
                                   acceptance does not notice)
  card.json                        the run that trained it (`train`'s training.json), the held-out evaluation of
                                   the bfloat16 weights on the features' held-out split, and `served`: the
                                   acceptance measured by serving held-out chat prompts with the head (what
                                   `tests/test_shipped_head.py` measures again); with `--heldout`, `walked`: the
                                   served walk over the replies in `heldout`'s features (more prompts than serving
                                   them in `ship` would take time for: `eval --all --max-tokens`'s numbers)
  README.md                        the same, for people

`served` uses the first `--num-prompts` ShareGPT first turns of `bench`'s sample, rendered with the chat template and
answered greedily up to EOS: `regenerate` skips those prompts, so they are held out by construction.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

# The served measurement. quantization "none" (float32 weights, float activations): the target the features were
# computed with, and one whose greedy choices do not depend on the step's shape (a quantized GGUF's default scheme
# rounds activations to int8, which turns float noise between a verify step and a decode step into flipped near-ties
# now and then), so the acceptance is reproducible and the replies equal plain greedy decoding.
SERVED = dict(num_prompts=16, max_tokens=128, num_speculative_tokens=3, max_num_seqs=16, quantization="none")


def chat_prompts(tokenizer, num: int) -> list[list[int]]:
    """The first `num` ShareGPT first turns (seed 0, as `bench` samples them) under the chat template."""
    from jaxserve.datasets.sharegpt import sample_requests

    reqs = sample_requests(tokenizer, num, seed=0, max_prompt_len=512)
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}],
                                                           add_generation_prompt=True), add_special_tokens=False)
            for r in reqs]


def served_acceptance(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Greedy replies to `prompts` (to EOS or `max_tokens`) from an `LLM` that speculates -> (the acceptance of this
    call's drafts, `SpecMetrics.as_dict()` rounded; the replies)."""
    from jaxserve import SamplingParams
    from jaxserve.spec_decode.controller import SpecMetrics

    before = copy.deepcopy(llm.llm_engine.spec.metrics)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    after, run = llm.llm_engine.spec.metrics, SpecMetrics(len(before.num_drafts))
    run.num_drafts = [a - b for a, b in zip(after.num_drafts, before.num_drafts)]
    run.num_accepted = [a - b for a, b in zip(after.num_accepted, before.num_accepted)]
    run.num_steps, run.num_emitted = after.num_steps - before.num_steps, after.num_emitted - before.num_emitted
    return _rounded(run.as_dict()), [list(o.outputs[0].token_ids) for o in outs]


def _rounded(metrics: dict) -> dict:
    """`SpecMetrics.as_dict()` with its rates to 4 decimals, for the card."""
    r4 = lambda v: round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v] if isinstance(v, list) else v  # noqa: E731
    return {k: r4(v) for k, v in metrics.items()}


def served_features(out: str, num_prompts: int, target: str | None = None, *,
                    prompts: list[list[int]] | None = None, features_kw: dict | None = None, **engine_kw) -> dict:
    """The served measurement's prompts (`chat_prompts`, the first `num_prompts`) answered by plain greedy decoding
    under `SERVED`'s settings -> `out`/replies.jsonl and their features in `out` (returns the features' meta).
    `python -m training.eagle3 eval --head H --features OUT --all --max-tokens 128` then walks those replies as the
    server would (`ttt.served_walk`): `ship`'s served acceptance for any head in seconds, without serving it.
    `prompts` (token ids) replace the chat prompts; `features_kw` go to `TargetFeatures`, `engine_kw` to the `LLM`."""
    from jaxserve import LLM, SamplingParams
    from training.eagle3.features import TargetFeatures, extract

    llm = LLM(target, max_num_seqs=SERVED["max_num_seqs"], quantization=SERVED["quantization"], **engine_kw)
    if prompts is None:
        prompts = chat_prompts(llm.get_tokenizer(), num_prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=SERVED["max_tokens"]), use_tqdm=False)
    samples = [dict(index=i, prompt_token_ids=p, output_token_ids=list(o.outputs[0].token_ids), chat=True)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    del llm, outs
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "replies.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in samples)
    return extract(samples, TargetFeatures(target, **(features_kw or {})), out, log_every=0)


def speculating_llm(target: str | None, head: str, k: int, max_num_seqs: int, **engine_kw):
    """An `LLM` drafting exactly `k` tokens with `head` for every sequence (adaptive K off: acceptance is measured at
    every position)."""
    from jaxserve import LLM

    return LLM(target, max_num_seqs=max_num_seqs, speculative_config=dict(
        method="eagle3", model=head, num_speculative_tokens=k, adaptive=False), **engine_kw)


def _acceptance_lines(m: dict) -> list[str]:
    rates = " / ".join(f"{x:.3f}" for x in m["acceptance_rate_per_position"])
    return [f"- acceptance per draft position: {rates}",
            f"- mean acceptance length (tokens per verify step): {m['mean_acceptance_length']:.2f}",
            f"- drafts verified: {m['num_draft_tokens']}, accepted: {m['num_accepted_tokens']}"]


def write_card(out: str, card: dict) -> None:
    with open(os.path.join(out, "card.json"), "w") as f:
        json.dump(card, f, indent=1)
    t, s, h = card.get("training") or {}, card["served"], card.get("held_out")
    lines = [
        f"# EAGLE-3 head for {card['target']}",
        "",
        f"Served by jaxserve when `speculative_config={{\"method\": \"eagle3\"}}` names no `model` and the target is "
        f"`{card['target']}`. Speculators format, {card['dtype']} weights, draft vocabulary "
        f"{card['draft_vocab_size']}, aux layers {card['aux_layer_ids']} (input convention). Served in the target's "
        f"weight scheme (int8 beside a GGUF target's blocks) unless `speculative_config[\"quantization\"]` names one.",
        "",
        "## Acceptance on held-out chat prompts (served)",
        "",
        f"{s['num_prompts']} ShareGPT first turns under the chat template (never in the training data), greedy to "
        f"EOS or {s['max_tokens']} tokens, K = {s['num_speculative_tokens']} drafts every step, the target's weights "
        f"as quantization={s['quantization']!r}:",
        *_acceptance_lines(s),
    ]
    if w := card.get("walked"):
        lines += ["", "## Acceptance walked over more held-out replies (offline)", "",
                  f"The first {w['num_prompts']} of the same prompts, answered greedily by the target "
                  f"(`python -m training.eagle3 heldout`), replayed as a server drafting K = "
                  f"{w['num_speculative_tokens']} tokens every step would serve them (`eval --all --max-tokens "
                  f"{w['max_tokens']}`; equal to serving them):", *_acceptance_lines(w)]
    if h:
        lines += ["", "## Held-out features (offline)", "",
                  f"The trainer's held-out split ({t.get('eval_samples')} samples): accuracy per draft step "
                  f"{' / '.join(f'{x:.3f}' for x in h['acc'])} (each step fed the true tokens), implied mean "
                  f"acceptance length {h['tau']:.2f}."]
    if t:
        c = t["config"]
        lines += ["", "## Training", "",
                  f"- data: {t['features']['num_samples']} samples ({t['features']['num_tokens']} tokens) of the "
                  f"target's own greedy replies (`python -m training.eagle3 regenerate`); {t['train_samples']} train "
                  f"({t['train_output_tokens']} reply tokens), {t['eval_samples']} held out",
                  f"- {t['steps']} steps of {c['batch_tokens']} tokens ({c['epochs']} epochs), {c['ttt_steps']} TTT "
                  f"steps, lr {c['lr']}, draft vocabulary {c['draft_vocab_size']}, loss {c.get('loss', 'kl')}; "
                  f"{t['train_seconds'] / 60:.0f} min of training"]
        seconds, r = t["train_seconds"], t.get("started_from")
        while r is not None:  # the runs it started from (`train --init-head`), newest first
            if not r:
                lines.append("- on top of a head whose training is not recorded")
                break
            c, seconds = r["config"], seconds + r["train_seconds"]
            lines.append(f"- on top of a head trained {r['steps']} steps ({c['epochs']} epochs) on "
                         f"{r['features']['num_samples']} samples, draft vocabulary {c['draft_vocab_size']}, "
                         f"{r['train_seconds'] / 60:.0f} min")
            r = r.get("started_from")
        if "started_from" in t:
            lines.append(f"- {seconds / 60:.0f} min of recorded training in all")
        lines.append("- pipeline and commands: README, *Training an EAGLE-3 head*; ablations: docs/eagle3_training.md")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def ship(head: str, out: str, *, features: str | None = None, target: str | None = None, heldout: str | None = None,
         served: dict | None = None, prompts: list[list[int]] | None = None, **engine_kw) -> dict:
    """Write the shipped form of `head` to `out` (module docstring); returns the card. `heldout`: a feature directory
    `served_features` wrote, walked as served; `prompts` (token ids) replace the chat prompts of `served`;
    `engine_kw` go to the serving `LLM`."""
    from jaxserve.loader import load_checkpoint
    from jaxserve.loader.eagle3 import load_eagle3
    from jaxserve.loader.gguf import model_id
    from training.eagle3.export import export_speculators
    from training.eagle3.train import TRAINING_RECORD, TrainConfig, Trainer
    from training.eagle3.vocab import vocab_mapping

    served = SERVED | (served or {})
    record_path = os.path.join(head, TRAINING_RECORD)
    training = json.load(open(record_path)) if os.path.isfile(record_path) else None
    target = target if target is not None else (training or {}).get("target")
    ck = load_checkpoint(None if target == model_id(None) else target)
    cfg, w = load_eagle3(head, ck.config, np.float32)
    draft_ids = np.arange(cfg.draft_vocab_size) + w.d2t.astype(np.int64)
    d2t, t2d = vocab_mapping(draft_ids, ck.config.vocab_size)
    export_speculators(out, cfg, w, d2t, t2d, verifier=model_id(ck.path), dtype="bfloat16",
                       num_speculative_tokens=served["num_speculative_tokens"])
    card = dict(target=model_id(ck.path), dtype="bfloat16", draft_vocab_size=cfg.draft_vocab_size,
                aux_layer_ids=list(cfg.aux_layer_ids), training=training)
    if features:
        from training.eagle3.features import FeatureStore

        tc = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in training["config"].items()}) \
            if training else TrainConfig()
        tr = Trainer(FeatureStore.open(features), tc, ck.path, head=out)  # the run's split, windows and TTT steps
        card["held_out"] = tr.evaluate()
    if heldout:
        from training.eagle3.features import FeatureStore

        store, k = FeatureStore.open(heldout), served["num_speculative_tokens"]
        tr = Trainer(store, TrainConfig(ttt_steps=k, eval_frac=0.0), ck.path, head=out)
        walked = tr.evaluate(ids=np.arange(store.num_samples), max_tokens=served["max_tokens"])["served_walk"]
        card["walked"] = dict(num_prompts=store.num_samples, max_tokens=served["max_tokens"],
                              num_speculative_tokens=k) | _rounded(walked)
    llm = speculating_llm(ck.path, out, served["num_speculative_tokens"], served["max_num_seqs"],
                          quantization=served["quantization"], **engine_kw)
    if prompts is None:
        prompts = chat_prompts(llm.get_tokenizer(), served["num_prompts"])
    served["num_prompts"] = len(prompts)
    result, _ = served_acceptance(llm, prompts, served["max_tokens"])
    card["served"] = served | result
    write_card(out, card)
    return card
