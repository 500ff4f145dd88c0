"""kernels/backend.py: which implementation each name selects, and when triton gets imported.

Each case that may import triton runs in a fresh interpreter: whether triton (and the
interpreter switch) is loaded is process-wide state.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels import attention_ref
from kernels.backend import AttentionBackendError, get_attention_backend


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_auto_backend_on_cpu_is_the_torch_reference():
    backend = get_attention_backend("auto", "cpu")
    assert backend.name == "torch"
    assert (backend.write_kv, backend.decode, backend.extend) == (
        attention_ref.write_kv, attention_ref.paged_decode_attention, attention_ref.prefix_extend_attention
    )


def test_unknown_backend_name_is_refused_with_the_valid_choices():
    with pytest.raises(AttentionBackendError, match="auto, triton, torch"):
        get_attention_backend("flash", "cpu")


def test_importing_the_selector_and_using_torch_never_imports_triton():
    out = _python(
        "import sys, kernels.backend as b; b.get_attention_backend('auto', 'cpu');"
        " b.get_attention_backend('torch', 'cpu'); print('triton' in sys.modules)"
    )
    assert out == "False"


def test_auto_backend_on_cuda_is_the_compiled_triton_kernels():
    # Defining the kernels needs no GPU; launching them would.
    out = _python(
        "import os, kernels.backend as b; from kernels import triton_decode as t;"
        " k = b.get_attention_backend('auto', 'cuda');"
        " print(k.name, k.decode is t.paged_decode_attention, type(t._decode_split_kernel).__name__,"
        " os.environ.get('TRITON_INTERPRET'))"
    )
    assert out == "triton True JITFunction None"


def test_triton_backend_on_cpu_switches_the_interpreter_on_before_defining_the_kernels():
    out = _python(
        "import os, kernels.backend as b; k = b.get_attention_backend('triton', 'cpu');"
        " from kernels import triton_extend as t;"
        " print(k.name, os.environ['TRITON_INTERPRET'], type(t._extend_kernel).__name__)"
    )
    assert out == "triton 1 InterpretedFunction"


def test_triton_backend_on_cpu_is_refused_once_the_kernels_were_compiled_for_a_gpu():
    out = _python(
        "import kernels.backend as b, kernels.triton_decode\n"
        "try:\n    b.get_attention_backend('triton', 'cpu')\n"
        "except b.AttentionBackendError as e:\n    print(e)"
    )
    assert "needs TRITON_INTERPRET=1 before the kernels are imported" in out
