"""PyTorch jobs for tests/test_torch.py, written as a Horovod user writes them
(``import horovod.torch as hvd`` under ``--as-horovod``, else ``elastic_hvd.torch``).

    python torch_job.py collectives      # every collective's values on 2 ranks
    python torch_job.py train STEPS      # a training loop, a digest after every step
    python torch_job.py elastic EPOCHS   # the same under hvd.elastic.run, an ElasticSampler
    python torch_job.py exactly_once EPOCHS SAMPLES   # ElasticDataLoader's oracle

``train``: a small conv net on generated data (each rank's batches a function of its
original id and the step) plus two *counters*, vectors with one entry per original id,
each in a group of its own (its own collective): a rank's loss adds its counter
entries, so its gradient is 1 at its id, and with op=Sum and a learning rate of 1 every
committed step subtracts exactly 1 from the entry of each rank it reduced.  At the end
a survivor's entries are -STEPS and a lost rank's are minus the steps it was part of,
alike in both counters: a step applied twice, lost, or mixing two memberships (one
counter's collective with the lost rank, the other's without) shows.  This oracle reads
what the optimizer applied, not the core's records.
"""

import hashlib
import json
import os
import sys
import time

import torch

import report

try:  # under elastic-hvd-run --as-horovod (no Horovod is installed)
    import horovod.torch as hvd
except ImportError:
    import elastic_hvd.torch as hvd
from elastic_hvd.core import runtime  # noqa: E402

OUT = os.environ["TEST_OUT_DIR"]


