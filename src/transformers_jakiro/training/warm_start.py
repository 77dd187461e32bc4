"""Warm start: a new head initialised from a trained head of the same target (`jakiro train --init-from`), its
experts possibly widened and its draft vocabulary possibly chosen anew."""

import torch

from ..modeling_jakiro import JakiroDraftModel


def init_from_head(draft: JakiroDraftModel, head: JakiroDraftModel) -> dict:
    """Start `draft` from a trained `head` of the same target and shape (warm start: fine-tune a published head on
    new data instead of training from scratch). Every weight is copied except the reduced lm_head, whose
    vocabulary the new data may choose differently: a row is copied for each token both vocabularies hold. The
    other rows start as the target's lm_head rows (the from-scratch initialisation) mapped by the linear map that
    best takes the target's rows of the shared tokens to the head's trained rows: training moves the rows away from
    the target's, so raw target rows outscore every trained row and the warm start would predict almost only new
    tokens (SmolLM2: 9% top-1 agreement with the head, against 76% with the mapped rows). Returns how many rows were
    carried over and how many were mapped.

    `draft` may have wider experts than `head` (`expert_intermediate_size`, `jakiro train --expert-size`): the
    head's units are copied into the first columns and the new units' down-projection starts at zero, so the
    widened head computes exactly what `head` did and training grows the new units from there. Likewise `draft` may
    read more target layers (`target_feature_layers`, `jakiro train --feature-layers`) than a `head` that read the
    last hidden state alone: its fusion starts at zero, adding nothing to the last hidden state, so it too starts as
    `head`."""
    shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_experts", "contrastive_head",
             "vocab_size", "target_model_type")
    differences = [f"{k}: {getattr(head.config, k)!r} vs {getattr(draft.config, k)!r}" for k in shape
                   if getattr(head.config, k) != getattr(draft.config, k)]
    if draft.config.expert_intermediate_size < head.config.expert_intermediate_size:
        differences.append(
            f"expert_intermediate_size: {head.config.expert_intermediate_size} vs {draft.config.expert_intermediate_size}"
            " (experts can be widened, not narrowed)"
        )
    head_layers, layers = head.config.target_feature_layers, draft.config.target_feature_layers
    if head_layers and head_layers != layers:
        differences.append(f"target_feature_layers: {head_layers} vs {layers}")
    if differences:
        raise ValueError(f"--init-from: that head was built for another target or shape ({'; '.join(differences)}).")
    state = {k: v for k, v in head.state_dict().items() if not k.startswith(("lm_head.", "d2t"))}
    state = _widen_experts(state, draft.state_dict())
    missing = draft.load_state_dict(state, strict=False).missing_keys
    # A head that read the last hidden state alone starts a fused one: the fusion keeps its zero start.
    new = ("lm_head.", "d2t") + (("feature_norms.", "feature_fusion.") if not head_layers else ())
    if any(not k.startswith(new) for k in missing):
        raise ValueError(f"--init-from: the head lacks weights {missing}")
    carried = mapped = 0
    with torch.no_grad():
        if draft.lm_head is not None and head.lm_head is not None:
            weight = draft.lm_head.weight
            old = {int(t): i for i, t in enumerate(head.d2t.tolist())}
            pairs = [(i, old[int(t)]) for i, t in enumerate(draft.d2t.tolist()) if int(t) in old]
            shared = {i for i, _ in pairs}
            others = torch.tensor([i for i in range(weight.shape[0]) if i not in shared], dtype=torch.long)
            if pairs:
                new_rows, old_rows = map(torch.tensor, zip(*pairs))
                trained = head.lm_head.weight[old_rows].float()
                if len(others) and len(pairs) >= weight.shape[1]:  # enough shared rows to fit the map
                    to_trained = torch.linalg.lstsq(weight[new_rows].float(), trained).solution
                    weight[others] = (weight[others].float() @ to_trained).to(weight)
                    mapped = len(others)
                weight[new_rows] = trained.to(weight)
            carried = len(pairs)
    out_features = None if draft.lm_head is None else draft.lm_head.out_features
    return {"lm_head rows carried over": carried, "mapped from the target's": mapped, "of": out_features}


def _widen_experts(state: dict, wider: dict) -> dict:
    """`state` with each expert matrix that is narrower than its counterpart in `wider` (the new draft's state) placed
    into the first units of that counterpart; the new units keep their initialisation in gate_proj/up_proj and get
    zero columns in down_proj, so they add nothing until trained."""
    out = dict(state)
    for key, value in state.items():
        if ".experts." not in key or value.shape == wider[key].shape:
            continue
        grown = wider[key].detach().clone()
        if key.endswith("down_proj.weight"):  # [hidden, units]
            grown[:, value.shape[1] :] = 0
            grown[:, : value.shape[1]] = value
        else:  # gate_proj / up_proj: [units, hidden]
            grown[: value.shape[0]] = value
        out[key] = grown
    return out



__all__ = ["init_from_head"]
