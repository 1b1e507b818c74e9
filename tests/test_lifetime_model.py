"""A model of the lifetime protocol (broker/protocol.py, "Segments and generations" and
"Ledger"), explored over every interleaving of its atomic steps.

One pooled segment, its owner, two receivers, at most one forked child and a broker;
each process may be SIGKILLed between any two steps. Breadth-first search over every
reachable state (deduplicated; in the largest world, every state within 14 steps of the
start), asserting at every one:

safety    whenever a live process keeps a storage of generation G, or a message naming
          G was counted sent and not yet loaded for the first time (and is not lost),
          the header still holds G: the generation was not ended and its memory reused.
liveness  at every quiescent state (every process let go of everything or died, the
          broker read every dead receiver's ledger, every message sent was loaded or
          is lost) with the owner alive, the segment is free (``hdr_end`` would
          succeed, or did) or RETIRED; the one pin the protocol documents is a message
          never loaded (sent > loaded), with no holder counted.

Each step below is one function; what it models, by file and function:

owner (process 0; ``shmreduce/pool.py``, ``shmreduce/transfer.py``)
    begin         ``Segment.begin``: the header's generation written (nothing else:
                  ``hdr_end`` zeroed the rest), the owner's own storage made.
    draw          ``transfer.share`` -> ``_native.hdr_issue`` (``issue_ticket``): a ref
                  pickled draws a ticket; one past the bitmap sets RETIRED | UNCOUNTED.
                  A receiver holding the generation may send (forward) it too.
    pickled       ``transfer.sending.__exit__`` -> ``_native.count_sent``: sent + 1,
                  the message exists (deliverable) from now on.
    pickle_fails  ``sending.__exit__`` with an error: nothing counted sent.
    drop_own      the owner's last storage of G dies (``_native`` gen dead).
    free_begin    ``transfer.settle_dead`` / ``Pool.reap_waiting`` -> ``hdr_end``: CAS holders 0 -> FREEING;
                  if held instead, a RETIRED generation closes the segment (never reused).
    free_end      the rest of ``hdr_end``: ends G (generation 0, counters, tickets and
                  flags zeroed) if G is there, not RETIRED and sent == loaded; holders = 0.
                  Ended: the segment is free (``Pool.give_back``) for the next generation.
receiver (processes 1, 2; ``transfer.receive_tensor`` / ``_new_gen``, ``transfer.settle_dead``)
    take          ``broker.client.hold``: the ledger entry written TAKING.
    hold          ``hdr_hold``'s CAS: holders + 1, waiting while FREEING (or, after its
                  spins, giving up: nothing counted, the load fails stale).
    check         ``hdr_hold``'s generation check: stale, holders - 1 (and the load fails).
    stale         ``broker.client.let_go(entry, taken=False)``: entry FREE.
    mark_held     ``broker.client.held``: entry HELD.
    make          ``gen.storage`` / ``_native.rebuild``: the storage exists.
    ticket        ``hdr_loaded`` / ``rebuild``'s ``count_loaded``: the ticket's bit set,
                  loaded + 1 if it was clear (any count past the bitmap).
    load_again    a load in a process holding G (``seg.live_gen``): storage and
                  ``count_loaded``, no hold.
    drop          a storage dies; the last one: ``settle`` -> ``broker.client.dropping``
                  (entry DROPPING), then ``unhold`` (``hdr_unhold``), then ``clear``
                  (``broker.client.let_go``: entry FREE). The death and DROPPING are one
                  step: killed between them, the entry says HELD, as killed before.
any process
    fork          ``transfer._before_fork`` -> ``segments.retire_in_use``: ``hdr_retire`` of
                  each generation with a live storage here; the child keeps the storages,
                  uncounted (``pool._after_fork_in_child``), and can only let go of them.
    kill          SIGKILL: storages gone, a message being pickled never exists, the
                  ledger stays as it was.
broker (``shmreduce/broker/keeper.py``)
    reap          ``Keeper.count_out``: a dead receiver's entry HELD -> ``hdr_unhold``;
                  TAKING -> ``hdr_retire_any`` (what the header holds now: a stale
                  load's hold may have counted there); DROPPING -> ``hdr_retire``.
messages
    lose          a counted message dropped unread (a queue dropped): never loaded.

A message (the bytes of a pickle, e.g. a ``dumps`` blob) may be loaded any number of
times, by any receiver. Processes are single-threaded here: a fork happens between
operations, not inside another thread's load, and the owner does not load its own
messages. A receiver keeps one ledger entry: while it holds a generation it loads only
messages of that generation.

``BROKEN`` lists deliberately broken variants of the protocol; the explorer must find a
safety violation in each (the model has teeth); ``LEAKY_RETIRE``, the broker as first
written, pins a segment (``test_retiring_only_the_entrys_generation_pins_a_segment``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import pytest

# Ledger entry states, as broker/protocol.py numbers them.
FREE, HELD, TAKING, DROPPING = 0, 1, 2, 3

# A message: its pickle under way (ticket drawn), counted sent, lost unread, never made.
PICKLING, SENT, LOST, FAILED = "pickling", "sent", "lost", "failed"

# Roles.
OWNER, RECEIVER, CHILD = "owner", "receiver", "child"
OWN = -1  # the owner's own storage (not a message's), in Proc.storages

# Where a process is inside a multi-step operation (Proc.pc).
IDLE = "idle"
PICKLE = "pickle"  # a ticket drawn for message arg, not yet counted sent
HOLD = "hold"  # entry TAKING written; next: holders + 1
CHECK = "check"  # holders counted; next: the generation check
STALE = "stale"  # not holding (any more); next: entry FREE, the load fails
MARK_HELD = "mark_held"  # holding, checked; next: entry HELD
MAKE = "make"  # entry HELD; next: the storage made
TICKET = "ticket"  # storage made; next: count_loaded
UNHOLD = "unhold"  # entry DROPPING; next: hdr_unhold
CLEAR = "clear"  # counted out; next: entry FREE

# The owner's segment (State.phase).
NO_GEN = "no_gen"  # new, or free in the pool (hdr_end succeeded): the next generation may begin
ACTIVE = "active"  # generation State.procs[0].gen, the owner's own storage alive
WAITING = "waiting"  # the owner's storage dead; hdr_end not yet successful (Pool.waiting)
FREEING = "freeing"  # inside hdr_end, FREEING set
CLOSED = "closed"  # retired: never reused

BROKEN = (
    "count_every_load",  # count_loaded counts every load, not first loads
    "no_fork_retire",  # retire_in_use does nothing
    "held_without_taking",  # the ledger says HELD before holders + 1, no TAKING state
    "broker_unholds_taking",  # the broker counts a TAKING entry out (hdr_unhold)
    "hold_ignores_freeing",  # hdr_hold counts itself in while FREEING
    "free_ignores_sent",  # hdr_end ends the generation with refs not loaded
)
# The broker as first written: a TAKING entry retired only if the header still holds
# the entry's generation (``hdr_retire``). A receiver killed inside a stale load's
# ``hdr_hold`` then leaves a holder nobody counts out (found by this model).
LEAKY_RETIRE = "retire_entry_generation_only"


@dataclass(frozen=True)
class Config:
    receivers: int = 2
    messages: int = 2  # tickets drawn, in all (failed pickles too)
    generations: int = 2
    forks: int = 1
    tickets: int = 2  # the bitmap's capacity: a ticket >= this retires its generation
    variant: str = ""  # "" (the protocol as written), one of BROKEN, or LEAKY_RETIRE


# The records are NamedTuples (hashed and compared in C: every state is looked up in a
# dict), the state that holds them a frozen dataclass.


class Header(NamedTuple):
    """The shared header (``shmreduce/_native/header.c``: HDR_GEN .. HDR_BITS)."""

    gen: int = 0
    sent: int = 0
    loaded: int = 0
    holders: int = 0
    freeing: bool = False
    issued: int = 0
    retired: bool = False
    uncounted: bool = False
    bits: int = 0


class Msg(NamedTuple):
    gen: int
    ticket: int
    state: str
    loaded: bool = False  # ghost: some load of it reached count_loaded


class Proc(NamedTuple):
    role: str
    alive: bool = True
    reaped: bool = True  # a dead receiver's ledger read by the broker
    gen: int = 0  # the generation of its storages, ledger entry or own segment
    storages: frozenset[int] = frozenset()  # live storages: message indices, or OWN
    entry: int = FREE  # its ledger entry (receivers)
    pc: str = IDLE
    arg: int = -1  # the message of the operation in progress


@dataclass(frozen=True)
class State:
    header: Header
    procs: tuple[Proc, ...]
    msgs: tuple[Msg, ...] = ()
    phase: str = NO_GEN
    gens: int = 0  # generations begun
    forks: int = 0


def initial(cfg: Config) -> State:
    return State(Header(), (Proc(OWNER),) + tuple(Proc(RECEIVER) for _ in range(cfg.receivers)))


T = TypeVar("T")


def _with(obj: T, **changes: Any) -> T:
    """*obj* with *changes*: a record's ``_replace``, or for the State dataclass
    ``dataclasses.replace`` without ``__init__`` (a quarter of its time, here where
    copies are most of the exploration's)."""
    rebuild = getattr(obj, "_replace", None)
    if rebuild is not None:
        return rebuild(**changes)
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **changes)
    return new


