#!/usr/bin/env python3
"""Reads the event file tests/summary/write_summary.cpp wrote: first with a
TFRecord, CRC-32C and protobuf reader of its own (always), then, where the
tensorboard package is installed, with TensorBoard's readers, and checks
every value against what TensorFlow would have written.

    check_tensorboard.py WRITE_SUMMARY_BINARY WORK_DIR
"""
import bisect
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time

writer, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
path = subprocess.run([writer, work], check=True, capture_output=True, text=True).stdout.strip()
assert os.listdir(work) == [os.path.basename(path)], (os.listdir(work), path)
assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+", os.path.basename(path)), path

# --- TFRecord framing and CRC-32C, from the spec ------------------------------
CRC_TABLE = []
for n in range(256):
    c = n
    for _ in range(8):
        c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    CRC_TABLE.append(c)


def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c = CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked(c):
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def records(file):
    data = open(file, "rb").read()
    out, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= 16, f"truncated record at byte {pos}"
        (length,) = struct.unpack_from("<Q", data, pos)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        assert length_crc == masked(crc32c(data[pos:pos + 8])), f"length CRC at byte {pos}"
        assert pos + 16 + length <= len(data), f"truncated record at byte {pos}"
        payload = data[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, pos + 12 + length)
        assert data_crc == masked(crc32c(payload)), f"data CRC at byte {pos}"
        out.append(payload)
        pos += 16 + length
    return out


