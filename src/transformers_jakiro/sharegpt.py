"""The former path of `transformers_jakiro.training.sharegpt`: importing it gives that module itself, so that code (and
monkeypatching) written against the old path reaches the one implementation."""

import sys

from .training import sharegpt

sys.modules[__name__] = sharegpt
