"""Reading PEFT adapters (validation, scaling, identity) and the host-memory tier (LoRARegistry)."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from tests.lora_support import ALL_TARGETS, peft_key, write_adapter
from worker.engine.errors import (InvalidLoRAAdapterError, LoRAAdapterConflictError, LoRAAdapterNotFoundError,
                                  LoRAUnavailableError)
from worker.engine.lora.adapter import read_peft_adapter
from worker.engine.lora.registry import LoRARegistry
from worker.engine.model.presets import preset_config

TINY = preset_config("tiny")  # hidden 256, intermediate 704, 8 heads of 32 over 2 KV heads, 4 layers


def read(path, max_rank=16, **kw):
    return read_peft_adapter("ad", path, max_rank=max_rank, model_config=TINY, **kw)


# ---- reading -------------------------------------------------------------------------------------

def test_a_valid_adapter_reads_with_its_scaling_folded_into_b(tmp_path):
    path = write_adapter(tmp_path / "ad", rank=4, alpha=8, targets=ALL_TARGETS, seed=3)
    from safetensors.torch import load_file
    raw = load_file(str(path / "adapter_model.safetensors"))

    adapter = read(path)

    assert (adapter.rank, adapter.scaling, adapter.target_modules) == (4, 2.0, ALL_TARGETS)
    assert len(adapter.weights) == 4 * 7
    a, b = adapter.weights[(2, "k_proj")]
    assert a.shape == (4, 256) and b.shape == (64, 4)
    assert torch.equal(a, raw[peft_key(2, "k_proj", "A")])
    assert torch.equal(b, raw[peft_key(2, "k_proj", "B")] * 2.0)
    assert adapter.num_params == 4 * sum(4 * (i + o) for i, o in
                                         [(256, 256), (256, 64), (256, 64), (256, 256), (256, 704), (256, 704), (704, 256)])


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path):
    adapter = read(write_adapter(tmp_path / "ad", rank=16, alpha=8, config={"use_rslora": True}))
    assert adapter.scaling == 8 / math.sqrt(16)


def test_the_identity_is_the_name_and_a_digest_of_both_files(tmp_path):
    one = read(write_adapter(tmp_path / "one", seed=1))
    same = read(write_adapter(tmp_path / "same", seed=1))
    other_weights = read(write_adapter(tmp_path / "w", seed=2))
    other_config = read(write_adapter(tmp_path / "c", seed=1, config={"lora_alpha": 16}))

    assert one.digest == same.digest
    assert len({one.digest, other_weights.digest, other_config.digest}) == 3
    assert one.identity == "ad\x00" + one.digest and len(one.short_digest) == 16


def test_a_missing_directory_or_config_is_not_found(tmp_path):
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for"):
        read(tmp_path / "nowhere")
    path = write_adapter(tmp_path / "ad")
    (path / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterNotFoundError):
        read(path)


def test_pickled_weights_are_refused_even_when_the_config_is_fine(tmp_path):
    path = write_adapter(tmp_path / "ad")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(InvalidLoRAAdapterError, match="only adapter_model.safetensors"):
        read(path)


@pytest.mark.parametrize("config,match", [
    ({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
    ({"r": 0}, "r must be a positive integer"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_alpha": "big"}, "lora_alpha must be a number"),
])
def test_configs_the_engine_cannot_serve_are_refused(tmp_path, config, match):
    path = write_adapter(tmp_path / "ad", config=config)
    with pytest.raises(InvalidLoRAAdapterError, match=match):
        read(path)


@pytest.mark.parametrize("tensors,match", [
    ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 256)}, "not a LoRA A/B of a supported module"),
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 258)}, "not a LoRA A/B"),
    ({"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(4, 256),
      "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.zeros(4, 4)},
     "no module self_attn.rotary"),
    ({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 256)}, "no module mlp.q_proj"),
    ({peft_key(4, "q_proj", "A"): torch.zeros(4, 256), peft_key(4, "q_proj", "B"): torch.zeros(256, 4)},
     "layer 4 does not exist"),
    ({peft_key(0, "k_proj", "A"): torch.zeros(4, 256)}, "lora_A without its pair"),
    ({peft_key(0, "q_proj", "B"): torch.zeros(64, 4)}, r"shape \[64, 4\], expected \[256, 4\]"),
    ({peft_key(0, "q_proj", "A"): torch.zeros(8, 256)}, r"shape \[8, 256\], expected \[4, 256\]"),
    ({peft_key(0, "v_proj", "A"): torch.full((4, 256), float("nan"))}, "NaN or Inf"),
])
def test_tensors_the_model_cannot_take_are_refused(tmp_path, tensors, match):
    path = write_adapter(tmp_path / "ad", rank=4, targets=("q_proj", "v_proj"), tensors=tensors)
    with pytest.raises(InvalidLoRAAdapterError, match=match):
        read(path)


def test_a_corrupt_weights_file_or_config_is_invalid_not_a_crash(tmp_path):
    path = write_adapter(tmp_path / "ad")
    (path / "adapter_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(InvalidLoRAAdapterError, match="not a safetensors file"):
        read(path)
    path = write_adapter(tmp_path / "ad2")
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(InvalidLoRAAdapterError, match="not valid JSON"):
        read(path)


def test_without_a_model_only_the_format_and_rank_are_checked_and_no_tensor_is_built(tmp_path):
    adapter = read_peft_adapter("ad", write_adapter(tmp_path / "ad", rank=8), max_rank=8)
    assert adapter.weights is None and adapter.rank == 8


# ---- the host-memory tier ----------------------------------------------------------------------

class CountingReader:
    """The engine's reader (PEFT, against the tiny model), counting disk reads."""

    def __init__(self):
        self.reads = []

    def __call__(self, name, path):
        self.reads.append(name)
        return read_peft_adapter(name, path, max_rank=16, model_config=TINY)


