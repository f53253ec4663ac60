"""Faults end in the documented outcome, within a bounded time (docs/reliability.md).

In-process tier (thread workers, fast): checkpoint files, a state from another world size,
uneven step counts, the elastic re-sync after workers leave or join.
Horovod tier (marked ``horovod``): each fault injected under horovodrun -np 2 with the tiny
reference model, each launch in its own process group, killed (SIGCONT then SIGKILL) when the
test ends, so a frozen worker never outlives its test. The worker: tests/workers/fault_worker.py.
"""

import json
import logging
import os

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hvd_slowmo.comm.base import Communicator
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.elastic import sync_optimizer

from helpers import ForwardingCommunicator, anchor_of, slow_buffer_of
from horovod_launch import horovodrun_command, run_bounded
from reference import loss_at, make_model, params_of

WORKER = os.path.join(os.path.dirname(__file__), "workers", "fault_worker.py")
GOSSIP_TIMEOUT = 10  # seconds; HVD_SLOWMO_GOSSIP_TIMEOUT for the launches
GLOO_TIMEOUT = (
    20  # seconds; HOROVOD_GLOO_TIMEOUT_SECONDS: how long a Gloo collective waits for a peer
)


# --- in-process tier ------------------------------------------------------------------------
def _opt(model, comm, **kwargs) -> DistributedOptimizer:
    return DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        communicator=comm,
        **{"tau": 3, "slow_lr": 1.0, "slow_momentum": 0.5, **kwargs},
    )


def _train(model, opt, rank, steps, start=0):
    for k in range(start, start + steps):
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    model = make_model()
    opt = _opt(model, _solo())
    _train(model, opt, 0, 4)
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    loaded = load_checkpoint(path)
    assert torch.equal(
        loaded["opt"]["slowmo"]["fragments"][0]["slow_state"]["anchor"][0], anchor_of(opt)[0]
    )
    assert loaded["opt"]["slowmo"]["position"]["world_size"] == 1
    good = path.read_bytes()

    cases = {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "garbage": b"not a checkpoint at all" * 10,
        "flipped": good[:64] + bytes(b ^ 0xFF for b in good[64:600]) + good[600:],
    }
    for name, data in cases.items():
        bad = tmp_path / f"{name}.pt"
        bad.write_bytes(data)
        with pytest.raises(CheckpointError, match=str(bad)) as err:
            load_checkpoint(bad)
        assert "earlier checkpoint" in str(err.value), name
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_checkpoint({}, tmp_path / "no-such-dir" / "c.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")  # a save that dies half-way

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint({"model": model.state_dict(), "x": Unpicklable()}, path)
    assert path.read_bytes() == good  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == [
        "ckpt.pt"
    ]  # no temp left


def _solo() -> Communicator:
    return run_threads(1, lambda c: c)[0]


