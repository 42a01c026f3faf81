"""What a DHT server node agrees to store for others, within bounds. Pure, no I/O:
the caller passes the time and applies each decision to py-libp2p's stores (net/dht.py).

py-libp2p keeps any valid record a peer puts, up to 50,000 of them, for 24-48 h; a
Sybil flood of valid records from fresh keys grew a node by gigabytes. Here:

- a byte budget over everything stored (key + value + what py-libp2p spends per entry);
- per publisher (the key that signed the record, which our record keys name): at most
  so many records and bytes; fresh keys defeat this alone, hence
- per sender (the peer that put a record someone else signed): at most so many;
- a TTL cap: an entry lives until the record's own expiry or the cap, whichever is first
  (our own records: until their own expiry; we re-put them before it);
- when the budget is full, a newcomer evicts the oldest entries of whoever holds the
  most (a sender's third-party records, else a publisher's), but only from a holder that
  would still hold more than the newcomer does: fresh identities with one record each
  cannot push out established ones. A re-put of a stored key (a publisher refreshing its
  record) and our own records are always taken (they may evict without that limit), and
  our own records are never evicted.

The same class bounds provider records: key (content key, provider), publisher = sender
= the provider (py-libp2p takes ADD_PROVIDER only for the sender itself).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Hashable

MiB = 1024 * 1024

# Values (PUT_VALUE). A server record is at most 8 KiB, a karma record 4 KiB; honest ones
# are 0.3-1 KiB. ENTRY_OVERHEAD_BYTES: measured RSS per stored record beyond its key and
# value (py-libp2p's protobuf copy of the record, its tuple and dict slot, timeReceived):
# 5,000 records of 0.5 KB (key and value) grew a node by 1.65 KB each, of 2.5 KB by 3.3 KB.
VALUE_BUDGET_BYTES = 16 * MiB  # ~10,000 typical records: every record of a 1,000-server swarm
ENTRY_OVERHEAD_BYTES = 1280
PER_PUBLISHER_RECORDS = 32  # one server record per model served, plus a karma record
PER_PUBLISHER_BYTES = 128 * 1024
PER_SENDER_RECORDS = 64  # records signed by others one peer may put (py-libp2p's look-ups re-put a few)
PER_SENDER_BYTES = 256 * 1024
# Server records are re-put every 20 s (TTL 60 s), karma records every 10 minutes (TTL
# 1 h): three karma refresh periods. py-libp2p would keep a record 24 h (served 48 h).
# (A --record-ttl over 90 min, re-put less often than the cap, would lapse between puts.)
VALUE_TTL_CAP_S = 30 * 60.0

# Provider records (ADD_PROVIDER). A server provides the model key, one key per block it
# serves, the seed key per model and reports keys; re-provided at least every 10 minutes.
PROVIDER_BUDGET_BYTES = 8 * MiB
PROVIDER_ENTRY_OVERHEAD_BYTES = 768  # ProviderRecord, PeerInfo, dict slots: ~730 B traced
PROVIDER_ADDR_OVERHEAD_BYTES = 128  # one Multiaddr object beyond its bytes: ~72 B traced
MAX_PROVIDER_ADDRS = 8  # addresses kept per provider entry (py-libp2p keeps any number)
PER_PROVIDER_KEYS = 512  # keys one provider may hold here (an 80-block span is ~90)
PER_PROVIDER_BYTES = PER_PROVIDER_KEYS * 4096
PROVIDER_TTL_CAP_S = 30 * 60.0  # three 10-minute refresh periods (py-libp2p: 48 h)


@dataclasses.dataclass(frozen=True)
class Bounds:
    budget: int  # total size of every entry
    per_publisher_count: int
    per_publisher_size: int
    per_sender_count: int  # entries one sender put that another publisher signed
    per_sender_size: int
    ttl_cap_s: float


VALUE_BOUNDS = Bounds(VALUE_BUDGET_BYTES, PER_PUBLISHER_RECORDS, PER_PUBLISHER_BYTES, PER_SENDER_RECORDS,
                      PER_SENDER_BYTES, VALUE_TTL_CAP_S)
PROVIDER_BOUNDS = Bounds(PROVIDER_BUDGET_BYTES, PER_PROVIDER_KEYS, PER_PROVIDER_BYTES, PER_PROVIDER_KEYS,
                         PER_PROVIDER_BYTES, PROVIDER_TTL_CAP_S)


def value_size(key: bytes, value: bytes) -> int:
    return len(key) + len(value) + ENTRY_OVERHEAD_BYTES


def provider_size(addrs: list[bytes]) -> int:
    return PROVIDER_ENTRY_OVERHEAD_BYTES + sum(len(a) + PROVIDER_ADDR_OVERHEAD_BYTES for a in addrs)


def publisher_of(key: bytes) -> str:
    """The signer a record key names: its last segment (`/csserver/<model>/<peer>`,
    `/cskarma/<peer>`); the DHT's validators have checked that this key signed it."""
    return key.rsplit(b"/", 1)[-1].decode("utf-8", "replace")


