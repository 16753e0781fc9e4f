"""The tables the rows print, and writing them between markers into the docs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax

from . import ROOT


def tables(timing: list[dict], compile_: list[tuple[str, str, str]]) -> str:
    lines = ["| network | reference | run ratio | solve ms | ref ms | compile s (solve / ref) | peak memory ratio "
             "| temp memory ratio | grad / forward |", "|---|---|---|---|---|---|---|---|---|"]
    for r in timing:
        lines.append(f"| {r['network']} | {r['reference']} | **{r['ratio']:.2f}** | {r['ours ms']:.2f} | "
                     f"{r['ref ms']:.2f} | {r['compile'][0]:.2f} / {r['compile'][1]:.2f} | {r['peak']:.2f} | "
                     f"{r['temp']:.2f} | {r['grad/fwd']:.2f} |")
    lines += ["", "| compile and scaling | measured | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in compile_]
    return "\n".join(lines)


def small_table(title: str, rows: list[tuple[str, str, str]], third: str = "target") -> str:
    return "\n".join([f"| {title} | measured | {third} |", "|---|---|---|",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def write_headline(timing: list[dict], threshold: list[tuple[str, str, str]], rows: str, on_cpu: bool) -> None:
    """README's headline rows (CPU) or accelerator rows (elsewhere, with the threshold sweep), and
    the sweep in docs/performance.md (CPU)."""
    sweep = small_table("where ℳ after the loop pays", threshold)
    if on_cpu:
        write_between(ROOT / "README.md", "headline rows", headline(timing), rows)
        write_between(ROOT / "docs" / "performance.md", "threshold table", sweep, rows)
    else:
        write_between(ROOT / "README.md", "accelerator rows", f"{headline(timing)}\n\n{sweep}", rows)


# The README's rows: one per regime (compute-bound, latency-bound, several kinds, a sequence, a transformer).
HEADLINE = ("deep chain 128×128×64 (depth×width×batch)", "deep narrow chain 512×32×8", "deep narrow DAG",
            "RNN, 2048 steps", "character-level GPT")


def headline(timing: list[dict]) -> str:
    lines = ["| network | time / `jax.grad` over `lax.scan` | peak memory ratio | compile s (solve / ref) |",
             "|---|---|---|---|"]
    for r in timing:
        if r["network"].startswith(HEADLINE):
            short = r["network"].split(" (", 1)[0].split(":", 1)[0]
            lines.append(f"| {short} | **{r['ratio']:.2f}** | {r['peak']:.2f} | "
                         f"{r['compile'][0]:.2f} / {r['compile'][1]:.2f} |")
    return "\n".join(lines)


def write_between(path: Path, marker: str, text: str, rows: str, flags: str = "") -> None:
    """Replace what ``path`` holds between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    flag = ("" if rows == "all" else f" --rows {rows}") + flags
    device = jax.devices()[0]
    where = "CPU" if device.platform == "cpu" else f"{device.platform.upper()} ({device.device_kind})"
    threads = os.environ.get("OPENBLAS_NUM_THREADS")  # part of the command: it moves the factorisations' times
    prefix = f"OPENBLAS_NUM_THREADS={threads} " if threads else ""
    block = (f"<!-- {marker} -->\n`{prefix}python benchmarks/run.py --write-docs{flag}` on "
             f"{where} ({'float64' if jax.config.jax_enable_x64 else 'float32'}), jax {jax.__version__}:\n\n{text}\n"
             f"<!-- /{marker} -->")
    content, found = re.subn(f"<!-- {marker} -->.*<!-- /{marker} -->", lambda _: block, path.read_text(), flags=re.S)
    if not found:
        raise SystemExit(f"{path} has no <!-- {marker} --> ... <!-- /{marker} --> markers")
    path.write_text(content)
