"""Acceptance on hand-built trees, and per-node logits processing against a node-by-node loop."""

import torch
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

from transformers_jakiro.decoding.logits import path_tokens, process_tree_logits
from transformers_jakiro.decoding.tree import DraftTree, ancestor_matrix
from transformers_jakiro.decoding.verification import accept, path_nodes, target_choices, verify


def hand_tree():
    """
    root(0, tok 10) ── a(1, tok 5) ── c(3, tok 7) ── e(5, tok 9)
                    │              └─ d(4, tok 8)
                    └─ b(2, tok 6) ── f(6, tok 7)
    """
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2])
    return DraftTree(
        tokens=torch.tensor([10, 5, 6, 7, 8, 9, 7]),
        parents=parents,
        depths=torch.tensor([0, 1, 1, 2, 2, 3, 2]),
        ancestors=ancestor_matrix(parents, 3),
        scores=torch.zeros(7),
    )


def choices(**at):
    """Target choices per node (default 0, a token no node carries)."""
    out = torch.zeros(7, dtype=torch.long)
    for node, token in at.items():
        out[int(node[1:])] = token
    return out


def test_longest_matching_path_and_bonus():
    path, bonus = accept(hand_tree(), choices(n0=5, n1=7, n3=9, n5=42))
    assert path.tolist() == [0, 1, 3, 5]  # the full depth: no padding and bonus.item() == 42


def test_other_branch():
    path, bonus = accept(hand_tree(), choices(n0=6, n2=7, n6=11))
    assert path.tolist() == [0, 2, 6, -1]  # fixed size: one entry per level, -1 below the path
    assert path_nodes(path).tolist() == [0, 2, 6] and bonus.item() == 11


def test_nothing_accepted():
    path, bonus = accept(hand_tree(), choices(n0=42))
    assert path_nodes(path).tolist() == [0] and bonus.item() == 42


def test_a_match_below_a_mismatch_does_not_count():
    # c and e would match, but a (their ancestor) does not: only the root is accepted.
    path, bonus = accept(hand_tree(), choices(n0=99, n1=7, n3=9))
    assert path_nodes(path).tolist() == [0] and bonus.item() == 99


def test_stop_partway_down():
    path, bonus = accept(hand_tree(), choices(n0=5, n1=8, n4=3))
    assert path_nodes(path).tolist() == [0, 1, 4] and bonus.item() == 3


def test_target_choices_greedy_and_sampled():
    logits = torch.tensor([[0.0, 5.0, 1.0], [-float("inf"), -float("inf"), 0.0]])
    assert target_choices(logits, do_sample=False).tolist() == [1, 2]
    torch.manual_seed(0)
    assert target_choices(logits, do_sample=True)[1].item() == 2  # the only token with mass


def test_path_tokens():
    assert path_tokens(hand_tree()).tolist() == [
        [10, 0, 0, 0], [10, 5, 0, 0], [10, 6, 0, 0], [10, 5, 7, 0], [10, 5, 8, 0], [10, 5, 7, 9], [10, 6, 7, 0]
    ]


def test_per_node_processing_equals_node_by_node_loop():
    tree = hand_tree()
    input_ids = torch.tensor([[3, 4, 5, 7, 10]])  # ends with the root token
    torch.manual_seed(0)
    logits = torch.randn(7, 12)
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.8),
        NoRepeatNGramLogitsProcessor(2),
        MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=4, eos_token_id=2),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(5),
    ])
    got = process_tree_logits(processors, input_ids, tree, logits)
    tokens = path_tokens(tree)
    for node in range(7):
        depth = int(tree.depths[node])
        prefix = torch.cat([input_ids, tokens[node : node + 1, 1 : depth + 1]], dim=1)
        expected = processors(prefix, logits[node : node + 1].clone())
        assert torch.equal(got[node : node + 1], expected), node


def test_prefix_free_processors_leave_raw_logits_untouched():
    tree = hand_tree()
    logits = torch.randn(7, 12)
    before = logits.clone()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)])
    got = process_tree_logits(processors, torch.tensor([[1, 10]]), tree, logits)
    assert torch.equal(logits, before)
    assert torch.equal(got, processors(torch.tensor([[1, 10]]).expand(7, -1), before.clone()))


def test_lazy_leaf_logits_give_the_same_verdict():
    """verify() with rows for internal nodes only plus a leaf callback decides exactly as with every row, and asks
    for a leaf's logits only when the path ends at that leaf."""
    tree = hand_tree()
    internal = tree.internal_nodes()
    assert internal.tolist() == [0, 1, 2, 3]
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randn(7, 12, generator=g)
        # make some children the target's pick, so that paths of every length occur
        for node in range(7):
            children = [c for c in range(7) if tree.parents[c] == node]
            if children and trial % 3:
                logits[node, tree.tokens[children[trial % len(children)]]] += 10.0
        asked = []

        def leaf_logits(node):
            asked.append(int(node))
            return logits[node]

        expected = verify(tree, logits, do_sample=False)
        got = verify(tree, logits[internal], do_sample=False, leaf_logits=leaf_logits)
        assert torch.equal(got[0], expected[0]) and got[1].item() == expected[1].item()
        last = int(path_nodes(expected[0])[-1])
        assert asked == ([last] if last not in internal.tolist() else [])


def test_verify_tree_returns_a_named_round():
    """`verify_tree` on a real tiny target: the named result's fields agree with each other and with the cache."""
    from tiny_models import make_target, quick_trained_draft
    from transformers_jakiro.decoding.row_rounds import VerifiedRound, cache_kwarg, verify_tree
    from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings
    from transformers_jakiro.decoding.kv_cache import new_target_cache

    target = make_target("llama")
    draft = quick_trained_draft(target, steps=100)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    cache = new_target_cache(target.config)
    with torch.no_grad():
        out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, **{cache_kwarg(target): cache})
        sequence = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        generator = JakiroCandidateGenerator(draft, TreeSettings(total_tokens=20, depth=3, top_k=4, contrastive=True))
        generator.observe(out.hidden_states[-1][0], [])
        tree = generator.get_candidates(sequence)
        verified = verify_tree(target, cache, cache_kwarg(target), tree, sequence, LogitsProcessorList(), False)
    assert isinstance(verified, VerifiedRound)
    m = verified.path.numel()
    assert verified.path[0].item() == 0 and cache.get_seq_length() == prompt.shape[1] + m
    assert verified.processed.shape == verified.raw.shape == (m, target.config.vocab_size)
    assert verified.features.shape == (m, target.config.hidden_size)
    assert verified.bonus.item() == verified.processed[-1].argmax().item()
    # along the path, each accepted child is the target's argmax at its parent
    assert tree.tokens[verified.path[1:]].tolist() == verified.processed[:-1].argmax(-1).tolist()
