"""Drafting: the tree settings and the candidate generator that expands one Jakiro token tree per round.

The draft (its KV cache kept across rounds) reads the newly accepted tokens with their target hidden states and
expands a token tree EAGLE-2 style, the last level from the contrastive (two-ahead) head. The decoding loop that
verifies the tree lives in `decoding/loop.py`.
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .round_controller import RoundChoice
from .kv_cache import new_draft_cache, truncate
from .lookup import NgramIndex, continues
from ..modeling_jakiro import JakiroDraftModel
from .tree import DraftTree, TreeRecorder, flattened_tensors, graft_chain_slots, graft_chains, tree_columns


@dataclass
class TreeSettings:
    """total_tokens: draft nodes verified per round (root excluded). depth: draft forwards per round.
    top_k: children per node and nodes expanded per level. contrastive: build the last level from the
    contrastive (two-ahead) head, giving depth + 1 levels for depth forwards; False is the EAGLE-2-style ablation.
    lookup_tokens: length of the n-gram lookup chains grafted onto the tree (0: off; they come on top of
    total_tokens). lookup_max_ngram: longest suffix n-gram matched. lookup_chains: distinct chains per round.
    fixed_shape: pad every round's tree to `max_nodes` with never-accepted dummy nodes, so that every verification
    forward has one shape (one compiled graph serves them all); None: on exactly when the target's cache is static.
    adaptive: let `round_controller.RoundController` choose every round between a plain step, lookup alone, a smaller tree
    and this tree, by measured tokens per second; False pins this tree for every round."""

    total_tokens: int
    depth: int
    top_k: int
    contrastive: bool
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_chains: int = 1
    fixed_shape: bool | None = None
    adaptive: bool = True

    @property
    def max_levels(self) -> int:
        """The deepest any round's tree can be: its levels (the contrastive one included) or its longest lookup
        chain. A round accepts at most this many nodes below the root, plus the bonus token."""
        return max(int(self.depth) + int(self.contrastive), int(self.lookup_tokens), 1)

    @property
    def max_nodes(self) -> int:
        """The most nodes a round's tree can have: the root, `total_tokens` draft nodes and the lookup chains."""
        return int(self.total_tokens) + 1 + int(self.lookup_tokens) * int(self.lookup_chains)

    @classmethod
    def resolve(cls, draft: JakiroDraftModel, generation_config=None, **overrides) -> "TreeSettings":
        """The settings for one call, each taken from the first of: `overrides` (keyword arguments of the
        custom_generate entry point), `generation_config` (`prompt_lookup_num_tokens` asks for lookup chains of that
        many tokens, 0 turns lookup off; `max_matching_ngram_size` the longest n-gram matched), `tree_settings(draft,
        ...)`, the draft's config. Both entry points resolve their settings here, so they take the same ones."""
        overrides = {**lookup_from_generation_config(generation_config), **{
            k: v for k, v in overrides.items() if v is not None
        }}
        config = draft.config
        values = dict(
            total_tokens=config.total_tokens, depth=config.depth, top_k=config.top_k, contrastive=config.contrastive_head
        )
        # Heads saved before n-gram lookup existed have no lookup fields: lookup off.
        for name in ("lookup_tokens", "lookup_max_ngram", "lookup_chains", "adaptive"):
            values[name] = getattr(config, name, getattr(cls, name))
        values.update(getattr(draft, "_tree_overrides", None) or {})
        values.update(overrides)
        settings = cls(**values)
        for name in ("total_tokens", "depth", "top_k", "lookup_max_ngram", "lookup_chains"):
            if int(getattr(settings, name)) < 1:
                raise ValueError(f"Jakiro tree setting {name} must be >= 1, got {getattr(settings, name)}.")
        if int(settings.lookup_tokens) < 0:
            raise ValueError(f"Jakiro tree setting lookup_tokens must be >= 0 (0: off), got {settings.lookup_tokens}.")
        if settings.contrastive and not config.contrastive_head:
            raise ValueError("contrastive=True needs a draft with a contrastive head (config.contrastive_head).")
        return settings


