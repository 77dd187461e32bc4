"""Position-dependent RoPE: which multi-token forwards compute the same keys as plain generate's one-token steps.

transformers' `dynamic_rope_update` makes two RoPE types choose their frequencies per forward, from the largest
position in it (`seq_len = max(position_ids) + 1`):

  * `longrope` (Phi-3/3.5 128k, Phi-4-mini, ...): the long factors when `seq_len > original_max_position_embeddings`,
    the short ones otherwise. Plain generate's step at position p uses the long set exactly when p >= that boundary.
  * `dynamic` (NTK scaling): past `max_position_embeddings`, frequencies recomputed for every new `seq_len` (and the
    rotary module remembers the largest `seq_len` it has seen). Plain generate's step at p uses the frequencies of
    `seq_len = p + 1`, so no forward of two or more tokens past the boundary can match it.

A tree forward spans positions root .. root + depth: every node gets the frequencies of its deepest position. So a
round is exact when all of its positions lie on one side of a longrope boundary, and, for dynamic NTK, below the
boundary; any other round is a plain one-token step (what plain generate runs there). Other RoPE types (default,
linear, yarn, llama3, proportional) are fixed per model and need nothing.

Some targets' own generate goes further: Phi-3 (and PhiMoE) `prepare_inputs_for_generation` drops the cache at the
step whose input reaches `original_max_position_embeddings + 1` tokens and recomputes the whole sequence in one
forward, so every earlier key is recomputed with the long factors. That step is found by asking the target's own
`prepare_inputs_for_generation` (`probe_recomputation`), and the decoding loop runs the same recomputation there.
"""

from dataclasses import dataclass

import torch

_DYNAMIC = "dynamic"
_LONGROPE = "longrope"


@dataclass(frozen=True)
class RopeBoundary:
    """One position-dependent RoPE of the target: `kind` ("longrope" or "dynamic") and `at`, the first position whose
    one-token step plain generate computes with the scaled frequencies."""

    kind: str
    at: int

    def allows(self, first: int, last: int) -> bool:
        """Whether a forward over positions `first` .. `last` computes every position's keys as a one-token step there
        would: longrope, all positions on one side of the boundary; dynamic, all positions below it."""
        if self.kind == _LONGROPE:
            return last < self.at or first >= self.at
        return last < self.at


@dataclass(frozen=True)
class RopeLimits:
    """What makes a target's forwards depend on where they stand: its position-dependent RoPE boundaries (one per layer
    type for models with several), and `recompute_at`, the sequence index (left padding included) of the token whose
    step the target's own generate runs as a recomputation of the whole sequence (None: it never does)."""

    boundaries: tuple[RopeBoundary, ...] = ()
    recompute_at: int | None = None
    recomputes_whole: bool = True  # False: the target's generate drops its cache there and goes on without context

    def refuse_unfollowable(self, max_length: int, static: bool) -> None:
        """Refuse, before any work, a call that would reach a step of the target's own generate that tree decoding
        cannot reproduce exactly."""
        if self.recompute_at is None or max_length <= self.recompute_at + 1:
            return
        length = self.recompute_at + 1
        if not self.recomputes_whole:
            raise ValueError(
                f"This target's own generate drops its cache at sequence length {length} (Phi-3 crossing "
                f"original_max_position_embeddings in this transformers release) and from there decodes each token "
                "without context; Jakiro decoding will not reproduce that. Upgrade transformers (newer releases "
                f"recompute the cache there), or keep max_length at or below {length}."
            )
        if static:
            raise ValueError(
                f"This target's own generate recomputes its whole cache at sequence length {length} (Phi-3 crossing "
                "its longrope boundary), which a static cache cannot follow exactly. Use the dynamic cache, or keep "
                f"max_length at or below {length}."
            )

    def allows(self, first: int, last: int, padding: int = 0) -> bool:
        """Whether one forward may hold the tokens at sequence indices `first` .. `last` (`padding`: the row's left
        padding, which positions do not count): it stands on one side of every RoPE boundary and does not hold the
        token whose step is a recomputation."""
        if self.recompute_at is not None and first <= self.recompute_at <= last:
            return False
        return all(boundary.allows(first - padding, last - padding) for boundary in self.boundaries)

    def describe(self) -> str:
        parts = [f"rope_type='{b.kind}' (boundary at position {b.at})" for b in self.boundaries]
        if self.recompute_at is not None:
            parts.append(f"its generate recomputes the whole cache at sequence length {self.recompute_at + 1}")
        return ", ".join(parts)


