"""The generated code under tandem/ must be exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path):
    gen = _load_generator()
    written = gen.generate(tmp_path)
    assert written, "no proto files found"
    stale = []
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = ROOT / rel
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(rel))
    # and nothing generated is left over from a proto that no longer exists
    expected = {str(p.relative_to(tmp_path)) for p in written}
    leftovers = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tandem").rglob("*_pb2*.py*")
        if str(p.relative_to(ROOT)) not in expected
    ]
    assert not stale and not leftovers, (
        f"generated code is stale: {stale} leftovers: {leftovers}; run `python scripts/gen_protos.py`"
    )


def test_every_proto_field_and_message_is_documented():
    """Each message, field, enum value and rpc in protos/ has a comment line right above it."""
    undocumented = []
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if not s or s.startswith("//") or s.startswith(("syntax", "package", "import", "option", "}")):
                continue
            if s.startswith(("message ", "enum ", "service ")) and s.endswith(("{", "{}")):
                # message/service: documented by a comment above, or (messages named *Request /
                # *Response) by the rpc that uses them
                name = s.split()[1]
                if s.startswith("message") and name.endswith(("Request", "Response")):
                    continue
            prev = lines[i - 1].strip() if i else ""
            if not prev.startswith("//"):
                undocumented.append(f"{proto.relative_to(ROOT)}:{i + 1}: {s}")
    assert not undocumented, "undocumented proto elements:\n" + "\n".join(undocumented)
