"""One row's rounds (a batch of one): the draft's `drafter.JakiroCandidateGenerator` and the target's verification.

A round: the draft expands a token tree; the target verifies the whole tree in one forward with a tree attention
mask (`verify_tree`, or over a static cache with fixed shapes `static_verify.verify_round`, compiled whole when
generate would compile); the acceptance rule (`verification.verify`) keeps the longest path that agrees with the
target plus one bonus token; both caches are cut back to the accepted path. `loop.jakiro_decode` runs these rounds
through `RowRounds`, the same loop that runs a batch's (`batch_rounds.BatchRounds`).

What a batch of one gets that a batch does not: the target's cache ends exactly as plain generate's (the caller's
cache is filled in place and can be continued), plain steps run with the mask plain generate gives a step, leaf
logits may be computed lazily on a CPU (`lazy_leaf_head`), the draft's round is one fixed-shape function over a
static cache (`drafter.draft_round`), and Phi-3's whole-sequence recomputation at its RoPE boundary is followed.
"""

import time

import torch

from . import verification
from .drafter import JakiroCandidateGenerator, TreeSettings, compiled_draft_round, draft_round
from ..features import TargetFeatures
from .kv_cache import is_static, keep_accepted, static_length, truncate
from .logits import PREFIX_FREE_PROCESSORS, process_tree_logits
from .rope import rope_limits
from .round_controller import RoundChoice, padded_size
from .static_verify import compiled_verify_round, verify_fixed_round, verify_round
from ..stats import JakiroGenerationStats
from .target_inputs import (
    cache_kwarg, check_position_ids, forward_accepts, left_padding, round_verdicts, target_cache, verify_forward,
)
from .tree import DraftTree
from .verification import RoundTokens, VerifiedRound


# The fewest verified nodes (the root included) for which the lazy leaf path pays. An output-layer product over a few
# rows costs what one row's does on a CPU (the output matrix is read once either way: SmolLM2's 576 x 49152 layer,
# fp32, one thread, 4.3 ms for 1 to 3 rows, 8.2 ms for 4), so for a 3-node tree the leaf's extra one-row product is
# pure cost: pinned 2/1/4 rounds took 58.5 ms with full logits against 60.7-64.2 ms lazy; 5/1/4 (6 nodes) took
# 85.5-88.4 ms lazy against 94.2-94.9 ms full (RCOST-6).
LAZY_LEAVES_MIN_NODES = 4


def lazy_leaf_head(target, last_hidden: torch.Tensor, last_logits: torch.Tensor):
    """The target's output layer, when leaf logits may be left to `verify_tree` to compute lazily; else None.

    Most tree nodes are leaves, and a leaf's logits matter only when the accepted path ends there, so the target's
    forward can keep logits for internal nodes only (`logits_to_keep` with node indices) and apply its output layer
    to one leaf afterwards. The aim is to skip most of the lm_head rows of a verify forward on a CPU, where compute
    grows with every row; but the leaf's one-row product reads the whole output matrix again, and on SmolLM2-135M
    with 2 cores the two paths measured within noise of each other, on Qwen2.5-Coder-1.5B (a 151936-row output
    layer) the lazy path was 0.79-1.00x the time (README). On an accelerator extra rows are nearly free and the
    extra host sync is not, so the full logits are kept there. `last_hidden`/`last_logits` (the prefill's last
    position) check that the output layer alone reproduces the model's logits: models that scale or soft-cap logits
    after it keep the full path.
    """
    if last_hidden.device.type != "cpu" or not forward_accepts(target, "logits_to_keep"):
        return None
    head = target.get_output_embeddings()
    if head is None:
        return None
    reproduced = head(last_hidden).float()
    return head if torch.allclose(reproduced, last_logits.float(), rtol=1e-3, atol=1e-3) else None


