"""One prepared GPU check: a single command answers the open GPU questions on one lent accelerator (an NVIDIA H200,
no network) in under 9 minutes, and writes one JSON and one markdown summary.

    python3 benchmarks/gpu/check.py --out $OUT/gpu-check          # on the accelerator (README.md: the exact call)
    python benchmarks/gpu/check.py --fetch-wheels                  # here, before: fills .gpu-wheels/ (ignored by git)
    python benchmarks/gpu/check.py --cpu-smoke --out /tmp/check    # every part at tiny shapes on a CPU (the tests)

Parts, each in its own subprocess with a time cap (`CAPS`), in this order:
  env             versions (Python, torch, CUDA, transformers, this package) and the GPU;
  correctness     tiny random-weight target + quickly fitted head: greedy fp32 output against plain `generate`
                  (dynamic, static, compiled static; lookup off and on; the round controller on; batch > 1 where
                  asked), then bf16 match rates of Jakiro and of stock prompt lookup against plain;
  syncs           host syncs per draft-verify round, counted by `torch.cuda.set_sync_debug_mode` (greedy, prefix
                  processors, lookup off and on, static cache);
  round_eager     8B shape (Llama-3-8B, random bf16 weights built on the GPU): plain eager step, Jakiro eager round
                  at 16, 32 and 60 tree nodes (draft and verify split), projected speedups; at batch sizes 4, 16
                  and 32 the batched round (each row at the batch tree size) against a plain batched step;
  training        8B shape: target feature preparation tokens/s, a 30-step `JakiroTrainer` run in bf16 on synthetic
                  data (draft training tokens/s, peak memory, the loss falls);
  round_compiled  8B shape: plain static + compiled step and the Jakiro round static + compiled at 60, 32, 16 nodes,
                  compile times, dynamo graph counts (and any added while timing: recompiles), CUDA graph skips.
The compiled part is last: it is the one most likely to run long. Every part writes its result file after each
measurement, so a part cut off by its cap keeps what it measured ("status": "timed out"); the whole run keeps to
`BUDGET_S` and then writes check.json, check.md and check.log into --out.

If the installed transformers is outside the supported range, the wheels in .gpu-wheels/ (transformers and the
requirements the machine does not already satisfy) are installed with `pip install --no-index --no-deps --target
/tmp/site` and the script re-executes itself with PYTHONPATH=/tmp/site:src. This package is never installed there:
every part runs with src/ on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC, TESTS = ROOT / "src", ROOT / "tests"
WHEEL_DIR = ROOT / ".gpu-wheels"
SITE = "/tmp/site"
SUPPORTED = ">=5.17,<6"  # pyproject.toml's transformers requirement
DEFAULT_TRANSFORMERS = "5.24.0"  # what --fetch-wheels downloads when this environment's transformers is not 5.x

# Seconds per part, and for the whole run. The caps sum to 510 s; the budget (530 s) leaves 30 s of the 9 minutes
# for a reinstall of transformers (about 10 s) and the summaries; each part's cap is cut to what the budget has left.
CAPS = {"env": 20, "correctness": 110, "syncs": 40, "round_eager": 80, "training": 80, "round_compiled": 180}
BUDGET_S = 530
PARTS = list(CAPS)
TEST_PARTS = {"sleep": 3600}  # a part that hangs, for the test of the caps (only when named in --parts)

# Tokens per round to project speedups with: our shipped heads (benchmarks/results/README.md, draft tree alone and
# with n-gram lookup) and the 4-5 the papers' heads accept (docs/experiments/smollm2-135m.md).
TAUS = {
    "qwen-v2 tree 32/5/8": 2.04,
    "smollm2-v6 tree 24/4/6": 2.63,
    "qwen-v2 tree+lookup 32/5/8": 3.0,
    "papers, low": 4.0,
    "papers, high": 5.0,
}

GPU = dict(
    device="cuda", dtype="bfloat16", round_shape="llama3-8b", train_shape="llama3-8b", context=512,
    trees=[16, 32, 60], depth=5, top_k=10, repeats=20, warmup=3, backend="inductor", batch_sizes=[1, 4, 16, 32],
    draft_fit=dict(steps=200, batch=16, length=48), prompts=6, bf16_prompts=8, new_tokens=40, lookup_tokens=8,
    sync_new_tokens=48,
    train_length=1024, train_batch=4, train_examples=32, train_steps=30, train_lr=3e-4,
)
SMOKE = dict(
    GPU, device="cpu", round_shape="tiny", train_shape="tiny", context=32, repeats=2, warmup=1, backend="eager",
    batch_sizes=[1, 3],
    draft_fit=dict(steps=20, batch=4, length=16), prompts=2, bf16_prompts=1, threads=1, new_tokens=12,
    sync_new_tokens=16, train_length=48, train_examples=8,
)


# -- wheels --------------------------------------------------------------------------------------------------------
def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def read_wheel(path: Path) -> dict:
    """Name, version and requirements (the Requires-Dist lines, extras left out) of a wheel file."""
    import zipfile
    from email.parser import HeaderParser

    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(archive.read(metadata).decode("utf-8"))
    return {"name": _canonical(headers["Name"]), "version": headers["Version"], "path": str(path),
            "requires": headers.get_all("Requires-Dist") or []}


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan_install(wheel_dir: Path, installed=_installed_version, root: str = "transformers") -> list[dict]:
    """The wheels to install for `root`: itself and, transitively, each requirement that this interpreter does not
    already satisfy. Raises if a needed requirement has no wheel in `wheel_dir`."""
    from packaging.requirements import Requirement

    wheels = {}
    for path in sorted(Path(wheel_dir).glob("*.whl")):
        wheel = read_wheel(path)
        wheels.setdefault(wheel["name"], wheel)
    chosen, todo = {}, [_canonical(root)]
    while todo:
        name = todo.pop()
        if name in chosen:
            continue
        if name not in wheels:
            raise FileNotFoundError(f"no wheel for {name} in {wheel_dir}")
        chosen[name] = wheels[name]
        for line in chosen[name]["requires"]:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            dependency = _canonical(requirement.name)
            version = installed(dependency)
            if version is not None and requirement.specifier.contains(version, prereleases=True):
                continue
            todo.append(dependency)
    return list(chosen.values())


def install_wheels(wheels: list[dict], target: str) -> dict:
    """`pip install --no-index --no-deps --target` of exactly these wheels (unpacked by hand where pip is missing)."""
    paths = [w["path"] for w in wheels]
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", target, *paths]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    method = "pip"
    if done.returncode != 0:
        if "No module named pip" not in done.stderr:
            raise RuntimeError(f"pip install failed: {done.stderr[-2000:]}")
        import zipfile

        method = "unzip"  # a wheel's files are laid out as site-packages wants them
        for path in paths:
            with zipfile.ZipFile(path) as archive:
                archive.extractall(target)
    return {"installed": [f"{w['name']}=={w['version']}" for w in wheels], "method": method, "target": target,
            "seconds": round(time.perf_counter() - started, 1)}


def fetch_wheels(dest: Path, transformers_version: str, python_version: str, exclude=("numpy",)) -> dict:
    """Here, with the package index at hand: transformers and every requirement, as binary wheels for the
    accelerator's Python (CPython `python_version`, x86-64 Linux), into `dest`. numpy is left out (the accelerate
    and torch there need it already; it alone would double the size)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64", "any"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", *[f"--platform={p}" for p in platforms], "-d", str(dest),
               f"transformers=={transformers_version}"]
    subprocess.run(command, check=True)
    for path in dest.glob("*.whl"):
        if read_wheel(path)["name"] in exclude:
            path.unlink()
    files = sorted(dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in files)
    summary = {"dir": str(dest), "wheels": [p.name for p in files], "bytes": size, "mib": round(size / 2**20, 1)}
    (dest / "README.txt").write_text(
        "Filled by `python benchmarks/gpu/check.py --fetch-wheels`; installed on the accelerator by the check when its "
        f"transformers is outside {SUPPORTED}.\n" + "\n".join(summary["wheels"]) + "\n"
    )
    return summary


