"""Load safety: pickle checkpoints are refused, damaged safetensors files and mismatched targets get clear errors."""

import os

import pytest
import torch
from tiny_models import make_target
from transformers import AutoModel

import transformers_jakiro  # noqa: F401  (registers the jakiro model type with AutoModel)
from transformers_jakiro import JakiroDraftModel


@pytest.fixture
def saved_draft(tiny_llama, tmp_path):
    draft = JakiroDraftModel.from_target(tiny_llama)
    draft.save_pretrained(tmp_path / "draft")
    return draft, tmp_path / "draft"


def test_round_trip_loads(saved_draft):
    draft, path = saved_draft
    loaded = AutoModel.from_pretrained(path)
    for name, tensor in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    # RoPE frequencies are not stored in the checkpoint; they must be rebuilt, not left uninitialised.
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "draft.pt"])
def test_pickle_only_directory_refused(saved_draft, name):
    draft, path = saved_draft
    os.remove(path / "model.safetensors")
    torch.save(draft.state_dict(), path / name)
    for load in (JakiroDraftModel.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert name in message and "refused for safety" in message
        assert "jakiro convert" in message and "safetensors" in message


def _damage(path, how: str):
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if how == "truncated" else b"this is not a safetensors file" * 40)
    return weights


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_damaged_safetensors_named(saved_draft, how):
    _, path = saved_draft
    weights = _damage(path, how)
    with pytest.raises(ValueError) as info:
        AutoModel.from_pretrained(path)
    message = str(info.value)
    assert str(weights) in message and "corrupt or truncated" in message
    assert "Re-download" in message and "re-save" in message


def test_bind_to_other_hidden_size(tiny_llama):
    draft = JakiroDraftModel.from_target(tiny_llama)
    other = make_target("llama", hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="hidden size: the draft expects 64, the target has 32"):
        draft.bind_target(other)


def test_bind_to_other_vocabulary(tiny_llama):
    draft = JakiroDraftModel.from_target(tiny_llama)
    other = make_target("llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary: the draft expects 128 tokens, the target has 256"):
        draft.bind_target(other)


def test_bind_to_other_model_type(tiny_llama):
    draft = JakiroDraftModel.from_target(tiny_llama)
    with pytest.raises(ValueError, match="model type: the draft was built for 'llama', the target is 'qwen2'"):
        draft.bind_target(make_target("qwen2"))
