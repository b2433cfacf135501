"""Docstrings in Lightning's shape: none over 60 lines (manuals belong on the documentation pages), and the
shared logging arguments described once, on ``LoggingLoop``: every other Args entry for them refers to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
SHARED = {"log_every", "tensorboard", "wandb", "sinks", "health", "echo"}
# Where the shared arguments are written out in full.
HOME = ("lossscale_callbacks/loop/_logging_loop.py", "LoggingLoop")
ENTRY = re.compile(r"^(\s+)([\w, ]+?)(?: \([^)]*\))?: ")


def docstrings() -> list[tuple[str, str, str]]:
    """``(file, name, docstring)`` of every module, class and function of the package and its integrations."""
    found = []
    files = [*(ROOT / "lossscale_callbacks").rglob("*.py"), *(ROOT / "integrations").rglob("*.py")]
    for path in sorted(files):
        tree = ast.parse(path.read_text())
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    found.append((str(path.relative_to(ROOT)), getattr(node, "name", "<module>"), text))
    return found


def args_entries(text: str) -> list[tuple[set[str], str]]:
    """``({names}, text)`` of each entry of the Args section (``a, b: text`` documents two names)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return []
    entries: list[tuple[set[str], str]] = []
    indent = None
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= len(lines[start]) - len(lines[start].lstrip()):
            break  # the next section
        match = ENTRY.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            entries.append(({n.strip() for n in match.group(2).split(",")}, line))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
    return entries


def test_no_docstring_over_60_lines():
    long = [f"{path}:{name} ({len(text.splitlines())} lines)" for path, name, text in docstrings()
            if len(text.splitlines()) > MAX_LINES]
    assert not long, f"docstrings over {MAX_LINES} lines (move the manual to a page under docs/): {long}"


def test_shared_logging_arguments_are_described_once_on_logging_loop():
    home = [entry for path, name, text in docstrings() if (path, name) == HOME
            for entry in args_entries(text)]
    assert SHARED <= set().union(*(names for names, _ in home)), "LoggingLoop describes every shared argument"
    # The loop's own methods (start(sinks=...)) are its business; everything else refers to the loop.
    repeated = [f"{path}:{name} {sorted(names & SHARED)}" for path, name, text in docstrings()
                if path != HOME[0] for names, entry in args_entries(text)
                if names & SHARED and "LoggingLoop" not in entry]
    assert not repeated, f"shared logging arguments described again, not referring to LoggingLoop: {repeated}"


def test_the_entry_parser_reads_grouped_and_single_entries():
    text = '''Summary.

    Args:
        log_every, health: as for LoggingLoop.
        policy: the policy,
            on two lines.

    Raises:
        ValueError: bad.
    '''
    assert [names for names, _ in args_entries(text)] == [{"log_every", "health"}, {"policy"}]
