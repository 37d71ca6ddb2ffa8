"""Which model the router serves, and which registered workers it may route to.

``--model X`` fixes it (the tokenizer is loaded at start); ``--model auto`` learns it from the
first worker registered with the kvstore: that worker's ``Info.model_name`` names a folder (or
``tiny``, or a hub id), and the router loads the tokenizer from there (compose and ``tandem up``
give every service the same model path). A hub id's tokenizer is fetched at the router's
``--revision``, which ``tandem up`` sets to the workers' ``--revision`` (a tokenizer can change
between revisions; ``main`` is not necessarily what the workers serve).

A worker is compatible when it names the router's model (workers that name none, e.g. older
builds, are judged by vocabulary alone) and its registered vocabulary size equals the tokenizer's.
An incompatible worker is never routed to, and said so once per incarnation in an error line:
decoding its tokens with another tokenizer would be gibberish, not an answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.common.errors import TandemError, Unavailable
from services.common.tokenizer import Tokenizer, load_tokenizer
from services.router.directory import WorkerEntry

log = logging.getLogger(__name__)

AUTO = "auto"


def incompatibility(router_model: str, router_vocab: int, worker_model: str, worker_vocab: int) -> str | None:
    """Why a worker cannot serve this router's requests, or None when it can (pure)."""
    if worker_model and worker_model != router_model:
        return f"it serves model {worker_model!r}, this router serves {router_model!r}"
    if worker_vocab != router_vocab:
        return f"its vocabulary has {worker_vocab} tokens, this router's tokenizer {router_vocab}"
    return None


class ModelBinding:
    """The router's model and tokenizer, and the verdict on every worker incarnation seen.

    ``worker_model(entry)`` asks a worker which model it serves (its ``Info.model_name``; ""
    when unknown). ``on_bound(tokenizer)`` runs once the tokenizer is known.
    """

    def __init__(self, configured: str, tokenizer: Tokenizer | None,
                 worker_model: Callable[[WorkerEntry], Awaitable[str]],
                 on_bound: Callable[[Tokenizer], None] = lambda tokenizer: None, revision: str | None = None):
        self.model = None if configured == AUTO else configured
        self.revision = revision or None  # of a hub id's tokenizer (None = main)
        self.tokenizer = tokenizer
        self._worker_model = worker_model
        self._on_bound = on_bound
        self._verdicts: dict[tuple[str, int], str | None] = {}  # (worker, incarnation) -> reason or None

    def is_compatible(self, worker_id: str, incarnation: int) -> bool:
        """True only for a worker incarnation that answered ``Info`` and serves this router's
        model (read-only): a newly registered worker gets no request before it was probed, so a
        registration nobody answers behind (a dead or fake address) is never routed to."""
        key = (worker_id, incarnation)
        return key in self._verdicts and self._verdicts[key] is None

    async def review(self, entries: list[WorkerEntry]) -> list[WorkerEntry]:
        """Judge every new worker incarnation (learning the model first in auto mode); return the
        compatible ones. Mutates the verdicts (and the tokenizer, once)."""
        compatible = []
        for entry in entries:
            key = (entry.worker_id, entry.incarnation)
            if key not in self._verdicts:
                try:
                    name = await self._worker_model(entry)
                except TandemError as err:  # unreachable for now: judge it on the next review
                    log.info("cannot ask worker %s which model it serves: %s", entry.worker_id, err.message)
                    continue
                if self.tokenizer is None:
                    self._learn(name, entry)
                reason = incompatibility(self.model or "", self.tokenizer.vocab_size, name, entry.vocab_size)
                self._verdicts[key] = reason
                if reason:
                    log.error("not routing to worker %s at %s: %s", entry.worker_id, entry.address, reason)
            if self._verdicts[key] is None:
                compatible.append(entry)
        return compatible

    def _learn(self, name: str, entry: WorkerEntry) -> None:
        if not name:
            raise Unavailable(f"worker {entry.worker_id} does not say which model it serves: start the router with --model")
        try:
            tokenizer = load_tokenizer(name, self.revision)
        except TandemError as err:
            raise Unavailable(f"cannot load the tokenizer of {name!r} (served by worker {entry.worker_id}): {err.message}") from None
        self.model, self.tokenizer = name, tokenizer
        log.info("serving model %r%s, learned from worker %s", name, f" at revision {self.revision}" if self.revision else "",
                 entry.worker_id)
        self._on_bound(tokenizer)
