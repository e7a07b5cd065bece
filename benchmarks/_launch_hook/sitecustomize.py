"""Benchmark-only: log every collective launch of a TorchTitan step (FSDP2's and DMuon's).

The benchmarks put this folder on PYTHONPATH of the run_train.sh they start,
with DMUON_BENCH_LAUNCHES=1. With ``[metrics] count_all_comm = true`` the
CommLedger already records every collective of a step (each with its
coalesced-launch id), but the trainer's log line carries only elements and
bytes for them (DMuon's own launches are logged; FSDP2's are not). When
``titan_dmuon.integration.trainer`` is imported, this wraps
``DMuonMetricsProcessor.log`` to read the ledger before the records are
cleared and log one more line per step:

    bench launches: all 65 dmuon 34 other 31 dmuon_groups 17 | other by kind all_gather:17 all_reduce:5 reduce_scatter:9

(launches per rank per step, ``CommLedger.launches()``: a coalesced group counts once; gloo
cannot coalesce, so there every collective is a launch. ``dmuon_groups`` counts DMuon's
``Launch`` groups, i.e. its launches where the backend coalesces, as NCCL does.)
Nothing happens without the environment variable, or if the module is never imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "titan_dmuon.integration.trainer"


_groups: dict[str, int] = {}


def _patch_launch() -> None:
    """Count DMuon's launch groups (a unit's collectives in one direction): what NCCL runs as one
    coalesced launch; on gloo, which cannot coalesce, the ledger sees one launch per collective."""
    from titan_dmuon.runtime import comm

    original_exit = comm.Launch.__exit__

    def __exit__(self, *exc):
        if self._ops:
            _groups[self.source] = _groups.get(self.source, 0) + 1
        return original_exit(self, *exc)

    comm.Launch.__exit__ = __exit__


def _patch(module) -> None:
    _patch_launch()
    cls = module.DMuonMetricsProcessor
    original_log = cls.log

    def log(self, step, *args, **kwargs):
        ledger = getattr(self, "ledger", None)
        line = None
        if ledger is not None:
            # steps since the last log, as the trainer counts them for its own figures
            if hasattr(self, "_steps_since_figures"):
                steps = max(1, self._steps_since_figures)
            else:
                steps = max(1, step - getattr(self, "_last_logged_step", step - 1))
            other = ledger.select(source="other")
            kinds: dict[str, int] = {}
            for record in other:
                kinds[record.kind] = kinds.get(record.kind, 0) + 1
            groups = sum(_groups.values())
            _groups.clear()
            line = (
                f"bench launches: all {ledger.launches() / steps:g} dmuon {ledger.launches(source='dmuon') / steps:g} "
                f"other {ledger.launches(source='other') / steps:g} dmuon_groups {groups / steps:g} | other by kind "
                + " ".join(f"{k}:{v / steps:g}" for k, v in sorted(kinds.items()))
            )
        original_log(self, step, *args, **kwargs)
        if line is not None:
            module.logger.info(line)

    cls.log = log


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(mod):
            exec_module(mod)
            _patch(mod)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("DMUON_BENCH_LAUNCHES") == "1":
    sys.meta_path.insert(0, _Finder())