def _proc(s: State, i: int, **changes: Any) -> State:
    p = _with(s.procs[i], **changes)
    if p.entry == FREE and not p.storages and p.pc == IDLE and p.role != OWNER and (p.gen or p.arg != -1):
        p = _with(p, gen=0, arg=-1)  # nothing left of a generation: one state, not many
    return _with(s, procs=s.procs[:i] + (p,) + s.procs[i + 1 :])


def _msg(s: State, j: int, **changes: Any) -> State:
    return _with(s, msgs=s.msgs[:j] + (_with(s.msgs[j], **changes),) + s.msgs[j + 1 :])


def _header(s: State, h: Header) -> State:
    return _with(s, header=h)


# -- the header's atomics (shmreduce/_native/header.c) -----------------------------


def hdr_unhold(h: Header, gen: int) -> Header:
    if h.gen != gen or h.holders == 0:
        return h
    return _with(h, holders=h.holders - 1)


def hdr_retire(h: Header, gen: int) -> Header:
    return _with(h, retired=True) if h.gen == gen else h


def count_loaded(h: Header, ticket: int, cfg: Config) -> Header:
    if ticket >= h.issued:
        return h  # never issued in this generation: counts nothing
    if ticket >= cfg.tickets or cfg.variant == "count_every_load":
        # Every load counts. Past cfg.messages + 1 the number tells nothing more (it is
        # only ever compared with sent): it stops there, and the state space stays finite.
        return _with(h, loaded=min(h.loaded + 1, cfg.messages + 1))
    bit = 1 << ticket
    if h.bits & bit:
        return h
    return _with(h, bits=h.bits | bit, loaded=h.loaded + 1)


