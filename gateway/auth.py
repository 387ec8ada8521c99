"""Who is calling: API keys to tenants, admin keys."""

from __future__ import annotations

from fastapi import Request

from gateway.errors import ApiError
from gateway.policy import LoadedPolicy


def bearer_token(auth: str | None) -> str | None:
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return None


def authenticate(request: Request, policy: LoadedPolicy) -> tuple[str, bool]:
    """(tenant, is_admin). Without configured keys (embedded default) everyone is the default tenant."""
    return authenticate_token(bearer_token(request.headers.get("authorization")), policy)


def authenticate_token(token: str | None, policy: LoadedPolicy) -> tuple[str, bool]:
    keys, admins = policy.policy.api_keys, policy.policy.admin_keys
    if token is not None and token in admins:
        return "default", True
    if not keys:
        return "default", False
    if token is None:
        raise ApiError(401, "missing API key (Authorization: Bearer <key>)", kind="authentication_error",
                       code="invalid_api_key")
    if token not in keys:
        raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")
    return keys[token], False


def require_admin(request: Request, policy: LoadedPolicy) -> None:
    tenant, is_admin = authenticate(request, policy)
    open_embedded = not policy.policy.api_keys and not policy.policy.admin_keys
    if not (is_admin or open_embedded):
        raise ApiError(401, "admin key required", kind="authentication_error", code="invalid_api_key")
