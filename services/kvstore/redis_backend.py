"""The kvstore's Redis backend: a fenced journal of committed transactions plus snapshots.

Keys under ``prefix`` (default ``tandem:kv:``)::

    lease     "<epoch>:<node>" with a PX expiry: who may write. Taken with SET-if-absent after
              INCR of ``epoch``, so every leader has a fresh fencing epoch.
    epoch     counter of leaderships
    meta      pickled KVStore constructor arguments (the journal's genesis)
    snapshot  pickled store at seq ``base`` (``journal.JournaledStore.snapshot``)
    base      seq of the snapshot; ``journal`` holds entries base+1 .. base+LLEN
    journal   list of pickled entries (``journal`` module)

Every write is one Lua script that first compares ``lease`` with the writer's token: a kvstore
that lost its lease (a standby took over, or it was cut off past the lease) can never write
again, whatever it still believes. Appends also check the sequence number, so a gap — Redis
lost acknowledged entries (``appendfsync everysec`` crash) — is detected at the next write and
repaired from the leader's memory with a fresh snapshot.

Hot path (``Committer``): a handler mutates the in-memory store, the entry is queued, and the
handler awaits ``durable(seq)``; everything queued goes out as ONE script call (group commit:
concurrent RPCs share one round trip), in order, one batch in flight. While nothing fails a
batch is sent from a loop callback and its reply handled in the append pipe's
``data_received`` (no task hop either way); a failed batch goes back to a task that retries it
with backoff while the lease lasts. Reads (Match, Stats) never touch Redis.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import pickle
import socket
import sys
import time
import uuid

import redis
import redis.asyncio as aredis

from services.common.errors import Unavailable

from .journal import FORMAT, JournalDiverged, JournaledStore

log = logging.getLogger(__name__)

_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED lease held by another kvstore') end
local have = tonumber(redis.call('GET', KEYS[3]) or '0') + redis.call('LLEN', KEYS[2])
local first = tonumber(ARGV[2])
local n = #ARGV - 2
if first - 1 > have then return redis.error_reply('GAP ' .. have .. ' ' .. (first - 1)) end
-- Entries at or below `have` are there already: a resent batch that had landed, or a snapshot
-- taken while they were still queued.
local skip = have - (first - 1)
if skip >= n then return have end
for i = 3 + skip, #ARGV, 4000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 3999, #ARGV)))
end
return have + n - skip
"""

_SNAPSHOT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED lease held by another kvstore') end
local base = tonumber(redis.call('GET', KEYS[3]) or '0')
local len = redis.call('LLEN', KEYS[2])
local seq = tonumber(ARGV[2])
-- a snapshot older than the one there (a slow snapshot process) changes nothing
if seq < base then return base + len end
if seq >= base + len then
  redis.call('DEL', KEYS[2])
else
  redis.call('LTRIM', KEYS[2], seq - base, -1)
