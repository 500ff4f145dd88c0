"""Regenerate the real vLLM samples in tests/data (run by hand; needs .venv-vllm, ~3 minutes).

    .venv/bin/python -m tests.data.capture_vllm_samples

Starts one vLLM 0.32 server on the tiny checkpoint with a 16-block KV pool (so that requests
evict) and the development endpoints (``/reset_prefix_cache``), runs a fixed scenario, and writes:

- ``vllm_metrics_idle.txt``, ``vllm_metrics_busy.txt`` (requests running), ``vllm_metrics_after.txt``;
- ``vllm_kv_events.jsonl``: every KV-event message of the scenario, fetched from the replay
  socket (frames base64: topic, seq, payload; the last line is the end-of-replay marker);
- ``vllm_kv_scenario.json``: each scenario request with its prompt token ids and the
  ``cached_tokens`` vLLM reported, in order.
"""
from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support import wait_for
from tests.vllm_support import MODEL_NAME, get_text, post_json, save_checkpoint, start_server

OUT = Path(__file__).resolve().parent
SHARED = "You are a careful assistant. " * 10  # 290 characters: two full blocks with BOS


def main() -> int:
    import zmq

    work = Path(tempfile.mkdtemp(prefix="prefixlb-capture-"))
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    server = start_server(save_checkpoint(work / "tiny-hf"), "capture", work,
                          max_model_len=1024, extra_args=["--num-gpu-blocks-override", "16"])
    try:
        server.wait_ready(time.monotonic() + 600)
        url = server.url
        (OUT / "vllm_metrics_idle.txt").write_text(get_text(url + "/metrics"))
        scenario = []

        def complete(prompt: str, **kw) -> None:
            r = post_json(url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                                                    "temperature": 0, "return_token_ids": True, **kw})
            scenario.append({"request": {"prompt": prompt, **kw},
                             "prompt_token_ids": r["choices"][0]["prompt_token_ids"],
                             "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"]})

        complete(SHARED + "Question one?")
        complete(SHARED + "Question two?")
        complete(SHARED + "Question one?", cache_salt="tenant-a")
        complete("Z" * 600)  # 5 blocks
        complete("Y" * 900)  # 8 blocks: the 16-block pool evicts (BlockRemoved)
        complete(SHARED + "Question one?")
        busy = [threading.Thread(target=post_json, args=(url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": f"busy {i} " + "w" * 100, "max_tokens": 600,
            "temperature": 0, "ignore_eos": True})) for i in range(4)]
        for t in busy:
            t.start()
        text = wait_for(lambda: (t := get_text(url + "/metrics")) and
                        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' not in t and t,
                        timeout=60, interval=0.05, what="running requests in /metrics")
        (OUT / "vllm_metrics_busy.txt").write_text(text)
        for t in busy:
            t.join()
        (OUT / "vllm_metrics_after.txt").write_text(get_text(url + "/metrics"))
        post_json(url + "/reset_prefix_cache", {})
        complete(SHARED + "Question one?")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(server.replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        lines = []
        while True:
            frames = sock.recv_multipart()[1:]
            lines.append(json.dumps({"frames": [base64.b64encode(f).decode() for f in frames]}))
            if int.from_bytes(frames[1], "big", signed=True) == -1:
                break
        sock.close(0)
        (OUT / "vllm_kv_events.jsonl").write_text("\n".join(lines) + "\n")
        (OUT / "vllm_kv_scenario.json").write_text(json.dumps(scenario, indent=1) + "\n")
        print(f"{len(lines)} messages; cached_tokens {[s['cached_tokens'] for s in scenario]}")
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
