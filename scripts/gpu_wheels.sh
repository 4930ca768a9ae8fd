#!/usr/bin/env bash
# The wheels the GPU check installs on the GPU machine (which has no network): run here, with the
# package index, before the check travels.
#
#   bash scripts/gpu_wheels.sh                  # download scripts/gpu_wheels.txt's wheels (cp312) into .whl/
#   bash scripts/gpu_wheels.sh --python 3.11    # the same for another Python (cp311: a 3.11 GPU machine)
#   bash scripts/gpu_wheels.sh --list           # the pinned requirements, one a line (nothing downloaded)
#   bash scripts/gpu_wheels.sh --size           # the wheels' total size and what travels (repository + wheels)
#   bash scripts/gpu_wheels.sh --no-model       # wheels only (default: also the built tiny model, see below)
#
# What travels to the GPU machine is the working tree (tracked files and untracked files git does not
# ignore) plus the carried folder .whl/: at most 64 MiB in all. Downloads are binary only
# (--only-binary=:all:, --no-deps: the list is the whole closure, checked by tests/scripts/test_gpu_check.py),
# for CPython on manylinux x86-64. Wheels in .whl/ that the list no longer names are removed.
# The built-in tiny model (what the tiny_model_path fixture gives a test; built here on first use, ~2 minutes,
# 3 MiB) is copied to
# .whl/cache/ so the GPU machine does not rebuild it (gpu_check.sh points COTRAIN_CACHE at a copy).
#
# Environment: WHEEL_DIR (default .whl), PYTHON (the interpreter whose pip downloads; default
# .venv/bin/python, else python3).
set -euo pipefail

cd "$(dirname "$0")/.." || exit 2
LIST=scripts/gpu_wheels.txt
WHEEL_DIR=${WHEEL_DIR:-.whl}
LIMIT_MIB=64
PYVER=3.12
MODE=download
MODEL=1
while (( $# )); do
  case $1 in
    --list) MODE=list ;;
    --size) MODE=size ;;
    --python) PYVER=$2; shift ;;
    --no-model) MODEL=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

requirements() {  # the pinned requirements of $LIST, comments and blank lines dropped
  sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$'
}

mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }

tree_bytes() {  # what the device tool copies of the working tree: tracked + untracked, not ignored
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
      | awk '{ s += $1 } END { print s + 0 }'
  else  # a copy without git (the GPU machine): everything but the wheel folder
    find . -path "./$WHEEL_DIR" -prune -o -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'
  fi
}

wheel_bytes() {  # the whole carried folder: wheels and the model cache
  if [[ -d "$WHEEL_DIR" ]]; then find "$WHEEL_DIR" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; else echo 0; fi
}

report_size() {
  local w t n
  w=$(wheel_bytes)
  t=$(tree_bytes)
  n=$(compgen -G "$WHEEL_DIR/*.whl" | wc -l || true)
  echo "wheels: $n files in $WHEEL_DIR; $WHEEL_DIR in all (with cache/): $(mib "$w")"
  echo "repository (tracked + untracked, not ignored): $(mib "$t")"
  echo "travels (repository + wheels): $(mib $(( w + t ))) of ${LIMIT_MIB} MiB"
  if (( w + t > LIMIT_MIB * 1048576 * 3 / 4 )); then
    echo "gpu_wheels.sh: what travels is over 3/4 of the ${LIMIT_MIB} MiB limit" >&2
    return 1
  fi
}

case $MODE in
  list) requirements; exit 0 ;;
  size) report_size; exit ;;
esac

PY=${PYTHON:-}
[[ -z "$PY" && -x .venv/bin/python ]] && PY=.venv/bin/python
PY=${PY:-python3}
mkdir -p "$WHEEL_DIR"
mapfile -t REQS < <(requirements)
echo "downloading ${#REQS[@]} wheels for CPython $PYVER (manylinux x86-64) into $WHEEL_DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEEL_DIR" "${REQS[@]}"

# drop wheels the list no longer names (normalised distribution name + version from the file name)
keep=$(for r in "${REQS[@]}"; do echo "${r%%==*}-${r##*==}" | tr 'A-Z.-' 'a-z__'; done)
for f in "$WHEEL_DIR"/*.whl; do
  base=$(basename "$f" | cut -d- -f1-2 | tr 'A-Z.-' 'a-z__')
  if ! grep -qxF "$base" <<<"$keep"; then
    echo "removing $(basename "$f") (not in $LIST)"
    rm -f "$f"
  fi
done
ls -1 "$WHEEL_DIR"/*.whl | xargs -n1 basename
if (( MODEL )); then
  model=$("$PY" -c "from cotrain.models.build_tiny import ensure_builtin_model; print(ensure_builtin_model('tiny', progress=False))")
  rm -rf "$WHEEL_DIR/cache"
  mkdir -p "$WHEEL_DIR/cache"
  cp -r "$model" "$WHEEL_DIR/cache/"
  echo "the built tiny model: $WHEEL_DIR/cache/$(basename "$model")"
fi
report_size
