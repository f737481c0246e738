"""MkDocs hook: the experiments' reports (experiments/**: Markdown, figures, JSON) become pages and files of the
site under experiments/, so that the documentation links to them by the same relative paths as the README does,
and ``mkdocs build --strict`` checks those links too."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
KINDS = {".md", ".png", ".json"}


def on_files(files, config):
    for path in sorted((ROOT / "experiments").rglob("*")):
        if path.is_file() and path.suffix in KINDS:
            files.append(File(str(path.relative_to(ROOT)), src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
