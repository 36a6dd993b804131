"""REFs: which code of the engine a run uses, named in one word (``repro compare``, ``repro hunt --ref``,
``repro bisect``; docs/adapters.md: REF locations).

A *REF* names the code a side runs:

- ``installed``: the target interpreter's engine package as it is;
- ``patch:FILE``: that package with a unified diff applied to an **overlay** placed first on the server's
  PYTHONPATH. The overlay is a temporary folder holding a ``<package>/`` tree of symlinks to the installed files,
  where only the files the patch touches are real (patched) copies; the user's installation is never written.
  Paths in the diff may be rooted at the package (``a/sglang/...``) or at a source checkout
  (``a/python/sglang/...``);
- ``git:PATH@REV``: a ``git worktree`` of the engine's source checkout PATH at REV (detached), its package folder
  first on PYTHONPATH; the user's working tree is not touched and the worktree is removed afterwards;
- ``python:PATH``: another interpreter (venv) with its own engine package;
- ``release:V``: release V's interpreter (``repro.releases``: its testbed venv; not set up → one line naming the
  command that sets it up). It composes with ``patch:``: ``release:0.5.18+patch:FILE`` is that patch on 0.5.18.

:func:`parse_ref` checks the syntax; :func:`materialize` checks a REF and makes it runnable before any server starts
(a patch that does not apply, a missing rev, an unknown kind → :class:`RefError`, one line naming the fix). The
caller removes what was made (``Materialized.close``) on every outcome; :func:`sweep_stale` removes what a
SIGKILLed harness left.

This module never imports the engine and names none: where the engine's package lives (its name, the folder of a
source checkout that holds it) is the adapter's ``ref_location`` (``repro.targets.base.RefLocation``), and the
installed package is located by running the target interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from repro import resources
from repro.targets.base import RefLocation

REF_KINDS = ("installed", "patch", "git", "python", "release")
OVERLAY_PREFIX = "repro-overlay-"
WORKTREE_PREFIX = "repro-worktree-"
LOCATE_TIMEOUT_S = 120.0  # seconds to let the target interpreter locate its engine package
GIT_TIMEOUT_S = 300.0  # seconds for one git command (worktree add on a large checkout)


class RefError(Exception):
    """A REF that cannot be used, found before any server started; ``str()`` is one line naming the fix."""


# --------------------------------------------------------------------------------------------------------- REFs
@dataclass(frozen=True)
class Ref:
    """A parsed REF.

    Attributes:
        kind: ``installed`` / ``patch`` / ``git`` / ``python``.
        text: the REF as the user wrote it.
        path: the patch file, the git checkout or the interpreter (None for ``installed``).
        rev: the git revision (``git`` only).
        release: the engine release the side runs (``release:V``, alone or ``release:V+patch:FILE``), else None.
    """

    kind: str
    text: str
    path: Optional[Path] = None
    rev: Optional[str] = None
    release: Optional[str] = None


def parse_ref(text: str) -> Ref:
    """Parse ``installed`` | ``patch:FILE`` | ``git:PATH@REV`` | ``python:PATH`` | ``release:V`` |
    ``release:V+patch:FILE`` (syntax only, no file access).

    Raises:
        RefError: unknown kind, or an empty FILE / PATH / REV / V (the message lists the accepted forms).
    """
    from repro.releases import ReleaseError, parse_release_ref

    forms = "installed, patch:FILE, git:PATH@REV, python:PATH, release:V or release:V+patch:FILE"
    t = (text or "").strip()
    try:
        release, rest = parse_release_ref(t)
    except ReleaseError as e:
        raise RefError(str(e)) from None
    if release is not None:
        if not rest:
            return Ref("release", t, release=release)
        if "+patch:" in rest or "+release:" in rest:
            raise RefError(f"REF {t!r}: one patch per REF; combine the patches into one unified diff (cat A.patch "
                           "B.patch > AB.patch when they touch different files) and pass release:V+patch:AB.patch")
        inner = parse_ref(rest)
        if inner.kind != "patch":
            raise RefError(f"REF {t!r}: only patch:FILE composes with release:V (got {inner.kind}:); "
                               "expected release:V or release:V+patch:FILE")
        return Ref("patch", t, inner.path, release=release)
    if t == "installed":
        return Ref("installed", t)
    kind, sep, rest = t.partition(":")
    if not sep or kind not in REF_KINDS or kind in ("installed", "release"):
        return _bad_ref(t, f"unknown REF kind {kind!r}" if sep else "unknown REF", forms)
    if kind == "git":
        path, at, rev = rest.rpartition("@")
        if not at or not path or not rev:
            raise RefError(f"REF {t!r}: expected git:PATH@REV (e.g. git:~/src/ENGINE@v1.2.3), got no {'REV' if path else 'PATH'}")
        return Ref("git", t, Path(path).expanduser(), rev)
    if not rest:
        raise RefError(f"REF {t!r}: expected {kind}:{'FILE' if kind == 'patch' else 'PATH'} after the colon")
    return Ref(kind, t, Path(rest).expanduser())


def _bad_ref(text: str, what: str, forms: str) -> Ref:
    raise RefError(f"REF {text!r}: {what}; expected one of {forms}")


# ------------------------------------------------------------------------------------------- materialised REFs
@dataclass
class Materialized:
    """A REF made runnable. Call :meth:`close` (idempotent) to remove what was created for it.

    Attributes:
        ref: the REF.
        python: interpreter that runs the server (None: the runner's default choice).
        pythonpath_prepend: folders to put first on the server's PYTHONPATH (overlay / worktree ``python/``).
        description: one line for people: what code this side runs.
        package_dir: the engine package folder the server will import (for the record).
        created: folders created by the harness (removed by ``close``).
    """

    ref: Ref
    python: Optional[str]
    pythonpath_prepend: tuple[str, ...] = ()
    description: str = ""
    package_dir: Optional[str] = None
    created: list[Path] = field(default_factory=list)
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Remove the overlay / worktree (never raises; safe to call twice)."""
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:
                pass


def package_location(python: str, timeout_s: float = LOCATE_TIMEOUT_S, *, loc: RefLocation) -> Path:
    """The folder of the engine's package (``loc.package``, e.g. ``sglang``) ``python`` would import, found without
    importing it.

    Runs ``python -c`` with ``importlib.util.find_spec(package)`` (the package's ``__init__`` is not executed).

    Raises:
        RefError: the interpreter cannot be run, or it has no such package (names ``--python``).
    """
    pkg = loc.package
    code = (f"import importlib.util as u, sys; s = u.find_spec({pkg!r}); "
            "sys.stdout.write(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else '')")
    try:
        r = subprocess.run([python, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RefError(f"cannot run {python} to locate its {pkg} ({e}); pass --python PATH of an interpreter with {pkg}") from None
    out = r.stdout.strip()
    if r.returncode != 0 or not out:
        raise RefError(f"{python} has no importable {pkg} package; pass --python PATH of an interpreter with {pkg} installed")
    return Path(out)


OWNER_FILE = ".repro-owner.json"


def _write_owner(folder: Path, repo: Optional[Path] = None) -> None:
    """Record which harness process owns a temporary folder (pid + create time), for :func:`sweep_stale`."""
    import psutil

    me = psutil.Process()
    from repro.procs import start_ticks

    data = {"pid": me.pid, "create_time": me.create_time(), "start_ticks": start_ticks(me.pid), "repo": str(repo) if repo else None}
    (folder / OWNER_FILE).write_text(json.dumps(data), encoding="utf-8")


def sweep_stale(parent: Optional[Path] = None) -> list[Path]:
    """Remove overlays/worktrees left by a harness that was SIGKILLed (its recorded pid + create time is gone).

    Folders of a live harness, and folders without an owner record, are left alone. Returns the removed folders.
    """
    import psutil

    base = Path(parent) if parent else Path(tempfile.gettempdir())
    removed: list[Path] = []
    for d in base.glob(f"{OVERLAY_PREFIX}*"), base.glob(f"{WORKTREE_PREFIX}*"):
        for folder in d:
            try:
                owner = json.loads((folder / OWNER_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            try:  # start ticks: a wall-clock step cannot make a live owner look gone (create_time: older records)
                from repro.procs import ProcInfo, alive as _alive

                alive = _alive(ProcInfo(pid=int(owner["pid"]), create_time=float(owner.get("create_time") or 0.0), name="",
                                        start_ticks=owner.get("start_ticks")))
            except (psutil.Error, KeyError, TypeError, ValueError):
                alive = False
            if alive:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            if owner.get("repo"):
                try:
                    _git(Path(owner["repo"]), "worktree", "prune", timeout_s=60)
                except Exception:
                    pass
            removed.append(folder)
    return removed


_DIFF_TARGET = re.compile(r"^\+\+\+ (\S+)")
_DIFF_SOURCE = re.compile(r"^--- (\S+)")


def patch_files(patch_text: str) -> list[str]:
    """The paths a unified diff changes, as written after ``+++`` (``/dev/null`` targets use the ``---`` path)."""
    out: list[str] = []
    last_src: Optional[str] = None
    for line in patch_text.splitlines():
        m = _DIFF_SOURCE.match(line)
        if m:
            last_src = m.group(1)
            continue
        m = _DIFF_TARGET.match(line)
        if m:
            p = m.group(1)
            if p == "/dev/null" and last_src:
                p = last_src
            if p not in out:
                out.append(p)
    return out


def patch_strip(patch_file: Path, patch_text: str, loc: RefLocation) -> int:
    """The ``-p`` level that maps every path of the diff onto the engine's package folder (``loc.package``, e.g.
    ``sglang/``).

    ``a/python/sglang/srt/x.py`` → 2, ``a/sglang/srt/x.py`` → 1, ``sglang/srt/x.py`` → 0.

    Raises:
        RefError: the file holds no diff, or a path does not contain the package's folder, or the levels differ.
    """
    pkg, sub = loc.package, loc.checkout_subdir
    src = f"a/{sub}/{pkg}/… or a/{pkg}/…" if sub else f"a/{pkg}/…"
    files = patch_files(patch_text)
    if not files:
        raise RefError(f"{patch_file}: no unified diff found (expected '--- a/…' / '+++ b/…' lines); make it with `git diff` or `diff -u`")
    levels = set()
    for f in files:
        parts = f.split("/")
        if pkg not in parts[:-1]:
            raise RefError(f"{patch_file}: path {f!r} is not inside a {pkg}/ package folder; diff against {pkg}'s sources ({src})")
        levels.add(parts.index(pkg))
    if len(levels) != 1:
        raise RefError(f"{patch_file}: its paths put {pkg}/ at different depths ({', '.join(files)}); use one layout for every file")
    return levels.pop()


_HUNK_FAILED = re.compile(r"Hunk #(\d+) FAILED at (\d+)")
_CHECKING = re.compile(r"^checking file (.+)$")


def check_patch_applies(patch_file: Path, root: Path, strip: int, loc: RefLocation) -> None:
    """Dry-run ``patch`` against ``root`` (the folder that holds the engine's package, ``sglang/``); writes nothing.

    Raises:
        RefError: the patch does not apply: names the file and hunk (``Hunk #2 of sglang/…/scheduler.py failed
            at line 4204``), or a file is missing, or ``patch`` is not installed.
    """
    pkg = loc.package
    exe = shutil.which("patch")
    if exe is None:
        raise RefError("the `patch` program is not installed; install it (e.g. apt-get install patch) to use patch:FILE")
    try:
        r = subprocess.run([exe, "--dry-run", "--batch", "--force", "--fuzz=0", f"-p{strip}", "-d", str(root), "-i", str(patch_file)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RefError(f"patch --dry-run of {patch_file} failed to run: {e}") from None
    if r.returncode == 0 and "FAILED" not in r.stdout:
        return
    current = "?"
    for line in (r.stdout + "\n" + r.stderr).splitlines():
        m = _CHECKING.match(line.strip())
        if m:
            current = m.group(1)
            continue
        m = _HUNK_FAILED.search(line)
        if m:
            raise RefError(
                f"{patch_file} does not apply to {root / pkg}: hunk #{m.group(1)} of {current} failed at line "
                f"{m.group(2)}; make the patch for this {pkg} version (the installed files are what it must match)"
            )
        if "can't find file" in line or "No such file" in line:
            raise RefError(f"{patch_file} does not apply to {root}: {line.strip()}; check the paths in the diff")
    detail = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["unknown error"])[-1]
    raise RefError(f"{patch_file} does not apply to {root / pkg}: {detail}")


def make_overlay(package_dir: Path, patch_file: Path, patch_text: str, strip: int, parent: Optional[Path],
                 loc: RefLocation) -> Path:
    """Create the overlay folder: ``<tmp>/<package>`` mirrors ``package_dir`` (the installed package folder) with
    symlinks; patched files are copies.

    Args:
        package_dir: the installed package folder (read only).
        patch_file / patch_text / strip: the checked patch and its ``-p`` level (see :func:`patch_strip`).
        parent: where to create the temporary folder (None: the system temp dir).
        loc: where the engine's package lives (the run's adapter's ``ref_location``).
    Returns:
        The overlay root, to be put first on PYTHONPATH. The caller removes it (``shutil.rmtree``).
    Raises:
        RefError: applying the patch failed (the dry run passed, so only on I/O errors).
    """
    root = Path(tempfile.mkdtemp(prefix=OVERLAY_PREFIX, dir=str(parent) if parent else None))
    try:
        _write_owner(root)
        dst = root / loc.package
        shutil.copytree(package_dir, dst, symlinks=True, copy_function=lambda s, d: os.symlink(os.path.abspath(s), d))
        for f in patch_files(patch_text):
            rel = Path(*f.split("/")[strip:])
            target = root / rel
            if target.is_symlink():
                real = Path(os.readlink(target))
                target.unlink()
                shutil.copy2(real, target)
            pyc_dir = target.parent / "__pycache__"
            if pyc_dir.is_dir():  # stale bytecode links of a patched module: let python recompile into the overlay
                for pyc in pyc_dir.glob(target.stem + ".*.pyc"):
                    pyc.unlink()
        r = subprocess.run(["patch", "--batch", "--forward", "--fuzz=0", f"-p{strip}", "-d", str(root), "-i", str(patch_file)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RefError(f"applying {patch_file} to the overlay failed: {(r.stdout + r.stderr).strip().splitlines()[-1:]}")
        for junk in list(root.rglob("*.orig")) + list(root.rglob("*.rej")):
            junk.unlink()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _git(repo: Path, *args: str, timeout_s: float = GIT_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)


def _checkout_words(loc: RefLocation) -> str:
    return f"an {loc.package} source checkout"


def resolve_git_rev(repo: Path, rev: str, loc: RefLocation) -> str:
    """The full commit id of ``rev`` in ``repo``.

    Raises:
        RefError: ``repo`` is not a git checkout, or ``rev`` names no commit there (one line, names both).
    """
    if shutil.which("git") is None:
        raise RefError("git is not installed; install it to use git:PATH@REV")
    if not repo.is_dir():
        raise RefError(f"git:{repo}@{rev}: {repo} is not a folder; pass the path of {_checkout_words(loc)}")
    r = _git(repo, "rev-parse", "--is-inside-work-tree")
    if r.returncode != 0:
        raise RefError(f"git:{repo}@{rev}: {repo} is not a git checkout; pass the path of {_checkout_words(loc)}")
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if r.returncode != 0 or not r.stdout.strip():
        raise RefError(f"git:{repo}@{rev}: revision {rev!r} not found in {repo}; fetch it (git -C {repo} fetch) or pass an existing rev")
    return r.stdout.strip()


def make_worktree(repo: Path, commit: str, parent: Optional[Path], loc: RefLocation) -> Path:
    """``git worktree add --detach`` of ``commit`` into a new temporary folder (the user's work tree is untouched).

    Returns:
        The worktree folder; remove it with :func:`remove_worktree`.
    Raises:
        RefError: git refused (message names the repo and git's reason), or the tree has no
            ``<checkout_subdir>/<package>`` folder (``loc``).
    """
    base = Path(tempfile.mkdtemp(prefix=WORKTREE_PREFIX, dir=str(parent) if parent else None))
    _write_owner(base, repo)
    wt = base / "src"
    r = _git(repo, "worktree", "add", "--detach", str(wt), commit)
    if r.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        _git(repo, "worktree", "prune")
        last = (r.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise RefError(f"git worktree add of {commit[:12]} in {repo} failed: {last}")
    lc = loc
    if not (wt / lc.checkout_subdir / lc.package).is_dir():
        remove_worktree(repo, wt)
        rel = "/".join(x for x in (lc.checkout_subdir, lc.package) if x)
        raise RefError(f"{repo}@{commit[:12]} has no {rel} folder; pass the root of {_checkout_words(lc)}")
    return wt


def remove_worktree(repo: Path, wt: Path) -> None:
    """Remove a worktree made by :func:`make_worktree` and its temporary parent; prune git's record of it."""
    try:
        _git(repo, "worktree", "remove", "--force", str(wt), timeout_s=120)
    finally:
        shutil.rmtree(wt.parent, ignore_errors=True)
        try:
            _git(repo, "worktree", "prune", timeout_s=60)
        except Exception:
            pass


def materialize(ref: Ref, python: Optional[str], adapter: Any, choose: Optional[Callable[[Optional[str]], str]] = None,
                tmp_parent: Optional[Path] = None) -> Materialized:
    """Check a REF and make it runnable, before any server starts.

    Args:
        ref: the parsed REF.
        python: the ``--python`` given to compare (None: the runner's default choice).
        adapter: the run's adapter (resolved once from the scenario): where the engine's package lives
            (``ref_location``), its releases, and the CPU testbed the default ``choose`` falls back on.
        choose: picks the interpreter from ``python`` (default ``repro.interpreter.choose_python`` with ``adapter``).
        tmp_parent: where overlays/worktrees are created (default: system temp dir).
    Returns:
        A :class:`Materialized`; the caller must ``close()`` it (also on errors and interrupts).
    Raises:
        RefError: the patch file is missing or does not apply; the git rev is missing; the interpreter has
            no engine package. Nothing is left behind when it raises.
    """
    if choose is None:
        from repro.interpreter import InterpreterError, choose_python

        def choose(p: Optional[str]) -> str:
            try:
                return choose_python(p, adapter)
            except InterpreterError as e:
                raise RefError(str(e)) from None

    lc = adapter.ref_location
    pkg = lc.package
    rel_what = ""
    if ref.release is not None:  # the release's own interpreter; --python does not apply to this side
        from repro.releases import ReleaseError, describe_python, release_python

        try:
            rel_py = release_python(ref.release, adapter)
        except ReleaseError as e:
            raise RefError(f"REF {ref.text!r}: {e}") from None
        python = rel_py
        choose = lambda p: rel_py  # noqa: E731
        # the release and which interpreter runs it: its own venv or an overlay (the testbed's testbed.json)
        rel_what = f"{describe_python(rel_py) or f'{pkg} {ref.release} release'} ({rel_py})"
        if ref.kind == "release":
            return Materialized(ref, rel_py, (), rel_what, str(package_location(rel_py, loc=lc)))
    if ref.kind == "installed":
        py = choose(python)
        return Materialized(ref, python, (), f"installed {pkg} of {py}", str(package_location(py, loc=lc)))
    if ref.kind == "python":
        assert ref.path is not None
        if not ref.path.exists():
            raise RefError(f"REF {ref.text!r}: {ref.path} does not exist; pass python:PATH of an interpreter (e.g. a venv's bin/python)")
        try:
            loc = package_location(str(ref.path), loc=lc)
        except RefError:  # the knob here is the REF itself, not --python
            raise RefError(f"REF {ref.text!r}: {ref.path} has no importable {pkg} package; pass python:PATH of an "
                               f"interpreter that has {pkg} installed (--python only picks the interpreter of "
                               "`installed`, `patch:` and `git:` sides)") from None
        return Materialized(ref, str(ref.path), (), f"{pkg} of {ref.path}", str(loc))
    if ref.kind == "patch":
        assert ref.path is not None
        pf = resources.find_data_file(ref.path).resolve()  # also scenarios/... from outside a clone (the wheel's copy)
        if pf.is_dir():
            raise RefError(f"REF {ref.text!r}: {ref.path} is a folder, not a patch file; pass patch:FILE with a unified diff")
        if not pf.is_file():
            raise RefError(f"REF {ref.text!r}: patch file {ref.path} not found; pass patch:FILE with a unified diff")
        text = pf.read_text(encoding="utf-8", errors="replace")
        strip = patch_strip(pf, text, lc)
        py = choose(python)
        loc = package_location(py, loc=lc)
        check_patch_applies(pf, loc.parent, strip, lc)
        root = make_overlay(loc, pf, text, strip, tmp_parent, lc)
        what = rel_what if ref.release else f"installed {pkg} of {py}"
        m = Materialized(ref, python, (str(root),), f"{what} + {pf.name} (overlay)", str(root / pkg), [root])
        m._closers.append(lambda: shutil.rmtree(root, ignore_errors=True))
        return m
    if ref.kind == "git":
        assert ref.path is not None and ref.rev is not None
        repo = ref.path.resolve()
        commit = resolve_git_rev(repo, ref.rev, lc)
        wt = make_worktree(repo, commit, tmp_parent, lc)
        src = wt / lc.checkout_subdir if lc.checkout_subdir else wt
        m = Materialized(ref, python, (str(src),), f"{repo} at {ref.rev} ({commit[:12]}, git worktree)",
                         str(src / pkg), [wt.parent])
        m._closers.append(lambda: remove_worktree(repo, wt))
        return m
    raise RefError(f"REF {ref.text!r}: unknown kind {ref.kind!r}")  # parse_ref prevents this
