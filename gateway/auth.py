"""Who is calling: API keys to tenants, admin keys (from the policy, the environment or a secret file).

Admin routes are closed unless the caller holds an admin key. The one exception is a gateway
that listens on loopback only and has no keys at all (the embedded default of `probex
serve`): there the local user is the operator. A gateway listening anywhere else refuses to
start without an admin key. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from gateway.errors import ApiError
from gateway.policy import LoadedPolicy

ADMIN_KEYS_ENV = "PROBEX_ADMIN_KEYS"  # "name:key,name:key"
ADMIN_KEYS_FILE_ENV = "PROBEX_ADMIN_KEYS_FILE"  # a file of "name:key" lines
HOW_TO_ADD_KEYS = (f"add one with {ADMIN_KEYS_ENV}=name:key, {ADMIN_KEYS_FILE_ENV}=FILE or --admin-key-file FILE"
                   " (lines of name:key), or admin_keys in the policy")


class AdminKeyError(ValueError):
    """Admin keys that cannot be read, or a gateway that would be open to the network without any."""


@dataclass(frozen=True)
class Caller:
    tenant: str
    is_admin: bool
    key_name: str | None = None  # the admin key's name (what the audit records; never the key)


def bearer_token(auth: str | None) -> str | None:
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return None


def parse_admin_keys(entries: list[str], where: str) -> dict[str, str]:
    """name -> key from `name:key` entries (a bare key is named after where it came from)."""
    keys: dict[str, str] = {}
    for number, entry in enumerate(entries, 1):
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        name, sep, key = entry.partition(":")
        if not sep:
            name, key = f"{where}#{number}", name
        name, key = name.strip(), key.strip()
        if not name or not key:
            raise AdminKeyError(f"{where}: entry {number} has an empty name or key (expected name:key)")
        if name in keys:
            raise AdminKeyError(f"{where}: admin key name {name!r} appears twice")
        keys[name] = key
    return keys


def load_admin_keys(key_file: str | os.PathLike | None = None, environ: dict | None = None) -> dict[str, str]:
    """Admin keys from $PROBEX_ADMIN_KEYS and a secret file (`key_file`, else $PROBEX_ADMIN_KEYS_FILE)."""
    environ = os.environ if environ is None else environ
    keys = parse_admin_keys(environ.get(ADMIN_KEYS_ENV, "").split(","), ADMIN_KEYS_ENV)
    key_file = key_file or environ.get(ADMIN_KEYS_FILE_ENV)
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise AdminKeyError(f"cannot read admin key file {key_file}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        for name, key in parse_admin_keys(lines, str(key_file)).items():
            if name in keys:
                raise AdminKeyError(f"admin key name {name!r} is given twice ({ADMIN_KEYS_ENV} and {key_file})")
            keys[name] = key
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def policy_admin_keys(policy: LoadedPolicy) -> dict[str, str]:
    keys = policy.policy.admin_keys
    if isinstance(keys, dict):
        return {f"policy:{name}": key for name, key in keys.items()}
    return {f"policy:admin_keys[{i}]": key for i, key in enumerate(keys)}


def _matches(token: bytes, key: str) -> bool:
    return hmac.compare_digest(token, key.encode("utf-8", "surrogatepass"))


class Authenticator:
    """Maps a bearer token to its caller under the current policy and the configured admin keys."""

    def __init__(self, admin_keys: dict[str, str], listen_host: str) -> None:
        self.admin_keys = dict(admin_keys)
        self.loopback = is_loopback(listen_host)

    def check_startup(self, policy: LoadedPolicy, listen_host: str) -> None:
        if not self.loopback and not self.admin_keys and not policy.policy.admin_keys:
            raise AdminKeyError(f"listening on {listen_host} (beyond loopback) needs an admin key; {HOW_TO_ADD_KEYS}")

    def identify(self, token: str | None, policy: LoadedPolicy) -> Caller:
        api_keys = policy.policy.api_keys
        if token is not None:
            raw = token.encode("utf-8", "surrogatepass")
            admin = None
            # Every key is compared (no early exit), so timing does not say how far a guess got.
            for name, key in (*self.admin_keys.items(), *policy_admin_keys(policy).items()):
                if _matches(raw, key) and admin is None:
                    admin = name
            if admin is not None:
                return Caller("default", True, admin)
            tenant = None
            for key, name in api_keys.items():
                if _matches(raw, key) and tenant is None:
                    tenant = name
            if tenant is not None:
                return Caller(tenant, False)
        if not api_keys:
            return Caller("default", False)
        if token is None:
            raise ApiError(401, "missing API key (Authorization: Bearer <key>)", kind="authentication_error",
                           code="invalid_api_key")
        raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    def admin_open(self, policy: LoadedPolicy) -> bool:
        """Loopback only, and no keys of any kind: the local user is the operator."""
        return self.loopback and not self.admin_keys and not policy.policy.admin_keys and not policy.policy.api_keys

    def authenticate(self, request: Request, policy: LoadedPolicy) -> Caller:
        return self.identify(bearer_token(request.headers.get("authorization")), policy)

    def require_admin(self, request: Request, policy: LoadedPolicy) -> Caller:
        """The admin caller, or a 401."""
        token = bearer_token(request.headers.get("authorization"))
        if self.admin_open(policy):
            return Caller("default", True, "local (loopback gateway without keys)")
        caller = None
        if token is not None:
            try:
                caller = self.identify(token, policy)
            except ApiError:
                caller = None
        if caller is None or not caller.is_admin:
            raise ApiError(401, "admin key required (Authorization: Bearer <admin key>)",
                           kind="authentication_error", code="invalid_api_key")
        return caller