def test_elastic_sync_shrink_then_grow_restarts_from_the_anchor(caplog, monkeypatch):
    """3 workers stop inside an outer step; 2 survive (renumbered), then a new one joins: after
    each hvd.elastic-style sync every worker sits bitwise on the anchor of the interrupted outer
    step, with rank 0's counters and slow buffer, and training goes on with exact averages."""
    models = [make_model() for _ in range(4)]
    opts: dict[int, DistributedOptimizer] = {}

    def start(comm):
        opts[comm.rank] = _opt(models[comm.rank], ForwardingCommunicator(comm))
        # Outer step at 3, then 1 inner step
        _train(models[comm.rank], opts[comm.rank], comm.rank, 4)
        opt = opts[comm.rank]
        return [a.clone() for a in anchor_of(opt)], slow_buffer_of(opt)[0].clone()

    (anchor, slow0), *_ = run_threads(3, start)
    survivors = {0: 0, 1: 2}  # new rank -> old rank (old rank 1 died)

    def shrink(comm):
        model, opt = models[survivors[comm.rank]], opts[survivors[comm.rank]]
        opt.comm.inner = comm
        sync_optimizer(opt)
        got = (params_of(model), opt.num_steps, opt.inner_step, opt.outer_steps, opt.base.comm.size)
        _train(model, opt, comm.rank, 3, start=opt.num_steps)  # completes the restarted outer step
        return got, params_of(model)

    with caplog.at_level(logging.WARNING, logger="hvd_slowmo"):
        out = run_threads(2, shrink)
    for (params, num_steps, inner, outer, base_size), _ in out:
        assert all(torch.equal(p, a) for p, a in zip(params, anchor))
        assert (num_steps, inner, outer, base_size) == (3, 0, 1, 2)
    # Bitwise equal after the average
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))
    assert "3 -> 2 workers" in caplog.text and "1 base steps dropped" in caplog.text

    # Grow: a new process builds its optimizer alone (elastic: no construction collective), then
    # syncs.
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    pytest.importorskip("horovod.torch", reason="the elastic handler registers with Horovod")
    opts[3] = _opt(models[3], ForwardingCommunicator(_solo()))
    members = {0: 0, 1: 2, 2: 3}
    # Survivors one step into outer step 2, so the sync restarts that outer step again.
    run_threads(
        2,
        lambda comm: _train(
            models[members[comm.rank]], opts[members[comm.rank]], comm.rank, 1, start=6
        ),
    )

    def grow(comm):
        model, opt = models[members[comm.rank]], opts[members[comm.rank]]
        opt.comm.inner = comm
        # TorchState's model handler
        model.load_state_dict(comm.broadcast_object(model.state_dict()))
        sync_optimizer(opt)
        return (
            params_of(model),
            opt.num_steps,
            opt.outer_steps,
            slow_buffer_of(opt)[0].clone(),
            opt.base.comm.size,
        )

    res = run_threads(3, grow)
    for params, num_steps, outer, slow, base_size in res:
        assert all(torch.equal(p, q) for p, q in zip(params, res[0][0]))
        assert (num_steps, outer, base_size) == (6, 2, 3)
        # Rank 0's slow buffer, updated
        assert torch.equal(slow, res[0][3]) and not torch.equal(slow, slow0)

    from horovod.torch.elastic.state import _get_handler  # TorchState's own lookup

    assert type(_get_handler(opts[3])).__name__ == "SlowMoStateHandler"


@pytest.mark.parametrize("base", ["sgp", "osgp"])
def test_elastic_sync_rebuilds_the_gossip_graph(base):
    """Gossip over 3 workers, 2 survive inside an outer step: after the sync the base gossips
    over a 2-worker graph with push-sum weight 1 from the anchor, and the next exact average is
    bitwise equal on both."""
    models = [make_model() for _ in range(3)]
    opts = {}

    def start(comm):
        opts[comm.rank] = _opt(models[comm.rank], ForwardingCommunicator(comm), base=base)
        _train(models[comm.rank], opts[comm.rank], comm.rank, 4)
        return [a.clone() for a in anchor_of(opts[comm.rank])]

    anchor = run_threads(3, start)[0]
    survivors = {0: 0, 1: 2}

    def shrink(comm):
        model, opt = models[survivors[comm.rank]], opts[survivors[comm.rank]]
        opt.comm.inner = comm
        sync_optimizer(opt)
        at_anchor = all(torch.equal(p, a) for p, a in zip(params_of(model), anchor))
        graph = (
            opt.base.graph.size,
            opt.base.ps_weight,
            opt.base.graph.out_peers(comm.rank, opt.num_steps),
        )
        _train(model, opt, comm.rank, 3, start=opt.num_steps)
        return at_anchor, graph, opt.inner_step, params_of(model)

    res = run_threads(2, shrink)
    for rank, (at_anchor, graph, inner, _) in enumerate(res):
        assert at_anchor and inner == 0
        assert graph == (2, 1.0, (1 - rank,)), graph
    assert all(torch.equal(a, b) for a, b in zip(res[0][3], res[1][3]))


def test_world_change_without_sync_is_noticed_at_the_next_step(caplog):
    """Workers removed at a commit (Horovod skips the sync): the next step() sees the new size,
    rebuilds the base and restarts the outer step from the anchor, locally."""
    models = [make_model() for _ in range(3)]
    opts = {}

    def start(comm):
        opts[comm.rank] = _opt(models[comm.rank], ForwardingCommunicator(comm), buffers="maintain")
        # Outer step at 3, then 2 inner steps
        _train(models[comm.rank], opts[comm.rank], comm.rank, 5)
        return [a.clone() for a in anchor_of(opts[comm.rank])]

    anchor = run_threads(3, start)[0]

    def after(comm):
        model, opt = models[comm.rank], opts[comm.rank]
        opt.comm.inner = comm
        opt.zero_grad()
        model(torch.zeros(8, 4)).sum().backward()
        # Restarts from the anchor, then one SGD step with momentum from the maintained buffers.
        opt.step()
        return opt.num_steps, opt.inner_step, opt.base.comm.size, params_of(model)

    with caplog.at_level(logging.WARNING, logger="hvd_slowmo"):
        res = run_threads(2, after)
    for num_steps, inner, size, params in res:
        assert (num_steps, inner, size) == (4, 1, 2)
        # It stepped from the anchor
        assert not all(torch.equal(p, a) for p, a in zip(params, anchor))
    assert "without an elastic state sync" in caplog.text and "2 base steps dropped" in caplog.text


