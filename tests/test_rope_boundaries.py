"""Position-dependent RoPE (`decoding/rope.py`): targets whose frequencies depend on the largest position in a forward, with
the boundary inside the generated span. Greedy output equals plain generate token for token; sampled runs see
exactly the logits plain generate computes along the same tokens; batches that could cross are refused by name."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tiny_models import ROPE_BOUNDARY, VOCAB, make_target, quick_trained_draft
from transformers_jakiro import jakiro_generate, tree_settings
from transformers_jakiro.decoding.rope import RopeBoundary, RopeLimits, deepest_level, rope_limits


def _follows_plain(target) -> bool:
    """False for Phi-3 on a transformers release whose generate drops the cache at the boundary and decodes without
    context from there (5.17): Jakiro refuses to cross it there."""
    limits = rope_limits(target)
    return limits is None or limits.recomputes_whole

BOUNDARY = ROPE_BOUNDARY
KINDS = {"phi3-longrope": ("phi3", "longrope"), "llama-longrope": ("llama", "longrope"),
         "llama-dynamic": ("llama", "dynamic")}


@pytest.fixture(scope="module")
def pairs():
    built = {}

    def get(kind):
        if kind not in built:
            arch, rope = KINDS[kind]
            target = make_target(arch, rope=rope)
            built[kind] = (target, quick_trained_draft(target, steps=120))
        return built[kind]

    return get


def test_limits_are_read_from_the_config(pairs):
    phi3, _ = pairs("phi3-longrope")
    limits = rope_limits(phi3)
    assert limits.boundaries == (RopeBoundary("longrope", BOUNDARY),) and limits.recompute_at == BOUNDARY
    # transformers 5.17's Phi-3 generate feeds one token without a cache there; later releases recompute the sequence.
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.18"):
        assert not limits.recomputes_whole
    llama, _ = pairs("llama-longrope")
    assert rope_limits(llama) == RopeLimits((RopeBoundary("longrope", BOUNDARY),), None, True)
    dynamic, _ = pairs("llama-dynamic")
    assert rope_limits(dynamic) == RopeLimits((RopeBoundary("dynamic", BOUNDARY),), None, True)
    assert rope_limits(make_target("llama")) is None
    # Phi-3 recomputes at its original_max_position_embeddings (4096 by default) whatever its RoPE type.
    assert rope_limits(make_target("phi3")).recompute_at == 4096


def test_boundary_rules():
    longrope, dynamic = RopeBoundary("longrope", 32), RopeBoundary("dynamic", 32)
    assert longrope.allows(20, 31) and longrope.allows(32, 40) and not longrope.allows(31, 32)
    assert dynamic.allows(20, 31) and not dynamic.allows(32, 33) and not dynamic.allows(31, 32)
    recompute = RopeLimits((), recompute_at=32)
    assert recompute.allows(20, 31) and recompute.allows(33, 40) and not recompute.allows(32, 32)
    assert not recompute.allows(30, 35)
    # Positions do not count left padding; the recomputed index does (it is a sequence length in generate).
    padded = RopeLimits((longrope,), None)
    assert padded.allows(30, 35, padding=4) and not padded.allows(30, 36, padding=4)


def test_deepest_level_bounds_every_choice():
    from transformers_jakiro.decoding.round_controller import RoundChoice
    from transformers_jakiro.decoding.drafter import TreeSettings

    settings = TreeSettings(total_tokens=20, depth=5, top_k=4, contrastive=True, lookup_tokens=8)
    assert deepest_level(RoundChoice("plain"), settings) == 0
    assert deepest_level(RoundChoice("lookup"), settings) == 8
    assert deepest_level(RoundChoice("tree", 6, 3, 2), settings) == 8
    assert deepest_level(None, TreeSettings(total_tokens=20, depth=5, top_k=4, contrastive=True)) == 6


def _prompts(seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    # Lengths from well below to just below the boundary: generation crosses it at every offset within a tree's depth.
    return [torch.randint(3, VOCAB, (1, int(torch.randint(14, BOUNDARY, (1,), generator=g))), generator=g)
            for _ in range(count)]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("route", ["assistant", "custom", "controller", "lookup", "padded"])
def test_greedy_across_the_boundary_equals_plain_generate(pairs, kind, route):
    target, draft = pairs(kind)
    if not _follows_plain(target):
        with pytest.raises(ValueError, match="drops its cache at sequence length 33.*Upgrade transformers"):
            target.generate(_prompts(0, 1)[0], max_new_tokens=28, assistant_model=draft)
        return
    longest = 0
    for prompt in _prompts(sum(map(ord, route)), 6):
        inputs = {"input_ids": prompt}
        if route == "padded":
            pad = torch.zeros(1, 3, dtype=torch.long)
            inputs = {"input_ids": torch.cat([pad, prompt], 1),
                      "attention_mask": torch.cat([pad, torch.ones_like(prompt)], 1)}
        options = dict(do_sample=False, max_new_tokens=28, pad_token_id=0)
        expected = target.generate(**inputs, **options)
        if route == "custom":
            got = target.generate(**inputs, **options, custom_generate=jakiro_generate, draft=draft)
        else:
            overrides = {"adaptive": route == "controller", "lookup_tokens": 6 if route == "lookup" else 0}
            with tree_settings(draft, **overrides):
                got = target.generate(**inputs, **options, assistant_model=draft)
        assert torch.equal(got, expected), (kind, route, prompt.tolist())
        longest = max(longest, *draft.last_generation_stats.accepted_lengths)
    assert longest > 1  # trees were accepted, not only plain steps


class _Force(LogitsProcessor):
    """Makes plain greedy generate follow a given continuation (the raw logits it reports are untouched)."""

    def __init__(self, continuation):
        self.continuation = continuation

    def __call__(self, input_ids, scores):
        token = self.continuation[input_ids.shape[1] - self.start]
        forced = torch.full_like(scores, float("-inf"))
        forced[:, token] = 0.0
        return forced


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampling_sees_plain_generates_logits_across_the_boundary(pairs, kind):
    """Sampling draws every token from the target's processed logits at its prefix (the acceptance rule's
    distribution is tested in test_sampling.py); here those logits must be the ones plain generate computes along the
    same tokens, boundary included: plain greedy generate is forced along the sampled tokens and both report raw
    logits."""
    target, draft = pairs(kind)
    if not _follows_plain(target):
        pytest.skip("this transformers release's Phi-3 generate decodes without context past the boundary (refused)")
    for seed, prompt in enumerate(_prompts(7, 4)):
        torch.manual_seed(seed)
        options = dict(max_new_tokens=28, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        sampled = target.generate(prompt, do_sample=True, assistant_model=draft, **options)
        continuation = sampled.sequences[0, prompt.shape[1]:].tolist()
        force = _Force(continuation)
        force.start = prompt.shape[1]
        plain = target.generate(prompt, do_sample=False, logits_processor=LogitsProcessorList([force]),
                                min_new_tokens=len(continuation), **{**options, "max_new_tokens": len(continuation)})
        assert torch.equal(plain.sequences, sampled.sequences)
        ours, theirs = torch.cat(sampled.logits), torch.cat(plain.logits)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_batches_that_could_cross_are_refused_and_the_rest_exact(pairs, kind):
    target, draft = pairs(kind)
    prompts = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="position-dependent RoPE boundary.*one at a time"):
        target.generate(prompts, do_sample=False, max_new_tokens=40, assistant_model=draft)
    # Below the boundary (and the recomputation): identical to plain batched generate.
    expected = target.generate(prompts, do_sample=False, max_new_tokens=18, pad_token_id=0)
    got = target.generate(prompts, do_sample=False, max_new_tokens=18, pad_token_id=0, assistant_model=draft)
    assert torch.equal(got, expected)


def test_static_cache_is_refused_where_phi3_recomputes(pairs):
    target, draft = pairs("phi3-longrope")
    prompt = torch.randint(3, VOCAB, (1, 20))
    with pytest.raises(ValueError, match="recomputes its whole cache" if _follows_plain(target) else "drops its cache"):
        target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft, cache_implementation="static")
