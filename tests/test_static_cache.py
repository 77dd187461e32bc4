"""`generate(..., assistant_model=draft, cache_implementation="static")`: the tree is verified into transformers'
StaticCache, every round padded to one shape, the draft runs over its own static cache in fixed-shape steps, and
greedy output stays token-identical to plain generate (the draft's trees identical to the dynamic path's)."""

import pytest
import torch
from transformers import StaticCache
from transformers.cache_utils import DynamicCache

from tiny_models import make_target, random_prompt, trained_pairs
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding import verification
from transformers_jakiro.decoding.target_inputs import cache_kwarg
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings
from transformers_jakiro.decoding.kv_cache import keep_accepted, new_target_cache, truncate
from transformers_jakiro.decoding.tree import DraftTree, ancestor_matrix

# (total_tokens, depth, top_k, lookup_tokens): default-like, chain, one node, with n-gram lookup chains.
TREES = [(20, 4, 4, 0), (6, 6, 1, 0), (1, 2, 3, 0), (12, 3, 3, 4)]


@pytest.fixture(scope="module")
def pairs():
    return trained_pairs()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_greedy_identical_to_plain_and_to_dynamic_jakiro(arch, pairs):
    target, draft = pairs(arch)
    g = torch.Generator().manual_seed(3)
    accepted = []
    for i in range(8):
        prompt = random_prompt(g)
        max_new = int(torch.randint(1, 40, (1,), generator=g))
        total_tokens, depth, top_k, lookup = TREES[i % len(TREES)]
        kwargs = dict(do_sample=False, max_new_tokens=max_new)
        expected = target.generate(prompt, **kwargs)
        with tree_settings(draft, total_tokens=total_tokens, depth=depth, top_k=top_k, lookup_tokens=lookup):
            dynamic = target.generate(prompt, assistant_model=draft, **kwargs)
            dynamic_stats = draft.last_generation_stats
            static = target.generate(prompt, assistant_model=draft, cache_implementation="static", **kwargs)
            accepted += draft.last_generation_stats.accepted_lengths
            # The static draft (its own static cache, k-row reads and levels) drafts the same trees: same acceptance.
            assert draft.last_generation_stats.accepted_lengths == dynamic_stats.accepted_lengths, f"prompt {i}"
            assert draft.last_generation_stats.lookup_accepted == dynamic_stats.lookup_accepted, f"prompt {i}"
            with tree_settings(draft, fixed_shape=False):  # unpadded trees into the static cache
                unpadded = target.generate(prompt, assistant_model=draft, cache_implementation="static", **kwargs)
            with tree_settings(draft, fixed_shape=True):  # padded trees into a dynamic cache
                padded = target.generate(prompt, assistant_model=draft, **kwargs)
        assert torch.equal(dynamic, expected), f"prompt {i}"
        assert torch.equal(static, expected), f"prompt {i}"
        assert torch.equal(unpadded, expected), f"prompt {i}"
        assert torch.equal(padded, expected), f"prompt {i}"
    assert max(accepted) >= 3  # multi-token paths were moved into place


def test_static_cache_is_returned_sized_for_the_tree_and_never_shrinks(pairs):
    target, draft = pairs("llama")
    prompt = torch.tensor([[5, 9, 33, 17, 40, 41]])
    kwargs = dict(do_sample=False, assistant_model=draft, cache_implementation="static", return_dict_in_generate=True)
    with tree_settings(draft, total_tokens=10, depth=3, top_k=3):
        out = target.generate(prompt, max_new_tokens=30, **kwargs)
        cache = out["cache" if "cache" in out else "past_key_values"]
        assert isinstance(cache, StaticCache)
        assert cache.layers[0].max_cache_len >= prompt.shape[1] + 30 + 11  # max_length + root + 10 draft nodes
        # The cache holds exactly the returned sequence but its last token, as after plain generate.
        assert int(cache.get_seq_length()) == out.sequences.shape[1] - 1
        # ... and its entries are right: continuing from it gives the logits of a fresh forward over the sequence.
        with torch.no_grad():
            following = target(out.sequences[:, -1:], **{cache_kwarg(target): cache}).logits[0, -1]
            torch.testing.assert_close(following, target(out.sequences).logits[0, -1], rtol=1e-4, atol=1e-4)
        longer = cache.layers[0].max_cache_len
        shorter = target.generate(prompt[:, :3], max_new_tokens=5, **kwargs)
        shorter_cache = shorter["cache" if "cache" in shorter else "past_key_values"]
        # One size per target, as generate does for static caches: a compiled forward keeps its shapes.
        assert shorter_cache.layers[0].max_cache_len == longer


def test_static_left_padding(pairs):
    target, draft = pairs("qwen2")
    prompt = torch.tensor([[0, 0, 0, 7, 9, 33, 17]])
    mask = (prompt != 0).long()
    expected = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=25)
    got = target.generate(
        prompt, attention_mask=mask, do_sample=False, max_new_tokens=25, assistant_model=draft,
        cache_implementation="static",
    )
    assert torch.equal(got, expected)


def test_static_compaction_matches_dynamic():
    """keep_accepted on a StaticCache leaves the same keys/values in [0, prefix + path) as on a DynamicCache."""
    target = make_target("llama")
    tokens = torch.randint(3, 100, (1, 9))
    dynamic, static = new_target_cache(target.config), new_target_cache(target.config, static_length=16)
    with torch.no_grad():
        for cache in (dynamic, static):
            target(tokens, **{cache_kwarg(target): cache})
    path = torch.tensor([0, 2, 4])  # node indices of a 5-node tree after a prefix of 4
    keep_accepted(dynamic, 4, path)
    keep_accepted(static, 4, path)
    assert dynamic.get_seq_length() == int(static.get_seq_length()) == 7
    for d, s in zip(dynamic.layers, static.layers):
        torch.testing.assert_close(s.keys[:, :, :7], d.keys, rtol=0, atol=0)
        torch.testing.assert_close(s.values[:, :, :7], d.values, rtol=0, atol=0)
    truncate(static, 5)
    assert int(static.get_seq_length()) == 5


