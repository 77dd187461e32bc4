"""Chat records: the one place that reads a conversation or a prompt out of a JSON record.

Records come as ShareGPT (`conversations`: `from`/`value` turns), OpenAI-style (`messages`: `role`/`content`), our
bench format (`turns`: the user's turns as strings) or a plain `prompt` / `question` / `instruction` field. One role
table (`ROLES`) names the speakers of all of them. On top of `chat_messages`, the parse every caller shares, sit the
rules of each use:

- `trainable_messages`: a conversation to train on from our own JSONL (`jakiro distill` output): any turns, at least
  one assistant turn.
- `clean_dialogue`: a conversation from a ShareGPT-scale source, where many records are unusable: human first,
  alternating, no empty turn, ending on an answer.
- `first_user_prompt`: the prompt `jakiro distill` answers; `user_turns`: every user text, matched against the
  benchmark questions so that no head trains on what it is benchmarked on.

Every parser raises ValueError with the reason a record is unusable; `read_jsonl` collects those reasons by line.
"""

import json

# Speaker names -> chat-template roles. ShareGPT writes `human`/`gpt` (and names a few other assistants).
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}
PROMPT_FIELDS = ("prompt", "question", "instruction")


def _role(turn) -> str | None:
    return ROLES.get(str(turn.get("from", turn.get("role"))).lower()) if isinstance(turn, dict) else None


def _conversation(record) -> list:
    return (record.get("conversations") or record.get("messages") or []) if isinstance(record, dict) else []


def chat_messages(record) -> list[dict]:
    """One ShareGPT or OpenAI-style record -> chat messages `[{"role", "content"}]`, in order; ValueError when it is
    not an object, has no turns, or a turn has an unknown role or no text."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    turns = _conversation(record)
    if not isinstance(turns, list) or not turns:
        raise ValueError("no `conversations` (or `messages`) list")
    messages = []
    for turn in turns:
        role = _role(turn)
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise ValueError("a turn with an unknown role or no text")
        messages.append({"role": role, "content": content})
    return messages


def trainable_messages(record) -> list[dict]:
    """`chat_messages` of a record that has at least one assistant turn."""
    messages = chat_messages(record)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant (gpt) turn")
    return messages


def clean_dialogue(record) -> list[dict]:
    """`chat_messages` of a clean human-first dialogue: no empty turn, a leading system turn dropped, human and
    assistant turns alternating, a trailing human turn (with no answer to train on) dropped."""
    messages = chat_messages(record)
    if any(not m["content"].strip() for m in messages):
        raise ValueError("a turn with an unknown role or no text")
    if messages[0]["role"] == "system":
        messages = messages[1:]
    if not messages or messages[0]["role"] != "user":
        raise ValueError("does not start with a human turn")
    for i, message in enumerate(messages):
        if message["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise ValueError("turns do not alternate human/assistant")
    if len(messages) % 2:
        messages = messages[:-1]
    if not messages:
        raise ValueError("no assistant turn")
    return messages


def _user_contents(record) -> list:
    return [turn.get("value", turn.get("content")) for turn in _conversation(record) if _role(turn) == "user"]


def first_user_prompt(record) -> str:
    """The user prompt of a record in any of the formats: the first of bench-format `turns`, the first human turn
    of a conversation, or a `prompt` / `question` / `instruction` field; ValueError (the reason) if there is none."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        text = turns[0] if isinstance(turns, list) and turns else None
    elif "conversations" in record or "messages" in record:
        users = _user_contents(record)
        text = users[0] if users else None
    else:
        field = next((k for k in PROMPT_FIELDS if k in record), None)
        if field is None:
            raise ValueError("no prompt field (expected turns, conversations, prompt, question or instruction)")
        text = record[field]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the prompt is empty or not a string")
    return text


def user_turns(record) -> list[str]:
    """Every user text of a record in any of the formats (empty for anything else)."""
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("turns"), list):
        return [turn for turn in record["turns"] if isinstance(turn, str)]
    users = [text for text in _user_contents(record) if isinstance(text, str)]
    return users + [record[key] for key in PROMPT_FIELDS if isinstance(record.get(key), str)]


def read_jsonl(path, parse):
    """[(line number, parse(record))] for the good lines, [(line number, reason)] for the bad ones."""
    good, bad = [], []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                good.append((number, parse(json.loads(line))))
            except (json.JSONDecodeError, ValueError, TypeError, AttributeError, KeyError) as error:
                bad.append((number, str(error)))
    return good, bad


__all__ = [
    "PROMPT_FIELDS",
    "ROLES",
    "chat_messages",
    "clean_dialogue",
    "first_user_prompt",
    "read_jsonl",
    "trainable_messages",
    "user_turns",
]
