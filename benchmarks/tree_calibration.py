"""Where a head's tree loses tokens: the draft's calibration per depth, and what a better choice of nodes could buy.

In every round the draft scores far more candidates than the tree keeps (24/4/6: 6 + 3 x 36 + 36 = 150 scored, 24
kept). This script records all of them during real greedy tree decoding, marks each one whose path is the target's
own continuation ("right"), and reports:

  * per tree depth, the draft's probability of a step (given a right parent) against how often the step is right:
    EAGLE-2's dynamic tree keeps the candidates of highest cumulative probability, which is the best choice only if
    those probabilities are calibrated;
  * tokens per draft round (the accepted draft tokens + 1, prefill excluded, as papers count) three ways: as decoded
    (the kept tree), as the kept tree would give if each depth's log-probabilities were re-weighted by the power that
    calibrates them (P(right) = p ** a_d, fitted by maximum likelihood), and the ceiling of the scored candidates
    (every right candidate kept).

The decoded figure is recomputed from the recorded candidates with the decoder's own rule, so it must equal what the
decoder accepted (checked in tests/test_tree_calibration.py). Greedy only; n-gram lookup is switched off.

    OMP_NUM_THREADS=1 python benchmarks/tree_calibration.py --target smollm2-135m-instruct \
        --draft heads/jakiro-smollm2-135m-instruct --prompts data/smollm2/heldout.jsonl --max-new-tokens 128 \
        --tree 24/4/6
"""

import argparse
import contextlib
import math

import torch

from transformers_jakiro.decoding import tree as tree_module
from transformers_jakiro import tree_settings

POWERS = [0.2 + 0.05 * i for i in range(57)]  # the grid the per-depth power is fitted on: 0.2 ... 3.0


@contextlib.contextmanager
def recorded_candidates():
    """Inside the block, every round's full candidate set (tokens, parents, scores, depths; root first) is appended
    to the yielded list when the decoder flattens it. `TreeRecorder.flatten` is the one place where all exist."""
    rounds, flatten = [], tree_module.TreeRecorder.flatten

    def recording_flatten(recorder, total_tokens):
        rounds.append({name: torch.cat(getattr(recorder, name)).tolist()
                       for name in ("tokens", "parents", "scores", "depths")})
        return flatten(recorder, total_tokens)

    tree_module.TreeRecorder.flatten = recording_flatten
    try:
        yield rounds
    finally:
        tree_module.TreeRecorder.flatten = flatten


def label(candidates: dict, continuation: list[int]) -> dict:
    """`candidates` with `right` (its path is `continuation`, the target's tokens after the root), `known` (the
    continuation reaches its depth) and `step` (its own log-probability: its score minus its parent's)."""
    tokens, parents, scores, depths = (candidates[k] for k in ("tokens", "parents", "scores", "depths"))
    right, known, step = [True], [True], [0.0]
    for i in range(1, len(tokens)):
        inside = depths[i] <= len(continuation)
        known.append(inside)
        right.append(inside and right[parents[i]] and continuation[depths[i] - 1] == tokens[i])
        step.append(scores[i] - scores[parents[i]])
    return dict(candidates, right=right, known=known, step=step)


def record(target, draft, prompts: list[torch.LongTensor], max_new_tokens: int, **tree) -> list[dict]:
    """Greedy tree decoding of each prompt ([1, length] ids); returns every draft round's labelled candidates with
    `accepted` (the tokens that round added, bonus included, as the decoder counted them) and `last` (the
    generation's last round, which max_new_tokens or a stop may have cut)."""
    labelled = []
    for input_ids in prompts:
        with tree_settings(draft, lookup_tokens=0, **tree), recorded_candidates() as rounds:
            output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=draft,
                                     do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()
        accepted = list(draft.last_generation_stats.accepted_lengths)
        assert len(accepted) == len(rounds) + 1, "one prefill round, then one recorded tree per round"
        length = input_ids.shape[1] + accepted[0]  # the root of draft round i is the last token of the context
        for i, candidates in enumerate(rounds):
            row = label(candidates, output[length:])
            row.update(accepted=accepted[i + 1], last=i == len(rounds) - 1)
            labelled.append(row)
            length += accepted[i + 1]
    return labelled


