"""The Jakiro decoding loop: prefill, then draft-verify rounds until a stopping criterion fires.

One round: the draft expands a token tree (`drafter.JakiroCandidateGenerator`); the target verifies the whole tree
in one forward with a tree attention mask (`verify_tree`); the acceptance rule (`verification.verify`) keeps the
longest path that agrees with the target plus one bonus token; both caches are cut back to the accepted path.

`jakiro_decode` is the loop that both entry points run (see `generation.py` for the `assistant_model` route);
`jakiro_generate` is the public `custom_generate` entry point.
"""

import inspect
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from . import round_controller, verification
from .static_verify import compiled_verify_round, verify_fixed_round, verify_round
from .round_controller import RoundChoice
from .batch_loop import batch_decode
from .drafter import JakiroCandidateGenerator, TreeSettings, compiled_draft_round, draft_round
from ..features import TargetFeatures
from .kv_cache import is_static, keep_accepted, static_length, truncate
from .logits import PREFIX_FREE_PROCESSORS, process_tree_logits
from ..modeling_jakiro import JakiroDraftModel
from .rope import deepest_level, rope_limits
from ..stats import JakiroGenerationStats
from .target_inputs import (
    cache_kwarg,
    check_generation_mode,
    check_position_ids,
    check_supported,
    forward_accepts,
    left_padding,
    round_verdicts,
    stop_verdicts,
    target_cache,
    verify_forward,
)
from .tree import DraftTree
from .verification import VerifiedRound


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
    if last_hidden.device.type != "cpu" or not forward_accepts(target, "logits_to_keep"):
        return None
    head = target.get_output_embeddings()
    if head is None:
        return None
    reproduced = head(last_hidden).float()
    return head if torch.allclose(reproduced, last_logits.float(), rtol=1e-3, atol=1e-3) else None


def _candidate_generator(target, draft, settings, cache, fixed_shape: bool, compiled: bool, generation_config):
    """The draft side follows the target's: with a static cache and fixed shapes the draft gets a static cache too
    (long enough for the target's positions plus a tree's levels and one read), and when the target's verify forward
    is compiled so is the draft's round (`compiled_draft_round`), with the same `CompileConfig`."""
    if not (is_static(cache) and fixed_shape):
        return JakiroCandidateGenerator(draft, settings)
    # the target's positions, then a tree's levels after `draft_round`'s read (padded to its read width)
    length = static_length(cache) + settings.top_k * settings.depth + settings.max_levels + 1
    round_fn = draft_round
    if compiled:
        round_fn = compiled_draft_round(generation_config.compile_config or target._default_compile_config())
    return JakiroCandidateGenerator(draft, settings, static_length=length, round_fn=round_fn)


def _prefill(target, sequence, mask, cache, cache_arg: str, feature_layers):
    """The whole `sequence` ([1, length]) through the target into an empty cache, as plain generate's first step runs
    it (`mask`: the padding mask, None without left padding, positions then counted from the first real token).
    Returns the draft's features at every position and the last position's logits. Only the layers the draft reads are
    kept (by hooks), not every layer's states: the prompt may be long."""
    padded = {}
    if mask is not None:
        padded = dict(attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0))
    with TargetFeatures(target, feature_layers) as hidden:
        out = target(
            input_ids=sequence,
            **padded,
            use_cache=True,
            **hidden.forward_kwargs(),
            **({"logits_to_keep": 1} if forward_accepts(target, "logits_to_keep") else {}),
            **{cache_arg: cache},
        )
        return hidden.take(out), out.logits[:, -1]


