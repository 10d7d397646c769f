"""Optional API keys: `Authorization: Bearer <key>` on every path but /health.

Keys come from an env var (comma-separated) and/or a file (one per line) named in the config, read
once when the ingress starts. They are compared in constant time and never logged, echoed in an
error, or shown by a repr.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Iterable, Optional

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from deployments import metrics
from deployments.errors import APIError

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key


class APIKeyConfigError(ValueError):
    """Keys are configured but none can be read: the ingress refuses to start (the deploy fails)."""


class APIKeys:
    """The accepted keys, as bytes. Its repr says how many, never which."""

    def __init__(self, keys: Iterable[str]):
        self._keys = tuple(k.encode() for k in keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"APIKeys({len(self._keys)} keys)"

    def accepts(self, presented: bytes) -> bool:
        # Compares with every key, no early exit: the time taken says nothing about which matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(key, presented)
        return matched


def load_api_keys(env_name: Optional[str], key_file: Optional[str]) -> Optional[APIKeys]:
    """The configured keys; None when neither source is configured (no auth)."""
    if env_name is None and key_file is None:
        return None
    keys: list = []
    if env_name is not None:
        value = os.environ.get(env_name, "")
        if not value.strip():
            raise APIKeyConfigError(
                f"ingress.api_keys_env names the env var {env_name}, which is unset or empty in the ingress "
                "process: set it there (serve_config runtime_env.env_vars) or drop api_keys_env"
            )
        keys += [k.strip() for k in value.split(",")]
    if key_file is not None:
        try:
            keys += [line.strip() for line in Path(key_file).read_text().splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise APIKeyConfigError(
                f"ingress.api_key_file {key_file!r} cannot be read: "
                f"{type(e).__name__}: {e.strerror if isinstance(e, OSError) else 'not UTF-8'}"
            ) from None
    keys = [k for k in keys if k]
    if not keys:
        raise APIKeyConfigError(
            "API keys are configured (ingress.api_keys_env / ingress.api_key_file) "
            "but none was found: refusing to serve without them"
        )
    return APIKeys(keys)


class APIKeyAuth:
    """ASGI middleware: 401 with OpenAI's error body unless the request carries an accepted key."""

    def __init__(self, app: ASGIApp, keys: APIKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return await _refuse("Missing API key: send it as `Authorization: Bearer <key>`.", scope, receive, send)
        if not self.keys.accepts(token.strip()):
            return await _refuse("Incorrect API key provided.", scope, receive, send)  # never echo the key
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path below the application's route prefix (Serve puts the prefix in root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


async def _refuse(message: str, scope: Scope, receive: Receive, send: Send) -> None:
    e = APIError(401, message, code="invalid_api_key")
    metrics.count_error(e.status_code, e.type)
    await JSONResponse(e.body(), 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
