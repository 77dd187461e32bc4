"""Jakiro heads in vLLM: `jakiro export --format vllm` and the vLLM plugin.

The export tests run everywhere. The tests marked `vllm` need vLLM's CPU build, which pins its own transformers and
lives in a separate environment: `make test-vllm` creates it and runs them (the third stage of `.ci/run`); under
`make test` they skip. Each starts vLLM engines in a child process (`bench/vllm_engine.run_vllm`), fp32, eager.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transformers_jakiro.cli import main as jakiro_cli
from transformers_jakiro.export import VLLM_ARCHITECTURE, export_vllm

HEAD = Path(__file__).resolve().parents[1] / "heads" / "jakiro-smollm2-135m-instruct"
CHAIN = 3


def _vllm():
    return pytest.importorskip("vllm", reason="vLLM is tested in its own environment: make test-vllm")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    out = tmp_path_factory.mktemp("vllm-head")
    speculative = export_vllm(HEAD, out, num_speculative_tokens=CHAIN)
    return out, speculative


@pytest.fixture(scope="module")
def other_target(tmp_path_factory, smollm2):
    """A random two-layer Llama with SmolLM2's vocabulary and tokenizer but another hidden size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tokenizer = smollm2
    config = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("other-target")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _prompts(tokenizer) -> list[list[int]]:
    from transformers_jakiro.bench.suites import encode, load_suite

    records = [load_suite(suite, 1)[0] for suite in ("mt_bench", "humaneval", "alpaca")]
    return [encode(tokenizer, [{"role": "user", "content": r["turns"][0]}], "cpu")["input_ids"][0].tolist()
            for r in records]


def test_export_writes_the_folder_vllm_loads(exported, smollm2):
    """Config (architecture, aux layer ids in vLLM's numbering, the head's fields), weights under vLLM names with the
    target's final norm, and the speculative config; the CLI writes the same."""
    out, speculative = exported
    model, _ = smollm2
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [VLLM_ARCHITECTURE]
    # decoder layers 2, 15, 27 -> vLLM ids 3, 16, 28, and the last layer's output (id 30) for the final hidden state
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 16, 28, 30]
    assert config["jakiro"]["target"]["num_hidden_layers"] == 30 and config["draft_vocab_size"] == 16384
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.target_norm.weight"], model.model.norm.weight.detach())
    head = load_file(HEAD / "model.safetensors")
    assert torch.equal(weights["d2t"], head["d2t"])  # target ids, as the head stores them (not EAGLE-3's offsets)
    assert torch.equal(weights["model.layers.0.gate.weight"], head["layer.moe.gate.weight"])
    assert {"model.layers.0.experts.1.down_proj.weight", "model.layers.0.gate.weight", "model.fc.bias",
            "model.feature_fusion.weight", "lm_head.weight"} <= set(weights)
    assert json.loads((out / "speculative_config.json").read_text()) == speculative
    assert speculative == {"method": "eagle3", "model": str(out.resolve()), "num_speculative_tokens": CHAIN}


def test_export_cli_and_wrong_target(tmp_path, other_target, capsys):
    """`jakiro export` writes the folder; a target the head was not trained for is refused by name."""
    assert jakiro_cli(["export", str(HEAD), str(tmp_path / "a"), "--format", "vllm"]) == 0
    assert (tmp_path / "a" / "speculative_config.json").is_file()
    assert jakiro_cli(["export", str(HEAD), str(tmp_path / "b"), "--target", str(other_target)]) == 2
    error = capsys.readouterr().err
    assert "was not built for this target" in error and "hidden size: the draft expects 576" in error


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_with_the_exported_head_is_exact_and_accepts_like_ours(exported, smollm2):
    """vLLM with the exported head: the same greedy text as vLLM without a draft (fp32), and a mean acceptance length
    within 10% of transformers-jakiro's on the same prompts with the same chain (3 tokens from the left head)."""
    _vllm()
    from transformers import AutoModel

    from transformers_jakiro import tree_settings
    from transformers_jakiro.bench.vllm_engine import run_vllm
    from transformers_jakiro.targets import plain_directory

    out, speculative = exported
    model, tokenizer = smollm2
    prompts = _prompts(tokenizer)
    target_dir = plain_directory("smollm2-135m-instruct")[0]
    plain = run_vllm(target_dir, prompts, max_tokens=64)
    jakiro = run_vllm(target_dir, prompts, speculative, max_tokens=64)
    assert jakiro["token_ids"] == plain["token_ids"]
    assert jakiro["spec"]["num_drafts"] > 0

    draft = AutoModel.from_pretrained(HEAD, dtype=torch.float32)
    tokens = rounds = 0
    chain = dict(total_tokens=CHAIN, depth=CHAIN, top_k=1, contrastive=False, lookup_tokens=0, adaptive=False)
    for prompt in prompts:
        with tree_settings(draft, **chain):
            model.generate(torch.tensor([prompt]), assistant_model=draft, do_sample=False, max_new_tokens=64)
        tokens += sum(draft.last_generation_stats.accepted_lengths)
        rounds += draft.last_generation_stats.rounds
    ours = tokens / rounds
    assert ours > 1.3  # the head does draft
    assert jakiro["spec"]["mean_acceptance_length"] == pytest.approx(ours, rel=0.10)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_refuses_a_head_exported_for_another_target(exported, other_target):
    """The plugin checks the served target against the one the head was exported for, and says what to do."""
    _vllm()
    from transformers_jakiro.bench.vllm_engine import run_vllm

    _, speculative = exported
    with pytest.raises(RuntimeError, match="This Jakiro head was exported for HuggingFaceTB/SmolLM2-135M-Instruct"):
        run_vllm(other_target, [[1, 2, 3]], speculative, max_tokens=4)
