"""A per-rank collective timeline picture (SVG, self-contained, embeddable in a pull request).

One lane per rank; each box is one collective from the rank's ledger (the last ``last_n``), in the order the rank
entered them, right-aligned so that every rank's latest collective sits at the right edge (where a hang is).
Box colour = process group; label = op and per-group sequence number (``AR#57`` = all_reduce 57); a collective
never left (the rank is blocked in it) has a thick outline; the first divergence's records are marked red, and a
rank missing from it gets a red "never entered" note. Plain SVG 1.1 text written here (no plotting library).
"""

from __future__ import annotations

from html import escape
from typing import Optional

from repro.diagnosis import DivergenceKind, op_abbrev
from repro.ledger import Divergence, RankLedger

BOX_W = 44
BOX_H = 26
GAP = 4
LANE_H = 44
LEFT = 70
TOP = 46
PALETTE = ("#9ecae1", "#a1d99b", "#fdd0a2", "#dadaeb", "#c7e9c0", "#fdae6b", "#bcbddc", "#d9d9d9")


def render_timeline(ledgers: dict[int, RankLedger], divergence: Optional[Divergence] = None, last_n: int = 24,
                    title: str = "Collectives per rank (newest at the right)", proof: Optional[dict] = None) -> str:
    """The SVG text of the timeline.

    Args:
        ledgers: rank → RankLedger; divergence: from ``repro.ledger.align`` (marked when its kind is not none).
        last_n: collectives shown per rank (the most recent).
        proof: a ledger proof of a deadlock (``repro.proof.Proof.to_dict()``): the records it holds the ranks in are
            outlined in purple and its wait edges listed under the title.
    Returns:
        An SVG document (str), width/height in pixels.
    """
    ranks = sorted(ledgers)
    groups: dict[str, str] = {}
    for led in ledgers.values():
        for r in led.records:
            groups.setdefault(r.group, "")
    for led in ledgers.values():
        for k, g in led.groups.items():
            if k in groups and g.label and not groups[k]:
                groups[k] = g.short()
    colour = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(sorted(groups))}
    n = max((min(len(ledgers[r].records), last_n) for r in ranks), default=0)
    width = LEFT + n * (BOX_W + GAP) + 20
    legend_h = 22
    height = TOP + len(ranks) * LANE_H + legend_h + 30
    marked = set()
    missing: set = set()
    if divergence is not None and divergence.kind != DivergenceKind.NONE:
        marked = {(r.rank, r.group, r.seq) for r in divergence.entered.values()}
        marked |= {(r.rank, r.group, r.seq) for r in divergence.waits.values()} if divergence.kind == DivergenceKind.MISSING else set()
        missing = set(divergence.missing)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(title)}</text>']
    if divergence is not None and divergence.kind != DivergenceKind.NONE:
        out.append(f'<text x="8" y="34" fill="#b30000">first divergence: {escape(str(divergence.kind))} at '
                   f'{escape(divergence.group.short() if divergence.group else "?")} #{divergence.seq}</text>')
    proven = {(int(r["rank"]), str(r["group"]), int(r["seq"])) for r in (proof or {}).get("inside", {}).values()}
    for i, rank in enumerate(ranks):
        y = TOP + i * LANE_H
        out.append(f'<text x="8" y="{y + BOX_H - 8}" font-size="12">rank {rank}</text>')
        out.append(f'<line x1="{LEFT - 4}" y1="{y + BOX_H / 2}" x2="{width - 10}" y2="{y + BOX_H / 2}" '
                   f'stroke="#cccccc"/>')
        recs = ledgers[rank].records[-last_n:]
        x0 = LEFT + (n - len(recs)) * (BOX_W + GAP)
        for j, r in enumerate(recs):
            x = x0 + j * (BOX_W + GAP)
            is_marked = (rank, r.group, r.seq) in marked
            is_proven = (rank, r.group, r.seq) in proven
            stroke = "#6a1b9a" if is_proven else ("#b30000" if is_marked else "#333333")
            sw = 3 if is_marked or is_proven else (2.5 if r.open else 0.8)
            dash = ' stroke-dasharray="4,2"' if r.open and not is_marked else ""
            tip = (f"rank {rank} {r.op}{'(' + r.red + ')' if r.red else ''} #{r.seq} on "
                   f"{groups.get(r.group) or 'pg' + r.group} tick {r.tick} from {r.call_site(3)}"
                   f"{' [injected ' + r.inj + ']' if r.inj else ''}{' — never left' if r.open else ''}")
            out.append(f'<g><title>{escape(tip)}</title><rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" '
                       f'rx="3" fill="{colour.get(r.group, "#eeeeee")}" stroke="{stroke}" stroke-width="{sw}"{dash}/>'
                       f'<text x="{x + BOX_W / 2}" y="{y + 11}" text-anchor="middle">'
                       f'{escape(op_abbrev(r.op))}{"*" if r.inj else ""}</text>'
                       f'<text x="{x + BOX_W / 2}" y="{y + 22}" text-anchor="middle">#{r.seq}</text></g>')
        if rank in missing:
            out.append(f'<text x="{LEFT}" y="{y + BOX_H + 12}" fill="#b30000">never entered '
                       f'{escape(divergence.group.short() if divergence and divergence.group else "?")} '
                       f'#{divergence.seq if divergence else 0}</text>')
    ly = TOP + len(ranks) * LANE_H + 14
    x = 8
    for k in sorted(groups):
        label = groups[k] or f"pg{k}"
        out.append(f'<rect x="{x}" y="{ly - 10}" width="12" height="12" fill="{colour[k]}" stroke="#333333" '
                   f'stroke-width="0.8"/><text x="{x + 16}" y="{ly}">{escape(label)}</text>')
        x += 24 + 7 * len(label)
    out.append(f'<text x="{x + 8}" y="{ly}">thick = never left · * = injected · red = first divergence'
               f'{" · purple = held by the ledger proof" if proof else ""}</text>')
    if proof:
        waits = "; ".join(f"{e['rank']}→{e['waits_for']} ({e['kind']})" for e in proof.get("edges", []))
        out.append(f'<text x="8" y="{ly + 18}" fill="#6a1b9a">ledger proof of the deadlock '
                   f'({escape(str(proof.get("kind")))}), wait edges: {escape(waits)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


__all__ = ["render_timeline"]
