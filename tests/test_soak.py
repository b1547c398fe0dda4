"""The chaos soak (bench/soak.py), shortened: ~20 s of 40 concurrent streams against `jaxserve serve` on a tiny model.

Same harness and checks as `python -m bench soak`: a real server process (the CLI) with its KV squeezed and n-gram
speculation on; HTTP completions / chat (streaming and not), jaxserve.v1 and KServe streams, 30% of them cancelled,
deadlined, disconnected or aborted; then every request ended exactly once, greedy outputs equal their references, no
leaked request or page, flat RSS, healthy, clean SIGTERM.
"""

import argparse
import dataclasses

from bench import soak
from service_fixtures import make_tiny_model_with_tokenizer

ARGS = [
    "--duration", "20", "--concurrency", "40", "--warmup", "6",
    "--prompt-source", "synthetic", "--prompt-chars", "8", "60", "--num-prompts", "6",
    "--greedy-lengths", "8", "24", "--max-output-len", "32", "--recheck-prompts", "3", "--truncation-fraction", "0.5",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128", "--page-size", "16",
    "--num-pages", "12", "--num-speculative-tokens", "3", "--server-timeout", "300",
]


def test_chaos_soak_short(tmp_path):
    model = make_tiny_model_with_tokenizer(str(tmp_path / "tiny"))
    ap = argparse.ArgumentParser()
    soak.add_args(ap)
    args = ap.parse_args([*ARGS, "--model", model])
    cfg = dataclasses.replace(soak.config_from_args(args), deadline_s=(0.1, 3.0), chaos_delay_s=(0.02, 1.5),
                              sample_interval_s=1.0, hang_timeout_s=90.0, idle_timeout_s=30.0)
    summary, _ = soak.run_soak(cfg, args, log_dir=str(tmp_path))
    table = soak.checks_table(summary)
    print(table)
    assert summary["passed"], f"soak checks failed:\n{table}\nviolations: {summary['violations'][:5]}\n" \
                              f"errors: {summary['errors'][:5]}\nmismatches: {summary['mismatches'][:5]}"
    t = summary["totals"]
    assert t["cancelled"] > 0 and t["completed"] > 0 and t["greedy_compared"] > 0
    assert {c for c in summary["chaos"]} == {"cancel", "deadline", "disconnect", "abort"}
