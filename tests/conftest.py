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
