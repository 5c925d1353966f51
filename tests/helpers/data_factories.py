"""Data factories for tests: `data.factory = tests.helpers.data_factories:NAME` (the repository root is on
sys.path in the test runs)."""

from pathlib import Path

import torch
from torch.utils.data import Dataset


def png_tensors(root: str):
    """An ImageFolder tree read with PIL directly, as tensors: the device path's twin of data.name=imagefolder."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    splits = []
    for split in ("train", "test"):
        classes = sorted(p.name for p in (Path(root) / split).iterdir())
        images, labels = [], []
        for label, name in enumerate(classes):
            for path in sorted((Path(root) / split / name).iterdir()):
                with Image.open(path) as image:
                    images.append(pil_to_tensor(image))
                labels.append(label)
        splits.append((torch.stack(images), torch.tensor(labels)))
    return tuple(splits)


class Pairs(Dataset):
    """A map-style dataset of (float tensor, int label), without a targets attribute."""

    def __init__(self, n: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def pairs(n_train: int = 64, n_test: int = 20, num_classes: int = 5):
    return Pairs(n_train, num_classes, 0), Pairs(n_test, num_classes, 1)


def tensors(n_train: int = 64, n_test: int = 20, num_classes: int = 5):
    a, b = pairs(n_train, n_test, num_classes)
    return (a.x, a.y), (b.x, b.y)


def raises(**kwargs):
    raise ValueError("no such bucket: s3://nowhere")


def returns_a_dict():
    return {"train": 1, "test": 2}


def returns_strings():
    return "train.csv", "test.csv"


def bad_samples():
    return [("x", 1)], [("x", 1)]


def tiny_cnn(num_classes: int, in_channels: int):
    """A model factory for the new sets (distrib passes the data's classes and channels)."""
    return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3, stride=2), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, num_classes))


def mismatched():
    (x, y), (tx, ty) = tensors()
    return (x, y), (tx[:, :, :4], ty)


def with_val():
    """(train, val, test): 64, 10 and 20 synthetic Fashion-MNIST-shaped samples."""
    from distrib.data.named import synthetic_split

    splits = [synthetic_split(size, seed) for size, seed in ((64, 1), (10, 3), (20, 2))]
    return tuple((split.inputs, split.targets) for split in splits)


def pad_to_32(batch):
    """A user's collate function (data.collate): token samples padded to 32 ids, labels -100 on the padding."""
    ids = torch.zeros(len(batch), 32, dtype=torch.long)
    labels = torch.full((len(batch), 32), -100)
    for row, sample in enumerate(batch):
        ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        labels[row, :len(sample["labels"])] = sample["labels"]
    return {"input_ids": ids, "labels": labels}
