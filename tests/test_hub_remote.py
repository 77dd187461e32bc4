"""A head used the Hub way: loaded as remote code and decoded through the `custom_generate/` folder saved with it,
in processes where transformers-jakiro is not installed (its code, its editable-install path file and its metadata
all hidden) and in processes where it is. Only local folders: nothing is downloaded."""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from tiny_models import make_target, quick_trained_draft
from transformers_jakiro import JakiroDraftModel
from transformers_jakiro.hub_decoding import FILES, FOLDER, TEMPLATE_DIR

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_HEADS = sorted(path for path in (ROOT / "heads").iterdir() if (path / "config.json").is_file())
SMOLLM2_HEAD = ROOT / "heads" / "jakiro-smollm2-135m-instruct"
INSTALL = "pip install transformers-jakiro"


def _site_without_the_package(tmp_path) -> Path:
    """A site-packages folder of links to everything installed except transformers-jakiro: a process that uses it
    (with `python -S`) is one where the package was never installed, for imports and for importlib.metadata alike."""
    view = tmp_path / "site-without-jakiro"
    view.mkdir()
    for directory in site.getsitepackages():
        for entry in sorted(Path(directory).iterdir()):
            name = entry.name.lower().replace("-", "_")
            if "transformers_jakiro" not in name and not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    return view


def _run(code: str, tmp_path, *args, without_package: bool) -> dict:
    """Run `code` in a fresh interpreter outside the repository (offline, its own Hugging Face cache); the last
    line it prints is JSON."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "PATH": "", "TRANSFORMERS_VERBOSITY": "error"}
    if without_package:
        view = _site_without_the_package(tmp_path)
        command = [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(view)!r})\n{code}"]
    else:
        command = [sys.executable, "-c", code]
        if os.environ.get("PYTHONPATH"):  # the package may be found through it rather than installed
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    done = subprocess.run(
        [*command, *map(str, args)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


WITHOUT_PACKAGE = """
import importlib.metadata, json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
try:
    import transformers_jakiro
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("transformers_jakiro is importable: the test would not show what a user without it sees")
try:
    importlib.metadata.version("transformers-jakiro")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    raise SystemExit("transformers-jakiro's metadata is visible: transformers' requirements check would pass")

target = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
ids = torch.tensor([[5, 6, 7, 8]])
results = {}
for head in sys.argv[2:]:
    draft = AutoModel.from_pretrained(head, trust_remote_code=True)
    entry = {"class": type(draft).__name__, "module": type(draft).__module__}
    calls = {
        "assistant_model": dict(assistant_model=draft),
        "custom_generate": dict(custom_generate=head, draft=draft, trust_remote_code=True),
    }
    for name, kwargs in calls.items():
        try:
            target.generate(ids, max_new_tokens=4, do_sample=False, **kwargs)
            entry[name] = None
        except Exception as error:
            entry[name] = [type(error).__name__, str(error)]
    results[head] = entry
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def smollm2_shaped_target(tmp_path_factory):
    """A tiny random target with SmolLM2's vocabulary, so that transformers takes the shipped head as a same-tokenizer
    assistant and goes on to use it."""
    folder = tmp_path_factory.mktemp("target") / "tiny-llama-49152"
    make_target("llama", vocab_size=49152).save_pretrained(folder)
    return folder


def test_without_the_package_the_head_loads_and_every_way_to_decode_says_what_to_do(smollm2_shaped_target, tmp_path):
    target = make_target("llama", vocab_size=49152)
    tiny_head = tmp_path / "tiny-head"
    JakiroDraftModel.from_target(target).save_pretrained(tiny_head)
    heads = [str(tiny_head), str(SMOLLM2_HEAD)]
    results = _run(WITHOUT_PACKAGE, tmp_path, smollm2_shaped_target, *heads, without_package=True)
    for head in heads:
        entry = results[head]
        # (a) AutoModel loads the head from its own modeling file.
        assert entry["class"] == "JakiroDraftModel" and entry["module"].startswith("transformers_modules.")
        # (b) as a plain assistant: the fix, not "'JakiroDraftModel' object has no attribute 'generation_config'".
        kind, message = entry["assistant_model"]
        assert kind == "RuntimeError", message
        assert INSTALL in message and "import transformers_jakiro" in message
        assert f'custom_generate="{head}", draft=draft, trust_remote_code=True' in message
        # (c) the decoding method saved with the head: transformers loads it, and it names the package to install.
        kind, message = entry["custom_generate"]
        assert kind == "ImportError", message
        assert INSTALL in message and "No module named 'transformers_jakiro'" in message


