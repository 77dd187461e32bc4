"""Training data: conversations read from a data file or spec (`read_conversations`), chat-templated and tokenised
with a mask of the assistant tokens (`tokenize_conversation`, `build_examples`), padded into batches
(`JakiroCollator`), and the reduced draft vocabulary chosen from them (`select_draft_vocab`)."""

from dataclasses import dataclass

import torch

from .chat_records import read_jsonl, trainable_messages
from .feature_store import conversation_key
from .sharegpt import benchmark_prompts, is_data_spec, read_sources, sharegpt_messages


def read_conversations(path, exclude_benchmarks: bool = True) -> tuple[list[list[dict]], list[tuple]]:
    """([messages] of the good records, [(where, reason)] of the bad ones).

    `path` is one JSONL file (bad records named by line number), or a data spec for `sharegpt.read_sources`
    (`sharegpt`, `sharegpt:3000`, a JSON array, several sources separated by commas). Conversations from a data spec
    whose user turns are benchmark questions are skipped."""
    if is_data_spec(path):
        return read_sources(str(path), sharegpt_messages, benchmark_prompts() if exclude_benchmarks else None)
    good, bad = read_jsonl(path, trainable_messages)
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



__all__ = [
    "JakiroCollator",
    "assistant_tokens",
    "build_examples",
    "read_conversations",
    "select_draft_vocab",
    "tokenize_conversation",
]
