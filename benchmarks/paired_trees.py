"""Tree sizes compared on the same text: what each tree would have accepted at every position of the target's own
greedy output (teacher-forced), and what its draft costs.

Decoding with different trees produces different texts (bf16 near-ties, stops), so comparing two trees' separate
runs mixes the trees' yields with the texts' difficulty. Here every tree is scored at every position of one text:
the plain greedy output of each prompt, whose target features come from one forward pass. At position p the draft
has read the features up to p - 1 (as in decoding), expands each tree with the root y[p], and the tree's draft
tokens are the longest path of its nodes equal to y[p+1], y[p+2], ... (what greedy verification accepts). N-gram
lookup is off. Used for the round controller's shape model (docs/experiments/round-controller.md, RC-7).

    python benchmarks/paired_trees.py --target qwen2.5-coder-1.5b-instruct \
        --draft heads/jakiro-qwen2.5-coder-1.5b-instruct --dtype bfloat16 --trees 8/2/8,2/1/4,4/1/4,4/2/4 \
        --suite humaneval,mt_bench,grounded --num-prompts 2 --max-new-tokens 48
"""

import argparse
import json
import time

import torch

from transformers_jakiro.decoding.round_controller import RoundChoice
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings
from transformers_jakiro.features import TargetFeatures
from transformers_jakiro.decoding.verification import accept, path_nodes


def accepted_depth(tree, continuation: torch.LongTensor) -> int:
    """How many of the tree's nodes greedy verification (`verification.accept`) keeps when the target's next tokens
    are `continuation`: teacher-forced, the target's choice at a node of depth d is continuation[d]."""
    beyond = torch.full((tree.levels + 1,), -1, dtype=continuation.dtype)  # past the text: no node matches
    choices = torch.cat([continuation, beyond])[tree.depths]
    path, _ = accept(tree, choices)
    return len(path_nodes(path)) - 1


@torch.no_grad()
def score_trees(target, draft, sequence: torch.LongTensor, prompt_length: int, trees: list[RoundChoice]) -> dict:
    """For each tree (a `RoundChoice`), its accepted draft tokens at every root position of `sequence` ([1, n], the
    prompt then the target's greedy output) from `prompt_length` on, and its draft seconds per position."""
    settings = TreeSettings.resolve(draft, lookup_tokens=0)
    with TargetFeatures(target, draft.config.target_feature_layers) as hidden:
        features = hidden.take(target(input_ids=sequence, **hidden.forward_kwargs()))[0]
    out = {}
    for choice in trees:
        drafter = JakiroCandidateGenerator(draft, settings)
        drafter.observe(features[:prompt_length], [])
        depths, seconds = [], []
        for root in range(prompt_length, sequence.shape[1] - 1):
            started = time.perf_counter()
            tree = drafter.get_candidates(sequence[:, : root + 1], choice)
            seconds.append(time.perf_counter() - started)
            depths.append(accepted_depth(tree, sequence[0, root + 1 :]))
            drafter.observe(features[root : root + 1], [])
        out[choice.name] = {"draft_tokens": depths, "draft_s": seconds}
    return out


def main() -> None:
    from transformers_jakiro.bench.cli import load_draft
    from transformers_jakiro.bench.suites import encode, load_suite
    from transformers_jakiro.targets import load_target_or_explain

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--trees", required=True, help="comma-separated TOTAL/DEPTH/TOPK; the first is the reference")
    parser.add_argument("--suite", default="humaneval,mt_bench,grounded")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=None, help="write every position's figures to this JSON file")
    args = parser.parse_args()

    target, tokenizer = load_target_or_explain(args.target, args.dtype)
    draft = load_draft(args.draft, target)
    trees = [RoundChoice("tree", *map(int, spec.split("/"))) for spec in args.trees.split(",")]
    results = {}
    print("| prompt | " + " | ".join(f"{t.name}: draft tokens (ratio), draft ms" for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for suite in args.suite.split(","):
        for record in load_suite(suite, args.num_prompts):
            inputs = encode(tokenizer, [{"role": "user", "content": record["turns"][0]}], target.device)
            sequence = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
            scored = score_trees(target, draft, sequence, inputs["input_ids"].shape[1], trees)
            results[f"{suite}/{record['id']}"] = scored
            means = {name: sum(v["draft_tokens"]) / len(v["draft_tokens"]) for name, v in scored.items()}
            reference = means[trees[0].name]
            cells = []
            for name, v in scored.items():
                ratio = means[name] / reference if reference else float("nan")
                cells.append(f"{means[name]:.2f} ({ratio:.2f}), {1000 * sum(v['draft_s'][1:]) / max(len(v['draft_s']) - 1, 1):.1f}")
            print(f"| {suite}/{record['id']} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
