"""The weight sync's surface (trainer/weight_sync.py WeightSync) without engines, for the trainer's tests: a sync
is a new version; the pause modes asked for are recorded."""

import time


class StandInSync:
    def __init__(self, sync_s: float = 0.0):
        self.sync_s = sync_s  # each sync's length
        self.engines, self.version, self.engine_version, self.pause_modes = [], 0, 0, []
        self.fleet, self.engines_dropped, self.drain_frozen, self.broadcasts_failed = None, 0, 0, 0  # fixed engines
        self.check = False  # no probe check (LoRA only)
        self.figures = {}  # a sync's figures (sparse, bytes): none here
        self.check_wait_s = 0.0  # nothing to wait for
        self.trained_on = []  # each to_train's newest weight version among the samples

    def sync(self, pause_mode=None):
        time.sleep(self.sync_s)
        self.version = self.engine_version = self.version + 1
        self.pause_modes.append(pause_mode)

    def settle(self):  # the sync's check: nothing to check here
        pass

    def catch_up(self):
        return 0

    def to_train(self, newest_version=None):  # the hybrid engine's hand-overs: none here
        self.trained_on.append(newest_version)

    def to_generate(self):
        pass
