"""A batch's rounds: tree speculative decoding of B > 1 rows in one `generate` call, every row exactly as if decoded
alone. `loop.jakiro_decode` runs these rounds (`BatchRounds`), the same loop that runs one row's (`row_rounds`).

Each row drafts its own tree (`batch_drafter.BatchDrafter`: one draft forward per level for all rows), the target
verifies every row's tree in one forward (trees padded to one size with never-accepted dummy nodes, per-row 4D tree
masks and positions), and each row accepts its own path by the one-row rule (`verification.verify`, with the logits
processors and stopping criteria applied to the row's own sequence, left padding included, as plain generate does).

Ragged acceptance: per-row compaction with masked holes. After a round in which row r accepted m_r nodes, every row
keeps M = max(m_r) cache entries after the prefix: row r its m_r accepted nodes, then M - m_r holes. `key_mask`
([rows, cached], like generate's attention mask) marks holes and left padding absent, so no query sees them, and a
row's position ids count only its present entries: each row attends to exactly the keys and positions it would have
alone. Cost per round over B separate one-row rounds: one gather of M entries per layer (no copy of the prefix
grows with the context), the holes' share of attention (sum of M - m_r over rounds), and the host work per row
(processing, acceptance, stopping checks; one device-to-host copy for the whole batch). Rows that finish (EOS, stop
strings, max length) leave the batch at once (their cache rows are dropped, and columns that became holes in every
row with them); the output pads them with `pad_token_id`, as plain generate does.

Per batch round one choice (`round_controller.RoundController`, keyed by batch size): a plain batched step, lookup
chains alone, a smaller tree or the batch tree (`round_controller.batch_tree`: the configured tree's node budget
shared by the rows; `round_controller.batch_lookup_tokens`: the lookup chains' too).

With a static cache (`cache_implementation="static"`) every round's trees are padded to one size per kind of round
and finished rows keep idle slots (`BatchVerifier`), so the target's verify forward has fixed shapes and is compiled
whenever generate would compile (`target_inputs.verify_forward`); the draft stays eager. Not yet for batches: a cache
the caller passes in (it would end with holes and without finished rows, where plain batched generate leaves a
continuable one), per-step scores or logits (`output_scores`, `output_logits`: plain generate's rows keep producing
scores after they finish), and generations that could cross a position-dependent RoPE boundary
(`rope.refuse_batch_across`); all are refused by name before any work.
"""

import dataclasses
import time

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from . import round_controller, verification
from .round_controller import RoundChoice
from .batch_drafter import BatchDrafter
from .drafter import TreeSettings
from ..features import TargetFeatures
from .kv_cache import drop_hole_columns, is_static, keep_accepted_rows, pack_present, select_rows, static_length, truncate
from .logits import process_tree_logits, processors_for_row
from .rope import refuse_batch_across, rope_limits
from ..stats import JakiroGenerationStats
from .target_inputs import (
    cache_kwarg, check_position_ids, forward_accepts, left_paddings, round_verdicts, target_cache, verify_forward,
)
from .tree import DraftTree
from .verification import RoundTokens


def _check_batch_supported(generation_config: GenerationConfig, cache, streamer) -> None:
    if getattr(cache, "_is_user_defined", False):
        raise ValueError(
            "Jakiro decoding of a batch (B > 1) cannot fill a cache you pass to generate (past_key_values / cache) as "
            "plain batched generate fills it: rows accept different numbers of tokens each round and finished rows "
            "leave the batch, so the cache would end with holes and missing rows and could not be continued. Leave "
            "the cache out (generate builds its own), or decode one row at a time to keep a cache per row."
        )
    if generation_config.return_dict_in_generate and (generation_config.output_scores or generation_config.output_logits):
        raise ValueError(
            "Jakiro decoding of a batch (B > 1) does not return per-step scores or logits (output_scores / "
            "output_logits): plain generate keeps computing them for rows that have finished, from pad tokens, and "
            "tree decoding drops finished rows. Generate one row at a time for scores, or leave them out."
        )
    if streamer is not None:
        raise ValueError("Streamers take one sequence; transformers' streamers refuse batches too. Stream one row at a time.")


