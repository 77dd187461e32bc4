"""The round controller: its choice rule (pure, on simulated rounds), its cost cache, and exactness whatever it
chooses (greedy identical to plain; sampling keeps the target's distribution)."""

import itertools
import json

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from test_sampling import PROMPT, chi_square_p_value, exact_distribution, sample_counts
from tiny_models import ARCHS, random_prompt, trained_pairs
from transformers_jakiro import jakiro_generate, tree_settings
from transformers_jakiro.decoding import round_controller
from transformers_jakiro.decoding.round_controller import RoundChoice, RoundController, choices_for
from transformers_jakiro.decoding.drafter import TreeSettings

FULL, SMALL = RoundChoice("tree", 24, 4, 6), RoundChoice("tree", 3, 2, 4, chains=False)
LOOKUP, PLAIN = RoundChoice("lookup"), RoundChoice("plain")


def test_choices_for_the_configured_tree():
    assert choices_for(24, 4, 6, lookup=True, fixed_shape=False) == [FULL, SMALL, LOOKUP, PLAIN]
    assert choices_for(24, 4, 6, lookup=False, fixed_shape=True) == [FULL, PLAIN]  # one padded tree size
    one_node = RoundChoice("tree", 1, 1, 2, chains=False)  # a small configured tree's smaller one: a single node
    assert choices_for(5, 1, 2, lookup=False, fixed_shape=False) == [RoundChoice("tree", 5, 1, 2), one_node, PLAIN]
    # a batch's per-row trees (`batch_tree`): 8/2/8 at 4 rows is 2/2/2, whose smaller tree is one node; at 8 rows the
    # per-row tree is one node already, and there is nothing smaller
    assert choices_for(2, 2, 2, lookup=True, fixed_shape=False) == [
        RoundChoice("tree", 2, 2, 2), one_node, LOOKUP, PLAIN]
    assert choices_for(1, 1, 1, lookup=True, fixed_shape=False) == [RoundChoice("tree", 1, 1, 1), LOOKUP, PLAIN]


def test_a_smaller_tree_grows_to_fill_a_forward_that_costs_less_with_more_queries():
    """`pad_queries` (a machine's cheaper query counts, `output_rows.padded_count`) grows the smaller tree: 2 nodes
    and the root are 3 queries, which a machine that runs 4 faster pads to 3 nodes, never to the configured tree's
    size; the configured tree stays."""
    four = {3: 4}
    assert choices_for(16, 1, 6, lookup=True, fixed_shape=False, pad_queries=lambda q: four.get(q, q)) == [
        RoundChoice("tree", 16, 1, 6), RoundChoice("tree", 3, 1, 4, chains=False), LOOKUP, PLAIN]
    assert choices_for(16, 1, 6, lookup=True, fixed_shape=False) == [
        RoundChoice("tree", 16, 1, 6), RoundChoice("tree", 2, 1, 4, chains=False), LOOKUP, PLAIN]
    assert choices_for(24, 4, 6, lookup=True, fixed_shape=False, pad_queries=lambda q: q) == [FULL, SMALL, LOOKUP,
                                                                                            PLAIN]
    # never as large as the configured tree (a table that says 16 queries cost less than 3 keeps 2 nodes)
    assert choices_for(16, 1, 6, lookup=False, fixed_shape=False, pad_queries=lambda q: 17)[1] == RoundChoice(
        "tree", 2, 1, 4, chains=False)


def simulate(controller, outcome, rounds=200, lookup_ready=True):
    """Run the controller on simulated rounds: outcome(choice) -> (tokens, seconds). Returns the choice counts and
    the tokens per second reached."""
    counts, tokens, seconds = {}, 0.0, 0.0
    for _ in range(rounds):
        choice = controller.choose(lookup_ready)
        counts[choice.name] = counts.get(choice.name, 0) + 1
        added, took = outcome(choice)
        controller.record(choice, added, took)
        tokens, seconds = tokens + added, seconds + took
    return counts, tokens / seconds


