"""Engine releases: the release index, ``release:V`` REFs, and which release a dump or a report came from (issue 34).

The data is the adapter's (``Adapter.releases_dir``, schema ``repro.targets.release_data``: for SGLang
``repro/targets/sglang/releases/index.toml`` beside the adapter, naming its index ``index.json`` built from the wheels
of 0.5.14-0.5.23 by ``scripts/build_release_index.py``, and one ``<V>.toml`` per release with its CPU compatibility).
This module is engine-neutral: it reads that data, never the engine.

- :class:`ReleaseIndex`: the releases in order, each one's tree-cache factory classes, and for every indexed module
  the functions (qualified names) with their ``[first_line, last_line]`` per release.
- :func:`release_python`: the interpreter of release V, or :class:`ReleaseError` (one line naming the command that
  sets it up; exit 2 in the CLI). A release is set up when its testbed folder holds ``venv/bin/python`` and the
  ``.setup-stamp`` (``Adapter.release_testbed_dir``).
- :func:`version_in_text`: the version a pasted ``check_env`` block or a log line names.
- :func:`infer_releases` / :func:`choose_release`: the releases that can have produced a dump's frames (module,
  function, line inside the function's span), less those whose factory never builds the frames' classes; which one
  to run and why.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from repro.targets.release_data import ReleaseDataError, adapter_releases

RELEASE_PREFIX = "release:"


class ReleaseError(ValueError):
    """A release that is unknown to the index or not set up; ``str()`` is one line naming the fix."""


@dataclass(frozen=True)
class Release:
    """One release of the index.

    Attributes:
        version: e.g. ``0.5.18``.
        wheel: the wheel file the entry was read from.
        requires: its pins of torch / the kernel package (``torch==2.13.0``).
        factory_builds: ``module:Class`` of every tree cache its factory can return.
        factory_bases: bare names of those classes' base classes (an inherited method's frame counts as built).
    """

    version: str
    wheel: str = ""
    requires: tuple[str, ...] = ()
    factory_builds: tuple[str, ...] = ()
    factory_bases: tuple[str, ...] = ()

    def builds(self, class_name: str) -> bool:
        """Whether this release's factory builds ``class_name`` (bare name) or a subclass of it."""
        return class_name in {b.rsplit(":", 1)[-1] for b in self.factory_builds} or class_name in self.factory_bases


@dataclass(frozen=True)
class FrameRef:
    """What inference reads of one frame: the source path as the dump shows it, the function (qualified name or
    bare ``co_name``) and the line (None when unknown)."""

    path: str
    function: str
    line: Optional[int] = None


