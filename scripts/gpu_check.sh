#!/usr/bin/env bash
# cotrain's GPU check: one command on a GPU machine without network, under 7 minutes.
#
#   bash scripts/gpu_wheels.sh                     # first, on a machine with the package index
#   OUT=/some/dir bash scripts/gpu_check.sh        # then on the GPU machine (results in $OUT, default ./gpu_check_out)
#   bash scripts/gpu_check.sh --dry-run            # the stages, their time limits and what travels; runs nothing
#
# It runs from the checkout (cotrain is not pip-installed: its requires-python and torch pin are the CPU
# environment's): PYTHONPATH = the wheels installed into a temporary folder + the repository, on the
# machine's own torch, Python 3.11 or 3.12. It installs only from .whl/ (pip --no-index --no-deps
# --target; scripts/gpu_wheels.txt says which and why) and never from an index.
#
# Stages (each under a time limit, capped by what is left of the budget; a failing stage does not stop
# the later ones; the required ones all count; exit status 0 only if every required stage passed):
#   env            nvidia-smi, Python (3.11 / 3.12), torch with CUDA
#   wheels         scripts/gpu_wheels.txt's wheels not already installed at their version -> a temp --target
#   imports        every tests/gpu file and GPU measurement imports (scripts/gpu_imports.py); versions;
#                  which optional packages are present (flash-attn, transformer-engine, vllm, ray)
#   pytest-gpu     pytest tests/gpu (per-test timeout; results in summary.json)
#   cotrain-step   (a) bench/gpu_cotrain_step.py: a Qwen3-0.6B-shaped co-training step, DFlash and EAGLE-3
#   verify-cost    (b) bench/gpu_verify_cost.py: verification round (k+1 positions) vs a decode step, batch 1..256
#   cp-attention   (c) bench/cp_attention.py --device cuda: packed zigzag vs padded USP, CP=2/4/8 on one GPU
#   tapchannel     (d) bench/tapchannel.py --device cuda: cuda_ipc tap bandwidth and the reader's wait
#   pytest-heavy   only where vllm and ray import (never installed): pytest -m gpu over the rest of tests/
#
# Output ($OUT, at most 8 files, each <= 16 MiB): summary.json (stages, environment, imports, every
# test's outcome, where each measurement went), gpu_check.log, and the measurements' JSON (+ PNG while
# slots last); anything else stays in the work folder, named in summary.json.
#
# Environment: OUT, PYTHON (default python3), WHEEL_DIR (default .whl), GPU_WHEELS_LIST (the list the
# wheels stage installs, default scripts/gpu_wheels.txt; tests use their own), GPU_CHECK_BUDGET_S (default
# 405: stages that would start after it are skipped, which fails the check), COTRAIN_CACHE (default:
# .whl/cache when gpu_wheels.sh put the built tiny model there, copied to a temp folder).
set -u

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument $1 (allowed: --dry-run, --help)" >&2; exit 2 ;;
esac
WHEEL_DIR=${WHEEL_DIR:-.whl}
WHEEL_LIST=${GPU_WHEELS_LIST:-scripts/gpu_wheels.txt}
BUDGET=${GPU_CHECK_BUDGET_S:-405}
PY=${PYTHON:-python3}
MAX_FILES=8
MAX_FILE_BYTES=$(( 16 * 1048576 ))

# name:limit_s:kind:function:note  (kind: required | heavy = only where its packages import)
PLAN=(
  "env:30:required:st_env:nvidia-smi, Python, torch + CUDA"
  "wheels:60:required:st_wheels:$WHEEL_DIR -> pip --no-index --no-deps --target"
  "imports:90:required:st_imports:tests/gpu + measurements, scripts/gpu_imports.py"
  "pytest-gpu:210:required:st_pytest_gpu:pytest tests/gpu, per-test timeout 180 s (fixtures included)"
  "cotrain-step:110:required:st_cotrain_step:(a) bench/gpu_cotrain_step.py"
  "verify-cost:60:required:st_verify_cost:(b) bench/gpu_verify_cost.py"
  "cp-attention:60:required:st_cp_attention:(c) bench/cp_attention.py --device cuda"
  "tapchannel:45:required:st_tapchannel:(d) bench/tapchannel.py --device cuda"
  "pytest-heavy:240:heavy:st_pytest_heavy:pytest -m gpu tests --ignore=tests/gpu (vllm + ray present)"
)

