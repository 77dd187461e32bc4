"""Jakiro rounds inside transformers' continuous batching (`transformers_jakiro.continuous`): every request's greedy
output identical to plain `generate` of that request alone, whatever joins, leaves or is cancelled around it, with
split prefills, pages crossed by trees, lookup chains and EOS inside an accepted path; no page leaked; refusals by
name. Needs transformers >= 5.25 (its page allocators); older versions get a clear error, tested here too."""

import time

import pytest
import torch
from transformers import GenerationConfig

from tiny_models import ARCHS, VOCAB, make_tokenizer, trained_pairs
from transformers_jakiro.continuous_support import page_allocators_available
from transformers_jakiro.decoding.drafter import TreeSettings

SUPPORTED = page_allocators_available()
needs_allocators = pytest.mark.skipif(not SUPPORTED, reason="transformers < 5.25: refused (see the last test)")


@pytest.fixture(scope="module")
def pairs():
    return trained_pairs()


def prompts_of(seed: int, count: int, low: int = 2, high: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def alone(target, prompt: list[int], config: GenerationConfig) -> list[int]:
    """Plain `generate` of one request alone (the reference), under sdpa."""
    target.config._attn_implementation = "sdpa"
    return target.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


@needs_allocators
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("lookup", [0, 4])
def test_requests_identical_to_generate_alone(arch, lookup, pairs, tmp_path, monkeypatch):
    """Six requests at once, prompts of 2-40 tokens; pages of 4 tokens (trees cross pages); a batch budget of 48
    tokens (long prompts' prefills are split, and trees are cut to fit); the pinned tree and the round controller;
    max_new_tokens 1 and 30; an EOS inside an accepted path (a token request 0 emits at its 6th step)."""
    from transformers_jakiro.continuous import jakiro_cb_config, jakiro_generate_batch

    target, draft = pairs(arch)
    settings = TreeSettings.resolve(draft, lookup_tokens=lookup, adaptive=lookup > 0)  # pinned tree, controller
    prompts = prompts_of(5 + ARCHS.index(arch), 6)
    for max_new, eos in [(1, -1), (30, -1), (30, "step 6")]:
        # no round costs from earlier runs: the controller tries every choice, trees included
        monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(tmp_path / f"costs-{max_new}-{eos}.json"))
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)
        if eos == "step 6":
            config.eos_token_id = alone(target, prompts[0], config)[5]
        expected = [alone(target, prompt, config) for prompt in prompts]
        cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=48)
        out = jakiro_generate_batch(target, draft, prompts, config, cb, settings=settings, max_new_tokens=max_new)
        got = [result.generated_tokens for result in out.values()]
        assert got == expected, (max_new, eos)
        stats = [result.jakiro_stats for result in out.values()]
        assert all(s.new_tokens == len(g) for s, g in zip(stats, got))
        if max_new == 30:  # trees were verified and accepted more than one token per forward somewhere
            assert any(name.startswith("tree") for s in stats for name in s.choices)
            assert max(s.mean_accepted_length for s in stats) > 1.2


@needs_allocators
def test_requests_join_leave_and_cancel_without_leaking_pages(pairs):
    """Requests added while others decode, one cancelled mid-generation: every finished request identical to its
    plain generation alone, and every page back in the pool afterwards."""
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config

    target, draft = pairs("llama")
    config = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=-1, pad_token_id=0)
    prompts = prompts_of(21, 6)
    expected = [alone(target, prompt, config) for prompt in prompts]
    manager = JakiroContinuousBatchingManager(target, draft, config, jakiro_cb_config(page_size=4, num_blocks=256,
                                                                                     max_batch_tokens=64))
    manager.start()
    try:
        deadline = time.time() + 120
        first = [manager.add_request(p, max_new_tokens=40) for p in prompts[:3]]
        results = {}
        while not results:
            result = manager.get_result(timeout=5)
            if result is not None:
                results[result.request_id] = result
        later = [manager.add_request(p, max_new_tokens=40) for p in prompts[3:]]
        cancelled = later[-1]
        manager.cancel_request(cancelled)
        wanted = set(first + later[:-1])
        while not wanted <= set(results) and time.time() < deadline:
            result = manager.get_result(timeout=5)
            if result is not None:
                results[result.request_id] = result
        time.sleep(0.2)  # the cancellation is carried out by the next scheduling
        assert manager.batch_processor.held_pages() == 0
        assert manager.batch_processor.rows == [] and manager.batch_processor.trees == {}
    finally:
        manager.stop(block=True)
    ids = first + later
    for request, prompt_expected in zip(ids, expected):
        if request != cancelled:
            assert results[request].generated_tokens == prompt_expected, request


