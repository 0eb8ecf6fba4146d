"""``make mutants``: break each mechanism on purpose and check that the tests named after it fail.

Each mutation replaces one exact piece of product code (it must occur exactly once) in a
temporary copy of the tree, then runs the tests that claim to guard that mechanism against the
copy. "caught" means those tests failed. A mutation whose text no longer matches the code is
reported as STALE: when you change a mechanism, update its mutation in the same commit; when you
add one, add its mutation.

The copy is importable as ``modelwarden`` through PYTHONPATH (its ``modelwarden/`` folder gains
links to ``supervisor/``, ``worker/``, ``shared/`` and ``gateway/``), which takes precedence over the editable
install, in the test process, the daemon it starts and the daemon's spawned workers alike.

    python bench/mutants.py               # all; exit 1 if any mutation survives or is stale
    python bench/mutants.py --list
    python bench/mutants.py probe-timeout retire-first
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


M = Mutation
MUTATIONS = [
    # -- health checks and replacement ---------------------------------------------------------
    M("probe-timeout", "supervisor/pool.py",
      "if probe.inflight_since is not None and now - probe.inflight_since > timeout:", "if False:",
      ("tests/test_chaos.py::test_a_hung_probe_is_caught_and_the_worker_replaced",
       "tests/test_unit_pool.py::test_an_unanswered_probe_replaces_the_worker_at_once")),
    M("retire-first", "supervisor/pool.py",
      "        slot.restarts += 1\n        self.spawn(slot)\n        return True",
      "        slot.restarts += 1\n        self.spawn(slot)\n        self.drain(handle, reason)\n        return True",
      ("tests/test_chaos.py::test_a_leaking_worker_is_recycled_past_max_rss",
       "tests/test_reliability.py::test_max_requests_recycles_the_worker_without_failing_anything",
       "tests/test_chaos.py::test_restarting_one_worker_leaves_the_others_alone",
       "tests/test_lifecycle.py::test_a_rolling_restart_replaces_every_worker_before_retiring_it")),
    M("heartbeat-timeout", "supervisor/pool.py",
      "              and now - handle.last_seen > config.heartbeat_timeout):",
      "              and False):",
      ("tests/test_chaos.py::test_a_hung_forward_is_killed_and_its_request_retried",)),
    M("start-timeout", "supervisor/pool.py",
      "if handle.state in BOOTING and now - handle.started_at > config.start_timeout:", "if False:",
      ("tests/test_lifecycle.py::test_start_timeout_kills_a_worker_that_never_gets_ready",)),
    M("drain-timeout", "supervisor/pool.py",
      "elif handle.state == S.DRAINING and handle.drain_deadline and now > handle.drain_deadline:",
      "elif False:",
      ("tests/test_lifecycle.py::test_drain_timeout_kills_a_draining_worker_and_its_request_is_retried",)),
    M("max-rss", "supervisor/pool.py",
      "if self.config.max_rss and rss and rss > self.config.max_rss:", "if False:",
      ("tests/test_chaos.py::test_a_leaking_worker_is_recycled_past_max_rss",)),
    M("max-requests", "supervisor/pool.py",
      "if handle.request_limit and handle.served >= handle.request_limit:", "if False:",
      ("tests/test_reliability.py::test_max_requests_recycles_the_worker_without_failing_anything",)),
    M("sighup-reload", "supervisor/arbiter.py",
      "                try:\n                    self.reload()\n",
      "                try:\n                    pass\n",
      ("tests/test_reload.py::test_reload_under_load_adds_removes_scales_and_rolls_with_no_failed_request",
       "tests/test_curve.py::test_sighup_rereads_client_keys_without_a_restart")),
    M("probe-drift", "supervisor/probes.py",
      'return Verdict(False, f"drifted from golden by {drift:.3g}", drift)',
      'return Verdict(True, "ok", drift)',
      ("tests/test_chaos.py::test_a_drifting_worker_is_replaced_before_it_is_retired",)),
    M("probe-latency", "supervisor/probes.py",
      "if baseline_us is not None and self._too_slow(latency_us, baseline_us):", "if False:",
      ("tests/test_lifecycle.py::test_a_probe_slower_than_its_baseline_fails_and_the_worker_is_replaced",)),
    M("probe-failures-in-a-row", "supervisor/pool.py",
      "        if verdict.ok:\n            probe.consecutive_failures = 0\n",
      "        if verdict.ok:\n",
      ("tests/test_reliability.py::test_a_probe_failing_every_other_time_does_not_replace_the_worker",)),
    M("start-failures-fatal", "supervisor/pool.py",
      "if slot.start_failures >= self.config.max_start_failures:", "if False:",
      ("tests/test_load_failure.py",)),
    M("slot-follows-worker", "supervisor/pool.py",
      "        if handle is slot.current:\n            slot.follow(new)",
      "        if handle is slot.current:\n            pass",
      ("tests/test_unit_pool.py::test_a_slot_is_ready_when_its_current_worker_is_and_starting_while_a_replacement_boots",)),
    M("one-line-per-state-change", "supervisor/slot.py",
      'self._change(SLOT_FOLLOWS[worker_state], logging.DEBUG, f"worker {worker_state.value}")',
      'self._change(SLOT_FOLLOWS[worker_state], logging.INFO, f"worker {worker_state.value}")',
      ("tests/test_unit_pool.py::test_a_worker_death_logs_the_worker_once_and_the_slot_from_its_own_state",)),
    M("pdeathsig", "worker/placement.py",
      "libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)", "pass",
      ("tests/test_lifecycle.py::test_a_worker_stuck_in_forward_dies_with_a_sigkilled_supervisor",)),
    # -- reload, versions, FATAL healing ------------------------------------------------------
    M("reload-ignores-the-file", "supervisor/arbiter.py",
      "changes = reload.diff(self.settings, new,", "changes = reload.diff(self.settings, self.settings,",
      ("tests/test_reload.py::test_reload_under_load_adds_removes_scales_and_rolls_with_no_failed_request",)),
    M("policy-change-rolls", "supervisor/reload.py",
      "return ModelChange(after, placements, roll=bool(changed), reasons=reasons)",
      "return ModelChange(after, placements, roll=True, reasons=reasons)",
      ("tests/test_unit_reload.py",)),
    M("roll-every-slot-at-once", "supervisor/pool.py",
      "                self.replace(slot.current, \"reload: new configuration\")\n            return",
      "                self.replace(slot.current, \"reload: new configuration\")",
      ("tests/test_unit_pool.py::test_a_reconfigured_pool_rolls_one_worker_at_a_time_replacing_before_retiring",)),
    M("roll-retires-first", "supervisor/pool.py",
      "                self.replace(slot.current, \"reload: new configuration\")",
      "                self.terminate(slot.current, \"reload: new configuration\")",
      ("tests/test_reload.py::test_reload_under_load_adds_removes_scales_and_rolls_with_no_failed_request",)),
    M("replan-moves-running-slots", "supervisor/placement.py",
      "            elif owner in kept:", "            elif False:",
      ("tests/test_unit_placement.py", "tests/test_reload.py::test_scale_and_stop_commands_change_one_model_until_restart")),
    M("golden-shared-across-versions", "supervisor/probes.py",
      "return self.file_golden or self.recorded.get(version)",
      "return self.file_golden or next(iter(self.recorded.values()), None)",
      ("tests/test_unit_probes.py",
       "tests/test_reload.py::test_a_new_version_records_its_own_golden_and_serves_without_a_probe_failure")),
    M("version-ignores-new-weights", "supervisor/versions.py",
      "if known is not None and known[0] == key:", "if known is not None:",
      ("tests/test_reload.py::test_new_weights_in_place_and_a_restart_make_a_new_version_with_its_own_golden",)),
    M("no-max-replacements", "supervisor/pool.py",
      "if slot.probe_replacements < limit:", "if True:",
      ("tests/test_unit_pool.py",
       "tests/test_reload.py::test_a_worker_always_failing_probes_is_replaced_max_replacements_times_then_fatal")),
    M("no-fatal-retry", "supervisor/pool.py",
      "slot.retry_timer = self.host.timers.call_at(slot.retry_at, self._retry_fatal, slot)", "pass",
      ("tests/test_unit_pool.py",
       "tests/test_reload.py::test_a_fatal_slot_retries_by_itself_after_fatal_retry_and_heals")),

    # -- requests: retries, queueing, deadlines --------------------------------------------------
    M("async-client-edge-not-rechecked", "shared/client.py",
      "        # the edge of a reply that has already arrived: look now, or it could wait for ever.\n"
      "        self._on_events()",
      "        # the edge of a reply that has already arrived: look now, or it could wait for ever.\n"
      "        pass",
      ("tests/test_serving.py::test_async_client_keeps_64_in_flight_from_one_loop_then_another",)),
    M("async-client-reader-stays-on-the-first-loop", "shared/client.py",
      "        if self._loop is not loop:", "        if self._loop is None:",
      ("tests/test_serving.py::test_async_client_keeps_64_in_flight_from_one_loop_then_another",)),
    M("async-client-no-timer", "shared/client.py",
      "        timer = loop.call_later(timeout, _expire, future)",
      "        timer = loop.call_later(3600, _expire, future)",
      ("tests/test_serving.py::test_async_client_gives_up_on_a_silent_daemon_and_close_ends_what_still_waits",)),
    M("async-client-close-leaves-waiters", "shared/client.py",
      "        for future in self._waiting.values():",
      "        for future in []:",
      ("tests/test_serving.py::test_async_client_gives_up_on_a_silent_daemon_and_close_ends_what_still_waits",)),
    M("retry-after-crash", "supervisor/requests.py",
      "    if request.deaths > retries:\n        return WORKER_DIED\n    return None",
      "    return WORKER_DIED",
      ("tests/test_chaos.py::test_a_worker_dying_in_forward_is_hidden_by_the_retry",)),
    M("retries-zero", "supervisor/requests.py",
      "    if request.deaths > retries:\n        return WORKER_DIED", "    if False:\n        return WORKER_DIED",
      ("tests/test_lifecycle.py::test_retries_zero_answers_worker_died_instead_of_retrying",)),
    M("poison", "supervisor/requests.py",
      "    if request.deaths >= POISON_AFTER_DEATHS:\n        return POISON",
      "    if False:\n        return POISON",
      ("tests/test_chaos.py::test_poison_input_is_answered_poison_and_the_pool_recovers",)),
    M("queue-while-restarting", "supervisor/router.py",
      "            if pool.all_fatal():", "            if pool.ready_count() == 0:",
      ("tests/test_reliability.py::test_requests_wait_for_a_worker_while_every_worker_restarts",)),
    # -- dynamic batching ------------------------------------------------------------------------
    M("batch-mates-retried-alone", "supervisor/router.py",
      "            request.alone = request.alone or request.batch_size > 1\n", "",
      ("tests/test_batching.py::test_a_poison_input_in_a_batch_ends_poison_alone_and_its_batch_mates_succeed",
       "tests/test_unit_router.py::test_a_dead_workers_batch_is_retried_one_per_forward_and_poison_ends_alone")),
    M("batch-hold", "supervisor/router.py",
      "            if config.max_delay_us and self._hold(pool, members, now):", "            if False:",
      ("tests/test_batching.py::test_a_partial_batch_under_load_waits_for_more_up_to_max_delay",
       "tests/test_unit_router.py::test_a_partial_batch_is_held_until_max_delay_after_its_head_arrived")),
    M("lone-request-never-waits", "supervisor/batching.py",
      "            or head.alone or not head.queued_under_load):", "            or head.alone):",
      ("tests/test_batching.py::test_a_lone_request_on_an_idle_pool_is_not_delayed",
       "tests/test_unit_batching.py::test_a_partial_batch_waits_only_under_load_and_never_past_a_deadline")),
    M("batch-compatibility", "supervisor/batching.py",
      "        shapes.append((desc.dtype, shape[:dim], shape[dim + 1:]))",
      "        shapes.append((desc.dtype,))",
      ("tests/test_batching.py::test_incompatible_requests_are_never_merged",)),
    M("batch-failure-reruns-each-alone", "worker/serve.py",
      "            for call in calls:\n                self._run_call(call)\n            return\n        for call, share",
      "            for call in calls:\n                self._answer_failure(call.rid, call.client_id, exc)\n"
      "            return\n        for call, share",
      ("tests/test_batching.py::test_an_exception_for_one_member_fails_only_that_member",)),
    M("overloaded", "supervisor/router.py",
      "if len(queue) >= pool.config.max_queue:", "if False:",
      ("tests/test_reliability.py::test_a_full_queue_answers_overloaded_at_once_and_loses_nothing",)),
    M("timeout", "supervisor/router.py",
      "request.timer = host.timers.call_at(request.deadline, self.expire, request)",
      "request.timer = None",
      ("tests/test_reliability.py::test_a_request_past_its_deadline_gets_timeout",)),
    # -- stopping --------------------------------------------------------------------------------
    M("sigterm-drain", "supervisor/arbiter.py",
      "self._stop_deadline = now + self.settings.daemon.graceful_timeout", "self._stop_deadline = now",
      ("tests/test_lifecycle.py::test_sigterm_serves_what_was_accepted_refuses_new_work_and_exits_zero",)),
    M("second-signal", "supervisor/arbiter.py",
      'logger.warning("%s again: stopping now", reason)\n            self._stop_deadline = now',
      'logger.warning("%s again: stopping now", reason)',
      ("tests/test_lifecycle.py::test_a_second_signal_stops_at_once_and_answers_everything",)),
    M("graceful-timeout", "supervisor/arbiter.py",
      "if self._stop_deadline is not None and now >= self._stop_deadline:", "if False:",
      ("tests/test_lifecycle.py::test_graceful_timeout_bounds_the_drain",)),
    M("shutting-down", "supervisor/router.py",
      "            if host.stopping:\n", "            if False:\n",
      ("tests/test_lifecycle.py::test_sigterm_serves_what_was_accepted_refuses_new_work_and_exits_zero",)),
    # -- systemd and logs --------------------------------------------------------------------
    M("watchdog", "supervisor/systemd.py",
      'self.notify("WATCHDOG=1")', 'self.notify("STATUS=alive")',
      ("tests/test_lifecycle.py::test_watchdog_pings_reach_notify_socket",)),
    M("notify-never-blocks", "supervisor/systemd.py",
      "sock.sendto(message.encode(), socket.MSG_DONTWAIT, self._address)",
      "sock.sendto(message.encode(), self._address)",
      ("tests/test_lifecycle.py::test_a_notify_socket_nobody_reads_does_not_stop_the_daemon",)),
    M("json-logs", "shared/logs.py",
      'JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)',
      "logging.Formatter(TEXT_FORMAT)",
      ("tests/test_lifecycle.py::test_json_logs_are_one_object_a_line_from_every_process",)),
    # -- the wire: one per error code --------------------------------------------------------
    M("bad-request-frame-length", "shared/protocol.py",
      "if desc.frame is not None and len(payload[desc.frame]) != desc.nbytes:", "if False:",
      ("tests/test_serving.py::test_malformed_messages_get_typed_errors_and_the_daemon_serves_on",)),
    M("bad-request-map-keys", "shared/protocol.py",
      "    if len(header) != len(pairs):\n        raise _MapKeyError", "    if False:\n        raise _MapKeyError",
      ("tests/test_serving.py::test_malformed_messages_get_typed_errors_and_the_daemon_serves_on",)),
    M("bad-request-bool-bytes", "worker/serve.py",
      "        problem = check_bool_bytes(tensors)\n", "        problem = None\n",
      ("tests/test_wire_edges.py",)),
    M("bad-input", "supervisor/router.py",
      "check_declared(parsed.tree, parsed.tensors, pool.config.inputs)", "pass",
      ("tests/test_serving.py::test_client_errors_are_typed",)),
    M("unknown-model", "supervisor/router.py",
      'raise ProtocolError(UNKNOWN_MODEL, f"no model named', 'raise ProtocolError(NO_WORKER, f"no model named',
      ("tests/test_serving.py::test_client_errors_are_typed",)),
    M("no-worker", "supervisor/router.py",
      "            if pool.all_fatal():\n", "            if False:\n",
      ("tests/test_load_failure.py",)),
    M("model-error", "worker/serve.py",
      "        return MODEL_ERROR, f\"{type(exc).__name__}: {exc}\"",
      "        return \"INTERNAL\", f\"{type(exc).__name__}: {exc}\"",
      ("tests/test_error_codes.py",)),
    M("out-of-memory", "worker/serve.py",
      "if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):",
      "if isinstance(exc, MemoryError):",
      ("tests/test_error_codes.py",)),
    # -- shared memory as capabilities -----------------------------------------------------------
    M("buffer-region-check", "supervisor/buffers.py",
      "        token, offset, nbytes = region\n", "        return\n        token, offset, nbytes = region\n",
      ("tests/test_shm.py::test_out_of_bounds_descriptors_are_rejected",
       "tests/test_unit_buffers.py::test_check_refuses_unknown_tokens_and_regions_outside_without_echoing_the_token")),
    M("buffer-revoke-on-close", "supervisor/buffers.py",
      "        return self._revoke(list(peer.tokens))", "        return []",
      ("tests/test_shm.py::test_a_token_dies_with_the_channel_connection_that_registered_it",)),
    M("buffer-seals", "shared/shm.py", "or not seals & REQUIRED_SEALS", "",
      ("tests/test_shm.py::test_descriptors_that_are_not_sealed_memfds_are_refused",)),
    M("buffer-truncated-message-fds", "shared/fdchannel.py",
      "        close_all(fds)\n        raise bad(", "        raise bad(",
      ("tests/test_shm.py::test_too_many_descriptors_and_garbage_leak_nothing",)),
    M("buffer-worker-closes-fd", "shared/shm.py",
      "    finally:\n        os.close(fd)\n    return Segment(size, -1, memory, token)",
      "    finally:\n        pass\n    return Segment(size, -1, memory, token)",
      ("tests/test_shm.py::test_valid_raw_shm_request_is_served",)),
    M("buffer-forget", "supervisor/arbiter.py",
      "        if not tokens:\n            return\n        revoked", "        return\n        revoked",
      ("tests/test_shm.py::test_no_leaks_after_sigkill_of_a_client_a_worker_and_the_supervisor",)),
    M("buffer-token-logged", "supervisor/channel.py",
      "            tokens = self.registry.register(peer, fds)  # owns the fds from here on\n",
      "            tokens = self.registry.register(peer, fds)  # owns the fds from here on\n"
      "            logger.info('registered %s', tokens)\n",
      ("tests/test_shm.py::test_another_users_token_is_known_only_to_whoever_it_was_given_to",)),
    M("buffer-revoked-while-queued", "supervisor/router.py", "        if None in buffers:", "        if False:",
      ("tests/test_shm.py::test_a_queued_request_whose_token_is_revoked_is_answered_buffer_not_registered",)),
    M("buffer-client-renews", "shared/session.py",
      "        if self.arena is not None:\n            self.arena.renew(pending.tokens)", "        pass",
      ("tests/test_shm.py::test_clients_survive_a_daemon_restart",)),
    # -- the trust boundary (privilege separation, CURVE) ---------------------------------------
    M("worker-secret", "supervisor/workerauth.py",
      "elif not isinstance(secret, bytes) or not hmac.compare_digest(secret, handle.spec.secret):",
      "elif False:",
      ("tests/test_privsep.py::test_forged_workers_are_refused_logged_and_never_served",
       "tests/test_privsep.py::test_messages_count_only_after_the_right_secret_once")),
    M("worker-unauthenticated", "supervisor/workerauth.py",
      "        if not handle.authenticated:\n", "        if False:\n",
      ("tests/test_privsep.py::test_messages_count_only_after_the_right_secret_once",)),
    M("admin-only-commands", "supervisor/arbiter.py",
      "if command.mutating and not admin:", "if False:",
      ("tests/test_privsep.py::test_control_socket_refuses_mutating_commands_from_anyone",)),
    M("private-dir-mode", "supervisor/runtime.py",
      "    ensure_dir(path, PRIVATE_MODE, None)", "    ensure_dir(path, 0o755, None)",
      ("tests/test_privsep.py::test_a_group_member_serves_and_reads_but_cannot_command_or_impersonate",)),
    M("runtime-dir-mode-checked", "supervisor/runtime.py",
      "    if stat.S_IMODE(info.st_mode) != mode:", "    if False:",
      ("tests/test_privsep.py::test_a_runtime_dir_with_a_wrong_mode_is_refused_not_chmodded",)),
    M("runtime-dir-symlink", "supervisor/runtime.py",
      "    if stat.S_ISLNK(info.st_mode):", "    if False:",
      ("tests/test_privsep.py::test_a_symlinked_runtime_dir_is_refused_and_its_target_untouched",)),
    M("curve-server", "supervisor/auth.py",
      "    sock.setsockopt(zmq.CURVE_SERVER, 1)\n", "",
      ("tests/test_curve.py::test_curve_traffic_holds_no_plaintext",)),
    M("curve-zap-domain", "supervisor/auth.py",
      "    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())\n", "",
      ("tests/test_curve.py::test_wrong_or_missing_keys_get_nothing_and_refusals_are_logged_once",)),
    # -- bounded under abuse ---------------------------------------------------------------------
    M("fd-pause", "supervisor/connections.py",
      "            os.rename(self._path, self._aside())\n", "",
      ("tests/test_abuse.py::test_a_connection_flood_pauses_new_connections_and_never_aborts_the_daemon",)),
    M("paused-socket-unreachable", "supervisor/connections.py",
      "            os.chmod(self._path, 0)\n", "",
      ("tests/test_unit_limits.py::test_a_paused_ipc_listener_is_neither_at_its_name_nor_connectable_aside",)),
    M("unread-reply-cap", "supervisor/limits.py",
      "if unread and (unread + nbytes > self.per_connection or self.total + nbytes > self.total_cap):",
      "if False:",
      ("tests/test_abuse.py::test_a_peer_that_never_reads_cannot_grow_the_supervisor",)),
    M("request-bytes-cap", "supervisor/limits.py",
      "        if held + nbytes > self.per_connection:", "        if False:",
      ("tests/test_abuse.py::test_requests_past_the_in_flight_byte_cap_are_overloaded",)),
    M("frames-per-message", "supervisor/limits.py",
      "    if len(frames) > MAX_FRAMES:", "    if False:",
      ("tests/test_abuse.py::test_a_message_of_too_many_frames_is_a_bad_request",)),
    # -- one descriptor account, shares per identity, bytes by size (issue 21) --------------------
    M("control-never-paused", "supervisor/arbiter.py",
      "self._watch_connections(self.control, self.settings.control_endpoint, pausable=True)",
      "self._watch_connections(self.control, self.settings.control_endpoint, pausable=False)",
      ("tests/test_attacks.py::test_a_control_sock_flood_is_paused_and_shut_and_never_aborts_the_supervisor[pause]",)),
    M("connection-share-not-shut", "supervisor/connections.py", "        if over:\n", "        if False:\n",
      ("tests/test_attacks.py::test_a_control_sock_flood_is_paused_and_shut_and_never_aborts_the_supervisor[share]",
       "tests/test_unit_quotas.py::test_a_connection_over_its_identitys_share_is_shut_by_the_guard")),
    M("channel-connection-share", "supervisor/channel.py",
      "                self.guard.quotas.take(peer.identity, \"connections\")",
      "                pass",
      ("tests/test_attacks.py::test_a_channel_connection_fill_by_one_uid_leaves_room_for_others",)),
    M("buffer-count-share", "supervisor/buffers.py",
      "            quotas.take(identity, \"buffers\", count)\n", "",
      ("tests/test_attacks.py::test_a_buffers_sock_descriptor_flood_gets_typed_refusals_within_a_share",)),
    M("buffer-bytes-in-all", "supervisor/buffers.py",
      "if self.max_bytes is not None and self.bytes + nbytes > self.max_bytes:", "if False:",
      ("tests/test_unit_quotas.py::test_registered_bytes_are_bounded_per_identity_and_in_all_by_size_not_count",)),
    M("buffer-larger-than-a-share", "supervisor/buffers.py",
      "identity != quotas.house and largest > quotas.shares.buffer_bytes:",
      "identity != quotas.house and largest > 1 << 62:",
      ("tests/test_attacks.py::test_huge_and_sparse_memfds_cost_the_daemon_no_more_than_a_share",)),
    M("shm-tensor-bytes", "supervisor/router.py",
      "            if region[2] > daemon.max_shm_tensor_bytes:", "            if False:",
      ("tests/test_attacks.py::test_a_shared_memory_tensor_past_its_byte_limit_is_refused_before_a_worker_maps_it",)),
    M("request-share", "supervisor/router.py",
      "        quotas.take(identity, \"requests\")\n", "",
      ("tests/test_unit_router.py::test_an_identity_past_its_share_of_requests_is_overloaded_and_others_are_served",
       "tests/test_curve.py::test_a_curve_client_is_known_by_its_key_and_held_to_its_share")),
    M("worker-map-budget", "worker/segments.py",
      "or (self.budget is not None and self.mapped + size > self.budget)", "or False",
      ("tests/test_unit_auth.py::test_a_worker_maps_client_buffers_only_within_its_budget",)),
    M("children-search-the-cwd", "supervisor/arbiter.py",
      "        os.environ[\"PYTHONSAFEPATH\"] = \"1\"\n", "",
      ("tests/test_privsep.py::test_a_stdlib_name_planted_in_the_cwd_never_runs_in_a_spawned_worker",)),
    M("pid-file-for-the-group", "supervisor/runtime.py",
      "PID_FILE_MODE = 0o600", "PID_FILE_MODE = 0o644",
      ("tests/test_privsep.py::test_a_group_member_cannot_lock_the_pid_file_to_block_a_restart",)),
    M("runtime-dir-owner-unchecked", "shared/trustdir.py",
      "def dir_problem(path: Path, info: os.stat_result, modes: tuple, owners: set[int]) -> str | None:\n"
      "    \"\"\"What makes ``path`` a directory not to trust, or None.\"\"\"\n",
      "def dir_problem(path: Path, info: os.stat_result, modes: tuple, owners: set[int]) -> str | None:\n"
      "    \"\"\"What makes ``path`` a directory not to trust, or None.\"\"\"\n    return None\n",
      ("tests/test_privsep.py::test_the_runtime_dir_checker_refuses_what_the_daemon_does_not_make",)),
    M("metrics-per-source", "supervisor/metrics_http.py",
      "        if self.by_source[source] >= self.per_source:", "        if False:",
      ("tests/test_metrics.py::test_admission_caps_connections_in_all_and_per_source",
       "tests/test_metrics.py::test_the_loop_server_refuses_beyond_its_shares_and_when_the_budget_is_spent")),
    M("gateway-buffers-kept", "shared/shm.py",
      "                    if region.leased or kept + size <= keep_bytes:",
      "                    if True:",
      ("tests/test_gateway.py::test_an_idle_gateway_gives_back_its_shared_memory_after_a_burst",
       "tests/test_unit_gateway.py::test_trim_gives_back_only_free_buffers_idle_since_the_last_trim")),
    # -- metrics, access log, CLI (issue 10) -------------------------------------------------------
    M("metrics-observers", "supervisor/router.py",
      "        for observe in self.observers:\n            observe(request, code, timing)", "        pass",
      ("tests/test_metrics.py::test_metrics_follow_requests_errors_and_a_killed_worker",)),
    M("metrics-refusals", "supervisor/router.py",
      "            if self.observers:\n                refused", "            if False:\n                refused",
      ("tests/test_metrics.py::test_metrics_follow_requests_errors_and_a_killed_worker",)),
    M("metrics-worker-error-code", "supervisor/router.py",
      'code = _error_code(frames[0]) if self.observers else ""', 'code = "INTERNAL"',
      ("tests/test_metrics.py::test_the_access_log_has_a_line_per_answer_ok_or_error",)),
    M("readyz-always", "supervisor/metrics.py",
      "ready = self.telemetry.live() and self.telemetry.snapshot.ready", "ready = True",
      ("tests/test_metrics.py::test_metrics_follow_requests_errors_and_a_killed_worker",)),
    M("restart-cause", "supervisor/metrics.py",
      'return text.split(":", 1)[0].strip() or "unknown"', 'return "unknown"',
      ("tests/test_metrics.py::test_metrics_follow_requests_errors_and_a_killed_worker",)),
    M("probe-failures-total", "supervisor/pool.py", "        probe.failures += 1\n", "",
      ("tests/test_metrics.py::test_failed_probes_are_counted_across_workers",)),
    M("histogram-inclusive", "supervisor/metrics.py",
      "self.counts[bisect.bisect_left(self.bounds, value)] += 1",
      "self.counts[bisect.bisect_right(self.bounds, value)] += 1",
      ("tests/test_metrics.py::test_histogram_buckets_are_cumulative_and_inclusive",)),
    M("access-log-always", "supervisor/arbiter.py",
      "        if daemon.access_log:\n            accesslog.enable()", "        if True:\n            accesslog.enable()",
      ("tests/test_metrics.py::test_no_access_log_unless_asked",)),
    M("stale-socket", "shared/ipcaccess.py", "        stale = stale_socket(path)", "        stale = None",
      ("tests/test_cli.py::test_a_stale_socket_is_named_at_once_for_every_command",)),
    M("cli-imports-torch", "supervisor/cli.py",
      "    from modelwarden.shared.control import control_request\n",
      "    from modelwarden.shared.client import control_request\n",
      ("tests/test_cli.py::test_status_restart_and_stop_never_import_torch",)),
    M("sigusr-default", "supervisor/arbiter.py",
      "for signum in (*STOP_SIGNALS, signal.SIGHUP, *IGNORED_SIGNALS):", "for signum in (*STOP_SIGNALS, signal.SIGHUP):",
      ("tests/test_cli.py::test_sigusr1_and_sigusr2_are_logged_and_ignored",)),
    # Not here: client_runtime_dir's fallback to /run/modelwarden. Its test runs the CLI as another
    # user, who imports the installed package, not this script's mutated copy (0700, root's).
    M("check-devices", "supervisor/devices.py", "        if index >= count:", "        if False:",
      ("tests/test_cli.py::test_check_refuses_a_cuda_device_this_machine_lacks",)),
    M("oom-recycle", "supervisor/router.py", '            pool.replace(handle, "out of memory in forward")',
      "            pass", ("tests/test_error_codes.py::test_out_of_memory_is_typed_and_that_worker_is_replaced",)),
    M("output-check", "supervisor/cli.py", "    if args.output:\n        _check_output(args.output)\n", "",
      ("tests/test_cli.py::test_a_user_mistake_gets_one_line_and_exit_2",)),
    # -- real models: shared weights, the pretrained example, GPU paths (issue 13) ----------------
    M("mmap-copies", "worker/weights.py", "tensors[name] = tensor if mapped else tensor.clone()",
      "tensors[name] = tensor.clone()",
      ("tests/test_weights.py::test_two_workers_share_one_copy_of_mapped_weights",)),
    M("mmap-shared-writes", "worker/weights.py", "access=mmap.ACCESS_COPY", "access=mmap.ACCESS_WRITE",
      ("tests/test_weights.py::test_a_write_to_mapped_weights_stays_private",)),
    M("weights-ignored", "worker/loader.py", "        if spec.model.weights_file is not None:\n"
      "            _load_weights(model, spec)\n", "",
      ("tests/test_weights.py::test_two_workers_share_one_copy_of_mapped_weights",)),
    M("minilm-gelu", "modelwarden/minilm.py", "return functional.gelu(self.dense(hidden))",
      "return functional.relu(self.dense(hidden))",
      ("tests/test_minilm.py::test_the_probe_sentence_embeds_as_on_the_model_card_and_as_the_shipped_golden",
       "tests/test_minilm.py::test_the_shipped_config_serves_embeddings_batches_them_and_its_probe_passes")),
    M("unpinned-forget", "worker/segments.py", "                self.pinner.unpin(segment)", "                pass",
      ("tests/test_gpu_check.py::test_a_cuda_worker_pins_each_client_buffer_while_it_holds_it",)),
    # -- several daemons (issue 12) ----------------------------------------------------------------
    M("fleet-resend", "shared/balancer.py",
      "(resend if ticket.runs < RUNS_AT_MOST else fail).append(ticket)", "fail.append(ticket)",
      ("tests/test_multiclient.py::test_sigkill_one_daemon_under_load_fails_nothing_and_a_restart_takes_load_again",)),
    M("fleet-heartbeat-silence", "shared/balancer.py",
      "            if sent is not None and now - sent >= self.heartbeat_timeout:", "            if False:",
      ("tests/test_multiclient.py::test_a_silent_daemon_is_down_after_its_heartbeats_and_up_once_it_answers",
       "tests/test_multihost.py::test_a_silent_cut_link_is_caught_by_heartbeats_and_the_daemon_behind_it_serves_once_it_is_back")),
    M("fleet-runs-twice", "shared/balancer.py", "RUNS_AT_MOST = 2", "RUNS_AT_MOST = 3",
      ("tests/test_multiclient.py::test_a_request_whose_two_daemons_die_is_poison_and_not_sent_a_third_time",
       "tests/test_unit_balancer.py::test_a_lost_endpoints_requests_are_resent_once_then_poison")),
    M("fleet-overloaded", "shared/multiclient.py",
      "NOT_RUN = {protocol.OVERLOADED, protocol.SHUTTING_DOWN, protocol.NO_WORKER}",
      "NOT_RUN = {protocol.SHUTTING_DOWN, protocol.NO_WORKER}",
      ("tests/test_multiclient.py::test_overloaded_from_one_daemon_tries_the_other",)),
    M("fleet-least-outstanding", "shared/balancer.py",
      "            if best is None or len(state.outstanding) < len(best.outstanding):",
      "            if best is None:",
      ("tests/test_unit_balancer.py::test_the_least_busy_endpoint_wins_whatever_the_rotation",)),
    # -- the KServe v2 gateway (issue 11) ----------------------------------------------------------
    M("gateway-not-restarted", "supervisor/gateway.py",
      "        self._timer = self._call_at(self.clock() + delay, self.start)\n", "        self._timer = None\n",
      ("tests/test_gateway.py::test_a_killed_gateway_is_restarted_and_native_clients_never_notice",)),
    M("gateway-backoff-flat", "supervisor/gateway.py",
      "BACKOFF_INITIAL_S * 2 ** (self.failed_starts - 1))", "BACKOFF_INITIAL_S)",
      ("tests/test_gateway.py::test_a_gateway_that_cannot_bind_backs_off_and_the_daemon_serves_on",)),
    M("gateway-stopped-first", "supervisor/arbiter.py",
      "and (self.gateway is None or self.gateway.stop_last())", "and True",
      ("tests/test_gateway.py::test_the_gateway_stops_after_the_last_worker",)),
    M("gateway-body-unbounded", "gateway/http.py",
      "    if body_length is not None and body_length > limits.body:\n        raise limits.too_large()\n", "",
      ("tests/test_gateway.py::test_bad_input_over_raw_http_gets_typed_errors_and_the_gateway_serves_on",)),
    M("gateway-timeout-ignored", "gateway/service.py",
      "timeout = timeout_s if timeout_s is not None else", "timeout = ",
      ("tests/test_gateway.py::test_parameters_timeout_is_honoured",)),
    M("gateway-no-shm", "gateway/service.py", "self.client = AsyncClient(endpoint)",
      "self.client = AsyncClient(endpoint, shm=False)",
      ("tests/test_gateway.py::test_a_large_tensor_goes_through_shared_memory_and_back",)),
    M("gateway-nagle", "gateway/main.py", "socket.SOCK_STREAM, socket.IPPROTO_TCP)", "socket.SOCK_STREAM)",
      ("tests/test_gateway.py::test_a_keep_alive_rest_call_does_not_wait_for_delayed_acks",)),
    M("gateway-always-ready", "gateway/service.py", "        return (offer is not None and not offer.get(",
      "        return True or (offer is not None and not offer.get(",
      ("tests/test_gateway.py::test_readiness_follows_the_workers",)),
    M("gateway-grpc-unparsed-unknown", "gateway/grpc_service.py",
      "        return parse(data)\n    except Exception as exc:", "        return parse(data)\n    except ZeroDivisionError as exc:",
      ("tests/test_gateway.py::test_bad_input_through_tritonclient_gets_typed_errors",)),
    M("gateway-ready-while-draining", "gateway/service.py",
      'return (offer is not None and not offer.get("stopping")', "return (offer is not None",
      ("tests/test_gateway.py::test_readiness_is_503_while_the_daemon_drains_and_the_request_in_flight_completes",)),
    M("gateway-extra-unchecked", "supervisor/arbiter.py",
      "problem = self.settings.gateway is not None and gateway.cannot_run(self.settings)", "problem = None",
      ("tests/test_gateway.py::test_a_daemon_configured_with_a_gateway_it_cannot_run_refuses_to_start",)),
    M("gateway-grpc-message-unbounded", "gateway/grpc_service.py",
      '("grpc.max_receive_message_length", max_message_bytes)', '("grpc.max_receive_message_length", -1)',
      ("tests/test_gateway.py::test_a_message_over_max_message_bytes_is_refused_on_both_transports",)),
    M("gateway-config-keeps-batch-dim", "gateway/kserve.py",
      '"dims": item["shape"][1:] if batched else item["shape"]', '"dims": item["shape"]',
      ("tests/test_gateway.py::test_model_config_is_what_tritons_tools_read",
       "tests/test_unit_kserve.py::test_model_config_drops_the_batch_dimension_only_when_it_is_dimension_0")),
    M("gateway-unknown-model-400", "gateway/kserve.py", "UNKNOWN_MODEL: 404,", "UNKNOWN_MODEL: 400,",
      ("tests/test_unit_kserve.py::test_every_error_code_maps_to_the_issue_s_status",
       "tests/test_gateway.py::test_bad_input_over_raw_http_gets_typed_errors_and_the_gateway_serves_on")),
    # -- who may call the gateway: tokens and unix sockets ----------------------------------------
    M("gateway-rest-token-unchecked", "gateway/http.py",
      "Route(path, handler if gate is None or path in access.OPEN_PATHS else _guarded(handler, gate),",
      "Route(path, handler,",
      ("tests/test_gateway_access.py::test_without_a_token_only_the_health_checks_answer",)),
    M("gateway-grpc-token-unchecked", "gateway/grpc_service.py",
      "        if self.gate is not None and name not in access.OPEN_METHODS:", "        if False:",
      ("tests/test_gateway_access.py::test_without_a_token_only_the_health_checks_answer",)),
    M("gateway-token-file-read-once", "gateway/access.py",
      "        if signature == self._signature:\n            return", "        return",
      ("tests/test_gateway_access.py::test_tokens_are_added_and_revoked_without_a_restart",
       "tests/test_gateway_access.py::test_the_gatekeeper_looks_at_the_file_at_most_once_a_second")),
    M("gateway-bad-token-file-keeps-old-tokens", "gateway/access.py",
      "            self._digests = []\n", "            pass\n",
      ("tests/test_gateway_access.py::test_tokens_are_added_and_revoked_without_a_restart",
       "tests/test_gateway_access.py::test_the_gatekeeper_looks_at_the_file_at_most_once_a_second")),
    M("gateway-token-file-mode-unchecked", "gateway/access.py", "    if mode & 0o027:", "    if False:",
      ("tests/test_gateway_access.py::test_a_token_file_that_cannot_be_trusted_stops_the_daemon_at_start",
       "tests/test_gateway_access.py::test_tokens_are_added_and_revoked_without_a_restart")),
    M("gateway-unix-socket-not-for-the-group", "gateway/main.py",
      "        if path is not None:\n            _restrict(path, group)\n        sock.listen(2048)",
      "        sock.listen(2048)",
      ("tests/test_gateway_access.py::test_unix_socket_listeners_let_in_the_clients_group_and_nobody_else",
       "tests/test_systemd.py::test_the_shipped_gateway_example_serves_the_clients_group_under_the_hardening")),
    M("gateway-unix-socket-open-to-all", "gateway/main.py", "os.umask(0o177)", "os.umask(0o000)",
      ("tests/test_gateway_access.py::test_a_unix_listener_is_private_and_never_replaces_a_file_or_a_live_socket",)),
    M("gateway-unix-binds-over-a-live-socket", "gateway/main.py",
      'raise OSError(errno.EADDRINUSE, f"cannot listen on unix:{path}: another process listens there")',
      "os.unlink(path)",
      ("tests/test_gateway_access.py::test_a_unix_listener_is_private_and_never_replaces_a_file_or_a_live_socket",)),
    M("gateway-unix-stale-socket-kept", "gateway/main.py",
      "        os.unlink(path)\n        return\n", '        raise OSError(errno.EADDRINUSE, "in use")\n',
      ("tests/test_gateway_access.py::test_unix_socket_listeners_let_in_the_clients_group_and_nobody_else",)),
    M("gateway-rest-tls-off", "gateway/main.py",
      "                config.ssl = _rotating_context(_tls_files(spec))\n", "                pass\n",
      ("tests/test_gateway_access.py::test_tls_carries_tritonclient_and_plaintext_gets_nothing",)),
    M("gateway-grpc-tls-off", "gateway/main.py",
      "    if spec.tls_cert is None:\n        return None\n", "    return None\n",
      ("tests/test_gateway_access.py::test_tls_carries_tritonclient_and_plaintext_gets_nothing",)),
    M("gateway-tls-key-mode-unchecked", "gateway/access.py",
      "        _check_owner_and_mode(key, info)\n", "        pass\n",
      ("tests/test_gateway_access.py::test_a_tls_key_that_cannot_be_trusted_or_used_stops_the_daemon_at_start",)),
    M("gateway-http-connection-cap-off", "gateway/http.py",
      "if len(self.connections) > max_connections:", "if False:", ("tests/test_gateway_access.py::test_connections_that_say_nothing_are_cut_and_a_flood_is_capped",)),
    M("gateway-http-read-timeout-off", "gateway/http.py",
      "            self.peer, self.client_subject = _peer_of(transport)\n            self._arm()\n",
      "            self.peer, self.client_subject = _peer_of(transport)\n", ("tests/test_gateway_access.py::test_connections_that_say_nothing_are_cut_and_a_flood_is_capped",)),
    M("gateway-http-read-timeout-counts-the-model", "gateway/http.py",
      "            self._disarm()  # the whole request is in", "            pass  #", ("tests/test_gateway_access.py::test_connections_that_say_nothing_are_cut_and_a_flood_is_capped",)),
    M("gateway-grpc-connection-cap-off", "gateway/grpc_service.py",
      '        ("grpc.max_allowed_incoming_connections", max_connections),\n', "", ("tests/test_gateway_access.py::test_connections_that_say_nothing_are_cut_and_a_flood_is_capped",)),
    M("gateway-grpc-handshake-timeout-off", "gateway/grpc_service.py",
      '        ("grpc.server_handshake_timeout_ms", max(1, int(read_timeout * 1000))),\n', "", ("tests/test_gateway_access.py::test_connections_that_say_nothing_are_cut_and_a_flood_is_capped",)),
    M("gateway-grpc-logs-every-handshake", "gateway/main.py",
      'os.environ.setdefault("GRPC_VERBOSITY", "ERROR")', "pass",
      ("tests/test_gateway_access.py::test_tls_carries_tritonclient_and_plaintext_gets_nothing",)),
    M("gateway-deep-json-internal", "gateway/kserve.py",
      '    except RecursionError:  # "[[[[...": the caller\'s error, not an INTERNAL with a traceback\n'
      '        raise bad_request("the request body is not valid JSON: nested too deeply") from None\n', "",
      ("tests/test_gateway.py::test_bad_input_over_raw_http_gets_typed_errors_and_the_gateway_serves_on",)),
    M("gateway-rest-client-certificate-optional", "gateway/access.py",
      "            context.verify_mode = ssl.CERT_REQUIRED\n", "", ("tests/test_gateway_access.py::test_with_tls_client_ca_only_callers_with_a_certificate_it_signed_get_in",)),
    M("gateway-grpc-client-certificate-optional", "gateway/main.py",
      "require_client_authentication=spec.tls_client_ca is not None",
      "require_client_authentication=False", ("tests/test_gateway_access.py::test_with_tls_client_ca_only_callers_with_a_certificate_it_signed_get_in",)),
    M("gateway-rest-tls-handshake-unbounded", "gateway/main.py",
      "    asyncio.constants.SSL_HANDSHAKE_TIMEOUT = seconds\n", "    pass\n",
      ("tests/test_gateway_access.py::test_tls_carries_tritonclient_and_plaintext_gets_nothing",)),
    M("gateway-rest-certificate-not-renewed", "gateway/main.py",
      "            ssl_object.context = files.context\n", "            pass\n", ("tests/test_gateway_access.py::test_a_renewed_certificate_is_served_from_the_next_connection_without_a_restart",
       "tests/test_gateway_access.py::test_a_renewed_client_ca_takes_effect_from_the_next_connection_without_a_restart")),
    M("gateway-grpc-certificate-not-renewed", "gateway/main.py",
      "configuration() if files.refresh() else None", "None", ("tests/test_gateway_access.py::test_a_renewed_certificate_is_served_from_the_next_connection_without_a_restart",
       "tests/test_gateway_access.py::test_a_renewed_client_ca_takes_effect_from_the_next_connection_without_a_restart")),
    M("gateway-half-renewed-certificate-breaks-tls", "gateway/access.py",
      '                logger.error("%s: the gateway keeps its previous TLS certificate", exc)\n'
      "                return False\n", "                raise\n", ("tests/test_gateway_access.py::test_a_renewed_certificate_is_served_from_the_next_connection_without_a_restart",)),
    # -- warm standby workers (issue 14) -------------------------------------------------------
    M("standby-never-promoted", "supervisor/pool.py",
      "        standby = self.standbys.take(slot)\n",
      "        standby = None\n",
      ("tests/test_standby.py::test_a_killed_worker_is_replaced_by_its_standby_on_every_thread_of_the_slots_cores[1]",
       "tests/test_standby.py::test_a_worker_recycled_by_max_requests_is_replaced_by_the_standby",
       "tests/test_unit_standby.py::test_a_crash_promotes_the_standby_into_the_slot")),
    M("standby-repin-main-thread-only", "worker/standby.py",
      'fresh = {int(tid) for tid in os.listdir("/proc/self/task")} - moved',
      "fresh = set()",
      ("tests/test_standby.py::test_a_killed_worker_is_replaced_by_its_standby_on_every_thread_of_the_slots_cores[1]",)),
    M("standby-promotion-not-a-start", "supervisor/pool.py",
      "started = max(handle.started_at, handle.promoted_at or 0.0)",
      "started = handle.started_at",
      ("tests/test_standby.py::test_a_promoted_standby_that_dies_at_once_counts_as_a_failed_start_of_its_slot",
       "tests/test_unit_standby.py::test_a_promoted_standby_dying_within_start_seconds_is_a_failed_start")),
    M("standby-old-version-kept", "supervisor/pool.py",
      'self.standbys.let_go(handle, "reload: superseded version or configuration")',
      "pass",
      ("tests/test_standby.py::test_a_reload_to_a_new_version_replaces_the_standbys_of_the_old_one",
       "tests/test_unit_standby.py::test_a_new_version_lets_the_old_standbys_go_and_starts_new_ones")),
    M("standby-priority-not-restored", "worker/standby.py",
      "            os.setpriority(os.PRIO_PROCESS, tid, _restore_nice)  # per thread on Linux",
      "            pass",
      ("tests/test_standby.py::test_a_killed_worker_is_replaced_by_its_standby_on_every_thread_of_the_slots_cores[1]",)),
    M("standby-death-restarts-a-slot", "supervisor/pool.py",
      "        if self.standbys.owns(handle):\n            self.standbys.on_exit(handle)\n            return\n",
      "",
      ("tests/test_unit_standby.py::test_a_dying_standby_is_replaced_without_touching_the_slots",)),
]


def copy_tree(destination: Path) -> None:
    """The tree as git sees it (tracked and untracked, ignored files left out)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for role in ("supervisor", "worker", "shared", "gateway"):
        (destination / "modelwarden" / role).symlink_to(destination / role, target_is_directory=True)


