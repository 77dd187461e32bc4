"""What a benchmark writes: `results.md` (`markdown_table`), `speedup.png` (`plot_speedups`), `results.json`
(`write_outputs`), and the headline numbers a saved head's model card records (`head_metrics`, `update_head`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..stats import format_acceptance


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
        f"- max_new_tokens {config['max_new_tokens']}, prompts per suite {config['num_prompts']}"
        + (f", each generation timed {config['repeats']} times (median)" if config.get("repeats", 1) > 1 else ""),
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
        mix_rows = [r for r in result["results"] if r["temperature"] == temperature and r.get("choice_mix")
                    and r["method"] in ("jakiro", "jakiro_lookup")]
        if mix_rows:
            lines += ["", "What the round controller verified (share of rounds):", ""]
            lines += [f"- {r['suite']} / {r['method']}: "
                      + ", ".join(f"{name} {share:.0%}" for name, share in r["choice_mix"].items())
                      for r in mix_rows]
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
    from ..configuration_jakiro import JakiroConfig
    from ..hub import build_model_card
    from ..modeling_jakiro import JakiroDraftModel

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


__all__ = ["head_metrics", "markdown_table", "plot_speedups", "update_head", "write_outputs"]
