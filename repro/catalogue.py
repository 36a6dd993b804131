"""The hunt catalogue: an engine adapter's rank-local decision points, the perturbations that apply to them, and how
to classify the collective a perturbed run diverged in (data: ``scenarios/sglang/hunt_catalogue.toml``).

Read by ``repro hunt`` (what to perturb), ``repro discover`` (discovered points join it) and ``repro reproduce``
(the perturbations a root-cause candidate may use). Plain records and their loader only: no run, no report.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from repro.resources import EXAMPLES_DIR
from repro.targets import DEFAULT_ADAPTER


class HuntError(Exception):
    """The hunt could not be prepared or its baseline failed; the message names the file/flag and the fix."""


def catalogue_for(adapter: Any) -> Path:
    """The hunt catalogue of an engine adapter (the run's adapter, or a registered name).

    Raises:
        HuntError: the adapter has none (names it and ``--catalogue``).
    """
    if isinstance(adapter, str):
        from repro.targets.registry import get_adapter

        adapter = get_adapter(adapter)
    if adapter.hunt_catalogue is None:
        raise HuntError(f"adapter {adapter.name!r} has no hunt catalogue; pass --catalogue FILE")
    return Path(adapter.hunt_catalogue)


NATURAL_CATALOGUE_NAME = "natural_nemeses.toml"  # beside the adapter's hunt catalogue


def hunt_catalogue(adapter: Any, natural: bool = False) -> Path:
    """The adapter's hunt catalogue, or with ``natural`` its natural catalogue (``natural_nemeses.toml`` beside it).

    Raises:
        HuntError: the adapter has none, or no natural catalogue (names the file and ``--catalogue``).
    """
    path = catalogue_for(adapter)
    if not natural:
        return path
    nat = path.with_name(NATURAL_CATALOGUE_NAME)
    if not nat.is_file():
        raise HuntError(f"--natural: {nat} not found (the adapter's natural nemeses); pass --catalogue FILE")
    return nat


DEFAULT_CATALOGUE = catalogue_for(DEFAULT_ADAPTER)  # the default adapter's: a clone's scenarios/ or the installed wheel's copy


# ----------------------------------------------------------------------------------------------------- catalogue
LASTING_KINDS = ("fault", "clock", "state", "fail")  # actions whose effect outlives the trial (Perturbation.lasting; fail: pages never written)


@dataclass(frozen=True)
class Perturbation:
    """A way to perturb a decision point once: ``action`` is a scenario injection action (``repro.scenario``).

    ``by_construction``: the perturbation itself removes or adds a collective on one rank (skipping a function that
    issues one, an extra collective): a deadlock then shows the engine does not tolerate it, not that the engine can
    get there by itself; such deadlocks are never listed as findings or candidates.
    """

    name: str
    action: dict
    says: str
    by_construction: bool = False
    control: bool = False  # the natural hunt's control row: a forced action, run to show the oracle catches it

    @property
    def nature(self) -> str:
        """``natural`` (an environment nemesis), ``forced`` (the engine's own bookkeeping) or ``control``."""
        from repro.scenario import nature_of

        return "control" if self.control else nature_of(self.action)

    @property
    def lasting(self) -> bool:
        """Its effect outlives the trial in the server's processes: a ``fault`` (the thread it hit may have died), a
        ``clock`` shift (the process keeps the shifted clock), a ``state`` take (the slots stay taken), a storage ``fail``
        (the pages it did not write stay missing from that rank's storage). The hunt
        restarts the trial server after such a trial so the next one starts clean."""
        return str(self.action.get("kind")) in LASTING_KINDS


@dataclass(frozen=True)
class DecisionPoint:
    """A rank-local decision point: ``sites`` (``module:Class.method`` alternatives), what its value means, the
    perturbations that apply, and (for functions read everywhere, like clocks) caller globs that keep a row.

    ``loops``: keep only rows whose direct caller runs the call inside a ``for`` loop over one of these targets
    (``""`` = in no loop of the caller); empty keeps every row (discovered points name the loop their guard is in).
    ``servers``: on a multi-server stack (PD: ``prefill`` / ``decode``), keep only rows seen on these engine servers
    (empty: every server; a single server's rows have no server and are always kept).
    """

    name: str
    sites: tuple[str, ...]
    what: str
    perturbations: tuple[str, ...]
    callers: tuple[str, ...] = ()
    loops: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()


@dataclass(frozen=True)
class NamedCollective:
    """A collective we can name: a blocked rank whose caller chain matches any of ``frames`` is in it."""

    frames: tuple[str, ...]
    name: str


@dataclass(frozen=True)
class KnownIssue:
    """An upstream issue: a deadlock whose divergent chain matches all ``frames`` is that issue, not a finding."""

    issue: str
    frames: tuple[str, ...]


@dataclass(frozen=True)
class SiteApi:
    """How to perturb collectives the ledger names ``<prefix>.<method>`` (``--sites``).

    ``owner``: where the API lives (``module:Class`` or a module); ``skip``: the skip action (e.g. hand back the
    in-place input); ``extra_group``: attribute of ``self`` holding the group for an extra collective (None: no
    extra, e.g. module functions have no ``self``).
    """

    prefix: str
    owner: str
    skip: dict
    extra_group: Optional[str] = None

    def site_of(self, api: str) -> Optional[str]:
        """``GroupCoordinator.all_reduce`` → ``sglang…parallel_state:GroupCoordinator.all_reduce``; None if not ours."""
        if not api.startswith(self.prefix + "."):
            return None
        method = api[len(self.prefix) + 1:]
        return f"{self.owner}.{method}" if ":" in self.owner else f"{self.owner}:{method}"


@dataclass(frozen=True)
class Catalogue:
    """The adapter's hunt catalogue (see ``scenarios/sglang/hunt_catalogue.toml``)."""

    path: Path
    points: tuple[DecisionPoint, ...]
    perturbations: dict
    forward_frames: tuple[str, ...] = ()
    idle_frames: tuple[str, ...] = ()
    named: tuple[NamedCollective, ...] = ()
    known: tuple[KnownIssue, ...] = ()
    crash_forward_functions: tuple[str, ...] = ()
    site_apis: tuple[SiteApi, ...] = ()

    def point(self, name: str) -> DecisionPoint:
        for p in self.points:
            if p.name == name:
                return p
        raise HuntError(f"{self.path}: no decision point {name!r}; known: {', '.join(p.name for p in self.points)}")


def _tuple(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(str(x) for x in v)


def _action_error(e: Any) -> str:
    """The first problem of an action's validation: the field (``delay_s``; none for a bad ``kind``), what was
    expected and the value given (``Input should be greater than 0 (got -2.0)``), as a scenario file's errors say."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"] if x not in ("id", "site", "action")][1:]  # [kind, field…] → the field
    from repro.scenario import got_clause

    return f"{'.'.join(loc) + ': ' if loc else ''}{err['msg']}{got_clause(err)}"


SUPPORTED_VERSIONS = (1,)  # the catalogue ``version`` values this loader reads (absent: the current one)

# Every field each entry of a catalogue may hold, and what it must be (a typo is refused, never ignored: a point with
# ``perturbation = [...]`` would otherwise run with none, ``caller = [...]`` would drop its clock-call filter).
_TOP = {"version": "int", "perturbations": "table", "points": "tables", "classify": "table", "known": "tables",
        "sites": "table"}
_PERTURBATION = {"action": "table", "says": "str", "by_construction": "bool", "control": "bool"}
_POINT = {"name": "str", "site": "strs", "what": "str", "perturbations": "strs", "callers": "strs", "loops": "strs",
          "servers": "servers"}
_CLASSIFY = {"forward_frames": "strs", "idle_frames": "strs", "named": "tables", "crash_forward_functions": "strs"}
_NAMED = {"frames": "strs", "name": "str"}
_KNOWN = {"issue": "str", "frames": "strs"}
_SITES = {"apis": "table"}
_API = {"owner": "str", "skip": "table", "extra_group": "str"}
_EXPECT = {"int": "an integer", "str": "a string", "bool": "a TOML boolean (true or false, unquoted)",
           "table": "a table", "tables": "an array of tables ([[...]])", "strs": "a string or a list of strings",
           "servers": 'a list of server names, e.g. servers = ["prefill"]'}


def _is(kind: str, v: Any) -> bool:
    if kind == "int":
        return type(v) is int
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind == "table":
        return isinstance(v, dict)
    if kind == "tables":
        return isinstance(v, list) and all(isinstance(x, dict) for x in v)
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))  # strs, servers


def _check_keys(p: Path, where: str, entry: Any, spec: dict, label: str = "") -> dict:
    """``entry`` as a table whose every key is in ``spec`` and holds what ``spec`` says (:data:`_EXPECT`).

    Args:
        where: the entry as the file names it (``points[3]``, ``perturbations.zero_once``; "" for the top level).
        label: added after ``where`` in the unknown-field message (``(name = "perf_counter")``).
    Raises:
        HuntError: not a table; an unknown key (the nearest valid key, or all of them); a value of the wrong type
            (``where.key: expected …  (got …)``; a boolean must be a TOML boolean, not ``"false"``).
    """
    import difflib

    from repro.scenario import toml_value

    if not isinstance(entry, dict):
        raise HuntError(f"{p}: {where}: expected a table (got {toml_value(entry)})")
    for key, v in entry.items():
        if key not in spec:
            near = difflib.get_close_matches(key, list(spec), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}?" if near else f"expected one of: {', '.join(spec)}"
            at = f"{where} {label}".strip() or "top level"
            raise HuntError(f"{p}: {at}: unknown field {key!r}; {hint}")
        if not _is(spec[key], v):
            raise HuntError(f"{p}: {where + '.' if where else ''}{key}: expected {_EXPECT[spec[key]]} (got {toml_value(v)})")
    return entry


def load_catalogue(path: Path = DEFAULT_CATALOGUE) -> Catalogue:
    """Read and check a hunt catalogue TOML file.

    Each perturbation's action is validated as a scenario action (``repro.scenario.Injection``), so a typo fails here,
    before any launch.

    Raises:
        HuntError: missing file, bad TOML, an unsupported ``version``, an unknown field anywhere (the entry and the
            nearest valid field named), or a bad field (named as ``points[i].field`` with what was expected; a
            boolean must be a TOML boolean).
    """
    from pydantic import ValidationError

    from repro.scenario import Injection

    p = Path(path)
    if not p.is_file():
        raise HuntError(f"{p}: hunt catalogue not found (expected a TOML file like {EXAMPLES_DIR}/hunt_catalogue.toml)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise HuntError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise HuntError(f"{p}: not a UTF-8 text file (binary?); pass a TOML file like {EXAMPLES_DIR}/hunt_catalogue.toml") from None
    _check_keys(p, "", data, _TOP)
    if "version" in data and data["version"] not in SUPPORTED_VERSIONS:
        raise HuntError(f"{p}: version = {data['version']}: this harness reads hunt catalogue version(s) "
                        f"{', '.join(map(str, SUPPORTED_VERSIONS))}; write version = {SUPPORTED_VERSIONS[-1]} "
                        "(and the fields that version has), or use the harness that wrote the file")
    perts: dict[str, Perturbation] = {}
    for name, spec in (data.get("perturbations") or {}).items():
        if isinstance(spec, dict):
            _check_keys(p, f"perturbations.{name}", spec, _PERTURBATION)
        if not isinstance(spec, dict) or not isinstance(spec.get("action"), dict):
            raise HuntError(f"{p}: perturbations.{name}: expected a table with an 'action' table, e.g. action = {{ kind = \"return_value\", value = 0 }}")
        try:
            Injection.model_validate({"id": "check", "site": "m:f", "action": spec["action"]})
        except ValidationError as e:
            raise HuntError(f"{p}: perturbations.{name}.action is not a valid injection action: {_action_error(e)}") from None
        perts[name] = Perturbation(name, dict(spec["action"]), str(spec.get("says", name)), bool(spec.get("by_construction", False)),
                                   bool(spec.get("control", False)))
    points = []
    for i, spec in enumerate(data.get("points") or []):
        where = f"{p}: points[{i}]"
        if isinstance(spec, dict):
            _check_keys(p, f"points[{i}]", spec, _POINT,
                        f"(name = {spec['name']!r})" if isinstance(spec.get("name"), str) else "")
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("site"):
            raise HuntError(f"{where}: expected 'name' and 'site' ('module:Class.method' or a list of alternatives)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", spec["name"]):
            raise HuntError(f"{where}.name: {spec['name']!r} must use letters, digits, '_', '.', '-' only")
        unknown = [x for x in _tuple(spec.get("perturbations")) if x not in perts]
        if unknown:
            raise HuntError(f"{where}.perturbations: unknown {unknown}; defined: {sorted(perts)}")
        try:
            Injection.model_validate({"id": "check", "site": list(_tuple(spec["site"])), "action": {"kind": "none"}})
        except ValidationError as e:
            raise HuntError(f"{where}.site: {e.errors()[0]['msg']}") from None
        points.append(DecisionPoint(spec["name"], _tuple(spec["site"]), str(spec.get("what", "")),
                                    _tuple(spec.get("perturbations")), _tuple(spec.get("callers")), _tuple(spec.get("loops")),
                                    _tuple(spec.get("servers"))))
    if not points:
        raise HuntError(f"{p}: no [[points]]: the catalogue must list at least one decision point")
    names = [x.name for x in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HuntError(f"{p}: decision point names must be unique, repeated: {dup}")
    cl = _check_keys(p, "classify", data.get("classify") or {}, _CLASSIFY)
    for j, n in enumerate(cl.get("named") or []):
        _check_keys(p, f"classify.named[{j}]", n, _NAMED)
    for j, k in enumerate(data.get("known") or []):
        _check_keys(p, f"known[{j}]", k, _KNOWN)
    named = tuple(NamedCollective(_tuple(n.get("frames")), str(n.get("name", ""))) for n in cl.get("named") or [])
    known = tuple(KnownIssue(str(k.get("issue", "")), _tuple(k.get("frames"))) for k in data.get("known") or [])
    apis = []
    for prefix, spec in (_check_keys(p, "sites", data.get("sites") or {}, _SITES).get("apis") or {}).items():
        if isinstance(spec, dict):
            _check_keys(p, f"sites.apis.{prefix}", spec, _API)
        if not isinstance(spec, dict) or not spec.get("owner") or not isinstance(spec.get("skip"), dict):
            raise HuntError(f"{p}: sites.apis.{prefix}: expected owner = 'module:Class' and skip = {{ kind = \"skip\", … }}")
        try:
            Injection.model_validate({"id": "check", "site": "m:f", "action": spec["skip"]})
        except ValidationError as e:
            raise HuntError(f"{p}: sites.apis.{prefix}.skip is not a valid injection action: {_action_error(e)}") from None
        apis.append(SiteApi(prefix, str(spec["owner"]), dict(spec["skip"]), spec.get("extra_group")))
    return Catalogue(p, tuple(points), perts, _tuple(cl.get("forward_frames")), _tuple(cl.get("idle_frames")), named, known,
                     _tuple(cl.get("crash_forward_functions")), tuple(apis))


def check_natural(cat: Catalogue) -> None:
    """A natural hunt's catalogue: every perturbation natural except those marked ``control = true`` (at most one).

    Raises:
        HuntError: naming each forced perturbation and the fix (make it natural, or mark the one control).
    """
    forced = sorted(n for n, pt in cat.perturbations.items() if pt.nature == "forced")
    controls = sorted(n for n, pt in cat.perturbations.items() if pt.control)
    if forced:
        raise HuntError(f"{cat.path}: --natural: perturbation(s) {', '.join(forced)} force the engine's own "
                        "bookkeeping (return_value / skip / state / extra_collective); a natural hunt takes only "
                        "delay / stop / clock / fault / pending / miss / fail, plus one row marked control = true")
    if len(controls) > 1:
        raise HuntError(f"{cat.path}: --natural: {len(controls)} perturbations marked control ({', '.join(controls)}); "
                        "keep one control")


def check_storage_points(cat: Catalogue, storage_sites: Sequence[str], adapter_name: str) -> None:
    """A point offering a storage answer (``miss`` / ``fail``) must sit on storage backend methods only (the
    adapter's ``storage_sites`` globs): elsewhere the answer is the engine's own bookkeeping, forced, while its rows
    and fire records would say natural (docs/injector.md, "Storage answers").

    Raises:
        HuntError: the point, its first site outside the globs and the perturbation.
    """
    for pt in cat.points:
        storage = [n for n in pt.perturbations if str(cat.perturbations[n].action.get("kind")) in ("miss", "fail")]
        bad = [x for x in pt.sites if not any(fnmatch.fnmatchcase(x, g) for g in storage_sites)]
        if storage and bad:
            where = (f"the {adapter_name} adapter's storage backend methods ({', '.join(storage_sites)})"
                     if storage_sites else f"a storage backend method (the {adapter_name} adapter names none)")
            raise HuntError(f"{cat.path}: decision point {pt.name}: perturbation(s) {', '.join(storage)} (miss / fail) are "
                            f"natural only on {where}; the site {bad[0]} is not one: drop them from this point, or "
                            "put them on a point at the backend's own method")


def short_frame(frame: str) -> str:
    """``module:Class.method`` → ``Class.method`` (a name without a module is returned as it is)."""
    return frame.split(":", 1)[-1]


def glob_any(names: Sequence[str], patterns: Sequence[str]) -> bool:
    """Does any name match any glob? A pattern with ':' matches ``module:qual``; without, the part after ':'."""
    for pat in patterns:
        for n in names:
            target = n if ":" in pat else short_frame(n)
            if fnmatch.fnmatchcase(target, pat):
                return True
    return False
