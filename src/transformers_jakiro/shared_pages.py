"""Prefix sharing with the draft in continuous batching: the target's features at the positions of prompt pages that
transformers' prefix sharing (`allow_block_sharing`) hands to later prompts.

transformers hashes a request's complete pages (`mark_complete_blocks`) and lets a later prompt that starts with the
same pages skip their prefill. The later request's draft row still needs the target's features at those positions,
which its own prefill then never computes: they are kept here by page hash when the first prompt's prefill ends.
Only prompt pages are hashed (transformers' walk is given the prompt's tokens, not the generated ones): the pages a
round writes hold tree nodes until the round is verified, so generated text is never shared.
"""

import logging

import torch

logger = logging.getLogger(__name__)


class SharedPageFeatures:
    """Features of shared prompt pages, by page hash (one `[tokens_per_page, width]` tensor each), pruned to the pages
    transformers' ledger still holds."""

    def __init__(self) -> None:
        self.by_hash: dict[int, torch.Tensor] = {}

    def prompt_features(self, cache, state, chunks: list[torch.Tensor]) -> torch.Tensor | None:
        """The target's features at every prompt position: those kept for the pages the request shares with an
        earlier prompt (transformers skipped their prefill), then its prefill's own `chunks`. None when a shared
        page's features are gone (the request then decodes without the draft: exact)."""
        features = torch.cat(chunks)
        shared = len(state.initial_tokens) - features.shape[0]
        if shared <= 0:
            return features
        allocator = next(iter(cache.cache_allocators.values()))
        pages = allocator.block_table[state.request_id][: shared // allocator.tokens_per_page]
        kept = [self.by_hash.get(allocator.ledger.block_to_hash.get(page)) for page in pages]
        if shared % allocator.tokens_per_page or any(page is None for page in kept):
            logger.warning("jakiro request %s: the features of its %d shared prompt tokens are gone; it decodes "
                           "without the draft", state.request_id, shared)
            return None
        return torch.cat([*kept, features])

    def share(self, cache, state, features: torch.Tensor | None) -> None:
        """When a prefill ends: the prompt's complete pages hashed for prefix sharing (transformers' own
        `mark_complete_blocks`, given the prompt's tokens only) and each new page's features kept by its hash."""
        if not cache.use_prefix_sharing:
            return
        prompt = list(state.initial_tokens)
        for allocator in cache.cache_allocators.values():
            size = allocator.tokens_per_page
            allocator.mark_complete_blocks(state.request_id, prompt, len(prompt) // size)
            for i, page in enumerate(allocator.block_table[state.request_id][: len(prompt) // size]):
                page_hash = allocator.ledger.block_to_hash.get(page)
                if features is not None and page_hash is not None and page_hash not in self.by_hash:
                    self.by_hash[page_hash] = features[i * size : (i + 1) * size].clone()
        if len(self.by_hash) > 2 * sum(len(a.ledger.hash_to_block) for a in cache.cache_allocators.values()) + 64:
            self.prune(cache)

    def prune(self, cache) -> None:
        """Forget the features of pages that transformers' ledger no longer holds (evicted, or freed unshared)."""
        hashed = {h for allocator in cache.cache_allocators.values() for h in allocator.ledger.hash_to_block}
        self.by_hash = {h: f for h, f in self.by_hash.items() if h in hashed}


__all__ = ["SharedPageFeatures"]
