"""The installed package: importable as a user installs it, typed, documented."""

from __future__ import annotations

import inspect
from pathlib import Path

import dbuf
import dbuf.torch

SOURCE = Path(__file__).resolve().parents[1] / "dbuf"


def test_the_tests_run_against_the_installed_package():
    # pip install ./python, not the source tree (which has no native core).
    assert Path(dbuf.__file__).resolve().parent != SOURCE
    assert Path(dbuf._dbuf.__file__).name.startswith("_dbuf.")


def test_type_stubs_and_marker_are_installed():
    package = Path(dbuf.__file__).parent
    assert (package / "py.typed").exists()
    stubs = (package / "_dbuf.pyi").read_text()
    for name in ("class Client", "def register_group", "class TensorView", "def plan_unit", "def reduce_scatter"):
        assert name in stubs, name
    # Docstrings reach the stubs, for editors.
    assert "Collective: returns once every rank registered the same group" in stubs


def test_every_public_name_exists_and_is_documented():
    for module in (dbuf, dbuf.torch):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
                assert (value.__doc__ or "").strip(), f"{module.__name__}.{name} has no docstring"
    for method in ("attach", "register_group", "barrier", "noop", "detach", "close"):
        assert getattr(dbuf.Client, method).__doc__
    for method in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "unshard", "reshard", "shard_view"):
        assert getattr(dbuf.Group, method).__doc__
