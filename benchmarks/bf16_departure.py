"""Where, in bfloat16, Jakiro's output departs from plain greedy decoding, and why.

    .venv/bin/python benchmarks/bf16_departure.py                      # 6 chat prompts x 64 new tokens, bf16
    .venv/bin/python benchmarks/bf16_departure.py --json /tmp/bf16.json --fp32

For each prompt it decodes with plain `generate`, Jakiro (the shipped SmolLM2 head; draft tree alone, and with its
n-gram lookup), and stock prompt lookup (`prompt_lookup_num_tokens=10`), and reports each method's match against
plain output and the first token where it departs. At Jakiro's first departure it replays the target's computation
of that position from the same prefix in several ways, each changing one factor against a plain one-token step:

  plain_steps        one-token steps with a 2D mask, as `generate` does them (the reference; must reproduce plain's
                     logits bit for bit)
  step_4d_mask       the same steps, each with an explicit [1, 1, 1, past + 1] additive bf16 mask instead of none
  tree_bf16_mask     the round's own tree in one forward with `DraftTree.attention_mask` in bf16 (what Jakiro does)
  tree_f32_mask      the same with the additive mask in float32
  tree_bool_mask     the same with a boolean mask (True = visible)
  tree_eager         the same mask, eager attention instead of SDPA
  chain_hf_mask      a chain of 11 tokens (root + 10, as prompt lookup verifies) with transformers' own causal mask
  chain_4d_mask      the same chain with an explicit 4D additive bf16 causal mask
  rows_R             the chain cut to R query rows (R >= the row's depth + 1): matmul shapes alone
  own_cache_step     plain one-token steps, but over Jakiro's own cache (the K/V its earlier verify forwards wrote)
  own_cache_tree     the round's tree over Jakiro's own cache: must reproduce Jakiro's logits bit for bit

All replays except the own_cache ones start from plain decoding's cache, so they isolate the verify forward from the
history. Per layer (forward hooks on every decoder layer, the final norm) the max abs difference of the hidden state
at the departing row against plain_steps, the first op that departs (hooks on every submodule), the logits' max abs
difference, and the top-2 logit gap of plain's logits at that position. A micro test checks each bf16 matmul shape
alone (row 0 of an M-row product against the 1-row product) and SDPA with one query row against the same row among
several.

`--patch NAME` applies a candidate change to Jakiro's path (by monkeypatching) before measuring the match rates:
`bool_mask` (the tree mask as booleans), `f32_mask` (the additive mask in float32), `full_logits` (no lazy
leaf head: the lm_head over every node, as in one forward), `rowwise_attention` (every multi-row masked forward -- Jakiro's verify and stock prompt lookup's alike --
computes attention one query row at a time over exactly that row's keys, as a one-token step does).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import transformers_jakiro  # noqa: F401  (installs the generate hook)
from transformers_jakiro.decoding import row_rounds as decoding
from transformers_jakiro.bench import load_draft
from transformers_jakiro.demo import CODER_PROMPTS, PROMPTS, find_head
from transformers_jakiro import tree_settings
from transformers_jakiro.targets import load_target
from transformers_jakiro.decoding.tree import DraftTree

DEFAULT_PROMPTS = tuple(PROMPTS) + tuple(CODER_PROMPTS[:2])
METHODS = ("jakiro", "jakiro_lookup", "prompt_lookup")


def encode(tokenizer, text):
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    return {k: inputs[k] for k in ("input_ids", "attention_mask")}


class RoundRecorder:
    """Wraps `row_rounds.verify_tree` to keep each round's tree, cache length, accepted path and raw logits."""

    def __init__(self):
        self.rounds, self.prompt_length, self._original = [], 0, None

    def __enter__(self):
        self._original = decoding.verify_tree

        def recording(target, cache, cache_kwarg, tree, sequence, *args, **kwargs):
            verified = self._original(target, cache, cache_kwarg, tree, sequence, *args, **kwargs)
            self.rounds.append(dict(
                start=sequence.shape[1] - self.prompt_length,  # tokens generated before the round (root included)
                past=sequence.shape[1] - 1, tree=tree, path=verified.path.tolist(),
                leaf=(args[2] if len(args) > 2 else kwargs.get("leaf_head")) is not None,
            ))
            return verified

        decoding.verify_tree = recording
        return self

    def __exit__(self, *exc):
        decoding.verify_tree = self._original


