"""The foundation snippet: a head sized from its target, saved, loaded back through the Auto classes, and loaded
as remote code in a process that never imports the package."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel, DynamicCache

from tiny_models import make_target
from transformers_jakiro import JakiroConfig, JakiroDraftModel


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_from_target_save_and_auto_load(arch, tmp_path):
    target = make_target(arch)
    draft = JakiroDraftModel.from_target(target)
    text = target.config
    assert (draft.config.hidden_size, draft.config.num_attention_heads, draft.config.num_key_value_heads) == (
        text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    )
    assert draft.config.vocab_size == text.vocab_size and draft.config.target_model_type == arch
    assert draft.layer.self_attn.q_proj.bias is not None if arch == "qwen2" else draft.layer.self_attn.q_proj.bias is None
    draft.save_pretrained(tmp_path)
    saved = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_jakiro.py", "modeling_jakiro.py", "README.md"} <= saved
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "configuration_jakiro.JakiroConfig", "AutoModel": "modeling_jakiro.JakiroDraftModel"
    }
    # The target's embeddings and lm_head are borrowed, never saved.
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
    assert b"embed_tokens" not in header and b"lm_head" not in header

    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, JakiroDraftModel) and isinstance(loaded.config, JakiroConfig)
    loaded.bind_target(target)
    ids, features = torch.randint(3, 128, (1, 9)), torch.randn(1, 9, text.hidden_size)
    a, b = draft(input_ids=ids, hidden_states=features), loaded(input_ids=ids, hidden_states=features)
    torch.testing.assert_close(a.last_hidden_state, b.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(a.contrastive_hidden_state, b.contrastive_hidden_state, rtol=0, atol=0)


REMOTE = """
import sys, torch
from transformers import AutoModel
draft = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
assert "transformers_jakiro" not in sys.modules, "the package must not be needed"
inputs = torch.load(sys.argv[2])
out = draft(inputs_embeds=inputs["embeds"], hidden_states=inputs["features"])
torch.save({"left": out.last_hidden_state, "right": out.contrastive_hidden_state, "cls": type(draft).__name__}, sys.argv[3])
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_remote_code_load_without_the_package(arch, tmp_path):
    target = make_target(arch)
    draft = JakiroDraftModel.from_target(target)
    draft.save_pretrained(tmp_path / "head")
    ids = torch.randint(3, 128, (1, 7))
    inputs = {"embeds": target.get_input_embeddings()(ids).detach(), "features": torch.randn(1, 7, 64)}
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run(
        [sys.executable, "-c", REMOTE, str(tmp_path / "head"), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        check=True, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1", "PATH": ""},
    )
    remote = torch.load(tmp_path / "out.pt")
    mine = draft(input_ids=ids, hidden_states=inputs["features"])
    assert remote["cls"] == "JakiroDraftModel"
    torch.testing.assert_close(remote["left"], mine.last_hidden_state)
    torch.testing.assert_close(remote["right"], mine.contrastive_hidden_state)


def test_incremental_cache_equals_full_forward_and_bf16_runs():
    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target)
    ids, features = torch.randint(3, 128, (1, 12)), torch.randn(1, 12, 64)
    full = draft(input_ids=ids, hidden_states=features)
    cache = DynamicCache()
    parts = [draft(input_ids=ids[:, a:b], hidden_states=features[:, a:b], cache=cache) for a, b in [(0, 5), (5, 6), (6, 12)]]
    torch.testing.assert_close(torch.cat([p.last_hidden_state for p in parts], 1), full.last_hidden_state)
    assert cache.get_seq_length() == 12
    last = draft(input_ids=ids, hidden_states=features, features_to_keep=1)
    torch.testing.assert_close(last.contrastive_hidden_state, full.contrastive_hidden_state[:, -1:])

    target_bf16 = make_target("llama", dtype=torch.bfloat16)
    draft_bf16 = JakiroDraftModel.from_target(target_bf16)
    assert draft_bf16.fc.weight.dtype == torch.bfloat16
    # RoPE frequencies stay exact float32 through dtype casts (a bf16 copy would shift the rotations)
    assert torch.equal(draft_bf16.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)
    assert torch.equal(draft_bf16.float().to(torch.bfloat16).rotary_emb.inv_freq, draft.rotary_emb.inv_freq)
    out = draft_bf16(input_ids=ids, hidden_states=features.bfloat16())
    assert out.last_hidden_state.dtype == torch.bfloat16 and torch.isfinite(out.last_hidden_state).all()
    prompt = torch.tensor([[5, 6, 7]])
    assert target_bf16.generate(prompt, max_new_tokens=8, assistant_model=draft_bf16).shape == (1, 11)


def test_reduced_vocabulary_head_round_trips(tmp_path):
    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target, draft_vocab_size=32)
    draft.d2t.copy_(torch.randperm(128)[:32].sort().values)
    draft.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).bind_target(target)
    assert torch.equal(loaded.d2t, draft.d2t) and loaded.lm_head.weight.shape == (32, 64)
    assert torch.equal(loaded.draft_to_target_ids(torch.tensor([0, 31])), draft.d2t[[0, 31]])
    outside = sorted(set(range(128)) - set(draft.d2t.tolist()))[:2]
    assert loaded.in_vocabulary([int(draft.d2t[3]), *outside]).tolist() == [True, False, False]
    assert JakiroDraftModel.from_target(target).in_vocabulary([0, 127]).all()  # full vocabulary: everything
    prompt = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(target.generate(prompt, max_new_tokens=20, assistant_model=loaded), target.generate(prompt, max_new_tokens=20))


def test_config_validation_messages():
    with pytest.raises(ValueError, match="num_experts must be 1"):
        JakiroConfig(num_experts=3, num_experts_per_tok=3, contrastive_head=False)
    with pytest.raises(ValueError, match="sparse routing is not supported"):
        JakiroConfig(num_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="contrastive_head=True needs num_experts=2"):
        JakiroConfig(num_experts=1, num_experts_per_tok=1)


@pytest.mark.parametrize("empty", ["init_empty_weights", "meta_device"])
def test_materialised_from_the_meta_device(empty, tmp_path):
    """`init_empty_weights(include_buffers=True)` / `torch.device("meta")` followed by `to_empty()` and
    `load_checkpoint_and_dispatch(device_map="auto")`: the big-model loading flow. The RoPE table is not in the
    checkpoint; it must come out float32 and exact, and the loaded head must compute what the original does."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target).eval()
    draft.save_pretrained(tmp_path)
    with init_empty_weights(include_buffers=True) if empty == "init_empty_weights" else torch.device("meta"):
        empty_draft = JakiroDraftModel(draft.config)
    assert empty_draft.rotary_emb.inv_freq.is_meta
    empty_draft.to_empty(device="cpu")
    assert empty_draft.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(empty_draft.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)
    loaded = load_checkpoint_and_dispatch(empty_draft, str(tmp_path), device_map="auto").eval().bind_target(target)
    ids, features = torch.randint(3, 128, (1, 9)), torch.randn(1, 9, 64)
    torch.testing.assert_close(
        loaded(input_ids=ids, hidden_states=features).last_hidden_state,
        draft(input_ids=ids, hidden_states=features).last_hidden_state,
    )


def test_from_pretrained_with_device_map_auto_and_bf16(tmp_path):
    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target)
    draft.save_pretrained(tmp_path)
    loaded = JakiroDraftModel.from_pretrained(tmp_path, device_map="auto", dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)
