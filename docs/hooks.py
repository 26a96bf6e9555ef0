"""MkDocs hooks of refattn's documentation site (``mkdocs.yml`` names this file).

Everything a page shows that the code can say is generated at build time, so it cannot drift:

- ``api/<package>.md``: one API reference page per public package, listing every name of the
  package's ``__all__`` as a mkdocstrings ``:::`` block (the lazily re-exporting packages,
  ``refattn.testing`` and ``refattn.bundle``, point at the module that owns each name);
- ``figures/*.png``: the pictures of ``refattn plot`` for two conformance cases, computed by
  the exact generator and drawn by :mod:`refattn.plot` (needs matplotlib, in the ``docs`` and
  ``test`` extras);
- ``<!-- refattn-help COMMAND -->`` in a page becomes the text of ``refattn COMMAND --help``;
- ``<!-- schema NAME -->`` becomes the published JSON Schema ``refattn/bundle/schema/NAME``;
- the docstrings' Sphinx roles (``:class:`~refattn.X``` and the like, which numpydoc readers of
  the source expect) render as code names, linked to the API entry they name where there is
  one, instead of showing the role;
- the nav entries of pages other engineers own (:data:`OPTIONAL_PAGES`) are dropped while the
  page does not exist yet, so the strict build does not depend on their schedule.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: the API reference: page name -> (title, package)
API = {
    "refattn": ("refattn: calls, forward, backward", "refattn"),
    "call": ("refattn.call: the call description", "refattn.call"),
    "masks": ("refattn.masks: visibility relations", "refattn.masks"),
    "dropout": ("refattn.dropout: Philox multipliers", "refattn.dropout"),
    "softmax": ("refattn.softmax: the row softmax", "refattn.softmax"),
    "states": ("refattn.states: merging attention states", "refattn.states"),
    "rope": ("refattn.rope: rotary embeddings", "refattn.rope"),
    "engine": ("refattn.engine: backends and traces", "refattn.engine"),
    "bundle": ("refattn.bundle: golden bundles", "refattn.bundle"),
    "quant": ("refattn.quant: quantised attention (FP8, INT8)", "refattn.quant"),
    "sparse": ("refattn.sparse: attention by index lists", "refattn.sparse"),
    "testing": ("refattn.testing: the pytest plugin", "refattn.testing"),
    "adapters": ("refattn.adapters: PyTorch, JAX, ONNX, NumPy", "refattn.adapters"),
    "distributed": ("refattn.distributed: Dask", "refattn.distributed"),
    "gradcheck": ("gradcheck: the gradient checker", "gradcheck"),
}

#: pages other engineers write; listed in the nav only once they exist
OPTIONAL_PAGES = ("gpu.md", "gpu-model.md", "verify.md", "reliability.md", "lowerings.md",
                  "EXACT_ROUNDING.md")

#: figures: file name -> (case of the conformance suite, which picture)
FIGURES = {
    "causal_lower_right_q3_k7_visible.png": ("causal_lower_right_q3_k7", "visible"),
    "causal_lower_right_q3_k7_probs.png": ("causal_lower_right_q3_k7", "probs"),
    "causal_lower_right_q3_k7_error_output.png": ("causal_lower_right_q3_k7", "error"),
    "sliding_window_causal_incl3_probs.png": ("sliding_window_causal_incl3", "probs"),
}


def api_page(title: str, package: str) -> str:
    """The markdown of one API page: the package's docstring, then each public name."""
    module = importlib.import_module(package)
    owners = getattr(module, "_OWNERS", {})  # lazily re-exporting packages
    lines = [f"# {title}", "", f"::: {package}", "    options:", "      members: false", ""]
    for name in module.__all__:
        if name.startswith("_") or name.isupper():  # __version__, constants
            continue
        owner = owners.get(name, package)
        if not owner.startswith(("refattn", "gradcheck")):
            owner = f"{package}.{owner}"
        lines += [f"::: {owner}.{name}", "    options:", "      heading_level: 2", ""]
    return "\n".join(lines)


def figures() -> dict[str, bytes]:
    """The PNG bytes of :data:`FIGURES`, drawn by ``refattn plot``'s own functions."""
    import numpy as np

    from refattn.bundle.golden.spec import case_spec
    from refattn.bundle.suites import build_suite
    from refattn.plot import plot_case, plot_error

    wanted = {case for case, _ in FIGURES.values()}
    specs = {c.case_id: case_spec(c) for c in build_suite("conformance") if c.case_id in wanted}
    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, spec in specs.items():
            plot_case(spec, tmp)
            if (case, "error") in FIGURES.values():  # a float32 kernel, one element off
                mine = spec.tensors["output"].astype(np.float32)  # (B, Hq, Q, Dv)
                mine[0, 1, 2, 3] += 0.01
                plot_error(spec, {"output": mine}, tmp)
        for name in FIGURES:
            out[name] = (Path(tmp) / name).read_bytes()
    return out


def cli_help(command: str) -> str:
    """``refattn COMMAND --help`` as printed in an 100-column terminal."""
    from refattn.cli import main

    buffer = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(buffer):
            code = main([command, "--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    if code != 0:
        raise RuntimeError(f"refattn {command} --help exited {code}")
    return buffer.getvalue()


def _drop_missing(nav: list[Any], docs: Path) -> list[Any]:
    out = []
    for item in nav:
        if isinstance(item, dict):
            (title, value), = item.items()
            if isinstance(value, list):
                value = _drop_missing(value, docs)
            elif isinstance(value, str) and value in OPTIONAL_PAGES and not (
                    docs / value).is_file():
                continue
            out.append({title: value})
        else:
            out.append(item)
    return out


# -- the hooks --------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    config["nav"] = _drop_missing(config["nav"], Path(config["docs_dir"]))
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page, (title, package) in API.items():
        files.append(File.generated(config, f"api/{page}.md", content=api_page(title, package)))
    for name, data in figures().items():
        files.append(File.generated(config, f"figures/{name}", content=data))
    return files


_HELP = re.compile(r"<!-- refattn-help (\w+) -->")
_SCHEMA = re.compile(r"<!-- schema ([\w.-]+\.json) -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = _HELP.sub(lambda m: f"```text\n{cli_help(m.group(1))}```", markdown)
    schema_dir = ROOT / "refattn" / "bundle" / "schema"
    return _SCHEMA.sub(
        lambda m: f"```json\n{(schema_dir / m.group(1)).read_text().rstrip()}\n```", markdown)


_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain_role(m: re.Match[str]) -> str:
    """A role as its code name; a dotted one links to its API entry where the site has one
    (an optional autoref: unresolved, it stays plain text and raises no warning)."""
    target = m.group(2).removesuffix("()")
    name = m.group(2).split(".")[-1] if m.group(1) else m.group(2)  # ~a.b.c reads as c
    if "." not in target:
        return f"<code>{name}</code>"
    return f'<autoref identifier="{target}" optional><code>{name}</code></autoref>'


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub(_plain_role, html)
