"""Benchmark Jakiro against plain decoding and the stock speculative methods of transformers, in one process:

    jakiro bench --target smollm2-135m-instruct --draft heads/jakiro-smollm2-135m-instruct \
        --suite mt_bench,humaneval,alpaca --temperature 0,1 --max-new-tokens 128 --out benchmarks/results/smollm2

Methods (all through `target.generate`, same prompts, same `max_new_tokens`, same sampling settings):
  plain          `generate` without a draft: the baseline every speedup is measured against, in the same run.
  jakiro         `assistant_model=draft`: Jakiro trees, the contrastive head builds the last level.
  eagle2         the same engine with `tree_settings(draft, contrastive=False)`: the EAGLE-2-style ablation (every
                 level from a draft forward).
  assisted       transformers' assisted generation with `--assistant` (a smaller LM with the same tokenizer) as the
                 draft; stock code path, stock heuristic schedule.
  prompt_lookup  transformers' prompt-lookup decoding, `prompt_lookup_num_tokens=10` (PROMPT_LOOKUP_NUM_TOKENS), the
                 stock `max_matching_ngram_size` (2).

Prompts: the first turn of each record, rendered with the tokenizer's chat template. MT-bench records also run their
second turn: the conversation continues with the *baseline's* first answer, so every method sees the same context.
Methods alternate per prompt (the order rotates by one each prompt) to spread machine noise evenly; one short warm-up
generation per method runs first. At temperature 0 each output is compared token for token with the baseline's
(`match_rate`); at temperature > 0 outputs are samples and are not compared.

Reported per suite and overall (the sum over suites): tokens/s (new tokens / wall seconds of generate), speedup
(tokens/s over plain's, same run), tau (new tokens per target forward, the prefill included, Jakiro engine only),
tau (papers) (new tokens per draft-verify cycle, each generation's prefill and first token left out: the acceptance
length EAGLE and Jakiro papers report), efficiency (speedup / tau:
how much of the acceptance length survives the drafting and verification overheads), peak memory (on CUDA,
`torch.cuda.max_memory_allocated` during that method's generations; on CPU, the process RSS sampled every 5 ms during
them, which includes the loaded models) and match rate. Files in `--out`: `results.json` (with machine info and the
exact command), `results.md` and `speedup.png`.

`--tune` measures, on this machine, the target's verify-forward time against tree size and the draft's time per round
against depth, and the head's acceptance profile (per-depth acceptance rates from short Jakiro runs at each tree
size), picks the `total_tokens`/`depth` with the highest predicted tokens/s = E[accepted + 1] / (t_verify(n) +
t_draft(depth)) (`choose_tree_settings`), measures the chosen settings against the defaults in the same run, and
uses them for the jakiro/eagle2 rows of the benchmark. It then runs the chosen tree with each n-gram lookup budget
(`TUNE_LOOKUP_TOKENS`, 0 = off) on the same prompts and keeps the fastest for the jakiro_lookup row (10 when off wins,
so that the row still shows what lookup does).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from .decoding import _cache_kwarg, lazy_leaf_head, verify_tree
from .drafting import JakiroCandidateGenerator, TreeSettings
from .features import TargetFeatures
from .generation import tree_settings
from .kv_cache import new_target_cache, truncate
from .tree import DraftTree

METHODS = ("plain", "jakiro", "jakiro_lookup", "eagle2", "assisted", "prompt_lookup")
# jakiro and eagle2 run the draft tree alone (n-gram lookup off); jakiro_lookup adds lookup chains (hybrid tree).
TREE_METHODS = ("jakiro", "jakiro_lookup", "eagle2")
SUITES = ("mt_bench", "humaneval", "alpaca")
PROMPT_LOOKUP_NUM_TOKENS = 10
LOOKUP_TOKENS = 10  # jakiro_lookup's chain budget when neither --tune nor the head chose one
# The benchmark questions live in shared/data/bench beside a checkout of this repository; $JAKIRO_BENCH_DATA or
# --data-dir point elsewhere.
DEFAULT_DATA_DIR = Path(
    os.environ.get("JAKIRO_BENCH_DATA", Path(__file__).resolve().parents[3] / "shared" / "data" / "bench")
)
# Suites of our own, in this repository: `grounded` (a passage or function in the prompt that the answer quotes,
# edits or summarises; scripts/grounded_prompts.py). Found when --data-dir has no file of that name.
SHIPPED_SUITES = Path(__file__).resolve().parents[2] / "benchmarks" / "suites"
TUNE_SIZES = (1, 4, 8, 16, 32, 64)
TUNE_DEPTHS = (1, 2, 3, 4, 5, 6)
TUNE_LOOKUP_TOKENS = (0, 5, 10, 20)  # lookup chain budgets --tune compares (0: off)


# ---------------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------------


def load_suite(
    suite: str,
    num_prompts: int | None = None,
    data_dir: str | os.PathLike | None = None,
    spread_categories: bool = False,
) -> list[dict]:
    """The first `num_prompts` records of `<data_dir>/<suite>.jsonl`: dicts with `id`, `category`, `turns`.

    `spread_categories`: take them round-robin over the categories instead (first of each category in file order,
    then the second of each, ...), so that a few prompts cover MT-bench's eight categories, not only its first."""
    path = Path(data_dir or DEFAULT_DATA_DIR) / f"{suite}.jsonl"
    if not path.is_file() and (SHIPPED_SUITES / f"{suite}.jsonl").is_file():
        path = SHIPPED_SUITES / f"{suite}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"benchmark suite {suite!r} not found: {path} (set --data-dir or JAKIRO_BENCH_DATA)")
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            turns = record.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{number}: expected a non-empty list of strings in `turns`")
            records.append(
                {"id": str(record.get("question_id", record.get("id", number))), "category": record.get("category"),
                 "turns": turns}
            )
            if num_prompts is not None and len(records) >= num_prompts and not spread_categories:
                break
    if spread_categories:
        by_category = {}
        for record in records:
            by_category.setdefault(record["category"], []).append(record)
        rounds = itertools.zip_longest(*by_category.values())
        records = [record for round_ in rounds for record in round_ if record is not None]
    return records[:num_prompts]


