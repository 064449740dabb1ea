"""Build a small C or C++ shared library with the system compiler at first use, and keep it in a per-user cache.

Two parts ship C sources as package data and build them on the user's machine: SuperOffload's CPU AdamW kernel
(``superoffload/csrc/adamw.c``) and the managed-memory allocator shim (``unified/csrc/managed.cpp``). Both go
through :func:`build_shared_library`, which

* names the library after a hash of the source, the flags, the compiler (its path and file stamp) and the
  machine's architecture, so a changed source, flag or compiler builds a new library and never loads a stale one;
* keeps it in :func:`cache_dir` (``$LGH_CACHE_DIR``, the package's one cache variable);
* compiles into a private temporary file and renames it into place, so that concurrent builds (DDP ranks on one
  host) never load a half-written library: each rename installs an identical file;
* writes the compiler's command and output next to the library (``<name>-<hash>.log``) and, on failure, raises a
  :class:`NativeBuildError` that names the compiler, its exit code and the way out.

Nothing here runs at import time.

Example::

    >>> from lightning_gh import _native
    >>> _native.compiler_candidates("c")[-2:]
    ['gcc', 'cc']
    >>> src = _native.package_source("lightning_gh.unified", "csrc/managed.cpp")
    >>> src.name
    'managed.cpp'
    >>> _native.build_shared_library(src, "lgh_managed", ["-O2", "-fPIC", "-shared", "-I/usr/local/cuda/include"],
    ...                              link_flags=["-lcudart"])  # doctest: +SKIP
    PosixPath('/home/me/.cache/lightning_gh/lgh_managed-0123456789abcdef.so')
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable

from lightning_gh import hardware
from lightning_gh._util import env

__all__ = ["NativeBuildError", "build_shared_library", "cache_dir", "compiler_candidates", "find_compiler",
           "package_source"]

#: The source languages :func:`find_compiler` knows, with the variable that names the user's compiler and the
#: compilers looked for on ``PATH`` after it.
_COMPILERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "c": ("CC", ("gcc", "cc")),
    "c++": ("CXX", ("g++", "c++", "clang++")),
}
_SUFFIXES = {".c": "c", ".cc": "c++", ".cpp": "c++", ".cxx": "c++"}


class NativeBuildError(RuntimeError):
    """A native library could not be built here: no compiler, an unwritable cache folder, or a failed compile.
    The message names the compiler and the way out."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LGH_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_gh``, else
    ``~/.cache/lightning_gh``. Read on every call (tests and users may point it elsewhere at run time)."""
    root = env("CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_gh"


def package_source(package: str, relative: str) -> Traversable:
    """A source file shipped inside ``package`` (``package_source("lightning_gh.unified", "csrc/managed.cpp")``),
    read through :mod:`importlib.resources` so that it is found wherever the package is installed."""
    out = importlib.resources.files(package)
    for part in relative.split("/"):
        out = out / part
    return out


def compiler_candidates(language: str) -> list[str]:
    """The compilers :func:`find_compiler` tries for ``language`` (``"c"`` or ``"c++"``), in order: ``$CC`` /
    ``$CXX`` alone when set (the user's choice is not second-guessed), else the usual names."""
    if language not in _COMPILERS:
        raise ValueError(f"language={language!r} is not a source language; allowed: {sorted(_COMPILERS)}.")
    var, names = _COMPILERS[language]
    user = os.environ.get(var)
    return [user] if user else list(names)


def find_compiler(language: str) -> str | None:
    """The first of :func:`compiler_candidates` found (a path, or a name on ``PATH``), or ``None``."""
    for cand in compiler_candidates(language):
        found = shutil.which(cand)
        if found:
            return found
    return None


def _language_of(source: Traversable | Path) -> str:
    suffix = Path(source.name).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(f"source={source.name!r} has no C or C++ suffix; allowed: {sorted(_SUFFIXES)}.")
    return _SUFFIXES[suffix]


def _compiler_stamp(compiler: str) -> str:
    """The compiler's resolved path with its size and modification time: an upgraded compiler builds anew."""
    path = os.path.realpath(shutil.which(compiler) or compiler)
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def library_key(source_bytes: bytes, compiler: str, flags: Sequence[str], link_flags: Sequence[str] = (),
                key_extra: Sequence[str] = ()) -> str:
    """The 16-hex-digit hash that names a built library (see the module docstring for what goes in)."""
    h = hashlib.sha256(source_bytes)
    for part in (_compiler_stamp(compiler), *flags, "--", *link_flags, "--", *key_extra, hardware.host_arch(),
                 sys.platform):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()[:16]


def build_shared_library(source: Traversable | str | os.PathLike[str], name: str, flags: Sequence[str] = (), *,
                         link_flags: Sequence[str] = (), compiler: str | None = None, key_extra: Sequence[str] = (),
                         timeout_s: float = 600, force: bool = False) -> Path:
    """Compile ``source`` into ``cache_dir()/<name>-<hash>.so`` once (later calls find it) and return its path.

    The command is ``compiler *flags source -o <tmp> *link_flags``; the flags must make a shared library
    (``-shared -fPIC`` for gcc and clang).

    Args:
        source: the C (``.c``) or C++ (``.cpp``, ``.cc``, ``.cxx``) file, e.g. from :func:`package_source`.
        name: the library's name in the cache (``lgh_adamw``).
        flags: compiler flags before the source.
        link_flags: arguments after the output (libraries to link, ``-Wl,`` options).
        compiler: the compiler (default: :func:`find_compiler` for the source's language).
        key_extra: anything else the library depends on that the flags do not show (a header version).
        timeout_s: how long the compiler may run.
        force: rebuild even when the cache has the library.

    Raises:
        NativeBuildError: no compiler, the cache folder cannot be created, or the compiler failed (its output is in
            the message and in the log next to where the library would be).
    """
    if not isinstance(source, Traversable):
        source = Path(source)
    language = _language_of(source)
    if compiler is None:
        compiler = find_compiler(language)
        if compiler is None:
            var = _COMPILERS[language][0]
            where = f"${var}={os.environ[var]!r}" if os.environ.get(var) else \
                f"{', '.join(compiler_candidates(language))} on PATH"
            raise NativeBuildError(f"building {name} needs a {language.upper()} compiler and none was found (looked "
                                   f"for {where}). Install one (gcc / g++) or set ${var} to one.")
    flags, link_flags = [str(f) for f in flags], [str(f) for f in link_flags]
    key = library_key(source.read_bytes(), compiler, flags, link_flags, key_extra)
    folder = cache_dir()
    target = folder / f"{name}-{key}.so"
    if target.is_file() and not force:
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeBuildError(f"cannot create the build cache folder {folder} for {name} ({e}); set "
                               "$LGH_CACHE_DIR to a writable folder.") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-{key}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        with importlib.resources.as_file(source) as src:
            cmd = [compiler, *flags, str(src), "-o", tmp, *link_flags]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except (OSError, subprocess.SubprocessError) as e:
                raise NativeBuildError(f"building {name} could not run the compiler {compiler}: {e}. Set "
                                       f"${_COMPILERS[language][0]} to a working {language.upper()} compiler.") from None
        log = folder / f"{name}-{key}.log"
        log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        if proc.returncode != 0 or os.path.getsize(tmp) == 0:
            raise NativeBuildError(
                f"building {name} with {compiler} failed (exit code {proc.returncode}; the command and its output "
                f"are in {log}):\n{proc.stderr.strip()[-2000:]}\nSet ${_COMPILERS[language][0]} to another "
                f"{language.upper()} compiler.")
        os.replace(tmp, target)  # atomic: a concurrent build renames an identical file
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
