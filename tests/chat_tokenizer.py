"""A tiny character-level chat tokenizer (128 ids, like the tiny targets' vocabulary) for the data-pipeline tests."""

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Ids 0-2 match the tiny targets' pad/bos/eos ids; <|end|> (2) closes every turn and is the EOS.
SPECIALS = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<unk>"]
CHARS = list(string.printable[:-5]) + ["\n"]  # printable ASCII, space and newline
CHARS += list("àáâäçèéêëìíîïñòóôöùúûüßæœøåþ")[: 128 - len(SPECIALS) - len(CHARS)]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    assert len(vocab) == 128
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a token
    backend.decoder = decoders.Fuse()  # join characters without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
