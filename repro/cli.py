"""Command-line interface: one verb per job; the CLI only wires the modules together and renders.

Exit codes for commands that end in a verdict: 0 ALL REQUESTS SUCCEEDED, 3 DEADLOCKED, 4 INCONCLUSIVE, 2 bad
input/usage, 1 internal error; with ``--expect``: 0 iff the verdict matches, else 5.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from repro import paths as _paths  # (analyze's argument is called paths)
from repro.resources import EXAMPLES_DIR
from repro.targets import DEFAULT_ADAPTER
from repro.verdict import EXIT_INTERRUPTED, EXIT_TERMINATED, EXPECT_WORDS, Interrupted  # SIGINT 130, SIGTERM 143: one definition

app = typer.Typer(
    name="repro",
    help=f"Reproduce, capture and explain tensor-parallel collective-desync deadlocks ({DEFAULT_ADAPTER} by default; "
         "other engines through their adapters).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EXIT_SUCCESS = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_DEADLOCKED = 3
EXIT_INCONCLUSIVE = 4
EXIT_MISMATCH = 5


# Without a terminal (a pipe, a file, a CI log) rich would lay tables out for 80 columns and wrap inside identifiers
# (`sglang.srt.me` / `m_cache.unifi` …): there the consoles are as wide as their content (NO_TERMINAL_WIDTH), so
# every row is one line a log can be searched in. COLUMNS, when set, still wins. With a terminal: its width.
NO_TERMINAL_WIDTH = 100_000


def _make_console(stderr: bool) -> Console:
    """A console on stdout/stderr; soft_wrap keeps long paths and commands on one line (copy-paste, scripts)."""
    import os

    c = Console(stderr=stderr, soft_wrap=True)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c = Console(stderr=stderr, soft_wrap=True, width=NO_TERMINAL_WIDTH)
    return c


console = _make_console(stderr=True)
out = _make_console(stderr=False)


def _rule(c: Console, title: str) -> None:
    """A section rule: the console's width on a terminal, a short one-line title otherwise (no 100 000-char line)."""
    if c.is_terminal or c.width < NO_TERMINAL_WIDTH:
        c.rule(title)
    else:
        c.print(f"──── {title} ────")

EXPECT_CHOICES = " | ".join(EXPECT_WORDS)  # the words --expect, --expect-before and --expect-after accept
EXPECT_HELP = f"Expected verdict: {EXPECT_CHOICES}. Exit 0 iff it matches, else 5."


MAX_TABLE_LINES = 120  # lines the rank table may take as the terminal wraps it (the whole output stays ≤ 200)
MAX_TABLE_RANKS = 16  # rows of `repro analyze`'s rank table (issue 29 item 1: a 50 MB dump printed 61 MB); the rest in --json
_INTERRUPT_SIGNAL: Optional[int] = None  # the signal that interrupted this command, once one did


def _interrupted_exit() -> int:
    """Exit code after an interrupt: 143 when SIGTERM ended the command, else 130 (Ctrl-C), as a shell reports them."""
    return EXIT_TERMINATED if _INTERRUPT_SIGNAL == signal.SIGTERM else EXIT_INTERRUPTED


