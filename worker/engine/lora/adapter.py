"""LoRA adapters in PEFT's format: reading and validating a directory, and one loaded adapter.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with::

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight    [r, in_features]
    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight    [out_features, r]
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

and the forward pass adds ``scaling · B A x`` to each targeted projection, ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). The scaling is folded into B
once, at load time.

Refused with :class:`InvalidLoRAAdapterError` (the server answers 400): pickled weights only
(``adapter_model.bin``: loading one runs arbitrary code), another PEFT method than LoRA, DoRA,
trained biases, ``modules_to_save``, per-module ``rank_pattern`` / ``alpha_pattern``,
``fan_in_fan_out``, ``layer_replication``, a tensor for anything but the seven projections
(embeddings, ``lm_head``), a layer the model does not have, a rank above ``max_lora_rank``, an A
without its B, and any shape that does not match the model. A missing directory or config is
:class:`LoRAAdapterNotFoundError` (404).

An adapter's **identity** is its name plus the SHA-256 of both files' bytes: the engine seeds
its prefix-cache block hashes with it, so two adapters never share KV, and a name reloaded with
different weights never reuses the blocks its previous weights computed.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol import untrusted_json
from worker.engine.config import ModelConfig
from worker.engine.errors import InvalidLoRAAdapterError, LoRAAdapterNotFoundError
from worker.engine.stats import LoRACounters

if TYPE_CHECKING:  # torch is imported only when weights are read: the simulated engine has none
    import torch

# The projections an adapter may target, in the model's order (worker/engine/model/llama.py
# LORA_TARGETS, which imports torch), with the parent module in PEFT's tensor names.
TARGET_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                  "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# Config keys whose non-empty values change the forward pass in ways the engine does not compute.
_UNSUPPORTED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                "layer_replication", "lora_bias", "trainable_token_indices", "use_qalora", "use_bdlora",
                "alora_invocation_tokens", "target_parameters")


@dataclass(eq=False, slots=True)
class LoRAAdapter:
    """One loaded version of a named adapter.

    ``weights`` maps ``(layer, module)`` to ``(A [r, in], B·scaling [out, r])`` while the
    adapter is resident in host memory, ``None`` otherwise (the registry reads it back from
    ``path``, and refuses if the files changed). ``lora_int_id`` is unique per load (vLLM's
    name), so an in-place reload never reuses a GPU slot holding the old weights.
    """

    name: str
    path: str
    digest: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    num_params: int
    weights: "dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None" = None
    lora_int_id: int = 0
    counters: LoRACounters = field(default_factory=LoRACounters)
    # Registry bookkeeping (under its lock): requests in the engine, LRU tick, still current.
    refcount: int = 0
    last_used: int = 0
    removed: bool = False

    @property
    def identity(self) -> str:
        """Name and content digest: what the prefix cache is keyed by."""
        return f"{self.name}\x00{self.digest}"

    @property
    def short_digest(self) -> str:
        """The first 16 hex digits of the digest (enough to tell versions apart in reports)."""
        return self.digest[:16]

    def num_bytes(self, bytes_per_param: int = 4) -> int:
        """Bytes of A and B at ``bytes_per_param`` (host memory, and one GPU slot's worth)."""
        return self.num_params * bytes_per_param


def _read_files(path: Path, name: str) -> tuple[bytes, bytes]:
    if not path.is_dir() or not (path / CONFIG_FILE).is_file():
        raise LoRAAdapterNotFoundError(f"Loading lora {name} failed: No adapter found for {path}")
    if not (path / WEIGHTS_FILE).is_file():
        if any(path.glob("adapter_model*.bin")) or (path / "adapter_model.pt").is_file():
            raise InvalidLoRAAdapterError(
                f"adapter {name!r}: only {WEIGHTS_FILE} is accepted (pickled .bin/.pt weights can run "
                "code when loaded); convert it with safetensors' convert script or re-save with PEFT")
        raise LoRAAdapterNotFoundError(f"Loading lora {name} failed: No {WEIGHTS_FILE} in {path}")
    try:
        return (path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise LoRAAdapterNotFoundError(f"Loading lora {name} failed: {exc}") from exc


def _parse_config(raw: bytes, name: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA ``adapter_config.json``, refusing what the engine cannot serve."""
    try:
        cfg = untrusted_json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidLoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise InvalidLoRAAdapterError(f"adapter {name!r}: {CONFIG_FILE} must be a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InvalidLoRAAdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for key in _UNSUPPORTED:
        if cfg.get(key) not in (None, False, {}, [], ""):
            raise InvalidLoRAAdapterError(f"adapter {name!r}: {key}={cfg[key]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise InvalidLoRAAdapterError(f"adapter {name!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidLoRAAdapterError(f"adapter {name!r}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise InvalidLoRAAdapterError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InvalidLoRAAdapterError(f"adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _header(data: bytes, name: str) -> dict[str, Any]:
    """The safetensors header (tensor name -> dtype, shape) without reading any tensor."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = untrusted_json.loads(data[8:8 + size])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidLoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is not a safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    return header


def _check_tensors(header: dict[str, Any], name: str, rank: int,
                   model_config: ModelConfig | None) -> dict[tuple[int, str], dict[str, str]]:
    """``(layer, module) -> {"A": key, "B": key}``, every shape checked against the model."""
    features = target_features(model_config) if model_config is not None else None
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidLoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of a supported module "
                f"({', '.join(TARGET_PARENTS)}); embeddings, lm_head and biases cannot be adapted")
        layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if TARGET_PARENTS.get(module) != parent:
            raise InvalidLoRAAdapterError(f"adapter {name!r}: the model has no module {parent}.{module} "
                                          f"(targets: {', '.join(TARGET_PARENTS)})")
        if model_config is not None and layer >= model_config.num_hidden_layers:
            raise InvalidLoRAAdapterError(f"adapter {name!r}: layer {layer} does not exist "
                                          f"(the model has {model_config.num_hidden_layers})")
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise InvalidLoRAAdapterError(f"adapter {name!r}: {key} has unsupported dtype "
                                          f"{info.get('dtype') if isinstance(info, dict) else info!r}")
        shape = tuple(info.get("shape", ()))
        if features is not None:
            in_f, out_f = features[module]
        elif len(shape) == 2:  # no model to compare with (the simulator): only the rank is checked
            in_f = out_f = shape[1] if ab == "A" else shape[0]
        else:
            in_f = out_f = -1
        expected = (rank, in_f) if ab == "A" else (out_f, rank)
        if shape != expected:
            raise InvalidLoRAAdapterError(f"adapter {name!r}: {key} has shape {list(shape)}, expected "
                                          f"{list(expected)} (rank {rank})")
        pairs.setdefault((layer, module), {})[ab] = key
    for (layer, module), keys in pairs.items():
        if set(keys) != {"A", "B"}:
            raise InvalidLoRAAdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(keys)} "
                                          "without its pair")
    if not pairs:
        raise InvalidLoRAAdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return pairs