def mid_path_positions(stats) -> list[int]:
    """Indices of a request's new tokens that a round accepted with more tokens after them in the same round."""
    positions, start = [], 0
    for length in stats.accepted_lengths:
        positions += range(start, start + length - 1)
        start += length
    return positions


@needs_allocators
def test_stop_strings_end_requests_where_generate_alone_ends_them(pairs, monkeypatch):
    """Stop strings from four of six requests' answers, shared by all (as a server's `stop` list), each ending where a
    run without them accepted more tokens after it in the same round, and one across a fifth's prompt end and first
    token: every request ends after the token that completes the first one it writes, as `generate(stop_strings=...)`
    of that request alone ends (the fifth at its first token), one of them inside an accepted path at least
    (counted); the sixth runs to max_new_tokens unless it writes one. No stop strings are left behind; without a
    tokenizer they are refused by name."""
    from transformers_jakiro import continuous
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config, jakiro_generate_batch

    target, draft = pairs("llama")
    tokenizer = make_tokenizer()
    config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    prompts = prompts_of(31, 6)
    settings = TreeSettings.resolve(draft, lookup_tokens=0, adaptive=False)
    cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=128)
    unstopped = list(jakiro_generate_batch(target, draft, prompts, config, cb, settings=settings).values())
    stops = []
    for result in unstopped[:4]:
        end = next(p for p in mid_path_positions(result.jakiro_stats) if p >= 4)
        stops.append(tokenizer.decode([t for t in result.generated_tokens[end - 2 : end + 1] if t > 2]))
    boundary = [prompts[4][-1], unstopped[4].generated_tokens[0]]  # across the prompt's end: stops at the first token
    assert min(boundary) > 2
    stops.append(tokenizer.decode(boundary))
    expected = [target.generate(torch.tensor([p]), generation_config=config, stop_strings=stops,
                                tokenizer=tokenizer)[0, len(p) :].tolist() for p in prompts]
    assert sum(len(e) < 30 for e in expected) >= 5 and len(expected[4]) == 1, (stops, expected)
    paths = {}  # per request: the tokens its last tree round accepted
    verify = continuous.JakiroBatchProcessor._verify

    def recording_verify(self, future, tree, rows):
        tokens, accepted, lookup = verify(self, future, tree, rows)
        paths[future.state.request_id] = len(tokens)
        return tokens, accepted, lookup

    monkeypatch.setattr(continuous.JakiroBatchProcessor, "_verify", recording_verify)
    manager = JakiroContinuousBatchingManager(target, draft, config, cb, settings)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=30, stop_strings=stops, tokenizer=tokenizer) for p in prompts]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=30)
            assert result is not None
            results[result.request_id] = result
        assert manager.pending_stops == {} and manager.batch_processor.stop_criteria == {}
        finished = manager.batch_processor.finished_stats
        assert any(finished[r].accepted_lengths[-1] < paths[r] for r in ids
                   if r in paths and finished[r].choices[-1] not in ("plain", "prefill"))
        with pytest.raises(ValueError, match="tokenizer"):
            manager.add_request(prompts[0], max_new_tokens=4, stop_strings=stops)
    finally:
        manager.stop(block=True)
    assert [results[request].generated_tokens for request in ids] == expected


@needs_allocators
def test_refusals_name_the_problem(pairs):
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config

    target, draft = pairs("llama")
    greedy = dict(max_new_tokens=8, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        JakiroContinuousBatchingManager(target, draft, GenerationConfig(repetition_penalty=1.3, **greedy))
    with pytest.raises(ValueError, match="use_async_batching=False"):
        JakiroContinuousBatchingManager(target, draft, GenerationConfig(**greedy),
                                        jakiro_cb_config(use_async_batching=True))
    target.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="dense attention mask"):
            JakiroContinuousBatchingManager(target, draft, GenerationConfig(**greedy))
    finally:
        target.config._attn_implementation = "sdpa"