def lookup_from_generation_config(generation_config) -> dict:
    """The n-gram lookup settings a `GenerationConfig` asks for: `generate(..., prompt_lookup_num_tokens=k)` beside a
    Jakiro draft runs the lookup inside the tree with chains of k tokens, matching suffixes of up to
    `max_matching_ngram_size` tokens. Unset fields ask for nothing."""
    overrides = {}
    if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None:
        overrides["lookup_tokens"] = int(generation_config.prompt_lookup_num_tokens)
    if getattr(generation_config, "max_matching_ngram_size", None) is not None:
        overrides["lookup_max_ngram"] = int(generation_config.max_matching_ngram_size)
    return overrides


def expand_tree(root, left, right, log_probs, tokens, level, top, depth: int, k: int) -> TreeRecorder:
    """EAGLE-2 expansion from the root's draft outputs (`left`/`right` [1, hidden], its top-k `log_probs`/`tokens`
    [1, k]): `depth` levels of `k` kept nodes with `k` children each, then the contrastive level from the last
    forward's `right` outputs (None: no contrastive level). `top(features)`: the draft's top-k. `level(tokens,
    parent_features, level, visible)` runs one draft forward over the k kept nodes (their parents' predicted features;
    `visible` [k, tree entries]: each node's ancestors and itself among the tree's cached entries, this forward's
    included) and returns (left, right, top-k log-probs, top-k ids). Returns the recorded candidates."""
    recorder = TreeRecorder(root)
    device = left.device
    kept_scores, kept_tokens = log_probs[0], tokens[0]
    kept_index = recorder.add_level(kept_tokens, torch.zeros_like(kept_tokens), kept_scores, depth=1)
    kept_rows = torch.zeros_like(kept_tokens)  # row of each kept node's parent in the last forward
    eye = torch.eye(k, dtype=torch.bool, device=device)
    visible = eye  # kept nodes x tree KV entries: own ancestors
    for depth_now in range(2, depth + 1):
        # a node reads its parent's predicted feature; log_probs, tokens: [k, k]
        left, right, log_probs, tokens = level(kept_tokens, left[kept_rows], depth_now, visible)
        scores = kept_scores[:, None] + log_probs
        index = recorder.add_level(tokens, kept_index[:, None].expand(k, k), scores, depth=depth_now)
        best = scores.flatten().topk(k).indices
        kept_rows = best // k
        kept_index, kept_tokens, kept_scores = index.flatten()[best], tokens.flatten()[best], scores.flatten()[best]
        visible = torch.cat([visible[kept_rows], eye], dim=1)
    if right is not None:
        # The right head of node r predicts the token two ahead of r, i.e. a grandchild of r. Hang it under each
        # kept child c of r (score(c) + its log-prob): every grandchild sits below its own parent. (The
        # reference code attaches node r's predictions to the r-th kept child instead.)
        log_probs, tokens = top(right)
        recorder.add_level(
            tokens[kept_rows], kept_index[:, None].expand(k, k), kept_scores[:, None] + log_probs[kept_rows],
            depth=depth + 1,
        )
    return recorder


def draft_top_k(draft: JakiroDraftModel, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.LongTensor]:
    """Top-k (log-probability, target token id) of the draft's next-token distribution for each feature row."""
    top = draft_log_probs(draft, features).topk(k, dim=-1)
    return top.values, draft.draft_to_target_ids(top.indices)


def draft_log_probs(draft: JakiroDraftModel, features: torch.Tensor) -> torch.Tensor:
    """The draft's next-token log-probabilities (float32) for each feature row, NaN as -inf: a head that overflows
    (NaN or infinite logits give NaN log-probabilities) then proposes its candidates last, never first (topk ranks NaN
    above every number). What the target accepts does not depend on this; the tree's size and shape do."""
    log_probs = F.log_softmax(draft.compute_logits(features).float(), dim=-1)
    return log_probs.masked_fill(torch.isnan(log_probs), float("-inf"))