def generate(target, inputs, method, draft, max_new_tokens):
    """(new token ids, [new, vocab] float32 raw logits, cache, recorded Jakiro rounds)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2, return_dict_in_generate=True,
                  output_logits=True)
    recorder = RoundRecorder()
    recorder.prompt_length = inputs["input_ids"].shape[1]
    started = time.perf_counter()
    with recorder:
        if method == "plain":
            out = target.generate(**inputs, **kwargs)
        elif method == "prompt_lookup":
            out = target.generate(**inputs, **kwargs, prompt_lookup_num_tokens=10)
        else:
            lookup = None if method == "jakiro_lookup" else 0
            with tree_settings(draft, lookup_tokens=lookup):
                out = target.generate(**inputs, **kwargs, assistant_model=draft)
    ids = out.sequences[0, recorder.prompt_length:].tolist()
    logits = torch.cat([row.float() for row in out.logits])
    cache = out.get("cache", out.get("past_key_values"))
    return ids, logits, cache, recorder.rounds, time.perf_counter() - started


def first_departure(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------------------------------------ replays


class Hooks:
    """Captures the output of every decoder layer, the final norm and every submodule at the query rows along the
    accepted path (`rows`, root first), and the final norm's output at every row."""

    def __init__(self, target):
        self.target, self.rows, self.records, self.handles, self.norm = target, [0], {}, [], None

    def __enter__(self):
        decoder = self.target.get_decoder()
        named = [(f"layers.{i}.{name}" if name else f"layers.{i}", module)
                 for i, layer in enumerate(decoder.layers) for name, module in layer.named_modules()]
        named.append(("norm", decoder.norm))
        for name, module in named:
            self.handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name):
        def hook(module, args, output):
            value = output if isinstance(output, torch.Tensor) else output[0]
            if name == "norm":
                self.norm = value[0].detach()
            if value.dim() == 3 and value.shape[1] > max(self.rows):
                self.records.setdefault(name, []).append(value[0, self.rows].detach().float().clone())
        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def take(self):
        records, self.records = self.records, {}
        return {name: torch.cat(values) for name, values in records.items()}  # name -> [path rows, width]


def cropped(cache, length):
    cache = copy.deepcopy(cache)
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5.24: a negative count removes that many positions
    assert cache.get_seq_length() == length
    return cache


def _run(target, cache, tokens, positions, mask):
    return target(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask, cache=cache,
                  use_cache=True, logits_to_keep=1 if tokens.numel() == 1 else 0)


def _result(target, hooks, logits, row, internal=None):
    head = target.get_output_embeddings()
    result = dict(logits=logits, one_row_logits=head(hooks.norm[row][None]).float()[0], records=hooks.take())
    if internal is not None and row in internal:
        result["internal_logits"] = head(hooks.norm[internal]).float()[internal.index(row)]
    return result


def forward(target, cache, tokens, positions, mask, hooks, rows, internal=None):
    """One forward of the target over `tokens` ([n]) after `cache`; `rows`: the path's query rows, root first, the
    last one the departing row. Returns float32 logits at that row: `logits` from the forward's lm_head over all
    rows, `one_row_logits` from a one-row lm_head on the final norm's output (a lazy leaf), `internal_logits` from
    the lm_head over the `internal` rows (verify_tree's lazy-leaf forward); and the hooked records along the path."""
    hooks.rows = list(rows)
    hooks.take()
    out = _run(target, cache, tokens, positions, mask)
    return _result(target, hooks, out.logits[0, rows[-1]].float(), rows[-1], internal)


