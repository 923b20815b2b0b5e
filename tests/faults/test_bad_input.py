"""Bad input on the wire: entries that decode but carry fields of the wrong type, fuzz, and the dead-letter cap."""

from __future__ import annotations

import random
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import redis

from rollstream.consumer.data.reader import DEAD_MAXLEN, StreamReader
from rollstream.shared.codec import decode_entry, encode_drop, encode_trajectory
from rollstream.shared.keys import Keys
from rollstream.shared.schema import Trajectory
from rollstream.tiny_model import build_tiny_model
from tests.faults.conftest import FaultRedis, audit, wait_until

TRAJ = "rollstream:faults:traj"
DEAD = "rollstream:faults:dead"
COUNTERS = "rollstream:faults:counters"
MODEL_CONFIG = Path(__file__).with_name("model.yaml")


def _a_real_entry(client: redis.Redis) -> dict[bytes, bytes]:
    entries = wait_until(lambda: client.xrange(TRAJ, count=1), 60, "a first trajectory in the stream")
    return entries[0][1]


def _mutated(fields: dict[bytes, bytes], change: Any) -> dict[bytes, bytes]:
    """The entry with its payload body changed by `change(body)`; arrays stay opaque bytes."""
    message = msgpack.unpackb(fields[b"payload"], raw=False)
    change(message["body"])
    return {**fields, b"payload": msgpack.packb(message, use_bin_type=True)}


def _set(name: str, value: Any) -> Any:
    return lambda body: body.__setitem__(name, value)


def _set_turn_version(value: Any) -> Any:
    return lambda body: body["turns"][0].__setitem__(0, value)


MISTYPED = {
    "group_id null": _set("group_id", None),
    "group_id a list": _set("group_id", ["train", "FrozenLake"]),
    "member a string": _set("member", "3"),
    "turn version a string": _set_turn_version("7"),
    "episode a float": _set("episode", 2.5),
    "turns a map": _set("turns", {"a": 1}),
}


