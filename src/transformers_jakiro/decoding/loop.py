"""The Jakiro decoding loop, one for every batch size: prefill, then rounds until every row has stopped.

A round: the round controller chooses what the rows verify (a plain step, lookup chains alone, a smaller tree or the
configured one); the rows' rounds (`row_rounds.RowRounds` for a batch of one, `batch_rounds.BatchRounds` for B > 1)
draft, verify in one target forward and hand back each row's new tokens; the loop appends them, checks the stopping
criteria after every token (an EOS or a stop string may sit inside an accepted path), and finished rows leave.

`jakiro_decode` is the loop that both entry points run (see `generation.py` for the `assistant_model` route);
`jakiro_generate` is the public `custom_generate` entry point.
"""

import dataclasses
import inspect
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from . import round_controller
from .batch_rounds import BatchRounds
from .drafter import TreeSettings
from ..modeling_jakiro import JakiroDraftModel
from .rope import deepest_level
from .round_controller import RoundChoice
from .row_rounds import RowRounds
from ..stats import JakiroGenerationStats
from .target_inputs import check_generation_mode, check_supported, stop_verdicts
from .verification import RoundTokens


@dataclasses.dataclass
class _Row:
    """One row of the batch: where it stands in the caller's batch and what it has so far."""

    index: int  # row in the caller's batch
    sequence: torch.LongTensor  # [1, length]: the row's padded prompt and its tokens so far
    padding: int  # left padding
    stats: JakiroGenerationStats


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
    """The decoding loop (see the module docstring); `generate` has already prepared processors, stopping criteria
    and the config."""
    check_supported(target, draft, input_ids, logits_processor, model_kwargs, generation_config)
    settings = settings or TreeSettings.resolve(draft)
    batch = input_ids.shape[0]
    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    scores, raw_logits = [], []  # per step, one row only (a batch refuses them)
    started = time.perf_counter()
    stats = JakiroGenerationStats()
    rounds_of = RowRounds if batch == 1 else BatchRounds
    extra = {} if batch == 1 else {"streamer": streamer}
    rounds = rounds_of(target, draft, settings, input_ids, logits_processor, generation_config, model_kwargs, stats,
                       **extra)
    device = target.get_input_embeddings().weight.device
    rows = [_Row(i, input_ids[i : i + 1].to(device), rounds.paddings[i], JakiroGenerationStats()) for i in range(batch)]
    if batch > 1:
        stats.rows = [row.stats for row in rows]

    def emit(result: RoundTokens, choice: str) -> set[int]:
        """Append each row's new tokens, cut after its first stop; returns the rows that finished. The stopping
        verdicts come read with the round (`result.stops`), or are read here for the whole batch (one sync)."""
        starts = [row.sequence.shape[1] for row in rows]
        for row, tokens in zip(rows, result.tokens):
            row.sequence = torch.cat([row.sequence, tokens[None].to(row.sequence.device)], dim=1)
        row_stops = result.stops
        if row_stops is None:
            verdicts = [
                stop_verdicts(stopping_criteria, row.sequence, start, row_scores, len(ids))
                for row, start, row_scores, ids in zip(rows, starts, result.scores, result.token_ids)
            ]
            flat, row_stops, at = torch.cat(verdicts).tolist(), [], 0
            for ids in result.token_ids:
                row_stops.append(flat[at : at + len(ids)])
                at += len(ids)
        done, added = set(), 0
        for r, (row, ids, stops) in enumerate(zip(rows, result.token_ids, row_stops)):
            count = stops.index(True) + 1 if True in stops else len(ids)
            row.sequence = row.sequence[:, : starts[r] + count]
            if keep_scores:  # copies: a fixed-shape round's logits live in buffers that the next round reuses
                scores.extend(result.scores[r][i : i + 1].clone() for i in range(count))
            if keep_logits:
                raw_logits.extend(result.raw[r][i : i + 1].clone() for i in range(count))
            if streamer is not None:
                streamer.put(torch.tensor(ids[:count]))
            row.stats.record(count, choice)
            added += count
            if True in stops:
                done.add(r)
        stats.record(added, choice)
        return done

    done = emit(rounds.prefill([row.sequence for row in rows]), "prefill")
    finished: dict[int, torch.LongTensor] = {}
    limits = rounds.limits  # position-dependent RoPE: rounds that would straddle a limit are plain steps
    controller = round_controller.controller_for(
        target, draft, rounds.settings, rounds.static, rounds.fixed_shape, batch_size=batch,
        do_sample=generation_config.do_sample,
    )
    while True:
        active = [r for r in range(len(rows)) if r not in done]
        for r in done:
            finished[rows[r].index] = rows[r].sequence
        if not active:
            break
        if len(active) < len(rows):  # finished rows leave the batch
            rounds.select(active)
            rows = [rows[r] for r in active]

        round_started = time.perf_counter()
        choice = controller.choose(*rounds.signals())
        if limits is not None:
            deepest = deepest_level(choice, rounds.settings)
            roots = [(row.sequence.shape[1] - 1, row.padding) for row in rows]  # each root's index in its sequence
            if not all(limits.allows(root, root + deepest, padding) for root, padding in roots):
                choice = RoundChoice("plain")
        result = rounds.round(choice, [row.sequence for row in rows], stopping_criteria)
        done = emit(result, result.name or choice.name)
        accepted = [a for a in result.lookup_accepted or () if a is not None]
        if accepted:
            stats.lookup_rounds += 1
            stats.lookup_accepted += sum(accepted)
        if result.measured:
            mean_tokens = sum(len(ids) for ids in result.token_ids) / len(result.token_ids)
            mean_chain = sum(accepted) / len(result.token_ids)
            seconds = time.perf_counter() - round_started - rounds.catch_up_s
            controller.record(choice, mean_tokens, seconds, mean_chain, rounds.catch_up_s)

    sequences = [finished[i] for i in range(batch)]
    rounds.finish(sequences)
    round_controller.remember(controller, draft)
    if streamer is not None:
        streamer.end()
    stats.total_time_s = time.perf_counter() - started
    draft.last_generation_stats = stats
    output = _padded_output(sequences, generation_config)
    if not want_dict:
        return output
    if batch > 1:  # the batch's cache holds holes and no finished rows: it cannot be continued, none is returned
        return GenerateDecoderOnlyOutput(sequences=output)
    result = GenerateDecoderOnlyOutput(
        sequences=output,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
    )
    result["cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"] = rounds.cache
    return result


def _padded_output(sequences: list, generation_config: GenerationConfig) -> torch.LongTensor:
    """The rows in the caller's order, each padded on the right with `pad_token_id` to the longest, as plain
    generate pads rows that finished early."""
    longest = max(sequence.shape[1] for sequence in sequences)
    if all(sequence.shape[1] == longest for sequence in sequences):
        return torch.cat(sequences)
    pad = generation_config._pad_token_tensor
    if pad is None:
        raise ValueError("Rows of a batch finished at different lengths and no pad_token_id is set to fill them: set "
                         "pad_token_id (plain generate needs it for batches too).")
    return torch.cat([
        torch.cat([sequence, pad.to(sequence).reshape(1, 1).expand(1, longest - sequence.shape[1])], dim=1)
        for sequence in sequences
    ])


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


__all__ = ["jakiro_decode", "jakiro_generate", "refuse_synced_gpus"]
