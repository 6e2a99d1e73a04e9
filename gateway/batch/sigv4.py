"""AWS Signature Version 4 for S3 requests: the headers that authenticate one request.

The signature is an HMAC-SHA256 chain over a canonical form of the request:

    canonical request = the lines: method, canonical URI, canonical query, canonical headers,
                        signed header names, hex(SHA-256(payload))
    string to sign    = the lines: "AWS4-HMAC-SHA256", amz-date, scope,
                        hex(SHA-256(canonical request))
    signing key       = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), "s3"), "aws4_request")
    signature         = hex(HMAC(signing key, string to sign))

S3's flavour: the canonical URI is the path exactly as it goes on the wire (S3 neither
normalises nor re-encodes it), so the caller encodes an object key once with
:func:`uri_encode` and sends that path; the query is re-encoded and sorted; every header
handed to :func:`sign` is signed (``host``, ``x-amz-content-sha256`` and ``x-amz-date`` are
always added). Only the gateway's own S3 file store uses it (batch/s3_storage.py): boto3
would be a large dependency for five requests.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import parse_qsl, quote

import httpx

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Credentials:
    """An access key pair (and the session token of temporary credentials)."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def uri_encode(text: str, *, keep_slash: bool) -> str:
    """Percent-encode every byte but ``A-Za-z0-9-._~`` (and ``/`` in a path), uppercase hex:
    the one encoding SigV4 accepts."""
    return quote(text, safe="/-_.~" if keep_slash else "-_.~")


def canonical_query(query: str) -> str:
    """The query's pairs, decoded, re-encoded and sorted; a bare name gets ``=``."""
    pairs = parse_qsl(query, keep_blank_values=True)
    encoded = sorted(
        (uri_encode(k, keep_slash=False), uri_encode(v, keep_slash=False)) for k, v in pairs
    )
    return "&".join(f"{k}={v}" for k, v in encoded)


def canonical_request(
    method: str, url: httpx.URL, headers: Mapping[str, str], payload_sha256: str
) -> tuple[str, str]:
    """The canonical request and its signed header names (``;``-joined)."""
    values = {name.lower(): " ".join(str(v).split()) for name, v in headers.items()}
    names = sorted(values)
    lines = [
        method.upper(),
        url.raw_path.decode("ascii").partition("?")[0] or "/",
        canonical_query(url.query.decode("ascii")),
        "".join(f"{name}:{values[name]}\n" for name in names),
        ";".join(names),
        payload_sha256,
    ]
    return "\n".join(lines), ";".join(names)


def signing_key(secret_access_key: str, date: str, region: str, service: str) -> bytes:
    key = f"AWS4{secret_access_key}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def string_to_sign(amz_date: str, scope: str, canonical: str) -> str:
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"{ALGORITHM}\n{amz_date}\n{scope}\n{digest}"


def sign(
    method: str,
    url: httpx.URL,
    headers: Mapping[str, str],
    payload_sha256: str,
    credentials: Credentials,
    region: str,
    now: datetime | None = None,
    service: str = "s3",
) -> dict[str, str]:
    """``headers`` plus ``host``, ``x-amz-date``, ``x-amz-content-sha256`` (and
    ``x-amz-security-token`` for temporary credentials) and the ``Authorization`` that signs
    them all. ``url``'s path must already be encoded as it will be sent (:func:`uri_encode`)."""
    moment = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    amz_date = moment.strftime("%Y%m%dT%H%M%SZ")
    date = amz_date[:8]
    signed = {name.lower(): value for name, value in headers.items()}
    signed["host"] = url.netloc.decode("ascii")
    signed["x-amz-date"] = amz_date
    signed["x-amz-content-sha256"] = payload_sha256
    if credentials.session_token:
        signed["x-amz-security-token"] = credentials.session_token
    canonical, names = canonical_request(method, url, signed, payload_sha256)
    scope = f"{date}/{region}/{service}/aws4_request"
    key = signing_key(credentials.secret_access_key, date, region, service)
    signature = hmac.new(
        key, string_to_sign(amz_date, scope, canonical).encode(), hashlib.sha256
    ).hexdigest()
    signed["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key_id}/{scope}, "
        f"SignedHeaders={names}, Signature={signature}"
    )
    return signed
