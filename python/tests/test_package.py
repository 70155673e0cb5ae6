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


def _imports_of(path: Path, package: str) -> set[str]:
    """The modules of `package` that `path` imports, under TYPE_CHECKING and inside functions too."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 and module:  # from ._unit import Unit
                found.add(module.split(".")[0])
            elif node.level == 1 or module == package:  # from . import _unit / from dbuf.torch import _unit
                found.update(alias.name for alias in node.names)
            elif module.startswith(package + "."):  # from dbuf.torch._unit import Unit
                found.add(module.removeprefix(package + ".").split(".")[0])
        elif isinstance(node, ast.Import):  # import dbuf.torch._unit
            found.update(alias.name.removeprefix(package + ".").split(".")[0]
                         for alias in node.names if alias.name.startswith(package + "."))
    return found


def test_dbuf_torch_modules_import_one_way():
    # A cycle, even one only a type checker follows, means two modules hold one design between them.
    folder = SOURCE / "torch"
    modules = {path.stem: _imports_of(path, "dbuf.torch") & {p.stem for p in folder.glob("*.py")}
               for path in folder.glob("*.py") if path.stem != "__init__"}
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(trail + [module])
        state[module] = "open"
        for imported in sorted(modules.get(module, ())):
            visit(imported, trail + [module])
        state[module] = "done"

    assert {"_session", "_unit"} <= modules.keys()
    assert "_session" in modules["_unit"] and "_unit" not in modules["_session"]
    for module in sorted(modules):
        visit(module, [])


def test_a_torch_release_dbuf_torch_is_not_tested_with_is_refused_at_import():
    import pytest

    from dbuf.torch import _torch_version

    _torch_version.check("2.15.0")
    _torch_version.check("2.15.2+cu130")
    for untested in ("2.14.1", "2.16.0", "3.0.0a0", "nonsense"):
        with pytest.raises(ImportError, match="tested with torch 2.15"):
            _torch_version.check(untested, override="")
    _torch_version.check("2.16.0", override="1")  # $DBUF_TORCH_UNTESTED=1: at the user's risk


def test_torch_functions_dbuf_changes_are_wrapped_and_a_missing_one_fails_loudly():
    import functools
    import types

    import pytest
    import torch.distributed as dist
    import torch.distributed._state_dict_utils as state_dict_utils
    import torch.distributed.tensor as tensor_api

    from dbuf.torch import _patch

    for owner, name in ((dist, "destroy_process_group"), (tensor_api, "distribute_tensor"),
                        (state_dict_utils, "_distribute_tensors")):
        wrapper = getattr(owner, name)
        original = wrapper.__wrapped__
        assert wrapper.__name__ == original.__name__ == name and wrapper.__doc__ == original.__doc__, name
        assert inspect.signature(wrapper) == inspect.signature(original), name
    assert dist.distributed_c10d.destroy_process_group is dist.destroy_process_group
    with pytest.raises(ImportError, match="no renamed_away"):
        _patch.wrap([types.ModuleType("torch_like")], "renamed_away", lambda original: functools.partial(original))
