"""Signed worker messages (protocol/signing.py): only the worker a message names can have signed it."""
from __future__ import annotations

import json

import pytest

from protocol import KVEvent, LoadReport
from protocol.signing import SignatureError, sign, verify, worker_key

SECRET = "fleet-secret-for-tests"


def test_a_message_signed_with_its_workers_key_verifies_and_decodes():
    report = LoadReport(worker_id="w0", running=3, prefill_tokens_per_s=1234.5, ts=100.25)
    text = sign(report.to_dict(), worker_key(SECRET, "w0"))
    assert LoadReport.from_dict(verify(text, SECRET)) == report


@pytest.mark.parametrize("tamper", [
    lambda d: {**d, "running": 0},                      # content changed after signing
    lambda d: {**d, "worker_id": "w1"},                 # re-addressed to another worker
    lambda d: {k: v for k, v in d.items() if k != "sig"},  # signature removed
    lambda d: {**d, "sig": "00" * 32},                  # a made-up signature
])
def test_a_tampered_or_unsigned_message_is_refused(tamper):
    text = sign(LoadReport(worker_id="w0", running=3).to_dict(), worker_key(SECRET, "w0"))
    with pytest.raises(SignatureError):
        verify(json.dumps(tamper(json.loads(text))), SECRET)


def test_a_worker_cannot_sign_as_another_and_keys_differ_per_worker_and_secret():
    forged = sign(KVEvent(worker_id="w0", kind="cleared").to_dict(), worker_key(SECRET, "w1"))
    with pytest.raises(SignatureError, match="bad signature for worker 'w0'"):
        verify(forged, SECRET)
    assert len({worker_key(SECRET, "w0"), worker_key(SECRET, "w1"), worker_key("other", "w0")}) == 3


def test_key_order_and_spacing_do_not_matter_only_content():
    text = sign({"worker_id": "w0", "kind": "stored", "hashes": [1, 2]}, worker_key(SECRET, "w0"))
    data = json.loads(text)
    respaced = json.dumps(dict(reversed(list(data.items()))), indent=2)
    assert verify(respaced, SECRET)["hashes"] == [1, 2]
