"""Compiled Jakiro decoding on CPU (inductor): `generate(..., assistant_model=draft, cache_implementation="static",
compile_config=...)` runs every verification round (the target's forward, acceptance, cache compaction) through the
compiled `verify_round` and every draft round (the read, the levels, ranking and flattening) through the compiled
`draft_round`: two graphs, two graph calls per round, for every round and every prompt, with greedy output
token-identical to plain generate and to eager Jakiro.

Compiling is expensive on 2 CPU cores (tens of seconds per model), so each architecture's target is compiled once,
in a module-scoped fixture, and every check runs against it."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from tiny_models import make_target, quick_trained_draft, random_prompt
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding import drafter as drafting

pytestmark = pytest.mark.compile

# Small trees with n-gram lookup chains: rounds differ in their real node count (lookup-only rounds verify a chain
# alone), so the padding to one shape is what keeps the compiled graph unique.
TREE = dict(total_tokens=12, depth=3, top_k=3, lookup_tokens=3)
MAX_CACHE_LEN = 96  # one static size for every call, as a user sets `max_cache_len` to avoid recompiles


def compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode="default")  # fullgraph: a graph break would be an error
    config._compile_all_devices = True  # transformers' switch for compiling on CPU ("useful for testing purposes")
    return config


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-fused"])
def compiled(request):
    """(target, draft, config) after one warm-up generate that compiled the verify round and the draft round. `llama-fused`: a head that reads two more target layers (hooks inside the compiled forward; the draft round
    still one graph)."""
    torch._dynamo.reset()
    fused = request.param.endswith("-fused")
    target = make_target(request.param.removesuffix("-fused"), num_hidden_layers=4 if fused else 2)
    draft = quick_trained_draft(target, steps=150, **({"target_feature_layers": [0, 2]} if fused else {}))
    config = compile_config()
    graphs = counters["stats"]["unique_graphs"]
    with tree_settings(draft, **TREE):
        target.generate(
            torch.tensor([[5, 9, 33, 5, 9]]), do_sample=False, max_new_tokens=8, assistant_model=draft,
            cache_implementation="static", compile_config=config, max_cache_len=MAX_CACHE_LEN,
        )
    # the verify round and the draft round, each compiled once, without graph breaks
    assert counters["stats"]["unique_graphs"] == graphs + 2, counters["stats"]["unique_graphs"] - graphs
    yield target, draft, config
    torch._dynamo.reset()


def test_compiled_greedy_identical_and_never_recompiled(compiled, monkeypatch):
    target, draft, config = compiled
    # Count the rounds that went through the compiled verify round (every round but the eager prefill).
    calls, draft_calls = [], []
    for key, fn in list(drafting._COMPILED.items()):  # keyed by (the function's name, the compile options)
        counted = calls if key[0] == "verify_round" else draft_calls
        monkeypatch.setitem(drafting._COMPILED, key, lambda *a, _fn=fn, _c=counted, **k: _c.append(1) or _fn(*a, **k))
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(11)
    rounds, tree_rounds, accepted = 0, 0, set()
    for i in range(6):
        prompt = random_prompt(g, 3, 20)
        max_new = int(torch.randint(16, 40, (1,), generator=g))
        kwargs = dict(do_sample=False, max_new_tokens=max_new)
        expected = target.generate(prompt, **kwargs)
        with tree_settings(draft, **TREE):
            eager_static = target.generate(
                prompt, assistant_model=draft, cache_implementation="static", max_cache_len=MAX_CACHE_LEN, **kwargs
            )
            with torch.compiler.set_stance("fail_on_recompile"):  # a recompilation would raise here
                got = target.generate(
                    prompt, assistant_model=draft, cache_implementation="static", max_cache_len=MAX_CACHE_LEN,
                    compile_config=config, **kwargs,
                )
        stats = draft.last_generation_stats
        rounds += stats.draft_rounds
        tree_rounds += sum(choice.startswith("tree") for choice in stats.choices)
        accepted.update(stats.accepted_lengths[1:])
        assert torch.equal(eager_static, expected), f"prompt {i}"
        assert torch.equal(got, expected), f"prompt {i}"
    assert counters["stats"]["unique_graphs"] == graphs  # prompts of other lengths, rounds of other acceptances
    assert len(calls) == rounds >= 64  # every round, over many rounds, in the two graphs compiled at warm-up
    # one compiled draft call per round with a draft tree (lookup-only and plain rounds have none)
    assert len(draft_calls) == tree_rounds > 0
    assert len(accepted) >= 2 and max(accepted) >= 2  # rounds really differed in what they kept


def test_compile_follows_transformers_criteria(compiled, monkeypatch):
    """Without `compile_config` on a CPU (or with `disable_compile`), generate would not compile: neither does
    Jakiro; its rounds then run the target and the draft eagerly."""
    target, draft, config = compiled
    compiled_call, calls = target._compiled_call, []
    monkeypatch.setattr(target, "_compiled_call", lambda *args, **kwargs: calls.append(1) or compiled_call(*args, **kwargs))
    for key, fn in list(drafting._COMPILED.items()):
        monkeypatch.setitem(drafting._COMPILED, key, lambda *a, _fn=fn, **k: calls.append(2) or _fn(*a, **k))
    prompt = torch.tensor([[7, 8, 9, 10]])
    with tree_settings(draft, **TREE):
        target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=draft, cache_implementation="static")
        target.generate(
            prompt, do_sample=False, max_new_tokens=6, assistant_model=draft, cache_implementation="static",
            compile_config=config, disable_compile=True,
        )
    assert calls == []