def _in_range(version: str | None, spec: str = SUPPORTED) -> bool:
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def ensure_transformers(args, t0: float) -> dict:
    """In the parent, before any part: if transformers is outside the supported range, install the travelling
    wheels into /tmp/site and re-execute this script with them first on the path (never returns then)."""
    version = _installed_version("transformers")
    setup = {"transformers_found": version, "supported": SUPPORTED}
    if os.environ.get("JAKIRO_GPU_CHECK_SETUP"):
        setup.update(json.loads(os.environ["JAKIRO_GPU_CHECK_SETUP"]))
        setup["transformers_after_reinstall"] = version
        return setup
    if _in_range(version):
        setup["reinstall"] = "not needed"
        return setup
    wheel_dir = Path(args.wheel_dir)
    try:
        wheels = plan_install(wheel_dir)
        setup["reinstall"] = install_wheels(wheels, args.site)
    except Exception as error:  # go on with what is installed: the env part shows it, the others may still run
        setup["reinstall"] = f"failed: {type(error).__name__}: {error}"
        return setup
    environment = dict(os.environ, JAKIRO_GPU_CHECK_SETUP=json.dumps(setup), JAKIRO_GPU_CHECK_T0=str(t0))
    environment["PYTHONPATH"] = os.pathsep.join([args.site, str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    print(f"transformers {version} is outside {SUPPORTED}: installed {setup['reinstall']['installed']}, re-executing",
          flush=True)
    os.execve(sys.executable, [sys.executable, *sys.argv], environment)


# -- running the parts -----------------------------------------------------------------------------------------------
def _child_environment(work: Path, config: dict) -> dict:
    """src/ (and /tmp/site after a reinstall) first on the path, a private round-cost cache, nothing from the Hub;
    for the CPU smoke one thread per part (tiny shapes; on a shared 2-core machine two spinning threads per process
    made the training steps 4 times slower)."""
    threads = {"OMP_NUM_THREADS": str(config["threads"]), "MKL_NUM_THREADS": str(config["threads"])} if config.get(
        "threads") else {}
    paths = [str(SRC)]  # after a reinstall PYTHONPATH already starts with the site folder
    existing = os.environ.get("PYTHONPATH")
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join(paths + ([existing] if existing else [])), PYTHONUNBUFFERED="1",
        JAKIRO_CACHE=str(work / "jakiro-cache"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **threads,
    )


def run_part(name: str, cap: float, config: dict, work: Path, log) -> dict:
    """Runs `--part name` in a subprocess of its own process group; cut off (SIGTERM, then SIGKILL) after `cap`
    seconds. Returns what the part recorded, with status, seconds and, on failure, the end of its output."""
    result_path = work / f"{name}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(result_path),
               "--config", json.dumps(config)]
    log.write(f"\n===== part {name} (cap {cap:.0f} s) =====\n")
    log.flush()
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                               env=_child_environment(work, config), start_new_session=True)
    status = "ok"
    try:
        code = process.wait(timeout=cap)
        if code != 0:
            status = f"failed (exit code {code})"
    except subprocess.TimeoutExpired:
        status = "timed out"
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    seconds = round(time.perf_counter() - started, 1)
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        result = {}
    if status == "ok" and result.get("errors"):
        status = "ok, with errors"
    result = {"status": status, "seconds": seconds, "cap_s": round(cap), **result}
    if not status.startswith("ok"):
        log.flush()
        with open(log.name, errors="replace") as text:
            result["log_tail"] = text.read()[-1500:]
    log.write(f"===== part {name}: {status} in {seconds} s =====\n")
    log.flush()
    return result