@dataclass
class ReleaseIndex:
    """The releases of one engine in release order, with their functions' line spans.

    Attributes:
        engine: the adapter name.
        releases: in release order (bit i of a mask is ``releases[i]``).
        modules: source path in the package (``sglang/srt/mem_cache/hiradix_cache.py``) → qualified name →
            ``[[first_line, last_line, release_mask], ...]``.
        patterns: regular expressions whose first group is a version named in a report.
        testbeds: version → its recipe (``{"recipe": "cpu_testbed", "kind": "venv" | "overlay", "base": V or None}``,
            from the release file's ``[cpu]``).
        testbed_default: the release the plain testbed command sets up (``index.toml``'s ``testbed_default``).
    """

    engine: str
    releases: tuple[Release, ...]
    modules: dict[str, dict[str, list[list[int]]]]
    patterns: tuple[str, ...] = ()
    testbeds: dict[str, dict] = field(default_factory=dict)
    testbed_default: str = ""

    def versions(self) -> list[str]:
        """The versions in release order."""
        return [r.version for r in self.releases]

    def get(self, version: str) -> Release:
        """The release ``version``.

        Raises:
            ReleaseError: not in the index (the message lists the known versions).
        """
        for r in self.releases:
            if r.version == version:
                return r
        bare = re.sub(rf"^(?:{re.escape(self.engine)}[-_=@ ]*)?[vV]", "", version.strip())
        hint = f"did you mean {bare}? " if bare in self.versions() else ""
        raise ReleaseError(f"{self.engine} release {version!r} is not in the release index; {hint}known: "
                           f"{', '.join(self.versions())} (add one with scripts/build_release_index.py)")

    def between(self, first: str, last: str) -> list[Release]:
        """The releases from ``first`` to ``last`` inclusive, in release order (either order of the arguments).

        Raises:
            ReleaseError: a version not in the index.
        """
        vs = self.versions()
        i, j = vs.index(self.get(first).version), vs.index(self.get(last).version)
        lo, hi = min(i, j), max(i, j)
        return list(self.releases[lo:hi + 1])

    def _modules_for(self, path: str) -> list[str]:
        p = path.replace("\\", "/").lstrip("./")
        if p in self.modules:
            return [p]
        return [m for m in self.modules if p.endswith("/" + m) or m.endswith("/" + p) or m == p]

    def frame_mask(self, f: FrameRef) -> Optional[int]:
        """Bit mask of the releases whose source has ``f``'s function in ``f``'s file with ``f.line`` inside it
        (any line when unknown). None when the file is not indexed, or the function is in none of its releases
        (a locally modified file says nothing about the release)."""
        mods = self._modules_for(f.path)
        if not mods:
            return None
        mask, named = 0, False
        for m in mods:
            for q, spans in self.modules[m].items():
                if q != f.function and not q.endswith("." + f.function) and not f.function.endswith("." + q):
                    continue
                named = True
                for first, last, rmask in spans:
                    if f.line is None or first <= f.line <= last:
                        mask |= rmask
        return mask if named else None

    def frame_classes(self, f: FrameRef) -> set[str]:
        """Bare names of the classes that own ``f``'s function in the index (``HiRadixCache`` for
        ``check_prefetch_progress`` in ``hiradix_cache.py``)."""
        out: set[str] = set()
        for m in self._modules_for(f.path):
            for q in self.modules[m]:
                if "." in q and (q == f.function or q.endswith("." + f.function)) and "<locals>" not in q:
                    out.add(q.rsplit(".", 1)[0].split(".")[-1])
        return out

    def mask_versions(self, mask: int) -> list[str]:
        """The versions whose bit is set in ``mask``, in release order."""
        return [r.version for i, r in enumerate(self.releases) if mask >> i & 1]


def _adapter(adapter: Any) -> Any:
    """The run's adapter: an adapter, or a registered name (never a default: the caller knows its engine)."""
    if isinstance(adapter, str):
        from repro.targets.registry import get_adapter

        return get_adapter(adapter)
    if adapter is None:
        raise TypeError("repro.releases: pass the run's adapter (or its name); there is no default engine")
    return adapter


