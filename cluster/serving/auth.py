"""Optional API keys for both front ends: HTTP `Authorization: Bearer KEY`, gRPC metadata
`authorization: Bearer KEY`. Health endpoints stay open (load balancers and Kubernetes probes carry no
key); everything else, admin stats included, is refused with 401 / UNAUTHENTICATED before a request
reaches the engine.

The key comes from `--api-key`, `--api-key-file` or the WARPSPEC_API_KEY environment variable (in that
order; a Serve config file's args take `api_key` or `api_key_file`). Replicas only ever hold its SHA-256:
the deployment's arguments are stored by the Serve controller, and a digest there gives nothing away.
Candidates are hashed and compared with hmac.compare_digest, so the time taken does not depend on how
much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from warpspec.errors import UnauthenticatedError

API_KEY_ENV = "WARPSPEC_API_KEY"
AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case



def resolve_api_key(api_key: str | None, api_key_file: str | None,
                    environ: Mapping[str, str] = os.environ) -> str | None:
    """The key to require, or None (no authentication). A key given twice is refused rather than guessed at."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give api_key or api_key_file, not both")
    if api_key_file is not None:
        try:
            key = Path(api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"api_key_file {api_key_file!r} cannot be read: {e.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file {api_key_file!r} is empty")
        return key
    if api_key is not None:
        if not api_key.strip():
            raise ValueError("api_key is empty")
        return api_key.strip()
    return environ.get(API_KEY_ENV, "").strip() or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeyAuth:
    key_sha256: bytes

    @classmethod
    def from_key(cls, key: str) -> ApiKeyAuth:
        return cls(_digest(key))

    def check_header(self, authorization: str | None) -> None:
        """`authorization` is the header's (or metadata entry's) value: "Bearer KEY"."""
        if not authorization:
            raise UnauthenticatedError("this server requires an API key: send `Authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthenticatedError("the authorization header must be `Bearer <key>`")
        if not hmac.compare_digest(_digest(key.strip()), self.key_sha256):
            raise UnauthenticatedError("invalid API key")

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """gRPC invocation metadata, as (key, value) pairs."""
        value = None
        for key, item in metadata or ():
            if key.lower() == AUTH_METADATA_KEY:
                value = item.decode(errors="replace") if isinstance(item, bytes) else item
        self.check_header(value)

    def check_grpc(self, grpc_context) -> None:
        """Serve's RayServegRPCContext (None when a method is called through a handle, not the proxy:
        handles are reachable only from inside the cluster, so they are trusted)."""
        if grpc_context is not None:
            self.check_metadata(grpc_context.invocation_metadata())
