"""Tuning the tree for this machine (`jakiro bench --tune`): the target's verify-forward time against tree size, the
draft's time per round against depth and the head's acceptance profile, then the `total_tokens`/`depth` with the
highest predicted tokens/s (`choose_tree_settings`), checked against the defaults in the same run, and the n-gram
lookup budget measured with the chosen tree (`tune_lookup`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import LogitsProcessorList

from ..decoding.row_rounds import lazy_leaf_head, verify_tree
from ..decoding.target_inputs import cache_kwarg
from ..decoding.drafter import JakiroCandidateGenerator, TreeSettings
from ..features import TargetFeatures
from ..decoding.kv_cache import new_target_cache, truncate
from ..stats import acceptance_profile
from ..decoding.tree import DraftTree
from .measure import _sampling_kwargs, _sync, generate_once
from .suites import encode

TUNE_SIZES = (1, 4, 8, 16, 32, 64)
TUNE_DEPTHS = (1, 2, 3, 4, 5, 6)
TUNE_LOOKUP_TOKENS = (0, 5, 10, 20)  # lookup chain budgets --tune compares (0: off)


def expected_tokens_per_round(survival: Sequence[float], depth: int, contrastive: bool = True) -> float:
    """E[accepted + 1] for a tree `depth` draft forwards deep, from `survival[d - 1]` = P(at least d draft tokens
    accepted) measured at this tree size (the tree has depth + 1 levels with the contrastive head)."""
    levels = depth + 1 if contrastive else depth
    return 1.0 + sum(survival[:levels])


def choose_tree_settings(
    verify_s: Mapping[int, float],
    draft_s: Mapping[int, float],
    survival: Mapping[int, Sequence[float]],
    contrastive: bool = True,
) -> dict:
    """Pick (total_tokens, depth) maximising predicted tokens/s = E[accepted + 1] / (t_verify(n) + t_draft(depth)).

    verify_s[n]: seconds of one target forward over a tree of n draft tokens (plus the root), at the context length.
    draft_s[depth]: seconds of one draft round (tree expansion) with `depth` draft forwards.
    survival[n][d - 1]: P(at least d draft tokens accepted per round) measured with trees of n tokens.
    Pure: returns {"total_tokens", "depth", "predicted_tokens_per_s", "table": every candidate, best first}.
    """
    table = []
    for n, t_verify in verify_s.items():
        if n not in survival:
            continue
        for depth, t_draft in draft_s.items():
            tokens = expected_tokens_per_round(survival[n], depth, contrastive)
            table.append(
                dict(total_tokens=n, depth=depth, expected_tokens_per_round=tokens,
                     seconds_per_round=t_verify + t_draft, predicted_tokens_per_s=tokens / (t_verify + t_draft))
            )
    if not table:
        raise ValueError("choose_tree_settings: no tree size has both a verify cost and an acceptance profile")
    table.sort(key=lambda row: (-row["predicted_tokens_per_s"], row["total_tokens"], row["depth"]))
    best = table[0]
    return {"total_tokens": best["total_tokens"], "depth": best["depth"],
            "predicted_tokens_per_s": best["predicted_tokens_per_s"], "table": table}


def _median_time(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prefix_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first n + 1 nodes (root included) of a breadth-first tree: a tree again (parents precede children)."""
    m = min(n + 1, tree.num_nodes)
    return DraftTree(
        tree.tokens[:m], tree.parents[:m], tree.depths[:m], tree.ancestors[:m, :m], tree.scores[:m], levels=tree.levels
    )


