"""Cost of one full Jakiro round against one plain decode step, random weights at Llama-2-7B shape, eager and compiled.

Sized for one H200 with no network (random bf16 weights, nothing downloaded; the eager pair takes about 2 minutes
including start-up; the compiled pair adds three inductor compilations: the target's forward for the plain step,
`draft_round` and `verify_round`):

    python benchmarks/gpu/round_cost.py --out benchmarks/results/gpu/round_cost.json

Four timings, each per decode step or round at a fixed context:
  * plain eager:      one token through the target over a DynamicCache (what eager `generate` does per token);
  * plain compiled:   the same over a StaticCache, through the forward transformers compiles for
                      `cache_implementation="static"` (`get_compiled_call`; CUDA graphs with its default
                      `mode="reduce-overhead"`);
  * Jakiro eager:     what `generate(..., assistant_model=draft)` does per iteration: the draft extends its cache
                      with the accepted tokens and expands the tree (get_candidates), the target verifies the flattened
                      tree in one forward, logits are checked, the target cache is compacted to the accepted path and
                      the accepted tokens come back to the host;
  * Jakiro compiled:  the same round as `generate(..., assistant_model=draft, cache_implementation="static")` runs
                      it: `draft_round` (the draft over its own static cache) and `verify_round` (the forward over
                      the padded tree, acceptance, the compaction), each compiled whole: two graph calls.
Context length stays fixed: every timed step is undone before the next one. `--shape tiny --device cpu` runs the
same code on a CPU (used by the test suite, with `--compile-backend eager`: dynamo traces the same full graphs
without inductor's code generation, seconds instead of a minute); `--no-compile` leaves out the compiled pair.

The pieces are separate functions for benchmarks/gpu/check.py, which times them at Llama-3-8B shape (`--shape
llama3-8b` here) for several tree sizes: `build_pair` (random weights created on the device), `measure_plain_eager`,
`measure_round_eager`, `measure_plain_compiled` and `measure_round_compiled` (one static cache length,
`static_cache_length`, shared by the plain step and every tree size).
"""

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig, LogitsProcessorList

from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.decoding.round_controller import batch_tree
from transformers_jakiro.decoding.batch_drafter import BatchDrafter
from transformers_jakiro.decoding.batch_rounds import BatchVerifier
from transformers_jakiro.decoding.row_rounds import verify_tree
from transformers_jakiro.decoding.static_verify import compiled_verify_round, verify_fixed_round
from transformers_jakiro.decoding.target_inputs import cache_kwarg
from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator, TreeSettings, compiled_draft_round
from transformers_jakiro.decoding.kv_cache import new_target_cache, truncate
from transformers_jakiro.decoding.tree import DraftTree

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # Llama-3-8B: grouped-query attention (8 KV heads), a 128256-token vocabulary, untied embeddings.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048),
}


def timed(fn, device, repeats: int, warmup: int) -> list[float]:
    """Milliseconds per call; CUDA work is synchronised before each clock read."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return times


def build_pair(shape: str, device, dtype: torch.dtype, seed: int = 0):
    """A random-weight Llama target of `shape` and a fresh Jakiro head for it, both created directly on `device` in
    `dtype` (an 8B model built on a CPU first would take minutes to initialise and copy)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    with device:
        target = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype, attn_implementation="sdpa")
        draft = JakiroDraftModel.from_target(target.eval()).eval()
    return target, draft


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def random_prompt(target, context: int, batch: int = 1, seed: int = 0) -> torch.LongTensor:
    device = target.get_input_embeddings().weight.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(3, target.config.vocab_size, (batch, context), generator=generator).to(device)


