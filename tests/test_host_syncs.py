"""Host syncs per verify round, counted, so that they cannot creep back.

On an accelerator every place where the host waits for a device value stalls the launch queue; with a cheap draft
and a fast target they decide the speed. Where CUDA is present its sync debug mode counts every blocking call. On a
CPU the same places are counted at the Python level: the calls that read a tensor's value on the host (`item`,
`tolist`, `bool`, `int`, `float`, `nonzero`, `torch.equal`, `.cpu()`, boolean-mask indexing) and `new_tensor` (a
blocking host-to-device copy on an accelerator), wherever they run: our code, transformers' or torch's Python code.

The counted decode is the accelerator path (full logits in the verify forward; the CPU path's lazy leaf logits add a
host round trip on purpose) with the default tree settings.
"""

import contextlib
import warnings

import pytest
import torch

from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import decoding
from transformers_jakiro.drafting import JakiroCandidateGenerator

ROUND_LIMIT = 3  # greedy, no prefix-dependent logits processor
ROUND_LIMIT_WITH_PREFIX_PROCESSORS = 5  # repetition_penalty, min_new_tokens


class SyncCounter:
    """Counts host syncs while active; `marks` records the count at the start of every draft round."""

    _METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy", "new_tensor")
    _FUNCTIONS = ("nonzero", "equal", "allclose")

    def __init__(self):
        self.count = 0
        self.marks = []

    def _counted(self, function):
        def wrapper(*args, **kwargs):
            self.count += 1
            return function(*args, **kwargs)

        return wrapper

    def _counted_if_bool_index(self, function):
        def wrapper(tensor, index, *rest):
            indices = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.count += 1  # a boolean mask index needs the number of True entries on the host
            return function(tensor, index, *rest)

        return wrapper

    @contextlib.contextmanager
    def python_level(self, monkeypatch):
        for name in self._METHODS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        for name in self._FUNCTIONS:
            monkeypatch.setattr(torch, name, self._counted(getattr(torch, name)))
        for name in ("__getitem__", "__setitem__"):
            monkeypatch.setattr(torch.Tensor, name, self._counted_if_bool_index(getattr(torch.Tensor, name)))
        yield self

    @contextlib.contextmanager
    def cuda(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield self
        finally:
            torch.cuda.set_sync_debug_mode(0)
        self.count = sum("synchronizing" in str(w.message).lower() for w in caught)

    def per_round(self, end: int) -> list[int]:
        """Syncs of each draft-verify round: from one round's drafting to the next's (the last to `end`)."""
        bounds = self.marks + [end]
        return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, quick_trained_draft(target)


def count_round_syncs(target, draft, monkeypatch, **generate_kwargs) -> list[int]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft = target.to(device), draft.to(device)
    counter = SyncCounter()
    monkeypatch.setattr(decoding, "lazy_leaf_head", lambda *args: None)  # the accelerator path
    get_candidates = JakiroCandidateGenerator.get_candidates

    def marked(self, input_ids, choice=None):
        counter.marks.append(counter.count)
        return get_candidates(self, input_ids, choice)

    monkeypatch.setattr(JakiroCandidateGenerator, "get_candidates", marked)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]], device=device)
    with monkeypatch.context() as patches:
        context = counter.cuda() if device == "cuda" else counter.python_level(patches)
        with context:
            target.generate(prompt, do_sample=False, max_new_tokens=48, assistant_model=draft, **generate_kwargs)
            end = counter.count
    if device == "cuda":  # the debug mode counts in one block; per-round marks are not available there
        rounds = draft.last_generation_stats.rounds - 1
        return [end / max(rounds, 1)]
    stats = draft.last_generation_stats
    assert len(counter.marks) == stats.rounds - 1 and stats.mean_accepted_length > 1.5  # rounds accept several tokens
    return counter.per_round(end)


def test_syncs_per_round_greedy(pair, monkeypatch):
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
    from transformers_jakiro import tree_settings

    target, draft = pair
    with tree_settings(draft, lookup_tokens=10):
        per_round = count_round_syncs(target, draft, monkeypatch)
    print("syncs per round:", per_round, "lookup rounds:", draft.last_generation_stats.lookup_rounds)
    assert draft.last_generation_stats.lookup_rounds > 0
    assert max(per_round) <= ROUND_LIMIT + 1


def test_syncs_per_round_static_cache(pair, monkeypatch):
    """The static path (fixed-shape trees written into a StaticCache, the path moved by index copies) syncs no more:
    the cached length is known on the host, the layers' device-side lengths are set without being read."""
    per_round = count_round_syncs(*pair, monkeypatch, cache_implementation="static")
    print("syncs per round (static):", per_round)
    assert max(per_round) <= ROUND_LIMIT