class Recorder:
    """A part's results, rewritten to its file (atomically) after every measurement: a part that is cut off keeps
    what it had."""

    def __init__(self, path: Path):
        self.path, self.data = Path(path), {}

    def __setitem__(self, key, value):
        self.data[key] = value
        self.flush()

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)

    def flush(self):
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(temporary, self.path)

    def attempt(self, key, function, *args, **kwargs):
        """`self[key] = function(...)`; an exception is recorded under `errors` (the part goes on). The seconds it
        took go under `timings_s`."""
        started = time.perf_counter()
        try:
            value = function(*args, **kwargs)
        except Exception as error:
            self.data.setdefault("timings_s", {})[key] = round(time.perf_counter() - started, 2)
            print(f"{key}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            self["errors"] = {**self.get("errors", {}), key: f"{type(error).__name__}: {str(error)[:500]}"}
            return None
        self.data.setdefault("timings_s", {})[key] = round(time.perf_counter() - started, 2)
        self[key] = value
        return value


def run_child(name: str, result_path: str, config: dict) -> None:
    for path in (str(TESTS), str(SRC), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    record = Recorder(Path(result_path))
    record["started"] = time.strftime("%H:%M:%S")
    PART_FUNCTIONS[name](config, record)


# -- parts -----------------------------------------------------------------------------------------------------------
def part_sleep(config, record):
    record["sleeping"] = True
    time.sleep(TEST_PARTS["sleep"])


def part_env(config, record):
    import platform

    record["python"] = platform.python_version()
    record["platform"] = platform.platform()
    record["executable"] = sys.executable
    import torch

    record["torch"] = torch.__version__
    record["cuda_available"] = torch.cuda.is_available()
    record["torch_cuda"] = torch.version.cuda
    import transformers

    record["transformers"] = transformers.__version__
    record["transformers_path"] = str(Path(transformers.__file__).parent)
    record["transformers_in_range"] = _in_range(transformers.__version__)
    import transformers_jakiro

    record["transformers_jakiro"] = transformers_jakiro.__version__
    record["transformers_jakiro_path"] = str(Path(transformers_jakiro.__file__).parent)
    for package in ("accelerate", "safetensors", "tokenizers", "huggingface_hub", "triton", "numpy"):
        record[package] = _installed_version(package)
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        record["gpu"] = {"name": properties.name, "capability": f"{properties.major}.{properties.minor}",
                         "memory_gib": round(properties.total_memory / 2**30, 1),
                         "multiprocessors": properties.multi_processor_count,
                         "cudnn": torch.backends.cudnn.version()}
        try:
            query = ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=5)
            record["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            record["nvidia_smi"] = f"unavailable: {error}"
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        a @ a  # cuBLAS initialisation
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        record["bf16_matmul_tflops"] = round(10 * 2 * 4096**3 / (time.perf_counter() - start) / 1e12, 1)
    else:
        record["gpu"] = None
        record["cpu_threads"] = torch.get_num_threads()


def _compile_config(device: str, backend: str):
    from round_cost import compile_config
    import torch

    # transformers' default for static-cache generation (CUDA graphs on a GPU), with full graphs: a break is an error.
    return compile_config(torch.device(device), backend)


def _tiny_pair(config: dict, work: Path):
    """The tests' tiny Llama target and a head fitted to it in seconds (cached under the run's work folder, so the
    correctness and syncs parts fit it once), both on the CPU in fp32."""
    import torch

    from tiny_models import make_target, quick_trained_draft

    target = make_target("llama")
    fit = config["draft_fit"]
    path = work / f"tiny-draft-{fit['steps']}-{fit['batch']}-{fit['length']}.pt"
    if path.exists():
        from transformers_jakiro import JakiroDraftModel

        torch.manual_seed(0)
        draft = JakiroDraftModel.from_target(target, adaptive=False)
        draft.load_state_dict(torch.load(path))
        return target, draft.eval()
    draft = quick_trained_draft(target, **fit)
    torch.save(draft.state_dict(), path)
    return target, draft


def _prompts(count: int, seed: int = 0):
    """Prompts with a repeated stretch (so n-gram lookup finds chains), of varying lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        stretch = torch.randint(3, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g)
        head = torch.randint(3, 128, (i % 3,), generator=g)
        prompts.append(torch.cat([head, stretch, stretch[: 3 + i % 4]])[None])
    return prompts


def _compare(expected: list, got: list, stats: list | None = None) -> dict:
    """How many outputs are token-identical to the expected ones; with the drafts' generation stats, the mean tau
    and the rounds that carried n-gram lookup nodes."""
    import torch

    same = [torch.equal(e.cpu(), g.cpu()) for e, g in zip(expected, got)]
    summary = {"identical": sum(same), "of": len(same)}
    if not all(same):
        summary["differing_prompts"] = [i for i, s in enumerate(same) if not s]
    if stats:
        summary["mean_tau"] = round(sum(s.mean_accepted_length for s in stats) / len(stats), 3)
        summary["lookup_rounds"] = sum(s.lookup_rounds for s in stats)
    return summary


def part_correctness(config, record):
    import torch
    from torch._dynamo.utils import counters

    from transformers_jakiro import tree_settings

    device = config["device"]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    target, draft = _tiny_pair(config, Path(config["work"]))
    target, draft = target.to(device), draft.to(device)
    record["models"] = {"target": "tests/tiny_models.py llama (hidden 64, 2 layers, vocab 128)",
                        "draft_fit": config["draft_fit"], "fit_s": round(time.perf_counter() - started, 1)}
    prompts = [p.to(device) for p in _prompts(config["prompts"])]
    new = config["new_tokens"]
    kwargs = dict(do_sample=False, max_new_tokens=new)
    lookup = dict(lookup_tokens=config["lookup_tokens"])
    max_cache_len = 128 + new

    with torch.no_grad():
        expected = [target.generate(p, **kwargs) for p in prompts]

    def variant(settings: dict, **generate_kwargs):
        outs, stats = [], []
        with tree_settings(draft, **settings):
            for p in prompts:
                outs.append(target.generate(p, assistant_model=draft, **kwargs, **generate_kwargs))
                stats.append(draft.last_generation_stats)
        return _compare(expected, outs, stats)

    static = dict(cache_implementation="static", max_cache_len=max_cache_len)
    for name, settings, extra in (
        ("dynamic", {}, {}), ("dynamic_lookup", lookup, {}), ("static", {}, static),
        ("static_lookup", lookup, static), ("dynamic_adaptive", {"adaptive": True}, {}),
    ):
        record.attempt(f"fp32_{name}", variant, settings, **extra)

    for batch in config["batch_sizes"]:
        if batch == 1:
            continue
        record.attempt(f"fp32_batch_{batch}", _batched, target, draft, prompts, batch, kwargs)
        # a static cache, the verify forward compiled (plain batched generate compiles its steps over it too)
        record.attempt(f"fp32_batch_{batch}_static_compiled", _batched, target, draft, prompts, batch,
                       {**kwargs, **static, "compile_config": _compile_config(device, config["backend"])})

    # bf16 (before the compiled runs, which take longest): plain decoding, Jakiro (lookup off, on) and stock prompt
    # lookup, each against plain, on bf16 copies of the target and the head (generate binds the copy to the copy).
    import copy

    target16, draft16 = copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)
    bf16_prompts = [p.to(device) for p in _prompts(config["bf16_prompts"], seed=1)]
    with torch.no_grad():
        plain = [target16.generate(p, **kwargs) for p in bf16_prompts]
        stock = [target16.generate(p, prompt_lookup_num_tokens=10, **kwargs) for p in bf16_prompts]

    def bf16(settings):
        outs, stats = [], []
        with tree_settings(draft16, **settings):
            for p in bf16_prompts:
                outs.append(target16.generate(p, assistant_model=draft16, **kwargs))
                stats.append(draft16.last_generation_stats)
        return {"vs_plain": _compare(plain, outs, stats), "vs_stock_prompt_lookup": _compare(stock, outs)}

    record["bf16_stock_prompt_lookup"] = {"vs_plain": _compare(plain, stock)}
    record.attempt("bf16_jakiro", bf16, {})
    record.attempt("bf16_jakiro_lookup", bf16, lookup)
    del target16, draft16

    def compiled(settings: dict):
        compile_config = _compile_config(device, config["backend"])
        graphs = counters["stats"]["unique_graphs"]
        with tree_settings(draft, **settings):
            start = time.perf_counter()
            target.generate(prompts[0], assistant_model=draft, compile_config=compile_config, **static, **kwargs)
            compile_s = time.perf_counter() - start
            after_first = counters["stats"]["unique_graphs"]
            outs, stats, recompile_error = [], [], None
            for p in prompts:
                try:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        outs.append(target.generate(p, assistant_model=draft, compile_config=compile_config,
                                                    **static, **kwargs))
                except Exception as error:  # a recompilation: record it, then run the prompt allowing it
                    recompile_error = recompile_error or f"{type(error).__name__}: {str(error)[:300]}"
                    outs.append(target.generate(p, assistant_model=draft, compile_config=compile_config,
                                                **static, **kwargs))
                stats.append(draft.last_generation_stats)
        return {**_compare(expected, outs, stats), "first_call_s": round(compile_s, 1),
                "graphs_first_call": after_first - graphs,
                "graphs_after_first_call": counters["stats"]["unique_graphs"] - after_first,
                "recompile": recompile_error, "backend": config["backend"], "mode": compile_config.mode}

    record.attempt("fp32_compiled", compiled, {})
    record.attempt("fp32_compiled_lookup", compiled, lookup)


def _batched(target, draft, prompts, batch, kwargs):
    """Batch > 1: left-padded prompts against plain batched generate."""
    import torch

    rows = [prompts[i % len(prompts)][0] for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(batch, width, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    expected = target.generate(ids, attention_mask=mask, **kwargs)
    got = target.generate(ids, attention_mask=mask, assistant_model=draft, **kwargs)
    return {"status": "ran", **_compare(list(expected[:, None]), list(got[:, None]))}


def _count_syncs_cuda(target, draft, prompt, generate_kwargs: dict) -> tuple[list[int], int]:
    """Host syncs of each draft-verify round (from one round's drafting to the next's, the last to the end of
    generate), as CUDA's sync debug mode reports them, and those before the first round (the prefill)."""
    import warnings

    import torch

    from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator

    marks = []
    caught = []
    original = JakiroCandidateGenerator.get_candidates

    def marked(self, input_ids, choice=None):
        marks.append(len(caught))
        return original(self, input_ids, choice)

    JakiroCandidateGenerator.get_candidates = marked
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                target.generate(prompt, assistant_model=draft, **generate_kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            end = len(caught)
    finally:
        JakiroCandidateGenerator.get_candidates = original
    is_sync = [("synchroniz" in str(w.message).lower()) for w in caught]
    bounds = marks + [end]
    return [sum(is_sync[a:b]) for a, b in zip(bounds, bounds[1:])], sum(is_sync[: marks[0] if marks else end])


def _count_syncs_counted(target, draft, prompt, generate_kwargs: dict):
    """On a CPU: the dispatch-mode count of `benchmarks/round_cost.py` (`HostSyncCounter`, what
    tests/test_host_syncs.py holds), along the accelerator path (full logits, no lazy leaf head)."""
    import importlib.util

    from transformers_jakiro.decoding import row_rounds as decoding
    from transformers_jakiro.decoding.drafter import JakiroCandidateGenerator

    spec = importlib.util.spec_from_file_location("round_cost", HERE.parent / "round_cost.py")
    round_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(round_cost)
    counter, marks = round_cost.HostSyncCounter(), []
    original, lazy_leaf_head = JakiroCandidateGenerator.get_candidates, decoding.lazy_leaf_head

    def marked(self, input_ids, choice=None):
        marks.append(counter.total)
        return original(self, input_ids, choice)

    decoding.lazy_leaf_head = lambda *args: None
    JakiroCandidateGenerator.get_candidates = marked
    try:
        with counter:
            target.generate(prompt, assistant_model=draft, **generate_kwargs)
            end = counter.total
    finally:
        JakiroCandidateGenerator.get_candidates, decoding.lazy_leaf_head = original, lazy_leaf_head
    bounds = marks + [end]
    return [b - a for a, b in zip(bounds, bounds[1:])], marks[0] if marks else end


def part_syncs(config, record):
    import torch

    from transformers_jakiro import tree_settings

    device = config["device"]
    target, draft = _tiny_pair(config, Path(config["work"]))
    target, draft = target.to(device), draft.to(device)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]], device=device)
    count = _count_syncs_cuda if device == "cuda" else _count_syncs_counted
    record["method"] = ("torch.cuda.set_sync_debug_mode('warn'), warnings counted per round" if device == "cuda"
                        else "dispatch-mode count of benchmarks/round_cost.py, as tests/test_host_syncs.py (no CUDA)")
    base = dict(do_sample=False, max_new_tokens=config["sync_new_tokens"])
    prefix = dict(repetition_penalty=1.2, min_new_tokens=config["sync_new_tokens"] - 8)
    lookup = dict(lookup_tokens=10)
    target.generate(prompt, assistant_model=draft, **base)  # warm-up: lazy initialisations sync once

    def measure(settings, kwargs):
        with tree_settings(draft, **settings):
            per_round, prefill = count(target, draft, prompt, {**base, **kwargs})
        stats = draft.last_generation_stats
        rounds = per_round[:-1] or per_round  # the last round ends generate (its final copies counted there)
        return {"per_round": per_round, "max": max(per_round, default=0), "max_but_last": max(rounds, default=0),
                # the first round also initializes the draft's DynamicCache (transformers' lazy layer set-up)
                "max_after_first": max(per_round[1:], default=0),
                "mean": round(sum(per_round) / max(len(per_round), 1), 2), "before_first_round": prefill,
                "draft_rounds": stats.draft_rounds, "tau": round(stats.mean_accepted_length, 2),
                "lookup_rounds": stats.lookup_rounds}

    for name, settings, kwargs in (
        ("greedy", {}, {}), ("prefix_processors", {}, prefix), ("lookup", lookup, {}),
        ("lookup_prefix_processors", lookup, prefix), ("static", {}, {"cache_implementation": "static"}),
    ):
        record.attempt(name, measure, settings, kwargs)
    record["limits_in_tests"] = {"greedy": 1, "prefix_processors": 2, "lookup": 3, "static": 1}


