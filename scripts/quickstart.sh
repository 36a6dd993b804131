#!/usr/bin/env bash
# The README's two quick-start commands on a fresh machine (a clone of this repository, Python >= 3.10):
#
#   bash scripts/quickstart.sh demo [-- repro demo args]     set up what the demo needs, then run it
#   bash scripts/quickstart.sh test [STAGE...] [-- pytest args]
#                                                            set up what the tests need, then run scripts/test.sh
#
# Steps (each skipped in about a second when already in place, so a re-run is fast):
#   1. the harness: `$PYTHON -m pip install -e '.[test]'` (typer, rich, pydantic, requests, psutil, py-spy, pytest,
#      build: about 30 MB) unless $PYTHON already imports this clone's `repro` and its dependencies;
#   2. the CPU testbed: scripts/cpu_testbed/setup.sh (real sglang 0.5.23 + torch 2.14.1 in their own venv under
#      $REPRO_TESTBED_DIR, default ~/.cache/tp-deadlock-repro/testbed/sglang-0.5.23: about 11 GB on disk and
#      4-5 min on a fresh machine, with progress lines; an empty or missing folder gets a fresh install);
#   3. `python -m repro demo` (two runs on a real SGLang TP=2 server on CPU, ~2 min) or `bash scripts/test.sh`.
# Environment: PYTHON (default python3) runs the harness; REPRO_TESTBED_DIR as in setup.sh. Step 1 installs this
#   clone editable into $PYTHON: one that imports another checkout's repro is re-pointed here (a NOTE line says so);
#   PYTHON=/path/to/venv/bin/python keeps the install to a venv of your own.
# Exit code: the demo's or the tests' own; 1 when a set-up step failed (its error says why); 2 on bad usage.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$(pwd)"
PY="${PYTHON:-python3}"
export PYTHON="$PY"

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
what="$1"; shift
case "$what" in
  demo|test) ;;
  -h|--help) usage; exit 0 ;;
  *) echo "quickstart.sh: unknown command '$what' (expected demo or test)" >&2; usage >&2; exit 2 ;;
esac
if [ "$what" = demo ] && [ "${1:-}" = "--" ]; then shift; fi

now() { date +%s; }
t_all=$(now)
durations=()
step_done() { durations+=("$(printf '%-16s %5d s' "$1" $(( $(now) - $2 )))"); }
fail() { echo "quickstart.sh: ERROR: $*" >&2; exit 1; }

# ---- 1. the harness -----------------------------------------------------------------------------------------------
t=$(now)
command -v "$PY" >/dev/null 2>&1 || fail "no '$PY' on PATH; install Python >= 3.10 or set PYTHON=/path/to/python3"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || fail "$PY is older than Python 3.10; set PYTHON=/path/to/python3.10+"
harness_ok() {  # this clone's repro and every dependency importable by $PY (pytest and build for the tests)
  "$PY" - "$root" <<'EOF' >/dev/null 2>&1
import sys, os, importlib.util
root = os.path.realpath(sys.argv[1])
os.chdir("/")  # what an installed `repro` sees, not this folder on sys.path
import repro
assert os.path.realpath(repro.__file__).startswith(root + os.sep), repro.__file__
for m in ("typer", "rich", "pydantic", "requests", "psutil", "pytest", "build"):
    assert importlib.util.find_spec(m), m
EOF
}
other_repro() {  # where the `repro` that $PY imports lives when it is not this clone's (else nothing)
  "$PY" - "$root" <<'EOF' 2>/dev/null
import sys, os
root = os.path.realpath(sys.argv[1])
os.chdir("/")  # what an installed `repro` sees, not this folder on sys.path
try:
    import repro
except Exception:
    sys.exit(0)
here = os.path.realpath(repro.__file__)
if not here.startswith(root + os.sep):
    print(os.path.dirname(os.path.dirname(here)))
EOF
}
echo "=== 1/3 harness: $PY ($("$PY" --version 2>&1)) ==="
if harness_ok; then
  echo "  in place: this clone's repro and its dependencies import"
else
  other="$(other_repro)"
  if [ -n "$other" ]; then
    echo "  NOTE: $PY imports repro from another checkout ($other); this install re-points $PY's repro (import and console script, for everyone using $PY here) to $root. To leave it alone: python3 -m venv .venv && PYTHON=.venv/bin/python bash scripts/quickstart.sh $what"
  fi
  echo "  installing: $PY -m pip install -e '.[test]' (typer, rich, pydantic, requests, psutil, py-spy, pytest, build: ~30 MB)"
  "$PY" -m pip install --no-input -q --progress-bar off -e '.[test]' \
    || fail "pip could not install the harness (output above); check network access to the package index (pip config list)"
  harness_ok || fail "$PY still cannot import this clone's repro after the install (is another checkout installed editable? run: $PY -m pip install -e '$root[test]')"
fi
step_done "harness" "$t"

# ---- 2. the CPU testbed -------------------------------------------------------------------------------------------
t=$(now)
echo "=== 2/3 CPU testbed: bash scripts/cpu_testbed/setup.sh ==="
bash scripts/cpu_testbed/setup.sh || fail "the CPU testbed could not be set up (output above)"
step_done "testbed" "$t"

# ---- 3. the demo or the tests -------------------------------------------------------------------------------------
t=$(now)
rc=0
if [ "$what" = demo ]; then
  echo "=== 3/3 demo: $PY -m repro demo $* (two runs on a real SGLang TP=2 server on CPU, ~2 min) ==="
  "$PY" -m repro demo "$@" || rc=$?
else
  echo "=== 3/3 tests: bash scripts/test.sh $* ==="
  bash scripts/test.sh "$@" || rc=$?
fi
step_done "$what" "$t"

printf '%s\n' "=== quickstart $what: durations ===" "${durations[@]}" "$(printf '%-16s %5d s' total $(( $(now) - t_all )))" "exit $rc"
exit "$rc"
