"""Configuration of a Jakiro draft head.

The draft head is one decoder layer shaped like the target's layers (hidden size, attention heads, RoPE), followed by
a two-expert MoE block. Everything that must match the target is copied from the target's config by
`JakiroConfig.from_target_config`, so a head can never silently disagree with the model it drafts for.
"""

from typing import Any

from transformers import PreTrainedConfig

# Target families whose attention projections carry a bias on q/k/v (but not o).
_QKV_BIAS_MODEL_TYPES = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}


class JakiroConfig(PreTrainedConfig):
    r"""
    Configuration of [`JakiroDraftModel`].

    Shape (copied from the target): `hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `rms_norm_eps`, `rope_parameters`, `max_position_embeddings`, `attention_bias` (bias on q/k/v, as in Qwen2),
    `vocab_size` (the target's vocabulary).

    Head: `draft_vocab_size` (None: use the target's lm_head; N: an own lm_head over N frequent target tokens and a
    draft-to-target id map), `num_experts`, `num_experts_per_tok`, `expert_intermediate_size` (default: hidden size),
    `fc_bias`, `contrastive_head` (the two-ahead right head that builds the last tree level for free).

    Input: `target_feature_layers` (empty: the draft reads the target's last hidden state only, as in EAGLE-1/2 and
    the paper; indices of decoder layers: their outputs are read too, normalised and fused with the last hidden state
    by a linear layer, as in EAGLE-3's low/middle/high fusion; the last layer itself is never listed).

    Identity: `target_model_type`, `target_name_or_path`. Tree defaults: `total_tokens` (draft nodes verified per
    round, root excluded), `depth` (draft forwards per round; the tree has `depth + 1` levels with the contrastive
    head, `depth` without), `top_k` (children kept per node and nodes expanded per level).

    N-gram lookup (hybrid trees): `lookup_tokens` (0 = off; else up to this many tokens copied from an earlier
    occurrence of the current suffix join the tree as a chain, verified in the same forward, on top of
    `total_tokens`), `lookup_max_ngram` (longest suffix n-gram matched, down to 1), `lookup_chains` (distinct
    continuations added per round).

    Round control: `adaptive` (True: every round the decoder chooses between a plain step, lookup alone, a smaller
    tree and the tree above by measured tokens per second, `decoding/round_controller.py`; False: this tree every round).
    """

    model_type = "jakiro"

    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    hidden_act: str = "silu"
    vocab_size: int = 32000
    draft_vocab_size: int | None = None
    num_experts: int = 2
    num_experts_per_tok: int = 2
    expert_intermediate_size: int | None = None
    fc_bias: bool = True
    contrastive_head: bool = True
    target_feature_layers: list[int] | None = None
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    total_tokens: int = 60
    depth: int = 5
    top_k: int = 10
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_chains: int = 1
    adaptive: bool = True
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.expert_intermediate_size is None:
            self.expert_intermediate_size = self.hidden_size
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.rope_parameters = dict(self.rope_parameters)
        self.target_feature_layers = [int(i) for i in self.target_feature_layers or ()]
        self.rope_parameters.setdefault("rope_type", self.rope_parameters.pop("type", "default"))
        super().__post_init__(**kwargs)
        self._check()

    def _check(self):
        if self.num_experts not in (1, 2):
            raise ValueError(f"num_experts must be 1 (EAGLE-style dense head) or 2 (Jakiro), got {self.num_experts}.")
        if self.num_experts_per_tok != self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must equal num_experts ({self.num_experts}): "
                "Jakiro heads activate every expert; sparse routing is not supported."
            )
        if self.contrastive_head and self.num_experts != 2:
            raise ValueError("contrastive_head=True needs num_experts=2; set contrastive_head=False for one expert.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must lie in [1, vocab_size={self.vocab_size}]."
            )
        for name in ("total_tokens", "depth", "top_k", "lookup_max_ngram", "lookup_chains"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        layers = self.target_feature_layers
        if any(i < 0 for i in layers) or len(set(layers)) != len(layers) or layers != sorted(layers):
            raise ValueError(
                f"target_feature_layers must be distinct, non-negative decoder-layer indices in increasing order, got "
                f"{layers}."
            )
        if self.lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0 (0 turns n-gram lookup off), got {self.lookup_tokens}.")

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "JakiroConfig":
        """A config whose draft layer has the target's shape; `overrides` set head or tree options."""
        text = target_config.get_text_config(decoder=True)
        rope = getattr(text, "rope_parameters", None)
        if rope is None:  # very old configs: rope_theta / rope_scaling as separate fields
            rope = dict(getattr(text, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
        num_heads = text.num_attention_heads
        shape = dict(
            hidden_size=text.hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            attention_bias=text.model_type in _QKV_BIAS_MODEL_TYPES or bool(getattr(text, "attention_bias", False)),
            hidden_act=getattr(text, "hidden_act", "silu"),
            vocab_size=text.vocab_size,
            target_model_type=text.model_type,
            target_name_or_path=getattr(target_config, "_name_or_path", None) or None,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        shape.update(overrides)
        layers, num_layers = shape.get("target_feature_layers") or (), text.num_hidden_layers
        if any(int(i) >= num_layers - 1 for i in layers):
            raise ValueError(
                f"target_feature_layers {list(layers)}: this target has {num_layers} decoder layers, so the indices "
                f"must lie in [0, {num_layers - 2}] (the last layer's output is the last hidden state, always read)."
            )
        return cls(**shape)


__all__ = ["JakiroConfig"]