@needs_allocators
def test_another_continuous_batching_layout_is_refused_by_name(pairs, monkeypatch):
    """A transformers whose page ledger (or cache, allocators, batch inputs) lacks what the rounds rewrite is refused
    when the batch processor is built, naming the missing attribute, before any request runs."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger

    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config

    target, draft = pairs("llama")
    monkeypatch.delattr(BlockLedger, "release")
    manager = JakiroContinuousBatchingManager(target, draft, GenerationConfig(max_new_tokens=4, eos_token_id=-1),
                                              jakiro_cb_config(page_size=4, num_blocks=16))
    with pytest.raises(RuntimeError, match=r"continuous batching layout .*no ledger\.release"):
        manager._create_batch_processor()


@pytest.mark.skipif(SUPPORTED, reason="transformers >= 5.25 is supported")
def test_older_transformers_refused_by_name(pairs):
    from transformers_jakiro.continuous_support import check_supported

    target, _ = pairs("llama")
    with pytest.raises(RuntimeError, match="needs transformers >= 5.25"):
        check_supported(target, GenerationConfig(do_sample=False), None)


@needs_allocators
@pytest.mark.parametrize("pages", [40, 24, 20])
def test_cache_pressure_offloads_without_corrupting_requests(pages, pairs):
    """Six requests of up to 79 tokens over 4-token pages: with 40 pages trees compete for pages, with 20 (one long
    request's worth) transformers offloads requests and resumes them. Every request still ends identical to its
    generation alone, as under plain continuous batching (which fails the same requests from 16 pages on)."""
    from transformers_jakiro.continuous import jakiro_cb_config, jakiro_generate_batch

    target, draft = pairs("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(10, 40, (6,), generator=g)]
    config = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=-1, pad_token_id=0)
    expected = [alone(target, prompt, config) for prompt in prompts]
    cb = jakiro_cb_config(page_size=4, num_blocks=pages, max_batch_tokens=64)
    out = jakiro_generate_batch(target, draft, prompts, config, cb, settings=TreeSettings.resolve(draft, adaptive=False),
                                max_new_tokens=40)
    assert [result.error for result in out.values()] == [None] * 6
    assert [result.generated_tokens for result in out.values()] == expected


def sampled_in_waves(target, draft, config, cb, settings, prompt, samples: int, wave: int, **request_kwargs):
    """`samples` requests of `prompt` through one manager, `wave` at a time (so that they share forwards and still
    draft trees of some size): their generated tokens and stats."""
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager

    manager = JakiroContinuousBatchingManager(target, draft, config, cb, settings)
    manager.start()
    outputs = []
    try:
        while len(outputs) < samples:
            ids = [manager.add_request(prompt, max_new_tokens=config.max_new_tokens, **request_kwargs)
                   for _ in range(min(wave, samples - len(outputs)))]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=10)
                assert result is not None and result.error is None
                done[result.request_id] = result
            processor = manager.batch_processor
            outputs += [(done[r].generated_tokens, processor.finished_stats.pop(r)) for r in ids]
    finally:
        manager.stop(block=True)
    return outputs


@needs_allocators
@pytest.mark.parametrize("rule", ["one-row rule", "wrong rule"])
def test_sampling_draws_the_target_distribution(rule, monkeypatch):
    """Sampling (temperature 0.8, top-k 5, top-p 0.9, transformers' per-request processors as `transformers serve`
    sets them): the first three tokens of 4000 requests, two decoding at a time, against the target's exact joint
    distribution (chi-square). The same test with the classic wrong residual rule fails, so it can tell."""
    from test_sampling import WARPERS, chi_square_p_value, classic_wrong_verify, exact_distribution, \
        small_target_and_draft
    from transformers import LogitsProcessorList

    from transformers_jakiro import continuous
    from transformers_jakiro.continuous import jakiro_cb_config

    target, draft = small_target_and_draft()
    samples = 4000 if rule == "one-row rule" else 1500
    if rule == "wrong rule":
        monkeypatch.setattr(continuous.verification, "verify", classic_wrong_verify)
    probs = exact_distribution(target, LogitsProcessorList(WARPERS))
    config = GenerationConfig(do_sample=True, temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=3, eos_token_id=-1,
                              pad_token_id=0)
    cb = jakiro_cb_config(page_size=4, num_blocks=64, max_batch_tokens=64, per_request_processors=True)
    settings = TreeSettings.resolve(draft, total_tokens=10, depth=2, top_k=3, adaptive=False)
    torch.manual_seed(7)
    outputs = sampled_in_waves(target, draft, config, cb, settings, [3, 5, 4], samples, wave=2)
    counts = torch.zeros(8**3, dtype=torch.float64)
    for tokens, _ in outputs:
        counts[tokens[0] * 64 + tokens[1] * 8 + tokens[2]] += 1
    p_value = chi_square_p_value(counts, probs)
    multi = sum(n > 1 for _, stats in outputs for n in stats.accepted_lengths)
    print(f"{rule}: p-value {p_value:.3g}, rounds accepting more than one token {multi}")
    if rule == "wrong rule":
        assert p_value < 1e-6
        return
    assert p_value > 1e-4
    assert multi > samples // 4  # trees were accepted beyond the root in many rounds, not only the bonus token


@needs_allocators
@pytest.mark.parametrize("lazy_leaves", [True, False])
def test_greedy_requests_among_sampled_ones_match_generate_alone(lazy_leaves, pairs, monkeypatch):
    """The server's way of mixing settings: a sampling config, greedy requests asking top_k=1 (as transformers' server
    sends them) decode beside requests sampled at temperature 1.3, and stay identical to greedy `generate` alone;
    with leaves' logits computed only where a path ends (the CPU's way) and at every node (an accelerator's)."""
    from transformers_jakiro.continuous import JakiroBatchProcessor, JakiroContinuousBatchingManager, jakiro_cb_config

    attach = JakiroBatchProcessor.attach

    def attach_with(self, *args):
        attach(self, *args)
        self.lazy_leaves = lazy_leaves

    monkeypatch.setattr(JakiroBatchProcessor, "attach", attach_with)

    target, draft = pairs("llama")
    greedy = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    prompts = prompts_of(31, 6)
    expected = [alone(target, prompt, greedy) for prompt in prompts]
    config = GenerationConfig(do_sample=True, temperature=0.9, top_k=50, max_new_tokens=30, eos_token_id=-1,
                              pad_token_id=0)
    cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=64, per_request_processors=True)
    manager = JakiroContinuousBatchingManager(target, draft, config, cb, TreeSettings.resolve(draft, adaptive=False))
    manager.start()
    try:
        ids = []
        for prompt in prompts:
            ids.append(manager.add_request(prompt, max_new_tokens=30, top_k=1))
            manager.add_request(prompt, max_new_tokens=30, temperature=1.3)
        results = {}
        while len(results) < 2 * len(prompts):
            result = manager.get_result(timeout=10)
            assert result is not None and result.error is None
            results[result.request_id] = result
        stats = [manager.batch_processor.finished_stats[r] for r in ids]
    finally:
        manager.stop(block=True)
    assert [results[r].generated_tokens for r in ids] == expected
    assert max(s.mean_accepted_length for s in stats) > 1.2


