#!/usr/bin/env bash
# EvoCUA's cold start on the real desktop, end to end on this machine: synthesize office tasks on the Xvfb desktop,
# replay their references with hindsight thoughts, start a desktop server, then `--config=evocua_desktop_cpu`
# fine-tunes a fresh small policy on the training tasks' traces and evaluates it on that server (training and
# held-out tasks). Needs the desktop packages (bash .ci/setup_desktop.sh).
#
#   bash benchmarks/evocua_desktop_policy.sh OUTDIR [COUNT [SEED [--config.KEY=VALUE ...]]]
# COUNT tasks (default 16) from SEED (default 0). OUTDIR gets tasks/, coldstart/ (traces and their inspector
# page), run/ (the recipe's workdir: report.md, eval_base.json, each evaluation's inspector page) and log.txt.
# A rerun with the same OUTDIR keeps what is done: the tasks and traces are not made again and the recipe
# resumes at its first unfinished stage. The desktop server listens on port 5000 (EVOCUA_DESKTOP_PORT).
set -euo pipefail
OUT=${1:?usage: evocua_desktop_policy.sh OUTDIR [COUNT [SEED [--config.KEY=VALUE ...]]]}
COUNT=${2:-16}
SEED=${3:-0}
shift $(( $# < 3 ? $# : 3 ))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=$(cd "$ROOT/.." && pwd)/shared/osworld
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log.txt"
cd "$ROOT"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

HELD_OUT=()
[ -d "$SHARED" ] && HELD_OUT=(--held_out="$SHARED")  # decontaminate against the OSWorld tasks when beside the repo
if [ ! -d "$OUT/tasks/examples" ]; then
  say "synthesis: $COUNT office tasks, seed $SEED"
  python -m guijax.evocua.office_synthesis --out="$OUT/tasks.partial" --count="$COUNT" --seed="$SEED" \
    "${HELD_OUT[@]}" 2>&1 | tee -a "$LOG"
  mv "$OUT/tasks.partial" "$OUT/tasks"
fi
if [ ! -f "$OUT/coldstart/coldstart.json" ]; then
  say "cold start: the references replayed on the desktop"
  python -m guijax.evocua.office_coldstart --tasks="$OUT/tasks" --out="$OUT/coldstart" 2>&1 | tee -a "$LOG"
fi

# A fixed port: the server's URL is part of the config the recipe's stages record, so a rerun on another port
# would train again.
PORT=${EVOCUA_DESKTOP_PORT:-5000}
python -c "import socket; socket.socket().bind(('127.0.0.1', $PORT))" 2>/dev/null || {
  say "port $PORT is taken: stop what serves there or set EVOCUA_DESKTOP_PORT"; exit 1; }
say "desktop server on port $PORT"
python -m envs.server --port="$PORT" --no-token --screen=1280x720 >>"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 60); do
  python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/platform', timeout=2)" 2>/dev/null && break
  kill -0 $SERVER 2>/dev/null || { say "the desktop server exited: see $OUT/server.log"; exit 1; }
  sleep 1
done

say "evocua_desktop_cpu: cold start, then evaluation on the desktop"
START=$(date +%s)
python -m guijax.launch --config=evocua_desktop_cpu --workdir="$OUT/run" \
  --config.env.osworld_dir="$OUT/tasks" --config.coldstart.traces_dir="$OUT/coldstart" \
  "--config.env.server_urls=('http://127.0.0.1:$PORT',)" "$@" 2>&1 | tee -a "$LOG"
say "recipe done in $(( $(date +%s) - START )) s"
