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

Signatures bind content to a worker; what binds it to a moment is in the signed content too
(:class:`Incarnation`, :class:`ReplayGuard`): every signed message carries the worker process's
incarnation (``"inc"``: a random id drawn when the process starts), its start time
(``"started"``) and a number (``"n"``) that grows with every message the process writes. A
router keeps, per worker id, the newest incarnation and the highest number seen per kind of
message, and drops (and counts, ``kind="replay"``) a message of that incarnation with a lower
number, and any message of an incarnation that started no later than the newest one: a
captured old load report, KV event or registration -- of this process or of a dead one -- has
no effect. A restarted worker starts later, so its new incarnation takes over at once. (The
order of incarnations is their start times, read from the workers' clocks: a replacement whose
clock is behind its predecessor's start is refused until it is not.)
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import secrets
import time
from collections import OrderedDict
from typing import Any

from protocol import untrusted_json

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
    data = untrusted_json.loads(raw)
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


INCARNATION_FIELD, NUMBER_FIELD, STARTED_FIELD = "inc", "n", "started"
ENVELOPE_FIELDS = (INCARNATION_FIELD, NUMBER_FIELD, STARTED_FIELD)


class Incarnation:
    """One worker process's stamp on what it signs: a random id and the start time, drawn once,
    and a number that grows with every message."""

    def __init__(self, started: float | None = None) -> None:
        self.id = secrets.token_hex(8)
        self.started = time.time() if started is None else started
        self._numbers = itertools.count(1)

    def stamp(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with the incarnation, the start time and the next number."""
        return {**data, INCARNATION_FIELD: self.id, NUMBER_FIELD: next(self._numbers), STARTED_FIELD: self.started}


def envelope(data: dict[str, Any]) -> tuple[str, int, float]:
    """The (incarnation, number, start time) of a verified message; SignatureError if absent or
    malformed (a signed message without them cannot be ordered, so it does not count)."""
    inc, number, started = (data.get(name) for name in ENVELOPE_FIELDS)
    if not (isinstance(inc, str) and 0 < len(inc) <= 64 and inc.isascii() and inc.isalnum()):
        raise SignatureError("signed message without a valid incarnation ('inc')")
    if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 2**63:
        raise SignatureError("signed message without a valid number ('n')")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or not math.isfinite(started) \
            or not 0 <= started < 1e11:
        raise SignatureError("signed message without a valid start time ('started')")
    return inc, number, float(started)


class ReplayGuard:
    """Per worker id: the newest incarnation (by start time) and the highest number seen per kind
    of message. :meth:`check` says whether a verified message is fresh; bounded to ``capacity``
    worker ids (least recently heard from forgotten first)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, tuple[str, float, dict[str, int]]] = OrderedDict()

    def check(self, kind: str, worker_id: str, data: dict[str, Any], *, again_ok: bool) -> str | None:
        """None if the message may count, else why not (``replay``: an older number of the newest
        incarnation; ``old_incarnation``: an incarnation that started no later than the newest).
        ``again_ok``: the very same message may be read again (a key holding the latest value,
        re-read every sync), as opposed to a stream whose entries come once each."""
        inc, number, started = envelope(data)
        seen = self._seen.get(worker_id)
        if seen is None or (inc != seen[0] and started > seen[1]):
            self._seen[worker_id] = (inc, started, {kind: number})
            self._seen.move_to_end(worker_id)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return None
        if inc != seen[0]:
            return "old_incarnation"
        last = seen[2].get(kind, 0)
        if number < last or (number == last and not again_ok):
            return "replay"
        seen[2][kind] = number
        self._seen.move_to_end(worker_id)
        return None

    def incarnation(self, worker_id: str) -> str | None:
        """The newest incarnation seen of ``worker_id``."""
        seen = self._seen.get(worker_id)
        return seen[0] if seen is not None else None
