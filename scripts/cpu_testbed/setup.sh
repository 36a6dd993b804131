#!/usr/bin/env bash
# Set up the CPU testbed: a separate venv with real sglang + torch for running SGLang TP servers on a CPU-only box.
#
#   bash scripts/cpu_testbed/setup.sh [--dir DIR] [--python PYTHON] [--force]
#
# DIR defaults to $REPRO_TESTBED_DIR, else ${XDG_CACHE_HOME:-~/.cache}/tp-deadlock-repro/testbed/sglang-<version>
# (outside the clone, so fresh clones and CI reuse it). Idempotent: when the stamp file says everything is in place
# a re-run takes about a second. An existing venv that already has the pinned versions (e.g. installed by hand with
# the same pip command) is reused without reinstalling. Installs the HiCache compat hook (.pth, inert unless
# REPRO_TESTBED_COMPAT=1) into the venv. The sgl_kernel stand-in and the tiny model stay in the repo
# (scripts/cpu_testbed/stub, scripts/cpu_testbed/tiny_llama); the adapter's testbed profile points the server at them.
# PD disaggregation (prefill + decode + router): also installs Mooncake's transfer engine (non-CUDA build, used over
# TCP) and SGLang's router from PyPI, and the Debian library libibverbs1 that Mooncake's engine.so links (apt-get,
# only when the library is missing; needs root).
set -euo pipefail

SGLANG_VERSION="0.5.23"   # keep in step with repro/targets/sglang/releases/ (index.toml testbed_default; a fast test checks it)
TORCH_VERSION="2.14.1"    # keep in step with repro/targets/sglang/releases/0.5.23.toml [cpu] torch (checked)
PACKAGES=("sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}" "py-spy")
MOONCAKE_VERSION="0.3.13.post1"   # PD disaggregation: Mooncake transfer engine over TCP
ROUTER_VERSION="0.3.2"            # SGLang's router (sglang 0.5.23 has no in-tree one)
PD_PACKAGES=("mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}" "sglang-router==${ROUTER_VERSION}")
PD_DEBIAN_PACKAGE="libibverbs1"   # provides libibverbs.so.1, linked by mooncake's engine.so even without RDMA

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${REPRO_TESTBED_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tp-deadlock-repro/testbed/sglang-${SGLANG_VERSION}}"
base_python="${PYTHON:-python3}"
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift 2 ;;
    --dir=*) dir="${1#--dir=}"; shift ;;
    --python) base_python="$2"; shift 2 ;;
    --python=*) base_python="${1#--python=}"; shift ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (expected --dir DIR, --python PYTHON, --force)" >&2; exit 2 ;;
  esac
done

venv="$dir/venv"
py="$venv/bin/python"
stamp="$dir/.setup-stamp"
boot_src="$here/compat/repro_testbed_compat_boot.py"
t0=$(date +%s)

fail() { echo "setup.sh: ERROR: $*" >&2; exit 1; }
elapsed() { echo $(( $(date +%s) - t0 )); }

want_stamp() {
  printf 'sglang=%s torch=%s mooncake=%s router=%s boot=%s\n' "$SGLANG_VERSION" "$TORCH_VERSION" "$MOONCAKE_VERSION" \
    "$ROUTER_VERSION" "$(sha256sum "$boot_src" | cut -c1-16)"
}

