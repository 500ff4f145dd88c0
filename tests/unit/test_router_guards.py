"""The router's guards at its edges: worker URLs (scheme, allow-list), API keys, forwarded headers."""
from __future__ import annotations

import pytest

from protocol.api_keys import check_api_key
from protocol.openai_api import OpenAIError
from router.http.api import forwardable
from router.fleet.worker_url import InvalidWorkerURL, WorkerURLPolicy


@pytest.mark.parametrize("url", [
    "http://user:pw@10.0.0.1:8000",   # credentials in a worker URL
    "http://10.0.0.1:8000/?next=evil",  # a query
    "http://10.0.0.1:8000/#x",
    "http://10.0.0.1:99999",          # a port that is not one
    "http://10.0.0.1 :8000",          # spaces / control characters
    "http://10.0.0.1:8000/\r\nHost: x",
    "gopher://10.0.0.1:70",
    "http:///path-only",
])
def test_worker_urls_that_are_not_plain_http_base_urls_are_refused(url):
    with pytest.raises(InvalidWorkerURL):
        WorkerURLPolicy().check(url)


def test_without_an_allow_list_any_http_host_is_accepted_and_normalised():
    assert WorkerURLPolicy().check(" https://worker-3.example:8443/base/ ") == "https://worker-3.example:8443/base"


ALLOW = ["10.1.0.0/16", "127.0.0.1:8001", "*.workers.svc.cluster.local", "[::1]:9000"]


@pytest.mark.parametrize("url,allowed", [
    ("http://10.1.2.3:8000", True),
    ("http://10.2.0.1:8000", False),               # outside the network
    ("http://127.0.0.1:8001", True),
    ("http://127.0.0.1:8002", False),              # the pattern names a port
    ("http://w-0.workers.svc.cluster.local:8000", True),
    ("http://W-0.WORKERS.svc.cluster.local", True),  # host names are case-insensitive
    ("http://workers.svc.cluster.local.evil.com", False),
    ("http://169.254.169.254/latest/meta-data", False),  # the cloud metadata service, say
    ("http://[::1]:9000", True),
    ("http://[::1]:9001", False),
    ("http://localhost:8001", False),              # names are not resolved: 127.0.0.1 does not admit it
])
def test_an_allow_list_admits_only_matching_hosts_and_ports(url, allowed):
    policy = WorkerURLPolicy(ALLOW)
    if allowed:
        assert policy.check(url) == url
    else:
        with pytest.raises(InvalidWorkerURL):
            policy.check(url)


@pytest.mark.parametrize("host,allowed", [
    ("worker-3", True),
    ("worker-", True),
    ("worker-x.attacker.example", False),  # compose's worker-*:8000 must not admit another domain
    ("worker-x.", True),                   # the same name, fully qualified
    ("w-0.workers.svc", True),
    ("a.b.workers.svc", False),            # two labels where the pattern has one
    ("w-10.workers.svc", False),           # "?" is one character
])
def test_a_host_wildcard_matches_within_one_dns_label(host, allowed):
    policy = WorkerURLPolicy(["worker-*:8000", "w-?.workers.svc"])
    if allowed:
        assert policy.check(f"http://{host}:8000") == f"http://{host}:8000"
    else:
        with pytest.raises(InvalidWorkerURL, match="not in the allow-list"):
            policy.check(f"http://{host}:8000")


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data",
    "http://169.254.10.1:8000",
    "http://[fe80::1]:8000",
    "http://[fe80::1%25eth0]:8000",
    "http://[::ffff:169.254.169.254]",      # IPv4-mapped
    "http://2852039166",                    # 169.254.169.254 as one number
    "http://0xa9fea9fe",                    # ... in hexadecimal
    "http://[fd00:ec2::254]",               # AWS's metadata service over IPv6
    "http://metadata.google.internal/computeMetadata/v1",
    "http://Metadata.Google.Internal.:80",
])
def test_link_local_and_metadata_hosts_are_refused_without_an_allow_list(url):
    with pytest.raises(InvalidWorkerURL, match="link-local or cloud-metadata"):
        WorkerURLPolicy().check(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8001", "http://[::1]:8001", "http://localhost:8001",
                                 "http://10.0.0.7:8000", "http://worker-0.workers.svc:8000"])
def test_loopback_and_ordinary_hosts_stay_accepted_without_an_allow_list(url):
    assert WorkerURLPolicy().check(url) == url


def test_a_link_local_or_metadata_host_is_accepted_when_a_pattern_names_it():
    policy = WorkerURLPolicy(["169.254.0.0/16", "metadata.google.internal:80"])
    assert policy.check("http://169.254.169.254") == "http://169.254.169.254"
    assert policy.check("http://metadata.google.internal") == "http://metadata.google.internal"
    with pytest.raises(InvalidWorkerURL):
        policy.check("http://[fe80::1]")


def test_a_kv_event_host_on_a_link_local_address_is_refused_unless_listed():
    with pytest.raises(InvalidWorkerURL, match="link-local or cloud-metadata"):
        WorkerURLPolicy().check_host("169.254.169.254")
    WorkerURLPolicy().check_host("127.0.0.1")
    WorkerURLPolicy(["169.254.169.254:8000"]).check_host("169.254.169.254")


@pytest.mark.parametrize("pattern", ["", "10.0.0.0/33", "host:port", "[::1", "a/b", "x:70000"])
def test_malformed_allow_list_patterns_are_refused_at_start_up(pattern):
    with pytest.raises(ValueError):
        WorkerURLPolicy([pattern])


@pytest.mark.parametrize("header,code", [
    (None, "missing_api_key"),
    ("Bearer wrong", "invalid_api_key"),
    ("Basic k1", "invalid_api_key"),
    ("Bearer k1x", "invalid_api_key"),
    ("Bearer \udcff", "invalid_api_key"),  # undecodable bytes as aiohttp hands them over
    ("Bearer \ud800k1", "invalid_api_key"),  # any other surrogate
])
def test_inference_calls_without_a_valid_api_key_get_a_401(header, code):
    with pytest.raises(OpenAIError) as refused:
        check_api_key(header, ["k1", "k2"])
    assert (refused.value.status, refused.value.code) == (401, code)


def test_an_admin_token_that_is_not_utf8_is_a_wrong_token_not_a_crash():
    from router.http.admin import check_token

    with pytest.raises(OpenAIError) as refused:
        check_token("Bearer \udcff\udcfe", "s3cret")
    assert (refused.value.status, refused.value.code) == (403, "invalid_token")


def test_any_configured_api_key_passes_and_none_configured_means_open():
    check_api_key("Bearer k2", ["k1", "k2"])
    check_api_key("bearer  k1 ", ["k1", "k2"])
    check_api_key(None, [])


@pytest.mark.parametrize("value", ["caf\u00e9", "a\x00b", "x" * 1025, "\udcc3"])
def test_headers_that_cannot_be_forwarded_to_a_worker_are_a_400(value):
    with pytest.raises(OpenAIError) as refused:
        forwardable("X-Request-Id", value)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "X-Request-Id", "invalid_header")


def test_printable_ascii_headers_are_forwarded_as_they_are():
    assert forwardable("X-Session-Id", "user-42 / tab 3") == "user-42 / tab 3"