def encode(tokenizer, messages: list[dict], device) -> dict:
    """Chat-template the conversation (generation prompt added); a tokenizer without a template gets the plain text."""
    if getattr(tokenizer, "chat_template", None):
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")
    return {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}


# ---------------------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory of a block, in MiB. CUDA: `max_memory_allocated` (reset on entry). CPU: the process RSS sampled
    every 5 ms by a background thread (psutil), else the process high-water mark (`ru_maxrss`, never reset)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_mb = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            import psutil

            self._process = psutil.Process()
        except ImportError:
            self._process = None
            return self
        self._stop = threading.Event()
        self._peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self._process is None:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self._peak, self._process.memory_info().rss) / 2**20
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _method_kwargs(method: str, draft, assistant) -> dict:
    if method == "plain":
        return {}
    if method in TREE_METHODS:
        return {"assistant_model": draft}
    if method == "assisted":
        return {"assistant_model": assistant}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS}
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def _sampling_kwargs(temperature: float, tokenizer, max_new_tokens: int) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    return kwargs


def _lookup_budget(settings: dict, draft) -> int:
    """jakiro_lookup's chain budget: the given (tuned or --lookup-tokens) one, else the head's, else LOOKUP_TOKENS."""
    return settings.get("lookup_tokens") or draft.config.lookup_tokens or LOOKUP_TOKENS


