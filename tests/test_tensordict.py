"""tensordict through shmreduce: TensorDict and tensorclasses, consolidated or not.

tensordict installs its own ForkingPickler reducer for ``TensorDict`` (and
``LazyStackedTensorDict``) when it is imported: a tensordict pickles as its class and
state (or, consolidated, as its metadata and one flat storage), and the tensors inside
are then pickled by whatever reducer ForkingPickler has for tensors. With shmreduce
registered that is ours, so the two compose: tensordict decides the shape of the
message, shmreduce shares every storage in it. Checked here:

* through ``mp.Queue`` to a fork and to a spawn child, under both strategies: the
  class comes back, every value, and the aliasing (leaves that share a storage in the
  sender share one storage in the receiver, at the same offsets: views of one tensor
  stay views of one storage; a consolidated tensordict stays views of one flat
  storage); the storages went through shmreduce (its counters on both sides, received
  storages ``is_shared()``); in-place writes are seen across, both ways, as with
  torch.multiprocessing;
* ``register()`` leaves tensordict's reducer in ``ForkingPickler._extra_reducers``
  and ``unregister()`` leaves it in place too, whether tensordict was imported before
  ``register()`` or while registered (a fresh interpreter);
* ``TensorDict.share_memory_()`` while registered puts the leaves in shmreduce's
  segments, and sending them afterwards copies nothing.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
import torch.multiprocessing.reductions as torch_reductions

import shmreduce

# tensordict is an optional peer (the `bench` extra; `make test` installs it): without it,
# `pip install -e '.[test]'` then `pytest` skips this module instead of failing collection.
pytest.importorskip("tensordict", reason="tensordict is not installed (pip install -e '.[bench]')")
from tensordict import LazyStackedTensorDict, TensorDict, tensorclass  # noqa: E402

TIMEOUT = 60.0  # a spawn child imports torch and tensordict on a loaded 2-core machine

# What tensordict's import installed, before any register() in this process.
TD_REDUCER = ForkingPickler._extra_reducers.get(TensorDict)  # type: ignore[attr-defined]
LAZY_REDUCER = ForkingPickler._extra_reducers.get(LazyStackedTensorDict)  # type: ignore[attr-defined]


@tensorclass
class Transition:
    obs: torch.Tensor
    window: torch.Tensor  # a view of obs
    reward: torch.Tensor


def make(kind: str, consolidated: bool, start: float = 0.0) -> Any:
    """A tensordict or tensorclass whose leaves include views of one tensor."""
    base = torch.arange(16.0) + start
    reward = torch.tensor(start - 1.0)
    obj: Any
    if kind == "tensordict":
        # a nested tensordict holds a view of the same tensor too
        obj = TensorDict({"obs": base, "window": base[4:8], "reward": reward, "next": {"obs": base[8:12]}}, batch_size=[])
    else:
        # tensorclass adds batch_size to the constructor at runtime; its stub does not
        obj = Transition(obs=base, window=base[4:8], reward=reward, batch_size=[])  # type: ignore[call-arg]
    return obj.consolidate() if consolidated else obj


def leaves(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, TensorDict):
        return {"obs": obj["obs"], "window": obj["window"], "reward": obj["reward"], "next.obs": obj["next", "obs"]}
    return {"obs": obj.obs, "window": obj.window, "reward": obj.reward}


def layout(obj: Any) -> dict[str, tuple]:
    """Per leaf: which storage (numbered by first appearance), offset, shape, stride."""
    storages: list[int] = []
    out = {}
    for name, t in leaves(obj).items():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages:
            storages.append(ptr)
        out[name] = (storages.index(ptr), t.storage_offset(), tuple(t.shape), t.stride())
    return out


def values(obj: Any) -> dict[str, list]:
    return {name: t.tolist() for name, t in leaves(obj).items()}


def storage_count(obj: Any) -> int:
    return len({t.untyped_storage().data_ptr() for t in leaves(obj).values()})


def _child(q_in: Any, q_out: Any) -> None:
    made = None
    while True:
        before = shmreduce.stats()
        cmd = q_in.get(timeout=TIMEOUT)
        if cmd is None:
            return
        op, arg = cmd
        if op == "strategy":
            shmreduce.set_sharing_strategy(arg)  # what the child shares from now on
            q_out.put(shmreduce.get_sharing_strategy())
        elif op == "inspect":
            got = shmreduce.stats()
            reply = {
                "type": type(arg).__name__,
                "layout": layout(arg),
                "values": values(arg),
                "shared": [t.untyped_storage().is_shared() for t in leaves(arg).values()],
                "messages": got["messages_received"] - before["messages_received"],
                "storages": got["storages_received"] - before["storages_received"],
            }
            leaves(arg)["obs"][0] = 1000.0  # the parent must see this write
            q_out.put(reply)
        elif op == "make":
            kind, consolidated = arg
            made = make(kind, consolidated, start=50.0)
            q_out.put(made)
        elif op == "read":
            assert made is not None
            q_out.put(float(leaves(made)["obs"][1]))


def _cases() -> list[tuple[str, str, bool]]:
    return [
        (strategy, kind, consolidated)
        for strategy in ("file_descriptor", "file_system")
        for kind in ("tensordict", "tensorclass")
        for consolidated in (False, True)
    ]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_tensordicts_through_queue_keep_aliasing_and_share(registered_fd, context):
    # One child for both strategies (a spawn child takes seconds to import torch and
    # tensordict here): each side switches with set_sharing_strategy, the public toggle.
    ctx = mp.get_context(context)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(q_in, q_out))
    proc.start()
    try:
        for strategy, kind, consolidated in _cases():
            shmreduce.set_sharing_strategy(strategy)
            q_in.put(("strategy", strategy))
            assert q_out.get(timeout=TIMEOUT) == strategy
            case = (strategy, context, kind, "consolidated" if consolidated else "plain")
            # parent -> child
            obj = make(kind, consolidated)
            sent = (layout(obj), values(obj))
            if kind == "tensordict" and not consolidated:
                assert sent[0]["obs"][0] == sent[0]["window"][0] == sent[0]["next.obs"][0] != sent[0]["reward"][0]
            before = shmreduce.stats()
            q_in.put(("inspect", obj))
            reply = q_out.get(timeout=TIMEOUT)
            after = shmreduce.stats()
            assert reply["type"] == type(obj).__name__, case
            assert reply["layout"] == sent[0], (case, reply["layout"], sent[0])
            assert reply["values"] == sent[1], case
            # the storages went through shmreduce: one message, every storage in it
            assert reply["messages"] == 1 and reply["storages"] >= storage_count(obj), (case, reply)
            assert all(reply["shared"]), (case, reply)
            moved = sum(after[k] - before[k] for k in ("storages_shared", "storages_reused"))
            assert after["messages_sent"] - before["messages_sent"] >= 1 and moved >= storage_count(obj), (case, before, after)
            # the child's in-place write is the parent's tensor's
            assert float(leaves(obj)["obs"][0]) == 1000.0, case
            if not consolidated:
                assert all(t.untyped_storage().is_shared() for t in leaves(obj).values()), case

            # child -> parent
            q_in.put(("make", (kind, consolidated)))
            got = q_out.get(timeout=TIMEOUT)
            expected = make(kind, consolidated, start=50.0)
            assert type(got) is type(expected), case
            assert layout(got) == layout(expected), (case, layout(got), layout(expected))
            assert values(got) == values(expected), case
            assert all(t.untyped_storage().is_shared() for t in leaves(got).values()), case
            leaves(got)["obs"][1] = -7.0  # the child must see this write
            q_in.put(("read", None))
            assert q_out.get(timeout=TIMEOUT) == -7.0, case
            if not consolidated:
                assert float(leaves(got)["window"][0]) == float(leaves(got)["obs"][4]), case  # still a view
        q_in.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        q_in.close()
        q_out.close()


def test_register_and_unregister_leave_tensordicts_reducer():
    assert not shmreduce.is_registered()
    assert TD_REDUCER is not None and TD_REDUCER.__module__.startswith("tensordict"), TD_REDUCER
    assert LAZY_REDUCER is not None
    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    assert extra.get(TensorDict) is TD_REDUCER
    with shmreduce.registered(strategy="file_descriptor"):
        # register() replaced the tensor reducers, not tensordict's
        assert extra.get(TensorDict) is TD_REDUCER and extra.get(LazyStackedTensorDict) is LAZY_REDUCER
        assert extra[torch.Tensor] is not torch_reductions.reduce_tensor
        before = shmreduce.stats()
        td = make("tensordict", consolidated=False)
        back = ForkingPickler.loads(ForkingPickler.dumps(td))
        after = shmreduce.stats()
        assert type(back) is TensorDict and values(back) == values(td) and layout(back) == layout(td)
        assert after["messages_sent"] - before["messages_sent"] == 1
        assert after["storages_shared"] - before["storages_shared"] == storage_count(td)
        del back, td
    assert extra.get(TensorDict) is TD_REDUCER and extra.get(LazyStackedTensorDict) is LAZY_REDUCER
    assert extra[torch.Tensor] is torch_reductions.reduce_tensor  # torch's own, back


_IMPORTED_WHILE_REGISTERED = """
import json, sys
from multiprocessing.reduction import ForkingPickler
import torch, shmreduce
shmreduce.register()
from tensordict import TensorDict  # its import registers its reducer while ours are in place
reducer = ForkingPickler._extra_reducers.get(TensorDict)
sent, values = {}, {}
for strategy in ("file_descriptor", "file_system"):
    shmreduce.set_sharing_strategy(strategy)
    before = shmreduce.stats()
    base = torch.arange(8.0)
    back = ForkingPickler.loads(ForkingPickler.dumps(TensorDict({"a": base, "b": base[2:4]}, batch_size=[])))
    sent[strategy] = shmreduce.stats()["messages_sent"] - before["messages_sent"]
    values[strategy] = back["b"].tolist()
    del back, base
