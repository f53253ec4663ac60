"""Worker for tests/test_faults.py: injects one fault per MODE and records what every rank saw.

Usage: fault_worker.py OUT_DIR MODE
  errors:        in sequence, each with a fresh optimizer: skewed configuration (rank-dependent
                 slow_momentum), NaN written into rank 1's parameters with nonfinite="raise" and
                 with "skip", rank 1 skipping one step then finish(), a truncated checkpoint file.
  gossip-stall:  base="sgp"; rank 1 SIGSTOPs itself inside the inner loop (gossip timeout from
                 HVD_SLOWMO_GOSSIP_TIMEOUT); rank 0 must raise TimeoutError naming rank 1.
  average-stall: base="localsgd"; rank 1 SIGSTOPs itself inside the inner loop; rank 0 waits at
                 the next outer step's collective until Horovod's Gloo timeout ends it.
  kill:          base="localsgd"; rank 1 SIGKILLs itself inside the inner loop.
Each rank writes OUT_DIR/MODE.RANK.json: {phase: {"error": type, "message": str, "t": time}},
plus "t_fault" (when the faulty rank stopped or died, written by it just before).
"""

import functools
import json
import math
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo
from hvd_slowmo.checkpoint import load_checkpoint, save_checkpoint

from reference import loss_at, make_model

FAULTY = 1  # the rank that misbehaves


def build(**options):
    model = make_model()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        **{"tau": 3, "slow_momentum": 0.5, **options},
    )
    return model, opt


def one_step(model, opt, k):
    opt.zero_grad()
    loss_at(model, hvd.rank(), k).backward()
    opt.step()


def run_phase(results, name, fn):
    """Run one phase; record the exception type and message (or None) on this rank."""
    try:
        out = fn()
        results[name] = {"error": None, "message": "", "t": time.time(), **(out or {})}
    except Exception as e:  # the faults under test surface as several exception types
        results[name] = {
            "error": type(e).__name__,
            "message": "\n".join([str(e)] + getattr(e, "__notes__", [])),
            "t": time.time(),
        }


def _skew():
    build(slow_momentum=0.5 + 0.1 * (hvd.rank() == FAULTY))


def _nan(policy):
    model, opt = build(nonfinite=policy)
    for k in range(5):
        one_step(model, opt, k)
        if k == 3 and hvd.rank() == FAULTY:  # inside outer step 1 (steps 3..5)
            with torch.no_grad():
                next(model.parameters())[0, 0] = math.nan
    one_step(model, opt, 5)  # outer step 1 ends here: the check runs
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    return {
        "finite": bool(flat.isfinite().all()),
        "params": flat.tolist(),
        "outer_steps": opt.outer_steps,
    }


def _uneven():
    model, opt = build()
    # 9 steps with tau=3: rank 0's last step is an outer step, where it meets rank 1's finish().
    for k in range(9):
        if k == 4 and hvd.rank() == FAULTY:
            continue  # one batch fewer on this rank (uneven data without drop_last)
        one_step(model, opt, k)
    opt.finish()


def _corrupt_checkpoint(out):
    rank = hvd.rank()
    model, opt = build()
    one_step(model, opt, 0)
    path = os.path.join(out, f"ckpt.{rank}.pt")
    save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    good = load_checkpoint(path)
    opt.load_state_dict(good["opt"])  # the intact file round-trips
    if rank == FAULTY:
        with open(path, "r+b") as f:
            # A job that died while writing with torch.save
            f.truncate(os.path.getsize(path) // 2)
    load_checkpoint(path)


def _join():
    # Uneven data "handled" with hvd.join(): rank 1 runs out after 8 steps and joins while
    # rank 0 reaches the outer step at step 9. Last phase: Horovod is shut down afterwards.
    model, opt = build()
    for k in range(9 if hvd.rank() != FAULTY else 8):
        one_step(model, opt, k)
    hvd.join()


def mode_errors(out, results):
    run_phase(results, "skew", _skew)
    run_phase(results, "nan-raise", functools.partial(_nan, "raise"))
    run_phase(results, "nan-skip", functools.partial(_nan, "skip"))
    run_phase(results, "uneven", _uneven)
    run_phase(results, "corrupt-checkpoint", functools.partial(_corrupt_checkpoint, out))
    run_phase(results, "join", _join)


def mode_fault(out, results, mode):
    rank = hvd.rank()
    options = {"base": "sgp"} if mode == "gossip-stall" else {}
    model, opt = build(**options)

    def train():
        for k in range(9):
            if rank == FAULTY and k == 4:  # inside outer step 1 (steps 3..5)
                results["t_fault"] = time.time()
                save(out, mode, results)
                os.kill(os.getpid(), signal.SIGSTOP if mode.endswith("stall") else signal.SIGKILL)
            one_step(model, opt, k)

    run_phase(results, mode, train)


def save(out, mode, results):
    path = os.path.join(out, f"{mode}.{hvd.rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def main():
    out, mode = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    results = {"t_start": time.time()}
    if mode == "errors":
        mode_errors(out, results)
    elif mode in ("gossip-stall", "average-stall", "kill"):
        mode_fault(out, results, mode)
    else:
        raise SystemExit(f"unknown mode {mode}")
    save(out, mode, results)
    if mode != "errors" and any(isinstance(v, dict) and v.get("error") for v in results.values()):
        # The job has failed: end this process now, as docs/reliability.md advises. A plain exit
        # would run Horovod's shutdown at interpreter exit, which under MPI waits for the frozen
        # peer forever; a non-zero exit without it makes horovodrun/mpirun end the other ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
