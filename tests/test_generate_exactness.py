"""Jakiro decoding never silently differs from plain `generate`: model inputs it cannot use are refused by name, the
returned cache continues like plain generate's, streamers and targets without optional forward arguments work,
and reloading the package leaves the stock assisted decoding intact."""

import importlib
import inspect
import queue
import threading

import pytest
import torch
from transformers import LlamaForCausalLM, TextIteratorStreamer

from tiny_models import make_target, make_tokenizer, quick_trained_draft
from transformers_jakiro import jakiro_generate


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, quick_trained_draft(target)


def cache_of(output):
    return output["cache"] if "cache" in output else output["past_key_values"]


class ToyVisionLM(LlamaForCausalLM):
    """A Llama whose forward also takes an image (`pixel_values`) and `token_type_ids`, as vision-language models'
    do: `generate` accepts and forwards both, so the tree path must not drop them silently."""

    def forward(self, input_ids=None, pixel_values=None, token_type_ids=None, inputs_embeds=None, **kwargs):
        if pixel_values is not None and input_ids is not None:
            inputs_embeds = self.get_input_embeddings()(input_ids) + pixel_values.mean()
            input_ids = None
        return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)


@pytest.mark.parametrize("entry", ["assistant_model", "custom_generate"])
def test_model_inputs_the_tree_path_cannot_use_are_refused_by_name(pair, entry):
    target, draft = pair
    vlm = ToyVisionLM(target.config).eval()
    vlm.load_state_dict(target.state_dict())
    route = dict(assistant_model=draft) if entry == "assistant_model" else dict(custom_generate=jakiro_generate, draft=draft)
    prompt = torch.tensor([[5, 6, 7, 8]])
    image = torch.full((1, 3, 4, 4), 2.0)
    plain = vlm.generate(prompt, pixel_values=image, do_sample=False, max_new_tokens=8)
    assert not torch.equal(plain, vlm.generate(prompt, do_sample=False, max_new_tokens=8))  # the image matters
    with pytest.raises(ValueError, match="pixel_values.*token_type_ids|token_type_ids.*pixel_values"):
        vlm.generate(prompt, pixel_values=image, token_type_ids=torch.zeros_like(prompt), max_new_tokens=8, **route)
    with pytest.raises(ValueError, match="pixel_values"):
        vlm.generate(prompt, pixel_values=image, max_new_tokens=8, **route)
    # a user's own positions (here shifted by 5) change plain generate's output too
    shifted = torch.arange(5, 9)[None]
    with pytest.raises(ValueError, match="position_ids"):
        target.generate(prompt, position_ids=shifted, max_new_tokens=8, **route)
    # the default positions, passed explicitly, are what generate passes anyway: accepted
    got = target.generate(prompt, position_ids=torch.arange(4)[None], do_sample=False, max_new_tokens=8, **route)
    assert torch.equal(got, target.generate(prompt, do_sample=False, max_new_tokens=8))
    # return_dict_in_generate outputs the tree path does not produce
    for flag in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match=flag):
            target.generate(prompt, max_new_tokens=4, return_dict_in_generate=True, **{flag: True}, **route)


@pytest.mark.parametrize("padding", [0, 2])
def test_returned_cache_continues_exactly_like_plain_generate(pair, padding):
    """Generate, then continue from the returned cache with a second `generate` call: the Jakiro cache lines up with
    `sequences` (left padding included) and continues to the same tokens as plain generate's."""
    target, draft = pair
    prompt = torch.tensor([[0] * padding + [44, 45, 46, 47, 48, 49, 50]])
    mask = (prompt != 0).long()
    first = dict(do_sample=False, max_new_tokens=12, min_new_tokens=12, return_dict_in_generate=True)
    plain = target.generate(prompt, attention_mask=mask, **first)
    mine = target.generate(prompt, attention_mask=mask, assistant_model=draft, **first)
    assert torch.equal(mine.sequences, plain.sequences)
    assert cache_of(mine).get_seq_length() == cache_of(plain).get_seq_length() == plain.sequences.shape[1] - 1
    for a, b in zip(cache_of(mine).layers, cache_of(plain).layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)

    def go_on(output):
        sequences = output.sequences
        longer_mask = torch.cat([mask, torch.ones(1, sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        return target.generate(
            sequences, attention_mask=longer_mask, past_key_values=cache_of(output), do_sample=False,
            max_new_tokens=10, min_new_tokens=10,
        )

    expected = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=22, min_new_tokens=22)
    assert torch.equal(go_on(plain), expected)
    assert torch.equal(go_on(mine), expected)


def test_reloading_keeps_the_stock_assisted_decoding(pair):
    """importlib.reload / IPython autoreload re-run the module that patches transformers: other assistants and prompt
    lookup must still reach the stock implementation (they used to recurse forever), and Jakiro the tree path."""
    import transformers_jakiro
    from transformers_jakiro import generation

    target, draft = pair
    prompt = torch.tensor([[5, 9, 33, 17, 5, 9, 33]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=16)
    importlib.reload(generation)
    importlib.reload(transformers_jakiro)
    importlib.reload(generation)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=16, prompt_lookup_num_tokens=3), expected)
    draft.last_generation_stats = None
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=draft), expected)
    assert draft.last_generation_stats is not None  # the tree path ran


@pytest.mark.parametrize("entry", ["assistant_model", "custom_generate"])
def test_text_iterator_streamer_gets_the_whole_answer_and_ends(pair, entry):
    """A consumer thread reading a TextIteratorStreamer gets every token and the end of the stream; with the
    `custom_generate` entry point transformers does not hand the streamer over, which used to leave it hanging."""
    target, draft = pair
    tokenizer = make_tokenizer()
    route = dict(assistant_model=draft) if entry == "assistant_model" else dict(custom_generate=jakiro_generate, draft=draft)
    prompt = torch.tensor([[5, 6, 7, 8]])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}

    def run():
        result["ids"] = target.generate(prompt, do_sample=False, max_new_tokens=30, streamer=streamer, **route)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        text = "".join(streamer)
    except queue.Empty:
        pytest.fail("the streamer never ended: generate did not feed it or did not call end()")
    thread.join(timeout=60)
    assert text == tokenizer.decode(result["ids"][0, 4:])


class WithoutLogitsToKeep(LlamaForCausalLM):
    """A remote-code style target whose forward has neither `logits_to_keep` nor `**kwargs`."""

    _cache_name = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, return_dict=None):
        cache = cache if cache is not None else past_key_values
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
            use_cache=use_cache, output_hidden_states=output_hidden_states, **{self._cache_name: cache},
        )


def test_target_without_logits_to_keep(pair):
    target, draft = pair
    plain_target = WithoutLogitsToKeep(target.config).eval()
    plain_target.load_state_dict(target.state_dict())
    prompt = torch.tensor([[9, 10, 11, 12]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=20)
    assert torch.equal(plain_target.generate(prompt, do_sample=False, max_new_tokens=20), expected)
    assert torch.equal(plain_target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=draft), expected)


def test_readme_states_where_token_identical_holds():
    """The README's Exactness section promises token-identical output in float32 and must say what happens in
    bf16/fp16 (near-ties) and what is refused."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Exactness") :].split("\n## ", 1)[0]
    assert "token-identical" in section and "float32" in section and "bfloat16" in section
    assert "near-tie" in section and "Refused" in section
