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


# -- replays (ReplayGuard): a verified message counts only if it is fresh ----------------------

def _stamped(incarnation, kind: str = "load_report", worker_id: str = "w0") -> dict:
    """What a router gets from verify(): the message with its incarnation's stamp."""
    body = LoadReport(worker_id=worker_id).to_dict() if kind == "load_report" else \
        KVEvent(worker_id=worker_id, kind="cleared").to_dict()
    return verify(sign(incarnation.stamp(body), worker_key(SECRET, worker_id)), SECRET)


def test_an_older_number_of_the_same_incarnation_is_a_replay_and_a_key_reread_is_not():
    from protocol.signing import Incarnation, ReplayGuard
    guard, a = ReplayGuard(), Incarnation(started=100.0)
    first, second = _stamped(a), _stamped(a)
    assert guard.check("load_report", "w0", first, again_ok=True) is None
    assert guard.check("load_report", "w0", second, again_ok=True) is None
    assert guard.check("load_report", "w0", second, again_ok=True) is None  # the same key read again
    assert guard.check("load_report", "w0", first, again_ok=True) == "replay"
    event = _stamped(a, "kv_event")
    assert guard.check("kv_event", "w0", event, again_ok=False) is None
    assert guard.check("kv_event", "w0", event, again_ok=False) == "replay"  # a stream entry comes once


def test_a_later_incarnation_takes_over_and_an_earlier_one_never_comes_back():
    from protocol.signing import Incarnation, ReplayGuard
    guard = ReplayGuard()
    old, new, older = Incarnation(started=100.0), Incarnation(started=200.0), Incarnation(started=50.0)
    old_report = _stamped(old)
    assert guard.check("load_report", "w0", old_report, again_ok=True) is None
    assert guard.check("registration", "w0", _stamped(new), again_ok=True) is None
    assert guard.incarnation("w0") == new.id
    assert guard.check("load_report", "w0", old_report, again_ok=True) == "old_incarnation"
    assert guard.check("load_report", "w0", _stamped(older), again_ok=True) == "old_incarnation"
    # another worker's books are its own
    assert guard.check("load_report", "w1", _stamped(old, worker_id="w1"), again_ok=True) is None


@pytest.mark.parametrize("envelope", [
    {},                                                   # signed without a stamp: cannot be ordered
    {"inc": "", "n": 1, "started": 1.0},
    {"inc": "a b", "n": 1, "started": 1.0},
    {"inc": "ab", "n": 0, "started": 1.0},
    {"inc": "ab", "n": True, "started": 1.0},
    {"inc": "ab", "n": 2**63, "started": 1.0},
    {"inc": "ab", "n": 1, "started": float("inf")},
    {"inc": "ab", "n": 1, "started": "1"},
])
def test_a_signed_message_without_a_valid_stamp_does_not_count(envelope):
    from protocol.signing import ReplayGuard
    data = {**LoadReport(worker_id="w0").to_dict(), **envelope}
    with pytest.raises(SignatureError):
        ReplayGuard().check("load_report", "w0", data, again_ok=True)


def test_the_guard_remembers_a_bounded_number_of_workers():
    from protocol.signing import Incarnation, ReplayGuard
    guard, a = ReplayGuard(capacity=3), Incarnation(started=1.0)
    for i in range(10):
        assert guard.check("load_report", f"w{i}", _stamped(a, worker_id=f"w{i}"), again_ok=True) is None
    assert len(guard._seen) == 3 and guard.incarnation("w9") == a.id and guard.incarnation("w0") is None
