"""`jakiro train`: data pipeline, the Trainer (online frozen target), resume, reduced vocabulary, errors, the CLI;
and, marked slow, distill + train on the real SmolLM2-135M-Instruct raising tau."""

import json
import random

import pytest
import torch
from chat_tokenizer import make_tokenizer
from tiny_models import make_target
from transformers import DynamicCache, TrainerCallback

from transformers_jakiro import JakiroDraftModel, cli, tree_settings
from transformers_jakiro.training.distill import distill
from transformers_jakiro.training.feature_store import FeatureStore, conversation_key, target_fingerprint
from transformers_jakiro.training import (
    JakiroCollator,
    JakiroTrainer,
    JakiroTrainingConfig,
    assistant_tokens,
    build_examples,
    evaluate_tau,
    init_from_head,
    read_conversations,
    select_draft_vocab,
    tokenize_conversation,
    train_head,
    unroll_draft,
    unrolled_attention_mask,
)
from transformers_jakiro.training.cli import _command, add_arguments, config_from_args


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, target, tokenizer):
    """24 conversations whose responses the tiny target wrote itself (what `jakiro distill` produces)."""
    rng = random.Random(0)
    prompts = [(str(i), "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 20)))) for i in range(24)]
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    distill(target, tokenizer, prompts, path, max_new_tokens=24, batch_size=8, progress=False)
    return path


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        learning_rate=3e-3,
        warmup_steps=0,
        logging_steps=1,
        save_steps=1000,
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        per_device_train_batch_size=4,
        seed=0,
    )
    values.update(overrides)
    return JakiroTrainingConfig(**values)


def examples_of(data_file, tokenizer, max_length=2048):
    conversations, bad = read_conversations(data_file)
    assert not bad
    return build_examples(conversations, tokenizer, max_length)[0]


# -- data -----------------------------------------------------------------------------------------------------------
def test_assistant_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok\nbye"},
    ]
    example = tokenize_conversation(tokenizer, messages)
    masked = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
    assert tokenizer.decode(masked) == "hello!<|end|>ok\nbye<|end|>"
    assert len(example["input_ids"]) == len(example["loss_mask"])


def test_read_conversations_formats_and_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "a"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{broken\n")
    conversations, bad = read_conversations(path)
    assert len(conversations) == 2 and conversations[1][1] == {"role": "assistant", "content": "a"}
    assert [n for n, _ in bad] == [3, 4, 5] and "no assistant" in bad[0][1] and "unknown role" in bad[1][1]


def test_truncation_skips_too_long_prompts_and_collator_pads_right(tokenizer):
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}]
    long = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "answer"}]
    examples, stats = build_examples([short, long], tokenizer, max_length=12)
    assert stats["conversations"] == 1 and stats["skipped_prompt_too_long"] == 1
    assert len(examples[0]["input_ids"]) <= 12
    with pytest.raises(ValueError, match="longer than max_length=12"):
        build_examples([long], tokenizer, max_length=12)
    kept, stats = build_examples([short, long], tokenizer, max_length=len(examples[0]["input_ids"]), drop_longer=True)
    assert kept == examples and stats["skipped_longer_than_max_length"] == 1
    with pytest.raises(ValueError, match="drop_longer skips them"):
        build_examples([long], tokenizer, max_length=30, drop_longer=True)
    batch = JakiroCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5], "loss_mask": [1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_no_assistant_tokens_is_a_clear_error(tmp_path, tokenizer, target):
    user_only = make_tokenizer()
    user_only.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="no assistant tokens"):
        build_examples([messages], user_only, max_length=64)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}]}) + "\n")
    with pytest.raises(ValueError, match="no usable conversation with assistant tokens.*line 1"):
        train_head(target, tokenizer, path, config(tmp_path), eval_size=0)


