"""Randomized differential test: greedy Jakiro decoding against plain `target.generate`, token for token (float32).

A seed draws one configuration from the whole settings space (see `sample_settings`):

  * architecture: the five tiny random-weight targets of `tiny_models` (llama, mistral, qwen2, qwen3, phi3), each
    with the default RoPE or, in about one case in four, a position-dependent one whose boundary lies inside the
    generated span (`tiny_models.rope_shape`: longrope, where Phi-3's generate also recomputes its cache, or dynamic
    NTK); a case whose call the decoding refuses by name there (a static cache at Phi-3's recomputation, or a
    transformers release whose Phi-3 generate drops its cache) must raise that refusal;
  * tree: total_tokens, depth, top_k, the contrastive last level on or off;
  * n-gram lookup: lookup_tokens 0 or > 0, lookup_chains, lookup_max_ngram (with lookup on, the prompt mostly repeats
    itself so that chains are proposed from the first round);
  * target cache: dynamic or `cache_implementation="static"`; fixed_shape: default (None), False or True;
  * logits processors: none, repetition_penalty, no_repeat_ngram_size, min_new_tokens (with an EOS that the target
    emits), bad_words_ids, sequence_bias, suppress_tokens, or a mix (the token ids come from the target's own
    unprocessed continuation, so the processors change the output);
  * left padding: a batch of one with leading pad tokens and zeros in the attention mask, or no mask at all;
  * max_new_tokens from 1 to 40; EOS: the model's default, or one or two tokens the target emits mid-generation so
    that generation stops early (sometimes inside a multi-token accepted path);
  * entry point: `assistant_model=draft` under `tree_settings(...)`, the same with lookup asked for through
    `prompt_lookup_num_tokens`, or `custom_generate=jakiro_generate, draft=draft, total_tokens=...` (lookup_chains and
    lookup_max_ngram, which are not keyword arguments of `jakiro_generate`, go through `tree_settings`);
  * round controller (`adaptive`): the draft config's default (off for `quick_trained_draft`, on for the untrained
    draft), on, or off (the configured tree every round); when on, each round's choice (a plain step, lookup alone, a
    smaller tree, the tree) follows measured timings;
  * draft: the quickly fitted draft of `tiny_models.quick_trained_draft` (accepted several tokens deep), an untrained
    random one, or the fitted one with a pathology patched onto its `compute_logits` (what both the dynamic and the
    static draft paths call): NaN, +inf, -inf or 1e30 written over some rows (whole rows, or a few entries of a row);
    constant logits (every token tied); adversarial: the logits negated, so that the draft's top-k are its own least
    likely tokens (the target's next-token logits are not available to the draft, so "least likely" means the
    draft's: for a fitted draft, tokens the target is also very unlikely to pick).

Whatever the draft proposes, greedy output must equal plain greedy `generate` with the same processors and stopping
rule. With the round controller off and a draft whose proposals do not depend on call shapes (fitted, untrained,
adversarial), a static cache or fixed-shape trees must also leave the trees unchanged: the accepted lengths are
compared with a dynamic, unpadded Jakiro run of the same settings. A failure prints the seed, the settings dict
(prompt and token ids included) and the first differing position, and `JAKIRO_DIFF_SEEDS=<seed>` reruns that case
(exactly so with `adaptive` False; with the controller on, its timing-driven choices may differ from run to run).
Round costs are cached in a temporary $JAKIRO_CACHE for the module, and each case starts without the token priors
the controller keeps on a draft.

Runs:
  * CI (default, part of the suite): `pytest tests/test_differential.py`: a fixed list of seeds (`CI_SEEDS`), one
    test per seed, plus the unconditional reproductions of known defects (marker `known_defect`:
    `pytest -m known_defect` runs only those).
  * Larger run (skipped unless JAKIRO_DIFF_CASES or JAKIRO_DIFF_SEEDS is set):
        JAKIRO_DIFF_CASES=500 .venv/bin/python -m pytest tests/test_differential.py -m slow -s
    runs seeds JAKIRO_DIFF_START (default 1000) to JAKIRO_DIFF_START + JAKIRO_DIFF_CASES - 1 in one test, and
    fails with every failing seed listed (with settings); JAKIRO_DIFF_SEEDS=17,42 reruns chosen seeds instead.
"""

import contextlib
import math
import os
import random
from unittest import mock

import pytest
import torch