def test_each_choice_is_measured_first_then_the_fastest_dominates():
    # A CPU where a tree round costs 2.5 plain steps and adds 2 tokens: plain decoding is the fastest; lookup with
    # nothing accepted is nearly as fast (its choice then costs little).
    slow_tree = {FULL.name: (2, 2.5), SMALL.name: (1.5, 1.8), LOOKUP.name: (1, 1.05), PLAIN.name: (1, 1.0)}
    controller = RoundController(choices_for(24, 4, 6, True, False))
    assert controller.choose() == FULL  # nothing measured yet: the configured tree first
    counts, rate = simulate(controller, lambda c: slow_tree[c.name])
    assert all(counts[name] >= 1 for name in slow_tree)
    assert counts[FULL.name] + counts[SMALL.name] < 30 and rate >= 0.95  # the best choice gives 1.0 token/s
    # An accelerator where a tree round costs 1.2 steps and adds 3.5 tokens: the tree.
    fast_tree = {FULL.name: (3.5, 1.2), SMALL.name: (2.2, 1.1), LOOKUP.name: (1.2, 1.0), PLAIN.name: (1, 1.0)}
    counts, rate = simulate(RoundController(choices_for(24, 4, 6, True, False)), lambda c: fast_tree[c.name])
    assert counts[FULL.name] > 180 and rate >= 0.97 * 3.5 / 1.2


def test_a_choice_that_lost_is_tried_again_and_wins_when_the_text_changes():
    controller = RoundController([FULL, PLAIN])
    phase = {"tree_tokens": 1}
    outcome = lambda c: (phase["tree_tokens"], 1.5) if c.kind == "tree" else (1, 1.0)  # noqa: E731
    counts, _ = simulate(controller, outcome, rounds=60)
    assert counts[PLAIN.name] > 45
    phase["tree_tokens"] = 5  # the text starts repeating itself: trees are accepted deep
    counts, rate = simulate(controller, outcome, rounds=100)
    assert counts[FULL.name] > 80 and rate > 0.85 * 5 / 1.5


def test_a_cost_measured_once_too_high_is_measured_again():
    """The first plain step took three times its real cost (a warm-up, a busy moment): the tree, slower in truth,
    wins on that one sample; plain is tried again after STALE_ROUNDS rounds and then wins."""
    controller = RoundController([FULL, PLAIN])
    first = {"plain": True}

    def outcome(choice):
        if choice.kind == "plain":
            took, first["plain"] = (3.0 if first["plain"] else 1.0), False
            return 1, took
        return 1.5, 1.8  # 0.83 tokens/s against plain's 1.0

    counts, rate = simulate(controller, outcome, rounds=300)
    assert counts[PLAIN.name] > 200 and rate > 0.9


def test_choices_that_keep_losing_are_re_measured_ever_more_rarely():
    """Trees that lose at every re-measurement (temperature 1 in float32 on a small CPU: 2 plain steps' time for 1.05
    tokens) wait twice as long each time, so that over many rounds nearly all are plain steps; the waits carry over
    to the next call through `remember`."""
    losing = {FULL.name: (1.05, 2.0), SMALL.name: (1.02, 1.4), PLAIN.name: (1, 1.0)}
    controller = RoundController([FULL, SMALL, PLAIN], cost_priors={FULL.name: 2.0, SMALL.name: 1.4, PLAIN.name: 1.0},
                                 token_priors={FULL.name: 1.05, SMALL.name: 1.02})
    counts, rate = simulate(controller, lambda c: losing[c.name], rounds=2000)
    # 5 re-measurements of each tree (after 60, 180, 420, 900 and 1860 rounds), of REMEASURE_ROUNDS rounds each
    assert counts[PLAIN.name] >= 2000 - 2 * 5 * round_controller.REMEASURE_ROUNDS and rate >= 0.985
    assert controller.stale_after[FULL.name] >= 8 * round_controller.STALE_ROUNDS
    draft = type("Draft", (), {})()
    round_controller.remember(controller, draft)
    assert draft._jakiro_round_memory["greedy"]["stale_after"] == controller.stale_after
    # ... and a choice that wins once re-measured goes back to the usual wait.
    controller.rounds += controller.stale_after[FULL.name]
    for _ in range(round_controller.REMEASURE_ROUNDS):
        assert controller.choose() == FULL
        controller.record(FULL, 4.0, 0.5)
    assert controller.stale_after[FULL.name] == round_controller.STALE_ROUNDS


