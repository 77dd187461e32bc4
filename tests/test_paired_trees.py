"""benchmarks/paired_trees.py on a tiny target: teacher-forced, its per-position draft tokens must equal what the
decoder accepted with the same tree at every root it reached (else its paired comparison of trees would compare
something else than decoding)."""

import pytest
import torch

from benchmark_scripts import load_script
from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding.round_controller import RoundChoice


@pytest.fixture(scope="module")
def tool():
    return load_script("paired_trees.py", "paired_trees")


def test_paired_scores_equal_what_decoding_accepted(tool):
    torch.manual_seed(0)
    target = make_target("llama")
    draft = quick_trained_draft(target, steps=150)
    trees = [RoundChoice("tree", 12, 3, 4), RoundChoice("tree", 4, 1, 4)]
    checked = 0
    for length in (6, 11):
        input_ids = torch.randint(3, 60, (1, length))
        plain = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=30)
        scored = tool.score_trees(target, draft, plain, length, trees)
        for choice in trees:
            assert len(scored[choice.name]["draft_tokens"]) == plain.shape[1] - length - 1
            settings = dict(total_tokens=choice.total_tokens, depth=choice.depth, top_k=choice.top_k)
            with tree_settings(draft, lookup_tokens=0, adaptive=False, **settings):
                decoded = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=draft,
                                          do_sample=False, max_new_tokens=30)
            assert torch.equal(decoded, plain)
            added = list(draft.last_generation_stats.accepted_lengths)[1:-1]  # the prefill, and a last round cut short
            root = length
            for tokens in added:
                assert scored[choice.name]["draft_tokens"][root - length] == tokens - 1
                root += tokens
                checked += 1
    assert checked >= 10
    many = [t for t in scored[trees[0].name]["draft_tokens"] if t >= 2]
    assert many, "the head should accept multi-token paths"
