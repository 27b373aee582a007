"""The base of every configuration and request model: unknown fields are errors and values
keep their type, so a typo in a config or a request is a 4xx that names the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown fields are errors, and values keep their type (``true`` is not a number, ``"2"``
    is not an integer): a typo in a config or in ``PUT /v1/speculation`` is a 4xx, not a silent
    coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)