if (( DRY )); then
  echo "cotrain GPU check, dry run: budget ${BUDGET}s, Python \$PYTHON or python3, wheels from $WHEEL_DIR"
  printf '%-14s %7s  %-9s %s\n' stage limit_s kind what
  for entry in "${PLAN[@]}"; do
    IFS=: read -r name limit kind fn note <<<"$entry"
    printf '%-14s %7s  %-9s %s\n' "$name" "$limit" "$kind" "$note"
  done
  total=0
  for entry in "${PLAN[@]}"; do IFS=: read -r name limit kind fn note <<<"$entry"; [[ $kind == required ]] && total=$((total + limit)); done
  echo "required stages' limits sum to ${total}s; each is capped by what is left of the ${BUDGET}s budget"
  echo "wheels listed (scripts/gpu_wheels.txt): $(bash scripts/gpu_wheels.sh --list | tr '\n' ' ')"
  missing=0
  while read -r req; do
    stem=$(echo "${req%%==*}-${req##*==}" | tr 'A-Z.-' 'a-z__')
    ls "$WHEEL_DIR" 2>/dev/null | tr 'A-Z.-' 'a-z__' | grep -q "^${stem}_" || { echo "  no wheel in $WHEEL_DIR for $req"; missing=1; }
  done < <(bash scripts/gpu_wheels.sh --list)
  (( missing )) && echo "  (run scripts/gpu_wheels.sh where the package index is reachable)"
  [[ -d "$WHEEL_DIR/cache" ]] && echo "model cache carried: $(ls "$WHEEL_DIR/cache" | tr '\n' ' ')"
  bash scripts/gpu_wheels.sh --size
  exit $?
fi

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
SITE="$WORK/site"
mkdir -p "$SITE"
T_START=$(date +%s)
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${COTRAIN_CACHE:-}" && -d "$WHEEL_DIR/cache" ]]; then  # the built tiny model, carried (writable copy)
  cp -r "$WHEEL_DIR/cache" "$WORK/cache" && export COTRAIN_CACHE="$WORK/cache"
fi
export OUT WORK SITE ROOT PY WHEEL_DIR WHEEL_LIST

NAMES=() STATUS=() SECS=() NOTES=() LIMITS=() KINDS=()
now() { date +%s; }
elapsed() { echo $(( $(now) - T_START )); }
record() { NAMES+=("$1"); STATUS+=("$2"); SECS+=("$3"); NOTES+=("$4"); LIMITS+=("$5"); KINDS+=("$6"); }

# run_stage NAME LIMIT KIND FUNCTION NOTE: FUNCTION in a child bash under a timeout capped by the budget
run_stage() {
  local name=$1 limit=$2 kind=$3 fn=$4 note=$5
  local left=$(( BUDGET - $(elapsed) - 10 ))
  if (( left < 15 )); then
    echo "==== [$(date +%T)] $name: SKIPPED (time budget of ${BUDGET}s used up)"
    record "$name" "SKIPPED" 0 "time budget used up; $note" "$limit" "$kind"
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "==== [$(date +%T)] $name (limit ${limit}s, $(elapsed)s elapsed): $note"
  local t0 rc dt
  t0=$(now)
  timeout --kill-after=15 "$limit" bash -c "$fn" < /dev/null
  rc=$?
  dt=$(( $(now) - t0 ))
  if (( rc == 0 )); then
    record "$name" "ok" "$dt" "$note" "$limit" "$kind"
  elif (( rc == 124 || rc == 137 )); then
    record "$name" "TIMEOUT" "$dt" "after ${limit}s; $note" "$limit" "$kind"
  else
    record "$name" "FAILED($rc)" "$dt" "$note" "$limit" "$kind"
  fi
  echo "==== [$(date +%T)] $name: ${STATUS[-1]} in ${dt}s"
}