def kept_right(row: dict, total_tokens: int, powers: list[float] | None = None) -> int:
    """How many right candidates the tree keeps when the decoder's own choice (`tree.best_candidates`) is applied to
    the cumulative (re-weighted) scores."""
    scores = torch.tensor(row["scores"])  # as the decoder compared them (float32 sums): near-ties break the same way
    if powers is not None:
        summed = [0.0]
        for i in range(1, len(row["tokens"])):
            summed.append(summed[row["parents"][i]] + powers[row["depths"][i]] * row["step"][i])
        scores = torch.tensor(summed, dtype=torch.float64)
    return sum(row["right"][i] for i in tree_module.best_candidates(scores, total_tokens).tolist())


def calibration(rows: list[dict]) -> list[dict]:
    """Per depth: steps with a right parent, their mean draft probability, the share that is right, and the power
    a_d that calibrates them (P(right) = p ** a_d), fitted by maximum likelihood."""
    table = []
    for depth in range(1, max(max(r["depths"]) for r in rows) + 1):
        pairs = [(math.exp(r["step"][i]), r["right"][i]) for r in rows for i in range(1, len(r["tokens"]))
                 if r["depths"][i] == depth and r["known"][i] and r["right"][r["parents"][i]]]
        if not pairs:
            continue

        def likelihood(a):
            return sum(math.log(max(p**a if y else 1 - p**a, 1e-12)) for p, y in pairs)

        table.append(dict(depth=depth, steps=len(pairs), mean_p=sum(p for p, _ in pairs) / len(pairs),
                          right=sum(y for _, y in pairs) / len(pairs), power=max(POWERS, key=likelihood)))
    return table


def report(rows: list[dict], total_tokens: int) -> dict:
    table = calibration(rows)
    powers = [1.0] * (max(t["depth"] for t in table) + 1)
    for t in table:
        powers[t["depth"]] = t["power"]
    full = [r for r in rows if not r["last"]]  # whole rounds: none cut by max_new_tokens or a stop
    return dict(
        rounds=len(full),
        decoded=sum(r["accepted"] for r in full) / len(full),
        recomputed=1 + sum(kept_right(r, total_tokens) for r in full) / len(full),
        calibrated=1 + sum(kept_right(r, total_tokens, powers) for r in full) / len(full),
        ceiling=1 + sum(sum(r["right"][1:]) for r in full) / len(full),
        calibration=table,
    )


def main() -> None:
    from transformers_jakiro import JakiroDraftModel
    from transformers_jakiro.training.distill import read_prompts, render_prompt
    from transformers_jakiro.targets import load_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True, help="a prompts .jsonl or a data spec such as sharegpt:11000-11024")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", default=None, metavar="TOTAL/DEPTH/TOPK", help="default: the head's own settings")
    args = parser.parse_args()
    target, tokenizer = load_target(args.target)
    draft = JakiroDraftModel.from_pretrained(args.draft)
    tree = {}
    if args.tree:
        tree = dict(zip(("total_tokens", "depth", "top_k"), map(int, args.tree.split("/"))))
    prompts = [tokenizer(render_prompt(tokenizer, text), return_tensors="pt", add_special_tokens=False).input_ids
               for _, text in read_prompts(args.prompts)[0][: args.limit]]
    rows = record(target, draft, prompts, args.max_new_tokens, **tree)
    total = tree.get("total_tokens", draft.config.total_tokens)
    result = report(rows, total)
    print(f"{result['rounds']} whole draft rounds; tokens per round: decoded {result['decoded']:.3f} (recomputed "
          f"{result['recomputed']:.3f}), with calibrated scores {result['calibrated']:.3f}, ceiling of the scored "
          f"candidates {result['ceiling']:.3f}")
    print("depth | steps with a right parent | mean draft p | right | calibrating power")
    for t in result["calibration"]:
        print(f"{t['depth']} | {t['steps']} | {t['mean_p']:.3f} | {t['right']:.3f} | {t['power']:.2f}")


if __name__ == "__main__":
    main()