def _candidate_generator(target, draft, settings, cache, fixed_shape: bool, compiled: bool, generation_config):
    """The draft side follows the target's: with a static cache and fixed shapes the draft gets a static cache too
    (long enough for the target's positions plus a tree's levels and one read), and when the target's verify forward
    is compiled so is the draft's round (`compiled_draft_round`), with the same `CompileConfig`."""
    if not (is_static(cache) and fixed_shape):
        return JakiroCandidateGenerator(draft, settings)
    # the target's positions, then a tree's levels after `draft_round`'s read (padded to its read width)
    length = static_length(cache) + settings.top_k * settings.depth + settings.max_levels + 1
    round_fn = draft_round
    if compiled:
        round_fn = compiled_draft_round(generation_config.compile_config or target._default_compile_config())
    return JakiroCandidateGenerator(draft, settings, static_length=length, round_fn=round_fn)


def prefill(target, sequence, mask, cache, cache_arg: str, feature_layers):
    """The whole `sequence` ([1, length]) through the target into an empty cache, as plain generate's first step runs
    it (`mask`: the padding mask, None without left padding, positions then counted from the first real token).
    Returns the draft's features at every position and the last position's logits. Only the layers the draft reads are
    kept (by hooks), not every layer's states: the prompt may be long."""
    padded = {}
    if mask is not None:
        padded = dict(attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0))
    with TargetFeatures(target, feature_layers) as hidden:
        out = target(
            input_ids=sequence,
            **padded,
            use_cache=True,
            **hidden.forward_kwargs(),
            **({"logits_to_keep": 1} if forward_accepts(target, "logits_to_keep") else {}),
            **{cache_arg: cache},
        )
        return hidden.take(out), out.logits[:, -1]