from tiny_models import ARCHS, ROPE_KINDS, VOCAB, make_target, quick_trained_draft, random_prompt
from transformers_jakiro import JakiroDraftModel, jakiro_generate, tree_settings
from transformers_jakiro.decoding.rope import rope_limits

CI_SEEDS = list(range(110))

DRAFT_KINDS = ["trained", "untrained", "nan", "posinf", "neginf", "huge", "constant", "adversarial"]
# Draft kinds whose trees do not depend on the shapes the draft is called with: static/fixed-shape runs must accept
# exactly what a dynamic unpadded run accepts. (Value pathologies hit rows by call order; constant logits tie.)
SHAPE_INVARIANT_DRAFTS = {"trained", "untrained", "adversarial"}
VALUES = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf, "huge": 1e30}
PROCESSORS = [
    "none", "repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "bad_words_ids", "sequence_bias",
    "suppress_tokens", "mix",
]


# -- models, built once per module ------------------------------------------------------------------------------------
class Models:
    def __init__(self):
        self.built = {}

    def __call__(self, arch, rope="default"):
        """(target, fitted draft, untrained draft) for an architecture and RoPE kind."""
        if (arch, rope) not in self.built:
            target = make_target(arch, rope=rope)
            trained = quick_trained_draft(target)
            torch.manual_seed(1)
            untrained = JakiroDraftModel.from_target(target).eval()
            self.built[arch, rope] = (target, trained, untrained)
        return self.built[arch, rope]


@pytest.fixture(scope="module")
def models():
    return Models()


