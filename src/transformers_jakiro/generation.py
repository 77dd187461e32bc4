"""Jakiro tree speculative decoding inside `target.generate`.

Two entry points run the same loop (`jakiro_decode`):
  * `target.generate(**inputs, assistant_model=draft)`: importing the package wraps
    `GenerationMixin._assisted_decoding` so that a Jakiro draft takes the tree path; any other assistant (a small
    LM, prompt lookup) goes to the stock implementation untouched.
  * `target.generate(**inputs, custom_generate=jakiro_generate, draft=draft, total_tokens=...)`: the public
    `custom_generate` hook, with per-call tree settings as keyword arguments.

One round: the draft (its KV cache kept across rounds) reads the newly accepted tokens with their target hidden
states and expands a token tree (`JakiroCandidateGenerator`); the target verifies the whole tree in one forward
with a tree attention mask; the acceptance rule (`verification.accept`) keeps the longest path that agrees with the
target plus one bonus token; both caches are cut back to the accepted path.
"""

import contextlib
import inspect
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from . import verification
from .kv_cache import check_cache_supported, keep_accepted, new_target_cache, truncate
from .logits import check_processors, process_tree_logits
from .modeling_jakiro import JakiroDraftModel
from .lookup import NgramIndex
from .tree import DraftTree, TreeRecorder, graft_chains

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class TreeSettings:
    """total_tokens: draft nodes verified per round (root excluded). depth: draft forwards per round.
    top_k: children per node and nodes expanded per level. contrastive: build the last level from the
    contrastive (two-ahead) head, giving depth + 1 levels for depth forwards; False is the EAGLE-2-style ablation.
    lookup_tokens: length of the n-gram lookup chains grafted onto the tree (0: off; they come on top of
    total_tokens). lookup_max_ngram: longest suffix n-gram matched. lookup_chains: distinct chains per round."""

    total_tokens: int
    depth: int
    top_k: int
    contrastive: bool
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_chains: int = 1

    @classmethod
    def resolve(cls, draft: JakiroDraftModel, **overrides) -> "TreeSettings":
        config = draft.config
        values = dict(
            total_tokens=config.total_tokens, depth=config.depth, top_k=config.top_k, contrastive=config.contrastive_head
        )
        # Heads saved before n-gram lookup existed have no lookup fields: lookup off.
        for name in ("lookup_tokens", "lookup_max_ngram", "lookup_chains"):
            values[name] = getattr(config, name, getattr(cls, name))
        values.update(getattr(draft, "_tree_overrides", None) or {})
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        for name in ("total_tokens", "depth", "top_k", "lookup_max_ngram", "lookup_chains"):
            if int(getattr(settings, name)) < 1:
                raise ValueError(f"Jakiro tree setting {name} must be >= 1, got {getattr(settings, name)}.")
        if int(settings.lookup_tokens) < 0:
            raise ValueError(f"Jakiro tree setting lookup_tokens must be >= 0 (0: off), got {settings.lookup_tokens}.")
        if settings.contrastive and not config.contrastive_head:
            raise ValueError("contrastive=True needs a draft with a contrastive head (config.contrastive_head).")
        return settings


@dataclass
class JakiroGenerationStats:
    """What the last `generate` call did. A round is one target forward (the prefill counts as the first round,
    accepting one token); `accepted_lengths[i]` is how many tokens round i added, bonus token included, so
    `new_tokens == sum(accepted_lengths)` and `mean_accepted_length` (tau) `== new_tokens / rounds`.
    Times are host wall-clock seconds."""

    new_tokens: int = 0
    rounds: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    lookup_rounds: int = 0  # rounds whose tree carried n-gram lookup nodes
    lookup_accepted: int = 0  # accepted tokens that only the n-gram lookup proposed
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def record(self, accepted: int) -> None:
        self.rounds += 1
        self.new_tokens += accepted
        self.accepted_lengths.append(accepted)

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_length": self.mean_accepted_length}


