"""What the decoding loops take from `generate`, checked: the target and its attention backend, the model inputs,
left padding, the target's cache. Shared by one row's rounds (`row_rounds.py`) and a batch's (`batch_rounds.py`).
"""

import inspect

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .kv_cache import check_cache_supported, is_static, new_target_cache, static_length
from .logits import check_processors

SUPPORTED_ATTENTION = ("sdpa", "eager")


def forward_accepts(model, name: str) -> bool:
    """Whether the model's forward takes `name` (optional arguments such as `logits_to_keep` are missing from some
    remote-code models, which then fail with a TypeError)."""
    return name in inspect.signature(model.forward).parameters


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed the forward argument `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Model inputs that `generate` hands to every decoding method (5.17 to 5.24) and the loop below handles: the padding
# mask and the positions derived from it, the empty cache generate prepares, the prefill's `logits_to_keep=1`.
# Anything else (`pixel_values`, `token_type_ids`, ...) would be dropped, and the output would silently differ from
# plain generate's, so it is refused by name.
_HANDLED_MODEL_KWARGS = ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep")
# Output flags: generate leaves them in the model inputs (5.17 to 5.25). Plain generate returns per-step attentions or
# hidden states only with return_dict_in_generate=True and ignores the flags otherwise; so does this loop, and it
# refuses them by name where plain generate would return them.
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")


def check_model_kwargs(model_kwargs: dict, generation_config: GenerationConfig) -> None:
    unhandled = sorted(
        key for key, value in model_kwargs.items()
        if value is not None and key not in _HANDLED_MODEL_KWARGS + _OUTPUT_FLAGS
    )
    if unhandled:
        raise ValueError(
            f"Jakiro decoding cannot use the model input(s) {', '.join(unhandled)}: its tree path feeds the target "
            "input_ids and attention_mask only, so the output would differ from plain generate (a vision-language "
            "target would decode without its image). Generate without the Jakiro draft for such inputs, or leave "
            f"{', '.join(unhandled)} out."
        )
    if model_kwargs.get("logits_to_keep") not in (None, 1):
        raise ValueError(
            f"Jakiro decoding keeps the logits it needs itself; got logits_to_keep={model_kwargs['logits_to_keep']!r}. "
            "Leave logits_to_keep out."
        )
    if generation_config.return_dict_in_generate:
        for flag in _OUTPUT_FLAGS:
            if getattr(generation_config, flag, False) or model_kwargs.get(flag):
                raise ValueError(
                    f"Jakiro decoding does not return per-step attentions or hidden states; got {flag}=True with "
                    f"return_dict_in_generate=True. Leave {flag} out, or generate without the Jakiro draft."
                )


# The generation modes tree decoding implements: greedy decoding and sampling (`prompt_lookup_num_tokens` makes either
# "assisted"; it sets the lookup chains). Every other mode is refused by `check_generation_mode`, with the flags that
# select it.
DECODED_MODES = ("greedy_search", "sample", "assisted_generation")
_MODE_FLAGS = {
    "beam_search": "num_beams > 1",
    "beam_sample": "num_beams > 1 with do_sample=True",
    "group_beam_search": "num_beam_groups > 1",
    "constrained_beam_search": "constraints / force_words_ids",
    "contrastive_search": "penalty_alpha > 0 with top_k > 1",
    "dola_generation": "dola_layers",
}


def check_generation_mode(generation_config: GenerationConfig) -> None:
    """`custom_generate=jakiro_generate` replaces whatever decoding method `generate` would have run, so a mode it does
    not implement would silently become greedy decoding (or, for beams, several greedy rows: generate has already
    expanded the prompt by num_beams). Refuse it by name. (The `assistant_model` route needs no check: generate
    itself sends beam search and the other modes to their own implementations.)"""
    mode = generation_config.get_generation_mode()
    value = getattr(mode, "value", str(mode))
    if value in DECODED_MODES:
        return
    flags = _MODE_FLAGS.get(value, "the flags that select it")
    raise ValueError(
        f"jakiro_generate implements greedy decoding and sampling only; this call asks for {value} ({flags}). Leave "
        f"{flags} out for tree speculative decoding, or generate without custom_generate=jakiro_generate to run "
        f"{value} as transformers does."
    )


def left_paddings(attention_mask, batch: int, length: int) -> list[int]:
    """Left-padding positions of each row of a [batch, length] mask (None: no padding). Refuses any other zeros:
    right padding, holes, or a row without a real token."""
    if attention_mask is None or bool(attention_mask.all()):
        return [0] * batch
    mask = attention_mask.bool()
    paddings = (mask.long().cumsum(1) == 0).sum(1)
    real = torch.arange(length, device=mask.device)[None, :] >= paddings[:, None]
    if bool((paddings == length).any()) or not torch.equal(mask, real):
        raise ValueError(
            "Jakiro decoding supports left padding only (zeros before each row's first real token, at least one real "
            "token per row; right padding would be decoded after the pads). Tokenize with "
            "tokenizer.padding_side = 'left', or fix the attention_mask."
        )
    return paddings.tolist()


def left_padding(attention_mask, length: int) -> int:
    """Number of left-padding positions of a [1, length] mask (None: no padding); refuses any other zeros."""
    return left_paddings(attention_mask, 1, length)[0]


def check_position_ids(position_ids, paddings, length: int) -> None:
    """`generate` passes positions 0, 1, ... over each row's real tokens (what pads get differs between versions and
    does not matter: they are masked). A user's own positions would be ignored by the tree path: refuse them.
    `paddings`: each row's left padding (an int for a batch of one)."""
    if position_ids is None:
        return
    paddings = [paddings] if isinstance(paddings, int) else list(paddings)
    ok = tuple(position_ids.shape) == (len(paddings), length)
    for row, padding in enumerate(paddings if ok else ()):
        expected = torch.arange(length - padding, device=position_ids.device)
        ok = ok and torch.equal(position_ids[row, padding:], expected)
    if not ok:
        raise ValueError(
            "Jakiro decoding places tokens at positions 0, 1, ... after the left padding, but the position_ids "
            "passed to generate differ; the output would differ from plain generate. Leave position_ids out."
        )


def stop_verdicts(stopping_criteria, sequence: torch.LongTensor, start: int, processed: torch.Tensor, count: int):
    """[count] bool on the device: whether generation stops after each of the `count` tokens that `sequence`
    ([1, length]) holds from `start` on. Plain decoding checks the stopping criteria after every token, and an EOS or
    a stop string may sit inside an accepted path, so every prefix is checked; `processed` holds the tokens'
    scores. The caller reads the verdicts on the host together with whatever else it needs (one sync)."""
    verdicts = _all_at_once(stopping_criteria, sequence[0, start : start + count], start)
    if verdicts is not None:
        return verdicts
    verdicts = [stopping_criteria(sequence[:, : start + i + 1], processed[i : i + 1]).any() for i in range(count)]
    return torch.stack(verdicts)


def round_verdicts(stopping_criteria, prefix: torch.LongTensor, tokens: torch.LongTensor, scores: torch.Tensor):
    """`stop_verdicts` for a round's `tokens` ([w], padded to a fixed width; their `scores` [w, vocab]) after
    `prefix` ([1, length]): decided from the tokens alone when the criteria allow (`_all_at_once`), else prefix by
    prefix over the extended sequence."""
    verdicts = _all_at_once(stopping_criteria, tokens, prefix.shape[1])
    if verdicts is not None:
        return verdicts
    extended = torch.cat([prefix, tokens[None].to(prefix.device)], dim=1)
    return stop_verdicts(stopping_criteria, extended, prefix.shape[1], scores, tokens.numel())


def _all_at_once(stopping_criteria, tokens: torch.LongTensor, start: int):
    """Whether generation stops after each of `tokens` ([count], the sequence's tokens from position `start` on) in
    a few ops for all of them at once, when every criterion is a maximum length (a verdict that depends on the
    length only) or an EOS token (on the token only); None for any other criterion (stop strings, time limits,
    custom ones), which are asked prefix by prefix. A maximum length that the sequence could pass
    `max_position_embeddings` with goes that way too, for the warning plain generate gives there."""
    count = tokens.shape[0]
    verdicts = None
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            limit = criterion.max_position_embeddings
            if limit is not None and start + count > limit:
                return None
            # the length after token i is start + i + 1: the verdict holds from token max_length - start - 1 on
            verdict = torch.arange(count, device=tokens.device) >= criterion.max_length - start - 1
        elif type(criterion) is EosTokenCriteria:
            verdict = torch.isin(tokens, criterion.eos_token_id.to(tokens.device))
        else:
            return None
        verdicts = verdict if verdicts is None else verdicts | verdict
    return torch.zeros_like(tokens, dtype=torch.bool) if verdicts is None else verdicts


def check_supported(target, draft, input_ids, processors, model_kwargs, generation_config) -> None:
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
    check_model_kwargs(model_kwargs, generation_config)
    check_processors(processors)
    draft.bind_target(target)  # checks shapes every call: the draft may have been bound to another target before


def verify_forward(target, cache, generation_config: GenerationConfig):
    """The callable for fixed-shape verification forwards: the target's forward compiled by transformers' own
    mechanism (`get_compiled_call` with `generation_config.compile_config`) whenever `generate` would compile its
    decoding steps for this cache, device and config (`_valid_auto_compile_criteria`: a compileable cache on an
    accelerator, or `CompileConfig` with `_compile_all_devices`; never with `disable_compile`); the target otherwise.
    The prefill stays eager, as in `generate`: its shape changes with every prompt."""
    # The criteria read the cache from model_kwargs under the forward's name: `past_key_values` (5.17) or `cache`.
    if target._valid_auto_compile_criteria({"cache": cache, "past_key_values": cache}, generation_config):
        return target.get_compiled_call(generation_config.compile_config)
    return target


def target_cache(target, model_kwargs: dict, generation_config: GenerationConfig, max_nodes: int):
    """The target's cache for this call: the DynamicCache generate prepared or the caller passed (filled in place,
    as plain generate fills it), or static with `cache_implementation="static"` or a StaticCache passed to generate.
    Offloaded and quantized caches are refused by name: the tree path edits every layer's tensors in place.

    The static cache `generate` builds holds `max_length - 1` positions, but a round writes a whole tree after the
    accepted prefix, so it is replaced by one of transformers' own `StaticCache`s of `max_length + max_nodes`
    positions (at least `max_cache_len`). As in `generate` (`_prepare_static_cache`), the size never shrinks from one
    call to the next on the same target: a compiled forward then keeps its shapes whatever the prompt length. A
    StaticCache the caller passed is used as it is (and so filled, as in plain generate), if it is large enough."""
    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if given is None:  # use_cache=False, or a model that builds no cache in generate: decode with our own
        return new_target_cache(target.config)
    if getattr(given, "offloading", False):
        kind = "static" if is_static(given) else "dynamic"
        raise ValueError(
            f"Jakiro decoding does not support offloaded caches (cache_implementation='offloaded"
            f"{'_static' if kind == 'static' else ''}'): it moves the accepted path inside each layer's tensors, "
            f"which offloading keeps on another device. Use cache_implementation='{kind}'."
        )
    if not is_static(given):
        # The DynamicCache generate built, or the caller's own: filled in place, as plain generate fills it. Anything
        # else (a QuantizedCache, sliding-window layers) is refused by name.
        what = "The cache passed to generate" if getattr(given, "_is_user_defined", False) else "The target's cache"
        check_cache_supported(given, what=what)
        return given
    needed = max(generation_config.max_length + max_nodes, getattr(generation_config, "max_cache_len", None) or 0)
    if getattr(given, "_is_user_defined", False):  # set by generate on a cache passed in (5.17 and 5.24)
        check_cache_supported(given, what="The cache passed to generate")
        if static_length(given) < needed:
            raise ValueError(
                f"The StaticCache passed to generate holds {static_length(given)} positions; Jakiro decoding writes a "
                f"whole tree after the prefix and needs {needed} (max_length + {max_nodes} tree nodes). Pass a larger "
                "cache, or cache_implementation='static' instead of a cache."
            )
        return given
    length = max(needed, getattr(target, "_jakiro_static_cache_length", 0))
    target._jakiro_static_cache_length = length
    return new_target_cache(target.config, static_length=length)


