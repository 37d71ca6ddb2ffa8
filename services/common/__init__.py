"""Plumbing shared by every Tandem service: speculative-mode facts, gRPC server factory, error
mapping, settings helpers and telemetry hooks. Nothing here knows about a particular service."""
