"""Per-host allocation of ports and CPU cores to engine replicas.

Several engine replicas can land on one host (and Ray gives them no core or port of their own), so each
replica claims what it uses with an advisory lock file under a per-host directory. The locks are held by
the replica process and vanish with it, so a crashed replica never leaks a claim.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pdserve.settings import settings


def lock_dir() -> Path:
    """The per-host directory of the claim files (``$PDSERVE_LOCK_DIR``, read at each claim)."""
    return settings().lock_dir


def _try_lock(path: Path, wait: bool = False) -> IO[str] | None:
    """``path`` locked for the caller (held until closed), or None when another holds it; ``wait``: wait for
    it instead (a short critical section among this host's replicas)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")  # noqa: SIM115 - held for the life of the claim
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _served_claim(port: int) -> Path:
    return lock_dir() / "served" / f"{port}.lock"


def claim_served_port(port: int) -> IO[str] | None:
    """This host's claim on serving ``port`` for one ``pdserve serve``, with that process's pid in it (None:
    another process holds it). Its routers bind the port with ``SO_REUSEPORT``, which lets a second app of
    the same user bind it too: the kernel would then split the connections between the two apps."""
    f = _try_lock(_served_claim(port))
    if f is not None:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
    return f


def served_port_holder(port: int) -> str:
    """The pid written in ``port``'s claim (:func:`claim_served_port`), or "" when unreadable."""
    try:
        return _served_claim(port).read_text().strip()
    except OSError:
        return ""


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ephemeral_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Claim:
    """What one replica holds: released when closed or when the process exits."""

    ports: list[int] = field(default_factory=list)
    cores: list[int] = field(default_factory=list)
    _files: list[IO[str]] = field(default_factory=list, repr=False)
    _core_files: list[IO[str]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for f in self._files:
            try:
                f.close()
            except OSError:
                pass
        self._files.clear()
        self._core_files.clear()


def claim_port_block(claim: Claim, base: int, count: int, *, limit: int = 2000) -> int:
    """Claim ``count`` consecutive free ports starting at or above ``base``; return the first.

    vLLM derives one NIXL side-channel port per rank from the base port, so a replica needs a block.
    """
    port = base
    while port + count <= min(base + limit, 65535):
        held: list[IO[str]] = []
        ok = True
        for p in range(port, port + count):
            f = _try_lock(lock_dir() / "ports" / f"{p}.lock")
            if f is None or not port_is_free(p):
                if f is not None:
                    f.close()
                ok = False
                break
            held.append(f)
        if ok:
            claim._files.extend(held)
            claim.ports.extend(range(port, port + count))
            return port
        for f in held:
            f.close()
        port += count
    raise RuntimeError(f"no block of {count} free ports in [{base}, {base + limit})")


#: Ephemeral ports :func:`claim_free_port` tries before it gives up.
FREE_PORT_TRIES = 64


def claim_free_port(claim: Claim, host: str = "0.0.0.0", *, tries: int = FREE_PORT_TRIES,
                    pick: Callable[[str], int] | None = None) -> int:
    """A free port the kernel picks (``bind`` to port 0), claimed under the same per-host locks as
    :func:`claim_port_block`'s, so no other replica on this host takes it before its engine binds it.

    A port only seen free is not enough: two replicas starting together can each be given the same one (it is
    free again once the probe socket closes), and vLLM binds its server socket with ``SO_REUSEADDR`` long
    before it listens, so both binds succeed. The second engine's server then fails, while the first answers
    the second's readiness check on the shared port, and the router sends one engine's requests, with its
    key, to the other (``HTTP 401``: seen with two prefill and two decode replicas starting at once)."""
    pick = pick or free_ephemeral_port
    for _ in range(max(1, tries)):
        port = pick(host)
        f = _try_lock(lock_dir() / "ports" / f"{port}.lock")
        if f is None:
            continue
        if not port_is_free(port, host):
            f.close()
            continue
        claim._files.append(f)
        claim.ports.append(port)
        return port
    raise RuntimeError(f"no free port on {host} that no other engine replica of this host has claimed "
                       f"after {tries} tries")


#: Engines sharing one core at most, as claims go (each a lock file of its own: ``cores/<core>[.<n>].lock``).
MAX_PER_CORE = 64


def _core_lock(core: int, n: int) -> Path:
    return lock_dir() / "cores" / (f"{core}.lock" if n == 0 else f"{core}.{n}.lock")


def _core_holders(core: int) -> tuple[list[tuple[str, int | None]], int | None]:
    """The replicas holding claims on ``core``: (role, its engine's pid once running) as each wrote them in
    its lock file, and the first claim slot free there (None: all ``MAX_PER_CORE`` held). Called under the
    host's claiming lock (:func:`claiming`)."""
    holders: list[tuple[str, int | None]] = []
    first_free: int | None = None
    for n in range(MAX_PER_CORE):
        path = _core_lock(core, n)
        if not path.exists():
            return holders, n if first_free is None else first_free
        f = _try_lock(path)
        if f is None:
            try:
                role, _, pid = path.read_text().strip().partition(" ")
            except OSError:
                role, pid = "", ""
            holders.append((role, int(pid) if pid.isdigit() else None))
        else:
            f.close()
            if first_free is None:
                first_free = n
    return holders, first_free


@contextmanager
def claiming() -> Iterator[None]:
    """This host's replicas claim cores and read each other's claims one at a time."""
    guard = _try_lock(lock_dir() / "cores" / "claiming.lock", wait=True)
    try:
        yield
    finally:
        if guard is not None:
            guard.close()


def _write(f: IO[str], text: str) -> None:
    f.seek(0)
    f.truncate()
    f.write(text)
    f.flush()


def claim_cores(claim: Claim, want: int, available: list[int], role: str = "") -> list[int]:
    """Claim ``want`` cores no other replica holds; when all are taken, share the least-claimed ones, those
    with the fewest engines of ``role`` first, taken in ``available``'s order among equals.

    Sharing keeps N engines on fewer cores working (slower, not broken). Each core has a series of claims
    (its first engine, its second, ...), each a lock file with its holder's role in it; replicas claim one at
    a time (a host-wide lock), so two prefill and two decode replicas on two cores run one of each a core,
    whatever order they start in: a decode engine never shares its core with the other decode engine while
    a core has none (two decode engines on one core each got half of it: time per token twice an idle
    engine's), and the prefill engine beside it can be put behind it (``cpu.shared_core_nice``).
    """
    want = max(1, min(want, len(available)))
    mine: list[int] = []
    with claiming():
        held = {core: _core_holders(core) for core in available}
        ranked = sorted(
            (c for c in available if held[c][1] is not None),
            key=lambda c: ([r for r, _ in held[c][0]].count(role) if role else 0, len(held[c][0]),
                           available.index(c)))
        for core in ranked[:want]:
            f = _try_lock(_core_lock(core, held[core][1]))  # type: ignore[arg-type]
            if f is None:  # (a replica of an older pdserve, claiming without the host lock)
                continue
            _write(f, role)
            claim._files.append(f)
            claim._core_files.append(f)
            mine.append(core)
    if len(mine) < want:  # (more than MAX_PER_CORE engines a core: the last cores, unclaimed)
        mine += [core for core in reversed(available) if core not in mine][:want - len(mine)]
    claim.cores = sorted(mine)
    return claim.cores


def note_engine(claim: Claim, role: str, pid: int) -> list[tuple[str, int | None]]:
    """Write this replica's running engine (``pid``) into its core claims, and return the other replicas
    holding claims on its cores: (role, engine pid or None while it starts). Under the claiming lock, so of
    two replicas sharing a core, the one that notes its engine later sees the other's."""
    with claiming():
        for f in claim._core_files:
            _write(f, f"{role} {pid}")
        others: list[tuple[str, int | None]] = []
        for core in claim.cores:
            holders, _ = _core_holders(core)
            others += [h for h in holders if h != (role, pid)]
        return others


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))