def verify_tree(
    target,
    cache,
    cache_kwarg: str,
    tree: DraftTree,
    sequence,
    processors,
    do_sample: bool,
    leaf_head=None,
    padding=0,
    past: int | None = None,
    forward=None,
    feature_layers=(),
    verdicts=None,
):
    """One verification round: a single target forward over the whole tree (tree mask, positions = prefix length +
    depth), per-node logits processing, acceptance, and the cache cut back to the accepted path. The first `padding`
    cache positions hold the prompt's left padding: hidden from the tree, and not counted in its positions.

    Returns a `VerifiedRound`. `sequence` ([1, length], ending with the root token) is what the logits processors
    see as the prefix. `leaf_head` (from `lazy_leaf_head`): compute logits at internal nodes in the forward and at
    most one leaf after. Host syncs: one copy of the path and its tokens, plus one in `process_tree_logits` when a
    processor depends on the prefix (and, on the lazy-leaf path, the index of internal nodes and the leaf check).

    With a StaticCache the tree is written at `past` (the layers' `cumulative_length`), the mask spans the whole
    static length, and the accepted path is moved into place by index copies. `past`: the cached length when the
    caller knows it (a StaticCache reports it as a device tensor, which would cost a sync to read). `forward`: the
    callable that runs the target (a compiled `target.__call__`); the target itself by default. `feature_layers`: the
    decoder layers whose outputs the draft reads besides the last hidden state (`config.target_feature_layers`).
    `verdicts(tokens, scores)`: the stopping criteria's verdicts [w] (bool, on the device) after each of the round's
    tokens, given them padded to a fixed width w ([w] ids, [w, vocab] scores; entries past the round's length are
    placeholders, their verdicts ignored): read in the round's one copy into `VerifiedRound.stops`.
    """
    static = is_static(cache)
    if past is None:
        past = int(cache.get_seq_length())
    forward = target if forward is None else forward
    # A plain step's one node is its own leaf: its logits come from the forward, with no separate leaf head call.
    internal = tree.internal_nodes() if leaf_head is not None and tree.num_nodes > 1 else None
    if tree.num_nodes == 1 and not static:
        # A plain step (the round controller's, or a lookup round that found no chain): the mask plain generate
        # gives a one-token step, none or the 2D padding mask, so the target runs the same kernels as there.
        mask = None
        if padding:
            mask = torch.ones(1, past + 1, dtype=torch.long, device=tree.tokens.device)
            mask[:, :padding] = 0
    else:
        mask = tree.attention_mask(past, target.dtype, padding, kv_length=static_length(cache) if static else None)
    with TargetFeatures(target, feature_layers) as hidden:
        out = forward(
            input_ids=tree.tokens[None],
            position_ids=tree.position_ids(past - padding),
            attention_mask=mask,
            use_cache=True,
            **hidden.forward_kwargs(),
            **({} if internal is None else {"logits_to_keep": internal}),
            **{cache_kwarg: cache},
        )
        features = hidden.take(out)[0]
    raw = out.logits[0].float()
    processed = process_tree_logits(processors, sequence, tree, raw, nodes=internal)
    if tree.num_nodes == 1 and not static:
        # A plain step: the root's pick is the round's one token and the cache already ends at the root, so there
        # is no path to find and nothing to move (rounds the controller fills with plain steps run at plain speed).
        bonus = verification.target_choices(processed, do_sample)
        lookup_accepted = None if tree.from_lookup is None else 0
        path = torch.zeros(1, dtype=torch.long, device=bonus.device)
        if verdicts is None:
            return VerifiedRound(path, bonus[0], bonus, bonus.tolist(), processed, raw, features, lookup_accepted)
        host = torch.cat([bonus, verdicts(bonus, processed).long()]).tolist()  # the round's one copy
        stops = [bool(v) for v in host[1:]]
        return VerifiedRound(path, bonus[0], bonus, host[:1], processed, raw, features, lookup_accepted, stops)
    leaf = {}

    def leaf_logits(node: torch.LongTensor) -> torch.Tensor:
        last_hidden = features[node][None, ..., -leaf_head.weight.shape[1] :]  # after any fused layers' outputs
        leaf["raw"] = leaf_head(last_hidden).float()
        leaf["processed"] = process_tree_logits(processors, sequence, tree, leaf["raw"], nodes=node[None])
        return leaf["processed"][0]

    padded_path, bonus = verification.verify(tree, processed, do_sample, None if internal is None else leaf_logits)
    # The round's one device-to-host copy: the padded path (its length) with the tokens along it and the bonus, the
    # lookup count, and the stopping verdicts after each token.
    padded_tokens = tree.tokens[padded_path.clamp(min=0)]
    fetch = [padded_path, padded_tokens, bonus[None]]
    if tree.from_lookup is not None:  # how many accepted nodes only the n-gram lookup proposed
        fetch.append((tree.from_lookup[padded_path.clamp(min=0)] & (padded_path >= 0)).sum()[None])
    width = padded_path.numel()
    # Lazy-leaf path: `processed` holds internal nodes' rows only; each internal node's row there (-1 for leaves)
    row = None
    if internal is not None:
        row = torch.full_like(tree.tokens, -1).index_copy_(
            0, internal, torch.arange(internal.numel(), device=internal.device))
    if verdicts is not None:
        # The round's tokens padded to the path's width: token i is the draft token of path node i + 1, or the bonus
        # at i = m - 1 (m: the path's length); their scores are the processed logits of path node i.
        length = (padded_path >= 0).sum()
        index = torch.arange(width, device=padded_path.device)
        round_tokens = torch.where(index == length - 1, bonus, torch.cat([padded_tokens[1:], bonus[None]]))
        rows = padded_path.clamp(min=0)
        if row is not None:  # a leaf's row stands in as row 0 (its verdict is the leaf's, below, or ignored)
            rows = row[rows].clamp(min=0)
        round_scores = processed[rows]
        if leaf:  # the path ends at a leaf: the bonus token's scores are the leaf's
            round_scores = torch.where((index == length - 1)[:, None], leaf["processed"], round_scores)
        fetch.append(verdicts(round_tokens, round_scores).long())
    host = torch.cat(fetch).tolist()
    stops = None
    if verdicts is not None:
        stops, host = host[-width:], host[:-width]
    lookup_accepted = host.pop() if tree.from_lookup is not None else None
    m = sum(node >= 0 for node in host[:width])
    stops = None if stops is None else [bool(v) for v in stops[:m]]
    path = padded_path[:m]
    token_ids = host[width + 1 : width + m] + host[-1:]
    tokens = torch.cat([padded_tokens[1:m], bonus[None]])
    keep_accepted(cache, past, path)
    if internal is None:
        return VerifiedRound(
            path, bonus, tokens, token_ids, processed[path], raw[path], features[path], lookup_accepted, stops
        )

    if leaf:  # every node of the path but the last is internal
        rows = row[path[:-1]]
        processed, raw = torch.cat([processed[rows], leaf["processed"]]), torch.cat([raw[rows], leaf["raw"]])
    else:
        processed, raw = processed[row[path]], raw[row[path]]
    return VerifiedRound(path, bonus, tokens, token_ids, processed, raw, features[path], lookup_accepted, stops)


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
    """The decoding loop; `generate` has already prepared processors, stopping criteria and the config. A batch of
    several rows goes to `batch_loop.batch_decode`."""
    check_supported(target, draft, input_ids, logits_processor, model_kwargs, generation_config)
    if input_ids.shape[0] > 1:
        return batch_decode(
            target, input_ids, logits_processor, stopping_criteria, generation_config, draft, streamer, settings,
            **model_kwargs,
        )
    settings = settings or TreeSettings.resolve(draft)
    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    scores, raw_logits = ([] if keep_scores else None), ([] if keep_logits else None)

    # Left padding in a batch of one: as in plain generate, the target's cache holds the padded positions (so that a
    # cache returned with return_dict_in_generate lines up with `sequences` and can be continued), nothing attends to
    # them and positions continue after them; the draft reads the unpadded prompt only. The logits processors and
    # stopping criteria see the full row, exactly as in plain generate.
    padding = left_padding(model_kwargs.get("attention_mask"), input_ids.shape[1])
    check_position_ids(model_kwargs.get("position_ids"), padding, input_ids.shape[1])

    stats = JakiroGenerationStats()
    started = time.perf_counter()
    target_device = target.get_input_embeddings().weight.device
    sequence = input_ids.to(target_device)
    cache = target_cache(target, model_kwargs, generation_config, settings.max_nodes)
    cache_arg = cache_kwarg(target)
    static = is_static(cache)
    fixed_shape = static if settings.fixed_shape is None else bool(settings.fixed_shape)
    forward = verify_forward(target, cache, generation_config) if static and fixed_shape else target
    compiled = forward is not target
    candidates = _candidate_generator(target, draft, settings, cache, fixed_shape, compiled, generation_config)
    limits = rope_limits(target)  # position-dependent RoPE: rounds that would straddle a limit are plain steps
    if limits is not None:
        limits.refuse_unfollowable(generation_config.max_length, static)
    # Fixed shapes over a static cache: a round is two fixed-shape functions, the draft's (`draft_round`) and this
    # one, compiled whole when generate would compile. Processors that read the ids stay on `verify_tree`'s path.
    verify_fn = None
    if static and fixed_shape and all(type(p) in PREFIX_FREE_PROCESSORS for p in logits_processor):
        config = generation_config.compile_config or target._default_compile_config()
        verify_fn = compiled_verify_round(config) if compiled else verify_round
        padding_t = torch.full((), padding, dtype=torch.long, device=target_device)  # one graph for every padding

    def emit(
        tokens: torch.LongTensor, token_ids: list[int], processed: torch.Tensor, raw: torch.Tensor, choice="prefill",
        stops: list[bool] | None = None,
    ) -> bool:
        """Append a round's tokens ([m] on the device, `token_ids` on the host); True when generation ends. The m
        stopping verdicts (`stop_verdicts`) come read with the round (`stops`), or are read here together (one
        sync), and the round is cut after the first token that stops."""
        nonlocal sequence
        start = sequence.shape[1]
        sequence = torch.cat([sequence, tokens[None].to(sequence.device)], dim=1)
        if stops is None:
            stops = stop_verdicts(stopping_criteria, sequence, start, processed, len(token_ids)).tolist()
        count = stops.index(True) + 1 if True in stops else len(token_ids)
        sequence = sequence[:, : start + count]
        if keep_scores:  # copies: a fixed-shape round's logits live in buffers that the next round reuses
            scores.extend(processed[i : i + 1].clone() for i in range(count))
        if keep_logits:
            raw_logits.extend(raw[i : i + 1].clone() for i in range(count))
        if streamer is not None:
            streamer.put(torch.tensor(token_ids[:count]))
        stats.record(count, choice)
        return True in stops

    # Prefill: the prompt through the target, the first token from its last position.
    tic = time.perf_counter()
    mask = None if not padding else model_kwargs["attention_mask"].to(target_device)
    features, last_logits = _prefill(target, sequence, mask, cache, cache_arg, draft.config.target_feature_layers)
    raw = last_logits.float()
    processed = logits_processor(sequence, raw.clone())
    first = verification.target_choices(processed, do_sample)
    # the prompt and the first token, once (read to the host only for the n-gram lookup); rounds add their own
    candidates.observe(features[0, padding:], torch.cat([sequence[0, padding:], first.to(sequence.device)]))
    # The lazy leaf path keeps logits for a data-dependent set of nodes: a shape that changes every round.
    last_hidden = features[:, -1, -draft.config.hidden_size :]
    leaf_head = None if fixed_shape else lazy_leaf_head(target, last_hidden, last_logits)
    del features
    stats.verify_time_s += time.perf_counter() - tic
    finished = emit(first, first.tolist(), processed, raw)

    controller = round_controller.controller_for(target, draft, settings, static, fixed_shape, do_sample=do_sample)
    while not finished:
        tic = round_started = time.perf_counter()
        choice = controller.choose(*candidates.signals())
        root = sequence.shape[1] - 1  # the root's index in the sequence (left padding included)
        if limits is not None and not limits.allows(root, root + deepest_level(choice, settings), padding):
            choice = RoundChoice("plain")
        if limits is not None and limits.recompute_at == root:
            # The target's own generate recomputes the whole sequence at this step (Phi-3 at the longrope boundary):
            # so does this loop, as a plain step (`rope.recompute_index`).
            candidates.get_candidates(sequence[:, padding:], choice)  # a plain step's bookkeeping on the draft side
            truncate(cache, 0)
            whole = None if mask is None else torch.cat([mask, mask.new_ones(1, root + 1 - mask.shape[1])], dim=1)
            features, last_logits = _prefill(target, sequence, whole, cache, cache_arg, draft.config.target_feature_layers)
            raw = last_logits.float()
            processed = logits_processor(sequence, raw.clone())
            token = verification.target_choices(processed, do_sample)
            stats.verify_time_s += time.perf_counter() - tic
            token_ids = token.tolist()
            finished = emit(token, token_ids, processed, raw, "plain")
            candidates.observe(features[0, -1:], token_ids)
            continue
        tree = candidates.get_candidates(sequence[:, padding:], choice).to_device(target_device)
        if fixed_shape:
            tree = tree.padded(round_controller.padded_size(choice, settings))
        stats.draft_time_s += time.perf_counter() - tic

        tic = time.perf_counter()
        past = sequence.shape[1] - 1  # the cache holds everything but the root, the last accepted token
        def verdicts(round_tokens, round_scores, prefix=sequence):
            return round_verdicts(stopping_criteria, prefix, round_tokens, round_scores)

        if verify_fn is not None:  # every round's path padded to one width: the deepest any tree can be
            verified = verify_fixed_round(
                verify_fn, target, cache, cache_arg, tree, padding_t, logits_processor, do_sample,
                draft.config.target_feature_layers, verdicts, lookup=settings.lookup_tokens > 0,
                levels=settings.max_levels,
            )
        else:
            verified = verify_tree(
                target, cache, cache_arg, tree, sequence, logits_processor, do_sample, leaf_head, padding, past,
                forward, draft.config.target_feature_layers, verdicts,
            )
        stats.verify_time_s += time.perf_counter() - tic
        finished = emit(verified.tokens, verified.token_ids, verified.processed, verified.raw, choice.name,
                        verified.stops)
        seconds = time.perf_counter() - round_started - candidates.catch_up_s
        chain_tokens = verified.lookup_accepted or 0
        controller.record(choice, len(verified.token_ids), seconds, chain_tokens, candidates.catch_up_s)
        if verified.lookup_accepted is not None:
            stats.lookup_rounds += 1
            stats.lookup_accepted += verified.lookup_accepted
        candidates.observe(verified.features, verified.token_ids, verified.lookup_accepted)

    truncate(cache, sequence.shape[1] - 1)  # a stop inside an accepted path leaves extra positions
    round_controller.remember(controller, draft)
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


