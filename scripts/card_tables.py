"""Rebuild the benchmark tables of a shipped head's model card from the benchmark runs behind them.

    python scripts/card_tables.py heads/jakiro-smollm2-135m-instruct \
        benchmarks/results/smollm2-135m-cpu-fp32-lookup-unroll2-new-answers-lr2e-4 ...

For each results folder (a `jakiro bench --out` directory) the head's `jakiro_training.json` gets one table under
`metrics`: one row per suite (and overall), one column per method (speedup over plain `generate`, with tau for the
tree methods), and a per-depth acceptance table over all of them. The card (README.md) is then rendered again from
the template, so the committed card always matches `jakiro_training.json`.
"""

import json
import sys
from pathlib import Path

METHOD_LABELS = {
    "jakiro": "Jakiro",
    "jakiro_lookup": "Jakiro + n-gram lookup",
    "eagle2": "EAGLE-2 ablation",
    "assisted": "assisted (0.5B draft)",
    "prompt_lookup": "prompt lookup",
}


def _run_label(result: dict) -> str:
    tree = result["config"]["tree_settings"]
    machine = result["machine"]
    return (f"tree {tree['total_tokens']}/{tree['depth']}/{tree['top_k']}, {machine['dtype']}, {machine['cpu']} "
            f"({machine['torch_threads']} thread{'s' if machine['torch_threads'] > 1 else ''})")


def suite_table(folder: Path) -> tuple[dict, list[tuple[str, list]]]:
    """The suite x method table of one run, and its per-depth acceptance rows (label, shares)."""
    result = json.loads((folder / "results.json").read_text())
    rows = [r for r in result["results"] if r["temperature"] == 0]
    methods = [m for m in result["config"]["methods"] if m != "plain"]
    suites = [*result["config"]["suites"], "overall"]
    by_key = {(r["suite"], r["method"]): r for r in rows}
    columns = ["suite (prompts)", "plain tok/s", *(METHOD_LABELS.get(m, m) for m in methods)]
    table_rows, depth_rows = [], []
    for suite in suites:
        prompts = sum(result["config"]["num_prompts"].values()) if suite == "overall" else \
            result["config"]["num_prompts"][suite]
        row = [f"{suite} ({prompts})", f"{by_key[(suite, 'plain')]['tokens_per_s']:.2f}"]
        for method in methods:
            r = by_key[(suite, method)]
            cell = f"{r['speedup']:.2f}x"
            if r.get("tau") is not None:
                cell += f", tau {r['tau']:.2f}"
            row.append(cell)
        table_rows.append(row)
    tree = result["config"]["tree_settings"]
    for method in methods:
        r = by_key[("overall", method)]
        if r.get("acceptance_at_depth"):
            label = f"{METHOD_LABELS.get(method, method)}, tree {tree['total_tokens']}/{tree['depth']}/{tree['top_k']}"
            depth_rows.append((label, r["acceptance_at_depth"][:6]))
    match = sorted({r["match_rate"] for r in rows if r["method"] != "plain" and r["match_rate"] is not None})
    identical = f"{match[0]:.0%}" if len(match) == 1 else f"{match[0]:.0%}-{match[-1]:.0%}"
    note = (f"Greedy, {result['config']['max_new_tokens']} new tokens; speedup over plain `generate` in the same "
            f"run; outputs identical to plain decoding in {identical} of generations. "
            f"Run: [benchmarks/results/{folder.name}](../../benchmarks/results/{folder.name}/results.md).")
    return {"title": f"jakiro bench, {_run_label(result)}", "columns": columns, "rows": table_rows,
            "note": note}, depth_rows


def depth_table(rows: list[tuple[str, list]]) -> dict:
    depth = max(len(shares) for _, shares in rows)
    return {
        "title": "Acceptance per depth (share of rounds accepting at least d draft tokens, bench overall)",
        "columns": ["setting", *(f"d>={d}" for d in range(1, depth + 1))],
        "rows": [[label, *(f"{s:.2f}" for s in shares), *([""] * (depth - len(shares)))] for label, shares in rows],
    }


def main(head: str, *folders: str) -> None:
    from transformers_jakiro import JakiroDraftModel
    from transformers_jakiro.hub import build_model_card

    head_dir = Path(head)
    report_path = head_dir / "jakiro_training.json"
    report = json.loads(report_path.read_text())
    metrics = {key: value for key, value in report.get("metrics", {}).items() if not isinstance(value, dict)}
    depth_rows = []
    for folder in folders:
        table, rows = suite_table(Path(folder))
        metrics[f"bench {Path(folder).name}"] = table
        depth_rows += rows
    if depth_rows:
        metrics["acceptance per depth (bench)"] = depth_table(depth_rows)
    report["metrics"] = metrics
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    draft = JakiroDraftModel.from_pretrained(str(head_dir))
    card_metrics = {**metrics, **report.get("benchmarks", {})}
    build_model_card(draft, training_summary=report.get("summary"), metrics=card_metrics).save(
        str(head_dir / "README.md"))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