# -- steps: each returns the next state, or None where it cannot run ----------------
# The owner's segment (State.phase) first; then a process's steps, by where it is
# (Proc.pc); then the broker's and the messages'.


def begin(s: State, cfg: Config) -> State | None:
    if s.phase != NO_GEN or s.gens >= cfg.generations:
        return None
    gen = s.gens + 1
    s = _with(s, header=_with(s.header, gen=gen), phase=ACTIVE, gens=gen)
    return _proc(s, 0, gen=gen, storages=frozenset({OWN}))


def drop_own(s: State, cfg: Config) -> State | None:
    if s.phase != ACTIVE or s.procs[0].pc != IDLE:
        return None  # a pickle under way keeps its storage alive
    return _proc(_with(s, phase=WAITING), 0, storages=frozenset())


def free_begin(s: State, cfg: Config) -> State | None:
    if s.phase != WAITING:
        return None
    h = s.header
    if h.holders == 0 and not h.freeing:
        return _with(s, header=_with(h, freeing=True), phase=FREEING)
    if h.retired:
        return _with(s, phase=CLOSED)
    return None  # held: it waits (Pool.waiting), looked at again later


def free_end(s: State, cfg: Config) -> State | None:
    if s.phase != FREEING:
        return None
    h = s.header
    loaded = h.sent == h.loaded or cfg.variant == "free_ignores_sent"
    if h.gen == s.procs[0].gen and not h.retired and loaded:
        return _with(s, header=Header(), phase=NO_GEN)
    return _with(s, header=_with(h, freeing=False, holders=0), phase=CLOSED if h.retired else WAITING)


OWNER_STEPS = (begin, drop_own, free_begin, free_end)


def draw(s: State, i: int, cfg: Config) -> State | None:
    p = s.procs[i]
    sender = (p.role == OWNER and s.phase == ACTIVE) or (p.role == RECEIVER and p.entry == HELD and p.storages)
    if not sender or len(s.msgs) >= cfg.messages:
        return None
    h = s.header
    ticket = h.issued
    h = _with(h, issued=h.issued + 1)
    if ticket >= cfg.tickets:
        h = _with(h, retired=True, uncounted=True)
    s = _with(s, header=h, msgs=s.msgs + (Msg(p.gen, ticket, PICKLING),))
    return _proc(s, i, pc=PICKLE, arg=len(s.msgs) - 1)


def pickled(s: State, i: int, cfg: Config) -> State | None:
    s = _header(s, _with(s.header, sent=s.header.sent + 1))
    return _proc(_msg(s, s.procs[i].arg, state=SENT), i, pc=IDLE, arg=-1)


def pickle_fails(s: State, i: int, cfg: Config) -> State | None:
    return _proc(_msg(s, s.procs[i].arg, state=FAILED), i, pc=IDLE, arg=-1)


def take(s: State, i: int, j: int, cfg: Config) -> State | None:
    p, m = s.procs[i], s.msgs[j]
    if p.role != RECEIVER or p.entry != FREE or m.state != SENT:
        return None
    entry = HELD if cfg.variant == "held_without_taking" else TAKING
    return _proc(s, i, entry=entry, gen=m.gen, pc=HOLD, arg=j)


def hold(s: State, i: int, cfg: Config) -> State | None:
    h = s.header
    if h.freeing and cfg.variant != "hold_ignores_freeing":
        return None  # it spins
    return _proc(_header(s, _with(h, holders=h.holders + 1)), i, pc=CHECK)


def hold_gives_up(s: State, i: int, cfg: Config) -> State | None:
    if not s.header.freeing:
        return None
    return _proc(s, i, pc=STALE)  # SPIN_LIMIT reached: hdr_hold returns False, nothing counted


def check(s: State, i: int, cfg: Config) -> State | None:
    p, h = s.procs[i], s.header
    if h.gen != p.gen:
        return _proc(_header(s, _with(h, holders=h.holders - 1)), i, pc=STALE)
    return _proc(s, i, pc=MARK_HELD)


def stale(s: State, i: int, cfg: Config) -> State | None:
    return _proc(s, i, entry=FREE, pc=IDLE, arg=-1)


def mark_held(s: State, i: int, cfg: Config) -> State | None:
    return _proc(s, i, entry=HELD, pc=MAKE)


def make(s: State, i: int, cfg: Config) -> State | None:
    p = s.procs[i]
    return _proc(s, i, storages=p.storages | {p.arg}, pc=TICKET)


