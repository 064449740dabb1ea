"""The one native-build helper: the cache folder's one variable, a build at first use keyed by what it depends on,
atomic installs, and errors that name the compiler and the way out."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from lightning_gh import _native

needs_cc = pytest.mark.skipif(_native.find_compiler("c") is None, reason="needs a C compiler")

GOOD = "int lgh_answer(void) { return 42; }\n"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LGH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path / "cache"


def _source(tmp_path: Path, text: str = GOOD, name: str = "answer.c") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_cache_dir_reads_one_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("LGH_CACHE_DIR", str(tmp_path / "x"))
    monkeypatch.setenv("LIGHTNING_GH_CACHE", str(tmp_path / "old"))  # the retired name is not read
    assert _native.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("LGH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native.cache_dir() == tmp_path / "xdg" / "lightning_gh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _native.cache_dir() == Path.home() / ".cache" / "lightning_gh"


def test_package_sources_are_found():
    for package, rel in (("lightning_gh.superoffload", "csrc/adamw.c"), ("lightning_gh.unified", "csrc/managed.cpp")):
        src = _native.package_source(package, rel)
        assert src.is_file() and src.read_bytes()


@pytest.mark.parametrize("env_cc, want", [(None, ["gcc", "cc"]), ("/opt/my-cc", ["/opt/my-cc"])])
def test_compiler_candidates(monkeypatch, env_cc, want):
    if env_cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", env_cc)
    assert _native.compiler_candidates("c") == want
    with pytest.raises(ValueError, match=r"language='fortran' is not a source language; allowed: \['c', 'c\+\+'\]"):
        _native.compiler_candidates("fortran")


@needs_cc
def test_built_once_cached_and_keyed_by_flags(cache, tmp_path):
    src = _source(tmp_path)
    path = _native.build_shared_library(src, "lgh_answer", ["-O2", "-fPIC", "-shared"])
    assert path.parent == cache and path.name.startswith("lgh_answer-") and path.suffix == ".so"
    assert path.with_suffix(".log").read_text().startswith("$ ")
    stamp = path.stat().st_mtime_ns
    assert _native.build_shared_library(src, "lgh_answer", ["-O2", "-fPIC", "-shared"]) == path
    assert path.stat().st_mtime_ns == stamp  # found in the cache, not rebuilt
    other = _native.build_shared_library(src, "lgh_answer", ["-O1", "-fPIC", "-shared"])
    assert other != path  # other flags: another library
    src.write_text(GOOD.replace("42", "43"))
    assert _native.build_shared_library(src, "lgh_answer", ["-O2", "-fPIC", "-shared"]) not in (path, other)
    import ctypes

    assert ctypes.CDLL(str(path)).lgh_answer() == 42
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]


@needs_cc
def test_concurrent_builds_install_one_library(cache, tmp_path):
    src = _source(tmp_path)
    out: list[Path] = []
    threads = [threading.Thread(target=lambda: out.append(
        _native.build_shared_library(src, "lgh_answer", ["-O2", "-fPIC", "-shared"], force=True))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and len(set(out)) == 1 and out[0].is_file()
    assert sorted(p.name for p in cache.iterdir() if p.suffix in (".so", ".tmp")) == [out[0].name]


@needs_cc
def test_a_failed_compile_names_the_compiler_and_leaves_nothing(cache, tmp_path):
    src = _source(tmp_path, "this is not C\n")
    with pytest.raises(_native.NativeBuildError) as e:
        _native.build_shared_library(src, "lgh_broken", ["-fPIC", "-shared"])
    msg = str(e.value)
    cc = _native.find_compiler("c")
    assert f"building lgh_broken with {cc} failed (exit code" in msg and "Set $CC to another C compiler" in msg
    assert not list(cache.glob("*.so")) and not list(cache.glob("*.tmp")) and list(cache.glob("lgh_broken-*.log"))


def test_no_compiler_is_one_clear_error(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(_native.NativeBuildError, match=r"lgh_x needs a C compiler and none was found \(looked for "
                                                       r"\$CC='no-such-compiler-here'\).*set \$CC to one"):
        _native.build_shared_library(_source(tmp_path), "lgh_x", ["-shared"])
    monkeypatch.delenv("CC")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(_native.NativeBuildError, match=r"C\+\+ compiler and none was found \(looked for g\+\+, c\+\+, "
                                                       r"clang\+\+ on PATH\)"):
        _native.build_shared_library(_source(tmp_path, name="x.cpp"), "lgh_x", ["-shared"])


def test_unwritable_cache_says_which_variable_to_set(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LGH_CACHE_DIR", str(blocker / "sub"))
    with pytest.raises(_native.NativeBuildError, match=r"cannot create the build cache folder .* set \$LGH_CACHE_DIR"):
        _native.build_shared_library(_source(tmp_path), "lgh_x", ["-shared"], compiler="cc")


def test_a_source_that_is_not_c_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"source='x.f90' has no C or C\+\+ suffix"):
        _native.build_shared_library(_source(tmp_path, name="x.f90"), "lgh_x")
