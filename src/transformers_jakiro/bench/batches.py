"""`jakiro bench --batch-sizes 1,2,4,8`: throughput of batched decoding, plain batched `generate` against Jakiro and
the hybrid tree (Jakiro with n-gram lookup) at each batch size, on the same prompts in one run.

The prompts (first turns of the suites) are cut into left-padded batches of B; every batch runs every method,
in a rotating order. Throughput is every row's generated tokens (up to and including its EOS; the padding of rows
that finished early is not counted) per second of wall clock for the whole batch. Greedy outputs are compared
with plain batched generate's row by row (`match_rate`: the share of rows identical to it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..decoding.round_controller import batch_tree
from ..decoding.drafter import TreeSettings
from ..generation import tree_settings
from .measure import LOOKUP_TOKENS, _sampling_kwargs
from .run import machine_info
from .suites import load_suite

BATCH_METHODS = ("plain", "jakiro", "jakiro_lookup")


def batch_inputs(tokenizer, texts: Sequence[str], device) -> dict:
    """Chat-templated, left-padded input_ids and attention_mask for a batch of user messages."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        chats = [[{"role": "user", "content": text}] for text in texts]
        inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True, padding=True)
    finally:
        tokenizer.padding_side = side
    return {key: inputs[key].to(device) for key in ("input_ids", "attention_mask")}


def row_lengths(new_ids: torch.LongTensor, eos_ids: set[int]) -> list[int]:
    """Generated tokens per row: up to and including the first EOS (what follows is the padding of a finished row)."""
    lengths = []
    for row in new_ids.tolist():
        stop = next((i for i, token in enumerate(row) if token in eos_ids), None)
        lengths.append(len(row) if stop is None else stop + 1)
    return lengths


def _eos_ids(target, tokenizer) -> set[int]:
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return set(eos) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def run_batch_benchmark(
    target,
    tokenizer,
    draft,
    *,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    suites: Sequence[str] = ("mt_bench", "humaneval", "alpaca"),
    num_prompts: int | None = None,
    data_dir=None,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    lookup_tokens: int | None = None,
    methods: Sequence[str] = BATCH_METHODS,
    seed: int = 0,
    labels: dict | None = None,
    cache_implementation: str | None = None,
    log=print,
) -> dict:
    """Every method at every batch size on the same prompts; returns the results dict (`results`: one row per batch
    size and method with tokens/s, the speedup over plain at that batch size, tau per row and the round mix).
    `cache_implementation` ("static"): every method's generate gets it (plain generate compiles its steps over a
    static cache on an accelerator; Jakiro its verify forward)."""
    device = target.get_input_embeddings().weight.device
    draft.bind_target(target)
    texts = [record["turns"][0] for suite in suites for record in load_suite(suite, num_prompts, data_dir)]
    if not texts:
        raise ValueError("no prompts to benchmark")
    methods = list(dict.fromkeys(["plain", *methods]))
    settings = TreeSettings.resolve(draft)
    lookup = lookup_tokens or draft.config.lookup_tokens or LOOKUP_TOKENS
    eos_ids = _eos_ids(target, tokenizer)
    sampling = _sampling_kwargs(temperature, tokenizer, max_new_tokens)
    if cache_implementation is not None:
        sampling["cache_implementation"] = cache_implementation
    overrides = {"plain": None, "jakiro": {"lookup_tokens": 0}, "jakiro_lookup": {"lookup_tokens": lookup}}

    def generate(method, inputs):
        start = time.perf_counter()
        if method == "plain":
            out = target.generate(**inputs, **sampling)
        else:
            with tree_settings(draft, **overrides[method]):
                out = target.generate(**inputs, assistant_model=draft, **sampling)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out[:, inputs["input_ids"].shape[1] :], time.perf_counter() - start

    generate("plain", batch_inputs(tokenizer, texts[:1], device))  # warm-up
    for method in methods[1:]:
        generate(method, batch_inputs(tokenizer, texts[:2], device))
    rows, turn = [], 0
    for size in batch_sizes:
        totals = {m: {"tokens": 0, "seconds": 0.0, "rows": 0, "matches": 0, "rounds": 0, "row_rounds": 0, "mix": {}}
                  for m in methods}
        for start in range(0, len(texts) - size + 1, size):  # whole batches only: every B sees full batches
            inputs = batch_inputs(tokenizer, texts[start : start + size], device)
            order = methods[turn % len(methods):] + methods[: turn % len(methods)]
            turn += 1
            outputs = {}
            for method in order:
                torch.manual_seed(seed + start)
                outputs[method] = generate(method, inputs)
                total = totals[method]
                new_ids, seconds = outputs[method]
                total["tokens"] += sum(row_lengths(new_ids, eos_ids))
                total["seconds"] += seconds
                total["rows"] += size
                if method != "plain":
                    stats = draft.last_generation_stats
                    per_row = stats.rows or [stats]
                    total["row_rounds"] += sum(row.rounds for row in per_row)
                    for name, count in stats.choice_counts.items():
                        total["mix"][name] = total["mix"].get(name, 0) + count
            plain_ids = outputs["plain"][0]
            lengths = row_lengths(plain_ids, eos_ids)
            for method in methods:
                ids = outputs[method][0]
                totals[method]["matches"] += sum(
                    ids.shape[1] >= n and torch.equal(ids[r, :n], plain_ids[r, :n]) for r, n in enumerate(lengths)
                )
            log(f"B={size} batch {start // size + 1}: " + ", ".join(
                f"{m} {totals[m]['tokens'] / max(totals[m]['seconds'], 1e-9):.1f} tok/s" for m in methods))
        base = totals["plain"]["tokens"] / totals["plain"]["seconds"] if totals["plain"]["seconds"] else None
        for method in methods:
            total = totals[method]
            if not total["rows"]:
                continue
            speed = total["tokens"] / total["seconds"]
            mix = total["mix"]
            rows.append(dict(
                batch_size=size, method=method, rows=total["rows"], new_tokens=total["tokens"],
                time_s=round(total["seconds"], 3), tokens_per_s=round(speed, 3),
                speedup=round(speed / base, 4) if base else None,
                tau_per_row=round(total["tokens"] / total["row_rounds"], 4) if total["row_rounds"] else None,
                match_rate=round(total["matches"] / total["rows"], 4) if temperature == 0 else None,
                tree_per_row="/".join(map(str, batch_tree(settings.total_tokens, settings.depth, settings.top_k, size)))
                if method != "plain" else None,
                choice_mix={k: round(v / sum(mix.values()), 4) for k, v in sorted(mix.items())} if mix else None,
            ))
    return {
        "machine": machine_info(target, target.dtype, None),
        "config": {**(labels or {}), "suites": list(suites), "prompts": len(texts), "batch_sizes": list(batch_sizes),
                   "methods": methods, "temperature": temperature, "max_new_tokens": max_new_tokens,
                   "lookup_tokens (jakiro_lookup)": lookup,
                   "tree (batch of one)": f"{settings.total_tokens}/{settings.depth}/{settings.top_k}"},
        "results": rows,
    }


