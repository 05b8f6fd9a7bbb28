"""Secrets kept out of what otel-rl writes: config values under secret-looking keys, and credentials
inside string values (URL userinfo, secret query parameters).  Used wherever a config or a setting is
logged to a tracker, written to a spool or a log line; tracker plug-ins use it for their own settings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# A key is secret when its last word names a secret (``api_key``, ``hf_token``,
# ``accessToken``, ``db_password``, ``otlp_headers``); keys that merely contain
# such a word (``ppo_max_token_len_per_gpu``, ``token2text``, ``tokenizer``) are not.
SECRET_KEY_RE = re.compile(
    r"(?:^|_)(api_?keys?|access_?key|secret_?key|private_?key|token|secret|password|passwd|pwd"
    r"|credentials?|auth|authorization|headers?)$"
)


def is_secret_key(key: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()
    return SECRET_KEY_RE.search(re.sub(r"[^a-z0-9]+", "_", words).strip("_")) is not None


REDACTED = "***"

# Credentials inside a value: the userinfo of a URL (``https://user:pw@host``, ``s3://key:secret@bucket``)
# and query parameters named like a secret (``?token=``, ``&sig=``, ``X-Amz-Signature=``).
_URL_USERINFO_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/?#\s]+)@")
_QUERY_PARAM_RE = re.compile(r"([?&;])([^=&;#\s]+)=([^&;#\s]*)")
_SECRET_PARAM_RE = re.compile(r"(?:^|_)(sig|signature|key|keys|credential|sas|security_token|session_token|code)$")


def _is_secret_param(name: str) -> bool:
    if is_secret_key(name):
        return True
    words = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return _SECRET_PARAM_RE.search(words) is not None


def _redact_param(m: re.Match) -> str:
    if m.group(3) and _is_secret_param(m.group(2)):
        return f"{m.group(1)}{m.group(2)}={REDACTED}"
    return m.group(0)


def redact_text(text: str) -> str:
    """`text` with credentials inside URL-shaped parts replaced by '***': the userinfo
    (``http://***@host``) and the values of query parameters named like a secret."""
    if "@" not in text and "=" not in text:
        return text
    if "://" in text:
        text = _URL_USERINFO_RE.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    if "=" in text and ("?" in text or "&" in text or ";" in text):
        text = _QUERY_PARAM_RE.sub(_redact_param, text)
    return text


def scrub_secrets(obj: Any) -> Any:
    """Copy of a config with values of secret-looking keys replaced by '***' (None stays None), and
    credentials inside every string value redacted (`redact_text`: URL userinfo, secret query parameters)."""
    if isinstance(obj, Mapping):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and is_secret_key(k) and v is not None and not isinstance(v, Mapping)
                else scrub_secrets(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj)
    return obj
