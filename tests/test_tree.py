"""Property tests of tree building, flattening, masks, positions and paths against brute force."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformers_jakiro.decoding.tree import TreeRecorder, ancestor_matrix


@st.composite
def recorded_trees(draw):
    """Random draft expansions: per level, candidates hang under nodes of the previous level; a child's score is
    its parent's plus a log-probability <= 0 (exact zeros included, to force score ties)."""
    root_token = draw(st.integers(0, 99))
    recorder = TreeRecorder(torch.tensor(root_token))
    records = [(root_token, -1, 0.0, 0)]  # (token, parent, score, depth) in recorded order
    previous = [0]
    for depth in range(1, draw(st.integers(1, 5)) + 1):
        count = draw(st.integers(1, 8))
        parents = [draw(st.sampled_from(previous)) for _ in range(count)]
        log_probs = [draw(st.sampled_from([0.0, -0.5, -1.0]) | st.floats(-8.0, 0.0)) for _ in range(count)]
        tokens = [draw(st.integers(0, 99)) for _ in range(count)]
        # float32 like the real scores, so the comparisons below see the values the recorder sees
        scores = torch.tensor([records[p][2] + lp for p, lp in zip(parents, log_probs)], dtype=torch.float32)
        index = recorder.add_level(torch.tensor(tokens), torch.tensor(parents), scores, depth).tolist()
        scores = scores.tolist()
        records += list(zip(tokens, parents, scores, [depth] * count))
        previous = index
    return recorder, records, draw(st.integers(1, 40))


def brute_force_ancestors(parents):
    n = len(parents)
    result = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            result[i, j] = True
            j = parents[j]
    return result


@settings(max_examples=300, deadline=None)
@given(recorded_trees())
def test_flatten_keeps_best_closed_breadth_first(case):
    recorder, records, total_tokens = case
    tree = recorder.flatten(total_tokens)
    n = tree.num_nodes
    assert n == 1 + min(total_tokens, len(records) - 1)
    parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
    assert parents[0] == -1 and depths[0] == 0 and tokens[0] == records[0][0]
    for i in range(1, n):
        assert 0 <= parents[i] < i  # every parent precedes its children
        assert depths[i] == depths[parents[i]] + 1
    assert depths == sorted(depths)  # breadth-first
    # Every kept candidate scores at least as well as every dropped one.
    kept_scores = sorted(tree.scores[1:].tolist())
    all_scores = sorted((r[2] for r in records[1:]), reverse=True)
    if kept_scores:
        dropped = all_scores[len(kept_scores) :]
        assert all(kept_scores[0] >= s for s in dropped)
    # The (token, parent token, depth, score) structure is the recorded one: map each node back to a record.
    remaining = list(records[1:])
    for i in range(1, n):
        key = (tokens[i], depths[i], tree.scores[i].item())
        match = [r for r in remaining if (r[0], r[3], r[2]) == key]
        assert match, f"node {i} does not correspond to a recorded candidate"
        parent_record = records[match[0][1]]
        assert (parent_record[0], parent_record[3]) == (tokens[parents[i]], depths[parents[i]])
        remaining.remove(match[0])


@settings(max_examples=300, deadline=None)
@given(recorded_trees(), st.integers(0, 50), st.integers(0, 50))
def test_masks_positions_paths_match_brute_force(case, past, padding):
    padding = min(padding, past)  # left padding: the first cached positions, hidden from every node
    recorder, _, total_tokens = case
    tree = recorder.flatten(total_tokens)
    parents = tree.parents.tolist()
    expected = brute_force_ancestors(parents)
    assert torch.equal(tree.ancestors, expected)
    assert torch.equal(ancestor_matrix(tree.parents, int(tree.depths.max())), expected)

    mask = tree.attention_mask(past, torch.float32, padding)
    n = tree.num_nodes
    assert mask.shape == (1, 1, n, past + n)
    minimum = torch.finfo(torch.float32).min
    for i in range(n):
        for j in range(past + n):
            visible = padding <= j < past or (j >= past and bool(expected[i, j - past]))
            assert mask[0, 0, i, j].item() == (0.0 if visible else minimum)
    assert tree.position_ids(past).tolist() == [[past + d for d in tree.depths.tolist()]]

    children = {p for p in parents[1:]}
    leaves = [i for i in range(n) if i not in children]
    assert tree.leaves().tolist() == leaves
    assert tree.internal_nodes().tolist() == sorted(children)
    paths = tree.paths()
    assert paths.shape == (len(leaves), int(tree.depths.max()) + 1)
    for row, leaf in zip(paths.tolist(), leaves):
        walk, j = [], leaf
        while j != -1:
            walk.append(j)
            j = parents[j]
        walk.reverse()
        assert row[: len(walk)] == walk and all(x == -1 for x in row[len(walk) :])