def test_select_draft_vocab_most_frequent_plus_eos_sorted():
    examples = [{"input_ids": [9, 9, 9, 7, 7, 5, 3, 4], "loss_mask": [1, 1, 1, 1, 1, 1, 0, 1]}]
    tokens = assistant_tokens(examples)
    assert tokens == [9, 9, 9, 7, 7, 5, 4]  # the masked-out (prompt) token 3 is not an assistant token
    assert select_draft_vocab(tokens, 2, vocab_size=16).tolist() == [7, 9]
    assert select_draft_vocab(tokens, 3, vocab_size=16, always=[2]).tolist() == [2, 7, 9]
    # ties go to the lower id; the untrained token 3 is never picked; fewer distinct tokens -> fewer ids
    assert select_draft_vocab(tokens, 4, vocab_size=16).tolist() == [4, 5, 7, 9]
    assert select_draft_vocab(tokens, 100, vocab_size=16).tolist() == [4, 5, 7, 9]


# -- trainer --------------------------------------------------------------------------------------------------------
def test_one_step_changes_the_draft_and_not_the_target(tmp_path, target, tokenizer, data_file):
    draft = JakiroDraftModel.from_target(target)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = JakiroTrainer(
        model=draft, target=target, args=config(tmp_path), train_dataset=examples_of(data_file, tokenizer)
    )
    trainer.train()
    changed = [k for k, v in draft.state_dict().items() if not torch.equal(v, before[k])]
    assert "fc.weight" in changed and "layer.moe.gate.weight" in changed and "layer.self_attn.q_proj.weight" in changed
    assert all(torch.equal(v, target_before[k]) for k, v in target.state_dict().items())
    assert not any(p.requires_grad for p in target.parameters())
    logged = trainer.state.log_history[0]
    for key in ("loss", "left_l1", "left_ce", "left_acc", "right_l1", "right_ce", "right_acc"):
        assert key in logged


@pytest.mark.parametrize("bf16", [False, True])
def test_bf16_autocasts_the_vocabulary_projections_too(tmp_path, target, tokenizer, data_file, bf16):
    """accelerate autocasts only the draft's forward; the draft's and the teacher's lm_head projections, most of a
    CPU step's work, run in the loss. Under --bf16 they must run in bf16 as well, and the loss stays fp32."""
    draft = JakiroDraftModel.from_target(target)  # full vocabulary: both projections are the target's lm_head
    seen = []
    hook = target.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    args = config(tmp_path, bf16=bf16, use_cpu=True, cache_features=True)
    trainer = JakiroTrainer(model=draft, target=target, args=args)
    batch = JakiroCollator(0)(examples_of(data_file, tokenizer)[:4])
    trainer.target_features(batch)  # fills the cache: the loss below reads it and never runs the target
    seen.clear()
    try:
        loss = trainer.compute_loss(draft.train(), batch)
    finally:
        hook.remove()
    assert len(seen) == 4  # teacher and draft, for the left and the right head
    assert set(seen) == {torch.bfloat16 if bf16 else torch.float32}
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_target_features_run_the_lm_head_only_where_a_loss_is_taken(tmp_path, target, tokenizer, data_file):
    # The CausalLM forward's own lm_head call (on its last position) cost seconds per batch on a 152k-row vocabulary.
    draft = JakiroDraftModel.from_target(target)
    trainer = JakiroTrainer(model=draft, target=target, args=config(tmp_path))
    batch = JakiroCollator(0)(examples_of(data_file, tokenizer)[:4])
    rows = []
    hook = target.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape))
    try:
        features, next_tokens = trainer.target_features(batch)
    finally:
        hook.remove()
    assert rows == [torch.Size([int((next_tokens >= 0).sum()), target.config.hidden_size])]
    with torch.no_grad():
        expected = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    counted = next_tokens >= 0
    assert torch.equal(next_tokens[counted], expected[counted])


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_feature_cache_gives_the_same_loss_without_running_the_target_again(
    tmp_path, target, tokenizer, data_file, where
):
    examples = examples_of(data_file, tokenizer)
    d2t = select_draft_vocab(assistant_tokens(examples), 40, target.config.vocab_size, always=[2])
    draft = JakiroDraftModel.from_target(target, draft_vocab_size=40).eval()  # eval: no input noise
    draft.d2t.copy_(d2t)
    online = JakiroTrainer(model=draft, target=target, args=config(tmp_path))
    cache = dict(cache_features=True) if where == "memory" else dict(feature_cache_dir=str(tmp_path / "features"))
    cached = JakiroTrainer(model=draft, target=target, args=config(tmp_path, **cache))
    forwards = []
    # Training runs the target's decoder alone (its features are all it needs), so count the decoder's forwards.
    hook = target.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    keys = [conversation_key(e["input_ids"], e["loss_mask"]) for e in examples[:8]]
    try:
        whole, part = JakiroCollator(0)(examples[:8]), JakiroCollator(0)(examples[5:7])  # part: other padding
        with torch.no_grad():
            expected = [online.compute_loss(draft, batch).item() for batch in (whole, part)]
            forwards.clear()
            first = cached.compute_loss(draft, whole).item()
            assert len(forwards) == 1 and sorted(cached.feature_cache) == sorted(keys)
            if where == "disk":  # written to a shard, read back through a fresh store (a later run)
                cached.feature_cache.flush()
                cached = JakiroTrainer(model=draft, target=target, args=config(tmp_path, **cache))
                assert len(cached.feature_cache) == 8
            again = [cached.compute_loss(draft, batch).item() for batch in (whole, part)]
            assert len(forwards) == 1  # both batches came from the cache
    finally:
        hook.remove()
    assert first == pytest.approx(expected[0], rel=1e-6)
    assert again == pytest.approx(expected, rel=1e-6)
    # the reduced teacher is the full teacher's slice, computed from the kept rows only
    features = torch.randn(5, target.config.hidden_size)
    assert torch.allclose(online._teacher_logits(features, draft.d2t), target.lm_head(features)[:, d2t], atol=1e-6)