@torch.no_grad()
def measure_costs(target, draft, input_ids, sizes=TUNE_SIZES, depths=TUNE_DEPTHS, repeats: int = 3) -> dict:
    """Seconds of one verify forward per tree size and of one draft round per depth, at `input_ids`' length.

    Verify: the target's cache holds the prompt; a real draft tree cut to n tokens goes through `verify_tree` (the
    forward with its tree mask, acceptance, cache compaction, as in greedy decoding) and the cache is cut back after
    each round; n = 0 is a plain one-token decoding step. Draft: a steady-state
    round, one newly accepted position read plus the expansion, with the default top_k and the contrastive level."""

    draft.bind_target(target)
    device = input_ids.device
    cache_arg = cache_kwarg(target)
    cache = new_target_cache(target.config)
    layers = draft.config.target_feature_layers
    with TargetFeatures(target, layers) as hidden:
        out = target(input_ids=input_ids, use_cache=True, **hidden.forward_kwargs(), **{cache_arg: cache})
        features = hidden.take(out)[0]
    past = cache.get_seq_length()
    context = torch.cat([input_ids, out.logits[:, -1:].argmax(-1)], dim=1)

    def fresh_generator(total_tokens, depth):
        settings = TreeSettings.resolve(draft, total_tokens=total_tokens, depth=depth)
        generator = JakiroCandidateGenerator(draft, settings)
        generator.observe(features, [])
        tree = generator.get_candidates(context)  # reads the whole prompt once
        return generator, tree

    def draft_round(generator):
        truncate(generator.cache, context.shape[1] - 2)
        generator.observe(features[-1:], [])
        return generator.get_candidates(context)

    draft_s = {}
    for depth in depths:
        generator, _ = fresh_generator(max(sizes), depth)
        draft_round(generator)  # warm-up
        draft_s[depth] = _median_time(lambda: draft_round(generator), repeats, device)

    _, big_tree = fresh_generator(max(sizes), max(depths))
    leaf_head = lazy_leaf_head(target, features[-1:, -draft.config.hidden_size :], out.logits[0, -1:])
    verify_s = {}
    for n in [0, *sizes]:  # n = 0: one token, the cost of a plain decoding step
        tree = _prefix_tree(big_tree, n).to_device(target.get_input_embeddings().weight.device)

        def verify():
            if n == 0:  # plain decoding: one token, its logits
                target(input_ids=tree.tokens[None], use_cache=True, **{cache_arg: cache})
            else:  # the whole verification round as decoding runs it
                verify_tree(
                    target, cache, cache_arg, tree, context, LogitsProcessorList(), False, leaf_head,
                    feature_layers=layers,
                )
            truncate(cache, past)

        verify()  # warm-up
        verify_s[n] = _median_time(verify, repeats, device)
    return {"context_length": int(past), "verify_s": verify_s, "draft_s": draft_s}



def tuning_prompts(prompts: Mapping[str, list[dict]]) -> list[dict]:
    """The first prompt of each suite (two when there is one suite): tuning sees every kind of text benchmarked."""
    suites = [records for records in prompts.values() if records]
    chosen = [records[0] for records in suites]
    return chosen if len(chosen) > 1 else suites[0][:2]



