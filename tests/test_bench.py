"""The benchmark tool on a tiny random target: every method runs, the files have the expected fields, the baseline's
speedup is 1 and Jakiro matches it at temperature 0; the tree tuner's pure selection agrees with brute force."""

import importlib.util
import itertools
import json
import random

import pytest
import torch

from chat_tokenizer import make_tokenizer
from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import bench

PROMPTS = {
    "mt_bench": [{"id": "1", "category": "writing", "turns": ["Say hi.", "Again."]}],
    "humaneval": [{"id": "2", "category": "code", "turns": ["def f(x):"]}],
}


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = make_target("llama")
    draft = quick_trained_draft(target, steps=60, total_tokens=12, depth=3, top_k=4)
    assistant = make_target("llama", seed=1, num_hidden_layers=1)
    return target, make_tokenizer(), draft, assistant


def test_every_method_and_outputs(models, tmp_path):
    target, tokenizer, draft, assistant = models
    result = bench.run_benchmark(
        target, tokenizer, draft, assistant=assistant, prompts=PROMPTS, temperatures=(0.0, 1.0),
        max_new_tokens=12, out_dir=tmp_path, command="jakiro bench --test", labels={"target": "tiny"},
        log=lambda _: None,
    )
    assert result["config"]["methods"] == list(bench.METHODS)
    for key in ("cpu", "cpu_cores", "torch", "transformers", "dtype", "command"):
        assert result["machine"][key]
    assert result["machine"]["command"] == "jakiro bench --test"
    rows = {(r["temperature"], r["suite"], r["method"]): r for r in result["results"]}
    assert len(rows) == 2 * 3 * len(bench.METHODS)  # 2 temperatures x (2 suites + overall) x methods
    for (temperature, suite, method), row in rows.items():
        assert row["generations"] == (3 if suite == "overall" else 2 if suite == "mt_bench" else 1)
        assert row["tokens_per_s"] > 0 and row["peak_memory_mb"] > 0
        if method == "plain":
            assert row["speedup"] == 1.0
        if method in bench.TREE_METHODS:
            assert row["tau"] >= 1.0
            # both sides are rounded to 4 decimals: a small speedup needs an absolute tolerance too
            assert row["efficiency"] == pytest.approx(row["speedup"] / row["tau"], rel=1e-3, abs=2e-4)
            assert row["papers_tau"] is None or row["papers_tau"] >= row["tau"]  # None: every generation 1 token
        else:
            assert row["tau"] is None and row["efficiency"] is None and row["papers_tau"] is None
        if temperature == 0:
            assert row["match_rate"] is not None
        else:
            assert row["match_rate"] is None
    for suite in ("mt_bench", "humaneval", "overall"):
        assert rows[(0.0, suite, "jakiro")]["match_rate"] == 1.0
        assert rows[(0.0, suite, "eagle2")]["match_rate"] == 1.0  # fp32, greedy: lossless
        assert rows[(0.0, suite, "jakiro_lookup")]["match_rate"] == 1.0
        assert 0.0 <= rows[(0.0, suite, "jakiro_lookup")]["lookup_share"] <= 1.0
        assert rows[(0.0, suite, "jakiro")]["lookup_share"] is None
        assert rows[(0.0, suite, "plain")]["match_rate"] == 1.0
    # MT-bench runs its second turn; the method order rotates per prompt
    assert {s["turn"] for s in result["samples"] if s["suite"] == "mt_bench"} == {1, 2}

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"] == result["results"] and saved["machine"]["command"] == "jakiro bench --test"
    markdown = (tmp_path / "results.md").read_text()
    assert (
        "| suite | method | tokens/s | speedup | tau | tau (papers) | efficiency | match rate | lookup share | "
        "peak memory (MiB) |" in markdown
    )
    assert result["config"]["tree_settings"]["lookup_tokens (jakiro_lookup)"] == bench.LOOKUP_TOKENS
    assert "| overall | prompt_lookup |" in markdown and "n/a" in markdown
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors(models):
    target, tokenizer, draft, _ = models
    with pytest.raises(ValueError, match="--assistant"):
        bench.run_benchmark(target, tokenizer, draft, prompts=PROMPTS, methods=["assisted"], log=lambda _: None)
    with pytest.raises(ValueError, match="unknown method"):
        bench.run_benchmark(target, tokenizer, draft, prompts=PROMPTS, methods=["nope"], log=lambda _: None)


