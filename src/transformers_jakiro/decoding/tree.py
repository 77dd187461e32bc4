"""Draft trees: from scored candidates to the flattened tree the target verifies.

Pure tensor functions, no model calls. A tree is built in "recorded" order: index 0 is the root (the last accepted
token), then every candidate the draft proposed, level by level. Each candidate has a token, a parent (a recorded
index) and a score (cumulative draft log-probability along its path, so a child never outscores its parent).
`flatten_tree` keeps the best `total_tokens` candidates and lays them out breadth-first, which is what the target's
forward pass consumes: tokens, parent indices, depths, the ancestor matrix (tree attention), position ids, paths.
"""

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A flattened token tree; node 0 is the root and every parent comes before its children (breadth-first).

    tokens:    [n] target token ids.
    parents:   [n] index of each node's parent, -1 for the root.
    depths:    [n] 0 for the root, 1 for its children, ...
    ancestors: [n, n] bool, ancestors[i, j] is True when j is i itself or an ancestor of i.
    scores:    [n] cumulative draft log-probabilities (0 for the root and for lookup nodes).
    levels:    a host-side int >= every depth (the number of levels the draft expanded), so that tensors sized by the
               depth need no device-to-host read; computed from `depths` (one sync) when not given.
    from_lookup: [n] bool, True for nodes that only n-gram lookup proposed (`graft_chains`); None: no lookup nodes.
    real:      [n] bool, False for the masked-out dummy nodes that `padded` appends (never accepted); None: all real.
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    scores: torch.Tensor
    levels: int | None = None
    from_lookup: torch.BoolTensor | None = None
    real: torch.BoolTensor | None = None

    def __post_init__(self):
        if self.levels is None:
            self.levels = int(self.depths.max())

    def to_device(self, device) -> "DraftTree":
        if self.tokens.device == torch.device(device):
            return self
        names = ("tokens", "parents", "depths", "ancestors", "scores")
        lookup = None if self.from_lookup is None else self.from_lookup.to(device)
        real = None if self.real is None else self.real.to(device)
        return DraftTree(
            *(getattr(self, name).to(device) for name in names), levels=self.levels, from_lookup=lookup, real=real
        )

    def padded(self, size: int) -> "DraftTree":
        """The tree with dummy nodes appended up to `size` nodes, so that every round's verification forward has the
        same shape (one compiled graph serves them all).

        A dummy is a child of the root (depth 1) carrying the root's token; it sees the root and itself, no real node
        sees it, and `real` marks it so that the acceptance rule never takes it (its token may equal the target's
        pick). Its logits are computed and ignored; its keys/values land after the real nodes' and are never kept.
        No host sync: the sizes are host ints."""
        n = self.num_nodes
        if size < n:
            raise ValueError(f"Cannot pad a tree of {n} nodes to {size}.")
        if size == n:
            return self if self.real is not None else DraftTree(**{**self.__dict__, "real": self._all_real()})
        extra, device = size - n, self.tokens.device
        ancestors = with_appended_nodes(self.ancestors, dummy_ancestors(n, extra, device))
        real = self.real if self.real is not None else self._all_real()
        lookup = self.from_lookup
        return DraftTree(
            tokens=torch.cat([self.tokens, self.tokens[:1].expand(extra)]),
            parents=torch.cat([self.parents, self.parents.new_zeros(extra)]),
            depths=torch.cat([self.depths, self.depths.new_ones(extra)]),
            ancestors=ancestors,
            scores=torch.cat([self.scores, self.scores.new_full((extra,), float("-inf"))]),
            levels=max(self.levels, 1),
            from_lookup=None if lookup is None else torch.cat([lookup, lookup.new_zeros(extra)]),
            real=torch.cat([real, real.new_zeros(extra)]),
        )

    def _all_real(self) -> torch.BoolTensor:
        return torch.ones_like(self.tokens, dtype=torch.bool)

    @classmethod
    def root_only(cls, root_token: torch.LongTensor) -> "DraftTree":
        """The tree of the root alone (the last accepted token), for rounds that verify lookup chains only."""
        device = root_token.device
        return cls(
            tokens=root_token.reshape(1),
            parents=torch.full((1,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(1, dtype=torch.long, device=device),
            ancestors=torch.ones(1, 1, dtype=torch.bool, device=device),
            scores=torch.zeros(1, device=device),
            levels=0,
        )

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def position_ids(self, past_length: int) -> torch.LongTensor:
        """[1, n]: the root sits right after the `past_length` cached tokens; a node of depth d at past + d."""
        return (self.depths + past_length)[None]

    def attention_mask(
        self, past_length: int, dtype: torch.dtype, padding: int = 0, kv_length: int | None = None
    ) -> torch.Tensor:
        """[1, 1, n, past + n] additive float mask: every node sees the cached prefix, its ancestors and itself.
        The first `padding` cached positions are left padding, which no node sees (as in plain generate).
        `kv_length` (a static cache's size): the mask spans that many positions, those after the tree hidden.

        A float mask (0 / dtype-min) rather than a bool one: transformers' eager attention adds 4D masks, so a bool
        mask would be silently wrong there."""
        n = self.num_nodes
        prefix = (torch.arange(past_length, device=self.tokens.device) >= padding).expand(n, past_length)
        visible = torch.cat([prefix, self.ancestors], dim=1)
        if kv_length is not None:
            if kv_length < past_length + n:
                raise ValueError(f"A tree of {n} nodes after {past_length} cached positions needs a cache of at least "
                                 f"{past_length + n} positions, not {kv_length}.")
            hidden = torch.zeros(n, kv_length - past_length - n, dtype=torch.bool, device=self.tokens.device)
            visible = torch.cat([visible, hidden], dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.tokens.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]

    def has_children(self) -> torch.BoolTensor:
        """[n] True for nodes with at least one child."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.tokens.device)
        return has_child.index_fill_(0, self.parents[1:], True)

    def leaves(self) -> torch.LongTensor:
        return torch.nonzero(~self.has_children()).flatten()

    def internal_nodes(self) -> torch.LongTensor:
        """Nodes with children, ascending: the only nodes whose target choice decides which child is accepted."""
        return torch.nonzero(self.has_children()).flatten()

    def paths(self) -> torch.LongTensor:
        """[num_leaves, max_depth + 1] node indices from the root to each leaf, right-padded with -1."""
        leaves = self.leaves()
        width = int(self.depths.max()) + 1
        node_index = torch.arange(self.num_nodes, device=self.tokens.device)
        out = torch.full((leaves.numel(), width), -1, dtype=torch.long, device=self.tokens.device)
        for row, leaf in enumerate(leaves.tolist()):
            path = node_index[self.ancestors[leaf]]  # ascending index == ascending depth (breadth-first order)
            out[row, : path.numel()] = path
        return out


def dummy_ancestors(existing: int, extra: int, device) -> torch.BoolTensor:
    """[extra, existing + extra]: the ancestor rows of `extra` dummy nodes appended after `existing` nodes (each a
    child of the root that sees the root and itself: `DraftTree.padded`, the empty slots of `graft_chain_slots`)."""
    root = (torch.arange(existing, device=device) == 0).expand(extra, existing)
    return torch.cat([root, torch.eye(extra, dtype=torch.bool, device=device)], dim=1)


def with_appended_nodes(ancestors: torch.BoolTensor, rows: torch.BoolTensor) -> torch.BoolTensor:
    """The ancestor matrix [n, n] of a tree with nodes appended whose ancestor rows are `rows` ([m, n + m]): no old
    node sees a new one. Built from blocks: a Python scalar written into a tensor would be a blocking host-to-device
    copy on an accelerator."""
    n, m = ancestors.shape[0], rows.shape[0]
    return torch.cat([torch.cat([ancestors, ancestors.new_zeros(n, m)], dim=1), rows])


def tree_columns(visible: torch.BoolTensor, columns: torch.LongTensor, start) -> torch.BoolTensor:
    """[q, len(columns)] bool: `visible` ([q, t]: which of a tree's t cached entries each query sees) laid over a
    static cache's `columns`, the entries sitting at [start, start + t); False at every other column. `start` may be
    a device value: no shape depends on it (what `draft_round` and `verify_round` build their masks from)."""
    entries = visible.shape[1]
    offset = columns - start
    inside = (offset >= 0) & (offset < entries)
    return visible.gather(1, offset.clamp(0, entries - 1)[None].expand(visible.shape[0], -1)) & inside


def ancestor_matrix(parents: torch.LongTensor, max_depth: int) -> torch.BoolTensor:
    """ancestors[i, j] = j is i or one of its ancestors, for a parent array with -1 at the root (index 0).

    Built with `scatter_` of a constant: writing a Python scalar through advanced indexing
    (`ancestors[index, current] = True`) turns it into a tensor first, a blocking host-to-device copy per level on an
    accelerator."""
    n = parents.numel()
    step = parents.clamp(min=0)  # the root is its own parent: walking past it stays at the root
    ancestors = torch.eye(n, dtype=torch.bool, device=parents.device)
    current = torch.arange(n, device=parents.device)
    for _ in range(max_depth):
        current = step[current]
        ancestors.scatter_(1, current[:, None], True)
    return ancestors


def ranking_scores(scores: torch.Tensor, parents: torch.LongTensor, levels: int) -> torch.Tensor:
    """The scores that candidates are ranked by: NaN and +inf count as -inf (a draft that overflows, a damaged
    checkpoint), and no node outranks its parent (each score is capped by the minimum along its path).

    For a sane draft this changes nothing: a child's score is its parent's plus a log-probability <= 0. For any other
    input it is what makes the kept set a tree by construction (see `best_candidates`). `parents` [n] holds recorded
    indices (-1 at the root); `levels` >= every depth bounds the walk up (one vectorized step per level)."""
    scores = scores.float()
    scores = torch.where(torch.isnan(scores) | (scores == float("inf")), float("-inf"), scores)
    step = parents.clamp(min=0)  # the root is its own parent
    for _ in range(levels):
        scores = torch.minimum(scores, scores[step])
    return scores


def best_candidates(scores: torch.Tensor, total_tokens: int) -> torch.LongTensor:
    """Indices of the `total_tokens` best-scored candidates (`scores[0]` is the root's, never a candidate), best
    first. A stable descending sort: on a tie the earlier recorded candidate wins, and parents are recorded before
    their children, so with scores that never rise along a path (`ranking_scores`) every parent comes before its
    children and every prefix of the ranking is closed under ancestors. NaN counts as -inf."""
    scores = scores.float()
    scores = scores.masked_fill(torch.isnan(scores), float("-inf"))
    return torch.sort(scores[1:], descending=True, stable=True).indices[:total_tokens] + 1


def flatten_tree(
    tokens: torch.LongTensor,
    parents: torch.LongTensor,
    scores: torch.Tensor,
    depths: torch.LongTensor,
    total_tokens: int,
    levels: int | None = None,
) -> DraftTree:
    """Keep the root and the `total_tokens` best-scored candidates, breadth-first.

    Inputs are in recorded order (root first, then candidates level by level, each parent recorded before its
    children; `parents[0]` is ignored). `levels` (>= every depth; the recorder knows it) saves a device sync.
    `best_candidates` ranks on `ranking_scores`, which orders every parent before its children whatever the draft
    scored (ties, NaN, infinities), so the kept set is closed under ancestors: always a tree, and no kept node's
    parent can be missing (a -1 parent below the root would make the acceptance rule index `choices[-1]`).
    """
    levels = int(depths.max()) if levels is None else levels
    return DraftTree(*flattened_tensors(tokens, parents, scores, depths, total_tokens, levels), levels=levels)


def flattened_tensors(tokens, parents, scores, depths, total_tokens: int, levels: int):
    """`flatten_tree`'s work as tensors in, tensors out (tokens, parents, depths, ancestors, scores of the kept
    nodes), for code compiled whole (`drafter.draft_round`): fixed shapes, no host reads."""
    scores = ranking_scores(scores, parents, levels)
    order = best_candidates(scores, total_tokens)
    nodes = torch.cat([order.new_zeros(1), torch.sort(order).values])  # recorded order is breadth-first
    position = torch.full_like(tokens, -1)
    position[nodes] = torch.arange(nodes.numel(), device=tokens.device)
    flat_parents = torch.cat([parents.new_full((1,), -1), position[parents[nodes[1:]]]])
    return tokens[nodes], flat_parents, depths[nodes], ancestor_matrix(flat_parents, levels), scores[nodes]


def graft_chains(tree: DraftTree, chains: list[list[int]]) -> DraftTree:
    """The tree with token chains (n-gram lookup continuations) hung from its root, breadth-first again.

    Each chain is a list of target token ids that would follow the root. Where a chain's prefix equals existing
    nodes (the draft proposed the same tokens) it walks down through them; the rest hangs as a chain below the deepest
    shared node. Siblings therefore keep distinct tokens, which the acceptance rule relies on. New nodes get score 0
    and `from_lookup` True. The tree's tokens and parents are read on the host (one copy); a tree the chains add
    nothing to is returned unchanged.
    """
    chains = [chain for chain in chains if chain]
    if not chains:
        return tree
    device = tree.tokens.device
    tokens, parents, depths = torch.stack([tree.tokens, tree.parents, tree.depths]).tolist()
    child_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens)) if node > 0}
    old = len(tokens)
    for chain in chains:
        node = 0
        for token in chain:
            child = child_of.get((node, token))
            if child is None:
                child = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                depths.append(depths[node] + 1)
                child_of[(node, token)] = child
            node = child
    if len(tokens) == old:
        return tree
    order = sorted(range(len(tokens)), key=lambda i: (depths[i], i))  # breadth-first; old nodes keep their order
    position = {node: i for i, node in enumerate(order)}
    # One upload for the new tree's host data (each `torch.tensor` of host data is a copy to the device)
    flat_parents, index, new_tokens, new_depths = torch.tensor(
        [[position[parents[i]] if i else -1 for i in order], order, tokens, depths], device=device
    )
    scores = torch.cat([tree.scores, tree.scores.new_zeros(len(tokens) - old)])
    from_lookup = index >= old
    if tree.from_lookup is not None:
        from_lookup |= torch.cat([tree.from_lookup, from_lookup.new_zeros(len(tokens) - old)])[index]
    return DraftTree(
        tokens=new_tokens.to(tree.tokens.dtype)[index],
        parents=flat_parents,
        depths=new_depths[index],
        ancestors=ancestor_matrix(flat_parents, max(depths)),
        scores=scores[index],
        levels=max(tree.levels, max(depths)),
        from_lookup=from_lookup,
    )


def graft_chain_slots(tree: DraftTree, chains: list[list[int]], length: int, count: int) -> DraftTree:
    """`graft_chains` in fixed slots, on the device: `count` chains of `length` tokens each (missing chains and the
    ends of short ones are empty slots) always add `count * length` nodes, so nothing about the grafted tree is read
    on the host, and the chains' tokens are its one upload. For trees padded to a fixed size anyway (static caches):
    there the slots cost no extra rows.

    Chain i's slot j holds its token j as a new node when the tree does not already spell the chain's first j + 1
    tokens, below the deepest node that spells a prefix of the chain (a draft node, or an earlier chain's slot); else
    the slot is a dummy as `DraftTree.padded` appends them (`real` False: a child of the root that sees the root and
    itself and is never accepted). Parents still precede their children; the order is no longer breadth-first."""
    device = tree.tokens.device
    rows = [list(chain[:length]) + [-1] * (length - len(chain[:length])) for chain in chains[:count]]
    rows += [[-1] * length] * (count - len(rows))
    chain_tokens = torch.tensor(rows, dtype=tree.tokens.dtype, device=device)  # the one upload
    tokens, parents, depths, ancestors, scores = tree.tokens, tree.parents, tree.depths, tree.ancestors, tree.scores
    real = tree.real if tree.real is not None else torch.ones_like(tokens, dtype=torch.bool)
    from_lookup = tree.from_lookup if tree.from_lookup is not None else torch.zeros_like(real)
    step = torch.arange(length, device=device)
    for chain in chain_tokens:
        size = tokens.shape[0]
        nodes = torch.arange(size, device=device)
        # a node spells the chain when every node on its way down (the root aside) holds the chain's token there
        spells = (tokens == chain[(depths - 1).clamp(0, length - 1)]) & (depths <= length) & real
        spells = spells | (nodes == 0)
        on_chain = ~(ancestors & ~spells[None, :]).any(dim=1)
        deepest = torch.argmax(torch.where(on_chain, depths, -1))[None]  # [1]: no host read
        shared = depths.index_select(0, deepest)  # the chain's tokens the tree already holds
        new = (chain >= 0) & (step >= shared)
        slot_parents = torch.where(step == shared, deepest, size + step - 1)
        seen = torch.cat([ancestors.index_select(0, deepest).expand(length, size),
                          (step[None, :] <= step[:, None]) & new[None, :]], dim=1)
        slot_rows = torch.where(new[:, None], seen, dummy_ancestors(size, length, device))
        ancestors = with_appended_nodes(ancestors, slot_rows)
        tokens = torch.cat([tokens, torch.where(new, chain, tokens[:1])])
        parents = torch.cat([parents, torch.where(new, slot_parents, 0)])
        depths = torch.cat([depths, torch.where(new, step + 1, 1)])
        scores = torch.cat([scores, torch.where(new, 0.0, float("-inf")).to(scores.dtype)])
        real = torch.cat([real, new])
        from_lookup = torch.cat([from_lookup, new])
    return DraftTree(tokens, parents, depths, ancestors, scores, levels=max(tree.levels, length),
                     from_lookup=from_lookup, real=real)


class TreeRecorder:
    """Collects candidates level by level while the draft expands, then flattens them.

    `add_level` returns the recorded indices of the new candidates so the caller can name them as parents later.
    """

    def __init__(self, root_token: torch.LongTensor):
        device = root_token.device
        self.tokens = [root_token.reshape(1)]
        self.parents = [torch.full((1,), -1, dtype=torch.long, device=device)]
        self.scores = [torch.zeros(1, dtype=torch.float32, device=device)]
        self.depths = [torch.zeros(1, dtype=torch.long, device=device)]
        self.size = 1
        self.num_levels = 0

    def add_level(self, tokens, parents, scores, depth: int) -> torch.LongTensor:
        tokens, parents, scores = tokens.reshape(-1), parents.reshape(-1), scores.reshape(-1).float()
        index = torch.arange(self.size, self.size + tokens.numel(), device=tokens.device)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.scores.append(scores)
        self.depths.append(torch.full_like(tokens, depth))
        self.size += tokens.numel()
        self.num_levels = max(self.num_levels, depth)
        return index

    def flatten(self, total_tokens: int) -> DraftTree:
        return flatten_tree(*self.recorded(), total_tokens, levels=self.num_levels)

    def recorded(self):
        """tokens, parents, scores, depths of every recorded candidate, root first."""
        return torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.scores), torch.cat(self.depths)


__all__ = [
    "DraftTree",
    "TreeRecorder",
    "ancestor_matrix",
    "best_candidates",
    "dummy_ancestors",
    "flatten_tree",
    "flattened_tensors",
    "graft_chain_slots",
    "graft_chains",
    "ranking_scores",
    "tree_columns",
    "with_appended_nodes",
]