@pytest.fixture(scope="module", autouse=True)
def _private_round_costs(tmp_path_factory):
    """The round controller caches measured round costs under $JAKIRO_CACHE: a fresh directory for this module, so
    that the user's cache neither steers these runs nor receives their timings."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAKIRO_CACHE", str(tmp_path_factory.mktemp("jakiro_cache")))
        yield


def forget_rounds(draft) -> None:
    """Drop the tokens-per-round priors the round controller keeps on a draft from its earlier generate calls, so
    that a case does not depend on the cases before it (its round costs still do: they are measured)."""
    vars(draft).pop("_jakiro_round_memory", None)


# -- the settings space -----------------------------------------------------------------------------------------------
def sample_settings(seed: int) -> dict:
    """Everything about a case that does not need the model; token-level details are added by `concrete_case`."""
    rng = random.Random(seed)
    lookup = rng.random() < 0.4
    s = dict(
        seed=seed,
        arch=rng.choice(ARCHS),
        total_tokens=rng.choice([1, 2, 3, 5, 8, 12, 20, 30, 60]),
        depth=rng.randint(1, 7),
        top_k=rng.randint(1, 10),
        contrastive=rng.choice([None, None, False]),
        lookup_tokens=rng.choice([1, 3, 6, 10]) if lookup else 0,
        lookup_chains=rng.choice([1, 1, 2, 3]) if lookup else 1,
        lookup_max_ngram=rng.choice([1, 2, 3, 4]) if lookup else 3,
        repetitive_prompt=rng.random() < (0.8 if lookup else 0.2),
        cache=rng.choice(["dynamic", "static"]),
        fixed_shape=rng.choice([None, None, False, True]),
        processors=rng.choice(PROCESSORS),
        padding=rng.choice([0, 0, 0, 1, 3]),
        max_new_tokens=rng.randint(1, 8) if rng.random() < 0.35 else rng.randint(9, 40),
        eos=rng.choice(["default", "mid", "mid", "two"]),
        entry=rng.choice(["assistant_model", "custom_generate"] + (["prompt_lookup_num_tokens"] if lookup else [])),
        draft=rng.choice(DRAFT_KINDS + ["trained"] * 3),  # the fitted draft most often: deep accepted paths
        rows=rng.choice([0.1, 0.3, 1.0]),  # value pathologies: the share of rows hit
        whole_rows=rng.choice([True, False]),  # value pathologies: a whole row, or ~5% of its entries
        short_prompt=rng.random() < 0.15,  # a prompt of 1 or 2 tokens (the draft's first read is that short)
        adaptive=rng.choice([None, True, False]),  # the round controller (None: the draft config's default)
    )
    s["rope"] = rng.choice(ROPE_KINDS[:1] * 6 + ROPE_KINDS[1:])  # drawn last: earlier seeds keep their other draws
    return s


def make_prompt(g: torch.Generator, repetitive: bool, short: bool = False) -> torch.LongTensor:
    if short:
        return random_prompt(g, 1, 3)
    if not repetitive:
        return random_prompt(g)
    span = random_prompt(g, 4, 12)
    noise = torch.randint(3, VOCAB, (1, 2), generator=g)
    return torch.cat([span, noise, span, span[:, : span.shape[1] // 2]], dim=1)


def concrete_case(s: dict, target) -> dict:
    """Adds the prompt, the EOS ids and the processor arguments, drawn from the target's unprocessed continuation."""
    rng = random.Random(s["seed"] * 7919 + 1)
    g = torch.Generator().manual_seed(s["seed"])
    prompt = make_prompt(g, s["repetitive_prompt"], s["short_prompt"])
    n = s["max_new_tokens"]
    free = target.generate(**inputs_of(prompt.tolist()[0], s["padding"]), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n)[0, s["padding"] + prompt.shape[1] :].tolist()
    emitted = sorted(set(free))

    def token():
        return rng.choice(emitted) if rng.random() < 0.8 else rng.randint(3, VOCAB - 1)

    eos = None
    if s["eos"] == "mid":
        eos = [free[rng.randrange(len(free))]]
    elif s["eos"] == "two":
        eos = [free[rng.randrange(len(free))], token()]
    kinds = s["processors"]
    kinds = ["repetition_penalty", "no_repeat_ngram_size", "sequence_bias", "suppress_tokens", "min_new_tokens"] if (
        kinds == "mix") else [kinds]
    processing = {}
    for kind in kinds:
        if kind == "repetition_penalty":
            processing["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
        elif kind == "no_repeat_ngram_size":
            processing["no_repeat_ngram_size"] = rng.choice([1, 2, 3])
        elif kind == "min_new_tokens":
            processing["min_new_tokens"] = rng.randint(1, n)
            if eos is None:
                eos = [free[rng.randrange(len(free))]]
        elif kind == "bad_words_ids":
            at = rng.randrange(len(free))
            words = [[token()], free[at : at + 2]]
            processing["bad_words_ids"] = [w for w in words if w]
        elif kind == "sequence_bias":
            at = rng.randrange(len(free))
            bias = {(token(),): rng.choice([-10.0, -3.0, 4.0, 8.0])}
            if len(free[at : at + 2]) == 2:
                bias[tuple(free[at : at + 2])] = rng.choice([-10.0, 6.0])
            processing["sequence_bias"] = bias
        elif kind == "suppress_tokens":
            processing["suppress_tokens"] = sorted({token() for _ in range(rng.randint(1, 3))})
    if eos is not None:
        processing["eos_token_id"] = eos
    return {**s, "prompt": prompt.tolist()[0], "processing": processing}


def inputs_of(prompt: list, padding: int) -> dict:
    if not padding:
        return dict(input_ids=torch.tensor([prompt]))
    return dict(
        input_ids=torch.tensor([[0] * padding + prompt]),
        attention_mask=torch.tensor([[0] * padding + [1] * len(prompt)]),
    )


# -- draft pathologies ------------------------------------------------------------------------------------------------
def pathological_logits(kind: str, seed: int, rows: float = 0.3, whole_rows: bool = True):
    """A function of the draft's logits for `kind` (None: leave them alone)."""
    if kind in ("trained", "untrained"):
        return None
    if kind == "constant":
        return torch.zeros_like
    if kind == "adversarial":
        return torch.neg
    value, g = VALUES[kind], torch.Generator().manual_seed(seed)

    def spoil(logits):
        flat = logits.reshape(-1, logits.shape[-1])
        hit = torch.rand(flat.shape[0], generator=g) < rows
        if not hit.any():
            hit[torch.randint(0, flat.shape[0], (1,), generator=g)] = True
        entries = torch.ones_like(flat, dtype=torch.bool) if whole_rows else (
            torch.rand(flat.shape, generator=g) < 0.05)
        return flat.masked_fill(hit[:, None] & entries, value).reshape(logits.shape)

    return spoil


def patched(draft, spoil):
    """Context manager: `draft.compute_logits` followed by `spoil`, on this instance only."""
    if spoil is None:
        return contextlib.nullcontext()
    original = draft.compute_logits
    return mock.patch.object(draft, "compute_logits", lambda features: spoil(original(features)))


# -- running one case -------------------------------------------------------------------------------------------------
def run_jakiro(target, draft, case, cache=None, fixed_shape="case"):
    """Jakiro greedy decoding of `case` (cache/fixed_shape overridable for the tree-invariance reference run)."""
    cache = case["cache"] if cache is None else cache
    fixed_shape = case["fixed_shape"] if fixed_shape == "case" else fixed_shape
    kwargs = dict(do_sample=False, max_new_tokens=case["max_new_tokens"], **case["processing"])
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    tree = dict(total_tokens=case["total_tokens"], depth=case["depth"], top_k=case["top_k"],
                contrastive=case["contrastive"], lookup_tokens=case["lookup_tokens"], fixed_shape=fixed_shape,
                adaptive=case["adaptive"])
    extra = dict(lookup_chains=case["lookup_chains"], lookup_max_ngram=case["lookup_max_ngram"])
    spoil = pathological_logits(case["draft"], case["seed"], case["rows"], case["whole_rows"])
    inputs = inputs_of(case["prompt"], case["padding"])
    with patched(draft, spoil):
        if case["entry"] == "custom_generate":
            with tree_settings(draft, **extra):
                return target.generate(**inputs, custom_generate=jakiro_generate, draft=draft, **tree, **kwargs)
        if case["entry"] == "prompt_lookup_num_tokens":
            lookup = tree.pop("lookup_tokens")
            with tree_settings(draft, **tree, **extra):
                return target.generate(**inputs, assistant_model=draft, prompt_lookup_num_tokens=lookup, **kwargs)
        with tree_settings(draft, **tree, **extra):
            return target.generate(**inputs, assistant_model=draft, **kwargs)


def describe(case) -> str:
    return f"seed={case['seed']} settings={case!r}\n  rerun: JAKIRO_DIFF_SEEDS={case['seed']} " \
           f".venv/bin/python -m pytest tests/test_differential.py -m slow"


def first_difference(got: torch.Tensor, expected: torch.Tensor, start: int) -> str:
    a, b = got[0].tolist(), expected[0].tolist()
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"first difference at new token {at - start} (position {at}): jakiro {a[at:at + 6]} vs plain "
            f"{b[at:at + 6]}; lengths {len(a) - start} vs {len(b) - start} new tokens")