def ticket(s: State, i: int, cfg: Config) -> State | None:
    p = s.procs[i]
    s = _header(s, count_loaded(s.header, s.msgs[p.arg].ticket, cfg))
    return _proc(_msg(s, p.arg, loaded=True), i, pc=IDLE, arg=-1)


def load_again(s: State, i: int, j: int, cfg: Config) -> State | None:
    p, m = s.procs[i], s.msgs[j]
    if p.role != RECEIVER or p.entry != HELD or not p.storages or m.state != SENT or m.gen != p.gen:
        return None
    s = _header(s, count_loaded(s.header, m.ticket, cfg))
    return _proc(_msg(s, j, loaded=True), i, storages=p.storages | {j})


def drop(s: State, i: int, storage: int, cfg: Config) -> State | None:
    p = s.procs[i]
    if p.role == OWNER:
        return None  # drop_own
    left = p.storages - {storage}
    if left or p.role == CHILD:
        return _proc(s, i, storages=left)  # a child counts nothing
    return _proc(s, i, storages=left, entry=DROPPING, pc=UNHOLD)


def unhold(s: State, i: int, cfg: Config) -> State | None:
    return _proc(_header(s, hdr_unhold(s.header, s.procs[i].gen)), i, pc=CLEAR)


def clear(s: State, i: int, cfg: Config) -> State | None:
    return _proc(s, i, entry=FREE, pc=IDLE)


def fork(s: State, i: int, cfg: Config) -> State | None:
    p = s.procs[i]
    if not p.storages or p.role == CHILD or s.forks >= cfg.forks:
        return None
    h = s.header if cfg.variant == "no_fork_retire" else hdr_retire(s.header, p.gen)
    child = Proc(CHILD, gen=p.gen, storages=p.storages)
    return _with(s, header=h, procs=s.procs + (child,), forks=s.forks + 1)


def kill(s: State, i: int, cfg: Config) -> State | None:
    p = s.procs[i]
    if p.pc == PICKLE:
        s = _msg(s, p.arg, state=FAILED)
    reaped = p.role != RECEIVER or p.entry == FREE
    return _proc(s, i, alive=False, reaped=reaped, storages=frozenset(), pc=IDLE, arg=-1)


def reap(s: State, i: int, cfg: Config) -> State | None:
    p, h = s.procs[i], s.header
    if p.entry == HELD or (p.entry == TAKING and cfg.variant == "broker_unholds_taking"):
        h = hdr_unhold(h, p.gen)
    elif p.entry == TAKING and cfg.variant != LEAKY_RETIRE:
        # Its hdr_hold may have counted it into whatever the header holds now (a stale
        # load: another generation, or a free segment): that is retired.
        h = _with(h, retired=True)
    else:
        h = hdr_retire(h, p.gen)
    return _proc(_header(s, h), i, reaped=True, entry=FREE)


def lose(s: State, j: int, cfg: Config) -> State | None:
    if s.msgs[j].state != SENT:
        return None
    return _msg(s, j, state=LOST)


# What a live process can do where it is, beside being killed (and, idle, draw, fork,
# drop, take, load_again).
Step = Callable[[State, int, Config], "State | None"]
NEXT: dict[str, tuple[Step, ...]] = {
    IDLE: (draw, fork),
    PICKLE: (pickled, pickle_fails),
    HOLD: (hold, hold_gives_up),
    CHECK: (check,),
    STALE: (stale,),
    MARK_HELD: (mark_held,),
    MAKE: (make,),
    TICKET: (ticket,),
    UNHOLD: (unhold,),
    CLEAR: (clear,),
}


def successors(s: State, cfg: Config) -> Iterator[tuple[str, State]]:
    """Every step that can run in *s*, labelled, with the state it leads to."""
    candidates: list[tuple[str, State | None]] = []
    if s.procs[0].alive:
        candidates += [(f"owner: {step.__name__}", step(s, cfg)) for step in OWNER_STEPS]
    for i, p in enumerate(s.procs):
        who = f"{p.role} {i}"
        if not p.alive:
            if not p.reaped:
                candidates.append((f"broker: reap {who}", reap(s, i, cfg)))
            continue
        candidates.append((f"{who}: kill", kill(s, i, cfg)))
        candidates += [(f"{who}: {step.__name__}", step(s, i, cfg)) for step in NEXT[p.pc]]
        if p.pc == IDLE:
            candidates += [(f"{who}: drop storage {st}", drop(s, i, st, cfg)) for st in sorted(p.storages)]
            for j in range(len(s.msgs)):
                candidates.append((f"{who}: take message {j}", take(s, i, j, cfg)))
                candidates.append((f"{who}: load_again message {j}", load_again(s, i, j, cfg)))
    candidates += [(f"message {j}: lose", lose(s, j, cfg)) for j in range(len(s.msgs))]
    for label, after in candidates:
        if after is not None:
            yield label, after


# -- the properties ----------------------------------------------------------------


def unsafe(s: State) -> str | None:
    """What breaks the invariant in *s*, or None."""
    gen = s.header.gen
    for i, p in enumerate(s.procs):
        if p.alive and p.storages and p.gen != gen:
            return f"{p.role} {i} keeps a storage of generation {p.gen}; the header holds {gen}"
    for j, m in enumerate(s.msgs):
        if m.state == SENT and not m.loaded and m.gen != gen:
            return f"message {j} of generation {m.gen} waits for its first load; the header holds {gen}"
    return None


