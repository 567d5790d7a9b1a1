"""Where inputs become items: paths, folders (walked), globs, URLs and bytes named one by one
(:func:`expand`), each with its id, or with the error that says why it names no image
(:class:`BadSource`). The load stage (:mod:`~fullthrottle.data.load`) reads what they name."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: file name endings a directory walk picks up (decoding itself goes by content, not by name)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff")


class BadSource(str):
    """A source that names no loadable item; the string is the item's error."""


def is_url(s: str) -> bool:
    """Whether ``s`` is an http(s) URL (the scheme in any case, as URLs allow)."""
    return s[:8].lower().startswith(("http://", "https://"))


def expand(inputs: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    """Yield ``(id, source)`` for every item named by ``inputs``, lazily, in order.

    Accepts: paths (``str`` or ``Path``) to files; directories (walked recursively, sorted, files
    whose names end in :data:`IMAGE_SUFFIXES`); glob patterns (``**`` allowed); http(s) URLs;
    ``bytes`` (id ``<bytes #i>``); ``(id, bytes)`` pairs (or ``(id, memoryview)``: used without a
    copy, so its bytes must stay unchanged until the item's result is out). A path that does not
    exist fails with "file not found" in the load stage; an empty directory, a pattern that matches
    nothing and an input of another type each become one item carrying that error (:class:`BadSource`).
    """
    for i, src in enumerate(inputs):
        if isinstance(src, (bytes, bytearray, memoryview)):
            yield f"<bytes #{i}>", _data(src, name=f"<bytes #{i}>")
        elif isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], (bytes, bytearray, memoryview)):
            # (a bytes id, as os.listdir(b".") names files: its text, as for bytes paths)
            yield (os.fsdecode(src[0]) if isinstance(src[0], bytes) else str(src[0])), _data(src[1], copy=False)
        elif isinstance(src, (str, os.PathLike)):
            s = os.fspath(src)
            s = os.fsdecode(s) if isinstance(s, bytes) else s  # (os.scandir(b"dir")'s entries: bytes paths)
            found = 0
            if is_url(s):
                yield s, s
                continue
            if not s:
                yield f"<input #{i}>", BadSource(f"<input #{i}>: empty path (an empty string names no file)")
                continue
            if "\0" in s:  # (no file can be named so: the system would refuse the path)
                yield s.replace("\0", "\\0"), BadSource(f"invalid path {s!r}: it holds a NUL byte")
                continue
            scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", s)
            if scheme and not os.path.exists(s):
                yield (
                    s,
                    BadSource(
                        f"unsupported URL scheme {scheme.group(1)!r} (only http:// and https:// "
                        "are fetched; give local files as paths)"
                    ),
                )
                continue
            if os.path.isdir(s):
                said = False  # (an unreadable folder or a loop: its own item says why)
                for p, src in walk_images(s):
                    found += not isinstance(src, BadSource)
                    said = said or isinstance(src, BadSource)
                    yield p, src
                if not found and not said:
                    yield s, BadSource(f"no image files (*{', *'.join(IMAGE_SUFFIXES)}) in directory {s}")
            elif any(c in s for c in "*?[") and not os.path.exists(s):
                for p in glob_files(s):  # (folders left out; a dangling link or a FIFO gets its own error)
                    found += 1
                    yield p, Path(p)
                if not found:
                    yield s, BadSource(f"no files match the pattern {s}{_unlisted_base(s)}")
            else:
                yield s, Path(s)
        else:
            yield (
                f"<input #{i}>",
                BadSource(
                    f"<input #{i}>: cannot load an input of type {type(src).__name__} "
                    "(give a path, URL, bytes or (id, bytes))"
                ),
            )


def _data(src, copy: bool = True, name: str = "the bytes given"):
    """The bytes of a bytes-like input: a copy, or (``copy=False``) a contiguous memoryview as it is,
    cast to bytes (its bytes must then stay unchanged until its result); a released memoryview is a
    :class:`BadSource`."""
    try:
        if not copy and isinstance(src, memoryview) and src.c_contiguous:
            return src.cast("B")
        return bytes(src)
    except ValueError as e:  # (a released memoryview)
        return BadSource(f"cannot read {name}: {e}")


