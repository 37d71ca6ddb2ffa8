"""Fuzz every RPC of the three services (issue 8): >= 10,000 random and mutated messages over
mTLS, each answered with a documented status code; afterwards the kvstore's Stats and audit are
unchanged (apart from the Match counter), nothing is left reserved, and every service is SERVING.

Messages are built from the proto descriptors (random values per field type, repeated fields,
oneofs, nested messages), then serialized as is or mutated at the byte level (flips, cuts,
insertions): the services see well-formed nonsense and malformed bytes alike. Seeded.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import descriptor as d
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.kvstore.v1 import kvstore_pb2
from tandem.kvstore.v1 import kvstore_pb2 as kv_pb
from tandem.router.v1 import router_pb2
from tandem.worker.v1 import worker_pb2
from trust_rig import TrustRig, make_pki

MESSAGES = 10_500
SEED = 8
DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
STRINGS = ["", "w0", "fuzz", "router", "r-" + "0" * 32, "é☃𝄞", "x" * 129, "a/b", "\x00", "tok"]
INTS = [0, 1, 2, 3, 15, 16, 17, 1023, 1024, 1 << 20, 1 << 22, (1 << 31) - 1, (1 << 32) - 1]


def _value(field: d.FieldDescriptor, rng: random.Random, depth: int):
    t = field.type
    if t == d.FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type._concrete_class, rng, depth + 1)
    if t == d.FieldDescriptor.TYPE_STRING:
        return rng.choice(STRINGS) if rng.random() < 0.7 else "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(40)))
    if t == d.FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 16, 64]))
    if t == d.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == d.FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [7])
    if t in (d.FieldDescriptor.TYPE_FLOAT, d.FieldDescriptor.TYPE_DOUBLE):
        return rng.choice([0.0, 0.5, 1.0, -1.0, 2.0, 1e9, float("nan"), float("inf")])
    value = rng.choice(INTS) if rng.random() < 0.8 else rng.getrandbits(32)
    if t in (d.FieldDescriptor.TYPE_UINT64, d.FieldDescriptor.TYPE_FIXED64):
        return value if rng.random() < 0.8 else rng.getrandbits(64)
    if t in (d.FieldDescriptor.TYPE_INT32, d.FieldDescriptor.TYPE_SINT32, d.FieldDescriptor.TYPE_SFIXED32):
        return rng.choice([0, 1, -1, 3, 8, 1 << 30])
    return value


def _message(cls, rng: random.Random, depth: int = 0):
    msg = cls()
    if depth > 3:
        return msg
    seen_oneofs = set()
    for field in cls.DESCRIPTOR.fields:
        if field.containing_oneof is not None:
            if field.containing_oneof.name in seen_oneofs or rng.random() < 0.5:
                continue
            seen_oneofs.add(field.containing_oneof.name)
        elif rng.random() < 0.35:
            continue
        try:
            if field.is_repeated:
                for _ in range(rng.choice([0, 1, 2, 3])):
                    value = _value(field, rng, depth)
                    if field.type == d.FieldDescriptor.TYPE_MESSAGE:
                        getattr(msg, field.name).add().CopyFrom(value)
                    else:
                        getattr(msg, field.name).append(value)
            elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(_value(field, rng, depth))
            else:
                setattr(msg, field.name, _value(field, rng, depth))
        except (ValueError, TypeError):  # e.g. a value out of the field's range: leave it unset
            pass
    return msg


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        if op == 0 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            del buf[rng.randrange(len(buf)):]
        elif op == 2:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randrange(1, 6))
        else:
            buf += bytes([0x0A, 0x7F]) + rng.randbytes(3)  # a length that runs past the end
    return bytes(buf)


def _payload(cls, rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.1:
        return rng.randbytes(rng.randrange(24))
    data = _message(cls, rng).SerializeToString()
    return _mutate(data, rng) if r < 0.4 else data


def _methods(module, service: str):
    desc = module.DESCRIPTOR.services_by_name[service]
    return [(f"/{desc.full_name}/{m.name}", m.input_type._concrete_class, m.server_streaming) for m in desc.methods]


@pytest.fixture
def rig(tmp_path, start_service):
    rig = TrustRig(make_pki(tmp_path), start_service)
    rig.start_kvstore(lease_ttl_s=30.0)  # a loaded CI machine must not lapse the worker's lease mid-fuzz
    rig.start_worker("w0")
    rig.start_router(tenants="tokA=alice", max_new_tokens=4)
    yield rig
    rig.close()


def _call(channel, method, streaming, payload, metadata, timeout):
    try:
        if streaming:
            for _ in channel.unary_stream(method)(payload, timeout=timeout, metadata=metadata):
                pass
        else:
            channel.unary_unary(method)(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _comparable(stats: kv_pb.StatsResponse) -> kv_pb.StatsResponse:
    out = kv_pb.StatsResponse()
    out.CopyFrom(stats)
    out.matches = 0  # Match is read-only but counted
    return out


def test_fuzz_every_rpc_of_every_service(rig):
    rng = random.Random(SEED)
    # callers: the kvstore as a worker that is not registered ("evil") and as a router; the
    # worker as a router; the router as an authenticated client
    kv_worker, kv_router = rig.channel(rig.kv.address, "evil"), rig.channel(rig.kv.address, "router2")
    worker = rig.channel(rig.workers["w0"].address, "router2")
    targets = [(kv_worker, m, None) for m in _methods(kvstore_pb2, "KVStore")]
    targets += [(kv_router, m, None) for m in _methods(kvstore_pb2, "KVStore")]
    targets += [(worker, m, None) for m in _methods(worker_pb2, "Worker")]
    router_targets = [(rig.router.channel, m, [("authorization", "Bearer tokA")]) for m in _methods(router_pb2, "Router")]

    rig.generate("warm the cache up", token="tokA", max_new_tokens=4)
    rig.wait_settled()
    before = _comparable(rig.stats())
    assert rig.invariants().ok

    def fire(n, pool):
        calls = []
        for _ in range(n):
            channel, (method, cls, streaming), metadata = rng.choice(pool)
            timeout = 0.3 if method.endswith("WatchEvents") else 30.0  # a valid watch follows forever
            calls.append((channel, method, streaming, _payload(cls, rng), metadata, timeout))
        with ThreadPoolExecutor(8) as ex:
            return [(c[1], *r) for c, r in zip(calls, ex.map(lambda c: _call(*c), calls))]

    inner = fire(MESSAGES - 1500, targets)
    undocumented = [(m, code, detail) for m, code, detail in inner if code not in DOCUMENTED
                    and not (m.endswith("WatchEvents") and code == grpc.StatusCode.DEADLINE_EXCEEDED)]
    assert not undocumented, undocumented[:10]
    after = rig.stats()
    assert _comparable(after) == before, "fuzzing changed the kvstore"
    assert rig.invariants().ok

    outer = fire(1500, router_targets)  # some of these are valid requests and run
    undocumented = [(m, code, detail) for m, code, detail in outer if code not in DOCUMENTED]
    assert not undocumented, undocumented[:10]
    assert len(inner) + len(outer) >= 10_000
    every = {m for _, (m, _, _), _ in targets + router_targets}
    assert {m for m, _, _ in inner + outer} == every  # every RPC of every service was hit
    print({code.name: sum(c == code for _, c, _ in inner + outer) for code in DOCUMENTED})
    assert sum(code == grpc.StatusCode.INVALID_ARGUMENT for _, code, _ in inner + outer) > 1000
    assert not any("Traceback" in detail for _, _, detail in inner + outer)
    stats = rig.wait_settled()
    assert (stats.live_reservations, stats.ending_reservations) == (0, 0) and all(w.pool.in_use == 0 for w in stats.workers)
    assert [(w.worker_id, w.incarnation) for w in rig.kv_as("router").ListWorkers(kv_pb.ListWorkersRequest(), timeout=5).workers] \
        == [("w0", rig.incarnation())]
    assert rig.invariants().ok
    for channel in (kv_router, worker, rig.router.channel):
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
