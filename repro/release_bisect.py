"""``repro bisect SCENARIO --good REF --bad REF``: the first engine release at which a scenario's verdict changes.

``--good`` and ``--bad`` are release REFs (``release:V``, or ``release:V+patch:FILE`` with the same patch on both:
the patch is carried to every release tried). The releases between them come from the adapter's release index
(``repro.releases``), in release order. Every release in the range is checked to be set up before anything runs (a
release that is not: :class:`BisectError`, one line naming the command that sets it up). Then the good and the bad
end run; if their verdicts agree there is nothing to bisect; else a binary search over the releases between finds
the first one whose verdict differs from the good end's (a third verdict, e.g. INCONCLUSIVE, counts as changed:
the search assumes one change). Each step is an ordinary ``repro run`` evidence folder; ``BISECT.md`` in a bisect
folder lists every step with its verdict and evidence, and names the change.

Exit codes: 0 when the change was found; 2 bad input (REFs, range, a release not set up, scenario); when both ends
give the same verdict, that verdict's code (``repro.verdict.EXIT_CODES``: 0 success, 3 deadlock, 4 inconclusive,
7 desync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from repro import evidence as ev
from repro.releases import ReleaseError, describe_python, load_index, parse_release_ref, release_python
from repro.verdict import EXIT_CODES

EXIT_FOUND = 0


class BisectError(ValueError):
    """Bad input for ``repro bisect`` found before any server started; ``str()`` is one line naming the fix."""


@dataclass(frozen=True)
class BisectOptions:
    """What ``repro bisect`` was asked (``None`` fields fall back to the scenario file, as ``repro run``)."""

    scenario_path: Path
    good: str
    bad: str
    variant: Optional[str] = None
    model: Optional[str] = None
    tp: Optional[int] = None
    requests: Optional[int] = None
    label: Optional[str] = None
    evidence_root: Path = ev.DEFAULT_EVIDENCE_DIR
    native: bool = False


@dataclass(frozen=True)
class Step:
    """One release tried: its REF, the verdict word (``DEADLOCKED``…), the evidence folder, the run's reason and
    which testbed ran it (``sglang 0.5.20 (overlay: its wheel over the 0.5.18 venv)``; empty when unknown)."""

    release: str
    ref: str
    verdict: str
    evidence: Path
    reason: str = ""
    testbed: str = ""


@dataclass
class BisectResult:
    """The outcome.

    Attributes:
        releases: the range, in release order (good end first).
        steps: every release tried, in the order run.
        first_changed: the first release whose verdict differs from the good end's (None: both ends agree).
        last_same: the release before it (the last one with the good end's verdict).
        folder: the bisect folder holding ``BISECT.md`` and ``bisect.json``.
        exit_code: see the module docstring.
        stopped: why the bisection stopped before an answer (a step refused: its one-line reason); empty otherwise.
    """

    releases: list[str]
    steps: list[Step] = field(default_factory=list)
    first_changed: Optional[str] = None
    last_same: Optional[str] = None
    folder: Optional[Path] = None
    exit_code: int = 2
    stopped: str = ""

    def to_json(self) -> dict:
        return {"releases": self.releases, "first_changed": self.first_changed, "last_same": self.last_same,
                "exit_code": self.exit_code, "folder": str(self.folder) if self.folder else None,
                "stopped": self.stopped or None,
                "steps": [{"release": s.release, "ref": s.ref, "verdict": s.verdict, "evidence": str(s.evidence),
                           "reason": s.reason, "testbed": s.testbed} for s in self.steps]}


# (version, REF text, evidence root) -> (verdict word, evidence folder, reason)
Runner = Callable[[str, str, Path], tuple[str, Path, str]]


def release_range(good: str, bad: str, adapter: Any) -> tuple[list[str], str]:
    """The releases from ``good``'s to ``bad``'s (release order, good end first) and the REF suffix both carry.

    Raises:
        BisectError: a REF that is not ``release:V[+patch:FILE]``, different suffixes, the same release at both
            ends, or a version not in the index.
    """
    parts = []
    for name, text in (("--good", good), ("--bad", bad)):
        try:
            v, rest = parse_release_ref(text)
        except ReleaseError as e:
            raise BisectError(f"{name}: {e}") from None
        if v is None:
            raise BisectError(f"{name} {text!r}: bisect walks releases; expected release:V or release:V+patch:FILE "
                              "(e.g. --good release:0.5.18 --bad release:0.5.20)")
        parts.append((v, rest))
    (gv, gs), (bv, bs) = parts
    if gs != bs:
        raise BisectError(f"--good and --bad must differ only in the release (got +{gs or 'nothing'} and "
                          f"+{bs or 'nothing'}); the same patch is carried to every release tried")
    if gv == bv:
        raise BisectError(f"--good and --bad are the same release ({gv}); give two releases to bisect between")
    try:
        index = load_index(adapter)
        span = index.between(gv, bv)
    except ReleaseError as e:
        raise BisectError(str(e)) from None
    versions = [r.version for r in span]
    if versions[0] != gv:
        versions.reverse()  # good end first, whichever way the releases are ordered
    return versions, gs


def ref_for(version: str, suffix: str) -> str:
    """The REF of ``version`` carrying ``suffix`` (``release:0.5.19+patch:FILE``)."""
    return f"release:{version}" + (f"+{suffix}" if suffix else "")


def default_runner(opts: BisectOptions, adapter: Any) -> Runner:
    """A runner that runs one release REF with the real harness (``repro.refs.materialize`` + ``repro.runner.run``)."""

    def run_one(version: str, ref_text: str, evidence_root: Path) -> tuple[str, Path, str]:
        from repro.refs import RefError, materialize, parse_ref
        from repro.runner import RunError, RunOptions, run

        try:
            m = materialize(parse_ref(ref_text), None, adapter)
        except RefError as e:
            raise BisectError(str(e)) from None
        try:
            ro = RunOptions(scenario_path=opts.scenario_path, variant=opts.variant, python=m.python, model=opts.model,
                            tp=opts.tp, label=f"{opts.label or 'bisect'}-{version}", evidence_root=evidence_root,
                            requests=opts.requests, native=opts.native, pythonpath_prepend=tuple(m.pythonpath_prepend),
                            command_line=f"repro run {opts.scenario_path} (bisect step {ref_text})")
            try:
                res = run(ro)
            except RunError as e:
                raise BisectError(str(e)) from None
            return str(res.verdict.verdict), res.evidence, str(res.verdict.reason)
        finally:
            m.close()

    return run_one


def _check_set_up(versions: list[str], adapter: Any) -> None:
    """Every release of the range set up; else one line naming all that are not and the first one's set-up."""
    missing: list[tuple[str, str]] = []
    for v in versions:
        try:
            release_python(v, adapter)
        except ReleaseError as e:
            missing.append((v, str(e)))
    if missing:
        more = (f"{len(missing)} of {len(versions)} are not ({', '.join(v for v, _ in missing)}); the first: "
                if len(missing) > 1 else "")
        raise BisectError(f"bisect needs every release from {versions[0]} to {versions[-1]} set up: {more}"
                          f"{missing[0][1]}")


def _check_patch_applies(versions: list[str], suffix: str, adapter: Any) -> None:
    """With ``+patch:FILE``: the patch applies to every release of the range, checked (an overlay made and removed
    per release, seconds each) before the first step runs, so no end runs for minutes before a later step refuses.

    Raises:
        BisectError: the first release it does not apply to, with the patch's own one-line reason.
    """
    if not suffix:
        return
    from repro.refs import RefError, materialize, parse_ref

    for v in versions:
        try:
            materialize(parse_ref(ref_for(v, suffix)), None, adapter).close()
        except RefError as e:
            raise BisectError(f"{ref_for(v, suffix)}: {e} (bisect carries the same patch to every release from "
                              f"{versions[0]} to {versions[-1]}; narrow the range or pick a patch that applies to all)"
                              ) from None


def _check_inputs(opts: BisectOptions, first_ref: str) -> None:
    """What can be checked without any release set up, before the set-up check (a user must not set a release
    up to learn that --tp or the patch was wrong): --tp, --requests, the REF's form and its patch file.

    Raises:
        BisectError: one line naming the option and what is expected.
    """
    from repro import resources
    from repro.refs import RefError, parse_ref

    for name, value in (("--tp", opts.tp), ("--requests", opts.requests)):
        if value is not None and value < 1:
            raise BisectError(f"{name} must be ≥ 1 (got {value})")
    try:
        ref = parse_ref(first_ref)
    except RefError as e:
        raise BisectError(f"--good/--bad: {e}") from None
    if ref.kind == "patch" and ref.path is not None:
        pf = resources.find_data_file(ref.path)
        if pf.is_dir():
            raise BisectError(f"--good/--bad patch:{ref.path}: is a folder; pass patch:FILE with a unified diff")
        if not pf.is_file():
            raise BisectError(f"--good/--bad patch:{ref.path}: not found; pass patch:FILE with a unified diff")


def bisect(opts: BisectOptions, runner: Optional[Runner] = None, check: Optional[Callable[[list[str]], None]] = None,
           observe: Callable[[str, dict], None] = lambda e, d: None) -> BisectResult:
    """Find the first release at which the scenario's verdict changes; write ``BISECT.md`` and ``bisect.json``.

    Args:
        opts: the bisection.
        runner: runs one release (default :func:`default_runner`); tests pass a stand-in.
        check: refuses a range with a release not set up (default: every release's interpreter must exist, and a
            ``+patch:`` must apply to every release).
        observe: ``("step", {"release", "ref"})`` before each run, ``("verdict", {...})`` after.
    Returns:
        A :class:`BisectResult` with ``exit_code`` per the module docstring.
    Raises:
        BisectError: bad input, before anything ran (a later step's bad input: after the steps so far, whose
            evidence is kept).
    """
    from repro.scenario import ScenarioError, load_scenario
    from repro.targets.registry import UnknownAdapterError, get_adapter

    try:
        scen = load_scenario(opts.scenario_path)
        var = scen.variant(opts.variant)
        adapter = get_adapter(scen.server.adapter)
    except (ScenarioError, UnknownAdapterError) as e:
        raise BisectError(str(e)) from None
    versions, suffix = release_range(opts.good, opts.bad, adapter)
    _check_inputs(opts, ref_for(versions[0], suffix))
    (check or (lambda vs: (_check_set_up(vs, adapter), _check_patch_applies(vs, suffix, adapter))))(versions)
    run_one = runner or default_runner(opts, adapter)
    res = BisectResult(versions)
    folder = _bisect_folder(opts.evidence_root, scen.name, opts.label or var.name)
    res.folder = folder
    verdicts: dict[int, str] = {}

    def verdict_of(i: int) -> str:
        if i not in verdicts:
            ref = ref_for(versions[i], suffix)
            observe("step", {"release": versions[i], "ref": ref})
            word, evidence, reason = run_one(versions[i], ref, folder / "steps")
            res.steps.append(Step(versions[i], ref, word, Path(evidence), reason, _testbed_of(versions[i], adapter)))
            verdicts[i] = word
            observe("verdict", {"release": versions[i], "verdict": word, "evidence": str(evidence)})
            _write(res, opts, scen.name, var.name, verdicts)
        return verdicts[i]

    try:
        good, bad = verdict_of(0), verdict_of(len(versions) - 1)
        if good == bad:
            res.exit_code = EXIT_CODES.get(good, 1)
        else:
            lo, hi = 0, len(versions) - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if verdict_of(mid) == good:
                    lo = mid
                else:
                    hi = mid
            res.first_changed, res.last_same = versions[hi], versions[lo]
            res.exit_code = EXIT_FOUND
    except BisectError as e:  # a step refused (a site absent in that release): BISECT.md says why it stopped
        res.stopped = str(e)
        raise
    finally:
        _write(res, opts, scen.name, var.name, verdicts)
    return res


def _testbed_of(version: str, adapter: Any) -> str:
    """How release ``version`` ran (its own venv or an overlay), from its testbed record; empty when unknown."""
    try:
        return describe_python(release_python(version, adapter)) or ""
    except ReleaseError:
        return ""


def _bisect_folder(root: Path, scenario: str, label: str) -> Path:
    return ev.unique_folder(root, scenario, "bisect", label)


def bisect_markdown(res: BisectResult, opts: BisectOptions, scenario: str, variant: str,
                    verdicts: Optional[dict[int, str]] = None) -> str:
    """BISECT.md: the question, the answer, every release of the range with its verdict (or 'not run') and
    evidence, and how to run one step again."""
    steps = {s.release: s for s in res.steps}
    if res.first_changed:
        head = (f"# First change at {res.first_changed}\n\nThe verdict of `{variant}` is "
                f"{steps[res.last_same].verdict} up to {res.last_same} and {steps[res.first_changed].verdict} "
                f"from {res.first_changed}.")
    elif len(res.steps) >= 2 and res.steps[0].verdict == res.steps[1].verdict:
        head = (f"# No change\n\nBoth ends give {res.steps[0].verdict}: nothing to bisect between "
                f"{res.releases[0]} and {res.releases[-1]}.")
    else:
        head = "# Incomplete\n\nThe bisection stopped before the change was found; the steps so far are below."
        if res.stopped:
            head += f"\n\nStopped: {res.stopped}"
    lines = [head, "", f"Scenario `{opts.scenario_path}` ({scenario}), variant `{variant}`; "
             f"good `{opts.good}`, bad `{opts.bad}`; {len(res.steps)} of {len(res.releases)} releases run.", "",
             "| release | REF | testbed | verdict | evidence |", "|---|---|---|---|---|"]
    for v in res.releases:
        s = steps.get(v)
        mark = " ← first change" if v == res.first_changed else ""
        lines.append(f"| {v}{mark} | `{s.ref}` | {s.testbed or '-'} | {s.verdict} | {ev.Layout.REPORT.at(s.evidence)} |" if s else
                     f"| {v} | | | not run | |")
    lines += ["", f"Run one step again: `repro run {opts.scenario_path} --variant {variant} --python "
              "<that release's interpreter>`, or compare two: `repro compare "
              f"{opts.scenario_path} --variant {variant} --before release:A --after release:B`."]
    return "\n".join(lines) + "\n"


def _write(res: BisectResult, opts: BisectOptions, scenario: str, variant: str, verdicts: dict[int, str]) -> None:
    if res.folder is None:
        return
    folder = ev.EvidenceDir.open(res.folder)
    folder.bisect_md.write(bisect_markdown(res, opts, scenario, variant, verdicts))
    folder.bisect_json.write(res.to_json())