def batch_tree_settings(settings: TreeSettings, batch: int) -> TreeSettings:
    total, depth, top_k = round_controller.batch_tree(settings.total_tokens, settings.depth, settings.top_k, batch)
    lookup = round_controller.batch_lookup_tokens(settings.lookup_tokens, batch)
    return dataclasses.replace(settings, total_tokens=total, depth=depth, top_k=top_k, lookup_tokens=lookup)


def _stack_trees(trees: list[DraftTree], size: int | None = None):
    """Every row's tree padded to `size` nodes, by default the largest tree's (`DraftTree.padded`): tokens, depths
    [rows, n], ancestors [rows, n, n]."""
    size = max(tree.num_nodes for tree in trees) if size is None else size
    padded = [tree if tree.num_nodes == size else tree.padded(size) for tree in trees]
    return (
        torch.stack([tree.tokens for tree in padded]),
        torch.stack([tree.depths for tree in padded]),
        torch.stack([tree.ancestors for tree in padded]),
    )


@dataclasses.dataclass
class BatchVerdict:
    """What one batch round accepted, per row (lists in the batch's row order; tensors on the target's device).

    paths: accepted nodes, root first. tokens: the round's new tokens (accepted draft tokens, then the bonus).
    token_ids: the same on the host. scores: processed logits at the path's nodes (the new tokens' scores).
    lookup_accepted: accepted nodes only the n-gram lookup proposed (None without lookup nodes).
    features: [rows, n, width] the target's features at every node (the draft reads the paths' next round).
    stops: per row, whether generation stops after each of its tokens (read with the paths), when `verify` was given
    the stopping criteria; else None."""

    paths: list
    tokens: list
    token_ids: list
    scores: list
    lookup_accepted: list
    features: torch.Tensor
    stops: list | None = None


