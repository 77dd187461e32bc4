"""Batches (B > 1) over a static cache: every row identical to plain batched `generate` (float32 greedy), with idle
slots for finished rows, the shared columns packed when holes would overflow the static length, and the verify forward
compiled (inductor on the CPU) with fixed shapes: no recompiles from round to round or from prompt to prompt."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from test_batch import random_batch
from tiny_models import ARCHS, trained_pairs
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding import batch_rounds as batch_loop


@pytest.fixture(scope="module")
def pairs():
    return trained_pairs()


@pytest.fixture
def packs(monkeypatch):
    """Counts the times the shared static columns were packed (`kv_cache.pack_present`)."""
    calls = []
    pack = batch_loop.pack_present

    def counted(cache, key_mask):
        calls.append(key_mask.shape[1])
        return pack(cache, key_mask)

    monkeypatch.setattr(batch_loop, "pack_present", counted)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_static_batch_rows_identical_to_plain_batched_generate(arch, pairs, packs):
    """B in {2, 4}; lookup and the round controller on and off; processors that read the prefix; an EOS that some
    rows reach early (their slots then idle); generations long enough that holes fill the static length."""
    target, draft = pairs(arch)
    g = torch.Generator().manual_seed(23 + ARCHS.index(arch))
    for size in (2, 4):
        for lookup, controller, max_new in [(0, False, 60), (4, True, 40), (4, False, 30)]:
            batch = random_batch(g, size)
            kwargs = dict(do_sample=False, max_new_tokens=max_new)
            if lookup and not controller:
                kwargs.update(repetition_penalty=1.3, no_repeat_ngram_size=4)
            if controller:  # a token row 0 emits early: that row finishes first and its slot idles
                kwargs["eos_token_id"] = int(target.generate(**batch, do_sample=False, max_new_tokens=6)[0, -1])
            expected = target.generate(**batch, **kwargs)
            with tree_settings(draft, lookup_tokens=lookup, adaptive=controller):
                got = target.generate(**batch, assistant_model=draft, cache_implementation="static", **kwargs)
            assert torch.equal(got, expected), (size, lookup, controller)
    assert packs, "no generation left enough holes to pack the static columns"


def compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling on CPU
    return config


@pytest.mark.compile
@pytest.mark.parametrize("size", [2, 4])
def test_compiled_static_batch_is_exact_without_recompiles(size, pairs):
    """After one warm-up call, batches of other prompts and lengths run the compiled verify forward without a
    recompile (fail_on_recompile), rows finishing at different steps included, identical to plain batched generate."""
    target, draft = pairs("llama")
    torch._dynamo.reset()
    config = compile_config()
    g = torch.Generator().manual_seed(5 + size)
    settings = dict(total_tokens=12, depth=3, top_k=3, adaptive=False)
    common = dict(do_sample=False, cache_implementation="static", max_cache_len=160)
    before = counters["stats"]["unique_graphs"]
    with tree_settings(draft, **settings):
        target.generate(**random_batch(g, size), assistant_model=draft, max_new_tokens=8, compile_config=config,
                        **common)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == before + 1  # the verify forward, compiled once without graph breaks (the draft stays eager)
    for i in range(3):
        batch = random_batch(g, size)
        max_new = int(torch.randint(20, 50, (1,), generator=g))
        kwargs = dict(do_sample=False, max_new_tokens=max_new)
        if i == 1:  # rows finish at different steps
            kwargs["eos_token_id"] = int(target.generate(**batch, do_sample=False, max_new_tokens=5)[0, -1])
        expected = target.generate(**batch, **kwargs)
        with tree_settings(draft, **settings), torch.compiler.set_stance("fail_on_recompile"):
            got = target.generate(**batch, assistant_model=draft, compile_config=config, **{**common, **kwargs})
        assert torch.equal(got, expected), i
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
