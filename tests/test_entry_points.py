"""Both entry points behave like plain `generate` at its edges: the caller's cache, lookup settings, stop strings,
drafts for another vocabulary, synced_gpus, and the static draft cache's first read."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from tiny_models import make_tokenizer, trained_pairs
from transformers_jakiro import JakiroDraftModel, jakiro_generate, tree_settings
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # repeats itself: n-gram lookup proposes chains


@pytest.fixture(scope="module")
def pair():
    return trained_pairs()("llama")


def _cache_of(output):
    return output["cache"] if "cache" in output else output["past_key_values"]


def test_the_callers_dynamic_cache_is_filled(pair):
    target, draft = pair
    plain_cache, jakiro_cache, custom_cache = DynamicCache(), DynamicCache(), DynamicCache()
    kwargs = dict(do_sample=False, max_new_tokens=20, return_dict_in_generate=True)
    plain = target.generate(PROMPT, past_key_values=plain_cache, **kwargs)
    jakiro = target.generate(PROMPT, past_key_values=jakiro_cache, assistant_model=draft, **kwargs)
    custom = target.generate(
        PROMPT, past_key_values=custom_cache, custom_generate=jakiro_generate, draft=draft, **kwargs
    )
    assert torch.equal(jakiro.sequences, plain.sequences) and torch.equal(custom.sequences, plain.sequences)
    for cache, output in ((jakiro_cache, jakiro), (custom_cache, custom)):
        assert _cache_of(output) is cache  # the caller's object, as plain generate returns it
        assert cache.get_seq_length() == plain_cache.get_seq_length() == plain.sequences.shape[1] - 1
        for mine, theirs in zip(cache.layers, plain_cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_offloaded_and_other_caches_are_refused_by_name(pair):
    target, draft = pair
    offloaded = DynamicCache()
    offloaded.offloading = True  # what cache_implementation="offloaded" builds (it needs an accelerator to run)
    with pytest.raises(ValueError, match="offloaded caches .*cache_implementation='dynamic'"):
        target.generate(PROMPT, past_key_values=offloaded, max_new_tokens=4, assistant_model=draft)

    class OtherCache(Cache):  # stands for QuantizedCache and other layouts the tree path cannot edit
        def __init__(self):
            super().__init__(layers=[DynamicLayer()])

    with pytest.raises(ValueError, match="The cache passed to generate uses a OtherCache"):
        target.generate(PROMPT, past_key_values=OtherCache(), max_new_tokens=4, assistant_model=draft)


@pytest.mark.parametrize(
    "settings",
    [
        dict(lookup_tokens=4, lookup_chains=2, lookup_max_ngram=2),
        dict(total_tokens=6, depth=2, top_k=2, lookup_tokens=0),
        dict(total_tokens=8, depth=3, top_k=2, contrastive=False, fixed_shape=True),
    ],
)
def test_both_entry_points_take_the_same_settings(pair, settings):
    target, draft = pair
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=24)
    with tree_settings(draft, **settings):
        assisted = target.generate(PROMPT, do_sample=False, max_new_tokens=24, assistant_model=draft)
    assisted_stats = draft.last_generation_stats
    custom = target.generate(
        PROMPT, do_sample=False, max_new_tokens=24, custom_generate=jakiro_generate, draft=draft, **settings
    )
    assert torch.equal(assisted, plain) and torch.equal(custom, plain)
    assert draft.last_generation_stats.accepted_lengths == assisted_stats.accepted_lengths
    assert draft.last_generation_stats.lookup_rounds == assisted_stats.lookup_rounds
    if settings.get("lookup_tokens"):
        assert assisted_stats.lookup_rounds > 0


def test_prompt_lookup_num_tokens_reaches_both_entry_points(pair):
    """`prompt_lookup_num_tokens=k` beside a Jakiro draft: lookup chains of k tokens inside the tree, for either entry
    point (custom_generate ignored it before), and 0 turns the draft's own lookup off."""
    target, draft = pair
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=24)
    for k in (3, 0):
        kwargs = dict(do_sample=False, max_new_tokens=24, prompt_lookup_num_tokens=k, max_matching_ngram_size=2)
        with tree_settings(draft, lookup_tokens=5):  # overridden by the generation config
            assisted = target.generate(PROMPT, assistant_model=draft, **kwargs)
            assisted_stats = draft.last_generation_stats
            custom = target.generate(PROMPT, custom_generate=jakiro_generate, draft=draft, **kwargs)
        assert torch.equal(assisted, plain) and torch.equal(custom, plain)
        assert draft.last_generation_stats.accepted_lengths == assisted_stats.accepted_lengths
        assert (assisted_stats.lookup_rounds > 0) == (k > 0)
        assert (draft.last_generation_stats.lookup_rounds > 0) == (k > 0)


