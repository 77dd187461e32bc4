"""vLLM plugin (entry point `vllm.general_plugins` -> `register`): teaches vLLM the Jakiro draft architecture.

vLLM calls `register` in each of its processes before it reads a model's config. The model class itself lives in
`vllm_model.py` and is imported lazily (by its dotted path), so installing the package never imports vLLM, and vLLM
imports the head's code only when a config names `JakiroForCausalLMEagle3` (folders written by `jakiro export`).
"""

from .export import VLLM_ARCHITECTURE


def register() -> None:
    from vllm import ModelRegistry

    if VLLM_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VLLM_ARCHITECTURE, "transformers_jakiro.vllm_model:JakiroForCausalLMEagle3")
