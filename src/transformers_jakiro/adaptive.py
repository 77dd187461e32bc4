"""The round controller: every round, choose what the target verifies so that new tokens per second are highest.

A round can verify
  * `plain`:  the last accepted token alone (one target step, no draft forward): exactly 1 new token;
  * `lookup`: n-gram lookup chains alone (no draft forward), when the context offers one;
  * `tree T/D/K`: a draft tree (the configured one, or a smaller one), with lookup chains grafted when lookup is on.
Which pays depends on the machine (what a verify of n tokens costs against one step), the dtype, the text (how much
the draft and the lookup get accepted) and the position in it, so the choice is learned while decoding:

    expected tokens of a choice:  a discounted mean of the tokens its past rounds added (bonus token included;
                                  every round ages all choices' means by DISCOUNT), plus a prior worth PRIOR_ROUNDS
                                  rounds: the draft's mean from its earlier generations, else `prior_tokens`; kept
                                  apart for rounds that follow a *copying* round (one whose new tokens continued the
                                  lookup chain ready at its start, `lookup.continues`): there lookup yields far
                                  more than it does elsewhere (2.9-9.0 against 1.1-2.8 tokens on the benchmark
                                  suites), so one mean for both would average a copy run away;
    cost of a choice:             a discounted mean of its measured round times (draft + verify + emit, wall clock;
                                  aged only by its own rounds), plus the time cached for this target shape, dtype,
                                  device, cache kind, batch size and threads (`$JAKIRO_CACHE/round_costs.json`,
                                  written after every generate call) as a prior worth PRIOR_ROUNDS rounds;
    choice:                       the largest (expected tokens + bonus) / cost, bonus = EXPLORATION / (1 + the
                                  choice's recent weight)^2 (none for a plain step, whose yield is known). Choices
                                  with no cost yet are tried first, in the order of `choices_for`. A choice that
                                  lost is tried again once its yield has aged back towards its prior: every few tens
                                  of rounds, at the cost of one round (about 3-5% in simulated rounds, tests). And any
                                  choice not tried for STALE_ROUNDS rounds, a plain step included, is tried once
                                  more and its new time replaces the old: a cost measured once (a first round's
                                  warm-up, a moment the machine was busy) then cannot rule a choice out for good.
                                  A choice still behind after such a re-measurement waits twice as long for the
                                  next (up to MAX_STALE_ROUNDS; back to STALE_ROUNDS once it wins), so that choices
                                  that keep losing (trees in float32 on a small CPU, at temperature 1) stop costing
                                  a round every STALE_ROUNDS.

Yields, waits and the rounds since each choice was last tried are remembered on the draft from one generate call
to the next, apart for greedy decoding and sampling (a tree accepts far less at temperature 1), and serve as the
next call's priors: with calls of 20 rounds, a count that restarted with every call would never reach STALE_ROUNDS.
A round's time leaves out the draft's catch-up read of positions that earlier rounds without a draft forward (or the
prompt) left unread (`JakiroCandidateGenerator.catch_up_s`): that read is what those rounds deferred, and charged to
the first tree round of every call it priced trees too high (Qwen2.5-Coder bf16, 2 threads: the cost cache held
0.40 s for the 8/2/8 tree; with the read left out and a fresh cache it learned 0.26 s).

Exactness does not depend on the choice: every round is verified by the same rule, and the choice reads only past
rounds (their tokens and times), never the round's own random draws, so sampling keeps the target's distribution.
Everything here is pure bookkeeping on the host: no tensor, no device sync.
"""

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DISCOUNT = 0.95  # weight of an observation one round older: the last ~20 rounds dominate
PRIOR_ROUNDS = 0.5  # the prior's weight, in rounds: enough to rank untried choices, little against measurements
PRIOR_ACCEPTANCE = 0.55  # a tree's guessed acceptance per depth before anything was measured
EXPLORATION = 0.3  # the exploration bonus, in tokens, of a choice not seen lately (a quarter after one round)
STALE_ROUNDS = 60  # a choice not tried for this many rounds is tried again (its cost or yield may have changed)
MAX_STALE_ROUNDS = 960  # the longest wait between re-measurements of a choice that keeps losing
COPYING_PRIOR = 2.5  # tokens a lookup-carrying round is guessed to add right after a copying round
COPYING = " after copying"  # the suffix of a choice's name for its yield in rounds that follow a copying round