def run_one(mutation: Mutation, timeout: float, test_timeout: float) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix="mw-mutant-") as scratch:
        tree = Path(scratch)
        os.chmod(tree, 0o755)  # tests that run a client as another user must reach the copy
        copy_tree(tree)
        target = tree / mutation.path
        code = target.read_text()
        if code.count(mutation.old) != 1:
            return "STALE", 0.0, f"{mutation.path}: the text to mutate occurs {code.count(mutation.old)} times"
        target.write_text(code.replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        where = subprocess.run([sys.executable, "-c", "import modelwarden.supervisor as s; print(s.__file__)"],
                               cwd=tree, env=env, capture_output=True, text=True)
        if not where.stdout.startswith(str(tree)):
            return "ERROR", 0.0, f"the copy is not what gets imported: {where.stdout or where.stderr}"
        started = time.monotonic()
        try:
            # A mutation often turns a mechanism into a hang: cap each test well below the suite's
            # 300 s so a caught mutation costs minutes, not the whole budget.
            result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                     "-o", f"timeout={test_timeout:.0f}", *mutation.tests], cwd=tree,
                                    env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "caught (timeout)", time.monotonic() - started, ""
        elapsed = time.monotonic() - started
        last = (result.stdout.strip().splitlines() or [""])[-1]
        if result.returncode == 1:
            return "caught", elapsed, last
        if result.returncode == 0 and "skipped" in last:
            return "ERROR (skipped)", elapsed, last  # a skipped guard proves nothing
        if result.returncode == 0:
            return "SURVIVED", elapsed, last
        return "ERROR", elapsed, f"pytest exit {result.returncode}: {last}"


def main() -> int:
    parser = argparse.ArgumentParser(description="Break each mechanism on purpose; its tests must fail.")
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation")
    parser.add_argument("--test-timeout", type=float, default=150, help="seconds per test under a mutation")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations: {', '.join(sorted(unknown))}")
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name:28} {mutation.path:24} {' '.join(mutation.tests)}")
        return 0
    print(f"{'mutation':28} {'verdict':18} {'seconds':>7}  tests")
    bad = 0
    for mutation in chosen:
        verdict, elapsed, detail = run_one(mutation, args.timeout, args.test_timeout)
        bad += not verdict.startswith("caught")
        tests = ", ".join(test.split("::")[-1] if "::" in test else test for test in mutation.tests)
        print(f"{mutation.name:28} {verdict:18} {elapsed:7.1f}  {tests}", flush=True)
        if not verdict.startswith("caught"):
            print(f"    {detail}", flush=True)
    print(f"\n{len(chosen) - bad} of {len(chosen)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