def verify_tree(
    target,
    cache,
    cache_kwarg: str,
    tree: DraftTree,
    sequence,
    processors,
    do_sample: bool,
    leaf_head=None,
    padding=0,
    past: int | None = None,
    forward=None,
    feature_layers=(),
    verdicts=None,
):
    """One verification round: a single target forward over the whole tree (tree mask, positions = prefix length +
    depth), per-node logits processing, acceptance, and the cache cut back to the accepted path. The first `padding`
    cache positions hold the prompt's left padding: hidden from the tree, and not counted in its positions.

    Returns a `VerifiedRound`. `sequence` ([1, length], ending with the root token) is what the logits processors
    see as the prefix. `leaf_head` (from `lazy_leaf_head`): compute logits at internal nodes in the forward and at
    most one leaf after. Host syncs: one copy of the path and its tokens, plus one in `process_tree_logits` when a
    processor depends on the prefix (and, on the lazy-leaf path, the index of internal nodes and the leaf check).

    With a StaticCache the tree is written at `past` (the layers' `cumulative_length`), the mask spans the whole
    static length, and the accepted path is moved into place by index copies. `past`: the cached length when the
    caller knows it (a StaticCache reports it as a device tensor, which would cost a sync to read). `forward`: the
    callable that runs the target (a compiled `target.__call__`); the target itself by default. `feature_layers`: the
    decoder layers whose outputs the draft reads besides the last hidden state (`config.target_feature_layers`).
    `verdicts(tokens, scores)`: the stopping criteria's verdicts [w] (bool, on the device) after each of the round's
    tokens, given them padded to a fixed width w ([w] ids, [w, vocab] scores; entries past the round's length are
    placeholders, their verdicts ignored): read in the round's one copy into `VerifiedRound.stops`.
    """
    static = is_static(cache)
    if past is None:
        past = int(cache.get_seq_length())
    forward = target if forward is None else forward
    # A plain step's one node is its own leaf, and a tree of a few nodes takes all its logits from the forward too.
    lazy = leaf_head is not None and tree.num_nodes >= LAZY_LEAVES_MIN_NODES
    internal = tree.internal_nodes() if lazy else None
    if tree.num_nodes == 1 and not static:
        # A plain step (the round controller's, or a lookup round that found no chain): the mask plain generate
        # gives a one-token step, none or the 2D padding mask, so the target runs the same kernels as there.
        mask = None
        if padding:
            mask = torch.ones(1, past + 1, dtype=torch.long, device=tree.tokens.device)
            mask[:, :padding] = 0
    else:
        mask = tree.attention_mask(past, target.dtype, padding, kv_length=static_length(cache) if static else None)
    with TargetFeatures(target, feature_layers) as hidden:
        out = forward(
            input_ids=tree.tokens[None],
            position_ids=tree.position_ids(past - padding),
            attention_mask=mask,
            use_cache=True,
            **hidden.forward_kwargs(),
            **({} if internal is None else {"logits_to_keep": internal}),
            **{cache_kwarg: cache},
        )
        features = hidden.take(out)[0]
    raw = out.logits[0].float()
    processed = process_tree_logits(processors, sequence, tree, raw, nodes=internal)
    if tree.num_nodes == 1 and not static:
        # A plain step: the root's pick is the round's one token and the cache already ends at the root, so there
        # is no path to find and nothing to move (rounds the controller fills with plain steps run at plain speed).
        bonus = verification.target_choices(processed, do_sample)
        lookup_accepted = None if tree.from_lookup is None else 0
        path = torch.zeros(1, dtype=torch.long, device=bonus.device)
        if verdicts is None:
            return VerifiedRound(path, bonus[0], bonus, bonus.tolist(), processed, raw, features, lookup_accepted)
        host = torch.cat([bonus, verdicts(bonus, processed).long()]).tolist()  # the round's one copy
        stops = [bool(v) for v in host[1:]]
        return VerifiedRound(path, bonus[0], bonus, host[:1], processed, raw, features, lookup_accepted, stops)
    leaf = {}

    def leaf_logits(node: torch.LongTensor) -> torch.Tensor:
        last_hidden = features[node][None, ..., -leaf_head.weight.shape[1] :]  # after any fused layers' outputs
        leaf["raw"] = leaf_head(last_hidden).float()
        leaf["processed"] = process_tree_logits(processors, sequence, tree, leaf["raw"], nodes=node[None])
        return leaf["processed"][0]

    padded_path, bonus = verification.verify(tree, processed, do_sample, None if internal is None else leaf_logits)
    # The round's one device-to-host copy: the padded path (its length) with the tokens along it and the bonus, the
    # lookup count, and the stopping verdicts after each token.
    fetch = verification.path_packet(tree, padded_path, bonus)
    padded_tokens = fetch[1]
    width = padded_path.numel()
    # Lazy-leaf path: `processed` holds internal nodes' rows only; each internal node's row there (-1 for leaves)
    row = None
    if internal is not None:
        row = torch.full_like(tree.tokens, -1).index_copy_(
            0, internal, torch.arange(internal.numel(), device=internal.device))
    if verdicts is not None:
        # The round's tokens padded to the path's width: token i is the draft token of path node i + 1, or the bonus
        # at i = m - 1 (m: the path's length); their scores are the processed logits of path node i.
        length = (padded_path >= 0).sum()
        index = torch.arange(width, device=padded_path.device)
        round_tokens = torch.where(index == length - 1, bonus, torch.cat([padded_tokens[1:], bonus[None]]))
        rows = padded_path.clamp(min=0)
        if row is not None:  # a leaf's row stands in as row 0 (its verdict is the leaf's, below, or ignored)
            rows = row[rows].clamp(min=0)
        round_scores = processed[rows]
        if leaf:  # the path ends at a leaf: the bonus token's scores are the leaf's
            round_scores = torch.where((index == length - 1)[:, None], leaf["processed"], round_scores)
        fetch.append(verdicts(round_tokens, round_scores).long())
    host = torch.cat(fetch).tolist()
    stops = None
    if verdicts is not None:
        stops, host = host[-width:], host[:-width]
    m, token_ids, lookup_accepted = verification.read_path_packet(host, width, tree.from_lookup is not None)
    stops = None if stops is None else [bool(v) for v in stops[:m]]
    path = padded_path[:m]
    tokens = torch.cat([padded_tokens[1:m], bonus[None]])
    keep_accepted(cache, past, path)
    if internal is None:
        return VerifiedRound(
            path, bonus, tokens, token_ids, processed[path], raw[path], features[path], lookup_accepted, stops
        )

    if leaf:  # every node of the path but the last is internal
        rows = row[path[:-1]]
        processed, raw = torch.cat([processed[rows], leaf["processed"]]), torch.cat([raw[rows], leaf["raw"]])
    else:
        processed, raw = processed[row[path]], raw[row[path]]
    return VerifiedRound(path, bonus, tokens, token_ids, processed, raw, features[path], lookup_accepted, stops)




