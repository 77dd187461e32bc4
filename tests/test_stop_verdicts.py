"""`target_inputs.stop_verdicts` decides, for every token of a round, whether plain generate would have stopped after
it. Maximum lengths and EOS tokens are decided for all tokens at once; the answer must be the criteria's own,
asked prefix by prefix."""

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from transformers_jakiro.decoding.target_inputs import _all_at_once, round_verdicts, stop_verdicts


def _prefix_by_prefix(criteria, sequence, start, count):
    return torch.stack([criteria(sequence[:, : start + i + 1], None).any() for i in range(count)])


def test_lengths_and_eos_at_once_equal_the_criteria_prefix_by_prefix():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        start, count = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        sequence = torch.randint(0, 10, (1, start + count), generator=g)
        criteria = []
        if trial % 3:
            criteria.append(MaxLengthCriteria(int(torch.randint(1, 40, (1,), generator=g))))
        if trial % 2 == 0:
            criteria.append(EosTokenCriteria(torch.randint(0, 10, (int(trial % 4 == 0) + 1,), generator=g)))
        criteria = StoppingCriteriaList(criteria)
        at_once = _all_at_once(criteria, sequence[0, start:], start)
        assert at_once is not None
        assert torch.equal(at_once, _prefix_by_prefix(criteria, sequence, start, count)), trial
        assert torch.equal(stop_verdicts(criteria, sequence, start, None, count), at_once)
        tokens = sequence[0, start:]
        assert torch.equal(round_verdicts(criteria, sequence[:, :start], tokens, None), at_once)


def test_other_criteria_are_asked_prefix_by_prefix():
    class StopAfterSeven:
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 7

    sequence = torch.tensor([[1, 2, 7, 3, 7]])
    criteria = StoppingCriteriaList([MaxLengthCriteria(10), StopAfterSeven()])
    assert _all_at_once(criteria, sequence[0, 1:], 1) is None
    assert stop_verdicts(criteria, sequence, 1, torch.zeros(4, 10), 4).tolist() == [False, True, False, True]
    assert round_verdicts(criteria, sequence[:, :1], sequence[0, 1:], torch.zeros(4, 10)).tolist() == [
        False, True, False, True]
    # past max_position_embeddings plain generate warns: that length is checked prefix by prefix, as there
    beyond = StoppingCriteriaList([MaxLengthCriteria(10, max_position_embeddings=3)])
    assert _all_at_once(beyond, sequence[0, 1:], 1) is None
    assert stop_verdicts(beyond, sequence, 1, torch.zeros(4, 10), 4).tolist() == [False, False, False, False]