def _round_setup(config):
    import torch

    import round_cost
    from transformers_jakiro.decoding.drafter import TreeSettings

    device = torch.device(config["device"])
    started = time.perf_counter()
    target, draft = round_cost.build_pair(config["round_shape"], device, getattr(torch, config["dtype"]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = round(time.perf_counter() - started, 1)
    settings = {n: TreeSettings(total_tokens=n, depth=config["depth"], top_k=config["top_k"], contrastive=True)
                for n in config["trees"]}
    info = {"shape": config["round_shape"], **round_cost.SHAPES[config["round_shape"]], "dtype": config["dtype"],
            "context": config["context"], "build_s": build_s, "repeats": config["repeats"],
            "warmup": config["warmup"], "depth": config["depth"], "top_k": config["top_k"],
            "target_params_b": round(sum(p.numel() for p in target.parameters()) / 1e9, 3),
            "draft_params_b": round(sum(p.numel() for p in draft.parameters()) / 1e9, 3)}
    return round_cost, target, draft, settings, info


def _memory(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)}


def projected(step_ms: float, round_ms: float) -> dict:
    """Tokens per second relative to plain decoding: tau tokens per round against one token per plain step."""
    return {name: round(tau * step_ms / round_ms, 2) for name, tau in TAUS.items()}


def part_round_eager(config, record):
    round_cost, target, draft, settings, info = _round_setup(config)
    record["setup"] = info
    repeats, warmup = config["repeats"], config["warmup"]
    plain = {}
    for batch in config["batch_sizes"]:
        prompt = round_cost.random_prompt(target, config["context"], batch)
        plain[batch] = record.attempt(f"plain_b{batch}", round_cost.measure_plain_eager, target, prompt, repeats,
                                      warmup)
    prompt = round_cost.random_prompt(target, config["context"])
    step = (plain.get(1) or {}).get("plain_step_ms")
    for nodes, tree in settings.items():
        for batch in config["batch_sizes"]:
            key = f"jakiro_{nodes}" + ("" if batch == 1 else f"_b{batch}")
            if batch != 1:  # every row's tree at the batch tree size, against a plain step of the same batch
                batch_prompt = round_cost.random_prompt(target, config["context"], batch)
                result = record.attempt(key, round_cost.measure_batch_round_eager, target, draft, tree, batch_prompt,
                                        repeats, warmup)
                batch_step = (plain.get(batch) or {}).get("plain_step_ms")
                if result and batch_step:
                    result["round_over_plain"] = round(result["jakiro_round_ms"] / batch_step, 3)
                    result["projected_speedup"] = projected(batch_step, result["jakiro_round_ms"])
                    record[key] = result
                continue
            result = record.attempt(key, round_cost.measure_round_eager, target, draft, tree, prompt, repeats, warmup)
            if result and step:
                result["round_over_plain"] = round(result["jakiro_round_ms"] / step, 3)
                result["draft_ms_per_forward"] = round(result["draft_ms"] / config["depth"], 3)
                result["projected_speedup"] = projected(step, result["jakiro_round_ms"])
                record[key] = result
    record["memory"] = _memory(config["device"])


def part_round_compiled(config, record):
    import torch
    from torch._dynamo.utils import counters

    round_cost, target, draft, settings, info = _round_setup(config)
    device = torch.device(config["device"])
    compile_config = round_cost.compile_config(device, config["backend"])
    length = round_cost.static_cache_length(config["context"], list(settings.values()))
    record["setup"] = {**info, "backend": config["backend"], "mode": compile_config.mode,
                       "static_cache_length": length}
    forward = target.get_compiled_call(compile_config)
    repeats, warmup = config["repeats"], config["warmup"]
    prompt = round_cost.random_prompt(target, config["context"])

    def counted(function, *args):
        graphs = counters["stats"]["unique_graphs"]
        skips = dict(counters["inductor"]) if "inductor" in counters else {}
        result = function(*args)
        result["graphs_added"] = counters["stats"]["unique_graphs"] - graphs
        cudagraph = {k: v - skips.get(k, 0) for k, v in counters.get("inductor", {}).items() if "cudagraph" in k}
        if cudagraph:
            result["inductor_cudagraph_counters"] = cudagraph
        return result

    for batch in config["batch_sizes"]:
        batch_prompt = round_cost.random_prompt(target, config["context"], batch)
        record.attempt(f"plain_compiled_b{batch}", counted, round_cost.measure_plain_compiled, target, batch_prompt,
                       forward, length, repeats, warmup)
    step = (record.get("plain_compiled_b1") or {}).get("plain_compiled_step_ms")
    for nodes in sorted(settings, reverse=True):  # the default tree (60) first
        key = f"jakiro_compiled_{nodes}"
        result = record.attempt(key, counted, round_cost.measure_round_compiled, target, draft, settings[nodes],
                                prompt, compile_config, length, repeats, warmup)
        if result and step:
            result["round_over_plain_compiled"] = round(result["jakiro_compiled_round_ms"] / step, 3)
            result["projected_speedup"] = projected(step, result["jakiro_compiled_round_ms"])
            record[key] = result
        for batch in config["batch_sizes"]:
            if batch != 1:
                record[f"{key}_b{batch}"] = {"status": "not supported yet: batches decode with the dynamic cache"}
    record["total_unique_graphs"] = counters["stats"]["unique_graphs"]
    record["memory"] = _memory(config["device"])


def _synthetic_examples(count: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Conversations of `length` random tokens, the first quarter a prompt (no loss), the rest assistant tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = length // 4
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * prompt + [1] * (length - prompt)} for _ in range(count)]