def test_stop_strings_with_both_entry_points():
    """transformers drops the tokenizer that a custom_generate callable would need for `stop_strings`; the package's
    hook keeps it for jakiro_generate, so the stop lands where plain generate's does."""
    target, draft = trained_pairs()("qwen2")
    tokenizer = make_tokenizer()
    prompt = torch.tensor([[40, 41, 42, 43]])
    free = target.generate(prompt, do_sample=False, max_new_tokens=30)
    text = tokenizer.decode(free[0, 4:])
    stop = text[8:10]  # two characters the free run produces
    kwargs = dict(do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    plain = target.generate(prompt, **kwargs)
    assert plain.shape[1] < free.shape[1]
    assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), plain)
    assert torch.equal(target.generate(prompt, custom_generate=jakiro_generate, draft=draft, **kwargs), plain)


def test_draft_for_another_vocabulary_gets_our_error_first(pair):
    """Before: transformers' "different tokenizers" error (it compares vocabulary sizes) came first."""
    from tiny_models import make_target

    target, _ = pair
    other = JakiroDraftModel.from_target(make_target("llama", vocab_size=96))
    with pytest.raises(ValueError, match="vocabulary: the draft expects 96 tokens, the target has 128"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=other)


def test_synced_gpus_is_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="synced_gpus"):
        target.generate(PROMPT, max_new_tokens=4, assistant_model=draft, synced_gpus=True)
    with pytest.raises(ValueError, match="synced_gpus"):
        target.generate(PROMPT, max_new_tokens=4, custom_generate=jakiro_generate, draft=draft, synced_gpus=True)


def test_static_and_dynamic_draft_trees_are_identical_from_the_first_round(pair, monkeypatch):
    """With a one-token prompt the draft's first read over its static cache attended to the empty slots (no mask for
    one query): the first tree differed from the dynamic cache's (the output was still the target's)."""
    target, draft = pair
    trees = []
    original = JakiroCandidateGenerator.get_candidates

    def recording(self, input_ids, choice=None):
        tree = original(self, input_ids, choice)
        trees[-1].append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    monkeypatch.setattr(JakiroCandidateGenerator, "get_candidates", recording)
    outputs = []
    for cache in (None, "static"):
        trees.append([])
        with tree_settings(draft, total_tokens=10, depth=3, top_k=3, fixed_shape=True):
            outputs.append(
                target.generate(
                    torch.tensor([[9]]), do_sample=False, max_new_tokens=16, assistant_model=draft,
                    cache_implementation=cache,
                )
            )
    assert torch.equal(outputs[0], outputs[1])
    assert trees[0] and trees[0] == trees[1]


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_output_flags_are_ignored_as_plain_generate_ignores_them(pair, flag):
    """Without return_dict_in_generate, plain generate ignores output_attentions / output_hidden_states (they reach
    the decoding loop among the model inputs); both entry points do too, for one row and for a batch. With it, plain
    generate returns per-step tensors, which tree decoding does not produce: refused by name."""
    target, draft = pair
    batch = torch.cat([PROMPT, PROMPT.flip(1)])
    for inputs in (PROMPT, batch):
        expected = target.generate(inputs, do_sample=False, max_new_tokens=10, **{flag: True})
        for entry in ({"assistant_model": draft}, {"custom_generate": jakiro_generate, "draft": draft}):
            got = target.generate(inputs, do_sample=False, max_new_tokens=10, **{flag: True}, **entry)
            assert torch.equal(got, expected)
            with pytest.raises(ValueError, match=f"does not return per-step attentions or hidden states; got {flag}"):
                target.generate(inputs, max_new_tokens=10, return_dict_in_generate=True, **{flag: True}, **entry)