def test_prepare_features_fills_the_store_once_and_training_then_never_runs_the_target(
    tmp_path, target, tokenizer, data_file
):
    examples = examples_of(data_file, tokenizer)
    draft = JakiroDraftModel.from_target(target)
    args = config(tmp_path, feature_cache_dir=str(tmp_path / "features"), max_steps=4)
    report = JakiroTrainer(model=draft, target=target, args=args, train_dataset=examples).prepare_features()
    assert report["conversations"] == len(examples) and report["already_cached"] == 0
    again = JakiroTrainer(model=draft, target=target, args=args, train_dataset=examples)
    assert again.prepare_features()["conversations"] == 0
    forwards = []
    hook = target.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    try:
        again.train()
    finally:
        hook.remove()
    assert forwards == []
    names = sorted(p.name for p in (tmp_path / "features").iterdir())
    assert len(names) == 2 and names[0].startswith("shard-0-") and names[1] == "store.json"


def test_feature_store_refuses_features_of_another_target(tmp_path, target):
    fingerprint = target_fingerprint(target)
    store = FeatureStore(tmp_path, fingerprint, shard_bytes=1)  # every entry is its own shard
    store["a"] = (torch.randn(3, 4), torch.tensor([1, -1, 2]))
    store["a"] = (torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))  # an entry is written once
    store["b"] = (torch.randn(2, 4), torch.tensor([5, 6]))
    reopened = FeatureStore(tmp_path, fingerprint)
    assert sorted(reopened) == ["a", "b"] and len(list(tmp_path.glob("shard-*"))) == 2
    store["c"] = (torch.randn(1, 4), torch.tensor([7]))  # written by another run after `reopened` was opened
    assert "c" in reopened and reopened["c"][1].tolist() == [7]
    assert torch.equal(reopened["a"][0], store["a"][0]) and reopened["b"][1].tolist() == [5, 6]
    other = target_fingerprint(make_target("llama", seed=1))  # same architecture, other weights
    assert {k for k in other if other[k] != fingerprint[k]} == {"weights"}
    with pytest.raises(ValueError, match="features of another target.*weights"):
        FeatureStore(tmp_path, other)


def test_unrolled_attention_mask_matches_a_brute_force_definition():
    for rows in (1, 2, 5, 9):
        for step in range(1, rows):
            mask = unrolled_attention_mask(rows, step)
            sizes = [rows - i for i in range(step + 1)]
            assert mask.shape == (rows - step, sum(sizes))
            for s in range(rows - step):
                visible = {(0, c) for c in range(s + 1)} | {(i, s) for i in range(1, step + 1)}
                columns = [(i, c) for i, size in enumerate(sizes) for c in range(size)]
                assert {columns[k] for k in mask[s].nonzero().flatten().tolist()} == visible