def quiescent(s: State) -> bool:
    """Everyone let go of everything or died, the broker read every dead ledger, every
    message sent was loaded or is lost, and the owner lives, its storage dead."""
    return (
        s.procs[0].alive
        and s.phase in (NO_GEN, WAITING, CLOSED)
        and all(p.pc == IDLE and not (p.alive and p.storages) and p.reaped for p in s.procs)
        and all(m.loaded or m.state in (LOST, FAILED) for m in s.msgs)
    )


LEAKED = "holders nobody will count out"
UNCOUNTED_LOAD = "sent != loaded, every message loaded"


def stuck(s: State) -> str | None:
    """At a quiescent state: why the segment is pinned for good (neither free nor
    retired), or None. A message lost unread pins its generation (documented)."""
    h = s.header
    if s.phase == NO_GEN and h.holders and not h.retired:
        return f"{LEAKED}: {h.holders} in a free segment (its next generation is never freed)"
    if s.phase != WAITING or h.retired:
        return None
    if h.holders:
        return f"{LEAKED}: {h.holders} in generation {h.gen}"
    lost = any(m.state == LOST and not m.loaded and m.gen == h.gen for m in s.msgs)
    if h.sent != h.loaded and not lost:
        return f"{UNCOUNTED_LOAD}: {h.sent} != {h.loaded} in generation {h.gen}"
    return None


PAST_THE_BITMAP = "a ticket past the bitmap"
REUSED = "a second generation begun"


@dataclass
class Result:
    states: int = 1
    depth: int = 0
    unsafe: list[str] = field(default_factory=list)  # the shortest trace to a violation, its last line what breaks
    stuck: list[str] = field(default_factory=list)  # the shortest trace to a pinned quiescent state
    stuck_states: int = 0
    stuck_why: set[str] = field(default_factory=set)  # what pins them, numbers aside
    seen: set[str] = field(default_factory=set)  # the steps that ran, and PAST_THE_BITMAP, REUSED


def explore(cfg: Config, max_depth: int | None = None, stop_at_unsafe: bool = True) -> Result:
    """Breadth-first over every reachable state (or those within *max_depth* steps of
    the start), each checked: the traces found are the shortest."""
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
    while frontier and (max_depth is None or result.depth < max_depth):
        result.depth += 1
        following = []
        for s in frontier:
            for label, after in successors(s, cfg):
                result.seen.add(label.split(": ")[1].split(" ")[0])
                if after in parent:
                    continue
                parent[after] = (s, label)
                following.append(after)
                if after.header.uncounted:
                    result.seen.add(PAST_THE_BITMAP)
                if after.gens > 1:
                    result.seen.add(REUSED)
                why = unsafe(after)
                if why is not None and not result.unsafe:
                    result.unsafe = trace(after, why)
                    if stop_at_unsafe:
                        result.states = len(parent)
                        return result
                pinned = stuck(after) if quiescent(after) else None
                if pinned is not None:
                    result.stuck_states += 1
                    result.stuck_why.add(pinned.split(":")[0])
                    if not result.stuck:
                        result.stuck = trace(after, pinned)
        frontier = following
    result.states = len(parent)
    return result


# -- tests -------------------------------------------------------------------------

# Worlds explored: (config, depth bound or None: every reachable state). About 170,000
# states in all, 6 s here.
WORLDS = {
    "two receivers, two messages, to depth 14": (Config(), 14),
    "one receiver, two messages, a one-ticket bitmap": (Config(receivers=1, tickets=1), None),
    "two receivers, one message, one generation": (Config(messages=1, generations=1), None),
}
EXHAUSTIVE = [name for name, (_, depth) in WORLDS.items() if depth is None]


@functools.cache
def explored(world: str, variant: str = "") -> Result:
    cfg, depth = WORLDS[world]
    return explore(replace(cfg, variant=variant), depth, stop_at_unsafe=False)


@pytest.mark.parametrize("world", WORLDS)
def test_no_reachable_state_breaks_the_invariant(world: str) -> None:
    result = explored(world)
    assert not result.unsafe, "\n".join(result.unsafe)
    assert result.states > 20_000, "the model explores less than it did: a step lost its way?"


STEPS = {step.__name__ for step in OWNER_STEPS} | {step.__name__ for steps in NEXT.values() for step in steps}
STEPS |= {"take", "load_again", "drop", "kill", "reap", "lose"}


@pytest.mark.parametrize("world", EXHAUSTIVE)
def test_every_step_is_taken(world: str) -> None:
    """The model has no dead step: each runs somewhere, a ticket goes past the bitmap
    where there is one ticket for two messages, a segment is reused where there are two
    generations."""
    cfg, _ = WORLDS[world]
    expected = STEPS | ({PAST_THE_BITMAP} if cfg.tickets < cfg.messages else set()) | ({REUSED} if cfg.generations > 1 else set())
    assert explored(world).seen == expected


@pytest.mark.parametrize("world", EXHAUSTIVE)
def test_every_quiescent_state_is_free_or_retired(world: str) -> None:
    """Nothing is pinned for good once every process let go or died and the broker
    read every death, but a message lost unread (documented)."""
    result = explored(world)
    assert not result.stuck, "\n".join(result.stuck)