@torch.no_grad()
def measure_plain_eager(target, prompt, repeats: int, warmup: int) -> dict:
    """One token through the target over a DynamicCache at a fixed context (every batch row one token)."""
    cache_arg = cache_kwarg(target)
    context = prompt.shape[1]
    cache = new_target_cache(target.config)
    out = target(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    del out

    def plain_step():
        target(input_ids=first, use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits.argmax(-1).tolist()
        truncate(cache, context)

    times = timed(plain_step, prompt.device, repeats, warmup)
    return {"plain_step_ms": round(statistics.median(times), 3), "batch": prompt.shape[0]}


@torch.no_grad()
def measure_round_eager(target, draft, settings: TreeSettings, prompt, repeats: int, warmup: int) -> dict:
    """What `generate(..., assistant_model=draft)` does per iteration, at a fixed context (see the module doc)."""
    device = prompt.device
    cache_arg = cache_kwarg(target)
    context = prompt.shape[1]
    cache = new_target_cache(target.config)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1, **{cache_arg: cache})
    sequence = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    features = out.hidden_states[-1][0]
    del out
    candidates = JakiroCandidateGenerator(draft, settings)
    parts = {"draft": [], "verify": []}
    sync = _sync(device)

    # Steady state: the draft cache holds the context; each round extends it by the one newly accepted position
    # (the bonus token of the previous round) before expanding the tree.
    candidates.observe(features[:-1], [])
    candidates.get_candidates(sequence[:, :-1])
    stable = candidates.cache.get_seq_length()

    def jakiro_round():
        truncate(candidates.cache, stable)
        candidates.observe(features[-1:], [])
        start = time.perf_counter()
        tree = candidates.get_candidates(sequence)
        sync()
        middle = time.perf_counter()
        verified = verify_tree(target, cache, cache_arg, tree, sequence, LogitsProcessorList(), do_sample=False)
        candidates.observe(verified.features, [])
        sync()
        parts["draft"].append(1000 * (middle - start))
        parts["verify"].append(1000 * (time.perf_counter() - middle))
        truncate(cache, context)  # undo: same context length for the next round

    rounds = timed(jakiro_round, device, repeats, warmup)
    median = statistics.median
    return {
        "tree": {"total_tokens": settings.total_tokens, "depth": settings.depth, "top_k": settings.top_k,
                 "levels": settings.depth + 1},
        "jakiro_round_ms": round(median(rounds), 3),
        "draft_ms": round(median(parts["draft"][warmup:]), 3), "verify_ms": round(median(parts["verify"][warmup:]), 3),
    }


@torch.no_grad()
def measure_batch_round_eager(target, draft, settings: TreeSettings, prompt, repeats: int, warmup: int) -> dict:
    """One round of `generate(**batch, assistant_model=draft)` at a fixed context: every row's tree at the batch's tree
    size (`round_controller.batch_tree`), drafted together (`BatchDrafter`), verified in one forward with the cache compacted
    (`BatchVerifier`), against which `measure_plain_eager` on the same [batch, context] prompt is the plain step."""
    batch, context = prompt.shape
    device = prompt.device
    cache = new_target_cache(target.config)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                 **{cache_kwarg(target): cache})
    first = out.logits[:, -1].argmax(-1)
    features = out.hidden_states[-1]
    del out
    size = batch_tree(settings.total_tokens, settings.depth, settings.top_k, batch)
    tree = dataclasses.replace(settings, total_tokens=size[0], depth=size[1], top_k=size[2])
    drafter = BatchDrafter(draft, tree, batch)
    for row in range(batch):  # steady state: the draft has read the context but its last position
        drafter.observe(row, features[row, :-1], prompt[row, 1:], [])
    drafter.propose(prompt[:, -1])
    for row in range(batch):
        drafter.observe(row, features[row, -1:], first[row : row + 1], [])
    verifier = BatchVerifier(target, cache, torch.ones_like(prompt, dtype=torch.bool))
    states = drafter.snapshot(), verifier.snapshot()
    sequences = [torch.cat([prompt[row], first[row : row + 1]])[None] for row in range(batch)]
    processors = [LogitsProcessorList()] * batch

    def batch_round():
        drafter.restore(states[0])
        verifier.restore(states[1])
        trees, _ = drafter.propose(first)
        verifier.verify(trees, sequences, processors, do_sample=False)

    times = timed(batch_round, device, repeats, warmup)
    return {"batch": batch, "tree_per_row": "/".join(map(str, size)),
            "jakiro_round_ms": round(statistics.median(times), 3)}


