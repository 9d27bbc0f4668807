"""A rank with a 2-worker DataLoader, every warning shown: torch's worker-count check must not warn
under placerun where it does not under torchrun (tests/bind/test_bind_dataloader.py)."""
import os
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("always")
dist.init_process_group("gloo")
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8, num_workers=2)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in loader:
    model(x).sum().backward()
    opt.step()
# one write(2) of a whole line: the two ranks share the launcher's stdout, and print() writes its
# pieces one by one when the stream is unbuffered, so their lines could interleave
os.write(1, f"main cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n".encode())
dist.destroy_process_group()
