#!/usr/bin/env bash
# The project's test command (README "Running the tests"; CI runs it from .ci/run).
#
#   bash scripts/test.sh [fast|sglang|hang|pd|vllm|multihost ...] [-- extra pytest args]
#
# Runs the stages in order — fast (no SGLang server), sglang (real-SGLang tests sharing one healthy TP=2 server),
# hang (tests that deliberately hang their own server), pd (one PD-disaggregation stack: prefill + decode + router),
# vllm (a real vLLM TP=2 server), multihost (root: TP=2 across two namespaced hosts over ssh and a stand-in kubectl,
# scripts/multihost/rig.py) — each as its own pytest session, and prints each stage's
# duration. A stage that collects no tests (pytest exit 5) fails: a marker nobody uses any more must not pass
# silently. Every requested stage runs (so one failure does not hide another); the exit code is the first failing
# stage's.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

stages=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    fast|sglang|hang|pd|multihost|vllm) stages+=("$1"); shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "test.sh: unknown stage '$1' (expected fast, sglang, hang, pd, multihost, vllm; pytest args go after --)" >&2; exit 2 ;;
  esac
done
[ ${#stages[@]} -eq 0 ] && stages=(fast sglang hang pd vllm multihost)

marker() {
  case "$1" in
    fast) echo "not sglang and not hang and not pd and not multihost and not vllm" ;;
    sglang) echo "sglang" ;;
    hang) echo "hang" ;;
    pd) echo "pd" ;;
    vllm) echo "vllm" ;;  # the vLLM testbed (scripts/vllm_testbed/setup.sh) is set up first, below
    multihost) echo "multihost" ;;
  esac
}

summary=()
first_rc=0
total0=$(date +%s)
for stage in "${stages[@]}"; do
  echo "=== test stage '$stage': pytest -m \"$(marker "$stage")\" ==="
  t0=$(date +%s)
  if [ "$stage" = vllm ] && ! bash scripts/vllm_testbed/setup.sh; then
    echo "test.sh: the vLLM testbed could not be set up; the vllm stage's test fails without it" >&2
  fi
  "$PY" -m pytest -m "$(marker "$stage")" --durations=10 "${extra[@]}"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  summary+=("$(printf '%-7s %5d s  exit %d  load %s' "$stage" "$dt" "$rc" "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)")")
  # what else uses the box after this stage (a leaked server or spinning rank slows every later stage)
  # (zombies left out: dead, unreaped by a container init that does not reap; they use no CPU, only a pid each)
  echo "=== after stage '$stage': load $(cat /proc/loadavg 2>/dev/null); busiest live processes," \
       "$(ps -eo stat= 2>/dev/null | grep -c '^Z') zombies ==="
  ps -eo pid,stat,pcpu,etimes,args --sort=-pcpu 2>/dev/null | awk 'NR == 1 || $2 !~ /^Z/' | head -6 | cut -c1-200
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: stage '$stage' collected no tests (pytest exit 5): that is a failure" >&2
  fi
  if [ "$rc" -ne 0 ] && [ "$first_rc" -eq 0 ]; then
    first_rc=$rc
  fi
done
printf '%s\n' "=== test durations ===" "${summary[@]}" "$(printf 'total   %5d s' $(( $(date +%s) - total0 )))"
exit "$first_rc"
