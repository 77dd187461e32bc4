"""Jakiro tree speculative decoding inside `target.generate`: the transformers integration.

Two entry points run the same loop (`loop.jakiro_decode`):
  * `target.generate(**inputs, assistant_model=draft)`: importing the package wraps
    `GenerationMixin._assisted_decoding` so that a Jakiro draft takes the tree path; any other assistant (a small
    LM, prompt lookup) goes to the stock implementation untouched.
  * `target.generate(**inputs, custom_generate=jakiro_generate, draft=draft, total_tokens=...)`: the public
    `custom_generate` hook, with per-call tree settings as keyword arguments.

The parts live in their own modules: `decoding/drafter.py` (tree settings, the candidate generator), `decoding/loop.py` (one
verification round, the loop, `jakiro_generate`). This module keeps the patch of transformers and the per-call tree
settings.
"""

import contextlib
import inspect

from transformers.generation.utils import GenerationMixin

from .decoding.loop import jakiro_decode, refuse_synced_gpus
from .decoding.drafter import TreeSettings
from .modeling_jakiro import JakiroDraftModel


def _is_jakiro_draft(model) -> bool:
    # Duck-typed so that drafts loaded with trust_remote_code (another class object) take the tree path too.
    return isinstance(model, JakiroDraftModel) or getattr(getattr(model, "config", None), "model_type", None) == "jakiro"


def _stock(name: str):
    """The stock `GenerationMixin` method, captured once: when this module is reloaded (importlib.reload, IPython
    autoreload) the class attribute is already our wrapper, which would then call itself forever; each wrapper
    carries the stock implementation along instead."""
    method = getattr(GenerationMixin, name)
    return getattr(method, "_jakiro_stock", method)


_STOCK_ASSISTED_DECODING = _stock("_assisted_decoding")
_STOCK_VALIDATE_GENERATION_MODE = _stock("_validate_generation_mode")
_STOCK_EXTRACT_MODE_KWARGS = _stock("_extract_generation_mode_kwargs")


def _with_signature_of(stock):
    """Give a wrapper the stock method's signature (`inspect.signature` follows `__wrapped__`), keeping its own
    name and docstring."""

    def decorate(wrapper):
        wrapper.__wrapped__ = stock
        return wrapper

    return decorate


# Keyword arguments `generate` hands to every assisted-decoding implementation that tree decoding does not use.
_GENERATE_ONLY_KWARGS = ("synced_gpus", "inputs_tensor", "assistant_model", "assistant_tokenizer", "tokenizer")


# The stock signature, through `__wrapped__`: `generate` passes `inputs_tensor` (the encoder's input, which stock
# assisted decoding of encoder-decoder models re-encodes for the assistant) only to a decoding method whose
# signature names it, so a wrapper with a signature of its own would change what the stock path receives.
@_with_signature_of(_STOCK_ASSISTED_DECODING)
def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """Replaces `GenerationMixin._assisted_decoding`: a Jakiro draft takes the tree path, anything else the stock one."""
    if not _is_jakiro_draft(kwargs.get("assistant_model")):
        return _STOCK_ASSISTED_DECODING(
            self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
        )
    draft = kwargs["assistant_model"]
    refuse_synced_gpus(kwargs.get("synced_gpus", False))
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
        settings=TreeSettings.resolve(draft, generation_config),
        **model_kwargs,
    )


@_with_signature_of(_STOCK_VALIDATE_GENERATION_MODE)
def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs):
    """Replaces `GenerationMixin._validate_generation_mode`: a Jakiro draft is checked against the target first, so
    a draft for another vocabulary or hidden size gets our error naming what differs, not transformers' "different
    tokenizers" (which compares vocabulary sizes and asks for tokenizers a Jakiro draft never uses); then the stock
    checks run unchanged."""
    draft = generation_mode_kwargs.get("assistant_model")
    if _is_jakiro_draft(draft):
        draft.bind_target(self)
    return _STOCK_VALIDATE_GENERATION_MODE(
        self, generation_mode, generation_config, generation_mode_kwargs, *args, **kwargs
    )


@_with_signature_of(_STOCK_EXTRACT_MODE_KWARGS)
def _extract_generation_mode_kwargs(self, custom_generate, kwargs, *args, **extra):
    """Replaces `GenerationMixin._extract_generation_mode_kwargs`: for a Jakiro `custom_generate` callable it also keeps
    the `tokenizer`, `streamer` and `synced_gpus` that stock drops for callables. Without the tokenizer, `generate`
    cannot build the stop-string criteria (`stop_strings=` then fails with "could not locate a tokenizer" although
    one was passed), and without the streamer the stream is never ended. Any other callable is left as it was."""
    if not getattr(custom_generate, "_jakiro_generate", False):
        return _STOCK_EXTRACT_MODE_KWARGS(self, custom_generate, kwargs, *args, **extra)
    named = inspect.signature(_STOCK_EXTRACT_MODE_KWARGS).bind(self, custom_generate, kwargs, *args, **extra).arguments
    tokenizer = kwargs.get("tokenizer")
    custom = _STOCK_EXTRACT_MODE_KWARGS(self, custom_generate, kwargs, *args, **extra)
    # The non-callable branch computes the default of synced_gpus (DeepSpeed ZeRO-3 / FSDP across ranks).
    usual = _STOCK_EXTRACT_MODE_KWARGS(self, None, {}, named.get("synced_gpus"), None, named.get("streamer"))
    kept = {key: usual[key] for key in ("synced_gpus", "streamer") if key in usual}
    if tokenizer is not None:
        kept["tokenizer"] = tokenizer
    return {**kept, **custom}


_HOOKS = {
    "_assisted_decoding": (_assisted_decoding, _STOCK_ASSISTED_DECODING),
    "_validate_generation_mode": (_validate_generation_mode, _STOCK_VALIDATE_GENERATION_MODE),
    "_extract_generation_mode_kwargs": (_extract_generation_mode_kwargs, _STOCK_EXTRACT_MODE_KWARGS),
}


def install_generate_hook() -> None:
    """Route `generate(..., assistant_model=<Jakiro draft>)` to tree decoding, and let `custom_generate=jakiro_generate`
    receive what it needs (idempotent; after a reload of this module the class gets the reloaded wrappers, still in
    front of the stock implementations). Each wrapper passes anything that is not Jakiro's to the stock method as
    it came, with the stock signature."""
    for name, (wrapper, stock) in _HOOKS.items():
        if getattr(GenerationMixin, name) is not wrapper:
            wrapper._jakiro = True
            wrapper._jakiro_stock = stock
            setattr(GenerationMixin, name, wrapper)


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


# Here as well as in the package's __init__: a reload of this module alone then routes to the reloaded code.
install_generate_hook()

__all__ = ["install_generate_hook", "tree_settings"]
