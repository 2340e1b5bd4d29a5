"""Trajectories on disk: append-only ArrayRecord shards in a run directory, one record per trajectory.

Why ArrayRecord: grain reads it natively (`grain.sources.ArrayRecordDataSource`) with random access, so
replay buffers, analysis scripts and SFT pipelines read the same files the trainer wrote.

Why a temp name + rename: `append` writes a whole shard under a hidden temp name, fsyncs it and renames it to
its real name (atomic on POSIX). A crash mid-write leaves at most a hidden `.*.tmp` file, which readers never
list, and never a truncated shard under a real name.

Record format (no pickle, so files stay readable across code versions): msgpack of plain values, tagged
{"format": "guijax.trajectory", "version": 1, "trajectory": {...}}; numpy arrays as msgpack ext type 1
(dtype, shape, raw bytes), tuples as ext type 2, screenshots as ext type 3 (PNG bytes, lossless).
"""
from __future__ import annotations

import bisect
import dataclasses
import io
import os
import pathlib
import uuid
from typing import Any, Iterator, Sequence

import msgpack
import numpy as np
from PIL import Image

from guijax.rollout.trajectory import Source, Status, Step, Trajectory

FORMAT = "guijax.trajectory"
VERSION = 1
SUFFIX = ".array_record"
_EXT_ARRAY, _EXT_TUPLE, _EXT_PNG = 1, 2, 3
# One record per chunk: random access reads exactly one trajectory, not a group of them.
_WRITER_OPTIONS = "group_size:1"
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(Step))
_TRAJECTORY_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory))


class StoreError(ValueError):
    """A record or shard that cannot be read or written (names the file / record / task)."""


@dataclasses.dataclass(frozen=True)
class _Png:
    """Marks an image to be stored as PNG (only screenshots; other arrays keep their exact bytes)."""

    array: np.ndarray


# ---------------------------------------------------------------------------------------------- encoding
def _default(obj: Any) -> Any:
    if isinstance(obj, _Png):
        buf = io.BytesIO()
        Image.fromarray(obj.array).save(buf, format="PNG", compress_level=1)
        return msgpack.ExtType(_EXT_PNG, buf.getvalue())
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"cannot store numpy arrays of dtype object (shape {obj.shape})")
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_EXT_ARRAY, _pack([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, (Status, Source)):
        return obj.value
    if isinstance(obj, str):  # other str subclasses (e.g. other str enums)
        return str(obj)
    raise TypeError(f"cannot store a value of type {type(obj).__name__}: {obj!r:.80}")


def _pack(obj: Any) -> bytes:
    # strict_types: tuples and str/int subclasses reach `_default` instead of being silently coerced.
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _ext_hook(decode_images: bool):
    def hook(code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            dtype, shape, raw = _unpack(data, decode_images)
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        if code == _EXT_TUPLE:
            return tuple(_unpack(data, decode_images))
        if code == _EXT_PNG:
            return np.asarray(Image.open(io.BytesIO(data))) if decode_images else None
        return msgpack.ExtType(code, data)

    return hook


def _unpack(data: bytes, decode_images: bool = True) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook(decode_images), raw=False, strict_map_key=False)


def _check_screenshot(traj: Trajectory, index: int, image: Any) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (3, 4))):
        raise StoreError(f"task {traj.task_id} step {index}: screenshot must be uint8 [H, W] or [H, W, 3|4], "
                         f"got {image.dtype} {image.shape}")
    return image


def encode_trajectory(traj: Trajectory) -> bytes:
    """One record: every field of the Trajectory and its Steps (the field lists come from the dataclasses,
    so a field added to them is stored too; decoding checks the names)."""
    steps = []
    for i, step in enumerate(traj.steps):
        fields = {name: getattr(step, name) for name in _STEP_FIELDS}
        fields["screenshot"] = _Png(_check_screenshot(traj, i, step.screenshot))
        fields["response_tokens"] = np.asarray(step.response_tokens)
        fields["behaviour_logprobs"] = np.asarray(step.behaviour_logprobs)
        fields["actions"] = list(step.actions)
        steps.append(fields)
    body = {name: getattr(traj, name) for name in _TRAJECTORY_FIELDS}
    body.update(steps=steps, status=Status(traj.status).value, source=Source(traj.source).value,
                plan=tuple(traj.plan), reward=float(traj.reward))
    try:
        return _pack({"format": FORMAT, "version": VERSION, "trajectory": body})
    except TypeError as e:
        raise StoreError(f"task {traj.task_id}: {e}") from None