def draft_round(draft: JakiroDraftModel, cache, tokens, features, count, root, depth: int, top_k: int,
                total_tokens: int, contrastive: bool):
    """A whole draft round over the draft's static cache, as one fixed-shape function (compiled whole, one graph
    call per round): read the newly accepted positions, expand `depth` levels of `top_k` nodes and the contrastive
    level, rank and flatten to the best `total_tokens` candidates.

    tokens [W], features [W, width]: the accepted positions to read (the token after each position, the target's
    features there), padded to a fixed width W; `count` [] (a device value, 1..W): how many are real; `root` []: the
    last accepted token. Every length is a device value: the cache's `cumulative_length` (where each forward writes)
    and `stable` (the cached length after the read), so nothing is read on the host and nothing changes shape from
    round to round. Padding rows write after the real ones and are dropped; the tree's levels write after the read
    and are dropped at the end, as in the eager drafter. Returns the flattened tree's tokens, parents, depths,
    ancestors and scores (`tree.flattened_tensors`)."""
    layer = cache.layers[0]
    device = tokens.device
    columns = torch.arange(layer.max_cache_len, device=device)
    past = layer.cumulative_length.clone()
    read = past + torch.arange(tokens.shape[0], device=device)
    out = draft(
        input_ids=tokens[None], hidden_states=features[None], position_ids=read[None],
        attention_mask=(columns[None, :] <= read[:, None])[None, None], cache=cache,
    )
    stable = past + count  # the root was read at position stable - 1
    layer.cumulative_length.copy_(stable)  # the first level writes over the padding rows' entries
    last = (count - 1).reshape(1)
    left = out.last_hidden_state[0].index_select(0, last)
    right = out.contrastive_hidden_state[0].index_select(0, last) if contrastive else None

    def top(rows):
        return draft_top_k(draft, rows, top_k)

    def level(kept_tokens, parent_features, depth_now, visible):
        # Each node sees the cached prefix [0, stable) and, among the tree's entries from `stable` on, its
        # ancestors and itself (`visible`).
        mask = (columns < stable)[None] | tree_columns(visible, columns, stable)
        positions = (stable - 2 + depth_now).expand(top_k)
        out = draft(
            input_ids=kept_tokens[None], hidden_states=parent_features[None], position_ids=positions[None],
            attention_mask=mask[None, None], cache=cache,
        )
        right = out.contrastive_hidden_state[0] if contrastive else None
        return (out.last_hidden_state[0], right, *top(out.last_hidden_state[0]))

    recorder = expand_tree(root, left, right, *top(left), level, top, depth, top_k)
    layer.cumulative_length.copy_(stable)  # the tree's entries are dropped
    return flattened_tensors(*recorder.recorded(), total_tokens, depth + int(contrastive))


_COMPILED = {}


