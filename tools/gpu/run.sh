#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU runbook (kind nvidia-h200-x2): one step per device command, each ending well
# inside the 10-minute limit, its files in $OUT (at most 8, directly in $OUT).
#
#   tools/gpu/run.sh install DIR   ~1 min   installs the offline bundle whose parts are in DIR
#                                  (docs/offline-install.md) into $STATE/site; the steps
#                                  after it put that install on PYTHONPATH themselves
#   tools/gpu/run.sh all           <= CMD_LIMIT_S: check, then (unless no GPU / vLLM / plugin
#                                  can load) correctness and bench; follows the bench to the end
#   tools/gpu/run.sh check         ~1-2 min  GPUs, torch, vLLM, NIXL, our plugin + patches,
#                                            model dirs, bench plan, a small GPU floor
#   tools/gpu/run.sh correctness   ~3-5 min  tiny model (real weights): one engine vs push
#                                            1P1D, then TP2 P -> TP1 D; verdict JSON
#   tools/gpu/run.sh floor         ~1-3 min  the GPU floor alone
#   tools/gpu/run.sh bench         starts the benchmark detached (setsid; BUDGET_S long),
#                                  follows it for up to WAIT_S (540 s), copies its files
#   tools/gpu/run.sh bench-wait    follows it again for up to WAIT_S, copies its files
#   tools/gpu/run.sh bench-stop    stops it (SIGTERM: it stops its engines and saves)
#   tools/gpu/run.sh status        what runs, GPU memory, leftover processes of ours
#   tools/gpu/run.sh cleanup       stops leftover engines of earlier steps (by their ids)
#
# Environment:
#   OUT                  where the files that come back go (default ./gpu-out)
#   VLLM_EXT_PYTHONPATH  the PYTHONPATH the install step printed (default: $PYTHONPATH)
#   PYTHON               the host's python3 (default python3)
#   STATE                state kept between commands (default /tmp/vllm-ext-gpu)
#   BUDGET_S             the benchmark's whole run, seconds (default 780)
#   WAIT_S               how long bench / bench-wait follow it (default 540)
#   CMD_LIMIT_S          'all' ends its follow by then (default 570: the device allows 600)
#   CORRECTNESS_BUDGET_S 'all' gives the correctness step this long (default 300)
#   GPUS                 CUDA_VISIBLE_DEVICES of P and of D (default 0,1; 0,0: one GPU shared
#                        by P and D, e.g. on kind nvidia-h200: TP2 is skipped, each engine of
#                        the benchmark gets SHARED_MEMORY_UTILIZATION of the GPU)
#   BENCH_ARGS           more arguments for python -m devkit.bench.gpu; without --modes, the
#                        comparison of the installed vLLM: on a 0.34.0 bundle push-0.34
#                        vllm-push-0.34 single-0.34 (docs/offline-install.md), else
#                        push-0.23 pull-0.23 single-0.23
#   CORRECTNESS_ARGS     more arguments for python -m devkit.bench.correctness
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STEP="${1:-help}"
OUT="${OUT:-$PWD/gpu-out}"
STATE="${STATE:-/tmp/vllm-ext-gpu}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-780}"
WAIT_S="${WAIT_S:-540}"
CMD_LIMIT_S="${CMD_LIMIT_S:-570}"
CORRECTNESS_BUDGET_S="${CORRECTNESS_BUDGET_S:-300}"
T0=$SECONDS
BENCH_ARGS="${BENCH_ARGS:-}"
CORRECTNESS_ARGS="${CORRECTNESS_ARGS:-}"
GPUS="${GPUS:-0,1}"
SHARED_MEMORY_UTILIZATION="${SHARED_MEMORY_UTILIZATION:-0.42}"
MIN_GPUS=2
if [ "${GPUS%%,*}" = "${GPUS##*,}" ]; then  # P and D on one GPU
  MIN_GPUS=1
  BENCH_ARGS="--memory-utilization $SHARED_MEMORY_UTILIZATION $BENCH_ARGS"