@pytest.mark.parametrize("world", EXHAUSTIVE)
def test_retiring_only_the_entrys_generation_pins_a_segment(world: str) -> None:
    """What this model found in the protocol as first written: a receiver loads a
    message of a generation that has ended (stale): its ledger entry says TAKING,
    ``hdr_hold`` adds 1 to holders, and SIGKILL lands before the generation check
    takes it back. A broker that retires only the entry's generation, which the header
    no longer holds, does nothing: the +1 stays in whatever the segment holds now,
    which its owner then never frees (safety holds: memory kept, never bytes lost).
    The broker retires what the header holds now instead (``hdr_retire_any``)."""
    result = explored(world, LEAKY_RETIRE)
    assert not result.unsafe
    assert result.stuck_why == {LEAKED}, result.stuck_why
    *_, take, hold, kill, reap, why = result.stuck
    who = take.split(":")[0]
    assert take.startswith(f"{who}: take message") and (hold, kill, reap) == (f"{who}: hold", f"{who}: kill", f"broker: reap {who}")
    assert why.startswith(LEAKED)


# The smallest world in which each broken variant goes wrong (exhaustive: the search
# stops at its first violation).
BROKEN_WORLDS = {
    "count_every_load": Config(receivers=1, generations=1, forks=0),
    "no_fork_retire": Config(receivers=1, messages=1, generations=1),
    "held_without_taking": Config(messages=1, generations=1, forks=0),
    "broker_unholds_taking": Config(messages=1, generations=1, forks=0),
    "hold_ignores_freeing": Config(receivers=1, messages=1, generations=1, forks=0),
    "free_ignores_sent": Config(receivers=1, messages=1, generations=1, forks=0),
}


@pytest.mark.parametrize("variant", BROKEN)
def test_a_broken_protocol_is_caught(variant: str) -> None:
    result = explore(replace(BROKEN_WORLDS[variant], variant=variant))
    assert result.unsafe, f"{variant}: no violation in {result.states} states"
    # ... and the same world, as written, has none.
    assert not explore(BROKEN_WORLDS[variant]).unsafe


# -- a memfd's deposit: the states the caps made ------------------------------------
#
# A second model, of one memfd segment's deposit at the broker (who keeps its
# descriptor, and who may send refs of it) rather than of its header's counts (the
# model above). The caps on what is kept each made a state of a segment that the other
# paths meet:
#
# retired      past ``pool.IDLE_SEGMENTS`` waiting, it leaves its owner's pool, never
#              reused: ``LEAVING`` (its descriptor and deposit kept) while refs sent in
#              it wait to be loaded, then ``LEFT`` (``Pool.leave``: deposit dropped);
# let go       the broker closes the descriptor of a memfd nobody uses that processes
#              only hold, every ref loaded (``FORWARDABLE``): a fetch of it fails;
# indexed      a Gen ``_native.reduce`` sends from without asking whether its memfd
#              is deposited (``Gen.index``).
#
# Actors: the owner O, which may load its own messages (it then holds the generation as
# a receiver) and send them on (own-ref resend); a stranger S that maps nothing and
# fetches the descriptor to load (one that maps it already loads without the broker);
# the broker. Events: the broker killed and started again (O's next connection brings
# back what it keeps), ``unregister()`` (the pool keeps nothing free). One pickle is one
# step here: a deposit checked and its ref counted sent at once.
#
# safety    a message sent is never refused at S, which maps nothing, while its sender
#           lives and has connected to the current broker (README, Limits), but one
#           sent as a forward (the segment out of its pool) whose broker restarted
#           after its send, O holding it no more: nothing keeps its descriptor to
#           bring back, as with any process that forwards what it received;
# no leak   no deposit the broker counts as O's pool's (a user) outlives that pool's
#           keeping the segment: nothing would ever drop it.

IN_USE, WAIT, FREE_, LEAVING, LEFT = "in use", "waiting", "free", "leaving", "left"
NONE_, USER, FORWARD = "none", "user", "forward"  # O's deposit, and how the broker counts it
LOADED_, REFUSED = "loaded", "refused"

DEPOSIT_BROKEN = (
    "close_keeps_index",  # a pool that lets go of a segment leaves its Gen indexed
    "left_deposits_as_user",  # a segment its pool let go of is deposited as the pool's
    "retire_closes_in_flight",  # the cap closes a segment with refs in flight at once
    "forward_outlives_hold",  # a forward deposit is trusted after O let go of its hold
)


class Rec(NamedTuple):
    """What the broker keeps of the memfd: a user (O's pool), its descriptor, forwarded."""

    user: bool = False
    fd: bool = True
    forwarded: bool = False


class Dep(NamedTuple):
    pool: str = IN_USE  # O's pool: its own storage alive, waiting, free, leaving, left
    ended: bool = False  # the generation ended (free): a ref of it loads stale
    o_held: bool = False  # O holds the generation as a receiver
    s_held: bool = False  # S maps it and holds the generation
    deposited: str = NONE_
    indexed: bool = False
    sent: int = 0
    loaded: int = 0
    # Each message: SENT, LOADED_ (first load done) or REFUSED, and for a forward, the
    # broker restarts before its send (-1: sent from the pool's deposit).
    msgs: tuple[tuple[str, int], ...] = ()
    rec: Rec | None = None  # at the current broker
    connected: bool = True  # O is connected to the current broker
    restarts: int = 0
    active: bool = True  # not unregister()ed


