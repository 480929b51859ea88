"""Keys for the fronts and the Admin service: read from files or the environment, compared in
constant time, never logged.

Inference API keys (``auth.api_key_file``) and admin keys (``gateway.admin_key_file`` or
``$BATON_ADMIN_KEY``) are separate sets, and a key may not be in both: an inference client must
never be able to resize or drain the cluster.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Iterable, Mapping

from protos.errors import ConfigError

ADMIN_KEY_ENV = "BATON_ADMIN_KEY"


class KeySet(frozenset):
    """Accepted keys. Its repr and str say how many, never the keys themselves, so a log line or
    a traceback that shows one leaks nothing."""

    def __repr__(self) -> str:
        return f"KeySet(<{len(self)} keys>)"

    __str__ = __repr__

    def accepts(self, offered: str) -> bool:
        """Whether ``offered`` is one of the keys, compared with ``hmac.compare_digest``
        against every key (no early exit that would tell which one came close)."""
        offered_bytes = offered.encode()
        matched = False
        for key in self:
            matched |= hmac.compare_digest(offered_bytes, key.encode())
        return bool(offered) and matched


def read_key_file(path: str | None, field: str) -> KeySet:
    """Keys in ``path``, one per line (blank lines and ``#`` comments skipped); none without a
    path. ``ConfigError`` naming ``field`` when the file is unreadable or holds no key."""
    if path is None:
        return KeySet()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}") from exc
    keys = KeySet(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"{field}: {path} holds no key")
    return keys


def read_api_keys(path: str | None) -> KeySet:
    """Accepted inference API keys, one per line of ``path`` (``auth.api_key_file``)."""
    return read_key_file(path, "auth.api_key_file")


def read_admin_keys(admin_key_file: str | None, api_keys: Iterable[str] = (),
                    environ: Mapping[str, str] = os.environ) -> KeySet:
    """The admin keys: from ``gateway.admin_key_file``, else the one in ``$BATON_ADMIN_KEY``,
    else none (the Admin service is off). ``ConfigError`` when one of them is also an inference
    API key."""
    keys = read_key_file(admin_key_file, "gateway.admin_key_file")
    if admin_key_file is None and environ.get(ADMIN_KEY_ENV, "").strip():
        keys = KeySet({environ[ADMIN_KEY_ENV].strip()})
    if keys & frozenset(api_keys):
        source = "gateway.admin_key_file" if admin_key_file else f"${ADMIN_KEY_ENV}"
        raise ConfigError(f"{source} holds a key that auth.api_key_file also accepts: an inference "
                          "key must not grant admin; give the Admin service its own key")
    return keys


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key a call offers in ``authorization: Bearer <key>`` metadata ("" when none)."""
    for name, value in metadata or ():
        if name.lower() == "authorization" and isinstance(value, str):
            if value[:7].lower() == "bearer ":
                return value[7:].strip()
    return ""
