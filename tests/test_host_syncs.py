"""Host syncs per round, counted, so that they cannot creep back.

On an accelerator every place where the host waits for the device, or hands it host data, stalls the launch queue;
with a cheap draft and a fast target they decide the speed. The count is a torch dispatch mode
(`benchmarks/round_cost.py`, `HostSyncCounter`): value reads (`item`, `int()`, `bool()`, indexing with a 0-dim
tensor), ops whose output size depends on data (`nonzero`, boolean-mask indexing), Python data turned into a tensor
(`torch.tensor(list)`, a Python scalar written into a tensor: a blocking host-to-device copy on an accelerator), and
`tolist` / `numpy` / `cpu`. Where CUDA is present its sync debug mode counts instead.

The counted decode is the accelerator path (full logits in the verify forward; the CPU path's lazy leaf logits add a
host round trip on purpose), greedy, a tiny Llama; one row and a batch of four. The first round is left out: the
draft's first forward also initializes its DynamicCache (transformers creates each layer's empty tensors then).
"""

import warnings

import pytest
import torch

from benchmark_scripts import load_script
from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding import row_rounds as decoding
from transformers_jakiro.decoding import batch_rounds as batch_loop
from transformers_jakiro.decoding.batch_drafter import BatchDrafter
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator

HostSyncCounter = load_script("round_cost.py", "round_cost").HostSyncCounter

ROUND_LIMIT = 1  # one row, greedy: the round's one read (path, tokens, lookup count, stopping verdicts)
ROUND_LIMIT_WITH_PREFIX_PROCESSORS = 2  # repetition_penalty, min_new_tokens: the nodes per depth are read once more
# Grafting lookup chains on the host reads the draft tree's tokens and parents, and uploads the grafted tree.
ROUND_LIMIT_WITH_LOOKUP = 3
ROUND_LIMIT_WITH_LOOKUP_STATIC = 2  # the chains' upload into their fixed slots, and the round's one read
BATCH_ROUND_LIMIT = 2  # B = 4: the round's one read, and one upload of the rows' lengths and positions to the draft
BATCH_LEAVING_EXTRA = 3  # a round after which rows finish: the kept rows' index, each cache's columns that stay
# The compiled static round: the ops outside its two graphs (padding the draft's read, the stopping verdicts, the
# round's one read and the host's slices of it); none per layer.
COMPILED_ROUND_EAGER_OPS = 40


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, quick_trained_draft(target)


class _Marks:
    """The counter's total at the start of every round (the draft side's first call of the round)."""

    def __init__(self, counter):
        self.counter, self.at = counter, []

    def wrap(self, method):
        def marked(*args, **kwargs):
            self.at.append(self.counter.total if self.counter.active else 0)
            return method(*args, **kwargs)

        return marked

    def per_round(self, end: int) -> list[int]:
        bounds = self.at + [end]
        return [b - a for a, b in zip(bounds, bounds[1:])]


class _Counter(HostSyncCounter):
    active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)


def count_round_syncs(target, draft, monkeypatch, prompt=None, **generate_kwargs) -> list[int]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft = target.to(device), draft.to(device)
    monkeypatch.setattr(decoding, "lazy_leaf_head", lambda *args: None)  # the accelerator path
    counter = _Counter()
    marks = _Marks(counter)
    monkeypatch.setattr(JakiroCandidateGenerator, "get_candidates", marks.wrap(JakiroCandidateGenerator.get_candidates))
    monkeypatch.setattr(BatchDrafter, "propose", marks.wrap(BatchDrafter.propose))
    prompt = (torch.tensor([[3, 4, 5, 6, 7, 8]]) if prompt is None else prompt).to(device)
    kwargs = dict(do_sample=False, max_new_tokens=48, assistant_model=draft, **generate_kwargs)
    if device == "cuda":  # the debug mode counts in one block; per-round marks are not available there
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                target.generate(prompt, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchronizing" in str(w.message).lower() for w in caught)
        return [syncs / max(draft.last_generation_stats.rounds - 1, 1)]
    with counter:
        target.generate(prompt, **kwargs)
        end = counter.total
    stats = draft.last_generation_stats
    assert len(marks.at) == stats.rounds - 1 and stats.mean_accepted_length > 1.5  # rounds accept several tokens
    return marks.per_round(end)[1:]


def test_syncs_per_round_greedy(pair, monkeypatch):
    with tree_settings(pair[1], total_tokens=60, depth=5, top_k=10):
        per_round = count_round_syncs(*pair, monkeypatch)
    print("syncs per round:", per_round)
    assert max(per_round) <= ROUND_LIMIT


def test_syncs_per_round_with_prefix_dependent_processors(pair, monkeypatch):
    per_round = count_round_syncs(*pair, monkeypatch, repetition_penalty=1.2, min_new_tokens=40)
    print("syncs per round:", per_round)
    assert max(per_round) <= ROUND_LIMIT_WITH_PREFIX_PROCESSORS


def test_syncs_per_round_with_ngram_lookup(pair, monkeypatch):
    """Lookup costs at most one more: the index is fed from the tokens each round already copies to the host, and
    grafting reads the draft tree's tokens and parents in one copy in rounds that found a chain."""
    target, draft = pair
    with tree_settings(draft, lookup_tokens=10):
        per_round = count_round_syncs(target, draft, monkeypatch)
    print("syncs per round:", per_round, "lookup rounds:", draft.last_generation_stats.lookup_rounds)
    assert draft.last_generation_stats.lookup_rounds > 0
    assert max(per_round) <= ROUND_LIMIT_WITH_LOOKUP


def test_syncs_per_round_with_ngram_lookup_static_cache(pair, monkeypatch):
    """Over a static cache the chains go into fixed slots on the device (`tree.graft_chain_slots`): their tokens
    are uploaded once and nothing of the grafted tree is read back."""
    target, draft = pair
    with tree_settings(draft, lookup_tokens=10):
        per_round = count_round_syncs(target, draft, monkeypatch, cache_implementation="static")
    print("syncs per round (static, lookup):", per_round, "lookup rounds:", draft.last_generation_stats.lookup_rounds)
    assert draft.last_generation_stats.lookup_rounds > 0
    assert max(per_round) <= ROUND_LIMIT_WITH_LOOKUP_STATIC


def test_syncs_per_round_static_cache(pair, monkeypatch):
    """The static path (fixed-shape trees written into a StaticCache, the path moved by index copies) syncs no more:
    the cached length is known on the host, the layers' device-side lengths are set without being read."""
    per_round = count_round_syncs(*pair, monkeypatch, cache_implementation="static")
    print("syncs per round (static):", per_round)
    assert max(per_round) <= ROUND_LIMIT


def test_syncs_per_round_batch_of_four(pair, monkeypatch):
    prompts = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 5, 7, 9, 11, 13], [20, 4, 20, 4, 20, 4]])
    per_round = count_round_syncs(*pair, monkeypatch, prompt=prompts, pad_token_id=0)
    print("syncs per round (B = 4):", per_round)
    leaving = len(prompts) - 1  # at most this many rounds end with rows finishing (the last one ends the loop)
    assert max(sorted(per_round)[: len(per_round) - leaving]) <= BATCH_ROUND_LIMIT
    assert max(per_round) <= BATCH_ROUND_LIMIT + BATCH_LEAVING_EXTRA


