"""Which engine backend a replica runs, with that backend's own options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from serve_app.strict import Strict


def _options_class(backend: str) -> type[BaseModel]:
    # Imported on use: the sglang options module is importable without sglang itself, and
    # neither engine package is needed to validate or run the policy.
    if backend == "embedded":
        from serve_app.engines.embedded.config import EmbeddedOptions

        return EmbeddedOptions
    from serve_app.engines.sglang.config import SGLangOptions

    return SGLangOptions


class EngineConfig(Strict):
    """Which engine backend the replicas run, with that backend's own options."""

    backend: Literal["embedded", "sglang"] = "embedded"
    embedded: Any = Field(default=None, description="EmbeddedOptions when backend is 'embedded'.")
    sglang: Any = Field(default=None, description="SGLangOptions when backend is 'sglang'.")

    @field_validator("embedded", "sglang", mode="before")
    @classmethod
    def _parse_options(cls, value: Any, info) -> Any:
        if value is None:
            return None
        options_cls = _options_class(info.field_name)
        return value if isinstance(value, options_cls) else options_cls.model_validate(value)

    @model_validator(mode="after")
    def _one_backend(self) -> EngineConfig:
        if self.backend == "embedded" and self.embedded is None:
            self.embedded = _options_class("embedded")()
        if self.backend == "sglang" and self.sglang is None:
            raise ValueError("sglang: options are required when backend is 'sglang'")
        other = "sglang" if self.backend == "embedded" else "embedded"
        if getattr(self, other) is not None:
            raise ValueError(f"{other}: options given but backend is {self.backend!r}")
        return self

    @property
    def options(self) -> BaseModel:
        """The selected backend's options."""
        return getattr(self, self.backend)