@lru_cache(maxsize=8)
def _load_json(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_index(adapter: Any) -> ReleaseIndex:
    """The adapter's release index (an adapter or a registered name): its ``releases_dir``'s ``index.toml``, the
    JSON index it names (read once per process) and every release file's setup recipe.

    Raises:
        ReleaseError: the adapter has no release index, or its release data fails the schema (one line naming the
            file and the field).
    """
    a = _adapter(adapter)
    try:
        data = adapter_releases(a)
    except ReleaseDataError as e:
        raise ReleaseError(str(e)) from None
    if data is None or data.index_json is None:
        raise ReleaseError(f"the {a.name} adapter has no release index (no index.toml naming one in its releases_dir; "
                           "docs/adapters.md, 'Per-release data'): release:V and --release need one")
    raw = _load_json(str(data.index_json))
    rels = tuple(Release(r["version"], r.get("wheel", ""), tuple(r.get("requires", ())), tuple(r.get("factory_builds", ())),
                         tuple(r.get("factory_bases", ()))) for r in raw["releases"])
    beds = {v: {"recipe": r.cpu.recipe, "kind": r.cpu.kind, "base": r.cpu.base or None}
            for v, r in data.releases.items() if r.cpu is not None and r.cpu.recipe}
    return ReleaseIndex(a.name, rels, raw["modules"], data.version_patterns, beds, data.testbed_default)


def parse_release_ref(text: str) -> tuple[Optional[str], str]:
    """Split ``release:V`` / ``release:V+REST`` into ``(V, REST)``; ``(None, text)`` when it is no release REF.

    Raises:
        ReleaseError: ``release:`` without a version.
    """
    t = (text or "").strip()
    if not t.startswith(RELEASE_PREFIX):
        return None, t
    v, _, rest = t[len(RELEASE_PREFIX):].partition("+")
    if not v.strip():
        raise ReleaseError(f"REF {t!r}: expected release:V (e.g. release:0.5.18 or release:0.5.18+patch:FILE)")
    return v.strip(), rest.strip()


TESTBED_RECORD = "testbed.json"  # written by the testbed recipe beside venv/: release, kind, base, setup_s, gb


@dataclass(frozen=True)
class ReleaseSetup:
    """Where release V runs: its testbed folder, its interpreter when set up, and the command that sets it up.

    Attributes:
        kind: ``venv`` (a venv of its own) or ``overlay`` (the release's wheel over ``base``'s venv): what the recipe
            set up (``testbed.json``), else what the release data asks for.
        base: the release whose venv an overlay runs on (None for a venv).
    """

    version: str
    folder: Path
    python: Optional[Path]
    setup_command: str
    has_recipe: bool
    kind: str = "venv"
    base: Optional[str] = None

    def describe(self, engine: str) -> str:
        """``<engine> 0.5.18 (its own venv)`` / ``<engine> 0.5.20 (overlay: its wheel over the 0.5.18 venv)``."""
        how = f"overlay: its wheel over the {self.base} venv" if self.kind == "overlay" else "its own venv"
        return f"{engine} {self.version} ({how})".strip()


def testbed_record(python: str) -> Optional[dict]:
    """The testbed record (``testbed.json``) of the testbed whose ``venv/bin/python`` is ``python``, else None.

    Keys: ``engine``, ``release``, ``kind`` (venv | overlay), ``base``, ``setup_s``, ``gb``, ``set_up_at``."""
    try:
        rec = Path(python).parent.parent.parent / TESTBED_RECORD
        data = json.loads(rec.read_text(encoding="utf-8")) if rec.is_file() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("release") else None


def describe_python(python: str) -> Optional[str]:
    """How a testbed interpreter runs its release (``sglang 0.5.20 (overlay: its wheel over the 0.5.18 venv)``),
    from its ``testbed.json``; None when ``python`` is no recipe-made testbed's."""
    rec = testbed_record(python)
    if rec is None:
        return None
    s = ReleaseSetup(str(rec["release"]), Path(python).parent.parent.parent, Path(python), "", True,
                     str(rec.get("kind") or "venv"), rec.get("base"))
    return s.describe(str(rec.get("engine") or ""))  # the recipe writes its engine's name


def release_setup(version: str, adapter: Any) -> ReleaseSetup:
    """Where ``version`` runs (nothing is created).

    Raises:
        ReleaseError: the version is not in the index.
    """
    a = _adapter(adapter)
    idx = load_index(a)
    rel = idx.get(version)
    folder = Path(a.release_testbed_dir(version))
    py = folder / "venv" / "bin" / "python"
    ok = py.exists() and (folder / ".setup-stamp").is_file()
    table = idx.testbeds.get(version, {})
    recipe = table.get("recipe")
    with_recipe = sorted(idx.testbeds)
    rec = testbed_record(str(py)) if ok else None
    kind = str((rec or {}).get("kind") or table.get("kind") or "venv")
    base = (rec or {}).get("base") or table.get("base")
    if recipe:
        cmd = a.testbed_setup_command() + ("" if version == idx.testbed_default else f" --release {version}")
        if table.get("kind") == "overlay" and base and not release_setup(str(base), a).python:
            cmd = f"{a.testbed_setup_command()} --release {base} && {cmd}"
    else:
        pins = " ".join(f"'{p}'" for p in (f"{idx.engine}=={version}", *rel.requires))
        cmd = (f"only {', '.join(with_recipe) or 'no release'} {'has' if len(with_recipe) == 1 else 'have'} a testbed "
               f"recipe today ({a.testbed_setup_command()}); by hand (untested: the CPU stand-in and compat layer are "
               f"written for {', '.join(with_recipe) or 'another release'}): python3 -m venv {folder}/venv && "
               f"{folder}/venv/bin/pip install {pins} py-spy && touch {folder}/.setup-stamp")
    return ReleaseSetup(version, folder, py if ok else None, cmd, bool(recipe), kind, base)




def release_python(version: str, adapter: Any) -> str:
    """The interpreter of release ``version``.

    Raises:
        ReleaseError: unknown version, or not set up: one line naming the command that sets it up.
    """
    s = release_setup(version, adapter)
    if s.python is None:
        a = _adapter(adapter)
        how = f"set it up with: {s.setup_command}" if s.has_recipe else s.setup_command
        raise ReleaseError(f"{a.name} {version} is not set up (no {s.folder}/venv/bin/python with .setup-stamp); {how}")
    return str(s.python)


def version_in_text(text: str, index: ReleaseIndex) -> Optional[tuple[str, str]]:
    """The version a report names (``sglang: 0.5.18`` of ``python3 -m sglang.check_env``, ``sglang==0.5.18``, a
    log's ``sglang version 0.5.18``) as ``(version, the line that said it)``; None when no pattern matches."""
    for pat in index.patterns:
        m = re.search(pat, text)
        if m:
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            return m.group(1), text[start:end if end >= 0 else None].strip()
    return None


def versions_in_text(text: str, index: ReleaseIndex) -> list[tuple[str, str]]:
    """Every distinct version ``text`` names by any of the index's patterns, as ``(version, the line that said it)``
    in order of first appearance (a pasted report holding two ``check_env`` blocks names two)."""
    found: dict[str, tuple[int, str]] = {}
    for pat in index.patterns:
        for m in re.finditer(pat, text):
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            if m.group(1) not in found or m.start() < found[m.group(1)][0]:
                found[m.group(1)] = (m.start(), text[start:end if end >= 0 else None].strip())
    return [(v, line) for v, (_, line) in sorted(found.items(), key=lambda kv: kv[1][0])]


@dataclass
class ReleaseChoice:
    """Which release to use and why.

    Attributes:
        version: the chosen release (None: nothing to go by; the caller keeps its default interpreter).
        source: ``forced`` | ``report`` | ``frames`` | ``none``.
        reason: one line for people (REPORT / stdout).
        candidates: the releases that can have produced the dump (release order; frames only).
        excluded: version → why it was left out (a factory that does not build a frame's class).
    """

    version: Optional[str]
    source: str
    reason: str
    candidates: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": self.version, "source": self.source, "reason": self.reason, "candidates": self.candidates,
                "excluded": self.excluded}


