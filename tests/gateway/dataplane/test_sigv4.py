"""The SigV4 signer against the examples AWS publishes for S3 ("Signature Calculations for the
Authorization Header", docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html):
the example key pair, bucket ``examplebucket`` in us-east-1, 24 May 2013 00:00:00 UTC, and the
signatures, intermediate hashes and signing key printed there. None of the expected values
below was computed by this code."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import httpx

from gateway.batch.sigv4 import (
    EMPTY_SHA256,
    Credentials,
    canonical_query,
    canonical_request,
    sign,
    signing_key,
    string_to_sign,
    uri_encode,
)

EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime(2013, 5, 24, 0, 0, 0, tzinfo=timezone.utc)
HOST = "https://examplebucket.s3.amazonaws.com"
SCOPE = "20130524/us-east-1/s3/aws4_request"
CREDENTIAL = f"Credential=AKIAIOSFODNN7EXAMPLE/{SCOPE}"


def signature_of(headers: dict[str, str]) -> str:
    return headers["authorization"].rpartition("Signature=")[2]


def test_get_object_example_step_by_step() -> None:
    url = httpx.URL(f"{HOST}/test.txt")
    headers = sign("GET", url, {"Range": "bytes=0-9"}, EMPTY_SHA256, EXAMPLE, "us-east-1", WHEN)
    assert EMPTY_SHA256 == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    # the published canonical request, string to sign and signing key
    canonical, names = canonical_request(
        "GET", url, {k: v for k, v in headers.items() if k != "authorization"}, EMPTY_SHA256
    )
    assert canonical == (
        "GET\n/test.txt\n\n"
        "host:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
        f"x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:20130524T000000Z\n\n"
        f"host;range;x-amz-content-sha256;x-amz-date\n{EMPTY_SHA256}"
    )
    to_sign = string_to_sign("20130524T000000Z", SCOPE, canonical)
    assert to_sign == (
        "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
        "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"
    )
    key = signing_key(EXAMPLE.secret_access_key, "20130524", "us-east-1", "s3")
    assert key.hex() == "dbb893acc010964918f1fd433add87c70e8b0db6be30c1fbeafefa5ec6ba8378"
    assert headers["authorization"] == (
        f"AWS4-HMAC-SHA256 {CREDENTIAL}, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert headers["x-amz-date"] == "20130524T000000Z"
    assert headers["host"] == "examplebucket.s3.amazonaws.com"


def test_put_object_example_encodes_the_key_and_signs_the_payload() -> None:
    payload = hashlib.sha256(b"Welcome to Amazon S3.").hexdigest()
    assert payload == "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
    url = httpx.URL(f"{HOST}/{uri_encode('test$file.text', keep_slash=True)}")
    assert url.raw_path == b"/test%24file.text"
    extra = {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"}
    headers = sign("PUT", url, extra, payload, EXAMPLE, "us-east-1", WHEN)
    canonical, _ = canonical_request(
        "PUT", url, {k: v for k, v in headers.items() if k != "authorization"}, payload
    )
    assert (
        hashlib.sha256(canonical.encode()).hexdigest()
        == "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d"
    )
    assert (
        "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class,"
        in (headers["authorization"])
    )
    assert signature_of(headers) == (
        "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"
    )


def test_get_bucket_lifecycle_example_a_bare_query_name() -> None:
    url = httpx.URL(f"{HOST}/?lifecycle")
    assert canonical_query(url.query.decode()) == "lifecycle="
    headers = sign("GET", url, {}, EMPTY_SHA256, EXAMPLE, "us-east-1", WHEN)
    assert "SignedHeaders=host;x-amz-content-sha256;x-amz-date," in headers["authorization"]
    assert signature_of(headers) == (
        "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"
    )


def test_list_objects_example_sorts_the_query() -> None:
    url = httpx.URL(f"{HOST}/?max-keys=2&prefix=J")
    headers = sign("GET", url, {}, EMPTY_SHA256, EXAMPLE, "us-east-1", WHEN)
    assert signature_of(headers) == (
        "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
    )
    # the same request with its query in another order signs the same
    swapped = sign(
        "GET", httpx.URL(f"{HOST}/?prefix=J&max-keys=2"), {}, EMPTY_SHA256, EXAMPLE,
        "us-east-1", WHEN,
    )  # fmt: skip
    assert signature_of(swapped) == signature_of(headers)


def test_temporary_credentials_sign_their_session_token() -> None:
    temporary = Credentials(EXAMPLE.access_key_id, EXAMPLE.secret_access_key, "token/+=")
    headers = sign("GET", httpx.URL(f"{HOST}/test.txt"), {}, EMPTY_SHA256, temporary,
                   "us-east-1", WHEN)  # fmt: skip
    assert headers["x-amz-security-token"] == "token/+="
    assert "x-amz-security-token" in headers["authorization"].split("SignedHeaders=")[1]
    assert "token" not in repr(temporary) and "EXAMPLEKEY" not in repr(temporary)
