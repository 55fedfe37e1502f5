"""Datasets, integrity checks, augmentation and the on-device batch iterators.

Importing this package only imports modules; nothing is read, downloaded or computed until called.
"""

from trainscale.data.augment import (
    center_crop,
    cutout,
    normalize,
    random_crop,
    random_flip,
    resize,
)
from trainscale.data.checksums import FORMATS, FileSpec, FormatSpec, md5_file, verify_files
from trainscale.data.cifar import find_cifar_folder, load_cifar
from trainscale.data.download import download_dataset, ensure_dataset, resolve_data_dir, safe_extract
from trainscale.data.imagefolder import FolderBatches, ImageFolderDataset, load_folder_as_tensors
from trainscale.data.loader import AugmentConfig, Batches, DeviceBatches
from trainscale.data.registry import DATASETS, list_datasets, load_dataset
from trainscale.data.synthetic import synthetic_dataset
from trainscale.data.tensors import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageTensors,
)
from trainscale.data.unpickle import restricted_load, restricted_loads

__all__ = [
    "AugmentConfig",
    "Batches",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DATASETS",
    "DeviceBatches",
    "FORMATS",
    "FileSpec",
    "FolderBatches",
    "FormatSpec",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFolderDataset",
    "ImageTensors",
    "center_crop",
    "cutout",
    "download_dataset",
    "ensure_dataset",
    "find_cifar_folder",
    "list_datasets",
    "load_cifar",
    "load_dataset",
    "load_folder_as_tensors",
    "md5_file",
    "normalize",
    "random_crop",
    "random_flip",
    "resize",
    "resolve_data_dir",
    "restricted_load",
    "restricted_loads",
    "safe_extract",
    "synthetic_dataset",
    "verify_files",
]
