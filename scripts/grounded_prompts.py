"""Build the `grounded` benchmark suite: prompts that carry a passage the answer must quote, edit or summarise.

This is where copying from the context pays (n-gram lookup, hybrid trees), unlike open-ended chat. The passages are
functions and module docstrings of the Python standard library (Python Software Foundation License, permissive),
taken from the interpreter that runs this script; the result ships in the package as
src/transformers_jakiro/bench/data/grounded.jsonl so every run benchmarks the same text.

    python scripts/grounded_prompts.py --out src/transformers_jakiro/bench/data/grounded.jsonl
"""

import argparse
import inspect
import json

import heapq
import shlex
import string
import textwrap
import fnmatch
import colorsys
import html

EDIT = [
    (textwrap.dedent, "Add type hints to this function and return the complete function, unchanged otherwise."),
    (fnmatch.translate, "Rename the variable `res` to `result` everywhere in this function and return the whole "
                        "function."),
    (colorsys.rgb_to_hsv, "Rewrite this function with a docstring that explains its arguments; keep the code as it "
                          "is and return the complete function."),
    (html.escape, "Add a `quote_apostrophe: bool = True` parameter to this function that controls the last replace, "
                  "and return the complete function."),
]
EXPLAIN = [
    (string.capwords, "Explain what this function does, line by line, quoting each line before explaining it."),
    (shlex.quote, "Summarise what this function does and list the exact string literals it uses."),
]
PASSAGES = [
    (heapq, "Summarise this passage in five bullet points, reusing its wording where you can."),
    (string, "List every name this passage defines, each with the sentence that describes it, quoted exactly."),
    (textwrap, "Rewrite this passage as a short README section with a heading and a usage example."),
    (shlex, "Quote the first sentence of this passage, then explain it in simpler words."),
]


def build() -> list[dict]:
    records = []
    for category, items in (("edit", EDIT), ("explain", EXPLAIN)):
        for function, task in items:
            source = inspect.getsource(function)
            records.append({"category": category, "turns": [f"{task}\n\n```python\n{source}```"],
                            "source": f"{function.__module__}.{function.__qualname__}"})
    for module, task in PASSAGES:
        passage = inspect.cleandoc(module.__doc__)[:1500]
        records.append({"category": "passage", "turns": [f"{task}\n\n\"\"\"\n{passage}\n\"\"\""],
                        "source": f"{module.__name__} module docstring"})
    for i, record in enumerate(records):
        record["id"] = f"grounded-{i}"
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = build()
    with open(args.out, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
