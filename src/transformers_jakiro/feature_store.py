"""The former path of `transformers_jakiro.training.feature_store`: importing it gives that module itself, so that code (and
monkeypatching) written against the old path reaches the one implementation."""

import sys

from .training import feature_store

sys.modules[__name__] = feature_store