def never_built(site: str, version: Optional[str], adapter: Any) -> Optional[str]:
    """A warning when ``site`` (``module:Class.method``) is on a class that release ``version``'s tree-cache
    factory never builds (nor a subclass of it), though other releases' factories do: patching it there is dead code
    (sglang 0.5.19 and 0.5.20 ship ``hiradix_cache.HiRadixCache`` but build ``UnifiedRadixCache``). None when it is
    built, the class is no factory class, the version is unknown, or the engine has no release index."""
    if not version or ":" not in site:
        return None
    try:
        index = load_index(adapter)
        rel = index.get(version)
    except ReleaseError:
        return None
    cls = site.split(":", 1)[1].split(".")[0]
    builders = [r.version for r in index.releases if r.builds(cls)]
    if not builders or rel.builds(cls):
        return None
    built = sorted({b.rsplit(":", 1)[-1] for b in rel.factory_builds})
    return (f"{site} resolves, but {index.engine} {version}'s tree-cache factory never builds {cls} (it builds "
            f"{', '.join(built) or 'nothing indexed'}; {cls} is built by {builders[0]}–{builders[-1]}): a patch there "
            "is dead code; add an alternative on a class this release builds")


def infer_releases(frames: Iterable[FrameRef], index: ReleaseIndex) -> tuple[list[str], dict[str, str], int]:
    """The releases that can have produced ``frames``: every indexed frame's function in its file with its line
    inside the function (the intersection; when no release has them all, the releases matching the most frames),
    less the releases whose tree-cache factory builds none of the frames' factory classes (or a subclass).

    Returns:
        (candidate versions in release order, excluded version → why, number of frames that counted).
    """
    cands, excluded, counted, _ = infer_releases_scored(frames, index)
    return cands, excluded, counted


