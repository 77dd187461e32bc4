"""The round controller: each round, the one place that decides what the target verifies.

A round verifies a `plain` step (the root alone), `lookup` chains alone, or a `tree T/D/K` (the configured tree or a
smaller one, lookup chains grafted when lookup is on). `RoundController` picks the largest

    (expected tokens + exploration bonus) / expected seconds,

expected tokens of a tree = 1 + shape x draftability (+ the tokens grafted chains add), of lookup and of a plain step
their discounted past yields; seconds = each choice's discounted round times, with times cached per machine
(`$JAKIRO_CACHE/round_costs.json`) as a prior. Untried choices are tried first, stale ones re-measured over a few
rounds in a row; yields are kept apart after a copying round (`lookup.continues`). `PinnedController`
(`adaptive=False`) verifies the configured tree every round, and lookup chains alone after a round that accepted its
whole chain, as prompt lookup decoding does.

Exactness never depends on the choice: every round is verified by the same rule, and a choice reads past rounds only,
never the round's own random draws. Host bookkeeping only: no tensor, no device sync. Why the rule has this shape and
what each earlier version got wrong: docs/experiments/round-controller.md, runs RC-1 to RC-8.
"""

import contextlib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

DISCOUNT = 0.95  # weight of an observation one round older: the last ~20 rounds dominate
PRIOR_ROUNDS = 0.5  # the prior's weight, in rounds: enough to rank untried choices, little against measurements
PRIOR_ACCEPTANCE = 0.55  # a tree's guessed acceptance per depth before anything was measured
EXPLORATION = 0.3  # the exploration bonus, in tokens, of a choice not seen lately (a quarter after one round)
STALE_ROUNDS = 60  # a choice not tried for this many rounds is tried again (its cost or yield may have changed)
# A re-measurement's rounds, in a row: one round's time varies by up to +-20% (SmolLM2 on a CPU: 62-87 ms for one
# tree) and its yield by whole tokens, so that one round decided waits of up to MAX_STALE_ROUNDS (RCOST-7).
REMEASURE_ROUNDS = 3
HOPELESS = 0.5  # ... unless its first round left it below this share of the best's tokens per second (plain on a GPU)
MAX_STALE_ROUNDS = 960  # the longest wait between re-measurements of a choice that keeps losing
COPYING_PRIOR = 2.5  # tokens a lookup-carrying round is guessed to add right after a copying round
SHAPE_DISCOUNT = 0.98  # a tree shape's weight per own round: the last ~50 rounds of that tree
DRAFTABILITY_PRIOR_ROUNDS = 1.0  # the draftability prior (1) weighs one round of the largest tree
SHAPE_PRIOR_ROUNDS = 4.0  # the weight, in rounds of that tree, of a tree shape's prior
COPYING = " after copying"  # the suffix of a choice's name for its yield in rounds that follow a copying round
CHAINS = "lookup chains on a tree"  # the name tokens that only grafted chains added are remembered under (+ COPYING)


@dataclass(frozen=True)
class RoundChoice:
    kind: str  # "plain", "lookup" or "tree"
    total_tokens: int = 0
    depth: int = 0
    top_k: int = 0
    # A tree: whether the round's lookup chains (lookup on, a chain ready) are grafted onto it in every round, or only
    # in a copy run (the last round continued the ready chain, `lookup.continues`: there a chain adds most).
    chains: bool = True

    def carries_chains(self, copying: bool) -> bool:
        return self.kind == "tree" and (self.chains or copying)

    @property
    def name(self) -> str:
        return self.kind if self.kind != "tree" else f"tree {self.total_tokens}/{self.depth}/{self.top_k}"


