"""Hybrid trees: n-gram lookup chains grafted onto the Jakiro draft tree and verified in the same forward.

Pure parts (the n-gram index, grafting) are checked against brute force; decoding with lookup on is checked to be
token-identical to plain `generate` (greedy) and to sample the target's distribution, including on a "cycle" target
whose output repeats so that whole chains are accepted and stops land in the middle of a chain.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

from test_tree import brute_force_ancestors, recorded_trees
from tiny_models import ARCHS, random_prompt, trained_pairs
from transformers_jakiro import JakiroDraftModel, jakiro_generate, tree_settings
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings
from transformers_jakiro.decoding.lookup import NgramIndex
from transformers_jakiro.decoding.tree import DraftTree, ancestor_matrix, graft_chain_slots, graft_chains


# -- the n-gram index -------------------------------------------------------------------------------------------------
def brute_force_chains(tokens, max_ngram, max_tokens, max_chains):
    """Scan the whole sequence: longest suffix n-gram first, most recent occurrence first, prefix-duplicates skipped."""
    end, found = len(tokens), []
    for n in range(min(max_ngram, end), 0, -1):
        suffix = tokens[end - n :]
        for start in range(end - 1, n - 1, -1):
            if tokens[start - n : start] == suffix:
                period = tokens[start:]  # what follows the occurrence, repeated if the chain outruns it
                chain = (period * max_tokens)[:max_tokens]
                if not any(f[: len(chain)] == chain for f in found):
                    found.append(chain)
                    if len(found) == max_chains:
                        return found
    return found


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=60),
    st.lists(st.integers(1, 7), min_size=1, max_size=10),
    st.integers(1, 4),
    st.integers(1, 8),
    st.integers(1, 3),
)
def test_ngram_index_matches_brute_force_at_every_step(tokens, chunks, max_ngram, max_tokens, max_chains):
    index = NgramIndex(max_ngram)
    position, chunk = 0, 0
    while position < len(tokens):  # extended in uneven pieces, as decoding rounds accept different lengths
        step = chunks[chunk % len(chunks)]
        index.extend(tokens[position : position + step])
        position, chunk = min(position + step, len(tokens)), chunk + 1
        seen = tokens[:position]
        assert index.chains(max_tokens, max_chains) == brute_force_chains(seen, max_ngram, max_tokens, max_chains)


def test_ngram_index_prefers_longest_then_most_recent_match():
    index = NgramIndex(max_ngram=2)
    index.extend([7, 1, 2, 9, 9, 5, 2, 8, 8, 1, 2])
    # "1 2" occurred once before (continued by 9 9); the single "2" occurred twice, the most recent continuing 8.
    assert index.chains(3, 1) == [[9, 9, 5]]
    assert index.chains(3, 3) == [[9, 9, 5], [8, 8, 1]]
    # a loop: the continuation after the latest "a b" is only "c" long, so it repeats "c a b c ..."
    loop = NgramIndex(max_ngram=2)
    loop.extend([4, 1, 2, 3, 1, 2, 3, 1, 2])
    assert loop.chains(7, 1) == [[3, 1, 2, 3, 1, 2, 3]]
    assert NgramIndex(2).chains(5) == []  # empty sequence
    fresh = NgramIndex(3)
    fresh.extend([4, 5, 6])
    assert fresh.chains(5) == []  # no earlier occurrence of any suffix
    with pytest.raises(ValueError, match="min_ngram"):
        NgramIndex(0)


# -- grafting chains onto a tree --------------------------------------------------------------------------------------
def path_tokens_of(tree: DraftTree) -> list[tuple]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(tree.num_nodes):
        walk, j = [], i
        while j > 0:
            walk.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(walk)))
    return out


@settings(max_examples=300, deadline=None)
@given(recorded_trees(), st.lists(st.lists(st.integers(0, 99), max_size=7), max_size=3))
def test_graft_shares_prefixes_and_keeps_a_breadth_first_tree(case, chains):
    recorder, _, total_tokens = case
    tree = recorder.flatten(total_tokens)
    # Draft levels may repeat a token under one parent in these random cases; real top-k levels never do.
    before = path_tokens_of(tree)
    grafted = graft_chains(tree, chains)
    after = path_tokens_of(grafted)
    parents, depths = grafted.parents.tolist(), grafted.depths.tolist()
    assert parents[0] == -1 and depths == sorted(depths)
    for i in range(1, grafted.num_nodes):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
    assert torch.equal(grafted.ancestors, brute_force_ancestors(parents))
    # Every draft node is still there with its whole path; every chain prefix is a path of the tree.
    assert sorted(after) == sorted(before + [p for p in set(after) if p not in before])
    prefixes = {tuple(c[:k]) for c in chains for k in range(1, len(c) + 1)}
    assert prefixes <= set(after)
    # New nodes are exactly the chain prefixes no draft path had, each once, marked as lookup nodes.
    new = prefixes - set(before)
    assert grafted.num_nodes == tree.num_nodes + len(new)
    marked = grafted.from_lookup.tolist() if grafted.from_lookup is not None else [False] * grafted.num_nodes
    assert {after[i] for i in range(grafted.num_nodes) if marked[i]} == new
    assert all(grafted.scores[i] == 0 for i in range(grafted.num_nodes) if marked[i])


@settings(max_examples=300, deadline=None)
@given(recorded_trees(), st.lists(st.lists(st.integers(0, 99), max_size=7), max_size=3), st.integers(1, 8))
def test_fixed_slots_graft_the_same_paths_as_the_host(case, chains, length):
    """`graft_chain_slots` (fixed slots on the device) adds the same paths as `graft_chains` (on the host) for the
    chains cut to `length` tokens; its other slots are dummies that nothing real sees and that are never accepted."""
    recorder, _, total_tokens = case
    tree = recorder.flatten(total_tokens)
    count = max(len(chains), 1)
    slots = graft_chain_slots(tree, chains, length, count)
    merged = graft_chains(tree, [chain[:length] for chain in chains])
    assert slots.num_nodes == tree.num_nodes + count * length and slots.levels >= length
    parents, depths, real = slots.parents.tolist(), slots.depths.tolist(), slots.real.tolist()
    assert parents[0] == -1
    for i in range(1, slots.num_nodes):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1
        assert real[parents[i]] or not real[i]  # a real node hangs below real nodes only
    assert torch.equal(slots.ancestors, brute_force_ancestors(parents))
    paths = path_tokens_of(slots)
    real_paths = [paths[i] for i in range(slots.num_nodes) if real[i]]
    assert sorted(real_paths) == sorted(path_tokens_of(merged))
    marked = slots.from_lookup.tolist()
    lookup_paths = {paths[i] for i in range(slots.num_nodes) if marked[i]}
    merged_marked = merged.from_lookup.tolist() if merged.from_lookup is not None else [False] * merged.num_nodes
    assert lookup_paths == {path_tokens_of(merged)[i] for i in range(merged.num_nodes) if merged_marked[i]}
    assert all(real[i] for i in range(slots.num_nodes) if marked[i])
    assert not any(slots.ancestors[i, j] for i in range(slots.num_nodes) for j in range(slots.num_nodes)
                   if real[i] and not real[j])  # no real node sees a dummy


def hand_tree(tokens, parents) -> DraftTree:
    parents_t = torch.tensor(parents)
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(torch.tensor(tokens), parents_t, torch.tensor(depths), ancestor_matrix(parents_t, max(depths)),
                     torch.zeros(len(tokens)))


def test_graft_hand_built_cases():
    # root 5; level 1: 6, 7; level 2: 8 (under 6), 9 (under 7); level 3 (the contrastive level): 10 under 8.
    tree = hand_tree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 2, 3])
    # A chain that follows the draft to its deepest (contrastive) level and goes on below it.
    grafted = graft_chains(tree, [[6, 8, 10, 11, 12]])
    assert grafted.num_nodes == 8
    assert path_tokens_of(grafted)[-2:] == [(6, 8, 10, 11), (6, 8, 10, 11, 12)]
    assert grafted.from_lookup.tolist() == [False] * 6 + [True, True]
    # A chain that leaves the draft after one token, and one entirely new; siblings stay distinct.
    grafted = graft_chains(tree, [[7, 3], [4, 4]])
    assert grafted.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 3]
    assert sorted(path_tokens_of(grafted)) == sorted(
        [(), (6,), (7,), (4,), (6, 8), (7, 9), (7, 3), (4, 4), (6, 8, 10)]
    )
    # Chains the draft already holds add nothing.
    assert graft_chains(tree, [[6, 8], [7], []]) is tree


# -- decoding with lookup on --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs():
    return trained_pairs(steps=120)


def repetitive_prompt(g):
    """A random span repeated with variations: suffixes recur, so the lookup proposes chains."""
    span = random_prompt(g, 4, 12)
    noise = torch.randint(3, 128, (1, 2), generator=g)
    return torch.cat([span, noise, span, span[:, : span.shape[1] // 2]], dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_lookup(arch, pairs):
    target, draft = pairs(arch)
    g = torch.Generator().manual_seed(11)
    lookup_rounds = 0
    for i in range(16):
        prompt = repetitive_prompt(g) if i % 4 else random_prompt(g)  # every fourth: likely no match at first
        max_new = int(torch.randint(1, 40, (1,), generator=g))
        expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new)
        shape = [(8, 2, 4, 6, 1), (24, 4, 6, 10, 2), (1, 1, 2, 3, 3)][i % 3]
        with tree_settings(draft, total_tokens=shape[0], depth=shape[1], top_k=shape[2], lookup_tokens=shape[3],
                           lookup_chains=shape[4]):
            got = target.generate(prompt, do_sample=False, max_new_tokens=max_new, assistant_model=draft)
        assert torch.equal(got, expected), f"prompt {i}"
        lookup_rounds += draft.last_generation_stats.lookup_rounds
    assert lookup_rounds > 0  # lookup nodes really were verified


def cycle_target(cycle, eos_token_id=None):
    """A target that continues every token of `cycle` with the next one (its layers' outputs are zeroed, so the
    logits depend on the current token only and lm_head row `next(x)` is x's embedding): its output repeats."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=eos_token_id,
                         pad_token_id=0, tie_word_embeddings=False)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = target.model.embed_tokens.weight
        embed.copy_(torch.nn.functional.normalize(torch.randn_like(embed), dim=-1) * 8)
        head = torch.zeros_like(embed)
        for x, y in zip(cycle, cycle[1:] + cycle[:1]):
            head[y] = embed[x] * 4
        target.lm_head.weight.copy_(head)
    return target


