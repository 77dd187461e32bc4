"""Drafting for a batch: one Jakiro tree per row, every draft forward run for all rows at once.

The batched counterpart of `drafter.JakiroCandidateGenerator` (read that first: the tree is built the same way, row
by row). What differs is the draft's KV cache, shared by the rows, whose rows accept different numbers of tokens:

  * The cache grows by the same number of entries for every row; a row that has fewer new positions than another
    leaves *holes*, entries that `key_mask` marks as absent and that no query ever sees. Each row's position ids
    count only its own present entries, so a row's draft computes what it would compute alone (up to rounding).
  * A read appends the accepted positions of every row (right-padded to the longest, the padding being holes), in
    one forward. The prompt is the first read: left padding never enters the draft's cache. Rows that join later (a
    continuous batch) read their prompts in a forward of their own, appended as columns that are holes elsewhere.
    A joining row may bring the draft's entries of its prompt's first positions (`preload`: another row computed
    them for the same tokens); it then reads the rest of its prompt only.
  * A tree level is one forward over `k` nodes of every row, [rows, k] queries; the tree's entries are dropped after
    the last level, as for one row.

Cost per round over one row's: the holes (the longest read minus each row's own) in attention, and the per-row
flattening and lookup on the host; everything on the device is one call per level for the whole batch.
"""

import time

import torch
from transformers.cache_utils import DynamicCache

from .round_controller import RoundChoice
from .drafter import TreeSettings, draft_top_k
from .kv_cache import append_columns, append_empty_rows, drop_hole_columns, select_rows, truncate
from .lookup import NgramIndex, continues
from ..modeling_jakiro import JakiroDraftModel
from .tree import DraftTree, flatten_tree, graft_chains