end
redis.call('SET', KEYS[3], seq)
redis.call('SET', KEYS[4], ARGV[3])
return base + len
"""

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local epoch = redis.call('INCR', KEYS[2])
local token = epoch .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return token
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_NAME_PREFIX = "tandem-kv-leader:"
NODE_NAME_PREFIX = "tandem-kv-node:"


def _printable(text: str) -> str:
    """``text`` as a Redis client name may hold it (no spaces or control characters)."""
    return "".join(c if "!" <= c <= "~" else "_" for c in text)

_LOAD_CHUNK = 10_000


class AppendPipe:
    """The group-commit append, spoken as raw RESP on one connection of its own: redis-py's
    asyncio client cost more per call than the rest of a batch together (connection-pool
    checkout, encoders, per-argument packing in Python: docs/benchmarks.md). One ``EVALSHA``
    frame built with one ``join``; the reply is parsed in the protocol's ``data_received`` and
    handed to the caller's future (no stream reader, no ``wait_for`` task: each cost more CPU
    than the Redis call itself on a small VM). Scripts are loaded with SCRIPT LOAD on connect;
    NOSCRIPT (a flushed Redis) reconnects and loads again. Errors surface as
    ``redis.ResponseError`` (script replies) or ``ConnectionError`` (the connection, reopened on
    the next call), as the redis-py path did."""

    def __init__(self, url: str, script: str, *, timeout_s: float = 5.0, name: str | None = None):
        self._pool = redis.ConnectionPool.from_url(url)  # parses host/port/db/password/TLS once
        self._kw = self._pool.connection_kwargs
        self._name = name  # CLIENT SETNAME: a standby sees the leader's connections (RedisLog.holder_connected)
        self._script = script
        self._sha = hashlib.sha1(script.encode()).hexdigest().encode()
        self._timeout_s = timeout_s
        self._proto: _RespProtocol | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self) -> None:
        kw = self._kw
        loop = asyncio.get_running_loop()
        proto = _RespProtocol()
        if "path" in kw:
            await loop.create_unix_connection(lambda: proto, kw["path"])
        else:
            ssl = None
            if self._pool.connection_class is not redis.Connection:  # rediss://: TLS as redis-py
                import ssl as ssl_

                ssl = ssl_.create_default_context()
            await loop.create_connection(lambda: proto, kw.get("host", "localhost"), kw.get("port", 6379), ssl=ssl)
        # Published only once the handshake below answered: a batch written while AUTH, SELECT or
        # SCRIPT LOAD are still in flight would run before them (NOSCRIPT, or the wrong db).
        hello = []
        if kw.get("password"):
            hello.append([b"AUTH", *([kw["username"].encode()] if kw.get("username") else []), kw["password"].encode()])
        if kw.get("db"):
            hello.append([b"SELECT", str(kw["db"]).encode()])
        hello.append([b"SCRIPT", b"LOAD", self._script.encode()])
        try:
            for cmd in hello:
                await self._send(_resp(cmd), proto)
            if self._name:
                try:
                    await self._send(_resp([b"CLIENT", b"SETNAME", self._name.encode()]), proto)
                except redis.ResponseError:
                    pass  # CLIENT denied by an ACL: standbys then wait for the lease (holder_connected)
        except BaseException:
            proto.close()
            raise
        if proto.closed:  # the peer hung up right after answering
            raise ConnectionError("redis append connection closed during its handshake")
        self._proto = proto

    async def ensure_connected(self) -> None:
        """Open the connection if it is not (the committer's lease keeper calls this, so a
        leader's named connection is back within a renewal period even without appends)."""
        if self._proto is None or self._proto.closed:
            try:
                await self._reconnect()
            except (OSError, TimeoutError, redis.ResponseError):
                self.close()  # the next append or renewal tries again

    async def _reconnect(self) -> None:
        async with self._connecting:  # one connection, whoever asks first (appends, the keeper)
            if self._proto is None or self._proto.closed:
                self.close()
                await self._connect()

    async def __call__(self, *, keys: list[str], args: list) -> int:
        """EVALSHA of the script; its integer reply (called as a redis-py ``Script`` is)."""
        frame = _resp([b"EVALSHA", self._sha, str(len(keys)).encode(), *(k.encode() for k in keys),
                       *(a if isinstance(a, bytes) else str(a).encode() for a in args)])
        try:
            if self._proto is None or self._proto.closed:
                await self._reconnect()
            return int(await self._send(frame))
        except (OSError, TimeoutError) as exc:
            self.close()
            raise ConnectionError(f"redis append connection: {exc}") from None
        except redis.ResponseError as exc:
            if str(exc).startswith("NOSCRIPT"):
                self.close()  # reconnect loads the script again; the caller retries
                raise ConnectionError("redis lost the append script") from None
            raise

    def _send(self, frame: bytes, proto: "_RespProtocol | None" = None) -> asyncio.Future:
        proto = self._proto if proto is None else proto
        fut = asyncio.get_running_loop().create_future()
        if not proto.waiters:
            proto.since = time.monotonic()
        proto.waiters.append(fut)
        proto.transport.write(frame)
        return fut

    def send_nowait(self, frame: bytes, callback) -> bool:
        """Write ``frame`` (``evalsha_frame``); its reply goes to ``callback(reply, exc)``, called
        from the protocol's ``data_received`` (no future, no coroutine, no task hop: the group
        commit's fast path). False, nothing sent, if the connection is not open (the caller's
        slow path reconnects)."""
        proto = self._proto
        if proto is None or proto.closed:
            return False
        if not proto.waiters:
            proto.since = time.monotonic()
        proto.waiters.append(callback)
        proto.transport.write(frame)
        return True

    def evalsha_head(self, keys: list[str], fixed: list[bytes]) -> tuple[bytes, int]:
        """The RESP of ``EVALSHA sha numkeys *keys *fixed`` without the array header, and how many
        elements it holds: built once per leadership (the keys and the lease token do not change),
        so a batch's frame is only its own arguments (``evalsha_frame``)."""
        parts = [b"EVALSHA", self._sha, str(len(keys)).encode(), *(k.encode() for k in keys), *fixed]
        return _resp(parts)[len(b"*%d\r\n" % len(parts)):], len(parts)

    def check_timeout(self) -> None:
        """Fail the connection if its oldest command waits past the timeout (a hung Redis);
        called by the committer's lease keeper, so a call needs no timer of its own."""
        proto = self._proto
        if proto is not None and proto.waiters and time.monotonic() - proto.since > self._timeout_s:
            proto.timed_out()

    def close(self) -> None:
        if self._proto is not None:
            self._proto.close()
        self._proto = None


class _RespProtocol(asyncio.Protocol):
    """Replies in order to the futures of the commands sent, parsed as they arrive: an integer,
    a simple or bulk string, or an error (``redis.ResponseError``)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self._buf = b""
        self.closed = False
        self.since = 0.0  # when the oldest command still waiting for its reply was sent (about)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        while self.waiters:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            kind = buf[pos:pos + 1]
            body = buf[pos + 1:end]
            nxt = end + 2
            if kind == b"$":  # a bulk string (SCRIPT LOAD's sha)
                n = int(body)
                if n >= 0:
                    if len(buf) < nxt + n + 2:
                        break
                    body, nxt = buf[nxt:nxt + n], nxt + n + 2
                else:
                    body = b""
            pos = nxt
            fut = self.waiters.popleft()
            self.since = time.monotonic()
            if callable(fut):  # AppendPipe.send_nowait's callback
                if kind == b"-":
                    _reply(fut, None, redis.ResponseError(body.decode(errors="replace")))
                else:
                    _reply(fut, body, None)
                continue
            if fut.done():
                continue
            if kind == b"-":
                fut.set_exception(redis.ResponseError(body.decode(errors="replace")))
            else:
                fut.set_result(body)  # ":" integer, "+" simple string, "$" bulk
        self._buf = buf[pos:]

    def timed_out(self) -> None:
        self._fail(TimeoutError("no reply from redis in time"))

    def connection_lost(self, exc) -> None:
        self._fail(ConnectionError(f"redis closed the connection ({exc})" if exc else "redis closed the connection"))

    def _fail(self, exc: Exception) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if callable(fut):
                _reply(fut, None, exc)
            elif not fut.done():
                fut.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _reply(callback, reply: bytes | None, exc: Exception | None) -> None:
    # a callback that raised must not stop the parse of the replies after it (nor lose them)
    try:
        callback(reply, exc)
    except Exception:  # noqa: BLE001
        log.exception("kvstore: a Redis reply handler failed")


def _resp(parts: list[bytes]) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n" % len(p))
        out.append(p)
        out.append(b"\r\n")
    return b"".join(out)


class Fenced(Unavailable):
    """This kvstore no longer holds the lease: it must not write (UNAVAILABLE to clients)."""


class RedisLog:
    """Synchronous access to one journal in Redis: leadership, load, snapshot, append. Used for
    start-up, recovery and tests; the serving hot path uses ``Committer``."""

    def __init__(self, url: str, *, prefix: str = "tandem:kv:", node_id: str | None = None, lease_ms: int = 1500):
        self.url = url
        self.prefix = prefix
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_ms = int(lease_ms)
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
        self._named = False
        self.keys = {k: prefix + k for k in ("lease", "epoch", "meta", "snapshot", "base", "journal")}
        self.token: str | None = None
        self._base_seen = 0  # the snapshot seq catch_up last saw
        c = self.client
        self._append = c.register_script(_APPEND)
        self._snapshot = c.register_script(_SNAPSHOT)
        self._acquire = c.register_script(_ACQUIRE)
        self._renew = c.register_script(_RENEW)
        self._resign = c.register_script(_RESIGN)

    def close(self) -> None:
        self.client.close()

    # -- leadership -------------------------------------------------------------------------------
    def try_acquire(self) -> str | None:
        """Take the lease if nobody holds it; returns the fencing token (or None)."""
        if not self._named:
            # CLIENT LIST shows each kvstore process, leader or standby, by its node id (one of
            # this client's connections; best effort: an ACL may deny CLIENT)
            self._named = True
            try:
                self.client.client_setname(NODE_NAME_PREFIX + _printable(self.node_id))
            except redis.ResponseError:
                pass
        token = self._acquire(keys=[self.keys["lease"], self.keys["epoch"]], args=[self.node_id, self.lease_ms])
        self.token = token.decode() if token else None
        return self.token

    def renew(self) -> bool:
        return bool(self._renew(keys=[self.keys["lease"]], args=[self.token, self.lease_ms]))

    def resign(self) -> None:
        """Give the lease up at once (graceful stop: the standby need not wait for expiry)."""
        if self.token:
            self._resign(keys=[self.keys["lease"]], args=[self.token])
            self.token = None

    def epoch(self) -> int:
        """The fencing epoch of the lease we hold (0 if none)."""
        return int(self.token.split(":", 1)[0]) if self.token else 0

    def holder(self) -> str | None:
        value = self.client.get(self.keys["lease"])
        return value.decode() if value else None

    def connection_name(self, token: str | None = None) -> str | None:
        """The CLIENT SETNAME of the connection a leader holding ``token`` (default: ours)
        keeps open while it lives (its append pipe, reopened by its lease keeper)."""
        token = token if token is not None else self.token
        if not token:
            return None
        return _NAME_PREFIX + _printable(token)

    def holder_connected(self, token: str) -> bool | None:
        """Whether Redis has a connection of the leader holding ``token`` open. A SIGKILLed or
        crashed-but-for-its-kernel process's connections close at once, long before its lease
        runs out. None if this Redis does not list its clients (CLIENT renamed or denied)."""
        try:
            clients = self.client.client_list(_type="normal")
        except redis.ResponseError:
            return None
        name = self.connection_name(token)
        return any(c.get("name") == name for c in clients)

    def depose(self, token: str) -> bool:
        """Drop the lease if ``token`` still holds it (its holder is gone: ``holder_connected``).
        Safe whatever the holder does next: every write it makes is checked against the lease
        and is refused from now on (fencing)."""
        return bool(self._resign(keys=[self.keys["lease"]], args=[token]))

    # -- journal ----------------------------------------------------------------------------------
    def append_args(self, first_seq: int, entries: list[bytes]) -> tuple[list, list]:
        k = self.keys
        return [k["lease"], k["journal"], k["base"]], [self.token, first_seq, *entries]

    def snapshot_args(self, seq: int, blob: bytes) -> tuple[list, list]:
        k = self.keys
        return [k["lease"], k["journal"], k["base"], k["snapshot"]], [self.token, seq, blob]

    def append(self, first_seq: int, entries: list[bytes]) -> int:
        keys, args = self.append_args(first_seq, entries)
        return _script_call(self._append, keys, args)

    def write_snapshot(self, seq: int, blob: bytes) -> int:
        keys, args = self.snapshot_args(seq, blob)
        return _script_call(self._snapshot, keys, args)

    def length(self) -> int:
        """Entries the journal covers (snapshot seq + entries after it)."""
        base, n = self.client.pipeline().get(self.keys["base"]).llen(self.keys["journal"]).execute()
        return int(base or 0) + n

    def load(self, store_args: dict, sink=None, *, previous: JournaledStore | None = None, previous_epoch: int = 0,
             acknowledged: int = 0, clock=None, ids=None, warm: JournaledStore | None = None) -> JournaledStore:
        """The store the journal describes (we must hold the lease). The genesis arguments in
        Redis win over ``store_args`` (replay needs the originals).

        ``previous`` is our own store from before we lost the lease (``previous_epoch`` the
        fencing epoch we held, ``acknowledged`` the entries we had answered for). It is kept only
        if nobody led in between (our new epoch is the next one) and Redis holds no more than it:
        then fewer entries than ``acknowledged`` means Redis lost writes, and our memory — which
        has them, plus transactions nobody was answered for, harmless to keep — is written back as
        a snapshot. Otherwise Redis is the truth."""
        k = self.keys
        meta = self.client.get(k["meta"])
        if meta is None:
            self.client.set(k["meta"], pickle.dumps({"format": FORMAT, "store_args": store_args}))
        else:
            stored = pickle.loads(meta)
            if not isinstance(stored, dict) or stored.get("format") != FORMAT:
                found = stored.get("format") if isinstance(stored, dict) else "unknown"
                raise JournalFormatError(
                    f"the kvstore journal under {self.prefix!r} has format {found}, this kvstore reads format "
                    f"{FORMAT}: finish with the version that wrote it, or start over with another --redis-prefix"
                )
            stored = stored["store_args"]
            if {k: v for k, v in stored.items() if k != "epoch"} != {k: v for k, v in store_args.items() if k != "epoch"}:
                log.warning("kvstore settings %s differ from the journal's %s: the journal's are used", store_args, stored)
            store_args = stored
        have = self.length()
        nobody_between = previous is not None and self.epoch() == previous_epoch + 1
        if nobody_between and have <= previous.seq:
            if have < acknowledged:
                log.error("Redis holds %d journal entries but this kvstore acknowledged %d: Redis lost writes "
                          "(appendfsync / restart); repairing from memory", have, acknowledged)
            if have < previous.seq:
                self.write_snapshot(previous.seq, previous.snapshot())
            previous.sink = sink
            previous.clock.resume(previous.last_time)
            return previous
        if warm is not None:
            # a standby's warm copy: with the lease held nobody appends any more, so replaying
            # what it has not seen yet makes it exactly what a full load would give
            try:
                self.catch_up(warm)
            except JournalDiverged as exc:
                log.info("warm standby copy unusable (%s): loading from Redis", exc)
            else:
                warm.sink = sink
                warm.clock.resume(warm.last_time)
                return warm
        snapshot, base = self.client.pipeline(transaction=True).get(k["snapshot"]).get(k["base"]).execute()
        return JournaledStore.recover(store_args, snapshot, self._entries(int(base or 0)), sink, clock=clock, ids=ids)

    def catch_up(self, store: JournaledStore) -> int:
        """Replay onto ``store`` (a copy made by ``replica``) the entries Redis got since
        (a warm standby: its takeover then replays only the last few). JournalDiverged if a
        snapshot trimmed entries it had not replayed yet (it then needs a new replica)."""
        k, total = self.keys, 0
        base = self._base_seen
        while True:
            # the base and the entries in one transaction: a snapshot trims the list, which
            # would otherwise shift what an index names; a base other than the one assumed
            # means: ask again with it
            start = store.seq - base
            if start < 0:
                raise JournalDiverged(f"a snapshot at {base} covers entries past the replica's {store.seq}")
            got, chunk = (self.client.pipeline(transaction=True).get(k["base"])
                          .lrange(k["journal"], start, start + _LOAD_CHUNK - 1).execute())
            got = int(got or 0)
            if got != base:
                base = self._base_seen = got
                continue
            total += store.catch_up((base + start + i + 1, raw) for i, raw in enumerate(chunk))
            if len(chunk) < _LOAD_CHUNK:
                return total

    def replica(self) -> JournaledStore:
        """The store the journal in Redis describes, read without holding the lease (the
        snapshot process's copy, see ``snapshotter``). Snapshot and base are read together;
        the entries after them only grow."""
        k = self.keys
        meta, snapshot, base = (self.client.pipeline(transaction=True).get(k["meta"]).get(k["snapshot"])
                                .get(k["base"]).execute())
        stored = pickle.loads(meta) if meta is not None else None
        if not isinstance(stored, dict) or stored.get("format") != FORMAT:
            raise JournalFormatError(f"no kvstore journal of format {FORMAT} under {self.prefix!r}")
        self._base_seen = int(base or 0)  # what ``catch_up`` of this copy starts from
        return JournaledStore.recover(stored["store_args"], snapshot, self._entries(self._base_seen))

    def _entries(self, base: int):
        """(seq, entry) of the journal after ``base``, in chunks."""
        start = 0
        while True:
            chunk = self.client.lrange(self.keys["journal"], start, start + _LOAD_CHUNK - 1)
            for i, raw in enumerate(chunk):
                yield base + start + i + 1, raw
            if len(chunk) < _LOAD_CHUNK:
                return
            start += _LOAD_CHUNK

    def wipe(self) -> None:
        """Delete every key of this journal (tests and ``--redis-reset``)."""
        self.client.delete(*self.keys.values())


def _script_call(script, keys, args) -> int:
    try:
        return int(script(keys=keys, args=args))
    except redis.ResponseError as exc:
        raise _script_error(exc) from None


def _script_error(exc: redis.ResponseError) -> Exception:
    text = str(exc)
    if "FENCED" in text:
        return Fenced("kvstore: this instance lost its Redis lease (another kvstore leads); retry")
    if "GAP" in text:
        return JournalGap(text)
    return exc


class JournalFormatError(RuntimeError):
    """The journal in Redis was written by an incompatible kvstore version."""


class JournalGap(RuntimeError):
    """Redis holds fewer entries than were written: it lost acknowledged writes."""


class Committer:
    """Group commit of journal entries (and snapshots) to Redis, in order, off the handlers.

    ``submit`` is the ``JournaledStore`` sink (called synchronously inside a handler);
    ``durable(seq)`` resolves once entry ``seq`` is in Redis. On a lost lease every waiter gets
    ``Fenced`` and ``lost`` is set: the server must stop serving."""

    def __init__(self, log_: RedisLog, store_ref, *, snapshot_every: int = 20_000, max_batch: int = 2000,
                 flush_at: int = 0, early_rtt_s: float = 250e-6):
        self.log = log_
        self._store_ref = store_ref  # () -> JournaledStore, for snapshots and repair
        self.snapshot_every = snapshot_every
        self.max_batch = max_batch
        # ``flush_at`` > 0: with nothing in flight, a batch leaves as soon as it holds that many
        # entries instead of at the end of the loop turn, so Redis works on it while the turn's
        # other handlers run (their entries form the next batch) and its time hides behind
        # theirs where it has a core of its own. It costs the kvstore a batch more per turn (16
        # clients, everysec, dev VM: 6-10 us more CPU a cycle for 4-20 us less wall time), so
        # it is off by default (0: one batch per loop turn). Only while Redis answered the last
        # batch within ``early_rtt_s``: a Redis that fsyncs every call (appendfsync always) is
        # the bottleneck itself, and halving its batches doubles its fsyncs.
        self.flush_at = flush_at
        self.early_rtt_s = early_rtt_s
        self._early = False  # the last batch came back within early_rtt_s
        self._sent_at = 0.0
        self.client = aredis.Redis.from_url(log_.url, socket_timeout=5, socket_connect_timeout=2)
        # the hot path, raw RESP (see AppendPipe); its connection carries the name standbys
        # watch for (RedisLog.holder_connected) and is kept open by the lease keeper
        self._append = AppendPipe(log_.url, _APPEND, name=log_.connection_name())
        self._snapshot = self.client.register_script(_SNAPSHOT)
        self._renew = self.client.register_script(_RENEW)
        # (seq, entry); None = snapshot after seq
        self._queue: collections.deque[tuple[int, bytes | None]] = collections.deque()
        self._wake = asyncio.Event()  # wakes _run, the slow path
        # The fast path (``_flush`` / ``_on_reply``): while nothing went wrong, batches are sent
        # from a loop callback and their reply handled in the append pipe's data_received, with
        # no task hop either way (each hop is a loop turn and a task step, which on a small VM
        # cost as much as a verb of the core). Any error hands the batch back to ``_run``, the
        # task that retries, repairs and fails as before, until the queue is drained again.
        self._slow = False
        self._flush_pending = False
        self._inflight: tuple[int, list[bytes]] | None = None  # (first seq, entries) sent by _flush
        self._head: tuple[str | None, bytes, int] | None = None  # (token, EVALSHA head, elements)
        self.durable_seq = 0
        # [the highest seq its waiters need, future]: done once durable_seq reaches it
        self._waiters: list[list] = []
        self._taken = 0  # the highest seq taken into a batch (sent or being sent)
        self.lost = asyncio.Event()
        self._error: Exception | None = None
        self.lease_deadline = time.monotonic() + log_.lease_ms / 1000
        self.batches = 0
        self.handbacks = 0  # batches the fast path gave to the slow one (failures, no connection)
        self.repairs = 0
        self.snapshots = 0
        self._snapshotting: asyncio.Task | None = None

    def start(self, durable_seq: int) -> list[asyncio.Task]:
        self.durable_seq = durable_seq
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._run()), loop.create_task(self._keep_lease())]

    # -- called from handlers ---------------------------------------------------------------------
    def submit(self, seq: int, entry: bytes) -> None:
        self._queue.append((seq, entry))
        if self.snapshot_every and seq % self.snapshot_every == 0:
            self._queue.append((seq, None))
        if self._slow:
            self._wake.set()
        elif self._inflight is None and self._early and len(self._queue) >= self.flush_at:
            self._flush()  # Redis is idle and quick: start on this batch while the other handlers run
        elif not self._flush_pending:
            # after the handlers already scheduled in this loop turn: they join the batch
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def durable(self, seq: int):
        """An awaitable that is done once entry ``seq`` is in Redis (None if it already is).
        Handlers whose entries go out in the same coming batch share one future: one future and
        one resolution per group commit, not per verb."""
        if self._error is not None:
            raise self._error
        if seq <= self.durable_seq:
            return None
        waiters = self._waiters
        taken, size = self._taken, self.max_batch
        # share the last future when its entries are not (all) sent yet and this one goes out in
        # the same coming batch (batches take max_batch entries from taken + 1 on): under a
        # backlog a shared future must not keep growing past the batch that answers its first
        if waiters and seq > taken and waiters[-1][0] > taken and (seq - 1 - taken) // size == (waiters[-1][0] - 1 - taken) // size:
            last = waiters[-1]
            if seq > last[0]:
                last[0] = seq
            return last[1]
        fut = asyncio.get_running_loop().create_future()
        waiters.append([seq, fut])
        return fut

    # -- the fast path ----------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send what is queued as one batch, unless one is in flight (its reply sends the next)
        or the slow path drives."""
        self._flush_pending = False
        if self._inflight is not None or self._slow or self._error is not None or not self._queue:
            return
        first, batch = self._take()
        if not batch:
            return
        self._inflight = (first, batch)
        self._sent_at = time.monotonic()
        if not self._append.send_nowait(self._frame(first, batch), self._on_reply):
            self._inflight = None
            self._hand_back(first, batch)  # not connected: the slow path connects and sends

    def _on_reply(self, reply: bytes | None, exc: Exception | None) -> None:
        """The append pipe's answer to the batch in flight (called from its data_received)."""
        if self._inflight is None:
            return  # the committer was closed meanwhile
        first, batch = self._inflight
        self._inflight = None
        if self._error is not None:
            return  # the lease was lost meanwhile (_fail): nothing is sent or retried any more
        if exc is not None:
            if not isinstance(exc, redis.ResponseError) or str(exc).startswith("NOSCRIPT"):
                self._append.close()  # a lost connection or script: the slow path reconnects
            self._hand_back(first, batch)
            return
        self.batches += 1
        self._early = self.flush_at > 0 and time.monotonic() - self._sent_at < self.early_rtt_s
        self._advance(first + len(batch) - 1)
        if not self._flush_pending:
            # scheduled behind the handlers the advance just woke: what they submit in their
            # turn goes out in the same loop turn, as one batch
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _hand_back(self, first: int, batch: list[bytes]) -> None:
        """The batch goes back to the head of the queue and ``_run`` sends it: it retries while
        the lease lasts, repairs a gap, or fails on a lost lease (the script recognises a resent
        batch that had landed)."""
        self._requeue(first, batch)
        self.handbacks += 1
        self._slow = True
        self._wake.set()

    def _requeue(self, first: int, batch: list[bytes]) -> None:
        """Put an unanswered batch back at the head of the queue, in order."""
        self._queue.extendleft(reversed([(first + i, e) for i, e in enumerate(batch)]))

    def _frame(self, first: int, batch: list[bytes]) -> bytes:
        """The EVALSHA of ``_APPEND`` for ``batch``: the same command ``append_args`` describes,
        its constant head (keys, lease token) encoded once per leadership."""
        token = self.log.token
        head = self._head
        if head is None or head[0] != token:
            keys, args = self.log.append_args(0, [])
            head = self._head = (token, *self._append.evalsha_head(keys, [str(args[0]).encode()]))
        seq = b"%d" % first
        parts = [b"*%d\r\n" % (head[2] + 1 + len(batch)), head[1], b"$%d\r\n" % len(seq), seq, b"\r\n"]
        for entry in batch:
            parts += (b"$%d\r\n" % len(entry), entry, b"\r\n")
        return b"".join(parts)

    def _take(self) -> tuple[int, list[bytes]]:
        """(first seq, entries) of the next batch, off the queue: at most ``max_batch``. A snapshot
        marker at the head starts the snapshot process (everything before it is durable: batches
        go in order) and is dropped; one behind entries ends the batch, so it starts only once
        they are durable."""
        queue, batch = self._queue, []
        first = 0
        while queue and len(batch) < self.max_batch:
            seq, entry = queue[0]
            if entry is None:
                if batch:
                    break
                queue.popleft()
                self._start_snapshot()
                continue
            if not batch:
                first = seq
            batch.append(entry)
            queue.popleft()
        if batch:
            self._taken = max(self._taken, first + len(batch) - 1)
        return first, batch

    # -- background -------------------------------------------------------------------------------
    async def _run(self) -> None:
        """The slow path: sends while ``_slow`` (set by ``_hand_back``), one awaited batch at a
        time, and hands back to the fast path once the queue is drained."""
        delay = 0.005
        while True:
            if not self._slow:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._queue:
                self._slow = False  # drained: the fast path sends from here on
                continue
            first, batch = self._take()
            if not batch:
                continue
            try:
                await self._call(self._append, *self.log.append_args(first, batch))
                self.batches += 1
                self._advance(first + len(batch) - 1)
                delay = 0.005
            except Fenced as exc:
                self._fail(exc)
                return
            except JournalGap as exc:
                # Redis lost entries we had acknowledged: our memory is the truth, write it back.
                log.error("kvstore journal gap (%s): Redis lost acknowledged writes; repairing from memory", exc)
                self.repairs += 1
                store = self._store_ref()
                self._queue = collections.deque((s, e) for s, e in self._queue if s > store.seq)
                try:
                    await self._write_snapshot(store.seq, store.snapshot())  # inline: rare, and must be first
                except Exception as exc2:  # noqa: BLE001
                    self._fail(Fenced(f"kvstore: repair failed: {exc2}"))
                    return
                self._advance(store.seq)
            except (redis.RedisError, OSError) as exc:
                # Unreachable or slow Redis: put the batch back, retry while the lease can last.
                if time.monotonic() > self.lease_deadline:
                    self._fail(Fenced(f"kvstore: Redis unreachable past the lease ({exc}); retry"))
                    return
                self._requeue(first, batch)
                log.warning("kvstore journal write failed (%s); retrying in %.3f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)

    async def _write_snapshot(self, seq: int, blob: bytes) -> None:
        await self._call(self._snapshot, *self.log.snapshot_args(seq, blob))

    async def _snapshot_now(self) -> None:
        self._start_snapshot()

    def _start_snapshot(self) -> None:
        """Start a snapshot in another process (``snapshotter``) if none runs: it rebuilds the
        state from Redis and writes it back, so the pickle never holds this event loop (inline
        it held it ~180 ms at 31k blocks). Not awaited: journal appends go on meanwhile."""
        if self._snapshotting is not None and not self._snapshotting.done():
            return  # the one running covers most of it; the next marker starts another
        self._snapshotting = asyncio.get_running_loop().create_task(self._snapshot_process())

    async def _snapshot_process(self) -> None:
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.kvstore.snapshotter",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        args = json.dumps({"url": self.log.url, "prefix": self.log.prefix, "token": self.log.token}).encode()
        out, err = await proc.communicate(args)
        if proc.returncode != 0:
            log.warning("kvstore snapshot process failed (%s): %s", proc.returncode, err.decode(errors="replace")[-500:])
            return
        self.snapshots += 1
        done = json.loads(out)
        log.info("kvstore snapshot at entry %d (%d bytes) written by a snapshot process in %.2f s (wall %.2f s)",
                 done["seq"], done["bytes"], done["seconds"], time.perf_counter() - started)

    async def _call(self, script, keys, args):
        try:
            return await script(keys=keys, args=args)  # a redis-py Script or the AppendPipe
        except redis.ResponseError as exc:
            raise _script_error(exc) from None

    def _advance(self, seq: int) -> None:
        self.durable_seq = durable = max(self.durable_seq, seq)
        self._taken = max(self._taken, durable)
        if not self._waiters:
            return
        keep = []
        for item in self._waiters:
            if item[0] > durable:
                keep.append(item)
            elif not item[1].done():
                item[1].set_result(None)
        self._waiters = keep

    def _fail(self, exc: Exception) -> None:
        log.error("kvstore stops leading: %s", exc)
        self._error = exc
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._waiters = []
        self.lost.set()

    async def _keep_lease(self) -> None:
        period = self.log.lease_ms / 3000
        while not self.lost.is_set():
            started = time.monotonic()
            self._append.check_timeout()
            try:
                ok = await self._renew(keys=[self.log.keys["lease"]], args=[self.log.token, self.log.lease_ms])
                if not ok:
                    self._fail(Fenced("kvstore: the Redis lease was taken over or ran out; retry"))
                    return
                self.lease_deadline = started + self.log.lease_ms / 1000
                await self._append.ensure_connected()
            except Exception as exc:  # noqa: BLE001 - the keeper must outlive any one failure
                if not isinstance(exc, (redis.RedisError, OSError)):
                    log.exception("kvstore: the lease keeper's renewal failed unexpectedly")
                if time.monotonic() > self.lease_deadline:
                    self._fail(Fenced(f"kvstore: Redis unreachable past the lease ({exc}); retry"))
                    return
            await asyncio.sleep(period)

    async def close(self) -> None:
        self._inflight = None  # its reply, if one still comes, changes nothing
        self._append.close()
        if self._snapshotting is not None:
            self._snapshotting.cancel()  # its process finishes or is fenced on its own
            await asyncio.gather(self._snapshotting, return_exceptions=True)
        await self.client.aclose()
