#!/usr/bin/env bash
# Set up the CPU testbed: a separate venv with real sglang + torch for running SGLang TP servers on a CPU-only box.
#
#   bash scripts/cpu_testbed/setup.sh [--release V] [--dir DIR] [--python PYTHON] [--force]
#
# V: the sglang release (default 0.5.23). Its recipe is data: [cpu] of repro/targets/sglang/releases/V.toml,
# read by release_recipe.py (kind "venv": a venv of its own; kind "overlay": the release's own wheel over the venv
# of an older release with the same torch pin, which must be set up first). DIR defaults to $REPRO_TESTBED_DIR for
# 0.5.23, else ${XDG_CACHE_HOME:-~/.cache}/tp-deadlock-repro/testbed/sglang-<V>
# (outside the clone, so fresh clones and CI reuse it). Writes testbed.json there: release, kind, base, seconds, GB. Idempotent: when the stamp file says everything is in place
# a re-run takes about a second. An existing venv that already has the pinned versions (e.g. installed by hand with
# the same pip command) is reused without reinstalling. Installs the HiCache compat hook (.pth, inert unless
# REPRO_TESTBED_COMPAT=1) into the venv. The sgl_kernel stand-in and the tiny model stay in the repo
# (scripts/cpu_testbed/stub, scripts/cpu_testbed/tiny_llama); the adapter's testbed profile points the server at them.
# PD disaggregation (prefill + decode + router): also installs Mooncake's transfer engine (non-CUDA build, used over
# TCP) and SGLang's router from PyPI, and the Debian library libibverbs1 that Mooncake's engine.so links (apt-get,
# only when the library is missing; needs root).
set -euo pipefail

SGLANG_VERSION="0.5.23"   # the default release; keep in step with repro/targets/sglang/releases/ (index.toml testbed_default; a fast test checks it)
TORCH_VERSION="2.14.1"    # keep in step with repro/targets/sglang/releases/0.5.23.toml [cpu] torch (checked)
MOONCAKE_VERSION="0.3.13.post1"   # PD disaggregation: Mooncake transfer engine over TCP
ROUTER_VERSION="0.3.2"            # SGLang's router (sglang 0.5.23 has no in-tree one)
PD_PACKAGES=("mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}" "sglang-router==${ROUTER_VERSION}")
PD_DEBIAN_PACKAGE="libibverbs1"   # provides libibverbs.so.1, linked by mooncake's engine.so even without RDMA

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/tp-deadlock-repro/testbed"
dir=""
release="$SGLANG_VERSION"
base_python="${PYTHON:-python3}"
force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --release) release="$2"; shift 2 ;;
    --release=*) release="${1#--release=}"; shift ;;
    --dir) dir="$2"; shift 2 ;;
    --dir=*) dir="${1#--dir=}"; shift ;;
    --python) base_python="$2"; shift 2 ;;
    --python=*) base_python="${1#--python=}"; shift ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (expected --release V, --dir DIR, --python PYTHON, --force)" >&2; exit 2 ;;
  esac
done

# ---- the release's recipe (data beside the adapter) ---------------------------------------------------------------
releases_dir="${REPRO_RELEASES_DIR:-}"
if [ -z "$releases_dir" ]; then
  for c in "$here/../../repro/targets/sglang/releases" "$here/../../targets/sglang/releases"; do  # clone | wheel
    [ -d "$c" ] && { releases_dir="$c"; break; }
  done
fi
recipe_py="python3"; command -v "$recipe_py" >/dev/null 2>&1 || recipe_py="$base_python"
recipe_out="$("$recipe_py" "$here/release_recipe.py" "${releases_dir:-<no release data: set REPRO_RELEASES_DIR>}" "$release" 2>&1)" \
  || { echo "setup.sh: $recipe_out" >&2; exit 2; }
eval "$recipe_out"   # KIND TORCH TORCH_BUILD SKIP_DEPS BASE PD RECIPE_HASH
if [ -z "$dir" ]; then
  if [ "$release" = "$SGLANG_VERSION" ]; then dir="${REPRO_TESTBED_DIR:-$cache_root/sglang-$release}"; else dir="$cache_root/sglang-$release"; fi