@needs_allocators
def test_only_a_lone_tree_takes_its_leaves_logits_lazily(pairs, monkeypatch):
    """On a CPU, a forward that holds one request's tree (of LAZY_LEAVES_MIN_NODES nodes or more) computes logits at
    its internal nodes and at the leaf where its path ends; a forward with several trees computes every node's in one
    product (each request whose path ends at a leaf would otherwise pay a one-row product of the whole output layer).
    Exact both ways: requests of a lone prompt, then of three."""
    from transformers_jakiro.continuous import JakiroBatchProcessor, jakiro_cb_config, jakiro_generate_batch
    from transformers_jakiro.decoding.row_rounds import LAZY_LEAVES_MIN_NODES

    seen = []  # per forward with trees: (trees in it, their smallest node count, the lazy request or None)
    original = JakiroBatchProcessor._lazy_tree

    def spy(self, requests):
        lazy = original(self, requests)
        trees = [self.trees[request][0].num_nodes for request in requests if request in self.trees]
        if trees:
            seen.append((len(trees), min(trees), lazy))
        return lazy

    monkeypatch.setattr(JakiroBatchProcessor, "_lazy_tree", spy)
    target, draft = pairs("llama")
    greedy = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=64)
    settings = TreeSettings.resolve(draft, adaptive=False)
    for prompts in (prompts_of(32, 1), prompts_of(33, 3)):
        results = jakiro_generate_batch(target, draft, prompts, greedy, cb, settings)
        assert [r.generated_tokens for r in results.values()] == [alone(target, p, greedy) for p in prompts]
    assert any(count == 1 and lazy is not None for count, _, lazy in seen)  # a lone tree went lazy
    assert all(lazy is None for count, nodes, lazy in seen if count > 1 or nodes < LAZY_LEAVES_MIN_NODES)
    assert any(count > 1 for count, _, _ in seen)


