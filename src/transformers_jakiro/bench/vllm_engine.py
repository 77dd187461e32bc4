"""Run vLLM on a list of prompts in a child process and read back what it generated, how long it took and what its
speculative decoding accepted. Used by the vLLM tests and the vLLM benchmark (benchmarks/vllm_bench.py).

A child process because vLLM's engine starts processes of its own (which must not re-import a test runner's main
module) and keeps them, with their memory, until its interpreter exits; a failed start then leaves nothing behind,
and its log comes back in the error.

    python -m transformers_jakiro.bench.vllm_engine --target DIR --prompts prompts.json [--speculative JSON]
"""

import argparse
import json
import os
import subprocess
import sys
import time

# vLLM's CPU build reserves this many GiB for its KV cache (its default takes a large share of the machine).
KV_CACHE_GIB = "1"


def run_vllm(target_dir, prompts: list[str] | list[list[int]], speculative: dict | None = None, max_tokens: int = 64,
             temperature: float = 0.0, seed: int = 0, repeats: int = 1, dtype: str = "float32",
             one_at_a_time: bool = False, python: str | None = None, timeout: float = 900) -> dict:
    """Generate `prompts` with vLLM (eager mode) in a child process; returns its JSON report (`texts`, `token_ids`,
    `seconds` per repeat, `new_tokens`, `spec`: vLLM's speculative-decoding counters, or None without a draft).
    `one_at_a_time`: one request after another (batch size 1, as a single-sequence `generate`) instead of all at
    once (vLLM's continuous batching). Raises RuntimeError with the end of vLLM's log when the engine fails."""
    args = [python or sys.executable, "-m", __name__, "--target", str(target_dir), "--max-tokens", str(max_tokens),
            "--temperature", str(temperature), "--seed", str(seed), "--repeats", str(repeats), "--dtype", dtype]
    if speculative is not None:
        args += ["--speculative", json.dumps(speculative)]
    if one_at_a_time:
        args.append("--one-at-a-time")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)}
    done = subprocess.run(args, input=json.dumps(prompts), capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"vLLM failed (exit {done.returncode}):\n{(done.stderr + done.stdout)[-6000:]}")


def _spec_counters(llm) -> dict | None:
    counters = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if metric.name.startswith("vllm:spec_decode_"):
            counters[name] = getattr(metric, "value", None) if getattr(metric, "values", None) is None else metric.values
    if not counters.get("num_drafts"):
        return None
    counters["mean_acceptance_length"] = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    return counters


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--speculative", default=None, help="vLLM's speculative_config as JSON")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--one-at-a-time", action="store_true")
    args = parser.parse_args()
    # A prompt is a string (vLLM tokenizes it) or a list of token ids (given exactly, as transformers would see it).
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in json.loads(sys.stdin.read())]

    from vllm import LLM, SamplingParams

    speculative = json.loads(args.speculative) if args.speculative else None
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, disable_log_stats=False, max_model_len=4096,
              seed=args.seed, speculative_config=speculative)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    seconds, outputs = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        if args.one_at_a_time:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    report = {
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "new_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "seconds": seconds,
        "spec": _spec_counters(llm) if speculative else None,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    _main()
