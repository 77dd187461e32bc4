"""What Jakiro rounds need of transformers' continuous batching, checked before any work with a clear error: the
settings and models the rounds cannot serve (`check_supported`, when a manager is built), and the private layout of
transformers' paged cache and batch inputs that the rounds read and rewrite (`check_layout`, when the batch processor
is attached: the classes are transformers' own, pinned to the versions CI tests)."""

import importlib.util
import warnings
from pathlib import Path

from transformers import ContinuousBatchingConfig, GenerationConfig

from .decoding.logits import PREFIX_FREE_PROCESSORS

# What the rounds read of transformers' continuous batching (5.25's layout), checked when a processor is attached.
_CACHE_ATTRIBUTES = ("cache_allocators", "use_prefix_sharing")
_ALLOCATOR_ATTRIBUTES = ("get_write_indices", "_kv_token_views", "block_table", "pool", "ledger", "tokens_per_page",
                         "mark_complete_blocks")
_LEDGER_ATTRIBUTES = ("release", "block_to_hash", "hash_to_block")  # page reference counts and prefix hashes
_IO_ATTRIBUTES = ("position_ids", "cumulative_seqlens_q", "cumulative_seqlens_k", "attention_mask", "requests_in_batch")


def page_allocators_available() -> bool:
    """Whether this transformers lays its paged cache out in page allocators (5.25 and later), as the rounds need."""
    return importlib.util.find_spec("transformers.generation.continuous_batching.cache_allocators") is not None


def check_supported(target, generation_config: GenerationConfig, cb_config: ContinuousBatchingConfig) -> None:
    """Refuses, by name and before any work, what the rounds cannot do yet: a transformers version whose continuous
    batching lays its paged cache out otherwise (before 5.25: no page allocators), logits processors whose result
    depends on the prefix (repetition penalty, minimum length, ...: continuous batching hands them one token),
    attention without a dense mask (flash kernels are causal only), sliding-window layers, async batching and CUDA
    graphs (they replay the inputs of a one-token step)."""
    if not page_allocators_available():
        import transformers

        raise RuntimeError(
            f"Jakiro continuous batching needs transformers >= 5.25 (its paged cache's page allocators); this is "
            f"{transformers.__version__}. Upgrade transformers, or serve one request at a time (jakiro serve "
            "--no-continuous-batching)."
        )
    processors = target._get_logits_processor(generation_config)
    prefix_dependent = [type(p).__name__ for p in processors if type(p) not in PREFIX_FREE_PROCESSORS]
    if prefix_dependent:
        raise ValueError(
            f"Jakiro continuous batching applies row-wise logits processors only (temperature, top-k, top-p, min-p, "
            f"...); this generation config adds {', '.join(prefix_dependent)}, which depend on each node's prefix. "
            "Leave them out of the generation config, decode with `target.generate(..., assistant_model=draft)` one "
            "request at a time, or serve without the draft."
        )
    attention = target.config._attn_implementation
    if attention not in ("sdpa", "eager", "paged|eager", "paged|sdpa"):
        raise ValueError(
            f"The target uses attn_implementation='{attention}'; a tree needs a dense attention mask, which only sdpa "
            "and eager build in continuous batching. Load the target with attn_implementation='sdpa'."
        )
    layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"Jakiro continuous batching supports full-attention layers only; this target has {sorted(layer_types)}."
        )
    wrong = {
        "use_async_batching": cb_config.use_async_batching,
        "use_cuda_graph": cb_config.use_cuda_graph,
    }
    wrong = {name: value for name, value in wrong.items() if value}
    if wrong:
        raise ValueError(
            f"Jakiro continuous batching needs {', '.join(f'{name}=False' for name in wrong)} in the "
            "ContinuousBatchingConfig (async batching and CUDA graphs replay a one-token step's inputs)."
        )
    if getattr(cb_config, "scheduler_type", "fifo") != "fifo":
        raise ValueError("Jakiro continuous batching needs scheduler_type='fifo' (decoding requests scheduled first).")


def check_layout(processor) -> None:
    """Refuses a continuous batch processor whose paged cache, page allocators, page ledgers or batch inputs lack an
    attribute the rounds use (another transformers version's layout), naming them."""
    cache = processor.cache
    missing = [name for name in _CACHE_ATTRIBUTES if not hasattr(cache, name)]
    missing += [name for name in _IO_ATTRIBUTES if not hasattr(processor.inputs_and_outputs, name)]
    for allocator in getattr(cache, "cache_allocators", {}).values():
        missing += [name for name in _ALLOCATOR_ATTRIBUTES if not hasattr(allocator, name)]
        ledger = getattr(allocator, "ledger", None)
        missing += [f"ledger.{name}" for name in _LEDGER_ATTRIBUTES if not hasattr(ledger, name)]
    if missing:
        import transformers

        raise RuntimeError(
            f"Jakiro continuous batching does not know this transformers version's continuous batching layout "
            f"({transformers.__version__}: no {', '.join(sorted(set(missing)))}); it is tested on transformers "
            "5.25. Serve one request at a time (jakiro serve --no-continuous-batching)."
        )


def refusal(model_dir: str | Path) -> str | None:
    """Why Jakiro rounds could not serve the model in `model_dir` (a transformers model directory) under continuous
    batching, or None where they can: `check_supported`'s answer for the model as the server will load it (its
    config and generation config, the attention kernel transformers picks), read before any weight is loaded (the
    model is built on the meta device). `jakiro serve` turns continuous batching on by default where this is None."""
    if not page_allocators_available():
        import transformers

        return f"continuous batching with the draft needs transformers >= 5.25 (this is {transformers.__version__})"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    except (ValueError, KeyError, OSError) as error:  # not a causal LM transformers builds: one at a time decides
        return f"its config could not be checked as a causal LM's ({type(error).__name__}: {error})"
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    try:
        with warnings.catch_warnings():  # building the processors warns about penalties this only names
            warnings.simplefilter("ignore")
            check_supported(model, model.generation_config, jakiro_cb_config())
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


# What the rounds need set in a ContinuousBatchingConfig (see `check_supported`; flash kernels take no tree mask)
REQUIRED_SETTINGS = dict(use_async_batching=False, use_cuda_graph=False, auto_switch_to_flash=False)


def jakiro_cb_config(**overrides) -> ContinuousBatchingConfig:
    """A `ContinuousBatchingConfig` the rounds accept (`REQUIRED_SETTINGS`), with `overrides`."""
    return ContinuousBatchingConfig(**{**REQUIRED_SETTINGS, **overrides})


__all__ = ["REQUIRED_SETTINGS", "check_layout", "check_supported", "jakiro_cb_config", "page_allocators_available",
           "refusal"]