def test_mistyped_entries_are_dead_lettered_and_training_goes_on(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=4", "train_env_manager.max_env_num_per_worker=32")
    client = fault_redis.client()
    job.start_workers()
    real = _a_real_entry(client)
    for change in MISTYPED.values():
        client.xadd(TRAJ, _mutated(real, change))
    job.start_trainer()
    assert job.wait_trainer(120) == 0, job.log("trainer")[-3000:]
    reasons = [f[b"reason"].decode() for _, f in client.xrange(DEAD)]
    assert len(reasons) == len(MISTYPED), reasons
    assert int(client.hget(COUNTERS, "dead_letters")) == len(MISTYPED)
    assert any("group_id is NoneType" in r for r in reasons), reasons
    assert any("member is str" in r for r in reasons), reasons
    result = audit(Path(job.record))
    assert not result.twice and not result.incomplete
    assert len(result.groups) == 4 * job.cfg.groups_per_batch


# ---- fuzz ----

RECORDED = Path(__file__).resolve().parents[1] / "data" / "frozen_lake_scripted.msgpack"
FUZZ_ENTRIES = 10_000
"""How many fuzzed entries the case injects (besides three 5 MB ones): about 16 s on 2 cores."""


def _recorded_entries() -> list[dict[bytes, Any]]:
    """The recorded entries, their payloads in today's schema (the file was recorded in schema 1)."""
    with open(RECORDED, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        next(unpacker)  # header
        entries = [{k if isinstance(k, bytes) else k.encode(): v for k, v in r.items()} for r in unpacker]
    return [{**e, b"payload": _current_payload(e)} for e in entries]


def _current_payload(fields: dict[bytes, Any]) -> bytes:
    entry = decode_entry(fields)
    encoded = encode_trajectory(entry) if isinstance(entry, Trajectory) else encode_drop(entry)
    return cast(bytes, encoded["payload"])


def _fuzz(rng: random.Random, real: list[dict[bytes, Any]]) -> tuple[str, dict[bytes, Any]]:
    """One fuzzed entry and what the trainer must do with it: 'dead' (dead-lettered) or 'orphan' (acked)."""
    base = dict(rng.choice(real))
    case = rng.randrange(10)
    if case == 0:
        return "dead", {**base, b"payload": rng.randbytes(rng.randrange(1, 300))}
    if case == 1:
        return "dead", {**base, b"payload": base[b"payload"][: rng.randrange(1, len(base[b"payload"]))]}
    if case == 2:
        return "dead", {b"kind": b"traj", b"group_id": b"x"}  # no payload at all
    message = msgpack.unpackb(base[b"payload"], raw=False)
    body = message["body"]
    if case == 3:
        message["schema"] = rng.choice([0, 3, "2", None, True])
    elif case == 4:
        del body[rng.choice(sorted(body))]
    elif case == 5:
        name, value = rng.choice([("member", "7"), ("episode", -3), ("score", float("nan")), ("group_id", "g/e"),
                                  *((n, v) for n in ("group_id", "success", "tag") for v in (None, [1, 2], {"a": 1}))])
        body[name] = value
    elif case == 6:  # arrays that disagree in length, or bytes that are not whole values
        n = rng.randrange(1, 50)
        body["input_ids"] = bytes(4 * n + rng.choice([0, 1, 3]))
        body["response_mask"] = bytes(n + 1)
        body["logprobs"] = bytes(4 * n)
    elif case == 7:  # a well-formed entry of a group nobody admitted
        body["group_id"] = f"train/FrozenLake/g{rng.randrange(100, 10**6)}/e0"
        message["body"] = body
        return "orphan", {**base, b"payload": msgpack.packb(message, use_bin_type=True)}
    elif case == 8:
        return "orphan", base  # a duplicate of a real entry (its group is not in flight)
    else:
        message["kind"] = rng.choice(["weights", "", None, 3])
    return "dead", {**base, b"payload": msgpack.packb(message, use_bin_type=True)}


@pytest.mark.slow
def test_fuzzed_entries_are_all_dead_lettered_or_dropped_and_training_goes_on(fault_redis: FaultRedis,
                                                                              job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=4", "train_env_manager.max_env_num_per_worker=32")
    client = fault_redis.client()
    rng = random.Random(17)
    real = _recorded_entries()
    for entry in real:  # from another run: retagged so none matches a group this run admits
        entry[b"payload"] = _mutated(entry, _set("episode", 10**6))[b"payload"]
        entry[b"payload"] = _mutated(entry, _set("group_id", f"train/FrozenLake/g0/e{10**6}"))[b"payload"]
    expected = Counter()
    pipe = client.pipeline(transaction=False)
    for i in range(FUZZ_ENTRIES):
        kind, fields = _fuzz(rng, real)
        expected[kind] += 1
        pipe.xadd(TRAJ, fields)
        if i % 200 == 0:
            pipe.execute()
    huge = {**real[0], b"payload": b"\x92" + rng.randbytes(5 * 2**20)}  # a 5 MB field
    for _ in range(3):
        pipe.xadd(TRAJ, huge)
    expected["dead"] += 3
    pipe.execute()

    job.start_workers()
    job.start_trainer()
    assert job.wait_trainer(180) == 0, job.log("trainer")[-3000:]
    counters = {k.decode(): int(v) for k, v in client.hgetall(COUNTERS).items()}
    assert counters["dead_letters"] == expected["dead"], (counters, expected)
    assert counters.get("orphan_entries", 0) >= expected["orphan"], (counters, expected)
    letters = client.xrange(DEAD)
    assert all(f[b"reason"] for _, f in letters)
    big = [f for _, f in letters if int(f.get(b"size:payload", 0)) == len(huge[b"payload"])]
    assert len(big) == 3 and all(len(f[b"orig:payload"]) <= 1024 for f in big)  # truncated copies
    result = audit(job.record)
    assert not result.twice and not result.incomplete and len(result.groups) == 4 * job.cfg.groups_per_batch
    print(f"\nfuzz: {FUZZ_ENTRIES + 3} entries, {expected['dead']} dead-lettered, {expected['orphan']} orphans "
          f"expected ({counters.get('orphan_entries', 0)} acked as orphans), dead stream "
          f"{client.memory_usage(DEAD) / 2**20:.2f} MB")


def test_the_dead_letter_stream_is_capped(fault_redis: FaultRedis) -> None:
    client = fault_redis.client()
    keys = Keys.for_exp("faults")
    reader = StreamReader(client, keys, keys.traj, "trainer-0")
    with client.pipeline(transaction=False) as pipe:
        for i in range(DEAD_MAXLEN + 2000):
            pipe.xadd(keys.traj, {b"payload": b"x" * 10}, id=f"{i + 1}-0")
        pipe.execute()
    for i in range(DEAD_MAXLEN + 2000):
        reader.dead_letter(f"{i + 1}-0".encode(), {b"payload": b"x" * 10}, "fuzz")
    assert DEAD_MAXLEN <= client.xlen(keys.dead) < DEAD_MAXLEN + 1000  # approximate trimming, by whole nodes
    assert int(client.hget(keys.counters, "dead_letters")) == DEAD_MAXLEN + 2000


# ---- no pickle ----

PICKLE = re.compile(rb"\A\x80[\x02-\x05]")


def _stored_values(client: redis.Redis) -> list[bytes]:
    values: list[bytes] = []
    for key in client.scan_iter(match="rollstream:*"):
        kind = client.type(key)
        if kind == b"stream":
            values += [v for _, f in client.xrange(key) for v in f.values()]
        elif kind == b"hash":
            values += list(client.hgetall(key).values())
        elif kind == b"string":
            values.append(client.get(key))
    return values


def _pickled_files(root: Path) -> list[str]:
    """Files under `root` that are a pickle, or a zip (torch.save's format) holding one."""
    found = []
    for path in (p for p in root.rglob("*") if p.is_file()):
        if PICKLE.match(path.read_bytes()[:2]) or path.suffix in (".pkl", ".pickle"):
            found.append(str(path))
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                found += [f"{path}:{n}" for n in z.namelist() if n.endswith(".pkl") or PICKLE.match(z.read(n)[:2])]
    return found


def test_no_pickle_on_the_wire_or_in_stored_files(fault_redis: FaultRedis, job_factory) -> None:
    job = job_factory(fault_redis.url, "max_steps=3", "train_env_manager.max_env_num_per_worker=32",
                      "weights_transport=redis")
    job.start_workers()
    job.start_trainer()
    assert job.wait_trainer(120) == 0, job.log("trainer")[-3000:]
    client = fault_redis.client()
    values = _stored_values(client)
    assert values and not [v[:40] for v in values if PICKLE.match(v)]
    for _, fields in client.xrange(TRAJ):  # payloads are plain msgpack: no extension types at all
        msgpack.unpackb(fields[b"payload"], raw=False, ext_hook=_no_extension)
    assert job.record in [p for p in job.tmp_path.rglob("*") if p.is_file()]
    assert not _pickled_files(job.tmp_path)


@pytest.mark.slow
def test_no_pickle_in_the_checkpoints_and_weights_of_a_torch_train_run(fault_redis: FaultRedis, job_factory,
                                                                      tmp_path: Path) -> None:
    """A model trained by torch_train: its checkpoints (model, optimizer, schedule, RNG: safetensors and JSON)
    and published weights hold no pickle, and the run resumes from them."""
    model = build_tiny_model(tmp_path / "model", tie_word_embeddings=True, corpus_episodes=20)
    job = job_factory(fault_redis.url, f"pretrain={model}", config=MODEL_CONFIG)
    job.start_workers()
    job.start_trainer()
    assert job.wait_trainer(180) == 0, job.log("trainer")[-3000:]
    checkpoints = job.tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2"]
    assert not _pickled_files(job.tmp_path)
    # and they load: one more step from the last checkpoint, every RNG and the optimizer restored
    job2 = job_factory(fault_redis.url, f"pretrain={model}", "max_steps=3", "resume_from_checkpoint=true",
                       f"output_dir={job.tmp_path / 'out'}", config=MODEL_CONFIG, name="resumed")
    job2.start_trainer()  # first: it reopens the finished experiment, which workers started before would leave
    wait_until(lambda: "resumed from" in job2.log("trainer"), 120, "the trainer resuming")
    assert f"resumed from {checkpoints / 'step_2'} at version 2" in job2.log("trainer")
    job2.start_workers()
    assert job2.wait_trainer(180) == 0, job2.log("trainer")[-3000:]
    assert not _pickled_files(job.tmp_path) and not _pickled_files(job2.tmp_path)


def _no_extension(code: int, data: bytes) -> None:
    raise AssertionError(f"msgpack extension {code} on the wire")
