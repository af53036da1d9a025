"""The PyTorch side: an IterableDataset adapter, a stateful loader over all workers,
rank discovery and atomic checkpoint files."""

from resumable.order.topology import dataloader_worker, distributed_rank
from resumable.torch.checkpoint import load, save
from resumable.torch.dataset import PipelineDataset
from resumable.torch.distributed import PerRank
from resumable.torch.loader import Loader

__all__ = ["Loader", "PerRank", "PipelineDataset", "dataloader_worker", "distributed_rank", "load", "save"]
