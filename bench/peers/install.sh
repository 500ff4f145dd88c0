#!/usr/bin/env bash
# Install the peer routers (sglang-router, vllm-router) from PyPI into their own virtual
# environment, .venv-peers, so that they never touch the project's .venv.
#   bench/peers/install.sh [VENV_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-peers}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "sglang-router==$SGLANG_ROUTER_VERSION" "vllm-router==$VLLM_ROUTER_VERSION"
"$VENV/bin/pip" list 2>/dev/null | grep -iE "sglang|vllm" || true