shmreduce.unregister()
print(json.dumps({
    "module": getattr(reducer, "__module__", None),
    "kept": ForkingPickler._extra_reducers.get(TensorDict) is reducer,
    "messages_sent": sent,
    "values": values,
}))
"""


def test_tensordict_imported_while_registered_keeps_its_reducer():
    # a fresh interpreter: tensordict is imported (its reducer registered) only after register()
    out = subprocess.run([sys.executable, "-c", _IMPORTED_WHILE_REGISTERED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    both = ("file_descriptor", "file_system")
    assert result == {
        "module": "tensordict._reductions",
        "kept": True,
        "messages_sent": dict.fromkeys(both, 1),
        "values": dict.fromkeys(both, [2.0, 3.0]),
    }, result


def test_share_memory_puts_leaves_in_shmreduce_segments(strategy):
    td = make("tensordict", consolidated=False)
    before = shmreduce.stats()
    td.share_memory_()
    after = shmreduce.stats()
    assert td.is_shared()
    assert all(t.untyped_storage().is_shared() for t in leaves(td).values())
    assert after["storages_shared"] - before["storages_shared"] == storage_count(td)
    assert layout(td)["window"][0] == layout(td)["obs"][0]  # the views still alias obs
    # sending it now copies nothing: every storage is already shmreduce's
    ForkingPickler.loads(ForkingPickler.dumps(td))
    again = shmreduce.stats()
    assert again["storages_shared"] == after["storages_shared"]
    assert again["storages_reused"] - after["storages_reused"] >= storage_count(td)
