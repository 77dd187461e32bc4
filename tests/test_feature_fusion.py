"""Heads that read several target layers (`target_feature_layers`, EAGLE-3-style fusion): the features captured by
hooks equal the target's own hidden states, a new fused head starts as the last-hidden-state head, decoding stays
token-identical, and training, the feature store and warm starts handle the wider features."""

import pytest
import torch

from chat_tokenizer import make_tokenizer
from tiny_models import make_target, quick_trained_draft, random_prompt
from transformers_jakiro import JakiroDraftModel, tree_settings
from transformers_jakiro.training.feature_store import FeatureStore, target_fingerprint
from transformers_jakiro.features import TargetFeatures, default_feature_layers
from transformers_jakiro.training import JakiroTrainer, JakiroTrainingConfig, init_from_head
from transformers_jakiro.training.cli import parse_feature_layers

LAYERS = [0, 2]  # of a 4-layer target: layer 3's output is the last hidden state


@pytest.fixture(scope="module")
def target():
    return make_target("llama", num_hidden_layers=4)


def test_hooks_capture_exactly_the_named_layers_and_the_last_hidden_state(target):
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        with TargetFeatures(target, LAYERS) as hidden:
            out = target(ids, **hidden.forward_kwargs())
            captured = hidden.take(out)
    assert hidden.forward_kwargs() == {}  # hooks, not every layer's states
    torch.testing.assert_close(captured, torch.cat([states[1], states[3], states[-1]], -1), rtol=0, atol=0)
    with TargetFeatures(target) as hidden:  # no fused layers: the last hidden state alone
        last = hidden.take(target(ids, **hidden.forward_kwargs()))
    torch.testing.assert_close(last, states[-1], rtol=0, atol=0)


def test_layer_choices_are_checked(target):
    assert default_feature_layers(30) == [2, 15, 27]
    assert parse_feature_layers("auto", make_target("llama", num_hidden_layers=8)) == [2, 4, 5]
    assert parse_feature_layers("0,2", target) == LAYERS and parse_feature_layers("none", target) == []
    for wrong in ("3", "2,0", "1,1", "a,b"):  # 3: the last layer (its output is the last hidden state, always read)
        with pytest.raises(ValueError, match="--feature-layers|decoder-layer indices"):
            parse_feature_layers(wrong, target)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        JakiroDraftModel.from_target(target, target_feature_layers=[1, 3])
    fused = JakiroDraftModel.from_target(target, target_feature_layers=LAYERS)
    with pytest.raises(ValueError, match=r"layers: the draft reads the outputs of decoder layers \[0, 2\]"):
        fused.bind_target(make_target("llama"))  # two layers: there is no layer 2
    with pytest.raises(ValueError, match="reads target features 192 wide"):
        fused(input_ids=torch.tensor([[5]]), hidden_states=torch.randn(1, 1, 128))


