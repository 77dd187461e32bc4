"""Cache surgery: checks that a transformers cache can follow a tree, and compacts it to the accepted path.

After a verification forward the target's cache holds the prefix plus every tree node. Only the nodes on the
accepted path stay; they are moved down to sit right after the prefix, and the rest is dropped. Two layouts work:

  * `DynamicCache` with full-attention `DynamicLayer`s: the tensors grow by the tree and are sliced back.
  * `StaticCache` (what `generate` builds for `cache_implementation="static"`) with full-attention `StaticLayer`s:
    preallocated [batch, heads, max_cache_len, head_dim] tensors at fixed addresses, written at the layer's
    `cumulative_length` (a device tensor). Compaction is one `index_copy_` per keys/values tensor and a reset of
    `cumulative_length`; the tree's other entries stay where they are, hidden by the next round's mask and
    overwritten by its writes. Nothing is reallocated, so a compiled forward sees the same tensors every round.

Sliding-window, quantized or linear-attention layers cannot be edited along the sequence and are refused up front.
"""

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer


def new_target_cache(config, static_length: int | None = None) -> DynamicCache | StaticCache:
    """A fresh cache laid out for `config`: a DynamicCache, or with `static_length` a StaticCache of that many
    positions; refused with a clear error if any layer is not full attention."""
    if static_length is None:
        cache = DynamicCache(config=config)
    else:
        cache = StaticCache(config=config, max_cache_len=static_length)
    check_cache_supported(cache, what=f"The target ({config.model_type})")
    return cache


def new_draft_cache(static_length: int) -> Cache:
    """A static cache for the one-layer Jakiro draft: transformers' `StaticLayer` in a plain `Cache` (StaticCache
    reads its layer layout from a decoder config, which the draft's config is not)."""
    return Cache(layers=[StaticLayer(max_cache_len=static_length)])


def is_static(cache) -> bool:
    """A StaticCache, or any cache made of full-attention static layers (the draft's)."""
    if isinstance(cache, StaticCache):
        return True
    return isinstance(cache, Cache) and len(cache.layers) > 0 and all(type(l) is StaticLayer for l in cache.layers)


def check_cache_supported(cache, what: str = "This cache") -> None:
    if isinstance(cache, StaticCache):
        expected, kind = StaticLayer, "static"
    elif isinstance(cache, DynamicCache):
        expected, kind = DynamicLayer, "dynamic"
    else:
        raise ValueError(
            f"{what} uses a {type(cache).__name__}; Jakiro tree decoding needs a DynamicCache or a StaticCache with "
            "full-attention layers. Pass no cache, or cache_implementation='dynamic' or 'static', to generate."
        )
    # Exact types: the sliding-window variants subclass these and cannot hold a tree's positions.
    bad = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not expected})
    if bad:
        raise ValueError(
            f"{what} has {kind} cache layers of type {', '.join(bad)} (sliding-window, hybrid or linear-attention). "
            "Jakiro tree decoding supports only full-attention layers, whose cache can be compacted to the accepted "
            "path; use a model (or config) without sliding windows."
        )


def static_length(cache: StaticCache) -> int:
    """The number of positions a StaticCache preallocates (the width of every attention mask over it)."""
    return cache.layers[0].max_cache_len


def keep_accepted(cache, prefix_length: int, path: torch.LongTensor) -> None:
    """Keep cache positions [0, prefix_length) plus `prefix_length + path` (tree nodes), in place."""
    new_length = prefix_length + path.numel()
    if is_static(cache):
        for layer in cache.layers:
            index = (path + prefix_length).to(layer.keys.device)
            target = torch.arange(prefix_length, new_length, device=layer.keys.device)
            # index_select copies first, so sources that the copy overwrites (path[j] >= j) are read intact.
            layer.keys.index_copy_(2, target, layer.keys.index_select(2, index))
            layer.values.index_copy_(2, target, layer.values.index_select(2, index))
        _set_static_length(cache, new_length)
        return
    root_only = path.numel() == 1  # a path starts at the root (node 0), already at prefix_length: nothing to move
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if not root_only:
            index = (path + prefix_length).to(layer.keys.device)
            layer.keys[..., prefix_length:new_length, :] = layer.keys.index_select(-2, index)
            layer.values[..., prefix_length:new_length, :] = layer.values.index_select(-2, index)
        layer.keys = layer.keys[..., :new_length, :]
        layer.values = layer.values[..., :new_length, :]


def _dynamic_layers(cache):
    """The layers of a DynamicCache that hold [rows, heads, positions, width] tensors, empty ones included (a model may
    leave some uninitialised: no tensor, or a 1-D placeholder)."""
    return [
        layer for layer in cache.layers
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.dim() == 4
    ]


