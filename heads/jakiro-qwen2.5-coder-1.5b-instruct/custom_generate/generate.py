"""Jakiro tree speculative decoding as a transformers Hub decoding method (`custom_generate`).

This folder is saved with every Jakiro draft head. Give the head's repo id (or local folder) as `custom_generate`
and the head itself as `draft`:

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(TARGET)
    draft = AutoModel.from_pretrained(HEAD, trust_remote_code=True)
    outputs = target.generate(**inputs, custom_generate=HEAD, draft=draft, trust_remote_code=True)

`draft` may also be the head's repo id or folder (`draft=HEAD`): it is then loaded here, in the dtype and on the
device of the target's lm_head, and kept for the next call with the same head. Optional keyword arguments: the tree
settings `total_tokens`, `depth`, `top_k`, `contrastive`, `lookup_tokens` and `fixed_shape` (defaults: the head's
config). Greedy output is token-for-token the target's own greedy output; sampling keeps the target's distribution.
The output is what `target.generate` returns; the statistics of the last call are in `draft.last_generation_stats`.

The decoding itself lives in the transformers-jakiro package (`pip install transformers-jakiro`); without it this
file raises an ImportError that gives that command. This file is copied from transformers_jakiro/templates/.
"""

import os

_INSTALL = "pip install transformers-jakiro"
# Arguments that transformers also hands to the loading of this file; here they serve only to load a `draft` given
# by name, and the target's generate would refuse them as unused model arguments.
_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
_LOADED = {}  # (head, revision, device, dtype) -> the head loaded for `draft=<name>`; one entry at most


def _package():
    # Imported in a try block so that transformers' import scan of this file leaves the message to us.
    try:
        import transformers_jakiro
    except ImportError as error:
        raise ImportError(
            "This Jakiro head's decoding method (custom_generate/generate.py) runs on the transformers-jakiro "
            f"package, which could not be imported ({error}). Install it with `{_INSTALL}` and call generate again."
        ) from error
    return transformers_jakiro


def _is_jakiro(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "jakiro"


def _load_draft(jakiro, target, name, hub_kwargs):
    weight = target.get_output_embeddings().weight
    key = (os.fspath(name), hub_kwargs.get("revision"), weight.device, weight.dtype)
    if key not in _LOADED:
        _LOADED.clear()  # a bound head holds its target's embeddings: keep only the latest
        head = jakiro.JakiroDraftModel.from_pretrained(name, dtype=weight.dtype, **hub_kwargs)
        _LOADED[key] = head.to(weight.device)
    return _LOADED[key]


def generate(model, *args, draft=None, **kwargs):
    """`target.generate(**inputs, custom_generate=<head>, draft=<head or its name>, trust_remote_code=True)`."""
    jakiro = _package()
    assistant = kwargs.pop("assistant_model", None)
    if assistant is not None:
        if not _is_jakiro(assistant) or (draft is not None and draft is not assistant):
            raise ValueError(
                "This decoding method drafts with the Jakiro head given as `draft=`; do not pass another "
                "`assistant_model` with it."
            )
        draft = assistant
    hub_kwargs = {key: kwargs.pop(key) for key in _HUB_KWARGS if key in kwargs}
    if draft is None:
        raise ValueError(
            "Jakiro decoding needs its draft head: pass `draft=` to generate, either the loaded head "
            "(`AutoModel.from_pretrained(<head>, trust_remote_code=True)`) or the head's repo id / folder, e.g. "
            "`target.generate(**inputs, custom_generate=<head>, draft=<head>, trust_remote_code=True)`."
        )
    if isinstance(draft, (str, os.PathLike)):
        draft = _load_draft(jakiro, model, draft, hub_kwargs)
    elif not _is_jakiro(draft):
        raise TypeError(f"`draft` must be a Jakiro draft head or its repo id / folder, not {type(draft).__name__}.")
    # The class's own generate: `model.generate` may itself be a custom generate set by from_pretrained.
    return type(model).generate(model, *args, custom_generate=jakiro.jakiro_generate, draft=draft, **kwargs)
