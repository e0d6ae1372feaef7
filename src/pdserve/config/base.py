"""What every config section shares: unknown keys are refused, defaults are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: The name under which the packaged SmolLM2 model is known in ``model_source``.
EMBEDDED_MODEL_SOURCE = "pdserve:smollm2-135m-instruct"
EMBEDDED_MODEL_ID = "smollm2-135m-instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)
