#!/bin/bash
# fd-cudagraph-plugin on a real GPU through a torch stand-in for Paddle (benchmarks/gpu/README.md).
# usage, from the project root: bash benchmarks/gpu/run.sh PART...  (setup main pair ctime dispatch fail budget recapture wakeup)
# FastDeploy's backend: FD_HARNESS_FASTDEPLOY_BACKEND=PATH/cudagraph_piecewise_backend.py; unset: skipped.
# Output in $OUT (or /tmp/fdcg_out), rewritten by each call: results.jsonl, summary.txt, stderr.log.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "${FD_HARNESS_REPO:-$HERE/../..}" && pwd)  # the plugin source: the project root
O=${OUT:-/tmp/fdcg_out}
PY=${PYTHON:-python3}
if [ $# -eq 0 ]; then sed -n '2,5p' "$0"; exit 2; fi
PARTS="setup main pair ctime dispatch fail budget recapture wakeup"
# Every part is checked before any runs (or the output is truncated): a typo at the end of a
# long list must not cost the runs before it, nor end in exit 0 with nothing run.
for part in "$@"; do
  known=0
  for p in $PARTS; do [ "$part" = "$p" ] && known=1; done
  [ "$known" = 1 ] || { echo "unknown part '$part' (parts: $PARTS)" >&2; exit 2; }
done
if [ ! -f "$ROOT/fd_cudagraph_plugin/__init__.py" ]; then
  echo "no fd_cudagraph_plugin/ in $ROOT: run from a checkout (or set FD_HARNESS_REPO)"; exit 2
fi
if [ -n "${FD_HARNESS_FASTDEPLOY_BACKEND:-}" ]; then  # relative to where run.sh was called
  FD_HARNESS_FASTDEPLOY_BACKEND=$(realpath -m "$FD_HARNESS_FASTDEPLOY_BACKEND")
  export FD_HARNESS_FASTDEPLOY_BACKEND
  [ -f "$FD_HARNESS_FASTDEPLOY_BACKEND" ] || echo "warning: $FD_HARNESS_FASTDEPLOY_BACKEND: no such file"
  echo "FastDeploy's backend: $FD_HARNESS_FASTDEPLOY_BACKEND"
else
  echo "FD_HARNESS_FASTDEPLOY_BACKEND not set: comparisons with FastDeploy's backend are skipped"
fi
mkdir -p "$O" && O=$(cd "$O" && pwd) && : > "$O/results.jsonl" && : > "$O/stderr.log"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Options of the plugin come from each script; none may leak in from the caller's environment.
for v in $(env | sed -n 's/^\(FD_CUDAGRAPH_[A-Z_]*\)=.*/\1/p'); do echo "unset $v (the scripts set the options they measure)"; unset "$v"; done
[ "${FD_HARNESS_CPU_DRY_RUN:-}" = 1 ] && echo "CPU DRY RUN (FD_HARNESS_CPU_DRY_RUN=1): no CUDA graphs, figures mean nothing"
echo "plugin source: $ROOT; output: $O"

RUNS=0 ERRORED=0 BROKEN=0
run() {  # run SCRIPT TAG ARGS...: one JSON line to results.jsonl, stderr to stderr.log
  local f=$1 tag=$2; shift 2
  echo "### $tag: $f $*" >> "$O/stderr.log"
  local t=$SECONDS before after rc
  before=$(wc -l < "$O/results.jsonl")
  # tqdm's progress bars ("CUDA graphs (decode)") would fill the log: left out.
  "$PY" "$HERE/$f" "$@" --tag "$tag" 2> >(grep -av "CUDA graphs (" >> "$O/stderr.log") \
    | tee -a "$O/results.jsonl" | cut -c1-160
  rc=${PIPESTATUS[0]}
  after=$(wc -l < "$O/results.jsonl")
  RUNS=$((RUNS + 1))
  if [ "$after" -le "$before" ]; then BROKEN=$((BROKEN + 1)); echo "    ($tag: rc=$rc, NO RESULT LINE: see stderr.log)"
  else [ "$rc" = 0 ] || ERRORED=$((ERRORED + 1)); echo "    ($tag: rc=$rc, $((SECONDS - t)) s)"; fi
}

for part in "$@"; do
  echo "== $part"
  t0=$SECONDS
  case $part in
  setup)
    if [ "${FD_HARNESS_CPU_DRY_RUN:-}" != 1 ]; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
    fi
    "$PY" -c "import sys, torch; print('torch', torch.__version__, '| python', sys.version.split()[0], '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" 2>> "$O/stderr.log"
    run harness.py setup_check
    ;;
  main)
    run bench_main.py fd_private --backend fd --latency --cycles 3
    run bench_main.py fd_unique --backend fd --unique-pool --latency --cycles 20
    run bench_main.py plugin_default --backend plugin --latency --cycles 20
    run bench_main.py plugin_graph --backend plugin --pool graph --cycles 3
    run bench_main.py plugin_selfcheck --backend plugin --self-check error --no-correct
    ;;
  pair)
    run bench_pair.py pair_fd_instance --backend fd
    run bench_pair.py pair_fd_shared --backend fd --shared
    run bench_pair.py pair_plugin_default --backend plugin
    run bench_pair.py pair_plugin_graph --backend plugin --pool graph
    ;;
  ctime)
    run bench_ctime.py capture_time --rounds 6
    run bench_ctime.py capture_time_breakdown --rounds 4 --breakdown
    ;;
  dispatch)
    run bench_dispatch.py dispatch_1layer_h256 --layers 1 --hidden 256 --inter 1024
    run bench_dispatch.py dispatch_0layer --layers 0
    ;;
  fail)
    run bench_fail.py fail_fd --backend fd
    run bench_fail.py fail_plugin --backend plugin
    ;;
  budget)
    run bench_budget.py budget
    ;;
  recapture)  # FastDeploy's default and 1 warm-up, the plugin, FD_CUDAGRAPH_FIT; two traces
    run bench_recapture.py recapture --rounds 5 --max-seconds 480 --fastdeploy-warmups 1 \
      --fit graphs:8,padding:10 --traffic skewed,rollout
    ;;
  wakeup)  # each backend in its own process: a stale graph may fault and lose the CUDA context
    run bench_wakeup.py wakeup_fd_nan --backend fd
    run bench_wakeup.py wakeup_plugin_nan --backend plugin
    run bench_wakeup.py wakeup_fd_nofill --backend fd --fill none
    run bench_wakeup.py wakeup_plugin_nofill --backend plugin --fill none
    run bench_wakeup.py wakeup_nosleep_fd_nan --backend fd --no-sleep
    run bench_wakeup.py wakeup_nosleep_plugin_nan --backend plugin --no-sleep
    run bench_wakeup.py wakeup_nosleep_fd_nofill --backend fd --no-sleep --fill none
    ;;
  esac
  echo "== $part: $((SECONDS - t0)) s"
done
if [ "$RUNS" -gt 0 ]; then
  echo "== summary ($RUNS runs; $ERRORED reported errors in their JSON line; $BROKEN gave no result line)"
  "$PY" "$HERE/summary.py" "$O/results.jsonl" | tee "$O/summary.txt"
fi
[ "$BROKEN" = 0 ] && [ "$ERRORED" = 0 ]