def test_repeats_keep_the_run_with_the_median_time(models):
    target, tokenizer, draft, _ = models
    result = bench.run_benchmark(target, tokenizer, draft, prompts={"humaneval": PROMPTS["humaneval"]},
                                 methods=["jakiro"], max_new_tokens=6, repeats=3, log=lambda _: None)
    assert result["config"]["repeats"] == 3
    assert {s["method"] for s in result["samples"]} == {"plain", "jakiro"}
    for sample in result["samples"]:
        assert len(sample["repeat_times_s"]) == 3 and sample["time_s"] == sorted(sample["repeat_times_s"])[1]
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        bench.run_benchmark(target, tokenizer, draft, prompts=PROMPTS, repeats=0, log=lambda _: None)


def test_median_run_is_the_lower_middle_one():
    from transformers_jakiro.bench.run import _median_run

    runs = [{"time_s": t, "peak_memory_mb": m, "tag": t} for t, m in ((3.0, 5), (1.0, 9), (2.0, 7), (4.0, 1))]
    chosen = _median_run(runs)
    assert chosen["tag"] == 2.0 and chosen["peak_memory_mb"] == 9 and chosen["repeat_times_s"] == [3.0, 1.0, 2.0, 4.0]
    assert _median_run(runs[:3])["tag"] == 2.0
    assert "repeat_times_s" not in _median_run(runs[:1])


