"""Concurrent clients without a server: transformers' continuous batching against Jakiro rounds in it, in one process.

    .venv/bin/python benchmarks/cb_offline.py --target smollm2-135m-instruct --clients 8 --repeats 4
    .venv/bin/python benchmarks/cb_offline.py --variants plain-cb,tree:1/1/2,tree:2/1/2 --repeats 3

Each variant gets a manager of its own per repeat (its round costs in a file of its own under --out, kept across
repeats, as a server keeps them), answers one untimed request (and with `--cached` one untimed burst of the same
prompts, whose pages prefix sharing then finds cached), then `--requests` greedy requests with `--clients` in
flight: a finished request is replaced by the next, as a client sends its next request when its answer comes. The
variants take turns, the order reversed every other repeat; each repeat's tokens/s is paired with the first variant's
of the same repeat. Variants: `plain-cb` (transformers' own), `jakiro-cb` (as shipped), `plain-steps` (Jakiro rounds
whose controller always chooses a plain step; copy runs stay), `tree:T/D/K` (every round that tree),
`jakiro-cb-no-draft-pages` (as shipped, but a prompt whose pages are shared still has the draft read it whole: what
`--cached` gains from the draft's entries kept by page).

What this leaves out of `serve_concurrency.py`'s runs: HTTP, the API process and the engine process's IPC. Against
those runs it separates what the rounds cost from what serving them costs. Not a test: nothing here runs in CI.
"""

import argparse
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

from transformers import GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.bench.suites import load_suite
from transformers_jakiro.continuous import JakiroBatchProcessor, JakiroContinuousBatchingManager
from transformers_jakiro.continuous_support import jakiro_cb_config
from transformers_jakiro.decoding.round_controller import PinnedController, RoundChoice
from transformers_jakiro.shared_pages import SharedPageFeatures
from transformers_jakiro.targets import load_target_or_explain

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(name: str) -> RoundChoice | str:
    """`tree:T/D/K` as the RoundChoice it pins; the other names as they are."""
    if name.startswith("tree:"):
        total, depth, top_k = (int(part) for part in name[5:].split("/"))
        return RoundChoice("tree", total, depth, top_k)
    if name not in ("plain-cb", "jakiro-cb", "plain-steps", "jakiro-cb-no-draft-pages"):
        raise SystemExit(f"unknown variant {name!r}: plain-cb, jakiro-cb, plain-steps, jakiro-cb-no-draft-pages or "
                         "tree:T/D/K")
    return name


class Pinned:
    """While open: every Jakiro round of the batch chooses `choice` (a plain step: copy runs still bring their chain);
    None leaves the round controller as it is."""

    def __init__(self, choice: RoundChoice | None):
        self.choice = choice

    def __enter__(self):
        self.controller = JakiroBatchProcessor._controller
        if self.choice is not None:
            JakiroBatchProcessor._controller = lambda processor, decoding: PinnedController(self.choice)
        return self

    def __exit__(self, *exc):
        JakiroBatchProcessor._controller = self.controller


def burst(manager, prompts: list[list[int]], clients: int, max_tokens: int) -> float:
    """Tokens/s of `prompts` with `clients` in flight, after one untimed request."""
    manager.add_request(prompts[0], "warm-up", max_new_tokens=8)
    while (result := manager.get_result(timeout=5)) is None or not result.is_finished():
        pass
    started, sent, finished, tokens = time.perf_counter(), 0, 0, 0
    while sent < min(clients, len(prompts)):
        manager.add_request(prompts[sent], f"r{sent}", max_new_tokens=max_tokens)
        sent += 1
    while finished < len(prompts):
        result = manager.get_result(timeout=5)
        if result is None or not result.is_finished():
            continue
        finished, tokens = finished + 1, tokens + len(result.generated_tokens)
        if sent < len(prompts):
            manager.add_request(prompts[sent], f"r{sent}", max_new_tokens=max_tokens)
            sent += 1
    return tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="head directory (default heads/jakiro-<target>)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suite", default="mt_bench")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", default="plain-cb,jakiro-cb,plain-steps")
    parser.add_argument("--out", default="/tmp/cb-offline", help="folder for the variants' round-cost files")
    parser.add_argument("--cached", action="store_true",
                        help="one untimed burst of the same prompts first (their pages then cached and shared, as in "
                             "a server that answered them before)")
    args = parser.parse_args()

    variants = {name: parse_variant(name) for name in args.variants.split(",")}
    target, tokenizer = load_target_or_explain(args.target, args.dtype)
    target.config._attn_implementation = "sdpa"
    draft = JakiroDraftModel.from_pretrained(args.draft or ROOT / "heads" / f"jakiro-{args.target}")
    records = load_suite(args.suite, args.requests, spread_categories=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"] for r in records]
    config = GenerationConfig(**target.generation_config.to_dict())
    config.do_sample, config.max_new_tokens = False, args.max_tokens
    if config.eos_token_id is None:
        config.eos_token_id = -1  # as transformers' `init_continuous_batching`
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rates = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
            os.environ["JAKIRO_ROUND_COSTS"] = str(Path(args.out) / f"round-costs-{name.replace('/', '-')}.json")
            kind = variants[name]
            cb = jakiro_cb_config(num_blocks=512, page_size=32, max_batch_tokens=512)
            unshared = (mock.patch.object(SharedPageFeatures, "draft_prefix", lambda *args: None)
                        if kind == "jakiro-cb-no-draft-pages" else nullcontext())
            with unshared, Pinned(RoundChoice("plain") if kind == "plain-steps" else
                                  kind if isinstance(kind, RoundChoice) else None):
                manager = (ContinuousBatchingManager(target, config, cb) if kind == "plain-cb"
                           else JakiroContinuousBatchingManager(target, draft, config, cb))
                manager.start()
                try:
                    if args.cached:
                        burst(manager, prompts, args.clients, args.max_tokens)
                    rates[name].append(burst(manager, prompts, args.clients, args.max_tokens))
                finally:
                    manager.stop(block=True)
            print(f"repeat {repeat} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
    base = next(iter(variants))
    print(f"\n| variant | tokens/s (mean) | paired vs {base} (range) |\n|---|---:|---|")
    for name, values in rates.items():
        ratios = [value / reference for value, reference in zip(values, rates[base])]
        mean = statistics.geometric_mean(ratios)
        print(f"| {name} | {statistics.mean(values):.1f} | {mean:.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
