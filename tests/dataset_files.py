"""Small generated datasets in the exact layouts torchvision expects, with the class attributes naming them.

Each builder returns a :class:`DatasetFiles`: the files a loopback mirror serves, the class attributes
that point the class at them (``{mirror}`` is replaced by the mirror's URL, md5s are of these files),
constructor arguments, and the digests a correct load gives (as
:func:`download_harness.build` computes them).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import tarfile
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from download_harness import digests_of_items


@dataclass
class DatasetFiles:
    name: str
    files: dict[str, bytes]
    attrs: dict[str, Any]
    reference: dict[str, str]
    kwargs: dict[str, Any] = field(default_factory=dict)


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _tar_gz(members: dict[str, bytes]) -> bytes:
    """gzip's header gets mtime 0: the bytes (and md5) depend on the members only, never on the clock."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)


def _mat(arrays: dict[str, np.ndarray]) -> bytes:
    """A MAT-file whose bytes depend on ``arrays`` only. savemat writes the time of the call into its
    116-byte header text, so two builds a second apart had different md5s: a CI run failed when a test
    took a split's md5 from one build and its file from another."""
    import scipy.io

    buf = io.BytesIO()
    scipy.io.savemat(buf, arrays)
    data = bytearray(buf.getvalue())
    data[:116] = b"MATLAB 5.0 MAT-file, written by the nemo_safe tests".ljust(116)
    return bytes(data)


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def item_reference(items: list[tuple[np.ndarray, Any]]) -> dict[str, str]:
    """What :func:`download_harness.item_digests` gives for these (image pixels, target) items."""
    return digests_of_items(items)


def cifar10(images_per_batch: int = 500) -> DatasetFiles:
    """CIFAR10's tar.gz: cifar-10-batches-py/ with 5 train batches, a test batch and batches.meta."""
    rng = np.random.default_rng(0)
    members, train_list, test_list = {}, [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, images_per_batch).tolist(),
        }
        members[name] = pickle.dumps(batch)
        (test_list if name == "test_batch" else train_list).append([name, _md5(members[name])])
    members["batches.meta"] = pickle.dumps({"label_names": [f"c{i}" for i in range(10)]})
    archive = _tar_gz({f"cifar-10-batches-py/{name}": data for name, data in members.items()})
    attrs = {
        "url": "{mirror}cifar-10-python.tar.gz",
        "tgz_md5": _md5(archive),
        "train_list": train_list,
        "test_list": test_list,
        "meta": {"filename": "batches.meta", "key": "label_names", "md5": _md5(members["batches.meta"])},
    }
    data = np.vstack([pickle.loads(members[n])["data"] for n, _ in train_list]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([pickle.loads(members[n])["labels"] for n, _ in train_list]).astype(np.uint8)
    reference = {
        "data_sha": hashlib.sha256(np.ascontiguousarray(data.transpose((0, 2, 3, 1))).tobytes()).hexdigest(),
        "targets_sha": hashlib.sha256(labels.tobytes()).hexdigest(),
    }
    return DatasetFiles("CIFAR10", {"cifar-10-python.tar.gz": archive}, attrs, reference)


def svhn(images: int = 600, split: str = "train") -> DatasetFiles:
    """SVHN's ``.mat`` files of the train and test splits (scipy, which torchvision's SVHN needs anyway): X is
    32x32x3xN, y in 1..10; the test split has a quarter of the images. ``attrs`` name both; ``files``, ``reference``
    and ``kwargs`` are ``split``'s."""
    files, attrs, items = {}, {"split_list": {}}, {}
    for seed, (name, count) in enumerate((("train", images), ("test", max(1, images // 4))), start=1):
        rng = np.random.default_rng(seed)
        x = rng.integers(0, 256, (32, 32, 3, count), dtype=np.uint8)
        y = rng.integers(1, 11, (count, 1), dtype=np.uint8)
        mat = files[f"{name}_32x32.mat"] = _mat({"X": x, "y": y})
        attrs["split_list"][name] = [f"{{mirror}}{name}_32x32.mat", f"{name}_32x32.mat", _md5(mat)]
        items[name] = [(x[:, :, :, i], int(y[i, 0]) % 10) for i in range(count)]
    mine = {name: data for name, data in files.items() if name.startswith(split)}  # the other split's is not asked for
    return DatasetFiles("SVHN", mine, attrs, item_reference(items[split]), {"split": split})


def omniglot(images: int = 100) -> DatasetFiles:
    """Omniglot's images_background.zip: images_background/<alphabet>/<character>/<n>.png (one character,
    so that the class index does not depend on the order a directory lists in)."""
    rng = np.random.default_rng(2)
    pixels = [rng.integers(0, 256, (105, 105), dtype=np.uint8) for _ in range(images)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, p in enumerate(pixels):
            name = f"images_background/Alphabet_of_Tests/character01/{i:04d}_01.png"
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # no clock in the bytes
            info.external_attr = 0o600 << 16  # what writestr(name, ...) gives
            zf.writestr(info, _png(p))
    archive = buf.getvalue()
    # Omniglot requests prefix + "/" + name: "<mirror>/" + "/images_background.zip", which the mirror serves.
    attrs = {"download_url_prefix": "{mirror}", "zips_md5": {"images_background": _md5(archive)}}
    items = [(p, 0) for p in pixels]
    return DatasetFiles("Omniglot", {"images_background.zip": archive}, attrs, item_reference(items))


def oxford_pet(images: int = 100) -> DatasetFiles:
    """OxfordIIITPet's two archives (two downloads into one folder): images.tar.gz with images/<id>.jpg
    (PNG data: PIL reads by content, so the pixels are exact) and annotations.tar.gz with trainval.txt."""
    rng = np.random.default_rng(3)
    breeds = ["Abyssinian", "basset_hound", "Bengal"]
    ids, pixels, labels = [], [], []
    for i in range(images):
        label = i % len(breeds)
        ids.append(f"{breeds[label]}_{i}")
        pixels.append(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
        labels.append(label)
    image_tar = _tar_gz({f"images/{name}.jpg": _png(p) for name, p in zip(ids, pixels, strict=True)})
    lines = "".join(f"{name} {label + 1} {1 + (label != 0)} 1\n" for name, label in zip(ids, labels, strict=True))
    ann_tar = _tar_gz({"annotations/trainval.txt": lines.encode(), "annotations/test.txt": b""})
    attrs = {
        "_RESOURCES": [
            ["{mirror}images.tar.gz", _md5(image_tar)],
            ["{mirror}annotations.tar.gz", _md5(ann_tar)],
        ]
    }
    items = list(zip(pixels, labels, strict=True))
    files = {"images.tar.gz": image_tar, "annotations.tar.gz": ann_tar}
    return DatasetFiles("OxfordIIITPet", files, attrs, item_reference(items), {"split": "trainval"})


BUILDERS = {"CIFAR10": cifar10, "SVHN": svhn, "Omniglot": omniglot, "OxfordIIITPet": oxford_pet}
