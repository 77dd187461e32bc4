"""`jakiro train` (and `python -m transformers_jakiro.training`, `accelerate launch -m transformers_jakiro.training`):
the command line, generated from the two configuration dataclasses (`JakiroRunArguments`, `JakiroTrainingConfig`)
the way `HfArgumentParser` renders dataclass fields, so every `TrainingArguments` option is available too."""

import argparse
import copy
import dataclasses
import sys
import typing
from pathlib import Path

import torch
from transformers import HfArgumentParser

from ..features import check_feature_layers, default_feature_layers
from ..targets import load_target_or_explain
from .config import JakiroRunArguments, JakiroTrainingConfig
from .distill import read_prompts
from .run import train_head
from .sharegpt import is_data_spec

# TrainingArguments fields the command line leaves out: `--push-to-hub ORG/NAME` (JakiroRunArguments) publishes the
# finished head instead of making the Trainer push checkpoints.
REPLACED_TRAINING_FIELDS = ("push_to_hub",)
# argparse's own usage line would list all of TrainingArguments' options.
USAGE = "{prog} --target TARGET --data DATA --out DIR [options]"


def _options(dataclass_type) -> list[dataclasses.Field]:
    """The fields of `dataclass_type` that are options of `jakiro train`."""
    left_out = REPLACED_TRAINING_FIELDS if dataclass_type is JakiroTrainingConfig else ()
    return [f for f in dataclasses.fields(dataclass_type) if f.init and f.name not in left_out]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per field of `JakiroRunArguments` and `JakiroTrainingConfig`, in two groups: `--name`,
    `--name-with-dashes` and the field's `aliases`, typed, defaulted and documented from the field."""
    for dataclass_type, title in ((JakiroRunArguments, "jakiro train"), (JakiroTrainingConfig, "training")):
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(dataclass_type)
        for field in _options(dataclass_type):
            field = copy.copy(field)  # the parser narrows `type`; the dataclass keeps its own
            field.type = hints[field.name]
            HfArgumentParser._parse_dataclass_field(group, field)


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
    """The training configuration the parsed options describe."""
    given = {field.name: getattr(args, field.name) for field in _options(JakiroTrainingConfig)}
    accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    # Without an accelerator Trainer wants use_cpu for bf16 autocast; pinned memory only helps copies to a GPU.
    given["use_cpu"] = given["use_cpu"] or not accelerator
    given["dataloader_pin_memory"] = given["dataloader_pin_memory"] and accelerator
    return JakiroTrainingConfig(**given)


def _command(args) -> str:
    """The command line that ran, rebuilt from the parsed options that differ from their defaults (for the model
    card), each under its short name where it has one."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # What an option left off the command line parses to: the default of the first action of its dest (a `--no-X`
    # complement comes second), a string default run through the option's type (TrainingArguments'
    # include_num_input_tokens_seen="no" parses to False).
    defaults = {}
    for action in parser._actions:
        default = action.default
        defaults.setdefault(action.dest, action.type(default) if isinstance(default, str) and action.type else default)
    parts = ["jakiro train"]
    for field in _options(JakiroRunArguments) + _options(JakiroTrainingConfig):
        value = getattr(args, field.name)
        if value == defaults[field.name]:
            continue
        aliases = field.metadata.get("aliases")
        option = aliases[0] if aliases else f"--{field.name.replace('_', '-')}"
        parts.append(option + ("" if value is True else f" {value}"))
    return " ".join(parts)


def run(args) -> int:
    if not is_data_spec(args.data) and not Path(args.data).is_file():
        raise FileNotFoundError(f"training data not found: {args.data}")
    if args.prepare_features and not args.feature_cache_dir:
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
    parser = subparsers.add_parser(
        "train", help="train a Jakiro draft head for a target model", usage=USAGE.format(prog="jakiro train"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """`python -m transformers_jakiro.training ...` / `accelerate launch -m transformers_jakiro.training ...`."""
    parser = argparse.ArgumentParser(
        prog="transformers_jakiro.training", description="Train a Jakiro draft head.",
        usage=USAGE.format(prog="%(prog)s"), formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"jakiro train: error: {error}", file=sys.stderr)
        return 2


__all__ = ["add_arguments", "add_cli", "config_from_args", "main", "parse_feature_layers", "run"]