class BatchVerifier:
    """The target's side of a batch: its cache with the key mask of present entries (left padding and holes absent;
    see the module docstring) and each row's next position. `verify` runs one round for every row.

    With a StaticCache every row of the prompt batch keeps its slot to the end, so that every forward has one shape
    (one compiled graph): a finished row's slot verifies a dummy tree and keeps nothing. The rows' entries are written
    at shared columns, so holes use up the static length; when a tree would not fit, each row's present entries are
    moved to the front (`kv_cache.pack_present`). `forward`: the callable that runs the target (compiled by
    `target_inputs.verify_forward`), the target by default."""

    def __init__(self, target, cache, key_mask: torch.BoolTensor, feature_layers=(), forward=None):
        self.target, self.cache, self.key_mask = target, cache, key_mask
        self.present = key_mask.sum(1)  # each row's cached real tokens: the position of its root
        self.feature_layers = feature_layers
        self.cache_arg = cache_kwarg(target)
        self.forward = target if forward is None else forward
        self.static = is_static(cache)
        self.slots = list(range(key_mask.shape[0]))  # each current row's slot in the cache (static: finished rows idle)
        self.slot_index = None  # `slots` on the device, once some slots idle

    def snapshot(self):
        """The state `restore` returns to (benchmarks replaying one round)."""
        return self.key_mask.shape[1], self.key_mask, self.present, list(self.slots), self.slot_index

    def restore(self, state) -> None:
        length, self.key_mask, self.present, self.slots, self.slot_index = state
        truncate(self.cache, length)

    def select(self, rows: list[int], index: torch.LongTensor | None = None) -> None:
        """Keep these rows, in this order (`index`: the same on the device, when the caller has it); cache columns
        that are then holes in every row go too (one read: which columns those are). A static cache keeps every slot:
        the finished rows' idle."""
        index = torch.tensor(rows, device=self.key_mask.device) if index is None else index.to(self.key_mask.device)
        if self.static:  # the finished rows' entries become holes: their slots attend to their own dummy tree only
            self.slot_index = index if self.slot_index is None else self.slot_index[index]
            self.slots = [self.slots[r] for r in rows]
            live = torch.zeros_like(self.present, dtype=torch.bool).index_fill_(0, self.slot_index, True)
            self.key_mask = self.key_mask & live[:, None]
            return
        select_rows(self.cache, index)
        self.key_mask = drop_hole_columns(self.cache, self.key_mask[index])
        self.present = self.present[index]

    def _in_slots(self, tokens, depths, ancestors):
        """The current rows' trees placed in their slots; an idle slot gets a dummy tree of its slot's size (token
        0, every node seeing the row's entries and itself), whose results are ignored."""
        slots = self.slot_index
        batch, size = self.key_mask.shape[0], tokens.shape[1]
        eye = torch.eye(size, dtype=torch.bool, device=tokens.device)
        return (
            tokens.new_zeros(batch, size).index_copy(0, slots, tokens),
            depths.new_zeros(batch, size).index_copy(0, slots, depths),
            eye.expand(batch, size, size).clone().index_copy(0, slots, ancestors),
        )

    def verify(self, trees: list[DraftTree], sequences, processors, do_sample: bool, stopping_criteria=None,
               size: int | None = None) -> BatchVerdict:
        """One forward over every row's tree (padded to `size` nodes, by default the largest tree's), each row's
        acceptance by the one-row rule with its own `sequences[r]` ([1, length], ending with its root) and
        `processors[r]`, one device-to-host copy for the batch (with `stopping_criteria`, each row's stopping verdicts
        after each of its tokens too), and the cache compacted: every row keeps M = the longest path's entries, its
        own path then holes."""
        target, device = self.target, self.key_mask.device
        tokens, depths, ancestors = _stack_trees(trees, size)
        idle = len(self.slots) < self.key_mask.shape[0]
        if idle:
            tokens, depths, ancestors = self._in_slots(tokens, depths, ancestors)
        nodes_per_row = tokens.shape[1]
        if self.static and self.key_mask.shape[1] + nodes_per_row > static_length(self.cache):
            self.key_mask = pack_present(self.cache, self.key_mask)
        cached = self.key_mask.shape[1]
        visible = torch.cat([self.key_mask[:, None, :].expand(-1, nodes_per_row, -1), ancestors], dim=2)
        if self.static:  # the mask spans the whole static length; the columns after the tree are unwritten
            visible = F.pad(visible, (0, static_length(self.cache) - cached - nodes_per_row))
        mask = torch.zeros(visible.shape, dtype=target.dtype, device=device)
        mask = mask.masked_fill(~visible, torch.finfo(target.dtype).min)[:, None]
        with TargetFeatures(target, self.feature_layers) as hidden:
            out = self.forward(
                input_ids=tokens, position_ids=self.present[:, None] + depths, attention_mask=mask, use_cache=True,
                **hidden.forward_kwargs(), **{self.cache_arg: self.cache},
            )
            features = hidden.take(out)
        raw = out.logits.float()
        del out
        if idle:  # the current rows' results, in their order
            raw, features = raw[self.slot_index], features[self.slot_index]

        fetch, picks = [], []
        for r, tree in enumerate(trees):
            processed = process_tree_logits(processors[r], sequences[r], tree, raw[r, : tree.num_nodes])
            path, bonus = verification.verify(tree, processed, do_sample)
            picks.append((path, bonus, processed))
            lookup = tree.from_lookup
            counted = (lookup[path.clamp(min=0)] & (path >= 0)).sum()[None] if lookup is not None else path.new_zeros(1)
            path_tokens = tree.tokens[path.clamp(min=0)]
            fetch.append(torch.cat([path, path_tokens, bonus[None], counted]))
            if stopping_criteria is not None:  # the row's tokens padded to its path's width, as in `decoding`
                width = path.numel()
                index = torch.arange(width, device=device)
                round_tokens = torch.where(index == (path >= 0).sum() - 1, bonus,
                                           torch.cat([path_tokens[1:], bonus[None]]))
                fetch.append(round_verdicts(stopping_criteria, sequences[r], round_tokens,
                                            processed[path.clamp(min=0)]).long())
        host = torch.cat(fetch).tolist()  # the round's one copy for the whole batch
        verdict = BatchVerdict([], [], [], [], [], features, [] if stopping_criteria is not None else None)
        at = 0
        for (path, bonus, processed), tree in zip(picks, trees):
            width = path.numel()
            size = 2 * width + 2 + (width if stopping_criteria is not None else 0)
            chunk = host[at : at + size]
            at += size
            m = sum(node >= 0 for node in chunk[:width])
            verdict.paths.append(path[:m])
            verdict.token_ids.append(chunk[width + 1 : width + m] + [chunk[2 * width]])
            verdict.tokens.append(torch.cat([tree.tokens[path[1:m]], bonus[None]]))
            verdict.scores.append(processed[path[:m]])
            verdict.lookup_accepted.append(chunk[2 * width + 1] if tree.from_lookup is not None else None)
            if stopping_criteria is not None:
                verdict.stops.append([bool(v) for v in chunk[2 * width + 2 : 2 * width + 2 + m]])

        most = max(path.numel() for path in verdict.paths)
        nodes = torch.zeros(self.key_mask.shape[0], most, dtype=torch.long, device=device)
        for slot, path in zip(self.slots, verdict.paths):
            nodes[slot, : path.numel()] = path
        lengths = torch.stack([(path >= 0).sum() for path, _, _ in picks])  # on the device: no upload
        if idle:  # an idle slot keeps nothing
            lengths = lengths.new_zeros(self.key_mask.shape[0]).index_copy(0, self.slot_index, lengths)
        if nodes_per_row > 1 or self.static:  # a dynamic cache's plain round: each row's one entry is in place
            keep_accepted_rows(self.cache, cached, nodes)
        self.key_mask = torch.cat([self.key_mask, torch.arange(most, device=device)[None, :] < lengths[:, None]], 1)
        self.present = self.present + lengths
        return verdict