def _sigterm_to_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt so every command tears down its server tree the same way as on Ctrl-C.

    Only the first SIGINT/SIGTERM interrupts: later ones (an impatient second Ctrl-C) are ignored so the teardown
    they would cut short — SIGKILL of survivors, the check that nothing is left — always completes.
    """

    def ignore(signum, frame):  # noqa: ARG001
        pass

    def handler(signum, frame):  # noqa: ARG001
        global _INTERRUPT_SIGNAL
        _INTERRUPT_SIGNAL = signum
        # A Python-level no-op, not SIG_IGN: an ignored disposition is inherited across exec, so every server the
        # process started afterwards (a hunt's next server, a test's) would ignore SIGTERM and need SIGKILL.
        signal.signal(signal.SIGTERM, ignore)
        signal.signal(signal.SIGINT, ignore)
        what = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        console.print(f"[yellow]interrupt ({what}): tearing down the server tree (further Ctrl-C and SIGTERM are "
                      "ignored until it is gone)[/]")
        raise Interrupted(signum)  # a KeyboardInterrupt that carries its exit code (verdict.json records it)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _scenario_arg(value: Path) -> Path:
    """Typer callback of every SCENARIO argument: a path (from any folder: ``scenarios/...`` also finds the
    installed wheel's copy) or a bundled scenario's bare name such as ``smoke_extra_allreduce``; exit 2 naming the
    bundled names when nothing matches."""
    from repro import resources

    if value is None:
        return value
    try:
        found = resources.find_scenario(value)
    except resources.ResourceError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(EXIT_USAGE)
    if found.exists() and not found.is_file():  # a folder or a FIFO: say what it is (a FIFO read would block)
        try:
            _paths.input_file(found, "", "a scenario .toml file or the name of a bundled scenario")
        except _paths.PathInputError as e:
            console.print(f"[red]error:[/] {escape(str(e))}")
            raise typer.Exit(EXIT_USAGE)
    if not found.is_file():
        names = ", ".join(resources.scenario_names()) or "(none found)"
        console.print(f"[red]error:[/] {escape(str(value))}: scenario file not found (expected a .toml file, or the name of "
                      f"a bundled scenario: {names})")
        raise typer.Exit(EXIT_USAGE)
    return found


def _path_check(kind: str, expect: str = "a file", example: str = "report.md"):
    """A Typer callback for a path option (``repro.paths``), so every verb checks its paths the same way and before
    anything is read, written or launched: ``kind`` is ``"in"`` (a regular readable file), ``"text"`` (that, and
    UTF-8), ``"out"`` (a file to write: not a folder or FIFO, in an existing folder), ``"dir"`` (a folder, or
    one that can be created) or ``"readdir"`` (a folder to read, which may appear later: not a file). A bad path is one line naming the option, the path, what it is and the fix; exit 2.
    ``expect``: what an input option wants, in words; ``example``: a file name for an output file's message."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value):
        if value is None or ctx.resilient_parsing:
            return value
        opt = max(param.opts, key=len) if param.param_type_name == "option" and param.opts else ""
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            try:
                if kind == "in":
                    _paths.input_file(v, opt, expect)
                elif kind == "text":
                    _paths.read_text(v, opt, expect)
                elif kind == "out":
                    _paths.output_file(v, opt, example)
                elif kind == "readdir":
                    _paths.input_dir(v, opt)
                else:
                    _paths.output_dir(v, opt)
            except _paths.PathInputError as e:
                console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
                raise typer.Exit(EXIT_USAGE)
        return value

    return check


_EVIDENCE_DIR = _path_check("dir")  # every verb's --evidence-dir: a folder, or one that can be created
_HOSTS_FILE = _path_check("text", 'a JSON list of hosts like [{"name": "h0", "node_rank": 0, "ssh": "root@10.0.0.10"}, …]')


def _check_expect(expect: Optional[str]) -> None:
    if expect is not None and expect not in EXPECT_WORDS:
        console.print(f"[red]error:[/] --expect must be deadlock, success, inconclusive or desync (got {expect!r})")
        raise typer.Exit(EXIT_USAGE)


def _verdict_style(verdict: str) -> str:
    return {"DEADLOCKED": "bold red", "DESYNCED": "bold magenta", "ALL REQUESTS SUCCEEDED": "bold green"}.get(verdict, "bold yellow")


class _Progress:
    """Rich rendering of a run's progress events (spinner while waiting healthy, a bar during the burst)."""

    def __init__(self, quiet: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.quiet = quiet
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True, disable=quiet)
        self.task = None
        self.started = False  # the live display starts at the first event: an error before any (a bad REF, a
        # missing site) is then the first line of stderr, with no empty line from a display that never showed

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            self.progress.__exit__(*exc)

    def __call__(self, event: str, data: dict) -> None:
        if self.quiet:
            return
        if not self.started:
            self.progress.__enter__()
            self.started = True
        if event == "launch":
            console.print(f"evidence: {data['evidence']}")
            self.task = self.progress.add_task("launching server", total=None)
        elif event == "wait_healthy":
            self.progress.update(self.task, description=f"waiting for {data['url']}/health (pid {data['pid']})")
        elif event == "arm_not_acknowledged":
            console.print(f"[yellow]warning:[/] rank(s) {', '.join(map(str, data['ranks']))} did not acknowledge the arm "
                          f"file within {data['timeout_s']:g} s; their first calls may run unarmed (the report's "
                          "injection checks say whether they armed later)")
        elif event == "armed":
            ranks = ", ".join(f"TP{k}={pid}" for k, pid in sorted(data["ranks"].items()))
            console.print(f"healthy; ranks {ranks}; armed: {', '.join(data['injections']) or '(nothing)'}")
            self.progress.update(self.task, description="burst", total=None, completed=0)
        elif event == "burst":
            st = data["state"]
            stalled = st.stalled_for(time.time())
            desc = f"burst ({st.outstanding} in flight" + (f", no progress for {stalled:.0f} s" if stalled >= 2 else "") + ")"
            self.progress.update(self.task, description=desc, total=st.total, completed=st.total - st.pending - st.outstanding)
        elif event == "capture":
            console.print(f"stall: no progress for {data['stalled_s']:.1f} s → capturing every rank (round {data['n']})")
        elif event == "judged":
            j = data["judgement"]
            console.print(("  deadlock confirmed: " if j.deadlocked else "  not a deadlock yet: ") + escape(j.reason))
        elif event == "teardown":
            self.progress.update(self.task, description="tearing down the server tree", total=None)


def _result_dict(res) -> dict:
    """One run's result as the JSON `repro run --json` prints (also one entry of `repro demo --json`)."""
    return {
        "verdict": res.verdict.verdict, "reason": res.verdict.reason, "notes": list(res.verdict.notes),
        "exit_code": res.exit_code, "evidence": str(res.evidence), "expected": res.expected,
        "requests_ok": res.requests_ok, "requests_total": res.requests_total,
        "timings": {k: round(v, 3) for k, v in res.timings.items()},
        "analysis": res.analysis.to_dict() if res.analysis is not None else None,
    }


def _render_result(res, as_json: bool) -> None:
    from repro.evidence import Layout

    if as_json:
        out.print_json(json.dumps(_result_dict(res)))
        return
    out.print(f"[{_verdict_style(res.verdict.verdict)}]{res.verdict.verdict}[/]  {escape(res.verdict.reason)}")
    for n in res.verdict.notes:
        out.print(f"  - {escape(n)}")
    if res.analysis is not None and getattr(res.analysis, "ranks", None):
        t = Table(title="where each rank is")
        for col in ("rank", "state", "blocked in", "via", "caller chain"):
            t.add_column(col)
        for r in res.analysis.ranks:
            t.add_row(f"TP{r.rank}", r.state, escape(str(getattr(r, "op", "") or "-")), escape(str(getattr(r, "via", "") or "-")),
                      escape(" ← ".join(getattr(r, "caller_chain", [])[:4])))
        out.print(t)
    out.print(f"requests: {res.requests_ok}/{res.requests_total} succeeded")
    out.print(f"evidence: {res.evidence}  ({Layout.REPORT.name})")
    if res.expected:
        out.print(f"expected {res.expected}: {'match' if res.exit_code == 0 else 'MISMATCH (exit 5)'}")


def _release_given(release: Optional[str]) -> None:
    """``--release ''`` (an unset shell variable) is refused in one line (exit 2), never read as no --release."""
    if release is not None and not release.strip():
        console.print("[red]error:[/] --release '': expected a release such as 0.5.23 (or leave --release out for "
                      "the default interpreter)", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)


def _release_python(release: Optional[str], python: Optional[str], scenario: Optional[Path]) -> Optional[str]:
    """``--release V``'s interpreter (``repro.releases.release_python`` of the scenario's engine; ``scenario`` None:
    the default adapter's, for ``repro demo``), else ``--python`` as given; both, an unknown release or one not set
    up: one error line (exit 2) naming the fix. A scenario that does not load is left to the verb's own error."""
    _release_given(release)
    if not release:
        return python
    from repro.releases import ReleaseError, release_python
    from repro.scenario import ScenarioError, load_scenario
    from repro.targets.registry import DEFAULT_ADAPTER

    if python:
        console.print(f"[red]error:[/] give --release {escape(release)} or --python {escape(python)}, not both", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        engine = load_scenario(scenario).server.adapter if scenario is not None else DEFAULT_ADAPTER
    except ScenarioError:
        return python
    try:
        return release_python(release, engine)
    except ReleaseError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)


@app.command()
def run(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help=f"scenario TOML file or bundled name, e.g. {EXAMPLES_DIR}/smoke_extra_allreduce.toml"),
    variant: Optional[str] = typer.Option(None, "--variant", help="variant name (default: the first in the file)"),
    python: Optional[str] = typer.Option(None, "--python", help="interpreter that runs the server (default: this one if it imports the scenario's engine, else that engine's CPU testbed)"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    model: Optional[str] = typer.Option(None, "--model", help="model path (default: the scenario's, else the testbed's tiny model)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size (default: the scenario's)"),
    label: Optional[str] = typer.Option(None, "--label", help="evidence folder label (default: the variant name)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    requests_: Optional[int] = typer.Option(None, "--requests", help="number of requests in the burst (default: the scenario's)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
    expect: Optional[str] = typer.Option(None, "--expect", help=EXPECT_HELP),
    native: bool = typer.Option(False, "--native", help="py-spy --native stacks (slower; retried without on failure)"),
    hosts: Optional[Path] = typer.Option(None, "--hosts", callback=_HOSTS_FILE, help="JSON list of the hosts the server spans (node rank, ssh target or command template; scripts/multihost/README.md): every rank is started, captured and stopped through its host's runner"),
) -> None:
    """Run one scenario variant end to end and print the verdict.

    Exit codes: 0 ALL REQUESTS SUCCEEDED, 3 DEADLOCKED, 4 INCONCLUSIVE, 2 bad input, 1 internal error;
    with --expect: 0 iff the verdict matches, else 5.
    """
    python = _release_python(release, python, scenario)
    from repro.runner import RunError, RunOptions, run as run_scenario

    _check_expect(expect)
    _sigterm_to_interrupt()
    opts = RunOptions(scenario_path=scenario, variant=variant, python=python, model=model, tp=tp, label=label,
                      evidence_root=evidence_dir, requests=requests_, expect=expect, native=native,
                      command_line=shlex.join(["repro", *sys.argv[1:]]))
    host_list = None
    if hosts is not None:
        import json as _json

        from repro.hosts import hosts_from_json

        try:
            host_list = hosts_from_json(_json.loads(hosts.read_text()))
        except (OSError, ValueError) as e:
            console.print(f"[red]error:[/] --hosts {hosts}: {e}; expected a JSON list of hosts like "
                          '[{"name": "h0", "node_rank": 0, "ssh": "root@10.0.0.1", "address": "10.0.1.1"}, …]')
            raise typer.Exit(EXIT_USAGE)
    try:
        with _Progress(as_json) as prog:
            if host_list is not None:
                from repro.remote_run import run_multihost

                res = run_multihost(opts, host_list, prog)
            else:
                res = run_scenario(opts, prog)
    except RunError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # one line, even on a terminal
        raise typer.Exit(EXIT_USAGE)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: server tree torn down; partial evidence kept")
        raise typer.Exit(_interrupted_exit())
    _render_result(res, as_json)
    raise typer.Exit(res.exit_code)



@app.command()
def compare(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help=f"scenario TOML file or bundled name, e.g. {EXAMPLES_DIR}/hicache_prefetch_30760.toml"),
    before: str = typer.Option(..., "--before", help="REF of the code before the fix: installed | patch:FILE | git:PATH@REV | python:PATH | release:V[+patch:FILE]"),
    after: str = typer.Option(..., "--after", help="REF of the code after the fix (same forms as --before)"),
    variant: Optional[str] = typer.Option(None, "--variant", help="variant name (default: the first in the file)"),
    python: Optional[str] = typer.Option(None, "--python", help="interpreter for installed/patch/git REFs (default: as `repro run`)"),
    model: Optional[str] = typer.Option(None, "--model", help="model path (default: the scenario's, else the testbed's tiny model)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size (default: the scenario's)"),
    label: Optional[str] = typer.Option(None, "--label", help="label of the evidence folders (default: the variant name)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    requests_: Optional[int] = typer.Option(None, "--requests", help="number of requests in the burst (default: the scenario's)"),
    expect_before: str = typer.Option("deadlock", "--expect-before", help=f"expected verdict before: {EXPECT_CHOICES}"),
    expect_after: str = typer.Option("success", "--expect-after", help=f"expected verdict after: {EXPECT_CHOICES}"),
    only: Optional[str] = typer.Option(None, "--only", help="run one side only: before | after"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON on stdout"),
    native: bool = typer.Option(False, "--native", help="py-spy --native stacks (slower; retried without on failure)"),
) -> None:
    """Run one scenario variant against two versions (before/after a fix) and write COMPARISON.md linking both.

    Exit codes: 0 iff both verdicts are the expected ones (default DEADLOCKED before, ALL REQUESTS SUCCEEDED
    after), 5 on a mismatch, 2 bad input (REF, patch that does not apply, missing git rev: found before any server
    starts), 1 internal error.
    """
    from repro.compare import CompareError, CompareOptions, dumps, run_compare
    from repro.evidence import Layout
    from repro.runner import RunError

    _sigterm_to_interrupt()
    opts = CompareOptions(scenario_path=scenario, before=before, after=after, variant=variant, python=python, model=model,
                          tp=tp, label=label, evidence_root=evidence_dir, requests=requests_, expect_before=expect_before,
                          expect_after=expect_after, native=native, only=only)
    try:
        with _Progress(as_json) as prog:
            def observe(event: str, data: dict) -> None:
                if event == "side" and not as_json:
                    _rule(console, f"{data['side']}: {data['ref']}  ({data['description']})")
                prog(event, data)

            res = run_compare(opts, observe)
    except (CompareError, RunError) as e:
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: server tree torn down; overlays/worktrees removed; partial evidence kept")
        raise typer.Exit(_interrupted_exit())
    if as_json:
        out.print_json(dumps(res))
        raise typer.Exit(res.exit_code)
    for s in res.sides:
        mark = "as expected" if s.matched else f"MISMATCH (expected {s.expect})"
        out.print(f"{s.side:6s} [{_verdict_style(s.verdict)}]{s.verdict}[/] ({mark})  {s.ref}")
        out.print(f"       {s.reason}")
        for n in s.notes:
            out.print(f"       - {n}")
        out.print(f"       evidence: {s.evidence / Layout.REPORT.name}")
    out.print(f"comparison: {res.folder / Layout.COMPARISON.name}  (wall time {res.wall_s:.0f} s)")
    raise typer.Exit(res.exit_code)


DEMO_VARIANTS = ("extra_collective", "control")  # variants of smoke_extra_allreduce.toml that `repro demo` runs


@app.command()
def demo(
    python: Optional[str] = typer.Option(None, "--python", help="interpreter that runs the server (default: as `repro run` picks it: this one if it imports the engine, else the CPU testbed's)"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder (default: evidence/ in the current folder)"),
    as_json: bool = typer.Option(False, "--json", help="print both results as one JSON object on stdout (no progress)"),
) -> None:
    """Run the smoke scenario's armed variant (expects DEADLOCKED) and its control (expects ALL REQUESTS SUCCEEDED).

    The scenario is the default adapter's ``Adapter.demo_scenario`` (SGLang: ``scenarios/sglang/smoke_extra_allreduce.toml``; a clone's, or the installed
    wheel's copy), so this works from any folder. Exit 0 iff both verdicts are the expected ones, else 5; 2 when
    the testbed is missing.
    """
    python = _release_python(release, python, None)
    from repro import resources
    from repro.evidence import Layout
    from repro.runner import RunError, RunOptions, run as run_scenario
    from repro.scenario import ScenarioError, load_scenario
    from repro.targets.registry import DEFAULT_ADAPTER, get_adapter

    _sigterm_to_interrupt()
    try:
        resources.scenarios_dir()  # a broken install: its own error, naming the fix
        demo_adapter = get_adapter(DEFAULT_ADAPTER)
        if demo_adapter.demo_scenario is None:
            raise ScenarioError(f"adapter {DEFAULT_ADAPTER!r} has no demo scenario (Adapter.demo_scenario)")
        path = Path(demo_adapter.demo_scenario)
        scen = load_scenario(path)
    except (resources.ResourceError, ScenarioError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(EXIT_USAGE)
    results = []
    # the two the demo promises (README): the armed deadlock and its control; the scenario's other variants (the
    # desync pair) are for `repro run --variant`
    for v in [v for v in scen.variants if v.name in DEMO_VARIANTS]:
        if not as_json:
            _rule(out, f"{scen.name} / {v.name} (expects {v.expect})")
        opts = RunOptions(scenario_path=path, variant=v.name, python=python, evidence_root=evidence_dir, expect=v.expect,
                          command_line=shlex.join(["repro", "run", str(path), "--variant", v.name, "--expect", v.expect]))
        try:
            with _Progress(as_json) as prog:
                res = run_scenario(opts, prog)
        except RunError as e:
            console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # one line, even on a terminal
            raise typer.Exit(EXIT_USAGE)
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: server tree torn down; partial evidence kept")
            raise typer.Exit(_interrupted_exit())
        if not as_json:
            _render_result(res, False)
        results.append((v, res))
    code = 0 if all(r.exit_code == 0 for _, r in results) else EXIT_MISMATCH
    if as_json:
        out.print_json(json.dumps({"scenario": str(path), "exit_code": code, "as_expected": code == 0,
                                   "variants": [{"variant": v.name, **_result_dict(res)} for v, res in results]}))
        raise typer.Exit(code)
    _rule(out, "demo summary")
    for v, res in results:
        ok = res.exit_code == 0
        out.print(f"{v.name:20s} [{_verdict_style(res.verdict.verdict)}]{res.verdict.verdict}[/] "
                  f"({'as expected' if ok else 'expected ' + v.expect}) → {Path(res.evidence) / Layout.REPORT.name}")
    raise typer.Exit(code)


@app.command()
def serve(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help="scenario TOML file or bundled name"),
    variant: Optional[str] = typer.Option(None, "--variant", help="variant whose injections are loaded (unarmed)"),
    python: Optional[str] = typer.Option(None, "--python", help="interpreter that runs the server"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    model: Optional[str] = typer.Option(None, "--model", help="model path"),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    label: Optional[str] = typer.Option(None, "--label", help="evidence folder label (default: serve-<variant>)"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout: one `serving` object once healthy (url, pids, evidence), one `stopped` object at the end"),
) -> None:
    """Start the server with the injector loaded and UNARMED; print its URL and evidence folder; stay until Ctrl-C.

    Arm it with `repro arm EVIDENCE_DIR [INJECTION…]`, disarm with `repro disarm EVIDENCE_DIR`. With --json, stdout
    carries only JSON lines (flushed as written, for a script waiting on the URL).
    """
    python = _release_python(release, python, scenario)
    from repro.runner import RunError, RunOptions, Session, UnresolvedSitesError, prepare

    _sigterm_to_interrupt()
    opts = RunOptions(scenario_path=scenario, variant=variant, python=python, model=model, tp=tp, evidence_root=evidence_dir,
                      label=label, command_line=shlex.join(["repro", *sys.argv[1:]]))
    try:
        p = prepare(opts, label_default=f"serve-{variant or 'default'}")
    except RunError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # one line, even on a terminal
        raise typer.Exit(EXIT_USAGE)
    p.evidence.command.write(opts.command_line + "\n")

    def starting(event: str, data: dict) -> None:
        if event == "wait_healthy":
            console.print(f"starting the server (pid {data['pid']}; log {data['log']}); waiting for "
                          f"{data['url']}/health, up to {data['timeout_s']:.0f} s (30–100 s on the CPU testbed) …")
        elif event == "still_starting":
            line = data["last_line"]
            console.print(f"  still starting after {data['waited_s']:.0f} s" + (f": {escape(line)}" if line else ""),
                          highlight=False)
        elif event == "relaunch":
            console.print(f"  {data['why']}: starting again (attempt {data['attempt']})")
        elif event == "healthy":
            console.print(f"healthy after {data['waited_s']:.0f} s")
        elif event == "role_healthy":
            console.print(f"  {data['role']} healthy after {data['after_s']:.0f} s")

    from repro.runner import make_session

    session = make_session(p, starting)  # the run's start: port-race retry, rank check, every site resolved
    # (a multi-server topology, e.g. PD: the whole stack; `repro arm` arms each server's share, repro.pd)
    server = None
    healthy = interrupted = False
    try:
        try:
            failed = session.start()
        except UnresolvedSitesError as e:  # every site must resolve in this engine before anyone arms it
            console.print(f"[red]error:[/] {escape(str(e))}")
            raise typer.Exit(EXIT_USAGE)
        if failed is not None:
            console.print(f"[red]error:[/] {escape(failed.reason)}")
            raise typer.Exit(EXIT_INTERNAL)
        server = session.server
        healthy = True
        ranks = session.rank_pids
        p.evidence.serve.write({"url": server.url, "pid": server.pid, "rank_pids": {str(k): v for k, v in ranks.items()},
                                             "injections": [i.id for i in p.variant.injections], "arm_file": str(p.arm_file)})
        if as_json:
            _json_line({"event": "serving", "url": server.url, "pid": server.pid,
                        "rank_pids": {str(k): v for k, v in sorted(ranks.items())}, "evidence": str(p.evidence.path),
                        "injections": [i.id for i in p.variant.injections],
                        "arm": ["repro", "arm", str(p.evidence.path)], "disarm": ["repro", "disarm", str(p.evidence.path)]})
        else:
            out.print(f"serving {server.url}  (ranks: {', '.join(f'TP{k}={v}' for k, v in sorted(ranks.items()))})")
            out.print(f"evidence: {p.evidence.path}")
            out.print(f"arm:      repro arm {p.evidence.path}   disarm: repro disarm {p.evidence.path}   stop: Ctrl-C")
        while server.is_running():
            time.sleep(0.5)
        console.print("[red]the server exited[/]; log: " + str(p.evidence.server_log.path))
        raise typer.Exit(EXIT_INTERNAL)
    except KeyboardInterrupt:
        console.print("stopping the server tree …")
        interrupted = True
    finally:
        left = session.stop()  # the whole tree; teardown.json records what was left
        # Ctrl-C once serving is the way to stop it; before it was healthy it cut the start-up short
        p.evidence.set_status("complete" if healthy or not interrupted else "interrupted")
        if as_json:
            _json_line({"event": "stopped", "evidence": str(p.evidence.path),
                        "left_running": [getattr(x, "pid", x) for x in left]})
    if interrupted and (not healthy or _INTERRUPT_SIGNAL == signal.SIGTERM):
        raise typer.Exit(_interrupted_exit())  # cut short before healthy (130), or SIGTERM (143)


def _json_line(rec: dict) -> None:
    """One JSON object per line on stdout, flushed (for a script reading a long-running verb's output live)."""
    sys.stdout.write(json.dumps(rec, default=str) + "\n")
    sys.stdout.flush()


@app.command()
def arm(
    evidence: Path = typer.Argument(..., help="evidence folder of a `repro serve` server"),
    injections: Optional[List[str]] = typer.Argument(None, help="injection ids to arm (default: all of the variant)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout: armed ids, ranks that read the arm file, late ranks"),
) -> None:
    """Arm a served server's injector (no restart) and wait until every rank read it (≤ 10 s; usually ~0.1 s).

    Re-arming restarts occurrence counts. Exit 0 when every rank acknowledged the arm file, 4 when a rank did not
    within 10 s (its calls may still run unarmed).
    """
    from repro import arming
    from repro.runner import ARM_ACK_TIMEOUT_S

    try:
        res = arming.arm(evidence, injections)
    except arming.ArmError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(EXIT_USAGE)
    ids, arm_file, late, rank_pids = list(res.armed), res.arm_file, list(res.late), res.rank_pids
    if as_json:
        out.print_json(data={"armed": ids, "arm_file": str(arm_file), "late_ranks": sorted(late),
                             "read_by": res.read_by,
                             "exit_code": EXIT_INCONCLUSIVE if late else EXIT_SUCCESS})
        raise typer.Exit(EXIT_INCONCLUSIVE if late else EXIT_SUCCESS)
    if late:
        console.print(f"[yellow]warning:[/] TP{', TP'.join(map(str, late))} did not read the arm file within "
                      f"{ARM_ACK_TIMEOUT_S:g} s; calls there may still run unarmed (its injector log: {res.injector_dir})")
        out.print(f"armed: {', '.join(ids)} (not confirmed on every rank)")
        raise typer.Exit(EXIT_INCONCLUSIVE)
    acked = f" (read by TP{', TP'.join(str(k) for k in res.read_by)})" if res.read_by else ""
    out.print(f"armed: {', '.join(ids)}{acked}")


@app.command()
def disarm(
    evidence: Path = typer.Argument(..., help="evidence folder of a `repro serve` server"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Disarm a served server's injector (sites stay patched and counted, nothing fires)."""
    from repro import arming

    try:
        arm_file = arming.disarm(evidence)
    except arming.ArmError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(EXIT_USAGE)
    if as_json:
        out.print_json(data={"disarmed": True, "arm_file": str(arm_file)})
        return
    out.print("disarmed")


@app.command()
def cleanup(
    evidence: Path = typer.Argument(..., help="evidence folder of a run whose harness was killed (or a hunt folder, a hunt trial's folder, an evidence root)"),
    force: bool = typer.Option(False, "--force", help="also when the run's harness is still alive (ends that run); never ends a server repro did not launch"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout: exit_code and one result per run folder"),
) -> None:
    """End a server tree left behind by a harness that was SIGKILLed, using the pids + start times it recorded.

    EVIDENCE is a run's folder (it holds processes.json); a hunt folder, a hunt trial's folder or an evidence root
    stand for the run folders they name or hold. The server's own temp folders (owned_dirs.json) are removed too.

    Only trees the harness itself launched are ended (processes.json carries its mark): a `repro watch` folder is
    refused, even with --force. A pid whose start time differs (reused by another process) is never touched. A run
    whose harness is still running is refused unless --force: cleaning it up would end someone's live run.
    """
    from repro.cleanup import CleanupError, cleanup as cleanup_folder, exit_code

    try:
        results = cleanup_folder(Path(evidence), force)
    except CleanupError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(EXIT_USAGE)
    if as_json:
        out.print_json(data={"exit_code": exit_code(results), "results": [r.to_json() for r in results]})
        raise typer.Exit(exit_code(results))
    for r in results:
        where = f" ({r.folder})" if len(results) > 1 else ""
        if r.refused:
            console.print(f"[red]error:[/] {escape(r.message)}")
        else:
            out.print(escape(r.message) + where)
            out.print(escape(f"engine: {r.engine} ({r.engine_from})"), style="dim", highlight=False)
    raise typer.Exit(exit_code(results))


@app.command()
def sites(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help="scenario TOML file or bundled name"),
    variant: Optional[str] = typer.Option(None, "--variant", help="check only this variant (default: all variants)"),
    python: Optional[str] = typer.Option(None, "--python", help="target interpreter (default: as `repro run` picks it)"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """Preflight: resolve every site of the scenario inside the target interpreter, without launching a server.

    Exit 0 when every injection has an alternative that resolves, 2 otherwise (missing names come with the nearest
    existing ones). Gate patterns naming functions absent in this version are warnings.
    """
    python = _release_python(release, python, scenario)
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError, gate_rank_problem, load_scenario
    from repro.sites import SitesPreflightError, check_sites

    try:
        sc = load_scenario(scenario)
        if variant is not None:
            sc.variant(variant)
        from repro.pd import injection_tp_sizes
        from repro.scenario import storage_action_problem
        from repro.targets.registry import get_adapter

        ad = get_adapter(sc.server.adapter)  # the run's engine, from the scenario
        bad_ranks = gate_rank_problem([sc.variant(variant)] if variant is not None else sc.variants, sc.server.tp_size,
                                      injection_tp_sizes(sc, ad, sc.server.tp_size))
        if bad_ranks:  # what `run` refuses before launch (repro.run.prepare), said before resolving anything
            raise ScenarioError(f"{scenario}: {bad_ranks}")
        bad_storage = storage_action_problem([sc.variant(variant)] if variant is not None else sc.variants,
                                             ad.storage_sites, ad.name)
        if bad_storage:  # likewise refused by `run` before launch
            raise ScenarioError(f"{scenario}: {bad_storage}")
        from repro.pd import topology_problem

        bad_servers = topology_problem(sc, ad)
        if bad_servers:
            raise ScenarioError(f"{scenario}: {bad_servers}")
        py = choose_python(python, ad, require_package=False)
    except (ScenarioError, InterpreterError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")  # a message may hold [ledger], [[points]]: not markup
        raise typer.Exit(EXIT_USAGE)
    try:
        rep = check_sites(sc, py, variant, adapter=ad)
    except SitesPreflightError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE if e.bad_interpreter else EXIT_INTERNAL)
    tops = {a.site.split(":")[0].split(".")[0] for i in rep.injections for a in i.alternatives}
    if not as_json and len(tops) == 1 and all(f"No module named '{next(iter(tops))}'" in a.detail
                                              for i in rep.injections for a in i.alternatives):
        pkg = next(iter(tops))  # the engine package itself is missing: one line, not a table of the same error
        console.print(f"[red]error:[/] {escape(str(py))} has no importable {pkg} package (every site's module is "
                      f"missing); pass --python PATH of an interpreter with {pkg} installed")
        raise typer.Exit(EXIT_USAGE)
    if as_json:
        out.print_json(json.dumps(rep.as_dict()))
    else:
        vers = ", ".join(f"{k} {v}" for k, v in rep.versions.items() if v)
        table = Table(title=f"sites of {rep.scenario} in {rep.python} (python {rep.python_version}; {vers})")
        for col in ("variant", "injection", "site alternative", "status", "nearest names / detail"):
            table.add_column(col, overflow="fold")
        for inj in rep.injections:
            for k, a in enumerate(inj.alternatives):
                chosen = inj.resolved is a
                status = {"resolved": "[green]resolved[/]" + (" (used)" if chosen and len(inj.alternatives) > 1 else ""),
                          "absent": "[yellow]absent[/]" if inj.satisfied else "[red]missing[/]",
                          "unverified": "[yellow]unverified[/]"}.get(a.status, f"[red]{a.status}[/]")
                if a.static and a.status == "resolved":
                    status += " (from source)"
                detail = ", ".join(a.suggestions) if a.suggestions else ("" if a.status == "resolved" else a.detail)
                table.add_row(inj.variant if k == 0 else "", inj.injection_id if k == 0 else "", a.site, status, detail)
            for w in inj.warnings:
                table.add_row("", "", "", "[yellow]warning[/]", w)
        out.print(table)
        bad = [i for i in rep.injections if not i.satisfied]
        if bad:
            out.print(f"[red]{len(bad)} injection(s) have no resolvable site:[/] " + ", ".join(f"{i.variant}/{i.injection_id}" for i in bad))
        else:
            out.print(f"[green]all {len(rep.injections)} injection(s) resolve[/]")
    raise typer.Exit(EXIT_SUCCESS if rep.ok else EXIT_USAGE)


def _print_engine_dumps(engine: Any, markdown: Optional[Path], as_json: bool) -> None:
    """``repro analyze`` of files with the engine's own per-rank dumps and no stack: the sentence, one table row per
    figure (the differing ones marked) and the events (``repro.engine_dumps``)."""
    from rich.markup import escape as rich_escape

    if markdown is not None:
        markdown.write_text("\n".join(engine.markdown_lines()) + "\n")
    if as_json:
        out.print_json(data={"engine_dumps": engine.to_dict()})
        return
    out.print(rich_escape(engine.summary), style="bold red" if engine.diverged else "bold", highlight=False)
    if len(engine.last_blocks) >= 2:
        labs = list(engine.last_blocks)
        table = Table(title="The engine's own dump, per rank (the last block of each)")
        for col in ["figure", *labs]:
            table.add_column(col, overflow="fold")
        diff = {d.figure for d in engine.diffs}
        for f in dict.fromkeys(f for b in engine.last_blocks.values() for f in b.figures):
            table.add_row(*(rich_escape(c) for c in [f, *(engine.last_blocks[lab].figures.get(f, "absent") for lab in labs)]),
                          style="bold red" if f in diff else "")
        out.print(table)
    for w in engine.warnings:
        console.print(f"[yellow]warning:[/] {rich_escape(w)}", highlight=False)
    if markdown is not None:
        console.print(f"markdown written to {markdown}")


@app.command()
def analyze(
    paths: List[Path] = typer.Argument(..., help="evidence folder (its stacks/), stacks folder, or dump files "
                                                 "(py-spy text/--json, faulthandler), one per rank"),
    as_json: bool = typer.Option(False, "--json", help="print the analysis as JSON on stdout"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", callback=_path_check("out", example="diagnosis.md"), help="also write the diagnosis as markdown "
                                                                     "(for an issue comment) to this file"),
    tag: Optional[str] = typer.Option(None, "--tag", help="which capture of an evidence folder: file suffix after "
                                                          "rank<k>, e.g. -1b (default: the untagged one, else the newest)"),
) -> None:
    """Explain where every rank is blocked from stack dumps; name the odd rank(s) out. An evidence folder whose
    injector recorded collective ledgers also gets the ledger's first divergent collective (``repro.ledger``).

    Exit 0 when analysed (diverged or not), 2 on bad input (including files from which no rank's stack could be read).
    """
    from rich.markup import escape as rich_escape

    from repro.analysis import AnalyzeInputError, analyze as analyze_captures, load_captures, EXPECTED_INPUT
    from repro.evidence import Layout

    from repro.ledger import diagnose_paths
    from repro.engine_dumps import read_engine_dumps

    ledger_diag = diagnose_paths(paths)
    engine = read_engine_dumps(paths)  # the engine's own per-rank dumps (SGLang's watchdog blocks…), no stack needed
    try:
        caps = load_captures(paths, tag=tag)
    except AnalyzeInputError as e:
        if ledger_diag is None and engine is None:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(EXIT_USAGE)
        caps = []
        if ledger_diag is not None:
            console.print(f"[yellow]warning:[/] {rich_escape(str(e))}; showing the collective ledger only", highlight=False)
    if not caps and ledger_diag is None and engine is None:
        console.print("[red]error:[/] no rank dump found in " + rich_escape(", ".join(str(p) for p in paths))
                      + f"; {EXPECTED_INPUT}", highlight=False)
        raise typer.Exit(EXIT_USAGE)
    if engine is not None and not caps and ledger_diag is None:
        _print_engine_dumps(engine, markdown, as_json)
        return
    if not caps:
        if markdown is not None:
            markdown.write_text("\n".join(ledger_diag.markdown_lines(None)) + "\n")
        if as_json:
            out.print_json(data={"ledger": ledger_diag.to_dict()})
            return
        if ledger_diag.state is not None:
            out.print("First divergent state: " + rich_escape(ledger_diag.state.summary), style="bold", highlight=False)
        out.print(rich_escape(ledger_diag.divergence.summary), style="bold", highlight=False)
        return
    result = analyze_captures(caps)
    from repro.readers.titles import dumps_engine

    assumed = dumps_engine(c.title for c in caps)  # no scenario: which engine the dumps are read as
    # nothing readable from any rank (garbage, empty, binary files): shown, but it is bad input, not an analysis
    unreadable = ledger_diag is None and bool(result.ranks) and len(result.unknown_ranks) == len(result.ranks)
    if unreadable and engine is not None:  # a log with the engine's own dumps and no stack: those are the analysis
        _print_engine_dumps(engine, markdown, as_json)
        return
    if markdown is not None:
        head = "\n".join(ledger_diag.markdown_lines(None)) + "\n" if ledger_diag is not None else ""
        head += "\n".join(engine.markdown_lines()) + "\n" if engine is not None else ""
        markdown.write_text(head + result.to_markdown(caps))
    if as_json:
        extra = {"engine_dumps": engine.to_dict()} if engine is not None else {}
        extra["engine"] = assumed
        if ledger_diag is None:
            out.print_json(data={**result.to_dict(), **extra})
        else:
            out.print_json(data={**result.to_dict(), "ledger": ledger_diag.to_dict(), **extra})
        if unreadable:
            raise typer.Exit(EXIT_USAGE)
        return
    if unreadable:
        # one line, no table of empty ranks: nothing in these files is a stack dump we can read
        console.print("[red]error:[/] " + rich_escape(result.unreadable(", ".join(str(p) for p in paths)) or ""),
                      highlight=False)
        raise typer.Exit(EXIT_USAGE)
    if ledger_diag is not None:
        d = ledger_diag.divergence
        if ledger_diag.state is not None:
            out.print("First divergent state: " + rich_escape(ledger_diag.state.summary),
                      style="bold red" if ledger_diag.state.diverged else "bold", highlight=False)
        out.print("Collective ledger: " + rich_escape(d.summary), style="bold red" if d.kind != "none" else "bold green",
                  highlight=False)
        for p in ledger_diag.problems:
            console.print(f"[yellow]ledger:[/] {rich_escape(p)}", highlight=False)
    if engine is not None:
        out.print(rich_escape(engine.summary), style="bold red" if engine.diverged else "bold", highlight=False)
    odd = set(result.odd_ranks)

    def rank_table(shown: list) -> Table:
        table = Table(title="Where each rank is blocked")
        for col in ("rank", "state", "blocked in", "via", "call site", "caller chain"):
            table.add_column(col, overflow="fold")
        keep = {r.rank for r in shown}
        for r in [r for r in result.ranks if r.rank in keep]:
            style = "bold red" if r.rank in odd else ("yellow" if r.state in ("busy", "unknown") else "")
            state = r.state if r.main_thread or not r.thread else f"{r.state} (thread {r.thread})"
            cells = [str(r.rank), state, r.op or r.wait or r.error, r.via or "", r.blocked_frame or "",
                     " \u2190 ".join(r.caller_chain[:4])]
            table.add_row(*(rich_escape(c) for c in cells), style=style)
        if len(result.ranks) > len(shown):
            table.add_row("…", f"{len(result.ranks) - len(shown)} more ranks", "(every rank is in --json / "
                          f"{Layout.ANALYSIS.name})", "", "", "", style="dim")
        return table

    # at most MAX_TABLE_RANKS rows and MAX_TABLE_LINES lines as this terminal wraps them (a narrow one folds a row
    # into many): the odd ranks first, then the others in rank order; one row says what was left out
    shown = sorted(result.ranks, key=lambda r: (r.rank not in odd, r.rank))[:MAX_TABLE_RANKS]
    table = rank_table(shown)
    while len(shown) > 1 and len(out.render_lines(table, out.options, pad=False)) > MAX_TABLE_LINES:
        shown = shown[:-1]
        table = rank_table(shown)
    out.print(table)
    out.print(rich_escape(result.summary), style="bold red" if result.diverged else "bold green", highlight=False)
    out.print(rich_escape(f"engine: {assumed['name']} ({assumed['from']})"), highlight=False, style="dim")
    for line in result.input_lines():
        out.print(rich_escape(line), highlight=False, style="dim")
    from repro.analysis import MAX_LISTED_LINES

    # the bound on printed warnings puts the "not read" ones (what a bound cut) first, then the others; one line says
    # how many more there are (every one is in --json)
    cut = [w for w in result.warnings if "not read" in w]
    shown_w = (cut + [w for w in result.warnings if "not read" not in w])[:MAX_LISTED_LINES]
    for w in shown_w:
        console.print(f"[yellow]warning:[/] {rich_escape(w)}", highlight=False)
    if len(result.warnings) > len(shown_w):
        console.print(f"[yellow]warning:[/] … and {len(result.warnings) - len(shown_w)} more warnings (every one is "
                      "in --json)", highlight=False)
    if markdown is not None:
        console.print(f"markdown written to {markdown}")


@app.command()
def watch(
    url: str = typer.Option(..., "--url", help="server base URL, e.g. http://127.0.0.1:30000"),
    interval: float = typer.Option(10.0, "--interval", help="seconds between probe rounds (start to start)"),
    probe_timeout: float = typer.Option(5.0, "--probe-timeout", help="seconds a 1-token generate probe may take"),
    health_timeout: float = typer.Option(25.0, "--health-timeout", help="seconds a /health probe may take (above the engine's own /health timeout, 20 s for the default engine, so its 503 is seen)"),
    failures: int = typer.Option(3, "--failures", help="consecutive failed generate probes that declare a hang"),
    pid_root: Optional[int] = typer.Option(None, "--pid-root", help="find rank processes under this pid (the server's launcher)"),
    match: Optional[str] = typer.Option(None, "--match", help="rank processes are those whose title contains this (default: the adapter's rank title, watch_defaults.title_match)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    on_hang: Optional[str] = typer.Option(None, "--on-hang", help="shell command run AFTER the evidence is on disk, with REPRO_EVIDENCE_DIR set (e.g. a restart)"),
    on_hang_timeout: float = typer.Option(600.0, "--on-hang-timeout", help="seconds before the --on-hang command's process group is ended"),
    once: bool = typer.Option(False, "--once", help="probe once and exit: 0 healthy, 3 hung with deadlock evidence, 4 hung without, 6 unreachable, 8 not this engine's API"),
    count: Optional[int] = typer.Option(None, "--count", help="stop after this many probe rounds"),
    native: bool = typer.Option(False, "--native", help="py-spy --native stacks (slower; retried without on failure)"),
    ledger_dir: Optional[Path] = typer.Option(None, "--ledger-dir", callback=_path_check("readdir"), help="the injector folder with the ranks' collective ledgers (repro serve's EVIDENCE/injector): a ledger proof declares a deadlock at once"),
    adapter_name: Optional[str] = typer.Option(None, "--adapter", help="engine adapter whose titles, frame rules and API the watch uses (default: the registry's default engine, said as assumed; an unknown name lists the known ones)"),
    hosts: Optional[Path] = typer.Option(None, "--hosts", callback=_HOSTS_FILE, help="JSON list of the hosts a multi-node server spans (ssh target or command template; scripts/multihost/README.md): its ranks are found and dumped on each host through that host's runner"),
) -> None:
    """Probe a live server's generate path; on a hang keep the evidence (stacks ×2, diagnosis, /metrics), then run --on-hang.

    One JSON line per probe round and per event on stdout. Runs until SIGINT/SIGTERM (exit 0); with --once exits
    0 healthy, 3 hung with deadlock evidence, 4 hung without it, 6 unreachable; 2 on bad options. Exit 8 (with or
    without --once) when the URL answers fast 404/405/501 or closes the connection before any generate succeeded:
    not this engine's API or a wrong URL, never a hang (no capture, no --on-hang).
    """
    from repro.watch import WatchConfigError, WatchOptions, Watcher

    try:
        opts = WatchOptions(url=url, interval_s=interval, probe_timeout_s=probe_timeout, health_timeout_s=health_timeout,
                            failures=failures, pid_root=pid_root, match=match, evidence_root=evidence_dir,
                            on_hang=on_hang, on_hang_timeout_s=on_hang_timeout, once=once, max_rounds=count,
                            native=native, ledger_dir=ledger_dir).validate()
        if hosts is not None:
            import dataclasses

            from repro.hosts import hosts_from_json

            try:
                opts = dataclasses.replace(opts, hosts=tuple(hosts_from_json(json.loads(hosts.read_text()))))
            except (OSError, ValueError) as e:
                raise WatchConfigError(f"--hosts {hosts}: {e}; expected a JSON list of hosts like "
                                       '[{"name": "h0", "node_rank": 0, "ssh": "root@10.0.0.10"}, …]') from None
    except WatchConfigError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(EXIT_USAGE)

    notes = {
        "hang": lambda e: f"[bold red]HANG[/] ({e['kind']}): {e['detail']}; capturing every rank …",
        "evidence": lambda e: f"[{_verdict_style(e['verdict'])}]{e['verdict']}[/] {e['reason']}\n  evidence: {e['path']}",
        "evidence_error": lambda e: f"[red]could not write[/] {e['path']}: {e['error']}"
                                    + (f" (kept at {e['fallback']} instead)" if e.get("fallback") else ""),
        "on_hang": lambda e: f"--on-hang exited {e.get('rc')}" + (" (timed out)" if e.get("timed_out") else ""),
        "on_hang_skipped": lambda e: f"[yellow]--on-hang not run[/]: {e['reason']}",
        "unreachable": lambda e: f"[yellow]unreachable[/]: {e['detail']}",
        "misconfigured": lambda e: f"[red]not this engine's API[/]: {e['detail']} (exit 8)",
        "recovered": lambda e: "[green]recovered[/]: a generate probe succeeded again",
    }

    def log(rec: dict) -> None:
        sys.stdout.write(json.dumps(rec, default=str) + "\n")
        sys.stdout.flush()
        note = notes.get(rec["event"])
        if note is not None:
            from rich.markup import escape as rich_escape

            console.print(note({k: rich_escape(v) if isinstance(v, str) else v for k, v in rec.items()}), highlight=False)

    from repro.targets.registry import UnknownAdapterError, get_adapter, known_adapters

    try:
        adapter = get_adapter(adapter_name) if adapter_name else None  # None: the default engine, assumed (said)
    except UnknownAdapterError as e:
        console.print(f"[red]error:[/] --adapter: {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    watcher = Watcher(opts, log, adapter=adapter)
    if watcher.adapter_assumed:
        console.print(f"engine: {watcher.adapter.name} (assumed: no --adapter given; known: "
                      f"{', '.join(known_adapters())})", highlight=False, soft_wrap=True)

    def on_signal(signum, frame):  # noqa: ARG001
        watcher.stop()

    # the watch's own handlers (stop the loop, then write what it has) live as long as the loop: restored after it,
    # so a caller that runs the command in-process (a test, a notebook) gets its Ctrl-C back
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        code = watcher.run()
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)
    from repro.watch import EXIT_MISCONFIGURED

    raise typer.Exit(code if once or code == EXIT_MISCONFIGURED else 0)


def _reproduce_run(w, dumps, out_dir: Path, evidence_dir, python, model, tp, only, as_json: bool) -> None:
    """Run the written candidates, write REPRODUCTION.md, print the outcome and exit 10/11/12 (``repro.reproduce``)."""
    from repro.evidence import EvidenceDir
    from repro.reproduce import ReproduceInputError, exit_code, keep_winner, reproduction_markdown, run_candidates
    from repro.runner import RunError

    _sigterm_to_interrupt()
    t0 = time.monotonic()
    try:
        tried = run_candidates(w, evidence_dir or out_dir / "evidence", python=python, model=model, tp=tp, only=only)
    except RunError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    except KeyboardInterrupt:
        raise typer.Exit(_interrupted_exit())
    src = ", ".join(str(d) for d in dumps)
    md = EvidenceDir.open(out_dir).reproduction
    try:
        kept = keep_winner(w, tried, out_dir)
    except ReproduceInputError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        kept = None
    md.write(reproduction_markdown(w, tried, src, time.monotonic() - t0))
    code = exit_code(tried)
    if as_json:
        out.print_json(json.dumps({**w.to_json(), "tried": [t.to_json() for t in tried], "reproduction": str(md.path),
                                   "kept": str(kept) if kept else None, "exit_code": code}, default=str))
        raise typer.Exit(code)
    for line in w.signature.lines():
        out.print("original:     " + escape(line), highlight=False)
    for t in tried:
        out.print(f"{t.candidate}: {t.verdict} → [bold]{t.outcome}[/] ({escape(str(t.evidence))})", highlight=False)
        for line in (t.signature.lines() if t.signature else []):
            out.print("  reproduction: " + escape(line), highlight=False)
    if kept:
        out.print(f"scenario kept: {escape(str(kept))}", highlight=False)
    out.print(f"{md.member.name} written to {escape(str(md.path))}", highlight=False)
    raise typer.Exit(code)


@app.command()
def reproduce(
    dumps: List[Path] = typer.Argument(..., help="anything `repro analyze` reads: an evidence folder, a stacks folder, per-rank dump files"),
    base: Optional[Path] = typer.Option(None, "--base", help="scenario whose server (flags, model, TP) the candidates use (default: the adapter's defaults for what the frames imply)"),
    python: Optional[str] = typer.Option(None, "--python", help="target interpreter whose engine source the frames are mapped to (default: as `repro run` picks it)"),
    model: Optional[str] = typer.Option(None, "--model", help="model path for the server"),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size (default: the number of ranks in the dumps)"),
    out_dir: Path = typer.Option(Path("reproduce"), "--out", callback=_EVIDENCE_DIR, help="folder for the scenario it writes and its report"),
    no_run: bool = typer.Option(False, "--no-run", help="only write the candidates (exit 0); launch nothing"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="run only these candidates (repeatable)"),
    evidence_dir: Optional[Path] = typer.Option(None, "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root for the candidate runs (default: OUT/evidence)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release to map and run on, e.g. 0.5.18 (default: what --report or the dumps say, else inferred from the frames)"),
    report: Optional[List[Path]] = typer.Option(None, "--report", callback=_path_check("in", "a text file: a pasted environment report (the engine's check_env output) or a server log"), help="a pasted environment report (the engine's check_env output) or a server log naming the release (repeatable)"),
) -> None:
    """Write a scenario whose variants make the dumps' divergence on purpose, then run them on one server and judge
    each against the dumps (with --no-run: only write it, launch nothing).

    Always: OUT/reproduce.toml with the candidates (``repro.reproduce``): an extra collective on the odd rank(s),
    its mirror, and discovery's root-cause candidates on the odd rank's path; then exit 0 with --no-run (run one
    later with ``repro run OUT/reproduce.toml --variant NAME``). Without --no-run (the default) it launches one
    server, runs the candidates on it (re-armed per candidate, restarted after a hang), compares each hang's
    signature with the dumps' and writes OUT/REPRODUCTION.md (and OUT/reproducer.toml with the one that
    reproduced): exit 10 REPRODUCED, 11 DIFFERENT HANG, 12 NOT REPRODUCED. Exit 2 on bad input (ranks that agree,
    one rank, a busy rank, no Python frames, an engine without adapter, a release unknown or not set up): one line,
    before anything is launched. The release: --release, else what --report / the dumps name, else inferred from the
    frames (``repro.reproduce_release``); printed with why.
    """
    from repro.reproduce import ReproduceInputError, write_candidates

    _release_given(release)
    try:
        w = write_candidates([str(d) for d in dumps], out_dir, base_path=base, python=python, tp=tp, model=model,
                             release=release, reports=[str(r) for r in report or []])
    except ReproduceInputError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    if w.release is not None and not as_json:
        out.print(f"release: {escape(w.release.reason)}", highlight=False)
    if not no_run:
        _reproduce_run(w, dumps, out_dir, evidence_dir, python, model, tp, only or [], as_json)
    if as_json:
        out.print_json(json.dumps(w.to_json(), default=str))
        raise typer.Exit(EXIT_SUCCESS)
    out.print("signature of the dumps:", style="bold")
    for line in w.signature.lines():
        out.print("  " + escape(line), highlight=False)
    table = Table(title=f"candidates in {w.scenario_file}")
    for col in ("variant", "kind", "what", "site", "gate"):
        table.add_column(col, overflow="fold")
    for c in w.plan.candidates:
        inj = c.injections[0]
        site = inj["site"] if isinstance(inj["site"], str) else inj["site"][0]
        gate = inj.get("gate") or {}
        g = ", ".join(x for x in (" & ".join(gate.get("called_from") or []),
                                  f"inside for {gate['inside_loop']}" if gate.get("inside_loop") else "") if x)
        table.add_row(*(escape(x) for x in (c.name, c.kind, c.description, site, g)))
    out.print(table)
    for s in w.plan.server_says:
        out.print(f"server guess: {escape(s)}", highlight=False)
    for s in w.plan.needs_base:
        console.print(f"[yellow]note:[/] {escape(s)}", highlight=False)
    for d in w.plan.drift:
        out.print(f"version drift: {escape(d)}", highlight=False)
    for n in w.notes:
        out.print(escape(n), style="dim", highlight=False)
    out.print(f"run one: python -m repro run {w.scenario_file} --variant {w.plan.candidates[0].name}", highlight=False)
    raise typer.Exit(EXIT_SUCCESS)


@app.command()
def discover(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help=f"base scenario (its server.adapter picks the rules), e.g. {EXAMPLES_DIR}/hicache_prefetch_30760.toml"),
    python: Optional[str] = typer.Option(None, "--python", help="target interpreter whose engine source is scanned (default: as `repro run` picks it)"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    rules: Optional[Path] = typer.Option(None, "--rules", callback=_path_check("text", f"a TOML rules file like {EXAMPLES_DIR}/discover_rules.toml"), help=f"discovery rules TOML (default: the adapter's, {EXAMPLES_DIR}/discover_rules.toml)"),
    out_file: Optional[Path] = typer.Option(None, "--out", callback=_path_check("out", example="points.toml"), help="write the huntable candidates as hunt catalogue [[points]] TOML to this file"),
    limit: int = typer.Option(30, "--limit", help="candidates shown in the table (all are in --json)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """List rank-local decision points around collectives, found in the engine's source (AST only, run in the target
    interpreter; nothing is launched): ranked candidates with their caller, rank-local source, guard and guarded
    collective. `repro hunt --discover` hunts them. Exit 0, 2 on bad input, 1 when the scan failed.
    """
    python = _release_python(release, python, scenario)
    from repro.discover import DiscoverError, default_rules_path, discover as run_discover, points_toml
    from repro.catalogue import HuntError, catalogue_for, load_catalogue
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError, load_scenario
    from repro.targets.registry import get_adapter

    try:
        sc = load_scenario(scenario)
        ad = get_adapter(sc.server.adapter)  # the run's engine, from the scenario
        py = choose_python(python, ad)
        cat = load_catalogue(catalogue_for(ad))
        path = rules or default_rules_path(ad, cat.path)
    except (ScenarioError, InterpreterError, HuntError, DiscoverError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")  # a message may hold [ledger], [[points]]: not markup
        raise typer.Exit(EXIT_USAGE)
    try:
        d = run_discover(py, path, known_perturbations=list(cat.perturbations))
    except DiscoverError as e:
        bad_input = any(k in str(e) for k in ("rules not found", "not valid TOML", ": expected", "not a UTF-8 text file"))
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE if bad_input else EXIT_INTERNAL)
    if out_file is not None:
        out_file.write_text(points_toml(d.points, header=f"repro discover {scenario} ({path}, {py})"), encoding="utf-8")
    if as_json:
        out.print_json(json.dumps(d.to_json(), default=str))
        raise typer.Exit(EXIT_SUCCESS)
    s = d.summary()
    table = Table(title=f"rank-local decision points in {s['package']} ({s['functions']} functions, "
                        f"{s['reaching_functions']} reach a collective)")
    for col in ("#", "caller", "rank-local source", "loop", "guard", "guarded collective", "site"):
        table.add_column(col, overflow="fold")
    for i, c in enumerate(d.candidates[:limit], 1):
        table.add_row(str(i), c.caller.split(":", 1)[-1], f"{c.source} ({c.source_kind})", f"for {c.loop_var}" if c.loop_var else "",
                      f"{c.guard} l.{c.guard_line}", f"{c.collective} → {c.chain[-1] if c.chain else ''}",
                      ", ".join(x.split(':', 1)[-1] for x in c.sites[:2]) or "none (listed only)")
    out.print(table)
    out.print(f"{s['candidates']} candidates ({s['huntable']} with a patchable site) → {s['points']} hunt points; "
              f"{s['unresolved_calls']} of {s['calls']} calls resolve to nothing in the package (not followed); "
              + (f"scan answer reused from {s['cached']}" if s.get("cached") else f"scan {s['seconds'].get('total')} s")
              + (f"; points written to {out_file}" if out_file else ""))
    raise typer.Exit(EXIT_SUCCESS)


@app.command()
def bisect(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help="scenario TOML file or bundled name"),
    good: str = typer.Option(..., "--good", help="REF of the good end: release:V or release:V+patch:FILE"),
    bad: str = typer.Option(..., "--bad", help="REF of the bad end (same form and patch as --good)"),
    variant: Optional[str] = typer.Option(None, "--variant", help="variant name (default: the first in the file)"),
    model: Optional[str] = typer.Option(None, "--model", help="model path (default: the scenario's)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="TP size (default: the scenario's)"),
    requests_: Optional[int] = typer.Option(None, "--requests", help="requests in the burst (default: the scenario's)"),
    label: Optional[str] = typer.Option(None, "--label", help="label of the folders (default: the variant name)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """The first release between --good and --bad at which the variant's verdict changes (``repro.release_bisect``):
    each step a `repro run` evidence folder, BISECT.md beside them. Exit 0 when found; 2 bad input (a REF that is
    not a release, a release not set up: one line naming the setup command); the shared verdict's code when both
    ends agree."""
    from repro.evidence import EvidenceDir, Layout
    from repro.release_bisect import BisectError, BisectOptions, bisect as run_bisect

    _sigterm_to_interrupt()
    opts = BisectOptions(scenario_path=scenario, good=good, bad=bad, variant=variant, model=model, tp=tp,
                         requests=requests_, label=label, evidence_root=evidence_dir)

    def observe(event: str, data: dict) -> None:
        if as_json:
            return
        if event == "step":
            _rule(console, f"{data['release']}: {data['ref']}")
        elif event == "verdict":
            out.print(f"{data['release']}: [{_verdict_style(data['verdict'])}]{data['verdict']}[/]  "
                      f"{escape(str(Path(data['evidence']) / Layout.REPORT.name))}", highlight=False)

    try:
        res = run_bisect(opts, observe=observe)
    except BisectError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: server tree torn down; the steps so far are in {Layout.BISECT_MD.name}")
        raise typer.Exit(_interrupted_exit())
    if as_json:
        out.print_json(json.dumps(res.to_json(), default=str))
        raise typer.Exit(res.exit_code)
    if res.first_changed:
        out.print(f"first change at [bold]{res.first_changed}[/] (last like --good: {res.last_same})")
    else:
        out.print(f"no change: both ends {res.steps[0].verdict if res.steps else '?'}")
    md = EvidenceDir.open(res.folder).bisect_md
    out.print(f"{md.member.name} written to {escape(str(md.path))}", highlight=False)
    raise typer.Exit(res.exit_code)


@app.command()
def hunt(
    scenario: Path = typer.Argument(..., callback=_scenario_arg, help=f"base scenario: its server and burst (variants ignored), e.g. {EXAMPLES_DIR}/hicache_prefetch_30760.toml"),
    budget_min: float = typer.Option(30.0, "--budget-min", help="wall-clock budget in minutes; trials not started in time are reported NOT RUN"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="decision point(s) to hunt (repeatable; default: the whole catalogue)"),
    perturbation: Optional[List[str]] = typer.Option(None, "--perturbation", help="perturbation(s) to try (repeatable; default: all that apply)"),
    rank: Optional[List[int]] = typer.Option(None, "--rank", help="rank(s) to perturb, one at a time (repeatable; default: every rank)"),
    sites: bool = typer.Option(False, "--sites", help="also skip once / add one extra collective at every collective call site the ledger saw in the baseline burst (each hangs by construction: a restart per trial)"),
    sites_matching: Optional[List[str]] = typer.Option(None, "--sites-matching", help="with --sites: only call sites whose frames match this glob (repeatable), e.g. '*hicache*'"),
    catalogue: Optional[Path] = typer.Option(None, "--catalogue", callback=_path_check("text", f"a hunt catalogue TOML like {EXAMPLES_DIR}/hunt_catalogue.toml (with --natural: {EXAMPLES_DIR}/natural_nemeses.toml)"), help=f"hunt catalogue TOML (default: {EXAMPLES_DIR}/hunt_catalogue.toml; with --natural: {EXAMPLES_DIR}/natural_nemeses.toml)"),
    ref: str = typer.Option("installed", "--ref", help="code to hunt in: installed | patch:FILE | git:PATH@REV | python:PATH (as in compare)"),
    python: Optional[str] = typer.Option(None, "--python", help="interpreter that runs the server (default: as `repro run`)"),
    release: Optional[str] = typer.Option(None, "--release", help="engine release whose set-up venv runs it, e.g. 0.5.23 (instead of --python; repro.releases)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder"),
    requests_: Optional[int] = typer.Option(None, "--requests", help="requests per burst (default: the scenario's)"),
    confirm: bool = typer.Option(False, "--confirm", help="re-run each new scheduling/cache finding from its scenario file on a fresh server"),
    discover_: bool = typer.Option(False, "--discover", help="also hunt the decision points `repro discover` proposes from the engine's source (hand catalogue entries win)"),
    no_hand: bool = typer.Option(False, "--no-hand-catalogue", help="with --discover: drop the hand catalogue's points (discovery alone decides where to search)"),
    discover_rules: Optional[Path] = typer.Option(None, "--discover-rules", callback=_path_check("text", f"a TOML rules file like {EXAMPLES_DIR}/discover_rules.toml"), help=f"discovery rules TOML (default: the adapter's, {EXAMPLES_DIR}/discover_rules.toml)"),
    workload: Optional[List[str]] = typer.Option(None, "--workload", help="workload nemesis to hunt under (repeatable; 'all': every one of the workload file); each runs clean first"),
    config: Optional[List[str]] = typer.Option(None, "--config", help="server configuration of the workload file to hunt beside the base scenario's (repeatable), e.g. no_radix"),
    clean_only: bool = typer.Option(False, "--clean-only", help="with --workload/--config: only each workload's clean run on each server group (no trials)"),
    workload_file: Optional[Path] = typer.Option(None, "--workload-file", callback=_path_check("text", f"a workloads TOML like {EXAMPLES_DIR}/hunt_workloads.toml"), help="workloads/configurations TOML (default: hunt_workloads.toml beside the catalogue)"),
    spare: bool = typer.Option(False, "--spare/--no-spare", help="keep a spare trial server starting in the background and swap to it after a hang (default: restart the hung server; on a 2-core CPU box the spare does not pay)"),
    shard: Optional[str] = typer.Option(None, "--shard", help="run only shard K of N of the trial plan (K/N, e.g. 2/4; split on point × perturbation × rank before the baseline); join the folders with `repro hunt-merge`"),
    natural: bool = typer.Option(False, "--natural", help="only natural nemeses (delay, stop, clock, fault, pending, storage miss / fail: what one rank's environment can do) plus one control row; catalogue: natural_nemeses.toml beside the hunt catalogue"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON on stdout"),
) -> None:
    """Search a live server for collective-desync hazards: perturb each rank-local decision point once, on one rank
    at a time, and report which perturbations deadlock and in which collective (HUNT.md, hunt.jsonl).

    Exit codes: 3 if any trial DEADLOCKED in a scheduling/cache collective, 0 otherwise (also when only the model's
    forward deadlocked, and a --shard holding no trial: no server), 4 when the baseline burst reached none of the
    chosen decision points (nothing was perturbed), 2 bad input or a failed baseline, 130 interrupted (results so far kept), 1 internal error.
    """
    python = _release_python(release, python, scenario)
    from rich.markup import escape as rich_escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

    from repro import resources
    from repro.hunt import DEFAULT_CATALOGUE, FAMILY_SCHED, HuntError, HuntOptions, hunt as run_hunt
    from repro.runner import RunError

    from repro.shard import ShardError, parse_shard

    try:
        shard_kn = parse_shard(shard) if shard is not None else None
    except ShardError as e:
        console.print(f"[red]error:[/] {rich_escape(str(e))}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    _sigterm_to_interrupt()
    opts = HuntOptions(scenario_path=scenario, catalogue_path=resources.find_data_file(catalogue) if catalogue else None, only=tuple(only or ()),
                       perturbations=tuple(perturbation or ()), ranks=tuple(rank or ()), budget_min=budget_min,
                       evidence_root=evidence_dir, python=python, ref=ref, sites=sites,
                       sites_matching=tuple(sites_matching or ()), confirm=confirm,
                       requests=requests_, command_line=shlex.join(["repro", *sys.argv[1:]]),
                       discover=discover_, hand_points=not no_hand, discover_rules=discover_rules,
                       workloads=tuple(workload or ()), configs=tuple(config or ()), workload_file=workload_file,
                       clean_only=clean_only, spare=spare, shard=shard_kn, natural=natural)
    from repro.evidence import EvidenceDir, Layout

    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[left]}"), console=console, transient=True, disable=as_json)
    state: dict = {"task": None, "folder": None}

    def observe(event: str, data: dict) -> None:
        if as_json:
            return
        if event == "hunt_folder":
            state["folder"] = data["folder"]
            console.print(f"hunt folder: {data['folder']}  ({Layout.HUNT_MD.name}, {Layout.HUNT_JSONL.name})")
        elif event == "baseline":
            state["task"] = prog.add_task("baseline burst (observe-only probes)", total=None, left="")
        elif event == "rows":
            console.print(f"baseline: {len(data['rows'])} row(s) (decision point × caller × loop)"
                          + (f"; not reached: {', '.join(data['not_seen'])}" if data["not_seen"] else ""))
        elif event == "trial_start" and state["task"] is not None:
            t = data["trial"]
            prog.update(state["task"], description=rich_escape(f"{t.name}"), total=data["total"], completed=data["n"] - 1,
                        left=f"{data['remaining_s'] / 60:.1f} min left")
        elif event == "trial":
            r = data["result"]
            console.print(f"[{_verdict_style(r.verdict)}]{r.verdict}[/] {rich_escape(r.trial.name)}: {rich_escape(r.hazard or r.reason)}",
                          highlight=False)
        elif event == "confirm":
            console.print(f"confirming {rich_escape(data['trial'].name)} from {rich_escape(data['scenario'])}")

    try:
        with prog:
            res = run_hunt(opts, observe)
    except (HuntError, RunError) as e:
        console.print(f"[red]error:[/] {rich_escape(str(e))}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: server tree torn down; results so far kept"
                      + (f" in {Path(state['folder']) / Layout.HUNT_MD.name}" if state["folder"] else ""))
        raise typer.Exit(_interrupted_exit())
    sched = [r for r in res.deadlocks if r.diagnosis and r.diagnosis.family == FAMILY_SCHED]
    if as_json:
        out.print_json(json.dumps({
            "folder": str(res.folder), "hunt_md": str(EvidenceDir.open(res.folder).hunt_md.path), "baseline": str(res.baseline),
            "wall_s": round(res.wall_s, 1), "budget_exhausted": res.budget_exhausted, "discovery": res.discovery,
            "empty_shard": res.empty_shard,
            "rows": [{"point": r.point, "caller": r.caller, "loop_frame": r.loop_frame, "loop_var": r.loop_var,
                      "where": r.where, "ranks": list(r.ranks)} for r in res.rows],
            "results": [r.to_json() for r in res.results],
        }, default=str))
    else:
        t = Table(title="deadlocks found (scheduling/cache first)")
        for col in ("trial", "family", "diverged in", "known", "scenario"):
            t.add_column(col)
        from repro.hunt import rank_key

        for r in sorted(res.deadlocks, key=rank_key):
            d = r.diagnosis
            t.add_row(r.trial.name, d.family if d else "?", d.collective if d else "?", (d.known or "") if d else "",
                      str(r.scenario_file or ""))
        out.print(t)
        ran = [r for r in res.results if r.verdict != "NOT RUN"]
        out.print(f"{len(ran)} of {len(res.results)} trial(s) run, {len(res.deadlocks)} deadlock(s), {len(sched)} in "
                  f"scheduling/cache collectives; wall time {res.wall_s / 60:.1f} min"
                  + ("; budget ended early" if res.budget_exhausted else ""))
        if res.empty_shard:  # no baseline ran: "reached none" (exit 4) would be untrue
            out.print(f"shard {res.empty_shard} holds no trial of the plan (split before the baseline): no server "
                      "started, nothing run; the other shards hold the trials (join the folders with repro hunt-merge)")
        elif not res.rows:
            out.print("nothing was perturbed: the baseline burst reached none of the chosen decision points")
        out.print(f"report: {EvidenceDir.open(res.folder).hunt_md.path}")
    if not res.rows and not res.empty_shard:  # nothing exercised is not "nothing found"
        raise typer.Exit(EXIT_INCONCLUSIVE)
    raise typer.Exit(EXIT_DEADLOCKED if sched or getattr(res, "findings", None) else EXIT_SUCCESS)


@app.command("hunt-merge")
def hunt_merge(
    shards: List[Path] = typer.Argument(..., help="the hunt folders `repro hunt --shard K/N` made (one per K)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", callback=_EVIDENCE_DIR, help="merged folder (default: a new <evidence-dir>/<scenario>/<time>-hunt-merged)"),
    evidence_dir: Path = typer.Option(Path("evidence"), "--evidence-dir", callback=_EVIDENCE_DIR, help="evidence root folder (for the default --out)"),
    as_json: bool = typer.Option(False, "--json", help="print the merged folder and its trial lines as JSON on stdout"),
) -> None:
    """Join the folders of a sharded hunt into one HUNT.md + hunt.jsonl (every trial in plan order; missing shards
    named). Exit codes: 0 merged, 2 folders that are not shards of one plan."""
    from repro.evidence import EvidenceDir
    from repro.hunt.merge import MergeError, merge_shards

    try:
        folder = merge_shards(shards, out_dir, evidence_dir)
    except MergeError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(EXIT_USAGE)
    merged = EvidenceDir.open(folder)
    lines = merged.hunt_jsonl.read()
    merge = next((x for x in lines if x.get("event") == "merge"), {})
    trials = [x for x in lines if x.get("event") == "trial"]
    if as_json:
        out.print_json(json.dumps({"folder": str(folder), "hunt_md": str(merged.hunt_md.path), "n": merge.get("n"),
                                   "shards": merge.get("shards"), "missing": merge.get("missing"), "results": trials}))
    else:
        out.print(f"{len(trials)} trial(s) from {len(merge.get('shards') or {})} of {merge.get('n')} shard(s)"
                  + (f"; missing: {', '.join(map(str, merge['missing']))}" if merge.get("missing") else ""))
        out.print(f"report: {merged.hunt_md.path}")
    raise typer.Exit(EXIT_SUCCESS)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
