"""Where the GPU and host files live (search_spaces/), and the TOML reader both are read with."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["search_spaces_dir", "tomllib"]


def search_spaces_dir() -> Path:
    """Folder of the GPU TOML files: $FREQOPT_SEARCH_SPACES, else search_spaces/ of the source tree, else the
    copy installed with the package (freqopt.search_spaces)."""
    env = os.environ.get("FREQOPT_SEARCH_SPACES")
    if env:
        return Path(env)
    source_tree = Path(__file__).resolve().parents[2] / "search_spaces"  # freqopt/gpu/search_spaces.py -> the repository
    if source_tree.is_dir():
        return source_tree
    from importlib.util import find_spec

    spec = find_spec("freqopt.search_spaces")  # a namespace package: data only, no __init__.py
    return Path(list(spec.submodule_search_locations)[0]) if spec else source_tree
