"""Checks of the paths a user passes on the command line, before anything reads, writes or launches.

Every verb's path options go through these (``repro.cli``'s option callbacks): a file to read must be a regular,
readable file (a FIFO would block the read for ever, a folder would raise ``IsADirectoryError``); a file to write
must not be a folder or a FIFO and its parent must be an existing folder (not a file); a folder to write into must
be a folder or creatable as one (no file on its way). Each failure is one :class:`PathInputError` whose message
names the path, what it is, and the fix; the CLI prints it as one line and exits 2.

Nothing here creates, writes or opens anything except :func:`read_text`, which reads the file it checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


class PathInputError(ValueError):
    """A path given by the user is not what the option needs (message: the path, what it is, the fix)."""


def kind(st: os.stat_result) -> str:
    """What a non-regular, non-folder path is, in words."""
    m = st.st_mode
    if stat.S_ISFIFO(m):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(m):
        return "a socket"
    if stat.S_ISCHR(m) or stat.S_ISBLK(m):
        return "a device"
    return "not a regular file"


def _label(path: Path, what: str) -> str:
    return f"{what} {path}" if what else str(path)


def input_file(path: PathLike, what: str = "", expect: str = "a file") -> Path:
    """Check that ``path`` is a regular file this process can read.

    Args:
        path: the path given.
        what: the option it came from, e.g. ``"--rules"`` (prefixes the message; empty for an argument).
        expect: what the option expects, in words, e.g. ``"a TOML rules file like scenarios/sglang/discover_rules.toml"``.
    Returns:
        ``path`` as a Path.
    Raises:
        PathInputError: it does not exist, is a folder, a FIFO/socket/device, or is not readable.
    """
    p = Path(path)
    lab = _label(p, what)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise PathInputError(f"{lab}: not found; pass {expect}") from None
    except NotADirectoryError:
        raise PathInputError(f"{lab}: not found ({nearest_existing(p)} is a file, not a folder); pass {expect}") from None
    except OSError as e:
        raise PathInputError(f"{lab}: cannot be read ({e.strerror}); pass {expect}") from None
    if stat.S_ISDIR(st.st_mode):
        raise PathInputError(f"{lab}: is a folder; pass {expect}")
    if not stat.S_ISREG(st.st_mode):
        raise PathInputError(f"{lab}: is {kind(st)}, not a regular file; save its content to a file and pass {expect}")
    if not os.access(p, os.R_OK):
        raise PathInputError(f"{lab}: not readable (permission denied); pass {expect} you can read")
    return p


def read_text(path: PathLike, what: str = "", expect: str = "a UTF-8 text file") -> str:
    """:func:`input_file`, then its text (UTF-8; a leading byte-order mark is dropped).

    Raises:
        PathInputError: as :func:`input_file`, or the bytes are not UTF-8 (a binary file: the byte and line named).
    """
    p = input_file(path, what, expect)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise PathInputError(f"{_label(p, what)}: cannot be read ({e.strerror}); pass {expect}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PathInputError(f"{_label(p, what)}: not a UTF-8 text file (binary? byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start}, line {line}); pass {expect}") from None


def nearest_existing(p: PathLike) -> Path:
    """``p`` itself or its nearest ancestor that exists (a file, when a path under it raised NotADirectoryError)."""
    q = Path(p)
    while not q.exists() and q != q.parent:
        q = q.parent
    return q


def output_file(path: PathLike, what: str = "", example: str = "report.md") -> Path:
    """Check that ``path`` can be written as a file: not a folder or FIFO/socket/device, in an existing folder.

    Args:
        path: the path given.
        what: the option, e.g. ``"--markdown"``.
        example: a file name for the message's fix (``pass a path like FOLDER/<example>``).
    Returns:
        ``path`` as a Path (nothing is created).
    Raises:
        PathInputError: it is a folder or not a regular file; its parent is a file or does not exist.
    """
    p = Path(path)
    lab = _label(p, what)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        st = None
    except OSError as e:
        raise PathInputError(f"{lab}: cannot be checked ({e.strerror}); pass another path") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise PathInputError(f"{lab}: is a folder; pass a file path inside it, e.g. {p / example}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise PathInputError(f"{lab}: is {kind(st)}, not a regular file; pass a path for a new or regular file")
    parent = p.parent
    if not parent.is_dir():
        if parent.exists():
            raise PathInputError(f"{lab}: {parent} is a file, not a folder; pass a path inside an existing folder")
        on_way = nearest_existing(parent)
        if on_way.exists() and not on_way.is_dir():
            raise PathInputError(f"{lab}: {on_way} is a file, not a folder; pass a path inside an existing folder")
        raise PathInputError(f"{lab}: folder {parent} does not exist; create it or pass a path inside an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PathInputError(f"{lab}: folder {parent} is not writable; pass a path inside a folder you can write")
    return p


def output_dir(path: PathLike, what: str = "") -> Path:
    """Check that ``path`` is a folder, or can be created as one (``mkdir -p``): no file on its way, and the
    nearest existing ancestor is a writable folder.

    Returns:
        ``path`` as a Path (nothing is created).
    Raises:
        PathInputError: it, or an ancestor, is a file (or a FIFO…); the folder that would hold it is not writable.
    """
    p = Path(path)
    lab = _label(p, what)
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise PathInputError(f"{lab}: folder is not writable; pass a folder you can write")
        return p
    if p.exists():
        raise PathInputError(f"{lab}: is a file, not a folder; pass a folder (it is created if missing)")
    on_way = nearest_existing(p)
    if on_way.exists() and not on_way.is_dir():
        raise PathInputError(f"{lab}: {on_way} is a file, not a folder; pass a folder path with no file on its way")
    if on_way.exists() and not os.access(on_way, os.W_OK | os.X_OK):
        raise PathInputError(f"{lab}: cannot be created ({on_way} is not writable); pass a folder you can write")
    return p


def input_dir(path: PathLike, what: str = "") -> Path:
    """Check that ``path`` is a folder to read from, or does not exist yet (one a server will write later): never a
    file, a FIFO or a path under a file.

    Raises:
        PathInputError: it, or an ancestor, is not a folder.
    """
    p = Path(path)
    lab = _label(p, what)
    if p.is_dir():
        return p
    up = nearest_existing(p)
    if up == p:
        raise PathInputError(f"{lab}: is {'a file' if p.is_file() else kind(p.stat())}, not a folder; pass a folder")
    if up.exists() and not up.is_dir():
        raise PathInputError(f"{lab}: {up} is a file, not a folder; pass a folder")
    return p