# ---- fast path: everything already in place ----------------------------------------------------------------------
if [ "$force" = 0 ] && [ -x "$py" ] && [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$(want_stamp)" ]; then
  echo "CPU testbed ready at $dir (sglang $SGLANG_VERSION, torch $TORCH_VERSION; stamp $(sed -n 2p "$stamp")) in $(elapsed) s"
  exit 0
fi

echo "Setting up the CPU testbed at $dir"
mkdir -p "$dir" || fail "cannot create $dir (set REPRO_TESTBED_DIR or --dir to a writable folder)"

# ---- venv --------------------------------------------------------------------------------------------------------
if [ ! -x "$py" ]; then
  command -v "$base_python" >/dev/null 2>&1 || fail "no '$base_python' to create the venv; pass --python /path/to/python3 (>= 3.10)"
  "$base_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || fail "$base_python is older than Python 3.10; pass --python /path/to/python3.10+"
  echo "  creating venv with $("$base_python" --version 2>&1) ..."
  "$base_python" -m venv "$venv" || fail "'$base_python -m venv $venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

installed_version() {  # prints the installed version of a distribution, or nothing
  "$py" - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

# ---- packages (reused when the pinned versions are already there) -------------------------------------------------
have_sglang="$(installed_version sglang)"
have_torch="$(installed_version torch)"
have_pyspy="$(installed_version py-spy)"
if [ "$have_sglang" = "$SGLANG_VERSION" ] && [ "${have_torch%%+*}" = "$TORCH_VERSION" ] && [ -n "$have_pyspy" ]; then
  echo "  reusing installed packages: sglang $have_sglang, torch $have_torch, py-spy $have_pyspy"
else
  echo "  installing ${PACKAGES[*]} and their dependencies: a ~4 GB download (the CUDA torch wheel and its nvidia-*"
  echo "  libraries, flashinfer, sgl-kernel), ~11 GB in $venv, 4-5 min on a fresh machine; progress every 15 s ..."
  tp=$(date +%s)
  log="$dir/pip-install.log"
  : >"$log"
  (  # progress: the venv's size against ~11 GB and pip's last line (full log: $log); on TERM its sleep ends too
    s=""; trap '[ -n "$s" ] && kill "$s" 2>/dev/null; exit 0' TERM
    while :; do
      sleep 15 & s=$!; wait "$s"
      mb=$(du -sm "$venv" 2>/dev/null | cut -f1 || true)
      last=$(tail -c 2000 "$log" 2>/dev/null | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -1 | cut -c1-110 || true)
      echo "  ... $(( $(date +%s) - tp )) s: venv ${mb:-0} MB of ~11000 MB; pip: ${last:-starting}"
    done
  ) &
  progress_pid=$!
  trap 'kill "$progress_pid" 2>/dev/null' EXIT
  pip_rc=0
  "$py" -m pip install --no-input --progress-bar off "${PACKAGES[@]}" >"$log" 2>&1 || pip_rc=$?
  kill "$progress_pid" 2>/dev/null || true; wait "$progress_pid" 2>/dev/null || true; trap - EXIT  # (set -e: a killed job's 143)
  if [ "$pip_rc" -ne 0 ]; then
    tail -15 "$log" >&2
    missing=$(grep -oE "No matching distribution found for [^ ]+|Could not find a version that satisfies the requirement [^ ]+" "$log" | head -1 || true)
    fail "pip could not install ${missing:-the packages} (full log: $log). Check network access to the package index (pip config list) or that the wheel for this Python/platform exists; then re-run this script."
  fi
  echo "  pip install took $(( $(date +%s) - tp )) s: sglang $(installed_version sglang), torch $(installed_version torch), py-spy $(installed_version py-spy)"
fi

# ---- PD disaggregation: libibverbs1 (Debian) + Mooncake's transfer engine + SGLang's router (PyPI) ---------------
have_ibverbs() { ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; }
if have_ibverbs; then
  echo "  reusing $PD_DEBIAN_PACKAGE (libibverbs.so.1 found)"
else
  command -v apt-get >/dev/null 2>&1 \
    || fail "libibverbs.so.1 is missing and there is no apt-get; install your distribution's libibverbs (rdma-core) package, then re-run this script"
  [ "$(id -u)" = 0 ] || fail "libibverbs.so.1 is missing; run 'apt-get update && apt-get install -y $PD_DEBIAN_PACKAGE' as root, then re-run this script"
  echo "  installing $PD_DEBIAN_PACKAGE with apt-get (Mooncake's engine.so links libibverbs.so.1; no RDMA device is needed) ..."
  apt_log="$dir/apt-get.log"
  if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$PD_DEBIAN_PACKAGE"; } >"$apt_log" 2>&1; then
    tail -10 "$apt_log" >&2
    fail "apt-get could not install $PD_DEBIAN_PACKAGE (full log: $apt_log); check access to the Debian package archive, then re-run this script"
  fi
  have_ibverbs || fail "$PD_DEBIAN_PACKAGE installed but libibverbs.so.1 is still not found by ldconfig (full log: $apt_log)"
fi
have_mooncake="$(installed_version mooncake-transfer-engine-non-cuda)"
have_router="$(installed_version sglang-router)"
if [ "$have_mooncake" = "$MOONCAKE_VERSION" ] && [ "$have_router" = "$ROUTER_VERSION" ]; then
  echo "  reusing installed PD packages: mooncake-transfer-engine-non-cuda $have_mooncake, sglang-router $have_router"
else
  echo "  installing ${PD_PACKAGES[*]} (about 60 MB) ..."
  tp=$(date +%s)
  log="$dir/pip-install-pd.log"
  if ! "$py" -m pip install --no-input "${PD_PACKAGES[@]}" >"$log" 2>&1; then
    tail -15 "$log" >&2
    fail "pip could not install ${PD_PACKAGES[*]} (full log: $log); check network access to the package index, then re-run this script"
  fi
  echo "  pip install took $(( $(date +%s) - tp )) s: mooncake-transfer-engine-non-cuda $(installed_version mooncake-transfer-engine-non-cuda), sglang-router $(installed_version sglang-router)"
fi

# ---- HiCache compat hook (inert unless REPRO_TESTBED_COMPAT=1) ---------------------------------------------------
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || fail "cannot locate site-packages of $py"
cp "$boot_src" "$site/repro_testbed_compat_boot.py" || fail "cannot write $site (is the venv writable?)"
# A .pth line starting with "import" is executed at start-up by every interpreter of this venv; it imports the boot
# module only when the testbed profile enabled the layer.
printf '%s\n' "import os; os.environ.get('REPRO_TESTBED_COMPAT') == '1' and __import__('repro_testbed_compat_boot')" \
  > "$site/repro_testbed_compat.pth"
echo "  installed compat hook: $site/repro_testbed_compat.pth"

# ---- import check, then the stamp ---------------------------------------------------------------------------------
echo "  checking imports (torch, sglang CPU mode with the sgl_kernel stand-in) ..."
if ! out=$(SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here/stub" "$py" -W ignore -c '
import torch, sglang, sgl_kernel
assert sgl_kernel.__file__.startswith(__import__("sys").argv[1]), "stand-in not first on the path: " + sgl_kernel.__file__
import sglang.srt.mem_cache.allocation  # imports assign_req_to_token_pool_cpu from the stand-in
from mooncake.engine import TransferEngine  # PD: loads engine.so (needs libibverbs.so.1)
import sglang_router.launch_router  # PD: the router
print(f"torch {torch.__version__}, sglang {sglang.__version__}")
' "$here/stub" 2>&1); then
  echo "$out" | tail -15 >&2
  fail "the testbed venv cannot import torch/sglang in CPU mode (output above); re-run with --force to reinstall"
fi
echo "  $out"
printf '%s\n%s\n' "$(want_stamp)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$stamp"
echo "CPU testbed ready at $dir in $(elapsed) s (python: $py)"
