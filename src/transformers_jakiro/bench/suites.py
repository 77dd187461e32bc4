"""The benchmark suites and how their prompts are read and encoded.

The suites ship inside the package, in `data/` beside this module (one `<suite>.jsonl` each; `data/README.md` gives
the origin and licence of each): MT-bench, HumanEval and Alpaca as packaged with the Jakiro paper's evaluation data,
and `grounded`, our own (a passage or function in the prompt that the answer quotes, edits or summarises;
scripts/grounded_prompts.py writes it). `--data-dir` or $JAKIRO_BENCH_DATA point to another directory of
`<suite>.jsonl` files; a suite that directory lacks is still read from the package.
"""

from __future__ import annotations

import itertools
import json
import os
from importlib import resources
from pathlib import Path

SUITES = ("mt_bench", "humaneval", "alpaca")
# A filesystem install (wheel, editable or sdist) gives a plain Path here.
PACKAGED_SUITES = Path(resources.files(__package__) / "data")
DEFAULT_DATA_DIR = Path(os.environ.get("JAKIRO_BENCH_DATA") or PACKAGED_SUITES)


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
    if not path.is_file() and (PACKAGED_SUITES / f"{suite}.jsonl").is_file():
        path = PACKAGED_SUITES / f"{suite}.jsonl"
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


__all__ = ["DEFAULT_DATA_DIR", "PACKAGED_SUITES", "SUITES", "encode", "load_suite"]