def test_load_suite_first_or_spread_over_categories(tmp_path):
    categories = ["writing", "writing", "math", "math", "code", "writing"]
    lines = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate(categories)]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    ids = lambda records: [r["id"] for r in records]  # noqa: E731
    assert ids(bench.load_suite("s", 3, tmp_path)) == ["0", "1", "2"]
    assert ids(bench.load_suite("s", 4, tmp_path, spread_categories=True)) == ["0", "2", "4", "1"]
    assert ids(bench.load_suite("s", None, tmp_path, spread_categories=True)) == ["0", "2", "4", "1", "3", "5"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"turns": "not a list"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: expected a non-empty list"):
        bench.load_suite("bad", 1, tmp_path)


def _brute_force(verify_s, draft_s, survival, contrastive):
    best = None
    for n, d in itertools.product(sorted(verify_s), sorted(draft_s)):
        levels = d + 1 if contrastive else d
        value = (1 + sum(survival[n][:levels])) / (verify_s[n] + draft_s[d])
        if best is None or value > best[0] + 1e-12:
            best = (value, n, d)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_choose_tree_settings_matches_brute_force(seed):
    rng = random.Random(seed)
    sizes, depths = [1, 4, 8, 16, 32, 64], [1, 2, 3, 4, 5, 6]
    base = rng.uniform(0.01, 0.1)
    verify_s = {n: base * (1 + rng.uniform(0, 0.05) * n) for n in sizes}
    draft_s = {d: rng.uniform(0.001, 0.02) * d for d in depths}
    survival = {}
    for n in sizes:
        p, s, values = min(0.95, rng.uniform(0.2, 0.6) + 0.05 * n ** 0.5), 1.0, []
        for _ in range(7):
            s *= p * rng.uniform(0.8, 1.0)
            values.append(s)
        survival[n] = values
    for contrastive in (True, False):
        choice = bench.choose_tree_settings(verify_s, draft_s, survival, contrastive)
        value, n, d = _brute_force(verify_s, draft_s, survival, contrastive)
        assert (choice["total_tokens"], choice["depth"]) == (n, d)
        assert choice["predicted_tokens_per_s"] == pytest.approx(value)


def test_choose_tree_settings_follows_costs():
    survival = {n: [0.8 ** d for d in range(1, 8)] for n in (1, 8, 64)}
    cheap_big = bench.choose_tree_settings({1: 1.0, 8: 1.0, 64: 1.0}, {1: 0.01, 6: 0.01}, survival)
    assert cheap_big["depth"] == 6
    # nothing is accepted: the cheapest round wins
    dead = {n: [0.0] * 7 for n in (1, 8, 64)}
    assert bench.choose_tree_settings({1: 1.0, 8: 1.2, 64: 2.0}, {1: 0.1, 6: 0.6}, dead)["total_tokens"] == 1


def test_acceptance_profile():
    profile = bench.acceptance_profile([[1, 3, 2, 1, 5], [1, 4, 1]], levels=3)  # rounds kept: 3 2 1 | 4
    assert profile["rounds"] == 4
    assert profile["survival"] == [0.75, 0.5, 0.25]
    assert profile["acceptance_rates"] == pytest.approx([0.75, 2 / 3, 0.5])


def test_tune_measures_and_chooses(models):
    target, tokenizer, draft, _ = models
    prompts = [{"turns": ["Say hi."]}, {"turns": ["def f(x):"]}]
    result = bench.tune(target, tokenizer, draft, prompts, max_new_tokens=10, sizes=(1, 4, 12), depths=(1, 3),
                        repeats=1, log=lambda _: None)
    assert set(result["verify_s"]) == {"0", "1", "4", "12"} and set(result["draft_s"]) == {"1", "3"}
    assert all(t > 0 for t in result["verify_s"].values())
    assert (result["chosen"]["total_tokens"], result["chosen"]["depth"]) in {(n, d) for n in (1, 4, 12) for d in (1, 3)}
    # the choice is the selection function applied to the measured numbers
    expected = bench.choose_tree_settings(
        {int(n): t for n, t in result["verify_s"].items() if n != "0"},
        {int(d): t for d, t in result["draft_s"].items()},
        {int(n): p["survival"] for n, p in result["acceptance"].items()},
    )
    chosen = result["chosen"]
    assert (expected["total_tokens"], expected["depth"]) == (chosen["total_tokens"], chosen["depth"])
    assert result["outputs_identical"] and result["gain_over_default"] > 0
    assert len(result["acceptance"]["12"]["acceptance_rates"]) == 4  # depth 3 + the contrastive level
    # n-gram lookup budgets are measured with the chosen tree and the fastest is kept
    assert set(result["lookup"]) == {str(b) for b in bench.TUNE_LOOKUP_TOKENS}
    fastest = max(bench.TUNE_LOOKUP_TOKENS, key=lambda b: result["lookup"][str(b)]["tokens_per_s"])
    assert result["chosen"]["lookup_tokens"] == fastest


def test_lookup_rows_use_the_tuned_or_default_budget(models, monkeypatch):
    target, tokenizer, draft, _ = models
    seen = []
    real = bench.measure.tree_settings

    def spy(draft, **overrides):
        seen.append(overrides)
        return real(draft, **overrides)

    monkeypatch.setattr(bench.measure, "tree_settings", spy)
    prompt = {"mt_bench": [{"id": "1", "turns": ["abcabcabcabc"]}]}
    bench.run_benchmark(target, tokenizer, draft, prompts=prompt, methods=["jakiro", "jakiro_lookup", "eagle2"],
                        max_new_tokens=8, log=lambda _: None)
    budgets = {(o.get("contrastive", True), o["lookup_tokens"]) for o in seen}
    # jakiro and eagle2: the draft tree alone; jakiro_lookup: the default chain budget (nothing tuned, head has 0)
    assert budgets == {(True, 0), (False, 0), (True, bench.LOOKUP_TOKENS)}


def test_update_head_records_tuning_and_results(models, tmp_path):
    _, _, draft, _ = models
    draft.save_pretrained(tmp_path)
    (tmp_path / "jakiro_training.json").write_text(json.dumps({"summary": {"steps": 60}, "metrics": {"tau": 2.5}}))

    def result(tokens_per_s, tune):
        row = dict(temperature=0.0, suite="mt_bench", method="jakiro", generations=4, tokens_per_s=tokens_per_s,
                   speedup=1.25, tau=2.5, match_rate=1.0)
        out = {
            "machine": {"dtype": "torch.float32", "device": "cpu", "command": "jakiro bench --tune"},
            "config": {"suites": ["mt_bench"], "max_new_tokens": 64,
                       "tree_settings": {"total_tokens": 8, "depth": 3, "top_k": 4}},
            "results": [row, {**row, "method": "plain", "speedup": 1.0, "tau": None}, {**row, "suite": "overall"}],
        }
        if tune:
            out["tune"] = {"chosen": {"total_tokens": 8, "depth": 3, "lookup_tokens": 5}}
        return out

    bench.update_head(tmp_path, result(10.0, tune=True))
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["total_tokens"], config["depth"], config["lookup_tokens"]) == (8, 3, 5)
    assert (config["total_tokens"], config["depth"]) != (draft.config.total_tokens, draft.config.depth)
    bench.update_head(tmp_path, result(12.5, tune=False))  # same dtype and suite: replaces the entry
    report = json.loads((tmp_path / "jakiro_training.json").read_text())
    (entry,) = report["benchmarks"].values()  # one suite: no separate "overall" entry
    assert entry.startswith("12.50 tok/s, 1.25x over plain generate, tau 2.50") and "100%" in entry
    card = (tmp_path / "README.md").read_text()
    assert "12.50 tok/s" in card and "10.00 tok/s" not in card and "| steps" not in card and "- steps: 60" in card
    assert "acceptance length tau" in card  # the training metrics stay
    two_suites = result(9.0, tune=False)
    two_suites["config"]["suites"] = ["mt_bench", "alpaca"]
    assert set(bench.head_metrics(two_suites)) == {
        "jakiro bench: mt_bench, temperature 0 (torch.float32, cpu)",
        "jakiro bench: mt_bench+alpaca, temperature 0 (torch.float32, cpu)",
    }
    # A run at another tree than the head's adds its own entry; the one at the head's tree stays.
    other_tree = result(20.0, tune=False)
    other_tree["config"]["tree_settings"] = {"total_tokens": 32, "depth": 5, "top_k": 4}
    bench.update_head(tmp_path, other_tree)
    report = json.loads((tmp_path / "jakiro_training.json").read_text())
    assert set(report["benchmarks"]) == {
        "jakiro bench: mt_bench, temperature 0 (torch.float32, cpu)",
        "jakiro bench: mt_bench, temperature 0, tree 32/5/4 (torch.float32, cpu)",
    }
    assert report["benchmarks"]["jakiro bench: mt_bench, temperature 0 (torch.float32, cpu)"].startswith("12.50")


