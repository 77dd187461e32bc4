"""Run by tests/test_stock_paths.py in a fresh interpreter: transformers' own assisted generation and prompt lookup on
tiny encoder-decoder (T5, Bart, Whisper) and decoder-only (Llama) models, before and after `import
transformers_jakiro`, recording the outputs and the `inputs_tensor` that the stock candidate generator receives.
Prints one JSON object {"before": ..., "after": ...}."""
import json
import sys

import torch
from transformers import (AutoModelForCausalLM, BartConfig, BartForConditionalGeneration, LlamaConfig, T5Config,
                          T5ForConditionalGeneration, WhisperConfig, WhisperForConditionalGeneration)
from transformers.generation.utils import GenerationMixin

received = []
_stock_get = GenerationMixin._get_candidate_generator


def recording(self, *args, **kwargs):
    inputs = kwargs.get("inputs_tensor")
    received.append(None if inputs is None else list(inputs.shape))
    return _stock_get(self, *args, **kwargs)


GenerationMixin._get_candidate_generator = recording


def models():
    torch.manual_seed(0)
    t5 = dict(vocab_size=99, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0,
              pad_token_id=0, eos_token_id=1)
    bart = dict(vocab_size=99, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    whisper = dict(vocab_size=99, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
                   max_source_positions=30, max_target_positions=40, pad_token_id=0, bos_token_id=97,
                   eos_token_id=98, decoder_start_token_id=97, suppress_tokens=None, begin_suppress_tokens=None)
    llama = dict(vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 10, 11]])
    yield "t5", T5ForConditionalGeneration(T5Config(**t5)), T5ForConditionalGeneration(T5Config(**t5)), {"input_ids": ids}
    yield "bart", BartForConditionalGeneration(BartConfig(**bart)), BartForConditionalGeneration(BartConfig(**bart)), {"input_ids": ids}
    features = torch.randn(1, 8, 60)
    yield ("whisper", WhisperForConditionalGeneration(WhisperConfig(**whisper)),
           WhisperForConditionalGeneration(WhisperConfig(**whisper)), {"input_features": features})
    yield "llama", AutoModelForCausalLM.from_config(LlamaConfig(**llama)), AutoModelForCausalLM.from_config(LlamaConfig(**llama)), {"input_ids": ids}


def run() -> dict:
    results = {}
    for name, target, assistant, inputs in models():
        target.eval(), assistant.eval()
        for mode, kwargs in [
            ("assisted_greedy", dict(assistant_model=assistant, do_sample=False)),
            ("assisted_sample", dict(assistant_model=assistant, do_sample=True, top_k=5)),
            ("prompt_lookup", dict(prompt_lookup_num_tokens=3, do_sample=False)),
        ]:
            if name == "whisper" and mode == "prompt_lookup":
                continue
            del received[:]
            torch.manual_seed(1)
            try:
                out = target.generate(**inputs, max_new_tokens=12, **kwargs).tolist()
            except Exception as error:  # recorded: a patch that breaks the stock path shows here
                out = f"{type(error).__name__}: {error}"
            results[f"{name}/{mode}"] = {"tokens": out, "candidate_generator_inputs": list(received)}
    return results


before = run()
import transformers_jakiro  # noqa: E402,F401  (the patch under test)

after = run()
json.dump({"before": before, "after": after}, sys.stdout)