# --- protobuf, the few fields TensorBoard's Event uses -----------------------
def fields(buf):
    """(field number, wire type, value) of every field of a message."""
    pos = 0

    def varint():
        nonlocal pos
        v = shift = 0
        while True:
            b = buf[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    while pos < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, wire, varint()
        elif wire == 1:
            yield field, wire, buf[pos:pos + 8]
            pos += 8
        elif wire == 5:
            yield field, wire, buf[pos:pos + 4]
            pos += 4
        else:
            assert wire == 2, wire
            n = varint()
            yield field, wire, buf[pos:pos + n]
            pos += n


def f64(b):
    return struct.unpack("<d", b)[0]


def decode_event(buf):
    event = {"wall_time": 0.0, "step": 0, "values": []}
    for f, w, v in fields(buf):
        if f == 1:
            event["wall_time"] = f64(v)
        elif f == 2:
            event["step"] = v - (1 << 64) if v >= 1 << 63 else v
        elif f == 3:
            event["file_version"] = v.decode()
        elif f == 5:
            for _, _, value in fields(v):
                event["values"].append(decode_value(value))
    return event


def decode_value(buf):
    value = {}
    for f, w, v in fields(buf):
        if f == 1:
            value["tag"] = v.decode()
        elif f == 2:
            value["scalar"] = struct.unpack("<f", v)[0]
        elif f == 5:
            h = {"bucket_limit": [], "bucket": []}
            for hf, hw, hv in fields(v):
                if hf <= 5:
                    h[["min", "max", "num", "sum", "sum_squares"][hf - 1]] = f64(hv)
                else:
                    key = "bucket_limit" if hf == 6 else "bucket"
                    h[key] += [f64(hv[i:i + 8]) for i in range(0, len(hv), 8)]
            value["histo"] = h
        elif f == 8:
            tensor = {tf: tv for tf, _, tv in fields(v)}
            value["dtype"], value["text"] = tensor[1], tensor[8].decode()
        elif f == 9:
            metadata = {mf: mv for mf, _, mv in fields(v)}
            plugin = {pf: pv for pf, _, pv in fields(metadata[1])}
            value["plugin_name"] = plugin[1].decode()
    return value


# --- what write_summary.cpp logged, and what TensorFlow makes of it ---------
def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


LOSS = {step: f32(1.0 / f32(step + 1)) for step in range(10)}
WEIGHTS = [f32(f32(i - 500) * f32(0.01)) for i in range(1000)] + [f32(1e25), f32(-3.0e38)]  # the NaN left out
TEXT = "psx **summary** check: ünïcödé"


def tf_bucket_limits():
    """tensorflow/core/lib/histogram/histogram.cc, InitDefaultBucketsInner."""
    pos, v = [], 1.0e-12
    while v < 1.0e20:
        pos.append(v)
        v *= 1.1
    pos.append(sys.float_info.max)
    return [-x for x in reversed(pos)] + [0.0] + pos


def tf_histogram(values):
    """Histogram::Add for each value, then EncodeToProto(proto, false)."""
    limits = tf_bucket_limits()
    counts = [0.0] * len(limits)
    h = {"min": sys.float_info.max, "max": -sys.float_info.max, "num": 0.0, "sum": 0.0, "sum_squares": 0.0}
    for v in values:
        counts[bisect.bisect_right(limits, v)] += 1.0
        h["min"], h["max"] = min(h["min"], v), max(h["max"], v)
        h["num"] += 1.0
        h["sum"] += v
        h["sum_squares"] += v * v
    h["bucket_limit"], h["bucket"] = [], []
    i = 0
    while i < len(counts):
        end, count = limits[i], counts[i]
        i += 1
        if count <= 0.0:
            while i < len(counts) and counts[i] <= 0.0:
                end, count = limits[i], counts[i]
                i += 1
        h["bucket_limit"].append(end)
        h["bucket"].append(count)
    return h


HISTO = tf_histogram(WEIGHTS)
assert len(tf_bucket_limits()) == 1551 and sum(HISTO["bucket"]) == 1002


raw = records(path)
events = [decode_event(r) for r in raw]
assert len(events) == 1 + 10 + 1 + 1 + 2, len(events)
now = time.time()
assert events[0]["file_version"] == "brain.Event:2" and events[0]["values"] == [], events[0]
assert all(now - 3600 < e["wall_time"] <= now + 1 for e in events), [e["wall_time"] for e in events]
for step in range(10):
    e = events[1 + step]
    assert e["step"] == step and e["values"] == [{"tag": "loss", "scalar": LOSS[step]}], e
assert events[11]["step"] == 9 and events[11]["values"] == [{"tag": "weights", "histo": HISTO}], events[11]
assert events[12]["values"] == [{"tag": "notes", "dtype": 7, "text": TEXT, "plugin_name": "text"}], events[12]
assert events[13]["step"] == 10 and math.isnan(events[13]["values"][0]["scalar"])
assert events[14]["step"] == 11 and events[14]["values"][0]["scalar"] == -math.inf
print(f"tfrecord+crc32c: {len(raw)} records, every CRC matches, every value as TensorFlow writes it "
      f"({len(HISTO['bucket'])} histogram buckets)")

try:
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util
except ImportError as e:
    print(f"tensorboard: the package is not installed here ({e}); its check is skipped")
    print("check_tensorboard: all checks passed")
    sys.exit(0)

# TensorBoard's own record reader (its CRC checks), and protobuf's parser:
# re-serialized, every record is the same bytes (psx writes canonical protobuf).
tb_raw = list(event_file_loader.RawEventFileLoader(path).Load())
assert tb_raw == raw, "TensorBoard's record reader disagrees"
for r in raw:
    assert event_pb2.Event.FromString(r).SerializeToString(deterministic=True) == r, event_pb2.Event.FromString(r)

# The protos as parsed.
parsed = list(event_file_loader.LegacyEventFileLoader(path).Load())
assert parsed[0].file_version == "brain.Event:2"
assert [(e.step, e.summary.value[0].simple_value) for e in parsed[1:11]] == sorted(LOSS.items())
histo = parsed[11].summary.value[0].histo
assert list(histo.bucket) == HISTO["bucket"] and list(histo.bucket_limit) == HISTO["bucket_limit"]
assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == tuple(
    HISTO[k] for k in ("min", "max", "num", "sum", "sum_squares"))

# What TensorBoard's plugins see: events through its compat layers (scalars
# and histograms become tensors), then the EventAccumulator.
migrated = list(event_file_loader.EventFileLoader(path).Load())
by_tag = {}
for e in migrated:
    for v in e.summary.value:
        by_tag.setdefault(v.tag, []).append((e.step, v))
assert [(s, float(tensor_util.make_ndarray(v.tensor))) for s, v in by_tag["loss"]] == sorted(LOSS.items())
assert by_tag["loss"][0][1].metadata.plugin_data.plugin_name == "scalars"
(_, hv), = by_tag["weights"]
# Rows of float32 [left edge, right edge, count]: the empty buckets at either
# end dropped, min and max for the outer edges, the limits between.
buckets = tensor_util.make_ndarray(hv.tensor).tolist()
nonzero = [i for i, c in enumerate(HISTO["bucket"]) if c > 0]
first, last = nonzero[0], nonzero[-1]
edges = [f32(x) for x in [HISTO["min"]] + HISTO["bucket_limit"][first:last] + [HISTO["max"]]]
assert hv.metadata.plugin_data.plugin_name == "histograms"
assert buckets == [[edges[i], edges[i + 1], c] for i, c in enumerate(HISTO["bucket"][first:last + 1])], buckets

acc = event_accumulator.EventAccumulator(work, size_guidance={event_accumulator.SCALARS: 0,
                                                              event_accumulator.HISTOGRAMS: 0,
                                                              event_accumulator.TENSORS: 0})
acc.Reload()
assert [(s.step, s.value) for s in acc.Scalars("loss")] == sorted(LOSS.items())
nonfinite = [s.value for s in acc.Scalars("nonfinite")]
assert len(nonfinite) == 2 and math.isnan(nonfinite[0]) and nonfinite[1] == -math.inf, nonfinite
(h,) = acc.Histograms("weights")
assert h.step == 9 and list(h.histogram_value.bucket) == HISTO["bucket"] and h.histogram_value.num == 1002
(t,) = acc.Tensors("notes")
assert t.step == 9 and tensor_util.make_ndarray(t.tensor_proto).item().decode() == TEXT
assert "notes" in acc.PluginTagToContent("text")
print(f"tensorboard: {len(tb_raw)} records read; 10 scalars, the NaN and -inf, {len(HISTO['bucket'])} histogram "
      f"buckets and the text match; every record re-serializes to the same bytes")
print("check_tensorboard: all checks passed")
