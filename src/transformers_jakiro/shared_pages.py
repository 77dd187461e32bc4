"""Prefix sharing with the draft in continuous batching: the target's features at the positions of prompt pages that
transformers' prefix sharing (`allow_block_sharing`) hands to later prompts, and the draft's cache entries there.

transformers hashes a request's complete pages (`mark_complete_blocks`) and lets a later prompt that starts with the
same pages skip their prefill. The later request's draft row still needs the target's features at those positions,
which its own prefill then never computes: they are kept here by page hash when the first prompt's prefill ends.
Only prompt pages are hashed (transformers' walk is given the prompt's tokens, not the generated ones): the pages a
round writes hold tree nodes until the round is verified, so generated text is never shared.

The draft's entries are kept too, once a prompt's first read has computed them (`BatchDrafter.first_reads`), so that a
later prompt's draft row reads only what follows them (`BatchDrafter.preload`). The draft's entry at position j depends
on the target's features there and on token j + 1, so page i (tokens [i*size, (i+1)*size)) keeps the entries of
positions [i*size - 1, (i+1)*size - 1), which its hash (a hash of the whole prefix up to its end) determines; the
first n pages in a row give positions [0, n*size - 1).
"""

import logging

import torch

logger = logging.getLogger(__name__)


class SharedPageFeatures:
    """Features of shared prompt pages, by page hash (one `[tokens_per_page, width]` tensor each), and the draft's
    entries there (`draft_by_hash`: per layer keys and values [heads, positions, head_dim]), pruned to the pages
    transformers' ledger still holds."""

    def __init__(self) -> None:
        self.by_hash: dict[int, torch.Tensor] = {}
        self.draft_by_hash: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.unread: dict[str, list[int]] = {}  # per request whose prompt the draft has not read: its pages' hashes

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
        hashed = sum(len(allocator.ledger.hash_to_block) for allocator in cache.cache_allocators.values())
        if max(len(self.by_hash), len(self.draft_by_hash)) > 2 * hashed + 64:
            self.prune(cache)

    def prompt_pages(self, cache, state) -> list[int]:
        """The hashes of the request's complete prompt pages, in order, as `share` registered them (up to the first
        page without one)."""
        allocator = next(iter(cache.cache_allocators.values()))
        hashes = []
        for page in allocator.block_table[state.request_id][: len(state.initial_tokens) // allocator.tokens_per_page]:
            page_hash = allocator.ledger.block_to_hash.get(page)
            if page_hash is None:
                break
            hashes.append(page_hash)
        return hashes

    def draft_prefix(self, pages: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The draft's entries at a prompt's first positions, [0, n*size - 1) for the first n of its `pages` (hashes,
        `prompt_pages`) whose entries are kept (`BatchDrafter.preload` takes them); None when its first page's are
        not."""
        kept = []
        for page_hash in pages:
            entries = self.draft_by_hash.get(page_hash)
            if entries is None:
                break
            kept.append(entries)
        if not kept:
            return None
        # per layer, the pages' keys joined and their values joined
        return [tuple(torch.cat(part, dim=-2) for part in zip(*layer)) for layer in zip(*kept)]

    def preload_draft(self, cache, state, drafter, row: int) -> int:
        """A joining request's draft row (`row` of `drafter`, just added): the draft's entries kept for its prompt's
        first pages preloaded (`BatchDrafter.preload`), and its prompt pages remembered, to keep what the draft's read
        of its prompt adds (`keep_draft_reads`). Returns the positions preloaded: queue the prompt from there on."""
        if not cache.use_prefix_sharing:
            return 0
        pages = self.prompt_pages(cache, state)
        entries = self.draft_prefix(pages)
        if entries is not None:
            drafter.preload(row, entries)
        self.unread[state.request_id] = pages
        return 0 if entries is None else entries[0][0].shape[-2]

    def keep_draft_reads(self, cache, drafter, requests: list[str]) -> None:
        """After a draft read: the entries of the prompts it read (`BatchDrafter.first_reads`, by row; `requests`:
        the drafter's rows' request ids) kept by prompt page."""
        for row, entries in drafter.first_reads.items():
            pages = self.unread.pop(requests[row], None)
            if pages:
                self.share_draft(cache, pages, entries)
        drafter.first_reads = {}

    def share_draft(self, cache, pages: list[int], entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a prompt's first read by the draft: its entries (per layer, positions from 0) kept for each of its
        prompt `pages` (hashes, in order) that has none kept yet."""
        size = next(iter(cache.cache_allocators.values())).tokens_per_page
        read = entries[0][0].shape[-2]
        for i, page_hash in enumerate(pages):
            start, end = max(i * size - 1, 0), (i + 1) * size - 1
            if end > read:
                break
            if page_hash not in self.draft_by_hash:
                self.draft_by_hash[page_hash] = [(k[:, start:end].clone(), v[:, start:end].clone()) for k, v in entries]

    def prune(self, cache) -> None:
        """Forget what is kept of pages that transformers' ledger no longer holds (evicted, or freed unshared)."""
        hashed = {h for allocator in cache.cache_allocators.values() for h in allocator.ledger.hash_to_block}
        self.by_hash = {h: f for h, f in self.by_hash.items() if h in hashed}
        self.draft_by_hash = {h: e for h, e in self.draft_by_hash.items() if h in hashed}


__all__ = ["SharedPageFeatures"]
