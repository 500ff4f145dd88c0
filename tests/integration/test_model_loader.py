"""Checkpoints written by transformers itself (random tiny weights) load into the engine and agree.

Covers the three architectures the loader accepts: Qwen2 (q/k/v bias, given random values so a
dropped bias would show), Mistral, and Llama with tied embeddings and Llama-3 RoPE scaling.
Also: `prefixlb model save tiny DIR` writes a checkpoint transformers loads, and broken
checkpoints fail with ModelLoadError naming the problem.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT
from worker.engine.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.engine.errors import ModelLoadError
from worker.engine.model.byte_tokenizer_files import save_byte_tokenizer
from worker.engine.model.loader import load_model
from worker.engine.sampling_params import SamplingParams

COMMON = dict(vocab_size=258, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=256, eos_token_id=257, rms_norm_eps=1e-6)


def _save_random(directory, arch: str, **extra) -> None:
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Decisive random weights (and non-zero biases) so differences cannot hide.
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    save_byte_tokenizer(directory)  # a checkpoint is served only with its own tokenizer


def _check(directory, arch: str) -> None:
    import transformers

    reference = getattr(transformers, arch).from_pretrained(directory, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(directory), block_size=8))
    prompt = engine.tokenizer.encode("Mixed prefix caching across architectures, block by block.")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=258)
    for _ in range(2):  # cold, then with the prompt's prefix cached
        out = engine.generate([prompt], params)[0]
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([prompt + out.token_ids])).logits[0], -1)
        for i, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + i]
            got = torch.tensor([v for _, v in sorted(lp.top)])
            assert (got - row).abs().max().item() < 2e-4
            assert lp.token_id == int(row.argmax())
    assert out.num_cached_tokens > 0


@pytest.mark.parametrize("arch, extra", [
    ("Qwen2ForCausalLM", dict(rope_theta=1_000_000.0, tie_word_embeddings=False)),
    ("MistralForCausalLM", dict(sliding_window=None, rope_theta=10000.0)),
    ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
])
def test_a_transformers_checkpoint_loads_and_matches_transformers(tmp_path, arch, extra):
    _save_random(tmp_path, arch, **extra)
    _check(tmp_path, arch)


def test_the_model_save_command_writes_a_checkpoint_transformers_loads(tmp_path):
    from transformers import LlamaForCausalLM

    done = subprocess.run([sys.executable, "-m", "prefixlb", "model", "save", "tiny", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["num_key_value_heads"], config["num_attention_heads"]) == (
        ["LlamaForCausalLM"], 2, 8)
    reference = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ours = load_model("tiny")
    assert torch.equal(reference.model.layers[0].self_attn.k_proj.weight,
                       ours.model.layers[0].self_attn.qkv_proj.weight[256:320])


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_random(tmp_path, "LlamaForCausalLM")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.qkv_proj.weight#2"):
        load_model(str(tmp_path))


def test_unsupported_architectures_and_missing_directories_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="neither a preset"):
        load_model(str(tmp_path / "nope"))


def test_dtype_auto_runs_a_bfloat16_checkpoint_in_float32_on_a_cpu_and_bfloat16_halves_the_kv_bytes(tmp_path):
    _save_random(tmp_path, "LlamaForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    kv = 64 * 1024  # 2 (K, V) x 2 layers x 8 tokens x 2 KV heads x 16 dims x 4 bytes = 4 KiB a float32 block
    auto = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, kv_memory_bytes=kv))
    half = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, kv_memory_bytes=kv, dtype="bfloat16"))
    assert auto.runner.dtype is torch.float32
    assert half.runner.dtype is torch.bfloat16
    assert half.runner.kv_caches[0][0].dtype is torch.bfloat16
    assert next(half.runner.model.parameters()).dtype is torch.bfloat16
    assert (auto.num_kv_blocks, half.num_kv_blocks) == (16, 32)
    prompt = half.tokenizer.encode("bfloat16 on a CPU still generates")
    out = half.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_the_worker_reports_the_dtype_it_runs_in():
    from worker.server.app import build_engine
    from worker.server.config import load_server_config

    assert build_engine(load_server_config(["--dtype", "float16"], environ={})).info["dtype"] == "float16"
    assert build_engine(load_server_config([], environ={})).info["dtype"] == "float32"


def test_generation_config_eos_ids_end_generation_too(tmp_path):
    from worker.engine.model.loader import load_model_config
    from worker.engine.model.presets import build_preset
    from worker.engine.model.save import save_pretrained

    save_pretrained(build_preset("tiny"), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 10]}))
    assert load_model_config(str(tmp_path)).eos_token_ids == [257, 10]
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=32))
    assert engine.eos_token_ids == [10, 257]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelLoadError, match="eos_token_id must be an integer or a list of integers"):
        load_model_config(str(tmp_path))
