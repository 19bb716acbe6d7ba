#!/usr/bin/env python3
"""Converts scikit-learn's copy of the UCI digits (digits.csv.gz: 1,797 rows of 64 pixels
0..16 and a label) into the safetensors file the example trainers read:

    images  f32 [1797, 64]   pixel counts 0..16, as in the source
    labels  i64 [1797]       0..9

    python3 examples/data/make_digits.py path/to/digits.csv.gz examples/data/digits.safetensors

Debian's python3-sklearn ships the source at
/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz (also in any scikit-learn
wheel). Needs numpy and safetensors; the trainers never need Python.
"""
import gzip
import sys

import numpy as np
from safetensors.numpy import save_file

source, target = sys.argv[1], sys.argv[2]
rows = np.loadtxt(gzip.open(source, "rt"), delimiter=",", dtype=np.float64)
assert rows.shape == (1797, 65), rows.shape
images = rows[:, :64].astype(np.float32)
labels = rows[:, 64].astype(np.int64)
save_file({"images": images, "labels": labels}, target,
          metadata={"source": "UCI ML optical recognition of handwritten digits (test set copy in scikit-learn)",
                    "license": "CC BY 4.0"})
print(f"{target}: images {images.shape}, labels {labels.shape}, classes {np.bincount(labels).tolist()}")