def test_unrolled_steps_compute_what_tree_levels_compute(target):
    """Row s of unrolled step j equals what drafting computes for a one-node-per-level branch rooted at position s:
    the draft reads the accepted context (true features up to s), then its own prediction level by level."""
    torch.manual_seed(0)
    draft = JakiroDraftModel.from_target(target).eval()
    ids = torch.randint(3, target.config.vocab_size, (1, 14))
    with torch.no_grad():
        features = target(ids, output_hidden_states=True).hidden_states[-1]
        unrolled = unroll_draft(draft, ids[:, 1:], features[:, :-1], steps=3)
    rows = ids.shape[1] - 1
    assert [out.last_hidden_state.shape[1] for out in unrolled] == [rows, rows - 1, rows - 2, rows - 3]
    for s in range(rows - 3):
        cache = DynamicCache()
        with torch.no_grad():
            out = draft(input_ids=ids[:, 1 : s + 2], hidden_states=features[:, : s + 1], cache=cache)
            left = out.last_hidden_state[:, -1:]
            for step in range(1, 4):
                out = draft(
                    input_ids=ids[:, s + step + 1 : s + step + 2],
                    hidden_states=left,
                    position_ids=torch.tensor([[s + step]]),
                    cache=cache,
                )
                left = out.last_hidden_state
                for mine, theirs in ((left, unrolled[step].last_hidden_state),
                                     (out.contrastive_hidden_state, unrolled[step].contrastive_hidden_state)):
                    torch.testing.assert_close(mine[0, 0], theirs[0, s], atol=1e-5, rtol=1e-5)


def test_unrolled_training_logs_each_step_and_trains_through_them(tmp_path, target, tokenizer, data_file):
    examples = examples_of(data_file, tokenizer)
    draft = JakiroDraftModel.from_target(target)
    trainer = JakiroTrainer(
        model=draft, target=target, args=config(tmp_path, unroll_steps=2, max_steps=2), train_dataset=examples
    )
    batch = JakiroCollator(0)(examples[:4])
    with torch.no_grad():
        plain = JakiroTrainer(model=draft, target=target, args=config(tmp_path)).compute_loss(draft.eval(), batch)
        unrolled = trainer.compute_loss(draft, batch)
    assert unrolled > plain  # the extra steps add their (weighted, positive) losses
    trainer.train()
    logged = trainer.state.log_history[0]
    for key in ("left_acc", "left_acc@1", "left_acc@2", "right_acc@2", "left_l1@1"):
        assert key in logged


def test_init_from_a_head_copies_its_weights_and_the_rows_of_shared_vocabulary(target):
    torch.manual_seed(0)
    old = JakiroDraftModel.from_target(target, draft_vocab_size=6)
    old.d2t.copy_(torch.tensor([2, 5, 7, 9, 11, 13]))
    torch.nn.init.normal_(old.lm_head.weight)
    new = JakiroDraftModel.from_target(target, draft_vocab_size=4)
    new.d2t.copy_(torch.tensor([3, 5, 9, 20]))
    before = new.lm_head.weight.detach().clone()
    # 2 shared rows are too few to fit a map for the other rows: they keep the target's rows
    assert init_from_head(new, old) == {"lm_head rows carried over": 2, "mapped from the target's": 0, "of": 4}
    assert torch.equal(new.fc.weight, old.fc.weight) and torch.equal(new.layer.moe.gate.weight, old.layer.moe.gate.weight)
    assert torch.equal(new.lm_head.weight[1], old.lm_head.weight[1]) and torch.equal(new.lm_head.weight[2], old.lm_head.weight[3])
    assert torch.equal(new.lm_head.weight[[0, 3]], before[[0, 3]])  # tokens the old head never had
    assert new.d2t.tolist() == [3, 5, 9, 20]
    other = JakiroDraftModel.from_target(target, num_experts=1, num_experts_per_tok=1, contrastive_head=False)
    with pytest.raises(ValueError, match="another target or shape.*num_experts"):
        init_from_head(new, other)


