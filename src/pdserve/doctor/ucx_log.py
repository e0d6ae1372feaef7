"""Read UCX's own diagnostics: which transport and device carried a transfer.

Two sources, both printed by UCX when its environment asks for them (one line each, prefixed with
``[time] [host:pid:thread]``, so lines of two processes may interleave and are kept apart by pid):

``UCX_PROTO_INFO=y`` prints one table per protocol and peer configuration, e.g.::

    | pdserve-doctor-same-host-reader intra-node cfg#1                  |
    | remote memory read by ucp_get*(multi) into host memory from host  |
    | Range  | Description | Config                                     |
    | 0..inf | zero-copy   | cma/memory                                 |

``UCX_LOG_LEVEL=info`` prints each endpoint configuration's lanes::

    UCX  INFO    pdserve-doctor-same-host-reader intra-node cfg#1 rma_am(tcp/lo) am(tcp/lo cma/memory) ka(tcp/lo)

A NIXL READ is ``ucp_get``, so the *data path* is the ``remote memory read`` table of the reading agent;
the lanes line is the fallback when UCX prints no tables (older UCX or ``UCX_PROTO_ENABLE=n``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[[^\]:]*:\s*(\d+)\s*:\s*\d+\]\s?(.*)$")
_HEADER = re.compile(r"^(\S+) (\S+) cfg#(\d+)$")
_LANES = re.compile(r"UCX\s+INFO\s+(\S+) (\S+) cfg#\d+ (.*\(.*)$")
_LANE = re.compile(r"([a-z_]+)\(([^)]*)\)")
_TL_DEV = re.compile(r"([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")
_VERSION = re.compile(r"UCX\s+INFO\s+Version (\S+)")
#: UCX keeps this many characters of a context (agent) name.
NAME_MAX = 31

_SHM = {"posix", "sysv", "cma", "knem", "xpmem", "mm"}
_GPU_PREFIXES = ("cuda", "gdr", "rocm", "ze_")
_RDMA_PREFIXES = ("rc", "dc", "ud")

#: What each kind of transport means for a KV handoff, best first.
KIND_ORDER = ("gpu", "efa", "rdma", "shared memory", "loopback", "tcp", "other")


def transport_kind(tl_dev: str) -> str:
    """``cma/memory`` -> ``shared memory``; ``tcp/eth0`` -> ``tcp``; ``srd/rdmap0s31:1`` -> ``efa``; ..."""
    tl, _, dev = tl_dev.partition("/")
    if tl == "srd" or "efa" in tl or dev.startswith(("rdmap", "efa")):
        return "efa"
    if tl in _SHM:
        return "shared memory"
    if tl == "tcp":
        return "tcp"
    if tl == "self":
        return "loopback"
    if tl.startswith(_GPU_PREFIXES):
        return "gpu"
    if tl.startswith(_RDMA_PREFIXES):
        return "rdma"
    return "other"


def _in_range(size: int, rng: str) -> bool:
    lo, _, hi = rng.strip().partition("..")
    try:
        low = int(lo)
        high = float("inf") if hi in ("inf", "") and ".." in rng else int(hi or lo)
    except ValueError:
        return True
    return low <= size <= high


@dataclass
class ProtoTable:
    """One ``UCX_PROTO_INFO`` table."""

    context: str
    scope: str  # self | intra-node | inter-node
    operation: str = ""
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (range, description, config)

    def transports(self, size: int | None = None) -> list[str]:
        """``tl/dev`` names in the rows (only the row whose range holds ``size``, when given)."""
        out: list[str] = []
        for rng, _desc, cfg in self.rows:
            if size is None or _in_range(size, rng):
                out += [f"{tl}/{dev}" for tl, dev in _TL_DEV.findall(cfg) if f"{tl}/{dev}" not in out]
        return out


@dataclass
class UcxDiagnostics:
    version: str | None = None
    tables: list[ProtoTable] = field(default_factory=list)
    #: (context, scope, {lane kind: [tl/dev, ...]}) from the info-level lines.
    lanes: list[tuple[str, str, dict[str, list[str]]]] = field(default_factory=list)

    def data_path(self, context: str, mem: str = "host", size: int | None = None) -> tuple[list[str], str]:
        """Transports of ``context``'s READs into ``mem`` memory from a peer: (``[tl/dev, ...]``, source).

        ``source`` is ``proto-info`` (the table of the get protocol), ``lanes`` (the fallback) or ``none``.
        """
        context = context[:NAME_MAX]
        found: list[str] = []
        for t in self.tables:
            if (t.context == context and t.scope != "self" and t.operation.startswith("remote memory read")
                    and f"into {mem} memory" in t.operation):
                found += [x for x in t.transports(size) if x not in found]
        if found:
            return found, "proto-info"
        for ctx, scope, lanes in self.lanes:
            if ctx == context and scope != "self":
                for kind in ("rma_bw", "rma", "rma_am"):
                    if lanes.get(kind):
                        return list(lanes[kind]), "lanes"
        return [], "none"

    def control_path(self, context: str) -> list[str]:
        """Transports of ``context``'s active messages (NIXL's notifications and connection set-up)."""
        context = context[:NAME_MAX]
        for ctx, scope, lanes in self.lanes:
            if ctx == context and scope != "self" and lanes.get("am"):
                return list(lanes["am"])
        return []


def parse(text: str) -> UcxDiagnostics:
    diag = UcxDiagnostics()
    # Table state per process: lines of the holder and the reader interleave in one stream.
    current: dict[str, ProtoTable | None] = {}
    expect_op: dict[str, bool] = {}
    for raw in text.splitlines():
        m = _PREFIX.match(raw)
        if not m:
            continue
        pid, body = m.group(1), m.group(2).strip()
        if diag.version is None and (v := _VERSION.search(body)):
            diag.version = v.group(1)
            continue
        if (lm := _LANES.search(body)) is not None:
            lanes: dict[str, list[str]] = {}
            for kind, inner in _LANE.findall(lm.group(3)):
                lanes[kind] = [f"{tl}/{dev}" for tl, dev in _TL_DEV.findall(inner)]
            diag.lanes.append((lm.group(1), lm.group(2), lanes))
            continue
        if not body.startswith("|"):
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        if len(cells) == 1:
            h = _HEADER.match(cells[0])
            if h:
                table = ProtoTable(context=h.group(1), scope=h.group(2))
                diag.tables.append(table)
                current[pid], expect_op[pid] = table, True
            elif expect_op.get(pid) and current.get(pid) is not None:
                current[pid].operation = cells[0]  # type: ignore[union-attr]
                expect_op[pid] = False
        elif len(cells) == 3 and current.get(pid) is not None and cells[0] != "Range":
            current[pid].rows.append((cells[0], cells[1], cells[2]))  # type: ignore[union-attr]
    return diag
