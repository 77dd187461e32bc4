"""The former path of `transformers_jakiro.training.distill`: importing it gives that module itself, so that code (and
monkeypatching) written against the old path reaches the one implementation."""

import sys

from .training import distill

sys.modules[__name__] = distill
