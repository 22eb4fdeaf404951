"""Import paths users may hold from before the model core moved to glm5/core/ (`glm5.config`,
`glm5.model`) keep working for one release, each with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

MOVED = [
    ("glm5.config", "glm5.core.config", "GLM5Config"),
    ("glm5.model", "glm5.core.model", "GLM5ForCausalLM"),
]


@pytest.mark.parametrize("old,new,name", MOVED)
def test_the_old_path_warns_and_gives_the_same_objects(old, new, name, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .*import {new}") as record:
        __import__(old)  # as an import statement does (importlib.import_module would be the warning's caller)
    alias = sys.modules[old]
    assert record[0].filename == __file__  # the warning points at the importing line, not at importlib
    moved = importlib.import_module(new)
    assert getattr(alias, name) is getattr(moved, name)
    assert name in dir(alias)
    with pytest.raises(AttributeError):
        alias.no_such_name  # noqa: B018


@pytest.mark.parametrize("old,new,name", MOVED)
def test_from_import_of_the_old_path_works_in_a_fresh_process(old, new, name):
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        f"try:\n    from {old} import {name}\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
        f"warnings.simplefilter('ignore', DeprecationWarning)\nfrom {old} import {name}\n"
        f"import {new}\nassert {name} is {new}.{name}\nprint('same')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        f"warned: {old} is deprecated and goes in the next release: import {new}",
        "same",
    ]


def test_the_new_paths_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        importlib.import_module("glm5.core.config")
        importlib.import_module("glm5.core.model")
