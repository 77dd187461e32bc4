"""`jakiro distill`: prompt formats, bad-line reporting, batched generation, resumability, the CLI."""

import json

import pytest
import torch
from chat_tokenizer import make_tokenizer
from tiny_models import make_target

from transformers_jakiro import cli
from transformers_jakiro.training.distill import distill, prompt_length, read_prompts


@pytest.fixture(scope="module")
def target_and_tokenizer():
    return make_target("llama"), make_tokenizer()


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


PROMPT_LINES = [
    {"question_id": 81, "turns": ["bench turn one", "bench turn two"]},  # line 1
    {
        "id": "sg",
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "sharegpt q"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "second"},
        ],
    },
    "{not json",  # line 3
    {"prompt": "plain prompt"},
    {"question": "a question"},  # line 5
    {"instruction": "an instruction"},
    {"text": "no prompt field"},  # line 7
    {"prompt": "   "},  # line 8: empty
    {"question_id": 81, "turns": ["duplicate id"]},  # line 9
    ["not", "an", "object"],  # line 10
]


def test_read_prompts_formats_and_bad_lines(tmp_path):
    prompts, bad = read_prompts(write_lines(tmp_path / "p.jsonl", PROMPT_LINES))
    assert [text for _, text in prompts] == [
        "bench turn one",
        "sharegpt q",
        "plain prompt",
        "a question",
        "an instruction",
    ]
    assert prompts[0][0] == "81" and prompts[1][0] == "sg"
    assert len({pid for pid, _ in prompts}) == 5  # lines without an id get a stable hash of their text
    assert [number for number, _ in bad] == [3, 7, 8, 9, 10]
    reasons = dict(bad)
    assert "no prompt field" in reasons[7] and "empty" in reasons[8] and "duplicate" in reasons[9]
    assert "JSON object" in reasons[10]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_distill_writes_target_responses_and_resumes(tmp_path, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    prompts = [(str(i), "abc def"[: 3 + i]) for i in range(5)]
    out = tmp_path / "data.jsonl"
    first = distill(target, tokenizer, prompts, out, max_new_tokens=12, batch_size=2, limit=3, progress=False)
    assert first["generated"] == 3 and first["new_tokens"] > 0 and first["tokens_per_s"] > 0
    records = _records(out)
    assert sorted(r["id"] for r in records) == ["0", "1", "2"]
    for record in records:
        human, gpt = record["conversations"]
        assert human == {"from": "human", "value": dict(prompts)[record["id"]]} and gpt["from"] == "gpt"

    # Left padding in a batch gives the target's own (unbatched) greedy response.
    text = dict(prompts)["2"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(rendered, return_tensors="pt", add_special_tokens=False)
    alone = target.generate(**ids, do_sample=False, max_new_tokens=12, pad_token_id=0)[0, ids["input_ids"].shape[1] :]
    expected = tokenizer.decode(
        alone[: (alone == 2).nonzero()[0, 0] + 1] if (alone == 2).any() else alone, skip_special_tokens=True
    )
    assert next(r for r in records if r["id"] == "2")["conversations"][1]["value"] == expected

    second = distill(target, tokenizer, prompts, out, max_new_tokens=12, batch_size=2, progress=False)
    assert second["already_done"] == 3 and second["generated"] == 2
    assert sorted(r["id"] for r in _records(out)) == ["0", "1", "2", "3", "4"]
    third = distill(target, tokenizer, prompts, out, max_new_tokens=12, progress=False)
    assert third["generated"] == 0 and len(_records(out)) == 5


def test_interrupted_last_line_is_cut_and_regenerated(tmp_path, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    out = tmp_path / "data.jsonl"
    distill(target, tokenizer, [("a", "xy"), ("b", "zw")], out, max_new_tokens=4, progress=False)
    text = out.read_text()
    out.write_text(text[: text.index("\n") + 1] + text[text.index("\n") + 1 : -10])  # second line half-written
    summary = distill(target, tokenizer, [("a", "xy"), ("b", "zw")], out, max_new_tokens=4, progress=False)
    assert summary["already_done"] == 1 and summary["generated"] == 1
    assert sorted(r["id"] for r in _records(out)) == ["a", "b"]


def test_sampled_distill(tmp_path, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    summary = distill(
        target, tokenizer, [("a", "hello")], tmp_path / "s.jsonl", max_new_tokens=6, temperature=0.9, progress=False
    )
    assert summary["generated"] == 1 and summary["new_tokens"] >= 1


def test_cli_distill_reports_bad_lines(tmp_path, capsys, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    model_dir = tmp_path / "tiny"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = write_lines(tmp_path / "p.jsonl", PROMPT_LINES)
    out = tmp_path / "data.jsonl"
    argv = [
        "distill",
        "--target",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
    ]
    assert cli.main(argv + ["--limit", "2", "--max-prompt-tokens", "1"]) == 0  # every prompt is longer
    printed = capsys.readouterr().out
    assert "0 responses written" in printed and "2 prompts over --max-prompt-tokens skipped" in printed
    assert cli.main(argv + ["--limit", "2"]) == 0
    captured = capsys.readouterr()
    assert "skipped line 3" in captured.err and "skipped line 10" in captured.err
    assert "2 responses written" in captured.out
    assert cli.main(argv) == 0
    assert "3 responses written" in capsys.readouterr().out and len(_records(out)) == 5

    assert (
        cli.main(["distill", "--target", str(model_dir), "--prompts", str(tmp_path / "none.jsonl"), "--out", str(out)])
        == 2
    )
    assert "prompts file not found" in capsys.readouterr().err


def test_max_prompt_tokens_skips_long_prompts_and_counts_them(tmp_path, target_and_tokenizer):
    target, tokenizer = target_and_tokenizer
    prompts = [("short", "ab"), ("long", "ab " * 40), ("mid", "ab cd ef")]

    def rendered_length(text):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    limit = rendered_length("ab cd ef")
    assert rendered_length("ab") < limit < rendered_length("ab " * 40)
    # The public helper (also used by scripts/smollm2_sharegpt_prompts.py) counts the same way.
    assert [prompt_length(tokenizer, text) for _, text in prompts] == [rendered_length(text) for _, text in prompts]
    out = tmp_path / "data.jsonl"
    first = distill(target, tokenizer, prompts, out, max_new_tokens=4, max_prompt_tokens=limit, progress=False)
    assert first["too_long"] == 1 and first["generated"] == 2 and first["already_done"] == 0
    assert sorted(r["id"] for r in _records(out)) == ["mid", "short"]
    # A skipped prompt is not "done": without the bound a rerun answers it.
    second = distill(target, tokenizer, prompts, out, max_new_tokens=4, progress=False)
    assert second["too_long"] == 0 and second["already_done"] == 2 and second["generated"] == 1
    assert sorted(r["id"] for r in _records(out)) == ["long", "mid", "short"]