class RowRounds:
    """The rounds of one row (see the module docstring), for `loop.jakiro_decode`: `prefill`, then one `round` per
    choice of the round controller, each returning the row's new tokens as a `RoundTokens` of one row.

    Left padding in a batch of one: as in plain generate, the target's cache holds the padded positions (so that a
    cache returned with return_dict_in_generate lines up with `sequences` and can be continued), nothing attends to
    them and positions continue after them; the draft reads the unpadded prompt only. The logits processors and
    stopping criteria see the full row, exactly as in plain generate."""

    def __init__(self, target, draft, settings: TreeSettings, input_ids, logits_processor, generation_config,
                 model_kwargs: dict, stats: JakiroGenerationStats):
        self.target, self.draft, self.settings, self.stats = target, draft, settings, stats
        self.processors = logits_processor
        self.do_sample = generation_config.do_sample
        self.padding = left_padding(model_kwargs.get("attention_mask"), input_ids.shape[1])
        check_position_ids(model_kwargs.get("position_ids"), self.padding, input_ids.shape[1])
        self.paddings = [self.padding]
        self.device = target.get_input_embeddings().weight.device
        self.cache = target_cache(target, model_kwargs, generation_config, settings.max_nodes)
        self.cache_arg = cache_kwarg(target)
        self.static = is_static(self.cache)
        self.fixed_shape = self.static if settings.fixed_shape is None else bool(settings.fixed_shape)
        self.forward = verify_forward(target, self.cache, generation_config) if self.static and self.fixed_shape else target
        compiled = self.forward is not target
        self.candidates = _candidate_generator(
            target, draft, settings, self.cache, self.fixed_shape, compiled, generation_config
        )
        self.limits = rope_limits(target)  # position-dependent RoPE: rounds that would straddle a limit are plain steps
        if self.limits is not None:
            self.limits.refuse_unfollowable(generation_config.max_length, self.static)
        # Fixed shapes over a static cache: a round is two fixed-shape functions, the draft's (`draft_round`) and
        # `verify_round`, compiled whole when generate would compile. Processors that read the ids stay on
        # `verify_tree`'s path.
        self.verify_fn = None
        if self.static and self.fixed_shape and all(type(p) in PREFIX_FREE_PROCESSORS for p in logits_processor):
            config = generation_config.compile_config or target._default_compile_config()
            self.verify_fn = compiled_verify_round(config) if compiled else verify_round
            self.padding_t = torch.full((), self.padding, dtype=torch.long, device=self.device)  # one graph for all
        self.mask = None if not self.padding else model_kwargs["attention_mask"].to(self.device)
        self.leaf_head = None
        self.feature_layers = draft.config.target_feature_layers

    @property
    def catch_up_s(self) -> float:
        return self.candidates.catch_up_s

    def signals(self):
        return self.candidates.signals()

    def _prefill(self, sequence, mask) -> RoundTokens:
        features, last_logits = prefill(self.target, sequence, mask, self.cache, self.cache_arg, self.feature_layers)
        raw = last_logits.float()
        processed = self.processors(sequence, raw.clone())
        token = verification.target_choices(processed, self.do_sample)
        return features, last_logits, RoundTokens([token], [token.tolist()], [processed], [raw])

    def prefill(self, sequences) -> RoundTokens:
        """The prompt through the target, the first token from its last position; the draft gets the prompt's
        features and tokens (read to the host only for the n-gram lookup)."""
        tic = time.perf_counter()
        sequence = sequences[0]
        features, last_logits, first = self._prefill(sequence, self.mask)
        self.candidates.observe(
            features[0, self.padding :], torch.cat([sequence[0, self.padding :], first.tokens[0].to(sequence.device)])
        )
        # The lazy leaf path keeps logits for a data-dependent set of nodes: a shape that changes every round.
        if not self.fixed_shape:
            self.leaf_head = lazy_leaf_head(self.target, features[:, -1, -self.draft.config.hidden_size :], last_logits)
        self.stats.verify_time_s += time.perf_counter() - tic
        return first

    def round(self, choice: RoundChoice, sequences, stopping_criteria) -> RoundTokens:
        """One round of `choice` for the row (`sequences[0]`: [1, length], ending with its root)."""
        sequence, padding, limits = sequences[0], self.padding, self.limits
        tic = time.perf_counter()
        root = sequence.shape[1] - 1  # the root's index in the sequence (left padding included)
        if limits is not None and limits.recompute_at == root:
            return self._recompute(sequence, choice, tic)
        tree = self.candidates.get_candidates(sequence[:, padding:], choice).to_device(self.device)
        if self.fixed_shape:
            tree = tree.padded(padded_size(choice, self.settings))
        self.stats.draft_time_s += time.perf_counter() - tic

        tic = time.perf_counter()

        def verdicts(round_tokens, round_scores):
            return round_verdicts(stopping_criteria, sequence, round_tokens, round_scores)

        if self.verify_fn is not None:  # every round's path padded to one width: the deepest any tree can be
            verified = verify_fixed_round(
                self.verify_fn, self.target, self.cache, self.cache_arg, tree, self.padding_t, self.processors,
                self.do_sample, self.feature_layers, verdicts, lookup=self.settings.lookup_tokens > 0,
                levels=self.settings.max_levels,
            )
        else:
            verified = verify_tree(
                self.target, self.cache, self.cache_arg, tree, sequence, self.processors, self.do_sample,
                self.leaf_head, padding, root, self.forward, self.feature_layers, verdicts,
            )
        self.stats.verify_time_s += time.perf_counter() - tic
        self.candidates.observe(verified.features, verified.token_ids, verified.lookup_accepted)
        return RoundTokens([verified.tokens], [verified.token_ids], [verified.processed], [verified.raw],
                           None if verified.stops is None else [verified.stops], [verified.lookup_accepted])

    def _recompute(self, sequence, choice, tic) -> RoundTokens:
        """The target's own generate recomputes the whole sequence at this step (Phi-3 at the longrope boundary): so
        does this row, as a plain step (`rope.recompute_index`)."""
        self.candidates.get_candidates(sequence[:, self.padding :], choice)  # a plain step's bookkeeping, draft side
        truncate(self.cache, 0)
        mask = self.mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(1, sequence.shape[1] - mask.shape[1])], dim=1)
        features, _, result = self._prefill(sequence, mask)
        self.stats.verify_time_s += time.perf_counter() - tic
        self.candidates.observe(features[0, -1:], result.token_ids[0])
        result.name, result.measured = "plain", False
        return result

    def select(self, rows: list[int]) -> None:
        """A batch of one ends when its row finishes: nothing to select."""

    def finish(self, sequences) -> None:
        """The cache cut to the output (a stop inside an accepted path leaves extra positions)."""
        truncate(self.cache, sequences[0].shape[1] - 1)


__all__ = ["LAZY_LEAVES_MIN_NODES", "RowRounds", "lazy_leaf_head", "prefill", "verify_tree"]