@needs_allocators
@pytest.mark.parametrize("cheapest_rows", [32, None])
def test_passes_of_the_output_layer_padded_to_a_cheaper_row_count_hold_a_lone_trees_leaves(cheapest_rows, pairs,
                                                                                          monkeypatch):
    """Where the output layer measured cheaper at a larger row count (`output_rows.padded_count`), a forward's pass is
    padded to it: a lone lazy tree's leaves fill the padding first, so a path ending at one of them needs no product
    of its own; other passes (plain steps of several requests, several trees) get copies of a row. Here one row and
    32 rows cost a third of every other count: each pass of 2 to 32 rows holds 32, a lone tree (13 nodes, lookup off)
    its leaves all, and the processor's only products of the output layer are the first forwards' checks. With no
    count cheaper than a smaller one (None) nothing is padded and lone trees whose path ends at a leaf make one
    product each. Exact both ways."""
    from transformers_jakiro import continuous
    from transformers_jakiro.continuous import JakiroBatchProcessor, jakiro_cb_config, jakiro_generate_batch

    costs = [0.0] + [1.0 if count in (1, cheapest_rows) else 3.0 for count in range(1, 33)]
    attach, rows_to_keep = JakiroBatchProcessor.attach, JakiroBatchProcessor._tree_rows_to_keep
    products, passes, leaves_held = [], [], []

    def attach_counting(self, *args):
        attach(self, *args)
        self.head = CountingHead(self.head, products)

    def rows_noting(self):
        rows = rows_to_keep(self)
        leaves_held.append(len(self._kept_leaves))
        return rows

    monkeypatch.setattr(continuous, "row_costs", lambda head: costs)
    monkeypatch.setattr(JakiroBatchProcessor, "attach", attach_counting)
    monkeypatch.setattr(JakiroBatchProcessor, "_tree_rows_to_keep", rows_noting)
    target, draft = pairs("llama")
    def note_pass(module, args, kwargs):  # continuous batching's forwards keep rows by index (generate's by count)
        if isinstance(kwargs.get("logits_to_keep"), torch.Tensor):
            passes.append(kwargs["logits_to_keep"].numel())

    target.register_forward_pre_hook(note_pass, with_kwargs=True)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=64)
    settings = TreeSettings.resolve(draft, adaptive=False, total_tokens=12, depth=3, top_k=4, lookup_tokens=0)
    checked = []  # the passes after each manager's first forward (that one's rows are the check's: never padded)
    for prompts in (prompts_of(35, 1), prompts_of(36, 3)):
        passes.clear()
        results = jakiro_generate_batch(target, draft, prompts, greedy, cb, settings)
        checked += passes[1:]
        assert [r.generated_tokens for r in results.values()] == [alone(target, p, greedy) for p in prompts]
    if cheapest_rows:  # beyond the measured counts (32) nothing is padded
        assert {count for count in checked if count <= 32} == {32}  # (every round here is a tree: pinned)
        assert max(leaves_held) > 3 and products == [1, 3]  # each manager's check (of one prompt, then three)
    else:
        assert 32 not in checked and max(leaves_held) == 0 and len(products) > 3


@needs_allocators
def test_a_lone_requests_smaller_tree_fills_a_forward_of_a_cheaper_query_count(pairs, monkeypatch):
    """One request decoding alone verifies its tree in a forward of its own, so its controller's smaller tree grows to
    the query count the output layer measured cheaper (`output_rows.padded_count`, the layers' products share its
    kernels); a batch's controllers keep theirs. Here 8 queries cost a third of 2 to 7: the smaller tree of the
    draft's 60/5/10 (4 nodes below the root) grows to 7. Exact."""
    from transformers_jakiro import continuous
    from transformers_jakiro.continuous import jakiro_cb_config, jakiro_generate_batch
    from transformers_jakiro.decoding.round_controller import choices_for

    costs = [0.0] + [1.0 if count in (1, 8) else 3.0 for count in range(1, 33)]
    made, controller = {}, continuous.RoundController
    monkeypatch.setattr(continuous, "row_costs", lambda head: costs)
    monkeypatch.setattr(continuous, "RoundController",
                        lambda choices, key, **kwargs: made.setdefault(key, controller(choices, key=key, **kwargs)))
    target, draft = pairs("llama")
    greedy = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    cb = jakiro_cb_config(page_size=4, num_blocks=256, max_batch_tokens=128)
    for prompts in (prompts_of(37, 1), prompts_of(38, 2)):
        results = jakiro_generate_batch(target, draft, prompts, greedy, cb, TreeSettings.resolve(draft, adaptive=True))
        assert [r.generated_tokens for r in results.values()] == [alone(target, p, greedy) for p in prompts]
    choices = {key.split("|")[-2]: [choice.name for choice in c.choices] for key, c in made.items()}
    assert choices["batch 1"][:2] == ["tree 60/5/10", "tree 7/3/4"]
    assert choices["batch 2"][:2] == [choice.name for choice in choices_for(30, 5, 10, True, False)[:2]]


class CountingHead:
    """An output layer that notes the rows of every product it makes."""

    def __init__(self, head, products: list):
        self.head, self.weight, self.products = head, head.weight, products

    def __call__(self, hidden):
        self.products.append(hidden.shape[0])
        return self.head(hidden)


