"""The built-in models' names, without building any (no torch import): so that a wrong name is refused at once,
before the seconds PyTorch takes to import (issue 38, item 4). freqopt.workload.models.MODELS holds their
configurations, in the same order; a test keeps the two equal."""

from __future__ import annotations

from freqopt.errors import UnknownNameError

__all__ = ["MODEL_NAMES", "HF_PREFIX", "check_model_name"]

MODEL_NAMES = ("gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b",
               "gpt3-175b", "bert-base", "bert-large", "distilbert")  # fmt: skip
HF_PREFIX = "hf:"  # a Hugging Face config: hf:PATH (freqopt.workload.models.hf)


def check_model_name(model: str) -> str:
    """``model`` if it is a built-in model's name (freqopt.workload.models.MODELS where that module is loaded, else
    MODEL_NAMES) or an ``hf:PATH``.

    Raises:
        UnknownNameError: any other name; the message lists the known ones.
    """
    import sys

    # Once the models are loaded their registry is the authority (a model registered at run time included).
    loaded = sys.modules.get("freqopt.workload.models")
    names = tuple(loaded.MODELS) if loaded is not None and hasattr(loaded, "MODELS") else MODEL_NAMES
    if not (isinstance(model, str) and (model in names or model.startswith(HF_PREFIX))):
        raise UnknownNameError(f"unknown model {model!r}; known models: {', '.join(names)} (see `freqopt "
                               "models`)")  # fmt: skip
    return model
