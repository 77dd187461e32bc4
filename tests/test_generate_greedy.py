"""Greedy Jakiro decoding is token-identical to plain `target.generate`, whatever the tree, architecture or
stopping rule. Drafts are quickly fitted to each tiny target so that trees are accepted several tokens deep."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from tiny_models import ARCHS, make_tokenizer, random_prompt, trained_pairs
from transformers_jakiro import jakiro_generate, tree_settings

# (total_tokens, depth, top_k): default-like, chain, wide and shallow, deep and narrow, one node, large.
TREE_SHAPES = [(60, 5, 10), (6, 6, 1), (40, 1, 10), (30, 8, 3), (1, 3, 4), (80, 6, 8)]


@pytest.fixture(scope="module")
def pairs():
    """One (target, trained draft) per architecture, built once for the module."""
    return trained_pairs()


@pytest.mark.parametrize("arch", ARCHS)
def test_identical_on_50_prompts_and_several_tree_shapes(arch, pairs):
    target, draft = pairs(arch)
    g = torch.Generator().manual_seed(hash(arch) % 1000)
    taus = []
    for i in range(50):
        prompt = random_prompt(g)
        total_tokens, depth, top_k = TREE_SHAPES[i % len(TREE_SHAPES)]
        max_new = int(torch.randint(1, 48, (1,), generator=g))
        expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new)
        with tree_settings(draft, total_tokens=total_tokens, depth=depth, top_k=top_k):
            got = target.generate(prompt, do_sample=False, max_new_tokens=max_new, assistant_model=draft)
        assert torch.equal(got, expected), f"prompt {i} tree {TREE_SHAPES[i % len(TREE_SHAPES)]}"
        taus.append(draft.last_generation_stats.mean_accepted_length)
    # The trees were really accepted several tokens deep, so multi-token paths were exercised.
    assert max(taus) > 2.0


@pytest.mark.parametrize("contrastive", [True, False])
def test_long_generation_and_contrastive_ablation(pairs, contrastive):
    target, draft = pairs("llama")
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        prompt = random_prompt(g)
        kwargs = dict(do_sample=False, max_new_tokens=320, min_new_tokens=320)  # min_new_tokens: no early EOS
        expected = target.generate(prompt, **kwargs)
        with tree_settings(draft, contrastive=contrastive):
            got = target.generate(prompt, assistant_model=draft, **kwargs)
        assert got.shape[1] == prompt.shape[1] + 320
        assert torch.equal(got, expected)


def test_custom_generate_entry_point(pairs):
    target, draft = pairs("qwen2")
    prompt = torch.tensor([[5, 9, 33, 17]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    got = target.generate(
        prompt, do_sample=False, max_new_tokens=40, custom_generate=jakiro_generate, draft=draft, total_tokens=20,
        depth=3, top_k=4,
    )
    assert torch.equal(got, expected)


def test_other_assistants_keep_stock_behaviour(pairs):
    target, _ = pairs("llama")
    small = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ).eval()
    prompt = torch.tensor([[5, 9, 33, 17, 5, 9]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=30)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=small), expected)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30, prompt_lookup_num_tokens=3), expected)


def test_eos_inside_accepted_paths(pairs):
    """Use tokens that occur mid-generation as EOS: both decoders must stop at the same first occurrence."""
    target, draft = pairs("llama")
    g = torch.Generator().manual_seed(3)
    stopped_inside = 0
    for _ in range(12):
        prompt = random_prompt(g)
        free = target.generate(prompt, do_sample=False, max_new_tokens=60, eos_token_id=[])
        new = free[0, prompt.shape[1] :].tolist()
        eos = [new[int(torch.randint(5, 50, (1,), generator=g))], 127]  # several EOS ids
        expected = target.generate(prompt, do_sample=False, max_new_tokens=60, eos_token_id=eos)
        got = target.generate(prompt, do_sample=False, max_new_tokens=60, eos_token_id=eos, assistant_model=draft)
        assert torch.equal(got, expected)
        assert got[0, -1].item() in eos and got.shape[1] < free.shape[1] + 1
        stopped_inside += draft.last_generation_stats.accepted_lengths[-1] > 1
    assert stopped_inside > 0  # at least once the EOS sat inside a multi-token accepted path


def test_max_new_tokens_and_max_length_exact(pairs):
    target, draft = pairs("mistral")
    prompt = torch.tensor([[11, 12, 13]])
    for n in range(1, 30):
        got = target.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, assistant_model=draft)
        assert got.shape[1] == 3 + n
        assert torch.equal(got, target.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n))
    got = target.generate(prompt, do_sample=False, max_length=17, assistant_model=draft)
    assert torch.equal(got, target.generate(prompt, do_sample=False, max_length=17))


class SumAbove(StoppingCriteria):
    """Stops once the generated ids add up past a threshold: a criterion only a per-token check gets right."""

    def __init__(self, prompt_length, threshold):
        self.prompt_length, self.threshold = prompt_length, threshold

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, self.prompt_length :].sum(-1) > self.threshold


def test_custom_stopping_criteria_and_stop_strings(pairs):
    target, draft = pairs("llama")
    tokenizer = make_tokenizer()
    g = torch.Generator().manual_seed(5)
    for _ in range(8):
        prompt = random_prompt(g)
        criteria = StoppingCriteriaList([SumAbove(prompt.shape[1], int(torch.randint(200, 2000, (1,), generator=g)))])
        expected = target.generate(prompt, do_sample=False, max_new_tokens=60, stopping_criteria=criteria)
        got = target.generate(
            prompt, do_sample=False, max_new_tokens=60, stopping_criteria=criteria, assistant_model=draft
        )
        assert torch.equal(got, expected)

        free = target.generate(prompt, do_sample=False, max_new_tokens=40, min_new_tokens=40)[0, prompt.shape[1] :]
        at = int(torch.randint(3, 35, (1,), generator=g))
        stop = "".join(tokenizer.convert_ids_to_tokens(free[at : at + 2].tolist()))
        kwargs = dict(do_sample=False, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
        expected = target.generate(prompt, **kwargs)
        assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), expected)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_each_token_once_in_order(pairs):
    target, draft = pairs("qwen3")
    prompt = torch.tensor([[7, 8, 9, 10]])
    streamer = Collect()
    got = target.generate(prompt, do_sample=False, max_new_tokens=50, streamer=streamer, assistant_model=draft)
    assert streamer.ended
    assert streamer.chunks[0] == prompt[0].tolist()
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == got[0, 4:].tolist()


def test_return_dict_scores_logits_and_cache(pairs):
    target, draft = pairs("phi3")
    prompt = torch.tensor([[21, 22, 23, 24, 25]])
    kwargs = dict(do_sample=False, max_new_tokens=25, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3)
    expected = target.generate(prompt, **kwargs)
    got = target.generate(prompt, assistant_model=draft, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == len(got.logits) == got.sequences.shape[1] - 5
    for mine, theirs in zip(got.scores, expected.scores):
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(mine))
        torch.testing.assert_close(mine[finite], theirs[finite], atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(got.logits, expected.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    cache = got["cache"] if "cache" in got else got["past_key_values"]
    assert cache.get_seq_length() == got.sequences.shape[1] - 1


def test_attention_mask_with_left_padding(pairs):
    target, draft = pairs("llama")
    prompt = torch.tensor([[0, 0, 0, 44, 45, 46, 47]])
    for mask in (torch.ones_like(prompt), torch.tensor([[0, 0, 0, 1, 1, 1, 1]])):
        expected = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=30)
        got = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=30, assistant_model=draft)
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "processing",
    [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(bad_words_ids=[[75], [122, 75]]),
        dict(min_new_tokens=20, suppress_tokens=[33, 59]),
        dict(sequence_bias={(41,): 5.0, (11, 75): -10.0}),
    ],
)
def test_greedy_with_logits_processors(pairs, processing):
    target, draft = pairs("llama")
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        prompt = random_prompt(g)
        expected = target.generate(prompt, do_sample=False, max_new_tokens=40, **processing)
        got = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=draft, **processing)
        assert torch.equal(got, expected)


def test_stats_are_consistent(pairs):
    target, draft = pairs("llama")
    prompt = torch.tensor([[3, 4, 5, 6]])
    out = target.generate(prompt, do_sample=False, max_new_tokens=64, min_new_tokens=64, assistant_model=draft)
    stats = draft.last_generation_stats
    assert stats.new_tokens == out.shape[1] - 4 == 64 == sum(stats.accepted_lengths)
    assert stats.rounds == len(stats.accepted_lengths)
    assert stats.mean_accepted_length == pytest.approx(stats.new_tokens / stats.rounds)
    assert stats.accepted_lengths[0] == 1  # the prefill round contributes the first token
    assert all(1 <= n <= draft.config.depth + 2 for n in stats.accepted_lengths)
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0
    assert stats.as_dict()["mean_accepted_length"] == stats.mean_accepted_length
    # the papers' figure: draft-verify cycles only, the prefill and its token left out
    assert stats.draft_rounds == stats.rounds - 1
    assert stats.papers_tau == pytest.approx((stats.new_tokens - 1) / (stats.rounds - 1))
    assert stats.papers_tau > stats.mean_accepted_length
    assert stats.as_dict()["papers_tau"] == stats.papers_tau
    target.generate(prompt, do_sample=False, max_new_tokens=1, assistant_model=draft)  # the prefill only
    assert draft.last_generation_stats.draft_rounds == 0 and draft.last_generation_stats.papers_tau == 0.0


def test_lazy_leaf_logits_match_the_full_logits_path(pairs, monkeypatch):
    """On CPU only internal nodes get logits in the verify forward (a leaf's are computed if the path ends there);
    decoding with the full logits (the accelerator path) gives the same tokens, scores and logits."""
    from transformers_jakiro.decoding import row_rounds as decoding

    target, draft = pairs("qwen2")
    prompt = torch.tensor([[7, 8, 9, 10, 11]])
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    assert decoding.lazy_leaf_head(target, out.hidden_states[-1][:, -1], out.logits[:, -1]) is not None
    # a model whose logits are more than its output layer's (soft-capping, scaling) keeps the full path
    assert decoding.lazy_leaf_head(target, out.hidden_states[-1][:, -1], 0.5 * out.logits[:, -1]) is None

    kwargs = dict(do_sample=False, max_new_tokens=40, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, no_repeat_ngram_size=3, assistant_model=draft)
    lazy = target.generate(prompt, **kwargs)
    lazy_tau = draft.last_generation_stats.mean_accepted_length
    monkeypatch.setattr(decoding, "lazy_leaf_head", lambda *args: None)
    full = target.generate(prompt, **kwargs)
    assert torch.equal(lazy.sequences, full.sequences) and lazy_tau > 1.5
    assert lazy_tau == draft.last_generation_stats.mean_accepted_length
    for mine, theirs in zip(lazy.scores + lazy.logits, full.scores + full.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("total_tokens, lazy", [(2, False), (8, True)])
def test_trees_of_a_few_nodes_take_their_logits_from_the_forward(pairs, monkeypatch, total_tokens, lazy):
    """On a CPU a tree of fewer than `LAZY_LEAVES_MIN_NODES` nodes (root, 2 draft nodes) keeps every node's logits in
    the verify forward; a larger one keeps the internal nodes' only (`logits_to_keep` with node indices)."""
    from transformers_jakiro import tree_settings
    from transformers_jakiro.decoding.row_rounds import LAZY_LEAVES_MIN_NODES

    assert 2 + 1 < LAZY_LEAVES_MIN_NODES <= 8 + 1
    target, draft = pairs("qwen2")
    prompt = torch.tensor([[7, 8, 9, 10, 11]])
    kept = []
    forward = target.forward

    @functools.wraps(forward)  # its signature says the forward takes `logits_to_keep`
    def spy(*args, **kwargs):
        kept.append(torch.is_tensor(kwargs.get("logits_to_keep")))
        return forward(*args, **kwargs)

    expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
    monkeypatch.setattr(target, "forward", spy)
    with tree_settings(draft, total_tokens=total_tokens, depth=1, top_k=4, adaptive=False):
        got = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft)
    assert torch.equal(got, expected)
    assert any(kept) == lazy