def steps(target, cache, tokens, start, hooks, explicit_mask=False):
    """One-token steps over `tokens` from cache length `start`, as generate does them (a 2D mask of ones, which
    transformers drops for SDPA); `explicit_mask`: an additive [1, 1, 1, past + 1] mask of zeros instead."""
    hooks.rows = [0]
    hooks.take()
    for offset, token in enumerate(tokens.tolist()):
        length = start + offset + 1
        if explicit_mask:
            mask = torch.zeros(1, 1, 1, length, dtype=target.dtype)
        else:
            mask = torch.ones(1, length, dtype=torch.long)
        out = _run(target, cache, torch.tensor([token]), torch.tensor([length - 1]), mask)
    return _result(target, hooks, out.logits[0, -1].float(), 0)


def causal_4d(n, past, dtype):
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def compare(reference, result):
    """Per layer max abs difference (at the departing row, and over the path's rows), the first op that departs
    at any row of the path (and at which depth), the logits' difference."""
    ref, got = reference["records"], result["records"]
    first = next(((name, int((value != ref[name]).any(-1).nonzero()[0])) for name, value in got.items()
                  if not torch.equal(value, ref[name])), None)
    layers = [(name, (value[-1] - ref[name][-1]).abs().max().item(), (value - ref[name]).abs().max().item())
              for name, value in got.items() if name.count(".") == 1 or name == "norm"]
    return dict(
        first_departing_op=None if first is None else f"{first[0]} (depth {first[1]})",
        first_departing_layer_at_row=next((name for name, diff, _ in layers if diff > 0), None),
        layer_max_abs=[round(diff, 4) for _, diff, _ in layers],
        layer_max_abs_path=[round(diff, 4) for _, _, diff in layers],
        logits_max_abs=(result["logits"] - reference["logits"]).abs().max().item(),
        one_row_logits_max_abs=(result["one_row_logits"] - reference["logits"]).abs().max().item(),
    )


def top2(logits, tokenizer):
    values, indices = logits.topk(2)
    return dict(tokens=[tokenizer.decode([i]) for i in indices.tolist()], ids=indices.tolist(),
                values=[round(v, 4) for v in values.tolist()], gap=round((values[0] - values[1]).item(), 4))


