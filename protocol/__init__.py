"""The wire contract: limits, error codes, message types, codec; SPEC.md is the prose."""