@dataclass(frozen=True)
class DepConfig:
    messages: int = 3
    restarts: int = 1
    variant: str = ""


def _holders(d: Dep) -> int:
    return int(d.o_held) + int(d.s_held)


def _closed(d: Dep, cfg: DepConfig) -> Dep:
    """``Pool.leave``: out of the pool; its deposit let go of (``Segment.undeposit``)."""
    rec = d.rec
    if d.deposited == USER and rec is not None and d.connected:
        rec = _with(rec, user=False)
    indexed = d.indexed if cfg.variant == "close_keeps_index" else False
    return _with(d, pool=LEFT, deposited=NONE_ if d.deposited == USER else d.deposited, indexed=indexed, rec=rec)


def _over_here(d: Dep, cfg: DepConfig) -> Dep:
    """``hdr_end``: free (the generation ends) if nobody holds it and every ref is loaded."""
    if _holders(d) or d.sent > d.loaded:
        return _with(d, pool=WAIT)
    d = _with(d, pool=FREE_, ended=True)
    return d if d.active else _closed(d, cfg)


def dep_drop_own(d: Dep, cfg: DepConfig) -> Dep | None:
    if d.pool != IN_USE:
        return None
    return _over_here(_with(d, indexed=False), cfg)  # the owner's Gen dies: unindexed (``dead``)


def dep_reap(d: Dep, cfg: DepConfig) -> Dep | None:
    if d.pool == WAIT and not _holders(d) and d.sent == d.loaded:
        return _over_here(d, cfg)
    if d.pool == LEAVING and d.sent == d.loaded:
        return _closed(d, cfg)
    return None


def dep_cap(d: Dep, cfg: DepConfig) -> Dep | None:
    """Another segment's wait pushes this one out of the pool (``Pool.add_waiting``)."""
    if d.pool != WAIT:
        return None
    if d.sent > d.loaded and cfg.variant != "retire_closes_in_flight":
        return _with(d, pool=LEAVING)
    return _closed(d, cfg)


def dep_trim(d: Dep, cfg: DepConfig) -> Dep | None:
    return _closed(d, cfg) if d.pool == FREE_ else None


def dep_send(d: Dep, cfg: DepConfig) -> Dep | None:
    """O pickles a ref of a storage it has: from an indexed gen, by ``_native.reduce``
    (nothing checked); else ``transfer.share``, which deposits it first if need be."""
    if not (d.pool == IN_USE or d.o_held) or not d.connected or len(d.msgs) >= cfg.messages:
        return None
    if not d.indexed and d.deposited == NONE_:
        kind = USER if d.pool != LEFT or cfg.variant == "left_deposits_as_user" else FORWARD
        rec = d.rec or Rec(fd=True)
        rec = _with(rec, fd=True, user=rec.user or kind == USER, forwarded=rec.forwarded or kind == FORWARD)
        d = _with(d, deposited=kind, rec=rec)
    msg = (SENT, d.restarts if d.deposited == FORWARD else -1)
    return _with(d, indexed=True, sent=d.sent + 1, msgs=d.msgs + (msg,))


def _msg_is(d: Dep, j: int, state: str) -> Dep:
    return _with(d, msgs=d.msgs[:j] + ((state, d.msgs[j][1]),) + d.msgs[j + 1 :])


def _first_load(d: Dep, j: int) -> Dep:
    if d.msgs[j][0] != SENT:
        return d
    return _with(_msg_is(d, j, LOADED_), loaded=d.loaded + 1)


def dep_load_own(d: Dep, j: int, cfg: DepConfig) -> Dep | None:
    """O loads one of its messages (again, or for the first time) once its own storage died."""
    if d.pool == IN_USE or d.ended or d.msgs[j][0] == REFUSED:
        return None
    return _with(_first_load(d, j), o_held=True)


def dep_drop_held(d: Dep, cfg: DepConfig) -> Dep | None:
    """O's last storage of what it loaded dies: its Gen (indexed or not) with it; a
    deposit no pool keeps (a forward) lasted while O held it (``transfer.settle_dead``)."""
    if not d.o_held:
        return None
    keep = d.deposited != FORWARD or cfg.variant == "forward_outlives_hold"
    return _with(d, o_held=False, indexed=False, deposited=d.deposited if keep else NONE_)


def dep_load_stranger(d: Dep, j: int, cfg: DepConfig) -> Dep | None:
    """S loads a message for the first time: fetching the descriptor, unless it maps it."""
    if d.msgs[j][0] != SENT or not d.connected:
        return None  # before O connected to a new broker, a loss is documented
    if not d.s_held and (d.rec is None or not d.rec.fd):
        return _msg_is(d, j, REFUSED)
    return _with(_first_load(d, j), s_held=True)


def dep_drop_stranger(d: Dep, cfg: DepConfig) -> Dep | None:
    return _with(d, s_held=False) if d.s_held else None