class BatchRounds:
    """The rounds of a batch (see the module docstring), for `loop.jakiro_decode`: `prefill`, then one `round` per
    choice of the round controller, each returning every current row's new tokens (`RoundTokens`); `select` keeps the
    rows that have not finished. `settings`: the batch's tree (the configured tree's node budget shared by the rows)."""

    def __init__(self, target, draft, settings: TreeSettings, input_ids, logits_processor, generation_config,
                 model_kwargs: dict, stats: JakiroGenerationStats, streamer=None):
        batch, length = input_ids.shape
        self.target, self.draft, self.stats = target, draft, stats
        self.settings = settings = batch_tree_settings(settings, batch)
        self.cache = target_cache(target, model_kwargs, generation_config, settings.max_nodes)
        _check_batch_supported(generation_config, self.cache, streamer)
        self.static = is_static(self.cache)
        self.fixed_shape = self.static if settings.fixed_shape is None else bool(settings.fixed_shape)
        self.forward = verify_forward(target, self.cache, generation_config) if self.static and self.fixed_shape else target
        self.attention_mask = model_kwargs.get("attention_mask")
        self.paddings = left_paddings(self.attention_mask, batch, length)
        check_position_ids(model_kwargs.get("position_ids"), self.paddings, length)
        self.limits = rope_limits(target)  # position-dependent RoPE: rounds that would reach it are plain steps
        refuse_batch_across(self.limits, generation_config.max_length, self.paddings)
        self.do_sample = generation_config.do_sample
        self.device = target.get_input_embeddings().weight.device
        self.logits_processor = logits_processor
        self.processors = [processors_for_row(logits_processor, i) for i in range(batch)]
        self.drafter = BatchDrafter(draft, settings, batch)
        self.verifier = None  # after the prefill

    @property
    def catch_up_s(self) -> float:
        return self.drafter.catch_up_s

    def signals(self):
        return self.drafter.signals()

    def prefill(self, sequences) -> RoundTokens:
        """The padded prompts in one forward, as in plain generate; each row's first token from its last position.
        The draft reads real positions only: left padding never enters its cache."""
        tic = time.perf_counter()
        target, device = self.target, self.device
        input_ids = torch.cat(sequences)
        mask = self.attention_mask
        key_mask = (torch.ones_like(input_ids) if mask is None else mask.to(device)).bool()
        positions = (key_mask.long().cumsum(1) - 1).clamp(min=0)
        feature_layers = self.draft.config.target_feature_layers
        with TargetFeatures(target, feature_layers) as hidden:
            out = target(
                input_ids=input_ids, attention_mask=key_mask.long(), position_ids=positions, use_cache=True,
                **hidden.forward_kwargs(),
                **({"logits_to_keep": 1} if forward_accepts(target, "logits_to_keep") else {}),
                **{cache_kwarg(target): self.cache},
            )
            features = hidden.take(out)
        raw = out.logits[:, -1].float()
        del out
        processed = self.logits_processor(input_ids, raw.clone())
        first = verification.target_choices(processed, self.do_sample)
        for r, start in enumerate(self.paddings):
            context = torch.cat([input_ids[r, start:], first[r : r + 1]])
            self.drafter.observe(r, features[r, start:], context[1:], context)
        del features
        self.verifier = BatchVerifier(target, self.cache, key_mask, feature_layers, self.forward)
        self.roots = first
        self.stats.verify_time_s += time.perf_counter() - tic
        rows = range(len(sequences))
        return RoundTokens([first[r : r + 1] for r in rows], [[t] for t in first.tolist()],
                           [processed[r : r + 1] for r in rows])

    def select(self, rows: list[int]) -> None:
        """Keep these rows (indices into the current batch), in this order: finished rows leave the batch."""
        index = torch.tensor(rows, device=self.roots.device)  # one upload for the three selections
        self.verifier.select(rows, index)
        self.drafter.select(rows, index)
        self.roots = self.roots[index]
        self.processors = [self.processors[r] for r in rows]

    def round(self, choice: RoundChoice, sequences, stopping_criteria) -> RoundTokens:
        """One round of `choice` for every current row (`sequences[r]`: [1, length], ending with its root)."""
        tic = time.perf_counter()
        trees, name = self.drafter.propose(self.roots, choice)
        trees = [tree.to_device(self.device) for tree in trees]
        self.stats.draft_time_s += time.perf_counter() - tic

        tic = time.perf_counter()
        size = round_controller.padded_size(choice, self.settings) if self.fixed_shape else None
        verdict = self.verifier.verify(trees, sequences, self.processors, self.do_sample, stopping_criteria, size)
        self.roots = torch.stack([tokens[-1] for tokens in verdict.tokens])
        self.stats.verify_time_s += time.perf_counter() - tic
        for r, path in enumerate(verdict.paths):
            self.drafter.observe(r, verdict.features[r, path], verdict.tokens[r], verdict.token_ids[r],
                                 verdict.lookup_accepted[r])
        return RoundTokens(verdict.tokens, verdict.token_ids, verdict.scores, None, verdict.stops,
                           verdict.lookup_accepted, name)

    def finish(self, sequences) -> None:
        """Nothing to cut: the cache holds holes between each row's tokens and no entries for finished rows' padding,
        so it cannot be continued as plain generate's can, and none is returned."""


__all__ = ["BatchRounds", "BatchVerdict", "BatchVerifier", "batch_tree_settings"]
