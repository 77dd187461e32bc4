"""The round-cost file (`$JAKIRO_ROUND_COSTS`, `$JAKIRO_CACHE/round_costs.json`) is data from outside: whatever it
holds, generate with the round controller on works and equals plain generate, only finite positive costs are used,
one warning names the file, and concurrent writers merge their entries."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from tiny_models import make_target, quick_trained_draft
from transformers_jakiro.decoding import round_controller

BAD_FILES = {
    "empty list": "[]",
    "string": '"x"',
    "number": "3",
    "not json": "{not json",
    "binary": b"\xff\xfe\x00\x81",
    "deeply nested": "[" * 100_000,
}
KEY = "KEY"  # replaced by the target's machine key
BAD_ENTRIES = {
    "key to a list": {KEY: [1, 2]},
    "cost a string": {KEY: {"plain": "fast"}},
    "cost zero": {KEY: {"plain": 0, "tree 60/5/10": 0.0}},
    "cost negative": {KEY: {"plain": -0.01}},
    "cost NaN": {KEY: {"plain": float("nan")}},
    "cost infinite": {KEY: {"plain": float("inf")}},
    "cost a bool": {KEY: {"plain": True}},
    "cost null": {KEY: {"plain": None}},
}


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, quick_trained_draft(target, steps=60, adaptive=True)


def _generate_equals_plain(target, draft):
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7, 9, 14]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=16)
    got = target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=draft)
    assert torch.equal(got, expected)


def _write(path, content, key):
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps({key if k == KEY else k: v for k, v in content.items()}))  # NaN/inf as literals


@pytest.mark.parametrize("name", list(BAD_FILES) + list(BAD_ENTRIES) + ["a directory"])
def test_generate_never_fails_because_of_the_cost_file(pair, tmp_path, monkeypatch, name):
    target, draft = pair
    path = tmp_path / "round_costs.json"
    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(path))
    key = round_controller.machine_key(target, "dynamic", 1)
    if name == "a directory":
        path.mkdir()
    else:
        _write(path, {**BAD_FILES, **BAD_ENTRIES}[name], key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own default: each message once per place
        assert all(isinstance(v, float) and v > 0 for v in round_controller.load_costs(key).values())
        _generate_equals_plain(target, draft)
        _generate_equals_plain(target, draft)
    named = [w for w in caught if str(path) in str(w.message) and "round-cost cache" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]  # one warning, naming the file
    if name != "a directory":  # rewritten with the measured costs: well-formed, finite and positive
        table = json.loads(path.read_text())
        costs = table[key]
        assert costs and all(isinstance(v, float) and 0 < v < float("inf") for v in costs.values())


def test_only_finite_positive_costs_are_kept(tmp_path, monkeypatch):
    path = tmp_path / "round_costs.json"
    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(path))
    path.write_text('{"k": {"plain": NaN, "lookup": 0.02, "tree 6/2/4": "x", "tree 60/5/10": 0}, "j": [1]}')
    assert round_controller.load_costs("k") == {"lookup": 0.02}
    round_controller.save_costs("k", {"plain": float("nan"), "tree 6/2/4": 0.05})
    assert json.loads(path.read_text()) == {"k": {"lookup": 0.02, "tree 6/2/4": 0.05}}


WRITER = textwrap.dedent("""
    import sys
    from transformers_jakiro.decoding import round_controller
    for i in range(int(sys.argv[2])):
        round_controller.save_costs(f"{sys.argv[1]}-{i}", {"plain": 0.01 + i * 1e-6})
""")


def test_two_writer_processes_keep_every_entry(tmp_path, monkeypatch):
    path = tmp_path / "round_costs.json"
    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(path))
    count = 150
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(count)]) for name in ("a", "b")]
    assert all(writer.wait(timeout=300) == 0 for writer in writers)
    table = json.loads(path.read_text())
    assert len(table) == 2 * count
    assert not list(tmp_path.glob("*.tmp"))
