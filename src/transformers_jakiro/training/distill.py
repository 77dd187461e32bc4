"""Self-distillation: let the target write the responses a draft head is trained on.

EAGLE-3 showed that a draft learns the target best from the target's *own* outputs (docs/design.md, section 1), so
`jakiro distill` reads prompts, renders them with the target's chat template, generates the target's responses in
left-padded batches and writes ShareGPT-style JSONL, one conversation per line:

    {"id": "81", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}

Accepted prompt lines: our bench format (`turns`: the first turn is used), ShareGPT (`conversations`: the first human
turn) or a plain `prompt` / `question` / `instruction` field. The id is the line's `id` / `question_id`, else a hash of
the prompt text, so a rerun skips prompts already in the output file (resume after an interruption). Unusable lines
are reported with their line number and reason, never dropped silently.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..targets import load_target_or_explain
from .chat_records import first_user_prompt, read_jsonl
from .sharegpt import benchmark_prompts, is_data_spec, read_sources

# The prompt of an input line, in any of the accepted formats.
prompt_of = first_user_prompt


def record_id(record: dict, prompt: str) -> str:
    given = record.get("id", record.get("question_id"))
    if given is not None:
        return str(given)
    return hashlib.sha1(prompt.encode()).hexdigest()[:16]


def read_prompts(path) -> tuple[list[tuple[str, str]], list[tuple]]:
    """([(id, prompt)] in file order, duplicates of an earlier id dropped, [(line number, reason)]).

    `path` may also be a data spec (`sharegpt:2000`, a ShareGPT JSON array, several sources separated by commas; see
    `sharegpt.read_sources`): then the first human turn of each conversation is the prompt, benchmark questions are
    skipped, and bad records are named by source and index."""

    def parse(record):
        return record_id(record, prompt_of(record)), prompt_of(record)

    if is_data_spec(path):
        parsed, bad = read_sources(str(path), parse, benchmark_prompts())
        good = [(f"#{i}", p) for i, p in enumerate(parsed)]
    else:
        good, bad = read_jsonl(path, parse)
    prompts, seen = [], set()
    for number, (pid, text) in good:
        if pid in seen:
            bad.append((number, f"duplicate id {pid!r}"))
            continue
        seen.add(pid)
        prompts.append((pid, text))
    return prompts, sorted(bad)


def _done_ids(out_path: Path) -> set[str]:
    """Ids already in the output file. An interrupted run can leave a half-written last line: it is cut off, since
    appending after it would corrupt the next record too."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        print(f"{out_path}: removing an incomplete last line left by an interrupted run", file=sys.stderr)
        with open(out_path, "r+b") as file:
            file.truncate(cut)
    good, bad = read_jsonl(out_path, lambda r: str(r["id"]))
    for number, reason in bad:
        print(f"{out_path}:{number}: unreadable existing line ({reason}); its prompt will be generated again")
    return {pid for _, pid in good}


