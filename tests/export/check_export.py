#!/usr/bin/env python3
"""Reads the exports tests/export/write_export.cpp wrote, with numpy and,
where it is installed, the safetensors package, and checks every value.

    check_export.py WRITE_EXPORT_BINARY WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np

writer, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
subprocess.run([writer, work], check=True)


TABLE_IDS = np.array([7, 42, 1000, (1 << 63) + 5], dtype=np.uint64)  # as exported: ascending


def expected(name):
    if name == "table":  # the row of id k: (k % 97) * 0.25 + j * 0.5 - 1
        k = (TABLE_IDS % np.uint64(97)).astype(np.float32)[:, None]
        j = np.arange(3, dtype=np.float32)[None, :]
        return (k * np.float32(0.25) + j * np.float32(0.5) - np.float32(1.0)).astype(np.float32)
    n = {"dense/kernel": 12, "bias": 4, "pruned": 40}[name]
    shape = {"dense/kernel": (3, 4), "bias": (4,), "pruned": (8, 5)}[name]
    i = np.arange(n, dtype=np.float32)
    if name == "dense/kernel":
        v = i * np.float32(0.37) - np.float32(2.1)
    elif name == "bias":
        v = i * np.float32(0.5) - np.float32(1.0)
    else:
        v = np.where(np.arange(n) % 4 == 0, i * np.float32(0.1) + np.float32(0.05), np.float32(0))
    return v.astype(np.float32).reshape(shape)


def bf16_bits(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def int8(x, per_channel):
    x = x.astype(np.float32)
    groups = x.reshape(x.shape[0], -1) if per_channel else x.reshape(1, -1)
    scale = (np.abs(groups).max(axis=1) / np.float32(127)).astype(np.float32)
    scale[scale == 0] = 1
    q = np.clip(np.rint(groups / scale[:, None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), scale


def stored(name, version):
    """What version `version` stores for `name`: (array as numpy reads it, scales or None)."""
    x = expected(name)
    if name == "bias" or version == 1:
        return x, None
    if version == 2:
        return x.astype(np.float16), None
    if version == 3:
        return bf16_bits(x), None
    return int8(x, version == 5 and x.ndim >= 2)


def dense_from(arrays, name):
    """The tensor `name` from a dict of arrays, rebuilt when stored sparsely."""
    if name in arrays:
        return arrays[name]
    shape = tuple(int(s) for s in arrays[name + ".shape"])
    out = np.zeros(int(np.prod(shape)), dtype=arrays[name + ".values"].dtype)
    out[arrays[name + ".indices"].astype(np.int64)] = arrays[name + ".values"]
    return out.reshape(shape)


checked = 0
for version in range(1, 6):
    d = os.path.join(work, str(version))
    meta = json.load(open(os.path.join(d, "metadata.json")))["psx_export"]
    assert meta["version"] == version and meta["step"] == 1, meta
    assert meta["signature"]["inputs"][0]["name"] == "x"
    npz = np.load(os.path.join(d, "model.npz"))
    arrays = {k: npz[k] for k in npz.files}
    assert meta["format_version"] == 2, meta  # it holds a table
    for name in ("dense/kernel", "bias", "pruned", "table"):
        want, scales = stored(name, version)
        got = dense_from(arrays, name)
        assert got.dtype == want.dtype and got.shape == want.shape, (version, name, got.dtype, got.shape)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (version, name, got, want)
        if scales is not None:
            assert np.array_equal(arrays[name + ".scale"], scales), (version, name)
        checked += 1
    assert "pruned.indices" in arrays and len(arrays["pruned.indices"]) == 10, version  # 40 values, 30 zeros
    assert "dense/kernel" in arrays  # dense tensors are stored whole
    ids = arrays["table.ids"]
    assert ids.dtype == np.uint64 and np.array_equal(ids, TABLE_IDS), (version, ids)

print(f"numpy.load: {checked} tensors of 5 exports match, bit for bit, the table's ids too")

try:
    from safetensors import safe_open
except ImportError:
    print("safetensors: the package is not installed here; its check is skipped")
    sys.exit(0)

checked = 0
for version in range(1, 6):
    path = os.path.join(work, str(version), "model.safetensors")
    arrays = {}
    with safe_open(path, framework="np") as f:
        meta = json.loads(f.metadata()["psx"])["psx_export"]
        assert meta["version"] == version
        bf16 = []
        for k in f.keys():
            try:
                arrays[k] = f.get_tensor(k)
            except (TypeError, ValueError, KeyError):  # numpy has no bfloat16
                bf16.append(k)
    if bf16:
        try:
            import torch
        except ImportError:
            print(f"safetensors: version {version}: bfloat16 needs torch, which is not installed; skipped")
            continue
        with safe_open(path, framework="pt") as f:
            for k in bf16:
                arrays[k] = f.get_tensor(k).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(arrays["table.ids"], TABLE_IDS), version
    for name in ("dense/kernel", "bias", "pruned", "table"):
        want, scales = stored(name, version)
        got = dense_from(arrays, name)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (version, name)
        if scales is not None:
            assert np.array_equal(arrays[name + ".scale"], scales)
        checked += 1
print(f"safetensors: {checked} tensors match, bit for bit")
