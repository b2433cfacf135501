"""Sphinx extension of the lossscale-callbacks docs: the face check, reference resolution, the CLI reference.

- **Face check**: every name in every package face's ``__all__`` (the packages of ``pyproject.toml`` and
  ``lsc_extra_faces``) must have an API entry; a missing one is a warning, an error under ``-W``. New
  faces and new face names fail the build until they are documented.
- **References**: a reference to ``lossscale_callbacks.<module>.<Name>`` whose ``Name`` is in a face links
  to the face's entry (the docs document faces, not the modules behind them, which may be renamed); a
  reference to another importable name of ours or a builtin renders as code; anything else stays a
  nitpicky warning, so a misspelt or removed name fails the build.
- ``lsc-argparse``: the reference of a command line or one of its subcommands, generated from its parser
  builder function as Markdown (Sphinx's ``program`` and ``option`` directives: each option rendered, with an
  anchor a link can name); a subcommand that no page documents is a warning.
- ``lsc-contract``: the names of an integration contract module (``lossscale_callbacks.integration``), one
  entry per name with its one line, generated from the module's ``_CONTRACT`` table.
- **Generated pages**: a face that no page under ``docs/api/`` documents (a new integration) gets one of its
  own in ``docs/api/_generated/`` at the start of the build (an orphan page: its names are linked from
  every reference to them), so a new integration needs no edit here; a hand-written page
  (``.. automodule:: <face>``) replaces it.

Example (a Markdown page)::

    ```{lsc-argparse} console:lossscale-callbacks:build_parser report
    ```
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import importlib.metadata
import inspect
import re
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


def _import_faces(app: Sphinx) -> None:
    """Import every face and its names once (a face may import them lazily), so that :func:`_ours` sees all
    our modules, whichever pages this build read."""
    if not getattr(app, "_lsc_faces_imported", False):
        for face, names in face_names(_faces(app)).items():
            for name in names:
                getattr(importlib.import_module(face), name)
        app._lsc_faces_imported = True


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
            _import_faces(app)  # an incremental build may not have imported the module that defines it
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


# What the generated Markdown shows as code: option names, quoted pip commands, extras, a JSON shape.
_CODE = re.compile(r'pip install "[^"]+"(?: (?:tensorflow|tensorflow-cpu|jax|torch)\b)?'  # and a backend
                   r"|(?<![\w-])--?[A-Za-z][\w-]*"  # --fail-on, -h
                   r"|\[[a-z][a-z,]*\](?= extra)"  # [plot] extra
                   r"|\{.*\}"  # a JSON shape: {"runs": [...], ...}
                   r"|\b\d+\*\*\d+(?: - \d+)?")  # 2**31 - 1
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]<>#|~!$])")


def markdown_text(text: str, options: Iterable[str] = ()) -> str:
    """Plain help text as Markdown: option names, commands and shapes as code, the rest escaped; a name
    in ``options`` (the program's own) links to its entry.

    Example:
        >>> print(markdown_text("exit 1 with --fail-on high; the [plot] extra; *not* a list", ["--fail-on"]))
        exit 1 with {option}`--fail-on` high; the `[plot]` extra; \\*not\\* a list
    """
    out, last = [], 0
    for match in _CODE.finditer(text):
        out.append(_MARKDOWN_SPECIAL.sub(r"\\\1", text[last:match.start()]))
        code = match.group(0)
        fence = "``" if "`" in code else "`"
        out.append(f"{'{option}' if code in options else ''}{fence}{code}{fence}")
        last = match.end()
    out.append(_MARKDOWN_SPECIAL.sub(r"\\\1", text[last:]))
    return "".join(out)


def _spelling(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """How the option is typed, argparse's own metavars: ``--png PATH``, ``--target {v100,t4}``, ``RUN``."""
    formatter = parser._get_formatter()
    if not action.option_strings:
        return formatter._format_args(action, action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    args = formatter._format_args(action, action.dest.upper())
    return ", ".join(f"{opt} {args}" for opt in action.option_strings)


def _fence(name: str, argument: str, body: list[str] = ()) -> list[str]:
    return [f"```{{{name}}} {argument}".rstrip(), *body, "```", ""]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{name: parser}`` of a parser's subcommands, in their order (empty without any)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def parser_markdown(parser: argparse.ArgumentParser) -> list[str]:
    """One parser's reference as MyST Markdown: its usage, description, every option (Sphinx's ``option``
    directive under a ``program``: rendered as a definition list, each with its own anchor) and its epilog.

    Subcommands are not included: each is documented where the page asks for it (``lsc-argparse SPEC
    NAME``), and the build warns about a subcommand that no page documents.
    """
    lines = _fence("program", parser.prog)
    options = {opt for action in parser._actions for opt in action.option_strings}
    if parser.description:
        lines += [markdown_text(parser.description, options), ""]
    lines += ["```text", *parser.format_usage().strip().splitlines(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction) and parser.prog.count(" "):
            continue  # a subcommand's -h is the command's, said once
        help_text = _help(parser, action)
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        lines += _fence("option", _spelling(parser, action), [markdown_text(help_text, options)])
    if parser.epilog:
        lines += [markdown_text(parser.epilog, options), ""]
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
    """``lsc-argparse SPEC [SUBCOMMAND]``: the reference of the parser that ``SPEC`` builds
    (``module:function`` or ``console:NAME:function``), or of one of its subcommands, as Markdown."""

    required_arguments = 1
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        spec = self.arguments[0]
        parser = parser_builder(spec)()
        documented = self.env.lsc_documented_commands = getattr(self.env, "lsc_documented_commands", {})
        if len(self.arguments) > 1:
            name = self.arguments[1]
            found = subcommands(parser)
            if name not in found:
                raise self.error(f"{spec} has no subcommand {name!r}; it has {sorted(found)}")
            parser = found[name]
            documented.setdefault(spec, {})[name] = self.env.docname
        container = nodes.container()
        self.state.nested_parse(StringList(parser_markdown(parser)), self.content_offset, container)
        return container.children


def _merge_documented(app: Sphinx, env: Any, docnames: list[str], other: Any) -> None:
    for spec, names in getattr(other, "lsc_documented_commands", {}).items():
        env.lsc_documented_commands = getattr(env, "lsc_documented_commands", {})
        env.lsc_documented_commands.setdefault(spec, {}).update(names)


def _purge_documented(app: Sphinx, env: Any, docname: str) -> None:
    for names in getattr(env, "lsc_documented_commands", {}).values():
        for name in [n for n, doc in names.items() if doc == docname]:
            del names[name]


def check_commands(app: Sphinx, env: Any) -> None:
    """Every subcommand of a parser that a page documents is documented on some page."""
    for spec, names in getattr(env, "lsc_documented_commands", {}).items():
        for name in subcommands(parser_builder(spec)()):
            if name not in names:
                LOGGER.warning("subcommand %s of %s has no reference: add ```{lsc-argparse} %s %s``` to a "
                               "page", name, spec, spec, name, type="lsc", subtype="command")


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
        # The page is made from the module: read it again when the module changes (an incremental build
        # would otherwise keep the old list, and the face check would miss a new name's entry).
        self.env.note_dependency(module.__file__)
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
    app.connect("env-check-consistency", check_commands)
    app.connect("env-merge-info", _merge_documented)
    app.connect("env-purge-doc", _purge_documented)
    app.connect("missing-reference", resolve_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
