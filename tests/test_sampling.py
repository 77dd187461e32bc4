"""Sampling with a Jakiro draft preserves the target's distribution exactly.

A tiny target over 8 tokens; the joint distribution of its first three generated tokens (512 outcomes) is
enumerated exactly from the target itself, with the same logits warpers, and compared with 10k Jakiro samples by a
chi-square test. The same test run with a deliberately wrong acceptance rule must fail, which shows the test can
tell the difference.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import MaxLengthCriteria

from tiny_models import quick_trained_draft
from transformers_jakiro import tree_settings
from transformers_jakiro.decoding import verification
from transformers_jakiro.decoding.loop import jakiro_decode
from transformers_jakiro.decoding.drafter import TreeSettings

VOCAB, NEW_TOKENS, SAMPLES = 8, 3, 10_000
WRONG_RULE_SAMPLES = 1_500  # the bias of the wrong rule is large; fewer samples already reject it
PROMPT = torch.tensor([[3, 5, 4]])


def small_target_and_draft():
    """A tiny target over 8 tokens and a draft fitted to it (also used by the batch tests)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(2.5)  # moderately peaked: the draft gets accepted and rejected often
    draft = quick_trained_draft(target, vocab=VOCAB, total_tokens=10, depth=2, top_k=3)
    return target, draft


@pytest.fixture(scope="module")
def target_and_draft():
    return small_target_and_draft()


def exact_distribution(target, processors, prompt=PROMPT) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) for all 512 continuations, flattened in itertools.product order."""
    outcomes = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))
    sequences = torch.cat([prompt.expand(len(outcomes), -1), outcomes], dim=1)
    with torch.no_grad():
        logits = target(sequences).logits.float()
    start = prompt.shape[1]
    prob = torch.ones(len(outcomes), dtype=torch.float64)
    for step in range(NEW_TOKENS):
        prefix = sequences[:, : start + step]
        scores = processors(prefix, logits[:, start + step - 1].clone())
        p = torch.softmax(scores.double(), dim=-1)
        prob *= p.gather(1, outcomes[:, step : step + 1]).squeeze(1)
    return prob


def sample_counts(target, draft, processors, samples: int, prompt=PROMPT, settings=None) -> torch.Tensor:
    config = GenerationConfig(do_sample=True)
    stop = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + NEW_TOKENS)])
    counts = torch.zeros(VOCAB**NEW_TOKENS, dtype=torch.float64)
    weights = torch.tensor([VOCAB**i for i in reversed(range(NEW_TOKENS))])
    torch.manual_seed(1234)
    multi_token_rounds = lookup_accepted = 0
    for _ in range(samples):
        out = jakiro_decode(target, prompt, processors, stop, config, draft, settings=settings)
        counts[int((out[0, prompt.shape[1] :] * weights).sum())] += 1
        multi_token_rounds += sum(n > 1 for n in draft.last_generation_stats.accepted_lengths)
        lookup_accepted += draft.last_generation_stats.lookup_accepted
    sample_counts.multi_token_rounds = multi_token_rounds
    sample_counts.lookup_accepted = lookup_accepted
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square; outcomes expected fewer than 5 times are pooled into one cell. An outcome of probability
    zero that was observed rejects outright (p = 0)."""
    if float(counts[probs == 0].sum()) > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    return float(chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue)


# Temperature, top-k and top-p together: p is reshaped and truncated (zero-probability children included), which is
# where a wrong residual would show.
WARPERS = [TemperatureLogitsWarper(0.8), TopKLogitsWarper(5), TopPLogitsWarper(0.9)]


def test_sampling_matches_exact_target_distribution(target_and_draft):
    target, draft = target_and_draft
    processors = LogitsProcessorList(WARPERS)
    probs = exact_distribution(target, processors)
    assert (probs == 0).sum() > 0  # top-k/top-p really cut tokens off
    counts = sample_counts(target, draft, processors, SAMPLES)
    print(f"p-value {chi_square_p_value(counts, probs):.3g}, multi-token rounds {sample_counts.multi_token_rounds}")
    assert chi_square_p_value(counts, probs) > 1e-4
    # Draft tokens were accepted in many rounds, so the tree part of the rule was exercised, not just the bonus.
    assert sample_counts.multi_token_rounds > SAMPLES // 4


