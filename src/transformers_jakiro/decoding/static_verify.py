"""The verification round over a static cache as one fixed-shape function, `verify_round`, compiled whole beside the
draft's `drafter.draft_round`: with both, a round is two graph calls and one host read (docs/design.md, section 2,
"Fixed shapes"). The dynamic-cache round, with data-dependent shapes, is `row_rounds.verify_tree`.
"""

import torch

from . import verification
from ..features import TargetFeatures
from .drafter import compiled_whole
from .tree import DraftTree, tree_columns
from .verification import VerifiedRound


def verify_round(target, cache, cache_arg: str, hidden: TargetFeatures, tokens, parents, depths, ancestors, real,
                 from_lookup, levels: int, padding, dtype, processors, do_sample: bool):
    """A whole verification round over the target's static cache, as one fixed-shape function (compiled whole, one
    graph call per round): the target's forward over the tree (its mask and positions built from the cache's own
    length, a device value), the per-node logits processing, acceptance, and every layer's cache compacted to the
    accepted path, with no host read and no shape that changes from round to round.

    The tree comes as its tensors (`DraftTree` fields, padded to the round's fixed size: `real` marks its real
    nodes; `from_lookup` the lookup's, or None without lookup). `padding` (a 0-dim device tensor, so that every
    prompt shares one graph): the prompt's left padding, hidden from every node. `processors`: logits processors
    that ignore the ids (`logits.PREFIX_FREE_PROCESSORS`), applied to every node at once. Returns, each padded to the path's width w = levels + 1: the host packet [2w + 1] (the path's
    nodes, -1 past its end; the round's tokens, i.e. the accepted draft tokens then the bonus; how many accepted
    nodes only the lookup proposed), the round's tokens [w], and the processed and raw logits and the features at
    the path's nodes ([w, vocab], [w, vocab], [w, width]).
    """
    layer = cache.layers[0]
    device = tokens.device
    past = layer.cumulative_length.clone()  # the tree is written from here on; the root's position is past - padding
    columns = torch.arange(layer.max_cache_len, device=device)
    visible = ((columns >= padding) & (columns < past))[None] | tree_columns(ancestors, columns, past)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    out = target(
        input_ids=tokens[None], position_ids=(depths + past - padding)[None], attention_mask=mask[None, None],
        use_cache=True, **hidden.forward_kwargs(), **{cache_arg: cache},
    )
    features = hidden.take(out)[0]
    raw = out.logits[0].float()
    processed = raw
    for processor in processors:  # prefix-free: the ids they are given do not matter
        processed = processor(tokens[:, None], processed.clone() if processed is raw else processed)
    tree = DraftTree(tokens, parents, depths, ancestors, None, levels=levels, from_lookup=from_lookup, real=real)
    path, bonus = verification.accept(tree, verification.target_choices(processed, do_sample))
    width = path.numel()
    index = torch.arange(width, device=device)
    count = (path >= 0).sum()
    nodes = path.clamp(min=0)
    # token i of the round: the draft token of path node i + 1, or the bonus at i = count - 1 (later ones: padding)
    round_tokens = torch.where(index == count - 1, bonus, torch.cat([tokens[nodes[1:]], bonus[None]]))
    lookup = (from_lookup[nodes] & (path >= 0)).sum() if from_lookup is not None else count.new_zeros(())
    for cached in cache.layers:  # the path's entries move to [past, past + count); the rest is dropped
        source, slots = past + nodes, past + index  # slots past the path get junk that the next round overwrites
        cached.keys.index_copy_(2, slots, cached.keys.index_select(2, source))
        cached.values.index_copy_(2, slots, cached.values.index_select(2, source))
        cached.cumulative_length.copy_(past + count)
    packet = torch.cat([path, round_tokens, lookup[None]])
    return packet, round_tokens, processed[nodes], raw[nodes], features[nodes]


def compiled_verify_round(compile_config):
    """`verify_round` compiled whole (`drafter.compiled_whole`)."""
    return compiled_whole(verify_round, compile_config)


def verify_fixed_round(round_fn, target, cache, cache_arg: str, tree: DraftTree, padding, processors, do_sample,
                       feature_layers=(), verdicts=None, lookup: bool = False, levels: int | None = None) -> VerifiedRound:
    """One round through `round_fn` (`verify_round` or its compiled form) and the round's one host read: the packet,
    with the stopping verdicts (`verdicts`, as in `verify_tree`) computed on the device from the padded round's
    tokens. `lookup`: the call drafts with lookup chains, so a tree without lookup nodes is given an all-False
    `from_lookup` (one graph for both). `levels`: the deepest any of the call's trees can be (its path width less
    one), so that every round's path has one width; the tree's own by default."""
    levels = tree.levels if levels is None else levels
    if tree.levels > levels:
        raise ValueError(f"A tree of {tree.levels} levels cannot be verified at a path width of {levels + 1}.")
    from_lookup = tree.from_lookup
    if from_lookup is None and lookup:
        from_lookup = torch.zeros_like(tree.tokens, dtype=torch.bool)
    real = tree.real if tree.real is not None else torch.ones_like(tree.tokens, dtype=torch.bool)
    with TargetFeatures(target, feature_layers) as hidden:
        packet, round_tokens, processed, raw, features = round_fn(
            target, cache, cache_arg, hidden, tree.tokens, tree.parents, tree.depths, tree.ancestors, real,
            from_lookup, levels, padding, target.dtype, processors, do_sample,
        )
    width = levels + 1
    fetch = [packet] if verdicts is None else [packet, verdicts(round_tokens, processed).long()]
    host = torch.cat(fetch).tolist()  # the round's one device-to-host copy
    m = sum(node >= 0 for node in host[:width])
    stops = None if verdicts is None else [bool(v) for v in host[2 * width + 1 : 2 * width + 1 + m]]
    lookup_accepted = host[2 * width] if tree.from_lookup is not None else None
    # A compiled call with CUDA graphs hands out the same buffers every round: the features are cloned (the draft
    # may read them rounds later); the logits are used up in the round, or cloned where kept (`jakiro_decode.emit`).
    return VerifiedRound(
        packet[:m], round_tokens[m - 1], round_tokens[:m], host[width : width + m], processed[:m], raw[:m],
        features[:m].clone(), lookup_accepted, stops,
    )


__all__ = ["compiled_verify_round", "verify_fixed_round", "verify_round"]
