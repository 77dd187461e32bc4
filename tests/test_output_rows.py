"""The output layer's row counts: measured once per layer, and a count padded only to one that costs clearly less."""

import torch

from transformers_jakiro.decoding import output_rows
from transformers_jakiro.decoding.output_rows import PADDING_GAIN, padded_count, row_costs

# A 2-core AMD EPYC's SmolLM2-135M fp32 output layer, ms per row count 1..16 (CB-16)
EPYC = [0.0, 6.9, 13.5, 19.9, 11.1, 11.7, 14.1, 21.1, 11.3, 14.1, 14.4, 21.6, 12.0, 12.9, 12.9, 13.7, 13.2]


def test_counts_are_padded_to_the_cheaper_counts_measured():
    assert [padded_count(EPYC, rows) for rows in range(1, 17)] == [1, 4, 4, 4, 5, 8, 8, 8, 12, 12, 12, 12, 13, 14,
                                                                   15, 16]
    assert padded_count(EPYC, 17) == 17 and padded_count(EPYC, 40) == 40  # beyond the measured counts
    assert padded_count(None, 3) == 3


def test_a_count_is_padded_only_for_a_clear_gain():
    flat = [0.0] + [1.0] * 8
    assert [padded_count(flat, rows) for rows in range(1, 9)] == list(range(1, 9))
    rising = [0.0] + [float(rows) for rows in range(1, 9)]  # the usual shape: more rows, more time
    assert [padded_count(rising, rows) for rows in range(1, 9)] == list(range(1, 9))
    assert padded_count([0.0, 1.0, 1.0, PADDING_GAIN + 1e-3], 2) == 2  # a little cheaper: not worth the rows
    assert padded_count([0.0, 1.0, 1.0, PADDING_GAIN - 1e-3], 2) == 3
    # of the counts, the smallest within reach of the cheapest
    assert padded_count([0.0, 1.0, 1.0, 0.8, 0.78], 2) == 3
    assert padded_count([0.0, 1.0, 1.0, 0.8, 0.7], 2) == 4


def test_row_costs_measure_each_count_once_per_layer(monkeypatch):
    monkeypatch.setattr(output_rows, "_MEASURED", {})
    head = torch.nn.Linear(8, 50, bias=False)
    calls = []
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda hidden: calls.append(hidden.shape) or forward(hidden))
    costs = row_costs(head, up_to=6, repeats=2)
    assert len(costs) == 7 and costs[0] == 0.0 and all(cost > 0 for cost in costs[1:])
    assert sorted(set(calls)) == [(1, rows, 8) for rows in range(1, 7)] and len(calls) == 6 * 3
    assert row_costs(head, up_to=6, repeats=2) is costs and len(calls) == 18  # measured once
