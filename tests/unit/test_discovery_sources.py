"""Membership sources: the diff rule, the watched file, and the config sections that name
them. DNS against a real dnsmasq is in tests/integration/test_discovery_dns.py."""

import os

import pytest

from prefixroute.core.errors import InputError
from prefixroute.edges.discovery.events import (ADDED, DRAINING, REMOVED, RESET, Member,
                                                diff_members)
from prefixroute.edges.discovery.file import FileSource
from prefixroute.edges.gateway.config import BackendConfig, hash_api_key, parse_config


def member(name, url=None, **kw):
    return Member(BackendConfig(name, url or f"http://{name}.test:8000", ("tiny",)), **kw)


def kinds(events):
    return [(e.kind, e.name) for e in events]


# -- the diff rule -------------------------------------------------------------------------

def test_a_new_name_is_added_and_a_missing_one_removed():
    old = {"a": member("a"), "b": member("b")}
    new = {"b": member("b"), "c": member("c")}
    assert kinds(diff_members(old, new)) == [(REMOVED, "a"), (ADDED, "c")]


def test_same_listing_gives_no_event():
    assert diff_members({"a": member("a")}, {"a": member("a")}) == []


def test_a_moved_address_is_removed_then_added_cold():
    old = {"a": member("a", "http://10.0.0.1:8000")}
    new = {"a": member("a", "http://10.0.0.2:8000")}
    events = diff_members(old, new)
    assert kinds(events) == [(REMOVED, "a"), (ADDED, "a")]
    assert events[1].member.backend.url == "http://10.0.0.2:8000"


def test_a_higher_generation_resets_and_draining_flags_drain_and_return():
    assert kinds(diff_members({"a": member("a")}, {"a": member("a", generation=1)})) == \
        [(RESET, "a")]
    assert kinds(diff_members({"a": member("a")}, {"a": member("a", draining=True)})) == \
        [(DRAINING, "a")]
    assert kinds(diff_members({"a": member("a", draining=True)}, {"a": member("a")})) == \
        [(ADDED, "a")]
    assert kinds(diff_members({}, {"a": member("a", draining=True)})) == \
        [(ADDED, "a"), (DRAINING, "a")]


# -- the watched file ----------------------------------------------------------------------

def write(path, text):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a new inode: seen as a change even within one mtime tick


def test_file_source_lists_then_follows_edits(tmp_path):
    path = tmp_path / "members.yaml"
    write(path, "- {name: a, url: 'http://127.0.0.1:9001'}\n")
    source = FileSource(path, {"models": ["tiny"]})
    events = source.poll_now()
    assert kinds(events) == [(ADDED, "a")]
    assert events[0].member.backend.models == ("tiny",)  # from backend_defaults
    assert source.poll_now() == []  # unchanged
    write(path, '[{"url": "http://127.0.0.1:9002", "models": ["other"]},'
                ' {"name": "a", "url": "http://127.0.0.1:9001", "generation": 2}]')
    events = source.poll_now()
    assert kinds(events) == [(RESET, "a"), (ADDED, "127.0.0.1:9002")]  # JSON works too
    assert events[1].member.backend.models == ("other",)  # its own beats the default


def test_an_invalid_file_keeps_the_old_list_and_is_logged_once(tmp_path, caplog):
    path = tmp_path / "members.yaml"
    write(path, "- {name: a, url: 'http://127.0.0.1:9001'}\n")
    source = FileSource(path, {})
    source.poll_now()
    write(path, "- {name: a, url: 'ftp://nope'}\n")
    assert source.poll_now() == []
    assert "members.yaml:1" in source.last_error and "backends" not in source.last_error
    assert "[0].url" in source.last_error
    assert set(source.members) == {"a"}
    os.utime(path, ns=(1, 1))  # touched again, same error: no second log line
    assert source.poll_now() == []
    assert sum("membership file invalid" in r.message for r in caplog.records) == 1
    path.unlink()
    assert source.poll_now() == [] and set(source.members) == {"a"}
    write(path, "")  # an empty file: no replicas (scaled to zero)
    assert kinds(source.poll_now()) == [(REMOVED, "a")]


def test_file_entries_with_one_name_twice_are_refused(tmp_path):
    path = tmp_path / "members.yaml"
    write(path, "- {name: a, url: 'http://127.0.0.1:9001'}\n"
                "- {name: a, url: 'http://127.0.0.1:9002'}\n")
    source = FileSource(path, {})
    assert source.poll_now() == []
    assert "used twice" in source.last_error


# -- config ---------------------------------------------------------------------------------

def base_config(**extra):
    data = {"server_secret": {"env": "PR_DISCOVERY_TEST_SECRET"},
            "tenants": [{"name": "a", "api_key_sha256": hash_api_key("k")}]}
    data.update(extra)
    return data


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("PR_DISCOVERY_TEST_SECRET", "5e" * 32)


def test_discovery_replaces_the_required_backends_list(tmp_path):
    config = parse_config(base_config(
        discovery={"file": "members.yaml",
                   "dns": {"name": "vllm.default.svc.cluster.local", "port": 8000,
                           "server": "10.96.0.10:53"}},
        backend_defaults={"models": ["tiny"], "scheduling_policy": "priority"}),
        "g.yaml", tmp_path)
    assert config.backends == ()
    assert config.discovery.file == tmp_path / "members.yaml"
    assert config.discovery.dns.name == "vllm.default.svc.cluster.local."
    assert config.discovery.dns.interval_s == 5.0  # CoreDNS's kubernetes TTL
    assert config.backend_defaults["scheduling_policy"] == "priority"


@pytest.mark.parametrize("extra, message", [
    ({}, "is required (a list) (field 'backends')"),
    ({"discovery": {"dns": {"name": "x.test"}}},
     "field 'discovery.dns.port'"),
    ({"discovery": {"dns": {"name": "x.test", "port": 80, "server": "10.0.0.1"}}},
     "expected HOST:PORT"),
    ({"discovery": {}}, "give file (a watched list of backends) and/or dns"),
    ({"discovery": {"file": "m.yaml"}, "backend_defaults": {"url": "http://x:1"}},
     "unknown key 'url'"),
    ({"discovery": {"file": "m.yaml"}, "backend_defaults": {"scheduling_policy": "lifo"}},
     "scheduling_policy"),
])
def test_bad_discovery_settings_name_the_field(extra, message):
    with pytest.raises(InputError) as info:
        parse_config(base_config(**extra), "g.yaml")
    assert message in str(info.value)
