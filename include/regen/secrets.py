"""What counts as a secret wherever regen shows, stores or hands on values: a name of any
spelling a person might give the key (``api_key``, ``API_KEY``, ``apiKey``, ``--api-key``), and the
value after a key flag inside another value (``extra_server_args: "--api-key sk-..."``). One
place, used by the conf scrub, config error messages and the servers' environment."""

from __future__ import annotations

import re
from typing import Any

SECRET_WORDS = frozenset({"key", "apikey", "secret", "password", "passwd", "token", "credential", "credentials",
                          "authorization", "bearer", "pat", "privatekey"})
# A name ending in one of these names where a secret is, not the secret (REGEN_KEY_DIR).
WHERE_WORDS = frozenset({"dir", "file", "path", "home", "cmd"})
REDACTED = "<redacted>"
_KEY_FLAG = re.compile(r"(--?(?:api[-_]?key|token|password|secret)(?:=|\s+))(\S+)", re.IGNORECASE)


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower())


def is_secret_name(name: str) -> bool:
    """A field, conf key or environment variable that holds a secret, under any spelling."""
    words = _words(name)
    return bool(words) and words[-1] not in WHERE_WORDS and (
        bool(SECRET_WORDS & set(words)) or "".join(words) in SECRET_WORDS)


def flagged_values(value: Any) -> set[str]:
    """The values given after a key flag anywhere in ``value`` (a string, a list of arguments,
    nested): ``--api-key X``, ``--api-key=X``, and ``["--api-key", "X"]``."""
    found: set[str] = set()
    if isinstance(value, str):
        found |= {m.group(2) for m in _KEY_FLAG.finditer(value)}
    elif isinstance(value, (list, tuple)):
        for flag, following in zip(value, [*value[1:], None]):
            if isinstance(flag, str) and isinstance(following, str) and _KEY_FLAG.fullmatch(flag + " " + following):
                found.add(following)
        for item in value:
            found |= flagged_values(item)
    elif isinstance(value, dict):
        for item in value.values():
            found |= flagged_values(item)
    return found


def scrubbed(value: Any) -> Any:
    """``value`` with every secret-named entry's value and every flagged value replaced, at any depth."""
    flagged = flagged_values(value)

    def clean(item: Any) -> Any:
        if isinstance(item, dict):
            return {k: REDACTED if is_secret_name(k) and item[k] not in (None, "", REDACTED) else clean(v)
                    for k, v in item.items()}
        if isinstance(item, list):
            return [clean(v) for v in item]
        if isinstance(item, str):
            for secret in flagged:
                item = item.replace(secret, REDACTED)
        return item

    return clean(value)