@needs_allocators
def test_trees_logits_come_from_the_forwards_own_output_layer_pass(pairs, monkeypatch):
    """The trees' node logits are kept by the forward, in the one pass of the output layer that also gives transformers
    the row per request it samples from: no second product over the trees' rows (on a CPU each pass reads the whole
    layer), and no row twice (a tree's last node is transformers' row of its request). Every node's logits from the
    forward here (an accelerator's way), three requests, outputs exact."""
    from transformers_jakiro.continuous import JakiroBatchProcessor, jakiro_cb_config, jakiro_generate_batch
    from transformers_jakiro.decoding.output_rows import ExtraLogitRows

    attach, products, call, repeated = JakiroBatchProcessor.attach, [], ExtraLogitRows.__call__, []

    def call_checking(self, **kwargs):  # the trees' rows never include a request's last query row (transformers')
        last_rows = set((kwargs["cu_seq_lens_q"][1:] - 1).tolist())
        repeated.append(bool(last_rows & set(self.rows.tolist())))
        return call(self, **kwargs)

    def attach_counting(self, *args):
        attach(self, *args)
        self.lazy_leaves = False
        self.head = CountingHead(self.head, products)  # the processor's own products of the output layer

    monkeypatch.setattr(JakiroBatchProcessor, "attach", attach_counting)
    monkeypatch.setattr(ExtraLogitRows, "__call__", call_checking)
    target, draft = pairs("llama")
    greedy = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    prompts = prompts_of(34, 3)
    results = jakiro_generate_batch(target, draft, prompts, greedy, jakiro_cb_config(
        page_size=4, num_blocks=256, max_batch_tokens=64), TreeSettings.resolve(draft, adaptive=False))
    assert sum(name.startswith("tree") for r in results.values() for name in r.jakiro_stats.choices) > 10
    assert len(repeated) > 10 and not any(repeated)
    assert len(products) == 1  # the first forward's check that the output layer alone reproduces its logits
    assert [r.generated_tokens for r in results.values()] == [alone(target, p, greedy) for p in prompts]


