"""Plan reports: ``autoplan report PLAN`` (HTML with embedded PNGs, or PNG files).

See :mod:`autoplan.report.report` for the sections; :mod:`.schedule` simulates the pipeline,
:mod:`.timing` gets per-stage times, :mod:`.plots` and :mod:`.timeline` draw, :mod:`.html`
writes the page, :mod:`.cli` is the command.
"""

__all__ = ["Report", "build_report", "write_report"]


def __getattr__(name: str):
    """Import on first use: registering ``autoplan report`` (and ``autoplan --help``) then
    does not import matplotlib or torch."""
    if name in __all__:
        from autoplan.report import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
