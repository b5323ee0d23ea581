"""A corpus's array_record records read back without tensorflow-datasets (which costs a query ~0.3 s to import).

tfds writes each record set (`cfir_jax.data.corpus_writer`) as `<version_dir>/{dataset_info,features}.json` and shards
of serialized `tf.train.Example` protos. This module reads them with array_record's own reader and decodes the few
feature kinds a corpus uses, as tfds' `as_data_source()` returns them:

    Text, Tensor(dtype=string, shape=())    -> bytes
    Sequence(Text)                          -> list of bytes
    Tensor(dtype=float32/int64, shape=(D,)) -> numpy array of that dtype and shape

A record set holding any other feature kind is refused ("rebuild"): corpus_writer makes no other. The tf.train.Example
wire format (Example{features=1}, Features{map<string, Feature> feature=1}, Feature{bytes_list=1 | float_list=2 |
int64_list=3}, each list {repeated value=1}, numbers packed or not) is parsed by hand: protobuf's own import would cost
about as much as tfds saves. tests/unit/test_records.py checks every row of a written corpus against tfds' own parse.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

# tfds' shard names: {DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}.
_SHARD = "{name}-{split}.array_record-{i:05d}-of-{n:05d}"
_TEXT = "tensorflow_datasets.core.features.text_feature.Text"
_TENSOR = "tensorflow_datasets.core.features.tensor_feature.Tensor"
_SEQUENCE = "tensorflow_datasets.core.features.sequence_feature.Sequence"


class RecordError(ValueError):
    """A record set this reader cannot read (the caller says "rebuild the corpus")."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of a message's fields; a length-delimited value is a (start, end) span."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = (pos, pos + n), pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise RecordError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value
    if pos != end:
        raise RecordError("truncated record")


def _feature(buf: bytes, start: int, end: int) -> tuple[str, list]:
    """One tf.train.Feature: ('bytes' | 'float' | 'int64', its values)."""
    for kind, wire, (s, e) in _fields(buf, start, end):
        if wire != 2 or kind not in (1, 2, 3):
            raise RecordError(f"unexpected Feature field {kind}")
        values: list = []
        for number, vwire, value in _fields(buf, s, e):
            if number != 1:
                continue
            if kind == 1:
                values.append(buf[value[0]:value[1]])
            elif kind == 2:
                values.extend(struct.unpack_from(f"<{(value[1] - value[0]) // 4}f", buf, value[0])
                              if vwire == 2 else struct.unpack("<f", value))
            elif vwire == 2:  # packed varints
                p = value[0]
                while p < value[1]:
                    v, p = _varint(buf, p)
                    values.append(v - (1 << 64) if v >= 1 << 63 else v)
            else:
                values.append(value - (1 << 64) if value >= 1 << 63 else value)
        return ("bytes", "float", "int64")[kind - 1], values
    return "none", []


def parse_example(buf: bytes) -> dict[str, tuple[str, list]]:
    """A serialized tf.train.Example: {feature name: (kind, values)}; RecordError when it is damaged."""
    try:
        return _parse_example(buf)
    except (IndexError, struct.error, UnicodeDecodeError, TypeError):
        raise RecordError("truncated record") from None


def _parse_example(buf: bytes) -> dict[str, tuple[str, list]]:
    out: dict[str, tuple[str, list]] = {}
    for number, wire, (s, e) in _fields(buf):
        if number != 1 or wire != 2:
            continue
        for entry, ewire, (es, ee) in _fields(buf, s, e):  # Features.feature, a map: entries {key=1, value=2}
            if entry != 1 or ewire != 2:
                continue
            key, span = "", None
            for k, _, v in _fields(buf, es, ee):
                if k == 1:
                    key = buf[v[0]:v[1]].decode("utf-8")
                elif k == 2:
                    span = v
            out[key] = _feature(buf, *span) if span else ("none", [])
    return out


def _decoder(name: str, spec: dict):
    """The function turning a feature's (kind, values) into what tfds' data source gives for `spec`."""
    cls = spec.get("pythonClassName")
    if cls == _TEXT or (cls == _TENSOR and spec["tensor"]["dtype"] == "string" and not spec["tensor"].get(
            "shape", {}).get("dimensions")):
        def text(kind_values):
            values = kind_values[1]
            if len(values) != 1:
                raise RecordError(f"feature {name!r}: {len(values)} values for a scalar")
            return values[0]
        return text
    if cls == _SEQUENCE and spec["sequence"]["feature"].get("pythonClassName") == _TEXT:
        def texts(kind_values):
            return list(kind_values[1])
        return texts
    if cls == _TENSOR and spec["tensor"]["dtype"] in ("float32", "int64"):
        dtype = np.dtype(spec["tensor"]["dtype"])
        shape = tuple(int(d) for d in spec["tensor"].get("shape", {}).get("dimensions", []))
        if any(d < 0 for d in shape):
            raise RecordError(f"feature {name!r}: unknown dimensions {shape}")

        def tensor(kind_values):
            arr = np.asarray(kind_values[1], dtype=dtype)
            return arr.reshape(shape) if shape else arr.reshape(())[()]
        return tensor
    raise RecordError(f"feature {name!r}: unsupported kind {cls}")


class RecordSource:
    """Random access by row over one record set's shards: `len`, `[i]` (a dict like tfds' data source gives).

    Picklable (the training input pipeline's workers get one): the shard readers open lazily in each process."""

    def __init__(self, version_dir: str | os.PathLike, split: str):
        version_dir = Path(version_dir)
        try:
            info = json.loads((version_dir / "dataset_info.json").read_text(encoding="utf-8"))
            features = json.loads((version_dir / "features.json").read_text(encoding="utf-8"))
            (entry,) = [s for s in info["splits"] if s["name"] == split]
            lengths = [int(n) for n in entry["shardLengths"]]
            specs = features["featuresDict"]["features"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RecordError(f"unreadable dataset_info.json/features.json ({e.__class__.__name__})") from None
        if info.get("fileFormat") != "array_record":
            raise RecordError(f"file format {info.get('fileFormat')!r}, not array_record")
        self.version_dir, self.split, self.lengths = version_dir, split, lengths
        self.paths = [os.fspath(version_dir / _SHARD.format(name=info["name"], split=split, i=i, n=len(lengths)))
                      for i in range(len(lengths))]
        missing = [p for p in self.paths if not os.path.isfile(p)]
        if missing:
            raise RecordError(f"missing shard {missing[0]}")
        self.specs = specs
        self.starts = np.cumsum([0] + lengths)
        self._readers: list[Any] | None = None
        self._decoders = {name: _decoder(name, spec) for name, spec in specs.items()}

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_decoders")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._readers = None
        self._decoders = {name: _decoder(name, spec) for name, spec in self.specs.items()}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _reader(self, k: int):
        if self._readers is None:
            self._readers = [None] * len(self.paths)
        if self._readers[k] is None:
            self._readers[k] = ArrayRecordReader(self.paths[k], "readahead_buffer_size:0")
        return self._readers[k]

    def raw(self, i: int) -> bytes:
        """The serialized record of row `i`."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self._reader(k).read([i - int(self.starts[k])])[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        parsed = parse_example(self.raw(i))
        return {name: decode(parsed.get(name, ("none", []))) for name, decode in self._decoders.items()}
