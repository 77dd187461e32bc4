"""Model card and Hub upload, with the Hub client stubbed at its network boundary (create_repo, create_commit and
the README download)."""

from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import ModelCard
from huggingface_hub.errors import EntryNotFoundError

import transformers_jakiro
from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.hub import TEMPLATE_PATH, build_model_card

ROOT = Path(__file__).resolve().parents[1]
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
USAGE = (
    "import transformers_jakiro\n"
    'draft = AutoModel.from_pretrained("{repo}")\n'
    "outputs = target.generate(**inputs, assistant_model=draft)\n"
)


@pytest.fixture
def draft(tiny_llama):
    return JakiroDraftModel.from_target(tiny_llama, target_name_or_path=TARGET)


def test_template_shipped_in_package_and_identical_to_model_cards_copy():
    assert TEMPLATE_PATH.parent.parent == Path(transformers_jakiro.__file__).parent
    assert TEMPLATE_PATH.read_bytes() == (ROOT / "model_cards" / "jakiro_draft.md").read_bytes()
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package_dir = TEMPLATE_PATH.parent.parent
    assert any(TEMPLATE_PATH in package_dir.glob(pattern) for pattern in package_data["transformers_jakiro"])


def test_card_metadata_and_usage(draft):
    card = build_model_card(draft, repo_id="me/jakiro-draft", license="apache-2.0")
    assert card.data.base_model == TARGET
    assert card.data.library_name == "transformers" and card.data.license == "apache-2.0"
    assert card.data.tags == ["speculative-decoding", "jakiro", "eagle"]
    assert USAGE.format(repo="me/jakiro-draft") in card.text
    assert f"Jakiro draft head for {TARGET}" in card.text
    assert "| experts | 2 (both active per token) |" in card.text
    assert "total_tokens=60, depth=5, top_k=10" in card.text
    assert "Not measured" in card.text and "Not documented" in card.text


def test_card_with_training_and_metrics(draft):
    card = build_model_card(
        draft,
        training_summary={"data": "ShareGPT, 68k conversations", "epochs": 20},
        metrics={"tau": 3.456, "speedup": 1.9, "benchmark": "MT-bench"},
    )
    assert "- data: ShareGPT, 68k conversations" in card.text and "- epochs: 20" in card.text
    assert "| acceptance length tau (tokens per target forward) | 3.46 |" in card.text
    assert "| speedup over plain decoding | 1.90x |" in card.text and "| benchmark | MT-bench |" in card.text
    assert "Not measured" not in card.text and "Not documented" not in card.text


def test_card_without_hub_target(tiny_llama):
    draft = JakiroDraftModel.from_target(tiny_llama, target_name_or_path="/local/models/smollm")
    card = build_model_card(draft)
    assert card.data.base_model is None  # a local path is not valid `base_model` metadata
    assert USAGE.format(repo="path/to/this/draft") in card.text


def test_save_pretrained_writes_card_unless_present_or_disabled(draft, tmp_path):
    draft.save_pretrained(tmp_path / "a")
    assert ModelCard.load(tmp_path / "a" / "README.md").data.base_model == TARGET
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "README.md").write_text("my own card")
    draft.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "README.md").read_text() == "my own card"
    draft.save_pretrained(tmp_path / "c", write_model_card=False)
    assert not (tmp_path / "c" / "README.md").exists()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Stubs the Hub at its network boundary and records what would be uploaded."""
    calls = SimpleNamespace(repo=None, files={}, remote_card=None, commit=None)

    def create_repo(self, repo_id, **kwargs):
        calls.repo = repo_id
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        calls.commit = dict(kwargs, repo_id=repo_id)
        for op in operations:  # the temporary folder is gone after the call: read the files now
            source = op.path_or_fileobj
            calls.files[op.path_in_repo] = Path(source).read_bytes() if isinstance(source, str) else source.read()
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    def hf_hub_download(repo_id, filename, **kwargs):  # ModelCard.load fetches the repo's README through this
        if calls.remote_card is None:
            raise EntryNotFoundError(f"{filename} not found in {repo_id}")
        path = tmp_path / "remote_README.md"
        path.write_text(calls.remote_card)
        return str(path)

    def no_network(*args, **kwargs):
        raise AssertionError("unexpected Hub call")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", no_network)
    monkeypatch.setattr(huggingface_hub.repocard, "hf_hub_download", hf_hub_download)
    return calls


def test_push_to_hub_uploads_weights_code_and_card(draft, hub):
    draft.push_to_hub("me/jakiro-draft", metrics={"tau": 3.2, "speedup": 1.7}, tags=["smollm"])
    assert hub.repo == "me/jakiro-draft" and hub.commit["repo_id"] == "me/jakiro-draft"
    assert set(hub.files) == {
        "config.json",
        "model.safetensors",
        "configuration_jakiro.py",
        "modeling_jakiro.py",
        "README.md",
        "custom_generate/generate.py",
        "custom_generate/requirements.txt",
    }
    card = ModelCard(hub.files["README.md"].decode())
    assert card.data.base_model == TARGET and card.data.library_name == "transformers"
    assert card.data.tags == ["speculative-decoding", "jakiro", "eagle", "smollm"]
    assert USAGE.format(repo="me/jakiro-draft") in card.text
    assert "| speedup over plain decoding | 1.70x |" in card.text
    assert b'"model_type": "jakiro"' in hub.files["config.json"]


def test_push_to_hub_keeps_an_existing_card(draft, hub):
    hub.remote_card = "---\ntags:\n- mine\n---\n\nA card written by hand.\n"
    draft.push_to_hub("me/jakiro-draft", tags="smollm")
    card = ModelCard(hub.files["README.md"].decode())
    assert "A card written by hand." in card.text and card.data.tags == ["mine", "smollm"]



def test_card_renders_metric_tables(draft):
    table = {"title": "jakiro bench, tree 1/1/6", "columns": ["suite", "Jakiro"], "rows": [["mt_bench", "1.06x"]],
             "note": "Run: benchmarks/results/x."}
    card = build_model_card(draft, metrics={"tau": 2.5, "bench x": table})
    assert "### jakiro bench, tree 1/1/6\n\n| suite | Jakiro |\n|---|---|\n| mt_bench | 1.06x |\n" in card.text
    assert "Run: benchmarks/results/x." in card.text and "bench x" not in card.text
    assert "| acceptance length tau (tokens per target forward) | 2.50 |" in card.text
