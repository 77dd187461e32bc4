"""KV entries moved inside transformers' paged cache (continuous batching), every layer at once.

A page allocator of transformers 5.25 (`cache_allocators`) keeps each layer's keys and values as views
(`_kv_token_views`: one row per token slot) into one tensor, each view starting further into it. A slot `s` of the
view that starts `r` rows in is row `r + s` of the view that starts first; so a request's accepted path moves in one
`index_select` and one `index_copy_` over that view for all layers, instead of two of each per layer and per keys and
values (on a GPU each is a kernel launch: 128 per request and round for a 32-layer model). Views laid out otherwise
move layer by layer.
"""

import torch


def layer_rows(allocator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the view that starts first, the row where each layer's keys and values start in it), or None where the views
    are not row slices of one tensor. Cached on the allocator (its views never change)."""
    cached = getattr(allocator, "_jakiro_layer_rows", False)
    if cached is not False:
        return cached
    views = [view for pair in allocator._kv_token_views.values() for view in pair]
    first = min(views, key=lambda view: view.storage_offset())
    row = first.stride(0)
    same_tensor = all(
        view.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and view.dtype == first.dtype
        and view.stride() == first.stride() and view.shape[1:] == first.shape[1:]
        and (view.storage_offset() - first.storage_offset()) % row == 0
        and (view.storage_offset() - first.storage_offset()) // row + view.shape[0] <= first.shape[0]
        for view in views)
    starts = [(view.storage_offset() - first.storage_offset()) // row for view in views]
    cached = (first, torch.tensor(starts, device=first.device)) if same_tensor else None
    allocator._jakiro_layer_rows = cached
    return cached


def move_slots(allocator, source: list[int], target: list[int]) -> None:
    """The KV entries at slots `source` copied to slots `target`, in every layer (sources read before any write)."""
    moves = [(s, t) for s, t in zip(source, target) if s != t]
    if not moves:
        return
    one_tensor = layer_rows(allocator)
    if one_tensor is not None:
        flat, starts = one_tensor
        index = torch.tensor(moves, device=flat.device).T  # [2, moves]: sources, targets
        flat_index = (starts[:, None, None] + index[None]).transpose(0, 1).reshape(2, -1)  # [2, views x moves]
        flat.index_copy_(0, flat_index[1], flat.index_select(0, flat_index[0]))
        return
    for keys, values in allocator._kv_token_views.values():
        index = torch.tensor(moves, device=keys.device).T
        for view in (keys, values):
            view.index_copy_(0, index[1], view.index_select(0, index[0]))


__all__ = ["layer_rows", "move_slots"]