def infer_releases_scored(frames: Iterable[FrameRef], index: ReleaseIndex
                          ) -> tuple[list[str], dict[str, str], int, int]:
    """:func:`infer_releases` plus how many of the counted frames the candidates hold at their lines: equal to the
    count when some release has them all, fewer when none does (a release outside the index, a local edit)."""
    n = len(index.releases)
    everything = (1 << n) - 1
    masks = []
    classes: set[str] = set()
    universe = {b.rsplit(":", 1)[-1] for r in index.releases for b in r.factory_builds}
    for f in frames:
        m = index.frame_mask(f)
        if m is None:
            continue
        masks.append(m)
        classes |= index.frame_classes(f) & universe
    if not masks:
        return [], {}, 0, 0
    mask = everything
    for m in masks:
        mask &= m
    best = len(masks)
    if mask == 0:  # no release has every frame (a local edit, a backport): the releases matching the most frames
        score = [sum(m >> i & 1 for m in masks) for i in range(n)]
        best = max(score)
        mask = sum(1 << i for i in range(n) if score[i] == best)
    excluded: dict[str, str] = {}
    for i, r in enumerate(index.releases):
        if not mask >> i & 1:
            continue
        missing = sorted(c for c in classes if not r.builds(c))
        if missing:
            excluded[r.version] = f"its factory does not build {', '.join(missing)}"
    kept = [v for v in index.mask_versions(mask) if v not in excluded]
    return (kept or index.mask_versions(mask)), (excluded if kept else {}), len(masks), best


def choose_release(index: ReleaseIndex, *, forced: Optional[str] = None, texts: Sequence[tuple[str, str]] = (),
                   frames: Sequence[FrameRef] = (), is_set_up: Any = None) -> ReleaseChoice:
    """Pick the release: ``forced`` (``--release``), else the first report text naming one (``(source, text)``
    pairs: a pasted check_env block, a log), else :func:`infer_releases` over ``frames``: the newest candidate that
    ``is_set_up(version)`` (default: all count as set up), else the newest candidate.

    Raises:
        ReleaseError: ``forced`` or the named version is not in the index; the texts name two or more releases
            (never one chosen silently).
    """
    if forced:
        index.get(forced)
        why = f"{index.engine} {forced}: forced with --release"
        cands, _, counted, _ = infer_releases_scored(frames, index)
        if cands and forced not in cands:  # forced wins, but a choice the frames contradict is said
            rng = cands[0] if len(cands) == 1 else f"{cands[0]}–{cands[-1]}"
            why += f" (note: the dump's {counted} indexed frame(s) point to {rng}, not {forced})"
        return ReleaseChoice(forced, "forced", why)
    named: dict[str, tuple[str, str]] = {}  # version -> (source, line): every release the texts name
    for src, text in texts:
        for v, line in versions_in_text(text, index):
            named.setdefault(v, (src, line))
    if len(named) > 1:  # a report that names two releases cannot pick one: never choose silently
        raise ReleaseError(f"the reports name {len(named)} {index.engine} releases: " + "; ".join(
            f"{v} in {src} ({line!r})" for v, (src, line) in named.items())
            + "; pass the one the dumps came from with --release V")
    for v, (src, line) in named.items():
        if v not in index.versions():
            raise ReleaseError(f"{src} names {index.engine} {v} ({line!r}), which is not in the release index "
                               f"({index.versions()[0]}–{index.versions()[-1]}); force one with --release V")
        return ReleaseChoice(v, "report", f"{index.engine} {v}: named by {src} ({line!r})")
    cands, excluded, counted, fit = infer_releases_scored(frames, index)
    if not cands:
        return ReleaseChoice(None, "none", f"no frame is in the {index.engine} release index "
                             f"({index.versions()[0]}–{index.versions()[-1]}); no release inferred")
    ok = is_set_up or (lambda v: True)
    chosen = next((v for v in reversed(cands) if ok(v)), cands[-1])
    rng = cands[0] if len(cands) == 1 else f"{cands[0]}–{cands[-1]} ({len(cands)} releases: {', '.join(cands)})"
    if fit == counted:
        why = f"{index.engine} {chosen}: the dump's {counted} indexed frame(s) fit {rng}"
    else:  # never say the frames fit when none of the indexed releases holds them all
        why = (f"{index.engine} {chosen}: no indexed release ({index.versions()[0]}–{index.versions()[-1]}) holds "
               f"all {counted} indexed frame(s) at their lines (a release outside the index, or local edits?); "
               f"the closest, {fit} of {counted}: {rng}")
    if excluded:
        why += "; left out " + "; ".join(f"{v} ({w})" for v, w in excluded.items())
    if len(cands) > 1:
        why += f"; chose {chosen}, the newest " + (
            "of them" if is_set_up is None else "that is set up" if ok(chosen) else "of them (none is set up)")
    return ReleaseChoice(chosen, "frames", why, cands, excluded)