def walk_images(top: str) -> Iterator[tuple[str, Any]]:
    """``(path, Path(path))`` for the image files under the folder ``top``, recursively, sorted, and
    ``(path, BadSource)`` for what the walk cannot enter: a folder that cannot be listed, a symlink
    that leads back to a folder it sits in (a loop), a tree too deep to walk. Those are items with
    their own error, not images dropped without a word. Symlinked folders are followed, as ``find -L``
    does (the link's path is the images' id), but a folder is walked once, by the first path the
    walk meets (top-down, each folder's entries in sorted order): reached again by another path
    (links to one folder from two places), it is passed over, so that a few links cannot make the
    walk exponential. An image file is a name ending in :data:`IMAGE_SUFFIXES`, whatever it is: a symlink so named
    that resolves to nothing (dangling, or a loop of links) is an item, whose read fails as it does
    when the link is given itself (``not_found``, ``unreadable``); any other name is passed over,
    links that resolve to nothing included."""
    errors: list[OSError] = []
    loops: list[str] = []
    walk = _walk_once(top, errors.append, loops)
    while True:
        try:
            root, dirs, files = next(walk)
        except StopIteration:
            break
        except RecursionError:  # (os.walk recurses before Python 3.12)
            yield top, BadSource(f"cannot read {top}: its folder tree is too deep to walk")
            return
        for e in errors:
            yield _unlisted(e, root)
        for full in loops:
            yield full, BadSource(f"cannot read {full}: a symlink loop (it leads back to a folder it is in)")
        errors.clear()
        loops.clear()
        for name in files:
            if name.lower().endswith(IMAGE_SUFFIXES):
                full = os.path.join(root, name)
                yield full, Path(full)
    for e in errors:  # (the top folder itself unreadable)
        yield _unlisted(e, top)


def _unlisted(e: OSError, where: str) -> tuple[str, BadSource]:
    """The item of a folder that could not be listed (``e``, os.walk's error; ``where``: its folder)."""
    path = e.filename or where
    return path, BadSource(f"cannot read directory {path}: {e.strerror or e}")


def glob_match(parts: list[str], pattern: list[str]) -> bool:
    """Whether a path (its components) matches a glob pattern (its components) as ``glob.glob(...,
    recursive=True)`` would list it: ``*``, ``?`` and ``[...]`` within one component, never a leading
    dot; ``**`` any number of components, none of them hidden."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        for i in range(len(parts) + 1):
            if i and parts[i - 1].startswith("."):
                return False
            if glob_match(parts[i:], rest):
                return True
        return False
    if not parts or (parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and glob_match(parts[1:], rest)


def _fixed_base(pattern: str) -> tuple[list[str], int, str]:
    """A glob pattern's parts, the index of its first part with a wildcard, and the folder the parts
    before it name (``.`` or ``/`` when there are none)."""
    parts = pattern.split(os.sep)
    k = next(i for i, c in enumerate(parts) if glob.has_magic(c))
    return parts, k, os.sep.join(parts[:k]) or ("." if not pattern.startswith(os.sep) else os.sep)


def _unlisted_base(pattern: str) -> str:
    """`` (cannot read directory D: why)`` when the fixed folder a glob pattern starts in cannot be
    listed (``glob`` then matches nothing without a word), else ``""``."""
    base = _fixed_base(pattern)[2]
    try:
        os.scandir(base).close()
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f" (cannot read directory {base}: {e.strerror or e})"
    return ""


def glob_files(pattern: str) -> list[str]:
    """The paths a glob pattern names, sorted, folders left out (a dangling link or a FIFO stays: it
    gets its own error). A pattern with ``**`` is matched over a walk of its fixed leading folder
    that enters each symlink loop once (``glob`` itself would follow loops until the system's link
    limit, once per loop and level: exponential), and a folder once per path that reaches it, as
    ``glob`` does (a pattern may match one of those paths only)."""
    if "**" not in pattern:
        return sorted(p for p in glob.iglob(pattern) if not os.path.isdir(p))
    parts, k, base = _fixed_base(pattern)
    if not os.path.isdir(base):
        return []
    out, prefix = [], parts[:k]
    for root, dirs, files in _walk_once(base, every_path=True):
        rel = [] if root == base else os.path.relpath(root, base).split(os.sep)
        for name in files + [d for d in dirs if not os.path.isdir(os.path.join(root, d))]:
            if glob_match(rel + [name], parts[k:]):
                out.append(os.sep.join(prefix + rel + [name]) if prefix else os.path.join(*rel, name))
    return sorted(out)


def _walk_once(top: str, onerror=None, loops: list | None = None, every_path: bool = False):
    """``os.walk(top, onerror=onerror, followlinks=True)``, folders and files sorted, entering no folder
    that one it sits in already is (a symlink loop: such a link's path goes into ``loops`` instead),
    nor, unless ``every_path``, one met already by another path (passed over: the walk is top-down,
    each folder's entries in sorted order, so the path kept is the first the walk meets).

    Raises:
        RecursionError: a tree too deep for ``os.walk`` (it recurses before Python 3.12)."""
    seen = {top: frozenset({_identity(top)})}  # folder -> its (device, inode) and its ancestors'
    walked = {_identity(top)}  # every folder entered or to be entered, by (device, inode)
    for root, dirs, files in os.walk(top, onerror=onerror, followlinks=True):
        above = seen.pop(root, frozenset())
        keep = []
        for d in sorted(dirs):
            full = os.path.join(root, d)
            ident = _identity(full)
            if ident is not None and ident in above:
                if loops is not None:
                    loops.append(full)
                continue
            if ident is not None and ident in walked and not every_path:  # (reached by another path)
                continue
            walked.add(ident)
            seen[full] = above | {ident}
            keep.append(d)
        dirs[:] = keep
        files.sort()
        yield root, dirs, files


def _identity(path: str) -> tuple[int, int] | None:
    """A folder's ``(st_dev, st_ino)`` (symlinks followed), or None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
