"""A worker on a real checkpoint renders chats with the checkpoint's tokenizer and template, or
with ``--tokenizer DIR`` / ``--chat-template FILE``; what it cannot honour is a 400 that says why.

The checkpoint is the tiny model saved in Hugging Face format; the official ``openai`` client
talks to real worker processes over loopback.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import openai
import pytest

from tests.integration.worker_client import call
from tests.support import ROOT, free_port, processes, spawn
from worker.engine.model.presets import build_preset
from worker.engine.model.save import save_pretrained
from worker.engine.tokenizer import HFTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ persona | default('') }}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``bare``: weights without tokenizer files; ``tok``: the tokenizer without a chat template;
    ``no_template``: weights and that tokenizer; ``template``: CHATML in a file."""
    root = tmp_path_factory.mktemp("chat-templates")
    full = save_pretrained(build_preset("tiny"), root / "full")
    bare, tok, no_template = root / "bare", root / "tok", root / "no-template"
    shutil.copytree(full, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    shutil.copytree(full, no_template)
    config = json.loads((full / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(no_template / name, tok / name)
    (root / "chatml.jinja").write_text(CHATML)
    return {"bare": bare, "tok": tok, "no_template": no_template, "template": root / "chatml.jinja"}


@pytest.fixture(scope="module")
def workers(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chat-template-logs")
    plain, templated = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--model", str(dirs["no_template"]), "--served-model-name", "tiny",
                            "--port", str(plain), "--kv-blocks", "64"], logs, "no-template", port=plain))
        procs.append(spawn(["worker", "--model", str(dirs["bare"]), "--tokenizer", str(dirs["tok"]),
                            "--chat-template", str(dirs["template"]), "--served-model-name", "tiny",
                            "--port", str(templated), "--kv-blocks", "64"], logs, "templated", port=templated))
        yield {"no_template": procs[0].url, "templated": procs[1].url}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_a_checkpoint_without_a_template_serves_completions_and_refuses_chats_naming_the_flag(workers):
    client = _client(workers["no_template"])
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=3).choices[0].text is not None
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
    assert "no chat template" in exc.value.message and "--chat-template FILE" in exc.value.message


def test_the_chat_template_file_and_tokenizer_dir_render_the_prompt_as_transformers_would(workers, dirs):
    expected = HFTokenizer(dirs["tok"], CHATML)
    reply = call(workers["templated"] + "/v1/chat/completions/render", "POST",
                 {"model": "tiny", "messages": HELLO, "max_tokens": 2})
    assert reply.status == 200, reply.raw
    assert reply.json["token_ids"] == expected.encode_chat(HELLO)
    assert bytes(reply.json["token_ids"]).decode() == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    answer = _client(workers["templated"]).chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
    assert answer.usage.prompt_tokens == len(expected.encode_chat(HELLO))


def test_chat_template_kwargs_reach_the_template(workers, dirs):
    client = _client(workers["templated"])
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    styled = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"persona": "Be terse."}})
    assert styled.usage.prompt_tokens == plain.usage.prompt_tokens + len("Be terse.")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert exc.value.body["param"] == "chat_template_kwargs"


def test_tools_the_model_may_call_need_a_tool_call_parser_and_tool_choice_none_renders_them(workers):
    client = _client(workers["templated"])
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1, tools=[WEATHER], **choice)
        assert exc.value.body["param"] == "tool_choice" and "--tool-call-parser" in exc.value.message
    answer = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1, tools=[WEATHER],
                                            tool_choice="none")
    assert answer.choices[0].finish_reason == "length"


def test_a_checkpoint_without_a_tokenizer_is_refused_at_start_with_a_clear_message(dirs):
    done = subprocess.run([sys.executable, "-m", "prefixlb", "worker", "--model", str(dirs["bare"]),
                           "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "has no tokenizer.json: give the checkpoint's tokenizer with --tokenizer DIR" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("chat, field, value", [
    (True, "guided_json", {"type": "object"}),
    (True, "structured_outputs", {"regex": "[0-9]+"}),
    (True, "chat_template", "{{ messages }}"),
    (True, "continue_final_message", True),
    (True, "add_generation_prompt", False),
    (True, "parallel_tool_calls", False),
    (True, "functions", [{"name": "f"}]),
    (False, "guided_regex", "[a-z]+"),
    (False, "prompt_logprobs", 1),
])
def test_fields_the_worker_cannot_honour_are_refused_not_ignored(workers, chat, field, value):
    body = {"model": "tiny", "max_tokens": 1, field: value}
    body.update({"messages": HELLO} if chat else {"prompt": "Hello"})
    reply = call(workers["templated"] + ("/v1/chat/completions" if chat else "/v1/completions"), "POST", body)
    assert reply.status == 400, reply.raw
    assert (reply.json["error"]["param"], reply.json["error"]["code"]) == (field, "unsupported")


def test_neutral_values_of_those_fields_are_served(workers):
    body = {"model": "tiny", "max_tokens": 1, "messages": HELLO, "add_generation_prompt": True,
            "parallel_tool_calls": True, "guided_json": None, "modalities": ["text"]}
    assert call(workers["templated"] + "/v1/chat/completions", "POST", body).status == 200