def part_training(config, record):
    import torch
    from transformers import TrainerCallback

    import round_cost
    from transformers_jakiro import JakiroDraftModel
    from transformers_jakiro.training import JakiroCollator, JakiroTrainer, JakiroTrainingConfig

    device = config["device"]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        from transformers import AutoModelForCausalLM, LlamaConfig

        shape = LlamaConfig(**round_cost.SHAPES[config["train_shape"]], pad_token_id=0)
        target = AutoModelForCausalLM.from_config(shape, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        draft = JakiroDraftModel.from_target(target).float()  # fp32 master weights; bf16 runs in autocast
    sync()
    length, batch = config["train_length"], config["train_batch"]
    examples = _synthetic_examples(config["train_examples"], length, target.config.vocab_size)
    record["setup"] = {"shape": config["train_shape"], "target_dtype": "bfloat16", "draft_dtype": "float32 + bf16 "
                       "autocast", "draft_vocab": "full (the target's lm_head)", "sequence_length": length,
                       "batch": batch, "examples": len(examples), "build_s": round(time.perf_counter() - started, 1),
                       "draft_params_b": round(sum(p.numel() for p in draft.parameters()) / 1e9, 3),
                       "driver": "JakiroTrainer (transformers Trainer), features cached in memory (cache_features)"}
    work = Path(config["work"]) / "train-out"
    args = JakiroTrainingConfig(
        output_dir=str(work), max_steps=config["train_steps"], learning_rate=config["train_lr"], warmup_steps=0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_pin_memory=False, per_device_train_batch_size=batch, seed=0, bf16=True, use_cpu=not cuda,
        cache_features=True, feature_noise=0.0,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = JakiroTrainer(model=draft, target=target, args=args, train_dataset=examples)

    # Feature preparation: one batch to warm up, then the rest through prepare_features (target forward, features
    # and next tokens copied to the host cache).
    warm = JakiroCollator(0)(examples[:batch])
    start = time.perf_counter()
    trainer.target_features(warm)
    sync()
    warm_s = time.perf_counter() - start
    prepared = trainer.prepare_features()
    record["feature_preparation"] = {**prepared, "warmup_batch_s": round(warm_s, 2), **_memory(device)}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self.start)

    steps = StepTimes()
    trainer.add_callback(steps)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    output = trainer.train()
    train_s = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    timed_steps = steps.times[3:] or steps.times
    median = sorted(timed_steps)[len(timed_steps) // 2]
    first, last = losses[:5], losses[-5:]
    record["train"] = {
        "steps": len(steps.times), "seconds": round(train_s, 1), "median_step_s": round(median, 4),
        "tokens_per_step": batch * length, "tokens_per_s": round(batch * length / median, 1),
        "trainer_runtime_s": output.metrics.get("train_runtime"), "losses": [round(x, 4) for x in losses],
        "first5_mean": round(sum(first) / len(first), 4), "last5_mean": round(sum(last) / len(last), 4),
        "loss_falls": sum(last) / len(last) < sum(first) / len(first), **_memory(device),
    }


PART_FUNCTIONS = {"env": part_env, "correctness": part_correctness, "syncs": part_syncs,
                  "round_eager": part_round_eager, "training": part_training, "round_compiled": part_round_compiled,
                  "sleep": part_sleep}


# -- summaries -------------------------------------------------------------------------------------------------------
def _cell(value) -> str:
    if isinstance(value, dict):
        if "identical" in value:
            tau = f" (tau {value['mean_tau']}, lookup rounds {value['lookup_rounds']})" if "mean_tau" in value else ""
            return f"{value['identical']}/{value['of']}{tau}"
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def markdown(summary: dict) -> str:
    parts = summary["parts"]
    lines = [f"# GPU check, {summary['date']}", "", f"Command: `{summary['command']}`", "",
             f"Mode: {summary['mode']}; wall {summary['wall_s']} s of a {summary['budget_s']} s budget.", "",
             "| part | status | seconds | cap |", "|---|---|---|---|"]
    for name, part in parts.items():
        lines.append(f"| {name} | {part.get('status')} | {part.get('seconds')} | {part.get('cap_s')} |")
    env = parts.get("env", {})
    lines += ["", "## Environment", "", f"Setup: {_cell(summary.get('setup'))}", ""]
    for key in ("python", "torch", "torch_cuda", "transformers", "transformers_path", "transformers_jakiro_path",
                "accelerate", "triton", "gpu", "nvidia_smi", "bf16_matmul_tflops"):
        if key in env:
            lines.append(f"- {key}: {_cell(env[key])}")
    correctness = parts.get("correctness", {})
    if correctness:
        lines += ["", "## Correctness (identical to plain greedy / prompts, mean tau)", "", "| variant | result |",
                  "|---|---|"]
        for key, value in correctness.items():
            if key.startswith(("fp32_", "bf16_")):
                lines.append(f"| {key} | {_cell(value)} |")
    syncs = parts.get("syncs", {})
    if syncs:
        lines += ["", f"## Host syncs per round ({syncs.get('method')})", "",
                  "| variant | max | max but last | mean | before first round | tau |", "|---|---|---|---|---|---|"]
        for key, value in syncs.items():
            if isinstance(value, dict) and "per_round" in value:
                lines.append(f"| {key} | {value['max']} | {value['max_but_last']} | {value['mean']} | "
                             f"{value['before_first_round']} | {value['tau']} |")
    for name, step_key, round_key in (("round_eager", "plain_step_ms", "jakiro_round_ms"),
                                      ("round_compiled", "plain_compiled_step_ms", "jakiro_compiled_round_ms")):
        part = parts.get(name, {})
        if not part:
            continue
        plain = {k: v for k, v in part.items() if k.startswith("plain") and isinstance(v, dict)}
        lines += ["", f"## {name} ({_cell(part.get('setup', {}).get('shape'))}, context "
                      f"{part.get('setup', {}).get('context')})", ""]
        for key, value in plain.items():
            compiled = (f", compile {value['compile_s']} s, graphs {value.get('graphs_added')} (while timing "
                        f"{value.get('graphs_while_timing')})") if "compile_s" in value else ""
            lines.append(f"- {key}: {value.get(step_key)} ms{compiled}")
        lines += ["", "| tree nodes | round ms | draft ms | verify ms | round / step | compile s | graphs (while "
                  "timing) | " + " | ".join(TAUS) + " |", "|---" * (7 + len(TAUS)) + "|"]
        for key, value in part.items():
            if not key.startswith("jakiro") or not isinstance(value, dict) or round_key not in value:
                continue
            ratio = value.get("round_over_plain", value.get("round_over_plain_compiled"))
            speedups = value.get("projected_speedup", {})
            lines.append(
                f"| {key} | {value[round_key]} | {value.get('draft_ms', value.get('draft_compiled_ms'))} | "
                f"{value.get('verify_ms', value.get('verify_compiled_ms'))} | {ratio} | "
                f"{value.get('compile_s', '-')} | {value.get('graphs_added', '-')} "
                f"({value.get('graphs_while_timing', '-')}) | "
                + " | ".join(str(speedups.get(t, "-")) for t in TAUS) + " |")
        lines.append("")
        lines.append("Projected speedup = tau x step / round for the taus in the header (check.py `TAUS`).")
    training = parts.get("training", {})
    if training:
        lines += ["", "## Training", ""]
        for key in ("setup", "feature_preparation"):
            if key in training:
                lines.append(f"- {key}: {_cell(training[key])}")
        train = training.get("train")
        if train:
            lines.append(f"- train: {train['steps']} steps, {train['tokens_per_s']} tokens/s (median step "
                         f"{train['median_step_s']} s), loss {train['first5_mean']} -> {train['last5_mean']} (falls: "
                         f"{train['loss_falls']}), peak {train.get('peak_allocated_gib', '-')} GiB")
    errors = {name: part["errors"] for name, part in parts.items() if part.get("errors")}
    if errors:
        lines += ["", "## Errors", ""] + [f"- {name}.{k}: {v}" for name, e in errors.items() for k, v in e.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for check.json, check.md and check.log")
    parser.add_argument("--cpu-smoke", action="store_true", help="every part at tiny shapes on the CPU")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--caps", default="", help="NAME=SECONDS,... overriding CAPS")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (B > 1 where supported)")
    parser.add_argument("--wheel-dir", default=str(WHEEL_DIR))
    parser.add_argument("--site", default=SITE, help="where the wheels are installed if transformers is out of range")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the wheels into --wheel-dir, then exit")
    parser.add_argument("--python-version", default="3.12", help="the accelerator's Python, for --fetch-wheels")
    parser.add_argument("--transformers-version", help="for --fetch-wheels (default: this environment's 5.x)")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        run_child(args.part, args.result, json.loads(args.config))
        return {}
    if args.fetch_wheels:
        version = args.transformers_version or _installed_version("transformers")
        if not _in_range(version):
            version = DEFAULT_TRANSFORMERS
        summary = fetch_wheels(Path(args.wheel_dir), version, args.python_version)
        print(json.dumps(summary, indent=1))
        return summary
    if not args.out:
        parser.error("--out DIR is required")
    t0 = float(os.environ.get("JAKIRO_GPU_CHECK_T0") or time.time())  # kept across a re-execution
    setup = ensure_transformers(args, t0)
    deadline = t0 + args.budget
    caps = dict(CAPS, **TEST_PARTS)
    for item in filter(None, args.caps.split(",")):
        name, seconds = item.split("=")
        caps[name] = float(seconds)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PART_FUNCTIONS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {list(PART_FUNCTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(SMOKE if args.cpu_smoke else GPU, batch_sizes=[int(b) for b in args.batch_sizes.split(",")])
    work = Path(tempfile.mkdtemp(prefix="jakiro-gpu-check-"))
    config["work"] = str(work)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
               "command": " ".join(["python3", "benchmarks/gpu/check.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
               "budget_s": args.budget, "caps_s": {n: caps[n] for n in names}, "setup": setup, "config": config,
               "taus": TAUS, "parts": {}}

    def write():
        summary["wall_s"] = round(time.time() - t0, 1)
        (out / "check.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        (out / "check.md").write_text(markdown(summary))

    with open(out / "check.log", "a") as log:
        for name in names:
            left = deadline - time.time() - 5
            if left < 5:
                summary["parts"][name] = {"status": "skipped: the run's budget is spent", "cap_s": caps[name]}
                continue
            cap = min(caps[name], left)
            print(f"[{time.time() - t0:6.1f} s] part {name} (cap {cap:.0f} s)", flush=True)
            summary["parts"][name] = run_part(name, cap, config, work, log)
            print(f"[{time.time() - t0:6.1f} s] part {name}: {summary['parts'][name]['status']}", flush=True)
            write()
    write()
    print((out / "check.md").read_text())
    return summary


if __name__ == "__main__":
    main()
