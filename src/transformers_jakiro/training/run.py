"""A whole training run (`train_head`): read and tokenise the data, choose the draft vocabulary, build (or warm-start)
the head, train it, save it, measure tau on held-out prompts (`evaluate_tau`) and write the model card."""

import json
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from ..generation import TreeSettings, tree_settings
from ..modeling_jakiro import JakiroDraftModel
from ..stats import acceptance_profile, format_acceptance
from .config import JakiroTrainingConfig
from .data import JakiroCollator, assistant_tokens, build_examples, read_conversations, select_draft_vocab
from .distill import render_prompt
from .feature_store import FeatureStore
from .trainer import JakiroTrainer
from .warm_start import init_from_head


def _eos_ids(target, tokenizer) -> list[int]:
    ids = [tokenizer.eos_token_id, target.config.eos_token_id, getattr(target.generation_config, "eos_token_id", None)]
    flat = []
    for value in ids:
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    return sorted({i for i in flat if i is not None})



@torch.no_grad()
def evaluate_tau(target, tokenizer, draft, prompts: list[tuple[str, str]], max_new_tokens: int = 64) -> dict:
    """Acceptance length tau by real tree decoding (greedy, the head's configured tree in every round): overall (new tokens / target forwards, prefill included)
    and per prompt, plus `papers_tau` (tokens per draft-verify cycle, prefill excluded: the papers' figure)."""
    device = target.get_input_embeddings().weight.device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for pid, text in prompts:
        inputs = tokenizer(render_prompt(tokenizer, text), return_tensors="pt", add_special_tokens=False).to(device)
        # The configured tree every round: tau measures the head, not what the round controller chose on this
        # machine at this moment (on a loaded machine it may choose plain steps for most rounds).
        with tree_settings(draft, adaptive=False):
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
    from ..hub import build_model_card

    build_model_card(draft, training_summary=summary, metrics=metrics, repo_id=push_to_hub).save(str(out / "README.md"))
    report = {"summary": summary, "metrics": metrics}
    (out / "jakiro_training.json").write_text(json.dumps(report, indent=2, default=str))
    if push_to_hub:
        draft.push_to_hub(push_to_hub, training_summary=summary, metrics=metrics)
        print(f"pushed to https://huggingface.co/{push_to_hub}")
    print(f"head written to {out}")
    return report



__all__ = ["check_output_dir", "evaluate_tau", "save_as", "train_head"]
