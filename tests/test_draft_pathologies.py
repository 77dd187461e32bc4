"""Whatever the draft proposes, the output is the target's: drafts that emit NaN, +inf, -inf or huge logits.

A bf16/fp16 head that overflows or a damaged checkpoint gives NaN scores; `topk` and `sort` rank NaN above every
number, so before `tree.ranking_scores` a NaN child could be kept while its parent was dropped, flatten gave it
parent -1 and the acceptance rule compared it with `choices[-1]`: greedy output then differed from plain generate.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from test_sampling import VOCAB as SAMPLING_VOCAB
from test_sampling import chi_square_p_value, exact_distribution, sample_counts
from tiny_models import VOCAB, make_target, quick_trained_draft, random_prompt
from transformers_jakiro import jakiro_generate, tree_settings
from transformers_jakiro.decoding.drafter import TreeSettings
from transformers_jakiro.decoding.tree import TreeRecorder, flatten_tree

PATHOLOGIES = ("nan", "posinf", "neginf", "huge")


def corrupt(logits: torch.Tensor, features: torch.Tensor, kind: str) -> torch.Tensor:
    """The draft's logits made pathological on the rows whose feature has a positive first component: about half
    the rows, a different set per level and per round, as when some inputs overflow a low-precision head."""
    bad = features[..., :1] > 0
    if kind == "nan":
        value = torch.full_like(logits, float("nan"))
    elif kind == "posinf":  # log_softmax of a row holding +inf is NaN everywhere
        value = logits.clone()
        value[..., 5:9] = float("inf")
    elif kind == "neginf":  # every token impossible: NaN log-probabilities
        value = torch.full_like(logits, float("-inf"))
    elif kind == "huge":
        value = logits.clone()
        value[..., 3:7] = 1e30
    return torch.where(bad, value, logits)


class pathological:
    """Context manager: the draft's `compute_logits` returns `corrupt(...)` output while it is active."""

    def __init__(self, draft, kind: str):
        self.draft, self.kind = draft, kind

    def __enter__(self):
        original = type(self.draft).compute_logits.__get__(self.draft)
        self.draft.compute_logits = lambda features: corrupt(original(features), features, self.kind)
        return self.draft

    def __exit__(self, *exc):
        del self.draft.compute_logits


@st.composite
def arbitrary_scored_trees(draw):
    """Recorded expansions whose scores are anything: NaN, infinities, children above their parents."""
    values = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0]) | st.floats(-10, 10)
    tokens, parents, scores, depths = [0], [-1], [0.0], [0]
    previous = [0]
    for depth in range(1, draw(st.integers(1, 5)) + 1):
        count = draw(st.integers(1, 8))
        level = list(range(len(tokens), len(tokens) + count))
        for _ in range(count):
            parents.append(draw(st.sampled_from(previous)))
            tokens.append(draw(st.integers(0, 50)))
            scores.append(draw(values))
            depths.append(depth)
        previous = level
    return tokens, parents, scores, depths, draw(st.integers(1, 40))


@settings(max_examples=300, deadline=None)
@given(arbitrary_scored_trees())
def test_flatten_keeps_a_tree_whatever_the_scores(case):
    tokens, parents, scores, depths, total_tokens = case
    tree = flatten_tree(
        torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32), torch.tensor(depths),
        total_tokens,
    )
    flat_parents = tree.parents.tolist()
    assert tree.num_nodes == 1 + min(total_tokens, len(tokens) - 1)
    assert flat_parents[0] == -1
    for node in range(1, tree.num_nodes):
        assert 0 <= flat_parents[node] < node  # a kept node's parent is kept, and comes before it
        assert tree.depths[node] == tree.depths[flat_parents[node]] + 1
    assert not torch.isnan(tree.scores).any()
    assert (tree.scores[1:] <= tree.scores[tree.parents[1:]]).all()  # ranking scores never rise along a path


def test_recorder_with_nan_scores_keeps_parents():
    """The reported case: a NaN child of a parent that its own score would have dropped."""
    recorder = TreeRecorder(torch.tensor(7))
    level1 = recorder.add_level(torch.tensor([10, 11]), torch.tensor([0, 0]), torch.tensor([-0.1, -5.0]), 1)
    # Both children hang under token 11 (score -5); one is NaN, the other scored above its parent.
    recorder.add_level(torch.tensor([20, 21]), level1[1].expand(2), torch.tensor([float("nan"), -0.2]), 2)
    tree = recorder.flatten(2)
    assert tree.parents.tolist() == [-1, 0, 0]
    assert tree.tokens.tolist() == [7, 10, 11]  # the parent first (a tie at -5 with its child), never the NaN


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", seed=3)
    return target, quick_trained_draft(target, steps=150)


def _prompts(count=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(g, 4, 16) for _ in range(count)]
    prompts.append(torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]))  # repeats itself: lookup chains fire
    return prompts


@pytest.mark.parametrize("kind", PATHOLOGIES)
@pytest.mark.parametrize("lookup_tokens", [0, 4])
def test_greedy_output_is_the_targets_whatever_the_draft_emits(pair, kind, lookup_tokens):
    target, draft = pair
    for prompt in _prompts():
        plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
        with pathological(draft, kind):
            with tree_settings(draft, total_tokens=12, depth=4, top_k=3, lookup_tokens=lookup_tokens):
                assisted = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=draft)
            custom = target.generate(
                prompt, do_sample=False, max_new_tokens=24, custom_generate=jakiro_generate, draft=draft,
                total_tokens=12, depth=4, top_k=3, lookup_tokens=lookup_tokens,
            )
        assert torch.equal(assisted, plain), (kind, lookup_tokens, prompt.tolist())
        assert torch.equal(custom, plain), (kind, lookup_tokens, prompt.tolist())


@pytest.mark.parametrize("kind", PATHOLOGIES)
def test_static_cache_and_fixed_shapes_with_pathological_drafts(pair, kind):
    target, draft = pair
    for prompt in _prompts(3, seed=1):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=16)
        with pathological(draft, kind), tree_settings(draft, total_tokens=10, depth=3, top_k=3):
            out = target.generate(
                prompt, do_sample=False, max_new_tokens=16, assistant_model=draft, cache_implementation="static"
            )
        assert torch.equal(out, plain), (kind, prompt.tolist())


def test_sampling_with_a_nan_draft_matches_the_target_distribution():
    """A chi-square test of the first three sampled tokens, as in test_sampling, with a draft emitting NaN rows."""
    from test_sampling import PROMPT, target_and_draft  # noqa: F401  (the fixture's body, called directly below)

    torch.manual_seed(0)
    target, draft = target_and_draft.__wrapped__()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    probs = exact_distribution(target, processors)
    settings = TreeSettings.resolve(draft, total_tokens=10, depth=2, top_k=3)
    with pathological(draft, "nan"):
        counts = sample_counts(target, draft, processors, 4000, PROMPT, settings)
    assert counts.numel() == SAMPLING_VOCAB**3
    assert chi_square_p_value(counts, probs) > 1e-4
    assert sample_counts.multi_token_rounds > 200  # the sane rows' candidates were still accepted
