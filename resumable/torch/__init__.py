"""The PyTorch side: an IterableDataset adapter, a stateful loader over all workers,
rank discovery and atomic checkpoint files."""

from resumable.order.topology import dataloader_worker, distributed_rank
from resumable.torch.dataset import PipelineDataset
from resumable.torch.loader import Loader

__all__ = ["Loader", "PipelineDataset", "dataloader_worker", "distributed_rank"]