@torch.no_grad()
def measure(shape: str, device: str, dtype: torch.dtype, context: int, total_tokens: int, depth: int, top_k: int,
            repeats: int, warmup: int, compiled: bool = True, backend: str = "inductor") -> dict:
    device = torch.device(device)
    target, draft = build_pair(shape, device, dtype)
    prompt = random_prompt(target, context)
    settings = TreeSettings(total_tokens=total_tokens, depth=depth, top_k=top_k, contrastive=True)
    plain = measure_plain_eager(target, prompt, repeats, warmup)
    rounds = measure_round_eager(target, draft, settings, prompt, repeats, warmup)
    if compiled:
        compiled_times = measure_compiled(target, draft, settings, prompt, repeats, warmup, backend)
    result = {
        "shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.platform(),
        "dtype": str(dtype).replace("torch.", ""), "context": context, "tree": rounds["tree"],
        "plain_step_ms": plain["plain_step_ms"], "jakiro_round_ms": rounds["jakiro_round_ms"],
        "draft_ms": rounds["draft_ms"], "verify_ms": rounds["verify_ms"],
        "repeats": repeats, "torch": torch.__version__, "transformers": transformers.__version__,
    }
    result["round_over_plain"] = round(result["jakiro_round_ms"] / result["plain_step_ms"], 3)
    if compiled:
        result.update(compiled_times)
        result["compiled_round_over_compiled_plain"] = round(
            result["jakiro_compiled_round_ms"] / result["plain_compiled_step_ms"], 3
        )
    return result


def compile_config(device: torch.device, backend: str = "inductor") -> CompileConfig:
    """transformers' default for static-cache generation on an accelerator; on a CPU (tests) inductor without CUDA
    graphs, enabled the way transformers allows it there. `dynamic=False`: the plain step (1 token) and the verify
    (the padded tree) get one static graph each, instead of a second compile that would make the length symbolic."""
    if device.type == "cuda":
        return CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default", backend=backend)
    config._compile_all_devices = True
    return config


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def static_cache_length(context: int, settings: list[TreeSettings]) -> int:
    """One static length for the plain cache and every tree's cache: one mask width, so the plain step compiles once
    and each tree size adds only its own verify graph."""
    return context + max(s.max_nodes for s in settings) + 8


@torch.no_grad()
def measure_plain_compiled(target, prompt, forward, length: int, repeats: int, warmup: int) -> dict:
    """Plain: the prefill eager (as generate does), then one token per step through the compiled forward."""
    device = prompt.device
    context = prompt.shape[1]
    cache_arg = cache_kwarg(target)
    sync = _sync(device)
    plain_cache = new_target_cache(target.config, static_length=length)
    out = target(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_arg: plain_cache})
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    del out
    position = torch.full((prompt.shape[0], 1), context, device=device)

    def plain_step():
        forward(input_ids=first, position_ids=position, use_cache=True, logits_to_keep=1,
                **{cache_arg: plain_cache}).logits.argmax(-1).tolist()
        truncate(plain_cache, context)

    graphs = _graphs()
    start = time.perf_counter()
    plain_step()
    sync()
    compile_s = time.perf_counter() - start
    compiled = _graphs()
    plain = timed(plain_step, device, repeats, warmup)
    return {"plain_compiled_step_ms": round(statistics.median(plain), 3), "compile_s": round(compile_s, 1),
            "graphs_compiled": compiled - graphs, "graphs_while_timing": _graphs() - compiled}


