"""Reads what W&B stored offline: the records of a run-ID.wandb file (LevelDB's log format holding W&B's protobuf
Record messages), as (config, history rows, summary), with no network and no W&B server."""

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7  # LevelDB log: 32 KiB blocks; each chunk has crc32 (4), length (2), type (1)
FULL, LAST = 1, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])  # W&B's own file header
    assert ident == b":W&B", f"{path}: not a W&B run file"
    position, chunks = 7, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        if kind == 0 and length == 0:
            position += left
            continue
        chunks += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: Path) -> tuple[dict, list[dict], dict]:
    """(config, history rows without W&B's own _keys, summary) of one offline run file."""
    config, history, summary = {}, [], {}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "summary":
            summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    return config, history, summary
