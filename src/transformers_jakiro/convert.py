"""Convert original Jakiro (github haiduo/Jakiro) and EAGLE-1/2 draft checkpoints into `JakiroDraftModel` checkpoints.

An original checkpoint is a directory with a Llama-style `config.json` (plus `num_local_experts` / `bias` for Jakiro)
and one weight file, `model.safetensors` or `pytorch_model.bin`, holding
    fc.weight [H, 2H], fc.bias                              (bias unless the checkpoint was trained without it)
    layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v bias)  (bias on Qwen2-style targets)
    layers.0.post_attention_layernorm.weight
    Jakiro: layers.0.mlp_moe.gate.weight [4, H], layers.0.mlp_moe.experts.{0,1}.{gate,up,down}_proj.weight
    EAGLE:  layers.0.mlp.{gate,up,down}_proj.weight          (one dense MLP -> a one-expert head, no contrastive head)
    embed_tokens.weight                                      (optional: dropped, the draft borrows the target's)

    jakiro convert path/to/EAGLE-Vicuna-7B --out vicuna-7b-draft --target-name-or-path lmsys/vicuna-7b-v1.3
"""

import json
import os
import pickle
from typing import NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .configuration_jakiro import JakiroConfig
from .modeling_jakiro import JakiroDraftModel

_LAYER = "layers.0."


def _fail(problem: str, fix: str) -> NoReturn:
    raise ValueError(f"{problem} {fix}")


