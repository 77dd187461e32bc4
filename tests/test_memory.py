"""What long prompts cost: the target's prefill keeps only the last layer's hidden states, the draft's prefill builds
no [T, T] mask, and draft attention shares key/value heads without copying the KV cache. Allocations are read with
the torch profiler (the largest single allocation of any op), so the tests hold whatever the implementation.
`benchmarks/memory.py` measures the whole generation against plain `generate`."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from benchmark_scripts import load_script
from tiny_models import ARCHS, make_target
from transformers_jakiro import JakiroDraftModel, modeling_jakiro
from transformers_jakiro.features import TargetFeatures


def largest_allocation(fn) -> tuple[int, str]:
    """(bytes, op name) of the largest memory any single op allocated while `fn` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    event = max(prof.events(), key=lambda e: e.cpu_memory_usage)
    return event.cpu_memory_usage, event.name


@pytest.fixture(scope="module")
def target_and_draft():
    target = make_target("llama")
    return target, JakiroDraftModel.from_target(target).eval()


def test_decoding_never_asks_the_target_for_every_layer(target_and_draft):
    """`output_hidden_states=True` at the prefill keeps all layers' states (~8.6 GB for an 8B model at 32k)."""
    target, draft = target_and_draft
    asked = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: asked.append(bool(kwargs.get("output_hidden_states"))), with_kwargs=True
    )
    try:
        prompt = torch.randint(3, 128, (1, 40))
        got = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=draft)
    finally:
        handle.remove()
    assert len(asked) > 2 and not any(asked)
    assert torch.equal(got, target.generate(prompt, do_sample=False, max_new_tokens=12))


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_last_hidden_state_is_the_last_entry_of_hidden_states(arch):
    target = make_target(arch)
    prompt = torch.randint(3, 128, (1, 17))
    with torch.no_grad():
        expected = target(prompt, output_hidden_states=True).hidden_states[-1]
        with TargetFeatures(target) as hidden:
            assert hidden.forward_kwargs() == {}
            got = hidden.take(target(prompt))
    assert torch.equal(got, expected)


def test_draft_prefill_builds_no_square_mask(target_and_draft):
    """The draft reads the whole prompt once; a [T, T] float mask (plus a bool one) was ~3 GB at 32k tokens."""
    _, draft = target_and_draft
    length = 2048
    ids, features = torch.randint(3, 128, (1, length)), torch.randn(1, length, 64)
    with torch.no_grad():
        size, op = largest_allocation(
            lambda: draft(input_ids=ids, hidden_states=features, cache=DynamicCache(), features_to_keep=1)
        )
    assert size < length * length, f"{op} allocated {size} bytes for a {length}-token prefill"


def test_draft_attention_does_not_copy_the_kv_cache_per_query_head(target_and_draft):
    """With 4 query heads on 2 key/value heads, repeat_interleave copied the whole cache twice over at every level."""
    _, draft = target_and_draft
    length, k = 4096, 10
    cache = DynamicCache()
    ids, features = torch.randint(3, 128, (1, length)), torch.randn(1, length, 64)
    with torch.no_grad():
        draft(input_ids=ids, hidden_states=features, cache=cache, features_to_keep=1)
        cache_bytes = cache.layers[0].keys.numel() * cache.layers[0].keys.element_size()
        tree_level = dict(
            input_ids=ids[:, :k], hidden_states=features[:, :k], position_ids=torch.full((1, k), length),
            attention_mask=torch.ones(1, 1, k, length + k, dtype=torch.bool), cache=cache,
        )
        size, op = largest_allocation(lambda: draft(**tree_level))
    heads_per_kv = draft.config.num_attention_heads // draft.config.num_key_value_heads
    assert heads_per_kv == 2
    # the cache's own update (a concatenation) copies it once; a per-head copy would be twice that
    assert size < heads_per_kv * cache_bytes, f"{op} allocated {size} bytes, the cache is {cache_bytes}"


@pytest.mark.parametrize("past, queries", [(0, 37), (29, 1), (29, 6)])
def test_causal_and_grouped_attention_equal_the_explicit_mask_path(target_and_draft, monkeypatch, past, queries):
    """SDPA's causal path and its grouped-query heads compute what an explicit additive mask over copied heads does."""
    _, draft = target_and_draft
    g = torch.Generator().manual_seed(past + queries)
    ids, features = torch.randint(3, 128, (1, past + queries), generator=g), torch.randn(1, past + queries, 64, generator=g)

    def run(explicit: bool):
        cache = DynamicCache()
        with torch.no_grad():
            if past:
                draft(input_ids=ids[:, :past], hidden_states=features[:, :past], cache=cache)
            mask = modeling_jakiro.causal_mask(queries, past, torch.float32, "cpu") if explicit else None
            out = draft(input_ids=ids[:, past:], hidden_states=features[:, past:], attention_mask=mask, cache=cache)
        return out.last_hidden_state, out.contrastive_hidden_state

    fast = run(explicit=False)
    monkeypatch.setattr(modeling_jakiro, "_SDPA_GQA", False)  # the repeat_interleave path
    reference = run(explicit=True)
    for mine, theirs in zip(fast, reference):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_memory_benchmark_script_runs_on_a_tiny_target(tmp_path):
    """benchmarks/memory.py end to end at a tiny size, so that it cannot rot (its numbers are in benchmarks/results)."""
    module = load_script("memory.py", "memory_benchmark")
    result = module.main(["--target", "tiny", "--prompt-tokens", "256", "--new-tokens", "4", "--out", str(tmp_path)])
    assert result["identical_outputs"] and result["plain"]["peak_added_bytes"] > 0
    assert (tmp_path / "results.json").exists() and "Jakiro / plain" in (tmp_path / "results.md").read_text()
