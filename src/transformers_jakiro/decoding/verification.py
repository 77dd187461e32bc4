"""Acceptance rules: which draft tokens the target keeps after one verification forward.

Greedy and sampling share one rule. At every tree node the target picks its own next token from that node's
(processed) distribution: the argmax when greedy, a sample when sampling. Walking down from the root, the walk moves
to the child whose token equals the target's pick; when no child matches, the pick itself is the bonus token and
the round ends.

Why this is lossless when sampling: with deterministic (top-k) drafts the draft's proposal is a point mass, and the
textbook multi-candidate rule "try each distinct child x in turn, accept it with probability p(x) under the residual
distribution, else zero it out and renormalise; if all are rejected, sample from the residual" selects child x with
probability exactly p(x) and stops with a fresh token y with probability p(y) restricted to non-children. Drawing
y ~ p once and descending if y is a child is the same distribution, and every emitted token is a sample from the
target's own distribution given its prefix. Picks at nodes off the realised path are never used, so drawing them
all at once in one batched `multinomial` changes nothing.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .tree import DraftTree


def target_choices(processed_logits: torch.Tensor, do_sample: bool) -> torch.LongTensor:
    """[n] the target's pick at every node: argmax, or one sample from softmax(processed logits)."""
    if not do_sample:
        return processed_logits.argmax(dim=-1)
    probs = torch.softmax(processed_logits.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1).squeeze(-1)


