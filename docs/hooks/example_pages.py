"""mkdocs hook: one page per script in ``examples/``, its source as the site shows code, so that
the examples page links each script to its code in the built site itself (which reads offline).
Long source lines wrap (``.example-source`` in ``stylesheets/extra.css``) instead of scrolling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def pages() -> dict[str, str]:
    """Each example's page: its path in the site's sources and its markdown."""
    return {f"examples/{script.stem}.md": (
        f"# examples/{script.name}\n\n[All examples](../examples.md) · run from the repository root: "
        f"`python examples/{script.name}`\n\n``` {{.python .example-source}}\n{script.read_text()}```\n")
        for script in sorted(EXAMPLES.glob("*.py"))}


def on_files(files: Files, config: Any) -> Files:
    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
