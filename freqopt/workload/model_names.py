"""The built-in models' names, without building any (no torch import): so that a wrong name is refused at once,
before the seconds PyTorch takes to import. freqopt.workload.models.MODELS holds their
configurations, in the same order; a test keeps the two equal."""

from __future__ import annotations

import json
from pathlib import Path

from freqopt.errors import InvalidSettingError, UnknownNameError

__all__ = ["MODEL_NAMES", "HF_PREFIX", "check_model_name", "read_hf_config_json"]

MODEL_NAMES = ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b",
               "gpt3-175b", "bert-base", "bert-large", "distilbert")  # fmt: skip
HF_PREFIX = "hf:"  # a Hugging Face config: hf:PATH (freqopt.workload.models.hf)


def check_model_name(model: str) -> str:
    """``model`` if it is a built-in model's name (freqopt.workload.models.MODELS where that module is loaded, else
    MODEL_NAMES) or an ``hf:PATH`` whose config.json can be read (read_hf_config_json; transformers reads it again
    where the model is built).

    Raises:
        UnknownNameError: any other name (the message lists the known ones), or no config.json at an ``hf:PATH``.
        InvalidSettingError: an ``hf:PATH`` config that cannot be read or names no model_type.
    """
    import sys

    # Once the models are loaded their registry is the authority (a model registered at run time included).
    loaded = sys.modules.get("freqopt.workload.models")
    names = tuple(loaded.MODELS) if loaded is not None and hasattr(loaded, "MODELS") else MODEL_NAMES
    if not (isinstance(model, str) and (model in names or model.startswith(HF_PREFIX))):
        raise UnknownNameError(f"unknown model {model!r}; known models: {', '.join(names)} (see `freqopt "
                               "models`)")  # fmt: skip
    if model.startswith(HF_PREFIX) and model not in names:
        read_hf_config_json(Path(model[len(HF_PREFIX):]).expanduser())
    return model


def read_hf_config_json(path: Path) -> dict:
    """A Hugging Face config.json read as JSON: ``path`` itself or ``path``/config.json (nothing imported but json,
    so that the command line refuses a wrong ``hf:PATH`` before it imports PyTorch).

    Raises:
        UnknownNameError: no such file.
        InvalidSettingError: a file that cannot be read, is not JSON, or names no model_type.
    """
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UnknownNameError(f"no Hugging Face config at {str(path)!r}; give a config.json or a folder holding one")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidSettingError(f"cannot read the Hugging Face config {str(path)!r}: {e}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise InvalidSettingError(f"{str(path)!r} is not a Hugging Face config: it names no model_type")
    return data
