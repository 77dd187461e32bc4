"""The target features a draft reads, captured during the target's own forward without keeping every layer's states.

A draft reads the target's last hidden state f_t (after the final norm: the vector the lm_head reads) and, when its
config names `target_feature_layers`, also the outputs of those decoder layers (EAGLE-3's low/middle/high fusion).
The draft's input is then their concatenation `[layer_a; layer_b; ...; f_t]`, last hidden state last, so
`features[..., -hidden_size:]` is always f_t (what the lm_head and the feature loss need).

`output_hidden_states=True` keeps the hidden states of every layer alive until the forward returns: at the prefill
of an 8B model (33 x 4096 values per token in bf16) over a 32k-token prompt that is ~8.6 GB, for one to four tensors
the draft needs. The last one, after the final norm, is exactly what the target's decoder (its base model) returns as
`last_hidden_state`, so a forward hook on the decoder catches it, and hooks on the named layers catch theirs, while
the other layers' states are freed as usual. Targets without a separate decoder module fall back to
`output_hidden_states=True`.
"""

import torch
from torch import nn


def check_feature_layers(layers, num_layers: int) -> list[int]:
    """`layers` as a list of distinct, increasing decoder-layer indices of a target with `num_layers` layers, or a
    clear error. The last layer is not among them: its output, after the final norm, is the last hidden state, which
    the draft always reads."""
    layers = [int(i) for i in layers]
    wrong = [i for i in layers if not 0 <= i < num_layers - 1]
    if wrong or len(set(layers)) != len(layers) or layers != sorted(layers):
        raise ValueError(
            f"target_feature_layers {layers} must be distinct decoder-layer indices in increasing order, each in "
            f"[0, {num_layers - 2}] (this target has {num_layers} layers; the last one's output is the last hidden "
            f"state, always read){f'; out of range: {wrong}' if wrong else ''}."
        )
    return layers


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice of a low, a middle and a high layer (2, L // 2, L - 3), for targets of at least 6 layers."""
    if num_layers < 6:
        raise ValueError(f"The low/middle/high layer choice needs a target of >= 6 layers, this one has {num_layers}.")
    return [2, num_layers // 2, num_layers - 3]


class TargetFeatures:
    """Use as a context manager around the target's forwards; `forward_kwargs()` goes into each forward call and
    `take(output)` returns that forward's [batch, seq, (len(layers) + 1) * hidden] features: the named decoder
    layers' outputs, then the last hidden state."""

    def __init__(self, target: nn.Module, layers=()):
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        self.decoder = decoder if isinstance(decoder, nn.Module) and decoder is not target else None
        self.layers = list(layers)
        stack = getattr(self.decoder, "layers", None)  # `model.layers` in Llama, Qwen2, Mistral, ...
        if self.layers and not isinstance(stack, nn.ModuleList):
            self.decoder = None  # no layer stack to hook: read every layer's states from the output instead
        self._modules = []
        if self.decoder is not None:
            if self.layers:
                check_feature_layers(self.layers, len(stack))
            self._modules = [stack[i] for i in self.layers] + [self.decoder]
        self._captured = {}
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, output):
            if index == len(self.layers):  # the decoder: its last (post-norm) hidden state
                value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            else:  # a decoder layer: a tensor, or a tuple whose first element is the hidden state
                value = output if isinstance(output, torch.Tensor) else output[0]
            self._captured[index] = value

        return hook

    def __enter__(self) -> "TargetFeatures":
        self._handles = [module.register_forward_hook(self._hook(i)) for i, module in enumerate(self._modules)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._captured = {}

    def forward_kwargs(self) -> dict:
        return {} if self.decoder is not None else {"output_hidden_states": True}

    def take(self, output) -> torch.Tensor:
        if self.decoder is None:
            states = output.hidden_states  # [embeddings, layer 0's output, ..., the last (post-norm) state]
            if self.layers:
                check_feature_layers(self.layers, len(states) - 1)
            parts = [states[i + 1] for i in self.layers] + [states[-1]]
        else:
            captured, self._captured = self._captured, {}
            if len(captured) != len(self._modules):
                raise RuntimeError(
                    f"The target's decoder ({type(self.decoder).__name__}) did not run all its layers in its forward, "
                    "so Jakiro got no hidden states; this target's layout is not supported."
                )
            parts = [captured[i] for i in range(len(self._modules))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


__all__ = ["TargetFeatures", "check_feature_layers", "default_feature_layers"]