def _streamer_of_running_generate(model):
    """The `streamer` passed to the `generate` call that is running a `custom_generate` function, or None.

    transformers hands a `custom_generate` callable only the keyword arguments that `_sample` does not declare, and
    `_sample` declares `streamer`: it is dropped, after `generate` has already put the prompt into it, so the stream
    would never end (a `TextIteratorStreamer` consumer hangs). No public way gives it back, so it is read from
    `generate`'s own frame, which is on the stack right above this call.
    """
    generate_code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        caller = frame.f_back
        while caller is not None:
            if caller.f_code is generate_code and caller.f_locals.get("self") is model:
                return caller.f_locals.get("streamer")
            caller = caller.f_back
        return None
    finally:
        del frame, caller  # frames hold references to every local on the stack


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
    lookup_max_ngram: int | None = None,
    lookup_chains: int | None = None,
    fixed_shape: bool | None = None,
    adaptive: bool | None = None,
    tokenizer=None,
    **model_kwargs,
):
    """`custom_generate` entry point: `target.generate(**inputs, custom_generate=jakiro_generate, draft=draft,
    total_tokens=60, depth=5, top_k=10, lookup_tokens=10)`. Takes the same settings as the `assistant_model` entry
    point (`TreeSettings.resolve`): these keyword arguments first, then `prompt_lookup_num_tokens` /
    `max_matching_ngram_size`, then `tree_settings(draft, ...)`, then `draft.config`; `fixed_shape` (default: on
    with `cache_implementation="static"`) pads every round's tree to one size. `tokenizer` is what `generate` built
    its stop-string criteria with (kept for this function by the package's hook); decoding itself needs none."""
    if draft is None:
        raise ValueError("jakiro_generate needs `draft=`, a JakiroDraftModel for this target.")
    refuse_synced_gpus(synced_gpus)
    check_generation_mode(generation_config)
    settings = TreeSettings.resolve(
        draft,
        generation_config,
        total_tokens=total_tokens,
        depth=depth,
        top_k=top_k,
        contrastive=contrastive,
        lookup_tokens=lookup_tokens,
        lookup_max_ngram=lookup_max_ngram,
        lookup_chains=lookup_chains,
        fixed_shape=fixed_shape,
        adaptive=adaptive,
    )
    if streamer is None:  # a transformers release whose generate the package's hook does not reach
        streamer = _streamer_of_running_generate(model)
    return jakiro_decode(
        model, input_ids, logits_processor, stopping_criteria, generation_config, draft, streamer, settings, **model_kwargs
    )


# Marks the callable whose `generate` keyword arguments the package's hook keeps (`generation._extract_...`).
jakiro_generate._jakiro_generate = True


def refuse_synced_gpus(synced_gpus: bool) -> None:
    """Under `synced_gpus` (DeepSpeed ZeRO-3 or FSDP across ranks, set by generate itself) every rank must run the same
    number of forwards; with a draft each rank accepts its own number of tokens per round, so ranks would wait for
    one another forever."""
    if synced_gpus:
        raise ValueError(
            "Jakiro decoding does not support synced_gpus=True (DeepSpeed ZeRO-3 or FSDP sharded across ranks): ranks "
            "accept different numbers of tokens per round and would run different numbers of forwards and hang. "
            "Generate without the draft there, or load the target unsharded on each rank (synced_gpus=False)."
        )


__all__ = [
    "JakiroGenerationStats",
    "VerifiedRound",
    "jakiro_decode",
    "jakiro_generate",
    "lazy_leaf_head",
    "refuse_synced_gpus",
    "verify_tree",
]
