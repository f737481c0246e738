"""Integrations of the DVFS runtime with training frameworks; each module imports its framework, which is an
optional dependency (``hf``: Hugging Face transformers; freqopt.errors.install_hint says how to install each)."""
