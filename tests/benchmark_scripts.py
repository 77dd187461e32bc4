"""Loads a script under benchmarks/ as a module, so tests can call its functions (the scripts are not a package)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load_script(relative_path: str, name: str):
    """The module of `benchmarks/<relative_path>`, registered under `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
