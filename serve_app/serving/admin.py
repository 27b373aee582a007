"""What guards the operator API (``PUT /v1/speculation``): a token bucket and a bearer token
from an environment variable, compared in constant time and read from the header only."""

from __future__ import annotations

import hmac
import math
import os
import time

from serve_app.serving.errors import APIError


class TokenBucket:
    """``rate`` events a second on average, in bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst, self.tokens, self.at = rate, burst, float(burst), time.monotonic()

    def take(self, now: float) -> float:
        """Take one token: 0 if granted, else the seconds until one is due."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


def throttle(bucket: TokenBucket) -> None:
    """A 429 with Retry-After when the bucket is empty."""
    wait_s = bucket.take(time.monotonic())
    if wait_s > 0:
        raise APIError(
            429,
            "too many operator requests; retry later",
            "rate_limit_error",
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )


def authorize(token_env: str, authorization: str | None) -> None:
    """Pass if ``authorization`` is ``Bearer <the token in $token_env>``; else 401/403."""
    expected = os.environ.get(token_env)
    if not expected:
        raise APIError(
            403,
            f"the operator API is disabled: set the environment variable {token_env} "
            "to a secret token where the Ray cluster runs, then send 'Authorization: Bearer <token>'",
            "permission_error",
        )
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing bearer token", "authentication_error", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(403, "invalid bearer token", "permission_error")
