"""The benchmark: every method on the same prompts, in one process (`run_benchmark`), with the machine it ran on."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..decoding.drafter import TreeSettings
from .measure import (
    METHODS,
    PROMPT_LOOKUP_NUM_TOKENS,
    TREE_METHODS,
    PeakMemory,
    _lookup_budget,
    _sampling_kwargs,
    generate_once,
    summarize,
)
from .report import write_outputs
from .suites import SUITES, encode, load_suite
from .tune import tune, tuning_prompts


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
    repeats: int = 1,
    log=print,
) -> dict:
    """Run every method on the same prompts and return the results dict (also written to `out_dir` if given).

    `prompts` maps suite -> records (`turns`, optional `id`/`category`); without it the suites are read from
    `data_dir` (`<suite>.jsonl`), `num_prompts` each (see `load_suite` for `spread_categories`). `methods` defaults
    to every method whose model is given. `tree_overrides` (total_tokens, depth, top_k, lookup_tokens) replace the
    draft's tree settings when nothing is tuned. `repeats`: every (prompt, method) generation runs that many times,
    each repeat with the methods in a further rotated order and the same seed, and the run with the median time
    stands for it (its tokens and stats; every repeat's time is kept in `repeat_times_s`). A single generation of a
    few seconds varies by several percent on a shared CPU; the median of three holds ratios near 1 apart."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
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
            "repeats": repeats,
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
                    runs = {method: [] for method in methods}
                    for repeat in range(repeats):
                        for method in order[repeat % len(order):] + order[: repeat % len(order)]:
                            torch.manual_seed(seed + index)
                            with PeakMemory(device) as memory:
                                run = generate_once(target, inputs, method, draft, assistant, sampling, tree)
                            run["peak_memory_mb"] = memory.peak_mb
                            runs[method].append(run)
                    outputs = {method: _median_run(method_runs) for method, method_runs in runs.items()}
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


def _median_run(runs: list[dict]) -> dict:
    """The run whose time is the median of the repeats (the lower middle one for an even count), with every
    repeat's time and the largest peak memory."""
    chosen = dict(sorted(runs, key=lambda run: run["time_s"])[(len(runs) - 1) // 2])
    if len(runs) > 1:
        chosen["repeat_times_s"] = [round(run["time_s"], 5) for run in runs]
        chosen["peak_memory_mb"] = max(run["peak_memory_mb"] for run in runs)
    return chosen


__all__ = ["machine_info", "run_benchmark"]
