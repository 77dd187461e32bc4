"""The former module of the training code, now the `training` package: its public names and command line, and the
entry point of `python -m transformers_jakiro.train` / `accelerate launch -m transformers_jakiro.train`."""

import sys

from .training import *  # noqa: F403 -- the public names, under their former module
from .training import __all__  # noqa: F401
from .training.cli import add_arguments, add_cli, config_from_args, main, parse_feature_layers, run  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
