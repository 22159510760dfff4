"""The HDF5 checkpoint store (one collection per file) and the readers of its exchange
formats (safetensors files, release archives, key maps). Verifying, importing and
exporting collections is the collection layer's (:mod:`posteriorzoo.collection`).

>>> from posteriorzoo.zoo import create_zoo, open_zoo
>>> with create_zoo("zoo.h5", architecture="optunet", dataset="fashion-mnist",
...                 method="de", num_classes=10, template=model.state_dict()) as zoo:
...     zoo.append(model.state_dict(), seed=0, test_accuracy=0.81)
>>> with open_zoo("zoo.h5") as zoo:
...     conv2 = zoo.layer("conv2.weight")        # (N, 10, 1, 5, 5)
...     model.load_state_dict(zoo.state_dict(0))
>>> reorder_collection("old.h5", "ordered.h5")   # rows in mode order, digests kept
>>> annotate_collection("svgd.h5", "svgd-mm.h5", posterior="multi-mode",
...                     reason="loss barriers: 87 of 100 particles in distinct modes")
"""

from posteriorzoo.zoo.annotate import AnnotateResult, annotate_collection
from posteriorzoo.zoo.archives import read_release_archive
from posteriorzoo.zoo.formats import ReadLimits, read_checkpoint, sniff_format
from posteriorzoo.zoo.keymap import KeyMap
from posteriorzoo.zoo.lifecycle import create_zoo, open_zoo, upgrade_zoo
from posteriorzoo.zoo.manifest import MANIFEST_NAME, sha256_file, verify_manifest, write_manifest
from posteriorzoo.zoo.reorder import ReorderResult, RowOrder, reorder_collection, row_order
from posteriorzoo.zoo.schema import METADATA_COLUMNS, checkpoint_digest, recipe_hash
from posteriorzoo.zoo.store import Zoo, iter_checkpoints

__all__ = [
    "MANIFEST_NAME",
    "METADATA_COLUMNS",
    "AnnotateResult",
    "KeyMap",
    "ReadLimits",
    "ReorderResult",
    "RowOrder",
    "Zoo",
    "annotate_collection",
    "checkpoint_digest",
    "create_zoo",
    "iter_checkpoints",
    "open_zoo",
    "read_checkpoint",
    "read_release_archive",
    "recipe_hash",
    "reorder_collection",
    "row_order",
    "sha256_file",
    "sniff_format",
    "upgrade_zoo",
    "verify_manifest",
    "write_manifest",
]
