"""`output_rows.OutputRows`: the row count the output layer computes is the cheapest of n to n + SLACK as timed on
this machine, each count timed once; counts outside [1, max_rows] are kept."""

import torch

from transformers_jakiro.output_rows import OutputRows


def test_the_cheapest_count_within_the_slack_each_timed_once():
    head = torch.nn.Linear(8, 32, bias=False)
    rows = OutputRows(head, slack=3, max_rows=16)
    timed = []
    costs = {1: 1.0, 2: 3.0, 3: 3.0, 4: 1.5, 5: 2.0, 6: 3.0, 7: 3.0, 8: 1.6, 9: 2.0, 10: 2.5, 11: 3.0, 12: 2.0}
    rows._time = lambda n: timed.append(n) or costs.get(n, float(n))
    assert rows.rows_for(1) == 1  # one row: the cheapest already
    assert rows.rows_for(2) == 4 and rows.rows_for(3) == 4 and rows.rows_for(4) == 4
    assert rows.rows_for(6) == 8 and rows.rows_for(9) == 9  # 9 costs what 12 does: the fewer rows
    assert rows.rows_for(17) == 17 and rows.rows_for(0) == 0  # outside [1, max_rows]: as it is
    assert sorted(timed) == sorted(set(timed)) == list(range(1, 13))  # every count timed once, when first needed


def test_timing_is_counted_apart():
    head = torch.nn.Linear(16, 64, bias=False)
    rows = OutputRows(head, max_rows=8)
    assert rows.timing_s == 0.0
    chosen = rows.rows_for(5)
    assert 5 <= chosen <= 8 and set(rows.seconds) == {5, 6, 7, 8} and rows.timing_s > 0.0
    spent = rows.timing_s
    rows.rows_for(6)  # 9 is new: timed; 6 to 8 known
    assert set(rows.seconds) == {5, 6, 7, 8, 9} and rows.timing_s > spent