def dep_let_go_descriptor(d: Dep, cfg: DepConfig) -> Dep | None:
    """The broker closes the descriptor of a memfd only held, every ref loaded, not
    forwarded (``Broker._forwardable``), once newer ones push it out."""
    rec = d.rec
    if rec is None or rec.user or not rec.fd or rec.forwarded or not _holders(d) or d.sent > d.loaded:
        return None
    return _with(d, rec=_with(rec, fd=False))


def dep_close_unreached(d: Dep, cfg: DepConfig) -> Dep | None:
    """The broker lets go of a memfd nobody uses, holds, or has refs in flight in."""
    rec = d.rec
    if rec is None or rec.user or _holders(d) or d.sent > d.loaded:
        return None
    return _with(d, rec=None)


def dep_restart(d: Dep, cfg: DepConfig) -> Dep | None:
    if d.restarts >= cfg.restarts:
        return None
    return _with(d, rec=None, connected=False, restarts=d.restarts + 1)


def dep_connect(d: Dep, cfg: DepConfig) -> Dep | None:
    """O's next send (of anything) connects to the new broker: its deposits forgotten,
    every gen unindexed, and what another process may load brought back
    (``transfer._bring_back``): what its pool keeps, as its pool's; what it holds of its
    own past its pool, with refs in flight, as a forward."""
    if d.connected:
        return None
    d = _with(d, connected=True, deposited=NONE_, indexed=False)
    if d.pool != LEFT and (_holders(d) or d.sent > d.loaded):
        return _with(d, deposited=USER, rec=Rec(user=True))
    if d.pool == LEFT and d.o_held and d.sent > d.loaded:
        return _with(d, deposited=FORWARD, rec=Rec(forwarded=True))
    return d


def dep_unregister(d: Dep, cfg: DepConfig) -> Dep | None:
    if not d.active:
        return None
    d = _with(d, active=False)
    return _closed(d, cfg) if d.pool == FREE_ else d


DEP_STEPS = (
    dep_drop_own,
    dep_reap,
    dep_cap,
    dep_trim,
    dep_send,
    dep_drop_held,
    dep_drop_stranger,
    dep_let_go_descriptor,
    dep_close_unreached,
    dep_restart,
    dep_connect,
    dep_unregister,
)
DEP_LOADS = (dep_load_own, dep_load_stranger)


def dep_unsafe(d: Dep) -> str | None:
    for state, forwarded_at in d.msgs:
        if state == REFUSED and not 0 <= forwarded_at < d.restarts:
            return "a message refused at a process that maps nothing, its sender alive and connected"
    return None


def dep_leaked(d: Dep) -> str | None:
    if d.rec is not None and d.rec.user and d.pool == LEFT:
        return "a deposit counted as the pool's, which let go of the segment: nothing drops it"
    return None


def explore_deposits(cfg: DepConfig) -> tuple[list[str], set[str], int]:
    """Every reachable state, breadth first: (the shortest trace to a violation, or
    [], the steps taken, the states)."""
    start = Dep()
    parent: dict[Dep, tuple[Dep | None, str]] = {start: (None, "start")}
    frontier, seen = [start], set()
    while frontier:
        following = []
        for d in frontier:
            moves = [(step.__name__, step(d, cfg)) for step in DEP_STEPS]
            moves += [(f"{load.__name__} {j}", load(d, j, cfg)) for load in DEP_LOADS for j in range(len(d.msgs))]
            for label, after in moves:
                if after is None:
                    continue
                seen.add(label.split(" ")[0])
                if after in parent:
                    continue
                parent[after] = (d, label)
                following.append(after)
                why = dep_unsafe(after) or dep_leaked(after)
                if why is not None:
                    steps = [why]
                    at: Dep | None = after
                    while at is not None:
                        at, step_label = parent[at]
                        steps.append(step_label)
                    return steps[::-1], seen, len(parent)
        frontier = following
    return [], seen, len(parent)


def test_no_deposit_state_loses_a_message_or_pins_a_memfd() -> None:
    trace, seen, states = explore_deposits(DepConfig())
    assert not trace, "\n".join(trace)
    assert seen == {step.__name__ for step in DEP_STEPS + DEP_LOADS}, "a step never taken"
    assert states > 1_000, states


@pytest.mark.parametrize("variant", DEPOSIT_BROKEN)
def test_a_path_that_ignores_a_deposit_state_is_caught(variant: str) -> None:
    """Each way a path ignored a state the caps made (before each was fixed) loses a
    message or pins a memfd here."""
    trace, _seen, states = explore_deposits(DepConfig(variant=variant))
    assert trace, f"{variant}: no violation in {states} states"
    assert trace[-1] == (dep_leaked if variant == "left_deposits_as_user" else dep_unsafe)(_final(trace, variant)), trace


def _final(trace: list[str], variant: str) -> Dep:
    """The state *trace* (labels, as ``explore_deposits`` gives them) leads to."""
    cfg, d = DepConfig(variant=variant), Dep()
    steps = {step.__name__: step for step in DEP_STEPS}
    for label in trace[1:-1]:
        name, *j = label.split(" ")
        after = steps[name](d, cfg) if not j else {load.__name__: load for load in DEP_LOADS}[name](d, int(j[0]), cfg)
        assert after is not None, label
        d = after
    return d
