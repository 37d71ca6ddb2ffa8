"""``--backend redis``: stand by until this process holds the Redis lease, recover, serve, and go
back to standing by if the lease is lost.

    standby ──lease taken──▶ recover (snapshot + journal) ──▶ bind gRPC, SERVING ──┐
       ▲                                                                           │
       └──────────── lease lost / Redis unreachable past the lease: unbind ◀───────┘

A standby does not bind its gRPC port, so clients given a list of kvstore addresses
(``--kvstore a,b``) connect to whichever one leads; a SIGKILLed leader's lease runs out after
``redis_lease_ms`` and a standby takes over; a SIGTERMed leader drains, then gives the lease up
at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import redis

from services.common.startup import StartupError

from .journal import JournalDiverged
from .redis_backend import Committer, JournalFormatError, RedisLog
from .settings import KVStoreSettings

log = logging.getLogger(__name__)


def store_args(settings: KVStoreSettings) -> dict:
    """KVStore constructor arguments for a new journal (``epoch`` fixed at genesis)."""
    return dict(settings.store_args(), epoch=time.time_ns() // 1000)


class Leadership:
    """One kvstore process on the Redis backend (see the module docstring)."""

    def __init__(self, settings: KVStoreSettings, *, start_server, node_id: str | None = None):
        self.settings = settings
        self._start_server = start_server  # async (settings, store) -> GrpcServer
        self.log = RedisLog(settings.redis_url, prefix=settings.redis_prefix, node_id=node_id,
                            lease_ms=settings.redis_lease_ms)
        self.stop = asyncio.Event()
        self.leading = asyncio.Event()
        self.server = None  # the GrpcServer ``start_server`` returned, while leading
        self.store = None
        self.terms = 0  # leaderships held so far
        self.recovery_s: float | None = None
        self._warm = None  # a standby's copy of the journal's state, kept current (see _keep_warm)
        self._gone: tuple[str, float] | None = None  # (lease holder, since when it has no connection)
        self._standing_by = False  # the warm copy's loop runs while this holds
        self._warm_task: asyncio.Task | None = None

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop.set)
            except (NotImplementedError, RuntimeError):
                pass

    async def _acquire(self) -> bool:
        """Wait for the lease (True) or a stop (False)."""
        # a SET-if-absent is cheap: poll at a tenth of the lease, so a standby takes over at most
        # lease/10 after the lease lapsed (a quarter of it was a visible part of the takeover)
        period = self.settings.redis_lease_ms / 10_000
        last_note = 0.0
        self._standing_by = True
        # The warm copy is kept on its own: building it (snapshot + journal, seconds on a loaded
        # machine) must not hold up noticing that the leader is gone.
        self._warm_task = asyncio.get_running_loop().create_task(self._keep_warm_loop(period))
        try:
            while not self.stop.is_set():
                try:
                    if await asyncio.to_thread(self._poll):
                        return True
                except (redis.RedisError, OSError) as exc:
                    if time.monotonic() - last_note > 5:
                        log.warning("kvstore standby: Redis at %s unreachable (%s); retrying", self.settings.redis_url, exc)
                        last_note = time.monotonic()
                try:
                    await asyncio.wait_for(self.stop.wait(), period)
                except TimeoutError:
                    pass
            return False
        finally:
            self._standing_by = False  # the warm loop ends after its step in flight

    async def _warm_handed_over(self) -> None:
        """Wait for the warm loop's step in flight (it loads what the takeover would load
        anyway); then the copy is ours. Called once the new lease is being renewed: that step
        can take longer than the lease."""
        if self._warm_task is not None:
            await asyncio.gather(self._warm_task, return_exceptions=True)
            self._warm_task = None

    async def _keep_warm_loop(self, period: float) -> None:
        while self._standing_by:
            try:
                await asyncio.to_thread(self._keep_warm)
            except Exception as exc:  # noqa: BLE001 - a copy in doubt is dropped, never used
                log.warning("kvstore standby: warm copy dropped (%s)", exc)
                self._warm = None
            if self._standing_by:
                await asyncio.sleep(period)

    def _poll(self) -> bool:
        """One standby poll (in a thread): take the lease if it is free or its holder is gone."""
        return bool(self.log.try_acquire() or (self._holder_gone() and self.log.try_acquire()))

    def _holder_gone(self) -> bool:
        """Whether the lease holder has had no connection to Redis for a third of the lease
        (then its lease is dropped): a SIGKILLed leader's sockets close at once, so the standby
        need not wait out the lease (most of the takeover time). The grace covers a live
        leader's reconnect (its lease keeper reopens the named connection every third of the
        lease); a leader deposed anyway only loses its lease, as after a lapse (its writes are
        fenced). A host that dies without closing its sockets is left to the lease, and so is a
        Redis whose ACL denies CLIENT."""
        holder = self.log.holder()
        alive = self.log.holder_connected(holder) if holder else None
        if alive is not False:
            self._gone = None
            return False
        now = time.monotonic()
        if self._gone is None or self._gone[0] != holder:
            self._gone = (holder, now)
            return False
        since = self._gone[1]
        if now - since < self.settings.redis_lease_ms / 3000:
            return False
        self._gone = None
        if self.log.depose(holder):
            log.warning("kvstore standby: the leader %s has had no connection to Redis for %.2f s: taking over "
                        "before its lease runs out", holder, now - since)
            return True
        return False

    def _keep_warm(self) -> None:
        """Standby: replay what the leader journaled since the last poll into a copy of the state,
        so a takeover replays only the last few entries instead of loading snapshot + journal
        (recovery was a visible part of the takeover time). Any doubt drops the copy: the
        takeover then loads from Redis as before."""
        try:
            if self._warm is None:
                if self.log.client.get(self.log.keys["meta"]) is None:
                    return  # no journal yet: nothing to keep
                self._warm = self.log.replica()
            else:
                self.log.catch_up(self._warm)
        except (JournalDiverged, JournalFormatError, redis.RedisError, OSError) as exc:
            log.info("kvstore standby: warm copy dropped (%s)", exc)
            self._warm = None

    async def run(self) -> None:
        previous, previous_epoch, acknowledged = None, 0, 0
        while await self._acquire():
            started = time.monotonic()
            committer = Committer(self.log, lambda: self.store, snapshot_every=self.settings.snapshot_every)
            keeper = asyncio.get_running_loop().create_task(committer._keep_lease())
            await self._warm_handed_over()
            try:
                store = await asyncio.to_thread(self.log.load, store_args(self.settings), committer.submit,
                                                previous=previous, previous_epoch=previous_epoch,
                                                acknowledged=acknowledged, warm=self._warm)
                self._warm = None
            except (JournalDiverged, JournalFormatError) as exc:
                keeper.cancel()
                await asyncio.to_thread(self.log.resign)  # another kvstore may read it
                raise StartupError(f"cannot recover the kvstore from {self.settings.redis_url}: {exc}") from None
            self.store = store
            store.waiter = committer.durable
            committer.durable_seq = store.seq
            writer = asyncio.get_running_loop().create_task(committer._run())
            self.recovery_s = time.monotonic() - started
            self.terms += 1
            log.info("kvstore leads (lease %s): recovered %d journal entries in %.3f s",
                     self.log.token, store.seq, self.recovery_s)
            self.server = await self._start_server(self.settings, store)
            self.leading.set()
            lost = asyncio.ensure_future(committer.lost.wait())
            stopping = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait([lost, stopping], return_when=asyncio.FIRST_COMPLETED)
            self.leading.clear()
            if committer.lost.is_set():
                stopping.cancel()
                await self.server.stop(0)
                # kept: Redis may have lost what we acknowledged (see RedisLog.load)
                previous, previous_epoch, acknowledged = store, self.log.epoch(), committer.durable_seq
            else:
                lost.cancel()
                await self.server.stop()
                await self._drain(committer)
                await asyncio.to_thread(self.log.resign)
            for task in (keeper, writer):
                task.cancel()
            await asyncio.gather(keeper, writer, return_exceptions=True)
            await committer.close()
            self.server = None
        await self._warm_handed_over()  # stopped while standing by
        self.log.close()

    async def _drain(self, committer: Committer, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while committer.durable_seq < self.store.seq and not committer.lost.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
