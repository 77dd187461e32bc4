"""transformers-jakiro: Jakiro speculative decoding for Hugging Face transformers.

Importing the package registers model_type "jakiro" with AutoConfig/AutoModel and lets
`target.generate(..., assistant_model=draft)` run lossless tree speculative decoding when `draft` is a
`JakiroDraftModel` (any other assistant keeps stock transformers behaviour).
"""

from transformers import AutoConfig, AutoModel

from .configuration_jakiro import JakiroConfig
from .decoding.loop import jakiro_generate
from .decoding.drafter import JakiroCandidateGenerator
from .generation import install_generate_hook, tree_settings
from .stats import JakiroGenerationStats
from .modeling_jakiro import JakiroDraftModel, JakiroDraftOutput

__version__ = "0.1.0"

AutoConfig.register("jakiro", JakiroConfig, exist_ok=True)
AutoModel.register(JakiroConfig, JakiroDraftModel, exist_ok=True)
# save_pretrained then writes `auto_map` and copies the two modeling files next to the weights, so
# AutoModel.from_pretrained(dir, trust_remote_code=True) works without this package.
JakiroConfig.register_for_auto_class()
JakiroDraftModel.register_for_auto_class("AutoModel")
install_generate_hook()

__all__ = [
    "JakiroCandidateGenerator",
    "JakiroConfig",
    "JakiroDraftModel",
    "JakiroDraftOutput",
    "JakiroGenerationStats",
    "jakiro_generate",
    "tree_settings",
    "__version__",
]
