"""Reload: what a new configuration changes, model by model, decided before anything is touched.

``modelwarden reload``, ``systemctl reload`` and SIGHUP re-read the configuration file. The new
file is loaded, validated and its placement planned first; if any of it fails -- or it changes a
daemon setting that cannot apply to a running daemon -- the reload is refused as a whole, the
error is logged and returned, and the running configuration keeps serving untouched.

Otherwise ``diff`` compares the running configuration with the new one, per model:

  * a model only in the new file is **added**: its workers start;
  * a model only in the old one is **removed**: new requests for it get UNKNOWN_MODEL at once;
    what is queued for it is still served by its workers, which then drain and stop;
  * ``workers`` changed: the model is **scaled**, new slots started or the last ones drained,
    without touching the other slots;
  * anything that changes what a worker is -- ``source``, ``kwargs``, ``version`` (given, or
    derived from the model file: supervisor/fleet/versions.py), ``device``, ``cores``, ``threads``,
    ``warmup``, ``inputs``, the probe's input, the batch dimension, a slot's placement -- makes
    its workers **roll**: one slot at a time, the new worker READY before the old one drains;
  * the rest (``POLICY_FIELDS``: timeouts, queue and in-flight limits, retries, batching sizes,
    restart policy, recycling limits, probe interval and tolerances; the declared ``outputs``,
    which only the gateway reads) is supervisor-side policy and applies at once, no worker
    restarted.

Daemon settings bind sockets, directories and every worker's environment when the daemon starts;
except ``LIVE_DAEMON_FIELDS`` they cannot change under a running daemon, and a reload that changes
one is refused, naming it ("needs a restart"), rather than half applied. So is a change to
``[gateway]`` (its listeners are bound by its process at start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from modelwarden.shared.config import ConfigError, ModelConfig, Settings
from modelwarden.supervisor.fleet.placement import SlotPlacement

# ModelConfig fields only the supervisor reads: a change applies in place.
POLICY_FIELDS = frozenset({
    "timeout", "max_queue", "max_inflight", "retries", "heartbeat_timeout", "start_timeout",
    "start_seconds", "max_start_failures", "backoff_initial", "backoff_max", "kill_grace",
    "drain_timeout", "fatal_retry", "max_rss", "max_cuda_memory", "max_requests",
    "max_requests_jitter", "outputs", "standby"})
# Within nested tables: what the worker reads is the rest (probe.input and seed, batching.dim and
# the bucket settings it pads and warms up by).
POLICY_SUBFIELDS = {
    "probe": frozenset({"interval", "golden", "atol", "rtol", "range", "latency_factor",
                        "latency_slack_ms", "failures", "timeout", "max_replacements"}),
    "batching": frozenset({"max_size", "max_delay_us", "max_rows", "bytes_per_token"}),
}
# Read when used, not bound at start: these may change on reload.
LIVE_DAEMON_FIELDS = frozenset({"graceful_timeout", "allow_oversubscription"})


@dataclass
class ModelChange:
    """A model in both configurations: its new config and slots, and whether its workers roll."""

    config: ModelConfig
    placements: list[SlotPlacement]
    roll: bool
    reasons: list[str] = field(default_factory=list)


@dataclass
class ReloadPlan:
    added: list[ModelConfig] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: dict[str, ModelChange] = field(default_factory=dict)

    def summary(self) -> list[str]:
        lines = [f"{config.name}: added ({config.workers} worker(s))" for config in self.added]
        lines += [f"{name}: removed" for name in self.removed]
        lines += [f"{name}: {', '.join(change.reasons)}"
                  for name, change in self.kept.items() if change.reasons]
        return lines


def check_daemon_unchanged(old: Settings, new: Settings) -> None:
    """ConfigError naming the daemon settings that changed and cannot apply live."""
    before, after = old.daemon.model_dump(), new.daemon.model_dump()
    changed = sorted(key for key in before if key not in LIVE_DAEMON_FIELDS
                     and before[key] != after[key])
    if old.gateway != new.gateway:
        changed.append("gateway")
    if changed:
        raise ConfigError(", ".join(key if key == "gateway" else f"daemon.{key}" for key in changed),
                          "changed, and applies only when the daemon starts: revert it, or "
                          "restart the daemon (systemctl restart modelwarden) to apply it")


def worker_identity(config: ModelConfig) -> dict:
    """The parts of a model's configuration a worker is built from."""
    dump = config.model_dump(exclude={"workers", *POLICY_FIELDS})
    for table, policy in POLICY_SUBFIELDS.items():
        dump[table] = {key: value for key, value in dump[table].items() if key not in policy}
    return dump


def diff(old: Settings, new: Settings, running: dict[str, list[SlotPlacement]],
         placements: dict[str, list[SlotPlacement]], version_of: Callable[[ModelConfig], str],
         running_versions: dict[str, set[str]]) -> ReloadPlan:
    """``running``: each running model's slot placements; ``running_versions``: the versions
    its workers run now (a new model file under an unchanged configuration changes these)."""
    plan = ReloadPlan()
    old_models = {model.name: model for model in old.models}
    for config in new.models:
        before = old_models.get(config.name)
        if before is None:
            plan.added.append(config)
            continue
        plan.kept[config.name] = _change(before, config, running[config.name],
                                         placements[config.name], version_of(config),
                                         running_versions.get(config.name, set()))
    new_names = {model.name for model in new.models}
    plan.removed = [name for name in old_models if name not in new_names]
    return plan


def _change(before: ModelConfig, after: ModelConfig, running: list[SlotPlacement],
            placements: list[SlotPlacement], version: str, versions: set[str]) -> ModelChange:
    reasons = []
    old_identity, new_identity = worker_identity(before), worker_identity(after)
    changed = sorted(key for key in new_identity if old_identity.get(key) != new_identity[key])
    if changed:
        reasons.append(f"rolling ({', '.join(changed)} changed)")
    elif versions - {version}:
        reasons.append(f"rolling (version {', '.join(sorted(versions))} -> {version})")
    if before.workers != after.workers:
        reasons.append(f"workers {before.workers} -> {after.workers}")
    moved = [index for index, (a, b) in enumerate(zip(running, placements)) if a != b]
    if moved:
        reasons.append("placement of slot(s) " + ", ".join(map(str, moved)) + " changed")
    policy = sorted(key for key in before.model_dump()
                    if key != "workers" and key not in old_identity
                    and getattr(before, key) != getattr(after, key))
    policy += [f"{table}.{key}" for table, keys in POLICY_SUBFIELDS.items() for key in sorted(keys)
               if getattr(getattr(before, table), key) != getattr(getattr(after, table), key)]
    if policy:
        reasons.append(f"applied in place: {', '.join(policy)}")
    return ModelChange(after, placements, roll=bool(changed), reasons=reasons)
