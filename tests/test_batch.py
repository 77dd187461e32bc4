"""Batches (B > 1): every row identical to plain batched `generate` on the same batch (float32 greedy), every row's
samples from the target's own distribution (chi-square), and every row's draft exactly as if the row were alone."""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import MaxLengthCriteria

from test_sampling import NEW_TOKENS, WARPERS, chi_square_p_value, exact_distribution, small_target_and_draft
from test_sampling import VOCAB as SMALL_VOCAB
from tiny_models import ARCHS, VOCAB, make_tokenizer, trained_pairs
from transformers_jakiro import jakiro_generate, tree_settings
from transformers_jakiro.decoding import round_controller
from transformers_jakiro.decoding.kv_cache import new_target_cache
from transformers_jakiro.decoding.loop import jakiro_decode


@pytest.fixture(scope="module")
def pairs():
    return trained_pairs()


def left_padded(prompts: list[torch.LongTensor], pad: int = 0):
    """input_ids and attention_mask of a left-padded batch."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = prompt
        mask[row, longest - len(prompt) :] = 1
    return dict(input_ids=ids, attention_mask=mask)


def random_batch(generator, size: int, low: int = 2, high: int = 20):
    lengths = torch.randint(low, high, (size,), generator=generator).tolist()
    return left_padded([torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_rows_identical_to_plain_batched_generate(arch, pairs):
    """B in {2, 3, 5}, prompts of different lengths, lookup on and off, the round controller on and off,
    max_new_tokens 1, 2 and more than a tree, processors that read the prefix, and an EOS that some rows reach
    early (a token the rows generate anyway)."""
    target, draft = pairs(arch)
    g = torch.Generator().manual_seed(11 + ARCHS.index(arch))
    cases = 0
    for size in (2, 3, 5):
        for lookup, controller, max_new in [(0, False, 1), (4, True, 2), (0, True, 40), (4, False, 40)]:
            batch = random_batch(g, size)
            kwargs = dict(do_sample=False, max_new_tokens=max_new)
            if max_new > 2 and size != 3:
                kwargs.update(repetition_penalty=1.3, no_repeat_ngram_size=4, min_new_tokens=3)
            if size == 3:  # an EOS that some rows reach early: the token plain decoding emits in row 0 at step 5
                eos = int(target.generate(**batch, do_sample=False, max_new_tokens=6)[0, -1])
                kwargs["eos_token_id"] = eos
            expected = target.generate(**batch, **kwargs)
            with tree_settings(draft, lookup_tokens=lookup, adaptive=controller):
                got = target.generate(**batch, assistant_model=draft, **kwargs)
            assert torch.equal(got, expected), (size, lookup, controller, max_new)
            stats = draft.last_generation_stats
            assert len(stats.rows) == size and stats.new_tokens == sum(row.new_tokens for row in stats.rows)
            cases += 1
    assert cases == 12


def test_each_row_drafts_as_if_alone(pairs):
    """Holes and padding in the shared caches change nothing: with the batch tree pinned, every row accepts exactly
    the lengths its own batch-of-one run accepts with that tree."""
    target, draft = pairs("qwen2")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (4, 13, 7, 2)]
    config = draft.config
    tree = round_controller.batch_tree(config.total_tokens, config.depth, config.top_k, len(prompts))
    kwargs = dict(do_sample=False, max_new_tokens=48, min_new_tokens=48)
    with tree_settings(draft, adaptive=False):
        batched = target.generate(**left_padded(prompts), assistant_model=draft, **kwargs)
    rows = draft.last_generation_stats.rows
    assert max(row.mean_accepted_length for row in rows) > 1.8  # trees really accepted several tokens deep
    with tree_settings(draft, total_tokens=tree[0], depth=tree[1], top_k=tree[2], adaptive=False):
        for i, prompt in enumerate(prompts):
            alone = target.generate(prompt[None], assistant_model=draft, **kwargs)
            assert torch.equal(alone[0], batched[i, -len(prompt) - 48 :])
            assert draft.last_generation_stats.accepted_lengths == rows[i].accepted_lengths


def test_custom_generate_entry_point_and_fused_head():
    """The custom_generate route takes batches too, and so do heads that read several target layers."""
    get = trained_pairs(target_feature_layers=[0])
    target, draft = get("llama")
    batch = random_batch(torch.Generator().manual_seed(2), 3)
    expected = target.generate(**batch, do_sample=False, max_new_tokens=30)
    got = target.generate(**batch, do_sample=False, max_new_tokens=30, custom_generate=jakiro_generate, draft=draft,
                          total_tokens=12, depth=3, top_k=4)
    assert torch.equal(got, expected)


def test_stop_strings_per_row(pairs):
    target, draft = pairs("llama")
    tokenizer = make_tokenizer()
    batch = random_batch(torch.Generator().manual_seed(9), 4)
    plain = target.generate(**batch, do_sample=False, max_new_tokens=30)
    text = tokenizer.decode(plain[1, -30:][10:12])  # a string row 1 writes midway
    kwargs = dict(do_sample=False, max_new_tokens=30, stop_strings=[text], tokenizer=tokenizer)
    expected = target.generate(**batch, **kwargs)
    assert expected.shape[1] < plain.shape[1] or (expected == 0).any()
    assert torch.equal(target.generate(**batch, assistant_model=draft, **kwargs), expected)


def test_several_return_sequences_through_custom_generate(pairs):
    """generate expands the prompt to num_return_sequences rows before the decoding method; they decode as a batch."""
    target, draft = pairs("llama")
    prompt = torch.tensor([[5, 9, 33, 17]])
    out = target.generate(prompt, do_sample=True, max_new_tokens=12, num_return_sequences=3,
                          custom_generate=jakiro_generate, draft=draft)
    assert out.shape == (3, 16) and torch.equal(out[:, :4], prompt.expand(3, -1))
    assert len(draft.last_generation_stats.rows) == 3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sampling_rows_match_the_target_distribution(cache):
    """Two prompts of different lengths, four rows each, in one left-padded batch: each row's first three tokens are
    samples from the target's exact distribution for its own prompt (chi-square per prompt); with a dynamic cache,
    and with a static one (fixed-shape trees, the verify forward over the whole static length)."""
    target, draft = small_target_and_draft()
    caches = dict(cache=new_target_cache(target.config, static_length=32)) if cache == "static" else {}
    prompts = [torch.tensor([3, 5, 4]), torch.tensor([6, 2, 7, 3, 5])]
    processors = LogitsProcessorList(WARPERS)
    batch = left_padded([prompts[i % 2] for i in range(8)])
    config = GenerationConfig(do_sample=True, pad_token_id=0, max_length=batch["input_ids"].shape[1] + NEW_TOKENS)
    config._pad_token_tensor = torch.tensor(0)
    weights = torch.tensor([SMALL_VOCAB**i for i in reversed(range(NEW_TOKENS))])
    counts = [torch.zeros(SMALL_VOCAB**NEW_TOKENS, dtype=torch.float64) for _ in prompts]
    stop = StoppingCriteriaList([MaxLengthCriteria(batch["input_ids"].shape[1] + NEW_TOKENS)])
    torch.manual_seed(4321)
    multi = 0
    for _ in range(700):
        out = jakiro_decode(target, batch["input_ids"], processors, stop, config, draft,
                            attention_mask=batch["attention_mask"], **caches)
        for row in range(8):
            counts[row % 2][int((out[row, -NEW_TOKENS:] * weights).sum())] += 1
        multi += sum(n > 1 for row in draft.last_generation_stats.rows for n in row.accepted_lengths)
    assert multi > 700  # draft tokens were accepted in many rounds, not only bonus tokens
    for prompt, row_counts in zip(prompts, counts):
        p_value = chi_square_p_value(row_counts, exact_distribution(target, processors, prompt[None]))
        print(f"prompt {prompt.tolist()}: p-value {p_value:.3g}")
        assert p_value > 1e-4


def test_chi_square_tells_rows_apart():
    """The per-row test can fail: samples of the other prompt's distribution, as many as a row gets above, are
    rejected (so rows mixed up in the batch would be caught)."""
    target, _ = small_target_and_draft()
    processors = LogitsProcessorList(WARPERS)
    other = exact_distribution(target, processors, torch.tensor([[6, 2, 7, 3, 5]]))
    own = exact_distribution(target, processors, torch.tensor([[3, 5, 4]]))
    torch.manual_seed(0)
    counts = torch.distributions.Multinomial(2800, probs=other.float()).sample().double()
    assert chi_square_p_value(counts, own) < 1e-4


@pytest.mark.slow
def test_smollm2_batch_of_four_chat_prompts_and_pipeline(smollm2):
    """The real target with the shipped head: a left-padded batch of 4 chat prompts identical to plain batched
    generate (float32), and `pipeline(..., assistant_model=draft, batch_size=4)` identical to the plain pipeline."""
    from pathlib import Path

    from transformers import AutoModel, pipeline

    model, tokenizer = smollm2
    head = Path(__file__).resolve().parents[1] / "heads" / "jakiro-smollm2-135m-instruct"
    draft = AutoModel.from_pretrained(head)
    questions = ["Write a Python function that reverses a string.", "What is the capital of France?",
                 "List three prime numbers.", "Explain recursion in one sentence."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    tokenizer.padding_side = "left"
    inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                           padding=True)
    kwargs = dict(do_sample=False, max_new_tokens=40)
    expected = model.generate(**inputs, **kwargs)
    assert torch.equal(model.generate(**inputs, assistant_model=draft, **kwargs), expected)
    # The head's acceptance with its batch tree pinned: with the controller on, a loaded machine may choose plain
    # steps for most rounds, and acceptance then says nothing about the head.
    with tree_settings(draft, adaptive=False):
        assert torch.equal(model.generate(**inputs, assistant_model=draft, **kwargs), expected)
    assert max(row.mean_accepted_length for row in draft.last_generation_stats.rows) > 1.5

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = generator(chats, batch_size=4, **kwargs)
    jakiro = generator(chats, batch_size=4, assistant_model=draft, **kwargs)
    assert [out[0]["generated_text"] for out in jakiro] == [out[0]["generated_text"] for out in plain]
    assert len(draft.last_generation_stats.rows) == 4  # the pipeline handed the draft one batch of four


def test_padded_batch_without_attention_mask(pairs):
    """Left padding with pad_token_id but no attention_mask: generate infers the mask from the pad tokens (with its
    own warning), and the rows still match plain batched generate."""
    target, draft = pairs("llama")
    batch = random_batch(torch.Generator().manual_seed(21), 3)
    kwargs = dict(do_sample=False, max_new_tokens=20, pad_token_id=0)
    expected = target.generate(batch["input_ids"], **kwargs)
    assert torch.equal(target.generate(batch["input_ids"], assistant_model=draft, **kwargs), expected)


def test_a_callers_cache_in_a_batch_is_refused_before_any_work(pairs):
    """Plain batched generate fills a DynamicCache passed to it (every row, left padding and pad tokens after EOS
    included) and it can be continued; tree decoding of a batch drops finished rows and leaves holes, so it refuses
    such a cache by name, before it writes anything into it. A batch of one fills it exactly (test_entry_points)."""
    from transformers import DynamicCache

    target, draft = pairs("llama")
    batch = random_batch(torch.Generator().manual_seed(5), 3)
    plain_cache = DynamicCache()
    expected = target.generate(**batch, do_sample=False, max_new_tokens=12, past_key_values=plain_cache)
    assert plain_cache.get_seq_length() == expected.shape[1] - 1  # what plain generate leaves in it
    cache = DynamicCache()
    for entry in ({"assistant_model": draft}, {"custom_generate": jakiro_generate, "draft": draft}):
        with pytest.raises(ValueError, match="cannot fill a cache you pass to generate.*Leave the cache out"):
            target.generate(**batch, do_sample=False, max_new_tokens=12, past_key_values=cache, **entry)
        assert cache.get_seq_length() == 0
    # Without a cache of the caller's, the same batch decodes as plain batched generate does.
    got = target.generate(**batch, do_sample=False, max_new_tokens=12, assistant_model=draft)
    assert torch.equal(got, expected)