fi
BENCH_ARGS="--gpus $GPUS $BENCH_ARGS"
CORRECTNESS_ARGS="--gpus $GPUS $CORRECTNESS_ARGS"

mkdir -p "$OUT" "$STATE/logs" "$STATE/pids"
cd "$REPO" || exit 2

# An install of 'run.sh install' (unless VLLM_EXT_PYTHONPATH names one).
if [ -z "${VLLM_EXT_PYTHONPATH:-}" ] && [ -f "$STATE/site/bundle-env.sh" ]; then
  VLLM_EXT_PYTHONPATH="$(PYTHONPATH='' && . "$STATE/site/bundle-env.sh" && echo "$PYTHONPATH")"
fi
# This checkout first (the tools and the plugin as committed here), then the install.
export PYTHONPATH="$REPO${VLLM_EXT_PYTHONPATH:+:$VLLM_EXT_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# No network on the GPU hosts: never try a hub, never phone home.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Multicast (NVLS) off in every process; FlashInfer is not installed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_USE_FLASHINFER_SAMPLER=0
# Model directories are built once per machine; engines we start are listed for cleanup.
export VLLM_EXT_CACHE="$STATE/cache"
export VLLM_EXT_PID_DIR="$STATE/pids"

say() { echo "[run.sh $(date +%H:%M:%S)] $*"; }

# vLLM loads our connector through the vllm.general_plugins entry point; where the
# project is only on PYTHONPATH (not pip-installed), declare it in a minimal dist-info.
SHIM="$("$PY" -m devkit.bench.hostcheck --plugin-shim "$STATE/plugin-shim" 2>/dev/null)"
if [ -n "$SHIM" ]; then
  export PYTHONPATH="$SHIM:$PYTHONPATH"
  say "no vllm_ext entry point installed: declared one in $SHIM"
fi

# tail of a log into $OUT (the device returns at most 8 files of at most 16 MiB each;
# with ONE_LOG=1, as 'all' sets, every log goes into $OUT/run.log)
keep_tail() {
  if [ "${ONE_LOG:-0}" = 1 ]; then
    { echo "===== $2"; tail -c "${3:-1000000}" "$1" 2>/dev/null; } >>"$OUT/run.log"
  else
    tail -c "${3:-1000000}" "$1" >"$OUT/$2" 2>/dev/null || true
  fi
}

gpu_state() {
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,utilization.gpu \
    --format=csv,noheader 2>&1 | sed 's/^/  gpu: /'
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null |
    sed 's/^/  gpu process: /'
  return 0
}

