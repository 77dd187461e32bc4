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

Modules: `suites` (the packaged benchmark questions), `measure` (one timed generation, the per-method rows), `tune`
(`--tune`), `run` (`run_benchmark`), `report` (results.md/json, the plot, the model-card entries), `cli`.
"""

from ..stats import acceptance_profile, format_acceptance
from .cli import add_cli, load_draft
from .measure import (
    LOOKUP_TOKENS,
    METHODS,
    PROMPT_LOOKUP_NUM_TOKENS,
    TREE_METHODS,
    PeakMemory,
    generate_once,
    summarize,
)
from .report import head_metrics, markdown_table, plot_speedups, update_head, write_outputs
from .run import machine_info, run_benchmark
from .suites import DEFAULT_DATA_DIR, PACKAGED_SUITES, SUITES, encode, load_suite
from .tune import (
    TUNE_DEPTHS,
    TUNE_LOOKUP_TOKENS,
    TUNE_SIZES,
    choose_tree_settings,
    expected_tokens_per_round,
    measure_costs,
    tune,
    tune_lookup,
)

__all__ = [
    "DEFAULT_DATA_DIR",
    "LOOKUP_TOKENS",
    "METHODS",
    "PACKAGED_SUITES",
    "PROMPT_LOOKUP_NUM_TOKENS",
    "SUITES",
    "TREE_METHODS",
    "TUNE_DEPTHS",
    "TUNE_LOOKUP_TOKENS",
    "TUNE_SIZES",
    "PeakMemory",
    "acceptance_profile",
    "add_cli",
    "choose_tree_settings",
    "encode",
    "expected_tokens_per_round",
    "format_acceptance",
    "generate_once",
    "head_metrics",
    "load_draft",
    "load_suite",
    "machine_info",
    "markdown_table",
    "measure_costs",
    "plot_speedups",
    "run_benchmark",
    "summarize",
    "tune",
    "tune_lookup",
    "update_head",
    "write_outputs",
]