class JakiroCandidateGenerator(CandidateGenerator):
    """Proposes one token tree per round from a Jakiro draft.

    The draft's KV cache holds the accepted context: draft position t has read (f_t, x_{t+1}), the target's hidden
    state at t and the next token. `set_features` hands over the target hidden states of newly accepted positions;
    `get_candidates` feeds them (with their next tokens) to the draft, expands the tree EAGLE-2 style and returns it
    flattened. The tree's KV entries are dropped again at the end of the round, so the cache only ever holds real
    target features. With `settings.lookup_tokens > 0` an `NgramIndex` of the accepted sequence (fed through
    `extend_context`) adds continuations of earlier occurrences of the current suffix to the tree (`graft_chains`).
    """

    def __init__(self, draft: JakiroDraftModel, settings: TreeSettings):
        self.draft = draft
        self.settings = settings
        self.cache = DynamicCache()
        self.pending_features = None
        vocab = draft.config.draft_vocab_size or draft.config.vocab_size
        self.top_k = min(settings.top_k, vocab)
        self.lookup = NgramIndex(settings.lookup_max_ngram) if settings.lookup_tokens > 0 else None

    def extend_context(self, tokens: list[int]) -> None:
        """Host copies of the accepted tokens (prompt first, then each round's), for the n-gram lookup."""
        if self.lookup is not None:
            self.lookup.extend(tokens)

    def set_features(self, features: torch.Tensor) -> None:
        """[m, hidden]: target hidden states of the positions accepted since the last round."""
        self.pending_features = features

    def _draft_level(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """Top-k (log-probability, target token id) of the draft's next-token distribution for each feature row."""
        log_probs = F.log_softmax(self.draft.compute_logits(features).float(), dim=-1)
        top = log_probs.topk(self.top_k, dim=-1)
        return top.values, self.draft.draft_to_target_ids(top.indices)

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor) -> DraftTree:
        """Expand a tree rooted at `input_ids[0, -1]` (the last accepted token); `input_ids` is [1, length]."""
        draft, k, settings = self.draft, self.top_k, self.settings
        device = draft.fc.weight.device
        input_ids = input_ids.to(device)
        past = self.cache.get_seq_length()
        features = self.pending_features
        next_tokens = input_ids[:, past + 1 : past + 1 + features.shape[0]]
        out = draft(input_ids=next_tokens, hidden_states=features[None], cache=self.cache, features_to_keep=1)
        stable = past + features.shape[0]  # the root token was read at draft position stable - 1

        recorder = TreeRecorder(input_ids[0, -1])
        left = out.last_hidden_state[0]  # [rows, hidden]: rows of the last draft forward (the root: 1 row)
        right = out.contrastive_hidden_state[0] if settings.contrastive else None
        log_probs, tokens = self._draft_level(left)
        kept_scores, kept_tokens = log_probs[0], tokens[0]
        kept_index = recorder.add_level(kept_tokens, torch.zeros_like(kept_tokens), kept_scores, depth=1)
        kept_rows = torch.zeros_like(kept_tokens)  # row of each kept node's parent in the last forward
        visible = torch.eye(k, dtype=torch.bool, device=device)  # kept nodes x tree KV entries: own ancestors

        for level in range(2, settings.depth + 1):
            mask = torch.cat([torch.ones(k, stable, dtype=torch.bool, device=device), visible], dim=1)
            out = draft(
                input_ids=kept_tokens[None],
                hidden_states=left[kept_rows][None],  # a node reads its parent's predicted feature
                position_ids=torch.full((1, k), stable - 2 + level, device=device),
                attention_mask=mask[None, None],
                cache=self.cache,
            )
            left = out.last_hidden_state[0]
            right = out.contrastive_hidden_state[0] if settings.contrastive else None
            log_probs, tokens = self._draft_level(left)  # [k, k]
            scores = kept_scores[:, None] + log_probs
            index = recorder.add_level(tokens, kept_index[:, None].expand(k, k), scores, depth=level)
            best = scores.flatten().topk(k).indices
            kept_rows = best // k
            kept_index, kept_tokens, kept_scores = index.flatten()[best], tokens.flatten()[best], scores.flatten()[best]
            visible = torch.cat([visible[kept_rows], torch.eye(k, dtype=torch.bool, device=device)], dim=1)

        if settings.contrastive:
            # The right head of node r predicts the token two ahead of r, i.e. a grandchild of r. Hang it under each
            # kept child c of r (score(c) + its log-prob): every grandchild sits below its own parent. (The
            # reference code attaches node r's predictions to the r-th kept child instead.)
            log_probs, tokens = self._draft_level(right)
            recorder.add_level(
                tokens[kept_rows],
                kept_index[:, None].expand(k, k),
                kept_scores[:, None] + log_probs[kept_rows],
                depth=settings.depth + 1,
            )
        truncate(self.cache, stable)
        tree = recorder.flatten(settings.total_tokens)
        if self.lookup is not None:
            tree = graft_chains(tree, self.lookup.chains(settings.lookup_tokens, settings.lookup_chains))
        return tree

    def update_candidate_strategy(self, input_ids, scores=None, num_matches=None):
        """The tree shape is fixed per call; nothing adapts between rounds."""


