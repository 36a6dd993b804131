#!/usr/bin/env bash
# sglang#30760 on a GPU box: DEADLOCKED before the fix, ALL REQUESTS SUCCEEDED after, for both scenario variants.
#
#   scripts/run_30760.sh --model PATH [--tp 4] [--before REF] [--after REF] [--python PY] [--variant V]...
#                        [--evidence-dir DIR]
#
# REF: installed | patch:FILE | git:PATH@REV | python:PATH   (see `repro compare --help`)
# Defaults: --tp 4, --before installed, --after patch:scenarios/sglang/patches/sglang-0.5.23-30760-bulk-prefetch.patch
# (that patch is for sglang 0.5.23; for another version pass your fix as --after git:PATH@REV or patch:FILE),
# variants allocatable_drift (the root cause; the run that proves a fix) and extra_collective (the seed's case).
#
# The HiCache file storage goes to a temporary folder removed on exit. The scenario's prompts are 64 tokens, so the
# storage prefetch threshold is lowered to 16 tokens (as the CPU testbed profile does) in a copy of the scenario kept
# next to the evidence; everything else is the scenario as committed.
# Prints the path of each COMPARISON.md; exits 0 iff every comparison matched (else the first non-zero code).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model=""; tp=4; before="installed"; python_opt=()
after="patch:${here}/scenarios/sglang/patches/sglang-0.5.23-30760-bulk-prefetch.patch"
variants=(); evidence="${here}/evidence"
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --before) before="$2"; shift 2 ;;
    --after) after="$2"; shift 2 ;;
    --python) python_opt=(--python "$2"); shift 2 ;;
    --variant) variants+=("$2"); shift 2 ;;
    --evidence-dir) evidence="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$model" ]] || { echo "error: --model PATH is required (the model the server loads)" >&2; exit 2; }
[[ "$tp" =~ ^[0-9]+$ && "$tp" -ge 2 ]] || { echo "error: --tp must be an integer ≥ 2 (got $tp): a desync needs two ranks" >&2; exit 2; }
[[ ${#variants[@]} -gt 0 ]] || variants=(allocatable_drift extra_collective)
command -v repro >/dev/null 2>&1 && repro=(repro) || repro=(python -m repro.cli)

storage="$(mktemp -d -t repro-hicache-gpu-XXXXXX)"
trap 'rm -rf "$storage"' EXIT
export SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR="$storage"

mkdir -p "$evidence/hicache_prefetch_30760"
scenario="$evidence/hicache_prefetch_30760/run_30760-$(date -u +%Y%m%dT%H%M%SZ).toml"
python3 - "$here/scenarios/sglang/hicache_prefetch_30760.toml" "$scenario" <<'EOF'
import re, sys
src, dst = sys.argv[1], sys.argv[2]
text = open(src).read()
extra = ', "--hicache-storage-backend-extra-config", "{\\"prefetch_threshold\\":16}"]'
new, n = re.subn(r'^(args = \[.*)\]\s*$', lambda m: m.group(1) + extra, text, count=1, flags=re.M)
if n != 1:
    sys.exit(f"error: {src}: no one-line `args = [...]` under [server] to extend")
open(dst, "w").write(new)
EOF

rc=0
cd "$here"
for v in "${variants[@]}"; do
  echo "== $v: before=$before after=$after model=$model tp=$tp" >&2
  set +e
  out="$("${repro[@]}" compare "$scenario" --variant "$v" --before "$before" --after "$after" --model "$model" --tp "$tp" \
        "${python_opt[@]}" --evidence-dir "$evidence" --label "gpu-$v" --json)"
  code=$?
  set -e
  path="$(printf '%s' "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["comparison"])' 2>/dev/null || true)"
  if [[ -n "$path" ]]; then echo "$path"; else echo "error: compare of $v gave no comparison (exit $code)" >&2; fi
  [[ $code -eq 0 || $rc -ne 0 ]] || rc=$code
done
exit $rc