# --------------------------------------------------------------------------------------- stages
st_env() {
  nvidia-smi || return 1
  "$PY" - <<'PY'
import json, os, platform, sys
assert sys.version_info[:2] in ((3, 11), (3, 12)), f"Python {sys.version}: the check runs on 3.11 or 3.12"
import torch
info = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.node(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if torch.cuda.is_available() else None}
print(json.dumps(info, indent=1))
json.dump(info, open(os.path.join(os.environ["WORK"], "env.json"), "w"), indent=1)
assert torch.cuda.is_available(), "CUDA is not available to torch"
PY
}

st_wheels() {
  # the listed wheels not already installed at their pinned version, and compatible with this Python
  "$PY" - "$WHEEL_LIST" "$WHEEL_DIR" "$WORK/wheels.txt" <<'PY' || return 1
import glob, os, re, sys
from importlib import metadata
try:
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
listing, folder, dest = sys.argv[1:]
supported = set(sys_tags())
wheels = {}
for f in glob.glob(os.path.join(folder, "*.whl")):
    name, version, _, tags = parse_wheel_filename(os.path.basename(f))
    if tags & supported:
        wheels[(canonicalize_name(name), str(version))] = f
install, missing = [], []
for line in open(listing):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have == version:
        print(f"{name}=={version}: already installed")
        continue
    f = wheels.get((canonicalize_name(name), version))
    if f is None:
        missing.append(f"{name}=={version}")
    else:
        print(f"{name}=={version}: {os.path.basename(f)}" + (f" (shadows the installed {have})" if have else ""))
        install.append(f)
open(dest, "w").write("\n".join(install) + ("\n" if install else ""))
if missing:
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    sys.exit(f"no wheel for this Python ({py}) in {folder}: {', '.join(missing)} (run scripts/gpu_wheels.sh --python {py} "
             "on a machine with the package index)")
PY
  [[ -s "$WORK/wheels.txt" ]] || return 0
  if "$PY" -m pip --version >/dev/null 2>&1; then
    xargs -a "$WORK/wheels.txt" "$PY" -m pip install -q --no-index --no-deps --target "$SITE" || return 1
  else  # no pip in this interpreter: a wheel is a zip of what goes on sys.path
    echo "no pip here: unpacking the wheels into $SITE"
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(f.strip()).extractall(sys.argv[1]) for f in open(sys.argv[2]) if f.strip()]" \
      "$SITE" "$WORK/wheels.txt" || return 1
  fi
  ls "$SITE"
}

st_imports() {
  "$PY" scripts/gpu_imports.py --gpu-check --json "$WORK/imports.json" > "$WORK/imports.out" || return 1
  "$PY" - <<'PY'
import importlib, json, os
work = os.environ["WORK"]
res = json.load(open(os.path.join(work, "imports.json")))
optional = {}
for mod in ("flash_attn", "transformer_engine.pytorch", "vllm", "ray", "apex"):
    try:
        m = importlib.import_module(mod)
        optional[mod.split(".")[0]] = getattr(m, "__version__", "present")
    except Exception as e:  # noqa: BLE001 - absent, or present and broken: both are facts
        optional[mod.split(".")[0]] = None if isinstance(e, ModuleNotFoundError) else f"broken: {type(e).__name__}: {e}"[:200]
res["versions"] = {}
for mod in ("torch", "megatron.core", "pydantic", "transformers"):
    try:
        res["versions"][mod] = importlib.import_module(mod).__version__
    except Exception as e:  # noqa: BLE001 - the import errors above say why
        res["versions"][mod] = f"does not import: {type(e).__name__}: {e}"[:200]
res["optional"] = optional
# the machine's description (scripts/gpu_machine.txt) against what is installed: None = listed, absent
from importlib import metadata
res["machine_list"] = {}
for line in open(os.path.join(os.environ["ROOT"], "scripts", "gpu_machine.txt")):
    name = line.split("#", 1)[0].strip().split("==")[0].strip()
    if name:
        try:
            res["machine_list"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            res["machine_list"][name] = None
json.dump(res, open(os.path.join(work, "imports.json"), "w"), indent=1)
print(json.dumps({k: res[k] for k in ("errors", "skipped", "outside", "versions", "optional", "machine_list")}, indent=1))
if res["outside"]:
    print(f"note: loaded here but in neither scripts/gpu_wheels.txt nor scripts/gpu_machine.txt: {res['outside']}")
raise SystemExit(1 if res["errors"] else 0)
PY
}

pytest_json() {  # junit XML -> [{test, outcome, seconds, message}]
  "$PY" - "$1" "$2" <<'PY'
import json, sys, xml.etree.ElementTree as ET
cases = []
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome, msg = "passed", ""
    for tag in ("failure", "error", "skipped"):
        el = tc.find(tag)
        if el is not None:
            outcome, msg = tag, (el.get("message") or "")[:500]
            break
    cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                  "seconds": float(tc.get("time") or 0), "message": msg})
