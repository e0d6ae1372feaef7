"""Tenants (``router.tenants``): who an API key belongs to, and what that tenant may take.

Each tenant names the environment variable that holds its keys (separated by commas or newlines, as
``router.api_keys_env``); keys never appear in the config, so never in rendered manifests (on Kubernetes
the variables come from Secrets). Every limit is optional:

- ``requests_per_s``: requests admitted per second (a bucket that holds one second's worth);
- ``prompt_tokens_per_min`` / ``output_tokens_per_min``: prompt tokens (the router's count) and output
  tokens (each request's output budget, charged when admitted: ``max_tokens``, else the context left after
  the prompt, for each sequence of ``n`` and of a batch's prompts) per minute (a bucket of one minute);
- ``max_concurrent``: requests in flight at once.

Beyond a limit the tenant gets 429 with ``Retry-After`` and the limit's name. Under overload admission by
work refuses first a tenant over its fair share of what is in flight, and a lower ``priority`` before a
higher one (pdserve/router/tenants.py); where every engine schedules by priority (vLLM's
``scheduling_policy: priority`` in both roles' ``engine_kwargs``) each request carries its tenant's too.
Keys of ``router.api_keys`` / ``api_keys_env`` belong to the tenant ``default`` (priority 0, no limits).

Like llm-d's flow control (priority bands, fairness within a band) and SGLang's gateway rate limits per
API key; unlike them, limits here are in prompt and output tokens too, since one CPU engine's cost is
tokens, not requests.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    keys_env: str = Field(
        ..., pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Environment variable holding this tenant's API keys (commas or newlines between them).")
    priority: int = Field(
        0, ge=-100, le=100,
        description="Higher is served first under overload: a lower priority is refused before a higher one. "
                    "Engines with `scheduling_policy: priority` (both roles' engine_kwargs) also order their "
                    "queues, and preempt, by it.")
    requests_per_s: float | None = Field(None, gt=0, description="Requests admitted per second (null: any).")
    prompt_tokens_per_min: int | None = Field(None, gt=0, description="Prompt tokens per minute (null: any).")
    output_tokens_per_min: int | None = Field(
        None, gt=0, description="Output tokens per minute, each request's budget charged at admission: "
                                "`max_tokens` (else the context left after the prompt) times its sequences "
                                "(`n`, a batch's prompts) (null: any).")
    max_concurrent: int | None = Field(None, gt=0, description="Requests in flight at once (null: any).")