class BatchDrafter:
    """Drafts one token tree per row of a batch (see the module docstring).

    `observe(row, ...)` hands over a row's newly accepted positions (target features [m, width] and the
    token after each); `trees(roots, ...)` reads everything queued, in one forward, and expands every row's tree.
    Rows are addressed by their place in the current batch; `select(rows)` keeps some rows (finished ones leave).
    """

    def __init__(self, draft: JakiroDraftModel, settings: TreeSettings, batch: int):
        self.draft = draft
        self.settings = settings
        self.cache = DynamicCache()
        device = draft.fc.weight.device
        self.key_mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # present entries of the cache
        self.present = [0] * batch  # present entries per row: the next position id of each row
        self.queued: list[list[tuple[torch.Tensor, torch.LongTensor]]] = [[] for _ in range(batch)]
        vocab = draft.config.draft_vocab_size or draft.config.vocab_size
        self.top_k = min(settings.top_k, vocab)
        lookup = settings.lookup_tokens > 0
        self.lookup = [NgramIndex(settings.lookup_max_ngram) if lookup else None for _ in range(batch)]
        self.lookup_length = [settings.lookup_tokens] * batch
        # This round's chains per row, once `signals` has found them (it runs every round, before `propose`):
        # grafted by `propose`, compared by `observe` with what each row accepts.
        self._ready_chains = None
        self.copied = [False] * batch  # per row: its last round's tokens continued the chain ready at its start
        self.catch_up_s = 0.0  # this round's read time spent on positions earlier rounds left (`drafting`'s)
        self.fresh = [True] * batch  # per row: nothing read yet (its first read is its prompt)
        self.preloaded: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * batch  # (`preload`)
        # With `keep_first_reads`, each read sets `first_reads`: the draft's entries of the rows whose prompt it read,
        # by row, per layer keys and values [heads, positions, head_dim] from position 0 (what `preload` takes).
        self.keep_first_reads = False
        self.first_reads: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def batch(self) -> int:
        return len(self.present)

    def observe(self, row: int, features: torch.Tensor, next_tokens: torch.LongTensor, tokens,
                lookup_accepted: int | None = None) -> None:
        """A row's one feedback per round (`JakiroCandidateGenerator.observe`, per row): its newly accepted positions
        (target features [m, width] and the token after each), queued for the next read, and their token ids for its
        n-gram index (`tokens`: host ids, or a tensor read only with lookup on), with its next chain length (2a + 1
        after a round that accepted a of its lookup nodes)."""
        self.queued[row].append((features, next_tokens))
        if self.lookup[row] is None:
            return
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        ready = self._ready_chains[row] if self._ready_chains is not None else []
        self.copied[row] = continues(ready[0] if ready else [], tokens)
        self.lookup[row].extend(tokens)
        if lookup_accepted is not None:
            self.lookup_length[row] = min(self.settings.lookup_tokens, 2 * lookup_accepted + 1)

    def chains(self) -> list[list[list[int]]]:
        """Every row's lookup chains this round, each row's at its own length (`observe`): in a batch every row's
        chain adds to every row's round, so a row whose chains were rejected brings one token, not a whole chain,
        until one of its chains is accepted again."""
        settings = self.settings
        return [
            [] if index is None else index.chains(length, settings.lookup_chains)
            for index, length in zip(self.lookup, self.lookup_length)
        ]

    def signals(self) -> tuple[bool, bool, bool]:
        """What the round controller reads before choosing the batch's round (`JakiroCandidateGenerator.signals`):
        whether the n-gram lookup offers a chain to some row now (the chains are kept for `propose`), whether at least
        half the rows copied in their last round (`lookup.continues`), and False for a whole accepted chain (a pinned
        batch verifies its tree every round)."""
        if self.settings.lookup_tokens <= 0:
            return False, False, False
        self._ready_chains = self.chains()
        return any(self._ready_chains), 2 * sum(self.copied) >= len(self.copied) > 0, False

    def propose(self, roots: torch.LongTensor, choice: RoundChoice | None = None) -> tuple[list[DraftTree], str]:
        """This round's trees, one per row, and the choice's name (`round_controller.RoundChoice.name`): the tree of the
        choice's size (without a choice, the settings' tree) with each row's lookup chains grafted (as the choice
        says for that row: `RoundChoice.carries_chains`), lookup chains alone (each row's at its length, `chains`; a
        row without a chain verifies its root alone), or the roots alone (a plain batched step). Rounds without a
        draft forward leave the queued positions for later."""
        settings = self.settings
        self.catch_up_s = 0.0  # set by `_read` in a tree round
        kind = "tree" if choice is None else choice.kind
        if kind == "tree":
            size = (settings.total_tokens, settings.depth, settings.top_k) if choice is None else (
                choice.total_tokens, choice.depth, choice.top_k)
            chains = self._round_chains() if settings.lookup_tokens > 0 else None
            if chains is not None and choice is not None:  # each row's own copy run decides (`carries_chains`)
                chains = [row if choice.carries_chains(copied) else [] for row, copied in zip(chains, self.copied)]
            return self.trees(roots, *size, chains=chains), RoundChoice("tree", *size).name
        trees = [DraftTree.root_only(root) for root in roots.to(self.draft.fc.weight.device)]
        if kind == "lookup":
            trees = [graft_chains(tree, row_chains) for tree, row_chains in zip(trees, self._round_chains())]
        return trees, kind

    def _round_chains(self) -> list[list[list[int]]]:
        """This round's chains per row: those `signals` found, else found now."""
        return self._ready_chains if self._ready_chains is not None else self.chains()

    def snapshot(self):
        """The state `restore` returns to (benchmarks replaying one round)."""
        return (self.cache.get_seq_length(), self.key_mask, list(self.present), [list(q) for q in self.queued],
                list(self.lookup_length), list(self.fresh), list(self.preloaded))

    def restore(self, state) -> None:
        length, self.key_mask, present, queued, lookup_length, fresh, preloaded = state
        truncate(self.cache, length)
        self.present, self.queued, self.lookup_length = list(present), [list(q) for q in queued], list(lookup_length)
        self.fresh, self.preloaded = list(fresh), list(preloaded)

    def select(self, rows: list[int], index: torch.LongTensor | None = None) -> None:
        """Keep these rows (indices into the current batch), in this order (`index`: the same on the device, when the
        caller has it)."""
        device = self.key_mask.device
        index = torch.tensor(rows, dtype=torch.long, device=device) if index is None else index.to(device)
        select_rows(self.cache, index)
        self.key_mask = drop_hole_columns(self.cache, self.key_mask[index])  # and columns that are holes in every row
        for name in ("present", "queued", "lookup", "lookup_length", "copied", "fresh", "preloaded"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in rows])
        if self._ready_chains is not None:
            self._ready_chains = [self._ready_chains[i] for i in rows]

    def add_rows(self, count: int) -> None:
        """`count` new rows at the end (requests joining a continuous batch), with nothing read yet: their first
        `observe` queues their prompts, which the next tree round reads with the other rows' new positions."""
        device = self.key_mask.device
        self.key_mask = torch.cat([self.key_mask, torch.zeros(count, self.key_mask.shape[1], dtype=torch.bool,
                                                              device=device)])
        append_empty_rows(self.cache, count)
        lookup = self.settings.lookup_tokens > 0
        self.present += [0] * count
        self.queued += [[] for _ in range(count)]
        self.lookup += [NgramIndex(self.settings.lookup_max_ngram) if lookup else None for _ in range(count)]
        self.lookup_length += [self.settings.lookup_tokens] * count
        self.copied += [False] * count
        self.fresh += [True] * count
        self.preloaded += [None] * count
        if self._ready_chains is not None:
            self._ready_chains += [[] for _ in range(count)]

    def preload(self, row: int, entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The draft's cache entries of a joining row's first positions [0, m), per layer keys and values [heads, m,
        head_dim], from a row that read the same tokens with the same features before (`first_reads`; continuous
        batching keeps them by shared prompt page). The row's first read starts at position m and sees them: queue
        its positions from m on. An entry depends only on its own position's input (the draft has one layer), so the
        row computes what it would compute reading its whole prompt."""
        if not self.fresh[row] or self.queued[row] or self.preloaded[row] is not None:
            raise ValueError(f"Row {row} has queued or read positions already; preload a row right after add_rows.")
        self.preloaded[row] = entries
        self.present[row] = entries[0][0].shape[-2]

    def _mask(self, visible_new: torch.BoolTensor) -> torch.BoolTensor:
        """[rows, 1, q, cached + new] bool: each query sees its row's present cached entries and `visible_new`
        ([rows, q, new]) among the entries this forward and earlier tree levels wrote after them."""
        rows, queries, _ = visible_new.shape
        cached = self.key_mask[:, None, :].expand(rows, queries, -1)
        return torch.cat([cached, visible_new], dim=2)[:, None]

    def _read(self):
        """Read every row's queued positions. Returns the left and right outputs at each row's last position ([rows,
        hidden] each; right None without a contrastive head). Rows that have read nothing yet (requests that just
        joined a continuous batch: their prompts) are read in a forward of their own when other rows read too: one
        forward pads every row to the longest queue, so a joined 150-token prompt beside 2-position rows cost what 8
        such prompts do (CB-12). Its time counts as this round's drafting, as the padded read's did."""
        self.first_reads = {}
        first = [row for row, queue in enumerate(self.queued) if queue and self.fresh[row]]
        others = any(queue for row, queue in enumerate(self.queued) if row not in first)
        if not others and any(self.preloaded[row] is not None for row in first):
            return self._read_rows(first, alone=True)  # every row is new: `first` is every row (`trees`)
        if not first or not others:
            return self._read_rows(None)
        left_first, right_first = self._read_rows(first, alone=True)
        left, right = self._read_rows(None)
        index = torch.tensor(first, device=left.device)
        left = left.index_copy(0, index, left_first)
        if right is not None:
            right = right.index_copy(0, index, right_first)
        return left, right

    def _read_rows(self, rows: list[int] | None, alone: bool = False):
        """One forward over the queued positions of `rows` (None: every row), each row's at its own length, appended
        to the cache as new columns (holes in the other rows). `alone`: rows that have read nothing, in a cache of
        their own that holds only their preloaded entries (`preload`). When every row reads, sets `stable` and
        `catch_up_s`. Returns the left and right outputs at each read row's last position."""
        draft, device = self.draft, self.draft.fc.weight.device
        tic = time.perf_counter()
        rows = list(range(self.batch)) if rows is None else rows
        queued = [self.queued[row] for row in rows]
        features = [torch.cat([f for f, _ in queue]) if queue else None for queue in queued]
        tokens = [torch.cat([t for _, t in queue]) if queue else None for queue in queued]
        lengths = [0 if f is None else f.shape[0] for f in features]
        longest = max(lengths)
        present = [self.present[row] for row in rows]
        newest = 1  # the first read: the prompts; later, the rows the last round accepted
        if not alone and any(present):
            newest = max((queue[-1][0].shape[0] for queue in queued if queue), default=longest)
        some = next(f for f in features if f is not None)
        padded_features = some.new_zeros(len(rows), longest, some.shape[-1])
        padded_tokens = next(t for t in tokens if t is not None).new_zeros(len(rows), longest)
        for i, (f, t) in enumerate(zip(features, tokens)):
            if f is not None:
                padded_features[i, : f.shape[0]] = f
                padded_tokens[i, : t.shape[0]] = t
        # The host's lengths and positions in one upload (each `torch.tensor` of host data is a copy to the device)
        lengths_t, present_t = torch.tensor([lengths, present], device=device)
        steps = torch.arange(longest, device=device)
        valid = steps[None, :] < lengths_t[:, None]  # [rows, longest]
        causal = steps[None, :, None] >= steps[None, None, :]  # query j sees new entries <= j
        visible = causal & valid[:, None, :]
        positions = present_t[:, None] + steps[None, :]
        if alone:
            cache, preloaded = self._preloaded_cache(rows)  # preloaded: [rows, m] present entries, m >= 0
            mask = torch.cat([preloaded[:, None, :].expand(-1, longest, -1), visible], dim=2)[:, None]
        else:
            cache, mask = self.cache, self._mask(visible)
        start = cache.get_seq_length()  # where this read's entries go
        out = draft(
            input_ids=padded_tokens.to(device), hidden_states=padded_features, position_ids=positions,
            attention_mask=mask, cache=cache,
        )
        if self.keep_first_reads:
            self._keep_first_reads(cache, rows, lengths, start)
        if alone:
            index = torch.tensor(rows, device=device)
            append_columns(self.cache, cache, index, self.batch)
            columns = torch.zeros(self.batch, start + longest, dtype=torch.bool, device=device)
            self.key_mask = torch.cat([self.key_mask, columns.index_copy(0, index, torch.cat([preloaded, valid], 1))],
                                      dim=1)
        else:
            self.key_mask = torch.cat([self.key_mask, valid], dim=1)
        if len(rows) == self.batch:
            self.stable = present_t + lengths_t  # the same on the device: each row's root was read at stable - 1
            self.catch_up_s = (time.perf_counter() - tic) * (1.0 - newest / longest)  # as the one-row drafter's
        for row, length in zip(rows, lengths):
            self.present[row] += length
            self.queued[row], self.fresh[row], self.preloaded[row] = [], False, None
        last = (lengths_t - 1).clamp(min=0)[:, None, None]  # a row with nothing queued: its output is replaced
        left = out.last_hidden_state.gather(1, last.expand(-1, 1, out.last_hidden_state.shape[-1]))[:, 0]
        right = out.contrastive_hidden_state
        if right is not None and self.settings.contrastive:
            right = right.gather(1, last.expand(-1, 1, right.shape[-1]))[:, 0]
        else:
            right = None
        return left, right

    def _preloaded_cache(self, rows: list[int]) -> tuple[DynamicCache, torch.BoolTensor]:
        """A cache for the first read of `rows` holding their preloaded entries (`preload`), each row's from column 0
        and padded to the longest, and which of its entries are present ([rows, longest preloaded])."""
        device = self.key_mask.device
        entries = [self.preloaded[row] for row in rows]
        counts = [0 if e is None else e[0][0].shape[-2] for e in entries]
        cache = DynamicCache()
        if max(counts) > 0:
            some = next(e for e in entries if e is not None)
            for layer, (keys, values) in enumerate(some):
                padded_keys = keys.new_zeros(len(rows), keys.shape[0], max(counts), keys.shape[-1])
                padded_values = values.new_zeros(len(rows), values.shape[0], max(counts), values.shape[-1])
                for i, e in enumerate(entries):
                    if e is not None:
                        padded_keys[i, :, : counts[i]] = e[layer][0]
                        padded_values[i, :, : counts[i]] = e[layer][1]
                cache.update(padded_keys.to(device), padded_values.to(device), layer)
        present = torch.arange(max(counts), device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
        return cache, present

    def _keep_first_reads(self, cache, rows: list[int], lengths: list[int], start: int) -> None:
        """`first_reads` of the rows this read took from the start (fresh), from `cache` after the read: a row's
        preloaded entries (columns [0, its count)) then its new ones (columns [start, start + its length))."""
        for i, (row, length) in enumerate(zip(rows, lengths)):
            if not self.fresh[row]:
                continue
            count = self.present[row]  # its preloaded entries (the read has not advanced `present` yet)
            self.first_reads[row] = [
                (torch.cat([layer.keys[i, :, :count], layer.keys[i, :, start : start + length]], dim=-2),
                 torch.cat([layer.values[i, :, :count], layer.values[i, :, start : start + length]], dim=-2))
                for layer in cache.layers
            ]

    @torch.no_grad()
    def trees(self, roots: torch.LongTensor, total_tokens: int, depth: int, top_k: int, chains=None) -> list[DraftTree]:
        """Every row's tree for this round, rooted at `roots` [rows] (each row's last accepted token), with its lookup
        `chains` (per row, or None) grafted. `total_tokens`/`depth`/`top_k`: the tree size every row gets."""
        draft, device = self.draft, self.draft.fc.weight.device
        k = min(top_k, self.top_k)
        left, right = self._read()
        rows = self.batch
        stable = self.stable  # each row's root was read at position stable - 1 (set by `_read`)
        cached = self.key_mask.shape[1]

        tokens_by_level, parents_by_level, scores_by_level, depths_by_level = [], [], [], []

        def record(tokens, parents, scores, level):
            start = 1 + sum(t.shape[1] for t in tokens_by_level)
            tokens_by_level.append(tokens.reshape(rows, -1))
            parents_by_level.append(parents.reshape(rows, -1))
            scores_by_level.append(scores.reshape(rows, -1).float())
            depths_by_level.append(torch.full_like(tokens_by_level[-1], level))
            return torch.arange(start, start + tokens_by_level[-1].shape[1], device=device)

        kept_scores, kept_tokens = draft_top_k(self.draft, left, k)  # [rows, k]
        index = record(kept_tokens, torch.zeros_like(kept_tokens), kept_scores, 1)
        kept_index = index[None].expand(rows, k)
        kept_rows = torch.zeros(rows, k, dtype=torch.long, device=device)
        left = left[:, None]  # [rows, 1, hidden]: rows of the last forward
        eye = torch.eye(k, dtype=torch.bool, device=device)
        visible = eye[None].expand(rows, k, k)

        for level in range(2, depth + 1):
            hidden = left.shape[-1]
            parent_features = left.gather(1, kept_rows[..., None].expand(-1, -1, hidden))
            positions = (stable - 2 + level)[:, None].expand(rows, k)
            out = draft(
                input_ids=kept_tokens, hidden_states=parent_features, position_ids=positions,
                attention_mask=self._mask(visible), cache=self.cache,
            )
            left = out.last_hidden_state
            right = out.contrastive_hidden_state if self.settings.contrastive else None
            log_probs, tokens = draft_top_k(self.draft, left, k)  # [rows, k, k]
            scores = kept_scores[..., None] + log_probs
            index = record(tokens, kept_index[..., None].expand(rows, k, k), scores, level)
            best = scores.reshape(rows, -1).topk(k, dim=-1).indices
            kept_rows = best // k
            kept_index = index[best]
            kept_tokens = tokens.reshape(rows, -1).gather(1, best)
            kept_scores = scores.reshape(rows, -1).gather(1, best)
            visible = torch.cat([visible.gather(1, kept_rows[..., None].expand(-1, -1, visible.shape[2])),
                                 eye[None].expand(rows, k, k)], dim=2)

        if right is not None:
            if right.dim() == 2:  # depth 1: the root's own right output
                right = right[:, None]
            log_probs, tokens = draft_top_k(self.draft, right, k)  # [rows, rows of the last forward, k]
            pick = kept_rows[..., None].expand(-1, -1, k)
            record(tokens.gather(1, pick), kept_index[..., None].expand(rows, k, k),
                   kept_scores[..., None] + log_probs.gather(1, pick), depth + 1)
        truncate(self.cache, cached)

        levels = len(tokens_by_level)
        tokens = torch.cat([roots.to(device)[:, None], *tokens_by_level], dim=1)
        parents = torch.cat([torch.full((rows, 1), -1, device=device, dtype=torch.long), *parents_by_level], dim=1)
        scores = torch.cat([torch.zeros(rows, 1, device=device), *scores_by_level], dim=1)
        depths = torch.cat([torch.zeros(rows, 1, device=device, dtype=torch.long), *depths_by_level], dim=1)
        trees = [flatten_tree(tokens[r], parents[r], scores[r], depths[r], total_tokens, levels) for r in range(rows)]
        if chains is not None:
            trees = [graft_chains(tree, row_chains) for tree, row_chains in zip(trees, chains)]
        return trees


__all__ = ["BatchDrafter"]
