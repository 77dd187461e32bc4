"""`JakiroTrainer`: a thin `Trainer` whose model is the draft head. The frozen target runs online inside
`compute_loss` (or its features come from a feature cache) to give the input features and teacher distributions;
`unroll_draft` adds the training-time test (the draft reading its own predicted features, as deeper tree levels do).

Alignment (docs/design.md, 1): draft position t reads (f_t, x_{t+1}). The left head is trained towards f_{t+1} and
the target's next-token distribution at t+1; the contrastive (right) head towards f_{t+2} and the distribution at
t+2. A position counts only if the token its teacher distribution predicts is an assistant token.

Reduced vocabulary: the draft's lm_head covers the N most frequent assistant tokens of the training data (plus EOS).
Its cross-entropy target is the target's distribution *restricted to those N ids and renormalised*: the draft can
only ever propose those ids, and the renormalised distribution is the best it can match (an unrenormalised slice
would ask the draft to put probability mass it does not have on tokens outside its vocabulary).
"""

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import DynamicCache, Trainer, TrainerCallback

from ..features import TargetFeatures
from ..modeling_jakiro import JakiroDraftModel
from .config import JakiroTrainingConfig
from .data import JakiroCollator
from .feature_store import FeatureStore, conversation_key, target_fingerprint


def unroll_draft(draft, input_ids: torch.LongTensor, hidden_states: torch.Tensor, steps: int = 0) -> list:
    """The draft's outputs for step 0 (row t reads the true f_t and x_{t+1}) and for `steps` unrolled steps.

    Training-time test (HASS, EAGLE-3): in a tree, a level-d node reads its parent's *predicted* feature, never a
    true one; training only on true features leaves the draft unused to its own errors. Row s of step j reads chain
    s's step j-1 prediction (of f_{s+j}) with the true token x_{s+j+1}, at position s + j, under
    `unrolled_attention_mask`. One cache holds every step's keys, as in the tree drafting loop."""
    cache = DynamicCache() if steps else None
    outputs = [draft(input_ids=input_ids, hidden_states=hidden_states, cache=cache)]
    rows, batch = input_ids.shape[1], input_ids.shape[0]
    for step in range(1, steps + 1):
        if rows - step < 1:
            break
        positions = torch.arange(rows - step, device=input_ids.device) + step
        outputs.append(
            draft(
                input_ids=input_ids[:, step:],
                hidden_states=outputs[-1].last_hidden_state[:, : rows - step],
                position_ids=positions[None].expand(batch, -1),
                attention_mask=unrolled_attention_mask(rows, step, input_ids.device)[None, None],
                cache=cache,
            )
        )
    return outputs


