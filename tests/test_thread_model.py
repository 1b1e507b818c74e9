"""A model of the threads that act on one pooled segment, every actor of it, explored
over every interleaving of their atomic steps.

``test_lifetime_model.py`` checks the cross-process protocol with single-threaded
processes. Here the processes are few and the threads many. The owner of ONE segment:
its two sender threads, its reaper (``Pool.reap_waiting``, run by a sender's ``Pool.take`` and by
the collector) and its collector thread, over its pool's state (the free list,
``waiting``, the segment's ``seg.gen``, that generation's Gen). The process that loads
from it: two loader threads, its collector, and at most one forked child (loaders in
the owner itself would load through its live Gen: the race on gens is a
receiver's). The header they share (its generation, sent, loaded, holders, flags), and
three locks: the owner's pool lock, its broker client's lock, and (fixed) the
receiver's find-or-make lock of the segment's Gen. A lock is held by the thread whose
place (pc) says so; a step that needs one held by another thread cannot run.

Breadth-first search over every reachable state (deduplicated; in the larger world,
every state within 14 steps of the start: about 116,000 states in all, 5 s here),
asserting at every one:

safety    a live storage of generation G (a sender's, a loader's, the child's), or a
          message naming G sent and not yet loaded, finds the header holding G: the
          generation was not ended under it (its memory not reused, its message not
          refused as stale). The segment is given back only with its header ended,
          never both free and waiting, and closed at most once.
deadlock  no thread waits for a lock held by a thread that waits, in turn, for one it
          holds (a cycle in the wait-for graph); and no state where nothing can run
          has a thread not done.
liveness  at every quiescent state (every thread idle, every storage dead and settled,
          every message loaded or failed) the segment is new, free, closed, or waiting
          with a header its next reap frees or closes.

The actors, their steps, and the code each step models (each step is one function
below, its docstring naming it):

sender threads 0, 1 (``transfer.sending`` / ``share``, ``Pool.take``)
    take          ``Pool.take`` on a free (or new) segment, ``Segment.begin`` (the
                  header's generation written, nothing else), ``Pool.place`` (the
                  storage made, the maker's hold released), then ``share``'s ticket
                  (``hdr_issue``): a sending scope open, pickling one message.
    share         ``share`` of a storage of the current generation that a thread holds
                  (the same tensor on a second queue, or sent again): a ticket.
    drop          the sender's storage dies: the user's tensor, or, inside the scope, a
                  tensor made during pickling that only the pickler's memo kept.
    scope_exit    ``sending.__exit__``: the message exists (deliverable) from now on.
    scope_fails   ``sending.__exit__`` with an error: never delivered.
    reap_copy     ``Pool.take`` -> ``Pool.reap_waiting``: ``waiting.copy()``.
    reap_end      ``Pool.reap_waiting`` -> ``Pool.end_generation`` of the entry copied.
    reconnect     a share that reconnects to its broker (``BrokerClient.connect``):
                  the client's lock taken ...
    hook          ... and under it the ``on_connect`` hook (``transfer._on_connect``:
                  ``Pool.owned`` / ``retire_where``) takes the pool's lock.
    post          a segment closed (``Pool.leave``: ``client.release``/``drop``)
                  posts to the broker under the client's lock.
the owner's collector thread (``transfer.collect``, every PURGE_EVERY)
    settle        ``transfer.settle_dead``: the owner's Gen dead (``_native.dead()``) ->
                  ``Pool.end_generation``: given back (``hdr_free`` ended it), closed (retired),
                  or into ``waiting``.
    reap_copy, reap_end    ``Pool.reap_waiting``, as a sender's.
    trim          ``Pool.trim``: a segment free too long closed (``_trim_locked``).
    post          as a sender's; after ``trim``, under the pool lock where it posts there.
loader threads 0, 1 of the receiver (``transfer.receive_tensor``, ``_new_gen``)
    lookup        a message taken from its queue; ``seg.live_gen(gen)`` and
                  ``gen.acquire()``: found, the storage loaded through it
                  (``Gen.load``: count_loaded) in the same step; else on to ``make``.
    make          ``_new_gen``: ``hdr_hold`` (holders + 1 if the header holds the
                  generation: else the load fails, stale), ``seg.new_gen`` (the
                  segment remembers it), then the storage loaded through it.
    drop          the loader's storage dies (its Gen's count - 1).
    fork          ``transfer._before_fork`` -> ``segments.retire_in_use``: ``hdr_retire``
                  of the remembered Gen's generation if that Gen is live here;
                  the child keeps every storage the loaders hold, uncounted, for good.
the receiver's collector (``transfer.settle_dead`` in a receiver)
    settle        a dead Gen (count 0, ``_native.dead()``): ended, ``hdr_unhold``.

What this model leaves to ``test_lifetime_model.py``: the ledger and the broker,
SIGKILL, messages lost, a message loaded twice (the ticket bitmap), the owner's forks,
and ``hdr_free``'s FREEING window (``hdr_hold`` waits it out); ``hdr_free`` and
``hdr_hold`` are one step each here. Slabs (a thread's gen held across messages)
are a sender holding its storage. A message is taken by one loader (a queue).

Each fix the code makes for a race between these actors has a flag in ``VARIANTS``
that takes it out again; the explorer must find a violation in each (the model has
teeth), and none with every fix in:

stale_reaper         ``Pool.reap_waiting`` copies ``waiting`` (segments) and ``Pool.end_generation(seg)``
                     reads ``seg.gen`` only when it runs: another thread ended that
                     generation meanwhile, gave the segment back and began the next in it,
                     whose header the stale ``hdr_free`` ends under its live storage.
                     Fixed: ``waiting`` holds (segment, generation); ``end(seg, gen)`` is
                     one compare-and-swap transition on the header for the generation the
                     caller saw (``hdr_free`` checks it under FREEING; a retired
                     generation's close is claimed once per generation); the entry is
                     popped only if it still is (seg, gen), under the pool lock; only the
                     thread whose transition succeeded gives back or closes.
close_unclaimed      part of that fix: the close of a retired generation decided by the
                     transition without its once-per-generation claim: two reapers that
                     copied (seg, gen) both close it.
count_sent_at_exit   ``count_sent`` when the sending scope closes: a storage made while
                     pickling dies first (only the memo kept it), the collector ends its
                     generation (sent == loaded == 0), and the count lands in the next
                     generation's header while the message names one gone. Fixed: sent
                     is counted with the ticket (the pickler holds the storage), a scope
                     that fails marks its tickets loaded (cancels them), and the scope
                     keeps its Gens alive until it closes.
racy_gen           two loaders find no live Gen of a generation at once and both
                     make one (holders 2); the segment remembers the second; a fork
                     retires only what the remembered Gen holds, so a storage of the
                     first goes to the child unretired and is reused under it. Fixed:
                     find-or-make of a Gen is one critical section per segment.
post_under_pool_lock the collector posts a close to the broker (client lock) while it
                     holds the pool lock; a reconnection hook runs under the client lock
                     and takes the pool lock: deadlock. Fixed: what to close is collected
                     under the pool lock and closed after it is released.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import pytest

STALE_REAPER = "stale_reaper"
CLOSE_UNCLAIMED = "close_unclaimed"
COUNT_AT_EXIT = "count_sent_at_exit"
RACY_GEN = "racy_gen"
POST_UNDER_LOCK = "post_under_pool_lock"
VARIANTS = (STALE_REAPER, CLOSE_UNCLAIMED, COUNT_AT_EXIT, RACY_GEN, POST_UNDER_LOCK)

# Where the segment is in its owner's pool (State.where).
NEW = "new"  # not made yet: the first take makes it
FREE = "free"  # in the free list
USED = "used"  # taken: its generation alive, or over and waiting (State.waiting), or being ended
CLOSED = "closed"  # out of the pool for good

# A message (Msg.state).
PICKLING, SENT, FAILED, TAKEN, LOADED, STALE = "pickling", "sent", "failed", "taken", "loaded", "stale"

# Where a thread is (its pc).
IDLE = "idle"
SCOPE = "scope"  # a sender inside a sending scope, its ticket drawn
REAP_END = "reap_end"  # waiting copied; next: end() of the copy's entry
POST = "post"  # a segment closed; next: its release posted (client lock)
POST_LOCKED = "post_locked"  # the same, the pool lock still held (post_under_pool_lock)
HOOK = "hook"  # the client lock held by a reconnection; next: its hook (pool lock)
MAKE = "make"  # a loader found no live Gen; next: _new_gen (holding the Gen lock, fixed)

# Locks.
POOL_LOCK, CLIENT_LOCK, GEN_LOCK = "the pool lock", "the client lock", "the Gen lock"

SEG = -2  # a reap's copy of waiting under stale_reaper: the segment, no generation

# Actors, as (kind, index): trace labels and the wait-for graph.
SENDER, COLLECTOR, LOADER, RSETTLE = "sender", "collector", "loader", "receiver's collector"
Me = tuple[str, int]


@dataclass(frozen=True)
class Config:
    senders: int = 2
    loaders: int = 2
    generations: int = 2
    messages: int = 3  # tickets drawn, in all
    forks: int = 1  # of the receiver
    reconnects: int = 1
    variant: str = ""  # "" (every fix in), or one of VARIANTS (that fix taken out)


class Header(NamedTuple):
    """The shared header (``shmreduce/_native/header.c``), the fields this model needs."""

    gen: int = 0
    sent: int = 0
    loaded: int = 0
    holders: int = 0
    retired: bool = False
    closing: bool = False  # the generation's close claimed (fixed stale_reaper)


class Msg(NamedTuple):
    gen: int
    state: str = PICKLING


class Sender(NamedTuple):
    pc: str = IDLE
    gen: int = 0  # of the storage it holds, or of its scope's message
    holds: bool = False  # a reference to a storage of gen (its tensor, or the pickler's memo)
    msg: int = -1  # the message its scope pickles
    snap: int = -1  # its reap's copy of waiting: a generation, or SEG


class Collector(NamedTuple):
    pc: str = IDLE
    snap: int = -1


class Loader(NamedTuple):
    pc: str = IDLE
    msg: int = -1  # the message it loads
    tok: int = -1  # the Gen its storage (or load) counts on, an index in State.toks
    gen: int = 0  # of that storage


class State(NamedTuple):
    header: Header
    senders: tuple[Sender, ...]
    loaders: tuple[Loader, ...]
    collector: Collector = Collector()
    where: str = NEW
    seg_gen: int = 0  # the owner's seg.gen: its generation's Gen's
    own_ended: bool = True  # that Gen ended (settled), or none yet
    waiting: int = 0  # the generation of Pool.waiting's entry for the segment; 0: none
    closes: int = 0
    gens: int = 0  # generations begun
    msgs: tuple[Msg, ...] = ()
    toks: tuple[int, ...] = ()  # the receiver's Gens not ended, by their generation
    rtok: int = -1  # the one the segment remembers (seg.gen_ref), an index in toks
    child: frozenset[int] = frozenset()  # the generations of the storages a forked child keeps
    forks: int = 0
    reconnects: int = 0


def initial(cfg: Config) -> State:
    return State(Header(), (Sender(),) * cfg.senders, (Loader(),) * cfg.loaders)


T = TypeVar("T", Header, Msg, Sender, Collector, Loader, State)


def _with(obj: T, **changes: Any) -> T:
    return obj._replace(**changes)


def _sender(s: State, i: int, **changes: Any) -> State:
    p = _with(s.senders[i], **changes)
    if p.pc == IDLE and not p.holds and (p.gen or p.msg != -1 or p.snap != -1):
        p = Sender()  # nothing left of what it did: one state, not many
    return _with(s, senders=s.senders[:i] + (p,) + s.senders[i + 1 :])


def _loader(s: State, i: int, **changes: Any) -> State:
    p = _with(s.loaders[i], **changes)
    if p.pc == IDLE and p.tok == -1 and (p.gen or p.msg != -1):
        p = Loader()
    return _with(s, loaders=s.loaders[:i] + (p,) + s.loaders[i + 1 :])


def _msg(s: State, j: int, state: str) -> State:
    return _with(s, msgs=s.msgs[:j] + (_with(s.msgs[j], state=state),) + s.msgs[j + 1 :])


# -- derived facts: gen counts, lock holders ----------------------------------


def owner_count(s: State, cfg: Config) -> int:
    """The count of the owner's Gen of ``seg.gen``: its senders' storages of it, and
    (fixed count_sent_at_exit) each sending scope's hold on its message's gen."""
    n = 0
    for p in s.senders:
        if p.gen and p.gen == s.seg_gen:
            n += p.holds + (p.pc == SCOPE and cfg.variant != COUNT_AT_EXIT)
    return n


def gen_count(s: State, k: int) -> int:
    """The count of the receiver's Gen *k*: its loaders' storages (or loads) of it."""
    return sum(1 for p in s.loaders if p.tok == k)


def live_gen(s: State, gen: int) -> int:
    """``Segment.live_gen(gen)`` in the receiver: the remembered Gen if it is of
    *gen* and not ended (a dead one not yet settled is revived by ``acquire``), else -1."""
    return s.rtok if s.rtok >= 0 and s.toks[s.rtok] == gen else -1


def holder(s: State, lock: str, cfg: Config) -> Me | None:
    """The thread holding *lock*, read off where each thread is."""
    if lock == POOL_LOCK:
        return (COLLECTOR, 0) if s.collector.pc == POST_LOCKED else None
    if lock == CLIENT_LOCK:
        for i, p in enumerate(s.senders):
            if p.pc == HOOK:
                return (SENDER, i)
        return None
    for i, q in enumerate(s.loaders):
        if q.pc == MAKE and cfg.variant != RACY_GEN:
            return (LOADER, i)
    return None


def _free(s: State, lock: str, cfg: Config, me: Me) -> bool:
    """Whether *me* may take *lock* (free, or its own)."""
    who = holder(s, lock, cfg)
    return who is None or who == me


# -- the header's transitions (shmreduce/_native/header.c) ------------------------


def hdr_free(h: Header, gen: int) -> tuple[Header, bool]:
    """``hdr_free(addr, gen)`` as it was before ``hdr_end`` (which the buggy variants'
    ``Pool.end_generation`` calls with ``seg.gen``; ``hdr_end`` does this part under FREEING): end
    *gen* if nobody holds it, it is not retired and every ref sent in it was loaded
    (every field zeroed: the next ``begin`` writes only the generation)."""
    if h.gen == gen and not h.holders and not h.retired and h.sent == h.loaded:
        return Header(), True
    return h, False


GONE, FREED, CLOSE, WAIT = "gone", "freed", "close", "wait"


def hdr_end(h: Header, gen: int, claim: bool = True) -> tuple[Header, str]:
    """The fixed ``Pool.end_generation``'s one transition for generation *gen*, the one its caller
    saw: GONE if the header holds another (ended by another thread) or its close is
    claimed already; CLOSE, claimed once (*claim*: close_unclaimed, every time), if
    retired; FREED as ``hdr_free``; else WAIT."""
    if h.gen != gen:
        return h, GONE
    if h.retired:
        return (h, GONE) if h.closing else (_with(h, closing=claim), CLOSE)
    h, freed = hdr_free(h, gen)
    return h, FREED if freed else WAIT


# -- the owner's steps: each returns the next state, or None where it cannot run ----


def _close(s: State, me: Me, locked: bool = False) -> State:
    """The segment leaves the pool (``Pool.leave``); *me* posts its release next."""
    s = _with(s, where=CLOSED, closes=s.closes + 1)
    pc = POST_LOCKED if locked else POST
    return _with(s, collector=_with(s.collector, pc=pc)) if me[0] == COLLECTOR else _sender(s, me[1], pc=pc)


def _done(s: State, me: Me) -> State:
    return _with(s, collector=Collector()) if me[0] == COLLECTOR else _sender(s, me[1], pc=IDLE, snap=-1)


def end(s: State, me: Me, snap: int, waited: bool, cfg: Config) -> State | None:
    """``Pool.end_generation``, by *me* (settle, or a reap: *waited*, with the copy *snap*)."""
    if not _free(s, POOL_LOCK, cfg, me):
        return None  # give_back, the waiting dict: under the pool lock
    if cfg.variant == STALE_REAPER:
        # end(seg): hdr_free(seg.addr, seg.gen), seg.gen read now; then its flags.
        h, freed = hdr_free(s.header, s.seg_gen)
        s = _with(s, header=h)
        if not freed and not h.retired:
            return _done(s, me) if waited else _with(_done(s, me), waiting=s.seg_gen)
        if waited:
            if not s.waiting:
                return _done(s, me)  # "another thread ended it"
            s = _with(s, waiting=0)
        outcome = FREED if freed else CLOSE
    else:
        h, outcome = hdr_end(s.header, snap, claim=cfg.variant != CLOSE_UNCLAIMED)
        s = _with(s, header=h)
        if outcome in (GONE, WAIT):
            return _done(s, me) if waited or outcome == GONE else _with(_done(s, me), waiting=snap)
        if waited and s.waiting == snap:
            s = _with(s, waiting=0)  # popped only if it still is (seg, gen)
    if outcome == CLOSE:
        return _close(s, me)
    return _with(_done(s, me), where=FREE)  # give_back


def take(s: State, i: int, cfg: Config) -> State | None:
    """``Pool.take`` (a free segment popped under the pool lock, or a new one made),
    ``Segment.begin`` (header's generation written), ``Pool.place`` (the storage),
    ``share``'s ticket (``hdr_issue``; fixed count_sent_at_exit: counted sent now)."""
    if s.where not in (NEW, FREE) or s.gens >= cfg.generations or len(s.msgs) >= cfg.messages:
        return None
    if not _free(s, POOL_LOCK, cfg, (SENDER, i)):
        return None
    gen = s.gens + 1
    s = _with(s, where=USED, gens=gen, seg_gen=gen, own_ended=False, header=_with(s.header, gen=gen))
    return _ticket(s, i, gen, cfg)


def _ticket(s: State, i: int, gen: int, cfg: Config) -> State:
    # Counted sent with the ticket, while the pickler holds the storage (count_sent_at_exit:
    # at scope_exit).
    h = s.header if cfg.variant == COUNT_AT_EXIT else _with(s.header, sent=s.header.sent + 1)
    s = _with(s, msgs=s.msgs + (Msg(gen),), header=h)
    return _sender(s, i, pc=SCOPE, gen=gen, holds=True, msg=len(s.msgs) - 1)


def share(s: State, i: int, cfg: Config) -> State | None:
    """``share`` of a storage of ``seg.gen`` alive in a sender (the same tensor pickled
    by a second feeder thread, or sent again): a ticket (``hdr_issue``)."""
    if len(s.msgs) >= cfg.messages or not any(p.holds and p.gen == s.seg_gen for p in s.senders):
        return None
    return _ticket(s, i, s.seg_gen, cfg)


def drop(s: State, i: int, cfg: Config) -> State | None:
    """The sender's storage dies (the user's tensor, or a pickled temporary whose only
    reference was the pickler's memo); the Gen's count - 1 (``_native`` deleter)."""
    if not s.senders[i].holds:
        return None
    return _sender(s, i, holds=False)


def scope_exit(s: State, i: int, cfg: Config) -> State | None:
    """``sending.__exit__`` without an error: the message exists from now on
    (count_sent_at_exit: ``count_sent`` here, into whatever the header holds now)."""
    p = s.senders[i]
    if cfg.variant == COUNT_AT_EXIT:
        s = _with(s, header=_with(s.header, sent=s.header.sent + 1))
    return _sender(_msg(s, p.msg, SENT), i, pc=IDLE, msg=-1)


def scope_fails(s: State, i: int, cfg: Config) -> State | None:
    """``sending.__exit__`` with an error: the message is never delivered. Fixed: its
    tickets marked loaded (cancelled); count_sent_at_exit: nothing was counted."""
    p = s.senders[i]
    if cfg.variant != COUNT_AT_EXIT:
        s = _with(s, header=_with(s.header, loaded=s.header.loaded + 1))
    return _sender(_msg(s, p.msg, FAILED), i, pc=IDLE, msg=-1)


def reap_copy(s: State, me: Me, cfg: Config) -> State | None:
    """``Pool.reap_waiting``: ``waiting.copy()`` (from ``Pool.take``, or the collector's
    ``collect``): a segment (stale_reaper) or a (segment, generation)."""
    if not s.waiting:
        return None
    snap = SEG if cfg.variant == STALE_REAPER else s.waiting
    if me[0] == COLLECTOR:
        return _with(s, collector=Collector(REAP_END, snap))
    if s.where != USED:
        return None  # Pool.take reaps only where no segment is free
    return _sender(s, me[1], pc=REAP_END, snap=snap)


def reap_end(s: State, me: Me, cfg: Config) -> State | None:
    """``Pool.reap_waiting`` -> ``Pool.end_generation`` of the entry it copied (stale_reaper: ``end(seg)``)."""
    snap = s.collector.snap if me[0] == COLLECTOR else s.senders[me[1]].snap
    return end(s, me, snap, True, cfg)


def settle(s: State, cfg: Config) -> State | None:
    """``transfer.settle_dead`` in the owner: its Gen of ``seg.gen`` dead (``_native.dead()``)
    -> ``Pool.end_generation``: given back, closed, or ``waiting[seg.key] = (seg, gen)``."""
    if s.where != USED or s.own_ended or owner_count(s, cfg):
        return None
    return end(_with(s, own_ended=True), (COLLECTOR, 0), s.seg_gen, False, cfg)


def trim(s: State, cfg: Config) -> State | None:
    """``Pool.trim``: a segment free too long, taken out of the free list under the pool
    lock and closed (post_under_pool_lock: its release posted still under it)."""
    if s.where != FREE or not _free(s, POOL_LOCK, cfg, (COLLECTOR, 0)):
        return None
    return _close(s, (COLLECTOR, 0), locked=cfg.variant == POST_UNDER_LOCK)


def post(s: State, me: Me, cfg: Config) -> State | None:
    """``Pool.leave`` -> ``client.release`` / ``drop``: a record posted under the
    client's lock (then the pool lock let go of, where it was held)."""
    if not _free(s, CLIENT_LOCK, cfg, me):
        return None
    return _done(s, me)


def reconnect(s: State, i: int, cfg: Config) -> State | None:
    """``share`` -> ``_live_program`` -> ``BrokerClient.connect``: the broker gone, a
    new connection made under the client's lock ..."""
    if s.reconnects >= cfg.reconnects or not _free(s, CLIENT_LOCK, cfg, (SENDER, i)):
        return None
    return _sender(_with(s, reconnects=s.reconnects + 1), i, pc=HOOK)


def hook(s: State, i: int, cfg: Config) -> State | None:
    """... whose ``on_connect`` hook (``transfer._on_connect``) takes the pool lock
    (``Pool.owned``, ``retire_where``); both let go of after."""
    if not _free(s, POOL_LOCK, cfg, (SENDER, i)):
        return None
    return _sender(s, i, pc=IDLE)


# -- the receiver's steps ------------------------------------------------------------


def lookup(s: State, i: int, j: int, cfg: Config) -> State | None:
    """``receive_tensor``: message *j* taken from the queue; ``seg.live_gen(gen)`` and
    ``acquire()`` (fixed racy_gen: under the segment's Gen lock): found, the storage
    loaded through it (``Gen.load``, ``count_loaded``); else on to ``make``, the lock
    kept."""
    m = s.msgs[j]
    if m.state != SENT or not _free(s, GEN_LOCK, cfg, (LOADER, i)):
        return None
    k = live_gen(s, m.gen)
    if k < 0:
        return _loader(_msg(s, j, TAKEN), i, pc=MAKE, msg=j, gen=m.gen)
    return _load(s, i, j, k)


def _load(s: State, i: int, j: int, k: int) -> State:
    h, gen = s.header, s.msgs[j].gen
    if h.gen == gen:
        s = _with(s, header=_with(h, loaded=h.loaded + 1))
    return _loader(_msg(s, j, LOADED), i, pc=IDLE, msg=-1, tok=k, gen=gen)


def make(s: State, i: int, cfg: Config) -> State | None:
    """``_new_gen``: ``hdr_hold`` (the load fails, stale, if the header holds another
    generation), ``seg.new_gen`` (the segment remembers it), then the storage loaded
    through it; the Gen lock let go of."""
    p, h = s.loaders[i], s.header
    if h.gen != p.gen:
        return _loader(_msg(s, p.msg, STALE), i, pc=IDLE, msg=-1, gen=0)
    s = _with(s, header=_with(h, holders=h.holders + 1), toks=s.toks + (p.gen,), rtok=len(s.toks))
    return _load(s, i, p.msg, len(s.toks) - 1)


def unload(s: State, i: int, cfg: Config) -> State | None:
    """The loader's storage dies: its Gen's count - 1 (dead at zero, until settled)."""
    if s.loaders[i].tok < 0:
        return None
    return _loader(s, i, tok=-1, gen=0)


def fork(s: State, i: int, cfg: Config) -> State | None:
    """``transfer._before_fork`` -> ``segments.retire_in_use``: the remembered Gen's
    generation retired if that Gen is live here; the child keeps every storage."""
    kept = frozenset(p.gen for p in s.loaders if p.tok >= 0)
    if s.forks >= cfg.forks or not kept:
        return None
    h = s.header
    if s.rtok >= 0 and gen_count(s, s.rtok) and h.gen == s.toks[s.rtok]:
        h = _with(h, retired=True)
    return _with(s, header=h, child=s.child | kept, forks=s.forks + 1)


def rsettle(s: State, k: int, cfg: Config) -> State | None:
    """``transfer.settle_dead`` in the receiver: Gen *k* dead (``_native.dead()``): ended, and
    ``hdr_unhold`` of its generation (the ledger's part: ``test_lifetime_model.py``)."""
    if gen_count(s, k):
        return None
    h, gen = s.header, s.toks[k]
    if h.gen == gen and h.holders:
        h = _with(h, holders=h.holders - 1)
    # An ended gen is gone from the model: nothing counts on it, live_gen skips it.
    rtok = -1 if s.rtok == k else s.rtok - (s.rtok > k)
    loaders = tuple(_with(p, tok=p.tok - (p.tok > k)) for p in s.loaders)
    return _with(s, header=h, toks=s.toks[:k] + s.toks[k + 1 :], rtok=rtok, loaders=loaders)


# -- successors ---------------------------------------------------------------------


def successors(s: State, cfg: Config) -> Iterator[tuple[str, State]]:
    """Every step that can run in *s*, labelled, with the state it leads to."""
    out: list[tuple[str, State | None]] = []
    for i, p in enumerate(s.senders):
        who, me = f"sender {i}", (SENDER, i)
        if p.pc == IDLE:
            out += [
                (f"{who}: take", take(s, i, cfg)),
                (f"{who}: share", share(s, i, cfg)),
                (f"{who}: drop", drop(s, i, cfg)),
                (f"{who}: reap_copy", reap_copy(s, me, cfg)),
                (f"{who}: reconnect", reconnect(s, i, cfg)),
            ]
        elif p.pc == SCOPE:
            out += [
                (f"{who}: drop", drop(s, i, cfg)),
                (f"{who}: scope_exit", scope_exit(s, i, cfg)),
                (f"{who}: scope_fails", scope_fails(s, i, cfg)),
            ]
        elif p.pc == REAP_END:
            out.append((f"{who}: reap_end", reap_end(s, me, cfg)))
        elif p.pc == POST:
            out.append((f"{who}: post", post(s, me, cfg)))
        elif p.pc == HOOK:
            out.append((f"{who}: hook", hook(s, i, cfg)))
    c, me = s.collector, (COLLECTOR, 0)
    if c.pc == IDLE:
        out += [
            ("collector: settle", settle(s, cfg)),
            ("collector: reap_copy", reap_copy(s, me, cfg)),
            ("collector: trim", trim(s, cfg)),
        ]
    elif c.pc == REAP_END:
        out.append(("collector: reap_end", reap_end(s, me, cfg)))
    else:
        out.append(("collector: post", post(s, me, cfg)))
    for i, q in enumerate(s.loaders):
        who = f"loader {i}"
        if q.pc == MAKE:
            out.append((f"{who}: make", make(s, i, cfg)))
            continue
        if q.tok >= 0:
            out += [(f"{who}: drop", unload(s, i, cfg)), (f"{who}: fork", fork(s, i, cfg))]
        else:
            out += [(f"{who}: lookup message {j}", lookup(s, i, j, cfg)) for j in range(len(s.msgs))]
    out += [(f"{RSETTLE}: settle", rsettle(s, k, cfg)) for k in range(len(s.toks))]
    for label, after in out:
        if after is not None:
            yield label, after


# -- the properties ---------------------------------------------------------------------


def unsafe(s: State) -> str | None:
    """What breaks safety in *s*, or None."""
    gen = s.header.gen
    for i, p in enumerate(s.senders):
        if p.holds and p.gen != gen:
            return f"sender {i} keeps a storage of generation {p.gen}; the header holds {gen}"
    for i, q in enumerate(s.loaders):
        if q.tok >= 0 and q.gen != gen:
            return f"loader {i} keeps a storage of generation {q.gen}; the header holds {gen}"
    for g in s.child:
        if g != gen:
            return f"the forked child keeps a storage of generation {g}; the header holds {gen}"
    for j, m in enumerate(s.msgs):
        if m.state in (SENT, TAKEN, STALE) and m.gen != gen:
            return f"message {j} of generation {m.gen} waits for its first load; the header holds {gen}"
    if s.where == FREE and (gen or s.waiting):
        return f"the segment is free with generation {gen} in its header, waiting {s.waiting}"
    if s.closes > 1:
        return f"the segment closed {s.closes} times"
    return None


def deadlock(s: State, cfg: Config) -> str | None:
    """A cycle of threads each waiting for a lock the next holds, or None."""
    wants: dict[Me, str] = {}
    for i, p in enumerate(s.senders):
        if p.pc == POST:
            wants[(SENDER, i)] = CLIENT_LOCK
        elif p.pc == HOOK:
            wants[(SENDER, i)] = POOL_LOCK
    if s.collector.pc in (POST, POST_LOCKED):
        wants[(COLLECTOR, 0)] = CLIENT_LOCK
    for start in wants:
        at: Me | None = start
        chain: list[str] = []
        while at is not None and at in wants:
            lock = wants[at]
            who = holder(s, lock, cfg)
            if who is None or who == at:
                break
            chain.append(f"{at[0]} {at[1]} waits for {lock}, held by {who[0]} {who[1]}")
            at = who
            if at == start:
                return "deadlock: " + "; ".join(chain)
            if len(chain) > len(wants):
                break
    return None


def quiescent(s: State) -> bool:
    """Every thread idle, every storage dead and settled, every message loaded or failed."""
    return (
        all(p == Sender() for p in s.senders)
        and all(q == Loader() for q in s.loaders)
        and s.collector == Collector()
        and not s.toks
        and (s.own_ended or s.where != USED)
        and all(m.state in (LOADED, FAILED) for m in s.msgs)
    )


def stuck(s: State) -> str | None:
    """At a quiescent state: why the segment is pinned for good, or None."""
    if s.where in (NEW, FREE, CLOSED):
        return None
    if not s.waiting:
        return f"the segment left the pool: neither free, waiting nor closed (header {tuple(s.header)})"
    _, outcome = hdr_end(s.header, s.waiting)
    if outcome in (FREED, CLOSE):
        return None
    return f"waiting for good: generation {s.waiting}, header {tuple(s.header)}"


@dataclass
class Result:
    states: int = 1
    depth: int = 0
    violation: list[str] = field(default_factory=list)  # the shortest trace to one, its last line what breaks
    stuck: list[str] = field(default_factory=list)  # the shortest trace to a pinned quiescent state
    quiescent: int = 0
    seen: set[str] = field(default_factory=set)  # the steps that ran


def explore(cfg: Config, max_depth: int | None = None) -> Result:
    """Breadth-first over every reachable state (or those within *max_depth* steps of
    the start), each checked; stops at the first violation (the shortest trace)."""
    start = initial(cfg)
    parent: dict[State, tuple[State | None, str]] = {start: (None, "start")}

    def trace(s: State, why: str) -> list[str]:
        steps = [why]
        at: State | None = s
        while at is not None:
            at, label = parent[at]
            steps.append(label)
        return steps[::-1]

    result = Result()
    frontier = [start]
    # The states are tuples of tuples, acyclic: the cyclic collector, run every few
    # hundred of them made, would only walk the growing set again and again (a fifth
    # of the time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        while frontier and (max_depth is None or result.depth < max_depth):
            result.depth += 1
            following = []
            for s in frontier:
                ran = False
                for label, after in successors(s, cfg):
                    ran = True
                    result.seen.add(label.split(": ")[1].split(" ")[0])
                    if after in parent:
                        continue
                    parent[after] = (s, label)
                    following.append(after)
                    why = unsafe(after) or deadlock(after, cfg)
                    if why is not None:
                        result.violation = trace(after, why)
                        return result
                    if quiescent(after):
                        result.quiescent += 1
                        pinned = stuck(after)
                        if pinned is not None and not result.stuck:
                            result.stuck = trace(after, pinned)
                if not ran and not quiescent(s):
                    result.violation = trace(s, f"nothing can run, yet not every thread is done: {s}")
                    return result
            frontier = following
        return result
    finally:
        result.states = len(parent)
        if collecting:
            gc.enable()


# -- tests -----------------------------------------------------------------------------

# Worlds explored with every fix in: (config, depth bound or None: every reachable
# state). About 116,000 states in all, 5 s here.
WORLDS = {
    "every actor, three generations, three messages": (Config(generations=3), None),
    "every actor, two generations, four messages, to depth 14": (Config(messages=4), 14),
}
EXHAUSTIVE = [name for name, (_, depth) in WORLDS.items() if depth is None]


@functools.cache
def explored(world: str) -> Result:
    cfg, depth = WORLDS[world]
    return explore(cfg, depth)


@pytest.mark.parametrize("world", WORLDS)
def test_no_reachable_state_breaks_the_invariants(world: str) -> None:
    result = explored(world)
    assert not result.violation, "\n".join(result.violation)
    assert result.states > 40_000, "the model explores less than it did: a step lost its way?"


STEPS = {
    "take",
    "share",
    "drop",
    "scope_exit",
    "scope_fails",
    "reap_copy",
    "reap_end",
    "reconnect",
    "hook",
    "post",
    "settle",
    "trim",
    "lookup",
    "make",
    "fork",
}


@pytest.mark.parametrize("world", EXHAUSTIVE)
def test_every_step_is_taken(world: str) -> None:
    """The model has no dead step: each runs somewhere."""
    assert explored(world).seen == STEPS


@pytest.mark.parametrize("world", EXHAUSTIVE)
def test_every_quiescent_state_is_free_or_closed(world: str) -> None:
    """Nothing is pinned for good once every thread is done: the segment is free, closed,
    or waiting with a header its next reap frees or closes."""
    result = explored(world)
    assert result.quiescent > 100
    assert not result.stuck, "\n".join(result.stuck)


# The smallest world in which each fix taken out goes wrong, and what breaks there:
# exhaustive, the search stops at its first violation (the shortest trace).
BROKEN_WORLDS = {
    STALE_REAPER: (Config(senders=1, loaders=1, messages=2, forks=0, reconnects=0), "sender 0 keeps a storage of generation 2"),
    CLOSE_UNCLAIMED: (Config(loaders=1, generations=1, messages=1, reconnects=0), "closed 2 times"),
    COUNT_AT_EXIT: (Config(senders=1, loaders=0, generations=1, messages=1, forks=0, reconnects=0), "waits for its first load"),
    RACY_GEN: (Config(senders=1, generations=1, messages=2, reconnects=0), "the forked child keeps a storage"),
    POST_UNDER_LOCK: (Config(loaders=0, generations=1, messages=1, forks=0), "deadlock"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_fix_taken_out_is_caught(variant: str) -> None:
    """Each fix has teeth: without it the explorer finds the race it closes (the trace
    printed: ``pytest -s``, or in the report of a failure); with it, in the same world,
    none."""
    cfg, what = BROKEN_WORLDS[variant]
    result = explore(replace(cfg, variant=variant))
    print(f"{variant}: {len(result.violation) - 2} steps, {result.states} states")
    print("\n".join(result.violation))
    assert result.violation, f"{variant}: no violation in {result.states} states"
    assert what in result.violation[-1], "\n".join(result.violation)
    fixed = explore(cfg)
    assert not fixed.violation, "\n".join(fixed.violation)
    assert fixed.states > 10
