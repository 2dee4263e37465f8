"""Sphinx configuration of the API reference (built by tools/build_docs.sh with warnings as errors)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

project = "ascend_dualpath"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpy docstrings carry shapes and dtypes; the signatures stay short
autodoc_default_options = {"members": False}
# optional runtimes the documented modules import lazily or at the top; none is needed to read the docstrings
autodoc_mock_imports = ["torch_npu", "triton", "vllm"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