def shared_prefix_run(target, draft, prompts, sharing: bool, forget_features: bool = False):
    """`prompts[0]` alone, then the others together, through one manager (4-token pages): each request's generated
    tokens and stats, the features its draft row got for its prompt, the prompt tokens whose prefill transformers
    skipped (prefix sharing), and per request the prompt positions whose draft entries its row got from an earlier
    prompt's (`preload`), the positions its draft's first read took and the draft's entries for its prompt after that
    read."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from transformers_jakiro.continuous import JakiroBatchProcessor, JakiroContinuousBatchingManager, jakiro_cb_config
    from transformers_jakiro.shared_pages import SharedPageFeatures

    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=-1, pad_token_id=0)
    features, skipped, preloaded, read, entries = {}, [], {}, {}, {}
    prompt_features, search = SharedPageFeatures.prompt_features, PagedAttentionCache.search_prefix_match
    preload_draft, observe = SharedPageFeatures.preload_draft, JakiroBatchProcessor._observe
    keep_draft_reads, attach = SharedPageFeatures.keep_draft_reads, JakiroBatchProcessor.attach

    def attach_keeping_first_reads(self, *args):  # without sharing too, to compare the entries
        attach(self, *args)
        self.drafter.keep_first_reads = True

    def spy_draft_reads(self, cache, drafter, requests):
        for row, kept in drafter.first_reads.items():
            entries[requests[row]] = [(k.clone(), v.clone()) for k, v in kept]
        return keep_draft_reads(self, cache, drafter, requests)

    def spy_features(self, cache, state, chunks):
        features[state.request_id] = prompt_features(self, cache, state, chunks)
        return features[state.request_id]

    def spy_preload(self, cache, state, drafter, row):
        preloaded[state.request_id] = preload_draft(self, cache, state, drafter, row)
        return preloaded[state.request_id]

    def spy_observe(self, request, rows, next_tokens, tokens, lookup=None):
        if request in self.rows:  # the first call for a draft row: its prompt's positions to read
            read.setdefault(request, rows.shape[0])
        return observe(self, request, rows, next_tokens, tokens, lookup)

    def spy_search(self, request_id, prompt_ids):
        skipped.append(search(self, request_id, prompt_ids))
        return skipped[-1]

    manager = JakiroContinuousBatchingManager(target, draft, config, jakiro_cb_config(
        page_size=4, num_blocks=128, max_batch_tokens=64, allow_block_sharing=sharing),
        TreeSettings.resolve(draft, adaptive=False))
    results, order = {}, []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharedPageFeatures, "prompt_features", spy_features)
        patch.setattr(SharedPageFeatures, "preload_draft", spy_preload)
        patch.setattr(JakiroBatchProcessor, "_observe", spy_observe)
        patch.setattr(SharedPageFeatures, "keep_draft_reads", spy_draft_reads)
        patch.setattr(JakiroBatchProcessor, "attach", attach_keeping_first_reads)
        patch.setattr(PagedAttentionCache, "search_prefix_match", spy_search)
        manager.start()
        try:
            for wave in (prompts[:1], prompts[1:]):
                ids = [manager.add_request(prompt, max_new_tokens=20) for prompt in wave]
                order += ids
                while not set(ids) <= set(results):
                    result = manager.get_result(timeout=30)
                    assert result is not None and result.error is None
                    results[result.request_id] = result
                if forget_features:
                    manager.batch_processor.shared_pages.by_hash.clear()
                    manager.batch_processor.shared_pages.draft_by_hash.clear()
            stats = manager.batch_processor.finished_stats
        finally:
            manager.stop(block=True)
    return ([results[r].generated_tokens for r in order], [stats[r] for r in order], [features.get(r) for r in order],
            skipped, [(preloaded.get(r, 0), read.get(r)) for r in order], [entries.get(r) for r in order])


@needs_allocators
def test_prompts_sharing_pages_skip_their_prefill_and_still_draft(pairs):
    """Prefix sharing: prompts that start like an earlier one (three 4-token pages in common) reuse its pages; their
    draft rows get the kept features of the shared positions, equal to those their own prefill computes without
    sharing, and the draft's entries of the first 11 positions, which the earlier prompt's read computed (the 12th
    depends on the 13th token), so that their draft reads the rest of the prompt only; they decode identical to
    `generate` alone. When the kept features are gone, a request decodes without the draft, still identical."""
    target, draft = pairs("llama")
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(3, VOCAB, (13,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 9)]
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=-1, pad_token_id=0)
    expected = [alone(target, prompt, config) for prompt in prompts]

    tokens, stats, features, skipped, reads, entries = shared_prefix_run(target, draft, prompts, sharing=True)
    assert tokens == expected
    assert sorted(skipped)[-2:] == [12, 12]  # both later prompts skipped the three shared pages
    assert reads == [(0, len(prompts[0]))] + [(11, len(prompt) - 11) for prompt in prompts[1:]]
    assert all(any(name.startswith("tree") for name in s.choices) for s in stats)
    tokens_off, stats_off, features_off, skipped_off, reads_off, entries_off = shared_prefix_run(
        target, draft, prompts, sharing=False)
    assert tokens_off == expected and not any(skipped_off)
    assert reads_off == [(0, len(prompt)) for prompt in prompts]
    assert [s.accepted_lengths for s in stats] == [s.accepted_lengths for s in stats_off]  # the same trees
    for shared, own, prompt in zip(entries, entries_off, prompts):  # the draft's entries as its own read computes them
        assert shared is not None and shared[0][0].shape[-2] == own[0][0].shape[-2] == len(prompt)
        for (k, v), (k_own, v_own) in zip(shared, own):
            torch.testing.assert_close(k, k_own, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, v_own, rtol=1e-4, atol=1e-5)
    for shared, own, prompt in zip(features, features_off, prompts):
        assert shared.shape[0] == len(prompt)
        torch.testing.assert_close(shared, own, rtol=1e-4, atol=1e-5)

    tokens, stats, features, _, _, _ = shared_prefix_run(target, draft, prompts, sharing=True, forget_features=True)
    assert tokens == expected
    assert features[1:] == [None, None] and all(set(s.choices[1:]) == {"plain"} for s in stats[1:])


@needs_allocators
def test_round_costs_are_kept_for_the_next_server(pairs, tmp_path, monkeypatch):
    """The controllers' measured round costs per count of decoding requests go to the per-machine cache when the
    batch goes idle; the next manager's controllers start from them instead of trying every choice first."""
    from transformers_jakiro.continuous import JakiroContinuousBatchingManager, jakiro_cb_config
    from transformers_jakiro.decoding import round_controller

    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(tmp_path / "round_costs.json"))
    target, draft = pairs("llama")
    config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=-1, pad_token_id=0)
    settings = TreeSettings.resolve(draft, adaptive=True)
    managers, saved = [], []
    for _ in range(2):
        manager = JakiroContinuousBatchingManager(target, draft, config, jakiro_cb_config(page_size=4, num_blocks=128),
                                                  settings)
        manager.start()
        try:
            ids = [manager.add_request(prompt, max_new_tokens=24) for prompt in prompts_of(41, 2)]
            for _ in ids:
                assert manager.get_result(timeout=30) is not None
            deadline = time.time() + 10
            while not manager.batch_processor._idle and time.time() < deadline:
                time.sleep(0.05)
            managers.append(manager.batch_processor)
        finally:
            manager.stop(block=True)
        saved.append(round_controller.load_costs(managers[-1].controllers[2].key))
    first, second = (processor.controllers[2] for processor in managers)
    assert "continuous-batching" in first.key and set(saved[0]) == {c.name for c in first.choices}
    assert first.cost_priors == {} and second.cost_priors == saved[0]


