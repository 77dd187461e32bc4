"""Bad input to Jakiro decoding gets a clear error naming the problem and the fix; dispatched targets work."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import make_target
from transformers_jakiro import JakiroDraftModel


@pytest.fixture(scope="module")
def target_and_draft():
    target = make_target("llama")
    return target, JakiroDraftModel.from_target(target)


def test_batch_with_right_padding(target_and_draft):
    target, draft = target_and_draft
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="left padding only.*padding_side = 'left'"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft)


def test_batch_with_the_callers_static_cache(target_and_draft):
    """A batch decodes over a static cache generate builds (test_batch_static); one the caller passes would be left
    with holes, like a dynamic one (test_batch)."""
    from transformers import StaticCache

    target, draft = target_and_draft
    cache = StaticCache(config=target.config, max_cache_len=64)
    with pytest.raises(ValueError, match="cannot fill a cache you pass to generate"):
        target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4, assistant_model=draft,
                        past_key_values=cache)


def test_batch_with_per_step_scores(target_and_draft):
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="output_scores / output_logits"):
        target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4, assistant_model=draft,
                        return_dict_in_generate=True, output_scores=True)


def test_batch_with_several_return_sequences(target_and_draft):
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="num_return_sequences"):
        target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4, assistant_model=draft,
                        do_sample=True, num_return_sequences=2)


def test_flash_attention_backend(target_and_draft, monkeypatch):
    target, draft = target_and_draft
    monkeypatch.setattr(target.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*sdpa"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft)


def test_sliding_window_cache():
    target = make_target("mistral", sliding_window=8)
    draft = JakiroDraftModel.from_target(target)
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer.*full-attention"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft)


def test_processor_that_cannot_run_per_node(target_and_draft):
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor cannot be applied per tree node"):
        target.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=draft,
            prefix_allowed_tokens_fn=lambda batch_id, ids: [5, 6],
        )


def test_processor_declared_row_wise_is_accepted(target_and_draft):
    target, draft = target_and_draft

    class BanToken:
        jakiro_per_node_safe = True

        def __call__(self, input_ids, scores):
            scores[:, 75] = -float("inf")
            return scores

    from transformers import LogitsProcessorList

    prompt = torch.tensor([[5, 6, 7]])
    kwargs = dict(do_sample=False, max_new_tokens=20, logits_processor=LogitsProcessorList([BanToken()]))
    assert torch.equal(target.generate(prompt, assistant_model=draft, **kwargs), target.generate(prompt, **kwargs))


def test_draft_built_for_another_target(target_and_draft):
    target, _ = target_and_draft
    other = make_target("llama", hidden_size=32, intermediate_size=48)
    with pytest.raises(ValueError, match="hidden size: the draft expects 32, the target has 64"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=JakiroDraftModel.from_target(other))


def test_bad_tree_settings(target_and_draft):
    from transformers_jakiro import tree_settings

    _, draft = target_and_draft
    with pytest.raises(ValueError, match="total_tokens must be >= 1"):
        with tree_settings(draft, total_tokens=0):
            pass


def test_target_dispatched_with_device_map_and_disk_offload(target_and_draft, tmp_path):
    """accelerate big-model inference: layers offloaded to disk are streamed in by hooks at each forward."""
    target, draft = target_and_draft
    target.save_pretrained(tmp_path / "target")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target", device_map=device_map, offload_folder=str(tmp_path / "offload"), attn_implementation="sdpa"
    )
    assert getattr(dispatched, "hf_device_map", None)
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    assert torch.equal(dispatched.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=draft), expected)
