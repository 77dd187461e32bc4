"""The target's last hidden state (the feature the draft reads), captured without keeping every layer's.

`output_hidden_states=True` keeps the hidden states of every layer alive until the forward returns: at the prefill
of an 8B model (33 x 4096 values per token in bf16) over a 32k-token prompt that is ~8.6 GB, for one tensor the draft
needs. The last one, after the final norm, is exactly what the target's decoder (its base model) returns as
`last_hidden_state` (the same tensor as `hidden_states[-1]`), so a forward hook on the decoder catches it while the
other layers' states are freed as usual. Targets without a separate decoder module fall back to
`output_hidden_states=True`.
"""

import torch
from torch import nn


class LastHiddenState:
    """Use as a context manager around the target's forwards; `forward_kwargs()` goes into each forward call and
    `take(output)` returns that forward's [batch, seq, hidden] last hidden state."""

    def __init__(self, target: nn.Module):
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        self.decoder = decoder if isinstance(decoder, nn.Module) and decoder is not target else None
        self._captured = None
        self._handle = None

    def _hook(self, module, args, output):
        self._captured = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def __enter__(self) -> "LastHiddenState":
        if self.decoder is not None:
            self._handle = self.decoder.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._captured = None

    def forward_kwargs(self) -> dict:
        return {} if self.decoder is not None else {"output_hidden_states": True}

    def take(self, output) -> torch.Tensor:
        if self.decoder is None:
            return output.hidden_states[-1]
        captured, self._captured = self._captured, None
        if captured is None:
            raise RuntimeError(
                f"The target's decoder ({type(self.decoder).__name__}) did not run in its forward, so Jakiro got no "
                "hidden states; this target's layout is not supported."
            )
        return captured


__all__ = ["LastHiddenState"]
