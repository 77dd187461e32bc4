"""What one Jakiro round costs against one plain decoding step, counted and timed on the same target:

  * host syncs: every op that makes the host wait for the device or feeds it host data, counted by a torch dispatch
    mode (`HostSyncCounter`): reading a value (`item`, `int()`, `bool()`, indexing with a 0-dim tensor), ops whose
    output size depends on data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`), Python data turned into
    a tensor (`torch.tensor(list)`, a Python scalar written into a tensor: a blocking host-to-device copy on an
    accelerator), plus `tolist` / `numpy` / `cpu`, which the dispatcher does not see on a CPU;
  * eager ops: every aten op dispatched in Python-visible eager mode (a compiled graph's inside is one call);
  * model calls: forwards of the target and of the draft head (the graph calls when both are compiled);
  * time: median wall time per round and per plain step, and their ratio.

Per-round numbers are differences between two generations (N and 1 new tokens), so the prefill drops out:

    python benchmarks/round_cost.py                                      # tiny Llama (hidden 64), tree 60/5/10
    python benchmarks/round_cost.py --layers 32                          # per-layer work shows up
    python benchmarks/round_cost.py --target smollm2-135m-instruct --draft heads/jakiro-smollm2-135m-instruct
    python benchmarks/round_cost.py --compiled                           # static cache, inductor on the CPU
    python benchmarks/round_cost.py --compiled --cache-room 0            # no static-cache width past the need

With `--compiled` the times are compiled ones; the counts come from a run in which every function that decoding
compiles runs as one opaque call outside the dispatch mode (compiled code under a dispatch mode or hooks would
recompile): its eager ops are the ones outside the graphs, and each such call is one graph call. The tree is pinned (`adaptive=False`) and greedy; `--lookup N` grafts lookup chains too. Counted is the accelerator's
path (the target's forward returns every node's logits); `--cpu-leaf-logits` keeps the CPU's lazy leaf logits.
"""

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose output size depends on the data: the host must read it before it can go on.
_DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "nonzero_static"}


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs (by kind) and every eager aten op while active. `tolist`, `numpy` and `cpu` read a CPU
    tensor without a dispatched op, so they are counted by patching `torch.Tensor` for the duration."""

    _READS = ("tolist", "numpy", "cpu")

    def __init__(self):
        super().__init__()
        self.syncs = Counter()
        self.ops = 0
        self._patched = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs["read a value (item/int/bool/0-dim index)"] += 1
        elif name in _DATA_DEPENDENT:
            self.syncs[f"data-dependent shape ({name})"] += 1
        elif name in ("index", "index_put_", "index_put") and _has_bool_index(args):
            self.syncs["boolean-mask indexing"] += 1
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self.syncs["host data into a tensor (torch.tensor, scalar write)"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for method in self._READS:
            original = getattr(torch.Tensor, method)
            self._patched.append((method, original))
            setattr(torch.Tensor, method, self._counting(original, f"copy to the host ({method})"))
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched:
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _counting(self, original, kind):
        counter = self

        def counted(*args, **kwargs):
            counter.syncs[kind] += 1
            return original(*args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.syncs.values())


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


@contextlib.contextmanager
def counting_calls(*modules):
    """Counts forward calls of each module (pre-hooks): [calls of modules[0], calls of modules[1], ...]."""
    counts = [0] * len(modules)
    handles = []
    for i, module in enumerate(modules):
        def hook(*_, i=i):
            counts[i] += 1
        handles.append(module.register_forward_pre_hook(hook))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


# Modules of the decoding subpackage under their names in trees from before it (`transformers_jakiro.drafting`)
_OLD_NAMES = {"drafter": "drafting"}


def decoding_loop():
    """The module that looks up one row's round functions (`lazy_leaf_head`, the compiled rounds):
    `transformers_jakiro.decoding.row_rounds`; in older trees `transformers_jakiro.decoding.loop`, or before the
    `decoding/` subpackage `transformers_jakiro.decoding` (before/after runs import an older tree by PYTHONPATH)."""
    import importlib
    import importlib.util

    module = importlib.import_module("transformers_jakiro.decoding")
    if not hasattr(module, "__path__"):
        return module
    name = "row_rounds" if importlib.util.find_spec("transformers_jakiro.decoding.row_rounds") else "loop"
    return importlib.import_module(f"transformers_jakiro.decoding.{name}")


@contextlib.contextmanager
def opaque_graphs(graph_calls: list, target):
    """Counting a compiled run: the functions that decoding compiles (`draft_round`, `verify_round`, the target's
    forward) run eagerly as opaque calls, outside the dispatch mode, each adding one to `graph_calls[0]`; the
    ops counted are then the ones a compiled run dispatches outside its graphs. (Compiled code itself cannot run
    under a dispatch mode or hooks without recompiling.)"""
    import importlib

    from torch.utils._python_dispatch import _disable_current_modes

    decoding = decoding_loop()

    def opaque(fn):
        def call(*args, **kwargs):
            graph_calls[0] += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return call

    # each compiled function decoding looks up, and the eager function it compiles (older trees: a draft step)
    compiled = {"compiled_draft_round": ("drafter", "draft_round"), "compiled_draft_step": ("drafter", "draft_step"),
                "compiled_verify_round": ("static_verify", "verify_round")}
    saved = {name: getattr(decoding, name) for name in compiled if hasattr(decoding, name)}
    target.get_compiled_call = lambda config: opaque(target.__call__)  # generate's own steps, verify_tree's forward
    for name in saved:
        module, function = compiled[name]
        if decoding.__name__ == "transformers_jakiro.decoding":  # a tree from before the subpackage
            module = _OLD_NAMES.get(module, module)
        eager = getattr(importlib.import_module(f"{decoding.__package__}.{module}"), function)
        setattr(decoding, name, lambda config, eager=eager: opaque(eager))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(decoding, name, value)
        del target.get_compiled_call


def _tiny_target(layers: int, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def load(args):
    from transformers_jakiro import JakiroDraftModel

    dtype = getattr(torch, args.dtype)
    if args.target == "tiny-llama":
        target = _tiny_target(args.layers, dtype)
        prompt = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    else:
        from transformers_jakiro.targets import load_target

        target, tokenizer = load_target(args.target, dtype=dtype)
        messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    if args.draft == "random":
        torch.manual_seed(1)
        draft = JakiroDraftModel.from_target(target).eval().to(dtype)
    else:
        from transformers import AutoModel

        draft = AutoModel.from_pretrained(args.draft, dtype=dtype).eval()
    return target, draft, prompt


def generation_kwargs(args, draft):
    from transformers import CompileConfig

    kwargs = dict(do_sample=False, eos_token_id=None)
    if args.compiled:
        config = CompileConfig(fullgraph=False, mode="default")
        config._compile_all_devices = True  # transformers' switch for compiling on a CPU
        kwargs.update(cache_implementation="static", compile_config=config,
                      max_cache_len=args.new_tokens + args.cache_room)
    return kwargs


def measure(target, draft, prompt, args, jakiro: bool) -> dict:
    """Per-step (plain) or per-round (Jakiro) counts and median time, from the difference between a generation of
    `args.new_tokens` and one of 1 new token (the prefill and the first token)."""
    from transformers_jakiro import tree_settings

    kwargs = generation_kwargs(args, draft)
    if jakiro:
        kwargs["assistant_model"] = draft
    settings = dict(total_tokens=args.tree[0], depth=args.tree[1], top_k=args.tree[2], adaptive=False,
                    lookup_tokens=args.lookup)
    context = (lambda: tree_settings(draft, **settings)) if jakiro else contextlib.nullcontext

    def run(new_tokens, count: bool):
        # Counting (the dispatch mode, forward hooks) only in untimed runs: both change what a compiled call runs.
        counter = HostSyncCounter() if count else contextlib.nullcontext()
        calls_context = counting_calls(target, draft) if count else contextlib.nullcontext([0, 0])
        with context(), torch.no_grad(), calls_context as calls, counter:
            tic = time.perf_counter()
            # an explicit mask: a chat prompt may hold the pad token, which generate would otherwise mask out
            target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, **kwargs)
            seconds = time.perf_counter() - tic
        rounds = draft.last_generation_stats.rounds if jakiro else new_tokens
        return seconds, rounds, (counter if count else None), list(calls)

    for _ in range(args.warmup):
        run(args.new_tokens, False)
    times = []
    for _ in range(args.repeats):
        long_s, long_rounds, _, _ = run(args.new_tokens, False)
        short_s, short_rounds, _, _ = run(1, False)
        times.append((long_s - short_s) / max(long_rounds - short_rounds, 1))
    graph_calls = [0]
    with contextlib.ExitStack() as stack:
        if args.compiled:  # counted with each compiled function run as one opaque call (see `opaque_graphs`)
            stack.enter_context(opaque_graphs(graph_calls, target))
        _, long_rounds, long_count, long_calls = run(args.new_tokens, True)
        long_graphs = graph_calls[0]
        _, short_rounds, short_count, short_calls = run(1, True)
        short_graphs = graph_calls[0] - long_graphs
    rounds = max(long_rounds - short_rounds, 1)
    syncs = {kind: (long_count.syncs[kind] - short_count.syncs[kind]) / rounds for kind in long_count.syncs}
    new_tokens = (args.new_tokens - 1) / rounds
    return dict(
        seconds=statistics.median(times),
        syncs=sum(syncs.values()),
        sync_kinds={kind: value for kind, value in syncs.items() if value},
        ops=(long_count.ops - short_count.ops) / rounds,
        target_calls=(long_calls[0] - short_calls[0]) / rounds,
        draft_calls=(long_calls[1] - short_calls[1]) / rounds,
        graph_calls=(long_graphs - short_graphs) / rounds if args.compiled else None,
        tokens=new_tokens,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny-llama", help="tiny-llama, or a registry name / path for load_target")
    parser.add_argument("--draft", default="random", help="a head directory, or random")
    parser.add_argument("--layers", type=int, default=2, help="tiny-llama's layers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tree", default="60/5/10", help="total_tokens/depth/top_k")
    parser.add_argument("--lookup", type=int, default=0, help="lookup_tokens (0: off)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="static cache, compiled by inductor on the CPU")
    parser.add_argument("--cache-room", type=int, default=512,
                        help="with --compiled: the static cache holds new tokens + this many positions (at least the "
                             "prompt, the new tokens and a tree, which the decoding loop ensures)")
    parser.add_argument("--cpu-leaf-logits", action="store_true",
                        help="keep the CPU path's lazy leaf logits (default: the accelerator path, full logits)")
    args = parser.parse_args(argv)
    args.tree = tuple(int(x) for x in args.tree.split("/"))
    torch.set_num_threads(args.threads)
    decoding = decoding_loop()
    lazy_leaf_head = decoding.lazy_leaf_head
    if not args.cpu_leaf_logits:  # count what runs on an accelerator, where leaf logits come from the forward
        decoding.lazy_leaf_head = lambda *_: None
    try:
        target, draft, prompt = load(args)
        step = measure(target, draft, prompt, args, jakiro=False)
        round_ = measure(target, draft, prompt, args, jakiro=True)
    finally:
        decoding.lazy_leaf_head = lazy_leaf_head
    label = f"{args.target} ({args.layers} layers)" if args.target == "tiny-llama" else args.target
    print(f"## Round cost: {label}, {args.dtype}, tree {'/'.join(map(str, args.tree))}"
          f"{f' + lookup {args.lookup}' if args.lookup else ''}, {'compiled, static cache' if args.compiled else 'eager'}"
          f", {args.threads} thread(s), torch {torch.__version__}\n")
    ops = "eager ops outside graphs | graph calls" if args.compiled else "eager ops"
    print(f"| per | host syncs | {ops} | target calls | draft calls | ms | new tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.compiled else ""))
    for name, row in (("plain step", step), ("Jakiro round", round_)):
        graphs = f" | {row['graph_calls']:.1f}" if args.compiled else ""
        print(f"| {name} | {row['syncs']:.1f} | {row['ops']:.0f}{graphs} | {row['target_calls']:.1f}"
              f" | {row['draft_calls']:.1f} | {1000 * row['seconds']:.2f} | {row['tokens']:.2f} |")
    print(f"\nround / step: {round_['seconds'] / step['seconds']:.2f}x time, {round_['ops'] / step['ops']:.1f}x ops")
    print("host syncs per round by kind:", ", ".join(f"{k}: {v:.1f}" for k, v in round_["sync_kinds"].items()))
    return step, round_


if __name__ == "__main__":
    main()