def check_case(seed: int, models) -> str | None:
    """None if the case passes, else a report: the seed, the settings and what differed."""
    s = sample_settings(seed)
    target, trained, untrained = models(s["arch"], s["rope"])
    draft = untrained if s["draft"] == "untrained" else trained
    forget_rounds(draft)
    case = concrete_case(s, target)
    start = case["padding"] + len(case["prompt"])
    inputs = inputs_of(case["prompt"], case["padding"])
    limits = rope_limits(target)
    try:
        if limits is not None:
            limits.refuse_unfollowable(start + case["max_new_tokens"], case["cache"] == "static")
    except ValueError as refusal:  # the decoding must refuse this call by name, before any work
        try:
            run_jakiro(target, draft, case)
        except ValueError as error:
            return None if str(error) == str(refusal) else f"REFUSED otherwise: {error}\n  {describe(case)}"
        return f"NOT REFUSED: expected {refusal}\n  {describe(case)}"
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=case["max_new_tokens"], **case["processing"])
    try:
        got = run_jakiro(target, draft, case)
    except Exception as error:  # noqa: BLE001 - any crash is a failure of the case, reported with its settings
        return f"RAISED {type(error).__name__}: {error}\n  {describe(case)}"
    if not torch.equal(got, expected):
        return f"MISMATCH: {first_difference(got, expected, start)}\n  {describe(case)}"
    stats = draft.last_generation_stats
    # With the round controller on, each round's choice depends on timings: trees are compared only with it off.
    pinned = not (case["adaptive"] if case["adaptive"] is not None else getattr(draft.config, "adaptive", True))
    if pinned and s["draft"] in SHAPE_INVARIANT_DRAFTS and (case["cache"] == "static" or case["fixed_shape"]):
        accepted, lookup_accepted = list(stats.accepted_lengths), stats.lookup_accepted
        reference = run_jakiro(target, draft, case, cache="dynamic", fixed_shape=False)
        ref = draft.last_generation_stats
        assert torch.equal(reference, expected), describe(case)
        if accepted != ref.accepted_lengths or lookup_accepted != ref.lookup_accepted:
            return (f"TREES DIFFER from the dynamic unpadded run (output identical): accepted lengths {accepted} vs "
                    f"{ref.accepted_lengths}, lookup-accepted {lookup_accepted} vs {ref.lookup_accepted}\n  "
                    f"{describe(case)}")
    return None