def _rope_parameter_sets(config) -> list[dict]:
    """The RoPE parameter dicts of a config: `rope_parameters` (transformers 5), one dict or one per layer type;
    `rope_scaling` for configs that still carry the older name."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [value for value in params.values() if isinstance(value, dict)]


def probe_recomputation(target) -> tuple[int | None, bool]:
    """(index, whole): the sequence index whose step the target's own generate runs without its cache, or None; and
    whether that step recomputes the whole sequence (False: it feeds the one new token with no cache, decoding from
    there without context, as Phi-3's generate in transformers 5.17 does).

    Asked of the target's `prepare_inputs_for_generation` itself (remote-code Phi-3 copies included), called as
    `generate` calls it for the step whose input reaches `original_max_position_embeddings + 1` tokens: a cache holding
    the positions before it (one layer of one-element entries stands in) and `next_sequence_length=1`. Targets
    without that config field are not asked."""
    from transformers import DynamicCache

    from .target_inputs import cache_kwarg

    at = getattr(target.config, "original_max_position_embeddings", None)
    if not isinstance(at, int) or at <= 0 or not hasattr(target, "prepare_inputs_for_generation"):
        return None, True
    device = target.get_input_embeddings().weight.device
    ids = torch.zeros(1, at + 1, dtype=torch.long, device=device)
    cache = DynamicCache(config=target.config.get_text_config(decoder=True))
    cache.update(torch.zeros(1, 1, at, 1, device=device), torch.zeros(1, 1, at, 1, device=device), 0)
    name = cache_kwarg(target)
    try:
        inputs = target.prepare_inputs_for_generation(
            ids, attention_mask=torch.ones_like(ids), use_cache=True, next_sequence_length=1, **{name: cache}
        )
    except Exception:  # a remote-code signature we cannot drive: treat as the usual, cache-keeping generate
        return None, True
    if inputs.get(name, inputs.get("past_key_values")) is not None:
        return None, True
    fed = inputs.get("input_ids")
    return at, fed is not None and fed.shape[-1] == at + 1


def rope_limits(target) -> RopeLimits | None:
    """The target's position-dependent limits (see `RopeLimits`), or None when its forwards do not depend on where
    they stand."""
    config = target.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    boundaries = []
    for params in _rope_parameter_sets(text):
        kind = str(params.get("rope_type", params.get("type", "default")))
        if _DYNAMIC in kind:  # transformers matches any rope_type containing "dynamic"
            # The rotary modules compare against `config.max_position_embeddings` (`original_max_seq_len`).
            boundaries.append(RopeBoundary(_DYNAMIC, int(text.max_position_embeddings)))
        elif kind == _LONGROPE:
            at = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
            boundaries.append(RopeBoundary(_LONGROPE, int(at or text.max_position_embeddings)))
    recompute_at, whole = probe_recomputation(target)
    if not boundaries and recompute_at is None:
        return None
    return RopeLimits(tuple(boundaries), recompute_at, whole)


def deepest_level(choice, settings) -> int:
    """An upper bound on the depth of any node a round of `choice` (None: the configured tree) verifies, known before
    drafting: a tree's levels (its contrastive level included), lookup chains grafted below the root, and the
    dummy children (depth 1) that fixed shapes pad with."""
    kind = "tree" if choice is None else choice.kind
    lookup = int(settings.lookup_tokens)
    if kind == "plain":
        return 0
    if kind == "lookup":
        return max(lookup, 1)
    depth = int(settings.depth if choice is None else choice.depth)
    return max(depth + 1, lookup, 1)


def refuse_batch_across(limits: RopeLimits | None, max_length: int, paddings: list[int]) -> None:
    """Batches (B > 1) under a position-dependent RoPE: plain batched generate picks one set of frequencies per forward
    from the largest position of any row, finished rows included (they go on with pad tokens), so a row's keys depend
    on where the other rows stand, and a recomputing target recomputes every row at one padded length. Tree decoding
    drops finished rows and advances rows unevenly, so it matches plain batched generate only while no forward of
    plain generate reaches a limit."""
    if limits is None:
        return
    # The largest index any forward of plain batched generate holds (its last step feeds index max_length - 2), and
    # the largest position (left padding not counted).
    last = max_length - 2
    if not limits.allows(0, last, min(paddings)):
        raise ValueError(
            f"Jakiro decoding of a batch (B > 1) cannot cross the target's position-dependent RoPE boundary "
            f"({limits.describe()}): plain batched generate switches frequencies for all rows at once, by the "
            f"longest row, and its output depends on the batch. This batch could reach sequence index {last}. "
            "Decode these prompts one at a time (a batch of one crosses the boundary exactly), or lower "
            "max_new_tokens so that no row reaches the boundary."
        )


__all__ = ["RopeBoundary", "RopeLimits", "deepest_level", "probe_recomputation", "refuse_batch_across", "rope_limits"]
