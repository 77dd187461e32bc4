"""benchmarks/tree_calibration.py on a tiny target: its labels of the recorded candidates must reproduce, round by
round, exactly what the decoder accepted (else its calibration and ceiling figures would mean nothing)."""

import pytest
import torch

from benchmark_scripts import load_script
from tiny_models import make_target, quick_trained_draft


@pytest.fixture(scope="module")
def tool():
    return load_script("tree_calibration.py", "tree_calibration")


@pytest.mark.parametrize("tree", [dict(total_tokens=12, depth=3, top_k=4), dict(total_tokens=5, depth=2, top_k=3)])
def test_recorded_candidates_reproduce_the_decoders_acceptance(tool, tree):
    torch.manual_seed(0)
    target = make_target("llama")
    draft = quick_trained_draft(target, steps=150)
    prompts = [torch.randint(3, 60, (1, n)) for n in (5, 9, 14)]
    rows = tool.record(target, draft, prompts, max_new_tokens=40, **tree)
    whole = [r for r in rows if not r["last"]]
    assert len(whole) >= 10 and any(r["accepted"] >= 3 for r in whole), "the head should accept multi-token paths"
    for row in whole:
        assert len(row["tokens"]) > tree["total_tokens"]  # every scored candidate, not only the kept ones
        assert row["accepted"] == 1 + tool.kept_right(row, tree["total_tokens"])
    result = tool.report(rows, tree["total_tokens"])
    assert result["recomputed"] == pytest.approx(result["decoded"])
    assert result["decoded"] <= result["ceiling"]
    depths = [t["depth"] for t in result["calibration"]]
    assert depths[0] == 1 and max(depths) == tree["depth"] + 1  # the contrastive head's level is reported too
    for t in result["calibration"]:
        assert 0 <= t["right"] <= 1 and 0 < t["mean_p"] <= 1


def test_labels_follow_paths(tool):
    # root, two children (7 right, 8 wrong), a grandchild under each: only 7 -> 9 is the continuation [7, 9].
    candidates = dict(tokens=[1, 7, 8, 9, 9], parents=[-1, 0, 0, 1, 2], scores=[0.0, -0.1, -2.0, -0.5, -2.1],
                      depths=[0, 1, 1, 2, 2])
    row = tool.label(candidates, [7, 9])
    assert row["right"] == [True, True, False, True, False]
    assert tool.label(candidates, [7])["known"] == [True, True, True, False, False]
    assert row["step"] == pytest.approx([0.0, -0.1, -2.0, -0.4, -0.1])
    assert tool.kept_right(row, 2) == 2 and tool.kept_right(row, 1) == 1
