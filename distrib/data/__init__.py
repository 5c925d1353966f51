"""Data for training: datasets by name or factory, read once and described by a DataInfo (load.py, idx.py, named.py,
factory.py, assemble.py; describe.py: classes and statistics; materialize.py: the splits' kind, read whole); what a
sample may be (samples.py: tensors of any dtype and shape, or dicts of them); the world-size-invariant batch plan and
the two batch sources (batching.py); micro-batches of samples of different lengths, padded, or the user's collate
function (collate.py); a validation set (split.py); batched augmentation on the device (augment.py); a folder of images
for predict (folder_inputs.py); language-model windows of a text or token stream, their own batch source (text.py), of
token shards (token_files.py); streams, plain or sharded, read pass by pass with each rank's position in the checkpoint
(stream.py, stream_read.py). The worker calls load_data; distrib.fit calls data_from_datasets."""

from distrib.data.assemble import Data
from distrib.data.augment import Augment
from distrib.data.batching import (
    Batch,
    BatchPlan,
    BatchSource,
    DeviceBatches,
    LoaderBatches,
    epoch_steps,
    eval_batches,
    make_plan,
)
from distrib.data.folder_inputs import load_inputs
from distrib.data.load import data_from_datasets, load_data, load_splits
from distrib.data.stream import StreamBatches
from distrib.data.stream_read import Shards
from distrib.data.tensors import DataInfo, Normalizer, Split, normalize

__all__ = ["Augment", "Batch", "BatchPlan", "BatchSource", "Data", "DataInfo", "DeviceBatches", "LoaderBatches",
           "Normalizer", "Shards", "Split", "StreamBatches", "data_from_datasets", "epoch_steps", "eval_batches",
           "load_data", "load_inputs", "load_splits", "make_plan", "normalize"]