def test_sampling_with_ngram_lookup_matches_exact_target_distribution(target_and_draft):
    """Lookup chains join the tree; the tree is still deterministic given the prefix, so the same rule is exact."""
    target, draft = target_and_draft
    prompt = torch.tensor([[3, 5, 4, 6, 3, 5, 4, 7, 3, 5]])  # "3 5" recurs: chains are proposed every round
    processors = LogitsProcessorList(WARPERS)
    probs = exact_distribution(target, processors, prompt)
    settings = TreeSettings.resolve(draft, total_tokens=4, depth=1, top_k=2, lookup_tokens=3, lookup_chains=2)
    counts = sample_counts(target, draft, processors, 6_000, prompt, settings)
    p_value = chi_square_p_value(counts, probs)
    print(f"lookup p-value {p_value:.3g}, lookup tokens accepted {sample_counts.lookup_accepted}")
    assert p_value > 1e-4
    assert sample_counts.lookup_accepted > 300  # chains were accepted in many rounds, not only drafted nodes


def classic_wrong_verify(tree, processed_logits, do_sample, leaf_logits=None):
    """A common bug: accept each child x with probability p(x) but, when all are rejected, sample the bonus from
    the full p instead of the residual with the rejected children removed. Drafted tokens get over-sampled.
    (Same interface as `verification.verify`: rows for internal nodes only when `leaf_logits` is given.)"""
    rows = tree.internal_nodes() if leaf_logits is not None else torch.arange(tree.num_nodes)
    row_of = {int(node): i for i, node in enumerate(rows)}

    def probs(node):
        logits = processed_logits[row_of[node]] if node in row_of else leaf_logits(torch.tensor(node))
        return torch.softmax(logits.float(), dim=-1)

    parents = tree.parents.tolist()
    path, node = [0], 0
    while True:
        for child in [i for i, p in enumerate(parents) if p == node]:
            if torch.rand(()) < probs(node)[tree.tokens[child]]:
                path.append(child)
                node = child
                break
        else:  # the path padded to one entry per level, as `verification.verify` returns it
            return torch.tensor(path + [-1] * (tree.levels + 1 - len(path))), torch.multinomial(probs(node), 1)[0]


def test_wrong_acceptance_rule_is_detected(target_and_draft, monkeypatch):
    target, draft = target_and_draft
    processors = LogitsProcessorList(WARPERS)
    probs = exact_distribution(target, processors)
    monkeypatch.setattr(verification, "verify", classic_wrong_verify)
    counts = sample_counts(target, draft, processors, WRONG_RULE_SAMPLES)
    print(f"wrong rule p-value {chi_square_p_value(counts, probs):.3g}")
    assert chi_square_p_value(counts, probs) < 1e-6


@pytest.mark.parametrize("cache_implementation", [None, "static", "static-compiled"])
def test_generate_entry_point_samples_the_same_distribution(target_and_draft, monkeypatch, cache_implementation):
    """Through target.generate(do_sample=True, temperature=..., assistant_model=draft): first two tokens. This one
    keeps the full logits of every tree node (the accelerator path); the tests above run the CPU path, where leaves'
    logits are computed only when the accepted path ends there. With cache_implementation="static" the trees are
    verified into a StaticCache, padded to one size with dummy nodes (sampled too, never accepted), by
    `verify_round`; "static-compiled" runs it and `draft_round` compiled (inductor's random numbers)."""
    from transformers import CompileConfig

    from transformers_jakiro.decoding import row_rounds as decoding

    compile_kwargs = {}
    if cache_implementation == "static-compiled":
        config = CompileConfig(fullgraph=True, mode="default")
        config._compile_all_devices = True  # transformers' switch for compiling on a CPU
        cache_implementation, compile_kwargs = "static", {"compile_config": config}

    monkeypatch.setattr(decoding, "lazy_leaf_head", lambda *args: None)
    target, draft = target_and_draft
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    three = exact_distribution(target, processors).reshape(VOCAB, VOCAB, VOCAB)
    probs = three.sum(-1).flatten()
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    torch.manual_seed(99)
    with tree_settings(draft, total_tokens=10, depth=2, top_k=3):
        for _ in range(2000):
            out = target.generate(
                PROMPT, do_sample=True, temperature=0.8, max_new_tokens=2, assistant_model=draft,
                cache_implementation=cache_implementation, **compile_kwargs,
            )
            counts[out[0, 3] * VOCAB + out[0, 4]] += 1
    assert chi_square_p_value(counts, probs) > 1e-4
