"""An unmodified torchrun-style DDP script: gloo, env://, DistributedSampler, DDP."""

import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
torch.manual_seed(0)
features = torch.randn(256, 8)
targets = features @ torch.arange(8.0).unsqueeze(1) + 0.1 * torch.randn(256, 1)
dataset = TensorDataset(features, targets)
sampler = DistributedSampler(dataset, shuffle=True, seed=1)
loader = DataLoader(dataset, batch_size=16, sampler=sampler)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for batch, target in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(batch), target).backward()
        optimizer.step()
digest = hashlib.sha256()
for tensor in model.module.state_dict().values():
    digest.update(tensor.numpy().tobytes())
print(f"rank={dist.get_rank()} digest={digest.hexdigest()}", flush=True)
dist.barrier()  # nobody tears the group down while a peer still talks to it
dist.destroy_process_group()