fi
PACKAGES=("sglang==${release}" "torch==${TORCH}" "py-spy")

venv="$dir/venv"
py="$venv/bin/python"
stamp="$dir/.setup-stamp"
boot_src="$here/compat/repro_testbed_compat_boot.py"
t0=$(date +%s)

fail() { echo "setup.sh: ERROR: $*" >&2; exit 1; }
elapsed() { echo $(( $(date +%s) - t0 )); }

EXT_STAMP=1  # the torch extensions this testbed builds at set-up, in its own folder (below)
want_stamp() {  # (0.5.23's stamp line is unchanged from before releases had recipes: its testbed stays reused)
  if [ "$PD" = 1 ]; then
    printf 'sglang=%s torch=%s mooncake=%s router=%s boot=%s ext=%s\n' "$release" "$TORCH" "$MOONCAKE_VERSION" \
      "$ROUTER_VERSION" "$(sha256sum "$boot_src" | cut -c1-16)" "$EXT_STAMP"
  else
    printf 'sglang=%s kind=%s base=%s recipe=%s boot=%s stub=%s ext=%s\n' "$release" "$KIND" "$BASE" "$RECIPE_HASH" \
      "$(sha256sum "$boot_src" | cut -c1-16)" "$(cat "$here"/stub/sgl_kernel/*.py | sha256sum | cut -c1-16)" "$EXT_STAMP"
  fi
}