def test_state_from_another_world_size(tmp_path):
    """A state saved inside an outer step by 2 workers, loaded by 3: every worker restarts from
    the anchor; without an anchor it is refused and the optimizer is left unchanged."""
    models = [make_model() for _ in range(5)]

    def save(comm):
        opt = _opt(models[comm.rank], comm)
        plain = _opt(models[comm.rank], comm, slow_momentum=0.0)  # no slow update: no anchor
        _train(models[comm.rank], opt, comm.rank, 4)
        for _ in range(4):
            plain.step()
        return opt.state_dict(), plain.state_dict()

    (state, plain_state), _ = run_threads(2, save)
    assert (
        state["slowmo"]["position"]["world_size"] == 2
        and state["slowmo"]["position"]["inner_step"] == 1
    )

    def load(comm):
        model = models[2 + comm.rank]
        opt = _opt(model, comm)
        opt.load_state_dict(state)
        plain = _opt(model, comm, slow_momentum=0.0)
        before = params_of(model)
        with pytest.raises(ValueError, match="saved by 2 workers inside an outer step"):
            plain.load_state_dict(plain_state)
        assert plain.num_steps == 0 and all(
            torch.equal(a, b) for a, b in zip(before, params_of(model))
        )
        return params_of(model), opt.inner_step, opt.num_steps

    for params, inner, num_steps in run_threads(3, load):
        assert (inner, num_steps) == (0, 3)
        assert all(
            torch.equal(p, a)
            for p, a in zip(
                params, state["slowmo"]["fragments"][0]["slow_state"]["anchor"].values()
            )
        )


def test_uneven_steps_fail_on_every_rank_in_finish():
    """A worker with one batch fewer: finish() against finish(), and finish() against the other
    worker's outer step, both raise on every rank instead of waiting forever."""
    models = [make_model() for _ in range(4)]

    def worker(comm, steps_by_rank):
        model = models[comm.rank + (2 if steps_by_rank[0] == 9 else 0)]
        opt = _opt(model, comm)
        _train(model, opt, comm.rank, steps_by_rank[comm.rank])
        try:
            opt.finish()
        except RuntimeError as e:
            return str(e)
        return "no error"

    for msg in run_threads(2, lambda c: worker(c, {0: 8, 1: 7})):
        assert (
            "rank 0 at finish after 8 steps; rank 1 at finish after 7 steps" in msg
            and "drop_last" in msg
        ), msg

    def at_outer(comm):
        try:
            return worker(comm, {0: 9, 1: 8})
        except RuntimeError as e:  # rank 0 raises inside its outer step (step 9)
            return str(e)

    for msg in run_threads(2, at_outer):
        assert "rank 0 at outer step after 9 steps; rank 1 at finish after 8 steps" in msg, msg
    assert run_threads(2, lambda c: worker(c, {0: 6, 1: 6})) == ["no error", "no error"]


# --- Horovod tier -----------------------------------------------------------------------------
def launch(tmp_path, mode: str, controller: str = "gloo") -> tuple[int, str, float]:
    """Run fault_worker.py MODE under horovodrun -np 2; returns (exit code, output, seconds)
    (a non-zero exit is an expected outcome here; a launch past 240 s fails as a hang)."""
    cmd = horovodrun_command(2, controller, [WORKER, str(tmp_path), mode])
    env = {
        "HVD_SLOWMO_GOSSIP_TIMEOUT": str(GOSSIP_TIMEOUT),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT),
    }
    return run_bounded(cmd, 240, env)


def results(tmp_path, mode: str, ranks: list[int]) -> dict[int, dict]:
    out = {}
    for r in ranks:
        path = tmp_path / f"{mode}.{r}.json"
        assert path.exists(), f"rank {r} wrote no result for {mode}"
        out[r] = json.loads(path.read_text())
    return out


