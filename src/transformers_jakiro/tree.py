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
    scores:    [n] cumulative draft log-probabilities (0 for the root).
    levels:    a host-side int >= every depth (the number of levels the draft expanded), so that tensors sized by the
               depth need no device-to-host read; computed from `depths` (one sync) when not given.
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    ancestors: torch.BoolTensor
    scores: torch.Tensor
    levels: int | None = None

    def __post_init__(self):
        if self.levels is None:
            self.levels = int(self.depths.max())

    def to_device(self, device) -> "DraftTree":
        if self.tokens.device == torch.device(device):
            return self
        names = ("tokens", "parents", "depths", "ancestors", "scores")
        return DraftTree(*(getattr(self, name).to(device) for name in names), levels=self.levels)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def position_ids(self, past_length: int) -> torch.LongTensor:
        """[1, n]: the root sits right after the `past_length` cached tokens; a node of depth d at past + d."""
        return (self.depths + past_length)[None]

    def attention_mask(self, past_length: int, dtype: torch.dtype, padding: int = 0) -> torch.Tensor:
        """[1, 1, n, past + n] additive float mask: every node sees the cached prefix, its ancestors and itself.
        The first `padding` cached positions are left padding, which no node sees (as in plain generate).

        A float mask (0 / dtype-min) rather than a bool one: transformers' eager attention adds 4D masks, so a bool
        mask would be silently wrong there."""
        n = self.num_nodes
        prefix = torch.ones(n, past_length, dtype=torch.bool, device=self.tokens.device)
        prefix[:, :padding] = False
        visible = torch.cat([prefix, self.ancestors], dim=1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.tokens.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]

    def has_children(self) -> torch.BoolTensor:
        """[n] True for nodes with at least one child."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.tokens.device)
        has_child[self.parents[1:]] = True
        return has_child

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


def ancestor_matrix(parents: torch.LongTensor, max_depth: int) -> torch.BoolTensor:
    """ancestors[i, j] = j is i or one of its ancestors, for a parent array with -1 at the root (index 0)."""
    n = parents.numel()
    index = torch.arange(n, device=parents.device)
    step = parents.clamp(min=0)  # the root is its own parent: walking past it stays at the root
    ancestors = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    ancestors[index, index] = True
    current = index
    for _ in range(max_depth):
        current = step[current]
        ancestors[index, current] = True
    return ancestors


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
    children; `parents[0]` is ignored). `levels` (>= every depth; the recorder knows it) saves a device sync. A stable descending sort puts every parent before its children even on
    score ties (a child's score is its parent's plus a log-probability <= 0), so any prefix of the sorted order is
    closed under ancestors: the kept set is always a tree.
    """
    num_candidates = tokens.numel() - 1
    keep = min(total_tokens, num_candidates)
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:keep] + 1
    nodes = torch.cat([order.new_zeros(1), torch.sort(order).values])  # recorded order is breadth-first
    position = torch.full_like(tokens, -1)
    position[nodes] = torch.arange(nodes.numel(), device=tokens.device)
    flat_parents = position[parents[nodes]]
    flat_parents[0] = -1
    flat_depths = depths[nodes]
    levels = int(depths.max()) if levels is None else levels
    return DraftTree(
        tokens=tokens[nodes],
        parents=flat_parents,
        depths=flat_depths,
        ancestors=ancestor_matrix(flat_parents, levels),
        scores=scores[nodes],
        levels=levels,
    )


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
        return flatten_tree(
            torch.cat(self.tokens),
            torch.cat(self.parents),
            torch.cat(self.scores),
            torch.cat(self.depths),
            total_tokens,
            levels=self.num_levels,
        )


__all__ = ["DraftTree", "TreeRecorder", "ancestor_matrix", "flatten_tree"]