def test_syncs_per_round_batch_of_four_static_cache(pair, monkeypatch):
    """A batch over a static cache syncs as over a dynamic one: rows that finish keep idle slots (no cache rows
    are selected), and the padded trees' shapes are known on the host. A round that packs the shared columns
    (`kv_cache.pack_present`, when holes leave no room for the next trees) reads one length more."""
    packs = []
    pack = batch_loop.pack_present
    monkeypatch.setattr(batch_loop, "pack_present", lambda *args: packs.append(1) or pack(*args))
    prompts = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 5, 7, 9, 11, 13], [20, 4, 20, 4, 20, 4]])
    per_round = count_round_syncs(*pair, monkeypatch, prompt=prompts, pad_token_id=0, cache_implementation="static")
    print("syncs per round (B = 4, static):", per_round, "packs:", len(packs))
    leaving = len(prompts) - 1
    assert len(packs) < len(per_round) // 4
    assert max(sorted(per_round)[: len(per_round) - leaving - len(packs)]) <= BATCH_ROUND_LIMIT
    assert max(per_round) <= BATCH_ROUND_LIMIT + BATCH_LEAVING_EXTRA


def test_the_round_cost_script_reports_a_round_against_a_step():
    """`benchmarks/round_cost.py` on the tiny Llama: one host read per round, one target call and `depth` draft calls
    per round, one target call per plain step."""
    script = load_script("round_cost.py", "round_cost_main")
    step, round_ = script.main(["--new-tokens", "8", "--repeats", "1", "--warmup", "0", "--tree", "20/3/4"])
    assert step["target_calls"] == 1 and step["draft_calls"] == 0
    assert round_["target_calls"] == 1 and round_["draft_calls"] == 3 and round_["syncs"] <= 1.5
    assert round_["ops"] > step["ops"] > 0 and round_["seconds"] > 0
    assert decoding.lazy_leaf_head is not None and decoding.lazy_leaf_head.__name__ == "lazy_leaf_head"  # restored



def test_compiled_static_round_is_two_graph_calls_one_read_and_few_eager_ops(pair):
    """With a static cache and `compile_config`, a round is `draft_round` and `verify_round`: two graph calls, one
    host read, and little around them. Counted as `benchmarks/round_cost.py --compiled` counts (each compiled
    function run as one opaque call, so nothing is compiled here): per round, from a long and a 1-token generation."""
    from transformers import CompileConfig

    script = load_script("round_cost.py", "round_cost_graphs")
    target, draft = pair
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    kwargs = dict(do_sample=False, eos_token_id=None, assistant_model=draft, cache_implementation="static",
                  compile_config=config, max_cache_len=160)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])

    def count(new_tokens):
        graphs, counter = [0], HostSyncCounter()
        with tree_settings(draft, total_tokens=60, depth=5, top_k=10, adaptive=False):
            with script.opaque_graphs(graphs, target), counter:
                target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        return counter.total, counter.ops, graphs[0], draft.last_generation_stats.rounds

    long, short = count(40), count(1)
    rounds = long[3] - short[3]
    syncs, ops, graph_calls = ((a - b) / rounds for a, b in zip(long[:3], short[:3]))
    print(f"per round: {syncs} syncs, {ops} eager ops outside graphs, {graph_calls} graph calls")
    assert rounds > 5 and graph_calls == 2 and syncs <= ROUND_LIMIT
    assert ops <= COMPILED_ROUND_EAGER_OPS