@dataclasses.dataclass(frozen=True)
class Admission:
    accepted: bool
    expires: float  # when the entry must be dropped (if accepted)
    evict: tuple = ()  # keys to drop from the store first (expired or evicted), accepted or not
    reason: str = ""  # why not, if refused


@dataclasses.dataclass
class _Entry:
    publisher: str
    sender: str | None  # None: our own put, or our own look-up's cache
    size: int
    expires: float
    holder: tuple | None  # whom eviction charges; None for our own records (never evicted)

    @property
    def foreign_sender(self) -> str | None:
        """The sender, if it put a record another key signed."""
        return self.sender if self.sender is not None and self.sender != self.publisher else None


class BoundedStore:
    """The bookkeeping of one store: admit() decides and records, remove() forgets."""

    def __init__(self, bounds: Bounds, *, own: str) -> None:
        self.bounds, self.own = bounds, own
        self.total = 0
        self._entries: dict[Hashable, _Entry] = {}
        self._publisher_count: dict[str, int] = {}
        self._publisher_size: dict[str, int] = {}
        self._sender_count: dict[str, int] = {}
        self._sender_size: dict[str, int] = {}
        self._holder_keys: dict[tuple, dict[Hashable, None]] = {}  # oldest first
        self._by_count: dict[int, set[tuple]] = {}  # holders by how many entries they hold
        self._max_count = 0
        self._expiry: list[tuple[float, int, Hashable]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def publisher_count(self, publisher: str) -> int:
        return self._publisher_count.get(publisher, 0)

    def publisher_size(self, publisher: str) -> int:
        return self._publisher_size.get(publisher, 0)

    def sender_count(self, sender: str) -> int:
        return self._sender_count.get(sender, 0)

    def sender_size(self, sender: str) -> int:
        return self._sender_size.get(sender, 0)

    def own_size(self) -> int:
        return sum(e.size for e in self._entries.values() if e.holder is None)

    def expires(self, key: Hashable) -> float | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.expires

    # -- decisions ----------------------------------------------------------------

    def admit(self, key: Hashable, *, publisher: str, sender: str | None, size: int, now: float,
              expires: float | None = None) -> Admission:
        """May `sender` (None: this node itself) store `key`, signed by `publisher`, of
        `size`? Expired entries are dropped first (listed in `evict`)."""
        dropped = self.expire(now)
        b = self.bounds
        own = publisher == self.own
        until = now + b.ttl_cap_s if expires is None else expires if own else min(now + b.ttl_cap_s, expires)
        old = self._entries.get(key)
        if old is not None:
            self._forget(key)
        # Our own record is ours whoever relayed it: it counts against no sender's bounds
        # (it always lands, so charging it to a sender could put that sender over them).
        entry = _Entry(publisher, None if own else sender, size, until,
                       None if own else self._holder_for(publisher, sender))

        def refuse(reason: str) -> Admission:
            if old is not None:
                self._record(key, old, schedule=False)  # its expiry is still scheduled
            return Admission(False, until, tuple(dropped), reason)

        if until <= now:
            return refuse("already expired")
        if not own:
            if self.publisher_count(publisher) + 1 > b.per_publisher_count:
                return refuse(f"publisher holds {b.per_publisher_count} records")
            if self.publisher_size(publisher) + size > b.per_publisher_size:
                return refuse(f"publisher holds {self.publisher_size(publisher)} bytes")
            via = entry.foreign_sender
            if via is not None and self.sender_count(via) + 1 > b.per_sender_count:
                return refuse(f"sender put {b.per_sender_count} records of others")
            if via is not None and self.sender_size(via) + size > b.per_sender_size:
                return refuse(f"sender put {self.sender_size(via)} bytes of others' records")
        evicted: list = []
        need = self.total + size - b.budget
        if need > 0:
            # A newcomer may only even out holders; a refresh or our own record may not wait.
            floor = 0 if own or old is not None else self._count(entry.holder) + 1
            planned = self._plan(need, floor)
            if planned is None and not own:
                return refuse("store full")
            evicted = planned if planned is not None else [k for k, e in self._entries.items()
                                                            if e.holder is not None]
        for victim in evicted:
            self._forget(victim)
        self._record(key, entry)
        return Admission(True, until, tuple(dropped + evicted))

    def remove(self, key: Hashable) -> None:
        """The store dropped `key` itself (expired on read, a look-up's refresh...)."""
        if key in self._entries:
            self._forget(key)

    def expire(self, now: float) -> list:
        """Forget and return every key whose entry expired by `now`."""
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            until, _, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires == until:
                self._forget(key)
                out.append(key)
        return out

    # -- eviction -----------------------------------------------------------------

    def _plan(self, need: int, floor: int) -> list | None:
        """Keys to evict to free `need`: the oldest entries of the holder holding most,
        again and again, while it holds more than `floor`; None if that is not enough."""
        plan: list = []
        taken: dict[tuple, int] = {}
        freed = 0
        while freed < need:
            holder = self._largest(taken, floor)
            if holder is None:
                return None
            keys = self._holder_keys[holder]
            key = next(itertools.islice(keys, taken.get(holder, 0), None))
            taken[holder] = taken.get(holder, 0) + 1
            plan.append(key)
            freed += self._entries[key].size
        return plan

    def _largest(self, taken: dict, floor: int) -> tuple | None:
        best, best_n = None, floor
        for n in range(self._max_count, floor, -1):
            if n <= best_n:
                break
            for holder in self._by_count.get(n, ()):
                left = n - taken.get(holder, 0)
                if left > best_n:
                    best, best_n = holder, left
                    if left == n:
                        break
        return best

    # -- bookkeeping --------------------------------------------------------------

    @staticmethod
    def _holder_for(publisher: str, sender: str | None) -> tuple:
        if sender is not None and sender != publisher:
            return ("via", sender)
        return ("by", publisher)

    def _count(self, holder: tuple | None) -> int:
        return 0 if holder is None else len(self._holder_keys.get(holder, ()))

    def _rebucket(self, holder: tuple, before: int, after: int) -> None:
        if before:
            bucket = self._by_count[before]
            bucket.discard(holder)
            if not bucket:
                del self._by_count[before]
        if after:
            self._by_count.setdefault(after, set()).add(holder)
            self._max_count = max(self._max_count, after)
        while self._max_count and self._max_count not in self._by_count:
            self._max_count -= 1

    def _record(self, key: Hashable, entry: _Entry, *, schedule: bool = True) -> None:
        self._entries[key] = entry
        self.total += entry.size
        p = entry.publisher
        self._publisher_count[p] = self._publisher_count.get(p, 0) + 1
        self._publisher_size[p] = self._publisher_size.get(p, 0) + entry.size
        via = entry.foreign_sender
        if via is not None:
            self._sender_count[via] = self._sender_count.get(via, 0) + 1
            self._sender_size[via] = self._sender_size.get(via, 0) + entry.size
        if entry.holder is not None:
            keys = self._holder_keys.setdefault(entry.holder, {})
            keys[key] = None
            self._rebucket(entry.holder, len(keys) - 1, len(keys))
        if schedule:
            heapq.heappush(self._expiry, (entry.expires, next(self._tie), key))
            if len(self._expiry) > 2 * len(self._entries) + 64:  # refreshes leave stale items behind
                self._expiry = [(e.expires, next(self._tie), k) for k, e in self._entries.items()]
                heapq.heapify(self._expiry)

    def _forget(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self.total -= entry.size
        _decrement(self._publisher_count, entry.publisher, 1)
        _decrement(self._publisher_size, entry.publisher, entry.size)
        via = entry.foreign_sender
        if via is not None:
            _decrement(self._sender_count, via, 1)
            _decrement(self._sender_size, via, entry.size)
        if entry.holder is not None:
            keys = self._holder_keys[entry.holder]
            del keys[key]
            self._rebucket(entry.holder, len(keys) + 1, len(keys))
            if not keys:
                del self._holder_keys[entry.holder]
        # its heap item stays until it surfaces: expire() skips it (no entry, or another expiry)


def _decrement(counts: dict, key, by: int) -> None:
    left = counts[key] - by
    if left:
        counts[key] = left
    else:
        del counts[key]