json.dump(cases, open(sys.argv[2], "w"), indent=1)
PY
}

st_pytest_gpu() {
  "$PY" -m pytest tests/gpu -p no:cacheprovider -q -rA --timeout 180 --junitxml="$WORK/pytest-gpu.xml" \
    > "$WORK/pytest-gpu.txt" 2>&1
  local rc=$?
  tail -n 80 "$WORK/pytest-gpu.txt"
  [[ -f "$WORK/pytest-gpu.xml" ]] && pytest_json "$WORK/pytest-gpu.xml" "$WORK/pytest-gpu.json"
  (( rc == 0 )) || return $rc  # 5 = nothing collected: a failure too
  # every test skipped (CUDA invisible to pytest, say) is not a pass
  "$PY" -c "import json, sys; c = json.load(open(sys.argv[1])); sys.exit(0 if any(t['outcome'] == 'passed' for t in c) else \
'pytest-gpu: no test passed (all skipped)')" "$WORK/pytest-gpu.json"
}

st_pytest_heavy() {
  "$PY" -m pytest -m gpu tests --ignore=tests/gpu -p no:cacheprovider -q -rA --timeout 200 \
    --junitxml="$WORK/pytest-heavy.xml" > "$WORK/pytest-heavy.txt" 2>&1
  local rc=$?
  tail -n 60 "$WORK/pytest-heavy.txt"
  [[ -f "$WORK/pytest-heavy.xml" ]] && pytest_json "$WORK/pytest-heavy.xml" "$WORK/pytest-heavy.json"
  return $rc
}

# bench_stage SCRIPT NAME [ARGS...]: a measurement with the agreed interface --device cuda --out DIR
bench_stage() {
  local script=$1 name=$2
  shift 2
  [[ -f "$script" ]] || { echo "$script does not exist"; return 1; }
  grep -q -- '"--device"' "$script" || { echo "$script has no --device option"; return 1; }  # (no import: --help costs seconds)
  mkdir -p "$WORK/bench/$name"
  "$PY" "$script" --device cuda --out "$WORK/bench/$name" "$@"
}
st_cotrain_step() { bench_stage bench/gpu_cotrain_step.py cotrain_step; }
st_verify_cost() { bench_stage bench/gpu_verify_cost.py verify_cost; }
st_cp_attention() { bench_stage bench/cp_attention.py cp_attention; }
st_tapchannel() { bench_stage bench/tapchannel.py tapchannel; }
export -f st_env st_wheels st_imports st_pytest_gpu st_pytest_heavy pytest_json bench_stage \
  st_cotrain_step st_verify_cost st_cp_attention st_tapchannel

# --------------------------------------------------------------------------------------- run
echo "cotrain GPU check: $(date -Is), output in $OUT, work folder $WORK, budget ${BUDGET}s"
for entry in "${PLAN[@]}"; do
  IFS=: read -r name limit kind fn note <<<"$entry"
  if [[ "$kind" == heavy ]]; then
    present=$("$PY" -c "import json; o = json.load(open('$WORK/imports.json')).get('optional', {}); \
print(int(all(isinstance(o.get(m), str) and not o[m].startswith('broken') for m in ('vllm', 'ray'))))" 2>/dev/null || echo 0)
    if [[ "$present" != 1 ]]; then
      record "$name" "absent" 0 "vllm or ray does not import here (detected, never installed)" "$limit" "$kind"
      echo "==== $name: not run (vllm or ray does not import here)"
      continue
    fi
  fi
  run_stage "$name" "$limit" "$kind" "$fn" "$note"