def compiled_whole(function, compile_config):
    """`function` (a round function: `draft_round`, `static_verify.verify_round`) under torch.compile with the
    target's `CompileConfig`, always whole (`fullgraph=True`) and with fixed shapes (`dynamic=False`): one graph per
    tree size, none recompiled from round to round. One wrapper per function and config: dynamo keeps its graphs on
    the function's code, so every generate call reuses them."""
    options = {**compile_config.to_dict(), "fullgraph": True, "dynamic": False}
    key = (function.__name__, repr(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(function, **options)
    return _COMPILED[key]


def compiled_draft_round(compile_config):
    """`draft_round` compiled whole (`compiled_whole`)."""
    return compiled_whole(draft_round, compile_config)


class JakiroCandidateGenerator:
    """Proposes one token tree per round from a Jakiro draft.

    Not a transformers `CandidateGenerator`, on purpose: that contract returns one linear chain of candidate ids (and
    their logits) for `_assisted_decoding` to verify, and a token tree cannot be expressed that way; the tree goes to
    `row_rounds.verify_tree` instead, and transformers' assisted loop never sees this class.

    The draft's KV cache holds the accepted context: draft position t has read (f_t, x_{t+1}), the target's hidden
    state at t and the next token. `observe` hands over the target hidden states of newly accepted positions;
    `get_candidates` feeds them (with their next tokens) to the draft, expands the tree EAGLE-2 style and returns it
    flattened. The tree's KV entries are dropped again at the end of the round, so the cache only ever holds real
    target features. With `settings.lookup_tokens > 0` an `NgramIndex` of the accepted sequence (fed through
    `observe`) adds continuations of earlier occurrences of the current suffix to the tree (`graft_chains`).

    With `static_length` the draft's cache is a static one of that many positions, the cached length kept on the
    host, and a tree round is one call of `round_fn` (`draft_round`, or `compiled_draft_round(...)`): the read of the
    accepted positions and every level in one fixed-shape function. The prompt (but its last position) is read
    before it eagerly, and so are positions that rounds without a draft forward left beyond its read width (in
    one eager forward: rare, and never a new graph).
    """

    def __init__(self, draft: JakiroDraftModel, settings: TreeSettings, static_length: int | None = None, round_fn=None):
        self.draft = draft
        self.settings = settings
        self.static = static_length is not None
        self.cache = DynamicCache() if static_length is None else new_draft_cache(static_length)
        self.static_length = static_length
        self._length = 0  # cached positions, for the static cache (which reports its length as a device tensor)
        self._round = draft_round if round_fn is None else round_fn
        # The widest read a tree round makes: the most positions one round accepts (its deepest level or longest
        # lookup chain, plus the bonus token); what rounds without a draft forward left beyond it is read before
        self.read_width = settings.max_levels + 1
        self._pending: list[torch.Tensor] = []  # see `pending_features`
        # Seconds of this round's draft read spent on rows that rounds without a draft forward (or the prompt) left:
        # a cost of those earlier rounds, which the round controller does not charge to this round's choice.
        self.catch_up_s = 0.0
        vocab = draft.config.draft_vocab_size or draft.config.vocab_size
        self.top_k = min(settings.top_k, vocab)
        self.lookup = NgramIndex(settings.lookup_max_ngram) if settings.lookup_tokens > 0 else None
        self.lookup_length = settings.lookup_tokens  # adapted per round, see observe
        self.chain_was_whole = False  # the last round with lookup nodes accepted every one of them
        self._proposed = 0  # the longest chain of the last round that had lookup nodes
        self._features_unread = False  # a lookup-only round left `pending_features` for the draft to read later
        self._chains = None  # this round's lookup chains, once `signals` has found them
        self._ready_chain: list[int] = []  # the first of them, to compare with what the round accepts
        self.copying = False  # the last round's tokens continued the chain ready at its start (`lookup.continues`)

    def observe(self, features: torch.Tensor, tokens, lookup_accepted: int | None = None) -> None:
        """The round's one feedback: the target features of the positions it accepted ([m, hidden]; after the prefill,
        the prompt's) and its tokens (`tokens`: host ids, or a tensor read only when the n-gram lookup needs them).

        `lookup_accepted`: after a round whose tree carried lookup nodes, how many of them were accepted (a). The next
        chain is 2a + 1 tokens long, at most `lookup_tokens`: chains that keep being accepted stay long, and in text
        that does not repeat itself (where a wrong chain only costs verification) a single-token probe is all that is
        verified until a chain is accepted again. Whether the chain was accepted whole is one of the signals the round
        controller reads (`signals`)."""
        self._set_features(features)
        if self.lookup is None:
            return
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        self.copying, self._ready_chain = continues(self._ready_chain, tokens), []
        self.lookup.extend(tokens)
        if lookup_accepted is not None:
            self.lookup_length = min(self.settings.lookup_tokens, 2 * lookup_accepted + 1)
            self.chain_was_whole = lookup_accepted >= self._proposed

    def _set_features(self, features: torch.Tensor) -> None:
        """[m, hidden]: target hidden states of the positions accepted since the last round; after a round without a
        draft forward they join the ones the draft has not read yet. Kept as a list and joined once, when the draft
        reads them: a run of plain steps would otherwise copy all the unread rows again at every step."""
        if not self._features_unread:
            self._pending = []
        self._pending.append(features)
        self._features_unread = False

    @property
    def pending_features(self) -> torch.Tensor | None:
        """[rows, hidden]: the target features the draft has not read yet (None before the prefill)."""
        if len(self._pending) > 1:
            self._pending = [torch.cat(self._pending)]
        return self._pending[0] if self._pending else None

    def cached_length(self) -> int:
        return self._length if self.static else self.cache.get_seq_length()

    def rewind(self, length: int) -> None:
        """Drop the draft's cached positions from `length` on (benchmarks replaying one round)."""
        truncate(self.cache, length)
        self._length = length

    def _visible_to_mask(self, visible: torch.BoolTensor) -> torch.Tensor:
        dtype = self.draft.fc.weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min)

    def _read(self, next_tokens: torch.LongTensor, features: torch.Tensor, past: int):
        """The draft reads the accepted positions [past, past + m) in one eager forward; returns the left and right
        outputs (right None without the contrastive level) of the last one, each with one row."""
        mask = positions = None
        if self.static and (past > 0 or features.shape[0] == 1):
            # Over the static cache, an explicit causal mask over its columns: without one a single query attends to
            # every slot, zeros included (the causal attention of several queries over an empty cache is right).
            positions = past + torch.arange(features.shape[0], device=features.device)
            columns = torch.arange(self.static_length, device=features.device)
            mask = self._visible_to_mask((columns[None, :] <= positions[:, None])[None, None])
            positions = positions[None]
        out = self.draft(
            input_ids=next_tokens[None], hidden_states=features[None], position_ids=positions, attention_mask=mask,
            cache=self.cache, features_to_keep=1,
        )
        self._length = past + features.shape[0]
        right = out.contrastive_hidden_state[0] if self.settings.contrastive else None
        return out.last_hidden_state[0], right

    def _level(self, tokens, parent_features, position: int, stable: int, visible: torch.BoolTensor, k: int):
        """One tree level (the dynamic cache's; `draft_round` has the static one's): k nodes at `position`, seeing the
        cached prefix [0, stable) and, among the tree's cached entries, `visible` (their own ancestors and
        themselves). Returns (left, right, top-k log-probs, top-k ids)."""
        device = tokens.device
        positions = torch.full((k,), position, device=device)
        mask = torch.cat([torch.ones(k, stable, dtype=torch.bool, device=device), visible], dim=1)
        out = self.draft(
            input_ids=tokens[None], hidden_states=parent_features[None], position_ids=positions[None],
            attention_mask=mask[None, None], cache=self.cache,
        )
        left = out.last_hidden_state[0]
        right = out.contrastive_hidden_state[0] if self.settings.contrastive else None
        return (left, right, *draft_top_k(self.draft, left, k))


    def signals(self) -> tuple[bool, bool, bool]:
        """What the round controller reads before choosing this round: whether the n-gram lookup offers a chain now
        (found once, kept for this round's `get_candidates`), whether the last round copied (`lookup.continues`), and
        whether the last round with lookup nodes accepted all of them."""
        self._chains = self._lookup_chains()
        self._ready_chain = self._chains[0] if self._chains else []
        return bool(self._chains), self.copying, self.chain_was_whole

    def _lookup_chains(self) -> list[list[int]]:
        return self.lookup.chains(self.lookup_length, self.settings.lookup_chains) if self.lookup is not None else []

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor, choice: RoundChoice | None = None) -> DraftTree:
        """The tree to verify this round, rooted at `input_ids[0, -1]` (the last accepted token; [1, length]).

        `choice` (the round controller's): a plain step (the root alone), lookup chains alone (whole chains, as prompt
        lookup proposes them), or a draft tree of the choice's size with any lookup chains grafted (as the choice
        says: `RoundChoice.carries_chains`); None: the configured tree. Rounds without a draft forward leave the
        accepted tokens' features in `pending_features`; the draft reads them all in its next tree round."""
        chains = self._chains if self._chains is not None else self._lookup_chains()
        self._chains = None
        self.catch_up_s = 0.0
        root = input_ids[0, -1].to(self.draft.fc.weight.device)
        kind = "tree" if choice is None else choice.kind
        if kind != "tree":
            self._features_unread = True
            if kind == "plain" or not chains:
                return DraftTree.root_only(root)
            chains = self.lookup.chains(self.settings.lookup_tokens, self.settings.lookup_chains) or chains
            self._proposed = max(len(chain) for chain in chains)
            return self._graft(DraftTree.root_only(root), chains)
        if choice is not None and not choice.carries_chains(self.copying):
            chains = []
        if chains:
            self._proposed = max(len(chain) for chain in chains)
        settings = self.settings
        if choice is None:
            total_tokens, depth, k = settings.total_tokens, settings.depth, self.top_k
        else:
            total_tokens, depth, k = choice.total_tokens, choice.depth, min(choice.top_k, self.top_k)
        return self._graft(self._expand(input_ids.to(root.device), total_tokens, depth, k), chains)

    def _graft(self, tree: DraftTree, chains: list[list[int]]) -> DraftTree:
        """The tree with this round's lookup chains: in fixed slots on the device over the static cache (where the
        tree is padded to a fixed size anyway: one upload, no read), else merged on the host (no extra rows)."""
        if not chains:
            return tree
        if self.static:
            return graft_chain_slots(tree, chains, self.settings.lookup_tokens, self.settings.lookup_chains)
        return graft_chains(tree, chains)

    def _expand(self, input_ids: torch.LongTensor, total_tokens: int, depth: int, k: int) -> DraftTree:
        """The draft reads the accepted positions it has not read yet, then expands a tree EAGLE-2 style: `depth`
        levels of `k` kept nodes with `k` children each (and the contrastive level), flattened to the best
        `total_tokens` candidates."""
        past = self.cached_length()
        # The rows the last round accepted; the rest were left unread by earlier rounds (the first read: the prompt)
        newest = self._pending[-1].shape[0] if past > 0 else 1
        features = self.pending_features
        next_tokens = input_ids[0, past + 1 : past + 1 + features.shape[0]]
        if self.static:
            return self._static_round(input_ids[0, -1], next_tokens, features, past, total_tokens, depth, k)
        tic = time.perf_counter()
        left, right = self._read(next_tokens, features, past)  # [1, hidden] each: the root's outputs
        self.catch_up_s = (time.perf_counter() - tic) * (1.0 - newest / features.shape[0])
        stable = past + features.shape[0]  # the root token was read at draft position stable - 1

        def level(kept_tokens, parent_features, level, visible):
            return self._level(kept_tokens, parent_features, stable - 2 + level, stable, visible, k)

        def top(features):
            return draft_top_k(self.draft, features, k)

        recorder = expand_tree(input_ids[0, -1], left, right, *top(left), level, top, depth, k)
        self.rewind(stable)
        return recorder.flatten(total_tokens)

    def _static_round(self, root, next_tokens, features, past: int, total_tokens: int, depth: int, k: int) -> DraftTree:
        """A tree round over the static cache: `draft_round`, one fixed-shape call. The prompt (but its last position)
        and positions that rounds without a draft forward left unread beyond its read width are read first, in one
        eager forward (`_read`)."""
        width = self.read_width
        extra = features.shape[0] - (1 if past == 0 else width)
        tic = time.perf_counter()
        if extra > 0:
            self._read(next_tokens[:extra], features[:extra], past)
            past, next_tokens, features = past + extra, next_tokens[extra:], features[extra:]
        self.catch_up_s = time.perf_counter() - tic
        rows = features.shape[0]
        count = torch.full((), rows, dtype=torch.long, device=features.device)  # a fill: no host-to-device copy
        tokens = F.pad(next_tokens, (0, width - rows))
        features = F.pad(features.to(self.draft.fc.weight.dtype), (0, 0, 0, width - rows))
        outputs = self._round(
            self.draft, self.cache, tokens, features, count, root, depth, k, total_tokens, self.settings.contrastive
        )
        self._length = past + rows
        # Not cloned: a compiled call with CUDA graphs hands out the same output buffers every round, but the tree is
        # used up (verified) before the next round's call.
        return DraftTree(*outputs, levels=depth + int(self.settings.contrastive))



__all__ = ["JakiroCandidateGenerator", "TreeSettings", "lookup_from_generation_config"]