@pytest.fixture
def dirs(tmp_path):
    return {n: str(write_adapter(tmp_path / n, seed=i)) for i, n in enumerate("abcd")}


def test_host_memory_keeps_the_most_recently_used_adapters_and_reads_evicted_ones_back(dirs):
    reader = CountingReader()
    registry = LoRARegistry(max_cpu_loras=2, reader=reader)
    a, b = registry.add("a", dirs["a"]), registry.add("b", dirs["b"])
    registry.prefetch(a)  # a is now more recent than b
    c = registry.add("c", dirs["c"])

    assert [x.name for x in registry.resident()] == ["a", "c"]
    assert b.weights is None and b.counters.cpu_evictions == 1

    registry.acquire(b)  # read back from disk, checked against its digest; evicts a
    assert reader.reads == ["a", "b", "c", "b"]
    assert b.weights is not None and b.counters.disk_loads == 2
    assert [x.name for x in registry.resident()] == ["b", "c"]


def test_an_adapter_with_requests_in_flight_keeps_its_weights_beyond_the_bound(dirs):
    registry = LoRARegistry(max_cpu_loras=1, reader=CountingReader())
    a = registry.add("a", dirs["a"])
    registry.acquire(a)
    b = registry.add("b", dirs["b"])

    assert a.weights is not None  # pinned by its request although b is newer
    assert b.weights is None and b.counters.cpu_evictions == 1
    registry.acquire(b)  # both pinned now: the bound gives way
    assert [x.name for x in registry.resident()] == ["a", "b"]
    registry.release(a)
    assert a.weights is None and [x.name for x in registry.resident()] == ["b"]


def test_files_changed_since_loading_are_refused_when_read_back(dirs, tmp_path):
    registry = LoRARegistry(max_cpu_loras=1, reader=CountingReader())
    a = registry.add("a", dirs["a"])
    registry.add("b", dirs["b"])  # evicts a's weights
    write_adapter(tmp_path / "a", seed=99)  # someone retrained a in place

    with pytest.raises(LoRAUnavailableError, match="changed on disk"):
        registry.acquire(a)
    assert a.refcount == 0
    shutil.rmtree(dirs["a"])
    with pytest.raises(LoRAUnavailableError, match="could not be read back"):
        registry.acquire(a)


def test_names_conflict_unless_replaced_and_the_base_model_name_is_reserved(dirs):
    registry = LoRARegistry(max_cpu_loras=4, reader=CountingReader(), reserved_names=["tiny"])
    old = registry.add("a", dirs["a"])
    with pytest.raises(LoRAAdapterConflictError, match="already been loaded"):
        registry.add("a", dirs["b"])
    with pytest.raises(LoRAAdapterConflictError, match="conflicts with a served base model"):
        registry.add("tiny", dirs["b"])

    registry.acquire(old)
    new = registry.add("a", dirs["b"], replace=True)

    assert registry.get("a") is new and new.lora_int_id != old.lora_int_id
    assert old.removed and old.weights is not None  # its request still runs with it
    assert new.counters is old.counters and new.counters.disk_loads == 2
    registry.release(old)
    assert old.weights is None


def test_removing_an_unknown_name_is_not_found_and_a_removed_idle_version_cannot_be_acquired(dirs):
    registry = LoRARegistry(max_cpu_loras=4, reader=CountingReader())
    with pytest.raises(LoRAAdapterNotFoundError, match="cannot be found"):
        registry.remove("x")
    a = registry.add("a", dirs["a"])
    registry.remove("a")
    assert "a" not in registry and a.weights is None
    with pytest.raises(LoRAAdapterNotFoundError):
        registry.acquire(a)


def test_disk_load_time_is_measured(dirs):
    registry = LoRARegistry(max_cpu_loras=4, reader=CountingReader())
    assert registry.disk_load_s == 0
    registry.add("a", dirs["a"])
    assert registry.disk_load_s > 0
