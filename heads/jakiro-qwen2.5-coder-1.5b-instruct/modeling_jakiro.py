"""The Jakiro draft head: one decoder layer with a two-expert MoE block, reading the target's last hidden states.

Read top to bottom: RMSNorm, RoPE, attention, one expert (SwiGLU), the MoE block with its left (mixture) and right
(contrastive) outputs, the decoder layer, and the `PreTrainedModel` that fuses the token embedding with the target
feature. This file imports only torch and transformers so that `trust_remote_code=True` loads work without the
package installed.

Data flow at draft position t (docs/design.md, section 1):
    u_t   = fc([embed(x_{t+1}); f_t])                   f_t: target's last (post-norm) hidden state at t
    a_t   = u_t + Attention(u_t)                        no input norm
    h_t   = RMSNorm(a_t)
    left  = a_t + softmax(g0, g1) . (E0(h_t), E1(h_t))  ~ f_{t+1}   -> target lm_head -> x_{t+2}
    right = a_t + w_hi E_hi(h_t) - w_lo E_lo(h_t)       ~ f_{t+2}   -> target lm_head -> x_{t+3}
where g = gate(h_t) has four logits, (g0, g1) route the left head and (g2, g3) the right one; E_hi is the expert
whose right-gate logit is strictly larger (expert 1 on ties, as in the reference implementation).

With `config.target_feature_layers` (EAGLE-3-style fusion) the draft also reads those decoder layers' outputs l^i_t:
f_t above becomes f_t + W [RMSNorm(l^1_t); ...; RMSNorm(l^n_t)], with W (`feature_fusion`) starting at zero, so a
fused head starts as the last-hidden-state head it may be warm-started from. Deeper tree levels read the draft's own
predicted features, which skip the fusion as they skip the target: they stand in for f_t, and the fusion only adds
to f_t (a full linear map of [l; f_t] would also re-map f_t, which `fc` already does, and move the first level's input
away from what the deeper levels read).
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_jakiro import JakiroConfig


@dataclass
class JakiroDraftOutput(ModelOutput):
    """`last_hidden_state`: left-head features (predict the next target feature), shape [batch, kept, hidden].
    `contrastive_hidden_state`: right-head features (two ahead), or None without the contrastive head.
    `cache`: the draft's own KV cache, updated in place."""

    last_hidden_state: torch.FloatTensor | None = None
    contrastive_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None


class JakiroRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class JakiroRotaryEmbedding(nn.Module):
    """RoPE with the target's parameters; scaled variants (llama3, yarn, linear, ...) come from transformers."""

    def __init__(self, config: JakiroConfig):
        super().__init__()
        self.config = config  # kept to recompute the table when the module is materialised from the meta device
        inv_freq, self.attention_scaling = self.compute_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def compute_inv_freq(config: JakiroConfig, device=None) -> tuple[torch.Tensor, float]:
        """(float32 inverse frequencies, attention scaling) for the config's RoPE type."""
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            base = config.rope_parameters["rope_theta"]
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
            return 1.0 / (base**exponents), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
        return inv_freq.float(), scaling

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` casts floating buffers too; bf16 frequencies are off by up to 0.2%, which shifts
        # rotations by a fraction of a radian a few hundred positions away. Follow device moves, stay float32.
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.is_meta:
            self.inv_freq = torch.empty_like(self.inv_freq, dtype=torch.float32)
        elif inv_freq.is_meta:
            # Materialised from the meta device (`to_empty()` after `init_empty_weights`): there are no values to keep
            # and the table is not in any checkpoint, so compute it again where the module now lives.
            self.inv_freq = self.compute_inv_freq(self.config, device=self.inv_freq.device)[0]
        else:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [batch, 1, seq, head_dim]: broadcast over heads
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# Grouped-query attention inside SDPA (torch >= 2.5): key/value heads are shared by their query heads without
# copying the whole KV cache `num_heads // num_kv_heads` times, as `repeat_interleave` does, at every draft level.
_SDPA_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


