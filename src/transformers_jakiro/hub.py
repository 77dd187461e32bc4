"""Model cards and Hub uploads for Jakiro draft heads.

`build_model_card` fills `templates/jakiro_draft.md` (shipped inside the package, so it is found when installed from a
wheel; `model_cards/jakiro_draft.md` at the repository root is the same file). `JakiroDraftModel.save_pretrained`
writes the card as README.md and `JakiroDraftModel.push_to_hub` goes through `push_to_hub` below, because the stock
push overwrites README.md with a generic card after saving.
"""

import os
import tempfile
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

TEMPLATE_PATH = Path(__file__).parent / "templates" / "jakiro_draft.md"
TAGS = ["speculative-decoding", "jakiro", "eagle"]

# Metric keys with a readable label and unit; any other key is shown as given.
_METRIC_LABELS = {
    "tau": ("acceptance length tau (tokens per target forward)", ""),
    "acceptance_length": ("acceptance length tau (tokens per target forward)", ""),
    "papers_tau": ("acceptance length per draft-verify cycle, prefill excluded (as papers report it)", ""),
    "speedup": ("speedup over plain decoding", "x"),
}

# Config fields the card's template shows.
_CONFIG_FIELDS = (
    "num_experts",
    "contrastive_head",
    "target_feature_layers",
    "draft_vocab_size",
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "target_model_type",
    "total_tokens",
    "depth",
    "top_k",
)


def _hub_id(name: str | None) -> str | None:
    """`name` if it can be a Hub model id; the Hub's `base_model` metadata cannot point at a local path."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _metric_rows(metrics: dict) -> list[tuple[str, str]]:
    rows = []
    for key, value in metrics.items():
        if isinstance(value, dict):  # a table ({"title", "columns", "rows"}): the template's `tables`
            continue
        label, unit = _METRIC_LABELS.get(key, (key, ""))
        rows.append((label, f"{value:.2f}{unit}" if isinstance(value, float) else f"{value}{unit}"))
    return rows


def build_model_card(
    draft,
    *,
    training_summary: dict | None = None,
    metrics: dict | None = None,
    repo_id: str | None = None,
    license: str | None = None,
) -> ModelCard:
    """The model card of `draft` (a `JakiroDraftModel`).

    `training_summary`: what it was trained on (e.g. {"data": "ShareGPT 68k", "epochs": 20}), shown as a list.
    `metrics`: measured results, e.g. {"tau": 3.4, "speedup": 1.9, "benchmark": "MT-bench, A100, fp16"}; the card
    says they were not measured when absent. `repo_id` goes into the usage snippet.
    """
    config = draft.config
    target = config.target_name_or_path
    card_data = ModelCardData(
        base_model=_hub_id(target), library_name="transformers", license=license, tags=list(TAGS)
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE_PATH),
        target=target,
        repo=repo_id or "path/to/this/draft",
        training_summary=training_summary or {},
        metrics=_metric_rows(metrics or {}),
        tables=[value for value in (metrics or {}).values() if isinstance(value, dict)],
        **{key: getattr(config, key) for key in _CONFIG_FIELDS},
    )


def push_to_hub(
    draft,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = "50GB",
    tags: list[str] | str | None = None,
    training_summary: dict | None = None,
    metrics: dict | None = None,
    license: str | None = None,
):
    """Upload `draft` (weights, config, modeling code for trust_remote_code, model card) to the Hub repo `repo_id`.

    Like `PreTrainedModel.push_to_hub`, except that a repo without a README gets the Jakiro card; a card already in
    the repo is kept (it may have been edited by hand) and only gains the tags.
    """
    api = HfApi(library_name="transformers-jakiro")
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    try:
        card = ModelCard.load(repo_id, token=token)
    except EntryNotFoundError:
        card = build_model_card(
            draft, training_summary=training_summary, metrics=metrics, repo_id=repo_id, license=license
        )
    extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *(draft.model_tags or []), *extra_tags]))
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        draft.save_pretrained(tmp_dir, max_shard_size=max_shard_size, write_model_card=False)
        card.save(os.path.join(tmp_dir, "README.md"))
        # One commit of every saved file, through create_commit as transformers does (upload_folder may take a
        # different, pipelined route depending on the huggingface_hub version).
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(tmp_dir).as_posix(), path_or_fileobj=str(path))
            for path in sorted(Path(tmp_dir).rglob("*"))
            if path.is_file()
        ]
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload Jakiro draft head",
            commit_description=commit_description,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )


__all__ = ["build_model_card", "push_to_hub", "TEMPLATE_PATH"]