def decode_trajectory(record: bytes, *, where: str = "record") -> Trajectory:
    """Inverse of encode_trajectory; `where` names the shard and record index in errors."""
    try:
        data = _unpack(record)
    except Exception as e:  # truncated / foreign bytes
        raise StoreError(f"{where}: not a msgpack trajectory record ({e})") from None
    _check_header(data, where)
    body = dict(data["trajectory"])
    unknown = set(body) - set(_TRAJECTORY_FIELDS) - {"steps"}
    if unknown:
        raise StoreError(f"{where}: unknown trajectory fields {sorted(unknown)} (written by newer code?)")
    steps = []
    for i, s in enumerate(body.pop("steps")):
        extra = set(s) - set(_STEP_FIELDS)
        if extra:
            raise StoreError(f"{where}: step {i} has unknown fields {sorted(extra)}")
        steps.append(Step(**s))
    body["status"], body["source"] = Status(body["status"]), Source(body["source"])
    body["plan"] = tuple(body["plan"])
    return Trajectory(steps=steps, **body)


def _check_header(data: Any, where: str) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StoreError(f"{where}: not a {FORMAT} record")
    if data.get("version") != VERSION:
        raise StoreError(f"{where}: record version {data.get('version')} is not supported (this code reads {VERSION})")


def _summary(record: bytes, where: str) -> tuple[str, int]:
    """(task_id, number of steps) without decoding screenshots: cheap enough to index a whole store."""
    data = _unpack(record, decode_images=False)
    _check_header(data, where)
    return data["trajectory"]["task_id"], len(data["trajectory"]["steps"])