# -- CI: a fixed seeded subset ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_case(seed, models):
    failure = check_case(seed, models)
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def test_the_ci_subset_covers_the_space():
    """The fixed seeds reach every value of every setting (so a change of the sampler cannot thin the CI run)."""
    cases = [sample_settings(seed) for seed in CI_SEEDS]
    for name, values in [("arch", ARCHS), ("draft", DRAFT_KINDS), ("processors", PROCESSORS), ("rope", ROPE_KINDS),
                         ("cache", ["dynamic", "static"]), ("fixed_shape", [None, False, True]),
                         ("entry", ["assistant_model", "custom_generate", "prompt_lookup_num_tokens"]),
                         ("eos", ["default", "mid", "two"]), ("padding", [0, 1, 3])]:
        assert {c[name] for c in cases} >= set(values), name
    assert any(c["lookup_tokens"] for c in cases) and any(c["max_new_tokens"] == 1 for c in cases)
    assert any(c["short_prompt"] and c["cache"] == "static" and c["draft"] in SHAPE_INVARIANT_DRAFTS
               and c["adaptive"] is False for c in cases)
    assert {c["adaptive"] for c in cases} == {None, True, False}
    assert any(c["cache"] == "static" and c["lookup_tokens"] and c["padding"] for c in cases)
    assert {c["arch"] for c in cases if c["rope"] == "longrope"} >= {"phi3", "llama"}
    assert any(c["rope"] != "default" and c["max_new_tokens"] > 20 and c["adaptive"] is not True for c in cases)


# -- the larger run ---------------------------------------------------------------------------------------------------
def larger_run_seeds() -> list[int]:
    if os.environ.get("JAKIRO_DIFF_SEEDS"):
        return [int(x) for x in os.environ["JAKIRO_DIFF_SEEDS"].replace(" ", "").split(",") if x]
    start = int(os.environ.get("JAKIRO_DIFF_START", "1000"))
    return list(range(start, start + int(os.environ.get("JAKIRO_DIFF_CASES", "0"))))


@pytest.mark.slow
@pytest.mark.skipif(not larger_run_seeds(), reason="set JAKIRO_DIFF_CASES=N (or JAKIRO_DIFF_SEEDS=a,b) to run")
def test_many_random_cases(models):
    torch.set_num_threads(1)  # tiny models: one thread is much faster (the slow marker would hand out every core)
    failures = []
    for seed in larger_run_seeds():
        failure = check_case(seed, models)
        if failure is not None:
            print(failure, flush=True)
            failures.append(failure)
    assert not failures, f"{len(failures)} of {len(larger_run_seeds())} cases failed:\n" + "\n".join(failures)


# -- unconditional reproductions of known defects ---------------------------------------------------------------------
def assert_lossless(target, draft, prompt, spoil=None, entry="assistant_model", lookup_tokens=0, label="", **kwargs):
    inputs = inputs_of(prompt, kwargs.pop("padding", 0))
    expected = target.generate(**inputs, do_sample=False, **kwargs)
    route = dict(assistant_model=draft) if entry == "assistant_model" else dict(
        custom_generate=jakiro_generate, draft=draft)
    pinned = dict(total_tokens=24, depth=4, top_k=6, lookup_tokens=lookup_tokens, adaptive=False)
    with patched(draft, spoil), tree_settings(draft, **pinned):
        got = target.generate(**inputs, do_sample=False, **route, **kwargs)
    assert torch.equal(got, expected), f"{label}: {first_difference(got, expected, inputs['input_ids'].shape[1])}"


REPEATING = [5, 9, 33, 17, 40, 41, 77, 5, 9, 33, 17, 40, 41, 77, 5, 9, 33]


