"""Bearer tokens → tenants → cache namespaces. Pure: no network, no clock.

* Configured tenants (setting ``tenants``): ``"tokenA=alice,tokenB=bob"``, inline JSON, or the path
  of a JSON file holding ``{"tokenA": "alice", ...}`` or ``[{"token": ..., "tenant": ...}, ...]``.
  A missing or unknown token is UNAUTHENTICATED.
* No tenants configured (demo mode): every caller is the ``public`` tenant, token or not.
* The cache salt that separates KV namespaces is an HMAC of the tenant's *name* under a server
  secret — never of anything in the request body — so two tenants never hit each other's cache,
  and nobody without the secret can compute a tenant's salt (and probe its namespace)::

      token ──▶ tenant "alice" ──▶ salt = HMAC(secret, "tandem/tenant/alice") ──▶ kvstore namespace
      token ──▶ tenant "bob"   ──▶ salt = HMAC(secret, "tandem/tenant/bob")   ──▶ another namespace

  The secret comes from ``--salt-secret-file`` or ``TANDEM_ROUTER_SALT_SECRET``; every router of a
  deployment needs the same one (else they share no cache). Unset: a random one per process.

* Sharing is opt-in: tenants listed in ``shared_tenants`` all get the salt of one shared
  namespace, so they reuse each other's prefixes (and only theirs).

Token checks are constant-time: the presented token's sha256 is compared with
``hmac.compare_digest`` against the sha256 of *every* configured token, with no early exit, so
neither timing nor length reveals which token or prefix was close.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, Unauthenticated

PUBLIC_TENANT = "public"
_TENANT_SALT_PREFIX = b"tandem/tenant/"
_SHARED_SALT_INPUT = b"tandem/shared-namespace"
SALT_BYTES = 16


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller: its name and the cache salt of its KV namespace."""

    name: str
    cache_salt: bytes

    @property
    def scope(self) -> str:
        """A short tag of the tenant's name: request ids are unique per tenant, so the router
        prefixes the ids it sends on with it (two tenants may both use "req-1")."""
        return hashlib.blake2b(self.name.encode("utf-8"), digest_size=6).hexdigest()


def tenant_salt(name: str, secret: bytes) -> bytes:
    """The cache salt of tenant ``name``'s private namespace under ``secret`` (pure)."""
    return hmac.new(secret, _TENANT_SALT_PREFIX + name.encode("utf-8"), hashlib.sha256).digest()[:SALT_BYTES]


def shared_salt(secret: bytes) -> bytes:
    """The cache salt of the opt-in shared namespace (pure; differs from every tenant's)."""
    return hmac.new(secret, _SHARED_SALT_INPUT, hashlib.sha256).digest()[:SALT_BYTES]


def load_salt_secret(path: str = "", value: str = "") -> bytes:
    """The salt secret from a file (stripped) or a value; a random one when both are empty.
    Shorter than 16 bytes is InvalidArgument (read-only apart from reading the file)."""
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            raise InvalidArgument(f"cannot read the salt secret file {path!r}: {exc.strerror or exc}") from None
    else:
        data = value.encode("utf-8")
    if not data:
        return secrets.token_bytes(32)
    if len(data) < 16:
        raise InvalidArgument("the salt secret must be at least 16 bytes")
    return data


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _pairs_from_json(data) -> list[tuple[str, str]]:
    if isinstance(data, dict):
        return [(str(k), v) for k, v in data.items()]
    if isinstance(data, list):
        pairs = []
        for i, item in enumerate(data):
            if not isinstance(item, dict) or "token" not in item or "tenant" not in item:
                raise InvalidArgument(f"tenants entry {i} must be an object with 'token' and 'tenant'")
            pairs.append((item["token"], item["tenant"]))
        return pairs
    raise InvalidArgument("tenants JSON must be an object {token: tenant} or a list of {token, tenant}")


