"""Install hints that work for the way refattn itself was installed.

Owns one question: which ``pip install`` command brings an optional extra (``plot``,
``distributed``, ...) into *this* environment. A wheel or an index install takes
``pip install 'refattn[plot]'``; a checkout (an editable install, or ``pip install .`` of a
directory) cannot resolve that name from an index that may not hold refattn at all, so it gets
the checkout's own path. Code imported from a checkout (an editable install, or ``PYTHONPATH``)
is recognised by the ``pyproject.toml`` above the package; otherwise the installed
distribution's ``direct_url.json`` (PEP 610, read with :mod:`importlib.metadata`) says whether
it came from a local directory (``pip install /path``) or from an index or a wheel.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["install_hint"]


def _source_tree() -> Path | None:
    """The checkout this refattn is imported from (a directory with ``pyproject.toml`` above
    the package, outside ``site-packages``), if it is one."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and not {"site-packages", "dist-packages"} & set(
            root.parts):
        return root
    return None


def _checkout() -> tuple[Path, bool] | None:
    """(directory, editable) when refattn comes from a local directory, else None."""
    tree = _source_tree()
    if tree is not None:  # running from a checkout (editable install, or PYTHONPATH)
        return tree, True
    try:
        text = metadata.distribution("refattn").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if text is None:
        return None  # installed from an index: pip records no direct URL
    try:
        info = json.loads(text)
    except ValueError:
        return None
    url = urlparse(str(info.get("url", "")))
    if url.scheme != "file" or not isinstance(info.get("dir_info"), dict):
        return None  # a wheel or an archive: the index name resolves
    return Path(unquote(url.path)), bool(info["dir_info"].get("editable", False))


def install_hint(extra: str) -> str:
    """The ``pip install`` command that adds the optional ``extra`` to this environment.

    Parameters
    ----------
    extra : str
        The optional-dependency group of ``pyproject.toml`` (``"plot"``, ``"distributed"``).

    Returns
    -------
    str
        ``pip install -e "/path/to/checkout[plot]"`` for a checkout installed in editable mode
        (or a source tree on ``sys.path``), ``pip install "/path/to/checkout[plot]"`` for one
        installed from its directory, ``pip install 'refattn[plot]'`` otherwise.

    Examples
    --------
    >>> install_hint("plot").startswith("pip install ")
    True
    >>> "[plot]" in install_hint("plot")
    True
    """
    found = _checkout()
    if found is None:
        return f"pip install 'refattn[{extra}]'"
    path, editable = found
    return f'pip install {"-e " if editable else ""}"{path}[{extra}]"'
