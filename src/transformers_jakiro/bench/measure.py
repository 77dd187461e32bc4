"""Measuring one generation: a timed `generate` per method (`generate_once`), peak memory around it (`PeakMemory`),
and the per-suite, per-method rows summed from those measurements (`summarize`)."""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Sequence

import torch

from ..generation import tree_settings
from ..stats import acceptance_profile

METHODS = ("plain", "jakiro", "jakiro_lookup", "jakiro_fixed", "jakiro_lookup_fixed", "eagle2", "assisted",
           "prompt_lookup")
# jakiro and eagle2 run the draft tree alone (n-gram lookup off); jakiro_lookup adds lookup chains (hybrid tree).
# jakiro and jakiro_lookup let the round controller choose every round (decoding/round_controller.py, the default); the _fixed
# variants and eagle2 (an ablation of the tree itself) verify the configured tree every round.
TREE_METHODS = ("jakiro", "jakiro_lookup", "jakiro_fixed", "jakiro_lookup_fixed", "eagle2")
ADAPTIVE_METHODS = ("jakiro", "jakiro_lookup")
PROMPT_LOOKUP_NUM_TOKENS = 10
LOOKUP_TOKENS = 10  # jakiro_lookup's chain budget when neither --tune nor the head chose one


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
    if method in ("jakiro", "jakiro_fixed", "eagle2"):
        overrides["lookup_tokens"] = 0
    elif method in ("jakiro_lookup", "jakiro_lookup_fixed"):
        overrides["lookup_tokens"] = _lookup_budget(overrides, draft)
    overrides.setdefault("adaptive", method in ADAPTIVE_METHODS)
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
                      lookup_accepted=stats.lookup_accepted, choice_counts=dict(stats.choice_counts),
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
            mix = {}
            for s in mine:
                for name, count in s.get("choice_counts", {}).items():
                    mix[name] = mix.get(name, 0) + count
            per_method[method] = dict(
                # what the rounds verified: a share per choice (plain, lookup, tree T/D/K), prefill rounds left out
                choice_mix={name: round(count / sum(mix.values()), 4) for name, count in sorted(mix.items())}
                if mix else None,
                temperature=temperature,
                suite=suite,
                method=method,
                generations=len(mine),
                new_tokens=tokens,
                time_s=round(seconds, 4),
                tokens_per_s=tokens / seconds if seconds else 0.0,
                tau=tokens / rounds if method in TREE_METHODS and rounds else None,
                lookup_share=lookup / tokens if method in ("jakiro_lookup", "jakiro_lookup_fixed") and tokens else None,
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


__all__ = ["ADAPTIVE_METHODS", "LOOKUP_TOKENS", "METHODS", "PROMPT_LOOKUP_NUM_TOKENS", "TREE_METHODS", "PeakMemory", "generate_once",
           "summarize"]
