"""Bearer tokens → tenants: parsing, constant-time checks, demo mode, salt isolation, sharing."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument, Unauthenticated
from services.router import tenants as tenants_mod
from services.router.tenants import PUBLIC_TENANT, TenantRegistry, load_salt_secret, parse_tenants, shared_salt, tenant_salt

SECRET = b"0123456789abcdef-test-secret"


def test_parse_pairs_json_and_file(tmp_path):
    assert parse_tenants("") == {}
    assert parse_tenants(" tokA=alice , tokB=bob ") == {"tokA": "alice", "tokB": "bob"}
    # base64-style tokens may end in '=': the last '=' separates the tenant
    assert parse_tenants("YWJj==alice") == {"YWJj=": "alice"}
    assert parse_tenants('{"t1": "alice"}') == {"t1": "alice"}
    f = tmp_path / "tenants.json"
    f.write_text(json.dumps([{"token": "t1", "tenant": "alice"}, {"token": "t2", "tenant": "bob"}]))
    assert parse_tenants(str(f)) == {"t1": "alice", "t2": "bob"}


@pytest.mark.parametrize(
    "spec",
    ["tokA", "=alice", "tok=", "a=x,a=y", "{not json", '[{"token": "a"}]', "/nonexistent/tenants.json", '["a"]'],
)
def test_bad_tenant_specs_are_invalid_argument(spec):
    with pytest.raises(InvalidArgument):
        parse_tenants(spec)


def test_error_messages_never_echo_tokens():
    with pytest.raises(InvalidArgument) as exc:
        parse_tenants("supersecret=alice,supersecret=bob")
    assert "supersecret" not in exc.value.message


def test_known_tokens_map_to_their_tenant():
    reg = TenantRegistry({"tokA": "alice", "tokB": "bob", "tokA2": "alice"}, secret=SECRET)
    assert reg.authenticate("tokA").name == "alice"
    assert reg.authenticate("tokA2").name == "alice"
    assert reg.authenticate("tokB").name == "bob"
    assert reg.authenticate("tokA").cache_salt == reg.authenticate("tokA2").cache_salt
    assert not reg.demo_mode


@pytest.mark.parametrize("token", [None, "", "tokC", "tokA ", "tok", "tokAA"])
def test_missing_or_unknown_tokens_are_unauthenticated(token):
    reg = TenantRegistry({"tokA": "alice"}, secret=SECRET)
    with pytest.raises(Unauthenticated):
        reg.authenticate(token)


def test_every_configured_token_is_compared_without_early_exit(monkeypatch):
    calls = []
    real = tenants_mod.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", counting)
    reg = TenantRegistry({f"tok{i}": f"t{i}" for i in range(5)})
    for token in ("tok0", "tok4", "nope", "a-much-longer-token-than-any-configured-one"):
        calls.clear()
        try:
            reg.authenticate(token)
        except Unauthenticated:
            pass
        assert len(calls) == 5, "a match on the first entry must not stop the loop"
        # digests are compared, so lengths are equal whatever the presented token's length
        assert all(a == b == 32 for a, b in calls)


def test_demo_mode_everyone_is_public():
    reg = TenantRegistry({}, secret=SECRET)
    assert reg.demo_mode
    assert reg.authenticate(None).name == PUBLIC_TENANT
    assert reg.authenticate("anything").name == PUBLIC_TENANT
    assert reg.authenticate(None).cache_salt == tenant_salt(PUBLIC_TENANT, SECRET)


def test_salts_isolate_tenants_and_come_only_from_the_name():
    reg = TenantRegistry({"tokA": "alice", "tokB": "bob"}, secret=SECRET)
    alice, bob = reg.authenticate("tokA"), reg.authenticate("tokB")
    assert alice.cache_salt != bob.cache_salt
    assert alice.cache_salt == tenant_salt("alice", SECRET)  # same name, same namespace, any registry
    assert TenantRegistry({"other-token": "alice"}, secret=SECRET).authenticate("other-token").cache_salt == alice.cache_salt
    assert len(alice.cache_salt) == 16
    assert tenant_salt("alice", SECRET) != tenant_salt("alicf", SECRET)


def test_sharing_is_opt_in():
    reg = TenantRegistry({"a": "alice", "b": "bob", "c": "carol"}, shared=["alice", "bob"], secret=SECRET)
    alice, bob, carol = (reg.authenticate(t) for t in "abc")
    assert alice.cache_salt == bob.cache_salt == shared_salt(SECRET)
    assert carol.cache_salt == tenant_salt("carol", SECRET) != shared_salt(SECRET)
    # a tenant literally named like the shared namespace still gets its own salt
    assert TenantRegistry({"x": "shared"}, secret=SECRET).authenticate("x").cache_salt != shared_salt(SECRET)


def test_shared_tenants_must_exist():
    with pytest.raises(InvalidArgument):
        TenantRegistry({"a": "alice"}, shared=["mallory"])
    reg = TenantRegistry.from_settings("a=alice,b=bob", "alice, bob")
    assert reg.authenticate("a").cache_salt == reg.authenticate("b").cache_salt


def test_salts_are_keyed_by_the_server_secret(tmp_path):
    """Issue 8 row 6: without the secret nobody can compute a tenant's salt (and probe its
    namespace): the same name under another secret is another namespace."""
    other = b"another-secret-of-16+bytes"
    assert tenant_salt("alice", SECRET) != tenant_salt("alice", other)
    assert shared_salt(SECRET) != shared_salt(other)
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_salt_secret(str(path)) == SECRET
    assert load_salt_secret("", SECRET.decode()) == SECRET
    assert len(load_salt_secret()) == 32 and load_salt_secret() != load_salt_secret()  # random per process
    with pytest.raises(InvalidArgument):
        load_salt_secret("", "short")
    with pytest.raises(InvalidArgument):
        load_salt_secret(str(tmp_path / "missing"))
