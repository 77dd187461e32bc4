"""The Jakiro draft head as a vLLM model, for vLLM's EAGLE-3 speculative decoding (`method: "eagle3"`).

vLLM imports this module only through the plugin (`vllm_plugin.register`, entry point `vllm.general_plugins`), and
only in its own processes; nothing else in the package imports vllm. The folder it loads is written by
`jakiro export HEAD OUT --format vllm` (`export.py`), which also writes the `speculative_config` to pass.

How the head maps onto vLLM's EAGLE-3 proposer (vllm 0.32, `v1/spec_decode/llm_base_proposer.py`):
  * The target hands the drafter the outputs of the decoder layers named in `eagle_aux_hidden_state_layer_ids`
    (vLLM's id k is the output of decoder layer k - 1, taken before the final norm). The export asks for the head's
    fused layers (`target_feature_layers`, each + 1) and for the last layer (id = number of target layers).
    `combine_hidden_states` applies the target's final norm (its weight is copied into the export) to the last one,
    which gives f_t, the vector the head reads, and adds the fused layers as `JakiroDraftModel.fuse_features` does.
  * `forward` is the head's own data flow (fc over [embedding; feature], attention without an input norm, the
    two-expert MoE) and returns (left, left): the left head's feature both gives the draft token's logits and is the
    feature the next chain step reads, as the deeper tree levels do in transformers-jakiro.
  * The reduced vocabulary: `d2t` holds target ids (not EAGLE-3's offsets); draft logits are scattered into the
    target's vocabulary, -inf elsewhere, so vLLM's probabilistic drafting sees target ids.
What vLLM's proposer cannot take: a tree (it drafts a chain, `num_speculative_tokens` long) and the contrastive
right head (it runs one draft forward per chain token, so the two-ahead prediction that saves the last forward in
transformers-jakiro has no place). README's vLLM section gives the measured cost of both.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

# Checkpoint names of the separate q/k/v and gate/up projections -> vLLM's fused parameter and its shard.
_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


def check_target(jakiro: dict, target_config) -> None:
    """Raise a clear error when the vLLM target is not the model this head was exported for."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    expected = jakiro["target"]
    problems = []
    for field, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size"),
                        ("num_hidden_layers", "number of decoder layers")):
        have = getattr(text, field, None)
        if have != expected[field]:
            problems.append(f"{what}: the head expects {expected[field]}, the target has {have}")
    if problems:
        raise ValueError(
            f"This Jakiro head was exported for {expected.get('name_or_path') or 'another target'}, not for the model "
            f"vLLM is serving ({'; '.join(problems)}). Serve the head with its own target, or export the head trained "
            "for this target: jakiro export HEAD OUT --format vllm --target <this target>."
        )


class JakiroVllmDecoderLayer(nn.Module):
    """Attention without an input norm (the fc output feeds it), post-attention norm, the two-expert MoE."""

    def __init__(self, config, jakiro: dict, prefix: str):
        super().__init__()
        h = config.hidden_size
        self.contrastive = jakiro["contrastive_head"]
        self.self_attn = LlamaAttention(
            config=config, hidden_size=h, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
            bias=config.attention_bias, bias_o_proj=False, prefix=f"{prefix}.self_attn",
        )
        self.post_attention_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.experts = nn.ModuleList(
            LlamaMLP(h, jakiro["expert_intermediate_size"], config.hidden_act, prefix=f"{prefix}.experts.{i}")
            for i in range(jakiro["num_experts"])
        )
        self.gate = None
        if jakiro["num_experts"] == 2:
            self.gate = ReplicatedLinear(h, 4 if self.contrastive else 2, bias=False, return_bias=False,
                                         prefix=f"{prefix}.gate")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions=positions, hidden_states=hidden_states)
        normed = self.post_attention_layernorm(hidden_states)
        if self.gate is None:
            return hidden_states + self.experts[0](normed)
        # The left (mixture) output only: the contrastive right one has no use in a chain (module docstring).
        w = F.softmax(self.gate(normed)[..., :2], dim=-1, dtype=torch.float32).to(normed.dtype)
        return hidden_states + w[..., :1] * self.experts[0](normed) + w[..., 1:] * self.experts[1](normed)