def replay(target, tokenizer, inputs, plain, jakiro, d):
    """The factor table at Jakiro's first departure d."""
    plain_ids, plain_logits, plain_cache = plain[:3]
    ids, logits, own_cache, rounds = jakiro[:4]
    info = dict(position=d, plain_token=tokenizer.decode([plain_ids[d]]), jakiro_token=tokenizer.decode([ids[d]]),
                plain_top2=top2(plain_logits[d], tokenizer), jakiro_logits_top2=top2(logits[d], tokenizer),
                logits_max_abs_end_to_end=(logits[d] - plain_logits[d]).abs().max().item())
    prompt = inputs["input_ids"][0]
    sequence = torch.cat([prompt, torch.tensor(ids)])
    if d == 0:
        info["round"] = "prefill"
        return info
    round_ = next(r for r in rounds if r["start"] <= d < r["start"] + len(r["path"]))
    tree, past, path = round_["tree"].to_device("cpu"), round_["past"], round_["path"]
    depth = d - round_["start"]
    node = path[depth]
    info.update(round=dict(start=round_["start"], past=past, nodes=tree.num_nodes, accepted=len(path) - 1,
                           row_depth=depth, lazy_leaf=round_["leaf"]))
    chain_tokens = sequence[past: past + 11]  # the root (the last accepted token before the round) and 10 more
    path_tokens = sequence[past: past + depth + 1]
    rows = [i for i in range(tree.num_nodes) if bool(tree.ancestors[node, i])]  # root first, the node last
    variants = {}
    with Hooks(target) as hooks:
        ref = steps(target, cropped(plain_cache, past), path_tokens, past, hooks)
        info["replay_reproduces_plain"] = torch.equal(ref["logits"], plain_logits[d])
        variants["step_4d_mask"] = steps(target, cropped(plain_cache, past), path_tokens, past, hooks, True)
        positions = tree.position_ids(past)[0]
        internal = tree.internal_nodes().tolist()
        for name, dtype in (("tree_bf16_mask", target.dtype), ("tree_f32_mask", torch.float32)):
            variants[name] = forward(target, cropped(plain_cache, past), tree.tokens, positions,
                                     tree.attention_mask(past, dtype), hooks, rows, internal)
        bool_mask = tree.attention_mask(past, torch.float32) == 0
        variants["tree_bool_mask"] = forward(target, cropped(plain_cache, past), tree.tokens, positions, bool_mask,
                                             hooks, rows)
        target.set_attn_implementation("eager")
        try:
            variants["tree_eager"] = forward(target, cropped(plain_cache, past), tree.tokens, positions,
                                             tree.attention_mask(past, target.dtype), hooks, rows)
            variants["plain_steps_eager"] = steps(target, cropped(plain_cache, past), path_tokens, past, hooks)
        finally:
            target.set_attn_implementation("sdpa")
        n = chain_tokens.numel()
        chain_positions = torch.arange(past, past + n)
        variants["chain_hf_mask"] = forward(target, cropped(plain_cache, past), chain_tokens, chain_positions,
                                            torch.ones(1, past + n, dtype=torch.long), hooks,
                                            list(range(depth + 1)))
        variants["chain_4d_mask"] = forward(target, cropped(plain_cache, past), chain_tokens, chain_positions,
                                            causal_4d(n, past, target.dtype), hooks,
                                            list(range(depth + 1)))
        for count in sorted({depth + 1, depth + 2, depth + 4, 8, n} - set(range(depth + 1))):
            if count <= n:
                variants[f"rows_{count}"] = forward(target, cropped(plain_cache, past), chain_tokens[:count],
                                                   chain_positions[:count], causal_4d(count, past, target.dtype), hooks,
                                                   list(range(depth + 1)))
        variants["own_cache_step"] = steps(target, cropped(own_cache, past), path_tokens, past, hooks)
        with rowwise_attention():
            variants["tree_rowwise_attention"] = forward(target, cropped(plain_cache, past), tree.tokens, positions,
                                                         tree.attention_mask(past, target.dtype), hooks, rows, internal)
        variants["own_cache_tree"] = forward(target, cropped(own_cache, past), tree.tokens, positions,
                                             tree.attention_mask(past, target.dtype), hooks, rows, internal)
    # which lm_head product Jakiro used for this row: over the internal nodes, one row (a leaf), or all rows
    used = ("internal_logits" if node in internal else "one_row_logits") if round_["leaf"] else "logits"
    info["round"]["lm_head_rows"] = {"internal_logits": len(internal), "one_row_logits": 1,
                                     "logits": tree.num_nodes}[used]
    info["own_cache_tree_reproduces_jakiro"] = bool(torch.equal(variants["own_cache_tree"][used], logits[d]))
    info["variants"] = {}
    for name, result in variants.items():
        row = compare(ref, result)
        if "internal_logits" in result:
            row["internal_logits_max_abs"] = (result["internal_logits"] - ref["logits"]).abs().max().item()
        row["flips"] = int(result["logits"].argmax()) != plain_ids[d]
        info["variants"][name] = row
    return info