leftovers() {  # our engines still alive, from their pid files
  local f pid
  for f in "$STATE"/pids/*.pid; do
    [ -e "$f" ] || continue
    pid="$(basename "$f" .pid)"
    if kill -0 "$pid" 2>/dev/null; then echo "$pid $(head -1 "$f")"; else rm -f "$f"; fi
  done
}

cleanup() {
  local pid name
  leftovers | while read -r pid name; do
    say "stopping leftover $name (process group $pid)"
    kill -TERM -- "-$pid" 2>/dev/null
  done
  sleep 5
  leftovers | while read -r pid name; do
    kill -KILL -- "-$pid" 2>/dev/null
    rm -f "$STATE/pids/$pid.pid"
  done
}

bench_pid() { [ -f "$STATE/bench.pid" ] && cat "$STATE/bench.pid"; }
bench_running() { local p; p="$(bench_pid)" && [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

before_gpu_step() {
  if bench_running; then
    say "the benchmark is running (pid $(bench_pid)); wait for it or run bench-stop first"
    exit 3
  fi
  if [ -n "$(leftovers)" ]; then
    say "leftover engines of an earlier step hold GPU memory; stopping them"
    cleanup
  fi
}

bench_follow() {
  local run pid lines n_new
  run="$(readlink -f "$STATE/bench-current")"
  pid="$(bench_pid)"
  lines="$(cat "$STATE/bench.lines" 2>/dev/null || echo 0)"
  say "following $run (pid $pid) for up to ${WAIT_S}s"
  # new progress lines as they come, until the run ends or WAIT_S passes
  timeout "$WAIT_S" tail -n "+$((lines + 1))" -F --pid="$pid" "$run/progress.log" 2>/dev/null
  n_new="$(wc -l <"$run/progress.log")"
  echo "$n_new" >"$STATE/bench.lines"
  # shellcheck disable=SC2086
  "$PY" -m devkit.bench.gpu --collect "$run" --to "$OUT" ${COLLECT_ONLY:+--only $COLLECT_ONLY} \
    >/dev/null
  if kill -0 "$pid" 2>/dev/null; then
    say "still running; files so far are in \$OUT. Next: tools/gpu/run.sh bench-wait"
  else
    say "finished (exit $(cat "$run/exit_code" 2>/dev/null || echo '?')); files in \$OUT:"
    ls -la "$OUT"
  fi
}

step_check() {
  say "python $($PY -c 'import sys; print(sys.version.split()[0])'); PYTHONPATH=$PYTHONPATH"
  gpu_state
  nvidia-smi topo -m 2>&1 | head -8
  timeout -k 20 300 "$PY" -m devkit.bench.hostcheck --device cuda --min-gpus "$MIN_GPUS" \
    --out "$OUT/check.json" \
    2>&1 | tee "$STATE/logs/check.log" | grep --line-buffered '^\[check\]'
  rc=${PIPESTATUS[0]}
  CHECK_RC=$rc
  say "GPU floor smoke test (2k tokens, per-layer contiguous, 2 repeats)"
  timeout -k 20 240 "$PY" -m devkit.bench.floor --device cuda --input-lens 2048 \
    --repeats 2 --layouts per-layer --placements contiguous --no-peer-copy --gpus "$GPUS" \
    --json-out "$STATE/floor-smoke.json" >"$STATE/logs/floor-smoke.log" 2>&1
  frc=$?
  grep '^floor' "$STATE/logs/floor-smoke.log" | tail -5
  keep_tail "$STATE/logs/check.log" check.log
  keep_tail "$STATE/logs/floor-smoke.log" floor-smoke.log 200000
  say "check exit $rc, floor smoke exit $frc"
  [ "$rc" = 0 ] && [ "$frc" = 0 ]
}

step_correctness() {  # $1: the check's budget in seconds
  local budget="$1" run rc f
  before_gpu_step
  run="$STATE/correctness-$(date +%H%M%S)"
  # shellcheck disable=SC2086
  timeout -k 30 "$((budget + 60))" "$PY" -m devkit.bench.correctness --device cuda \
    --budget-s "$budget" --out "$OUT/correctness.json" --run-dir "$run" $CORRECTNESS_ARGS 2>&1 |
    tee "$STATE/logs/correctness.log" | grep --line-buffered -v 'waiting for'
  rc=${PIPESTATUS[0]}
  keep_tail "$STATE/logs/correctness.log" correctness.log
  for f in "$run"/*/*.log; do
    [ -e "$f" ] && { echo "===== $f"; tail -n 80 "$f"; }
  done >"$STATE/logs/correctness-engines.txt" 2>/dev/null
  keep_tail "$STATE/logs/correctness-engines.txt" correctness-engines-tail.txt 3000000
  say "correctness exit $rc"
  return "$rc"
}

