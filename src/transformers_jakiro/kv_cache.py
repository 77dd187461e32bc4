"""Cache surgery: checks that a transformers cache can follow a tree, and compacts it to the accepted path.

After a verification forward the target's cache holds the prefix plus every tree node. Only the nodes on the
accepted path stay; they are moved down to sit right after the prefix, and the rest is cut off. This works for
full-attention `DynamicLayer`s (keys/values shaped [batch, heads, seq, head_dim]); sliding-window, static,
quantized or linear-attention layers cannot be edited along the sequence and are refused up front.
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


def new_target_cache(config) -> DynamicCache:
    """A fresh DynamicCache laid out for `config`, refused with a clear error if any layer is not full attention."""
    cache = DynamicCache(config=config)
    check_cache_supported(cache, what=f"The target ({config.model_type})")
    return cache


def check_cache_supported(cache, what: str = "This cache") -> None:
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"{what} uses a {type(cache).__name__}; Jakiro tree decoding needs a DynamicCache with full-attention "
            "layers. Pass no cache (or cache_implementation='dynamic') to generate."
        )
    bad = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if bad:
        raise ValueError(
            f"{what} has cache layers of type {', '.join(bad)} (sliding-window, hybrid or linear-attention). "
            "Jakiro tree decoding supports only full-attention layers, whose cache can be compacted to the accepted "
            "path; use a model (or config) without sliding windows."
        )


def keep_accepted(cache: DynamicCache, prefix_length: int, path: torch.LongTensor) -> None:
    """Keep cache positions [0, prefix_length) plus `prefix_length + path` (tree nodes), in place."""
    new_length = prefix_length + path.numel()
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        index = (path + prefix_length).to(layer.keys.device)
        layer.keys[..., prefix_length:new_length, :] = layer.keys.index_select(-2, index)
        layer.values[..., prefix_length:new_length, :] = layer.values.index_select(-2, index)
        layer.keys = layer.keys[..., :new_length, :]
        layer.values = layer.values[..., :new_length, :]


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every cached position from `length` on."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


__all__ = ["check_cache_supported", "keep_accepted", "new_target_cache", "truncate"]