def test_padded_nodes_are_never_accepted():
    """A dummy carries the root's token under the root; even when the target picks exactly that token there, only
    real nodes are accepted, and the real part of the tree is unchanged."""
    parents = torch.tensor([-1, 0, 0, 1])
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7, 8]),
        parents=parents,
        depths=torch.tensor([0, 1, 1, 2]),
        ancestors=ancestor_matrix(parents, 2),
        scores=torch.tensor([0.0, -1.0, -2.0, -3.0]),
    )
    padded = tree.padded(7)
    assert padded.num_nodes == 7 and padded.real.tolist() == [True] * 4 + [False] * 3
    assert torch.equal(padded.ancestors[:4, :4], tree.ancestors) and not padded.ancestors[:4, 4:].any()
    # the target picks the root's token (the dummies' token) at the root: nothing matches but dummies
    choices = torch.tensor([5, 8, 0, 0, 0, 0, 0])
    path, bonus = verification.accept(padded, choices)
    assert path.tolist()[0] == 0 and (path[1:] == -1).all() and int(bonus) == 5
    # a real path is still found: root -> 6 -> 8
    choices = torch.tensor([6, 8, 0, 0, 6, 6, 6])
    path, bonus = verification.accept(padded, choices)
    assert path.tolist() == [0, 1, 3] and int(bonus) == 0
    with pytest.raises(ValueError):
        tree.padded(3)


def test_static_mask_hides_everything_after_the_tree():
    parents = torch.tensor([-1, 0, 1])
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7]), parents=parents, depths=torch.tensor([0, 1, 2]),
        ancestors=ancestor_matrix(parents, 2), scores=torch.zeros(3),
    )
    mask = tree.attention_mask(4, torch.float32, padding=1, kv_length=10)
    assert mask.shape == (1, 1, 3, 10)
    visible = mask[0, 0] == 0
    assert visible[:, 1:4].all() and not visible[:, 0].any() and not visible[:, 7:].any()
    assert torch.equal(visible[:, 4:7], tree.ancestors)
    with pytest.raises(ValueError, match="at least 7"):
        tree.attention_mask(4, torch.float32, kv_length=6)


def test_sliding_window_static_cache_is_refused():
    target = make_target("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window"):
        new_target_cache(target.config, static_length=32)
    assert isinstance(new_target_cache(make_target("llama").config), DynamicCache)


@pytest.mark.parametrize("top_k, contrastive", [(3, True), (1, True), (3, False)])
def test_static_draft_expands_the_same_trees(pairs, top_k, contrastive):
    """Round after round, the draft over its static cache (fixed k-row steps, reads in k-row chunks with padding)
    proposes exactly the trees of the dynamic draft; reads of 1 to 5 positions cover one chunk, several chunks and a
    padded last chunk."""
    target, draft = pairs("llama")
    draft.bind_target(target)
    settings = TreeSettings.resolve(draft, total_tokens=12, depth=3, top_k=top_k, contrastive=contrastive)
    dynamic = JakiroCandidateGenerator(draft, settings)
    static = JakiroCandidateGenerator(draft, settings, static_length=64)
    sequence = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        features = target(sequence, output_hidden_states=True).hidden_states[-1][0]
    past = 0
    for read in [10, 1, 2, 5, 3, 4]:  # positions read per round: the prompt, then each round's accepted ones
        trees = []
        for generator in (dynamic, static):
            generator.observe(features[past : past + read], [])
            trees.append(generator.get_candidates(sequence[:, : past + read + 1]))
        past += read
        assert torch.equal(trees[0].tokens, trees[1].tokens), f"after {past}"
        assert torch.equal(trees[0].parents, trees[1].parents), f"after {past}"
        torch.testing.assert_close(trees[0].scores, trees[1].scores, rtol=1e-5, atol=1e-5)
        assert dynamic.cached_length() == static.cached_length() == past


def test_static_cache_passed_to_generate(pairs):
    """A StaticCache of the caller's is filled in place when large enough (as plain generate fills it), and refused
    with a clear error when a tree would not fit."""
    target, draft = pairs("llama")
    prompt = torch.tensor([[5, 9, 33, 17]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
    with tree_settings(draft, total_tokens=10, depth=3, top_k=3):
        cache = StaticCache(config=target.config, max_cache_len=64)
        got = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft,
                              **{cache_kwarg(target): cache})
        assert torch.equal(got, expected)
        assert int(cache.get_seq_length()) == got.shape[1] - 1
        with pytest.raises(ValueError, match="needs 35"):  # max_length 24 + 11 tree nodes
            target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft,
                            **{cache_kwarg(target): StaticCache(config=target.config, max_cache_len=30)})


def test_offloaded_static_cache_is_refused(pairs):
    """`cache_implementation="offloaded_static"` needs CUDA streams; its cache is marked `offloading`, which is what
    the check reads (set by hand here, on a CPU)."""
    target, draft = pairs("llama")
    cache = StaticCache(config=target.config, max_cache_len=64)
    cache.offloading = True
    with pytest.raises(ValueError, match="offloaded caches .cache_implementation=.offloaded_static.*Use cache_implementation=.static."):
        target.generate(torch.tensor([[5, 9]]), max_new_tokens=3, assistant_model=draft, **{cache_kwarg(target): cache})
