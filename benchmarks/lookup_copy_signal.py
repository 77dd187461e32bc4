"""How much n-gram lookup would yield right after a *copying* position, against elsewhere (the round controller's
context, `decoding/round_controller.py`).

    .venv/bin/python benchmarks/lookup_copy_signal.py                       # SmolLM2 fp32, 4 prompts per suite
    .venv/bin/python benchmarks/lookup_copy_signal.py --target qwen2.5-coder-1.5b-instruct --dtype bfloat16

For each prompt (first turn) it decodes greedily with plain `generate`, then replays the text token by token through
`lookup.NgramIndex`: at every position, the lookup yield is 1 + how many tokens of the chain ready there (up to
`--lookup-tokens`) agree with what follows; the position is *copying* when the previous token continued the chain
ready before it (`lookup.continues`). Prints the share of copying positions and the mean yield in each context.
"""

import argparse
import statistics

import torch

from transformers_jakiro.bench.suites import encode, load_suite
from transformers_jakiro.decoding.lookup import NgramIndex, continues
from transformers_jakiro.targets import load_target


def yields(prompt: list[int], generated: list[int], lookup_tokens: int, max_ngram: int) -> list[tuple[bool, int]]:
    """(copying, lookup yield) at each generated position."""
    index, copying, out = NgramIndex(max_ngram), False, []
    index.extend(prompt)
    for t, token in enumerate(generated):
        chains = index.chains(lookup_tokens, 1)
        chain = chains[0] if chains else []
        follow = generated[t : t + lookup_tokens]
        agreed = 0
        while agreed < min(len(chain), len(follow)) and chain[agreed] == follow[agreed]:
            agreed += 1
        out.append((copying, 1 + agreed))
        copying = continues(chain, [token])
        index.extend([token])
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suites", default="mt_bench,grounded,alpaca,humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--max-ngram", type=int, default=3)
    args = parser.parse_args(argv)
    model, tokenizer = load_target(args.target, dtype=args.dtype)[:2]
    device = model.get_input_embeddings().weight.device
    rows = []
    for suite in args.suites.split(","):
        for record in load_suite(suite, args.num_prompts):
            inputs = encode(tokenizer, [{"role": "user", "content": record["turns"][0]}], device)
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
            prompt = inputs["input_ids"][0].tolist()
            generated = out[0, len(prompt) :].tolist()
            rows += [(suite, *pair) for pair in yields(prompt, generated, args.lookup_tokens, args.max_ngram)]
    for suite in [*args.suites.split(","), "all"]:
        picked = [r for r in rows if suite == "all" or r[0] == suite]
        hot = [y for _, copying, y in picked if copying]
        cold = [y for _, copying, y in picked if not copying]
        print(f"{suite}: {len(picked)} positions, copying {len(hot) / len(picked):.2f}, lookup yield after copying "
              f"{statistics.mean(hot) if hot else float('nan'):.2f}, elsewhere {statistics.mean(cold):.2f}")


if __name__ == "__main__":
    main()