class JakiroAttention(nn.Module):
    """Multi-head attention with the target's head layout (GQA included), RoPE, an additive mask or causal."""

    def __init__(self, config: JakiroConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, hidden_states, cos, sin, attention_mask, cache: Cache | None = None):
        """`attention_mask`: an additive [batch, 1, seq, keys] mask, or None for causal attention over an empty cache
        (or a single query, which sees every key): SDPA's own causal path, no [seq, seq] mask in memory."""
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        grouped = {}
        if self.num_kv_heads != self.num_heads:
            if _SDPA_GQA:
                grouped = {"enable_gqa": True}
            else:  # older torch: copy each key/value head for its query heads
                k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
                v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        mask = None if attention_mask is None else attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1, **grouped)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class JakiroExpert(nn.Module):
    """One expert: a SwiGLU MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class JakiroMoE(nn.Module):
    """Two experts, both active. Returns (left, right): the softmax mixture and the contrastive difference.

    With one expert (converted EAGLE heads) there is no gate and the block is a dense MLP without a right output.
    """

    def __init__(self, config: JakiroConfig):
        super().__init__()
        self.contrastive = config.contrastive_head
        self.experts = nn.ModuleList(
            JakiroExpert(config.hidden_size, config.expert_intermediate_size, config.hidden_act)
            for _ in range(config.num_experts)
        )
        self.gate = None
        if config.num_experts == 2:
            self.gate = nn.Linear(config.hidden_size, 4 if self.contrastive else 2, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.gate is None:
            return self.experts[0](x), None
        logits = self.gate(x)
        e0, e1 = self.experts[0](x), self.experts[1](x)
        w = F.softmax(logits[..., :2], dim=-1, dtype=torch.float32).to(x.dtype)
        left = w[..., :1] * e0 + w[..., 1:] * e1
        if not self.contrastive:
            return left, None
        r = F.softmax(logits[..., 2:], dim=-1, dtype=torch.float32).to(x.dtype)
        # +(w0 E0 - w1 E1) when expert 0 is strictly preferred, else +(w1 E1 - w0 E0).
        sign = torch.where(logits[..., 2:3] > logits[..., 3:4], 1.0, -1.0).to(x.dtype)
        right = sign * (r[..., :1] * e0 - r[..., 1:] * e1)
        return left, right


class JakiroDecoderLayer(nn.Module):
    """Attention without an input norm (the fc output feeds it directly), post-attention norm, MoE, residuals."""

    def __init__(self, config: JakiroConfig):
        super().__init__()
        self.self_attn = JakiroAttention(config)
        self.post_attention_layernorm = JakiroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.moe = JakiroMoE(config)

    def forward(self, hidden_states, cos, sin, attention_mask, cache=None, features_to_keep: int = 0):
        hidden_states = hidden_states + self.self_attn(hidden_states, cos, sin, attention_mask, cache)
        if features_to_keep:  # the KV of every position is cached; only the last few need the MoE
            hidden_states = hidden_states[:, -features_to_keep:]
        left, right = self.moe(self.post_attention_layernorm(hidden_states))
        return hidden_states + left, (hidden_states + right) if right is not None else None


class JakiroPreTrainedModel(PreTrainedModel):
    config_class = JakiroConfig
    config: JakiroConfig
    base_model_prefix = "jakiro"
    main_input_name = "input_ids"
    _no_split_modules = ["JakiroDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, JakiroDraftModel) and module.d2t is not None:
            module.d2t.copy_(torch.arange(module.d2t.numel(), device=module.d2t.device))
        if module is getattr(self, "feature_fusion", None):
            module.weight.zero_()  # adds nothing until training finds what the other layers hold
        if isinstance(module, JakiroRotaryEmbedding):  # not in the checkpoint: from_pretrained leaves it uninitialised
            with torch.device(module.inv_freq.device):
                module.inv_freq.copy_(JakiroRotaryEmbedding(self.config).inv_freq)


def causal_mask(query_len: int, past_len: int, dtype: torch.dtype, device, padding_mask=None) -> torch.Tensor:
    """Additive [batch or 1, 1, query_len, past_len + query_len] mask: 0 where visible, dtype-min elsewhere.

    `padding_mask` (optional, [batch, past_len + query_len], 1 = real token) hides padded keys.
    """
    q = torch.arange(query_len, device=device)[:, None] + past_len
    k = torch.arange(past_len + query_len, device=device)[None, :]
    visible = (k <= q)[None, None]
    if padding_mask is not None:
        visible = visible & padding_mask[:, None, None, :].bool()
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)


class JakiroDraftModel(JakiroPreTrainedModel):
    """A Jakiro draft head. Bind it to its target (`bind_target`) to borrow the target's embeddings and lm_head;
    those are never stored in the draft checkpoint. With `config.draft_vocab_size` set, the head owns a reduced
    lm_head over the most frequent target tokens and `d2t` maps its ids back to target ids."""

    def __init__(self, config: JakiroConfig):
        super().__init__(config)
        h, fused = config.hidden_size, len(config.target_feature_layers)
        self.feature_norms = nn.ModuleList(JakiroRMSNorm(h, eps=config.rms_norm_eps) for _ in range(fused)) or None
        self.feature_fusion = nn.Linear(fused * h, h, bias=False) if fused else None
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layer = JakiroDecoderLayer(config)
        self.rotary_emb = JakiroRotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.lm_head = None
            self.register_buffer("d2t", None)
        self._target_modules = None  # (embed_tokens, lm_head) of the bound target; a tuple so nn.Module ignores it
        self.last_generation_stats = None
        self.post_init()

    # -- binding to the target ---------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides) -> "JakiroDraftModel":
        """A freshly initialised head shaped for `target` (hidden size, heads, RoPE, vocabulary), bound to it and
        placed beside the target's lm_head in the target's dtype. `overrides` set JakiroConfig fields."""
        config = JakiroConfig.from_target_config(target.config, **overrides)
        lm_head = target.get_output_embeddings()
        draft = cls(config).to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        return draft.bind_target(target)

    def bind_target(self, target: PreTrainedModel) -> "JakiroDraftModel":
        """Borrow `target`'s input embeddings and lm_head after checking that this head was built for it."""
        text = target.config.get_text_config(decoder=True)
        expected = self.config
        problems = []
        if text.hidden_size != expected.hidden_size:
            problems.append(f"hidden size: the draft expects {expected.hidden_size}, the target has {text.hidden_size}")
        if text.vocab_size != expected.vocab_size:
            problems.append(f"vocabulary: the draft expects {expected.vocab_size} tokens, the target has {text.vocab_size}")
        layers = expected.target_feature_layers
        if layers and max(layers) >= getattr(text, "num_hidden_layers", 0) - 1:
            problems.append(
                f"layers: the draft reads the outputs of decoder layers {layers}, the target has "
                f"{getattr(text, 'num_hidden_layers', None)} layers"
            )
        if expected.target_model_type is not None and text.model_type != expected.target_model_type:
            problems.append(
                f"model type: the draft was built for '{expected.target_model_type}', the target is '{text.model_type}'"
            )
        if problems:
            raise ValueError(
                "This Jakiro draft was not built for this target model ("
                + "; ".join(problems)
                + "). Load the draft trained for this target, or create a new one with "
                "JakiroDraftModel.from_target(target) and train it."
            )
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or lm_head is None:
            raise ValueError(f"{type(target).__name__} exposes no input embeddings or lm_head to draft with.")
        self._target_modules = (embed, lm_head)
        return self

    @property
    def is_bound(self) -> bool:
        return self._target_modules is not None

    def _bound(self):
        if self._target_modules is None:
            raise RuntimeError(
                "This Jakiro draft is not bound to a target model: call draft.bind_target(target) first "
                "(generate(..., assistant_model=draft) does this for you)."
            )
        return self._target_modules

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        embed = self._bound()[0]
        return embed(input_ids.to(embed.weight.device)).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the reduced one if configured, else the target's own lm_head)."""
        if self.lm_head is not None:
            return self.lm_head(features)
        lm_head = self._bound()[1]
        return lm_head(features.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)).to(features.device)

    def draft_to_target_ids(self, ids: torch.LongTensor) -> torch.LongTensor:
        return ids if self.d2t is None else self.d2t[ids]

    def in_vocabulary(self, target_ids) -> torch.BoolTensor:
        """Which of `target_ids` (target token ids) the draft vocabulary holds. The draft can never propose the
        others, so their share caps the acceptance of every draft token: a low share calls for a larger
        --draft-vocab."""
        ids = torch.as_tensor(target_ids, dtype=torch.long)
        if self.d2t is None:
            return torch.ones_like(ids, dtype=torch.bool)
        return torch.isin(ids, self.d2t.to(ids.device))

    @property
    def target_feature_width(self) -> int:
        """Width of the target features the draft reads: hidden size x (fused layers + 1)."""
        return self.config.hidden_size * (len(self.config.target_feature_layers) + 1)

    def fuse_features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The draft's [..., hidden] input feature from the target's features ([..., target_feature_width]: the
        named layers' outputs, then the last hidden state) or from its own predicted ones ([..., hidden], kept)."""
        h, width = self.config.hidden_size, hidden_states.shape[-1]
        if width == h:
            return hidden_states
        if width != self.target_feature_width:
            raise ValueError(
                f"The draft reads target features {self.target_feature_width} wide (hidden size {h} x "
                f"{len(self.config.target_feature_layers) + 1}: layers {self.config.target_feature_layers} and the "
                f"last hidden state) or its own features {h} wide, got {width}. Capture them with "
                "transformers_jakiro.features.TargetFeatures(target, draft.config.target_feature_layers)."
            )
        *layers, last = hidden_states.split(h, dim=-1)
        return last + self.feature_fusion(torch.cat([norm(x) for norm, x in zip(self.feature_norms, layers)], -1))

    # -- forward -------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        hidden_states: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        features_to_keep: int = 0,
        **kwargs,
    ) -> JakiroDraftOutput:
        r"""
        input_ids: tokens x_{t+1} (the token *after* each feature's position), [batch, seq].
        hidden_states: the target's last hidden states f_t, [batch, seq, hidden] (with `target_feature_layers`:
            [batch, seq, target_feature_width], those layers' outputs then f_t), or the draft's own predicted ones.
        position_ids: explicit positions (tree nodes of one level share one); default continues the cache.
        attention_mask: a 4D additive float mask [batch, 1, seq, past + seq] (tree masks), a 2D padding mask
            [batch, past + seq] (1 = real token), or None for causal attention.
        cache: the draft's own cache (a transformers `DynamicCache`), updated in place.
        features_to_keep: 0 = return features for every position, k = only the last k (the KV is cached for all).
        """
        if hidden_states is None:
            raise ValueError("JakiroDraftModel needs `hidden_states`: the target's last hidden states.")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        dtype, device = self.fc.weight.dtype, self.fc.weight.device
        hidden_states = self.fuse_features(hidden_states.to(device, dtype))
        x = self.fc(torch.cat([inputs_embeds.to(device=device, dtype=dtype), hidden_states], -1))
        seq = x.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=device)[None].expand(x.shape[0], -1)
        if attention_mask is None:
            # Causal. Over an empty cache (the prefill: thousands of positions) or for one query, the attention needs
            # no mask at all; a [seq, past + seq] one only for several queries after a cache (a round's few tokens).
            if past and seq > 1:
                attention_mask = causal_mask(seq, past, dtype, device)
        elif attention_mask.dim() == 2:
            attention_mask = causal_mask(seq, past, dtype, device, padding_mask=attention_mask)
        elif attention_mask.dtype == torch.bool:  # True = visible; an additive mask is what SDPA gets
            attention_mask = torch.zeros_like(attention_mask, dtype=dtype).masked_fill(
                ~attention_mask, torch.finfo(dtype).min
            )
        cos, sin = self.rotary_emb(x, position_ids.to(device))
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        left, right = self.layer(x, cos, sin, attention_mask, cache, features_to_keep)
        return JakiroDraftOutput(last_hidden_state=left, contrastive_hidden_state=right, cache=cache)

    # -- used as a plain assistant model ------------------------------------------------------------------------
    @property
    def generation_config(self):
        """A head has no generation config: it drafts trees for its target inside the target's generate. Without
        transformers-jakiro imported, `generate(..., assistant_model=draft)` would run the head as a stand-alone
        assistant LM, whose first read of the assistant is this attribute: it raises what to do instead. With the
        package imported the tree path never reads it, and it stays missing as on any model that cannot generate."""
        assigned = self.__dict__.get("_assigned_generation_config")
        if assigned is not None:
            return assigned
        from transformers.generation.utils import GenerationMixin

        if getattr(GenerationMixin._assisted_decoding, "_jakiro", False):  # the package's generate hook is installed
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'generation_config'")
        head = self.name_or_path or "<this head's repo id or folder>"
        raise RuntimeError(
            f"{type(self).__name__} is a Jakiro draft head, not a stand-alone assistant model: tree decoding with "
            "generate(..., assistant_model=draft) comes from the transformers-jakiro package. Run "
            "`pip install transformers-jakiro` and `import transformers_jakiro` before calling generate. Or use the "
            "decoding method saved with the head (it needs the package too): "
            f'target.generate(**inputs, custom_generate="{head}", draft=draft, trust_remote_code=True).'
        )

    @generation_config.setter
    def generation_config(self, value):
        self.__dict__["_assigned_generation_config"] = value

    # -- saving and loading --------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, is_main_process: bool = True, *args, write_model_card=True, **kwargs):
        """As in transformers, plus the Hub decoding method (custom_generate/generate.py and requirements.txt, for
        `target.generate(..., custom_generate=<head>, draft=draft, trust_remote_code=True)`) and a model card
        (README.md) unless the directory has one or write_model_card=False."""
        super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if not (is_main_process and os.path.isdir(save_directory)):
            return
        try:  # the card builder and the decoding method live in the package; this file also runs as remote code
            from transformers_jakiro.hub import build_model_card
            from transformers_jakiro.hub_decoding import write_custom_generate
        except ImportError:
            return
        write_custom_generate(save_directory)
        readme = os.path.join(save_directory, "README.md")
        if write_model_card and not os.path.exists(readme):
            build_model_card(self).save(readme)

    def push_to_hub(self, repo_id: str, **kwargs):
        """As in transformers, but a repo without a card gets the Jakiro model card: the stock push writes a generic
        card over the one save_pretrained wrote. Also takes `training_summary` / `metrics` for the card."""
        try:
            from transformers_jakiro.hub import push_to_hub
        except ImportError:
            return super().push_to_hub(repo_id, **kwargs)
        return push_to_hub(self, repo_id, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """As in transformers, but safetensors only: loading a pickle (`.bin`) checkpoint can run arbitrary code."""
        local = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        files = sorted(os.listdir(local)) if os.path.isdir(local) else []
        pickles = [name for name in files if name.endswith((".bin", ".pt", ".pth"))]
        if pickles and not any(name.endswith(".safetensors") for name in files):
            raise ValueError(
                f"{local} holds only pickle weights ({', '.join(pickles)}): pickle checkpoints are refused for "
                "safety, since loading one can run arbitrary code. Convert an original Jakiro/EAGLE checkpoint with "
                "`jakiro convert <dir> --out <new dir>`, or re-save the draft as safetensors with save_pretrained."
            )
        kwargs["use_safetensors"] = True
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        except SafetensorError as error:  # safetensors names neither the file nor a fix
            where = ", ".join(os.path.join(local, name) for name in files if name.endswith(".safetensors"))
            raise ValueError(
                f"{where or f'The safetensors weights of {pretrained_model_name_or_path}'} is corrupt or truncated "
                f"({error}). Re-download it (from_pretrained(..., force_download=True)) or re-save it with "
                "save_pretrained."
            ) from error


__all__ = ["JakiroDraftModel", "JakiroPreTrainedModel", "JakiroDraftOutput"]
