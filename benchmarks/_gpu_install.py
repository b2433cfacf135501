"""The GPU command's first part: install the project on a machine without network access.

A virtual environment is made beside the checkout (``.gpu-run/venv``) that sees the machine's own
packages (torch, Lightning, pytest... from the system, or from the virtual environment the command
was started in), so nothing the machine has is changed or downloaded. Into it, with ``--no-index``:

* ``setuptools`` from the carried wheels when the machine has none, or one older than the project's
  build needs (``[build-system] requires`` in ``pyproject.toml``): a bare Python 3.12 has pip and no
  setuptools;
* the project, editable (``pip install --no-deps --no-build-isolation -e .``), or a carried wheel of
  it when setuptools cannot be had;
* ``keras`` from the carried wheels, when one is there (its dependencies from the same folder or the
  machine).

Every step says what it did; a failure says what to carry (``docs/gpu.md``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomllib

PIP = ("-m", "pip", "install", "--no-index", "--disable-pip-version-check", "--no-input", "-q")


class InstallError(RuntimeError):
    """The project could not be installed; the message says what to carry."""


@dataclass
class Installed:
    """What the install part did: the interpreter to run everything with (its steps went to ``log``)."""

    python: Path
    keras: str | None = None  # the Keras version installed or found, None without Keras


def build_requirement(root: Path) -> tuple[str, tuple[int, ...]]:
    """The build backend's package and its minimum version, from ``pyproject.toml``.

    Example:
        >>> from pathlib import Path
        >>> build_requirement(Path(__file__).resolve().parents[1])[0]
        'setuptools'
    """
    requires = tomllib.loads((root / "pyproject.toml").read_text())["build-system"]["requires"]
    for requirement in requires:
        match = re.fullmatch(r"\s*setuptools\s*(?:>=\s*([\d.]+))?\s*", requirement)
        if match:
            return "setuptools", version_tuple(match.group(1) or "0")
    raise InstallError(f"pyproject.toml's build-system requires {requires}: no setuptools requirement found")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"80.9.0"`` -> ``(80, 9, 0)``; a suffix such as ``rc1`` or ``.post1`` ends the numbers."""
    numbers = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(numbers)


def find_wheel(folder: Path | None, project: str) -> Path | None:
    """The newest-named wheel of ``project`` in ``folder`` (wheel names spell ``-`` as ``_``)."""
    if folder is None or not folder.is_dir():
        return None
    stem = re.sub(r"[-_.]+", "_", project).lower()
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-"))
    return found[-1] if found else None


def installed_version(python: Path, package: str) -> str | None:
    """The version of ``package`` that ``python`` sees, or None."""
    code = ("import importlib.metadata as m, sys\ntry: print(m.version(sys.argv[1]))\n"
            "except m.PackageNotFoundError: pass")
    done = subprocess.run([str(python), "-c", code, package], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None


def make_venv(folder: Path) -> Path:
    """A virtual environment at ``folder`` that sees this interpreter's packages; returns its Python.

    System site-packages cover a system Python; when this interpreter is itself a virtual
    environment, a ``.pth`` file adds its site-packages too (a nested venv would not see them). pip
    comes from there as well: no ``ensurepip``, which some system Pythons lack.
    """
    builder = venv.EnvBuilder(system_site_packages=True, with_pip=False, clear=False)
    builder.create(folder)
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if sys.prefix != sys.base_prefix:
        inner = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        outer = sysconfig.get_path("purelib")
        # Named to be read last: the environment's own installs come first.
        Path(inner, "zz_outer_site.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    return python


def pip_install(python: Path, args: list[str], wheels: Path | None, log: Callable[[str], None]) -> None:
    """``pip install --no-index`` into ``python``'s environment; InstallError with pip's words on failure."""
    command = [str(python), *PIP, *(["--find-links", str(wheels)] if wheels else []), *args]
    log("$ " + " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise InstallError(f"pip install {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def ensure_setuptools(root: Path, python: Path, wheels: Path | None, log: Callable[[str], None]) -> bool:
    """Make a recent enough setuptools importable in ``python``; False when none can be had."""
    name, minimum = build_requirement(root)
    have = installed_version(python, name)
    wanted = ".".join(map(str, minimum))
    if have is not None and version_tuple(have) >= minimum:
        log(f"{name} {have} is installed (the build needs >= {wanted})")
        return True
    wheel = find_wheel(wheels, name)
    if wheel is None:
        log(f"{name} {have or 'is missing'}; the build needs >= {wanted} and no {name} wheel was carried")
        return False
    pip_install(python, [f"{name}>={wanted}"], wheels, log)
    log(f"{name} {installed_version(python, name)} installed from {wheel.name} (the machine had "
        f"{have or 'none'})")
    return True


def install_project(root: Path, python: Path, wheels: Path | None, log: Callable[[str], None]) -> None:
    """The project, editable when setuptools allows, else from a carried wheel of it."""
    if ensure_setuptools(root, python, wheels, log):
        pip_install(python, ["--no-deps", "--no-build-isolation", "-e", str(root)], None, log)
        log("lossscale-callbacks installed editable from this checkout")
    else:
        wheel = find_wheel(wheels, "lossscale-callbacks")
        if wheel is None:
            raise InstallError("cannot install the project: no recent setuptools here and none carried. "
                               "Put a setuptools wheel (or a wheel of the project) in the --wheels folder: "
                               "see docs/gpu.md")
        pip_install(python, ["--no-deps", "--force-reinstall", str(wheel)], None, log)
        log(f"lossscale-callbacks installed from {wheel.name} (not editable: tests use this wheel)")
    code = "import lossscale_callbacks.torch, lossscale_callbacks; print(lossscale_callbacks.__file__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise InstallError(f"the installed project does not import:\n{done.stderr[-3000:]}")
    log(f"lossscale_callbacks imports from {done.stdout.strip()}")


def install(root: Path, venv_dir: Path | None, wheels: Path | None, log: Callable[[str], None]) -> Installed:
    """The whole install part: the environment, the project, Keras when carried.

    Args:
        root: the checkout.
        venv_dir: where to make the virtual environment; None installs into this interpreter.
        wheels: the folder of carried wheels, or None.
        log: receives one line per step.

    Raises:
        InstallError: the project cannot be installed (the message says what to carry).
    """
    python = make_venv(venv_dir) if venv_dir is not None else Path(sys.executable)
    outcome = Installed(python)
    log(f"environment: {'virtual environment ' + str(venv_dir) if venv_dir else 'this interpreter'}, "
        f"Python {sys.version.split()[0]}")
    install_project(root, python, wheels, log)
    outcome.keras = installed_version(python, "keras")
    keras_wheel = find_wheel(wheels, "keras")
    if outcome.keras is None and keras_wheel is not None:
        try:
            pip_install(python, [str(keras_wheel)], wheels, log)
            outcome.keras = installed_version(python, "keras")
            log(f"keras {outcome.keras} installed from {keras_wheel.name}")
        except InstallError as exc:  # the Keras parts are skipped; the rest runs
            log(f"keras could not be installed from the carried wheels (its parts are skipped): {exc}")
    elif outcome.keras is None:
        log("no keras here and no keras wheel carried: the Keras parts are skipped")
    return outcome