def test_one_unlucky_round_does_not_decide_a_re_measurement():
    """A re-measurement runs REMEASURE_ROUNDS rounds in a row and judges their mean: a tree that pays on average
    (2.2 tokens in 1.4 plain steps' time, 1.57x) but whose first re-measured round is slow and accepts nothing keeps
    the usual wait. With one round deciding, that round would double its wait (RCOST-7)."""
    controller = RoundController([SMALL, PLAIN], cost_priors={SMALL.name: 3.0, PLAIN.name: 1.0},
                                 token_priors={SMALL.name: 1.3})  # its cached cost lost
    for _ in range(round_controller.STALE_ROUNDS):
        assert controller.choose(False) == PLAIN
        controller.record(PLAIN, 1, 1.0)
    rounds = iter([(1.0, 1.8), (2.8, 1.3), (2.8, 1.3)])  # an unlucky, slow round, then two typical ones
    for _ in range(round_controller.REMEASURE_ROUNDS):
        assert controller.choose(False) == SMALL
        controller.record(SMALL, *next(rounds))
    assert controller.stale_after[SMALL.name] == round_controller.STALE_ROUNDS
    assert controller.expected_cost(SMALL) < 1.75  # the cached 3.0 s weighs half a round against the three
    assert controller.choose(False) == SMALL


def test_a_re_measurement_of_lookup_ends_when_no_chain_is_ready():
    controller = RoundController([LOOKUP, PLAIN], cost_priors={LOOKUP.name: 1.5, PLAIN.name: 1.0})
    controller.rounds = round_controller.STALE_ROUNDS
    assert controller.choose(True) == LOOKUP
    controller.record(LOOKUP, 1.0, 1.2)
    assert controller.choose(False) == PLAIN  # no chain this round: the re-measurement stops with what it has
    controller.record(PLAIN, 1.0, 1.0)
    assert controller._remeasure != LOOKUP.name  # (plain, stale too, is re-measured next)
    assert controller.expected_cost(LOOKUP) == pytest.approx((1.2 + 1.5 * round_controller.PRIOR_ROUNDS)
                                                             / (1 + round_controller.PRIOR_ROUNDS))


def test_rounds_since_a_choice_was_tried_carry_over_between_calls():
    """Calls of 20 rounds each: a choice that lost on its prior is re-measured once STALE_ROUNDS rounds have passed
    over several calls (the draft remembers the count), not never."""
    costs = {FULL.name: 3.0, PLAIN.name: 1.0}  # the tree's cached cost is wrong (a busy moment, say)
    draft = type("Draft", (), {})()
    tried = []
    for _ in range(5):  # each call starts from the costs the last one learned, and the draft's memory
        known = getattr(draft, "_jakiro_round_memory", {}).get("greedy", {"tokens": {FULL.name: 2.0}})
        controller = RoundController([FULL, PLAIN], cost_priors=costs, token_priors=dict(known["tokens"]),
                                     since_tried=dict(known.get("since_tried", {})))
        counts, _ = simulate(controller, lambda c: (4, 1.2) if c.kind == "tree" else (1, 1.0), rounds=20)
        tried.append(counts.get(FULL.name, 0))
        round_controller.remember(controller, draft)
        costs = controller.learned_costs()
    assert tried[:2] == [0, 0] and sum(tried[2:4]) > 0  # re-measured in the call where 60 rounds are reached
    assert tried[4] >= 15  # measured, it wins: 4 tokens in 1.2 s against 1 in 1.0 s


def test_every_tree_round_informs_every_tree():
    """The text's draftability is shared: rounds of the configured tree alone that stop being accepted lower what
    the smaller tree is expected to add too (a mean per choice kept the small tree at its old yield, and a tree
    measured in a bad stretch at its low one, until each was tried again)."""
    controller = RoundController([FULL, SMALL, PLAIN], token_priors={FULL.name: 3.0, SMALL.name: 2.2})
    before = controller.expected_tokens(SMALL)
    for _ in range(20):
        controller.choose(False)
        controller.record(FULL, 1.0, 1.0)  # the bonus token only: the draft is not accepted here
    assert controller.expected_tokens(SMALL) < 1.0 + 0.3 * (before - 1.0)
    for _ in range(20):
        controller.choose(False)
        controller.record(FULL, 4.0, 1.0)  # ... and now deeper than ever
    assert controller.expected_tokens(SMALL) > before


def test_a_smaller_tree_is_not_expected_to_add_more_than_a_larger_one():
    controller = RoundController([FULL, SMALL, PLAIN], token_priors={FULL.name: 2.0, SMALL.name: 1.5})
    for _ in range(10):  # a lucky streak of the small tree
        controller.choose(False)
        controller.record(SMALL, 4.0, 1.0)
    assert controller.expected_tokens(SMALL) == pytest.approx(controller.expected_tokens(FULL))
    assert controller.shapes[SMALL.name].mean() > controller.shape(SMALL)  # its own estimate, capped


