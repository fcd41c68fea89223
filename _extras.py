"""The optional dependency groups (pip extras) and the error that names the one to install.

A plain install (``pip install .`` in the checkout) brings numpy and torch only: enough for ``affdiv.layers``. The
rest comes with extras (``pyproject.toml``)::

    affdiv[verify]        sympy, tqdm                     affdiv.theory, affdiv.verify, `affdiv verify`
    affdiv[experiments]   sympy, scipy, matplotlib,       affdiv.experiments, `affdiv falsify|analyse|probe`
                          scikit-learn, statsmodels, tqdm
    affdiv[bench]         scipy                           `affdiv bench layers` (affdiv.layers.benchmark)
    affdiv[dask]          dask, distributed               `affdiv falsify --executor dask`
    affdiv[all]           all of the above

Each sub-package that needs an extra calls :func:`require` before its imports, so that a missing
one fails with one line naming the extra instead of a bare ``No module named 'sympy'``. tqdm
draws the sweep's progress (``affdiv.experiments``, which requires it); ``affdiv verify`` uses it
where it is installed and runs without a bar where it is not.
"""

from __future__ import annotations

import importlib.util
import sys

# extra -> the top-level import names it provides (pyproject.toml's optional-dependencies)
EXTRAS = {
    "verify": ("sympy", "mpmath"),
    "experiments": ("sympy", "mpmath", "scipy", "matplotlib", "sklearn", "statsmodels", "tqdm"),
    "bench": ("scipy",),
    "dask": ("dask", "distributed"),
}


class MissingExtra(ModuleNotFoundError):
    """A module of an optional dependency group is not installed; the message names the extra."""


def available(module: str) -> bool:
    """Whether ``module`` (a top-level import name) can be imported, without importing it."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: marked unimportable (as tests do)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(extra: str) -> str:
    """How to install ``extra``: by its name, and from a checkout (affdiv is not on a package index)."""
    return (f"pip install 'affdiv[{extra}]' "
            f"(from a checkout of affdiv: pip install --no-build-isolation -e '.[{extra}]')")


def require(*modules: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming ``affdiv[extra]`` unless every import name in ``modules``
    is installed. ``feature`` is what needs them, e.g. ``"affdiv.verify"``."""
    missing = [m for m in modules if not available(m)]
    if missing:
        names = ", ".join(missing)
        raise MissingExtra(
            f"{feature} needs {names}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"{install_hint(extra)}",
            name=missing[0],
        )


def missing_extra(error: ModuleNotFoundError, *, extra: str, feature: str) -> ModuleNotFoundError:
    """For ``except ModuleNotFoundError as error: raise missing_extra(error, ...) from None`` around an
    optional import: a :class:`MissingExtra` naming ``affdiv[extra]`` when the missing module is one of
    that extra's, else ``error`` itself."""
    top = (error.name or "").partition(".")[0]
    if top in EXTRAS.get(extra, ()):
        return MissingExtra(
            f"{feature} needs {top}, which is not installed: {install_hint(extra)}", name=top
        )
    return error
