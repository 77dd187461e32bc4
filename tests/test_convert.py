"""Converting original Jakiro / EAGLE-1/2 checkpoints: synthetic checkpoints with the original names and shapes,
converted, reloaded through AutoModel, and checked against the Jakiro formula computed from the original tensors."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, Qwen2Config

import transformers_jakiro  # noqa: F401  (registers the jakiro model type with AutoModel)
from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.cli import main
from transformers_jakiro.convert import convert_checkpoint

H, HEADS, KV_HEADS, VOCAB = 32, 4, 2, 64
HEAD_DIM = H // HEADS
ROPE_THETA, EPS = 5000.0, 1e-5
EAGLE_WIDTH = 48  # EAGLE's dense MLP uses the config's intermediate_size
JAKIRO_CONFIG_WIDTH = 80  # the reference Jakiro code ignores intermediate_size: its experts are H wide


def original_config(kind: str) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": EAGLE_WIDTH if kind == "eagle" else JAKIRO_CONFIG_WIDTH,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    if kind != "eagle":
        config.update(num_local_experts=2, num_experts_per_tok=2, bias=True)
    return config


def original_tensors(kind: str, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors with exactly the names and shapes of the original checkpoints."""

    def rand(*shape, std=0.2):
        return (torch.randn(*shape) * std).to(dtype)

    layer = "layers.0."
    tensors = {
        "fc.weight": rand(H, 2 * H),
        "fc.bias": rand(H),
        "embed_tokens.weight": rand(VOCAB, H),  # shipped by some checkpoints; the converter drops it
        layer + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
        layer + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
        layer + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
        layer + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
        layer + "post_attention_layernorm.weight": 1.0 + rand(H),
    }
    if kind == "jakiro_qkv_bias":  # Qwen2-style targets
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            tensors[f"{layer}self_attn.{name}_proj.bias"] = rand(rows * HEAD_DIM)
    if kind == "eagle":
        tensors[layer + "mlp.gate_proj.weight"] = rand(EAGLE_WIDTH, H)
        tensors[layer + "mlp.up_proj.weight"] = rand(EAGLE_WIDTH, H)
        tensors[layer + "mlp.down_proj.weight"] = rand(H, EAGLE_WIDTH)
    else:
        tensors[layer + "mlp_moe.gate.weight"] = rand(4, H, std=1.0)  # large: both right-head branches occur
        for e in (0, 1):
            prefix = f"{layer}mlp_moe.experts.{e}."
            tensors[prefix + "gate_proj.weight"] = rand(H, H)
            tensors[prefix + "up_proj.weight"] = rand(H, H)
            tensors[prefix + "down_proj.weight"] = rand(H, H)
    return tensors


def write_checkpoint(path, config: dict, tensors: dict, fmt: str = "safetensors"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    else:
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    return str(path)


def tiny_target(model_type: str = "llama"):
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    )
    config = LlamaConfig(**shape) if model_type == "llama" else Qwen2Config(**shape, use_sliding_window=False)
    return AutoModelForCausalLM.from_config(config).eval()


