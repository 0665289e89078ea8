"""Plan reports: ``autoplan report PLAN`` (HTML with embedded PNGs, or PNG files).

See :mod:`autoplan.report.report` for the sections; :mod:`.schedule` simulates the pipeline,
:mod:`.timing` gets per-stage times, :mod:`.plots` and :mod:`.timeline` draw, :mod:`.html`
writes the page, :mod:`.cli` is the command.
"""

from autoplan.report.report import Report, build_report, write_report

__all__ = ["Report", "build_report", "write_report"]