def generate_once(target, inputs, method, draft, assistant, sampling, settings) -> dict:
    """One timed `generate`: the new token ids, seconds, and (tree methods) the Jakiro stats."""
    device = inputs["input_ids"].device
    kwargs = {**sampling, **_method_kwargs(method, draft, assistant)}
    overrides = dict(settings or {})
    if method == "eagle2":
        overrides["contrastive"] = False
    if method in ("jakiro", "eagle2"):
        overrides["lookup_tokens"] = 0
    elif method == "jakiro_lookup":
        overrides["lookup_tokens"] = _lookup_budget(overrides, draft)
    _sync(device)
    start = time.perf_counter()
    if method in TREE_METHODS:
        with tree_settings(draft, **overrides):
            output = target.generate(**inputs, **kwargs)
    else:
        output = target.generate(**inputs, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - start
    new = output[0, inputs["input_ids"].shape[1]:].tolist()
    record = {"new_ids": new, "new_tokens": len(new), "time_s": seconds}
    if method in TREE_METHODS:
        stats = draft.last_generation_stats
        record.update(rounds=stats.rounds, accepted_lengths=list(stats.accepted_lengths),
                      draft_time_s=stats.draft_time_s, verify_time_s=stats.verify_time_s,
                      lookup_accepted=stats.lookup_accepted,
                      in_draft_vocab=int(draft.in_vocabulary(new).sum()))
    return record


def summarize(samples: list[dict], methods: Sequence[str], temperature: float) -> list[dict]:
    """Rows per (suite, method) plus suite "overall" from per-generation samples of one temperature."""
    suites = list(dict.fromkeys(s["suite"] for s in samples)) + ["overall"]
    rows = []
    for suite in suites:
        chosen = [s for s in samples if suite == "overall" or s["suite"] == suite]
        per_method = {}
        for method in methods:
            mine = [s for s in chosen if s["method"] == method]
            tokens, seconds = sum(s["new_tokens"] for s in mine), sum(s["time_s"] for s in mine)
            rounds = sum(s.get("rounds", 0) for s in mine)
            lookup = sum(s.get("lookup_accepted", 0) for s in mine)
            levels = max((len(s["accepted_lengths"]) and max(s["accepted_lengths"]) for s in mine
                          if "accepted_lengths" in s), default=1) - 1
            per_method[method] = dict(
                temperature=temperature,
                suite=suite,
                method=method,
                generations=len(mine),
                new_tokens=tokens,
                time_s=round(seconds, 4),
                tokens_per_s=tokens / seconds if seconds else 0.0,
                tau=tokens / rounds if method in TREE_METHODS and rounds else None,
                lookup_share=lookup / tokens if method == "jakiro_lookup" and tokens else None,
                # the share of draft-verify rounds (prefill and each generation's last round left out) that accepted
                # at least d draft tokens, d = 1.. the deepest acceptance seen
                acceptance_at_depth=[round(x, 4) for x in acceptance_profile(
                    [s["accepted_lengths"] for s in mine], levels)["survival"]] if method in TREE_METHODS else None,
                # the papers' acceptance length: each generation's prefill round and its one token left out
                papers_tau=(tokens - len(mine)) / (rounds - len(mine))
                if method in TREE_METHODS and rounds > len(mine)
                else None,
                # the share of the generated tokens the draft vocabulary holds: a ceiling on any draft token's
                # acceptance (1 with the target's full vocabulary)
                vocab_coverage=round(sum(s["in_draft_vocab"] for s in mine) / tokens, 4)
                if tokens and all("in_draft_vocab" in s for s in mine) else None,
                match_rate=sum(s["matches_baseline"] for s in mine) / len(mine) if temperature == 0 and mine else None,
                peak_memory_mb=round(max((s["peak_memory_mb"] for s in mine), default=0.0), 1),
            )
        base = per_method.get("plain", {}).get("tokens_per_s")
        for row in per_method.values():
            row["speedup"] = row["tokens_per_s"] / base if base else None
            row["efficiency"] = row["speedup"] / row["tau"] if row["speedup"] is not None and row["tau"] else None
            row["tokens_per_s"] = round(row["tokens_per_s"], 3)
            for key in ("speedup", "tau", "papers_tau", "efficiency", "match_rate", "lookup_share"):
                if row[key] is not None:
                    row[key] = round(row[key], 4)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Tuning the tree for this machine
# ---------------------------------------------------------------------------------------------------------------------


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
    cache_kwarg = _cache_kwarg(target)
    cache = new_target_cache(target.config)
    layers = draft.config.target_feature_layers
    with TargetFeatures(target, layers) as hidden:
        out = target(input_ids=input_ids, use_cache=True, **hidden.forward_kwargs(), **{cache_kwarg: cache})
        features = hidden.take(out)[0]
    past = cache.get_seq_length()
    context = torch.cat([input_ids, out.logits[:, -1:].argmax(-1)], dim=1)

    def fresh_generator(total_tokens, depth):
        settings = TreeSettings.resolve(draft, total_tokens=total_tokens, depth=depth)
        generator = JakiroCandidateGenerator(draft, settings)
        generator.set_features(features)
        tree = generator.get_candidates(context)  # reads the whole prompt once
        return generator, tree

    def draft_round(generator):
        truncate(generator.cache, context.shape[1] - 2)
        generator.set_features(features[-1:])
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
                target(input_ids=tree.tokens[None], use_cache=True, **{cache_kwarg: cache})
            else:  # the whole verification round as decoding runs it
                verify_tree(
                    target, cache, cache_kwarg, tree, context, LogitsProcessorList(), False, leaf_head,
                    feature_layers=layers,
                )
            truncate(cache, past)

        verify()  # warm-up
        verify_s[n] = _median_time(verify, repeats, device)
    return {"context_length": int(past), "verify_s": verify_s, "draft_s": draft_s}


def acceptance_profile(accepted_lengths: Sequence[Sequence[int]], levels: int) -> dict:
    """From per-generation `accepted_lengths` (bonus token included; the prefill round and each generation's last
    round, which a stop may cut short, are left out): survival[d - 1] = P(at least d draft tokens accepted) and the
    per-depth acceptance rates P(d accepted | d - 1 accepted), d = 1..levels."""
    accepted = [length - 1 for lengths in accepted_lengths for length in lengths[1:-1]]
    rounds = len(accepted)
    survival = [sum(a >= d for a in accepted) / rounds if rounds else 0.0 for d in range(1, levels + 1)]
    rates = [survival[0] if levels else 0.0] + [
        survival[d] / survival[d - 1] if survival[d - 1] else 0.0 for d in range(1, levels)
    ]
    return {"rounds": rounds, "survival": survival, "acceptance_rates": rates}


def tuning_prompts(prompts: Mapping[str, list[dict]]) -> list[dict]:
    """The first prompt of each suite (two when there is one suite): tuning sees every kind of text benchmarked."""
    suites = [records for records in prompts.values() if records]
    chosen = [records[0] for records in suites]
    return chosen if len(chosen) > 1 else suites[0][:2]


def format_acceptance(survival: Sequence[float]) -> str:
    """`[0.6, 0.3]` -> "d>=1 0.60, d>=2 0.30": the share of draft rounds that accept at least d draft tokens."""
    return ", ".join(f"d>={d} {share:.2f}" for d, share in enumerate(survival, start=1))


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
        lengths = [generate_once(target, x, "jakiro", draft, None, sampling,
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
            runs[name].append(generate_once(target, x, "jakiro", draft, None, sampling, settings))
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


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------------


def tune_lookup(target, draft, inputs, sampling, tree: dict, budgets=TUNE_LOOKUP_TOKENS, log=print) -> dict:
    """Run the chosen draft tree with each n-gram lookup budget on the tuning prompts (rotating which goes first)
    and pick the fastest. Lookup's value depends on the text (code that repeats its prompt, answers that quote a
    passage), which no cost model predicts, so it is measured. Returns {"chosen", "measured", "outputs_identical"}."""
    runs = {budget: [] for budget in budgets}
    for i, x in enumerate(inputs):
        order = list(budgets[i % len(budgets):]) + list(budgets[: i % len(budgets)])
        for budget in order:
            method = "jakiro_lookup" if budget else "jakiro"  # jakiro runs the draft tree alone
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


def machine_info(target, dtype, command: str | None) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = target.get_input_embeddings().weight.device
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "command": command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_benchmark(
    target,
    tokenizer,
    draft=None,
    *,
    assistant=None,
    suites: Sequence[str] = SUITES,
    prompts: Mapping[str, list[dict]] | None = None,
    data_dir: str | os.PathLike | None = None,
    num_prompts: int | None = None,
    spread_categories: bool = False,
    temperatures: Sequence[float] = (0.0,),
    methods: Sequence[str] | None = None,
    max_new_tokens: int = 128,
    tune_settings: bool = False,
    tune_kwargs: dict | None = None,
    tree_overrides: dict | None = None,
    out_dir: str | os.PathLike | None = None,
    command: str | None = None,
    labels: dict | None = None,
    seed: int = 0,
    log=print,
) -> dict:
    """Run every method on the same prompts and return the results dict (also written to `out_dir` if given).

    `prompts` maps suite -> records (`turns`, optional `id`/`category`); without it the suites are read from
    `data_dir` (`<suite>.jsonl`), `num_prompts` each (see `load_suite` for `spread_categories`). `methods` defaults
    to every method whose model is given. `tree_overrides` (total_tokens, depth, top_k, lookup_tokens) replace the
    draft's tree settings when nothing is tuned."""
    if methods is None:
        methods = [m for m in METHODS
                   if (m not in TREE_METHODS or draft is not None) and (m != "assisted" or assistant is not None)]
    methods = list(dict.fromkeys(["plain", *methods]))  # the baseline always runs, first in the rotation
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if draft is None and any(m in TREE_METHODS for m in methods):
        raise ValueError("methods jakiro/eagle2 need a draft (--draft DIR, or --draft random for an untrained head)")
    if assistant is None and "assisted" in methods:
        raise ValueError("method assisted needs --assistant: a smaller causal LM with the target's tokenizer")
    if prompts is None:
        prompts = {suite: load_suite(suite, num_prompts, data_dir, spread_categories) for suite in suites}
    elif num_prompts is not None:
        prompts = {suite: records[:num_prompts] for suite, records in prompts.items()}
    if not any(prompts.values()):
        raise ValueError("no prompts to benchmark")
    device = target.get_input_embeddings().weight.device
    if draft is not None:
        draft.bind_target(target)

    result = {
        "machine": machine_info(target, target.dtype, command),
        "config": {
            **(labels or {}),
            "suites": list(prompts),
            "num_prompts": {suite: len(records) for suite, records in prompts.items()},
            "prompt_ids": {suite: [r.get("id") for r in records] for suite, records in prompts.items()},
            "methods": methods,
            "temperatures": [float(t) for t in temperatures],
            "max_new_tokens": max_new_tokens,
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS if "prompt_lookup" in methods else None,
            "sampling": "temperature 0: greedy; > 0: do_sample with that temperature, top_k=0, top_p=1",
            "seed": seed,
        },
    }

    tree = {}
    if draft is not None:
        if tree_overrides and not tune_settings:
            tree = {key: value for key, value in tree_overrides.items() if value is not None}
        if tune_settings:
            kwargs = {"max_new_tokens": min(32, max_new_tokens), **(tune_kwargs or {})}
            result["tune"] = tune(target, tokenizer, draft, tuning_prompts(prompts), log=log, **kwargs)
            chosen = result["tune"]["chosen"]
            tree = {"total_tokens": chosen["total_tokens"], "depth": chosen["depth"]}
            if chosen["lookup_tokens"]:
                tree["lookup_tokens"] = chosen["lookup_tokens"]
            if (tree_overrides or {}).get("lookup_chains") is not None:
                tree["lookup_chains"] = tree_overrides["lookup_chains"]
        resolved = TreeSettings.resolve(draft, **tree)
        lookup = _lookup_budget(tree, draft)
        result["config"]["tree_settings"] = {"total_tokens": resolved.total_tokens, "depth": resolved.depth,
                                             "top_k": resolved.top_k, "contrastive_head": resolved.contrastive,
                                             "lookup_tokens (jakiro_lookup)": lookup,
                                             "lookup_chains (jakiro_lookup)": resolved.lookup_chains,
                                             "source": "tuned" if tune_settings else
                                             "command line" if tree else "draft config"}

    # Warm-up: one short generation per method.
    warm = encode(tokenizer, [{"role": "user", "content": next(r for v in prompts.values() for r in v)["turns"][0]}],
                  device)
    for method in methods:
        generate_once(target, warm, method, draft, assistant, _sampling_kwargs(0.0, tokenizer, 8), tree)

    rows, samples = [], []
    for temperature in temperatures:
        sampling = _sampling_kwargs(float(temperature), tokenizer, max_new_tokens)
        mine = []
        index = 0
        for suite, records in prompts.items():
            for record in records:
                turns = record["turns"] if suite == "mt_bench" else record["turns"][:1]
                messages = []
                for turn_number, turn in enumerate(turns, start=1):
                    messages.append({"role": "user", "content": turn})
                    inputs = encode(tokenizer, messages, device)
                    shift = index % len(methods)
                    order = methods[shift:] + methods[:shift]
                    index += 1
                    outputs = {}
                    for method in order:
                        torch.manual_seed(seed + index)
                        with PeakMemory(device) as memory:
                            outputs[method] = generate_once(target, inputs, method, draft, assistant, sampling, tree)
                        outputs[method]["peak_memory_mb"] = memory.peak_mb
                    baseline = outputs["plain"]["new_ids"]
                    for method in methods:
                        sample = outputs[method]
                        sample.update(suite=suite, id=record.get("id"), category=record.get("category"),
                                      turn=turn_number, method=method, temperature=float(temperature),
                                      matches_baseline=sample["new_ids"] == baseline)
                        mine.append(sample)
                    log(f"T={temperature:g} {suite} #{record.get('id')} turn {turn_number}: "
                        + ", ".join(f"{m} {outputs[m]['new_tokens'] / outputs[m]['time_s']:.1f} tok/s"
                                    for m in methods))
                    messages.append({"role": "assistant",
                                     "content": tokenizer.decode(baseline, skip_special_tokens=True)})
        rows.extend(summarize(mine, methods, float(temperature)))
        samples.extend(mine)
    for sample in samples:
        sample.pop("new_ids")
        sample.pop("accepted_lengths", None)
        sample["time_s"] = round(sample["time_s"], 5)
        sample["peak_memory_mb"] = round(sample["peak_memory_mb"], 1)
    result["results"] = rows
    result["samples"] = samples
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value, digits=2, suffix="") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(result: dict) -> str:
    machine, config = result["machine"], result["config"]
    lines = [
        "# Jakiro benchmark",
        "",
        f"- command: `{machine['command']}`",
        f"- machine: {machine['cpu']}, {machine['cpu_cores']} cores, torch threads {machine['torch_threads']}, "
        f"device {machine['device']}{', ' + machine['gpu'] if 'gpu' in machine else ''}",
        f"- torch {machine['torch']}, transformers {machine['transformers']}, dtype {machine['dtype']}",
        f"- target {config.get('target')}, draft {config.get('draft')}, assistant {config.get('assistant')}",
        f"- max_new_tokens {config['max_new_tokens']}, prompts per suite {config['num_prompts']}",
    ]
    if "prompt_ids" in config:
        lines.append(f"- prompt ids: {config['prompt_ids']}")
    if "tree_settings" in config:
        lines.append(f"- tree settings: {config['tree_settings']}")
    for temperature in config["temperatures"]:
        lines += ["", f"## Temperature {temperature:g}", "",
                  "| suite | method | tokens/s | speedup | tau | tau (papers) | efficiency | match rate | lookup share | "
                  "peak memory (MiB) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in result["results"]:
            if row["temperature"] != temperature:
                continue
            lines.append(
                f"| {row['suite']} | {row['method']} | {row['tokens_per_s']:.2f} | {_fmt(row['speedup'], 2, 'x')} | "
                f"{_fmt(row['tau'])} | {_fmt(row.get('papers_tau'))} | {_fmt(row['efficiency'])} | "
                f"{_fmt(row['match_rate'])} | {_fmt(row.get('lookup_share'))} | {row['peak_memory_mb']:.0f} |"
            )
        depth_rows = [r for r in result["results"] if r["temperature"] == temperature and r.get("acceptance_at_depth")]
        if depth_rows:
            lines += ["", "Share of draft-verify rounds accepting at least d draft tokens:", ""]
            lines += [f"- {r['suite']} / {r['method']}: {format_acceptance(r['acceptance_at_depth'])}"
                      + (f"; the draft vocabulary holds {r['vocab_coverage']:.1%} of the generated tokens"
                         if r.get("vocab_coverage") is not None else "")
                      for r in depth_rows]
    if "tune" in result:
        t = result["tune"]
        lines += ["", "## Tree tuning", "",
                  f"Context {t['context_length']} tokens. Verify forward seconds by tree size: "
                  + ", ".join(f"{n}: {s:.4f}" for n, s in t["verify_s"].items())
                  + ". Draft round seconds by depth: " + ", ".join(f"{d}: {s:.4f}" for d, s in t["draft_s"].items())
                  + ".", "",
                  f"Chosen total_tokens={t['chosen']['total_tokens']} depth={t['chosen']['depth']}: "
                  f"{t['chosen']['tokens_per_s']} tok/s (tau {t['chosen']['tau']}) vs defaults "
                  f"total_tokens={t['default']['total_tokens']} depth={t['default']['depth']}: "
                  f"{t['default']['tokens_per_s']} tok/s (tau {t['default']['tau']}); gain {t['gain_over_default']}x."]
        if "lookup" in t:
            lines += ["", "N-gram lookup budget (lookup_tokens) with the chosen tree: "
                      + ", ".join(f"{b}: {m['tokens_per_s']} tok/s (tau {m['tau']})" for b, m in t["lookup"].items())
                      + f"; chose {t['chosen']['lookup_tokens']}."]
    return "\n".join(lines) + "\n"


def plot_speedups(result: dict, path: str | os.PathLike) -> bool:
    """Grouped bars: speedup over plain per method per suite, one panel per temperature. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    temperatures = result["config"]["temperatures"]
    methods = [m for m in result["config"]["methods"] if m != "plain"]
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 + 2 * len(methods), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [r for r in result["results"] if r["temperature"] == temperature]
        suites = list(dict.fromkeys(r["suite"] for r in rows))
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            values = [next((r["speedup"] or 0.0 for r in rows if r["suite"] == s and r["method"] == method), 0.0)
                      for s in suites]
            ax.bar([x + i * width for x in range(len(suites))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(suites))], suites)
        ax.set_ylabel("speedup over plain generate")
        ax.set_title(f"temperature {temperature:g}")
        ax.legend(fontsize="small")
    fig.suptitle(f"{result['config'].get('target')} ({result['machine']['dtype']}, {result['machine']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str | os.PathLike) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "speedup.png"}
    if not plot_speedups(result, paths["plot"]):
        paths["plot"] = None
        print("bench: matplotlib is not installed, no plot (pip install 'transformers-jakiro[bench]')", file=sys.stderr)
    result["files"] = {k: str(v) if v else None for k, v in paths.items()}
    paths["markdown"].write_text(markdown_table(result))
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    return result["files"]


def head_metrics(result: dict, default_tree: tuple | None = None) -> dict:
    """The benchmark's headline numbers for a head's model card: one entry per (suite, temperature) of the jakiro
    rows, keyed so that a later run in the same dtype on the same suite and tree replaces the entry. The tree is part
    of the key when it differs from `default_tree` (the head's (total_tokens, depth, top_k)), so that a run at
    another tree adds entries instead of replacing those at the head's own tree."""
    machine = result["machine"]
    # The processor is part of the key: the same suite measured on another machine is another entry.
    where = f"{machine['dtype']}, {machine['device']}" + (
        f" {machine['gpu']}" if "gpu" in machine else f" {machine['cpu']}" if machine.get("cpu") else ""
    )
    entries = {}
    suites = result["config"].get("suites") or sorted({r["suite"] for r in result["results"]} - {"overall"})
    settings = result["config"].get("tree_settings", {})
    tree = tuple(settings.get(name) for name in ("total_tokens", "depth", "top_k"))
    tree_text = "/".join(map(str, tree))
    tree_key = "" if default_tree is None or tree == tuple(default_tree) else f", tree {tree_text}"
    for row in result["results"]:
        if row["method"] not in ("jakiro", "jakiro_lookup") or (row["suite"] == "overall" and len(suites) < 2):
            continue
        suite = "+".join(suites) if row["suite"] == "overall" else row["suite"]
        if row["method"] == "jakiro_lookup":
            chains = settings.get("lookup_chains (jakiro_lookup)", 1)
            suite += f" with n-gram lookup ({settings.get('lookup_tokens (jakiro_lookup)')} tokens"
            suite += f" x {chains} chains)" if chains > 1 else ")"
        text = (f"{row['tokens_per_s']:.2f} tok/s, {_fmt(row['speedup'], 2, 'x')} over plain generate, "
                f"tau {_fmt(row['tau'])}")
        if row.get("papers_tau") is not None:
            text += f" (papers' tau {_fmt(row['papers_tau'])})"
        if row["match_rate"] is not None:
            text += f", outputs identical to plain on {row['match_rate']:.0%} of generations"
        if row.get("acceptance_at_depth"):
            text += f", rounds accepting >= d tokens: {format_acceptance(row['acceptance_at_depth'][:6])}"
        if row.get("vocab_coverage") is not None and row["vocab_coverage"] < 1:
            text += f", draft vocabulary holds {row['vocab_coverage']:.1%} of the generated tokens"
        text += (f" ({row['generations']} generations, max_new_tokens={result['config']['max_new_tokens']}, "
                 f"tree {tree_text})")
        entries[f"jakiro bench: {suite}, temperature {row['temperature']:g}{tree_key} ({where})"] = text
    return entries


def update_head(draft_dir: str | os.PathLike, result: dict) -> dict:
    """Record a benchmark in a saved head: tuned tree settings (if the run tuned) become the defaults in config.json,
    and the headline numbers join `jakiro_training.json` and the model card (README.md). Returns the card metrics."""
    from .configuration_jakiro import JakiroConfig
    from .hub import build_model_card
    from .modeling_jakiro import JakiroDraftModel

    draft_dir = Path(draft_dir)
    config = JakiroConfig.from_pretrained(draft_dir)
    if "tune" in result:
        config.total_tokens = result["tune"]["chosen"]["total_tokens"]
        config.depth = result["tune"]["chosen"]["depth"]
        config.lookup_tokens = result["tune"]["chosen"].get("lookup_tokens", 0)
        config.save_pretrained(draft_dir)
    report_path = draft_dir / "jakiro_training.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"summary": {}, "metrics": {}}
    default_tree = (config.total_tokens, config.depth, config.top_k)
    report.setdefault("benchmarks", {}).update(head_metrics(result, default_tree))
    if "tune" in result:
        report["tree_settings_tuned_by"] = result["machine"]["command"]
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    metrics = {**report.get("metrics", {}), **report["benchmarks"]}
    draft = JakiroDraftModel.from_pretrained(str(draft_dir))
    build_model_card(draft, training_summary=report.get("summary"), metrics=metrics).save(str(draft_dir / "README.md"))
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def load_draft(spec: str, target):
    """`random`: a fresh untrained head for `target`; otherwise a saved head directory (safetensors)."""
    from .modeling_jakiro import JakiroDraftModel

    if spec == "random":
        torch.manual_seed(0)
        draft = JakiroDraftModel.from_target(target)
    else:
        if not Path(spec).is_dir():
            raise FileNotFoundError(f"draft directory not found: {spec} (or pass --draft random for an untrained head)")
        weight = target.get_output_embeddings().weight
        draft = JakiroDraftModel.from_pretrained(spec).to(device=weight.device, dtype=weight.dtype)
    return draft.bind_target(target).eval()


def _tree_option(tree: str | None, lookup_tokens: int | None, lookup_chains: int | None = None) -> dict:
    """`--tree 8/2/6` (total_tokens/depth/top_k), `--lookup-tokens N` and `--lookup-chains C` as tree setting
    overrides."""
    overrides = {"lookup_tokens": lookup_tokens, "lookup_chains": lookup_chains}
    if tree:
        parts = tree.split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"bench: --tree takes TOTAL_TOKENS/DEPTH/TOP_K, e.g. 8/2/6; got {tree!r}")
        overrides.update(zip(("total_tokens", "depth", "top_k"), map(int, parts)))
    return overrides


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="registry name, .gguf file, local model dir or Hub id")
    parser.add_argument("--draft", default=None, help="Jakiro head directory, or 'random' (untrained head)")
    parser.add_argument("--assistant", default=None, help="smaller same-tokenizer LM for the 'assisted' method")
    parser.add_argument("--suite", default=",".join(SUITES), help="comma-separated: mt_bench,humaneval,alpaca")
    parser.add_argument("--data-dir", default=None, help=f"directory of <suite>.jsonl (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each suite (default all)")
    parser.add_argument("--spread-categories", action="store_true",
                        help="with --num-prompts: take prompts round-robin over each suite's categories")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} "
                        "(default: all whose models are given)")
    parser.add_argument("--tune", action="store_true", help="tune total_tokens/depth for this machine first")
    parser.add_argument("--tree", default=None, metavar="TOTAL/DEPTH/TOPK",
                        help="tree settings for this run instead of the head's (ignored with --tune), e.g. 8/2/6")
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="n-gram lookup chain budget of the jakiro_lookup method (default: tuned, the head's, or "
                             f"{LOOKUP_TOKENS})")
    parser.add_argument("--lookup-chains", type=int, default=None,
                        help="distinct n-gram lookup chains per round for jakiro_lookup (default: the head's)")
    parser.add_argument("--out", default=None, help="directory for results.json, results.md, speedup.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update-head", action="store_true", help="write the results into the --draft directory: "
                        "tuned tree settings into config.json (with --tune), headline numbers into the model card")