def test_init_from_maps_the_rows_of_new_tokens_as_training_moved_the_shared_ones(target):
    # a trained head's rows drift away from the target's lm_head rows they started as (here: by a known linear map);
    # rows for tokens the head never had must follow that drift, or the raw target rows outscore every trained row
    torch.manual_seed(0)
    hidden, rows_of = target.config.hidden_size, target.get_output_embeddings().weight.detach()
    drift = torch.randn(hidden, hidden) / hidden**0.5
    old = JakiroDraftModel.from_target(target, draft_vocab_size=100)
    old.d2t.copy_(torch.arange(0, 100))
    with torch.no_grad():
        old.lm_head.weight.copy_(rows_of[:100] @ drift)
    new = JakiroDraftModel.from_target(target, draft_vocab_size=100)
    with torch.no_grad():  # as train_head builds it: the target's rows of the new vocabulary
        new.d2t.copy_(torch.arange(20, 120))  # 80 tokens shared (>= hidden size: enough to fit the map), 20 new
        new.lm_head.weight.copy_(rows_of[20:120])
    assert init_from_head(new, old) == {"lm_head rows carried over": 80, "mapped from the target's": 20, "of": 100}
    assert torch.equal(new.lm_head.weight[:80], old.lm_head.weight[20:])
    torch.testing.assert_close(new.lm_head.weight[80:], rows_of[100:120] @ drift, atol=1e-4, rtol=1e-4)


def test_init_from_widens_the_experts_without_changing_what_the_head_computes(target):
    torch.manual_seed(0)
    old = JakiroDraftModel.from_target(target)
    for parameter in old.parameters():  # a "trained" head: no zero rows or columns anywhere
        torch.nn.init.normal_(parameter, std=0.1)
    width = old.config.expert_intermediate_size
    new = JakiroDraftModel.from_target(target, expert_intermediate_size=3 * width)
    init_from_head(new, old)
    experts = new.layer.moe.experts
    assert experts[0].up_proj.weight.shape[0] == 3 * width
    assert torch.equal(experts[1].gate_proj.weight[:width], old.layer.moe.experts[1].gate_proj.weight)
    assert experts[0].up_proj.weight[width:].abs().sum() > 0  # new units can learn: not all-zero
    assert not experts[0].down_proj.weight[:, width:].any()  # ...and add nothing until they do
    ids = torch.randint(0, target.config.vocab_size, (1, 7))
    features = torch.randn(1, 7, target.config.hidden_size)
    with torch.no_grad():
        a, b = old(input_ids=ids, hidden_states=features), new(input_ids=ids, hidden_states=features)
    torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state)
    torch.testing.assert_close(b.contrastive_hidden_state, a.contrastive_hidden_state)
    with pytest.raises(ValueError, match="expert_intermediate_size.*widened, not narrowed"):
        init_from_head(JakiroDraftModel.from_target(target), new)


def test_loss_falls_over_a_few_dozen_steps(tmp_path, target, tokenizer, data_file):
    examples = examples_of(data_file, tokenizer)
    draft = JakiroDraftModel.from_target(target)
    trainer = JakiroTrainer(model=draft, target=target, args=config(tmp_path, max_steps=40), train_dataset=examples)
    whole = JakiroCollator(0)(examples)

    def full_loss():  # on all the data, without input noise (eval mode)
        draft.eval()
        with torch.no_grad():
            return trainer.compute_loss(draft, whole).item()

    before = full_loss()
    trainer.train()
    after = full_loss()
    assert after < before - 0.1, (before, after)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert sum(e["left_acc"] for e in logs[-10:]) > sum(e["left_acc"] for e in logs[:10])


