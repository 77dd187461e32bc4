"""The demo's core (`run_demo`) on a tiny target: streamed answers, then the plain-vs-Jakiro table."""

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


def test_demo_table_greedy(models):
    target, tokenizer, draft = models
    out = io.StringIO()
    result = demo.run_demo(target, tokenizer, draft, ["Say hi.", "def f(x):"], max_new_tokens=16, file=out,
                           label="tiny target")
    text = out.getvalue()
    assert text.startswith("tiny target\n")
    assert "[1] Say hi.\n--- Jakiro:" in text and "[2] def f(x):" in text
    assert "plain tok/s" in text and "jakiro tok/s" in text and "speedup" in text and "tau" in text
    table = text.split("identical\n", 1)[1].splitlines()[1:]  # below the header and its rule
    lines = [line for line in table if line.startswith(("[1] Say", "[2] def", "all "))]
    assert len(lines) == 3 and all(line.rstrip().endswith("yes") for line in lines)
    assert all(row["identical"] for row in result["rows"])
    overall = result["table"][-1]
    assert overall["name"] == "all" and overall["tau"] >= 1.0
    assert overall["speedup"] == pytest.approx(overall["jakiro_tokens_per_s"] / overall["plain_tokens_per_s"])
    # the streamed text is the decoded Jakiro answer
    first = result["rows"][0]
    assert first["jakiro_tokens"] == first["plain_tokens"] > 0


def test_demo_sampling_and_random_head(models):
    target, tokenizer, _ = models
    torch.manual_seed(0)
    draft = JakiroDraftModel.from_target(target)  # untrained
    out = io.StringIO()
    demo.run_demo(target, tokenizer, draft, ["Say hi."], max_new_tokens=8, temperature=1.0, file=out)
    assert "n/a (sampling)" in out.getvalue()


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
    from transformers_jakiro.generation import JakiroGenerationStats

    draft.last_generation_stats = JakiroGenerationStats(new_tokens=3, rounds=2)
    # plain and Jakiro differ in the last token, as a near-tie in bf16 can make them
    monkeypatch.setattr(demo, "_generate", lambda t, i, d, s, st: ([1, 2, 3] if d is None else [1, 2, 4], 0.1))
    for dtype, explained in ((torch.float32, False), (torch.bfloat16, True)):
        monkeypatch.setattr(type(target), "dtype", property(lambda self: dtype))
        out = io.StringIO()
        demo.run_demo(target, tokenizer, draft, ["Say hi."], max_new_tokens=4, file=out)
        assert ("near-tie" in out.getvalue()) == explained and out.getvalue().rstrip().endswith(("0/1", "comparison."))