def test_an_unmeasured_tree_is_placed_relative_to_the_measured_one():
    known = RoundController([FULL, SMALL], token_priors={FULL.name: 4.0})  # 3 draft tokens per round remembered
    guess = RoundController([FULL, SMALL])
    ratio = (round_controller.prior_tokens(SMALL) - 1) / (round_controller.prior_tokens(FULL) - 1)
    assert known.shape(SMALL) == pytest.approx(3.0 * ratio)
    assert guess.shape(SMALL) == pytest.approx(round_controller.prior_tokens(SMALL) - 1)


def test_a_tree_carries_lookup_chains_as_its_choice_says():
    assert RoundChoice("tree", 8, 2, 4).carries_chains(copying=False)
    assert not SMALL.carries_chains(copying=False)
    assert SMALL.carries_chains(copying=True)  # a copy run's chain goes along
    assert not PLAIN.carries_chains(copying=True) and not LOOKUP.carries_chains(copying=False)


def test_lookup_chain_tokens_count_for_the_trees_that_carry_chains_when_a_chain_is_ready():
    carrying = RoundChoice("tree", 8, 2, 4)  # a smaller tree that carries chains, unlike `choices_for`'s SMALL
    controller = RoundController([FULL, carrying, SMALL, LOOKUP, PLAIN],
                                 token_priors={FULL.name: 2.0, carrying.name: 1.5, SMALL.name: 1.5})
    without = controller.expected_tokens(carrying, lookup_ready=True)
    small = controller.expected_tokens(SMALL, lookup_ready=True)
    for _ in range(10):
        controller.choose(True)
        controller.record(FULL, 5.0, 1.0, chain_tokens=3.0)  # 3 of the 4 accepted tokens came from the chain
    assert controller.expected_tokens(carrying, lookup_ready=True) > without + 2.0
    assert controller.expected_tokens(carrying, lookup_ready=False) < without + 0.5  # no chain, no chain tokens
    assert controller.expected_tokens(SMALL, lookup_ready=True) < small + 0.5  # no chain outside copy runs
    controller.choose(True)
    controller.record(SMALL, 2.0, 1.0, chain_tokens=0.0)  # its rounds do not tell what chains add
    assert controller.chain_tokens[""].mean() == pytest.approx(3.0)


def test_a_deferred_draft_read_is_charged_to_the_round_that_left_it():
    """A plain step leaves the draft a position to read in the next tree round: that read is the plain step's cost
    (it would not be paid without it), not the tree's."""
    controller = RoundController([FULL, PLAIN])
    controller.choose(False)
    controller.record(PLAIN, 1.0, 1.0)
    controller.choose(False)
    controller.record(FULL, 3.0, 2.0, deferred_s=0.25)
    assert controller.expected_cost(PLAIN) == pytest.approx(1.25)
    assert controller.expected_cost(FULL) == pytest.approx(2.0)
    controller.record(FULL, 3.0, 2.0, deferred_s=0.25)  # after a tree round nothing was deferred: not charged
    assert controller.expected_cost(PLAIN) == pytest.approx(1.25)


def test_the_configured_tree_shape_is_learned_between_calls():
    """Within a call the configured tree's shape sets the scale (the draftability moves); between calls it moves to
    what its rounds added, so a wrong first guess does not stay."""
    draft = type("Draft", (), {})()
    prior = None
    for _ in range(5):
        known = getattr(draft, "_jakiro_round_memory", {}).get("greedy", {})
        controller = RoundController([FULL, PLAIN], token_priors=dict(known.get("tokens", {})))
        prior = controller.expected_tokens(FULL)
        for _ in range(30):
            controller.choose(False)
            controller.record(FULL, 4.0, 1.0)
        round_controller.remember(controller, draft)
    assert prior == pytest.approx(4.0, abs=0.3)


