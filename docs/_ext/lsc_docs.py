"""Sphinx extension of the lossscale-callbacks docs: the face check, reference resolution, the CLI reference.

- **Face check**: every name in every package face's ``__all__`` (the packages of ``pyproject.toml`` and
  ``lsc_extra_faces``) must have an API entry; a missing one is a warning, an error under ``-W``. New
  faces and new face names fail the build until they are documented.
- **References**: a reference to ``lossscale_callbacks.<module>.<Name>`` whose ``Name`` is in a face links
  to the face's entry (the docs document faces, not the modules behind them, which may be renamed); a
  reference to another importable name of ours or a builtin renders as code; anything else stays a
  nitpicky warning, so a misspelt or removed name fails the build.
- ``lsc-argparse``: the reference of a command line, generated from its parser builder function.
- ``lsc-contract``: the names of an integration contract module (``lossscale_callbacks.integration``), one
  entry per name with its one line, generated from the module's ``_CONTRACT`` table.
- **Generated pages**: a face that no page under ``docs/api/`` documents (a new integration) gets one of its
  own in ``docs/api/_generated/`` at the start of the build (an orphan page: its names are linked from
  every reference to them), so a new integration needs no edit here; a hand-written page
  (``.. automodule:: <face>``) replaces it.

Example (a Markdown page)::

    ```{lsc-argparse} console:lossscale-callbacks:build_parser
    ```
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tomllib
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOGGER = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "lossscale_callbacks"
NOT_DOCUMENTED = {"__version__"}  # the version is on the home page and the API index


def package_faces(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The packages pyproject.toml installs: each one's ``__init__`` is a face, except the core's rooms
    (private sub-packages that hold a family of modules and export nothing: ``__all__ = []``)."""
    packages = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]
    return [name for name in packages if not _is_room(name)]


def _is_room(package: str) -> bool:
    path = ROOT.joinpath(*package.split("."), "__init__.py")  # the core's sub-packages live in its folder
    if not path.is_file():
        return False
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            return isinstance(node.value, ast.List) and not node.value.elts
    return False


def face_names(faces: Iterable[str]) -> dict[str, list[str]]:
    """``{face: [names of its __all__]}``, the version left out.

    Raises:
        ValueError: a face defines no ``__all__`` (what it exports would be a guess).
    """
    names = {}
    for face in faces:
        listed = getattr(importlib.import_module(face), "__all__", None)
        if listed is None:
            raise ValueError(f"face {face} defines no __all__")
        names[face] = [n for n in listed if n not in NOT_DOCUMENTED]
    return names


def missing_entries(names: dict[str, list[str]], documented: Iterable[str]) -> list[str]:
    """The ``face.name`` of every face name without an API entry, in order.

    Example:
        >>> missing_entries({"pkg": ["A", "b"]}, {"pkg.A"})
        ['pkg.b']
    """
    have = set(documented)
    return [f"{face}.{name}" for face, listed in names.items() for name in listed
            if f"{face}.{name}" not in have]


def _faces(app: Sphinx) -> list[str]:
    return [*package_faces(), *app.config.lsc_extra_faces]


def generate_missing_pages(app: Sphinx) -> None:
    """Write an API page for every face that no page under ``docs/api/`` documents, before reading."""
    api = Path(app.srcdir) / "api"
    generated = api / "_generated"
    written = "".join(p.read_text() for p in api.glob("*.md"))
    wanted = {face: (f"---\norphan: true\n---\n\n# {face}\n\n```{{eval-rst}}\n.. automodule:: {face}\n```\n")
              for face in _faces(app) if f".. automodule:: {face}\n" not in written}
    for old in generated.glob("*.md") if generated.is_dir() else []:
        if old.stem not in wanted:
            old.unlink()
    for face, text in wanted.items():
        generated.mkdir(exist_ok=True)
        page = generated / f"{face}.md"
        if not page.exists() or page.read_text() != text:  # unchanged pages are not rebuilt
            page.write_text(text)


def reexported_from(value: Any, name: str, faces: Iterable[str]) -> str | None:
    """The face among ``faces`` that exports ``value`` under ``name`` too (a re-export on purpose, such as
    the integration contract's ``require``, which is ``extend``'s), or None.

    Example:
        >>> from lossscale_callbacks.extend import require
        >>> reexported_from(require, "require", ["lossscale_callbacks.extend"])
        'lossscale_callbacks.extend'
    """
    for face in faces:
        module = importlib.import_module(face)
        if name in getattr(module, "__all__", ()) and getattr(module, name, None) is value:
            return face
    return None


def check_faces(app: Sphinx, env: Any) -> None:
    documented = env.get_domain("py").objects
    for name in missing_entries(face_names(_faces(app)), documented):
        face, attr = name.rsplit(".", 1)
        elsewhere = reexported_from(getattr(importlib.import_module(face), attr), attr,
                                    [other for other in _faces(app) if other != face])
        if elsewhere is not None and f"{elsewhere}.{attr}" in documented:
            continue  # a re-export on purpose: documented where it is exported first
        LOGGER.warning("face name %s has no API reference entry: add it to a page under docs/api/", name,
                       type="lsc", subtype="face")


def _face_target(objects: dict[str, Any], faces: list[str], target: str) -> str | None:
    """``lossscale_callbacks._state.LossScaleState.scale`` -> ``lossscale_callbacks.LossScaleState.scale``
    when the face documents it."""
    parts = target.split(".")
    for i in range(1, len(parts)):
        for face in faces:
            candidate = ".".join([face, *parts[i:]])
            if f"{face}.{parts[i]}" in objects and candidate in objects:
                return candidate
    return None