def test_resume_continues_from_the_saved_step(tmp_path, target, tokenizer, data_file):
    examples = examples_of(data_file, tokenizer)
    args = config(tmp_path, max_steps=4, save_steps=2, lr_scheduler_type="constant")
    JakiroTrainer(model=JakiroDraftModel.from_target(target), target=target, args=args, train_dataset=examples).train()
    assert (tmp_path / "out" / "checkpoint-4").is_dir()
    saved = JakiroDraftModel.from_pretrained(tmp_path / "out" / "checkpoint-4").state_dict()

    resumed = JakiroDraftModel.from_target(target)  # fresh weights: the checkpoint must replace them
    args = config(tmp_path, max_steps=6, save_steps=2, lr_scheduler_type="constant")
    trainer = JakiroTrainer(model=resumed, target=target, args=args, train_dataset=examples)
    loaded, steps = {}, []

    class Peek(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded.update({k: v.clone() for k, v in model.state_dict().items()})

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    trainer.add_callback(Peek())
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6 and steps == [5, 6]
    # on_train_begin runs after the checkpoint was loaded: training went on from checkpoint-4's weights
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_train_head_reduced_vocab_round_trip_tau_and_card(tmp_path, target, tokenizer, data_file):
    args = config(tmp_path, max_steps=3, draft_vocab_size=40)
    report = train_head(
        target,
        tokenizer,
        data_file,
        args,
        eval_size=2,
        eval_max_new_tokens=6,
        head_overrides=dict(total_tokens=8, depth=2, top_k=2),
    )
    out = tmp_path / "out"
    head = JakiroDraftModel.from_pretrained(out)
    d2t = head.d2t.tolist()
    assert head.config.draft_vocab_size == len(d2t) == 40 and head.lm_head.weight.shape[0] == 40
    assert d2t == sorted(set(d2t)) and 2 in d2t  # sorted, unique, EOS kept
    trained_on = examples_of(data_file, tokenizer)[:-2]
    assistant = assistant_tokens(trained_on)
    assert d2t == select_draft_vocab(assistant, 40, 128, always=[2]).tolist()
    # the card says which share of the trained-on assistant tokens the draft vocabulary can propose
    coverage = sum(t in set(d2t) for t in assistant) / len(assistant)
    assert 0 < coverage < 1
    assert f"holding {coverage:.1%} of the training data's assistant tokens" in report["summary"]["draft vocabulary"]
    # tau was measured by real tree decoding on the 2 held-out prompts, and the card says so
    assert report["metrics"]["tau"] >= 1.0 and len(report["metrics"]["tau per prompt"].split(",")) == 2
    assert report["metrics"]["acceptance per depth"].startswith("d>=1 ")  # per-depth acceptance in the card
    assert report["metrics"]["papers_tau"] >= report["metrics"]["tau"]  # the prefill round left out
    card = (out / "README.md").read_text()
    assert "acceptance length tau" in card and "steps: 3" in card and str(data_file) in card
    assert json.loads((out / "jakiro_training.json").read_text())["summary"]["steps"] == 3
    assert not list(out.glob("*.bin"))  # no pickle next to the published weights
    # the reloaded head drafts for the target with its reduced vocabulary
    ids = tokenizer("<|user|>abc<|end|><|assistant|>", return_tensors="pt", add_special_tokens=False)
    plain = target.generate(**ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
    with tree_settings(head.bind_target(target), total_tokens=8, depth=2, top_k=2):
        assert torch.equal(
            target.generate(**ids, assistant_model=head, do_sample=False, max_new_tokens=8, pad_token_id=0), plain
        )
    # a warm start from it with a larger vocabulary: its 40 rows carried over, and the card says so (40 shared rows
    # are too few to fit the 64-wide map for the 20 new ones; the map itself has its own test)
    more = config(tmp_path, max_steps=1, draft_vocab_size=60, output_dir=str(tmp_path / "more"))
    report = train_head(target, tokenizer, data_file, more, eval_size=0, init_from=str(out))
    assert report["summary"]["initialised from"] == f"{out} (40 lm_head rows carried over, 0 mapped from the target's)"
    assert JakiroDraftModel.from_pretrained(tmp_path / "more").config.draft_vocab_size == 60
    # without --draft-vocab a warm start keeps the head's vocabulary: every row carried over, none re-chosen
    same = config(tmp_path, max_steps=1, output_dir=str(tmp_path / "same"))
    report = train_head(target, tokenizer, data_file, same, eval_size=0, init_from=str(out))
    assert report["summary"]["initialised from"] == f"{out} (40 lm_head rows carried over, 0 mapped from the target's)"
    assert report["summary"]["draft vocabulary"].startswith("40 tokens: the vocabulary of the head it started from")
    assert JakiroDraftModel.from_pretrained(tmp_path / "same").d2t.tolist() == d2t


def test_output_dir_with_a_different_head(tmp_path, target, tokenizer, data_file):
    out = tmp_path / "out"
    JakiroDraftModel.from_target(target).save_pretrained(out)  # full vocabulary
    (out / "checkpoint-7").mkdir()
    args = config(tmp_path, draft_vocab_size=40)
    with pytest.raises(ValueError, match="already holds a different head.*draft_vocab_size.*--overwrite"):
        train_head(target, tokenizer, data_file, args, eval_size=0)
    train_head(target, tokenizer, data_file, args, eval_size=0, overwrite=True)
    assert JakiroDraftModel.from_pretrained(out).config.draft_vocab_size == 40
    assert not (out / "checkpoint-7").exists()
    train_head(target, tokenizer, data_file, args, eval_size=0)  # the same head again: fine


def test_cli_train(tmp_path, capsys, target, tokenizer, data_file):
    model_dir = tmp_path / "tiny"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["abc"]}) + "\n")
    out = tmp_path / "head"
    argv = [
        "train",
        "--target",
        str(model_dir),
        "--data",
        str(data_file),
        "--out",
        str(out),
        "--max-steps",
        "2",
        "--draft-vocab",
        "48",
        "--eval-prompts",
        str(prompts),
        "--eval-max-new-tokens",
        "4",
        "--total-tokens",
        "4",
        "--depth",
        "2",
        "--top-k",
        "2",
        "--logging-steps",
        "1",
        "--save-dtype",
        "bfloat16",
    ]
    assert cli.main(argv) == 0
    assert "tau = " in capsys.readouterr().out
    head = JakiroDraftModel.from_pretrained(out)
    assert head.config.total_tokens == 4 and head.fc.weight.dtype == torch.bfloat16
    assert "jakiro train --target" in (out / "README.md").read_text() and "--save-dtype bfloat16" in (
        out / "README.md"
    ).read_text()

    assert (
        cli.main(["train", "--target", str(tmp_path / "missing-model"), "--data", str(data_file), "--out", str(out)])
        == 2
    )
    assert "could not load the target" in capsys.readouterr().err
    assert (
        cli.main(["train", "--target", str(model_dir), "--data", str(tmp_path / "none.jsonl"), "--out", str(out)]) == 2
    )
    assert "training data not found" in capsys.readouterr().err