def tune(target, tokenizer, draft, prompts: list[dict], max_new_tokens: int = 32, sizes=TUNE_SIZES,
         depths=TUNE_DEPTHS, repeats: int = 3, log=print) -> dict:
    """Measure costs and the acceptance profile on `prompts` (first turns, greedy), choose the tree settings, and
    measure the chosen settings against the draft's defaults in the same run (alternating)."""
    device = target.get_input_embeddings().weight.device
    sampling = _sampling_kwargs(0.0, tokenizer, max_new_tokens)
    inputs = [encode(tokenizer, [{"role": "user", "content": p["turns"][0]}], device) for p in prompts]
    log(f"tune: measuring verify/draft costs at a {inputs[0]['input_ids'].shape[1]}-token context")
    costs = measure_costs(target, draft, inputs[0]["input_ids"], sizes, depths, repeats)
    contrastive = TreeSettings.resolve(draft).contrastive
    levels = max(depths) + (1 if contrastive else 0)
    profiles = {}
    for n in sizes:
        lengths = [generate_once(target, x, "jakiro_fixed", draft, None, sampling,
                                 {"total_tokens": n, "depth": max(depths)})["accepted_lengths"] for x in inputs]
        profiles[n] = acceptance_profile(lengths, levels)
        log(f"tune: total_tokens={n}: per-depth acceptance "
            + " ".join(f"{r:.2f}" for r in profiles[n]["acceptance_rates"]))
    choice = choose_tree_settings(
        {n: costs["verify_s"][n] for n in sizes}, costs["draft_s"], {n: p["survival"] for n, p in profiles.items()},
        contrastive,
    )
    default = TreeSettings.resolve(draft)
    chosen = {"total_tokens": choice["total_tokens"], "depth": choice["depth"]}
    runs = {"default": [], "chosen": []}
    for i, x in enumerate(inputs):  # alternate which setting goes first
        order = ["default", "chosen"] if i % 2 == 0 else ["chosen", "default"]
        for name in order:
            settings = {"total_tokens": default.total_tokens, "depth": default.depth} if name == "default" else chosen
            runs[name].append(generate_once(target, x, "jakiro_fixed", draft, None, sampling, settings))
    measured = {}
    for name, records in runs.items():
        tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["time_s"] for r in records)
        rounds = sum(r["rounds"] for r in records)
        measured[name] = {"tokens_per_s": round(tokens / seconds, 3), "tau": round(tokens / rounds, 4)}
    identical = all(a["new_ids"] == b["new_ids"] for a, b in zip(runs["default"], runs["chosen"]))
    lookup = tune_lookup(target, draft, inputs, sampling, chosen, log=log)
    identical = identical and lookup.pop("outputs_identical")
    result = {
        "context_length": costs["context_length"],
        "verify_s": {str(n): t for n, t in costs["verify_s"].items()},  # n = 0: a one-token (plain) step
        "draft_s": {str(d): t for d, t in costs["draft_s"].items()},
        "acceptance": {str(n): p for n, p in profiles.items()},
        "default": {"total_tokens": default.total_tokens, "depth": default.depth, "top_k": default.top_k,
                    **measured["default"]},
        "chosen": {**chosen, "top_k": default.top_k, **measured["chosen"],
                   "predicted_tokens_per_s": round(choice["predicted_tokens_per_s"], 3),
                   "lookup_tokens": lookup["chosen"]},
        "lookup": lookup["measured"],
        "gain_over_default": round(measured["chosen"]["tokens_per_s"] / measured["default"]["tokens_per_s"], 4),
        "outputs_identical": identical,
        "candidates": [{k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
                       for row in choice["table"][:10]],
    }
    log(f"tune: chose total_tokens={chosen['total_tokens']} depth={chosen['depth']}: "
        f"{measured['chosen']['tokens_per_s']} tok/s vs {measured['default']['tokens_per_s']} tok/s with the defaults "
        f"(total_tokens={default.total_tokens} depth={default.depth}): {result['gain_over_default']:.2f}x")
    return result



def tune_lookup(target, draft, inputs, sampling, tree: dict, budgets=TUNE_LOOKUP_TOKENS, log=print) -> dict:
    """Run the chosen draft tree with each n-gram lookup budget on the tuning prompts (rotating which goes first)
    and pick the fastest. Lookup's value depends on the text (code that repeats its prompt, answers that quote a
    passage), which no cost model predicts, so it is measured. Returns {"chosen", "measured", "outputs_identical"}."""
    runs = {budget: [] for budget in budgets}
    for i, x in enumerate(inputs):
        order = list(budgets[i % len(budgets):]) + list(budgets[: i % len(budgets)])
        for budget in order:
            method = "jakiro_lookup_fixed" if budget else "jakiro_fixed"  # the tree every round, as tuned
            runs[budget].append(generate_once(target, x, method, draft, None, sampling, {**tree, "lookup_tokens": budget}))
    measured = {}
    for budget, records in runs.items():
        tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["time_s"] for r in records)
        rounds = sum(r["rounds"] for r in records)
        measured[str(budget)] = {"tokens_per_s": round(tokens / seconds, 3), "tau": round(tokens / rounds, 4)}
    best = max(budgets, key=lambda b: measured[str(b)]["tokens_per_s"])
    identical = all(len({tuple(runs[b][i]["new_ids"]) for b in budgets}) == 1 for i in range(len(inputs)))
    log("tune: n-gram lookup budget " + ", ".join(f"{b}: {measured[str(b)]['tokens_per_s']} tok/s" for b in budgets)
        + f"; chose {best}")
    return {"chosen": best, "measured": measured, "outputs_identical": identical}


__all__ = ["TUNE_DEPTHS", "TUNE_LOOKUP_TOKENS", "TUNE_SIZES", "choose_tree_settings", "expected_tokens_per_round",
           "measure_costs", "tune", "tune_lookup", "tuning_prompts"]
