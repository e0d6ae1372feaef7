"""Typed configuration: schema, YAML loading, KV-transfer settings."""