@contextlib.contextmanager
def rowwise_attention():
    """SDPA for a forward of several query rows with a 4D mask, computed one query row at a time over exactly the
    keys that row sees, in cache order, with no mask: the very call a one-token step makes (transformers' SDPA path
    with `enable_gqa`). A one-token step and every forward without a mask are left as they are."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] == 1 or attention_mask is None or attention_mask.dim() != 4:
            return original(module, query, key, value, attention_mask, **kwargs)
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        rows = []
        for i in range(query.shape[2]):
            index = visible[0, 0, i].nonzero()[:, 0]
            out, _ = original(module, query[:, :, i : i + 1].contiguous(), key[:, :, index], value[:, :, index], None,
                              **kwargs)
            rows.append(out)  # [batch, 1, heads, head_dim]
        return torch.cat(rows, dim=1), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


# ------------------------------------------------------------------------------------------------ micro tests


def kv_length_sweep(dtype, heads=9, kv_heads=3, dim=64):
    """One query row over L keys (no mask, as a step) against the same row with `extra` masked keys after them (as
    a row of a multi-row verify forward sees them): how often the bf16 SDPA output differs, and whether every
    difference comes with L and L + extra in different 16-key chunks."""
    torch.manual_seed(0)
    differing, total, chunk_changes = 0, 0, 0
    for length in range(33, 161):
        q = torch.randn(1, heads, 1, dim).to(dtype)
        k = (torch.randn(1, kv_heads, length + 16, dim) * 2).to(dtype)
        v = torch.randn(1, kv_heads, length + 16, dim).to(dtype)
        step = F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], scale=dim**-0.5, enable_gqa=True)
        for extra in (1, 2, 4, 8, 10, 16):
            mask = torch.zeros(1, 1, 1, length + extra, dtype=dtype)
            mask[..., length:] = torch.finfo(dtype).min
            got = F.scaled_dot_product_attention(q, k[:, :, : length + extra], v[:, :, : length + extra], mask,
                                                 scale=dim**-0.5, enable_gqa=True)
            total += 1
            if not torch.equal(got, step):
                differing += 1
                chunk_changes += (length - 1) // 16 != (length + extra - 1) // 16
    return dict(cases=total, differing=differing, differing_with_a_new_16_key_chunk=chunk_changes)


def micro(target):
    """Row 0 of an M-row bf16 product against the 1-row product, for the target's own weight matrices; SDPA with
    one query row against the same row among several (with a mask)."""
    torch.manual_seed(0)
    layer = target.get_decoder().layers[0]
    matrices = dict(q_proj=layer.self_attn.q_proj, k_proj=layer.self_attn.k_proj, o_proj=layer.self_attn.o_proj,
                    gate_proj=layer.mlp.gate_proj, down_proj=layer.mlp.down_proj,
                    lm_head=target.get_output_embeddings())
    out = {}
    for name, linear in matrices.items():
        x = torch.randn(32, linear.in_features).to(target.dtype)
        one = linear(x[:1])
        out[name] = {m: (linear(x[:m])[:1].float() - one.float()).abs().max().item()
                     for m in (2, 3, 4, 8, 11, 16, 17, 32)}
    heads, kv_heads, dim, past = 9, 3, 64, 100
    q = torch.randn(1, heads, 11, dim).to(target.dtype)
    k = torch.randn(1, heads, past + 11, dim).to(target.dtype)
    v = torch.randn(1, heads, past + 11, dim).to(target.dtype)
    single = F.scaled_dot_product_attention(q[:, :, :1], k[:, :, : past + 1], v[:, :, : past + 1])
    sdpa = {}
    for rows in (1, 2, 4, 11):
        mask = causal_4d(rows, past, target.dtype)
        # the row sees the same past + 1 keys; the others' keys are masked out for it
        got = F.scaled_dot_product_attention(q[:, :, :rows], k[:, :, : past + rows], v[:, :, : past + rows], mask)
        sdpa[f"rows_{rows}_bf16_mask"] = (got[:, :, :1].float() - single.float()).abs().max().item()
    mask = causal_4d(1, past, target.dtype)
    got = F.scaled_dot_product_attention(q[:, :, :1], k[:, :, : past + 1], v[:, :, : past + 1], mask)
    sdpa["rows_1_zero_mask_vs_none"] = (got.float() - single.float()).abs().max().item()
    sdpa["backend_1_row_no_mask"] = int(torch._fused_sdp_choice(q[:, :, :1], k, v, None, 0.0, False))
    sdpa["backend_11_rows_bf16_mask"] = int(torch._fused_sdp_choice(q, k, v, causal_4d(11, past, target.dtype), 0.0,
                                                                    False))
    return dict(matmul_row0_max_abs=out, sdpa=sdpa, sdpa_backends="0 math, 1 flash (CPU flash kernel)",
                sdpa_kv_length=kv_length_sweep(target.dtype))


# ------------------------------------------------------------------------------------------------ patches


def apply_patch(name):
    """Monkeypatch one candidate change into Jakiro's path; returns an undo callable."""
    if name == "bool_mask":
        original = DraftTree.attention_mask

        def bool_mask(self, past_length, dtype, padding=0, kv_length=None):
            return original(self, past_length, torch.float32, padding, kv_length) == 0

        DraftTree.attention_mask = bool_mask
        return lambda: setattr(DraftTree, "attention_mask", original)
    if name == "f32_mask":
        original = DraftTree.attention_mask
        DraftTree.attention_mask = lambda self, p, dtype, padding=0, kv_length=None: original(
            self, p, torch.float32, padding, kv_length)
        return lambda: setattr(DraftTree, "attention_mask", original)
    if name == "rowwise_attention":
        manager = rowwise_attention()
        manager.__enter__()
        return lambda: manager.__exit__(None, None, None)
    if name == "full_logits":
        original = decoding.lazy_leaf_head
        decoding.lazy_leaf_head = lambda *args, **kwargs: None
        return lambda: setattr(decoding, "lazy_leaf_head", original)
    raise ValueError(name)