def _cache_kwarg(model) -> str:
    """transformers 5.24 renamed the forward argument `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_supported(target, draft, input_ids, processors, model_kwargs) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"Jakiro decoding supports batch size 1 for now; got a batch of {input_ids.shape[0]}. "
            "Call generate once per prompt."
        )
    attention = getattr(target.config, "_attn_implementation", None) or "sdpa"
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"The target uses attn_implementation='{attention}'. Tree verification needs an explicit 4D tree mask, "
            f"which only {' and '.join(SUPPORTED_ATTENTION)} honour; load the target with attn_implementation='sdpa'."
        )
    if target.config.is_encoder_decoder:
        raise ValueError("Jakiro decoding supports decoder-only targets only.")
    for key in ("cache", "past_key_values"):
        given = model_kwargs.get(key)
        if given is not None and given.get_seq_length() > 0:
            raise ValueError("Jakiro decoding starts from an empty cache; do not pass a filled cache to generate.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("Jakiro decoding needs input_ids, not inputs_embeds.")
    check_processors(processors)
    draft.bind_target(target)  # checks shapes every call: the draft may have been bound to another target before


def lazy_leaf_head(target, last_hidden: torch.Tensor, last_logits: torch.Tensor):
    """The target's output layer, when leaf logits may be left to `verify_tree` to compute lazily; else None.

    Most tree nodes are leaves, and a leaf's logits matter only when the accepted path ends there, so the target's
    forward can keep logits for internal nodes only (`logits_to_keep` with node indices) and apply its output layer
    to one leaf afterwards. The aim is to skip most of the lm_head rows of a verify forward on a CPU, where compute
    grows with every row; but the leaf's one-row product reads the whole output matrix again, and on SmolLM2-135M
    with 2 cores the two paths measured within noise of each other, on Qwen2.5-Coder-1.5B (a 151936-row output
    layer) the lazy path was 0.79-1.00x the time (README). On an accelerator extra rows are nearly free and the
    extra host sync is not, so the full logits are kept there. `last_hidden`/`last_logits` (the prefill's last
    position) check that the output layer alone reproduces the model's logits: models that scale or soft-cap logits
    after it keep the full path.
    """
    if last_hidden.device.type != "cpu" or "logits_to_keep" not in inspect.signature(target.forward).parameters:
        return None
    head = target.get_output_embeddings()
    if head is None:
        return None
    reproduced = head(last_hidden).float()
    return head if torch.allclose(reproduced, last_logits.float(), rtol=1e-3, atol=1e-3) else None


def verify_tree(target, cache, cache_kwarg: str, tree: DraftTree, sequence, processors, do_sample: bool, leaf_head=None):
    """One verification round: a single target forward over the whole tree (tree mask, positions = prefix length +
    depth), per-node logits processing, acceptance, and the cache cut back to the accepted path.

    Returns (path, bonus, processed logits, raw logits, target hidden states), the last three at the path's nodes.
    `sequence` ([1, length], ending with the root token) is what the logits processors see as the prefix.
    `leaf_head` (from `lazy_leaf_head`): compute logits at internal nodes in the forward and at most one leaf after.
    """
    past = cache.get_seq_length()
    internal = tree.internal_nodes() if leaf_head is not None else None
    out = target(
        input_ids=tree.tokens[None],
        position_ids=tree.position_ids(past),
        attention_mask=tree.attention_mask(past, target.dtype),
        use_cache=True,
        output_hidden_states=True,
        **({} if internal is None else {"logits_to_keep": internal}),
        **{cache_kwarg: cache},
    )
    features = out.hidden_states[-1][0]
    raw = out.logits[0].float()
    processed = process_tree_logits(processors, sequence, tree, raw, nodes=internal)
    if internal is None:
        path, bonus = verification.verify(tree, processed, do_sample)
        keep_accepted(cache, past, path)
        return path, bonus, processed[path], raw[path], features[path]

    leaf = {}

    def leaf_logits(node: torch.LongTensor) -> torch.Tensor:
        leaf["raw"] = leaf_head(features[node][None]).float()
        leaf["processed"] = process_tree_logits(processors, sequence, tree, leaf["raw"], nodes=node[None])
        return leaf["processed"][0]

    path, bonus = verification.verify(tree, processed, do_sample, leaf_logits)
    keep_accepted(cache, past, path)
    row = torch.full_like(tree.tokens, -1)
    row[internal] = torch.arange(internal.numel(), device=internal.device)
    if leaf:  # every node of the path but the last is internal
        rows = row[path[:-1]]
        processed, raw = torch.cat([processed[rows], leaf["processed"]]), torch.cat([raw[rows], leaf["raw"]])
    else:
        processed, raw = processed[row[path]], raw[row[path]]
    return path, bonus, processed, raw, features[path]


@torch.no_grad()
def jakiro_decode(
    target,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft: JakiroDraftModel,
    streamer=None,
    settings: TreeSettings | None = None,
    **model_kwargs,
):
    """The decoding loop; `generate` has already prepared processors, stopping criteria and the config."""
    _check_supported(target, draft, input_ids, logits_processor, model_kwargs)
    settings = settings or TreeSettings.resolve(draft)
    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    scores, raw_logits = ([] if keep_scores else None), ([] if keep_logits else None)

    # Left padding in a batch of one: the models never see the padded positions (plain generate gives them no
    # attention and continues positions after them, which is what decoding the unpadded prompt computes), but the
    # logits processors and stopping criteria see the full row, exactly as in plain generate.
    attention_mask = model_kwargs.get("attention_mask")
    padding = 0
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = int((attention_mask[0].cumsum(0) == 0).sum())
        if not bool(attention_mask[0, padding:].all()):
            raise ValueError("Jakiro decoding supports left padding only (zeros before the first real token).")

    stats = JakiroGenerationStats()
    started = time.perf_counter()
    target_device = target.get_input_embeddings().weight.device
    sequence = input_ids.to(target_device)
    cache = new_target_cache(target.config)
    cache_kwarg = _cache_kwarg(target)
    candidates = JakiroCandidateGenerator(draft, settings)

    def emit(new_tokens: list[int], processed: torch.Tensor, raw: torch.Tensor) -> bool:
        """Append tokens one at a time, checking the stopping criteria after each; True when generation ends."""
        nonlocal sequence
        for i, token in enumerate(new_tokens):
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
            if keep_scores:
                scores.append(processed[i : i + 1])
            if keep_logits:
                raw_logits.append(raw[i : i + 1])
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if bool(stopping_criteria(sequence, processed[i : i + 1]).any()):
                stats.record(i + 1)
                return True
        stats.record(len(new_tokens))
        return False

    # Prefill: the prompt through the target, the first token from its last position.
    tic = time.perf_counter()
    out = target(
        input_ids=sequence[:, padding:],
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
        **{cache_kwarg: cache},
    )
    raw = out.logits[:, -1].float()
    processed = logits_processor(sequence, raw.clone())
    first = verification.target_choices(processed, do_sample)
    candidates.set_features(out.hidden_states[-1][0])
    if candidates.lookup is not None:  # the prompt and the first token, once; later rounds add their own tokens
        candidates.extend_context(torch.cat([sequence[0, padding:], first.to(sequence.device)]).tolist())
    leaf_head = lazy_leaf_head(target, out.hidden_states[-1][:, -1], out.logits[:, -1])
    stats.verify_time_s += time.perf_counter() - tic
    finished = emit(first.tolist(), processed, raw)

    while not finished:
        tic = time.perf_counter()
        tree = candidates.get_candidates(sequence[:, padding:]).to_device(target_device)
        stats.draft_time_s += time.perf_counter() - tic

        tic = time.perf_counter()
        path, bonus, processed, raw, features = verify_tree(
            target, cache, cache_kwarg, tree, sequence, logits_processor, do_sample, leaf_head
        )
        candidates.set_features(features)
        fetch = [tree.tokens[path[1:]], bonus[None]]
        if tree.from_lookup is not None:  # how many accepted tokens only the lookup proposed, in the same copy
            fetch.append(tree.from_lookup[path].sum()[None])
        new_tokens = torch.cat(fetch).tolist()  # the one host sync of the round
        if tree.from_lookup is not None:
            stats.lookup_rounds += 1
            stats.lookup_accepted += new_tokens.pop()
        stats.verify_time_s += time.perf_counter() - tic
        finished = emit(new_tokens, processed, raw)
        candidates.extend_context(new_tokens)

    truncate(cache, sequence.shape[1] - padding - 1)  # a stop inside an accepted path leaves extra positions
    if streamer is not None:
        streamer.end()
    stats.total_time_s = time.perf_counter() - started
    draft.last_generation_stats = stats

    if not want_dict:
        return sequence
    output = GenerateDecoderOnlyOutput(
        sequences=sequence,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
    )
    output["cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"] = cache
    return output


def jakiro_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    draft: JakiroDraftModel | None = None,
    total_tokens: int | None = None,
    depth: int | None = None,
    top_k: int | None = None,
    contrastive: bool | None = None,
    lookup_tokens: int | None = None,
    **model_kwargs,
):
    """`custom_generate` entry point: `target.generate(**inputs, custom_generate=jakiro_generate, draft=draft,
    total_tokens=60, depth=5, top_k=10, lookup_tokens=10)`. Tree settings default to `draft.config`."""
    if draft is None:
        raise ValueError("jakiro_generate needs `draft=`, a JakiroDraftModel for this target.")
    settings = TreeSettings.resolve(
        draft, total_tokens=total_tokens, depth=depth, top_k=top_k, contrastive=contrastive, lookup_tokens=lookup_tokens
    )
    return jakiro_decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, draft, streamer, settings, **model_kwargs
    )


def _is_jakiro_draft(model) -> bool:
    # Duck-typed so that drafts loaded with trust_remote_code (another class object) take the tree path too.
    return isinstance(model, JakiroDraftModel) or getattr(getattr(model, "config", None), "model_type", None) == "jakiro"


_STOCK_ASSISTED_DECODING = GenerationMixin._assisted_decoding


# Keyword arguments `generate` hands to every assisted-decoding implementation that tree decoding does not use.
_GENERATE_ONLY_KWARGS = ("synced_gpus", "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer")


def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """Replaces `GenerationMixin._assisted_decoding`: a Jakiro draft takes the tree path, anything else the stock one."""
    if not _is_jakiro_draft(kwargs.get("assistant_model")):
        return _STOCK_ASSISTED_DECODING(
            self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
        )
    draft = kwargs["assistant_model"]
    streamer = kwargs.pop("streamer", None)
    model_kwargs = {key: value for key, value in kwargs.items() if key not in _GENERATE_ONLY_KWARGS}
    return jakiro_decode(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        draft,
        streamer,
        settings=TreeSettings.resolve(draft, **_lookup_from_generation_config(generation_config)),
        **model_kwargs,
    )


def _lookup_from_generation_config(generation_config) -> dict:
    """`generate(..., assistant_model=draft, prompt_lookup_num_tokens=k)` asks for prompt lookup and a Jakiro draft
    at once: the n-gram lookup runs inside the Jakiro tree with chains of k tokens (k = 0: lookup off), matching
    suffixes of up to `max_matching_ngram_size` tokens when that is given. Unset, the draft's settings hold."""
    overrides = {}
    if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None:
        overrides["lookup_tokens"] = int(generation_config.prompt_lookup_num_tokens)
    if getattr(generation_config, "max_matching_ngram_size", None) is not None:
        overrides["lookup_max_ngram"] = int(generation_config.max_matching_ngram_size)
    return overrides


def install_generate_hook() -> None:
    """Route `generate(..., assistant_model=<Jakiro draft>)` to tree decoding (idempotent)."""
    if not getattr(GenerationMixin._assisted_decoding, "_jakiro", False):
        _assisted_decoding._jakiro = True
        GenerationMixin._assisted_decoding = _assisted_decoding


@contextlib.contextmanager
def tree_settings(draft: JakiroDraftModel, **overrides):
    """Per-call tree settings for the assistant_model entry point:
    `with tree_settings(draft, total_tokens=30, depth=4): target.generate(..., assistant_model=draft)`."""
    previous = getattr(draft, "_tree_overrides", None)
    TreeSettings.resolve(draft, **overrides)  # validate now, not inside generate
    draft._tree_overrides = {**(previous or {}), **{k: v for k, v in overrides.items() if v is not None}}
    try:
        yield draft
    finally:
        draft._tree_overrides = previous


__all__ = [
    "JakiroCandidateGenerator",
    "JakiroGenerationStats",
    "TreeSettings",
    "install_generate_hook",
    "jakiro_decode",
    "jakiro_generate",
    "lazy_leaf_head",
    "tree_settings",
    "verify_tree",
]
