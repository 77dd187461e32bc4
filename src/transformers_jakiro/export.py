"""`jakiro export HEAD OUT --format vllm`: a Jakiro head as the folder vLLM's EAGLE-3 speculative decoding loads.

OUT holds `config.json` (a Llama-style config naming the architecture `JakiroForCausalLMEagle3`, which the package's
vLLM plugin registers, with the head's own fields under "jakiro"), `model.safetensors` (the head's weights under the
names `vllm_model.py` reads, plus the target's final-norm weight: vLLM hands the drafter the last decoder layer's
output before that norm) and `speculative_config.json`, the dict to pass as vLLM's `speculative_config`:

    vllm serve <target> --speculative-config "$(cat OUT/speculative_config.json)"
    LLM(model=<target>, speculative_config=json.load(open("OUT/speculative_config.json")))

The target (default: the head's `target_name_or_path`; a registry target's Hub id resolves to its PyPI-shipped copy)
is read for its config and one tensor, the final norm's weight; it is never loaded whole.
"""

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .modeling_jakiro import JakiroDraftModel

VLLM_ARCHITECTURE = "JakiroForCausalLMEagle3"
# vLLM's EAGLE-3 proposer drafts a chain this long per step unless told otherwise (measured: docs/experiments/vllm.md).
DEFAULT_CHAIN = 3


def _final_norm(target_dir: Path):
    """(the target's config, its final norm's weight name, a CPU copy of that norm module without weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module) or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(
            f"{type(target).__name__} has no final norm at `{type(decoder).__name__}.norm`: the vLLM export supports "
            "Llama-style targets (Llama, Qwen2, Mistral, ...), whose last decoder layer feeds one RMSNorm."
        )
    name = next(n for n, module in target.named_modules() if module is norm) + ".weight"
    return target, name, copy.deepcopy(norm).to_empty(device="cpu")


def _read_tensor(directory: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint (single file or sharded with an index), without loading the rest."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        if name not in weight_map:
            raise ValueError(f"{directory} has no tensor {name!r} (its index lists {len(weight_map)} others).")
        path = directory / weight_map[name]
    else:
        path = directory / "model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{directory} holds no safetensors weights (model.safetensors or its index).")
    with safe_open(str(path), framework="pt") as f:
        if name not in f.keys():
            raise ValueError(f"{path} has no tensor {name!r}.")
        return f.get_tensor(name)


def _check_rms_norm(norm: torch.nn.Module, weight: torch.Tensor, eps: float) -> None:
    """vLLM's drafter applies weight * x / rms(x) to the last layer's output; refuse a target whose norm differs."""
    norm.weight.data.copy_(weight.float())
    norm.float()
    x = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0))
    expected = norm(x)
    ours = weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if not torch.allclose(expected, ours, rtol=1e-4, atol=1e-5):
        raise ValueError(
            f"The target's final norm ({type(norm).__name__}) is not weight * x / rms(x) with eps {eps}: the vLLM "
            "export supports targets whose final norm is a plain RMSNorm (Llama, Qwen2, Mistral, ...)."
        )


def vllm_state_dict(draft: JakiroDraftModel, target_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The head's tensors under the names `vllm_model.JakiroForCausalLMEagle3` loads."""
    renamed = {"model.target_norm.weight": target_norm}
    for name, tensor in draft.state_dict().items():
        if name == "d2t" or name.startswith("lm_head."):
            new = name
        elif name.startswith("layer.moe."):
            new = "model.layers.0." + name[len("layer.moe."):]
        elif name.startswith("layer."):
            new = "model.layers.0." + name[len("layer."):]
        else:
            new = "model." + name
        renamed[new] = tensor.detach().contiguous().clone()
    return renamed


def export_vllm(head, out, target=None, num_speculative_tokens: int = DEFAULT_CHAIN) -> dict:
    """Write the vLLM folder for `head` (a head directory or Hub id) to `out`; returns the speculative config."""
    from .targets import plain_directory

    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
    draft = JakiroDraftModel.from_pretrained(head)
    config = draft.config
    target = target or config.target_name_or_path
    if not target:
        raise ValueError(f"{head} names no target (target_name_or_path): pass --target <registry name | dir | Hub id>.")
    target_dir, _ = plain_directory(target)
    meta_target, norm_name, norm = _final_norm(target_dir)
    draft.bind_target(meta_target)  # hidden size, vocabulary, layers and model type, with the usual clear error
    text = meta_target.config.get_text_config(decoder=True)
    weight = _read_tensor(target_dir, norm_name)
    _check_rms_norm(norm, weight, config.rms_norm_eps)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(vllm_state_dict(draft, weight), str(out / "model.safetensors"), metadata={"format": "pt"})
    jakiro = {
        key: getattr(config, key)
        for key in ("num_experts", "expert_intermediate_size", "fc_bias", "contrastive_head", "draft_vocab_size",
                    "target_feature_layers")
    }
    jakiro["target"] = {"name_or_path": config.target_name_or_path or str(target), "hidden_size": text.hidden_size,
                        "vocab_size": text.vocab_size, "num_hidden_layers": text.num_hidden_layers}
    vllm_config = {
        "architectures": [VLLM_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.expert_intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": config.rope_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "dtype": str(config.dtype).removeprefix("torch.") if config.dtype is not None else "float32",
        # vLLM's id k is the output of decoder layer k - 1; the last id is the last layer's (before the final norm).
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.target_feature_layers] + [text.num_hidden_layers],
        "jakiro": jakiro,
    }
    (out / "config.json").write_text(json.dumps(vllm_config, indent=2) + "\n")
    speculative = {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": num_speculative_tokens}
    (out / "speculative_config.json").write_text(json.dumps(speculative, indent=2) + "\n")
    return speculative


def add_cli(subparsers):
    parser = subparsers.add_parser(
        "export",
        help="write a head in the layout another engine loads (vLLM)",
        description="Write a Jakiro head as the folder vLLM's EAGLE-3 speculative decoding loads (with the package's "
        "vLLM plugin installed: pip install 'transformers-jakiro[vllm]'), and OUT/speculative_config.json, the "
        "dict to pass as vLLM's speculative_config.",
    )
    parser.add_argument("head", help="the head: a directory or Hub id")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--format", choices=["vllm"], default="vllm", help="the layout to write (vllm)")
    parser.add_argument("--target", default=None,
                        help="the target (registry name, directory, .gguf or Hub id; default: the head's own)")
    parser.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_CHAIN,
                        help=f"draft chain length written into speculative_config.json (default {DEFAULT_CHAIN})")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    speculative = export_vllm(args.head, args.out, args.target, args.num_speculative_tokens)
    print(f"Wrote {args.out}. Serve it with the target:\n"
          f"  vllm serve <target> --speculative-config '{json.dumps(speculative)}'")
    return 0


__all__ = ["export_vllm", "vllm_state_dict", "add_cli"]
