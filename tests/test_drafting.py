"""The candidate generator on its own: its place relative to transformers' contract, and its tree expansion."""

import pytest
import torch
import torch.nn.functional as F
from transformers.generation.candidate_generator import CandidateGenerator

from tiny_models import VOCAB, make_target
from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings


def test_not_a_transformers_candidate_generator():
    """It returns a DraftTree, which the CandidateGenerator contract (linear candidate ids and logits) cannot
    express, so it does not claim that contract; the docstring says so."""
    assert not issubclass(JakiroCandidateGenerator, CandidateGenerator)
    assert "Not a transformers `CandidateGenerator`" in JakiroCandidateGenerator.__doc__


def brute_force_expansion(draft, sequence, features, depth: int, top_k: int, contrastive: bool) -> dict:
    """{token path below the root: cumulative score} of every candidate EAGLE-2/Jakiro expansion records, computed
    node by node: each node's draft outputs come from one causal forward over the prompt and the node's own ancestors
    (no cache, no tree mask, no batching), each node reading its parent's predicted feature."""
    prompt_length = features.shape[0]
    next_tokens = sequence[0, 1:]  # x_{t+1} for each prompt feature f_t, then the root token's successors below

    def outputs(path: tuple, parent_features: list):
        ids = torch.cat([next_tokens, torch.tensor(path, dtype=torch.long)])[None]
        hidden = torch.cat([features, *[f[None] for f in parent_features]])[None]
        out = draft(input_ids=ids, hidden_states=hidden)
        right = out.contrastive_hidden_state[0, -1] if out.contrastive_hidden_state is not None else None
        return out.last_hidden_state[0, -1], right

    def top(feature):
        log_probs = F.log_softmax(draft.compute_logits(feature[None]).float(), dim=-1)[0]
        values, ids = log_probs.topk(top_k)
        return list(zip(draft.draft_to_target_ids(ids).tolist(), values.tolist()))

    assert sequence.shape[1] == prompt_length + 1
    root_left, root_right = outputs((), [])
    # node: (path, score, left feature, right feature, features read along the path); root's children first
    records = {}
    level = [((token,), score) for token, score in top(root_left)]
    info = {(): (0.0, root_left, root_right, [])}
    records.update(dict(level))
    for path, score in level:
        info[path] = (score, None, None, info[()][3] + [root_left])
    kept = [path for path, _ in level]
    for _ in range(2, depth + 1):
        children = []
        for path in kept:
            score, _, _, read = info[path]
            left, right = outputs(path, read)
            info[path] = (score, left, right, read)
            for token, log_prob in top(left):
                child = path + (token,)
                children.append((child, score + log_prob))
                info[child] = (score + log_prob, None, None, read + [left])
        records.update(dict(children))
        kept = [path for path, _ in sorted(children, key=lambda c: -c[1])[:top_k]]
    if contrastive:
        for path in kept:  # the right head of a kept node's parent predicts the kept node's children
            parent_right = info[path[:-1]][2]
            for token, log_prob in top(parent_right):
                records[path + (token,)] = info[path][0] + log_prob
    return records


def tree_paths(tree) -> dict:
    tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    out = {}
    for node in range(1, tree.num_nodes):
        path, j = [], node
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out[tuple(reversed(path))] = scores[node]
    return out


@pytest.mark.parametrize(
    "depth, top_k, contrastive, draft_vocab",
    [(3, 3, True, None), (1, 4, True, None), (4, 2, False, None), (2, 3, True, 48)],
)
def test_tree_expansion_equals_brute_force(depth, top_k, contrastive, draft_vocab):
    """Every node's children and cumulative scores, the global top-k kept per level and the contrastive level's
    parents, against a node-by-node expansion. Lossless verification would hide a wrong tree from end-to-end tests
    (it only costs acceptance), so the expansion is checked directly."""
    target = make_target("llama", dtype=torch.float64)  # float64: no near-ties between batched and sequential runs
    torch.manual_seed(1)
    draft = JakiroDraftModel.from_target(target, draft_vocab_size=draft_vocab).eval()
    if draft_vocab:
        draft.d2t.copy_(torch.randperm(VOCAB)[:draft_vocab])
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(depth))
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        sequence = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        features = out.hidden_states[-1][0]
        generator = JakiroCandidateGenerator(draft, TreeSettings(10_000, depth, top_k, contrastive))
        generator.observe(features, [])
        tree = generator.get_candidates(sequence)
        expected = brute_force_expansion(draft, sequence, features, depth, top_k, contrastive)
    got = tree_paths(tree)
    assert len(got) == len(expected) == top_k + (depth - 1) * top_k**2 + (top_k**2 if contrastive else 0)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, abs=1e-5), path
    assert tree.num_nodes - 1 == len(expected) and int(tree.depths.max()) == depth + contrastive


def test_catch_up_reads_are_timed_apart_from_the_round():
    """The draft's read of positions that earlier rounds left unread (the prompt, or plain steps) is reported as
    `catch_up_s`, which the round controller leaves out of the round's cost; a tree round right after a tree round
    has none."""
    from transformers_jakiro.decoding.round_controller import RoundChoice

    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target).eval()
    tree, plain = RoundChoice("tree", 6, 2, 3), RoundChoice("plain")
    sequence = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = target(sequence[:, :12], output_hidden_states=True).hidden_states[-1][0]
    generator = JakiroCandidateGenerator(draft, TreeSettings(6, 2, 3, True))
    generator.observe(features[:8], [])
    generator.get_candidates(sequence[:, :9], tree)
    assert generator.catch_up_s > 0  # the prompt: all but its last position
    generator.observe(features[8:9], [])
    generator.get_candidates(sequence[:, :10], tree)
    assert generator.catch_up_s == 0  # only what the last (tree) round accepted
    for end in (11, 12):  # two plain steps: nothing read, their positions left for later
        generator.observe(features[end - 2 : end - 1], [])
        generator.get_candidates(sequence[:, :end], plain)
        assert generator.catch_up_s == 0
    generator.observe(features[11:12], [])
    generator.get_candidates(sequence, tree)
    assert generator.catch_up_s > 0 and generator.pending_features.shape[0] == 3