# -- the real model ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_distill_train_raises_tau(tmp_path, smollm2):
    """Self-distil a handful of GSM8K-style prompts, train a reduced-vocabulary head for a few dozen steps, and
    measure tau on those prompts with real tree decoding: above the untrained head's."""
    model, tok = smollm2
    questions = [
        "What is 12 times 7?",
        "Name three primary colors.",
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "How many legs does a spider have?",
        "What is 15 plus 27?",
    ]
    prompts = [(str(i), q) for i, q in enumerate(questions)]
    data = tmp_path / "data.jsonl"
    distill(model, tok, prompts, data, max_new_tokens=40, batch_size=6, progress=False)
    args = config(
        tmp_path,
        max_steps=60,
        learning_rate=2e-3,
        per_device_train_batch_size=3,
        draft_vocab_size=2048,
        logging_steps=10,
        warmup_steps=5,
    )
    settings = dict(total_tokens=12, depth=3, top_k=4)
    report = train_head(model, tok, data, args, eval_prompts=prompts, eval_max_new_tokens=32, head_overrides=settings)
    trained = report["metrics"]["tau"]

    head = JakiroDraftModel.from_pretrained(tmp_path / "out")  # 2048 shrinks to the distinct tokens of the data
    untrained = JakiroDraftModel.from_target(model, draft_vocab_size=head.config.draft_vocab_size, **settings)
    with torch.no_grad():  # same reduced vocabulary and lm_head start as the trained head, untrained layer
        untrained.d2t.copy_(head.d2t)
        untrained.lm_head.weight.copy_(model.get_output_embeddings().weight[head.d2t])
    baseline = evaluate_tau(model, tok, untrained, prompts, max_new_tokens=32)["tau"]
    print(f"tau untrained {baseline:.2f}, trained {trained:.2f}")
    assert trained > baseline + 0.3