class JakiroVllmModel(nn.Module):
    def __init__(self, config, jakiro: dict, start_layer_id: int, prefix: str):
        super().__init__()
        h, fused = config.hidden_size, len(jakiro["target_feature_layers"])
        # Replaced by the target's embedding when the proposer loads the head (the export holds none).
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix=maybe_prefix(prefix, "embed_tokens"))
        self.target_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.feature_norms = nn.ModuleList(RMSNorm(h, eps=config.rms_norm_eps) for _ in range(fused))
        self.feature_fusion = (
            ReplicatedLinear(fused * h, h, bias=False, return_bias=False, prefix=maybe_prefix(prefix, "feature_fusion"))
            if fused else None
        )
        self.fc = ReplicatedLinear(2 * h, h, bias=jakiro["fc_bias"], return_bias=False, prefix=maybe_prefix(prefix, "fc"))
        # vLLM names a layer's KV cache by its index: start after the target's layers, as EAGLE-3 heads do.
        self.layers = nn.ModuleList(
            [JakiroVllmDecoderLayer(config, jakiro, prefix=maybe_prefix(prefix, f"layers.{start_layer_id}"))]
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[tokens, (fused + 1) * hidden] target layer outputs (fused layers, then the last, before the final
        norm) -> the head's input feature f_t (+ the fusion of the named layers)."""
        *layers, last = aux_hidden_states.chunk(len(self.feature_norms) + 1, dim=-1)
        feature = self.target_norm(last)
        if self.feature_fusion is not None:
            feature = feature + self.feature_fusion(torch.cat([n(x) for n, x in zip(self.feature_norms, layers)], -1))
        return feature

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        x = self.fc(torch.cat([inputs_embeds.to(hidden_states.dtype), hidden_states], dim=-1))
        left = self.layers[0](positions, x)
        return left, left


class JakiroForCausalLMEagle3(Eagle3LlamaForCausalLM):
    """A Jakiro head in vLLM's EAGLE-3 proposer (which accepts only EAGLE-3 model classes, hence the base class;
    none of its layers are used)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.speculative_config.draft_model_config.hf_config
        jakiro = getattr(config, "jakiro", None)
        if not isinstance(jakiro, dict):
            raise ValueError(
                "This vLLM draft folder has no 'jakiro' section in its config.json: write it with "
                "`jakiro export HEAD OUT --format vllm`."
            )
        check_target(jakiro, vllm_config.model_config.hf_config)
        self.config = config
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.model = JakiroVllmModel(config, jakiro, target_layers, maybe_prefix(prefix, "model"))
        self.draft_vocab_size = jakiro["draft_vocab_size"] or config.vocab_size
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.draft_vocab_size)
        reduced = torch.arange(self.draft_vocab_size) if jakiro["draft_vocab_size"] else None
        self.register_buffer("draft_id_to_target_id", reduced, persistent=False)  # target ids, not offsets
        self.use_parallel_drafting = False
        self.has_own_embed_tokens = False  # the head borrows the target's embedding and, without d2t, its lm_head
        self.has_own_lm_head = bool(jakiro["draft_vocab_size"])

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        return self.model.embed_input_ids(input_ids)

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.features(hidden_states)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if self.draft_id_to_target_id is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_id_to_target_id] = logits
        return full

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        top = self.logits_processor.get_top_tokens(self.lm_head, hidden_states)
        return top if self.draft_id_to_target_id is None else self.draft_id_to_target_id[top]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name == "d2t":
                if self.draft_id_to_target_id is None:
                    raise ValueError("The export holds a d2t map but its config has no draft_vocab_size.")
                self.draft_id_to_target_id.copy_(weight.to(torch.long))
                loaded.add(name)
                continue
            for fused, part, shard in _STACKED:
                if part in name:
                    name = name.replace(part, fused)
                    param = params[name]
                    param.weight_loader(param, weight, shard)
                    break
            else:
                if name not in params:
                    raise ValueError(f"Unexpected weight {name!r} in the exported Jakiro head.")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(name)
            if name.startswith("lm_head"):
                self.has_own_lm_head = True
        missing = {n for n in params if not n.startswith(("model.embed_tokens", "lm_head"))} - loaded
        if missing:
            raise ValueError(f"The exported Jakiro head lacks weights: {sorted(missing)}. Export it again.")
        return loaded | {n for n in params if n.startswith("model.embed_tokens")}
