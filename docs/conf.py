"""Sphinx configuration: Markdown pages (myst-parser), the API reference from the docstrings (autodoc with
napoleon for the Args/Raises/Example sections), the furo theme. Build with ``python3 dev.py docs``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
# Quiet framework imports during autodoc; the Keras face is documented as Keras 3 on TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from lossscale_callbacks import __version__  # noqa: E402

project = "lossscale-callbacks"
author = "lossscale-callbacks contributors"
copyright = "lossscale-callbacks contributors, Apache-2.0"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
    "lsc_docs",
    "lsc_figures",  # the concepts page's pictures, drawn from the code at every build
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# Straight quotes and dashes everywhere: a user copies `--json`, `pip install "..."` and the error messages
# the troubleshooting page quotes, and searches the logs for them (MyST's smartquotes extension is off too).
smartquotes = False

html_theme = "furo"
html_static_path = ["_static"]
html_css_files = ["lsc.css"]  # output blocks wrap at the column
html_title = f"lossscale-callbacks {release}"

# The API pages document the package faces; members in __all__ order as the source lists them.
autodoc_default_options = {"members": True, "member-order": "bysource", "undoc-members": True}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a NamedTuple's Attributes beside its fields would be documented twice

nitpicky = True
# No intersphinx (the build runs offline): references into the frameworks render as code. Our own
# references are checked by lsc_docs (a face name links to its entry; another name must import).
nitpick_ignore_regex = [
    ("py:.*", r"(torch|keras|tensorflow|tf|jax|lightning|pytorch_lightning|accelerate|transformers|wandb|"
              r"tensorboard|numpy|np|argparse|collections|typing|types|os|pathlib|enum|dataclasses|"
              r"contextlib|abc|logging|warnings)(\..*)?"),
]

# Faces that are modules inside a package rather than packages of their own (the packages are read
# from pyproject.toml): every name in their __all__ must have an API entry too.
lsc_extra_faces = ["lossscale_callbacks.lightning.fabric", "lossscale_callbacks.extend",
                   "lossscale_callbacks.integration", "lossscale_callbacks.torch.integration",
                   "lossscale_callbacks.testing"]
