"""Build the prompt file for self-distilling the SmolLM2-135M-Instruct head (never from the benchmark questions).

Sources: GSM8K training questions (../shared/data/gsm8k_train.jsonl, MIT) and conversation openers from the
`chitchat-dataset` PyPI package (MIT; `pip install --no-deps chitchat-dataset`). Output: one JSON object per line
with `id` and `prompt`, the format `jakiro distill` reads.

    python scripts/smollm2_prompts.py --gsm8k ../shared/data/gsm8k_train.jsonl --out data/smollm2/prompts.jsonl
"""

import argparse
import importlib.util
import json
import random
from pathlib import Path


def chitchat_openers(limit: int, rng: random.Random) -> list[str]:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None:
        raise SystemExit("chitchat-dataset is not installed: pip install --no-deps chitchat-dataset")
    conversations = json.loads((Path(spec.origin).parent / "dataset.json").read_text())
    openers = []
    for conversation in conversations.values():
        first_turn = " ".join(m["text"].strip() for m in conversation["messages"][0]).strip()
        if 20 <= len(first_turn) <= 300:
            openers.append(first_turn)
    rng.shuffle(openers)
    return openers[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gsm8k-count", type=int, default=3000)
    parser.add_argument("--chitchat-count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    questions = [json.loads(line)["question"] for line in open(args.gsm8k)]
    rng.shuffle(questions)
    prompts = [("gsm8k", q) for q in questions[: args.gsm8k_count]]
    prompts += [("chitchat", q) for q in chitchat_openers(args.chitchat_count, rng)]
    rng.shuffle(prompts)  # interleave sources so any prefix of the file is a mix
    with open(args.out, "w") as out:
        for i, (source, prompt) in enumerate(prompts):
            out.write(json.dumps({"id": f"{source}-{i}", "prompt": prompt}) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