def keep_accepted_rows(cache, prefix_length: int, nodes: torch.LongTensor) -> None:
    """A batch's `keep_accepted`: row r keeps positions [0, prefix_length) plus `prefix_length + nodes[r]` ([rows,
    m]; every row keeps m entries, a row's unused ones being holes that the caller masks), in place. A StaticCache
    keeps its tensors (the rest is overwritten by later writes) and its length becomes prefix_length + m."""
    static = is_static(cache)
    end = prefix_length + nodes.shape[1]
    for layer in cache.layers if static else _dynamic_layers(cache):
        rows, heads, _, width = layer.keys.shape
        index = nodes.to(layer.keys.device)[:, None, :, None].expand(rows, heads, -1, width)
        # gather copies first, so sources that the write overwrites (nodes[r, j] >= j) are read intact; the prefix is
        # not copied (a view of the first prefix_length + m positions is kept, as `keep_accepted` does).
        layer.keys[:, :, prefix_length:end] = layer.keys[:, :, prefix_length:].gather(2, index)
        layer.values[:, :, prefix_length:end] = layer.values[:, :, prefix_length:].gather(2, index)
        if not static:
            layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
    if static:
        _set_static_length(cache, end)


def pack_present(cache, key_mask: torch.BoolTensor) -> torch.BoolTensor:
    """A StaticCache shared by a batch whose rows left holes: move each row's present entries (`key_mask` [rows,
    cached]) to the front, in order, and cut the cache to the longest row; returns the new key mask. Keys carry
    their positions already (RoPE), so moving them changes nothing a query computes. One host read: that length."""
    counts = key_mask.sum(1)
    longest = int(counts.max())
    order = torch.argsort((~key_mask).to(torch.uint8), dim=1, stable=True)[:, :longest]  # present entries first
    for layer in cache.layers:
        rows, heads, _, width = layer.keys.shape
        index = order.to(layer.keys.device)[:, None, :, None].expand(rows, heads, -1, width)
        layer.keys[:, :, :longest] = layer.keys.gather(2, index)
        layer.values[:, :, :longest] = layer.values.gather(2, index)
    _set_static_length(cache, longest)
    return torch.arange(longest, device=key_mask.device)[None, :] < counts[:, None]


def select_rows(cache, rows: torch.LongTensor) -> None:
    """Keep these batch rows of a DynamicCache, in this order (the others finished)."""
    for layer in _dynamic_layers(cache):
        index = rows.to(layer.keys.device)
        layer.keys, layer.values = layer.keys[index], layer.values[index]


def append_empty_rows(cache, count: int) -> None:
    """`count` new batch rows at the end of a DynamicCache, all of their entries zeros (holes the caller masks): rows
    that join a batch whose cache already holds other rows' entries."""
    for layer in _dynamic_layers(cache):
        layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, *layer.keys.shape[1:])])
        layer.values = torch.cat([layer.values, layer.values.new_zeros(count, *layer.values.shape[1:])])


def append_columns(cache, new, rows: torch.LongTensor, batch: int) -> None:
    """Append the entries of DynamicCache `new` (written by a forward over only `rows` of a batch of `batch` rows,
    from an empty cache) to `cache` as new positions of every row: `rows` get theirs, the others holes (zeros). A
    `cache` that holds nothing yet (no layer written) gets them as its first entries."""
    layers = _dynamic_layers(cache)
    for i, written in enumerate(_dynamic_layers(new)):
        index = rows.to(written.keys.device)
        keys = written.keys.new_zeros(batch, *written.keys.shape[1:]).index_copy(0, index, written.keys)
        values = written.values.new_zeros(batch, *written.values.shape[1:]).index_copy(0, index, written.values)
        if not layers:
            cache.update(keys, values, i)
            continue
        layer = layers[i]
        layer.keys, layer.values = torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


def select_positions(cache, positions: torch.LongTensor) -> None:
    """Keep these cache positions of a DynamicCache, in this order (the others are holes in every row)."""
    for layer in _dynamic_layers(cache):
        index = positions.to(layer.keys.device)
        layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]


def drop_hole_columns(cache, key_mask: torch.BoolTensor) -> torch.BoolTensor:
    """Remove the cache positions that are holes in every row of a batch (`key_mask` [rows, cached]: present
    entries), as left after the rows that needed them finished; returns the key mask of what is kept. One host read:
    which columns stay."""
    columns = torch.nonzero(key_mask.any(dim=0)).flatten()
    if columns.numel() == key_mask.shape[1]:
        return key_mask
    select_positions(cache, columns)
    return key_mask[:, columns]


def _set_static_length(cache: StaticCache, length: int) -> None:
    # In place: `cumulative_length` has a static address that a compiled forward reads (and advances) every round.
    # StaticLayer.crop does the same, but 5.17 has no crop on static layers.
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def truncate(cache, length: int) -> None:
    """Drop every cached position from `length` on (a StaticCache keeps its tensors; later writes overwrite them)."""
    if is_static(cache):
        if cache.layers[0].is_initialized:
            _set_static_length(cache, length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


__all__ = [
    "check_cache_supported",
    "drop_hole_columns",
    "is_static",
    "keep_accepted",
    "keep_accepted_rows",
    "new_draft_cache",
    "new_target_cache",
    "pack_present",
    "select_positions",
    "select_rows",
    "static_length",
    "truncate",
]
