"""Paged KV pools of the gpuworker: one tensor per pool, target and draft indexed by the same
block ids (``pool``)."""

from services.gpuworker.kv.pool import KVPool, PairedKVPools

__all__ = ["KVPool", "PairedKVPools"]