def unrolled_attention_mask(rows: int, step: int, device=None) -> torch.Tensor:
    """Bool [rows - step, keys] mask (True = visible) for unrolled training step `step` >= 1 over a cache that holds
    step 0's `rows` keys, then step 1's rows - 1, ..., then this step's rows - step.

    Row s of every step belongs to the chain rooted at draft position s, as a tree branch is rooted at the last
    accepted token: it sees the true-feature keys of positions <= s (the accepted context) and, from each unrolled
    step 1..step, only its own chain's key (its tree ancestors and itself) -- the masks `JakiroCandidateGenerator`
    builds level by level, for a one-node-per-level branch."""
    chain = torch.arange(rows - step, device=device)[:, None]
    blocks = [torch.arange(rows, device=device)[None] <= chain]
    blocks += [torch.arange(rows - i, device=device)[None] == chain for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class _ClipGradValue(TrainerCallback):
    """The recipe clips gradient values (torch.nn.utils.clip_grad_value_); Trainer only clips the norm."""

    def __init__(self, value: float):
        self.value = value

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        torch.nn.utils.clip_grad_value_(model.parameters(), self.value)


class _FlushFeatures(TrainerCallback):
    """Writes the feature store's buffered entries with every checkpoint and at the end of training, so that
    `--resume` after an interruption finds them."""

    def __init__(self, store: FeatureStore):
        self.store = store

    def on_save(self, args, state, control, **kwargs):
        self.store.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.store.flush()


class JakiroTrainer(Trainer):
    """`Trainer` whose model is the draft head; `target` is frozen and run online in `compute_loss`."""

    def __init__(self, model: JakiroDraftModel, target, args: JakiroTrainingConfig, data_collator=None, **kwargs):
        if data_collator is None:
            data_collator = JakiroCollator(target.config.pad_token_id or 0)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        deepspeed = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (deepspeed is not None and deepspeed.zero_stage == 3):
            raise ValueError(
                "FSDP and DeepSpeed ZeRO-3 are not supported: they shard the draft's lm_head, which the loss applies "
                "outside the draft's forward. Use DDP (`accelerate launch --multi_gpu`) or DeepSpeed ZeRO-1/2; the "
                "draft is one layer, sharding it saves little."
            )
        # The target is not the Trainer's model: it is never wrapped (DDP/FSDP/DeepSpeed), never in the optimizer,
        # and sits whole on this process's device (unless it was dispatched with a device_map).
        self.target = target.eval().requires_grad_(False)
        if getattr(target, "hf_device_map", None) is None:
            self.target.to(self.args.device)
        self.accelerator.unwrap_model(self.model).bind_target(self.target)
        # The draft's forward takes **kwargs, which makes Trainer believe it scales the loss for gradient
        # accumulation itself; it does not.
        self.model_accepts_loss_kwargs = False
        if args.max_grad_value:
            self.add_callback(_ClipGradValue(args.max_grad_value))
        self._metrics = defaultdict(list)
        self.tokens_seen = 0  # real (unpadded) tokens through the target and the draft in training, this process
        # conversation key -> (features [n, width], next tokens [n]) on the CPU: on disk (feature_cache_dir), in memory
        # (cache_features) or nowhere
        self.feature_cache = {} if args.cache_features else None
        # The decoder layers the draft reads besides the last hidden state (EAGLE-3-style fusion); none by default.
        self.feature_layers = list(model.config.target_feature_layers)
        if args.feature_cache_dir:
            fingerprint = target_fingerprint(target, self.feature_layers)
            self.feature_cache = FeatureStore(args.feature_cache_dir, fingerprint, args.process_index)
            self.add_callback(_FlushFeatures(self.feature_cache))
        self._teacher_head = None  # (d2t, weight, bias): the target's lm_head rows the draft vocabulary keeps

    @torch.no_grad()
    def target_features(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features [B, L, width]: its post-norm last hidden states (the vectors its lm_head reads),
        after the outputs of the draft's `target_feature_layers` if any; and its greedy next token [B, L] at every
        position whose next token is an assistant token (-1 elsewhere), on the target's device. From the feature cache when it holds every conversation of the batch, else from a target forward
        (whose results then enter the cache). Padding positions hold zeros / -1: no loss is taken there, and under
        causal attention no real position reads them."""
        ids, loss_mask = inputs["input_ids"], inputs["loss_mask"].bool()
        device = self.target.get_input_embeddings().weight.device
        keys = inputs.get("feature_keys")
        cache = self.feature_cache
        if cache is not None and keys is not None and all(k in cache for k in keys):
            first = cache[keys[0]][0]
            features = first.new_zeros(*ids.shape, first.shape[-1], device=device)
            next_tokens = torch.full(ids.shape, -1, dtype=torch.long, device=device)
            for row, key in enumerate(keys):
                cached_features, cached_tokens = cache[key]
                features[row, : len(cached_features)] = cached_features.to(device)
                next_tokens[row, : len(cached_tokens)] = cached_tokens.to(device)
            return features, next_tokens
        attention = inputs["attention_mask"].to(device)
        # The same hooks that read the features in decoding, so training and decoding cannot read different layers
        # (and every other layer's states are freed as the forward goes, which matters for long conversations).
        with TargetFeatures(self.target, self.feature_layers) as reader:
            # Only the hidden states are needed here (the full-vocabulary logits only where a loss is taken, below),
            # so the decoder runs without the lm_head where the hooks can read it. The CausalLM's own lm_head call on
            # its one kept position took 13 s per batch of 4 on Qwen2.5-Coder-1.5B in bf16 on a CPU (a profile showed
            # a batched matmul copying its 151936-row operand), against about 1 s for the whole decoder.
            decoder = reader.decoder is not None
            out = (reader.decoder if decoder else self.target)(
                input_ids=ids.to(device),
                attention_mask=attention,
                use_cache=False,
                **({} if decoder else {"logits_to_keep": 1}),
                **reader.forward_kwargs(),
            )
            features = reader.take(out)
        # The post-norm last hidden state (the lm_head's input) is the last of the equally wide parts.
        last = features[..., -(features.shape[-1] // (len(self.feature_layers) + 1)) :]
        counted = torch.zeros_like(loss_mask)
        counted[:, :-1] = loss_mask[:, 1:]
        counted = counted.to(device)
        next_tokens = torch.full(ids.shape, -1, dtype=torch.long, device=device)
        next_tokens[counted] = self.target.get_output_embeddings()(last[counted]).argmax(-1)
        if cache is not None and keys is not None:
            for row, (key, length) in enumerate(zip(keys, attention.sum(-1).tolist())):
                # Copies: a CPU slice would be a view that keeps the whole padded batch alive.
                cache[key] = (
                    features[row, :length].to("cpu", copy=True),
                    next_tokens[row, :length].to("cpu", copy=True),
                )
        return features, next_tokens

    def prepare_features(self) -> dict:
        """Fill the feature cache for every training conversation (this process's share of them) without training:
        batches of similar lengths, conversations already cached are skipped. Returns counts and the time taken."""
        if self.feature_cache is None:
            raise ValueError("prepare_features needs a feature cache: set feature_cache_dir (--feature-cache DIR).")
        from tqdm.auto import tqdm

        started = time.time()
        examples = self.train_dataset
        keys = [conversation_key(e["input_ids"], e["loss_mask"]) for e in examples]
        todo = [i for i, key in enumerate(keys) if key not in self.feature_cache and i % self.args.world_size
                == self.args.process_index]
        todo.sort(key=lambda i: len(examples[i]["input_ids"]))
        size = self.args.per_device_train_batch_size
        tokens = sum(len(examples[i]["input_ids"]) for i in todo)
        with tqdm(total=tokens, unit="tok", desc="target features", disable=not self.is_local_process_zero()) as bar:
            for start in range(0, len(todo), size):
                batch = self.data_collator([examples[i] for i in todo[start : start + size]])
                self.target_features(batch)
                bar.update(int(batch["attention_mask"].sum()))
        if isinstance(self.feature_cache, FeatureStore):
            self.feature_cache.flush()
        seconds = time.time() - started
        return dict(conversations=len(todo), already_cached=len(keys) - len(todo), tokens=tokens,
                    seconds=round(seconds, 1), tokens_per_s=round(tokens / seconds, 1) if seconds else None)

    def _teacher_logits(self, features: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
        """The target's logits at `features`; with a reduced draft vocabulary only its rows (the same numbers as
        slicing the full logits, at a fraction of the cost: Qwen's vocabulary is 151936 rows, our head's 8014)."""
        head = self.target.get_output_embeddings()
        if d2t is None:
            return head(features)
        # The rows are gathered once per vocabulary map: a checkpoint loaded by --resume may bring another one.
        if self._teacher_head is None or not torch.equal(self._teacher_head[0], d2t):
            rows = d2t.to(head.weight.device)
            bias = getattr(head, "bias", None)
            self._teacher_head = (d2t.clone(), head.weight[rows], None if bias is None else bias[rows])
        return F.linear(features, *self._teacher_head[1:])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        ids = inputs["input_ids"]
        features, next_tokens = self.target_features(inputs)
        if model.training:
            self.tokens_seen += int(inputs["attention_mask"].sum())
        hidden = features[:, :-1].to(ids.device)
        if model.training and args.feature_noise > 0:
            hidden = hidden + (torch.rand_like(hidden) - 0.5) * (args.feature_noise * 512 / hidden.shape[1])
        # accelerate puts autocast (--bf16) around the draft's forward only; the vocabulary projections below (the
        # draft's lm_head and the teacher's, most of a step's matrix work) run outside it, so autocast them here too.
        with self.accelerator.autocast():
            # Right padding: causal attention alone keeps real positions away from the padding after them.
            outputs = unroll_draft(model, ids[:, 1:], hidden, args.unroll_steps)
            loss = 0.0
            for step, pred in enumerate(outputs):
                weight = args.unroll_loss_weight**step
                loss = loss + weight * self._step_loss(model, pred, inputs, features, next_tokens, step=step)
        return (loss, outputs[0]) if return_outputs else loss

    def _step_loss(self, model, pred, inputs, features, next_tokens, step: int) -> torch.Tensor:
        """Both heads' losses for the draft rows of unrolled step `step` (0: the draft read the true features)."""
        args, draft = self.args, self.accelerator.unwrap_model(model)
        ids, loss_mask = inputs["input_ids"], inputs["loss_mask"].bool()
        target_device = features.device
        length, loss = ids.shape[1], 0.0
        heads = (
            ("left", pred.last_hidden_state, 1, args.left_feature_weight, args.left_ce_weight),
            ("right", pred.contrastive_hidden_state, 2, args.right_feature_weight, args.right_ce_weight),
        )
        for name, head, shift, feature_weight, ce_weight in heads:
            if head is None or not (feature_weight or ce_weight):
                continue
            # Row s of step j sits at position t = s + j and predicts f_{t+shift}, whose distribution predicts
            # token x_{t+shift+1}: the row counts if that token is an assistant token.
            shift = shift + step
            valid = loss_mask[:, shift + 1 :]
            if not valid.any():
                # Keep every parameter (lm_head too) in the graph: DDP expects a gradient for each on every rank.
                loss = loss + 0.0 * draft.compute_logits(head[:, :1]).sum()
                continue
            predicted = head[:, : length - 1 - shift][valid].float()
            # The feature target is the last hidden state (the lm_head's input), the slice after any fused layers.
            wanted = features[:, shift : length - 1, -draft.config.hidden_size :][valid.to(target_device)]
            target_token = next_tokens[:, shift : length - 1][valid.to(target_device)].to(predicted.device)
            with torch.no_grad():
                # Reduced vocabulary: restricted to the draft's ids and renormalised (see the module docstring).
                teacher = self._teacher_logits(wanted, draft.d2t).float().to(predicted.device).softmax(-1)
            smooth_l1 = F.smooth_l1_loss(predicted, wanted.float().to(predicted.device))
            logits = draft.compute_logits(predicted).float()  # under --bf16: one cast, then fp32 softmax and argmax
            ce = -(teacher * logits.log_softmax(-1)).sum(-1).mean()
            loss = loss + feature_weight * smooth_l1 + ce_weight * ce
            if model.training:
                accuracy = (draft.draft_to_target_ids(logits.argmax(-1)) == target_token).float().mean()
                suffix = f"@{step}" if step else ""
                for key, value in (("l1", smooth_l1), ("ce", ce), ("acc", accuracy)):
                    self._metrics[f"{name}_{key}{suffix}"].append(value.detach())
        return loss

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Adds per-head losses and top-1 accuracies (vs the target's own next token), averaged since the last log
        and over processes, to the training logs (console and TensorBoard)."""
        if self._metrics and "loss" in logs:
            names = sorted(self._metrics)
            local = torch.stack([torch.stack(self._metrics[n]).mean() for n in names])
            averaged = self.accelerator.gather(local[None]).mean(0)
            logs.update({n: round(v, 4) for n, v in zip(names, averaged.tolist())})
            self._metrics.clear()
        super().log(logs, *args, **kwargs)



__all__ = ["JakiroTrainer", "unroll_draft", "unrolled_attention_mask"]
