"""`continuous_support.refusal`: what decides whether `jakiro serve` runs continuous batching by default, read from a
model directory before any weight is loaded. Tiny models saved to a temporary directory."""


import pytest
from transformers import GenerationConfig, Qwen2Config, T5Config

from tiny_models import CONFIGS
from transformers_jakiro.continuous_support import page_allocators_available, refusal

SUPPORTED = page_allocators_available()
needs_allocators = pytest.mark.skipif(not SUPPORTED, reason="transformers < 5.25: see the last test")


def saved(tmp_path, config=None, generation: dict | None = None):
    (config or CONFIGS["llama"]()).save_pretrained(tmp_path)
    if generation is not None:
        GenerationConfig(**generation).save_pretrained(tmp_path)
    return tmp_path


@needs_allocators
def test_a_supported_model_has_no_refusal(tmp_path):
    assert refusal(saved(tmp_path, generation={"do_sample": True, "temperature": 0.7, "top_p": 0.8})) is None


@needs_allocators
def test_a_prefix_dependent_processor_in_the_generation_config_is_named(tmp_path):
    why = refusal(saved(tmp_path, generation={"repetition_penalty": 1.1}))
    assert why is not None and "RepetitionPenaltyLogitsProcessor" in why


@needs_allocators
def test_sliding_window_layers_are_named(tmp_path):
    config = Qwen2Config(**{**CONFIGS["qwen2"]().to_dict(), "use_sliding_window": True, "sliding_window": 16,
                            "max_window_layers": 1, "layer_types": None})
    why = refusal(saved(tmp_path, config))
    assert why is not None and "full-attention layers only" in why and "sliding_attention" in why


@needs_allocators
def test_a_config_that_is_no_causal_lm_is_named_not_raised(tmp_path):
    why = refusal(saved(tmp_path, T5Config(vocab_size=32, d_model=16, num_layers=1, num_heads=2)))
    assert why is not None and "could not be checked as a causal LM's" in why


@pytest.mark.skipif(SUPPORTED, reason="transformers >= 5.25 is supported")
def test_older_transformers_are_named(tmp_path):
    why = refusal(saved(tmp_path))
    assert why is not None and "needs transformers >= 5.25" in why
