"""Cost of one full Jakiro round against one plain decode step, random weights at Llama-2-7B shape, eager and compiled.

Sized for one H200 with no network (random bf16 weights, nothing downloaded; the eager pair takes about 2 minutes
including start-up; the compiled pair adds three inductor compilations: the target's forward at two shapes and the
draft step):

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
                      it: the draft over its own static cache in compiled fixed-shape steps, the tree padded to its
                      fixed size, verified into a StaticCache through the compiled forward, the path moved by index
                      copies.
Context length stays fixed: every timed step is undone before the next one. `--shape tiny --device cpu` runs the
same code on a CPU (used by the test suite, with `--compile-backend eager`: dynamo traces the same full graphs
without inductor's code generation, seconds instead of a minute); `--no-compile` leaves out the compiled pair.
"""

import argparse
import json
import platform
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig, LogitsProcessorList

from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.decoding import _cache_kwarg, verify_tree
from transformers_jakiro.drafting import JakiroCandidateGenerator, TreeSettings, compiled_draft_step
from transformers_jakiro.kv_cache import new_target_cache, truncate
from transformers_jakiro.tree import DraftTree

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
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


@torch.no_grad()
def measure(shape: str, device: str, dtype: torch.dtype, context: int, total_tokens: int, depth: int, top_k: int,
            repeats: int, warmup: int, compiled: bool = True, backend: str = "inductor") -> dict:
    device = torch.device(device)
    torch.manual_seed(0)
    with device:
        target = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype, attn_implementation="sdpa")
    target.eval()
    draft = JakiroDraftModel.from_target(target).eval()
    cache_kwarg = _cache_kwarg(target)
    vocab = target.config.vocab_size
    prompt = torch.randint(3, vocab, (1, context), device=device)

    cache = new_target_cache(target.config)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1, **{cache_kwarg: cache})
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    sequence = torch.cat([prompt, first], dim=1)
    features = out.hidden_states[-1][0]

    def plain_step():
        target(input_ids=first, use_cache=True, logits_to_keep=1, **{cache_kwarg: cache}).logits.argmax(-1).tolist()
        truncate(cache, context)

    settings = TreeSettings(total_tokens=total_tokens, depth=depth, top_k=top_k, contrastive=True)
    candidates = JakiroCandidateGenerator(draft, settings)
    parts = {"draft": [], "verify": []}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # Steady state: the draft cache holds the context; each round extends it by the one newly accepted position
    # (the bonus token of the previous round) before expanding the tree.
    candidates.set_features(features[:-1])
    candidates.get_candidates(sequence[:, :-1])
    stable = candidates.cache.get_seq_length()

    def jakiro_round():
        truncate(candidates.cache, stable)
        candidates.set_features(features[-1:])
        start = time.perf_counter()
        tree = candidates.get_candidates(sequence)
        sync()
        middle = time.perf_counter()
        verified = verify_tree(target, cache, cache_kwarg, tree, sequence, LogitsProcessorList(), do_sample=False)
        candidates.set_features(verified.features)
        sync()
        parts["draft"].append(1000 * (middle - start))
        parts["verify"].append(1000 * (time.perf_counter() - middle))
        truncate(cache, context)  # undo: same context length for the next round

    plain = timed(plain_step, device, repeats, warmup)
    rounds = timed(jakiro_round, device, repeats, warmup)
    median = statistics.median
    if compiled:
        compiled_times = measure_compiled(target, draft, settings, prompt, repeats, warmup, backend)
    result = {
        "shape": shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.platform(),
        "dtype": str(dtype).replace("torch.", ""), "context": context,
        "tree": {"total_tokens": total_tokens, "depth": depth, "top_k": top_k, "levels": depth + 1},
        "plain_step_ms": round(median(plain), 3), "jakiro_round_ms": round(median(rounds), 3),
        "draft_ms": round(median(parts["draft"][warmup:]), 3), "verify_ms": round(median(parts["verify"][warmup:]), 3),
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


def measure_compiled(target, draft, settings: TreeSettings, prompt, repeats: int, warmup: int,
                     backend: str = "inductor") -> dict:
    """Plain step and Jakiro round over StaticCaches through the target's compiled forward (see the module doc)."""
    device = prompt.device
    context = prompt.shape[1]
    cache_kwarg = _cache_kwarg(target)
    config = compile_config(device, backend)
    forward = target.get_compiled_call(config)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    length = context + settings.max_nodes + 8  # both caches alike: one mask width

    # Plain: the prefill eager (as generate does), then one token per step through the compiled forward.
    plain_cache = new_target_cache(target.config, static_length=length)
    out = target(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kwarg: plain_cache})
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    position = torch.tensor([[context]], device=device)

    def plain_step():
        forward(input_ids=first, position_ids=position, use_cache=True, logits_to_keep=1,
                **{cache_kwarg: plain_cache}).logits.argmax(-1).tolist()
        truncate(plain_cache, context)

    start = time.perf_counter()
    plain_step()
    sync()
    plain_compile_s = time.perf_counter() - start
    plain = timed(plain_step, device, repeats, warmup)
    del plain_cache

    cache = new_target_cache(target.config, static_length=length)
    out = target(input_ids=prompt, use_cache=True, output_hidden_states=True, logits_to_keep=1,
                 **{cache_kwarg: cache})
    sequence = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    features = out.hidden_states[-1][0]
    del out
    # The draft as decoding sets it up next to a compiled target: its own static cache, compiled k-row steps.
    candidates = JakiroCandidateGenerator(
        draft, settings, static_length=length + settings.top_k * (settings.depth + 1), step=compiled_draft_step(config)
    )
    candidates.set_features(features[:-1])
    candidates.get_candidates(sequence[:, :-1])
    stable = candidates.cached_length()
    parts = {"draft": [], "verify": []}

    def jakiro_round():
        candidates.rewind(stable)
        candidates.set_features(features[-1:])
        start = time.perf_counter()
        tree: DraftTree = candidates.get_candidates(sequence).padded(settings.max_nodes)
        sync()
        middle = time.perf_counter()
        verified = verify_tree(target, cache, cache_kwarg, tree, sequence, LogitsProcessorList(), False,
                               past=context, forward=forward)
        candidates.set_features(verified.features)
        sync()
        parts["draft"].append(1000 * (middle - start))
        parts["verify"].append(1000 * (time.perf_counter() - middle))
        truncate(cache, context)

    start = time.perf_counter()
    jakiro_round()
    sync()
    round_compile_s = time.perf_counter() - start
    rounds = timed(jakiro_round, device, repeats, warmup)
    return {
        "plain_compiled_step_ms": round(statistics.median(plain), 3),
        "jakiro_compiled_round_ms": round(statistics.median(rounds), 3),
        "draft_compiled_ms": round(statistics.median(parts["draft"][warmup + 1 :]), 3),
        "verify_compiled_ms": round(statistics.median(parts["verify"][warmup + 1 :]), 3),
        "compile_s": {"plain": round(plain_compile_s, 1), "jakiro": round(round_compile_s, 1)},
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
                        help="torch.compile backend of the compiled pair (the CPU test uses 'eager': same code, no codegen)")
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
