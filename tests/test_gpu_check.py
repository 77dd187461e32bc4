"""benchmarks/gpu/check.py, the one prepared GPU check, runs every part at tiny shapes on the CPU (`--cpu-smoke`), so
that it cannot rot between the rare runs on an accelerator; a part that hangs is cut off by its cap and the run still
writes its summaries; the wheels that travel for an out-of-range transformers are chosen and installed right."""

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from benchmark_scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "gpu" / "check.py"


def load_check():
    return load_script("gpu/check.py", "gpu_check")


def run(*args, timeout=600):
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return time.perf_counter() - started, done.stdout


def test_cpu_smoke_runs_every_part(tmp_path):
    check = load_check()
    wall, stdout = run("--cpu-smoke", "--batch-sizes", "1,3", "--out", str(tmp_path))
    print(f"cpu smoke: {wall:.1f} s")
    summary = json.loads((tmp_path / "check.json").read_text())
    text = (tmp_path / "check.md").read_text()
    assert (tmp_path / "check.log").exists() and "# GPU check" in stdout
    parts = summary["parts"]
    assert list(parts) == check.PARTS
    for name, part in parts.items():
        assert part["status"] == "ok", (name, part)
        assert not part.get("errors"), (name, part["errors"])
        assert f"| {name} | ok |" in text
    assert sum(check.CAPS.values()) < check.BUDGET_S <= 540  # the whole run inside 9 minutes

    env = parts["env"]
    assert env["torch"] and env["transformers_in_range"] and env["cuda_available"] is False
    assert Path(env["transformers_jakiro_path"]).parent == check.SRC  # the package from src/, not installed

    correctness = parts["correctness"]
    for variant in ("dynamic", "dynamic_lookup", "static", "static_lookup", "dynamic_adaptive", "compiled",
                    "compiled_lookup"):
        result = correctness[f"fp32_{variant}"]
        assert result["identical"] == result["of"] > 0, (variant, result)
    for key in ("batch_3", "batch_3_static_compiled"):
        assert correctness[f"fp32_{key}"]["identical"] == correctness[f"fp32_{key}"]["of"] == 3, key
    for key in ("compiled", "compiled_lookup"):
        assert correctness[f"fp32_{key}"]["graphs_after_first_call"] == 0
        assert correctness[f"fp32_{key}"]["recompile"] is None
    for key in ("bf16_jakiro", "bf16_jakiro_lookup"):
        assert {"vs_plain", "vs_stock_prompt_lookup"} <= set(correctness[key])
    assert "vs_plain" in correctness["bf16_stock_prompt_lookup"]

    syncs = parts["syncs"]
    for variant in ("greedy", "prefix_processors", "lookup", "lookup_prefix_processors", "static"):
        assert syncs[variant]["per_round"] and syncs[variant]["draft_rounds"] > 0, variant
    assert syncs["greedy"]["max_after_first"] <= syncs["limits_in_tests"]["greedy"]

    eager = parts["round_eager"]
    assert eager["plain_b1"]["plain_step_ms"] > 0
    for nodes in (16, 32, 60):
        result = eager[f"jakiro_{nodes}"]
        assert result["tree"]["total_tokens"] == nodes and result["jakiro_round_ms"] > 0
        assert set(result["projected_speedup"]) == set(check.TAUS) and result["draft_ms_per_forward"] > 0

    compiled = parts["round_compiled"]
    assert compiled["plain_compiled_b1"]["plain_compiled_step_ms"] > 0
    assert compiled["plain_compiled_b1"]["graphs_added"] == compiled["plain_compiled_b1"]["graphs_compiled"] == 1
    for nodes in (60, 32, 16):
        result = compiled[f"jakiro_compiled_{nodes}"]
        assert result["jakiro_compiled_round_ms"] > 0 and result["verified_nodes"] == nodes + 1
        assert result["graphs_added"] >= 1 and set(result["projected_speedup"]) == set(check.TAUS)
        assert result["graphs_while_timing"] == 0  # no recompilation once compiled

    training = parts["training"]
    assert training["feature_preparation"]["tokens_per_s"] > 0
    train = training["train"]
    assert train["steps"] == 30 and len(train["losses"]) == 30 and train["tokens_per_s"] > 0
    assert train["loss_falls"], train["losses"]


