"""Every processor Jakiro decoding applies per tree node, checked with a left-padded prompt against plain generate.

Processors may hold per-batch state that generate derives from the padding (`RepetitionPenaltyLogitsProcessor`'s
`prompt_ignore_length` in transformers >= 5.24 is one entry per row); `decoding/logits.py` calls them with one row per tree
node of a depth, so such state must be repeated per node. `CHECKED` names every row-wise processor of
`logits.ROW_WISE_PROCESSORS`, with the generate arguments (or explicit instances) that bring it in; the coverage test
fails when a processor joins that list without a case here.
"""

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from tiny_models import VOCAB, trained_pairs
from transformers_jakiro import jakiro_generate, tree_settings
from transformers_jakiro.decoding.logits import ROW_WISE_PROCESSORS

EOS = 2
# name -> (generate kwargs, explicit processors); the explicit ones are warpers that greedy generate never builds
# from its config, so they are passed in `logits_processor` (argmax still sees their effect: masked tokens).
CHECKED = {
    "RepetitionPenaltyLogitsProcessor": (dict(repetition_penalty=1.5), []),
    "MinLengthLogitsProcessor": (dict(min_length=18, eos_token_id=EOS), []),
    "MinNewTokensLengthLogitsProcessor": (dict(min_new_tokens=12, eos_token_id=EOS), []),
    "NoRepeatNGramLogitsProcessor": (dict(no_repeat_ngram_size=2), []),
    "SequenceBiasLogitsProcessor": (dict(sequence_bias={(41,): 5.0, (11, 75): -10.0}), []),
    "NoBadWordsLogitsProcessor": (dict(bad_words_ids=[[75], [122, 75]], eos_token_id=EOS), []),
    "ForcedBOSTokenLogitsProcessor": (dict(forced_bos_token_id=17), []),
    "ForcedEOSTokenLogitsProcessor": (dict(forced_eos_token_id=EOS, max_length=26), []),
    "ExponentialDecayLengthPenalty": (dict(exponential_decay_length_penalty=(4, 1.3), eos_token_id=EOS), []),
    "SuppressTokensAtBeginLogitsProcessor": (dict(begin_suppress_tokens=[33, 59]), []),
    "SuppressTokensLogitsProcessor": (dict(suppress_tokens=[33, 59]), []),
    "InfNanRemoveLogitsProcessor": (dict(remove_invalid_values=True), []),
    "LogitNormalization": (dict(renormalize_logits=True), []),
    "TemperatureLogitsWarper": ({}, [lp.TemperatureLogitsWarper(0.7)]),
    "TopKLogitsWarper": ({}, [lp.TopKLogitsWarper(5)]),
    "TopPLogitsWarper": ({}, [lp.TopPLogitsWarper(0.8)]),
    "MinPLogitsWarper": ({}, [lp.MinPLogitsWarper(0.1)]),
    "TypicalLogitsWarper": ({}, [lp.TypicalLogitsWarper(0.9)]),
    "EpsilonLogitsWarper": ({}, [lp.EpsilonLogitsWarper(1e-3)]),
    "EtaLogitsWarper": ({}, [lp.EtaLogitsWarper(1e-3)]),
}
if hasattr(lp, "TopHLogitsWarper"):
    CHECKED["TopHLogitsWarper"] = ({}, [lp.TopHLogitsWarper(0.3)])

PROMPTS = [  # left-padded (pad id 0) and unpadded rows of a batch of one
    (torch.tensor([[0, 0, 0, 44, 45, 46, 47, 44, 45]]), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])),
    (torch.tensor([[0, 9, 30, 31, 9, 30]]), torch.tensor([[0, 1, 1, 1, 1, 1]])),
    (torch.tensor([[12, 13, 14, 15]]), None),
]


def test_every_row_wise_processor_is_checked_here():
    assert {cls.__name__ for cls in ROW_WISE_PROCESSORS} == set(CHECKED)


@pytest.fixture(scope="module")
def pair():
    return trained_pairs()("llama")


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_processor_with_left_padding_matches_plain(pair, name):
    target, draft = pair
    kwargs, explicit = CHECKED[name]
    kwargs = {"max_new_tokens": 20, **kwargs}
    for prompt, mask in PROMPTS:
        inputs = dict(input_ids=prompt, attention_mask=mask, do_sample=False, **kwargs)
        plain = target.generate(**inputs, logits_processor=LogitsProcessorList(explicit))
        with tree_settings(draft, total_tokens=12, depth=4, top_k=3, lookup_tokens=3):
            assisted = target.generate(**inputs, logits_processor=LogitsProcessorList(explicit), assistant_model=draft)
        custom = target.generate(
            **inputs, logits_processor=LogitsProcessorList(explicit), custom_generate=jakiro_generate, draft=draft,
            total_tokens=12, depth=4, top_k=3,
        )
        assert torch.equal(assisted, plain), (name, prompt.tolist())
        assert torch.equal(custom, plain), (name, prompt.tolist())
        assert plain.max() < VOCAB
