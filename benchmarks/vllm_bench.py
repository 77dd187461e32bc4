"""vLLM with an exported Jakiro head against vLLM alone, vLLM with n-gram drafting, and transformers-jakiro's own
paths (plain generate, Jakiro, hybrid), on the same machine and prompts. Run it in the vLLM environment
(`make test-vllm` creates .venv-vllm):

    .venv-vllm/bin/python benchmarks/vllm_bench.py --target smollm2-135m-instruct --head heads/jakiro-smollm2-135m-instruct
    .venv-vllm/bin/python benchmarks/vllm_bench.py --target qwen2.5-coder-1.5b-instruct \
        --head heads/jakiro-qwen2.5-coder-1.5b-instruct --suites humaneval

Every method decodes the same chat prompts (token ids, so both engines see the same input), greedy, one request at a
time (batch size 1: the case a single `generate` serves; vLLM's own strength, many requests at once, is not what
this compares). vLLM runs in a child process per method and repeat (`bench/vllm_engine.py`, eager mode, engine start
not timed); the repeats are interleaved (every method once, then every method again), because vLLM on two shared
cores varies up to ~1.5x between identical runs. vLLM's chain length is `--chain` for both drafts; our paths use the
head's shipped settings (tree, lookup, round controller). Reported per method: tokens/s of each repeat and their
median, speed against plain transformers and against plain vLLM, and tau (new tokens per target forward, counted
per decoding round; vLLM's: 1 + accepted draft tokens per draft).

Results go to benchmarks/results/vllm-<target>-<dtype>-<date>/: results.json and README.md (with this command).
Not a test: nothing here is timed in CI.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from transformers_jakiro import tree_settings  # noqa: E402
from transformers_jakiro.bench.suites import encode, load_suite  # noqa: E402
from transformers_jakiro.bench.vllm_engine import run_vllm  # noqa: E402
from transformers_jakiro.export import export_vllm  # noqa: E402
from transformers_jakiro.modeling_jakiro import JakiroDraftModel  # noqa: E402
from transformers_jakiro.targets import load_target, plain_directory  # noqa: E402

VLLM_METHODS = ("vllm plain", "vllm ngram", "vllm jakiro")
OURS = ("plain", "jakiro", "hybrid")


def transformers_run(model, draft, prompts, method: str, max_new_tokens: int) -> dict:
    """One pass of our path over the prompts: seconds, new tokens, rounds, outputs."""
    tokens = rounds = 0
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        if method == "plain":
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        else:
            with tree_settings(draft, lookup_tokens=None if method == "hybrid" else 0):
                out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=draft)
            rounds += draft.last_generation_stats.rounds
        outputs.append(out[0, len(prompt):].tolist())
        tokens += len(outputs[-1])
    return {"seconds": time.perf_counter() - start, "new_tokens": tokens, "rounds": rounds, "token_ids": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="registry name, directory or .gguf")
    parser.add_argument("--head", required=True, help="the head directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suites", default="mt_bench,humaneval,alpaca")
    parser.add_argument("--prompts-per-suite", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chain", type=int, default=3, help="vLLM's num_speculative_tokens for both drafts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_target(args.target, dtype=dtype)
    target_dir = plain_directory(args.target)[0]
    draft = JakiroDraftModel.from_pretrained(args.head, dtype=dtype).bind_target(model).eval()
    records = [r for suite in args.suites.split(",") for r in load_suite(suite, args.prompts_per_suite,
                                                                          spread_categories=True)]
    prompts = [encode(tokenizer, [{"role": "user", "content": r["turns"][0]}], "cpu")["input_ids"][0].tolist()
               for r in records]
    stamp = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"vllm-{Path(str(args.target)).name}-{args.dtype}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    exported = Path(tempfile.mkdtemp(prefix="jakiro-vllm-head-"))  # 30+ MB of weights: not kept with the results
    jakiro_spec = export_vllm(args.head, exported, args.target, num_speculative_tokens=args.chain)
    specs = {
        "vllm plain": None,
        "vllm ngram": {"method": "ngram", "num_speculative_tokens": args.chain, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1},
        "vllm jakiro": jakiro_spec,
    }
    runs = {name: [] for name in VLLM_METHODS + OURS}
    for repeat in range(args.repeats):
        for name in VLLM_METHODS:
            report = run_vllm(target_dir, prompts, specs[name], max_tokens=args.max_new_tokens, dtype=args.dtype,
                              one_at_a_time=True)
            runs[name].append({"seconds": report["seconds"][0], "new_tokens": report["new_tokens"],
                               "spec": report["spec"], "token_ids": report["token_ids"]})
            print(f"repeat {repeat} {name}: {report['new_tokens'] / report['seconds'][0]:.2f} tok/s", flush=True)
        for name in OURS:
            runs[name].append(transformers_run(model, draft, prompts, name, args.max_new_tokens))
            last = runs[name][-1]
            print(f"repeat {repeat} {name}: {last['new_tokens'] / last['seconds']:.2f} tok/s", flush=True)

    def speed(name):
        return statistics.median(r["new_tokens"] / r["seconds"] for r in runs[name])

    rows = []
    for name in VLLM_METHODS + OURS:
        last = runs[name][-1]
        if name in ("vllm ngram", "vllm jakiro"):
            tau = last["spec"]["mean_acceptance_length"] if last["spec"] else 1.0
        elif name in ("jakiro", "hybrid"):
            tau = last["new_tokens"] / last["rounds"]
        else:
            tau = None
        rows.append({
            "method": name, "tokens_per_s": [r["new_tokens"] / r["seconds"] for r in runs[name]],
            "median_tokens_per_s": speed(name), "vs_plain_transformers": speed(name) / speed("plain"),
            "vs_plain_vllm": speed(name) / speed("vllm plain"), "tau": tau,
            "same_text_as_plain": last["token_ids"] == runs["vllm plain" if name.startswith("vllm") else "plain"][-1][
                "token_ids"],
        })
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    (out / "results.json").write_text(json.dumps({"command": command, "args": vars(args), "rows": rows,
                                                  "torch_threads": torch.get_num_threads()}, indent=2) + "\n")
    lines = [f"# vLLM {args.target} {args.dtype}", "", f"Command: `{command}`", "",
             f"{len(prompts)} prompts ({args.suites}), {args.max_new_tokens} new tokens, greedy, one request at a time, "
             f"{args.repeats} interleaved repeats; vLLM chain {args.chain}.", "",
             "| method | tok/s (median) | vs plain transformers | vs plain vLLM | tau | same text as its plain |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        tau = f"{row['tau']:.2f}" if row["tau"] else "-"
        lines.append(f"| {row['method']} | {row['median_tokens_per_s']:.2f} | {row['vs_plain_transformers']:.2f}x | "
                     f"{row['vs_plain_vllm']:.2f}x | {tau} | {'yes' if row['same_text_as_plain'] else 'no'} |")
    same = runs["plain"][-1]["token_ids"] == runs["vllm plain"][-1]["token_ids"]
    lines += ["", f"Plain transformers and plain vLLM gave the same tokens: {'yes' if same else 'no'}.",
              f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
              f"{torch.get_num_threads()}."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