def reference(t: dict, embed: torch.Tensor, input_ids, features):
    """The Jakiro / EAGLE draft layer written out from the original tensors (docs/design.md, section 1)."""
    p = "layers.0."
    x = torch.cat([embed[input_ids], features], -1) @ t["fc.weight"].T + t["fc.bias"]
    seq = x.shape[1]

    def project(name, heads):
        y = x @ t[f"{p}self_attn.{name}_proj.weight"].T
        if f"{p}self_attn.{name}_proj.bias" in t:
            y = y + t[f"{p}self_attn.{name}_proj.bias"]
        return y.view(1, seq, heads, HEAD_DIM).transpose(1, 2)

    q, k, v = project("q", HEADS), project("k", KV_HEADS), project("v", KV_HEADS)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = torch.arange(seq).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotate(y):
        return y * cos + torch.cat([-y[..., HEAD_DIM // 2 :], y[..., : HEAD_DIM // 2]], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, seq, H)
    a = x + attn @ t[f"{p}self_attn.o_proj.weight"].T  # residual; no input norm
    h = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + EPS) * t[f"{p}post_attention_layernorm.weight"]

    def mlp(prefix):
        return (F.silu(h @ t[prefix + "gate_proj.weight"].T) * (h @ t[prefix + "up_proj.weight"].T)) @ t[
            prefix + "down_proj.weight"
        ].T

    if f"{p}mlp.up_proj.weight" in t:  # EAGLE: dense MLP, no right head
        return a + mlp(f"{p}mlp."), None, None
    e0, e1 = mlp(f"{p}mlp_moe.experts.0."), mlp(f"{p}mlp_moe.experts.1.")
    g = h @ t[f"{p}mlp_moe.gate.weight"].T
    w = g[..., :2].softmax(-1)
    left = a + w[..., :1] * e0 + w[..., 1:] * e1
    r = g[..., 2:].softmax(-1)
    first = g[..., 2:3] > g[..., 3:4]  # strictly
    right = a + torch.where(first, r[..., :1] * e0 - r[..., 1:] * e1, r[..., 1:] * e1 - r[..., :1] * e0)
    return left, right, first


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("kind", ["jakiro", "eagle", "jakiro_qkv_bias"])
def test_converted_draft_matches_original_formula(tmp_path, kind, fmt):
    tensors = original_tensors(kind)
    src = write_checkpoint(tmp_path / "original", original_config(kind), tensors, fmt)
    target_type = "qwen2" if kind == "jakiro_qkv_bias" else None
    convert_checkpoint(src, str(tmp_path / "converted"), target_model_type=target_type, target_name_or_path="org/t")

    draft = AutoModel.from_pretrained(tmp_path / "converted")
    assert isinstance(draft, JakiroDraftModel)
    config = draft.config
    assert config.target_model_type == (target_type or "llama") and config.target_name_or_path == "org/t"
    assert config.rope_parameters["rope_theta"] == ROPE_THETA and config.rms_norm_eps == EPS
    assert config.attention_bias == (kind == "jakiro_qkv_bias")
    head = (config.num_experts, config.contrastive_head, config.expert_intermediate_size)
    assert head == ((1, False, EAGLE_WIDTH) if kind == "eagle" else (2, True, H))
    saved = load_file(tmp_path / "converted" / "model.safetensors")
    assert not any("embed" in name for name in saved)  # the target's embeddings are borrowed, never stored

    target = tiny_target(target_type or "llama")
    draft.bind_target(target)
    input_ids = torch.randint(0, VOCAB, (1, 12))
    features = torch.randn(1, 12, H)
    with torch.no_grad():
        out = draft(input_ids=input_ids, hidden_states=features)
    left, right, first = reference(tensors, target.get_input_embeddings().weight.detach(), input_ids, features)
    torch.testing.assert_close(out.last_hidden_state, left, atol=1e-5, rtol=1e-5)
    if kind == "eagle":
        assert out.contrastive_hidden_state is None
    else:
        assert first.any() and (~first).any()  # both branches of the contrastive head are exercised
        torch.testing.assert_close(out.contrastive_hidden_state, right, atol=1e-5, rtol=1e-5)


def test_keeps_checkpoint_dtype_and_writes_card(tmp_path):
    src = write_checkpoint(tmp_path / "src", original_config("jakiro"), original_tensors("jakiro", torch.float16))
    draft = convert_checkpoint(src, str(tmp_path / "out"), target_name_or_path="lmsys/vicuna-7b-v1.3")
    assert draft.fc.weight.dtype == torch.float16
    assert load_file(tmp_path / "out" / "model.safetensors")["fc.weight"].dtype == torch.float16
    assert "base_model: lmsys/vicuna-7b-v1.3" in (tmp_path / "out" / "README.md").read_text()


def _convert_error(tmp_path, config=None, tensors=None, fmt="safetensors") -> str:
    config, tensors = config or original_config("jakiro"), tensors or original_tensors("jakiro")
    src = write_checkpoint(tmp_path / "src", config, tensors, fmt)
    with pytest.raises(ValueError) as info:
        convert_checkpoint(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written
    return str(info.value)


def test_unknown_tensor(tmp_path):
    tensors = original_tensors("jakiro")
    tensors["layers.1.self_attn.q_proj.weight"] = torch.zeros(H, H)
    message = _convert_error(tmp_path, tensors=tensors)
    assert "layers.1.self_attn.q_proj.weight" in message and "not part of a Jakiro/EAGLE draft layer" in message


def test_wrong_shape(tmp_path):
    tensors = original_tensors("jakiro")
    tensors["layers.0.self_attn.k_proj.weight"] = torch.zeros(H, H)  # as if num_key_value_heads were 4
    message = _convert_error(tmp_path, tensors=tensors)
    assert "layers.0.self_attn.k_proj.weight has shape [32, 32], expected [16, 32]" in message
    assert "num_key_value_heads=2" in message


def test_missing_tensor_named_as_in_the_checkpoint(tmp_path):
    tensors = original_tensors("eagle")
    del tensors["layers.0.mlp.down_proj.weight"]
    message = _convert_error(tmp_path, config=original_config("eagle"), tensors=tensors)
    assert "lacks ['layers.0.mlp.down_proj.weight']" in message


def test_input_layernorm_refused(tmp_path):
    tensors = original_tensors("jakiro")
    tensors["layers.0.input_layernorm.weight"] = torch.ones(H)
    assert "has no input norm" in _convert_error(tmp_path, tensors=tensors)


def test_fc_bias_config_disagreement(tmp_path):
    tensors = original_tensors("jakiro")
    del tensors["fc.bias"]
    assert "bias=True but the weights lack fc.bias" in _convert_error(tmp_path, tensors=tensors)


def test_bin_is_read_with_weights_only(tmp_path):
    tensors = original_tensors("jakiro")
    tensors["payload"] = torch.nn.Linear(2, 2)  # a pickled object, not a tensor: weights_only refuses it
    assert "could not be read as plain tensors" in _convert_error(tmp_path, tensors=tensors, fmt="bin")


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        convert_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        convert_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps(original_config("jakiro")))
    with pytest.raises(ValueError, match="neither model.safetensors nor pytorch_model.bin"):
        convert_checkpoint(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--out is the source directory"):
        convert_checkpoint(str(tmp_path / "empty"), str(tmp_path / "empty"))


def test_cli(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", original_config("eagle"), original_tensors("eagle"), "bin")
    out = tmp_path / "out"
    code = main(["convert", src, "--out", str(out), "--target-model-type", "llama", "--target-name-or-path", "a/b"])
    assert code == 0
    assert "Converted the EAGLE draft" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["target_name_or_path"]) == ("jakiro", 1, "a/b")
    assert {"model.safetensors", "modeling_jakiro.py", "configuration_jakiro.py"} <= set(os.listdir(out))

    assert main(["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "jakiro convert: error:" in capsys.readouterr().err