# ------------------------------------------------------------------------------------------------ main


def match_rates(target, tokenizer, draft, prompts, max_new_tokens, methods=METHODS):
    rows = []
    for prompt in prompts:
        inputs = encode(tokenizer, prompt)
        plain = generate(target, inputs, "plain", draft, max_new_tokens)
        row = dict(prompt=prompt[:40], results={})
        for method in methods:
            other = generate(target, inputs, method, draft, max_new_tokens)
            d = first_departure(plain[0], other[0])
            row["results"][method] = dict(identical=d is None, first_departure=d,
                                          prefill_logits_equal=torch.equal(plain[1][0], other[1][0]))
            if method != "prompt_lookup":  # the prompt's K/V from Jakiro's prefill against plain's, every layer
                length = inputs["input_ids"].shape[1]
                row["results"][method]["prefill_cache_equal"] = all(
                    torch.equal(a.keys[..., :length, :], b.keys[..., :length, :])
                    and torch.equal(a.values[..., :length, :], b.values[..., :length, :])
                    for a, b in zip(plain[2].layers, other[2].layers))
            if d is not None and d < min(len(plain[0]), len(other[0])):
                row["results"][method]["plain_top2_gap"] = top2(plain[1][d], tokenizer)["gap"]
            row["results"][method].update(tokens=len(other[0]), seconds=round(other[4], 3))
            row.setdefault("runs", {})[method] = other
        row["results"]["plain"] = dict(tokens=len(plain[0]), seconds=round(plain[4], 3))
        row["plain"] = plain
        row["inputs"] = inputs
        rows.append(row)
    summary = {m: sum(r["results"][m]["identical"] for r in rows) for m in methods}
    speed = {m: round(sum(r["results"][m]["tokens"] for r in rows) / sum(r["results"][m]["seconds"] for r in rows), 2)
             for m in ("plain",) + tuple(methods)}
    return rows, dict(identical=summary, tokens_per_s=speed)


def timing(target, tokenizer, draft, prompts, max_new_tokens, repeats=2):
    """tokens/s of plain, Jakiro and Jakiro + lookup, each with SDPA as it is and with `rowwise_attention`,
    interleaved per prompt (after one warm-up of each) so that other load on the cores hits all alike."""
    variants = [(m, rowwise) for m in ("plain", "jakiro", "jakiro_lookup") for rowwise in (False, True)
                if not (m == "plain" and rowwise)]
    totals = {f"{m}{' rowwise' if r else ''}": [0, 0.0] for m, r in variants}
    for warm in (True, False):
        for prompt in prompts[:1] if warm else prompts * repeats:
            inputs = encode(tokenizer, prompt)
            for method, rowwise in variants:
                with rowwise_attention() if rowwise else contextlib.nullcontext():
                    ids, *_, seconds = generate(target, inputs, method, draft, 8 if warm else max_new_tokens)
                if not warm:
                    key = f"{method}{' rowwise' if rowwise else ''}"
                    totals[key][0] += len(ids)
                    totals[key][1] += seconds
    return {key: round(tokens / seconds, 2) for key, (tokens, seconds) in totals.items()}


