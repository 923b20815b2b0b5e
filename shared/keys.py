"""Every Redis key rollstream uses, in one place. Nobody else builds key strings.

All keys live under one namespace, `rollstream:<exp_name>` (written <ns> in the docs).
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINER_GROUP = "trainer"
"""Consumer group the trainer reads the trajectory streams with."""
TRAINER_CONSUMER = "trainer-0"
"""The trainer's stable consumer name in TRAINER_GROUP: after a crash it re-reads its own pending entries."""


@dataclass(frozen=True)
class Keys:
    ns: str

    @classmethod
    def for_exp(cls, exp_name: str) -> Keys:
        return cls(f"rollstream:{exp_name}")

    @property
    def traj(self) -> str:
        """Stream of finished train trajectories (and producers' group-drop notices)."""
        return f"{self.ns}:traj"

    @property
    def val(self) -> str:
        """Stream of validation trajectories; never mixed into train batches."""
        return f"{self.ns}:val"

    @property
    def dead(self) -> str:
        """Dead-letter stream: entries that could not be decoded, with the reason."""
        return f"{self.ns}:dead"

    @property
    def weights(self) -> str:
        """Stream of weight announcements {version, uri, digest}."""
        return f"{self.ns}:weights"

    def weights_blob(self, name: str) -> str:
        """Hash holding the files of weights version `name` (v<N>) in chunks (weights_transport: redis)."""
        return f"{self.ns}:weights:{name}"

    @property
    def weights_blob_pattern(self) -> str:
        return f"{self.ns}:weights:v*"

    @property
    def version(self) -> str:
        """The latest published policy version (an integer)."""
        return f"{self.ns}:version"

    @property
    def counters(self) -> str:
        """Hash of group counters: admitted, returned, trained, stale, timeout, error, ..."""
        return f"{self.ns}:counters"

    @property
    def inflight(self) -> str:
        """Sorted set of admitted, not yet finished group ids, scored by admission time."""
        return f"{self.ns}:inflight"

    @property
    def episodes(self) -> str:
        """Hash: env group -> number of episodes it has been admitted so far."""
        return f"{self.ns}:episodes"

    @property
    def last_admission(self) -> str:
        """Hash: env group -> "<request id> <episode>" of its newest admission, so that an admission retried after
        its reply was lost (a Redis restart) gets the same episode back instead of a second slot."""
        return f"{self.ns}:last_admission"

    @property
    def control(self) -> str:
        """Stream of notifications producers block on: slots returned, versions, pause/resume."""
        return f"{self.ns}:control"

    @property
    def paused(self) -> str:
        """Set while train admission is paused for a validation round; holds "<round> <version>"."""
        return f"{self.ns}:paused"

    @property
    def owners(self) -> str:
        """Hash: in-flight group id -> "<worker rank> <incarnation>" of the env-worker process that admitted it,
        so the trainer can end the groups of a worker whose heartbeat expired or that restarted."""
        return f"{self.ns}:owners"

    @property
    def finished(self) -> str:
        """Set by the trainer when it reaches max_steps (holds the final version): admission stops and
        env-workers exit 0."""
        return f"{self.ns}:finished"

    @property
    def run(self) -> str:
        """Hash of high-water marks that let processes notice writes Redis lost: `last_commit` (the id of the
        trainer's last step commit) and `writes:<writer>` (how many entries each writer has written)."""
        return f"{self.ns}:run"

    @property
    def match_all(self) -> str:
        """A SCAN MATCH pattern for exactly this namespace's keys: glob characters in the name are escaped, so
        experiment `prod` never matches `prodexp` or `prod*`'s keys."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.ns) + ":*"

    def worker(self, rank: int) -> str:
        """Heartbeat hash of one env-worker; expires when the worker stops beating."""
        return f"{self.ns}:worker:{rank}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.ns}:worker:*"

    def engine(self, rank: int) -> str:
        """Heartbeat hash of one inference engine server (vllm_server): its URL and the version it serves; expires
        when the engine stops beating."""
        return f"{self.ns}:engine:{rank}"

    @property
    def engine_pattern(self) -> str:
        return f"{self.ns}:engine:*"
