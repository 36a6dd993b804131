"""Writing scenario files: a base scenario's server, burst and times with generated variants, as TOML text that
``repro.scenario.load_scenario`` reads back (``repro hunt``'s probe, trial and finding files; ``repro reproduce``'s
candidate files).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def scenario_toml(base: Any, name: str, description: str, variants: Sequence[tuple[str, str, str, Sequence[dict]]],
                  mirrors: str = "", comment: str = "") -> str:
    """A scenario file with ``base``'s server, burst and times and the given variants.

    Args:
        base: the base ``repro.scenario.Scenario``.
        variants: (name, expect, description, injections as dicts with id/site/action/gate[/required/server][,
            extra]); ``extra``: the variant's own ``abort`` / ``workload`` tables (``repro.nemeses``), written when
            given. A multi-server base (``server.topology``, e.g. PD) keeps its topology and ``[server.roles.*]``.
    Returns:
        TOML text that ``repro.scenario.load_scenario`` accepts.
    """
    s = base
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += [f"name = {_toml_value(name)}", f"description = {_toml_value(description)}"]
    if mirrors:
        lines.append(f"mirrors = {_toml_value(mirrors)}")
    lines += [f"stall_s = {s.stall_s!r}", f"budget_s = {s.budget_s!r}", f"ledger = {_toml_value(s.ledger)}", "", "[server]"]
    srv = s.server.model_dump()
    for k in ("adapter", "model", "tp_size", "args", "startup_timeout_s"):
        lines.append(f"{k} = {_toml_value(srv[k])}")
    if srv.get("env"):
        lines.append(f"env = {_toml_value(srv['env'])}")
    if srv.get("topology", "single") != "single":  # a multi-server stack (PD) and its per-role overrides
        lines.append(f"topology = {_toml_value(srv['topology'])}")
    for role, spec in (srv.get("roles") or {}).items():
        lines += ["", f"[server.roles.{_toml_key(role)}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in spec.items() if v not in (None, [], {})]
    lines += ["", "[burst]"]
    for k, v in s.burst.model_dump().items():
        if v is not None:  # an unset optional field (e.g. burst.abort) is left out, as in the scenario file
            lines.append(f"{k} = {_toml_value(v)}")
    for vname, expect, desc, injections, *rest in variants:
        lines += ["", "[[variants]]", f"name = {_toml_value(vname)}", f"expect = {_toml_value(expect)}",
                  f"description = {_toml_value(desc)}"]
        for k, v in ((rest[0] if rest else None) or {}).items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        for inj in injections:
            lines += ["", "[[variants.injections]]", f"id = {_toml_value(inj['id'])}", f"site = {_toml_value(inj['site'])}",
                      f"action = {_toml_value(inj['action'])}"]
            if inj.get("required") is False:  # an observe-only counter (repro.scenario.Injection.required)
                lines.append("required = false")
            if inj.get("server"):  # a multi-server stack: the engine server whose ranks take it
                lines.append(f"server = {_toml_value(inj['server'])}")
            if inj.get("gate"):
                lines += ["", "[variants.injections.gate]"]
                for k, v in inj["gate"].items():
                    if v is not None:
                        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