def collectives():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    r = float(rank)
    got = {}
    x = torch.full((2, 3), r + 1)
    got["average"] = hvd.allreduce(x).tolist()
    got["sum"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    got["max_int"] = hvd.allreduce(torch.tensor([rank, 10 - rank]), op=hvd.Max).tolist()
    got["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                  postscale_factor=0.5).tolist()
    got["half"] = hvd.allreduce(x.half(), op=hvd.Sum).float().tolist()
    got["bf16"] = hvd.allreduce(x.bfloat16(), op=hvd.Sum).float().tolist()
    got["fp16_compressed"] = hvd.allreduce(x, op=hvd.Sum,
                                           compression=hvd.Compression.fp16).tolist()
    strided = torch.arange(12.).reshape(3, 4).t()  # not contiguous
    got["strided"] = hvd.allreduce(strided + r, op=hvd.Sum).tolist()
    inplace = x.clone()
    same = hvd.allreduce_(inplace, op=hvd.Sum)
    got["inplace"] = [inplace.tolist(), same is inplace]
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    got["async"] = [hvd.poll(handle), hvd.synchronize(handle).tolist()]
    group = hvd.grouped_allreduce([x, torch.ones(3, dtype=torch.float64) * (r + 1)], op=hvd.Sum)
    got["grouped"] = [t.tolist() for t in group] + [str(group[1].dtype)]
    ys = [x.clone(), x.clone() * 2]
    hvd.synchronize(hvd.grouped_allreduce_async_(ys, op=hvd.Sum))
    got["grouped_inplace"] = [t.tolist() for t in ys]
    got["allgather"] = hvd.allgather(torch.full((rank + 1, 2), r)).tolist()
    got["grouped_allgather"] = [t.tolist() for t in hvd.grouped_allgather(
        [torch.tensor([r]), torch.full((1, 2), r * 10)])]
    got["broadcast"] = hvd.broadcast(torch.tensor([r, r]), root_rank=1).tolist()
    b = torch.tensor([r, r])
    hvd.broadcast_(b, root_rank=1)
    got["broadcast_"] = b.tolist()
    received, splits = hvd.alltoall(torch.arange(3.) + 10 * r, splits=torch.tensor([1, 2]))
    got["alltoall"] = [received.tolist(), splits.tolist()]
    got["alltoall_even"] = hvd.alltoall(torch.arange(4.) + 10 * r).tolist()
    got["reducescatter"] = hvd.reducescatter(torch.arange(6.).reshape(3, 2) * (r + 1),
                                             op=hvd.Sum).tolist()
    got["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    got["allgather_object"] = hvd.allgather_object(("r", rank))
    got["join"] = hvd.join()
    hvd.barrier()
    # gradients through the collectives, as Horovod's
    leaf = torch.ones(2, requires_grad=True)
    (hvd.allreduce(leaf * (r + 1), op=hvd.Sum) * torch.tensor([1., 2.])).sum().backward()
    got["allreduce_grad"] = leaf.grad.tolist()
    leaf = torch.ones(rank + 1, requires_grad=True)
    hvd.allgather(leaf).sum().backward()
    got["allgather_grad"] = leaf.grad.tolist()
    leaf = torch.ones(2, requires_grad=True)
    hvd.broadcast(leaf, root_rank=0).sum().backward()
    got["broadcast_grad"] = leaf.grad.tolist()
    # a model and its optimizer state from rank 0
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    for _ in range(rank + 1):  # rank-specific running stats, batch count, momentum
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    got["params"] = {k: v.tolist() for k, v in model.state_dict().items()}
    got["momentum"] = [opt.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
    got["lr"] = opt.param_groups[0]["lr"]
    got["optimizer"] = optimizer_checks(rank, size)
    got["sync_bn"] = sync_bn_checks(rank, size)
    # zero-copy: the array the core is given shares the tensor's memory
    from elastic_hvd.torch.mpi_ops import to_numpy
    t = torch.zeros(4)
    got["zero_copy"] = to_numpy(t).ctypes.data == t.data_ptr()
    report.write(runtime.current().original_id, rank=rank, size=size, got=got)


def _batch(r, k):
    g = torch.Generator().manual_seed(1000 * r + k)
    return torch.randint(0, 10, (4,), generator=g), torch.randn(4, 3, generator=g)


class Small(torch.nn.Module):
    """An embedding (sparse gradients or not) and a linear layer."""

    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(7)
        self.emb = torch.nn.Embedding(10, 3, sparse=sparse)
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, ids, x):
        return (self.fc(self.emb(ids) + x) ** 2).sum()


def _local_grads(sparse, r, passes):
    model = Small(sparse)
    for k in range(passes):
        model(*_batch(r, k)).backward()
    return [p.grad.to_dense() for p in model.parameters()]


def optimizer_checks(rank, size):
    """DistributedOptimizer's gradients against the average of every rank's local
    gradients, computed here without collectives; Horovod's errors."""
    results = {}
    cases = {"plain": ({}, False, 1), "passes2": ({"backward_passes_per_step": 2}, False, 2),
             "groups2": ({"groups": 2}, False, 1), "sparse": ({}, True, 1),
             "sparse_as_dense": ({"sparse_as_dense": True}, True, 1),
             "fp16": ({"compression": hvd.Compression.fp16}, False, 1),
             "predivide": ({"gradient_predivide_factor": 2.0}, False, 1)}
    for name, (kwargs, sparse, passes) in cases.items():
        model = Small(sparse)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), **kwargs)
        for k in range(passes):
            model(*_batch(rank, k)).backward()
        opt.synchronize()
        expected = [sum(gs) / size for gs in zip(*[_local_grads(sparse, r, passes)
                                                    for r in range(size)])]
        tol = 1e-2 if name == "fp16" else 1e-5
        results[name] = all(torch.allclose(p.grad.to_dense(), e, atol=tol)
                            for p, e in zip(model.parameters(), expected))
        with opt.skip_synchronize():
            opt.step()
    model = Small(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(*_batch(rank, 0)).backward()
    try:
        opt.zero_grad()
        results["zero_grad_error"] = None
    except AssertionError as exc:
        results["zero_grad_error"] = str(exc)[:40]
    opt.step()
    model(*_batch(rank, 0)).backward()
    try:
        model(*_batch(rank, 1)).backward()
        results["passes_error"] = None
    except AssertionError as exc:  # (raised by the hook, through autograd)
        results["passes_error"] = str(exc)[:40]
    except RuntimeError as exc:
        results["passes_error"] = str(exc)[:200]
    return results


def sync_bn_checks(rank, size):
    """SyncBatchNorm on each rank's part == BatchNorm2d on the whole batch: outputs,
    input gradients, parameter gradients (summed over ranks) and running statistics."""
    g = torch.Generator().manual_seed(5)
    whole = torch.randn(4 * size, 3, 5, 5, generator=g)
    weights = torch.randn(4 * size, 3, 5, 5, generator=g)
    mine = slice(4 * rank, 4 * rank + 4)
    ref = torch.nn.BatchNorm2d(3)
    x = whole.clone().requires_grad_()
    (ref(x) * weights).sum().backward()
    sync = hvd.SyncBatchNorm(3)
    part = whole[mine].clone().requires_grad_()
    out = sync(part)
    (out * weights[mine]).sum().backward()
    weight_grad = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
    def close(a, b):
        return bool(torch.allclose(a, b, atol=1e-4))

    expected = torch.nn.functional.batch_norm(whole, None, None, ref.weight, ref.bias,
                                              training=True, eps=ref.eps).detach()
    return {"output": close(out.detach(), expected[mine]),
            "input_grad": close(part.grad, x.grad[mine]),
            "weight_grad": close(weight_grad, ref.weight.grad),
            "running": close(sync.running_mean, ref.running_mean)
            and close(sync.running_var, ref.running_var)}


class Net(torch.nn.Module):
    def __init__(self, ids):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)
        self.counter_a = torch.nn.Parameter(torch.zeros(ids))
        self.counter_b = torch.nn.Parameter(torch.zeros(ids))

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


#: Entries of the counters: original ids (a respawned process gets a new one).
IDS = 8


def _me():
    return runtime.current().original_id


def _setup():
    hvd.init()
    me = _me()  # None in a process spawned to join, until it joined (in hvd.elastic.run)
    torch.manual_seed(1234 + (os.getpid() if me is None else me))  # the broadcast fixes them
    model = Net(IDS)
    counters = [model.counter_a, model.counter_b]
    body = [p for n, p in model.named_parameters() if not n.startswith("counter")]
    # The body's rate follows the live size (lr_policy "linear", the default); the
    # counters' stays 1, so that each committed step adds exactly 1 a member.
    opt = torch.optim.SGD([{"params": body, "lr": 0.01},
                           {"params": counters, "lr": 1.0, "lr_policy": "none"}])
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Sum,
                                   groups=[[model.counter_a], [model.counter_b]])
    return me, model, opt