def choices_for(total_tokens: int, depth: int, top_k: int, lookup: bool, fixed_shape: bool,
                pad_queries=None) -> list[RoundChoice]:
    """The configured tree, a smaller tree (not with fixed shapes: every tree is padded to one size there, so a
    smaller one would save only draft levels), lookup alone when lookup is on, and a plain step; in the order they
    are first tried.

    The smaller tree is the cheapest draft round: half the levels, as many nodes as levels (the contrastive one
    included), the best-ranked of up to 4 candidates per parent, and lookup chains grafted only in copy runs (where
    a 10-token chain verified alone adds 6.8 tokens on average, elsewhere 1.4: RC-2). It is for targets where every
    verified node costs compute: on a CPU, SmolLM2-135M fp32 on 1 thread, a 3-token forward costs 1.18x
    a one-token step and a 4- to 6-token one about 1.6x, so a third of the configured tree (or a one-token chain
    grafted onto the smaller tree) lost to plain steps (docs/experiments/round-cost.md, RCOST-6). It has at least one
    node, so a batch's per-row tree of 2 to 4 nodes (`batch_tree`) gets a one-node one: the cheapest drafted round
    where each row's extra query rows cost compute (Qwen2.5-Coder-1.5B bf16 at 4 rows on a 2-core CPU, BATCH-Q4 in
    docs/experiments/batches.md).

    `pad_queries` (a function from a verify forward's query count to the count this machine runs at least as fast)
    grows the smaller tree to fill its forward, while it stays smaller than the configured tree: on a 2-core AMD EPYC,
    SmolLM2-135M fp32, a 4-token forward costs less than a 3-token one, and one request's rounds of 3 draft nodes took
    63-65 ms against 72-73 ms for 2 (CB-16)."""
    full = RoundChoice("tree", total_tokens, depth, top_k)
    options = [full]
    small_depth = max(1, (depth + 1) // 2)
    small_total = max(1, min(total_tokens // 3, small_depth + 1))
    padded = pad_queries(1 + small_total) - 1 if pad_queries is not None else small_total  # the root and its nodes
    if padded < total_tokens:
        small_total = padded
    small = RoundChoice("tree", small_total, min(small_depth, small_total), max(1, min(top_k, 4)), False)
    if not fixed_shape and small.total_tokens < full.total_tokens:
        options.append(small)
    if lookup:
        options.append(RoundChoice("lookup"))
    options.append(RoundChoice("plain"))
    return options


def prior_tokens(choice: RoundChoice, acceptance: float = PRIOR_ACCEPTANCE, copying: bool = False) -> float:
    """Tokens a round of `choice` is guessed to add before any is measured: a plain step 1; a tree 1 + a + a^2 + ...
    over its levels (the contrastive level included); lookup 1 + a; after a copying round (only rounds with lookup
    on have one), a round with lookup chains at least COPYING_PRIOR."""
    if choice.kind == "plain":
        return 1.0
    guess = 1.0 + acceptance if choice.kind == "lookup" else sum(acceptance**level for level in range(choice.depth + 2))
    return max(guess, COPYING_PRIOR) if copying else guess


def _yield_key(choice: RoundChoice, copying: bool) -> str:
    """The name a choice's token yield is kept (and remembered on the draft) under: apart after copying rounds."""
    return choice.name + (COPYING if copying else "")


@dataclass
class RunningMean:
    """A discounted mean: each new observation weighs 1, older ones DISCOUNT times less per step (`decay`)."""

    weight: float = 0.0
    total: float = 0.0

    def decay(self) -> None:
        self.weight *= DISCOUNT
        self.total *= DISCOUNT

    def add(self, value: float) -> None:
        self.weight += 1.0
        self.total += value

    def mean(self, prior: float | None = None, prior_weight: float = 0.0) -> float | None:
        if prior is None:
            return self.total / self.weight if self.weight else None
        return (self.total + prior * prior_weight) / (self.weight + prior_weight)


@dataclass
class RoundController:
    """Chooses each round's `RoundChoice` (see the module docstring). `token_priors` maps choice names to tokens per
    round from earlier calls (a tree's: at draftability 1, lookup chains left out); `cost_priors` to seconds per
    round."""

    choices: list[RoundChoice]
    token_priors: dict = field(default_factory=dict)
    cost_priors: dict = field(default_factory=dict)
    key: str = ""  # the `machine_key` its costs are cached under
    stale_after: dict = field(default_factory=dict)  # per choice name: rounds until it is re-measured (STALE_ROUNDS)
    mode: str = "greedy"  # "greedy" or "sampling": what the draft remembers its yields and waits under
    since_tried: dict = field(default_factory=dict)  # per choice name: rounds since it was tried, in earlier calls

    def __post_init__(self):
        contexts = ("", COPYING)
        self.lookup_yield = {context: RunningMean() for context in contexts}  # tokens of lookup-alone rounds
        # Shared by every tree: draft tokens observed against expected at draftability 1 (the text's draftability),
        # and tokens that only the lookup chains added (the same chains hang from any tree).
        self.drafted = {context: (RunningMean(), RunningMean()) for context in contexts}
        self.chain_tokens = {context: RunningMean() for context in contexts}
        # Per tree: its recent rounds (aged every round), for the exploration bonus.
        self.tree_rounds = {c.name: RunningMean() for c in self.choices if c.kind == "tree"}
        # Per tree: draft tokens per round at draftability 1, aged only by that tree's own rounds. Before a tree was
        # measured: the reference tree's shape (`prior_tokens`, else the draft's memory) scaled by the two trees'
        # geometric guesses, so that an unmeasured tree is placed relative to the one the text was measured with.
        trees = [c for c in self.choices if c.kind == "tree"]
        guess = {c.name: max(prior_tokens(c) - 1.0, 1e-3) for c in trees}
        self.shapes = {}
        for choice in trees:
            remembered = self.token_priors.get(choice.name)
            if remembered is None and trees[0].name in self.token_priors:
                reference = max(self.token_priors[trees[0].name] - 1.0, 0.0)
                prior = reference * guess[choice.name] / guess[trees[0].name]
            else:
                prior = remembered - 1.0 if remembered is not None else guess[choice.name]
            self.shapes[choice.name] = RunningMean(SHAPE_PRIOR_ROUNDS, max(prior, 0.0) * SHAPE_PRIOR_ROUNDS)
        self.costs = {c.name: RunningMean() for c in self.choices}
        self.rounds = 0
        # The round in which each choice was last recorded; earlier calls' rounds count as negative ones, so that a
        # choice is re-measured after STALE_ROUNDS rounds even when every call is shorter than that.
        self.last_tried = {name: -since for name, since in self.since_tried.items()}
        self._remeasure = None  # the name of a stale choice being re-measured
        self._remeasured = 0  # its rounds so far
        self._copying = False  # whether the round being chosen follows a copying round
        self._lookup_ready = False  # whether lookup chains were ready for the round being chosen
        self._lookup_on = any(c.kind == "lookup" for c in self.choices)
        self._deferred_by = None  # the last round's choice, when it left the draft positions to read later
        self.reference = trees[0] if trees else None  # the configured tree (`choices_for` lists it first)
        self._reference_drafted = [0.0, 0.0]  # its draft tokens in this call, observed and expected
        self._observed = {}  # rounds of this call behind each remembered yield (lookup alone, chains), by its name

    def draftability(self, copying: bool = False) -> float:
        """The text's draftability now: draft tokens the configured tree's recent rounds added, over what its shape
        expects; the prior (1) weighs DRAFTABILITY_PRIOR_ROUNDS of its rounds, so that without recent rounds of it
        the draftability returns to 1 and every tree to its shape."""
        observed, expected = self.drafted[COPYING if copying else ""]
        prior = DRAFTABILITY_PRIOR_ROUNDS * max([shape.mean() for shape in self.shapes.values()] + [0.1])
        return (observed.total + prior) / (expected.total + prior)

    def shape(self, choice: RoundChoice) -> float:
        """A tree's draft tokens per round at draftability 1: its own estimate, capped by that of every tree at least
        as large in nodes, levels and children (with the same draft a smaller tree's candidates are nearly a subset
        of the larger's, and it never accepted more in paired measurements; the cap keeps a lucky streak of the
        small tree from ranking it above the large one)."""
        own = self.shapes[choice.name].mean()
        larger = [
            self.shapes[other.name].mean() for other in self.choices
            if other.kind == "tree" and other != choice and other.total_tokens >= choice.total_tokens
            and other.depth >= choice.depth and other.top_k >= choice.top_k
        ]
        return min([own, *larger])

    def expected_tokens(self, choice: RoundChoice, copying: bool = False, lookup_ready: bool = True) -> float:
        if choice.kind == "plain":
            return 1.0
        context = COPYING if copying else ""
        if choice.kind == "lookup":
            prior = self.token_priors.get(_yield_key(choice, copying), prior_tokens(choice, copying=copying))
            return self.lookup_yield[context].mean(prior, PRIOR_ROUNDS)
        tokens = 1.0 + self.shape(choice) * self.draftability(copying)
        if self._lookup_on and lookup_ready and choice.carries_chains(copying):
            # Before this call measured any: what chains added in earlier calls, else a guess (in a copy run a chain
            # adds most: without the memory, each call's first copy run had to beat plain steps on the guess alone).
            tokens += self.chain_tokens[context].mean(self._chain_prior(choice, copying), PRIOR_ROUNDS)
        return tokens

    def _chain_prior(self, choice: RoundChoice, copying: bool) -> float:
        guess = max(COPYING_PRIOR - prior_tokens(choice), 0.0) if copying else 0.0
        return self.token_priors.get(CHAINS + (COPYING if copying else ""), guess)

    def expected_cost(self, choice: RoundChoice) -> float | None:
        prior = self.cost_priors.get(choice.name)
        return self.costs[choice.name].mean(prior, PRIOR_ROUNDS if prior is not None else 0.0)

    def choose(self, lookup_ready: bool = True, copying: bool = False, chain_was_whole: bool = False) -> RoundChoice:
        """This round's choice; `lookup_ready`: the n-gram lookup has a chain to offer now; `copying`: the last round's
        tokens continued the chain ready at its start (`lookup.continues`); `chain_was_whole` (`PinnedController`'s
        signal) is not used here."""
        self._copying, self._lookup_ready = copying, lookup_ready
        available = [c for c in self.choices if c.kind != "lookup" or lookup_ready]
        for choice in available:  # first, measure what each choice costs
            if self.expected_cost(choice) is None:
                return choice
        if self._remeasure is not None:  # a re-measurement goes on for REMEASURE_ROUNDS rounds while it can
            going_on = [c for c in available if c.name == self._remeasure]
            if going_on:
                return going_on[0]
            self._remeasure, self._remeasured = None, 0  # lookup alone without a chain: what it measured stands
        for choice in available:  # then re-measure what was not tried for long: the new times replace the old
            if self.rounds - self.last_tried.get(choice.name, 0) >= self.stale_after.get(choice.name, STALE_ROUNDS):
                self._remeasure, self._remeasured = choice.name, 0
                return choice

        return max(available, key=lambda choice: self._value(choice, copying, EXPLORATION))  # ties: the larger tree

    def _value(self, choice: RoundChoice, copying: bool, exploration: float) -> float:
        """Expected tokens per second, plus an exploration bonus for a choice with an unknown yield: lookup alone
        while it was not tried lately, a tree while its shape rests on few rounds."""
        bonus = 0.0
        if choice.kind == "lookup":
            bonus = exploration / (1.0 + self.lookup_yield[COPYING if copying else ""].weight) ** 2
        elif choice.kind == "tree":
            bonus = exploration / (1.0 + self.tree_rounds[choice.name].weight) ** 2
        tokens = self.expected_tokens(choice, copying, self._lookup_ready)
        return (tokens + bonus) / self.expected_cost(choice)

    def record(
        self, choice: RoundChoice, tokens: float, seconds: float, chain_tokens: float = 0.0, deferred_s: float = 0.0
    ) -> None:
        """A round's outcome (of the round last chosen: its yield counts for that round's context). `chain_tokens`:
        the accepted tokens that only lookup chains proposed; `seconds`: the round's time without `deferred_s`, the
        time it spent on work that earlier rounds left (the draft's read of positions that rounds without a draft
        forward accepted), which is charged to the last such round's choice. Yields age with every round (the text
        changes); costs and tree shapes only with their own rounds (the machine and the draft do not)."""
        if deferred_s > 0 and self._deferred_by is not None:  # a plain or lookup-only round's cost, paid late
            self.costs[self._deferred_by].total += float(deferred_s)
        self._deferred_by = choice.name if choice.kind != "tree" else None
        self.rounds += 1
        self.last_tried[choice.name] = self.rounds
        remeasuring = self._remeasure == choice.name
        if remeasuring:
            if self._remeasured == 0:
                self.costs[choice.name] = RunningMean()
            self._remeasured += 1
        context = COPYING if self._copying else ""
        shared = [self.chain_tokens[c] for c in self.chain_tokens] + [m for pair in self.drafted.values() for m in pair]
        for mean in [*self.lookup_yield.values(), *shared, *self.tree_rounds.values()]:
            mean.decay()
        if choice.kind == "lookup":
            self.lookup_yield[context].add(float(tokens))
            self._observe(_yield_key(choice, self._copying))
        elif choice.kind == "tree":
            drafted = max(float(tokens) - 1.0 - float(chain_tokens), 0.0)
            self.tree_rounds[choice.name].add(1.0)
            if choice == self.reference:  # its shape sets the scale (learned between calls): its rounds measure the text
                observed, expected = self.drafted[context]
                observed.add(drafted)
                expected.add(self.shape(choice))
                if not self._copying:
                    self._reference_drafted[0] += drafted
                    self._reference_drafted[1] += self.shape(choice)
            else:  # a smaller tree's rounds measure its shape, against the text as the reference's rounds measured it
                shape = self.shapes[choice.name]
                shape.weight, shape.total = shape.weight * SHAPE_DISCOUNT, shape.total * SHAPE_DISCOUNT
                shape.add(drafted / self.draftability(self._copying))
            if self._lookup_on and self._lookup_ready and choice.carries_chains(self._copying):
                self.chain_tokens[context].add(float(chain_tokens))
                self._observe(CHAINS + context)
        self.costs[choice.name].decay()
        self.costs[choice.name].add(float(seconds))
        if remeasuring:
            ranked = [c for c in self.choices if self.expected_cost(c) is not None]
            best = max(ranked, key=lambda c: self._value(c, self._copying, 0.0))
            hopeless = self._value(choice, self._copying, 0.0) < HOPELESS * self._value(best, self._copying, 0.0)
            if self._remeasured >= REMEASURE_ROUNDS or hopeless:
                # Still behind the best: wait twice as long before measuring it again; ahead: the usual wait.
                self._remeasure, self._remeasured = None, 0
                wait = self.stale_after.get(choice.name, STALE_ROUNDS)
                self.stale_after[choice.name] = STALE_ROUNDS if best == choice else min(2 * wait, MAX_STALE_ROUNDS)

    def learned_tokens(self) -> dict:
        """What the draft remembers for the next call: each tree's tokens per round at draftability 1 (lookup chains
        left out), lookup alone's tokens per round and the tokens chains added to trees, in each context."""
        learned = {c.name: 1.0 + self.shape(c) for c in self.choices if c.kind == "tree"}
        observed, expected = self._reference_drafted
        if expected > 0:  # the reference tree's shape moves towards what its rounds of this call added
            shape = self.shapes[self.reference.name].mean()
            rounds = expected / max(shape, 1e-6)
            blended = (shape * SHAPE_PRIOR_ROUNDS + observed) / (SHAPE_PRIOR_ROUNDS + rounds)
            learned[self.reference.name] = 1.0 + blended
        lookup = RoundChoice("lookup")
        for copying in (False, True):
            context = COPYING if copying else ""
            # Each yield moves towards this call's as the reference's shape does: a call's one unlucky round (a copy
            # run's lookup round that accepted nothing) must not become every later call's prior.
            key = _yield_key(lookup, copying)
            if key in self._observed:
                prior = self.token_priors.get(key, prior_tokens(lookup, copying=copying))
                learned[key] = self._remembered(key, self.lookup_yield[context], prior)
            if CHAINS + context in self._observed and self.reference is not None:
                prior = self._chain_prior(self.reference, copying)
                learned[CHAINS + context] = self._remembered(CHAINS + context, self.chain_tokens[context], prior)
        return learned

    def _observe(self, key: str) -> None:
        self._observed[key] = self._observed.get(key, 0) + 1

    def _remembered(self, key: str, mean: RunningMean, prior: float) -> float:
        """A yield for the next call: this call's (recent rounds weigh most) against the prior, each by its rounds
        (the prior's: SHAPE_PRIOR_ROUNDS; this call's are counted, not discounted, so that a copy run early in a long
        call still counts)."""
        rounds = self._observed[key]
        return (mean.mean() * rounds + prior * SHAPE_PRIOR_ROUNDS) / (rounds + SHAPE_PRIOR_ROUNDS)

    def learned_costs(self) -> dict:
        costs = {choice.name: self.expected_cost(choice) for choice in self.choices}
        return {name: cost for name, cost in costs.items() if cost is not None}


def batch_tree(total_tokens: int, depth: int, top_k: int, batch: int) -> tuple[int, int, int]:
    """The tree each row of a batch of `batch` gets in place of the configured one (`total_tokens`/`depth`/`top_k`):
    the configured tree's node budget shared by the rows, so that a batch's verify forward holds about as many tokens
    as one sequence's (`total_tokens` + the roots) and costs about what the tuned tree costs at batch size 1:

        total = max(1, round(total_tokens / batch)),  depth = min(depth, total),  top_k = min(top_k, total)

    (24/4/6 becomes 12/4/6 at 2 rows, 6/4/6 at 4, 3/3/3 at 8). The round controller then chooses, per batch round,
    between this tree, a smaller one and a plain batched step, from measured times at this batch size."""
    if batch <= 1:
        return total_tokens, depth, top_k
    total = max(1, round(total_tokens / batch))
    return total, min(depth, total), min(top_k, total)


def batch_lookup_tokens(lookup_tokens: int, batch: int) -> int:
    """The longest lookup chain each row of a batch of `batch` gets in place of `lookup_tokens`: the chain budget
    shared by the rows as the tree's is (`batch_tree`), max(1, round(lookup_tokens / batch)); 0 stays 0 (lookup off).
    Rows are padded to the longest row's tree in the verify forward, so one row's full-length chain would make every
    row's part of the forward that long (measured at B = 8 with chains of 10 per row: 0.85-0.92x plain batched)."""
    if lookup_tokens <= 0 or batch <= 1:
        return lookup_tokens
    return max(1, round(lookup_tokens / batch))


class PinnedController:
    """The controller with `adaptive=False`: the configured tree every round, and lookup chains alone in a round
    after one that accepted its whole chain (the text copies an earlier passage), as prompt lookup decoding does.
    Nothing is measured or remembered."""

    def __init__(self, tree: RoundChoice):
        self.tree = tree

    def choose(self, lookup_ready: bool = True, copying: bool = False, chain_was_whole: bool = False) -> RoundChoice:
        return RoundChoice("lookup") if lookup_ready and chain_was_whole else self.tree

    def record(self, *args, **kwargs) -> None:
        pass


def controller_for(
    target, draft, settings, static: bool, fixed_shape: bool, batch_size: int = 1, do_sample: bool = False
) -> RoundController | PinnedController:
    """The controller for one generate call; with `settings.adaptive` off a `PinnedController`. Otherwise a
    `RoundController`: its choices from the settings, its cost priors from the disk cache for this machine and batch
    size, its token priors (tokens per row and round) and re-measurement waits from the draft's earlier generations in
    the same mode (greedy or sampling)."""
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
    if not settings.adaptive:
        return PinnedController(RoundChoice("tree", settings.total_tokens, settings.depth, min(settings.top_k, vocab)))
    choices = choices_for(
        settings.total_tokens, settings.depth, min(settings.top_k, vocab), settings.lookup_tokens > 0, fixed_shape
    )
    key = machine_key(target, "static" if static else "dynamic", batch_size)
    mode = "sampling" if do_sample else "greedy"
    known = getattr(draft, "_jakiro_round_memory", {}).get(mode, {})
    return RoundController(
        choices, token_priors=dict(known.get("tokens", {})), cost_priors=load_costs(key), key=key,
        stale_after=dict(known.get("stale_after", {})), mode=mode, since_tried=dict(known.get("since_tried", {})),
    )


def remember(controller: RoundController | PinnedController, draft) -> None:
    """After a generate call: the learned round costs go to the disk cache, the tokens per round, the
    re-measurement waits and the rounds since each choice was tried to the draft, under the call's mode (the next
    such call's priors). A pinned controller learned nothing."""
    if isinstance(controller, PinnedController):
        return
    save_costs(controller.key, controller.learned_costs())
    memory = getattr(draft, "_jakiro_round_memory", {})
    known = memory.get(controller.mode, {})
    memory[controller.mode] = {
        "tokens": {**known.get("tokens", {}), **controller.learned_tokens()},
        "stale_after": {**known.get("stale_after", {}), **controller.stale_after},
        "since_tried": {c.name: controller.rounds - controller.last_tried.get(c.name, 0) for c in controller.choices},
    }
    draft._jakiro_round_memory = memory


def padded_size(choice: RoundChoice, settings) -> int:
    """With fixed shapes, the size a round's tree is padded to: one per kind of choice (a handful of shapes, each
    compiled once): the root alone, the root and the lookup chains, or the largest tree. A pinned tree
    (`adaptive=False`) pads its lookup-only rounds to the tree's size: one shape for all its rounds."""
    if choice.kind == "plain":
        return 1
    if choice.kind == "lookup" and settings.adaptive:
        return 1 + int(settings.lookup_tokens) * int(settings.lookup_chains)
    return settings.max_nodes


def machine_key(target, cache_kind: str, batch_size: int = 1) -> str:
    """What a round's cost depends on besides the tree: the target's shape, dtype, device, cache kind, batch size and
    the threads torch uses (on a CPU)."""
    import torch

    text = target.config.get_text_config(decoder=True)
    device = target.get_input_embeddings().weight.device
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    shape = "-".join(str(getattr(text, name, "")) for name in ("hidden_size", "num_hidden_layers", "vocab_size"))
    return f"{text.model_type}-{shape}|{target.dtype}|{device.type}|{cache_kind}|batch {batch_size}|threads {threads}"


def costs_path() -> Path:
    """`$JAKIRO_ROUND_COSTS`, else `round_costs.json` in `$JAKIRO_CACHE` (default ~/.cache/transformers_jakiro)."""
    if os.environ.get("JAKIRO_ROUND_COSTS"):
        return Path(os.environ["JAKIRO_ROUND_COSTS"])
    root = os.environ.get("JAKIRO_CACHE") or Path.home() / ".cache" / "transformers_jakiro"
    return Path(root) / "round_costs.json"


def _finite_costs(entry) -> dict:
    """The usable part of one key's entry: choice names mapped to finite positive seconds (a cost of 0 would divide
    by zero, NaN would stay NaN whatever is added to it, a string or a list is no time at all)."""
    if not isinstance(entry, dict):
        return {}
    return {
        name: float(cost) for name, cost in entry.items()
        if isinstance(name, str) and isinstance(cost, (int, float)) and not isinstance(cost, bool)
        and math.isfinite(cost) and cost > 0
    }


def _read_costs(path: Path) -> dict:
    """The cost table in `path`, keeping only well-formed entries: {key: {choice name: seconds}}. The file is data
    from outside (hand edits, another version, a crash mid-write elsewhere): anything else in it is dropped with one
    warning naming the file, and an unreadable file reads as empty. Never raises."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as error:
        _warn_costs(path, f"cannot be read ({error})")
        return {}
    try:
        table = json.loads(text)
    except (ValueError, RecursionError):
        _warn_costs(path, "is not valid JSON")
        return {}
    if not isinstance(table, dict):
        _warn_costs(path, f"holds a JSON {type(table).__name__}, not an object of costs per key")
        return {}
    clean = {key: _finite_costs(entry) for key, entry in table.items() if isinstance(key, str)}
    if any(clean.get(key) != entry for key, entry in table.items()):
        _warn_costs(path, "holds entries that are not finite positive seconds per choice")
    return {key: entry for key, entry in clean.items() if entry}


def _warn_costs(path: Path, problem: str) -> None:
    """One warning per file and problem (Python shows a warning once per message and place)."""
    warnings.warn(
        f"The round-cost cache {path} {problem}; those entries are ignored (the controller measures the costs again "
        "and rewrites the file). Delete the file, or point $JAKIRO_ROUND_COSTS elsewhere, to start afresh.",
        RuntimeWarning,
        stacklevel=2,
    )


def load_costs(key: str) -> dict:
    """The per-choice round costs cached for `key`; {} when none (or the file is unreadable or malformed)."""
    return dict(_read_costs(costs_path()).get(key, {}))


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` + ".lock" while the block runs (POSIX `flock`; elsewhere no lock), so that two
    processes saving at once merge their entries instead of the later one's write dropping the earlier one's."""
    try:
        import fcntl
    except ImportError:  # Windows: last writer wins, as before
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def save_costs(key: str, costs: dict) -> None:
    """Merge `costs` (finite positive ones only) into the cache file: under a lock, the file is read again, merged
    and replaced atomically (a reader never sees half a file, a concurrent writer's entries are kept). Failures are
    ignored: the cache only saves the next call its first measurements."""
    costs = _finite_costs(costs)
    if not costs:
        return
    path = costs_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            table = _read_costs(path)
            table[key] = {**table.get(key, {}), **costs}
            handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as out:
                    json.dump(table, out, indent=1, sort_keys=True)
                os.replace(temporary, path)
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
    except OSError:
        pass


__all__ = [
    "RoundChoice",
    "batch_lookup_tokens",
    "batch_tree",
    "PinnedController",
    "RoundController",
    "choices_for",
    "controller_for",
    "load_costs",
    "machine_key",
    "padded_size",
    "prior_tokens",
    "remember",
    "save_costs",
]
