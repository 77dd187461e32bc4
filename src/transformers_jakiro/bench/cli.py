"""`jakiro bench`: the command line of the benchmark (the protocol is described in the package docstring)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..targets import load_target_or_explain
from .measure import LOOKUP_TOKENS, METHODS
from .report import markdown_table, update_head
from .run import run_benchmark
from .suites import DEFAULT_DATA_DIR, SUITES


def load_draft(spec: str, target):
    """`random`: a fresh untrained head for `target`; otherwise a saved head directory (safetensors)."""
    from ..modeling_jakiro import JakiroDraftModel

    if spec == "random":
        torch.manual_seed(0)
        draft = JakiroDraftModel.from_target(target)
    else:
        if not Path(spec).is_dir():
            raise FileNotFoundError(f"draft directory not found: {spec} (or pass --draft random for an untrained head)")
        weight = target.get_output_embeddings().weight
        draft = JakiroDraftModel.from_pretrained(spec).to(device=weight.device, dtype=weight.dtype)
    return draft.bind_target(target).eval()


def _tree_option(tree: str | None, lookup_tokens: int | None, lookup_chains: int | None = None) -> dict:
    """`--tree 8/2/6` (total_tokens/depth/top_k), `--lookup-tokens N` and `--lookup-chains C` as tree setting
    overrides."""
    overrides = {"lookup_tokens": lookup_tokens, "lookup_chains": lookup_chains}
    if tree:
        parts = tree.split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"bench: --tree takes TOTAL_TOKENS/DEPTH/TOP_K, e.g. 8/2/6; got {tree!r}")
        overrides.update(zip(("total_tokens", "depth", "top_k"), map(int, parts)))
    return overrides


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="registry name, .gguf file, local model dir or Hub id")
    parser.add_argument("--draft", default=None, help="Jakiro head directory, or 'random' (untrained head)")
    parser.add_argument("--assistant", default=None, help="smaller same-tokenizer LM for the 'assisted' method")
    parser.add_argument("--suite", default=",".join(SUITES), help="comma-separated: mt_bench,humaneval,alpaca")
    parser.add_argument("--data-dir", default=None, help=f"directory of <suite>.jsonl (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each suite (default all)")
    parser.add_argument("--spread-categories", action="store_true",
                        help="with --num-prompts: take prompts round-robin over each suite's categories")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} "
                        "(default: all whose models are given)")
    parser.add_argument("--tune", action="store_true", help="tune total_tokens/depth for this machine first")
    parser.add_argument("--tree", default=None, metavar="TOTAL/DEPTH/TOPK",
                        help="tree settings for this run instead of the head's (ignored with --tune), e.g. 8/2/6")
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="n-gram lookup chain budget of the jakiro_lookup method (default: tuned, the head's, or "
                             f"{LOOKUP_TOKENS})")
    parser.add_argument("--lookup-chains", type=int, default=None,
                        help="distinct n-gram lookup chains per round for jakiro_lookup (default: the head's)")
    parser.add_argument("--out", default=None, help="directory for results.json, results.md, speedup.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="time every generation this many times (methods rotated, same seed) and keep the median")
    parser.add_argument("--batch-sizes", default=None, metavar="1,2,4,8",
                        help="batch throughput instead: plain batched generate, jakiro and jakiro_lookup at each batch "
                             "size on the suites' first turns (--temperature: the first value)")
    parser.add_argument("--cache", default=None, choices=["dynamic", "static"],
                        help="with --batch-sizes: the cache every method's generate builds (default: generate's own)")
    parser.add_argument("--update-head", action="store_true", help="write the results into the --draft directory: "
                        "tuned tree settings into config.json (with --tune), headline numbers into the model card")


def run_batches(args, target, tokenizer) -> int:
    from .batches import batch_table, run_batch_benchmark, write_batch_outputs

    if not args.draft:
        raise SystemExit("bench: --batch-sizes needs --draft")
    draft = load_draft(args.draft, target)
    result = run_batch_benchmark(
        target, tokenizer, draft, batch_sizes=[int(b) for b in _csv(args.batch_sizes)], suites=_csv(args.suite),
        num_prompts=args.num_prompts, data_dir=args.data_dir, temperature=float(_csv(args.temperature)[0]),
        max_new_tokens=args.max_new_tokens, lookup_tokens=args.lookup_tokens, seed=args.seed,
        labels={"target": args.target, "draft": args.draft, **({"cache": args.cache} if args.cache else {})},
        cache_implementation=args.cache,
    )
    print()
    print(batch_table(result))
    if args.out:
        print(f"bench: wrote {', '.join(v for v in write_batch_outputs(result, args.out).values() if v)}")
    return 0


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, tokenizer = load_target_or_explain(args.target, args.dtype)
    target.to(device)
    if args.batch_sizes:
        return run_batches(args, target, tokenizer)
    methods = _csv(args.methods) if args.methods else None
    draft = load_draft(args.draft, target) if args.draft else None
    assistant = None
    if args.assistant and (methods is None or "assisted" in methods):
        assistant, _ = load_target_or_explain(args.assistant, args.dtype)
        assistant.to(device)
    labels = {"target": args.target, "draft": args.draft + (" (UNTRAINED)" if args.draft == "random" else "")
              if args.draft else None, "assistant": args.assistant}
    result = run_benchmark(
        target, tokenizer, draft, assistant=assistant, suites=_csv(args.suite), data_dir=args.data_dir,
        num_prompts=args.num_prompts, spread_categories=args.spread_categories,
        temperatures=[float(t) for t in _csv(args.temperature)], methods=methods,
        max_new_tokens=args.max_new_tokens, tune_settings=args.tune, out_dir=args.out, labels=labels, seed=args.seed,
        repeats=args.repeats, tree_overrides=_tree_option(args.tree, args.lookup_tokens, args.lookup_chains),
    )
    print()
    print(markdown_table(result))
    if args.update_head:
        if not args.draft or not Path(args.draft).is_dir():
            raise SystemExit("bench: --update-head needs --draft DIR, a saved head")
        update_head(args.draft, result)
        print(f"bench: updated {args.draft} (config.json tree settings, README.md model card)")
    if args.out:
        print(f"bench: wrote {', '.join(v for v in result['files'].values() if v)}")
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark Jakiro against plain and stock speculative decoding")
    add_arguments(parser)
    parser.set_defaults(func=run)


__all__ = ["add_arguments", "add_cli", "load_draft", "run"]
