"""Networks of one's own in a study: a method whose model is built by a factory function.

A preset's ``[method.NAME] model = "SPEC"`` names the factory, called as

    function(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module

with ``input_shape`` a sample's shape (e.g. (1, 28, 28)) and the number of classes; the module
returns logits (N, num_classes) and is initialised by the call (the harness seeds torch before
it, so each seed gives its own init). SPEC is ``package.module:function`` (a module file of the
working directory first, so a local ``code.py`` is not the standard library's ``code``; else
importable, the working directory first on the import path) or ``path/to/file.py:function`` (a relative path from
the working directory). On a Dask cluster the file must lie at the same path on every worker.

The factory's source file enters each run's key through ``model_digest`` (its SHA-256), set when
a preset's runs are planned: an edited factory file makes new runs, and a worker refuses a file
that changed after the plan. Only that file is fingerprinted: code it imports from elsewhere is
not, so a network defined in another module should be edited together with a change to the
factory's file (or given a new method name).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path


def _split(spec: str) -> tuple[str, str]:
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"model must be 'package.module:function' or 'path/to/file.py:function', got {spec!r}")
    return where, name


def check_spec(spec: str) -> None:
    """Refuse a factory spec of the wrong form (without importing anything)."""
    _split(spec)


def _file_module(path: Path):
    """The module of file ``path`` as it is now: loaded under a name of its path and content, so an
    edited file is loaded anew, never paired with a digest of other code."""
    source = path.read_bytes()
    name = "affdiv_factory_" + hashlib.sha256(str(path.resolve()).encode() + b"\0" + source).hexdigest()[:16]
    if name not in sys.modules:  # compiled from the bytes read (no bytecode cache: it goes by mtime)
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        try:
            exec(compile(source, str(path), "exec"), module.__dict__)
        except Exception as error:  # the user's file: whatever it raises is bad input, named with it
            del sys.modules[name]
            raise ValueError(f"model {path}: running it failed: {type(error).__name__}: {error}") from None
    return sys.modules[name]


def load_module(where: str):
    """The module ``where`` names: a file ``*.py``; a module file of the working directory
    (``where.py``, found first, so that a local ``code.py`` is not the standard library's
    ``code``); else an importable module (the working directory first on the import path, as
    ``python -m`` has it), reloaded if its source changed since this process imported it."""
    if where.endswith(".py") or Path(f"{where}.py").is_file():
        path = Path(where if where.endswith(".py") else f"{where}.py")
        if not path.is_file():
            raise FileNotFoundError(f"model {where}: no such file")
        return _file_module(path)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as error:
        raise ValueError(f"model {where}: cannot import it ({error})") from None
    except Exception as error:  # the user's module: whatever it raises on import is bad input
        raise ValueError(f"model {where}: importing it failed: {type(error).__name__}: {error}") from None
    source = inspect.getsourcefile(module)
    if source is not None and _IMPORTED.setdefault(where, Path(source).read_bytes()) != Path(source).read_bytes():
        module = importlib.reload(module)
        _IMPORTED[where] = Path(source).read_bytes()
    return module


_IMPORTED: dict[str, bytes] = {}  # module name -> its source when this process imported it


def resolve(spec: str) -> tuple[Callable, str]:
    """(the factory, the SHA-256 of its source file); a one-line error for a spec that does not
    name a callable."""
    where, name = _split(spec)
    module = load_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"model {spec}: {where} has no function {name!r}")
    source = inspect.getsourcefile(module)
    if source is None:
        raise ValueError(f"model {spec}: its module has no source file to fingerprint")
    return factory, hashlib.sha256(Path(source).read_bytes()).hexdigest()


def build(spec: str, digest: str | None, input_shape: tuple[int, ...], num_classes: int):
    """The factory's network for ``input_shape`` and ``num_classes``, after checking that its
    source is still the one the runs were planned with (``digest``; None: not checked)."""
    import torch

    factory, found = resolve(spec)
    if digest is not None and found != digest:
        raise ValueError(f"model {spec}: its source changed since the runs were planned (SHA-256 {found[:12]}, "
                         f"planned {digest[:12]}); plan them again")
    model = factory(tuple(input_shape), int(num_classes))
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model {spec}: returned {type(model).__name__}, expected a torch.nn.Module")
    return model