def _read_checkpoint(src_dir: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config.json as a dict, tensors by original name, weight file path)."""
    if not os.path.isdir(src_dir):
        _fail(f"{src_dir} is not a directory.", "Pass the directory of the original Jakiro/EAGLE checkpoint.")
    config_path = os.path.join(src_dir, "config.json")
    if not os.path.isfile(config_path):
        _fail(
            f"{src_dir} has no config.json.",
            "Put the draft's config.json (the Llama-style config shipped with the checkpoint) next to its weights.",
        )
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    safetensors_path = os.path.join(src_dir, "model.safetensors")
    bin_path = os.path.join(src_dir, "pytorch_model.bin")
    if os.path.isfile(safetensors_path):
        try:
            return config, load_file(safetensors_path), safetensors_path
        except SafetensorError as error:
            _fail(f"{safetensors_path} is corrupt or truncated ({error}).", "Download the checkpoint again.")
    if os.path.isfile(bin_path):
        try:
            # weights_only: a pickle may carry code; this loader only accepts tensors and plain containers.
            state = torch.load(bin_path, weights_only=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
            _fail(
                f"{bin_path} could not be read as plain tensors ({error}).",
                "It is corrupt or holds pickled objects besides tensors; re-save its state dict with safetensors.",
            )
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            _fail(f"{bin_path} is not a flat dict of tensors.", "Save the draft's state_dict() itself, not a wrapper.")
        return config, state, bin_path
    _fail(
        f"{src_dir} holds neither model.safetensors nor pytorch_model.bin (found: {sorted(os.listdir(src_dir))}).",
        "Sharded checkpoints are not supported: a draft head is one file; merge the shards into one.",
    )


def _our_name(name: str) -> str | None:
    """Our parameter name for an original one, or None if the name is not part of a Jakiro/EAGLE draft layer."""
    if name in ("fc.weight", "fc.bias"):
        return name
    if not name.startswith(_LAYER):
        return None
    rest = name[len(_LAYER) :]
    if rest.startswith(("self_attn.", "post_attention_layernorm.")):
        return "layer." + rest
    if rest.startswith("mlp_moe."):  # Jakiro: gate + experts.N
        return "layer.moe." + rest[len("mlp_moe.") :]
    if rest.startswith("mlp."):  # EAGLE: one dense MLP is a one-expert MoE
        return "layer.moe.experts.0." + rest[len("mlp.") :]
    return None


def _original_name(ours: str, dense: bool) -> str:
    """The inverse of `_our_name`, to report missing tensors under the names the checkpoint should have."""
    if ours.startswith("fc."):
        return ours
    rest = ours[len("layer.") :]
    if rest.startswith("moe."):
        rest = "mlp." + rest[len("moe.experts.0.") :] if dense else "mlp_moe." + rest[len("moe.") :]
    return _LAYER + rest


def _build_config(raw: dict, tensors: dict, target_model_type, target_name_or_path) -> JakiroConfig:
    for key in ("hidden_size", "num_attention_heads", "vocab_size"):
        if key not in raw:
            _fail(f"config.json has no `{key}`.", "Use the config.json that was shipped with these weights.")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    is_jakiro = any(name.startswith(_LAYER + "mlp_moe.") for name in tensors)
    # Expert width comes from the weights: the reference Jakiro code builds experts of width H whatever
    # `intermediate_size` its (copied) config says, while EAGLE uses the config's width.
    up = tensors.get(_LAYER + ("mlp_moe.experts.0." if is_jakiro else "mlp.") + "up_proj.weight")
    gate = tensors.get(_LAYER + "mlp_moe.gate.weight")
    fc_bias = "fc.bias" in tensors
    if "bias" in raw and bool(raw["bias"]) != fc_bias:
        _fail(
            f"config.json says bias={raw['bias']} but the weights {'have' if fc_bias else 'lack'} fc.bias.",
            "The config does not belong to these weights; use the config.json shipped with them.",
        )
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})  # old configs: rope_scaling + theta
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    num_experts = raw.get("num_local_experts", 2) if is_jakiro else 1
    return JakiroConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        attention_bias=_LAYER + "self_attn.q_proj.bias" in tensors,
        hidden_act=raw.get("hidden_act", "silu"),
        vocab_size=raw["vocab_size"],
        # The reference two-expert forward runs both experts whatever num_experts_per_tok says.
        num_experts=num_experts,
        num_experts_per_tok=num_experts,
        expert_intermediate_size=up.shape[0] if up is not None else raw.get("intermediate_size", hidden),
        fc_bias=fc_bias,
        contrastive_head=is_jakiro and (gate is None or gate.shape[0] == 4),
        target_model_type=target_model_type or raw.get("model_type") or "llama",
        target_name_or_path=target_name_or_path,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def convert_checkpoint(
    src_dir: str, out_dir: str, target_model_type: str | None = None, target_name_or_path: str | None = None
) -> JakiroDraftModel:
    """Convert the original Jakiro/EAGLE checkpoint in `src_dir` and save it (safetensors) to `out_dir`.

    `target_model_type` defaults to config.json's `model_type`, else "llama"; `target_name_or_path` is recorded in
    the config (and the model card's `base_model`). Returns the converted draft, not yet bound to a target.
    """
    if os.path.abspath(src_dir) == os.path.abspath(out_dir):
        _fail("--out is the source directory.", "Write the converted draft to a new directory.")
    raw, tensors, weights_path = _read_checkpoint(src_dir)
    if _LAYER + "input_layernorm.weight" in tensors:
        _fail(
            f"{weights_path} has layers.0.input_layernorm.weight, but a Jakiro/EAGLE draft layer has no input norm.",
            "This is not a Jakiro/EAGLE-1/2 draft head (EAGLE-3 heads are not supported).",
        )
    renamed, original, unknown = {}, {}, []
    for name, tensor in tensors.items():
        if name == "embed_tokens.weight" or name.endswith("rotary_emb.inv_freq"):
            continue  # the draft borrows the target's embeddings; RoPE frequencies are rebuilt from the config
        ours = _our_name(name)
        if ours is None:
            unknown.append(name)
        else:
            renamed[ours], original[ours] = tensor, name
    if unknown:
        _fail(
            f"{weights_path} has tensors that are not part of a Jakiro/EAGLE draft layer: {sorted(unknown)}.",
            "Only one-layer Jakiro and EAGLE-1/2 draft heads can be converted.",
        )
    draft = JakiroDraftModel(_build_config(raw, tensors, target_model_type, target_name_or_path))
    expected = draft.state_dict()
    missing = sorted(set(expected) - set(renamed))
    if missing:
        missing = [_original_name(name, dense=draft.config.num_experts == 1) for name in missing]
        _fail(f"{weights_path} lacks {missing}.", "The checkpoint is incomplete; download it again.")
    extra = sorted(original[name] for name in set(renamed) - set(expected))
    if extra:
        _fail(
            f"{weights_path} has tensors this head's config does not use: {extra}.",
            "Check that config.json (num_local_experts) matches the weights; o_proj biases are not supported.",
        )
    config = draft.config
    for name, tensor in renamed.items():
        if tensor.shape != expected[name].shape:
            _fail(
                f"{original[name]} has shape {list(tensor.shape)}, expected {list(expected[name].shape)} for "
                f"hidden_size={config.hidden_size}, num_attention_heads={config.num_attention_heads}, "
                f"num_key_value_heads={config.num_key_value_heads}, head_dim={config.head_dim}, "
                f"expert width {config.expert_intermediate_size}.",
                "config.json or the weights are not from the same checkpoint; use the files shipped together.",
            )
    draft = draft.to(renamed["fc.weight"].dtype)  # keep the checkpoint's precision (fp16/bf16 as released)
    draft.load_state_dict(renamed, strict=True)
    draft.save_pretrained(out_dir)
    return draft


def add_cli(subparsers):
    parser = subparsers.add_parser(
        "convert",
        help="convert an original Jakiro or EAGLE-1/2 draft checkpoint",
        description="Convert an original Jakiro or EAGLE-1/2 draft checkpoint (config.json + pytorch_model.bin or "
        "model.safetensors) into a safetensors JakiroDraftModel that AutoModel.from_pretrained loads.",
    )
    parser.add_argument("source", help="directory of the original checkpoint")
    parser.add_argument("--out", required=True, help="directory to write the converted draft to")
    parser.add_argument("--target-model-type", default=None, help="target family (default: config.json's, or llama)")
    parser.add_argument("--target-name-or-path", default=None, help="the target model's Hub id or path, for the card")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    draft = convert_checkpoint(args.source, args.out, args.target_model_type, args.target_name_or_path)
    config = draft.config
    kind = "Jakiro" if config.num_experts == 2 else "EAGLE"
    print(
        f"Converted the {kind} draft in {args.source} to {args.out} ({config.num_experts} expert(s), "
        f"contrastive head: {'yes' if config.contrastive_head else 'no'}, target: {config.target_model_type})."
    )
    return 0


__all__ = ["convert_checkpoint", "add_cli"]