def run(args) -> int:
    from .distill import load_target_or_explain

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, tokenizer = load_target_or_explain(args.target, args.dtype)
    target.to(device)
    methods = _csv(args.methods) if args.methods else None
    draft = load_draft(args.draft, target) if args.draft else None
    assistant = None
    if args.assistant and (methods is None or "assisted" in methods):
        assistant, _ = load_target_or_explain(args.assistant, args.dtype)
        assistant.to(device)
    labels = {"target": args.target, "draft": args.draft + (" (UNTRAINED)" if args.draft == "random" else "")
              if args.draft else None, "assistant": args.assistant}
    result = run_benchmark(
        target, tokenizer, draft, assistant=assistant, suites=_csv(args.suite), data_dir=args.data_dir,
        num_prompts=args.num_prompts, spread_categories=args.spread_categories,
        temperatures=[float(t) for t in _csv(args.temperature)], methods=methods,
        max_new_tokens=args.max_new_tokens, tune_settings=args.tune, out_dir=args.out, labels=labels, seed=args.seed,
        tree_overrides=_tree_option(args.tree, args.lookup_tokens, args.lookup_chains),
    )
    print()
    print(markdown_table(result))
    if args.update_head:
        if not args.draft or not Path(args.draft).is_dir():
            raise SystemExit("bench: --update-head needs --draft DIR, a saved head")
        update_head(args.draft, result)
        print(f"bench: updated {args.draft} (config.json tree settings, README.md model card)")
    if args.out:
        print(f"bench: wrote {', '.join(v for v in result['files'].values() if v)}")
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark Jakiro against plain and stock speculative decoding")
    add_arguments(parser)
    parser.set_defaults(func=run)


__all__ = [
    "METHODS",
    "acceptance_profile",
    "choose_tree_settings",
    "expected_tokens_per_round",
    "head_metrics",
    "load_suite",
    "markdown_table",
    "measure_costs",
    "run_benchmark",
    "tune",
    "update_head",
    "write_outputs",
]
