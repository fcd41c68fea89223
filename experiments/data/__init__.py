"""Datasets for the harness: one module per source, and the API that splits, standardises and
fingerprints them (:mod:`affdiv.experiments.data.dataset`).

    raw            the arrays a source hands over, checked once for all sources
    idx            the IDX container (MNIST, Fashion-MNIST)
    fashion_mnist  Fashion-MNIST from IDX files (Debian's dataset-fashion-mnist, or a folder)
    cifar10        CIFAR-10 from the official pickle release, checksummed
    synthetic      a teacher-student task whose inputs share a component of tunable weight
"""

from affdiv.experiments.data.dataset import DATASETS, Dataset, Split, load_dataset

__all__ = ["DATASETS", "Dataset", "Split", "load_dataset"]
