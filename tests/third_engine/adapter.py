"""``thirdeng``: an engine the harness has never heard of, behind the engine seam (``repro.targets.base``).

Its server is ``tests/fake_servers/third_engine_server.py`` (an HTTP process plus one rank process per TP rank, each
titled ``thirdeng::rank_TP<k>`` on its command line, calling ``thirdeng.core:Engine.step`` once per tick); its package
``thirdeng`` 7.1.0 lives in ``site/`` (with its distribution metadata); its per-release data in ``releases/``. Its
"CPU testbed" is an interpreter that has that package: a two-line wrapper around this Python, written into the
folder the test gives.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from repro.targets.base import AdapterBase, LaunchSpec, RankTitle, RefLocation, StreamUpdate, WatchDefaults

HERE = Path(__file__).resolve().parent
SITE = HERE / "site"
SERVER = HERE.parent / "fake_servers" / "third_engine_server.py"
_TITLE = re.compile(r"(?<![\w:])thirdeng::rank_TP(\d+)(?!\w)")


class ThirdEngineAdapter(AdapterBase):
    """The third engine: launch, HTTP shapes, titles, tick function, REF location, testbed, release data."""

    name = "thirdeng"
    health_path = "/health"
    generate_path = "/gen"
    tick_function = "thirdeng.core:Engine.step"
    ref_location = RefLocation(package="thirdeng", version_key="thirdeng")
    watch_defaults = WatchDefaults(title_match="thirdeng::rank", title_example="thirdeng::rank_TP<k>",
                                   health_timeout_s=5.0)
    title_namespace = "thirdeng::"
    releases_dir = HERE / "releases"

    def __init__(self, testbed_dir: Optional[Path] = None) -> None:
        self.testbed_dir = testbed_dir

    # ---- its testbed: a Python that has the thirdeng package ----------------------------------------------
    def testbed_python(self) -> Optional[Path]:
        if self.testbed_dir is None:
            return None
        py = Path(self.testbed_dir) / "bin" / "python"
        if not py.exists():
            py.parent.mkdir(parents=True, exist_ok=True)
            py.write_text(f'#!/bin/sh\nPYTHONPATH="{SITE}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n')
            py.chmod(py.stat().st_mode | stat.S_IXUSR)
        return py

    def testbed_model(self) -> Optional[Path]:
        return HERE  # the fake server loads nothing; any existing folder

    def testbed_setup_command(self) -> str:
        return "(the test writes it)"

    # ---- launching and talking to it -------------------------------------------------------------------------
    def launch_command(self, spec: LaunchSpec) -> list[str]:
        return [spec.python, str(SERVER), "--port", str(spec.port), "--tp", str(spec.tp_size), *spec.args]

    def parse_title(self, title: str) -> Optional[RankTitle]:
        m = _TITLE.search(title or "")
        return RankTitle(tp=int(m.group(1)), role="rank") if m else None

    def generate_body(self, input_ids: Sequence[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        self.check_generate_args(input_ids, max_new_tokens)
        return {"ids": [int(i) for i in input_ids], "n": int(max_new_tokens), "stream": bool(stream)}

    def parse_response(self, body: Any) -> StreamUpdate:
        return self._update(body, done=True)

    @staticmethod
    def _update(body: dict[str, Any], done: bool) -> StreamUpdate:
        fin = body.get("finish")
        return StreamUpdate(output_ids=int(body.get("n_out", 0)), finish_reason=fin, done=done or fin is not None,
                            error=body.get("error"))
