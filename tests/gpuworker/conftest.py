"""Shared fixtures of the gpuworker tests: the tiny model (loaded once per process), torch
attention backends, and helpers that build paged layouts with shuffled block ids.

torch runs single-threaded here: the suite runs under pytest-xdist with one process per core,
and the tiny shapes gain nothing from intra-op threads.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.spec import SpecMode

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target():
    """The built-in tiny target (seed 0), float32 on CPU. Read-only: do not mutate its weights."""
    from services.gpuworker.model.loader import load_model

    target, _, _ = load_model("tiny", spec_mode=SpecMode.NONE)
    return target


def _make_backend(target, block_size: int = 16, name: str = "torch"):
    """A fresh attention backend for ``target``'s geometry (fresh plan cache)."""
    from services.gpuworker.attention.base import get_backend

    return get_backend(name, "cpu", target.attention_geometry(block_size))


def _shuffled_tables(lengths: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Disjoint block tables, in shuffled id order, with room for ``lengths[r]`` positions each."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for n in lengths:
        need = -(-n // block_size)
        if need > len(ids):
            raise ValueError("pool too small for the test")
        tables.append([ids.pop() for _ in range(need)])
    return tables


@pytest.fixture
def make_backend():
    """``make_backend(target, block_size=16, name="torch")`` -> a backend with a fresh plan cache."""
    return _make_backend


@pytest.fixture
def shuffled_tables():
    """``shuffled_tables(lengths, block_size, num_blocks, seed=0)`` -> disjoint shuffled tables."""
    return _shuffled_tables