def _importable(target: str) -> bool:
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                value = getattr(value, attr)
        except AttributeError:
            return False
        return True
    return False


def _ours(target: str) -> bool:
    """A short name (``finish``, ``LossScaler``) that one of our loaded modules or classes defines."""
    for name, module in list(sys.modules.items()):
        if not name.startswith(PREFIX) or module is None:
            continue
        if hasattr(module, target):
            return True
        classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
        if any(hasattr(cls, target) for cls in classes):
            return True
    return False


def resolve_reference(app: Sphinx, env: Any, node: Any, contnode: nodes.Element) -> nodes.Element | None:
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    if target in vars(builtins):
        return contnode
    domain = env.get_domain("py")
    if "." not in target:
        # A short name in a docstring: a face's entry if one has that name, else code if it is ours.
        target = next((f"{face}.{target}" for face in _faces(app) if f"{face}.{target}" in domain.objects),
                      target)
        if "." not in target:
            return contnode if _ours(target) else None
    if not target.startswith(PREFIX):
        return None
    face_target = _face_target(domain.objects, _faces(app), target)
    if face_target is not None:
        return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], face_target, node,
                                   contnode)
    # An internal name of ours (not documented, as modules may be renamed): code, if it exists.
    return contnode if _importable(target) else None


def _attribute_docstring(self: GoogleDocstring) -> list[str]:
    """Napoleon reads a property's ``"Word: text"`` first line as a type; ours are sentences."""
    return self._dedent(self._consume_to_end())


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def _parser_lines(parser: argparse.ArgumentParser, name: str) -> list[str]:
    lines = [f".. rubric:: {name}", ""]
    if parser.description:
        lines += [parser.description, ""]
    usage = parser.format_usage().strip()
    lines += [".. code-block:: text", "", *("   " + line for line in usage.splitlines()), ""]
    subcommands: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subcommands += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
            continue
        if action.help == argparse.SUPPRESS:
            continue
        spelling = ", ".join(
            f"{opt} {action.metavar or action.dest.upper()}" if action.nargs != 0 else opt
            for opt in action.option_strings) or (action.metavar or action.dest)
        help_lines = _help(parser, action).splitlines()
        lines += [f".. option:: {spelling}", "", *("   " + line for line in help_lines), ""]
    if parser.epilog:
        lines += [parser.epilog, ""]
    for sub_name, sub_parser in subcommands:
        lines += _parser_lines(sub_parser, sub_name)
    return lines


def parser_builder(spec: str) -> Any:
    """``module:function``, or ``console:NAME:function``: that function in the module of the console
    script NAME (so the page follows the command wherever its module moves)."""
    if spec.startswith("console:"):
        _, script, function = spec.split(":")
        (entry,) = importlib.metadata.entry_points(group="console_scripts", name=script)
        return getattr(importlib.import_module(entry.module), function)
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


class ArgparseDirective(SphinxDirective):
    """``lsc-argparse module:function`` (or ``console:NAME:function``): the function builds an
    ``argparse.ArgumentParser``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        parser = parser_builder(self.arguments[0])()
        container = nodes.container()
        lines = StringList(_parser_lines(parser, parser.prog))
        self.state.nested_parse(lines, self.content_offset, container)
        return container.children


def contract_entries(module_name: str) -> dict[str, dict[str, str]]:
    """``{section: {name: one line}}`` of a contract module, in its order: what ``lsc-contract`` lists.

    Example:
        >>> entries = contract_entries("lossscale_callbacks.integration")
        >>> "check_int" in {name for section in entries.values() for name in section}
        True
    """
    module = importlib.import_module(module_name)
    return {section: {name: line for name, (_, line) in names.items()}
            for section, names in module._CONTRACT.items()}


def _rst_text(text: str) -> str:
    """Plain text as reStructuredText (``**logging`` is no emphasis, ``|`` no substitution)."""
    return "".join("\\" + char if char in "*`|_\\" else char for char in text)


def _kind(value: Any) -> str:
    return "class" if isinstance(value, type) else "function" if inspect.isroutine(value) else "data"


class ContractDirective(SphinxDirective):
    """``lsc-contract module``: a rubric per section of the module's contract, an entry per name with its one
    line. A name the module re-exports from another face (``require`` from ``extend``) is listed without an
    index entry: its entry is that face's, so a reference to it has one target."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        faces = [face for face in _faces(self.env.app) if face != module_name]
        lines: list[str] = []
        for section, names in contract_entries(module_name).items():
            lines += [f".. rubric:: {_rst_text(section)}", ""]
            for name, line in names.items():
                value = getattr(module, name)
                options = [f"   :module: {module_name}"]
                if reexported_from(value, name, faces):
                    options.append("   :no-index:")
                lines += [f".. py:{_kind(value)}:: {name}", *options, "", f"   {_rst_text(line)}", ""]
        # The pages are Markdown (MyST parses a directive's nested content as Markdown): the entries go in
        # as one reStructuredText block.
        block = ["```{eval-rst}", *lines, "```"]
        container = nodes.container()
        self.state.nested_parse(StringList(block), self.content_offset, container)
        return container.children


def setup(app: Sphinx) -> dict[str, Any]:
    GoogleDocstring._parse_attribute_docstring = _attribute_docstring  # type: ignore[method-assign]
    app.add_config_value("lsc_extra_faces", [], "env")
    app.add_directive("lsc-argparse", ArgparseDirective)
    app.add_directive("lsc-contract", ContractDirective)
    app.connect("builder-inited", generate_missing_pages)
    app.connect("env-check-consistency", check_faces)
    app.connect("missing-reference", resolve_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