# ---------------------------------------------------------------------------------------------- the store
class TrajectoryStore:
    """A directory of immutable ArrayRecord shards; random access across them in (shard name, record) order.

    Picklable (it holds only the directory and caches), so grain worker processes can read from it.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._readers: dict[pathlib.Path, Any] = {}
        self._summaries: dict[pathlib.Path, list[tuple[str, int]]] = {}  # shards never change once renamed
        self._shards: list[pathlib.Path] = []
        self._offsets: list[int] = [0]
        self.refresh()

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "_summaries": self._summaries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _readers={}, _shards=[], _offsets=[0])
        self.refresh()

    # ------------------------------------------------------------------ writing
    def append(self, trajectories: Sequence[Trajectory], *, name: str | None = None) -> pathlib.Path:
        """Write one new shard holding `trajectories`; returns its path. All or nothing: the shard appears
        under its real name only after every record is written and flushed to disk."""
        from array_record.python.array_record_module import ArrayRecordWriter

        path = self.directory / ((name or f"shard-{self._next_index():06d}") + SUFFIX)
        if path.exists():
            raise StoreError(f"shard {path} already exists; shards are immutable")
        tmp = self.directory / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        writer = ArrayRecordWriter(str(tmp), _WRITER_OPTIONS)
        try:
            for traj in trajectories:
                writer.write(encode_trajectory(traj))
            writer.close()
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if writer.is_open():
                writer.close()
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self.refresh()
        return path

    def _next_index(self) -> int:
        taken = [int(p.stem.split("-")[1]) for p in self._list_shards()
                 if p.stem.startswith("shard-") and p.stem[6:].isdigit()]
        return max(taken, default=-1) + 1

    # ------------------------------------------------------------------ reading
    def _list_shards(self) -> list[pathlib.Path]:
        return sorted(p for p in self.directory.glob("*" + SUFFIX) if not p.name.startswith("."))

    def refresh(self) -> None:
        """Pick up shards written since (e.g. by another process)."""
        self._shards = self._list_shards()
        self._offsets = [0]
        for p in self._shards:
            self._offsets.append(self._offsets[-1] + self._reader(p).num_records())

    def _reader(self, path: pathlib.Path):
        from array_record.python.array_record_module import ArrayRecordReader

        if path not in self._readers:
            try:
                reader = ArrayRecordReader(str(path), "readahead_buffer_size:0")
            except Exception as e:  # the C++ reader raises on some corruptions, and reports others through ok()
                raise StoreError(f"trajectory shard {path} cannot be opened ({e})") from e
            if not reader.ok():  # a truncated or overwritten shard reads as 0 records otherwise
                raise StoreError(f"trajectory shard {path} is truncated or corrupted; every record after it would "
                                 "move to another index, so the store refuses to read. Move the shard away (its "
                                 "trajectories are lost) or restore it from a copy")
            self._readers[path] = reader
        return self._readers[path]

    def _read(self, path: pathlib.Path, records: Sequence[int] | None = None) -> list[bytes]:
        """The raw records (all when `records` is None); a chunk whose checksum fails (a flipped bit) is a
        StoreError naming the shard, not the reader's bare RuntimeError."""
        reader = self._reader(path)
        try:
            return reader.read_all() if records is None else reader.read(list(records))
        except RuntimeError as e:
            raise StoreError(f"trajectory shard {path} is corrupted ({e}); move it away (its trajectories are "
                             "lost) or restore it from a copy") from e

    @property
    def shards(self) -> list[pathlib.Path]:
        return list(self._shards)

    def __len__(self) -> int:
        return self._offsets[-1]

    def _locate(self, index: int) -> tuple[pathlib.Path, int]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"trajectory index {index} out of range for a store of {n} in {self.directory}")
        index %= n
        shard = bisect.bisect_right(self._offsets, index) - 1
        return self._shards[shard], index - self._offsets[shard]

    def _record(self, index: int) -> tuple[bytes, str]:
        path, local = self._locate(index)
        return self._read(path, [local])[0], f"{path.name} record {local}"

    def __getitem__(self, index: int) -> Trajectory:
        record, where = self._record(index)
        return decode_trajectory(record, where=where)

    def at(self, shard: str, record: int) -> Trajectory:
        """Record `record` of the shard named `shard`: a reference that stays right whatever happens to other
        shards (a global index moves when an earlier shard is lost). Errors name the shard."""
        path = self.directory / shard
        if path not in self._shards:
            self.refresh()
        if path not in self._shards:
            raise StoreError(f"trajectory shard {path} is missing; a saved reference points into it")
        reader = self._reader(path)
        if not 0 <= record < reader.num_records():
            raise StoreError(f"trajectory shard {path} holds {reader.num_records()} records; record {record} "
                             "was referenced")
        return decode_trajectory(self._read(path, [record])[0], where=f"{path.name} record {record}")

    def __iter__(self) -> Iterator[Trajectory]:
        for i in range(len(self)):
            yield self[i]

    def summaries(self) -> list[tuple[str, int]]:
        """(task_id, num_steps) of every trajectory, in store order, read without decoding screenshots."""
        out = []
        for path in self._shards:
            if path not in self._summaries:
                self._summaries[path] = [_summary(r, f"{path.name} record {i}")
                                         for i, r in enumerate(self._read(path))]
            out.extend(self._summaries[path])
        return out

    def by_task(self, task_id: str) -> list[Trajectory]:
        return [self[i] for i, (task, _) in enumerate(self.summaries()) if task == task_id]

    def paths(self) -> list[str]:
        """Shard paths for `grain.sources.ArrayRecordDataSource` (records decode with decode_trajectory)."""
        return [str(p) for p in self._shards]


def _fsync_dir(directory: pathlib.Path) -> None:
    """Make the rename itself durable (POSIX needs the directory entry flushed too)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_named_shard(directory: str | os.PathLike, name: str, trajectories: Sequence[Trajectory]) -> pathlib.Path:
    """A folder's single shard `name`, replacing one a crashed earlier attempt left behind (shards are
    immutable; the writer of the folder marks it done only after this returns)."""
    directory = pathlib.Path(directory)
    for stale in directory.glob(f"{name}.*"):
        stale.unlink()
    return TrajectoryStore(directory).append(trajectories, name=name)
