"""The OpenAI-compatible router: API, P/D orchestration, replica choice."""