def accept(tree: DraftTree, choices: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The accepted path and the bonus token.

    Returns (path, bonus): `path` [tree.levels + 1] holds the node at each depth on the way from the root to the
    deepest node whose every ancestor's token equals the target's choice at its parent (so path[0] == 0), then -1
    below it; `bonus` is the target's choice at the last node of the path. Among the children of one node tokens are
    distinct, so at most one child matches and the accepted nodes form a single chain. The path has a fixed size, so
    no host sync happens here: the caller reads its length together with whatever else it needs on the host.
    """
    matches = torch.ones_like(tree.tokens, dtype=torch.bool)
    matches[1:] = tree.tokens[1:] == choices[tree.parents[1:]]
    if tree.real is not None:  # padding nodes (`DraftTree.padded`) are never accepted
        matches &= tree.real
    accepted = ~(tree.ancestors & ~matches[None, :]).any(dim=1)  # every node on the way down matched
    # [1]: indexing with a 0-dim tensor would read it on the host (`item`); index_select keeps it on the device
    deepest = torch.argmax(torch.where(accepted, tree.depths, -1))[None]
    row = tree.ancestors.index_select(0, deepest)[0]
    on_path = torch.where(row, torch.arange(tree.num_nodes, device=tree.tokens.device), -1)
    # one ancestor per depth: the maximum over a depth's nodes picks it out of the -1s of the others
    path = torch.full((tree.levels + 1,), -1, dtype=torch.long, device=tree.tokens.device)
    path = path.scatter_reduce(0, tree.depths, on_path, reduce="amax")
    return path, choices.index_select(0, deepest)[0]


def path_nodes(path: torch.LongTensor) -> torch.LongTensor:
    """The accepted node indices of a padded `path` (one host sync; tests and tools, not the decoding loop)."""
    return path[: int((path >= 0).sum())]


def verify(
    tree: DraftTree,
    processed_logits: torch.Tensor,
    do_sample: bool,
    leaf_logits: Callable[[torch.LongTensor], torch.Tensor] | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """One round's verdict from the target's processed logits: (accepted path, padded as in `accept`; bonus token).

    `processed_logits` holds a row for every node; or, when `leaf_logits` is given, rows for `tree.internal_nodes()`
    only, and `leaf_logits(node)` returns the processed logits [vocab] of a leaf. Only internal nodes' choices decide
    which children are accepted, so a leaf's logits are needed only when the path ends there: `leaf_logits` is called
    at most once (after a host sync). The target's picks are independent per node, so drawing the leaf's pick later
    samples the same distribution.
    """
    if leaf_logits is None:
        return accept(tree, target_choices(processed_logits, do_sample))
    choices = torch.full_like(tree.tokens, -1)
    choices[tree.internal_nodes()] = target_choices(processed_logits, do_sample)
    path, bonus = accept(tree, choices)
    if int(bonus) < 0:  # the path ends at a leaf: its deepest node, the largest index (parents precede children)
        bonus = target_choices(leaf_logits(path.max())[None], do_sample)[0]
    return path, bonus


def path_packet(tree: DraftTree, path: torch.LongTensor, bonus: torch.LongTensor) -> list[torch.Tensor]:
    """What a round reads to the host in its one copy, on the device: the padded path [w] (its length: the nodes
    >= 0), the tokens along it [w], the bonus token [1] and, when the tree has lookup nodes, how many accepted nodes
    only the n-gram lookup proposed [1]. `read_path_packet` reads it back."""
    tokens = tree.tokens[path.clamp(min=0)]
    packet = [path, tokens, bonus[None]]
    if tree.from_lookup is not None:
        packet.append((tree.from_lookup[path.clamp(min=0)] & (path >= 0)).sum()[None])
    return packet


def read_path_packet(host: list[int], width: int, lookup: bool) -> tuple[int, list[int], int | None]:
    """`path_packet` read on the host (`host`: its values, in order; `width`: the padded path's): the path's length
    m, the round's m new token ids (the accepted draft tokens below the root, then the bonus) and the lookup count
    (None without lookup nodes)."""
    m = sum(node >= 0 for node in host[:width])
    return m, host[width + 1 : width + m] + [host[2 * width]], host[2 * width + 1] if lookup else None


@dataclass
class VerifiedRound:
    """What one verification round accepted; tensors on the target's device, rows in path order (root first).

    path:      [m] node indices of the accepted path, root (node 0) first.
    bonus:     [] the target's own token after the path's last node.
    tokens:    [m] the round's new tokens: the accepted draft tokens below the root, then the bonus token.
    token_ids: the same m tokens on the host (read in the round's one device-to-host copy).
    processed: [m, vocab] processed logits at the path's nodes: the scores of the round's m new tokens.
    raw:       [m, vocab] raw (float32) logits at the same nodes.
    features:  [m, width] the target's features at the same nodes (the draft reads them next round): the last hidden
               states, after the outputs of the draft's `target_feature_layers` if it names any.
    lookup_accepted: accepted nodes that only the n-gram lookup proposed (read in the same copy); None when the tree
               had no lookup nodes.
    stops:     whether generation stops after each of the m tokens (read in the same copy), when `verify_tree` was
               given the stopping verdicts to compute; None otherwise.
    """

    path: torch.LongTensor
    bonus: torch.LongTensor
    tokens: torch.LongTensor
    token_ids: list[int]
    processed: torch.Tensor
    raw: torch.Tensor
    features: torch.Tensor
    lookup_accepted: int | None = None
    stops: list[bool] | None = None


@dataclass
class RoundTokens:
    """What one round added to each current row, for the decoding loop (lists in the rows' order; tensors on the
    target's device). A row's m new tokens: `tokens` [m], `token_ids` the same on the host, `scores` [m, vocab] their
    processed logits, `raw` [m, vocab] their raw logits (None where the rounds do not keep them: batches).
    `stops`: per row whether generation stops after each of its tokens, when read with the round (else None, or None
    for the row). `lookup_accepted`: per row its accepted nodes that only the n-gram lookup proposed (None without
    lookup nodes). `name`: what the round verified (`round_controller.RoundChoice.name`) when not the choice's own.
    `measured`: False for a round the round controller must not learn from (Phi-3's whole-sequence recomputation)."""

    tokens: list
    token_ids: list
    scores: list
    raw: list | None = None
    stops: list | None = None
    lookup_accepted: list | None = None
    name: str | None = None
    measured: bool = True


__all__ = ["RoundTokens", "VerifiedRound", "path_packet", "read_path_packet", "accept", "path_nodes", "target_choices", "verify"]