def test_cli_loss_weights_reach_the_training_config(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "t", "--data", "d.jsonl", "--out", str(tmp_path / "head")]
    args = parser.parse_args(base + ["--left-ce-weight", "1.0", "--right-feature-weight", "0"])
    config = config_from_args(args)
    assert config.left_ce_weight == 1.0 and config.right_feature_weight == 0.0
    defaults = config_from_args(parser.parse_args(base))
    # Flags not given keep the recipe's weights, and the card's command line records the given ones.
    assert (defaults.left_feature_weight, defaults.left_ce_weight) == (1.0, 0.1)
    assert (defaults.right_feature_weight, defaults.right_ce_weight) == (0.5, 0.05)
    assert config.left_feature_weight == 1.0 and config.right_ce_weight == 0.05
    assert "--left-ce-weight 1.0" in _command(args) and "--right-feature-weight 0.0" in _command(args)
    assert "--eval-size 0" in _command(parser.parse_args(base + ["--eval-size", "0"]))
    assert parser.parse_args(base + ["--expert-size", "1536"]).expert_size == 1536


def test_cli_keeps_every_option_spelling(tmp_path):
    """The options generated from the config dataclasses keep the original command line's spellings (both dashes and
    underscores work) and reach the right fields."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {
        "--out": str(tmp_path / "head"), "--draft-vocab": "100", "--epochs": "2", "--max-steps": "3", "--lr": "1e-4",
        "--batch-size": "2", "--grad-accum": "3", "--max-length": "64", "--warmup": "5", "--unroll-steps": "2",
        "--feature-noise": "0.1", "--left-feature-weight": "0.9", "--left-ce-weight": "0.2",
        "--right-feature-weight": "0.3", "--right-ce-weight": "0.4", "--save-steps": "7", "--logging-steps": "2",
        "--seed": "5", "--target-dtype": "float32", "--feature-cache": str(tmp_path / "fc"), "--init-from": "h",
        "--push-to-hub": "org/name", "--eval-prompts": "p.jsonl", "--eval-size": "0", "--eval-max-new-tokens": "9",
        "--save-dtype": "bfloat16", "--total-tokens": "8", "--depth": "2", "--top-k": "4", "--feature-layers": "auto",
        "--expert-size": "96",
    }
    switches = ["--drop-longer", "--bf16", "--cache-features", "--prepare-features", "--resume", "--overwrite"]
    help_text = parser.format_help()
    assert all(flag in help_text for flag in [*flags, *switches, "--target", "--data"])
    argv = ["--target", "t", "--data", "d.jsonl", *[x for pair in flags.items() for x in pair], *switches]
    args = parser.parse_args(argv)
    config = config_from_args(args)
    assert (config.output_dir, config.draft_vocab_size, config.num_train_epochs, config.learning_rate) == (
        str(tmp_path / "head"), 100, 2.0, 1e-4)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.warmup_steps) == (2, 3, 5.0)
    assert (config.feature_cache_dir, config.unroll_steps, config.bf16, config.drop_longer) == (
        str(tmp_path / "fc"), 2, True, True)
    assert not config.push_to_hub and args.push_to_hub == "org/name"  # the head is pushed, not the checkpoints
    assert (args.feature_layers, args.expert_size, args.prepare_features, args.target_dtype) == ("auto", 96, True,
                                                                                                 "float32")
    assert parser.parse_args(["--target", "t", "--data", "d", "--output_dir", "o", "--unroll_steps", "3"]).unroll_steps == 3
    assert _command(args).startswith("jakiro train --target t --data d.jsonl") and "--epochs 2.0" in _command(args)


@pytest.mark.parametrize(
    "flags, dtype",
    [([], "float32"), (["--bf16"], "bfloat16"), (["--bf16", "--target-dtype", "float32"], "float32")],
)
def test_cli_target_dtype(tmp_path, monkeypatch, flags, dtype):
    """--bf16 loads the target in bf16 unless --target-dtype says otherwise (e.g. to reuse an fp32 feature cache)."""
    import argparse

    from transformers_jakiro.training import cli as train_cli

    loaded = []

    def fake_load(name, wanted):
        loaded.append(wanted)
        raise ValueError("stop here")

    monkeypatch.setattr(train_cli, "load_target_or_explain", fake_load)
    data = tmp_path / "d.jsonl"
    data.write_text("")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="stop here"):
        train_cli.run(parser.parse_args(["--target", "t", "--data", str(data), "--out", str(tmp_path / "h")] + flags))
    assert loaded == [dtype]