def target_features(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every targetable projection of ``config``."""
    h, i = config.hidden_size, config.intermediate_size
    assert config.head_dim is not None
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_peft_adapter(name: str, path: str | Path, *, max_rank: int, model_config: ModelConfig | None = None,
                      dtype: "torch.dtype | None" = None, load_weights: bool = True) -> LoRAAdapter:
    """Read and validate the PEFT adapter at ``path`` (see the module docstring).

    With ``model_config`` every shape is checked against the model and, with ``load_weights``,
    the weights come back as ``dtype`` (default fp32) tensors on the CPU with the scaling folded
    into B (computed in fp32, rounded once). Without a model (the simulated worker) only the format and
    the rank are checked and no tensor is built.
    """
    directory = Path(path)
    raw_config, raw_weights = _read_files(directory, name)
    rank, scaling = _parse_config(raw_config, name, max_rank)
    header = _header(raw_weights, name)
    pairs = _check_tensors(header, name, rank, model_config)
    num_params = 0
    for keys in pairs.values():
        for key in keys.values():
            num_params += math.prod(header[key]["shape"])
    digest = hashlib.sha256(b"%d:" % len(raw_config) + raw_config + raw_weights).hexdigest()
    modules = {module for _, module in pairs}
    targets = tuple(m for m in TARGET_PARENTS if m in modules)
    weights = None
    if load_weights and model_config is not None:
        import torch
        from safetensors.torch import load as load_safetensors

        dtype = dtype or torch.float32
        try:
            tensors = load_safetensors(raw_weights)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise InvalidLoRAAdapterError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
        weights = {}
        for (layer, module), keys in pairs.items():
            a, b = tensors[keys["A"]], tensors[keys["B"]]
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise InvalidLoRAAdapterError(f"adapter {name!r}: layer {layer} {module} has NaN or Inf weights")
            weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(name=name, path=str(directory), digest=digest, rank=rank, scaling=scaling,
                       target_modules=targets, num_params=num_params, weights=weights)
