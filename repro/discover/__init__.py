"""``repro discover`` / ``repro hunt --discover``: propose rank-local decision points from the engine's source.

Discovery proposes, the live hunt confirms. The AST scan (``repro/discover/scan.py``, standard library only) runs
in the TARGET interpreter, as ``repro sites`` runs the injector's resolver there: the harness never imports the
engine. It reads the adapter's rules (data: ``scenarios/sglang/discover_rules.toml``, found through the adapter's
``discover_rules`` or next to the hunt catalogue) and answers with *guards*: a branch, loop bound, ``break``,
``continue`` or ``return`` whose condition depends on a rank-local source and which changes whether, or how many
times, a collective-reaching call runs. This module turns them into ranked :class:`Candidate` records and into hunt
catalogue points (the same shape as ``hunt_catalogue.toml``'s ``[[points]]``), merged with the hand catalogue
(hand entries win). Nothing here renders; the CLI prints.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.resources import EXAMPLES_DIR
from repro.targets import DEFAULT_ADAPTER

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCAN_SCRIPT = Path(__file__).resolve().parent / "scan.py"
RULES_NAME = "discover_rules.toml"
SCAN_TIMEOUT_S = 600.0
_MARK = "REPRO-DISCOVER "
POINT_PREFIX = "d."

# rank order of guard kinds and source kinds (higher first): a `break`/`return` on a pool query is the #30760 shape
_GUARD_SCORE = {"break": 5, "return": 4, "continue": 4, "branch": 3, "loop bound": 3, "loop condition": 3,
                "raise": 2, "except": 1}
_SOURCE_SCORE = {"pool query": 3, "poll": 2, "clock": 2, "per-rank container": 3, "cross-call attribute": 2,
                 "thread-written attribute": 1, "len of per-rank container": 2, "except path": 0}
# (an emptiness/membership test on a per-rank container before a collective is the writing_check shape: with a
# pool query the top source kind; state carried across calls next to the polls)


class DiscoverError(Exception):
    """Discovery could not run: missing/bad rules file (named, with the field), the interpreter failed or timed out."""


# ------------------------------------------------------------------------------------------------------ rules
def default_rules_path(adapter: Any, catalogue: Optional[Path] = None) -> Path:
    """The rules file of the run's engine (``adapter``: its adapter, or a registered name): the adapter's
    ``discover_rules`` when it has one, else ``discover_rules.toml`` next to ``catalogue`` (default: the adapter's
    hunt catalogue).

    Raises:
        DiscoverError: neither the adapter nor ``catalogue`` says where the rules are (names the adapter).
    """
    a = adapter
    if isinstance(adapter, str):
        from repro.targets.registry import UnknownAdapterError, get_adapter

        try:
            a = get_adapter(adapter)
        except UnknownAdapterError as e:
            raise DiscoverError(str(e)) from None
    if a.discover_rules:
        return Path(a.discover_rules)
    if catalogue is None and a.hunt_catalogue:
        catalogue = Path(a.hunt_catalogue)
    if catalogue is None:
        raise DiscoverError(f"the {a.name} adapter has no discover rules and no hunt catalogue; pass --rules FILE")
    return Path(catalogue).parent / RULES_NAME


def load_rules(path: Path) -> dict:
    """Read and check a discovery rules TOML file.

    Returns:
        The rules as a dict (``package``, ``scope``, ``collectives``, ``sanitizers``, ``sources``,
        ``perturbations_by_kind``, ``perturbations_by_return``, ``perturbations``).
    Raises:
        DiscoverError: missing file, bad TOML, or a missing/ill-typed field (named, with what was expected).
    """
    p = Path(path)
    if not p.is_file():
        raise DiscoverError(f"{p}: discovery rules not found (expected a TOML file like {EXAMPLES_DIR}/{RULES_NAME})")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise DiscoverError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise DiscoverError(f"{p}: not a UTF-8 text file (binary?); pass a TOML rules file like "
                            f"{EXAMPLES_DIR}/{RULES_NAME}") from None
    if not isinstance(data.get("package"), str) or not data["package"]:
        raise DiscoverError(f"{p}: package: expected the engine's top-level package name, e.g. package = \"{DEFAULT_ADAPTER}\"")
    coll = data.get("collectives")
    if not isinstance(coll, dict) or not coll.get("torch_functions"):
        raise DiscoverError(f"{p}: collectives.torch_functions: expected a list of torch.distributed collective names")
    for key in ("coordinator_methods", "object_broadcasts", "sanitizers", "torch_modules"):
        if key in coll and not _str_list(coll[key]):
            raise DiscoverError(f"{p}: collectives.{key}: expected a list of strings ('module:Class.method' globs)")
    methods = (data.get("sources") or {}).get("methods")
    if not isinstance(methods, dict) or not all(_str_list(v) for v in methods.values()):
        raise DiscoverError(f"{p}: sources.methods: expected a table of kind = [method-name globs], e.g. "
                            f"\"pool query\" = [\"*available_size\"]")
    by_kind = data.get("perturbations_by_kind") or {}
    if not isinstance(by_kind, dict) or not all(_str_list(v) for v in by_kind.values()):
        raise DiscoverError(f"{p}: perturbations_by_kind: expected a table of source kind = [perturbation names]")
    by_ret = data.get("perturbations_by_return") or {}
    if (not isinstance(by_ret, dict) or not all(_str_list(v) for v in by_ret.values())
            or set(by_ret) - {"none", "bool", "container", "object"}):
        raise DiscoverError(f"{p}: perturbations_by_return: expected a table of none / bool / container / object = "
                            f"[perturbation names] (a number takes its source kind's)")
    return data


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# ------------------------------------------------------------------------------------------------------ scan
def cache_dir() -> Path:
    """Where scan answers are kept, keyed by the scanned files' sizes/mtimes, the rules and the scan script
    (``$REPRO_DISCOVER_CACHE``, else ``~/.cache/tp-deadlock-repro/discover``; ``off`` disables it)."""
    env = os.environ.get("REPRO_DISCOVER_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tp-deadlock-repro" / "discover"


def run_scan(python: str, rules: dict, *, root: Optional[str] = None, timeout_s: float = SCAN_TIMEOUT_S,
             only_functions: Sequence[str] = (), use_cache: bool = True) -> dict:
    """Run the AST scan in ``python`` (the target interpreter) and return its answer.

    Args:
        python: interpreter whose installed engine package is scanned (located with ``find_spec``, not imported).
        rules: :func:`load_rules`'s dict.
        root: scan this folder as the package instead (tests: a synthetic engine package).
        timeout_s: bound on the subprocess in seconds (sglang 0.5.23's ``srt``: ~15–35 s on 2 cores).
        only_functions: ``module:Qual`` globs; analyse guards only in these functions (the call graph is whole).
        use_cache: reuse the answer of an identical earlier scan (:func:`cache_dir`; any change to a scanned file,
            the rules or the script makes a new one).
    Returns:
        The scan's JSON (``guards``, ``families``, counts, ``seconds``).
    Raises:
        DiscoverError: the interpreter is missing, timed out, or crashed (its output tail is in the message).
    """
    req = {"package": rules["package"], "rules": rules, "root": root, "only_functions": list(only_functions)}
    cd = cache_dir()
    if use_cache and str(cd) != "off":
        req["cache_dir"] = str(cd)
    env = dict(os.environ)
    env.pop("REPRO_PLAN", None)
    try:
        proc = subprocess.run([python, str(SCAN_SCRIPT)], input=json.dumps(req), capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except FileNotFoundError:
        raise DiscoverError(f"interpreter {python} not found (pass --python PATH to a Python that has the engine installed)") from None
    except subprocess.TimeoutExpired:
        raise DiscoverError(f"the discovery scan in {python} took more than {timeout_s:.0f} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    raise DiscoverError(f"the discovery scan in {python} failed (exit {proc.returncode}):\n{tail}")


# ------------------------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    """One rank-local decision point the scan proposes.

    Attributes:
        caller: ``module:Qual`` of the function holding the guard (the direct caller of the source).
        source_kind: ``pool query`` | ``poll`` | ``clock`` | ``thread-written attribute`` |
            ``len of per-rank container`` | ``per-rank container`` (an emptiness or membership test on one: its
            writers are the leaves, kind ``container write``) | ``cross-call attribute`` (an attribute of self written
            from a rank-local value in another method: the writes' queries are the leaves) | ``except path``.
        source: the source expression as written (``self.get_num_allocatable_reqs()``), ``source_line`` its line.
        sites: ``module:Qual`` definitions the source call may land in (empty: not a patchable call — listed, not
            hunted).
        loop_var: the ``for`` loop target enclosing the source call in ``caller`` (None: in no loop).
        guard: ``break`` | ``return`` | ``continue`` | ``branch`` | ``loop bound`` | ``loop condition`` |
            ``raise`` | ``except``; ``guard_line`` its line.
        collective: the collective-reaching calls the guard controls (up to four, comma-separated, in source
            order); ``chain`` the functions from the first of them to the collective API (innermost last).
        why: one sentence.
        score: rank (higher first).
        file: source file of ``caller``.
        leaves: when the source is a call (or property read) of a function returning a rank-local value, the
            innermost rank-local queries that value comes from, as (site, the function calling it, kind): each is a
            patch site of its own, hunted in the rows of that direct caller (``PrefillBudget._available_and_evictable``
            calling ``evictable_size``, under a guard on ``adder.add_one_req(…)`` in the admission loop).
    """

    caller: str
    source_kind: str
    source: str
    source_line: int
    sites: tuple[str, ...]
    loop_var: Optional[str]
    guard: str
    guard_line: int
    collective: str
    chain: tuple[str, ...]
    why: str
    score: int
    file: str = ""
    leaves: tuple[tuple[str, str, str], ...] = ()

    @property
    def huntable(self) -> bool:
        return bool(self.sites or self.leaves)

    def to_json(self) -> dict:
        d = asdict(self)
        d["huntable"] = self.huntable
        return d


def candidates_from_scan(scan: dict) -> list[Candidate]:
    """Ranked candidates (score, then caller and line), one per (guard, source occurrence); duplicates merged."""
    out: dict[tuple, Candidate] = {}
    for g in scan.get("guards") or []:
        coll = g.get("collective") or {}
        chain = tuple(coll.get("chain") or ())
        for s in g.get("sources") or []:
            sites = tuple(s.get("sites") or ())
            leaves = tuple(tuple(x) for x in (s.get("leaves") or ()) if isinstance(x, (list, tuple)) and len(x) == 3)
            score = (_GUARD_SCORE.get(g["guard"], 0) * 10 + _SOURCE_SCORE.get(s["kind"], 0) * 3
                     + (5 if sites else 0) + (2 if s.get("loop_var") else 0) - min(len(chain), 8) // 3)
            api = chain[-1] if chain else coll.get("call", "")
            why = (f"`{s['text']}` ({s['kind']}, line {s['line']}"
                   + (f", inside `for {s['loop_var']}`" if s.get("loop_var") else "") + f") decides a {g['guard']} at "
                   f"line {g['line']}: {g['why']} (`{coll.get('call', '?')}` → {_short(api)})")
            if leaves:
                named = sorted({f"`{_short(site).rsplit('.', 1)[-1]}` in {_short(caller)}" for site, caller, _ in leaves})
                why += ("; the value comes from " + ", ".join(named[:4])
                        + (f" and {len(named) - 4} more" if len(named) > 4 else ""))
            calls = [str(x) for x in (coll.get("calls") or [coll.get("call", "")]) if x]
            c = Candidate(g["caller"], s["kind"], s["text"], int(s["line"]), sites, s.get("loop_var"), g["guard"],
                          int(g["line"]), ", ".join(calls), chain, why, score, g.get("file", ""), leaves)
            key = (c.caller, c.source, c.source_line, c.guard, c.guard_line)
            if key not in out or out[key].score < c.score:
                out[key] = c
    return sorted(out.values(), key=lambda c: (-c.score, c.caller, c.source_line, c.guard_line))


def _short(q: str) -> str:
    return q.split(":", 1)[-1]


# ------------------------------------------------------------------------------------------------ catalogue
@dataclass(frozen=True)
class DiscoveredPoint:
    """A catalogue point made from candidates: one site, restricted to the caller that holds the guard(s)."""

    name: str
    site: str
    caller: str
    what: str
    perturbations: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    family: tuple[str, ...] = ()  # other definitions of the site's method in its class hierarchy
    loop_var: Optional[str] = None  # the caller's `for` loop the source call is in (None: in no loop)
    any_loop: bool = False  # a leaf query: every row of its direct caller, in a loop or not (the guard is further up)
    folded: tuple[str, ...] = ()  # overrides of the same call in the same caller/loop folded into this point (dedup)
    # points of the same query deciding exactly the same guards, folded into this one: (site, caller) each
    same_decisions: tuple[tuple[str, str], ...] = ()

    @property
    def loop_vars(self) -> tuple[Optional[str], ...]:
        return (self.loop_var,)

    @property
    def loops(self) -> tuple[str, ...]:
        """The catalogue point's ``loops`` (``repro.catalogue.DecisionPoint``): empty keeps every row of the caller."""
        return () if self.any_loop else (self.loop_var or "",)


def _point_name(site: str, caller: str, loop_var: Optional[str], taken: set) -> str:
    method = _short(site).rsplit(".", 1)[-1]
    cls_site = _short(site).rsplit(".", 1)[0] if "." in _short(site) else site.split(":")[0].rsplit(".", 1)[-1]
    where = _short(caller).rsplit(".", 1)[-1] + (f".in-{loop_var}" if loop_var else "")
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{POINT_PREFIX}{cls_site}.{method}--{where}")
    name, i = base, 2
    while name in taken:
        name, i = f"{base}-{i}", i + 1
    taken.add(name)
    return name


def perturbations_for(kind: str, returns: Optional[Sequence[str]], rules: dict) -> list[str]:
    """The perturbation names for one patch site, in rules order.

    A site that is a rank-local query itself (``available_size``) takes its source kind's ``perturbations_by_kind``.
    A *returner* site (a function whose returned value derives from one: ``returns`` is its ``return_types`` from the
    scan) takes what fits what it returns, from ``perturbations_by_return``: ``none`` and ``bool`` their own lists,
    ``container`` (a list: an empty one fits) its own, ``number`` and ``unknown`` (another call's result) the kind's,
    ``object`` its own (none by default: a batch object has no drifted value, and 0 in its place only crashed the
    engine — measured in session 6, 6 trials)."""
    by_kind = rules.get("perturbations_by_kind") or {}
    if returns is None:
        return list(by_kind.get(kind, []))
    by_ret = rules.get("perturbations_by_return") or {}
    out: list[str] = []
    for t in ("none", "bool", "container", "number", "unknown", "object"):
        if t not in returns:
            continue
        names = by_kind.get(kind, []) if t in ("number", "unknown") else by_ret.get(t, [])
        out += [n for n in names if n not in out]
    return out


def discovered_points(cands: Sequence[Candidate], rules: dict, known_perturbations: Sequence[str],
                      families: Optional[dict] = None,
                      return_types: Optional[dict] = None, depths: Optional[dict] = None) -> list[DiscoveredPoint]:
    """One point per (site, caller, enclosing loop of the source call) of the huntable candidates, in candidate rank
    order (the loop splits "before the admission loop" from "inside `for req`": one row each in the baseline).

    Args:
        known_perturbations: names the merged catalogue defines (the hand catalogue's plus the rules' own);
            a perturbation not among them is dropped.
        families: the scan's ``families`` (site -> other definitions of its method).
        return_types: the scan's ``return_types`` (returner site -> what it returns): each site's perturbations
            follow it (:func:`perturbations_for`); a point left with none is not made.
        depths: the scan's ``site_depth`` (site -> MRO length of its class): overrides of one call are folded
            into the base class's point unless the rules prefer another (:func:`_fold_overrides`).
    """
    rets = return_types or {}
    ANY = object()  # the loop key of a leaf point: every row of its direct caller
    groups: dict[tuple, list[Candidate]] = {}
    kinds_of: dict[tuple, list[str]] = {}

    def add(key: tuple, c: Candidate, kind: str) -> None:
        groups.setdefault(key, []).append(c)
        ks = kinds_of.setdefault(key, [])
        if kind not in ks:
            ks.append(kind)

    for c in cands:
        if not c.huntable:
            continue
        for site in c.sites:
            add((site, c.caller, c.loop_var), c, c.source_kind)
        for site, caller, kind in c.leaves:
            add((site, caller, ANY), c, kind)
    for key in [k for k in groups if k[2] is ANY]:
        # a query its own caller already guards keeps the loop-split points (one row each, named by the loop)
        if any(k[:2] == key[:2] and k[2] is not ANY for k in groups):
            groups.pop(key)
            kinds_of.pop(key)
    folded = _fold_overrides(groups, rules, families, depths)
    perts_of: dict[tuple, list[str]] = {}
    for (site, caller, loop_var) in groups:
        perts: list[str] = []
        for k in kinds_of[(site, caller, loop_var)]:
            # a leaf is a direct query in its caller; a site from the candidate's own source may be a returner
            for p in perturbations_for(k, None if loop_var is ANY else rets.get(site), rules):
                if p in known_perturbations and p not in perts:
                    perts.append(p)
        if perts:
            perts_of[(site, caller, loop_var)] = perts
    merged = _fold_same_decisions({k: v for k, v in groups.items() if k in perts_of}, perts_of, rules, depths)
    taken: set = set()
    out = []
    for (site, caller, loop_var), cs in groups.items():
        perts = perts_of.get((site, caller, loop_var))
        if not perts or (site, caller, loop_var) in merged["dropped"]:
            continue
        same = merged["kept"].get((site, caller, loop_var), ())
        kinds = kinds_of[(site, caller, loop_var)]
        any_loop = loop_var is ANY
        loop_var = None if any_loop else loop_var
        guards = sorted({f"{c.guard} at line {c.guard_line}" for c in cs})
        if any_loop:
            outer = sorted({_short(c.caller) for c in cs})
            what = (f"discovered: `{_short(site).rsplit('.', 1)[-1]}` ({kinds[0]}) read in {_short(caller)} feeds "
                    f"{cs[0].source} in {', '.join(outer[:3])}, which decides {', '.join(guards[:4])} around "
                    f"{cs[0].collective or 'a collective-reaching call'}")
        else:
            what = (f"discovered: {cs[0].source} ({cs[0].source_kind}) in {_short(caller)} decides "
                    f"{', '.join(guards)} around {cs[0].collective or 'a collective-reaching call'}")
        fold = folded.get((site, caller, None if any_loop else loop_var, any_loop), ())
        if fold:
            what += f" (one point for {len(fold) + 1} overrides of the call: {', '.join(_short(x) for x in fold[:3])}" \
                    + (" …" if len(fold) > 3 else "") + " folded in)"
        if same:
            what += (f" (the same decisions also reached through "
                     + ", ".join(f"`{_short(x).rsplit('.', 1)[-1]}` in {_short(y)}" for x, y in same[:3])
                     + (" …" if len(same) > 3 else "") + ": folded in)")
        out.append(DiscoveredPoint(_point_name(site, caller, loop_var, taken), site, caller, what, tuple(perts), tuple(cs),
                                   tuple((families or {}).get(site) or ()), loop_var, any_loop, tuple(fold), same))
    return out


def _fold_same_decisions(groups: dict, perts_of: dict, rules: dict, depths: Optional[dict] = None) -> dict:
    """The same decision reached twice (issue 31): points of one query (method names folded as in
    :func:`_fold_overrides`), with the same perturbations, whose candidates decide exactly the same guards (caller,
    guard kind, line) — the free-space query read in two helpers whose values feed the same branches — are one decision
    point: perturbing either flips the same guards, nothing else. One is kept (the rules' ``prefer_sites`` first, then
    a direct read of the guard's caller before a leaf, then base class, site and caller by name); the others are
    named in it. Overrides of the query read at the kept read's place (same caller and loop) stay as
    ``max_sites_per_call`` left them. On only with ``[points] fold_same_decisions = true``.

    Args:
        groups: (site, caller, loop key) -> the candidates of that point (after :func:`_fold_overrides`).
        perts_of: the same keys -> the point's perturbation names.
    Returns:
        {"kept": key -> ((site, caller), …) folded into it, "dropped": the keys folded away}.
    """
    import fnmatch

    cfg = rules.get("points") or {}
    out: dict = {"kept": {}, "dropped": set()}
    if not cfg.get("fold_same_decisions", False):
        return out
    prefer = [str(x) for x in cfg.get("prefer_sites", [])]
    fold = [str(x) for x in cfg.get("fold_methods", [])]

    def method_group(site: str) -> str:
        m = _short(site).rsplit(".", 1)[-1]
        return next((g for g in fold if fnmatch.fnmatchcase(m, g)), m)

    def rank(key: tuple) -> tuple:
        site, caller, loop = key
        i = next((k for k, g in enumerate(prefer) if fnmatch.fnmatchcase(site, g)), len(prefer))
        return (i, not (isinstance(loop, str) or loop is None), (depths or {}).get(site, 99), site, caller)

    classes: dict[tuple, list[tuple]] = {}
    for key, cs in groups.items():
        decided = frozenset((c.caller, c.guard, c.guard_line) for c in cs)
        classes.setdefault((method_group(key[0]), tuple(perts_of[key]), decided), []).append(key)
    for keys in classes.values():
        keys.sort(key=rank)
        # overrides of one call at one place (the same caller and loop) are max_sites_per_call's to keep or fold
        rest = [k for k in keys if k[1:] != keys[0][1:]]
        if rest:
            out["kept"][keys[0]] = tuple((k[0], k[1]) for k in rest)
            out["dropped"].update(rest)
    return out


def _fold_overrides(groups: dict, rules: dict, families: Optional[dict] = None, depths: Optional[dict] = None) -> dict:
    """De-duplicate points (issue 31): the overrides of one method called at one place (caller, loop) — an allocator's
    ``available_size`` in a dozen subclasses, of which a server builds one — are one decision point, not one each.
    Per (method name, caller, loop) at most ``[points] max_sites_per_call`` sites are kept (rules; default 2), those
    matching ``[points] prefer_sites`` first (in that order; engine data: the classes its default configuration
    builds), then by name; the others are dropped from ``groups`` (in place) and named in the kept point. Method
    names matching one glob of ``[points] fold_methods`` count as one name (``full_available_size`` and
    ``swa_available_size`` of a hybrid allocator are the same free-space query).

    Returns:
        (kept site, caller, loop var or None, any_loop) -> the sites folded into it.
    """
    import fnmatch

    cfg = rules.get("points") or {}
    cap = int(cfg.get("max_sites_per_call", 2))
    prefer = [str(x) for x in cfg.get("prefer_sites", [])]
    fold = [str(x) for x in cfg.get("fold_methods", [])]
    if cap < 1:
        return {}

    def rank(site: str) -> tuple:  # preferred classes, then a base class before its subclasses, then by name
        i = next((k for k, g in enumerate(prefer) if fnmatch.fnmatchcase(site, g)), len(prefer))
        return (i, (depths or {}).get(site, 99), site)

    def method_group(site: str) -> str:  # `full_available_size`, `swa_available_size`… fold as one query
        m = _short(site).rsplit(".", 1)[-1]
        return next((g for g in fold if fnmatch.fnmatchcase(m, g)), m)

    by_call: dict[tuple, list[tuple]] = {}
    for key in groups:
        site, caller, loop = key
        # a leaf point (every row of its caller) and an outside-loops point of the same call fold together
        by_call.setdefault((method_group(site), caller, loop if isinstance(loop, str) else None), []).append(key)
    # the same query called from every override of one method (`HostKVCache.alloc`, `MambaPoolHost.alloc`, …; one
    # class of the hierarchy is built): folded across the overrides, keyed by the family's first name
    merged: dict[tuple, list[tuple]] = {}
    for (mg, caller, loop), keys in by_call.items():
        where = min([caller, *((families or {}).get(caller) or ())])
        merged.setdefault((mg, where, loop), []).extend(keys)
    by_call = merged
    out: dict = {}
    for keys in by_call.values():
        if len(keys) <= cap:
            continue
        keys.sort(key=lambda k: (rank(k[0])[0], isinstance(k[2], str) or k[2] is None) + rank(k[0])[1:])
        kept, dropped = keys[:cap], keys[cap:]
        for k in dropped:
            groups.pop(k)
        head = kept[0]
        loop = head[2] if isinstance(head[2], str) or head[2] is None else None
        out[(head[0], head[1], loop, not (isinstance(head[2], str) or head[2] is None))] = tuple(k[0] for k in dropped)
    return out


def points_toml(points: Sequence[DiscoveredPoint], header: str = "") -> str:
    """The discovered points as hunt catalogue TOML (``[[points]]`` with name/site/what/perturbations/callers)."""
    lines = [f"# {x}" for x in header.splitlines()] if header else []
    lines.append("version = 1")
    for p in points:
        lines += ["", "[[points]]", f"name = {json.dumps(p.name)}", f"site = {json.dumps(p.site)}",
                  f"what = {json.dumps(p.what, ensure_ascii=False)}",
                  f"perturbations = {json.dumps(list(p.perturbations))}",
                  f"callers = {json.dumps([p.caller])}", f"loops = {json.dumps(list(p.loops))}"]
        if p.folded:
            lines.append(f"# folded in (the same call's other overrides): {', '.join(p.folded)}")
        if p.same_decisions:
            lines.append("# folded in (the same query deciding the same guards): "
                         + ", ".join(f"{site} in {caller}" for site, caller in p.same_decisions))
        for c in p.candidates[:4]:
            lines.append(f"# {c.guard} (line {c.guard_line}) on {c.source} (line {c.source_line}"
                         + (f", in `for {c.loop_var}`" if c.loop_var else "") + f") → {c.collective}")
    return "\n".join(lines) + "\n"


def merge_catalogue(hand: Any, points: Sequence[DiscoveredPoint], rules: dict, *, keep_hand_points: bool = True) -> tuple[Any, list[DiscoveredPoint]]:
    """The hunt catalogue with the discovered points added (hand entries win).

    Args:
        hand: the hand ``repro.catalogue.Catalogue`` (its perturbations, classification and known issues are always
            kept: they say how to read a trial, not where to search).
        keep_hand_points: False drops the hand catalogue's ``[[points]]`` (discovery alone decides where to search).
    Returns:
        (merged Catalogue, the discovered points that were added: a point whose site a kept hand point already
        names is left out).
    """
    import dataclasses

    from repro.catalogue import DecisionPoint, Perturbation, glob_any

    perts = dict(hand.perturbations)
    for name, spec in (rules.get("perturbations") or {}).items():
        if name not in perts and isinstance(spec, dict) and isinstance(spec.get("action"), dict):
            perts[name] = Perturbation(name, dict(spec["action"]), str(spec.get("says", name)),
                                       bool(spec.get("by_construction", False)))

    kept = list(hand.points) if keep_hand_points else []
    names = {p.name for p in kept}

    def hand_covers(p: DiscoveredPoint) -> bool:
        # a hand point naming the site wins, unless its own callers filter leaves this caller out (the hand clock
        # points watch timeout paths only: a discovered clock read elsewhere is new)
        return any(p.site in h.sites and (not h.callers or glob_any((p.caller,), h.callers)) for h in kept)

    added = []
    for p in points:
        if p.name in names or hand_covers(p):
            continue
        added.append(p)
        names.add(p.name)
    new = tuple(DecisionPoint(p.name, (p.site,), p.what, p.perturbations, (p.caller,), p.loops) for p in added)
    return dataclasses.replace(hand, points=tuple(kept) + new, perturbations=perts), added


# ------------------------------------------------------------------------------------------------- discovery
@dataclass
class Discovery:
    """What ``repro discover`` found: the scan's counts, the ranked candidates and the catalogue points."""

    rules_path: Path
    python: str
    scan: dict
    candidates: list[Candidate]
    points: list[DiscoveredPoint] = field(default_factory=list)

    def summary(self) -> dict:
        s = self.scan
        return {"package": s.get("package"), "folder": s.get("folder"), "modules": s.get("modules"),
                "functions": s.get("functions"), "calls": s.get("calls"), "unresolved_calls": s.get("unresolved_calls"),
                "reaching_functions": s.get("reaching"), "guards": len(s.get("guards") or []),
                "candidates": len(self.candidates), "huntable": sum(1 for c in self.candidates if c.huntable),
                "points": len(self.points), "folded": sum(len(p.folded) for p in self.points),
                "same_decisions_folded": sum(len(p.same_decisions) for p in self.points),
                "cross_call_attrs": s.get("cross_call_attrs"), "stored_callables": s.get("stored_callables"),
                "seconds": s.get("seconds"), "cached": s.get("cached")}

    def to_json(self) -> dict:
        return {"rules": str(self.rules_path), "python": self.python, "summary": self.summary(),
                "candidates": [c.to_json() for c in self.candidates],
                "points": [{"name": p.name, "site": p.site, "caller": p.caller, "what": p.what,
                            "perturbations": list(p.perturbations), "loop_vars": list(p.loop_vars),
                            "family": list(p.family), "folded": list(p.folded),
                            "same_decisions": [list(x) for x in p.same_decisions]} for p in self.points],
                "unresolved_in_guarded": self.scan.get("unresolved_in_guarded") or {},
                "thread_attrs": self.scan.get("thread_attrs") or {}}

    def markdown(self, limit: int = 60) -> str:
        """DISCOVERY.md: what was scanned, the ranked candidates, the points, the unresolved calls."""
        s = self.summary()
        out = ["# repro discover", "",
               f"- **rules**: {self.rules_path}", f"- **python**: {self.python}",
               f"- **package**: {s['package']} ({s['folder']})",
               f"- **scanned**: {s['modules']} modules, {s['functions']} functions, {s['calls']} calls "
               f"({s['unresolved_calls']} resolve to nothing in the package: listed below for the guarded functions, "
               f"never guessed); {s['reaching_functions']} functions reach a collective",
               f"- **found**: {s['guards']} guards → {s['candidates']} candidates ({s['huntable']} with a patchable "
               f"site) → {s['points']} catalogue points ({s['folded']} more overrides of the same calls and "
               f"{s['same_decisions_folded']} reads of the same query deciding the same guards folded into them); across calls: {s['cross_call_attrs']} attributes written from rank-local values, "
               f"{s['stored_callables']} callables stored on self followed", ""]
        out += ["## Candidates (ranked)", "", "| # | score | caller | source (kind) | loop | guard | guarded collective | sites |",
                "|---|---|---|---|---|---|---|---|"]
        for i, c in enumerate(self.candidates[:limit], 1):
            out.append(f"| {i} | {c.score} | `{_short(c.caller)}` | `{_md(c.source)}` ({c.source_kind}, l.{c.source_line}) | "
                       f"{('`for ' + c.loop_var + '`') if c.loop_var else '—'} | {c.guard} (l.{c.guard_line}) | "
                       f"`{_md(c.collective)}` → {_md(' → '.join(_short(x) for x in c.chain[-3:]))} | "
                       f"{', '.join('`' + _short(x) + '`' for x in c.sites[:3]) or 'none (listed only)'} |")
        if len(self.candidates) > limit:
            from repro.evidence import Layout

            out.append(f"\n({len(self.candidates) - limit} more in {Layout.DISCOVERY_JSON.name})")
        out += ["", "## Catalogue points", ""]
        for p in self.points:
            out.append(f"- `{p.name}`: `{p.site}` called from `{_short(p.caller)}` "
                       f"(loops: {', '.join(('for ' + v) if v else 'outside loops' for v in p.loop_vars)}); "
                       f"perturbations {', '.join(p.perturbations)}")
        unres = self.scan.get("unresolved_in_guarded") or {}
        if unres:
            out += ["", "## Unresolved calls in the guarded functions (not followed)", ""]
            for fid, calls in list(unres.items())[:40]:
                out.append(f"- `{_short(fid)}`: {len(calls)}: " + ", ".join(f"`{_md(x)}`" for x in calls[:12])
                           + (" …" if len(calls) > 12 else ""))
        return "\n".join(out) + "\n"


def _md(x: Any) -> str:
    from repro.diagnosis import md_cell  # the one markdown escape

    return md_cell(x)


def discover(python: str, rules_path: Path, *, known_perturbations: Sequence[str] = (), root: Optional[str] = None,
             timeout_s: float = SCAN_TIMEOUT_S, use_cache: bool = True) -> Discovery:
    """Scan the engine installed in ``python`` with the rules at ``rules_path``; rank candidates; make points.

    Args:
        known_perturbations: perturbation names the hunt catalogue defines (the rules' own are added); default:
            every name the rules mention.
        root: scan this folder as the engine package instead of the installed one.
    Raises:
        DiscoverError: bad rules, or the scan failed (see :func:`run_scan`).
    """
    rules = load_rules(rules_path)
    scan = run_scan(python, rules, root=root, timeout_s=timeout_s, use_cache=use_cache)
    cands = candidates_from_scan(scan)
    known = set(known_perturbations) | set((rules.get("perturbations") or {}).keys())
    if not known_perturbations:
        for table in ("perturbations_by_kind", "perturbations_by_return"):
            known |= {p for v in (rules.get(table) or {}).values() for p in v}
    pts = discovered_points(cands, rules, sorted(known), scan.get("families"), scan.get("return_types"),
                            scan.get("site_depth"))
    return Discovery(Path(rules_path), python, scan, cands, pts)