def test_a_new_fused_head_computes_what_the_last_hidden_state_head_does(target, tmp_path):
    torch.manual_seed(0)
    plain = JakiroDraftModel.from_target(target)
    fused = JakiroDraftModel.from_target(target, target_feature_layers=LAYERS)
    init_from_head(fused, plain)
    ids = torch.randint(3, 128, (1, 7))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        wide = torch.cat([states[1], states[3], states[-1]], -1)
        a, b = plain(input_ids=ids, hidden_states=states[-1]), fused(input_ids=ids, hidden_states=wide)
        own = fused(input_ids=ids, hidden_states=states[-1])  # the draft's own features skip the fusion
    torch.testing.assert_close(b.last_hidden_state, a.last_hidden_state)
    torch.testing.assert_close(own.contrastive_hidden_state, a.contrastive_hidden_state)
    fused.save_pretrained(tmp_path)
    loaded = JakiroDraftModel.from_pretrained(tmp_path)
    assert loaded.config.target_feature_layers == LAYERS
    torch.testing.assert_close(loaded.feature_fusion.weight, fused.feature_fusion.weight)
    card = (tmp_path / "README.md").read_text()
    assert "the last hidden state plus a linear fusion of decoder layers 0, 2" in card
    assert "reads the\ntarget's last hidden states and the outputs of its decoder layers\n0, 2 and borrows" in card
    with pytest.raises(ValueError, match=r"target_feature_layers: \[0, 2\] vs \[1, 2\]"):
        init_from_head(JakiroDraftModel.from_target(target, target_feature_layers=[1, 2]), fused)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_with_a_fused_head_is_identical_to_plain(arch):
    target = make_target(arch, num_hidden_layers=4)
    draft = quick_trained_draft(target, target_feature_layers=LAYERS)
    assert draft.feature_fusion.weight.abs().sum() > 0  # training used the other layers
    g = torch.Generator().manual_seed(3)
    taus = []
    for i in range(12):
        prompt = random_prompt(g)
        expected = target.generate(prompt, do_sample=False, max_new_tokens=32)
        with tree_settings(draft, total_tokens=(24, 6, 40)[i % 3], depth=(4, 6, 3)[i % 3], top_k=(6, 1, 8)[i % 3]):
            got = target.generate(prompt, do_sample=False, max_new_tokens=32, assistant_model=draft)
            taus.append(draft.last_generation_stats.mean_accepted_length)
            # The static path: k-row reads of the wide features, levels of the draft's own, over a static cache.
            static = target.generate(
                prompt, do_sample=False, max_new_tokens=32, assistant_model=draft, cache_implementation="static"
            )
        assert torch.equal(got, expected) and torch.equal(static, expected), f"prompt {i}"
    assert max(taus) > 2.0  # multi-token paths, read back through the fused features, were exercised


def test_training_reads_the_wide_features_and_the_store_keeps_them_apart(target, tmp_path):
    from transformers_jakiro.training.distill import distill
    from transformers_jakiro.training import JakiroCollator, build_examples, read_conversations

    tokenizer = make_tokenizer()
    prompts = [(str(i), "abc defg"[: 3 + i % 5] * 2) for i in range(8)]
    distill(target, tokenizer, prompts, tmp_path / "data.jsonl", max_new_tokens=16, batch_size=8, progress=False)
    examples = build_examples(read_conversations(tmp_path / "data.jsonl")[0], tokenizer, 256)[0]
    args = JakiroTrainingConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, learning_rate=3e-3, report_to="none", disable_tqdm=True,
        per_device_train_batch_size=4, dataloader_pin_memory=False, feature_cache_dir=str(tmp_path / "features"), save_steps=1000,
    )
    draft = JakiroDraftModel.from_target(target, target_feature_layers=LAYERS)
    trainer = JakiroTrainer(model=draft, target=target, args=args, train_dataset=examples)
    trainer.prepare_features()
    batch = JakiroCollator(0)(examples[:4])
    features, next_tokens = trainer.target_features(batch)
    assert features.shape[-1] == 3 * target.config.hidden_size
    with torch.no_grad():  # what the hooks stored equals what output_hidden_states returns, at every real token
        states = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=True).hidden_states
    expected = torch.cat([states[i + 1] for i in LAYERS] + [states[-1]], -1)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(features[real], expected[real])
    with torch.no_grad():  # the stored next tokens come from the last hidden state, the slice after the others
        expected = target.lm_head(features[..., -target.config.hidden_size :]).argmax(-1)
    assert torch.equal(next_tokens[next_tokens >= 0], expected[next_tokens >= 0])
    before = draft.feature_fusion.weight.detach().clone()
    trainer.train()
    assert not torch.equal(draft.feature_fusion.weight, before)
    # A store of wider features is not mistaken for one of last hidden states, nor the other way round.
    assert target_fingerprint(target, LAYERS)["feature_layers"] == LAYERS
    with pytest.raises(ValueError, match="feature_layers: \\[0, 2\\] there, None now"):
        FeatureStore(tmp_path / "features", target_fingerprint(target))
