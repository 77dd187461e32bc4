"""Training data sources: ShareGPT JSON arrays cut off mid-record, `:N` limits and `:START-END` ranges, several
sources, benchmark dedup."""

import json

import pytest

from transformers_jakiro.training.sharegpt import is_data_spec, iter_json_array, read_sources, sharegpt_messages
from transformers_jakiro.training import read_conversations


def record(i, first="human", prompt=None):
    return {"id": f"r{i}", "conversations": [{"from": first, "value": prompt or f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}]}


def write_truncated_array(path, records):
    text = json.dumps(records, indent=2)
    cut = text.rfind('"answer')  # inside the last record, as in the packaged ShareGPT file
    path.write_text(text[:cut])


def test_truncated_array_stops_cleanly_at_the_broken_record(tmp_path, capsys):
    path = tmp_path / "sharegpt.json"
    write_truncated_array(path, [record(i) for i in range(5)])
    assert [r["id"] for r in iter_json_array(path)] == ["r0", "r1", "r2", "r3"]
    assert "ends inside record 5" in capsys.readouterr().err
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps([record(0), record(1)]))
    assert len(list(iter_json_array(whole))) == 2
    (tmp_path / "bad.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        list(iter_json_array(tmp_path / "bad.json"))


def test_sharegpt_records_must_be_clean_dialogues():
    assert sharegpt_messages(record(0))[1] == {"role": "assistant", "content": "answer 0"}
    with pytest.raises(ValueError, match="human turn"):
        sharegpt_messages(record(0, first="gpt"))
    with pytest.raises(ValueError, match="alternate"):
        sharegpt_messages({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                             {"from": "gpt", "value": "c"}]})
    trailing = {"conversations": [*record(0)["conversations"], {"from": "human", "value": "unanswered"}]}
    assert len(sharegpt_messages(trailing)) == 2  # a last question without an answer is dropped


def test_sources_limits_mixing_and_benchmark_exclusion(tmp_path):
    array = tmp_path / "sharegpt.json"
    write_truncated_array(array, [record(0), record(1, first="gpt"), record(2), record(3, prompt="Bench  Question?"),
                                  record(4), record(5)])
    jsonl = tmp_path / "distilled.jsonl"
    jsonl.write_text("\n".join(json.dumps(record(10 + i)) for i in range(3)) + "\n")
    good, bad = read_sources(f"{jsonl}:2,{array}:3", sharegpt_messages, exclude={"bench question?"})
    assert [m[0]["content"] for m in good] == ["question 10", "question 11", "question 0", "question 2", "question 4"]
    assert [reason for _, reason in bad] == ["does not start with a human turn", "benchmark prompt"]
    # train's reader takes the same specs and still reads one JSONL file line by line
    conversations, bad = read_conversations(f"{array}", exclude_benchmarks=False)
    assert len(conversations) == 4 and len(bad) == 1
    conversations, bad = read_conversations(jsonl)
    assert len(conversations) == 3 and not bad
    with pytest.raises(FileNotFoundError, match="training data not found"):
        read_sources(str(tmp_path / "missing.jsonl,sharegpt:1"), sharegpt_messages)


def test_source_ranges_take_what_a_longer_limit_adds(tmp_path):
    array = tmp_path / "sharegpt.json"
    write_truncated_array(array, [record(0), record(1, first="gpt"), record(2), record(3, prompt="Bench  Question?"),
                                  record(4), record(5), record(6), record(7)])
    firsts = lambda spec: [m[0]["content"] for m in read_sources(spec, sharegpt_messages, {"bench question?"})[0]]
    usable = firsts(f"{array}")  # record 7 is the truncated tail
    assert usable == ["question 0", "question 2", "question 4", "question 5", "question 6"]
    # START-END counts usable conversations like :N, so :2 and :2-4 split :4 exactly, and :2- runs to the end
    assert firsts(f"{array}:2") + firsts(f"{array}:2-4") == firsts(f"{array}:4") == usable[:4]
    assert firsts(f"{array}:2-") == usable[2:]
    assert firsts(f"{array}:4-100") == usable[4:]
    # skips before the range belong to another run's report; those inside it are reported
    reasons = lambda spec: [reason for _, reason in read_sources(spec, sharegpt_messages, {"bench question?"})[1]]
    assert reasons(f"{array}:1-3") == ["does not start with a human turn", "benchmark prompt"]
    assert reasons(f"{array}:2-3") == ["benchmark prompt"]
    assert reasons(f"{array}:3-") == []
    assert is_data_spec(f"{array}:2-4") and is_data_spec("distilled.jsonl:10-")
    assert not is_data_spec(str(tmp_path / "plain.jsonl"))
    with pytest.raises(ValueError, match="END > START"):
        read_sources(f"{array}:4-2", sharegpt_messages)


def test_distill_reads_first_human_turns_from_a_data_spec(tmp_path):
    from transformers_jakiro.training.distill import read_prompts

    array = tmp_path / "sharegpt.json"
    write_truncated_array(array, [record(0), record(1, first="gpt"), record(2), record(3)])
    prompts, bad = read_prompts(f"{array}:5")
    assert prompts == [("r0", "question 0"), ("r2", "question 2")]  # record 3 is the truncated tail
    assert len(bad) == 1  # record 1 has no human turn


def test_distill_data_spec_skips_benchmark_prompts_in_every_format(tmp_path, monkeypatch):
    from transformers_jakiro.training import distill

    monkeypatch.setattr(distill, "benchmark_prompts", lambda: {"bench question?"})
    lines = [{"prompt": "Bench  Question?"}, {"turns": ["bench question?"]}, record(0, prompt="BENCH question?"),
             {"prompt": "fine"}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    prompts, bad = distill.read_prompts(f"{path}:10")
    assert [text for _, text in prompts] == ["fine"]
    assert [reason for _, reason in bad] == ["benchmark prompt"] * 3