def _step(model, opt, x, y, sizes, batch, epoch=0):
    me = _me()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y) \
        + model.counter_a[me] + model.counter_b[me]
    loss.backward()
    opt.step()
    sizes.append(hvd.size())
    with open(os.path.join(OUT, f"steps{me}.jsonl"), "a") as f:
        f.write(json.dumps({"step": runtime.session().step, "epoch": epoch, "batch": batch,
                            "digest": digest(model), "size": hvd.size(),
                            "time": time.time()}) + "\n")
    time.sleep(float(os.environ.get("TORCH_JOB_STEP_SLEEP", "0.02")))


def _report(model, opt, sizes, **more):
    report.write(_me(), rank=hvd.rank(), size=hvd.size(), steps=runtime.session().step,
                 counter_a=model.counter_a.tolist(), counter_b=model.counter_b.tolist(),
                 sizes=sizes, lrs=[group["lr"] for group in opt.param_groups], **more)


def train(steps):
    """A plain Horovod loop: each rank's batches a function of its id and the step."""
    me, model, opt = _setup()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sizes = []
    for step in range(steps):
        g = torch.Generator().manual_seed(me * 100003 + step)
        x = torch.randn(8, 1, 8, 8, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        _step(model, opt, x, y, sizes, step)
    _report(model, opt, sizes)


def train_elastic(epochs):
    """Horovod's elastic PyTorch idiom: hvd.elastic.run, TorchState with an
    ElasticSampler feeding a DataLoader, record_batch, commit every few batches."""
    _, model, opt = _setup()
    g = torch.Generator().manual_seed(42)  # the same dataset on every rank
    data = torch.utils.data.TensorDataset(torch.randn(480, 1, 8, 8, generator=g),
                                          torch.randint(0, 3, (480,), generator=g))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)
    sizes, seen = [], []

    @hvd.elastic.run
    def fit(state):
        for state.epoch in range(state.epoch, epochs):  # noqa: B020 (Horovod's idiom)
            for batch, (x, y) in enumerate(loader):
                _step(model, opt, x, y, sizes, batch, state.epoch)
                state.sampler.record_batch(batch, 8)
                state.batch = batch
                if batch % 5 == 4:
                    state.commit()
            seen.append(len(loader))
            state.sampler.set_epoch(state.epoch + 1)
            state.batch = 0
            state.commit()

    fit(state)
    _report(model, opt, sizes, batches_per_epoch=seen)


def exactly_once(epochs, samples):
    """The exactly-once oracle: one weight per sample id, the loss the sum of the weights
    of this rank's batch (gradient 1 at each id trained), op=Sum and lr 1: every epoch
    must subtract exactly 1 from every weight, whoever trained it, whatever was lost
    (lr_policy "none": the rate stays 1 through the loss).
    It reads what the optimizer applied, not the sampler's rule."""
    hvd.init()
    me = runtime.current().original_id
    data = torch.utils.data.TensorDataset(torch.arange(samples))
    w = torch.nn.Parameter(torch.zeros(samples))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                   op=hvd.Sum, lr_policy="none")
    loader = hvd.ElasticDataLoader(data, batch_size=2, shuffle=True, seed=5, num_workers=2)
    sizes, after_epoch = [], []
    for epoch in range(epochs):
        for batch, (ids,) in enumerate(loader):
            opt.zero_grad()
            w[ids].sum().backward()
            opt.step()
            sizes.append(hvd.size())
            with open(os.path.join(OUT, f"steps{me}.jsonl"), "a") as f:
                f.write(json.dumps({"step": runtime.session().step, "epoch": epoch,
                                    "batch": batch, "digest": digest(torch.nn.ParameterList([w])),
                                    "size": hvd.size(), "time": time.time()}) + "\n")
            time.sleep(0.02)
        after_epoch.append(sorted(set(w.tolist())))
    report.write(me, rank=hvd.rank(), size=hvd.size(), steps=runtime.session().step,
                 weights=w.tolist(), after_epoch=after_epoch, sizes=sizes,
                 discarded=loader.discarded, loaders_started=loader.loaders_started)


if __name__ == "__main__":
    if sys.argv[1] == "collectives":
        collectives()
    elif sys.argv[1] == "elastic":
        train_elastic(int(sys.argv[2]))
    elif sys.argv[1] == "exactly_once":
        exactly_once(int(sys.argv[2]), int(sys.argv[3]))
    else:
        train(int(sys.argv[2]))