@torch.no_grad()
def measure_round_compiled(target, draft, settings: TreeSettings, prompt, config: CompileConfig, length: int,
                           repeats: int, warmup: int) -> dict:
    """The Jakiro round as `generate(..., assistant_model=draft, cache_implementation="static", compile_config=...)`
    runs it: `draft_round` and `verify_round`, each compiled whole (two graph calls, one host read)."""
    device = prompt.device
    context = prompt.shape[1]
    cache_arg = cache_kwarg(target)
    sync = _sync(device)
    cache = new_target_cache(target.config, static_length=length)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                 **{cache_arg: cache})
    sequence = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    features = out.hidden_states[-1][0]
    del out
    # The draft as decoding sets it up next to a compiled target: its own static cache, its compiled round.
    extra = settings.top_k * settings.depth + settings.max_levels + 1
    candidates = JakiroCandidateGenerator(
        draft, settings, static_length=length + extra, round_fn=compiled_draft_round(config)
    )
    candidates.observe(features[:-1], [])
    candidates.get_candidates(sequence[:, :-1])
    stable = candidates.cached_length()
    verify = compiled_verify_round(config)
    no_padding = torch.zeros((), dtype=torch.long, device=device)
    parts = {"draft": [], "verify": []}

    def jakiro_round():
        candidates.rewind(stable)
        candidates.observe(features[-1:], [])
        start = time.perf_counter()
        tree: DraftTree = candidates.get_candidates(sequence).padded(settings.max_nodes)
        sync()
        middle = time.perf_counter()
        verified = verify_fixed_round(verify, target, cache, cache_arg, tree, no_padding, LogitsProcessorList(),
                                      False, levels=settings.max_levels)
        candidates.observe(verified.features, [])
        sync()
        parts["draft"].append(1000 * (middle - start))
        parts["verify"].append(1000 * (time.perf_counter() - middle))
        truncate(cache, context)

    graphs = _graphs()
    start = time.perf_counter()
    jakiro_round()
    sync()
    compile_s = time.perf_counter() - start
    compiled = _graphs()
    rounds = timed(jakiro_round, device, repeats, warmup)
    return {
        "jakiro_compiled_round_ms": round(statistics.median(rounds), 3),
        "graphs_compiled": compiled - graphs,
        "graphs_while_timing": _graphs() - compiled,  # recompilations: 0 expected
        "draft_compiled_ms": round(statistics.median(parts["draft"][warmup + 1 :]), 3),
        "verify_compiled_ms": round(statistics.median(parts["verify"][warmup + 1 :]), 3),
        "compile_s": round(compile_s, 1),
        "verified_nodes": settings.max_nodes,
    }


def measure_compiled(target, draft, settings: TreeSettings, prompt, repeats: int, warmup: int,
                     backend: str = "inductor") -> dict:
    """Plain step and Jakiro round over StaticCaches through the target's compiled forward (see the module doc)."""
    config = compile_config(prompt.device, backend)
    forward = target.get_compiled_call(config)
    length = static_cache_length(prompt.shape[1], [settings])  # both caches alike: one mask width
    plain = measure_plain_compiled(target, prompt, forward, length, repeats, warmup)
    rounds = measure_round_compiled(target, draft, settings, prompt, config, length, repeats, warmup)
    return {
        "plain_compiled_step_ms": plain["plain_compiled_step_ms"],
        "jakiro_compiled_round_ms": rounds["jakiro_compiled_round_ms"],
        "draft_compiled_ms": rounds["draft_compiled_ms"],
        "verify_compiled_ms": rounds["verify_compiled_ms"],
        "compile_s": {"plain": plain["compile_s"], "jakiro": rounds["compile_s"]},
        "static_cache_length": length,
        "compile_backend": backend,
        "verified_nodes": settings.max_nodes,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama2-7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--total-tokens", type=int, default=60)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="time the eager pair only")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled pair (the CPU test uses 'eager': same code, "
                        "no codegen)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = measure(args.shape, args.device, getattr(torch, args.dtype), args.context, args.total_tokens,
                     args.depth, args.top_k, args.repeats, args.warmup, compiled=not args.no_compile,
                     backend=args.compile_backend)
    result["wall_s"] = round(time.perf_counter() - started, 1)  # model creation and compilations included
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
