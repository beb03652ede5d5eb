"""Counting the reads of tensor values back to the host (each one a sync on a GPU), for the
tests that promise a decode step adds none."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the ops through which a tensor's value reaches the host (bool(), int(), .tolist(), equal)
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
              torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host, and ``Tensor.tolist``
    calls (on the CPU, tolist reads the data without dispatching an op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def counted(t):
            self.count += 1
            with torch._C.DisableTorchFunction():
                return tolist(t)

        torch.Tensor.tolist = counted  # shadows the C method until __exit__
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist
        return super().__exit__(*exc)
