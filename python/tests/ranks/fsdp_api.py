"""One rank of the FSDPModule API checks: dbuf's modules and fully_shard as torch 2.15's FSDP2 defines them.

  fsdp_api.py OUT.pt        (under DBUF_FSDP=1: torch's names are dbuf's)

Each check records its name in OUT.pt.<rank> once it passed; a failure raises.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard

import dbuf.torch as dt
from dbuf.torch import DBufModule

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert fully_shard is dt.fully_shard, "the switch put dbuf's fully_shard in FSDP2's place"
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (world,))
passed: list[str] = []


def raises(error: type, call, *words: str) -> None:
    try:
        call()
    except error as raised:
        assert all(word in str(raised) for word in words), f"{error.__name__} without {words}: {raised}"
        return
    raise AssertionError(f"{call} did not raise {error.__name__}")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


# Every public method of torch's FSDPModule is DBufModule's own.
public = [name for name, value in vars(FSDPModule).items() if not name.startswith("_") and callable(value)]
assert public and all(name in vars(DBufModule) for name in public), sorted(set(public) - set(vars(DBufModule)))
assert "_apply" in vars(DBufModule) and "_get_fsdp_state" in vars(DBufModule)
passed.append("every public method")

# fully_shard takes every argument of torch's.
torch_parameters = set(inspect.signature(inspect.unwrap(torch.distributed.fsdp._fully_shard.fully_shard)).parameters)
assert torch_parameters <= set(inspect.signature(dt.fully_shard).parameters), torch_parameters
passed.append("every argument")

# Arguments refused, with what to do instead.
raises(ValueError, lambda: fully_shard(model(), mesh=mesh, reshard_after_forward=world + 1), "factor of")
raises(NotImplementedError, lambda: fully_shard(model(), dp_mesh_dims=object()), "dp_mesh_dims")
raises(ValueError, lambda: fully_shard(model(), mesh=init_device_mesh("cpu", (1, 1, world))), "1D or 2D")
raises(TypeError, lambda: fully_shard(model(), mesh="the mesh"), "DeviceMesh")
passed.append("refused arguments")

# Accepted: int reshard_after_forward of the world size (True) and 1 (False), OffloadPolicy,
# CPUOffloadPolicy on the host backend, shard_placement_fn's Shard(0): each rank holds whole rows.
net = model()
fully_shard(net[0], mesh=mesh, reshard_after_forward=world, offload_policy=OffloadPolicy())
fully_shard(net[2], mesh=mesh, offload_policy=CPUOffloadPolicy(), shard_placement_fn=lambda p: Shard(0))
fully_shard(net, mesh=mesh, reshard_after_forward=1)
assert isinstance(net, FSDPModule) and isinstance(net[0], FSDPModule)
assert net[0].dbuf_unit.reshard_after_forward is True and net.dbuf_unit.reshard_after_forward is False
begin, end = net[2].weight.element_range
assert begin % 10 == 0 and end % 10 == 0, (begin, end)  # whole rows of the 3 x 10 weight
passed.append("accepted arguments")

# Refused methods name what dbuf cannot do.
raises(NotImplementedError, lambda: net.set_custom_all_gather(object()), "dbufd")
raises(NotImplementedError, lambda: net.set_custom_reduce_scatter(object()), "dbufd")
raises(NotImplementedError, lambda: net.set_manual_backward_finalization(True), "finalizes")
raises(NotImplementedError, lambda: net.finalize_backward(), "finalizes")
for accepted in (lambda: net.set_unshard_in_backward(True), lambda: net.set_unshard_in_backward(False),
                 lambda: net.set_is_last_backward(True),
                 lambda: net.set_requires_all_reduce(False), lambda: net.set_keep_unsharded_storage(True),
                 lambda: net.set_reduce_scatter_unused_params(True), lambda: net.set_manual_backward_finalization(False),
                 lambda: net.set_reduce_scatter_max_input_buffers(2), lambda: net.set_separate_reduce_scatter_group(),
                 lambda: net.set_allocate_memory_from_process_group_for_comm(True), lambda: net.set_symm_mem_for_comm()):
    accepted()
passed.append("refused and accepted methods")

# The gradient divide factor: the ranks' sum divided by it (default: the average).
x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
net(x).sum().backward()
average = [p.grad.full_tensor().clone() for p in net.parameters()]
for p in net.parameters():
    p.grad = None
for module in net.modules():
    if isinstance(module, FSDPModule):
        module.set_gradient_divide_factor(1.0)
net(x).sum().backward()
summed = [p.grad.full_tensor() for p in net.parameters()]
for a, s in zip(average, summed):
    torch.testing.assert_close(s, a * world)
for p in net.parameters():
    p.grad = None
for module in net.modules():
    if isinstance(module, FSDPModule):
        module.set_force_sum_reduction_for_comms(True)
net(x).sum().backward()
for s, forced in zip(summed, [p.grad.full_tensor() for p in net.parameters()]):
    torch.testing.assert_close(forced, s)  # summed, then divided by the factor (1) here
for p in net.parameters():
    p.grad = None
passed.append("divide factor")

# register_fsdp_forward_method (torch's): the method runs with the unit gathered.
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 2)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


head = Head()
fully_shard(head, mesh=mesh)
register_fsdp_forward_method(head, "score")
head.score(x).backward()
assert head.proj.weight.grad is not None and head.proj.weight.grad.shape == (2, 6)
passed.append("register_fsdp_forward_method")

# reset_iter_state after a forward that raised: the next iteration runs.
class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.fail = True

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return self.lin(x)


boom = Boom()
fully_shard(boom, mesh=mesh)
raises(RuntimeError, lambda: boom(x), "boom")
boom.reset_iter_state()
boom.fail = False
boom(x).sum().backward()
assert boom.lin.weight.grad is not None
passed.append("reset_iter_state")

# _apply: .to() of the same device and dtype keeps the parameters in dbufd's memory; a dtype dbufd does not
# hold is refused and leaves them as they were (another one moves them: test_fsdp2_parity.py).
before = net[0].weight.to_local().data_ptr()
net.to("cpu")
assert net[0].weight.to_local().data_ptr() == before
raises(TypeError, lambda: net.to(torch.complex64), "not torch.complex64", "left as they were")
assert net[0].weight.dtype == torch.float32 and net[0].weight.to_local().data_ptr() == before
passed.append("_apply")

torch.save(passed, f"{sys.argv[1]}.{rank}")
dist.barrier()
sys.stdout.flush()
os._exit(0)