CYCLE = list(range(3, 15))


def test_whole_chains_accepted_and_stops_inside_a_chain():
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)  # untrained: the chains carry the speedup
    prompt = torch.tensor([CYCLE + CYCLE[:5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
    assert expected[0, prompt.shape[1] :].tolist() == (CYCLE[5:] + CYCLE * 3)[:40]  # the target really cycles
    # The tree pinned: with the round controller on, which kind of round runs follows measured timings (a plain step
    # chosen in place of the chain made accepted_lengths [1, 1, 1] in one CI run)
    for max_new in (40, 17, 3):  # 17 and 3 end in the middle of a 10-token chain
        with tree_settings(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10, adaptive=False):
            got = target.generate(prompt, do_sample=False, max_new_tokens=max_new, assistant_model=draft)
        assert torch.equal(got, expected[:, : prompt.shape[1] + max_new])
        stats = draft.last_generation_stats
        assert stats.lookup_accepted >= max_new - 1 - stats.rounds  # nearly every token came from a chain
    assert stats.accepted_lengths == [1, 2]  # the prefill's token, then a chain cut by max_new_tokens
    with tree_settings(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10, adaptive=False):
        target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=draft)
    assert max(draft.last_generation_stats.accepted_lengths) == 11  # a whole 10-token chain plus the bonus token


def test_eos_inside_a_chain_ends_generation_there():
    eos = CYCLE[7]
    target = cycle_target(CYCLE, eos_token_id=eos)
    draft = JakiroDraftModel.from_target(target)
    prompt = torch.tensor([CYCLE[:2] + CYCLE + CYCLE[:2]])  # the chain after "3 4" is 5 6 7 8 9 10 (EOS) 11 ...
    expected = target.generate(prompt, do_sample=False, max_new_tokens=30)
    with tree_settings(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10):
        got = target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=draft)
    assert torch.equal(got, expected) and got[0, -1].item() == eos
    assert draft.last_generation_stats.lookup_accepted >= 5


def test_prompt_lookup_num_tokens_sets_the_lookup_budget(monkeypatch):
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)
    prompt = torch.tensor([CYCLE + CYCLE[:5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=30)
    got = target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=draft, prompt_lookup_num_tokens=4)
    assert torch.equal(got, expected)
    assert max(draft.last_generation_stats.accepted_lengths) == 5  # chains of 4 plus the bonus
    target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=draft, prompt_lookup_num_tokens=0)
    assert draft.last_generation_stats.lookup_rounds == 0  # 0 turns it off
    got = target.generate(prompt, do_sample=False, max_new_tokens=30, custom_generate=jakiro_generate, draft=draft,
                          lookup_tokens=6)
    assert torch.equal(got, expected) and max(draft.last_generation_stats.accepted_lengths) == 7
    # A head can ship lookup on by default.
    draft.config.lookup_tokens = 8
    assert TreeSettings.resolve(draft).lookup_tokens == 8
    target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=draft)
    assert max(draft.last_generation_stats.accepted_lengths) == 9


