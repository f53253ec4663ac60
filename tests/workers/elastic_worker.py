"""Worker for tests/test_elastic.py: SlowMo under ``horovodrun --min-np 2 --max-np 3`` with Gloo.

Usage: elastic_worker.py OUT_DIR   (env HVD_SLOWMO_TEST_HOSTS: the hosts file of discover_hosts.sh)

Three workers start (localhost:2 and 127.0.0.1:1). The one on 127.0.0.1 SIGKILLs itself in the
middle of an inner loop, after committing; its host is blacklisted, the job shrinks to two.
Two outer steps later rank 0 adds host ``127.1`` (another name of this machine) to the hosts
file; the job grows back to three and trains three more outer steps. Every process appends one
JSON line per step to OUT_DIR/log.<pid>.jsonl: world sizes seen by Horovod and by the
optimizer, the loss, the counters, a hash of the parameters each step starts from, and hashes
of the model after each exact average.
"""

import hashlib
import json
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo

from reference import loss_at, make_model

TAU = 3
KILL_AFTER_BATCH = 7  # the victim commits batch 7 (inner step 2 of 3) and dies
MAX_BATCHES = 400  # a guard: the test fails if the 3 -> 2 -> 3 sequence has not finished by then


def params_hash(model: torch.nn.Module, buffers: bool = True) -> str:
    """SHA-256 of the model's tensors: its parameters and (if ``buffers``) BatchNorm statistics."""
    h = hashlib.sha256()
    for t in model.state_dict().values() if buffers else model.parameters():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out = sys.argv[1]
    hosts_file = os.environ["HVD_SLOWMO_TEST_HOSTS"]
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    logf = open(os.path.join(out, f"log.{os.getpid()}.jsonl"), "a", buffering=1)
    hvd.init()
    torch.set_num_threads(1)
    model = make_model()
    base_lr = 0.05
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        tau=TAU,
        slow_lr=1.0,
        slow_momentum=0.5,
        buffers="reset",
    )
    # history: ((batch, world size), ...) whenever the size changes; a tuple, since ObjectState
    # keeps a reference to the committed value and a list would be mutated behind its back.
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, history=())
    resets = []

    def on_reset() -> None:
        # The documented hook for anything that depends on the number of workers, e.g. a linear
        # LR scaling (kept at one worker's LR here so the loss curve is comparable across sizes).
        resets.append(hvd.size())
        for g in opt.param_groups:
            g["lr"] = base_lr

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.batch < MAX_BATCHES:
            size = hvd.size()
            if not state.history or state.history[-1][1] != size:
                state.history = state.history + ((state.batch, size),)
            sizes = [s for _, s in state.history]
            if sizes[-3:] == [3, 2, 3] and state.batch >= state.history[-1][0] + 3 * TAU:
                return
            rec = {
                "pid": os.getpid(),
                "host": host,
                "batch": state.batch,
                "rank": hvd.rank(),
                "hvd_size": size,
                "comm_size": opt.comm.size,
                "comm_rank": opt.comm.rank,
                "base_size": opt.base.comm.size,
                "resets": list(resets),
            }
            # The parameters this step starts from (after a membership change: the anchor).
            rec["start"] = params_hash(model, buffers=False)
            opt.zero_grad()
            loss = loss_at(model, hvd.rank(), state.batch)
            loss.backward()
            opt.step()
            rec.update(
                loss=loss.item(),
                num_steps=opt.num_steps,
                inner_step=opt.inner_step,
                outer_steps=opt.outer_steps,
                time=time.time(),
            )
            if opt.inner_step == 0:  # after an exact average: the new anchor
                rec["params"] = params_hash(model)
                rec["anchor"] = params_hash(model, buffers=False)
            logf.write(json.dumps(rec) + "\n")
            state.batch += 1
            if (
                hvd.rank() == 0
                and sizes[-2:] == [3, 2]
                and state.batch == state.history[-1][0] + 2 * TAU
                and "127.1" not in open(hosts_file).read()
            ):
                with open(hosts_file + ".tmp", "w") as f:
                    f.write("localhost:2\n127.0.0.1:1\n127.1:1\n")
                os.replace(hosts_file + ".tmp", hosts_file)
            state.commit()
            if host == "127.0.0.1" and state.batch == KILL_AFTER_BATCH + 1:
                logf.write(
                    json.dumps(
                        {
                            "pid": os.getpid(),
                            "killed_at": state.batch - 1,
                            "inner_step": opt.inner_step,
                        }
                    )
                    + "\n"
                )
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)

    train(state)
    logf.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "done": True,
                "history": state.history,
                "rank": hvd.rank(),
                "final_params": params_hash(model),
                "num_steps": opt.num_steps,
            }
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
