"""Train a Jakiro draft head for a target model, in one command:

    jakiro train --target smollm2-135m-instruct --data data.jsonl --out heads/my-head
    accelerate launch -m transformers_jakiro.training --target ... --data ... --out ...   # several GPUs, same code

The pieces, TRL style: `JakiroTrainingConfig` (a `TrainingArguments` with the Jakiro loss weights and data options;
`config`), the data pipeline (`read_conversations`, `build_examples`, `JakiroCollator`, the reduced draft vocabulary
`select_draft_vocab`; `data`, reading records through `chat_records` and `sharegpt`), the warm start from a trained
head (`init_from_head`; `warm_start`), `JakiroTrainer` (a thin `Trainer`: the draft is the trained model; the frozen
target runs *online* inside `compute_loss` to give the input features and teacher distributions, or a `FeatureStore`
(`feature_store`) holds them; `trainer`), and `train_head`, which runs everything, measures tau and writes the head
with a model card (`run`). `distill` writes the target's own answers to train on; `cli` is `jakiro train`.
"""

from .config import JakiroRunArguments, JakiroTrainingConfig
from .data import (
    JakiroCollator,
    assistant_tokens,
    build_examples,
    read_conversations,
    select_draft_vocab,
    tokenize_conversation,
)
from .run import check_output_dir, evaluate_tau, save_as, train_head
from .trainer import JakiroTrainer, unroll_draft, unrolled_attention_mask
from .warm_start import init_from_head

__all__ = [
    "JakiroCollator",
    "JakiroRunArguments",
    "JakiroTrainer",
    "JakiroTrainingConfig",
    "assistant_tokens",
    "build_examples",
    "check_output_dir",
    "evaluate_tau",
    "init_from_head",
    "read_conversations",
    "save_as",
    "select_draft_vocab",
    "tokenize_conversation",
    "train_head",
    "unroll_draft",
    "unrolled_attention_mask",
]