def test_lookup_settings_are_validated(pairs):
    _, draft = pairs("llama")
    with pytest.raises(ValueError, match="lookup_tokens must be >= 0"):
        with tree_settings(draft, lookup_tokens=-1):
            pass
    with pytest.raises(ValueError, match="lookup_chains must be >= 1"):
        TreeSettings.resolve(draft, lookup_chains=0)
    generator = JakiroCandidateGenerator(draft, TreeSettings.resolve(draft))
    assert generator.lookup is None  # off by default: no index is kept


def test_chain_length_adapts_to_what_was_accepted():
    """A wrong chain shrinks the next one to a one-token probe; a chain accepted whole (the probe too) makes the next
    rounds verify whole chains alone (the pinned controller's lookup rounds, as prompt lookup decoding)."""
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)
    # "4 5 6" first continues with 30 31 ... in the prompt, but the target goes on 7 8 ...: the first chain is wrong.
    prompt = torch.tensor([[3, 4, 5, 6, 30, 31, 32, 33, 34, 35, 36, 37, 40, 3, 4, 5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=60)
    # the pinned tree's own lookup policy (the round controller, on by default, chooses lookup rounds itself)
    with tree_settings(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10, adaptive=False):
        got = target.generate(prompt, do_sample=False, max_new_tokens=60, assistant_model=draft)
    assert torch.equal(got, expected)
    lengths = draft.last_generation_stats.accepted_lengths
    assert lengths[1] == 1  # the 10-token chain was rejected at its first token
    # once the cycle repeats: a 1-token probe accepted (its token and the bonus), then whole 10-token chains alone
    first_whole = lengths.index(11)
    assert lengths[first_whole - 1] == 2 and draft.last_generation_stats.choices[first_whole] == "lookup"
    assert all(length <= 3 for length in lengths[1:first_whole])  # probes, and a tree 4/2/2 (3 tokens at most)


def test_batch_lookup_rounds_bring_each_rows_chain_at_its_own_length():
    """In a batch every row's lookup nodes enter every row's forward: in a lookup round, a row whose last chain was
    rejected brings a one-token probe and a row whose last chain was accepted whole brings a whole chain."""
    from transformers_jakiro.decoding.batch_drafter import BatchDrafter
    from transformers_jakiro.decoding.round_controller import RoundChoice

    draft = JakiroDraftModel.from_target(cycle_target(CYCLE))
    settings = TreeSettings.resolve(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10)
    drafter = BatchDrafter(draft, settings, batch=3)
    text = CYCLE * 2  # every row's text so far: the cycle repeats, so every row has a chain ready
    features = torch.zeros(len(text), draft.config.hidden_size)
    for row, accepted in ((0, 0), (1, 10), (2, 2)):
        drafter.observe(row, features, torch.tensor(text[1:] + text[:1]), text, lookup_accepted=accepted)
    assert drafter.signals()[0]
    trees, kind = drafter.propose(torch.tensor([text[-1]] * 3), RoundChoice("lookup"))
    assert kind == "lookup"
    assert [tree.num_nodes - 1 for tree in trees] == [1, 10, 5]  # 2a + 1 after a round that accepted a, at most 10
    assert trees[1].tokens[1:].tolist() == (CYCLE * 2)[:10]  # the cycle goes on from the text's end


def test_rounds_after_a_whole_chain_skip_the_draft(monkeypatch):
    """While the text copies an earlier passage the draft is not run; it catches up on the accepted features later."""
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)
    prompt = torch.tensor([[3, 4, 5, 6, 30, 31, 32, 33, 34, 35, 36, 37, 40, 3, 4, 5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=60)
    reads = []
    forward = draft.forward

    def counted(*args, **kwargs):
        reads.append(kwargs["hidden_states"].shape[1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(draft, "forward", counted)
    with tree_settings(draft, total_tokens=4, depth=1, top_k=2, lookup_tokens=10, adaptive=False):
        got = target.generate(prompt, do_sample=False, max_new_tokens=60, assistant_model=draft)
    assert torch.equal(got, expected)
    stats = draft.last_generation_stats
    draft_rounds = stats.rounds - 1  # depth 1: one draft forward per drafted round
    assert len(reads) < draft_rounds - 3  # several rounds verified lookup chains alone
    # the draft read the prompt, then only the positions of the rounds it drafted: the copied ones wait for it
    assert reads[0] == prompt.shape[1] and sum(reads) < prompt.shape[1] + stats.new_tokens - 20


def test_the_round_controller_sees_copy_runs(monkeypatch, tmp_path):
    """Rounds that follow one whose tokens continued the ready chain reach the controller as copying (one row, and a
    batch); the output stays exact."""
    from transformers_jakiro.decoding import round_controller

    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(tmp_path / "round_costs.json"))
    seen = []
    choose = round_controller.RoundController.choose

    def spy(self, lookup_ready=True, copying=False, chain_was_whole=False):
        seen.append(copying)
        return choose(self, lookup_ready, copying, chain_was_whole)

    monkeypatch.setattr(round_controller.RoundController, "choose", spy)
    for decode in copying_decodes(max_new_tokens=40):
        seen.clear()
        decode()
        assert len(seen) > 3 and not seen[0] and all(seen[1:])  # nothing before the first round; copying after


def copying_decodes(max_new_tokens: int):
    """One row, then a batch of two, of prompts from which the cycle target copies: yields for each a function that
    decodes it with a random draft (tree 4/2/2, lookup 10) and checks the output equals plain `generate`'s."""
    target = cycle_target(CYCLE)
    draft = JakiroDraftModel.from_target(target)
    prompts = torch.tensor([CYCLE + CYCLE[:5], CYCLE[3:] + CYCLE[:8]])  # the target copies the cycle from here on
    for batch in (prompts[:1], prompts):
        inputs = dict(input_ids=batch, attention_mask=torch.ones_like(batch))
        expected = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)

        def decode():
            with tree_settings(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=10):
                got = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=draft)
            assert torch.equal(got, expected)

        yield decode


@pytest.mark.parametrize("chains", [True, False])
def test_a_tree_choice_carries_lookup_chains_as_it_says(monkeypatch, tmp_path, chains):
    """A tree choice with `chains=False` (`choices_for`'s smaller tree) carries a ready lookup chain only in a copy run
    (the row's last round continued its chain), one row and a batch alike; with chains, in any round. Exact either
    way."""
    from transformers_jakiro.decoding import round_controller
    from transformers_jakiro.decoding.batch_drafter import BatchDrafter

    monkeypatch.setenv("JAKIRO_ROUND_COSTS", str(tmp_path / "round_costs.json"))
    choice = round_controller.RoundChoice("tree", 2, 1, 2, chains=chains)
    monkeypatch.setattr(round_controller, "choices_for", lambda *args: [choice, round_controller.RoundChoice("plain")])
    monkeypatch.setattr(round_controller.RoundController, "choose", lambda self, *args, **kwargs: choice)
    grafted = []  # per row and round: (copying, lookup nodes in its tree)
    one_row, batch_propose = JakiroCandidateGenerator.get_candidates, BatchDrafter.propose

    def spy_one_row(self, *args, **kwargs):
        copying = self.copying
        tree = one_row(self, *args, **kwargs)
        grafted.append((copying, tree.from_lookup is not None))
        return tree

    def spy_batch(self, *args, **kwargs):
        copied = list(self.copied)
        trees, name = batch_propose(self, *args, **kwargs)
        grafted.extend((c, tree.from_lookup is not None) for c, tree in zip(copied, trees))
        return trees, name

    monkeypatch.setattr(JakiroCandidateGenerator, "get_candidates", spy_one_row)
    monkeypatch.setattr(BatchDrafter, "propose", spy_batch)
    for decode in copying_decodes(max_new_tokens=30):
        grafted.clear()
        decode()
        assert any(g for c, g in grafted if c)  # copy runs carry their chain
        assert any(g for c, g in grafted if not c) == chains  # elsewhere only with chains


def test_a_joined_rows_prompt_is_read_in_a_forward_of_its_own():
    """A row that joins a batch (continuous batching) reads its prompt in its own forward, not padded across every
    row: the forwards are [1, prompt] then [rows, 2] queries, not [rows, prompt]. Every row's tree is the one a single
    padded read gives."""
    from transformers_jakiro.decoding.batch_drafter import BatchDrafter
    from transformers_jakiro.decoding.round_controller import RoundChoice

    torch.manual_seed(0)
    draft = JakiroDraftModel.from_target(cycle_target(CYCLE))
    settings = TreeSettings.resolve(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=0)
    width, text = draft.config.hidden_size, CYCLE * 3
    first = [torch.randn(len(text), width) for _ in range(2)]
    later = [torch.randn(2, width) for _ in range(2)]
    joined = torch.randn(len(text) - 4, width)

    def round_with_join(split: bool):
        drafter = BatchDrafter(draft, settings, batch=2)
        for row in range(2):
            drafter.observe(row, first[row], torch.tensor(text[1:] + text[:1]), text)
        drafter.propose(torch.tensor([text[-1]] * 2), RoundChoice("tree", 4, 2, 2))  # the prompts: one forward
        drafter.add_rows(1)
        for row in range(2):
            drafter.observe(row, later[row], torch.tensor(text[:2]), text[:2])
        drafter.observe(2, joined, torch.tensor(text[1:len(text) - 3]), text[:-4])
        if not split:  # one forward padded across every row, as before
            drafter._read = lambda: BatchDrafter._read_rows(drafter, None)
        shapes = []
        hook = draft.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
            tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            trees, _ = drafter.propose(torch.tensor([text[1], text[1], text[-4]]), RoundChoice("tree", 4, 2, 2))
        finally:
            hook.remove()
        return trees, shapes[:-1], drafter  # the last forward: the tree's second level

    trees, shapes, drafter = round_with_join(split=True)
    padded_trees, padded_shapes, padded = round_with_join(split=False)
    assert shapes == [(1, len(text) - 4), (3, 2)] and padded_shapes == [(3, len(text) - 4)]
    for tree, reference in zip(trees, padded_trees):
        assert tree.tokens.tolist() == reference.tokens.tolist()
        assert tree.parents.tolist() == reference.parents.tolist()
        torch.testing.assert_close(tree.scores, reference.scores, rtol=1e-4, atol=1e-5)
    assert drafter.present == padded.present == [len(text) + 2, len(text) + 2, len(text) - 4]
    assert not any(tree.scores.requires_grad for tree in trees)  # drafting records no autograd graph


def test_a_joined_row_with_preloaded_entries_reads_only_the_rest_of_its_prompt():
    """A row joining with the draft's entries of its prompt's first positions (`preload`, from another row's
    `first_reads`: continuous batching's shared prompt pages) reads the rest of its prompt only, and drafts the tree
    and keeps the entries that reading the whole prompt gives: beside a decoding row, and as the only row of a new
    batch (its entries then are the cache's first)."""
    from transformers_jakiro.decoding.batch_drafter import BatchDrafter
    from transformers_jakiro.decoding.round_controller import RoundChoice

    torch.manual_seed(1)
    draft = JakiroDraftModel.from_target(cycle_target(CYCLE))
    settings = TreeSettings.resolve(draft, total_tokens=4, depth=2, top_k=2, lookup_tokens=0)
    width, text = draft.config.hidden_size, CYCLE * 3
    features, next_tokens = torch.randn(len(text), width), torch.tensor(text[1:] + text[:1])
    choice = RoundChoice("tree", 4, 2, 2)

    first = BatchDrafter(draft, settings, batch=1)
    first.keep_first_reads = True
    first.observe(0, features, next_tokens, text)
    first.propose(torch.tensor([text[-1]]), choice)
    entries = first.first_reads[0]
    assert [tuple(k.shape) for k, _ in entries] == [(k.shape[0], len(text), k.shape[-1]) for k, _ in entries]
    m = 9

    def joined(preload: bool, beside: bool):
        drafter = BatchDrafter(draft, settings, batch=1 if beside else 0)
        drafter.keep_first_reads = True
        if beside:
            drafter.observe(0, features, next_tokens, text)
            drafter.propose(torch.tensor([text[-1]]), choice)
            drafter.observe(0, torch.randn(2, width, generator=torch.Generator().manual_seed(2)),
                            torch.tensor(text[:2]), text[:2])
        drafter.add_rows(1)
        row, start = drafter.batch - 1, m if preload else 0
        if preload:
            drafter.preload(row, [(k[:, :m], v[:, :m]) for k, v in entries])
        drafter.observe(row, features[start:], next_tokens[start:], text)
        shapes = []
        hook = draft.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
            tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        try:
            roots = torch.tensor([text[1]] * beside + [text[-1]])
            trees, _ = drafter.propose(roots, choice)
        finally:
            hook.remove()
        return trees, shapes[:-1], drafter

    for beside in (True, False):
        trees, shapes, drafter = joined(preload=True, beside=beside)
        reference_trees, reference_shapes, reference = joined(preload=False, beside=beside)
        assert shapes[0] == (1, len(text) - m) and reference_shapes[0] == (1, len(text))
        for tree, expected in zip(trees, reference_trees):
            assert tree.tokens.tolist() == expected.tokens.tolist()
            assert tree.parents.tolist() == expected.parents.tolist()
            torch.testing.assert_close(tree.scores, expected.scores, rtol=1e-4, atol=1e-5)
        assert drafter.present == reference.present
        row = drafter.batch - 1
        for (k, v), (k_ref, v_ref) in zip(drafter.first_reads[row], reference.first_reads[row]):
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)
        assert drafter.key_mask.sum(1).tolist() == reference.key_mask.sum(1).tolist()
        with pytest.raises(ValueError, match="preload a row right after add_rows"):
            drafter.preload(row, entries)
