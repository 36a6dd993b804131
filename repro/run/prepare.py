"""Preparing a run (:func:`prepare`): inputs checked, every site checked, the evidence folder made, the plan compiled.
Launches nothing."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro import resources
from repro.run.options import ARM_FILE_NAME, Prepared, RunError, RunOptions, UnresolvedSitesError
from repro.scenario import (Scenario, Variant, compile_plan, gate_rank_problem, load_scenario, PLAN_ENV,
                            storage_action_problem, tp_option_problem)


def prepare(opts: RunOptions, *, label_default: Optional[str] = None, variants: Optional[Sequence[str]] = None) -> Prepared:
    """Validate inputs, check every site (:func:`repro.sites.check_before_launch`), create the evidence folder and
    compile the plan. Launches nothing. Every verb that launches a server passes here (run, serve, demo, compare,
    hunt, reproduce, PD stacks, ``--hosts``), so a site that cannot exist is refused before any folder or server.

    Args:
        variants: load the injections of all these variants into one plan (a session that drives them in turn);
            default: only ``opts.variant``. Injection ids must be unique across them.
    Raises:
        UnresolvedSitesError: an injection none of whose sites exists in the server's interpreter (a RunError).
        RunError: bad scenario/variant/override or interpreter (message names the fix).
    """
    d = _decide(opts, variants)
    scenario, variant, loaded, adapter, python, on_testbed, spec = d
    ev_root = Path(opts.evidence_root)
    try:
        evd = ev.EvidenceDir(ev_root, scenario.name, opts.label or label_default or variant.name)
    except ev.EvidenceError as e:
        _remove_owned(adapter, spec)
        raise RunError(str(e)) from None
    arm_file = evd.path / ARM_FILE_NAME
    plan = session_plan(adapter, scenario, loaded, evd.injector_dir, arm_file)
    evd.plan.write(plan)
    shutil.copyfile(opts.scenario_path, evd.scenario.path)
    spec = dataclasses.replace(spec, env={**spec.env, PLAN_ENV: str(evd.plan.path.resolve())})
    return Prepared(scenario, variant, evd, plan, spec, adapter, python, on_testbed, arm_file)


def check_launch(opts: RunOptions, variants: Optional[Sequence[str]] = None) -> None:
    """What :func:`prepare` checks (inputs, interpreter, every site), without writing anything: for a verb that
    runs several launches in turn (``compare``'s two sides, ``demo``'s two variants) to refuse before the first.

    Raises:
        UnresolvedSitesError, RunError: as :func:`prepare`.
    """
    d = _decide(opts, variants)
    _remove_owned(d[3], d[6])


def _decide(opts: RunOptions, variants: Optional[Sequence[str]]) -> tuple:
    """prepare's checks and the launch spec (without the plan's path): (scenario, variant, loaded variants, adapter,
    python, on_testbed, spec). Writes no evidence; the testbed profile may make a storage folder (``_remove_owned``)."""
    from repro.interpreter import InterpreterError, choose_python
    from repro.scenario import ScenarioError
    from repro.targets.base import LaunchSpec
    from repro.targets.registry import UnknownAdapterError, get_adapter

    try:
        scenario = load_scenario(opts.scenario_path)
        variant = scenario.variant(opts.variant if not variants else variants[0])
        # each variant once (a variant may be asked for several times: repeats on one server)
        loaded = [scenario.variant(v) for v in dict.fromkeys(variants)] if variants else [variant]
    except ScenarioError as e:
        raise RunError(str(e)) from None
    all_ids = [i.id for v in loaded for i in v.injections]
    dup = sorted({i for i in all_ids if all_ids.count(i) > 1})
    if dup:
        raise RunError(f"{opts.scenario_path}: injection id(s) {', '.join(dup)} appear in several of the variants "
                       f"{', '.join(v.name for v in loaded)}; give each injection its own id to run them on one server")
    bad_tp = tp_option_problem(opts.tp, scenario.server.tp_size, [(f"variant {v.name!r}", v.expect) for v in loaded])
    if bad_tp:
        raise RunError(bad_tp)
    if opts.requests is not None and opts.requests < 1:
        raise RunError(f"--requests must be ≥ 1 (got {opts.requests})")
    tp = opts.tp or scenario.server.tp_size
    try:
        adapter = get_adapter(scenario.server.adapter)
    except UnknownAdapterError as e:
        raise RunError(f"{opts.scenario_path}: server.adapter: {e}") from None
    from repro.pd import injection_tp_sizes, topology_problem

    bad_ranks = gate_rank_problem(loaded, tp, injection_tp_sizes(scenario, adapter, tp))  # a stack: each its server's
    if bad_ranks:
        raise RunError(f"{opts.scenario_path}: {bad_ranks}")
    bad_storage = storage_action_problem(loaded, adapter.storage_sites, adapter.name)
    if bad_storage:
        raise RunError(f"{opts.scenario_path}: {bad_storage}")
    bad_servers = topology_problem(scenario, adapter)
    if bad_servers:
        raise RunError(f"{opts.scenario_path}: {bad_servers}")
    try:
        python = choose_python(opts.python, adapter)
    except InterpreterError as e:
        raise RunError(str(e)) from None
    tb_python = adapter.testbed_python()
    on_testbed = tb_python is not None and Path(python).resolve() == Path(tb_python).resolve()
    tb_model = adapter.testbed_model() if on_testbed else None
    model = opts.model or scenario.server.model or (str(tb_model) if tb_model else "")
    if not model:
        raise RunError(f"{opts.scenario_path}: server.model is empty and the interpreter is not the CPU testbed's; pass --model PATH")
    if _looks_like_path(model) and not Path(model).expanduser().exists():
        src = "--model" if opts.model else f"{opts.scenario_path}: server.model"
        raise RunError(f"{src} {model}: no such folder; pass the path of a model folder (or a hub id like org/name)")

    args = list(scenario.server.args)
    env = dict(scenario.server.env)
    prepend = [str(resources.injectors_dir()), *opts.pythonpath_prepend]  # a clone's injectors/ or the wheel's copy
    env.update(opts.extra_env)
    spec = LaunchSpec(python=python, model=model, tp_size=tp, port=0, nccl_port=0, args=args, env=env, pythonpath_prepend=prepend)
    if on_testbed:
        extra_args, extra_env, tb_prepend = adapter.testbed_profile(spec, args)
        spec = dataclasses.replace(
            spec, args=[*args, *extra_args], env={**env, **extra_env}, pythonpath_prepend=[*prepend, *tb_prepend]
        )
    from repro.launcher import LaunchError, check_fork_ranks

    try:  # the fork-ranks opt-in off a CPU device: bad input, before any server exists (the launcher checks again)
        check_fork_ranks({**os.environ, **spec.env}, spec.args, forks=bool(adapter.injector_profile.fork_plan()))
    except LaunchError as e:
        _remove_owned(adapter, spec)
        raise RunError(str(e)) from None
    # every injection must have a site that can exist in the server's interpreter, on the server's PYTHONPATH,
    # before any folder or server exists (issue 29 item 3): the resolver `repro sites` runs, reading sources only;
    # what it cannot decide, Session.start's check decides once the server's injector has patched it
    from repro.sites import SitesUnresolved, check_before_launch

    try:
        check_before_launch(scenario, opts.scenario_path, [v.name for v in loaded], python,
                            env=adapter.launch_env(spec, dict(os.environ)), adapter=adapter)
    except SitesUnresolved as e:
        _remove_owned(adapter, spec)
        raise UnresolvedSitesError(str(e)) from None
    return scenario, variant, loaded, adapter, python, on_testbed, spec


def _remove_owned(adapter: Any, spec: Any) -> None:
    """Remove the folders a launch spec made for its server (the testbed's HiCache storage) when it never launches."""
    try:
        for d in adapter.owned_dirs(spec.env):
            shutil.rmtree(d, ignore_errors=True)
    except Exception:
        pass


def engine_plan(adapter: Any) -> dict[str, str]:
    """The plan's ``engine``: the adapter's name, its importable package and the distribution whose version the
    injector records (``ref_location.version_key``, else the package)."""
    lc = adapter.ref_location
    return {"name": adapter.name, "package": lc.package, "distribution": lc.version_key or lc.package}


def session_plan(adapter: Any, scenario: Scenario, variants: Sequence[Variant], injector_dir: Path, arm_file: Path) -> dict:
    """The plan of a session that loads ``variants``' injections (all of them; armed one variant at a time).

    The engine's part comes from the adapter: the ledger's tick function is ``adapter.tick_function_for`` the
    server's args (a ``--disaggregation-mode prefill`` server counts ticks with its own loop's function) and
    ``adapter.injector_profile`` (coordinator classes, alias and communication-module prefixes) goes into the
    plan's ``ledger`` for the injector (which never imports the harness), its fork-ranks caller into ``fork_ranks``.
    """
    plan = compile_plan(scenario, variants[0], injector_dir, arm_file,
                        tick_function=adapter.tick_function_for(scenario.server.args),
                        injector_profile=adapter.injector_profile.to_plan(),
                        state_probes=adapter.state_probe_plan(),
                        fork_ranks=adapter.injector_profile.fork_plan(),
                        engine=engine_plan(adapter))
    for extra in variants[1:]:
        plan["injections"] += compile_plan(scenario, extra, injector_dir, arm_file)["injections"]
    plan["variant"] = ",".join(v.name for v in variants)
    return plan


def _looks_like_path(model: str) -> bool:
    """A model given as a filesystem path (absolute, ./, ../, ~), as opposed to a hub id like ``org/name``."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..")