done

# --------------------------------------------------------------------------------------- summary
echo
echo "==== summary ($(elapsed)s of ${BUDGET}s; log $LOG)"
printf '%-14s %-11s %7s  %s\n' stage status seconds note
fails=0
for i in "${!NAMES[@]}"; do
  printf '%-14s %-11s %7s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${NOTES[$i]}"
  if [[ "${KINDS[$i]}" == required && "${STATUS[$i]}" != ok ]] || [[ "${STATUS[$i]}" == FAILED* || "${STATUS[$i]}" == TIMEOUT ]]; then
    fails=$((fails + 1))
  fi
done
STAGES_TSV="$WORK/stages.tsv"
: > "$STAGES_TSV"
for i in "${!NAMES[@]}"; do
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${LIMITS[$i]}" "${KINDS[$i]}" \
    "${NOTES[$i]}" >> "$STAGES_TSV"
done
export SECONDS_TOTAL=$(elapsed) BUDGET FAILS=$fails MAX_FILES MAX_FILE_BYTES
"$PY" - <<'PY' || printf '{"error": "the summary could not be written by %s", "failed_stages": %s}\n' "$PY" "$fails" > "$OUT/summary.json"
import collections, datetime, glob, json, os, shutil
work, out = os.environ["WORK"], os.environ["OUT"]
def load(name):
    p = os.path.join(work, name)
    return json.load(open(p)) if os.path.exists(p) else None
stages = []
for line in open(os.path.join(work, "stages.tsv")):
    name, status, secs, limit, kind, note = line.rstrip("\n").split("\t")
    stages.append({"stage": name, "status": status, "seconds": int(secs), "limit_s": int(limit), "kind": kind, "note": note})
summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "seconds": int(os.environ["SECONDS_TOTAL"]), "budget_s": int(os.environ["BUDGET"]),
           "passed": int(os.environ["FAILS"]) == 0, "stages": stages, "env": load("env.json")}
imp = load("imports.json")
if imp:
    summary["imports"] = {k: imp.get(k) for k in ("errors", "skipped", "outside", "versions", "optional", "machine_list",
                                                  "packages")}
for kind in ("gpu", "heavy"):
    cases = load(f"pytest-{kind}.json")
    if cases is not None:
        summary[f"pytest_{kind}"] = {"counts": dict(collections.Counter(c["outcome"] for c in cases)), "tests": cases}
# measurements: their JSON first, then PNGs, while the output folder has room (8 files, 16 MiB each)
produced = sorted(glob.glob(os.path.join(work, "bench", "*", "*")), key=lambda p: (not p.endswith(".json"), p))
room = int(os.environ["MAX_FILES"]) - 2  # summary.json and gpu_check.log
summary["measurements"], summary["left_in_work_folder"] = {}, []
for p in produced:
    name = f"{os.path.basename(os.path.dirname(p))}__{os.path.basename(p)}"
    if room > 0 and os.path.getsize(p) <= int(os.environ["MAX_FILE_BYTES"]):
        shutil.copy(p, os.path.join(out, name))
        summary["measurements"][name] = os.path.getsize(p)
        room -= 1
    else:
        summary["left_in_work_folder"].append(p)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
for kind in ("gpu", "heavy"):
    s = summary.get(f"pytest_{kind}")
    if s:
        print(f"pytest {kind}: {s['counts']}")
        for c in s["tests"]:
            if c["outcome"] != "passed":
                print(f"  {c['outcome']:8s} {c['test']}: {c['message'][:160]}")
print("measurements in", out, ":", ", ".join(summary["measurements"]) or "none",
      ("; left in " + work + ": " + ", ".join(map(os.path.basename, summary["left_in_work_folder"])))
      if summary["left_in_work_folder"] else "")
PY
rm -rf "$SITE" "$WORK/cache"  # the installed wheels and the model copy; the rest of $WORK stays, named in summary.json
echo "results: $OUT ($(ls "$OUT" | wc -l) files); $fails required stage(s) not ok"
exec 1>&- 2>&-  # tee sees the end of its input and finishes the log before the script exits
wait "$TEE_PID" 2>/dev/null || sleep 1
exit $(( fails > 0 ))