@dataclass(frozen=True)
class RoundChoice:
    kind: str  # "plain", "lookup" or "tree"
    total_tokens: int = 0
    depth: int = 0
    top_k: int = 0

    @property
    def name(self) -> str:
        return self.kind if self.kind != "tree" else f"tree {self.total_tokens}/{self.depth}/{self.top_k}"


def choices_for(total_tokens: int, depth: int, top_k: int, lookup: bool, fixed_shape: bool) -> list[RoundChoice]:
    """The configured tree, a smaller tree (not with fixed shapes: every tree is padded to one size there, so a
    smaller one would save only draft levels), lookup alone when lookup is on, and a plain step; in the order they
    are first tried."""
    full = RoundChoice("tree", total_tokens, depth, top_k)
    options = [full]
    small = RoundChoice("tree", total_tokens // 3, max(1, (depth + 1) // 2), max(1, min(top_k, 4)))
    if not fixed_shape and small.total_tokens >= 2:
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
    """Chooses each round's `RoundChoice` (see the module docstring). `token_priors` and `cost_priors` map choice
    names to tokens per round and seconds per round from earlier calls."""

    choices: list[RoundChoice]
    token_priors: dict = field(default_factory=dict)
    cost_priors: dict = field(default_factory=dict)
    key: str = ""  # the `machine_key` its costs are cached under
    stale_after: dict = field(default_factory=dict)  # per choice name: rounds until it is re-measured (STALE_ROUNDS)
    mode: str = "greedy"  # "greedy" or "sampling": what the draft remembers its yields and waits under
    since_tried: dict = field(default_factory=dict)  # per choice name: rounds since it was tried, in earlier calls

    def __post_init__(self):
        self.tokens = {c.name + context: RunningMean() for c in self.choices for context in ("", COPYING)}
        self.costs = {c.name: RunningMean() for c in self.choices}
        self.rounds = 0
        # The round in which each choice was last recorded; earlier calls' rounds count as negative ones, so that a
        # choice is re-measured after STALE_ROUNDS rounds even when every call is shorter than that.
        self.last_tried = {name: -since for name, since in self.since_tried.items()}
        self._remeasure = None  # a stale choice being re-measured
        self._copying = False  # whether the round being chosen follows a copying round

    def expected_tokens(self, choice: RoundChoice, copying: bool = False) -> float:
        if choice.kind == "plain":
            return 1.0
        key = _yield_key(choice, copying)
        prior = self.token_priors.get(key, prior_tokens(choice, copying=copying))
        return self.tokens[key].mean(prior, PRIOR_ROUNDS)

    def expected_cost(self, choice: RoundChoice) -> float | None:
        prior = self.cost_priors.get(choice.name)
        return self.costs[choice.name].mean(prior, PRIOR_ROUNDS if prior is not None else 0.0)

    def choose(self, lookup_ready: bool = True, copying: bool = False) -> RoundChoice:
        """This round's choice; `lookup_ready`: the n-gram lookup has a chain to offer now; `copying`: the last round's
        tokens continued the chain ready at its start (`lookup.continues`)."""
        self._copying = copying
        context = COPYING if copying else ""
        available = [c for c in self.choices if c.kind != "lookup" or lookup_ready]
        for choice in available:  # first, measure what each choice costs
            if self.expected_cost(choice) is None:
                return choice
        for choice in available:  # then re-measure what was not tried for long: the new time replaces the old
            if self.rounds - self.last_tried.get(choice.name, 0) >= self.stale_after.get(choice.name, STALE_ROUNDS):
                self._remeasure = choice.name
                return choice

        return max(available, key=lambda choice: self._value(choice, copying, EXPLORATION))  # ties: the larger tree

    def _value(self, choice: RoundChoice, copying: bool, exploration: float) -> float:
        """Expected tokens per second, plus an exploration bonus for a choice with an unknown yield."""
        recent = self.tokens[_yield_key(choice, copying)].weight  # decays every round: not tried lately, weighs little
        bonus = 0.0
        if choice.kind != "plain":  # a plain step's yield is known: exactly one token
            bonus = exploration / (1.0 + recent) ** 2
        return (self.expected_tokens(choice, copying) + bonus) / self.expected_cost(choice)

    def record(self, choice: RoundChoice, tokens: int, seconds: float) -> None:
        """A round's outcome (of the round last chosen: its yield counts for that round's context). Token yields age
        with every round (the text changes: a choice not tried for a while drifts back to its prior and is tried
        again); costs age only with their own rounds (the machine does not)."""
        self.rounds += 1
        self.last_tried[choice.name] = self.rounds
        remeasured = self._remeasure == choice.name
        if remeasured:
            self.costs[choice.name], self._remeasure = RunningMean(), None
        for mean in self.tokens.values():
            mean.decay()
        self.tokens[_yield_key(choice, self._copying)].add(float(tokens))
        self.costs[choice.name].decay()
        self.costs[choice.name].add(float(seconds))
        if remeasured:  # still behind the best: wait twice as long before measuring it again; ahead: the usual wait
            ranked = [c for c in self.choices if self.expected_cost(c) is not None]
            best = max(ranked, key=lambda c: self._value(c, self._copying, 0.0))
            wait = self.stale_after.get(choice.name, STALE_ROUNDS)
            self.stale_after[choice.name] = STALE_ROUNDS if best == choice else min(2 * wait, MAX_STALE_ROUNDS)

    def learned_tokens(self) -> dict:
        return {name: mean.mean() for name, mean in self.tokens.items() if mean.weight}

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


def controller_for(
    target, draft, settings, static: bool, fixed_shape: bool, batch_size: int = 1, do_sample: bool = False
) -> RoundController | None:
    """The controller for one generate call (None with `settings.adaptive` off): its choices from the settings, its
    cost priors from the disk cache for this machine and batch size, its token priors (tokens per row and round) and
    re-measurement waits from the draft's earlier generations in the same mode (greedy or sampling)."""
    if not settings.adaptive:
        return None
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
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


def remember(controller: RoundController, draft) -> None:
    """After a generate call: the learned round costs go to the disk cache, the tokens per round, the
    re-measurement waits and the rounds since each choice was tried to the draft, under the call's mode (the next
    such call's priors)."""
    save_costs(controller.key, controller.learned_costs())
    memory = getattr(draft, "_jakiro_round_memory", {})
    known = memory.get(controller.mode, {})
    memory[controller.mode] = {
        "tokens": {**known.get("tokens", {}), **controller.learned_tokens()},
        "stale_after": {**known.get("stale_after", {}), **controller.stale_after},
        "since_tried": {c.name: controller.rounds - controller.last_tried.get(c.name, 0) for c in controller.choices},
    }
    draft._jakiro_round_memory = memory


def padded_size(choice: RoundChoice | None, settings) -> int:
    """With fixed shapes, the size a round's tree is padded to: one per kind of choice (a handful of shapes, each
    compiled once): the root alone, the root and the lookup chains, or the largest tree."""
    if choice is not None and choice.kind == "plain":
        return 1
    if choice is not None and choice.kind == "lookup":
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


def load_costs(key: str) -> dict:
    """The per-choice round costs cached for `key`; {} when none (or the file is unreadable)."""
    try:
        return dict(json.loads(costs_path().read_text()).get(key, {}))
    except (OSError, ValueError):
        return {}


def save_costs(key: str, costs: dict) -> None:
    """Merge `costs` into the cache file (atomically: a reader never sees half a file); failures are ignored, the
    cache only saves the next call its first measurements."""
    path = costs_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table[key] = {**table.get(key, {}), **costs}
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            json.dump(table, out, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError:
        pass


__all__ = [
    "RoundChoice",
    "batch_lookup_tokens",
    "batch_tree",
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
