#!/usr/bin/env bash
# The project's test command (README "Running the tests"; CI runs it from .ci/run).
#
#   bash scripts/test.sh [fast|sglang|hang|pd|vllm|release|multihost ...] [-- extra pytest args]
#
# Runs the stages in order — fast (no SGLang server), sglang (real-SGLang tests sharing one healthy TP=2 server),
# hang (tests that deliberately hang their own server), pd (one PD-disaggregation stack: prefill + decode + router),
# vllm (a real vLLM TP=2 server), release (the one old-release server test: #30760 on sglang 0.5.18; its testbed is
# set up first), multihost (root: TP=2 across two namespaced hosts over ssh and a stand-in kubectl,
# scripts/multihost/rig.py) — each as its own pytest session, and prints each stage's
# duration. A stage that collects no tests (pytest exit 5) fails: a marker nobody uses any more must not pass
# silently. Every requested stage runs (so one failure does not hide another); the exit code is the first failing
# stage's.
#
# Start-up (issue 36): the hang, pd, release and multihost stages run with REPRO_FORK_RANKS=1 (the injector forks sglang's
# ranks from the launcher after its imports instead of spawning them: same targets, same process layout, ~25 s less
# to /health per launch on the 2-core box; README "Faster start-up", benchmarks/RESULTS.md "Ranks forked from the
# launcher"), since they launch a server per deadlock. The sglang stage runs with it unset, so the default spawn
# path stays covered; the fast and vllm stages leave the caller's environment as it is (vLLM's ranks are not forked).
# sglang 0.5.18 (the release stage) makes the same `mp.set_start_method("spawn", force=True)` call in
# `engine._set_envs_and_config` (line 1747 of its wheel) that the opt-in switches.
# REPRO_CI_FORK_RANKS=0 runs the hang, pd, release and multihost stages spawned too (for a before/after timing).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

stages=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    fast|sglang|hang|pd|multihost|vllm|release) stages+=("$1"); shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "test.sh: unknown stage '$1' (expected fast, sglang, hang, pd, multihost, vllm, release; pytest args go after --)" >&2; exit 2 ;;
  esac
done
OLD_RELEASE="0.5.18"  # the release stage's testbed (scripts/cpu_testbed/setup.sh --release 0.5.18: ~9 GB, ~7 min fresh)
old_release_dir="${XDG_CACHE_HOME:-$HOME/.cache}/tp-deadlock-repro/testbed/sglang-$OLD_RELEASE"
if [ ${#stages[@]} -eq 0 ]; then
  stages=(fast sglang hang pd vllm)
  # The release stage runs by default where its testbed is already set up (cached, as on CI's machine) or with
  # REPRO_OLD_RELEASES=1; on a fresh machine it is opt-in: `bash scripts/test.sh release` (sets it up) or that variable.
  if [ -f "$old_release_dir/.setup-stamp" ] || [ "${REPRO_OLD_RELEASES:-0}" = 1 ]; then
    stages+=(release)
  else
    echo "test.sh: stage 'release' not run: the sglang $OLD_RELEASE testbed is not set up (~9 GB, ~7 min); opt in with" \
         "REPRO_OLD_RELEASES=1 or 'bash scripts/test.sh release' (both set it up)" >&2
  fi
  stages+=(multihost)
fi

marker() {
  case "$1" in
    fast) echo "not sglang and not hang and not pd and not multihost and not vllm and not release" ;;
    sglang) echo "sglang" ;;
    hang) echo "hang" ;;
    pd) echo "pd" ;;
    vllm) echo "vllm" ;;  # the vLLM testbed (scripts/vllm_testbed/setup.sh) is set up first, below
    release) echo "release" ;;  # the sglang 0.5.18 testbed (setup.sh --release 0.5.18) is set up first, below
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
  if [ "$stage" = release ] && ! bash scripts/cpu_testbed/setup.sh --release "$OLD_RELEASE"; then
    echo "test.sh: the sglang $OLD_RELEASE testbed could not be set up; the release stage's test fails without it" >&2
  fi
  # the fork-ranks opt-in per stage (header): on for the stages that launch a server per deadlock, off for sglang
  case "$stage" in
    hang|pd|release|multihost) stage_env=(env "REPRO_FORK_RANKS=${REPRO_CI_FORK_RANKS:-1}") ;;
    sglang) stage_env=(env -u REPRO_FORK_RANKS) ;;
    *) stage_env=() ;;
  esac
  [ ${#stage_env[@]} -gt 0 ] && echo "test.sh: stage '$stage' runs with: ${stage_env[*]:1}"
  ${stage_env[@]+"${stage_env[@]}"} "$PY" -m pytest -m "$(marker "$stage")" --durations=10 ${extra[@]+"${extra[@]}"}
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