WITH_PACKAGE = """
import json, sys, torch
import transformers_jakiro
from transformers import AutoModelForCausalLM
from transformers_jakiro import JakiroDraftModel

target = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
head = sys.argv[2]
draft = JakiroDraftModel.from_pretrained(head)
results = {"equal": {}, "tokens_per_round": {}}
generator = torch.Generator().manual_seed(0)
for case in range(3):
    ids = torch.randint(3, 128, (1, 4 + 5 * case), generator=generator)
    reference = target.generate(ids, max_new_tokens=32, do_sample=False)
    calls = {
        "draft": dict(draft=draft),
        "draft by name": dict(draft=head),
        "assistant_model": dict(assistant_model=draft),
        "tree settings": dict(draft=draft, total_tokens=10, depth=3, top_k=3),
    }
    for name, kwargs in calls.items():
        out = target.generate(
            ids, max_new_tokens=32, do_sample=False, custom_generate=head, trust_remote_code=True, **kwargs
        )
        results["equal"].setdefault(name, []).append(torch.equal(out, reference))
    stats = draft.last_generation_stats
    results["tokens_per_round"][case] = stats.new_tokens / max(stats.rounds, 1)
try:
    target.generate(ids, max_new_tokens=4, custom_generate=head, trust_remote_code=True)
except ValueError as error:
    results["no draft"] = str(error)
print(json.dumps(results))
"""


def test_with_the_package_custom_generate_folder_decodes_like_greedy(tmp_path):
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    quick_trained_draft(target, steps=120).save_pretrained(tmp_path / "head")
    results = _run(WITH_PACKAGE, tmp_path, tmp_path / "target", tmp_path / "head", without_package=False)
    calls = ("draft", "draft by name", "assistant_model", "tree settings")
    assert results["equal"] == {name: [True] * 3 for name in calls}
    assert max(results["tokens_per_round"].values()) > 1.5  # the tree path ran, accepting several tokens a round
    assert "pass `draft=` to generate" in results["no draft"]


def test_save_pretrained_writes_the_decoding_method(tmp_path):
    draft = JakiroDraftModel.from_target(make_target("llama"))
    draft.save_pretrained(tmp_path)
    for name in FILES:
        assert (tmp_path / FOLDER / name).read_bytes() == (TEMPLATE_DIR / name).read_bytes()
    (tmp_path / FOLDER / "generate.py").write_text("stale")
    draft.save_pretrained(tmp_path)  # a re-save refreshes it
    assert (tmp_path / FOLDER / "generate.py").read_bytes() == (TEMPLATE_DIR / "generate.py").read_bytes()


@pytest.fixture(scope="module")
def saved_code(tmp_path_factory):
    """What `save_pretrained` writes besides the weights and the config: the remote code and the decoding method."""
    out = tmp_path_factory.mktemp("saved-head")
    JakiroDraftModel.from_target(make_target("llama")).save_pretrained(out, write_model_card=False)
    return {path.relative_to(out).as_posix(): path.read_bytes() for path in out.rglob("*")
            if path.is_file() and path.suffix in (".py", ".txt")}


@pytest.mark.parametrize("head", SHIPPED_HEADS, ids=lambda path: path.name)
def test_shipped_heads_carry_the_code_save_pretrained_writes(head, saved_code):
    """A shipped head's remote code (`modeling_jakiro.py`, `configuration_jakiro.py`) and decoding method
    (`custom_generate/`) are exactly what `save_pretrained` writes from the package now: refresh them by saving the
    head again (`AutoModel.from_pretrained(head).save_pretrained(head)`) after changing the package."""
    assert {"modeling_jakiro.py", "configuration_jakiro.py", *(f"{FOLDER}/{name}" for name in FILES)} <= set(saved_code)
    for name, content in saved_code.items():
        assert (head / name).read_bytes() == content, f"{head.name}/{name} differs from what save_pretrained writes"
    modeling = (head / "modeling_jakiro.py").read_text()
    assert "def generation_config(self)" in modeling and INSTALL in modeling


def test_template_is_package_data():
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package_dir = TEMPLATE_DIR.parent.parent
    for name in FILES:
        assert any(TEMPLATE_DIR / name in package_dir.glob(pattern) for pattern in package_data["transformers_jakiro"])


def test_generation_config_stays_missing_with_the_package_imported():
    draft = JakiroDraftModel.from_target(make_target("llama"))
    assert not hasattr(draft, "generation_config")
    with pytest.raises(AttributeError, match="no attribute 'generation_config'"):
        draft.generation_config
    config = GenerationConfig()  # one assigned is kept
    draft.generation_config = config
    assert draft.generation_config is config
