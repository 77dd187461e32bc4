"""Tiny random-weight targets for tests: small enough to run hundreds of generations on 2 CPU cores."""

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Each takes config overrides that shape the model (e.g. num_hidden_layers: some configs derive fields from it).
CONFIGS = {
    "llama": lambda **shape: LlamaConfig(**_COMMON | shape),
    "mistral": lambda **shape: MistralConfig(**_COMMON | shape, sliding_window=None),
    "qwen2": lambda **shape: Qwen2Config(**_COMMON | shape, use_sliding_window=False),
    "qwen3": lambda **shape: Qwen3Config(**_COMMON | shape, head_dim=16, use_sliding_window=False),
    "phi3": lambda **shape: Phi3Config(**_COMMON | shape, sliding_window=None),
}
ARCHS = list(CONFIGS)

# Position-dependent RoPE (see transformers_jakiro/rope.py), with its boundary inside a test's generated span.
ROPE_KINDS = ["default", "longrope", "dynamic"]
ROPE_BOUNDARY = 32


def rope_shape(arch: str, rope: str, boundary: int = ROPE_BOUNDARY) -> dict:
    """Config fields for a RoPE kind: `longrope` with its short/long switch at `boundary` (Phi-3 also recomputes its
    cache there in generate), `dynamic` NTK scaling past `max_position_embeddings = boundary`."""
    if rope == "default":
        return {}
    half = (16 if arch == "qwen3" else _COMMON["hidden_size"] // _COMMON["num_attention_heads"]) // 2
    if rope == "longrope":
        params = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * half,
                      long_factor=[4.0 + i for i in range(half)], original_max_position_embeddings=boundary)
        extra = {"original_max_position_embeddings": boundary} if arch == "phi3" else {}
        return {"rope_parameters": params, **extra}
    if rope == "dynamic":
        return {"rope_parameters": dict(rope_type="dynamic", rope_theta=10000.0, factor=64.0),
                "max_position_embeddings": boundary}
    raise ValueError(rope)


def make_target(
    arch: str = "llama", seed: int = 0, dtype=torch.float32, num_hidden_layers: int = 2, rope: str = "default",
    **overrides,
):
    """A tiny random `*ForCausalLM` of the given family, in eval mode, with sdpa attention (`rope`: one of
    ROPE_KINDS)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch](num_hidden_layers=num_hidden_layers, **rope_shape(arch, rope))
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    # Random init gives near-uniform next-token distributions; sharpen them so greedy decoding has structure.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def random_prompt(generator: torch.Generator, low: int = 3, high: int = 24) -> torch.LongTensor:
    length = int(torch.randint(low, high, (1,), generator=generator))
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def quick_trained_draft(
    target, steps: int = 200, batch: int = 16, length: int = 48, seed: int = 0, vocab: int = VOCAB, **overrides
):
    """A draft head fitted in a few seconds to the tiny target's own continuations, so that trees get accepted
    several tokens deep and the multi-token paths of the decoding loop are exercised (a random head accepts ~0)."""
    from transformers_jakiro import JakiroDraftModel

    torch.manual_seed(seed)
    # The tree mechanics are what most tests exercise, so these drafts pin their tree (adaptive=False); tests of the
    # round controller, and the differential test, turn it on.
    draft = JakiroDraftModel.from_target(target, **{"adaptive": False, **overrides})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        prompts = torch.randint(3, vocab, (batch * 4, 4), generator=g)
        sequences = torch.cat(
            [
                target.generate(prompts[: batch * 2], do_sample=False, max_new_tokens=length, min_new_tokens=length),
                target.generate(
                    prompts[batch * 2 :], do_sample=True, temperature=0.8, max_new_tokens=length, min_new_tokens=length
                ),
            ]
        )
        out = target(sequences, output_hidden_states=True)
        # The last hidden state, after the outputs of any layers the draft fuses (`target_feature_layers`).
        states = out.hidden_states
        features = torch.cat([states[i + 1] for i in draft.config.target_feature_layers] + [states[-1]], -1)
        teacher = out.logits.float().softmax(-1)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    draft.train()
    for step in range(steps):
        rows = torch.randint(0, sequences.shape[0], (batch,), generator=g)
        pred = draft(input_ids=sequences[rows, 1:], hidden_states=features[rows, :-1])
        left = draft.compute_logits(pred.last_hidden_state[:, :-1]).log_softmax(-1)
        loss = -(teacher[rows, 1:-1] * left).sum(-1).mean()
        if pred.contrastive_hidden_state is not None:
            right = draft.compute_logits(pred.contrastive_hidden_state[:, :-2]).log_softmax(-1)
            loss = loss - 0.5 * (teacher[rows, 2:-1] * right).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def make_tokenizer():
    """A character-level tokenizer over the tiny vocabulary (ids 0-2: pad, bos, eos; ids 3.. one character each),
    so that stop strings and decoding behave like a real tokenizer's."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + string.punctuation + "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿ"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars[: VOCAB - 3])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def trained_pairs(**draft_options):
    """`get(arch)` -> (tiny target, `quick_trained_draft` for it), each built once: the body of the module-scoped
    `pairs` fixtures of the decoding tests."""
    built = {}

    def get(arch):
        if arch not in built:
            target = make_target(arch)
            built[arch] = (target, quick_trained_draft(target, **draft_options))
        return built[arch]

    return get