@needs_allocators
def test_copy_runs_bring_their_chain_when_the_batch_steps_plainly(monkeypatch):
    """With the batch's choice a plain step every round, requests whose text copies an earlier passage (a target that
    cycles) still bring their lookup chain: copy runs accept several tokens per forward, output identical to
    `generate` alone."""
    from test_lookup import CYCLE, cycle_target

    from transformers_jakiro import JakiroDraftModel
    from transformers_jakiro.continuous import JakiroBatchProcessor, jakiro_cb_config, jakiro_generate_batch
    from transformers_jakiro.decoding.round_controller import PinnedController, RoundChoice

    monkeypatch.setattr(JakiroBatchProcessor, "_controller", lambda self, n: PinnedController(RoundChoice("plain")))
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)
    prompts = [CYCLE + CYCLE[:5], CYCLE[3:] + CYCLE[:8], CYCLE[:9], CYCLE * 2]
    config = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=-1, pad_token_id=0)
    expected = [alone(target, prompt, config) for prompt in prompts]
    settings = TreeSettings.resolve(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10)
    out = jakiro_generate_batch(target, draft, prompts, config, jakiro_cb_config(page_size=4, num_blocks=128),
                                settings=settings, max_new_tokens=40)
    assert [result.generated_tokens for result in out.values()] == expected
    for result in out.values():
        stats = result.jakiro_stats
        assert set(stats.choice_counts) <= {"prefill", "plain", "copy run"} and stats.choice_counts["copy run"] >= 3
        assert stats.mean_accepted_length > 3  # nearly every token came from a chain


@needs_allocators
def test_draft_catch_up_is_charged_to_the_rounds_that_left_it(pairs, monkeypatch):
    """A tree round after plain steps first reads the positions those steps left to the draft: that time reaches the
    controller as deferred (charged to the plain steps), not as the tree's cost; outputs stay exact."""
    from transformers_jakiro.continuous import JakiroBatchProcessor, jakiro_cb_config, jakiro_generate_batch
    from transformers_jakiro.decoding.round_controller import RoundChoice

    class Scripted:  # plain, plain, plain, tree, ...: a tree round follows every plain spell
        def __init__(self):
            self.rounds, self.recorded = 0, []

        def choose(self, *signals):
            self.rounds += 1
            return RoundChoice("tree", 4, 2, 2) if self.rounds % 4 == 0 else RoundChoice("plain")

        def record(self, choice, tokens, seconds, chain_tokens=0.0, deferred_s=0.0):
            self.recorded.append((choice.kind, seconds, deferred_s))

    scripted = Scripted()
    monkeypatch.setattr(JakiroBatchProcessor, "_controller", lambda self, n: scripted)
    target, draft = pairs("llama")
    prompts = prompts_of(51, 2)
    config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=-1, pad_token_id=0)
    expected = [alone(target, prompt, config) for prompt in prompts]
    out = jakiro_generate_batch(target, draft, prompts, config, jakiro_cb_config(page_size=4, num_blocks=128),
                                settings=TreeSettings.resolve(draft, lookup_tokens=0), max_new_tokens=30)
    assert [result.generated_tokens for result in out.values()] == expected
    trees = [(seconds, deferred) for kind, seconds, deferred in scripted.recorded if kind == "tree"]
    plains = [deferred for kind, _, deferred in scripted.recorded if kind == "plain"]
    assert len(trees) >= 3 and all(deferred > 0 for _, deferred in trees[1:])  # after the first, each read a spell
    assert all(seconds > 0 for seconds, _ in trees) and not any(plains)


@needs_allocators
def test_offline_benchmark_pins_every_round_and_restores_the_controller(pairs):
    """`benchmarks/cb_offline.py`: under `Pinned` every decoding round is the variant's choice (a plain step, or the
    pinned tree), the classes are as before afterwards, and a burst answers every request in full."""
    from benchmark_scripts import load_script

    from transformers_jakiro.continuous import JakiroBatchProcessor, JakiroContinuousBatchingManager, jakiro_cb_config
    from transformers_jakiro.decoding.round_controller import RoundChoice

    script = load_script("cb_offline.py", "cb_offline")
    assert script.parse_variant("tree:2/1/2") == RoundChoice("tree", 2, 1, 2)
    target, draft = pairs("llama")
    before = JakiroBatchProcessor._controller
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=-1, pad_token_id=0)
    for choice in (RoundChoice("plain"), RoundChoice("tree", 2, 1, 2)):
        with script.Pinned(choice):
            cb = jakiro_cb_config(page_size=4, num_blocks=64)
            manager = JakiroContinuousBatchingManager(target, draft, config, cb)
            manager.start()
            try:
                assert script.burst(manager, prompts_of(6, 5), clients=2, max_tokens=6) > 0
                stats = manager.batch_processor.finished_stats
            finally:
                manager.stop(block=True)
        assert len(stats) == 6 and sorted(s.new_tokens for s in stats.values()) == [6] * 5 + [8]  # and the warm-up's
        kinds = set().union(*(s.choice_counts for s in stats.values())) - {"prefill", "copy run"}
        assert kinds == {choice.name}
        assert JakiroBatchProcessor._controller == before
