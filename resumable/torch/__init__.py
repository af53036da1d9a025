"""The PyTorch side: an IterableDataset adapter, a stateful loader over all workers,
rank discovery and atomic checkpoint files."""

from resumable.order.topology import dataloader_worker, distributed_rank
from resumable.torch.checkpoint import load, save
from resumable.torch.dataset import PipelineDataset
from resumable.torch.distributed import PerRank, load_all_ranks
from resumable.torch.figures import pack_figures
from resumable.torch.loader import Loader
from resumable.torch.tdnodes import FromTorchdata, ToTorchdata

__all__ = [
    "FromTorchdata",
    "Loader",
    "PerRank",
    "PipelineDataset",
    "ToTorchdata",
    "dataloader_worker",
    "distributed_rank",
    "load",
    "load_all_ranks",
    "pack_figures",
    "save",
]