# ---- fast path: everything already in place ----------------------------------------------------------------------
if [ "$force" = 0 ] && [ -x "$py" ] && [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$(want_stamp)" ]; then
  echo "CPU testbed ready at $dir (sglang $release, $KIND${BASE:+ over $BASE}; stamp $(sed -n 2p "$stamp")) in $(elapsed) s"
  exit 0
fi

echo "Setting up the CPU testbed of sglang $release ($KIND${BASE:+ over the $BASE venv}) at $dir"
if [ "$KIND" = overlay ]; then
  base_dir="$cache_root/sglang-$BASE"
  [ "$BASE" = "$SGLANG_VERSION" ] && base_dir="${REPRO_TESTBED_DIR:-$base_dir}"
  base_py="$base_dir/venv/bin/python"
  [ -x "$base_py" ] && [ -f "$base_dir/.setup-stamp" ] \
    || fail "sglang $release is an overlay on the sglang $BASE venv, which is not set up; run: bash $0 --release $BASE (then this command again)"
fi
mkdir -p "$dir" || fail "cannot create $dir (set REPRO_TESTBED_DIR or --dir to a writable folder)"

# ---- venv --------------------------------------------------------------------------------------------------------
[ "$KIND" = overlay ] && base_python="$base_py"   # the overlay runs on the base venv's interpreter
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
installed=0    # 1 once this run installed packages: testbed.json then records this run's seconds as the install's
pip_logged() {  # pip_logged LOG WHAT PIP-ARGS...: pip install with a progress line every 15 s; fails naming the package
  local log="$1" what="$2"; shift 2
  installed=1
  local tp; tp=$(date +%s)
  : >"$log"
  (  # progress: the venv's size and pip's last line (full log: $log); on TERM its sleep ends too
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
  local pip_rc=0
  "$py" -m pip install --no-input --progress-bar off "$@" >"$log" 2>&1 || pip_rc=$?
  kill "$progress_pid" 2>/dev/null || true; wait "$progress_pid" 2>/dev/null || true; trap - EXIT  # (set -e: a killed job's 143)
  if [ "$pip_rc" -ne 0 ]; then
    tail -15 "$log" >&2
    missing=$(grep -oE "No matching distribution found for [^ ]+|Could not find a version that satisfies the requirement [^ ]+" "$log" | head -1 || true)
    fail "pip could not install ${missing:-$what} (full log: $log). Check network access to the package index (pip config list) or that the wheel for this Python/platform exists; then re-run this script."
  fi
  echo "  pip install of $what took $(( $(date +%s) - tp )) s"
}

have_sglang="$(installed_version sglang)"
have_torch="$(installed_version torch)"
have_pyspy="$(installed_version py-spy)"
if [ "$KIND" = overlay ]; then
  # The release's own wheel, no dependencies: they come from the base venv (a .pth adds its site-packages after ours).
  if [ "$have_sglang" = "$release" ]; then
    echo "  reusing the overlay: sglang $have_sglang over the $BASE venv"
  else
    echo "  installing sglang==$release --no-deps (its wheel, ~25 MB) over the sglang $BASE venv ($base_dir) ..."
    pip_logged "$dir/pip-install.log" "sglang==$release" --no-deps "sglang==$release"
  fi
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || fail "cannot locate site-packages of $py"
  base_site="$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || fail "cannot locate site-packages of $base_py"
  # addsitedir (not a bare path line) so the base's own .pth files (the compat hook) run too; it comes after ours.
  printf 'import site; site.addsitedir(%s)\n' "'$base_site'" > "$site/repro_testbed_base.pth"
  echo "  overlay: $site/repro_testbed_base.pth adds $base_site after the overlay's own sglang"
elif [ "$have_sglang" = "$release" ] && [ "${have_torch%%+*}" = "$TORCH" ] && [ -n "$have_pyspy" ]; then
  echo "  reusing installed packages: sglang $have_sglang, torch $have_torch, py-spy $have_pyspy"
else
  constraints="$dir/constraints.txt"
  : >"$constraints"
  # A local `torch==X+cpu` wheel (pip's find-links) outranks the registry's torch==X; the CUDA build is wanted here.
  [ "$TORCH_BUILD" = cuda ] && echo "torch!=${TORCH}+cpu" >>"$constraints"
  echo "  installing ${PACKAGES[*]} and their dependencies${SKIP_DEPS:+ (less $SKIP_DEPS)}: a ~4 GB download (the CUDA"
  echo "  torch wheel and its nvidia-* libraries, flashinfer, sgl-kernel), ~11 GB in $venv, 4-5 min on a fresh machine;"
  echo "  progress every 15 s ..."
  if [ -z "$SKIP_DEPS" ]; then
    pip_logged "$dir/pip-install.log" "the packages" -c "$constraints" "${PACKAGES[@]}"
  else
    # sglang without its dependencies, then every dependency its wheel lists except SKIP_DEPS.
    pip_logged "$dir/pip-install-sglang.log" "sglang==$release" --no-deps "sglang==$release"
    "$py" - "$dir/requirements.txt" $SKIP_DEPS <<'PYEOF' || fail "cannot list the dependencies of the installed sglang ($py)"
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
skip = {canonicalize_name(n) for n in sys.argv[2:]}
out = []
for line in requires("sglang") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(r.name) in skip:
        continue
    r.marker = None
    out.append(str(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PYEOF
    pip_logged "$dir/pip-install.log" "the dependencies of sglang $release" -c "$constraints" -r "$dir/requirements.txt" \
      "torch==$TORCH" py-spy
  fi
  echo "  installed: sglang $(installed_version sglang), torch $(installed_version torch), py-spy $(installed_version py-spy)"
fi

# ---- PD disaggregation: libibverbs1 (Debian) + Mooncake's transfer engine + SGLang's router (PyPI) ---------------
if [ "$PD" = 1 ]; then
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
echo "  checking imports (torch, sglang $release in CPU mode with the sgl_kernel stand-in) ..."
if ! out=$(SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here/stub" "$py" -W ignore - "$here/stub" "$release" "$PD" <<'PYEOF' 2>&1
import os, re, sys
import torch, sglang, sgl_kernel, sgl_kernel.mamba
stub, release, pd = sys.argv[1:4]
assert sgl_kernel.__file__.startswith(stub), "stand-in not first on the path: " + sgl_kernel.__file__
assert sglang.__version__ == release, f"sglang {sglang.__version__} imports from {sglang.__file__}, expected {release}"
import sglang.srt.mem_cache.allocation  # imports assign_req_to_token_pool_cpu from the stand-in
# Every *_cpu name this release imports from sgl_kernel (module level, CPU mode) must be served by the stand-in.
pat = re.compile(r"from (sgl_kernel(?:\.mamba)?) import (?:\(([^)]*)\)|([^\n(]*))")
missing = set()
root = os.path.dirname(sglang.__file__)
for d, _, files in os.walk(root):
    for f in files:
        if f.endswith(".py"):
            text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
            for mod, in_parens, on_line in pat.findall(text):
                for n in (i.split()[0] for i in (in_parens or on_line).split(",") if i.split()):  # "X as Y": X
                    if not n.endswith("_cpu"):
                        continue
                    if not hasattr(sys.modules[mod], n):
                        missing.add(f"{mod}.{n} ({os.path.relpath(os.path.join(d, f), root)})")
assert not missing, "the sgl_kernel stand-in lacks " + ", ".join(sorted(missing)) + " (scripts/cpu_testbed/stub)"
if pd == "1":
    from mooncake.engine import TransferEngine  # PD: loads engine.so (needs libibverbs.so.1)
    import sglang_router.launch_router  # PD: the router
print(f"torch {torch.__version__}, sglang {sglang.__version__} from {os.path.dirname(root)}")
PYEOF
); then
  echo "$out" | tail -15 >&2
  fail "the testbed venv cannot import torch/sglang $release in CPU mode (output above); re-run with --force to reinstall"
fi
echo "  $out"
# ---- torch extensions sglang compiles at first use, built now in this testbed's own folder -------------------------
# HiCache hashes token pages with a C++ extension that sglang JIT-compiles on first use (torch.utils.cpp_extension.load,
# mem_cache/cpp_utils/native_hash.py in 0.5.18 and 0.5.23). In the shared ~/.cache/torch_extensions/<py>_<cuda>/ two
# releases with the same CUDA tag rebuild it in turn, and a server stopped mid-build leaves torch's lock file behind:
# every later HiCache server then waits on it forever in its warm-up (never healthy). The adapter's testbed profile
# points TORCH_EXTENSIONS_DIR at "$dir/torch_extensions" when that folder exists; it is built here, once.
ext_dir="$dir/torch_extensions"
mkdir -p "$ext_dir"
echo "  building the torch extensions sglang $release compiles at first use, in $ext_dir ..."
if ! ext_out=$(TORCH_EXTENSIONS_DIR="$ext_dir" SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here/stub" "$py" -W ignore -c '
import importlib.util
if importlib.util.find_spec("sglang.srt.mem_cache.cpp_utils.native_hash") is None:
    print("none to build (no sglang.srt.mem_cache.cpp_utils.native_hash)")
else:
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module
    print("built:", _load_native_hash_module().__file__)
' 2>&1); then
  echo "$ext_out" | tail -8 >&2
  fail "building sglang's HiCache hash extension failed (output above; needs a C++ compiler and OpenSSL headers: apt-get install g++ libssl-dev)"
fi
echo "  $(echo "$ext_out" | tail -1)"

# What ran and what it cost: read by repro (env.json, COMPARISON.md, REPORT.md name the release and its kind).
gb=$(du -sk "$dir" 2>/dev/null | awk '{printf "%.2f", $1 / 1048576}')
"$py" - "$dir/testbed.json" "$release" "$KIND" "$BASE" "$py" "$(elapsed)" "$gb" "$(echo "$out" | tail -1)" "$installed" <<'PYEOF' || fail "cannot write $dir/testbed.json"
import json, os, sys, time
path, release, kind, base, py, secs, gb, check, installed = sys.argv[1:10]
old = {}
if os.path.isfile(path):
    try:
        old = json.load(open(path))
    except ValueError:
        pass
now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
rec = {"engine": "sglang", "release": release, "kind": kind, "base": base or None, "python": py,
       "setup_s": int(secs), "gb": float(gb), "import_check": check, "set_up_at": now,
       # the run that installed the packages (a re-run that reuses them keeps these)
       "install_run_s": int(secs) if installed == "1" else old.get("install_run_s"),
       "installed_at": now if installed == "1" else old.get("installed_at")}
json.dump(rec, open(path, "w"), indent=1)
PYEOF
printf '%s\n%s\n' "$(want_stamp)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$stamp"
echo "CPU testbed of sglang $release ($KIND${BASE:+ over $BASE}) ready at $dir in $(elapsed) s, ${gb} GB (python: $py)"