def batch_table(result: dict) -> str:
    lines = ["| B | method | tree per row | tokens/s | vs plain batched | tau per row | identical rows | round mix |",
             "|---:|---|---|---:|---:|---:|---:|---|"]
    for row in result["results"]:
        mix = ", ".join(f"{k} {v:.0%}" for k, v in (row["choice_mix"] or {}).items())
        match = "" if row["match_rate"] is None else f"{row['match_rate']:.0%}"
        tau = "" if row["tau_per_row"] is None else f"{row['tau_per_row']:.2f}"
        lines.append(
            f"| {row['batch_size']} | {row['method']} | {row['tree_per_row'] or ''} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {tau} | {match} | {mix} |"
        )
    return "\n".join(lines) + "\n"


def plot_batches(result: dict, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in result["config"]["methods"]:
        points = [(r["batch_size"], r["tokens_per_s"]) for r in result["results"] if r["method"] == method]
        ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens per second (all rows)")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title(f"{result['config'].get('target')} ({result['machine']['dtype']}, {result['machine']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_batch_outputs(result: dict, out_dir) -> dict:
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "throughput.png"}
    if not plot_batches(result, files["plot"]):
        files["plot"] = None
    result["files"] = {k: str(v) if v else None for k, v in files.items()}
    machine = result["machine"]
    header = (f"Command: `{machine['command']}`\n\n{machine['cpu']}, {machine['torch_threads']} torch threads, "
              f"{machine['dtype']}, torch {machine['torch']}, transformers {machine['transformers']}; "
              f"temperature {result['config']['temperature']:g}, {result['config']['prompts']} prompts, "
              f"{result['config']['max_new_tokens']} new tokens\n\n")
    files["markdown"].write_text(header + batch_table(result))
    files["json"].write_text(json.dumps(result, indent=2) + "\n")
    return result["files"]


__all__ = ["BATCH_METHODS", "batch_inputs", "batch_table", "row_lengths", "run_batch_benchmark", "write_batch_outputs"]
