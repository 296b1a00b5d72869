"""A bounded on-disk spool of encoded batches, replayed in sequence order; and the node's sequence state.

Records live in segment files ``seg-<first seq>.spool`` under the spool directory, each record
``<u32 length><u8 flags><u64 seq><payload>``; a torn record at the end of a segment (power cut
while writing) is ignored on reopen. The spool is ordered by ``seq``, whatever order records
were appended in (a batch whose delivery failed late comes back before later ones).

- :meth:`Spool.append` writes a record (flags: :data:`FAULT` marks a fault-class batch);
- :meth:`Spool.head` returns the next ``n`` records by seq that are not :meth:`taken <Spool.take>`;
- :meth:`Spool.ack` forgets a delivered record; :meth:`Spool.untake` puts a taken one back;
- a segment file is deleted once none of its records is left; acknowledgements of records
  whose segment still lives are appended to ``acks`` (8 bytes each), so that a restart does not
  replay what was delivered; that file is emptied whenever the spool is.

The bound: when the live bytes exceed ``max_bytes``, the oldest records without :data:`FAULT`
are dropped (and counted in ``dropped``) until it fits; fault-class records are never dropped, so
the spool can exceed its bound only by them. Not thread-safe: one owner (the publisher thread).

:class:`SeqState` keeps the node's next batch ``seq`` in ``<dir>/seq`` so that numbering
survives restarts; it is rewritten in place each time a seq is taken (one ``pwrite`` of a
fixed-width number on a file kept open, no fsync: a process killed between two writes leaves the
one or the other, never a torn number; a create-and-rename per batch cost ~0.5 ms of journal work).
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass

from transom.log import get

__all__ = ["Spool", "SpoolRecord", "SeqState", "FAULT"]

log = get("agent.spool")

FAULT = 1
_HEAD = struct.Struct("<IBQ")


@dataclass
class SpoolRecord:
    seq: int
    flags: int
    segment: str
    offset: int
    size: int
    taken: bool = False

    @property
    def fault(self) -> bool:
        return bool(self.flags & FAULT)


class Spool:
    def __init__(self, directory: str, max_bytes: int, segment_bytes: int = 4 * 2**20) -> None:
        self.dir = directory
        self.max_bytes = int(max_bytes)
        self.segment_bytes = int(segment_bytes)
        os.makedirs(directory, exist_ok=True)
        self._seqs: list[int] = []                # sorted
        self._records: dict[int, SpoolRecord] = {}
        self._live: dict[str, int] = {}           # segment -> live record count
        self._tail: str | None = None
        self._tail_fh = None
        self.bytes = 0
        self._taken = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self._warned = False
        self._acks_path = os.path.join(directory, "acks")
        self._acks_fh = None
        self._recover()

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def max_seq(self) -> int | None:
        return self._seqs[-1] if self._seqs else None

    def _recover(self) -> None:
        acked: set[int] = set()
        try:
            with open(self._acks_path, "rb") as fh:
                raw = fh.read()
            acked = {v for (v,) in struct.iter_unpack("<Q", raw[: len(raw) - len(raw) % 8])}
        except FileNotFoundError:
            pass
        names = sorted(n for n in os.listdir(self.dir) if n.startswith("seg-") and n.endswith(".spool"))
        for name in names:
            path = os.path.join(self.dir, name)
            with open(path, "rb") as fh:
                data = fh.read()
            pos = 0
            good = 0
            while pos + _HEAD.size <= len(data):
                size, flags, seq = _HEAD.unpack_from(data, pos)
                if pos + _HEAD.size + size > len(data):
                    break
                if seq not in self._records and seq not in acked:
                    self._add(SpoolRecord(seq, flags, name, pos + _HEAD.size, size))
                pos += _HEAD.size + size
                good = pos
            if good < len(data):
                log.warning("spool: %s ends with a torn record (%d bytes ignored)", path, len(data) - good)
            if not self._live.get(name):
                os.unlink(path)
        with open(self._acks_path, "wb") as fh:  # keep only the acks that still matter
            fh.write(b"".join(struct.pack("<Q", a) for a in sorted(acked) if self._segment_of_acked(a, names)))
        if self._seqs:
            log.warning("spool: %d undelivered batch(es) found in %s (seq %d..%d); they are replayed first",
                        len(self._seqs), self.dir, self._seqs[0], self._seqs[-1])

    def _segment_of_acked(self, seq: int, names: list[str]) -> bool:
        return any(n in self._live for n in names) and seq <= (self._seqs[-1] if self._seqs else -1)

    def _add(self, rec: SpoolRecord) -> None:
        bisect.insort(self._seqs, rec.seq)
        self._records[rec.seq] = rec
        self._live[rec.segment] = self._live.get(rec.segment, 0) + 1
        self.bytes += rec.size

    def _forget(self, seq: int) -> SpoolRecord:
        rec = self._records.pop(seq)
        if rec.taken:
            self._taken -= 1
        i = bisect.bisect_left(self._seqs, seq)
        del self._seqs[i]
        self.bytes -= rec.size
        self._live[rec.segment] -= 1
        if self._live[rec.segment] == 0 and rec.segment != self._tail:
            del self._live[rec.segment]
            try:
                os.unlink(os.path.join(self.dir, rec.segment))
            except FileNotFoundError:
                pass
        return rec

    # ------------------------------------------------------------------ writing

    def append(self, seq: int, payload: bytes, flags: int = 0) -> None:
        if seq in self._records:
            return  # already spooled (a late failure of a batch that is in here)
        if self._tail_fh is None or self._tail_fh.tell() >= self.segment_bytes:
            self._rotate(seq)
        fh = self._tail_fh
        offset = fh.tell() + _HEAD.size
        fh.write(_HEAD.pack(len(payload), flags, seq) + payload)
        fh.flush()
        self._add(SpoolRecord(seq, flags, self._tail, offset, len(payload)))
        self._enforce_bound()

    def _rotate(self, seq: int) -> None:
        if self._tail_fh is not None:
            self._tail_fh.close()
            old = self._tail
            if old is not None and not self._live.get(old):
                self._live.pop(old, None)
                os.unlink(os.path.join(self.dir, old))
        name = f"seg-{seq:020d}.spool"
        while os.path.exists(os.path.join(self.dir, name)):
            name = name.replace(".spool", "x.spool")
        self._tail = name
        self._live.setdefault(name, 0)
        self._tail_fh = open(os.path.join(self.dir, name), "ab")

    def _enforce_bound(self) -> None:
        if self.bytes <= self.max_bytes:
            return
        for seq in list(self._seqs):
            if self.bytes <= self.max_bytes:
                break
            rec = self._records[seq]
            if rec.fault or rec.taken:
                continue
            self._forget(seq)
            self.dropped += 1
            self.dropped_bytes += rec.size
        if not self._warned:
            self._warned = True
            log.warning("spool: %s is full (%d MiB bound); dropping the oldest metric batches, never "
                        "fault-class ones (counted in the agent's 'dropped'; said once)",
                        self.dir, self.max_bytes >> 20)

    # ------------------------------------------------------------------ reading

    def _payload(self, rec: SpoolRecord) -> bytes:
        if rec.segment == self._tail and self._tail_fh is not None:
            self._tail_fh.flush()
        with open(os.path.join(self.dir, rec.segment), "rb") as fh:
            fh.seek(rec.offset)
            return fh.read(rec.size)

    def head(self, n: int) -> list[tuple[SpoolRecord, bytes]]:
        """The first ``n`` records by seq that are not taken, with their payloads."""
        out = []
        for seq in self._seqs:
            rec = self._records[seq]
            if rec.taken:
                continue
            out.append((rec, self._payload(rec)))
            if len(out) >= n:
                break
        return out

    def untaken(self) -> int:
        return len(self._seqs) - self._taken

    def take(self, seq: int) -> None:
        rec = self._records[seq]
        if not rec.taken:
            rec.taken = True
            self._taken += 1

    def untake(self, seq: int) -> None:
        rec = self._records.get(seq)
        if rec is not None and rec.taken:
            rec.taken = False
            self._taken -= 1

    def ack(self, seq: int) -> None:
        if seq not in self._records:
            return
        rec = self._forget(seq)
        if rec.segment in self._live:  # its segment stays: remember the ack across a restart
            if self._acks_fh is None:
                self._acks_fh = open(self._acks_path, "ab")
            self._acks_fh.write(struct.pack("<Q", seq))
            self._acks_fh.flush()
        if not self._seqs and self._acks_fh is not None:
            self._acks_fh.truncate(0)
            self._acks_fh.seek(0)

    def close(self) -> None:
        if self._acks_fh is not None:
            self._acks_fh.close()
            self._acks_fh = None
        if not self._seqs and os.path.exists(self._acks_path):
            os.unlink(self._acks_path)
        if self._tail_fh is not None:
            self._tail_fh.close()
            self._tail_fh = None
            if self._tail is not None and not self._live.get(self._tail):
                self._live.pop(self._tail, None)
                try:
                    os.unlink(os.path.join(self.dir, self._tail))
                except FileNotFoundError:
                    pass
            self._tail = None


class SeqState:
    """The next batch sequence number of this node, kept in ``<dir>/seq``."""

    def __init__(self, directory: str, floor: int = 0) -> None:
        self.path = os.path.join(directory, "seq")
        os.makedirs(directory, exist_ok=True)
        stored = 0
        try:
            with open(self.path) as fh:
                stored = int(fh.read().strip() or 0)
        except FileNotFoundError:
            pass
        except ValueError:
            log.warning("seq state %s is unreadable; continuing from the spool's highest seq", self.path)
        self.next = max(stored, floor)
        self._fd: int | None = None

    def take(self) -> int:
        seq = self.next
        self.next += 1
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.pwrite(self._fd, b"%20d\n" % self.next, 0)      # same width every time: never a shorter tail
        return seq

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
