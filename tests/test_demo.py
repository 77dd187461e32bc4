"""The demo's core (`run_demo`) on a tiny target: streamed answers, then the plain-vs-Jakiro table with stock prompt
lookup beside it, and the float32 identity check."""

import io

import pytest
import torch

from chat_tokenizer import make_tokenizer
from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import demo
from transformers_jakiro.modeling_jakiro import JakiroDraftModel


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = make_target("llama")
    return target, make_tokenizer(), quick_trained_draft(target, steps=60, total_tokens=12, depth=3, top_k=4)


def table_line(text: str, prefix: str) -> str:
    """The table's row for a prompt (the last line starting with it: the streamed answer's heading comes first)."""
    return [line for line in text.splitlines() if line.startswith(prefix)][-1]


def test_demo_table_greedy(models):
    target, tokenizer, draft = models
    out = io.StringIO()
    result = demo.run_demo(target, tokenizer, draft, ["Say hi.", "def f(x):"], max_new_tokens=16, file=out,
                           label="tiny target")
    text = out.getvalue()
    assert text.startswith("tiny target\n")
    assert "[1] Say hi.\n--- Jakiro:" in text and "[2] def f(x):" in text
    assert "plain tok/s" in text and "jakiro tok/s" in text and "speedup" in text and "tau" in text
    assert "float32, greedy: 'identical' = the same tokens as plain generate" in text
    all_lines = text.splitlines()
    at = next(i for i, line in enumerate(all_lines) if line.startswith("prompt "))
    assert "| prompt lookup" in all_lines[at] and all_lines[at].endswith("identical")
    lines = [line for line in all_lines[at + 2 :] if line.startswith(("[1] Say", "[2] def", "all "))]
    # Jakiro's column and prompt lookup's: both identical to plain in float32
    assert len(lines) == 3 and all(line.split("|")[0].rstrip().endswith("yes") for line in lines)
    assert all(line.rstrip().endswith("yes") for line in lines)
    assert all(row["identical"] and row["lookup_identical"] for row in result["rows"])
    assert "nearly tie" not in text and "float32 identity check" not in text  # float32 already: no check needed
    overall = result["table"][-1]
    assert overall["name"] == "all" and overall["tau"] >= 1.0
    assert overall["speedup"] == pytest.approx(overall["jakiro_tokens_per_s"] / overall["plain_tokens_per_s"])
    assert overall["lookup_speedup"] == pytest.approx(overall["lookup_tokens_per_s"] / overall["plain_tokens_per_s"])
    # the streamed text is the decoded Jakiro answer
    first = result["rows"][0]
    assert first["jakiro_tokens"] == first["plain_tokens"] > 0


def test_demo_sampling_and_random_head(models):
    target, tokenizer, _ = models
    torch.manual_seed(0)
    draft = JakiroDraftModel.from_target(target)  # untrained
    out = io.StringIO()
    demo.run_demo(target, tokenizer, draft, ["Say hi."], max_new_tokens=8, temperature=1.0, file=out,
                  fp32_check=lambda: pytest.fail("no identity check when sampling"))
    line = table_line(out.getvalue(), "[1] Say")
    assert line.count("n/a (sampling)") == 2  # Jakiro's column and prompt lookup's


def test_demo_missing_head_explains(monkeypatch):
    monkeypatch.setattr(demo, "find_head", lambda target: None)
    with pytest.raises(FileNotFoundError, match="jakiro train --target smollm2-135m-instruct"):
        demo.load_demo_models(None)
    with pytest.raises(FileNotFoundError, match="(?s)heads/jakiro-qwen2.5-coder-1.5b-instruct/.*data/qwen-coder"):
        demo.load_demo_models(None, target_name="qwen2.5-coder-1.5b-instruct")
    with pytest.raises(ValueError, match="ships heads for smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct"):
        demo.load_demo_models(None, target_name="llama-7b")


def test_demo_finds_both_shipped_heads_and_picks_a_dtype_the_cpu_is_fast_in(monkeypatch):
    for name in demo.TARGETS:
        assert demo.find_head(name).name == f"jakiro-{name}"
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    for has_bf16, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(demo, "cpu_has_bf16", lambda: has_bf16)
        assert demo.default_dtype() == dtype


def test_demo_explains_bf16_near_ties(models, monkeypatch):
    target, tokenizer, draft = models
    from transformers_jakiro.stats import JakiroGenerationStats

    draft.last_generation_stats = JakiroGenerationStats(new_tokens=3, rounds=2)
    # Jakiro differs from plain in the last token, as a near-tie in bf16 can make it; prompt lookup does not here
    calls = []

    def fake_generate(target, inputs, assistant, sampling, streamer, **extra):
        calls.append(extra)
        return ([1, 2, 3] if assistant is None else [1, 2, 4], 0.1)

    monkeypatch.setattr(demo, "_generate", fake_generate)
    for dtype, explained in ((torch.float32, False), (torch.bfloat16, True)):
        monkeypatch.setattr(type(target), "dtype", property(lambda self: dtype))
        out = io.StringIO()
        result = demo.run_demo(target, tokenizer, draft, ["Say hi."], max_new_tokens=4, file=out,
                               fp32_check=(target, draft))
        text = out.getvalue()
        line = table_line(text, "[1] Say")
        assert line.split("|")[0].rstrip().endswith("0/1") and line.rstrip().endswith("yes")
        assert ("nearly tie" in text) == explained and ("every speculative method" in text) == explained
        # the check runs in bf16 only; here the fake makes float32 differ too, which it reports as a bug
        assert ("float32 identity check" in text) == explained and ("fp32_check" in result) == explained
        if explained:
            assert "Jakiro vs plain DIFFERENT" in text and result["fp32_check"] is False
            assert text.rstrip().endswith("float32 keeps the output identical.")
    assert {"prompt_lookup_num_tokens": demo.PROMPT_LOOKUP_TOKENS} in calls


def test_demo_fp32_identity_check(models):
    """A bf16 target gets the float32 check on its first prompt (here the float32 originals): identical."""
    import copy

    target, tokenizer, draft = models
    target16 = copy.deepcopy(target).to(torch.bfloat16)
    draft16 = copy.deepcopy(draft).to(torch.bfloat16)
    loads = []
    out = io.StringIO()
    try:
        result = demo.run_demo(target16, tokenizer, draft16, ["Say hi."], max_new_tokens=6, file=out,
                               prompt_lookup=False, fp32_check=lambda: loads.append(1) or (target, draft),
                               fp32_check_tokens=5)
    finally:
        draft.bind_target(target)
    text = out.getvalue()
    assert "bfloat16, greedy" in text
    assert loads == [1] and result["fp32_check"] is True
    assert "float32 identity check, prompt [1], 5 new tokens: Jakiro vs plain identical" in text
    assert "prompt lookup" not in text and "lookup_identical" not in result["rows"][0]


def test_demo_cli_flags(monkeypatch):
    parser = __import__("argparse").ArgumentParser()
    demo.add_cli(parser.add_subparsers())
    seen = {}
    monkeypatch.setattr(demo, "load_demo_models", lambda *a: ("target", "tokenizer", "draft", "label"))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **kw: seen.update(kw))
    cases = ((["demo"], True, True), (["demo", "--no-prompt-lookup", "--no-fp32-check"], False, False))
    for argv, lookup, check in cases:
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        assert seen["prompt_lookup"] is lookup and (seen["fp32_check"] is not None) is check
