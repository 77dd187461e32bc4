"""Jakiro tree speculative decoding inside `target.generate`: the transformers integration.

Two entry points run the same loop (`decoding.jakiro_decode`):
  * `target.generate(**inputs, assistant_model=draft)`: importing the package wraps
    `GenerationMixin._assisted_decoding` so that a Jakiro draft takes the tree path; any other assistant (a small
    LM, prompt lookup) goes to the stock implementation untouched.
  * `target.generate(**inputs, custom_generate=jakiro_generate, draft=draft, total_tokens=...)`: the public
    `custom_generate` hook, with per-call tree settings as keyword arguments.

The parts live in their own modules: `drafting.py` (tree settings, the candidate generator), `decoding.py` (stats,
one verification round, the loop, `jakiro_generate`). This module keeps the patch of transformers and the per-call
tree settings, and re-exports the public names so that `transformers_jakiro.generation` imports keep working.
"""

import contextlib

from transformers.generation.utils import GenerationMixin

from .decoding import JakiroGenerationStats, jakiro_decode, jakiro_generate, lazy_leaf_head, verify_tree
from .drafting import JakiroCandidateGenerator, TreeSettings
from .modeling_jakiro import JakiroDraftModel


def _is_jakiro_draft(model) -> bool:
    # Duck-typed so that drafts loaded with trust_remote_code (another class object) take the tree path too.
    return isinstance(model, JakiroDraftModel) or getattr(getattr(model, "config", None), "model_type", None) == "jakiro"


# Captured once: when this module is reloaded (importlib.reload, IPython autoreload) the class attribute is already
# our wrapper, which would then call itself forever; the wrapper carries the stock implementation along instead.
_STOCK_ASSISTED_DECODING = getattr(
    GenerationMixin._assisted_decoding, "_jakiro_stock", GenerationMixin._assisted_decoding
)


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
    """Route `generate(..., assistant_model=<Jakiro draft>)` to tree decoding (idempotent; after a reload of this
    module the class gets the reloaded wrapper, still in front of the stock implementation)."""
    if GenerationMixin._assisted_decoding is not _assisted_decoding:
        _assisted_decoding._jakiro = True
        _assisted_decoding._jakiro_stock = _STOCK_ASSISTED_DECODING
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


# Here as well as in the package's __init__: a reload of this module alone then routes to the reloaded code.
install_generate_hook()

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
