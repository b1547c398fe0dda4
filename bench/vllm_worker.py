"""vLLM side of the offline benchmarks; runs inside the vLLM venv (no jaxserve import), driven by bench/peers.py.

stdin: one JSON job {"model", "dtype", "max_model_len", "max_num_seqs", "mode", ...}; stdout: the JSON result on the
line that starts with RESULT_PREFIX. Modes:
- "throughput": {"requests": [[prompt_token_ids, output_len], ...], "rounds"}: every request in one generate call,
  greedy, EOS ignored, once per round (a warm-up first); wall time per round.
- "decode": {"prompt_token_ids", "new_tokens", "rounds"}: single-stream decode rate from t(new_tokens) - t(1) on
  the same prompt with prefix caching off (vLLM's offline API has no per-token timestamps).
"""

import json
import sys
import time

RESULT_PREFIX = "BENCH_RESULT "  # vLLM logs to stdout too: the result is the line with this prefix


def main() -> None:
    job = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job.get("max_num_seqs", 16), enforce_eager=True, enable_prefix_caching=False, seed=0)

    def gen(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    result = {"vllm": vllm.__version__}
    if job["mode"] == "throughput":
        prompts = [r[0] for r in job["requests"]]
        lens = [r[1] for r in job["requests"]]
        gen(prompts[:2], [4, 4])  # warm-up
        walls = []
        for _ in range(job.get("rounds", 1)):
            wall, out_tokens = gen(prompts, lens)
            walls.append(wall)
        result.update(wall_s=walls, output_tokens=out_tokens, prompt_tokens=sum(map(len, prompts)))
    elif job["mode"] == "decode":
        p, n = job["prompt_token_ids"], job["new_tokens"]
        gen([p], [n])  # warm-up
        rates = []
        for _ in range(job.get("rounds", 1)):
            t_one, _ = gen([p], [1])
            t_all, _ = gen([p], [n])
            rates.append((n - 1) / (t_all - t_one))
        result.update(tok_s=rates)
    else:
        raise SystemExit(f"unknown mode {job['mode']!r}: expected throughput or decode")
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM's engine core spawns processes that re-import this file
    main()