def forward_times(target, tokenizer, nodes=17, repeats=30):
    """Best-of-`repeats` milliseconds of one target forward after the first prompt (43 tokens): a one-token step,
    and a `nodes`-row verify forward (a causal chain mask) with SDPA as it is and with `rowwise_attention`, interleaved.
    The minimum is robust to other load on the cores, which end-to-end tokens/s on a shared machine is not."""
    inputs = encode(tokenizer, DEFAULT_PROMPTS[0])
    with torch.no_grad():
        out = target(input_ids=inputs["input_ids"], use_cache=True)
        cache = out.get("cache", out.get("past_key_values"))
        past = cache.get_seq_length()
        tokens = inputs["input_ids"][0, :nodes]
        positions = torch.arange(past, past + nodes)
        mask = causal_4d(nodes, past, target.dtype)
        best = {"step": [], "verify": [], "verify rowwise": []}
        for _ in range(repeats):
            for name in best:
                c = cropped(cache, past)
                start = time.perf_counter()
                if name == "step":
                    _run(target, c, tokens[:1], positions[:1], torch.ones(1, past + 1, dtype=torch.long))
                else:
                    with rowwise_attention() if name.endswith("rowwise") else contextlib.nullcontext():
                        _run(target, c, tokens, positions, mask)
                best[name].append(time.perf_counter() - start)
    return {name: round(min(times) * 1000, 1) for name, times in best.items()}


def machine():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "?")
    wanted = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16") if f" {f}" in flags]
    return dict(cpu=model, flags=wanted, torch=torch.__version__, threads=torch.get_num_threads(),
                cpu_capability=torch.backends.cpu.get_cpu_capability(), python=platform.python_version())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(DEFAULT_PROMPTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="also the match rates in float32 (must all be identical)")
    parser.add_argument("--patch", action="append", default=[],
                        help="bool_mask, f32_mask, full_logits, rowwise_attention")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--timing", action="store_true",
                        help="only tokens/s with and without rowwise_attention (the first 3 prompts, twice)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = DEFAULT_PROMPTS[: args.num_prompts]
    report = dict(machine=machine(), max_new_tokens=args.max_new_tokens, prompts=list(prompts), patches=args.patch)
    started = time.perf_counter()

    target, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    draft = load_draft(str(find_head()), target)
    if args.timing:
        with torch.no_grad():
            report["forward_ms"] = forward_times(target, tokenizer)
            print(report["forward_ms"])
            report["timing"] = timing(target, tokenizer, draft, prompts[:3], args.max_new_tokens)
        print(report["timing"])
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        return report
    report["micro"] = micro(target)
    print(json.dumps(report["micro"], indent=1))
    undo = [apply_patch(name) for name in args.patch]
    try:
        with torch.no_grad():
            rows, summary = match_rates(target, tokenizer, draft, prompts, args.max_new_tokens)
            report["bf16"] = dict(**summary, per_prompt=[dict(prompt=r["prompt"], **r["results"]) for r in rows])
            print("bf16 identical of", len(rows), summary)
            for r in rows:
                print(" ", r["prompt"], {m: v.get("first_departure") for m, v in r["results"].items() if m != "plain"})
            if not args.no_replay:
                report["departures"] = []
                for r in rows:
                    for method in ("jakiro", "jakiro_lookup"):
                        d = r["results"][method]["first_departure"]
                        if d is None or d >= len(r["runs"][method][0]) or d >= len(r["plain"][0]):
                            continue
                        info = replay(target, tokenizer, r["inputs"], r["plain"], r["runs"][method], d)
                        info.update(prompt=r["prompt"], method=method)
                        report["departures"].append(info)
                        print(json.dumps({k: v for k, v in info.items() if k != "variants"}))
                        for name, v in info.get("variants", {}).items():
                            print(f"    {name:<18} flips={v['flips']!s:<5} logits {v['logits_max_abs']:.4f} "
                                  f"first op {v['first_departing_op']} layers {v['layer_max_abs'][:4]}...")
            if args.fp32:
                del rows
                target32, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.float32)
                draft32 = load_draft(str(find_head()), target32)
                rows32, summary32 = match_rates(target32, tokenizer, draft32, prompts, args.max_new_tokens)
                report["fp32"] = dict(**summary32,
                                      per_prompt=[dict(prompt=r["prompt"], **r["results"]) for r in rows32])
                print("fp32 identical of", len(rows32), summary32)
    finally:
        for u in undo:
            u()
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
