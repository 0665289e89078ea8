"""How busy the machine was with other work while a run of ours went on (Linux).

On a shared machine the step time a run measures depends on what else runs: ``N`` ranks
and ``k`` CPU-bound processes of other users on ``C`` cores get, from the kernel's fair
scheduler, about ``C · N / (N + k)`` cores between them. :class:`HostLoadMeter` measures
the other side of that split over a run:

    external cores = (busy CPU seconds of the whole machine, from /proc/stat
                      - CPU seconds of our child processes, from getrusage(RUSAGE_CHILDREN))
                     / wall seconds

so the cores the run could have had are ``C - external``. Our own processes must be children
(or grandchildren, waited for) of this one: ``engine.launch.run_local`` starts torchrun, which
starts and waits for the ranks. ``autoplan run`` and ``autoplan demo`` measure their engine
run with :func:`measured_run`, which writes the record into the run directory as
``host_load.json`` (:func:`write`), where ``autoplan calibrate`` reads it, and
:func:`describe` says it in one line next to predicted against measured.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FILE = "host_load.json"


@dataclass(frozen=True)
class HostLoad:
    """One run's view of the machine: wall seconds, CPU seconds of our processes and of
    everything (user + system, all cores), the cores, and the load averages around it."""

    wall_s: float
    own_cpu_s: float
    machine_busy_s: float
    cores: int
    load_avg_before: tuple[float, float, float]
    load_avg_after: tuple[float, float, float]

    @property
    def external_cores(self) -> float:
        """Average cores other processes kept busy (>= 0)."""
        if self.wall_s <= 0:
            return 0.0
        return max(0.0, (self.machine_busy_s - self.own_cpu_s) / self.wall_s)

    @property
    def available_cores(self) -> float:
        """Cores left to the run: C - external, at least a tenth of one."""
        return max(0.1, self.cores - self.external_cores)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "external_cores": self.external_cores,
                "available_cores": self.available_cores}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "<dict>") -> "HostLoad":
        from autoplan.errors import ConfigError

        try:
            return cls(wall_s=float(d["wall_s"]), own_cpu_s=float(d["own_cpu_s"]),
                       machine_busy_s=float(d["machine_busy_s"]), cores=int(d["cores"]),
                       load_avg_before=tuple(d["load_avg_before"]),
                       load_avg_after=tuple(d["load_avg_after"]))
        except KeyError as exc:
            raise ConfigError("missing", source=source, field=str(exc.args[0])) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"malformed ({exc})", source=source) from None


def _busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat, first line):
    user + nice + system + irq + softirq + steal, in clock ticks."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    ticks = [int(x) for x in fields]
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    steal = ticks[7] if len(ticks) > 7 else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class HostLoadMeter:
    """``with HostLoadMeter() as m: run(...)`` then ``m.result`` (a :class:`HostLoad`)."""

    def __init__(self) -> None:
        self.result: HostLoad | None = None

    def __enter__(self) -> "HostLoadMeter":
        self._load = os.getloadavg()
        self._t = time.perf_counter()
        self._busy = _busy_seconds()
        self._own = _children_cpu()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.result = HostLoad(wall_s=time.perf_counter() - self._t,
                               own_cpu_s=_children_cpu() - self._own,
                               machine_busy_s=_busy_seconds() - self._busy,
                               cores=os.cpu_count() or 1,
                               load_avg_before=tuple(round(x, 2) for x in self._load),
                               load_avg_after=tuple(round(x, 2) for x in os.getloadavg()))


def describe(load: HostLoad, ranks: int | None = None) -> str:
    """One line: how busy the machine was with other work while the run went on."""
    lo, hi = load.load_avg_before[0], load.load_avg_after[0]
    share = (f"; its {ranks} ranks had about {load.available_cores:.1f} of {load.cores} cores"
             if ranks else f"; about {load.available_cores:.1f} of {load.cores} cores were left")
    busy = ("idle apart from this run" if load.external_cores < 0.25 else
            f"busy: other processes kept {load.external_cores:.1f} of {load.cores} cores busy")
    return (f"host load during the run: {busy} (1-minute load average {lo:.1f} before, "
            f"{hi:.1f} after){share}. Predictions assume an idle machine.")


def measured_run(run_dir: str | os.PathLike, run) -> tuple[Any, HostLoad]:
    """``run()`` (which starts the ranks as child processes and waits for them) under a
    :class:`HostLoadMeter`; the record is written to ``run_dir/host_load.json`` when
    ``run_dir`` exists afterwards. Returns ``(run()'s result, the record)``."""
    with HostLoadMeter() as meter:
        result = run()
    if Path(run_dir).is_dir():
        write(run_dir, meter.result)
    return result, meter.result


def write(run_dir: str | os.PathLike, load: HostLoad) -> Path:
    from autoplan.plan import atomic_write_text

    return atomic_write_text(Path(run_dir) / FILE, json.dumps(load.to_dict(), indent=1) + "\n")


def read(run_dir: str | os.PathLike) -> HostLoad | None:
    """The run's ``host_load.json``, or None if it has none."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    from autoplan.errors import ConfigError

    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON (line {exc.lineno}: {exc.msg})",
                          source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("must be a JSON object", source=str(path))
    return HostLoad.from_dict(data, source=str(path))
