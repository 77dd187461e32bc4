"""Importing the package leaves transformers' own assisted generation and prompt lookup exactly as they were.

`generate` hands `inputs_tensor` (what an encoder-decoder assistant re-encodes) only to a decoding method whose
signature names it; a wrapper of `_assisted_decoding` with a signature of its own made the stock path receive None,
so T5 and Whisper assistants failed and Bart's drafted from a one-token encoder input. The probe runs in a fresh
interpreter, once before and once after the import, on tiny T5, Bart, Whisper and Llama models.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def probe():
    script = Path(__file__).with_name("stock_paths_probe.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


CASES = [f"{model}/{mode}" for model in ("t5", "bart", "whisper", "llama")
         for mode in ("assisted_greedy", "assisted_sample", "prompt_lookup") if (model, mode) != ("whisper", "prompt_lookup")]


@pytest.mark.parametrize("case", CASES)
def test_stock_paths_are_unchanged_by_the_import(probe, case):
    before, after = probe["before"][case], probe["after"][case]
    assert isinstance(before["tokens"], list), before["tokens"]  # the stock path itself works on these models
    assert after == before


@pytest.mark.parametrize("case", [c for c in CASES if not c.endswith("prompt_lookup")])
def test_stock_candidate_generator_receives_the_encoder_input(probe, case):
    received = probe["after"][case]["candidate_generator_inputs"]
    assert received and all(shape is not None for shape in received)
    assert received[0][-1] == (60 if case.startswith("whisper") else 10)  # the whole prompt, not one start token
