"""Reference link profiles for clusters not at hand, from published figures.

    python -m autoplan.profile.reference            # writes profiles/links/dgx-a100.json, dgx-h100.json

Same format as a measured link profile (:mod:`autoplan.profile.store`), with no raw points:
the ``published`` list holds the figures as published, each ``fits`` entry a source of kind
``published`` that says which figure it uses and how anything not published was derived.

Figures (``/work/shared/reference/published.md``, nccl-tests all-reduce bus bandwidth):
8x A100 SXM NVSwitch ~230 GB/s; 8x H100 SXM NVSwitch ring ~370 GB/s (NVLink SHARP ~480);
multi-node DGX A100 (8x HDR per node) ~192 GB/s; one NDR 400G NIC 46-49 GB/s.

Derivations, stated in each source:

* all-gather, reduce-scatter: the all-reduce busbw. A ring all-reduce is a reduce-scatter
  followed by an all-gather, each moving (n-1)/n·S per rank over the same links, so at the
  same link rate their bus bandwidths are equal (nccl-tests' busbw definition, PERFORMANCE.md).
* all-to-all and send/recv inside a node: assumed the all-reduce busbw (no figure published
  here); send/recv across nodes: one NIC (DGX A100: 192 / 8 = 24 GB/s; DGX H100: 46-49).
* DGX H100 across nodes: 8 NICs x 46-49 GB/s = 370-390 GB/s per node, bounded by the 370 GB/s
  intra-node ring of a hierarchical all-reduce: 370 GB/s.
* alpha (latency): not in published.md. ESTIMATE from NCCL's tuning model
  (src/graph/tuning.cc: ~1 us per NVLink step, ~5 us per network step), for the group the
  figure was measured on: a ring of 8 GPUs inside a node — 2·7 steps for all-reduce, 7 for
  the one-phase collectives, 1 for send/recv; across 2 nodes of 8 add 1 network step per phase.

Inter-node figures are for groups of whole nodes (8 ranks per node, as nccl-tests ran them);
a group with one rank per node gets one NIC: 192 / 8 = 24 GB/s on DGX A100, 46-49 GB/s on
DGX H100 (``autoplan.cost.comm`` models that NIC sharing from the cluster file).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from autoplan.profile.store import (COLLECTIVES, LinkFit, LinkProfile, source_id,
                                    update_link_profile)

PUBLISHED_MD = "/work/shared/reference/published.md"
NCCL_TESTS = f"{PUBLISHED_MD}, 'Measured collective bandwidth (nccl-tests, all-reduce bus bandwidth)'"
_STEPS_INTRA = {"all_reduce": 14, "all_gather": 7, "reduce_scatter": 7, "all_to_all": 7,
                "send_recv": 1}
_PHASES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1,
           "send_recv": 1}
_DERIVED = {
    "all_reduce": "the published all-reduce busbw",
    "all_gather": "= the all-reduce busbw (ring all-reduce = reduce-scatter + all-gather over "
                  "the same links)",
    "reduce_scatter": "= the all-reduce busbw (ring all-reduce = reduce-scatter + all-gather "
                      "over the same links)",
    "all_to_all": "ASSUMED = the all-reduce busbw (no all-to-all figure published here)",
    "send_recv": "ASSUMED = the all-reduce busbw (no send/recv figure published here)",
}


def _alpha(collective: str, level: str) -> float:
    """ESTIMATE (module docstring): 1 us per NVLink ring step, + 5 us per network phase."""
    steps = _STEPS_INTRA[collective] * 1e-6
    return steps + (_PHASES[collective] * 5e-6 if level == "inter" else 0.0)


def reference_profile(cluster: str, intra_gbps: float, inter_gbps: float,
                      published: list[dict[str, Any]], intra_figure: str,
                      inter_figure: str, nic: tuple[float, str]) -> LinkProfile:
    """Fits for every collective at both levels; inter-node send/recv uses one NIC
    (``nic`` = (GB/s, where that figure comes from))."""
    fits: list[LinkFit] = []
    sources: dict[str, dict[str, Any]] = {}
    for level, level_gbps, level_figure in (("intra", intra_gbps, intra_figure),
                                            ("inter", inter_gbps, inter_figure)):
        for collective in COLLECTIVES:
            gbps, figure, busbw = level_gbps, level_figure, _DERIVED[collective]
            if level == "inter" and collective == "send_recv":
                gbps, figure = nic
                busbw = "one NIC: a point-to-point transfer between two nodes uses one port"
            prov = {"kind": "published", "reference": NCCL_TESTS, "figure": figure,
                    "busbw": busbw,
                    "alpha": "ESTIMATE, not published: NCCL tuning-model latencies (~1 us per "
                             "NVLink step, ~5 us per network step) for an 8-GPU ring"
                             + (" over 2 nodes" if level == "inter" else "")}
            sid = source_id(prov)
            sources[sid] = prov
            fits.append(LinkFit(collective=collective, level=level, group_size=None,
                                alpha_s=_alpha(collective, level), busbw_gbps=gbps, points=0,
                                max_rel_err_ge_1mb=None, source=sid))
    return LinkProfile(cluster=cluster, backend="nccl", levels_present=["inter", "intra"],
                       note="REFERENCE built from published figures, not measured here "
                            "(autoplan.profile.reference). Inter-node fits are for groups of "
                            "whole nodes; one rank per node gets one NIC's bandwidth.",
                       fits=fits, published=published, sources=sources)


def dgx_a100() -> LinkProfile:
    published = [
        {"collective": "all_reduce", "level": "intra", "group_size": 8, "busbw_gbps": 230.0,
         "source": f"{NCCL_TESTS}: 8x A100 SXM, NVSwitch ~230 GB/s"},
        {"collective": "all_reduce", "level": "inter", "group_size": None, "busbw_gbps": 192.0,
         "source": f"{NCCL_TESTS}: multi-node DGX A100, 8x HDR per node ~192 GB/s"},
        {"collective": "send_recv", "level": "inter", "group_size": 2, "busbw_gbps": 25.0,
         "source": f"{PUBLISHED_MD}, 'Hardware peaks': HDR 200 Gb/s = 25 GB/s per port "
                   "(line rate, not a measurement)"},
    ]
    return reference_profile("dgx-a100", 230.0, 192.0, published,
                             "8x A100 SXM NVSwitch all-reduce busbw ~230 GB/s",
                             "multi-node DGX A100 (8x HDR per node) all-reduce busbw ~192 GB/s",
                             (24.0, "DERIVED: one HDR NIC's share of the multi-node busbw, "
                                    "192 / 8 = 24 GB/s (line rate 25 GB/s)"))


def dgx_h100() -> LinkProfile:
    published = [
        {"collective": "all_reduce", "level": "intra", "group_size": 8, "busbw_gbps": 370.0,
         "source": f"{NCCL_TESTS}: 8x H100 SXM, NVSwitch, ring ~370 GB/s"},
        {"collective": "all_reduce", "level": "intra", "group_size": 8, "busbw_gbps": 480.0,
         "source": f"{NCCL_TESTS}: 8x H100 SXM, NVLink SHARP ~480 GB/s (not used in the fits: "
                   "needs NVLS)"},
        {"collective": "all_reduce", "level": "inter", "group_size": None, "busbw_gbps": 47.5,
         "source": f"{NCCL_TESTS}: one NDR 400G NIC 46-49 GB/s (midpoint)"},
    ]
    return reference_profile("dgx-h100", 370.0, 370.0, published,
                             "8x H100 SXM NVSwitch ring all-reduce busbw ~370 GB/s",
                             "DERIVED: 8 NDR NICs x 46-49 GB/s = 370-390 GB/s per node, bounded "
                             "by the 370 GB/s intra-node ring of a hierarchical all-reduce",
                             (47.5, "one NDR 400G NIC 46-49 GB/s (nccl-tests; midpoint)"))


def write_all(folder: Path) -> list[Path]:
    out = []
    for prof in (dgx_a100(), dgx_h100()):
        path = folder / f"{prof.cluster}.json"
        update_link_profile(path, lambda _current, prof=prof: prof)
        out.append(path)
    return out


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else \
        Path(__file__).resolve().parents[2] / "profiles" / "links"
    for path in write_all(folder):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