def render_prompt(tokenizer, prompt: str) -> str:
    """`prompt` as one user turn under the target's chat template, ending where the assistant's answer starts."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def prompt_length(tokenizer, prompt: str) -> int:
    """Tokens of `prompt` under the chat template: what `--max-prompt-tokens` bounds."""
    return _rendered_length(tokenizer, render_prompt(tokenizer, prompt))


def _rendered_length(tokenizer, rendered: str) -> int:
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def distill(
    target,
    tokenizer,
    prompts: list[tuple[str, str]] | str | os.PathLike,
    out_path: str | os.PathLike,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    temperature: float = 0.0,
    limit: int | None = None,
    progress: bool = True,
    max_prompt_tokens: int | None = None,
) -> dict:
    """Generate `target`'s responses to `prompts` ([(id, text)] or a JSONL path) and append them to `out_path`.

    Greedy when `temperature == 0`, sampled otherwise. `limit` keeps the first N prompts of the input (before
    skipping those already done, so a rerun with the same limit completes the same set). `max_prompt_tokens` skips
    prompts longer than that many tokens under the chat template (counted as `too_long`): a training window holds
    prompt and answer together, and one long prompt in a left-padded batch makes every row of the batch pay for it.
    Returns a summary dict.
    """
    bad = []
    if not isinstance(prompts, list):
        prompts, bad = read_prompts(prompts)
        for number, reason in bad:
            print(f"skipped line {number}: {reason}", file=sys.stderr)
    if limit is not None:
        prompts = prompts[:limit]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _done_ids(out_path)
    todo = [(pid, text) for pid, text in prompts if pid not in done]
    rendered = {pid: render_prompt(tokenizer, text) for pid, text in todo}
    lengths = {pid: _rendered_length(tokenizer, rendered[pid]) for pid, _ in todo}  # = prompt_length, rendered once
    kept = [item for item in todo if max_prompt_tokens is None or lengths[item[0]] <= max_prompt_tokens]
    too_long, todo = len(todo) - len(kept), kept
    # Similar lengths in one batch waste less compute on padding.
    todo.sort(key=lambda item: lengths[item[0]])

    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # every row continues at its last position
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = target.get_input_embeddings().weight.device
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else dict(do_sample=False)
    )
    new_tokens, truncated, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            inputs = tokenizer(
                [rendered[pid] for pid, _ in batch], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(device)
            sequences = target.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
            generated = sequences[:, inputs["input_ids"].shape[1] :]
            for (pid, text), row in zip(batch, generated):
                length = _response_length(row, target.generation_config.eos_token_id, pad_id)
                new_tokens += length
                truncated += length >= max_new_tokens
                response = tokenizer.decode(row[:length], skip_special_tokens=True)  # exactly what the target wrote
                record = {
                    "id": pid,
                    "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": response}],
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()  # a finished batch survives an interruption
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")
    bar.close()
    tokenizer.padding_side = padding_side
    seconds = time.perf_counter() - started
    summary = dict(
        prompts=len(prompts),
        already_done=len(prompts) - len(todo) - too_long,
        generated=len(todo),
        too_long=too_long,
        bad_lines=len(bad),
        new_tokens=new_tokens,
        hit_max_new_tokens=int(truncated),
        seconds=round(seconds, 2),
        tokens_per_s=round(new_tokens / seconds, 2) if seconds > 0 and new_tokens else 0.0,
        out=str(out_path),
    )
    return summary


def _response_length(row: torch.Tensor, eos, pad_id) -> int:
    """Generated tokens up to and including the first EOS (rows that stopped early are padded after it)."""
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [i for i, token in enumerate(row.tolist()) if token in eos]
    if stops:
        return stops[0] + 1
    tokens = row.tolist()
    while tokens and pad_id is not None and tokens[-1] == pad_id and pad_id not in eos:
        tokens.pop()
    return len(tokens)


# -- command line ------------------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="registry name, .gguf file, local model dir or Hub id")
    parser.add_argument("--prompts", required=True, help="JSONL of prompts (turns / conversations / prompt field), "
                        "or a data spec such as `sharegpt:2000` (first human turns; see `jakiro train --data`)")
    parser.add_argument("--out", required=True, help="output JSONL (ShareGPT format); appended to, resumable")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 = sampled")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts of the file")
    parser.add_argument("--dtype", default="float32", help="target dtype: float32 or bfloat16")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="skip prompts longer than N tokens under the chat template (keep N well under the "
                        "training --max-length; one long prompt slows its whole left-padded batch)")


def run(args) -> int:
    if not is_data_spec(args.prompts) and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"prompts file not found: {args.prompts}")
    target, tokenizer = load_target_or_explain(args.target, args.dtype)
    summary = distill(
        target, tokenizer, args.prompts, args.out, args.max_new_tokens, args.batch_size, args.temperature, args.limit,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    print(
        f"distill: {summary['generated']} responses written to {summary['out']} ({summary['already_done']} already "
        f"there, {summary['bad_lines']} bad lines skipped, {summary['too_long']} prompts over --max-prompt-tokens "
        f"skipped); {summary['new_tokens']} tokens in {summary['seconds']} s "
        f"= {summary['tokens_per_s']} tok/s; {summary['hit_max_new_tokens']} responses hit --max-new-tokens"
    )
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("distill", help="generate the target's own responses to prompts (training data)")
    add_arguments(parser)
    parser.set_defaults(func=run)


__all__ = ["distill", "read_prompts", "prompt_of", "render_prompt", "prompt_length"]
