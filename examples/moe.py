"""The mixture-of-experts model both example trainers share.

Top-1 routed experts, spread over an expert-parallel group, with tokens routed to the
rank that owns their expert by ``dist_collectives.all_to_all_v``. With no process
group (or a group of one) the exchanges are the identity, so the same module trains
in one process and in the fault-tolerant replicas of ``train_ft.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

import dist_collectives


@dataclass(frozen=True)
class MoEConfig:
    """Model and data sizes; exported as config.json."""

    model_dim: int = 32
    hidden_dim: int = 64
    num_experts: int = 4
    tokens_per_rank: int = 256
    seed: int = 0


class Expert(nn.Module):
    """A two-layer MLP: one expert."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.model_dim, config.hidden_dim)
        self.down = nn.Linear(config.hidden_dim, config.model_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Applies the expert to a batch of tokens."""
        return self.down(torch.relu(self.up(tokens)))


class ExpertParallelMoE(nn.Module):
    """Top-1 routed experts, spread over an expert-parallel group.

    Rank ``r`` of the group holds experts ``r * per_rank ... (r + 1) * per_rank - 1``.
    """

    def __init__(
        self, config: MoEConfig, ep_rank: int = 0, ep_size: int = 1, ep_group: object = None
    ) -> None:
        super().__init__()
        if config.num_experts % ep_size:
            raise ValueError(
                f"num_experts={config.num_experts} is not divisible by the expert-parallel "
                f"size {ep_size}"
            )
        self.config = config
        self.ep_size = ep_size
        self.per_rank = config.num_experts // ep_size
        self.first_expert = ep_rank * self.per_rank
        self.ep_group = ep_group
        # Seeded so that the replicated gate, and each expert's data-parallel replicas,
        # start equal on every rank that holds them.
        torch.manual_seed(config.seed)
        self.gate = nn.Linear(config.model_dim, config.num_experts)
        experts = []
        for index in range(self.per_rank):
            torch.manual_seed(config.seed + 1000 + self.first_expert + index)
            experts.append(Expert(config))
        self.experts = nn.ModuleList(experts)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Routes each token to its top expert (on whichever rank holds it) and back."""
        probabilities = torch.softmax(self.gate(tokens), dim=-1)
        weight, expert = probabilities.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        destination = expert[order] // self.per_rank
        send_counts = torch.bincount(destination, minlength=self.ep_size)
        group = self.ep_group
        # Each peer learns how many tokens it receives from every other one.
        receive_counts = dist_collectives.all_to_all(send_counts, group=group)  # type: ignore[arg-type]
        sends, receives = send_counts.tolist(), receive_counts.tolist()
        received = dist_collectives.all_to_all_v(
            tokens[order],
            receives,
            sends,
            group=group,  # type: ignore[arg-type]
        )
        with torch.no_grad():
            received_expert = dist_collectives.all_to_all_v(
                expert[order].to(torch.float32).unsqueeze(1),
                receives,
                sends,
                group=group,  # type: ignore[arg-type]
            ).squeeze(1)
        local_expert = received_expert.long() - self.first_expert
        # `received * 0`, not zeros_like: the result must stay in the autograd graph even
        # when this rank got no tokens, so that every rank runs the backward exchanges
        # (a rank that skipped one would leave its peers waiting in the collective).
        processed = received * 0.0
        for index, module in enumerate(self.experts):
            rows = (local_expert == index).nonzero().squeeze(1)
            if rows.numel():
                processed = processed.index_put((rows,), module(received[rows]))
        returned = dist_collectives.all_to_all_v(
            processed,
            sends,
            receives,
            group=group,  # type: ignore[arg-type]
        )
        output = torch.empty_like(returned)
        output[order] = returned
        return output * weight.unsqueeze(1)

    def named_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under their global names (expert ids are global)."""
        shards = {f"gate.{name}": value for name, value in self.gate.state_dict().items()}
        for index, module in enumerate(self.experts):
            for name, value in module.state_dict().items():
                shards[f"experts.{self.first_expert + index}.{name}"] = value
        return {name: value.detach().cpu().clone() for name, value in shards.items()}


def teacher(tokens: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """The function the model learns: fixed, the same on every rank."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    projection = torch.randn(config.model_dim, config.model_dim, generator=generator)
    return torch.tanh(tokens @ projection.to(tokens.device)) * 0.5


def batch(config: MoEConfig, rank: int, step: int, device: torch.device) -> torch.Tensor:
    """Synthetic tokens, different on every rank and step, reproducible."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + rank * 10_007 + step)
    return torch.randn(config.tokens_per_rank, config.model_dim, generator=generator).to(device)


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes: equal digests mean bit-identical tensors."""
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()
