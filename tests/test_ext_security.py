"""The extension is loaded only from a build directory that no other user can change.

Loading a compiled library runs its code in this process: whoever can write the directory it is
loaded from can run code as the user who loads it. ssh refuses key files that others can write,
for the same reason; so does minidp, before torch builds or loads anything there.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from minidp import ext

ANOTHER_USER = 65534  # "nobody" on most systems


@dataclass
class Extensions:
    root: Path  # TORCH_EXTENSIONS_DIR
    loaded: list[str] = field(default_factory=list)  # the build directories torch was asked to load from


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Extensions:
    """TORCH_EXTENSIONS_DIR in a fresh directory; torch's build-and-load replaced by a recorder."""
    found = Extensions(tmp_path / "torch_extensions")
    found.root.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(found.root))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: found.loaded.append(kwargs.get("build_directory")) or "module")
    monkeypatch.setattr(ext, "_module", None)
    monkeypatch.setattr(ext, "_failure", None)
    monkeypatch.delenv("MINIDP_EXT", raising=False)
    return found


def test_a_directory_of_your_own_is_the_one_loaded_from(extensions):
    assert ext._build(verbose=False) == "module"
    [build_directory] = extensions.loaded
    assert os.path.dirname(build_directory) == str(extensions.root.resolve())


def test_a_build_directory_every_user_can_write_is_refused(extensions):
    previous = os.umask(0)  # torch creates the build directory rwxrwxrwx
    try:
        with pytest.raises(PermissionError, match="every user can write to it: drwxrwxrwx") as error:
            ext._build(verbose=False)
    finally:
        os.umask(previous)
    assert "chmod o-w" in str(error.value) and "TORCH_EXTENSIONS_DIR" in str(error.value)
    assert extensions.loaded == []


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False)], ids=["writable by all", "sticky, as /tmp"])
def test_a_directory_above_it_that_every_user_can_write_is_refused_unless_sticky(extensions, mode, refused):
    """With the sticky bit only an entry's owner may rename or remove it, so nobody can swap the build directory."""
    extensions.root.chmod(mode)
    if refused:
        with pytest.raises(PermissionError, match=f"can change {extensions.root.resolve()} "):
            ext._build(verbose=False)
    else:
        ext._build(verbose=False)
    assert len(extensions.loaded) == (0 if refused else 1)


def test_a_directory_another_user_owns_is_refused(extensions, monkeypatch):
    if os.getuid() == 0:  # root can hand the directory to another user
        os.chown(extensions.root, ANOTHER_USER, -1)
    else:  # anyone else can only be another user, for the check
        me = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: me + 1)
    with pytest.raises(PermissionError, match="belongs to uid .*, not to you .* or root") as error:
        ext._build(verbose=False)
    assert "TORCH_EXTENSIONS_DIR" in str(error.value)
    assert extensions.loaded == []


def test_a_refused_directory_means_the_torch_backend_with_a_warning(extensions):
    extensions.root.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="refusing to load the minidp extension"):
        assert not ext.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ext.is_loaded()
    assert extensions.loaded == []


def test_a_refused_directory_raises_when_the_extension_is_required(extensions, monkeypatch):
    monkeypatch.setenv("MINIDP_EXT", "1")
    extensions.root.chmod(0o777)
    with pytest.raises(RuntimeError, match="refusing to load the minidp extension"):
        ext.is_available()