step_bench_start() {
  if bench_running; then
    say "already running"
    return 0
  fi
  before_gpu_step
  local run
  run="$STATE/bench-$(date +%Y%m%d-%H%M%S)"
  mkdir -p "$run"
  ln -sfn "$run" "$STATE/bench-current"
  echo 0 >"$STATE/bench.lines"
  rm -f "$STATE/bench.pid"
  # its own session (survives this command); the pid file names the session leader
  # shellcheck disable=SC2016,SC2086
  setsid nohup bash -c 'echo $$ >"$1"; code="$2"; shift 2; "$@"; echo $? >"$code"' bench \
    "$STATE/bench.pid" "$run/exit_code" \
    "$PY" -m devkit.bench.gpu --out "$run" --budget-s "$BUDGET_S" $BENCH_ARGS \
    >"$run/progress.log" 2>&1 </dev/null &
  for _ in $(seq 50); do [ -s "$STATE/bench.pid" ] && break; sleep 0.1; done
  say "benchmark started: pid $(bench_pid), budget ${BUDGET_S}s, run folder $run"
  sleep 2
}

case "$STEP" in
  install)
    [ -f "${2:-}/install.py" ] || { say "usage: run.sh install DIR (DIR/install.py and parts)"; exit 2; }
    "$PY" "$2/install.py" install --parts "$2" --target "$STATE/site" --no-compile 2>&1 |
      tee "$STATE/logs/install.log" | tail -n 30
    rc=${PIPESTATUS[0]}
    keep_tail "$STATE/logs/install.log" install.log
    say "install exit $rc; PYTHONPATH of the later steps: $(PYTHONPATH='' &&
      . "$STATE/site/bundle-env.sh" 2>/dev/null && echo "$PYTHONPATH")"
    exit "$rc"
    ;;
  all)
    # one command: fewer round trips, and the machine never idles between steps;
    # files: check.json, correctness.json, run.log, and the bench's results so far
    export ONE_LOG=1 COLLECT_ONLY="results.json report.md"
    step_check
    if [ "$CHECK_RC" = 2 ]; then  # no GPUs, no vLLM or no vllm_ext: nothing can run
      say "the check failed fatally: stopping here (see check.json)"
      exit 1
    elif [ "$CHECK_RC" != 0 ]; then
      say "the check found problems (see check.json); going on: some modes may fail"
    fi
    step_correctness "$CORRECTNESS_BUDGET_S"
    step_bench_start
    WAIT_S=$((CMD_LIMIT_S - (SECONDS - T0)))
    [ "$WAIT_S" -lt 10 ] && WAIT_S=10
    bench_follow
    ;;
  check)
    step_check
    ;;
  correctness)
    step_correctness 480
    ;;
  floor)
    before_gpu_step
    timeout -k 20 420 "$PY" -m devkit.bench.floor --device cuda --gpus "$GPUS" \
      --json-out "$OUT/floor.json" \
      2>&1 | tee "$STATE/logs/floor.log" | grep --line-buffered '^floor'
    rc=${PIPESTATUS[0]}
    keep_tail "$STATE/logs/floor.log" floor.log
    exit "$rc"
    ;;
  bench)
    step_bench_start
    bench_follow
    ;;
  bench-wait)
    [ -e "$STATE/bench-current" ] || { say "no benchmark was started"; exit 2; }
    bench_follow
    ;;
  bench-stop)
    if bench_running; then
      pid="$(bench_pid)"
      say "stopping the benchmark (session $pid): it saves, then stops its engines"
      kill -TERM -- "-$pid" 2>/dev/null
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
    fi
    cleanup
    [ -e "$STATE/bench-current" ] && "$PY" -m devkit.bench.gpu \
      --collect "$(readlink -f "$STATE/bench-current")" --to "$OUT" >/dev/null
    ;;
  status)
    gpu_state
    bench_running && say "benchmark running: pid $(bench_pid), $(readlink -f "$STATE/bench-current")"
    say "our processes alive:"
    leftovers
    ;;
  cleanup)
    cleanup
    gpu_state
    ;;
  *)
    sed -n '3,39p' "$0"
    exit 2
    ;;
esac