@pytest.mark.known_defect
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("lookup_tokens", [0, 6])
@pytest.mark.parametrize("entry", ["assistant_model", "custom_generate"])
@pytest.mark.parametrize("kind", ["nan", "posinf", "neginf", "huge"])
def test_garbage_draft_logits_keep_greedy_lossless(models, kind, entry, lookup_tokens, cache):
    """Defect: a draft whose logits hold NaN (or +inf, -inf, 1e30) on some rows broke greedy losslessness (NaN
    sorted first among the best candidates; a kept child's parent could be dropped)."""
    target, draft, _ = models("llama")
    g = torch.Generator().manual_seed(4)
    for i in range(4):
        prompt = REPEATING if i % 2 else random_prompt(g).tolist()[0]
        for rows, whole_rows in [(0.1, True), (0.3, False)]:
            spoil = pathological_logits(kind, 10 * i + int(10 * rows), rows, whole_rows)
            assert_lossless(target, draft, prompt, spoil, entry, lookup_tokens, max_new_tokens=30,
                            cache_implementation=cache, label=f"{kind} prompt {prompt} rows {rows} whole {whole_rows}")


@pytest.mark.known_defect
@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("entry", ["assistant_model", "custom_generate"])
def test_repetition_penalty_with_left_padding(models, entry, cache):
    """Defect: repetition_penalty with a left-padded prompt crashed ("Incompatible `prompt_ignore_length` batch
    size")."""
    target, draft, _ = models("llama")
    assert_lossless(target, draft, [44, 45, 46, 47, 44, 45], entry=entry, padding=3, max_new_tokens=25,
                    repetition_penalty=1.5, cache_implementation=cache, label="repetition_penalty, 3 pads")


@pytest.mark.known_defect
@pytest.mark.parametrize("arch", ARCHS)
def test_static_draft_trees_match_dynamic_on_a_one_token_prompt(models, arch):
    """Defect: with a static cache the draft's first read of a one-token prompt attended to no slot at all (an
    unmasked single query over the static cache): output still right, but the trees differed from the dynamic
    draft's, so acceptance did too."""
    target, draft, _ = models(arch)
    for prompt in ([5], [44], [9, 33]):
        lengths = {}
        for cache in (None, "static"):
            with tree_settings(draft, total_tokens=12, depth=3, top_k=3, adaptive=False):
                out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, assistant_model=draft,
                                      cache_implementation=cache)
            assert torch.equal(out, target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30))
            lengths[cache] = draft.last_generation_stats.accepted_lengths
        assert lengths["static"] == lengths[None], f"prompt {prompt}"


# -- generation modes -------------------------------------------------------------------------------------------------
# Every mode of transformers' GenerationMode: decoded by tree decoding, or refused by `jakiro_generate` (the flags that
# select it). A mode added to transformers appears in neither and fails `test_every_generation_mode_is_decided`.
DECODED_MODES = {"greedy_search": {}, "sample": {"do_sample": True}, "assisted_generation": {"prompt_lookup_num_tokens": 3}}
REFUSED_MODES = {
    "beam_search": {"num_beams": 3},
    "beam_sample": {"num_beams": 3, "do_sample": True},
    "group_beam_search": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    "constrained_beam_search": {"num_beams": 3, "force_words_ids": [[5]]},
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "dola_generation": {"dola_layers": "low"},
}


def test_every_generation_mode_is_decided():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import GenerationMode

    assert {mode.value for mode in GenerationMode} == set(DECODED_MODES) | set(REFUSED_MODES)
    for value, flags in {**DECODED_MODES, **REFUSED_MODES}.items():
        assert GenerationConfig(**flags).get_generation_mode().value == value, value


@pytest.mark.parametrize("mode", sorted(REFUSED_MODES))
def test_custom_generate_refuses_modes_it_does_not_implement(models, mode):
    target, trained, _ = models("llama")
    prompt = torch.tensor([[5, 9, 14, 3, 22]])
    with pytest.raises(ValueError, match=f"jakiro_generate implements greedy decoding and sampling only.*{mode}"):
        target.generate(prompt, max_new_tokens=6, custom_generate=jakiro_generate, draft=trained,
                        **REFUSED_MODES[mode])


@pytest.mark.parametrize("mode", ["beam_search", "beam_sample"])
def test_the_assistant_route_keeps_transformers_beam_search(models, mode):
    """With `assistant_model=draft`, generate itself runs beam search (the draft ignored, as for any assistant):
    the same sequences as plain generate."""
    target, trained, _ = models("llama")
    prompt = torch.tensor([[5, 9, 14, 3, 22]])
    flags = dict(REFUSED_MODES[mode], max_new_tokens=8)
    torch.manual_seed(0)
    expected = target.generate(prompt, **flags)
    torch.manual_seed(0)
    got = target.generate(prompt, assistant_model=trained, **flags)
    assert got.shape[0] == 1 and torch.equal(got, expected)
