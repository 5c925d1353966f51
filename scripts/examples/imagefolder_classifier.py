"""An image classifier on your own folder of images: torchvision's ImageFolder and ResNet-18, trained by distrib.fit.

    ROOT/train/CLASS/*.png and ROOT/test/CLASS/*.png (any format PIL reads; one folder per class)

    python scripts/examples/imagefolder_classifier.py ROOT                     # one process (CPU or one GPU)
    torchrun --standalone --nproc-per-node 2 scripts/examples/imagefolder_classifier.py ROOT
    distrib launch --nproc-per-node 8 scripts/examples/imagefolder_classifier.py ROOT --epochs 30

The datasets are map-style, so distrib reads them through its DataLoader path, each rank loading only its slice of
every global batch. The same run without Python: distrib train --set data.name=imagefolder --set data.root=ROOT
--set model.factory=torchvision.models:resnet18."""

import argparse

from torchvision import datasets, models, transforms

from distrib import fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a folder with train/ and test/ subfolders of class folders")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=0, help="stop earlier (0: run all the epochs)")
    parser.add_argument("--batch", type=int, default=64, help="global batch size (all ranks together)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--run-dir", default="runs/imagefolder")
    args = parser.parse_args()

    to_tensor = transforms.Compose([transforms.Resize((args.image_size, args.image_size)), transforms.ToTensor()])
    train = datasets.ImageFolder(f"{args.root}/train", transform=to_tensor)
    test = datasets.ImageFolder(f"{args.root}/test", transform=to_tensor)

    def resnet18(num_classes: int):  # called by fit after seeding: the same initial weights on every rank
        return models.resnet18(num_classes=num_classes)

    summary = fit(resnet18, train, test, overrides={
        "train.epochs": args.epochs, "train.max_steps": args.max_steps, "train.global_batch_size": args.batch,
        "train.optimizer": "sgd", "train.lr": 0.05, "train.warmup_steps": 20, "data.num_workers": args.workers,
        "run.dir": args.run_dir})
    print(f"test accuracy {summary['test_accuracy']:.3f} over {summary['test_count']} images; per class: "
          + ", ".join(f"{name} {acc:.2f}" for name, acc in summary["test_per_class_accuracy"].items()
                      if acc is not None))


if __name__ == "__main__":
    main()
