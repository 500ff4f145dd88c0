"""Signed worker messages: what a worker writes into Redis, only that worker can have written.

Redis is shared by every worker; its ACLs can keep a worker off the routers' keys, not off the
keys and the stream every worker writes (registrations, load reports, KV events). So each
worker signs what it writes with a key of its own, and routers check it:

* the operator keeps one fleet secret; a worker's key is ``HMAC-SHA256(secret, worker_id)``
  (:func:`worker_key`; ``prefixlb signing-key --worker-id W`` prints it), so a worker holding
  only its own key cannot sign as another;
* a signed message is the usual JSON object with one more field, ``"sig"``: the hex HMAC-SHA256,
  under the key of the ``worker_id`` the message names, of the message's canonical JSON (sorted
  keys, no spaces, ASCII) without ``"sig"`` -- routers without a secret ignore the field;
* routers with ``--redis-signing-secret`` derive each worker's key themselves and drop (and
  count) every registration, load report or KV event whose signature is missing or wrong.

Signatures bind content to a worker, not to a moment: a replayed old message of the same
worker verifies. Load reports carry their time (older ones than the latest are ignored) and KV
events their sequence number (a replay shows as a gap).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIG_FIELD = "sig"
_LABEL = b"prefixlb-worker-key:"


class SignatureError(ValueError):
    """A message without a valid signature of the worker it names."""


def worker_key(secret: str, worker_id: str) -> str:
    """The signing key (hex) of ``worker_id`` under the fleet ``secret``."""
    return hmac.new(secret.encode(), _LABEL + worker_id.encode(), hashlib.sha256).hexdigest()


def _canonical(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _mac(key: str, data: dict[str, Any]) -> str:
    return hmac.new(bytes.fromhex(key), _canonical(data), hashlib.sha256).hexdigest()


def sign(data: dict[str, Any], key: str) -> str:
    """``data`` (a message's ``to_dict()``) as signed JSON text."""
    body = {k: v for k, v in data.items() if k != SIG_FIELD}
    return json.dumps({**body, SIG_FIELD: _mac(key, body)}, separators=(",", ":"))


def verify(raw: str | bytes, secret: str) -> dict[str, Any]:
    """The message object of signed JSON ``raw``, its signature checked against the key of the
    ``worker_id`` it names; raises :class:`SignatureError` (or ``ValueError`` for bad JSON)."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise SignatureError("a signed message is a JSON object")
    sig = data.pop(SIG_FIELD, None)
    worker_id = data.get("worker_id")
    if not isinstance(sig, str) or not isinstance(worker_id, str):
        raise SignatureError("unsigned message")
    try:
        expected = _mac(worker_key(secret, worker_id), data)
    except ValueError as exc:  # NaN/inf: not canonical JSON (and refused by the schema anyway)
        raise SignatureError(f"unsignable message: {exc}") from None
    if not hmac.compare_digest(sig, expected):
        raise SignatureError(f"bad signature for worker {worker_id!r}")
    return data