def test_what_chains_add_in_copy_runs_is_remembered_between_calls():
    """A CPU where a tree round costs 3 plain steps: in a copy run the chain-carrying small tree adds 9 tokens, and a
    call that measured that starts the next call's copy runs with it. Without the memory every call's first copy run
    had to beat a plain step on the guess (COPYING_PRIOR) alone, and lost (RCOST-7)."""
    costs = {FULL.name: 3.2, SMALL.name: 3.0, LOOKUP.name: 3.2, PLAIN.name: 1.0}
    memory = {}

    def call(rounds):
        controller = RoundController([FULL, SMALL, LOOKUP, PLAIN], cost_priors=costs, token_priors=dict(memory),
                                     key="test")
        first = controller.choose(True, copying=True)
        for _ in range(rounds):
            controller.record(SMALL, 9.0, 3.0, chain_tokens=7.5)  # (the rounds this call ran in its copy runs)
            controller.choose(True, copying=True)
        for _ in range(60):  # ... and plain steps after them: the copy run still counts when the call ends
            controller.choose(False)
            controller.record(PLAIN, 1.0, 1.0)
        memory.update(controller.learned_tokens())
        return first

    assert call(5) == PLAIN  # the guess: about 2.5 tokens for 3 steps' time
    assert memory[round_controller.CHAINS + round_controller.COPYING] > 3.5  # most of the way from the guess
    assert call(1).carries_chains(copying=True)  # remembered: the copy run is taken from its first round


def test_a_lookup_round_that_accepted_nothing_moves_the_memory_only_partway():
    controller = RoundController([FULL, LOOKUP, PLAIN], token_priors={"lookup after copying": 6.0})
    controller.choose(True, copying=True)
    controller.record(LOOKUP, 1.0, 1.0)
    learned = controller.learned_tokens()["lookup after copying"]
    assert 4.5 < learned < 6.0  # one round of 1 token against the remembered 6, which weighs SHAPE_PRIOR_ROUNDS


def test_batch_lookup_chains_share_the_budget_as_the_tree_does():
    assert [round_controller.batch_lookup_tokens(10, b) for b in (1, 2, 3, 4, 8, 32)] == [10, 5, 3, 2, 1, 1]
    assert round_controller.batch_lookup_tokens(0, 8) == 0  # lookup off stays off


def test_lookup_is_chosen_only_when_a_chain_is_ready():
    controller = RoundController(choices_for(24, 4, 6, True, False))
    counts, _ = simulate(controller, lambda c: (1, 1.0), rounds=50, lookup_ready=False)
    assert LOOKUP.name not in counts


def test_copy_runs_are_told_apart_from_the_rest_of_the_text():
    """Text that copies an earlier passage in runs (a copying round is followed by another with probability 0.85, a
    run starts with probability 0.08): lookup then adds 6 tokens, elsewhere 1 (at 1.3 plain steps). Keeping lookup's
    yield apart after copying rounds takes lookup in the runs and plain steps elsewhere, near the best policy's rate;
    one mean for both (no context) averages the runs away."""
    import random

    def run(with_context: bool) -> float:
        rng, copying, tokens, seconds = random.Random(0), False, 0.0, 0.0
        controller = RoundController([LOOKUP, PLAIN], cost_priors={LOOKUP.name: 1.3, PLAIN.name: 1.0})
        for _ in range(3000):
            choice = controller.choose(True, copying and with_context)
            added, took = ((6 if copying else 1), 1.3) if choice.kind == "lookup" else (1, 1.0)
            controller.record(choice, added, took)
            tokens, seconds = tokens + added, seconds + took
            copying = rng.random() < (0.85 if copying else 0.08)
        return tokens / seconds

    share = 0.08 / (0.08 + 0.15)  # rounds in copy runs, in the long run
    best = (share * 6 + (1 - share)) / (share * 1.3 + (1 - share))  # lookup in runs, plain steps elsewhere
    assert run(with_context=True) >= 0.9 * best
    assert run(with_context=True) > 1.1 * run(with_context=False)


def test_continues_compares_a_round_with_the_chain_ready_at_its_start():
    from transformers_jakiro.decoding.lookup import continues

    assert continues([5, 6, 7], [5]) and continues([5, 6, 7], [5, 6, 7, 9]) and continues([5], [5, 8])
    assert not continues([5, 6, 7], [5, 8]) and not continues([], [5]) and not continues([6], [5])


