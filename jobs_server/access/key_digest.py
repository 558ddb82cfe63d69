"""API keys and their digests: what the tokens file stores instead of a key (stdlib only, so
`jobs-server hash-token` starts fast)."""

from __future__ import annotations

import hashlib
import re
import secrets

DIGEST_PREFIX = "sha256:"
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
# 32 random bytes: as strong as the digest that stands for the key.
KEY_BYTES = 32


def new_api_key() -> str:
    """A new random key (URL-safe base64, 43 characters)."""
    return secrets.token_urlsafe(KEY_BYTES)


def digest_of(key: str) -> str:
    """The key's `sha256:<64 lowercase hex>` digest, as the tokens file stores it."""
    # aiohttp decodes header bytes that are not UTF-8 as surrogates: hash the bytes that were
    # sent (they match no key) instead of failing on them.
    data = key.encode("utf-8", "surrogateescape")
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()
