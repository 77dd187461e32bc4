"""The `jakiro` command line. Each subcommand lives in the module that implements it; that module exposes
`add_cli(subparsers)` which registers its parser and sets `func` to the function that runs it."""

import argparse
import importlib
import sys

# Modules that contribute a subcommand, in the order `jakiro --help` lists them.
SUBCOMMAND_MODULES = [
    "transformers_jakiro.convert",
    "transformers_jakiro.export",
    "transformers_jakiro.training.distill",
    "transformers_jakiro.training.cli",
    "transformers_jakiro.bench.cli",
    "transformers_jakiro.demo",
    "transformers_jakiro.serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jakiro", description="Jakiro speculative decoding for transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as error:  # user errors: one clear line, no stack trace
        print(f"jakiro {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