def test_shipped_grounded_suite_loads_beside_the_shared_ones(tmp_path):
    records = bench.load_suite("grounded", num_prompts=3, data_dir=tmp_path)  # not in data_dir: the shipped copy
    assert len(records) == 3 and all(r["category"] for r in records)
    assert "```python" in records[0]["turns"][0]  # the passage the answer works on is in the prompt


def test_acceptance_at_depth_in_rows():
    samples = [
        {"suite": "s", "method": "jakiro", "new_tokens": 9, "time_s": 1.0, "rounds": 5, "accepted_lengths": [1, 3, 1, 2, 2],
         "matches_baseline": True, "peak_memory_mb": 1.0},
        {"suite": "s", "method": "plain", "new_tokens": 9, "time_s": 2.0, "matches_baseline": True,
         "peak_memory_mb": 1.0},
    ]
    rows = {r["method"]: r for r in bench.summarize(samples, ["plain", "jakiro"], 0.0) if r["suite"] == "s"}
    # rounds 2-4 (prefill and last left out) accepted 2, 0 and 1 draft tokens
    assert rows["jakiro"]["acceptance_at_depth"] == [round(2 / 3, 4), round(1 / 3, 4)]
    assert rows["plain"]["acceptance_at_depth"] is None
    assert bench.format_acceptance([0.5, 0.25]) == "d>=1 0.50, d>=2 0.25"
    assert rows["jakiro"]["vocab_coverage"] is None  # samples without the count: not made up


def test_vocab_coverage_counts_generated_tokens_the_draft_can_propose(models):
    target, tokenizer, draft, _ = models
    samples = [
        {"suite": "s", "method": "jakiro", "new_tokens": 8, "time_s": 1.0, "rounds": 4, "accepted_lengths": [1, 3, 2, 2],
         "in_draft_vocab": 6, "matches_baseline": True, "peak_memory_mb": 1.0},
        {"suite": "s", "method": "jakiro", "new_tokens": 2, "time_s": 1.0, "rounds": 2, "accepted_lengths": [1, 1],
         "in_draft_vocab": 2, "matches_baseline": True, "peak_memory_mb": 1.0},
    ]
    (row,) = [r for r in bench.summarize(samples, ["jakiro"], 0.0) if r["suite"] == "s"]
    assert row["vocab_coverage"] == 0.8
    result = {"machine": {"dtype": "torch.float32", "device": "cpu", "command": "jakiro bench"},
              "config": {"suites": ["s"], "max_new_tokens": 8, "tree_settings": {}}, "results": [row]}
    (entry,) = bench.head_metrics(result).values()
    assert entry.endswith("draft vocabulary holds 80.0% of the generated tokens (2 generations, max_new_tokens=8, "
                          "tree None/None/None)")
    # a real run counts them: the shared draft has the target's full vocabulary, so every generated token
    record = bench.generate_once(target, {"input_ids": torch.tensor([[5, 6, 7]])}, "jakiro", draft, None,
                                 {"max_new_tokens": 5, "do_sample": False}, {})
    assert record["in_draft_vocab"] == record["new_tokens"] == 5


