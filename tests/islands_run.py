"""Worker of tests/test_islands.py, under ``torchrun --nproc-per-node 4``: 2 islands x 2 ranks.

Each rank trains two models side by side on the same batches and in the same order of
collectives:

* the island model: sharded inside its island with FSDP2 (``fully_shard`` on the mesh's
  ``"shard"`` dimension) or replicated with DDP, wrapped with ``worker=Islands(mesh)``;
* the unsharded reference: the whole model on this rank, wrapped with the plain
  torch.distributed communicator over the same two islands (this rank and its peer in the other
  island): the unsharded 2-worker run.

The two ranks of an island see the same batch (its island's), so FSDP's gradient reduction
inside the island, ``g/2 + g/2``, is exactly ``g``, and the island's per-element inner steps are
those of the unsharded worker: any difference between the two is the outer step's on shards.
After every step the rank gathers the island model's full parameters (``DTensor.full_tensor``)
and records their largest difference from the reference; after every step at which an outer
step landed it checks that its shard equals its peer's bit for bit.

Usage: ``torchrun --nproc-per-node N tests/islands_run.py OUT CASE[,CASE...] [STEPS [MODE
[DEVICE]]]``: 2 islands of ``N / 2`` ranks; writes ``OUT/rank<r>.json`` (several cases:
``OUT/<case>/rank<r>.json``) and the final parameters to ``OUT/rank<r>.final.pt``. ``CASE``
names a row of :data:`CASES`; ``MODE`` ``restart`` saves after every step (each rank its own
file) and kills rank 1 once before the middle step (under ``torchrun --max-restarts=1`` every
rank then resumes from the last step all saved); before that, the first attempt trains the case
uninterrupted into ``OUT/uninterrupted`` (the run the resumed one must end equal to, without a
launch of its own); ``DEVICE`` ``cuda`` puts every rank on GPU 0 (the ranks share it through Gloo:
scripts/gpu_check.sh's two-process case).
"""

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hvd_slowmo
from hvd_slowmo.comm.torchdist import TorchDistCommunicator

from helpers import end_process, state_tensors_of

WIDTH = 256  # every row of every weight is one 256-value chunk of the codecs, sharded or not
LAYERS = 3
CASES = {
    "plain": {"tau": 4, "slow_lr": 1.0, "slow_momentum": 0.5},
    "fragments": {"tau": 6, "fragments": 3, "overlap": 2, "eager": "local", "slow_momentum": 0.6},
    "nesterov": {
        "tau": 4,
        "fragments": 2,
        "outer_optimizer": "nesterov",
        "slow_lr": 0.7,
        "slow_momentum": 0.8,
    },  # fmt: skip
    "int8": {"tau": 4, "codec": "int8", "error_feedback": True},
    "sparse": {"tau": 4, "codec": hvd_slowmo.SparseCodec(density=0.05, bits=4, chunk=WIDTH)},
    "ddp": {"tau": 4, "slow_lr": 1.0, "slow_momentum": 0.5},
    # Each DDP rank sends its half of the model through int8 across islands, then the halves are
    # gathered inside the island: blocks of 256 line up with the flat run's, so the same codes.
    "ddp-hierarchical": {"tau": 4, "codec": "int8", "error_feedback": True, "hierarchical": True},
    "average-buffers": {"tau": 4, "buffers": "average"},
    "mismatch": {"tau": 4},  # rank 1 says tau=5: its island's other rank must not hang
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def batch(island: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * island + step)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    return x.to(device), y.to(device)


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def build(case: str, mesh, device: str):
    settings = dict(CASES[case])
    if case == "mismatch" and dist.get_rank() == 1:
        settings["tau"] = 5
    island_model = make_model().to(device)
    if case.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(island_model, process_group=mesh.get_group("shard"))
        named = list(island_model.named_parameters())
        model = wrapped
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in island_model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(island_model, mesh=mesh["shard"])
        named = list(island_model.named_parameters())
        model = island_model
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.AdamW(island_model.parameters(), lr=0.01, weight_decay=0.1),
        named_parameters=named,
        worker=hvd_slowmo.Islands(mesh, across="islands"),
        **settings,
    )
    ref_model = make_model().to(device)
    ref_opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.1),
        named_parameters=ref_model.named_parameters(),
        communicator=TorchDistCommunicator(group=mesh.get_group("islands")),
        **{k: v for k, v in settings.items() if k != "hierarchical"},  # one level: the flat run
    )
    return model, island_model, opt, ref_model, ref_opt


def train_step(model, opt, island: int, step: int, device: str) -> None:
    x, y = batch(island, step, device)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def run(
    out: str,
    case: str,
    mesh,
    steps: int,
    device: str = "cpu",
    restart_at: int | None = None,
) -> None:
    """Train one case on the islands and the reference side by side; write ``OUT/rank<r>.json``."""
    rank = dist.get_rank()
    island = mesh.get_local_rank("islands")
    peers = mesh.get_group("islands")  # this rank and its peer in the other island
    try:
        model, island_model, opt, ref_model, ref_opt = build(case, mesh, device)
    except ValueError as e:
        if case != "mismatch":
            raise
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"error": str(e)}, f)
        return
    start = 0
    if restart_at is not None:
        start = agreed_start(out, rank)
        ckpt = os.path.join(out, f"ckpt.{start}.rank{rank}.pt")
    if start:
        saved = torch.load(ckpt, weights_only=False, map_location=device)
        # What an FSDP user saves anyway: each rank its own shards (DTensors), one file a rank.
        island_model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ref_model.load_state_dict(saved["ref_model"])
        ref_opt.load_state_dict(saved["ref_opt"])
        print(f"rank {rank}: resumed at step {start}", flush=True)
    rec: dict = {"diffs": [], "bitwise": [], "landed": [], "consensus": []}
    for step in range(start, steps):
        marker = os.path.join(out, "killed")
        if step == restart_at and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a lost worker, mid-period
        train_step(model, opt, island, step, device)
        train_step(ref_model, ref_opt, island, step, device)
        record(opt, island_model, ref_opt, ref_model, peers, island, rec, step)
        if restart_at is not None:
            save(island_model, opt, ref_model, ref_opt, f"{out}/ckpt.{step + 1}.rank{rank}.pt")
    # The final parameters as tensors (the restart test compares them bit for bit).
    final = [full(p).detach().cpu() for p in island_model.parameters()]
    torch.save(final, os.path.join(out, f"rank{rank}.final.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {**rec, "outer_steps": opt.outer_steps,
             "state_bytes": opt_state_bytes(opt), "exchange": opt.exchanges[0].name},
            f,
        )  # fmt: skip