@pytest.mark.horovod
def test_errors_raise_on_every_rank(tmp_path):
    """Skewed configuration, NaN in one rank's parameters (raise / skip), one rank skipping a
    step, a truncated checkpoint: each is an exception with a clear message, never a hang."""
    rc, out, _ = launch(tmp_path, "errors")
    assert rc == 0, out[-4000:]
    res = results(tmp_path, "errors", [0, 1])
    for rank in (0, 1):
        skew = res[rank]["skew"]
        assert skew["error"] == "ValueError", skew
        assert "rank 1: slow_momentum=0.6 (rank 0: 0.5)" in skew["message"], skew

        nan = res[rank]["nan-raise"]
        assert nan["error"] == "FloatingPointError", nan
        assert "rank(s) [1]" in nan["message"] and "after step 6" in nan["message"], nan
        assert "outer step 1" in nan["message"], nan  # the note added by the optimizer

        skip = res[rank]["nan-skip"]
        assert skip["error"] is None and skip["finite"], skip
        assert skip["outer_steps"] == 2, skip

        uneven = res[rank]["uneven"]
        assert uneven["error"] == "RuntimeError", uneven
        assert (
            "different numbers of times" in uneven["message"] and "drop_last" in uneven["message"]
        ), uneven
        assert "rank 1 at finish after 8 steps" in uneven["message"], uneven
        assert "rank 0 at outer step after 9 steps" in uneven["message"], uneven
    # nonfinite="skip": both workers restarted from the same anchor, NaN never reached rank 0.
    assert res[0]["nan-skip"]["params"] == res[1]["nan-skip"]["params"]
    assert res[0]["corrupt-checkpoint"]["error"] is None
    # hvd.join() does not cover an outer step: Horovod's background loop fails on the joined rank
    # and both ranks get HorovodInternalError (no hang); rank 0's says where and points at finish().
    for rank in (0, 1):
        assert res[rank]["join"]["error"] == "HorovodInternalError", res[rank]["join"]
    assert "at outer step 2 (after step 9)" in res[0]["join"]["message"], res[0]["join"]
    assert "DistributedOptimizer.finish" in res[0]["join"]["message"], res[0]["join"]
    bad = res[1]["corrupt-checkpoint"]
    assert bad["error"] == "CheckpointError", bad
    assert str(tmp_path / "ckpt.1.pt") in bad["message"] and "truncated" in bad["message"], bad


@pytest.mark.horovod
@pytest.mark.parametrize("controller", ["gloo", "mpi"], ids=["horovod-alltoall", "mpi-neighbor"])
def test_frozen_gossip_peer_is_a_timeout_naming_it(tmp_path, controller):
    """SGP with one worker SIGSTOPped inside the inner loop: the other raises TimeoutError naming
    the frozen rank and the step after HVD_SLOWMO_GOSSIP_TIMEOUT, and the job ends."""
    rc, out, _ = launch(tmp_path, "gossip-stall", controller=controller)
    assert rc != 0, out[-4000:]
    res = results(tmp_path, "gossip-stall", [0, 1])
    got = res[0]["gossip-stall"]
    assert got["error"] == "TimeoutError", got
    assert "from rank(s) [1]" in got["message"] and "step-4 message" in got["message"], got
    # From the freeze to the error: the timeout, counted from when rank 0 began waiting (it may
    # have been a step ahead), plus scheduling on a loaded machine.
    waited = got["t"] - res[1]["t_fault"]
    assert 0 < waited < GOSSIP_TIMEOUT + 60, waited


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["average-stall", "kill"])
def test_lost_worker_at_the_exact_average_ends_the_job(tmp_path, mode):
    """Local SGD with one worker frozen (SIGSTOP) or killed (SIGKILL) inside the inner loop: the
    other fails at the next outer step's collective (Horovod over Gloo: a closed connection at
    once, a frozen peer after HOROVOD_GLOO_TIMEOUT_SECONDS) with a note naming the outer step."""
    rc, out, _ = launch(tmp_path, mode)
    assert rc != 0, out[-4000:]
    res = results(tmp_path, mode, [0, 1])
    got = res[0][mode]
    assert got["error"] == "HorovodInternalError", got
    assert "hvd_slowmo: raised on rank 0 of 2 at outer step 1 (after step 6)" in got["message"], got
    waited = got["t"] - res[1]["t_fault"]
    assert waited < GLOO_TIMEOUT + 60, waited