def test_priors_from_earlier_calls_skip_the_first_measurements():
    controller = RoundController([FULL, PLAIN], cost_priors={FULL.name: 2.0, PLAIN.name: 1.0},
                                 token_priors={FULL.name: 3.0})
    assert controller.choose() == FULL  # 3 tokens / 2 s beats 1 / 1 s before any round ran
    controller = RoundController([FULL, PLAIN], cost_priors={FULL.name: 2.0, PLAIN.name: 1.0},
                                 token_priors={FULL.name: 1.2})
    assert controller.choose() == PLAIN


def test_costs_are_cached_on_disk_per_machine_key(tmp_path, monkeypatch):
    monkeypatch.delenv("JAKIRO_ROUND_COSTS")
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path))
    assert round_controller.load_costs("k") == {}
    round_controller.save_costs("k", {FULL.name: 0.02})
    round_controller.save_costs("k", {PLAIN.name: 0.01})
    round_controller.save_costs("other", {PLAIN.name: 0.5})
    assert round_controller.load_costs("k") == {FULL.name: 0.02, PLAIN.name: 0.01}
    (tmp_path / "round_costs.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="round_costs.json is not valid JSON"):
        assert round_controller.load_costs("k") == {}  # a damaged cache only costs the next call its first measurements
    round_controller.save_costs("k", {PLAIN.name: 0.01})
    assert json.loads((tmp_path / "round_costs.json").read_text()) == {"k": {PLAIN.name: 0.01}}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(tmp_path / "round_costs.json"))
    return tmp_path


@pytest.fixture
def cycling(monkeypatch):
    """Replace the controller's choice by a fixed cycle over every available choice, so that all kinds of rounds
    (plain, lookup, small tree, full tree) follow each other in every order within a few rounds."""

    step = itertools.count()  # one cycle across generate calls: each call starts at another choice

    def choose(self, lookup_ready=True, copying=False, chain_was_whole=False):
        available = [c for c in self.choices if c.kind != "lookup" or lookup_ready]
        return available[(next(step) * 7 // 3) % len(available)]

    monkeypatch.setattr(RoundController, "choose", choose)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_is_exact_whatever_the_controller_chooses(arch, cache_dir, cycling):
    target, draft = trained_pairs()(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [random_prompt(g), torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])]
    kinds_seen = set()
    for prompt, cache, lookup in itertools.product(prompts, (None, "static"), (0, 3)):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=30, repetition_penalty=1.2)
        with tree_settings(draft, adaptive=True, total_tokens=12, depth=3, top_k=3, lookup_tokens=lookup):
            got = target.generate(prompt, do_sample=False, max_new_tokens=30, repetition_penalty=1.2,
                                  assistant_model=draft, cache_implementation=cache)
        assert torch.equal(got, plain), (arch, prompt.tolist(), cache, lookup)
        kinds = {name.split()[0] for name in draft.last_generation_stats.choice_counts}
        assert {"plain", "tree"} <= kinds
        kinds_seen |= kinds
    assert "lookup" in kinds_seen


def test_the_real_controller_is_exact_and_records_its_choices(cache_dir):
    target, draft = trained_pairs()("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    kwargs = dict(do_sample=False, max_new_tokens=40, total_tokens=12, depth=3, top_k=3, lookup_tokens=3)
    for _ in range(2):  # the second call starts from the costs the first one cached
        got = target.generate(prompt, custom_generate=jakiro_generate, draft=draft, adaptive=True, **kwargs)
        assert torch.equal(got, plain)
    stats = draft.last_generation_stats
    assert stats.choices[0] == "prefill" and len(stats.choices) == stats.rounds
    assert sum(stats.choice_counts.values()) == stats.rounds - 1
    assert (cache_dir / "round_costs.json").is_file()
    pinned = target.generate(prompt, custom_generate=jakiro_generate, draft=draft, adaptive=False, **kwargs)
    assert torch.equal(pinned, plain)
    assert set(draft.last_generation_stats.choice_counts) <= {"tree 12/3/3", "lookup"}


def test_sampling_with_the_controller_keeps_the_target_distribution(cache_dir, cycling):
    from test_sampling import target_and_draft

    torch.manual_seed(0)
    target, draft = target_and_draft.__wrapped__()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    probs = exact_distribution(target, processors)
    settings = TreeSettings.resolve(draft, total_tokens=10, depth=2, top_k=3, adaptive=True)
    counts = sample_counts(target, draft, processors, 4000, PROMPT, settings)
    assert chi_square_p_value(counts, probs) > 1e-4
    assert sample_counts.multi_token_rounds > 500  # tree rounds among the cycled ones were accepted