def parse_tenants(spec: str) -> dict[str, str]:
    """Parse the ``tenants`` setting into ``{token: tenant}`` (reads a file if given a path).

    Accepts ``"tok=alice,tok2=bob"`` (a token may itself contain ``=``: the last one splits),
    inline JSON, or a path to a JSON file; empty means no tenants. Duplicate or empty tokens and
    names are InvalidArgument; token values are never echoed in messages.
    """
    spec = (spec or "").strip()
    if not spec:
        return {}
    if spec[0] in "{[":
        pairs = _pairs_from_json(_load_json(spec, "inline tenants JSON"))
    elif spec.endswith(".json") or Path(spec).is_file():
        try:
            text = Path(spec).read_text()
        except OSError as exc:
            raise InvalidArgument(f"cannot read tenants file {spec!r}: {exc.strerror or exc}") from None
        pairs = _pairs_from_json(_load_json(text, f"tenants file {spec!r}"))
    else:
        pairs = []
        for i, item in enumerate(p for p in spec.split(",") if p.strip()):
            token, sep, name = item.strip().rpartition("=")
            if not sep:
                raise InvalidArgument(f"tenants entry {i} must look like token=tenant")
            pairs.append((token, name))
    tokens: dict[str, str] = {}
    for i, (token, name) in enumerate(pairs):
        if not isinstance(token, str) or not isinstance(name, str):
            raise InvalidArgument(f"tenants entry {i}: token and tenant must be strings")
        token, name = token.strip(), name.strip()
        if not token or not name:
            raise InvalidArgument(f"tenants entry {i}: empty token or tenant name")
        if token in tokens:
            raise InvalidArgument(f"tenants entry {i} repeats a token of an earlier entry")
        tokens[token] = name
    return tokens


def _load_json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}") from None


class TenantRegistry:
    """Authenticates bearer tokens; immutable after construction."""

    def __init__(self, tokens: Mapping[str, str], *, shared: Iterable[str] = (), secret: bytes | None = None):
        if any(not token or not name for token, name in tokens.items()):
            raise InvalidArgument("tenant tokens and names must be non-empty")
        names = set(tokens.values())
        shared = {s.strip() for s in shared if s.strip()}
        unknown = shared - names if tokens else set()
        if unknown:
            raise InvalidArgument(f"shared_tenants names tenants without a token: {sorted(unknown)}")
        self._shared = frozenset(shared)
        self._secret = secret if secret else secrets.token_bytes(32)
        self._tenants = {name: self._make(name) for name in names}
        self._digests = [(_digest(token), name) for token, name in tokens.items()]
        self._public = Tenant(PUBLIC_TENANT, tenant_salt(PUBLIC_TENANT, self._secret))

    @classmethod
    def from_settings(cls, tenants: str, shared_tenants: str = "", secret: bytes | None = None) -> TenantRegistry:
        """Build from the router settings' strings (see :func:`parse_tenants`)."""
        return cls(parse_tenants(tenants), shared=shared_tenants.split(","), secret=secret)

    def _make(self, name: str) -> Tenant:
        return Tenant(name, shared_salt(self._secret) if name in self._shared else tenant_salt(name, self._secret))

    @property
    def demo_mode(self) -> bool:
        """True when no tenants are configured (everyone is ``public``)."""
        return not self._digests

    @property
    def tenant_names(self) -> list[str]:
        return sorted(self._tenants)

    def authenticate(self, token: str | None) -> Tenant:
        """The tenant owning ``token`` (read-only). Unauthenticated if tenants are configured and
        the token is missing or unknown; in demo mode always the public tenant."""
        if self.demo_mode:
            return self._public
        presented = _digest(token or "")
        found: str | None = None
        for digest, name in self._digests:  # every entry, no early exit (constant time)
            if hmac.compare_digest(presented, digest):
                found = name
        if token is None or found is None:
            raise Unauthenticated("missing or unknown bearer token (metadata 'authorization: Bearer <token>')")
        return self._tenants[found]