def init_process_group() -> None:
    """Gloo over torchrun's store, under a prefix per attempt: torchrun keeps its store across
    restarts (--max-restarts) and the Gloo addresses' keys are the same in every attempt, so a
    restarted rank could read a peer's stale address and fail to connect."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=120),  # a lost peer ends the launch, not 30 minutes
    )


def record(opt, island_model, ref_opt, ref_model, peers, island, out: dict, step) -> None:
    """After a step: the largest difference from the reference, of the parameters and (between
    exact averages) of the consensus model, and whether this rank's outer state (and, right
    after a whole-model exact average, its shard) equals its peer's."""
    diffs, bitwise, landed = out["diffs"], out["bitwise"], out["landed"]
    with torch.no_grad():
        mine = [full(p) for p in island_model.parameters()]
        ref = list(ref_model.parameters())
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(mine, ref)))
    if not opt.at_consensus():  # this rank's shards of the islands' average, made whole
        from torch.distributed.tensor import DTensor

        shards, _ = opt.consensus()
        whole = [
            DTensor.from_local(s, p.device_mesh, p.placements).full_tensor()
            if hasattr(p, "device_mesh")
            else s
            for s, p in zip(shards, island_model.parameters())
        ]
        want, _ = ref_opt.consensus()
        out["consensus"].append(max(float((a - b).abs().max()) for a, b in zip(whole, want)))
    # The anchor (and, right after an exact average, the parameters) of the ranks holding one
    # shard must be bitwise identical: the same average, the same arithmetic.
    same = list(state_tensors_of(opt))
    whole = opt.config.fragments == 1 and not opt.config.overlap
    if opt.inner_step == 0 and whole:
        same += [hvd_slowmo.islands.local(p) for p in island_model.parameters()]
        landed.append(step)
    bitwise.append(same_bytes_as_peer(same, island, peers))


def same_bytes_as_peer(tensors: list[torch.Tensor], island: int, group) -> bool:
    """Whether these tensors' bytes equal the peer's (the other island's rank with this shard),
    bit for bit: their raw bytes gathered as one uint8 tensor (the sizes first, so a peer
    holding other shapes reads as different rather than hanging the gather)."""
    mine = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for t in tensors])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]), group=group)
    if sizes[0].item() != sizes[1].item():
        return False
    gathered = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(gathered, mine, group=group)
    return torch.equal(gathered[island], gathered[1 - island])


def agreed_start(out: str, rank: int) -> int:
    """torchrun --max-restarts: the last step every rank saved (an island that had no collective
    with the killed rank may have saved later steps)."""
    suffix = f".rank{rank}.pt"
    mine = [
        int(n.split(".")[1])
        for n in os.listdir(out)
        if n.startswith("ckpt.") and n.endswith(suffix)
    ]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return max(set.intersection(*map(set, everyone)), default=0)


def save(island_model, opt, ref_model, ref_opt, path: str) -> None:
    state = {
        "model": island_model.state_dict(),
        "opt": opt.state_dict(),
        "ref_model": ref_model.state_dict(),
        "ref_opt": ref_opt.state_dict(),
    }
    hvd_slowmo.save_checkpoint(state, path)


def opt_state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors_of(opt))


def main(argv: list[str]) -> None:
    out, cases = argv[1], argv[2].split(",")
    steps = int(argv[3]) if len(argv) > 3 else 12
    mode = argv[4] if len(argv) > 4 else "full"
    device = argv[5] if len(argv) > 5 else "cpu"
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU
    init_process_group()
    shape = (2, dist.get_world_size() // 2)
    mesh = init_device_mesh(device, shape, mesh_dim_names=("islands", "shard"))
    for case in cases:  # several cases in one launch: one process start-up for all of them
        where = out if len(cases) == 1 else os.path.join(out, case)
        os.makedirs(where, exist_ok=True)
        if mode == "restart":  # under torchrun --max-restarts=1: rank 1 dies mid-run
            # First the uninterrupted run, in the first attempt's fresh processes as in a launch
            # of its own: where the resumed run must end; the restarted attempt finds it done.
            uninterrupted = os.path.join(where, "uninterrupted")
            os.makedirs(uninterrupted, exist_ok=True)
            done: list = [None] * dist.get_world_size()
            mine = os.path.join(uninterrupted, f"rank{dist.get_rank()}.json")  # written last
            dist.all_gather_object(done, os.path.exists(mine))
            if not all(done):
                run(uninterrupted, case, mesh, steps, device=device)
            run(where, case, mesh, steps, device=device, restart_at=steps // 2 + 1)
        else:
            run(where, case, mesh, steps, device=device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
    end_process()