def test_a_hanging_part_is_cut_off_and_the_summaries_are_written(tmp_path):
    """`sleep` hangs: its cap (3 s) stops it, what it recorded is kept; the budget (13 s, of which a part may use all
    but the last 5) then has no room for env, which is skipped; check.json and check.md are written all the same."""
    wall, _ = run("--cpu-smoke", "--parts", "sleep,env", "--caps", "sleep=3", "--budget", "13", "--out",
                  str(tmp_path))
    assert wall < 30
    summary = json.loads((tmp_path / "check.json").read_text())
    sleep = summary["parts"]["sleep"]
    assert sleep["status"] == "timed out" and sleep["sleeping"] is True and sleep["seconds"] < 10
    assert summary["parts"]["env"]["status"].startswith("skipped")
    assert "| sleep | timed out |" in (tmp_path / "check.md").read_text()


def _fake_wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"__version__ = '{version}'\n")
        archive.writestr(f"{info}/METADATA", metadata)
        wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        archive.writestr(f"{info}/WHEEL", wheel)
        archive.writestr(f"{info}/RECORD", "")
    return path


def test_wheels_planned_from_requirements_and_installed(tmp_path):
    check = load_check()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "transformers", "9.0.0", ["needed_dep>=2", "present-dep>=1.0", "extra_dep; extra == 'x'",
                                                   "never_dep; python_version < '3'"])
    _fake_wheel(wheels, "needed_dep", "2.1", ["chained>=1"])
    _fake_wheel(wheels, "chained", "1.5")
    _fake_wheel(wheels, "present_dep", "1.2")
    installed = {"present-dep": "1.1", "needed-dep": "1.0"}.get  # needed_dep 1.0 is too old
    plan = check.plan_install(wheels, installed=installed)
    assert sorted(w["name"] for w in plan) == ["chained", "needed-dep", "transformers"]
    site = tmp_path / "site"
    done = check.install_wheels(plan, str(site))
    assert sorted(done["installed"]) == ["chained==1.5", "needed-dep==2.1", "transformers==9.0.0"]
    assert (site / "transformers" / "__init__.py").read_text() == "__version__ = '9.0.0'\n"
    assert (site / "needed_dep").is_dir() and not (site / "present_dep").exists()
    assert check._in_range("5.17.0") and check._in_range("5.30.1") and not check._in_range("4.57.0")
    assert not check._in_range("6.0.0") and not check._in_range(None)


def test_cuda_sync_count_splits_the_warnings_by_round(monkeypatch):
    """The CUDA branch of the syncs part, on a CPU: sync debug mode replaced by a warning from every `tolist` (the
    host copy each round makes), which the count must attribute to the round it happened in."""
    import warnings

    import torch
    from tiny_models import make_target

    from transformers_jakiro import JakiroDraftModel

    check = load_check()
    target = make_target("llama")
    draft = JakiroDraftModel.from_target(target, adaptive=False)
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    tolist = torch.Tensor.tolist

    def warning_tolist(self):
        warnings.warn("called a synchronizing CUDA operation")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", warning_tolist)
    per_round, before = check._count_syncs_cuda(target, draft, torch.tensor([[3, 4, 5, 6]]),
                                                dict(do_sample=False, max_new_tokens=8))
    monkeypatch.undo()
    stats = draft.last_generation_stats
    assert modes == ["warn", 0]
    assert len(per_round) == stats.draft_rounds > 0 and all(n >= 1 for n in per_round)
    assert before >= 0