def test_tree_option_overrides_the_heads_settings(models):
    target, tokenizer, draft, _ = models
    assert bench.cli._tree_option("8/2/6", 5) == {"total_tokens": 8, "depth": 2, "top_k": 6, "lookup_tokens": 5,
                                              "lookup_chains": None}
    with pytest.raises(SystemExit, match="TOTAL_TOKENS/DEPTH/TOP_K"):
        bench.cli._tree_option("8/2", None)
    result = bench.run_benchmark(target, tokenizer, draft, prompts=PROMPTS, methods=["jakiro_lookup"],
                                 max_new_tokens=4, tree_overrides=bench.cli._tree_option("3/1/2", 7, 2), log=lambda _: None)
    settings = result["config"]["tree_settings"]
    assert (settings["total_tokens"], settings["depth"], settings["top_k"]) == (3, 1, 2)
    assert settings["lookup_tokens (jakiro_lookup)"] == 7 and settings["source"] == "command line"
    assert settings["lookup_chains (jakiro_lookup)"] == 2
    labels = list(bench.head_metrics(result))
    assert labels and all("with n-gram lookup (7 tokens x 2 chains)" in label for label in labels)


def test_batch_throughput_benchmark(models, tmp_path):
    """`jakiro bench --batch-sizes`: every method at every batch size on whole batches of the same prompts, plain's
    speedup 1, every greedy Jakiro row identical to plain batched generate, the files written."""
    from transformers_jakiro.bench.batches import batch_table, row_lengths, run_batch_benchmark, write_batch_outputs

    target, tokenizer, draft, _ = models
    texts = ["Say hi.", "Count to three please.", "def f(x):", "Name a colour."]
    (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    result = run_batch_benchmark(target, tokenizer, draft, batch_sizes=(1, 3), suites=("mt_bench",),
                                 data_dir=tmp_path, max_new_tokens=10, log=lambda _: None)
    rows = {(r["batch_size"], r["method"]): r for r in result["results"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in ("plain", "jakiro", "jakiro_lookup")}
    assert rows[(1, "plain")]["rows"] == 4 and rows[(3, "plain")]["rows"] == 3  # whole batches only
    for (size, method), row in rows.items():
        assert row["match_rate"] == 1.0 and row["tokens_per_s"] > 0
        if method == "plain":
            assert row["speedup"] == 1.0 and row["tau_per_row"] is None
        else:
            assert row["tau_per_row"] >= 1.0 and row["tree_per_row"]
    assert rows[(3, "jakiro")]["tree_per_row"] == "4/3/4"  # the draft's 12/3/4 shared by 3 rows
    files = write_batch_outputs(result, tmp_path / "out")
    assert json.loads(open(files["json"]).read())["config"]["batch_sizes"] == [1, 3]
    assert "| 3 | jakiro | 4/3/4 |" in batch_table(result)
    eos = tokenizer.eos_token_id
    assert row_lengths(torch.tensor([[5, eos, eos], [5, 6, 7]]), {eos}) == [2, 3]


def test_batch_benchmark_over_a_static_cache(models, tmp_path, monkeypatch):
    """`--cache static`: every method's generate gets `cache_implementation="static"` (plain's too), and Jakiro's rows
    stay identical to plain batched generate over it."""
    from transformers_jakiro.bench.batches import run_batch_benchmark

    target, tokenizer, draft, _ = models
    texts = ["Say hi.", "Count to three please.", "def f(x):", "Name a colour."]
    (tmp_path / "mt_bench.jsonl").write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    caches = []
    generate = type(target).generate

    def recorded(self, *args, **kwargs):
        caches.append(kwargs.get("cache_implementation"))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "generate", recorded)
    result = run_batch_benchmark(target, tokenizer, draft, batch_sizes=(2,), suites=("mt_bench",), data_dir=tmp_path,
                                 max_new_tokens=10, cache_implementation="static", log=lambda _: None)
    assert caches and set(caches) == {"static"}
    assert all(row["match_rate"] == 1.0 for row in result["results"])
